"""Argument checks and operand normalisation (kernels/checks.py): pure CPU."""

import pytest
import torch

from hybridgemm.kernels.checks import (
    LinearArgumentError,
    call_signature,
    check_gpu_kernel_args,
    check_linear_args,
    contiguous_bias,
    flat_row_stride,
    operand_key,
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
    ((torch.randn(3, 4), torch.randn(5, 4, 1), None), LinearArgumentError, "weight must be 2-D"),
    # a kernel takes no 1-D weight (hybridgemm.linear brings F.linear's (K,) to (1, K) first)
    ((torch.randn(3, 4), torch.randn(4), None), LinearArgumentError, r"2-D \(out_features, in_features\), got"),
    ((torch.randn(3, 4), torch.randn(5, 3), None), LinearArgumentError, "input features"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(4)), LinearArgumentError, r"bias must have shape \(5,\)"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(1, 5)), LinearArgumentError, r"bias must have shape \(5,\)"),
    ((torch.randn(3, 4), torch.randn(5, 4).half(), None), LinearArgumentError, "one dtype"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(5).double()), LinearArgumentError, "bias=torch.float64"),
    ((torch.tensor(1.0), torch.randn(5, 4), None), LinearArgumentError, "scalar"),
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


# ------------------------------------------------------------------ exact rules and messages


def test_row_major_edges():
    t = torch.randn(6, 8)
    assert row_major(t) is t  # contiguous: row stride == C, no copy
    every_other_column = torch.randn(4, 10)[:, ::2]  # row stride 10 >= 5, but column stride 2
    r = row_major(every_other_column)
    assert r.stride() == (5, 1) and torch.equal(r, every_other_column)
    one_row = torch.as_strided(torch.randn(16), (1, 8), (3, 1))  # one row: its stride is meaningless
    assert row_major(one_row) is one_row
    overlapping = torch.as_strided(torch.randn(16), (2, 8), (4, 1))  # two rows sharing 4 elements
    r = row_major(overlapping)
    assert r is not overlapping and r.stride() == (8, 1) and torch.equal(r, overlapping)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_contiguous_bias_copy_keeps_dtype_and_device(dtype):
    strided = torch.randn(64, dtype=dtype)[::2]
    c = contiguous_bias(strided)
    assert c.dtype == dtype and c.stride() == (1,) and torch.equal(c, strided)
    misaligned = torch.randn(33, dtype=dtype)[1:]
    c = contiguous_bias(misaligned)
    assert c.dtype == dtype and c.data_ptr() % 16 == 0 and torch.equal(c, misaligned)
    meta = torch.empty(64, device="meta")[::2]
    assert contiguous_bias(meta).device == meta.device


def test_flat_row_stride_edges():
    # K = 1: the column stride is meaningless, rows are 4 apart
    k1 = torch.as_strided(torch.randn(32), (5, 1), (4, 7))
    assert flat_row_stride(k1) == 4
    assert torch.equal(torch.as_strided(k1, (5, 1), (4, 1)), k1)
    # K = 2 with column stride 2: not row-major
    assert flat_row_stride(torch.randn(5, 4)[:, ::2]) is None
    # three leading dims merge into one row stride: (2, 3, 4, K) contiguous reads as (24, K)
    x = torch.randn(2, 3, 4, 6)
    assert flat_row_stride(x) == 6 and rows_are_flat(x)
    # ... but not when the outermost dim's stride breaks the pattern
    gap = torch.randn(2, 4, 4, 6)[:, :3]
    assert flat_row_stride(gap) is None


def test_call_signature_keys_the_weight_and_bias_alignment():
    x = torch.randn(4, 8)
    wbuf, bbuf = torch.randn(6 * 8 + 64), torch.randn(64)
    w, b = wbuf[:48].view(6, 8), bbuf[:6]
    base = call_signature(x, w, b, None)[0]
    assert call_signature(x, wbuf[64:112].view(6, 8), b, None)[0] == base  # 256 bytes further: same class
    assert call_signature(x, wbuf[1:49].view(6, 8), b, None)[0] != base  # 4 bytes off
    assert call_signature(x, w, bbuf[4:10], None)[0] == base  # 16 bytes further: same class
    assert call_signature(x, w, bbuf[1:7], None)[0] != base  # 4 bytes off
    assert call_signature(x, w, None, None)[0] != base


