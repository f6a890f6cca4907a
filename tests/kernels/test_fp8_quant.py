"""On-the-fly e4m3 quantization of activations (kernels/fp8_quant.py), under the interpreter (on
the GPU where there is one): bytes and scales equal to a torch reference computed by hand, every
fp16 value in range rounded as torch rounds it, odd shapes, zero rows, strided rows, the padded rows
of the GEMM path, the block scales' layout, and bad input."""

from __future__ import annotations

import pytest
import torch

from helpers import silu_product
from hybridgemm.kernels import fp8_quant as fq
from hybridgemm.kernels.fp8 import quantize_fp8

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DTYPES = [torch.bfloat16, torch.float16]


def reference(x: torch.Tensor, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in torch, fp32: scale = max(amax, floor) / 448 per row or per 1x128 block,
    x8 = e4m3(clamp(x / scale, ±448)). Block scales returned as (M, L). The divisor 448 is a
    tensor: torch's CUDA division by a Python number multiplies by its reciprocal, which is not
    the IEEE quotient for every amax."""
    xf = x.float()
    m, k = xf.shape
    if group == "token":
        scale = xf.abs().amax(dim=1).clamp_min(fq.MIN_AMAX) / xf.new_full((), 448.0)
        return (xf / scale[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale
    nb = -(-k // 128)
    padded = torch.zeros(m, nb * 128, device=x.device)
    padded[:, :k] = xf
    scale = padded.view(m, nb, 128).abs().amax(dim=2).clamp_min(fq.MIN_AMAX) / xf.new_full((), 448.0)
    per_col = scale.repeat_interleave(128, dim=1)[:, :k]
    return (xf / per_col).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def activations(m, k, dtype, device, ld=None):
    """Rows whose magnitudes span 10**-4 .. 10**3 (so scales differ by orders of magnitude and
    small values land in e4m3's subnormals), row 0 all zeros, optional row stride ``ld``."""
    ld = ld or k
    mags = 10 ** (torch.rand(m, 1, device=device) * 7 - 4)
    buf = (torch.randn(m, ld, device=device) * mags).to(dtype)
    buf[0] = 0
    return buf[:, :k]


def assert_same_bytes(q, ref):
    assert q.dtype == torch.float8_e4m3fn and q.shape == ref.shape
    diff = q.view(torch.uint8) != ref.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} of {q.numel()} bytes differ, e.g. at {diff.nonzero()[:5].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", fq.GROUPS)
@pytest.mark.parametrize("m,k", [(1, 1), (1, 300), (3, 129), (17, 100), (17, 1000), (333, 264)])
def test_matches_the_reference_exactly(dtype, group, m, k, device):
    x = activations(m, k, dtype, device)
    q, s = fq.quantize_activations(x, group)
    ref_q, ref_s = reference(x, group)
    assert_same_bytes(q, ref_q)
    assert s.shape == ref_s.shape and s.dtype == torch.float32
    assert torch.equal(s, ref_s)
    assert torch.all(s[0] == fq.MIN_AMAX / 448.0) and not q[0].float().any()  # the zero row


@pytest.mark.parametrize("group", fq.GROUPS)
def test_strided_rows_and_a_wide_row(group, device):
    # row stride > K (a column slice of a wider buffer), and a row wider than one pass holds
    for m, k, ld in [(5, 260, 300), (3, fq.ONE_PASS_MAX + 808, fq.ONE_PASS_MAX + 1000)]:
        x = activations(m, k, torch.float16, device, ld)
        assert x.stride(0) == ld
        q, s = fq.quantize_activations(x, group)
        ref_q, ref_s = reference(x, group)
        assert_same_bytes(q, ref_q)
        assert torch.equal(s, ref_s)


def test_column_strided_input_is_copied_first(device):
    x = activations(40, 24, torch.bfloat16, device).t()  # (24, 40) with unit row stride
    q, s = fq.quantize_activations(x, "token")
    ref_q, ref_s = reference(x, "token")
    assert_same_bytes(q, ref_q)
    assert torch.equal(s, ref_s)


@pytest.mark.parametrize("group", fq.GROUPS)
def test_every_fp16_value_rounds_as_torch_rounds(group, device):
    """Every finite fp16 value in [-448, 448] (ties, subnormals, -0 included) with scale 1:
    each row (block) also holds 448, so its scale is exactly 1 and x8 is x rounded to e4m3."""
    vals = torch.arange(0, 2**16, dtype=torch.int32, device=device).to(torch.int16).view(torch.float16)
    vals = vals[torch.isfinite(vals) & (vals.abs() <= 448)]
    rows = -(-vals.numel() // 127)
    x = torch.zeros(rows * 127, dtype=torch.float16, device=device)
    x[: vals.numel()] = vals
    x = torch.cat([torch.full((rows, 1), 448.0, dtype=torch.float16, device=device), x.view(rows, 127)], dim=1)
    q, s = fq.quantize_activations(x, group)
    assert torch.all(s == 1.0)
    assert_same_bytes(q, x.float().to(torch.float8_e4m3fn))


def test_token_scales_are_the_weight_quantizers_channel_scales(device):
    x = activations(9, 200, torch.bfloat16, device)
    q, s = fq.quantize_activations(x, "token")
    w = quantize_fp8(x, "channel")  # the same formula for rows of a weight
    assert_same_bytes(q, w.data)
    assert torch.equal(s, w.scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", fq.GROUPS)
def test_dequantized_values_are_close(dtype, group, device):
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 where the value is normal in e4m3
    x = activations(6, 390, dtype, device)
    q, s = fq.quantize_activations(x, group)
    per_col = s[:, None] if group == "token" else s.repeat_interleave(128, dim=1)[:, :390]
    deq = q.float() * per_col
    normal = (x.float().abs() / per_col) >= 2.0**-6
    err = (deq - x.float()).abs()
    assert torch.all(err[normal] <= 2.0**-4 * x.float().abs()[normal])
    assert torch.all(err[~normal] <= 2.0**-10 * per_col.expand_as(err)[~normal])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf / inf
@pytest.mark.parametrize("group", fq.GROUPS)
def test_nan_and_inf_reach_the_bytes(group, device):
    # a non-finite activation must not quantize to finite bytes (the GEMM's row would look fine)
    x = activations(4, 300, torch.bfloat16, device)
    x[1, 7], x[2, 200], x[3, 5] = float("nan"), float("inf"), -float("inf")
    q, _ = fq.quantize_activations(x, group)
    assert torch.isnan(q[1].float()).any() and torch.isnan(q[2].float()).any() and torch.isnan(q[3].float()).any()
    assert torch.isfinite(q[0].float()).all()


def test_block_scales_are_m_major(device):
    x = activations(7, 300, torch.float16, device)
    q, s = fq.quantize_activations(x, "block128")
    assert s.shape == (7, 3) and s.stride() == (1, 7)


@pytest.mark.parametrize("group", fq.GROUPS)
def test_padded_rows_quantize_as_zeros(group, device):
    x = activations(5, 200, torch.bfloat16, device)
    x[0] = 1.0  # no zero row among the real ones
    x8, s = fq.quantize_for_gemm(x, group, rows=8)
    ref_q, ref_s = reference(x, group)
    assert x8.shape == (8, 200)
    assert_same_bytes(x8[:5], ref_q)
    assert not x8[5:].float().any()
    if group == "token":
        assert s.shape == (8,)
        assert torch.equal(s[:5], ref_s) and torch.all(s[5:] == fq.MIN_AMAX / 448.0)
    else:
        assert s.shape == (2, 8)  # (L, rows): M-major
        assert torch.equal(s[:, :5], ref_s.t()) and torch.all(s[:, 5:] == fq.MIN_AMAX / 448.0)


@pytest.mark.parametrize("group", fq.GROUPS)
def test_no_rows(group, device):
    q, s = fq.quantize_activations(torch.empty(0, 300, dtype=torch.float16, device=device), group)
    assert q.shape == (0, 300) and s.shape == ((0,) if group == "token" else (0, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", fq.GROUPS)
@pytest.mark.parametrize("m,k", [(1, 1), (3, 129), (17, 300), (4, fq.ONE_PASS_MAX + 264)])
def test_glu_quantizes_the_silu_product_it_never_writes(dtype, group, m, k, device):
    """``glu="silu"``: x holds gate then up (a stacked gate/up GEMM's output, here with a row
    stride past 2K); the bytes and scales are those of the eager product quantized, including a
    row wider than one pass and gates far into the negative (SiLU's -0) and the positive."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 to bf16 where the GPU rounds to nearest (the SiLU and the "
                    "product are rounded to x's dtype): bf16 runs on the GPU")
    torch.manual_seed(m * 1000 + k)
    buf = torch.randn(m, 2 * k + 8, device=device) * 4
    buf[:, 0] = -200.0  # exp(200) overflows fp32: the SiLU is -0
    buf[-1, :k] = 0  # a row whose product is all zeros
    gu = buf.to(dtype)[:, :2 * k]
    q, s = fq.quantize_activations(gu, group, glu="silu")
    ref_q, ref_s = reference(silu_product(gu), group)
    assert_same_bytes(q, ref_q)
    assert torch.equal(s, ref_s)
    assert not q[-1].float().any()


@pytest.mark.parametrize("stash", [False, True], ids=["formed_twice", "stashed"])
def test_glu_rows_of_two_passes_with_padding(stash, device, monkeypatch):
    """A GLU row wider than one pass, its product formed again in the second pass or stashed by
    the first (fp8_quant.GLU_STASH): the same bytes and scales, and the GEMM's padded rows zeros."""
    monkeypatch.setattr(fq, "GLU_STASH", stash)
    monkeypatch.setattr(fq, "_LAUNCHERS", type(fq._LAUNCHERS)(4))
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16: above)
    k = fq.ONE_PASS_MAX + 136
    torch.manual_seed(k)
    gu = (torch.randn(3, 2 * k, device=device) * 4).to(dtype)
    q, s = fq.quantize_for_gemm(gu, "token", rows=6, glu="silu")
    assert fq.stashes(k, "silu") == stash
    ref_q, ref_s = reference(silu_product(gu), "token")
    assert_same_bytes(q[:3], ref_q)
    assert torch.equal(s[:3], ref_s) and not q[3:].float().any() and torch.all(s[3:] == fq.MIN_AMAX / 448.0)


def test_launchers_are_cached_per_shape(device):
    fq._LAUNCHERS.clear()
    for _ in range(3):
        fq.quantize_activations(activations(4, 130, torch.float16, device), "block128")
    assert len(fq._LAUNCHERS) == 1
    fq.quantize_activations(activations(5, 130, torch.float16, device), "block128")
    assert len(fq._LAUNCHERS) == 2


def test_bad_input(device, monkeypatch):
    x = torch.ones(4, 64, dtype=torch.bfloat16, device=device)
    cases = [
        ((x.tolist(), "token"), TypeError, "torch.Tensor"),
        ((x, "row"), ValueError, "group must be one of"),
        ((x.float(), "token"), TypeError, "bfloat16 or float16"),
        ((x.to(torch.int32), "token"), TypeError, "bfloat16 or float16"),
        ((x.view(2, 2, 64), "token"), ValueError, "2-D"),
        ((x[:, :0], "block128"), ValueError, "K = 0"),
        ((x, "token", "gelu"), ValueError, "glu must be one of"),
        ((x[:, :63], "token", "silu"), ValueError, "even number of columns"),
    ]
    for args, exc, words in cases:
        with pytest.raises(exc, match=words):
            fq.quantize_activations(*args)
    with pytest.raises(ValueError, match="at least"):
        fq.quantize_for_gemm(x, "token", rows=3)
    if device == "cpu":
        monkeypatch.setattr(fq, "interpreting", lambda: False)
        with pytest.raises(ValueError, match="CUDA tensor"):
            fq.quantize_activations(x, "token")
