"""Argument checks and operand normalisation (kernels/checks.py): pure CPU."""

import pytest
import torch

from hybridgemm.kernels.checks import (
    call_signature,
    check_gpu_kernel_args,
    check_linear_args,
    contiguous_bias,
    flat_row_stride,
    row_major,
    rows_2d,
    rows_are_flat,
)


@pytest.mark.parametrize("x, expect", [
    (torch.randn(5, 8), True),
    (torch.randn(2, 3, 8), True),
    (torch.randn(5, 12)[:, 2:10], True),           # column slice: row stride 12 >= 8
    (torch.randn(8, 5).T, False),                   # column-major
    (torch.randn(10, 8)[::2], True),                # every other row: row stride 16
    (torch.randn(2, 6, 8)[:, ::2], True),           # rows 16 apart throughout
    (torch.randn(2, 6, 8)[:, :3], False),           # leading dims no longer merge
    (torch.randn(2, 1, 8), True),
    (torch.randn(8), True),
    (torch.randn(16)[::2], False),
    (torch.randn(4, 8).expand(3, 4, 8), False),     # stride 0 on a leading dim
    # attention's (B, H, 1, D) output -> (B, 1, H*D) for the O projection: the size-1 seq dim
    # keeps stride D, which must not count (decode at B = 8 copied x on every call before)
    (torch.randn(8, 28, 1, 16).transpose(1, 2).flatten(-2), True),
    (torch.as_strided(torch.randn(64), (3, 1, 8), (16, 5, 1)), True),   # odd stride on a size-1 dim
    (torch.as_strided(torch.randn(64), (3, 1, 8), (4, 5, 1)), False),   # rows overlap
    (torch.randn(0, 8), True),
])
def test_rows_are_flat(x, expect):
    assert rows_are_flat(x) is expect
    if expect:  # the claim must hold: the view equals the flattened rows
        m, k = x.numel() // x.shape[-1], x.shape[-1]
        ld = flat_row_stride(x)
        flat = torch.as_strided(x, (m, k), (ld, 1))
        assert torch.equal(flat, x.reshape(m, k))


def test_row_major_copies_only_when_needed():
    a = torch.randn(5, 12)[:, 2:10]
    assert row_major(a) is a
    t = torch.randn(8, 5).T
    r = row_major(t)
    assert r.is_contiguous() and torch.equal(r, t)
    assert rows_2d(torch.randn(3, 4, 7)).shape == (12, 7)
    assert rows_2d(torch.randn(7)).shape == (1, 7)


def test_contiguous_bias_realigns():
    buf = torch.randn(33)
    b = buf[1:]
    c = contiguous_bias(b)
    assert c is not b and c.data_ptr() % 16 == 0 and torch.equal(c, b)
    b2 = torch.randn(32)
    assert contiguous_bias(b2) is b2
    strided = torch.randn(64)[::2]
    assert torch.equal(contiguous_bias(strided), strided)


@pytest.mark.parametrize("args, exc, match", [
    ((torch.randn(3, 4), torch.randn(5, 4, 1), None), ValueError, "weight must be 2-D"),
    ((torch.randn(3, 4), torch.randn(5, 3), None), ValueError, "input features"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(4)), ValueError, r"bias must have shape \(5,\)"),
    ((torch.randn(3, 4), torch.randn(5, 4).half(), None), TypeError, "one dtype"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(5).double()), TypeError, "bias=torch.float64"),
    ((torch.tensor(1.0), torch.randn(5, 4), None), ValueError, "scalar"),
    (([1, 2], torch.randn(5, 4), None), TypeError, "x must be a torch.Tensor"),
    ((torch.randn(3, 4), torch.randn(5, 4), 3.0), TypeError, "bias must be"),
])
def test_check_linear_args_messages(args, exc, match):
    with pytest.raises(exc, match=match):
        check_linear_args(*args)


def test_gpu_kernel_args_refuse_cpu_and_float64():
    with pytest.raises(ValueError, match="needs CUDA"):
        check_gpu_kernel_args(torch.randn(3, 4), torch.randn(5, 4), None, "k")


def test_call_signature_distinguishes_layouts():
    w = torch.randn(6, 8)
    buf = torch.randn(256)
    x = buf[:32].view(4, 8)
    base = call_signature(x, w, None, None)[0]
    assert call_signature(buf[64:96].view(4, 8), w, None, None)[0] == base  # 256 bytes further: same key
    assert call_signature(buf[1:33].view(4, 8), w, None, None)[0] != base   # misaligned by 4 bytes
    assert call_signature(x, w, None, "relu")[0] != base
    assert call_signature(torch.randn(4, 9)[:, 1:], w, None, None)[0] != base   # stride and residue
    assert call_signature(x, w, torch.randn(6), None)[0] != base
    assert call_signature(x.half(), w.half(), None, None)[0] != base
