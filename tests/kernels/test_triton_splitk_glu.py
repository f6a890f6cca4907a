"""The split-K kernel's GLU epilogue (kernels/triton_splitk.py ``glu=``) under the Triton
interpreter: a stacked [gate; up] weight (fp16 or e4m3), out = act(gate) * up with
transformers' roundings, against fp64 products, every single-pass reduction mode, the norm
prologue, odd shapes, poisoned outputs, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridgemm.kernels import triton_splitk as sk
from hybridgemm.kernels.fp8 import quantize_fp8

pytestmark = pytest.mark.usefixtures("interpreter")

CONFIGS = {
    "one-pass": sk.TritonSplitKConfig(16, 32, 64, 1, 4, 2),
    "fused-reduce": sk.TritonSplitKConfig(16, 64, 32, 3, 4, 2, fused_reduce=True),
    "x1-one-pass": sk.TritonSplitKConfig(1, 16, 128, 1, 1, 2),
    "x2-fused-reduce": sk.TritonSplitKConfig(2, 32, 64, 2, 2, 2, fused_reduce=True),
}
ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _operands(m, inter, k, weights, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2 * inter, k, generator=g) * (0.5 + torch.rand(2 * inter, 1, generator=g)) / k ** 0.5 * 3
    x = torch.randn(m, k, generator=g).half()
    b = (torch.randn(2 * inter, generator=g) * 0.5).half()
    if weights == "fp16":
        return w.half(), None, w.half().double(), x, b
    q = quantize_fp8(w.half(), weights)
    return q.data, q.scale, q.dequantize(torch.float32).double(), x, b


def _reference(x, w64, b, act, xin=None, rstd=None, roundings=True):
    """transformers' GLU over the dequantized weight: gate and up each rounded to x's dtype, the
    activation rounded, the product rounded (``xin``/``rstd``: the norm prologue's order);
    without ``roundings`` the fp64 product rounded once."""
    y = (x if xin is None else xin).double() @ w64.T
    if rstd is not None:
        y = y * rstd
    y = y + b.double()
    if not roundings:
        gate, up = y.chunk(2, dim=-1)
        return (ACTS[act](gate) * up).to(x.dtype).double()
    gate, up = y.to(x.dtype).chunk(2, dim=-1)
    return (ACTS[act](gate.float()).to(x.dtype).float() * up.float()).to(x.dtype).double()


def _same(a, b) -> float:
    """The share of elements equal bit for bit."""
    return (a.double() == b.double()).float().mean().item()


def _run(cfg, w, scale, x, b, act, **fusion):
    out = torch.full((x.shape[0], w.shape[0] // 2), float("nan"), dtype=x.dtype)  # poisoned
    sk.run(cfg, x, w, b, out, None, weight_scale=scale, glu=act, **fusion)
    return out


@pytest.mark.parametrize("weights", ["fp16", "channel", "block128"])
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("m,inter,k", [(1, 100, 256), (3, 37, 384), (17, 130, 200)])
def test_glu_epilogue_matches_the_rounded_fp64_product(weights, cfg, m, inter, k):
    if weights == "block128" and k % 128 and CONFIGS[cfg].split_k > 1:
        k = 384  # a split starts on a scale block's edge: K of whole blocks keeps each split's share
    w, scale, w64, x, b = _operands(m, inter, k, weights, m + inter + k)
    out = _run(CONFIGS[cfg], w, scale, x, b, "silu")
    ref = _reference(x, w64, b, "silu")
    assert out.shape == (m, inter) and not out.isnan().any()
    # the GEMM's fp32 sums differ from fp64 by far less than an fp16 ulp; a gate or up value
    # near a rounding boundary can round the other way, so allow a few ulps of the product
    torch.testing.assert_close(out.double(), ref, rtol=4e-3, atol=4e-3)
    if out.numel() >= 100:  # bit for bit nearly everywhere with the three roundings, not with one
        assert _same(out, ref) > 0.97 and _same(out, _reference(x, w64, b, "silu", roundings=False)) < 0.8


@pytest.mark.parametrize("act", list(ACTS))
def test_each_activation_is_the_one_asked_for(act):
    w, scale, w64, x, b = _operands(3, 64, 128, "channel", 7)
    out = _run(CONFIGS["one-pass"], w, scale, x, b, act)
    ref = _reference(x, w64, b, act)
    torch.testing.assert_close(out.double(), ref, rtol=4e-3, atol=4e-3)
    for other in (a for a in ACTS if a != act):  # where the other activation rounds elsewhere, ours is taken
        theirs = _reference(x, w64, b, other)
        apart = ref != theirs
        assert apart.sum() >= 10 and _same(out[apart], ref[apart]) > 0.8 and _same(out[apart], theirs[apart]) < 0.05


def test_gate_and_up_are_not_swapped_and_every_column_is_its_own():
    """A weight whose up rows are all zero but one: every output column is zero except that
    one, and there it is act(gate) times that row's product."""
    w, scale, w64, x, b = _operands(2, 48, 128, "fp16", 3)
    w = w.clone()
    w[48:] = 0
    w[48 + 29] = 1 / 128
    b = torch.zeros_like(b)
    out = _run(CONFIGS["fused-reduce"], w, None, x, b, "silu")
    assert torch.count_nonzero(out[:, torch.arange(48) != 29]) == 0
    torch.testing.assert_close(out.double(), _reference(x, w.double(), b, "silu"), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("cfg", ["fused-reduce", "x1-one-pass"])
def test_norm_prologue_with_the_glu_epilogue(cfg):
    m, inter, k = 5, 40, 256
    w, scale, w64, x, b = _operands(m, inter, k, "channel", 9)
    g = (torch.rand(k) + 0.5).half()
    out = _run(CONFIGS[cfg], w, scale, x, b, "gelu_tanh", norm=(g, 1e-5))
    # the prologue's order (triton_splitk NORM): (x * g) rounded once, the GEMM, rows times 1/rms(x)
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = _reference(x, w64, b, "gelu_tanh", xin=x * g, rstd=rstd)
    torch.testing.assert_close(out.double(), ref, rtol=4e-3, atol=4e-3)


def test_output_rows_with_a_stride_are_written_in_place():
    w, scale, w64, x, b = _operands(3, 40, 128, "channel", 4)
    big = torch.full((3, 100), float("nan"), dtype=torch.float16)
    out = big[:, 10:50]
    sk.run(CONFIGS["one-pass"], x, w, b, out, None, weight_scale=scale, glu="silu")
    torch.testing.assert_close(out.double(), _reference(x, w64, b, "silu"), rtol=4e-3, atol=4e-3)
    assert big[:, :10].isnan().all() and big[:, 50:].isnan().all()


def test_what_the_glu_epilogue_refuses():
    w, scale, _, x, b = _operands(2, 32, 128, "channel", 1)
    out = torch.empty(2, 32, dtype=torch.float16)
    cfg = CONFIGS["one-pass"]
    with pytest.raises(ValueError, match="glu must be one of"):
        sk.run(cfg, x, w, b, out, None, weight_scale=scale, glu="relu")
    with pytest.raises(ValueError, match="no residual"):
        sk.run(cfg, x, w, b, out, None, weight_scale=scale, glu="silu", residual=torch.zeros_like(out))
    with pytest.raises(ValueError, match="no activation"):
        sk.run(cfg, x, w, b, out, "gelu", weight_scale=scale, glu="silu")
    with pytest.raises(ValueError, match="fused reduction"):
        sk.run(sk.TritonSplitKConfig(16, 32, 32, 2, 4, 2), x, w, b, out, None, weight_scale=scale, glu="silu")
    with pytest.raises(ValueError, match="N / 2|product's 32 columns"):
        sk.run(cfg, x, w, b, torch.empty(2, 64, dtype=torch.float16), None, weight_scale=scale, glu="silu")
    odd = torch.randn(63, 128).half()
    with pytest.raises(ValueError, match="must be even"):
        sk.run(cfg, x, odd, None, torch.empty(2, 31, dtype=torch.float16), None, glu="silu")