@pytest.mark.parametrize("args, kwargs, exc, message", [
    ((torch.randn(3, 4), torch.randn(5, 4), 1.5), {}, TypeError,
     "linear: bias must be a torch.Tensor or None, got float"),
    (([1.0], torch.randn(5, 4), None), {"who": "op"}, TypeError, "op: x must be a torch.Tensor, got list"),
    ((torch.randn(2, 3, 5), torch.randn(6, 4), None), {}, LinearArgumentError,
     "linear: x has 5 input features (shape (2, 3, 5)) but weight expects 4 (shape (6, 4))"),
    ((torch.randn(3, 4), torch.randn(5, 4).half(), None), {}, LinearArgumentError,
     "linear: x, weight and bias must share one dtype, got x=torch.float32, weight=torch.float16"),
    ((torch.randn(3, 4), torch.randn(5, 4, device="meta"), None), {}, LinearArgumentError,
     "linear: x, weight and bias must be on one device, got x=cpu, weight=meta"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, device="meta")), {}, LinearArgumentError,
     "linear: x, weight and bias must be on one device, got x=cpu, weight=cpu, bias=meta"),
    ((torch.randn(3, 4), torch.randn(5, 4, device="meta"), torch.randn(5)), {"who": "k"}, LinearArgumentError,
     "k: x, weight and bias must be on one device, got x=cpu, weight=meta, bias=cpu"),
])
def test_check_linear_args_full_messages(args, kwargs, exc, message):
    with pytest.raises(exc) as info:
        check_linear_args(*args, **kwargs)
    assert str(info.value) == message


def test_gpu_kernel_args_apply_the_linear_rules_first():
    with pytest.raises(LinearArgumentError) as info:  # F.linear's rules before the device: the bias is named
        check_gpu_kernel_args(torch.randn(3, 4), torch.randn(5, 4), torch.randn(4), "kern")
    assert str(info.value) == "kern: bias must have shape (5,) to match weight's 5 out_features, got (4,)"
    with pytest.raises(ValueError) as info:
        check_gpu_kernel_args(torch.randn(3, 4), torch.randn(5, 4), None, "kern")
    assert str(info.value) == ("kern: needs CUDA tensors, got cpu (use hybridgemm.linear, which falls back "
                               "to torch on the CPU)")


def test_one_dimensional_x_is_a_single_row():
    check_linear_args(torch.randn(4), torch.randn(5, 4), torch.randn(5))  # F.linear takes (K,) as one row


@pytest.mark.parametrize("dtype, flag", [(torch.float32, "allow_tf32"),
                                         (torch.bfloat16, "allow_bf16_reduced_precision_reduction"),
                                         (torch.float16, "allow_fp16_reduced_precision_reduction")])
def test_call_signature_keys_the_dtypes_math_flag(dtype, flag):
    x, w = torch.randn(4, 8, dtype=dtype), torch.randn(6, 8, dtype=dtype)
    matmul = torch.backends.cuda.matmul  # its flags are properties: set and restored by hand
    old = getattr(matmul, flag)
    try:
        setattr(matmul, flag, True)
        on = call_signature(x, w, None, None)[0]
        setattr(matmul, flag, False)
        off = call_signature(x, w, None, None)[0]
    finally:
        setattr(matmul, flag, old)
    assert on != off and on[:2] == off[:2]


def test_call_signature_of_a_dtype_without_a_math_flag():
    key = call_signature(torch.randn(4, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64), None,
                         "relu")[0]
    assert key[1:] == ("relu", None)


def test_operand_key_pointer_classes():
    buf = torch.randn(1024)
    w, b = torch.randn(6, 8), torch.randn(6)

    def x_at(offset):  # a (4, 8) view starting ``offset`` floats into buf
        return buf[offset:offset + 32].view(4, 8)

    def key(x, mask=255, **kw):
        return operand_key(x, x.data_ptr(), w, w.data_ptr(), b, mask=mask, **kw)

    assert key(x_at(0)) == key(x_at(64)) and key(x_at(0)) != key(x_at(1))  # 256 bytes: same class; 4: not
    assert key(x_at(0), 15) == key(x_at(4), 15) and key(x_at(0), 15) != key(x_at(2), 15)  # 16 bytes: same
    out_buf = torch.empty(1024)

    def out_key(offset):
        out = out_buf[offset:offset + 24].view(4, 6)
        return operand_key(x_at(0), x_at(0).data_ptr(), w, w.data_ptr(), None, out)

    assert out_key(0) == out_key(64) and out_key(0) != out_key(1)
    assert len(out_key(0)) == len(key(x_at(0))) + 5


def test_operand_key_by_pointer_names_the_weight_and_bias_themselves():
    x = torch.randn(4, 8)
    wbuf, b = torch.randn(2 * 48 + 64), torch.randn(6)
    w1, w2 = wbuf[:48].view(6, 8), wbuf[64:112].view(6, 8)  # 256 bytes apart: one alignment class

    def key(w, bias, **kw):
        return operand_key(x, x.data_ptr(), w, w.data_ptr(), bias, **kw)

    assert key(w1, b) == key(w2, b)  # by class
    assert key(w1, b, by_pointer=True) != key(w2, b, by_pointer=True)  # by address
    assert key(w1, None, by_pointer=True)[-1] is None
    assert key(w1, b, by_pointer=True)[-1] == (b.shape, b.stride(), b.dtype, b.data_ptr())
    xs = torch.randn(256)
    x0, x64 = xs[:32].view(4, 8), xs[64:96].view(4, 8)
    assert (operand_key(x0, x0.data_ptr(), w1, w1.data_ptr(), None, by_pointer=True)
            == operand_key(x64, x64.data_ptr(), w1, w1.data_ptr(), None, by_pointer=True))  # x: by class
