"""The FP8 weight format (kernels/fp8.py): quantize/dequantize against a hand computation, the
granularity read from the scale's shape, and every bad input with a clear error."""

from __future__ import annotations

import math

import pytest
import torch

from hybridgemm.kernels import fp8
from hybridgemm.kernels.fp8 import FP8FormatError, FP8Weight, quantize_fp8


def _hand_channel(w: torch.Tensor):
    """Per row, written out: s = max|w| / 448, q = round-to-nearest-even(w / s) in e4m3."""
    scales, rows = [], []
    for row in w.double():
        s = max(row.abs().max().item(), 1e-12) / 448.0
        scales.append(s)
        rows.append((row / s).float().to(torch.float8_e4m3fn))
    return torch.stack(rows), torch.tensor(scales, dtype=torch.float32)


@pytest.mark.parametrize("n,k", [(1, 1), (3, 17), (33, 130), (100, 300)])
def test_channel_quantization_matches_the_hand_computation(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 3
    w[0, :] = 0.0  # an all-zero row gets a tiny positive scale and zero data
    q = quantize_fp8(w, "channel")
    data, scale = _hand_channel(w)
    torch.testing.assert_close(q.scale, scale, rtol=1e-6, atol=0)
    # the same e4m3 values, except where w / s lands on a rounding tie differently in fp32 and fp64
    mismatch = (q.data.float() != data.float()).float().mean().item()
    assert mismatch < 0.01
    assert q.granularity == "channel" and q.scale.shape == (n,) and q.data.dtype == torch.float8_e4m3fn
    assert (q.data[0].float() == 0).all() and q.scale[0] > 0
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normals, ≤ s·2^-10 absolute for subnormals
    err = (q.dequantize(torch.float32) - w).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, q.scale[:, None] * 2 ** -10) * 1.0001
    assert (err <= bound).all()
    # the largest magnitude of each nonzero row maps to ±448
    assert torch.allclose(q.data[1:].float().abs().amax(1), torch.full((n - 1,), 448.0))


@pytest.mark.parametrize("n,k", [(1, 5), (128, 128), (130, 300), (257, 129)])
def test_block_quantization_scales_each_128_block(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * torch.linspace(0.1, 10, k)
    q = quantize_fp8(w, "block128")
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    assert q.scale.shape == (nb, kb) and q.granularity == "block128"
    for i in range(nb):
        for j in range(kb):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert q.scale[i, j].item() == pytest.approx(block.abs().max().item() / 448.0, rel=1e-6)
    deq = q.dequantize(torch.float32)
    expanded = q.scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    torch.testing.assert_close(deq, q.data.float() * expanded, rtol=0, atol=0)
    assert ((deq - w).abs() <= torch.maximum(w.abs() * 2 ** -4, expanded * 2 ** -10) * 1.0001).all()


def test_dequantize_rounds_once_to_the_requested_dtype():
    q = quantize_fp8(torch.randn(40, 70), "channel")
    exact = q.data.double() * q.scale.double()[:, None]
    assert torch.equal(q.dequantize(torch.bfloat16), exact.float().to(torch.bfloat16))
    assert q.dequantize().dtype == torch.bfloat16  # an fp32 weight computes in bf16
    assert quantize_fp8(torch.randn(4, 4).half()).dtype == torch.float16


def test_granularity_is_read_from_the_scale_shape():
    data = torch.zeros(300, 200, dtype=torch.float8_e4m3fn)
    assert fp8.granularity_of(data, torch.ones(300)) == "channel"
    assert fp8.granularity_of(data, torch.ones(300, 1)) == "channel"
    assert fp8.granularity_of(data, torch.ones(3, 2)) == "block128"
    with pytest.raises(FP8FormatError, match=r"fits neither granularity.*\(300,\) or \(300, 1\).*\(3, 2\)"):
        fp8.granularity_of(data, torch.ones(2, 2))
    w = FP8Weight.from_tensors(data, torch.ones(300, 1))
    assert w.scale.shape == (300,) and w.scale.is_contiguous()


@pytest.mark.parametrize("bad,match", [
    (lambda: FP8Weight(torch.zeros(4, 4), torch.ones(4), "channel"), "must be torch.float8_e4m3fn"),
    (lambda: FP8Weight(torch.zeros(4, 4, dtype=torch.float8_e5m2), torch.ones(4), "channel"), "e4m3fn"),
    (lambda: FP8Weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(4).half(), "channel"), "float32"),
    (lambda: FP8Weight(torch.zeros(4, dtype=torch.float8_e4m3fn), torch.ones(4), "channel"), "2-D"),
    (lambda: FP8Weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1), "channel"), "block128"),
    (lambda: FP8Weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(4), "tensor"), "granularity"),
    (lambda: FP8Weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(4), "channel", torch.float32),
     "bfloat16 or float16"),
])
def test_malformed_weights_are_refused(bad, match):
    with pytest.raises(FP8FormatError, match=match):
        bad()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_scales_that_are_not_finite_and_positive_are_refused(value):
    scale = torch.ones(6)
    scale[4] = value
    with pytest.raises(FP8FormatError, match="finite and > 0: 1 of 6"):
        FP8Weight.from_tensors(torch.zeros(6, 8, dtype=torch.float8_e4m3fn), scale)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_data_is_refused(code):
    """e4m3fn's NaN codes: the kernels' integer conversion would read them as -/+480."""
    data = torch.zeros(6, 8, dtype=torch.uint8)
    data[2, 5] = code
    data[3, 1] = 0x7E  # 448, the largest finite value, and 0xFE (-448) are fine
    data[3, 2] = 0xFE
    with pytest.raises(FP8FormatError, match="1 NaN values"):
        FP8Weight.from_tensors(data.view(torch.float8_e4m3fn), torch.ones(6))
    data[2, 5] = 0
    assert FP8Weight.from_tensors(data.view(torch.float8_e4m3fn), torch.ones(6)).shape == (6, 8)


def test_quantize_refuses_bad_weights():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(torch.ones(2, 2), "tensor")
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.ones(2))
    with pytest.raises(TypeError):
        quantize_fp8([[1.0]])
