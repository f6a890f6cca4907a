"""The kernels' decoder-layer fusions under the Triton interpreter: the RMSNorm prologue of
triton_splitk and triton_glu, the residual epilogue of triton_splitk, in every split-K mode,
against an fp64 reference of the unrounded formula; their argument checks. bf16 and the real
shapes run on the GPU (perf/bench_layer_fusion.py checks every fused call against fp32 first).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_counters_zero, poisoned, rel_err
from hybridgemm.kernels import triton_glu as tglu
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.fp8 import quantize_fp8
from hybridgemm.norm import reference_rms_norm

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

Cfg = ts.TritonSplitKConfig
DIRECT = Cfg(16, 32, 32, split_k=1, num_warps=4, num_stages=2)  # epilogue in the one launch
TWO_LAUNCH = Cfg(16, 32, 16, split_k=2, num_warps=4, num_stages=3)  # partials, then _reduce_kernel
FUSED3 = Cfg(16, 16, 16, split_k=3, num_warps=4, num_stages=2, fused_reduce=True)  # last program reduces
SPLITK = [DIRECT, TWO_LAUNCH, FUSED3]
GLU = [tglu.TritonGluConfig(16, 16, 32, 4, 2), tglu.TritonGluConfig(64, 16, 16, 4, 2)]  # swapped, usual
EPS = 1e-5
FLOOR = {torch.float16: 1e-3, torch.float32: 1e-5}
N, K = 40, 72  # neither a multiple of the blocks: masked tiles, a partial last K block


def _ids(c):
    return f"split{c.split_k}{'-fused' if getattr(c, 'fused_reduce', False) else ''}" if isinstance(c, Cfg) else \
        f"m{c.block_m}"


def _operands(m, n, k, dtype, bias):
    x = torch.randn(m, k, dtype=torch.float64).mul(3).to(dtype)  # rms far from 1: a lost norm shows
    w = (torch.randn(n, k, dtype=torch.float64) / k**0.5).to(dtype)
    b = torch.randn(n, dtype=torch.float64).to(dtype) if bias else None
    g = (1 + 0.5 * torch.randn(k, dtype=torch.float64)).to(dtype)
    r = torch.randn(m, n, dtype=torch.float64).to(dtype)
    return x, w, b, g, r


def _exact_norm(x, g):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * g.double()


def _stock_linear(x, w, b, g, r, norm, residual):
    """What the stock layer computes in x's dtype (the bound's yardstick)."""
    xin = reference_rms_norm(x, g, EPS) if norm else x
    y = F.linear(xin.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return r + y if residual else y


@pytest.mark.parametrize("cfg", SPLITK, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("parts", ["norm", "residual", "both"])
def test_splitk_fusions_match_the_exact_formula(cfg, dtype, m, parts):
    norm, residual = parts in ("norm", "both"), parts in ("residual", "both")
    for k in (K, 64):  # a partial last block, and whole blocks (EVEN_K)
        x, w, b, g, r = _operands(m, N, k, dtype, bias=m != 3)
        out = poisoned((m, N), dtype, "cpu")
        ts.run(cfg, x, w, b, out, None, norm=(g, EPS) if norm else None, residual=r if residual else None)
        assert torch.isfinite(out).all(), "some outputs were not written"
        xin = _exact_norm(x, g) if norm else x.double()
        ref = xin @ w.double().T + (0 if b is None else b.double())
        ref = ref + r.double() if residual else ref
        bound = 2 * rel_err(_stock_linear(x, w, b, g, r, norm, residual), ref) + FLOOR[dtype]
        err = rel_err(out, ref)
        assert err <= bound, f"{parts} m={m} k={k}: rel err {err:.3g} > {bound:.3g}"
    assert_counters_zero()


@pytest.mark.parametrize("cfg", SPLITK, ids=_ids)
@pytest.mark.parametrize("m", [1, 17])
def test_splitk_scaled_residual_rounds_as_granite_does(cfg, m):
    """``residual + y * residual_scale`` (Granite's residual_multiplier): y rounded to the output
    dtype, times the scale and rounded again, then the sum, as the stock layer computes it in
    fp16."""
    x, w, b, g, r = _operands(m, N, K, torch.float16, bias=True)
    out = poisoned((m, N), torch.float16, "cpu")
    ts.run(cfg, x, w, b, out, None, norm=(g, EPS), residual=r, residual_scale=0.22)
    y = (_exact_norm(x, g) @ w.double().T + b.double()).to(torch.float16)
    want = (r.float() + (y.float() * 0.22).half().float()).half()
    # the GEMM's fp32 sum may round y to a neighbouring fp16 value: at most a few ulps apart
    torch.testing.assert_close(out.float(), want.float(), rtol=4e-3, atol=4e-3)
    plain = ts.run(cfg, x, w, b, poisoned((m, N), torch.float16, "cpu"), None, norm=(g, EPS), residual=r)
    assert rel_err(out - r, 0.22 * (plain - r).double()) < 2e-2  # the scale applies to y, not to the residual
    with pytest.raises(ValueError, match="residual_scale must be a finite number and comes with a residual"):
        ts.run(cfg, x, w, b, torch.empty(m, N, dtype=torch.float16), None, residual_scale=0.5)
    with pytest.raises(ValueError, match="residual_scale must be a finite number"):
        ts.run(cfg, x, w, b, torch.empty(m, N, dtype=torch.float16), None, residual=r, residual_scale=float("nan"))


@pytest.mark.parametrize("cfg", SPLITK, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_splitk_second_residual_rounds_as_a_parallel_layer_does(cfg, dtype, m):
    """``(y + r) + r2`` (a parallel-residual layer's ``(mlp + a) + x``): y rounded to the output
    dtype, plus r, rounded, plus r2, rounded, bit for bit against those roundings of the same
    config's plain output; r2 at the residual stream's magnitude, where adding it first would
    round differently; r and r2 rows of other strides than the output's and each other's."""
    x, w, b, g, _ = _operands(m, N, K, dtype, bias=m != 3)
    r = torch.randn(m, N + 16, dtype=torch.float64).to(dtype)[:, 3:3 + N]
    r2 = (torch.randn(m, N + 48, dtype=torch.float64) * 300).to(dtype)[:, 8:8 + N]
    out = poisoned((m, N), dtype, "cpu")
    ts.run(cfg, x, w, b, out, None, norm=(g, EPS), residual=r, residual2=r2)
    y = ts.run(cfg, x, w, b, poisoned((m, N), dtype, "cpu"), None, norm=(g, EPS))
    want = ((y.float() + r.float()).to(dtype).float() + r2.float()).to(dtype)
    assert torch.equal(out, want)
    small_first = (y.float() + (r.float() + r2.float()).to(dtype).float()).to(dtype)
    assert dtype == torch.float32 or m == 1 or not torch.equal(out, small_first)  # (the order shows)
    assert_counters_zero()


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("split", [1, 2])
def test_splitk_second_residual_with_fp8_weights(granularity, split):
    """The same roundings over an e4m3 weight (its scales applied before the residuals)."""
    torch.manual_seed(split)
    k = 384
    cfg = Cfg(16, 32, 64, split_k=split, num_warps=4, num_stages=2, fused_reduce=split > 1)
    q = quantize_fp8(torch.randn(N, k).half(), granularity)
    x, b = torch.randn(5, k).half(), torch.randn(N).half()
    r, r2 = torch.randn(5, N).half(), (torch.randn(5, N) * 300).half()
    out = ts.run(cfg, x, q.data, b, poisoned((5, N), torch.float16, "cpu"), None, weight_scale=q.scale,
                 residual=r, residual2=r2)
    y = ts.run(cfg, x, q.data, b, poisoned((5, N), torch.float16, "cpu"), None, weight_scale=q.scale)
    assert torch.equal(out, ((y.float() + r.float()).half().float() + r2.float()).half())


def test_splitk_second_residual_needs_a_first_and_its_shape():
    x, w, b, _, r = _operands(3, N, K, torch.float16, bias=True)
    out = torch.empty(3, N, dtype=torch.float16)
    with pytest.raises(ValueError, match="residual2 comes with a residual and no residual_scale"):
        ts.run(DIRECT, x, w, b, out, None, residual2=r)
    with pytest.raises(ValueError, match="residual2 comes with a residual and no residual_scale"):
        ts.run(DIRECT, x, w, b, out, None, residual=r, residual_scale=0.5, residual2=r)
    with pytest.raises(ValueError, match="residual2: residual must match the output"):
        ts.run(DIRECT, x, w, b, out, None, residual=r, residual2=r[:2])


def test_splitk_norm_is_deterministic_and_plain_calls_are_unchanged():
    x, w, b, g, r = _operands(5, N, K, torch.float32, bias=True)
    outs = [ts.run(FUSED3, x, w, b, torch.empty(5, N), None, norm=(g, EPS), residual=r) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    plain = ts.run(FUSED3, x, w, b, torch.empty(5, N))  # a plan of its own: no norm, no residual
    ref = x.double() @ w.double().T + b.double()
    assert rel_err(plain, ref) <= 1e-5
    assert not torch.allclose(plain, outs[0], atol=1e-2)


def test_each_eps_gets_its_own_plan():
    x, w, b, g, _ = _operands(2, N, K, torch.float32, bias=False)
    x = x / 300  # mean square ~1e-4: eps 1e-2 and 1e-6 give visibly different norms
    for eps in (1e-2, 1e-6, 1e-2):
        out = ts.run(DIRECT, x, w, b, torch.empty(2, N), None, norm=(g, eps))
        xd = x.double()
        ref = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * g.double()) @ w.double().T
        assert rel_err(out, ref) <= 1e-5, eps


@pytest.mark.parametrize("cfg", GLU, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_glu_norm_prologue_matches_the_exact_formula(cfg, dtype, m):
    i = 24
    for k in (K, 64):
        x, w, b, g, _ = _operands(m, 2 * i, k, dtype, bias=m != 1)
        out = poisoned((m, i), dtype, "cpu")
        tglu.glu(x, w, b, "silu", config=cfg, out=out, norm=(g, EPS))
        z = _exact_norm(x, g) @ w.double().T + (0 if b is None else b.double())
        ref = F.silu(z[:, :i]) * z[:, i:]
        zs = _stock_linear(x, w, b, g, None, True, False)
        stock = F.silu(zs[:, :i]) * zs[:, i:]
        bound = 2 * rel_err(stock, ref) + FLOOR[dtype]
        err = rel_err(out, ref)
        assert err <= bound, f"m={m} k={k}: rel err {err:.3g} > {bound:.3g}"


def test_glu_norm_reads_a_row_strided_input():
    x, w, _, g, _ = _operands(6, 32, 64, torch.float32, bias=False)
    wide = torch.zeros(6, 100)
    wide[:, 20:84] = x
    out = tglu.glu(wide[:, 20:84], w, None, "silu", config=GLU[0], norm=(g, EPS))
    ref = tglu.glu(x, w, None, "silu", config=GLU[0], norm=(g, EPS))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bad,err,match", [
    (lambda x, g, r: dict(norm=(g[:-1], EPS)), ValueError, "contiguous vector of 72"),
    (lambda x, g, r: dict(norm=(g.half(), EPS)), TypeError, "x's dtype"),
    (lambda x, g, r: dict(norm=(g, -1.0)), ValueError, "finite number"),
    (lambda x, g, r: dict(norm=(g, float("nan"))), ValueError, "finite number"),
    (lambda x, g, r: dict(norm=(g, True)), ValueError, "finite number"),
    (lambda x, g, r: dict(norm=g), TypeError, "a \\(weight, eps\\) pair"),
    (lambda x, g, r: dict(residual=r[:, :-1]), ValueError, "must match the output"),
    (lambda x, g, r: dict(residual=r.double()), ValueError, "must match the output"),
    (lambda x, g, r: dict(residual=r.t().contiguous().t()), ValueError, "unit column stride"),
    (lambda x, g, r: dict(residual=[1.0]), TypeError, "must be a tensor"),
])
def test_fusion_arguments_are_checked(bad, err, match):
    x, w, b, g, r = _operands(4, N, K, torch.float32, bias=True)
    out = torch.empty(4, N)
    with pytest.raises(err, match=match):
        ts.run(DIRECT, x, w, b, out, None, **bad(x, g, r))
    if "norm" in bad(x, g, r):
        with pytest.raises(err, match=match):
            tglu.glu(x, torch.cat([w, w]), None, "silu", config=GLU[0], **bad(x, g, r))


@pytest.mark.parametrize("m", [1, 17])
def test_an_fp32_norm_factor_with_fp16_x_is_applied_in_fp32(m):
    """Gemma's norm hands the prologues its ``1 + w`` in fp32 (fusion/norm.py norm_operand) with
    16-bit x: both kernels apply it (the GLU one with Gemma's tanh GELU), and a call with an
    fp16 factor of the same length gets a plan of its own in each kernel (on the GPU a plan
    fixes the pointer types it was compiled for; the interpreter reads every call's tensors as
    they are, so here the plan counts show it)."""
    x, w, b, _, _ = _operands(m, N, K, torch.float16, bias=True)
    g32 = (1 + 0.5 * torch.randn(K, generator=torch.Generator().manual_seed(m))).float()
    ref = _exact_norm(x, g32) @ w.double().T + b.double()
    for cfg in (DIRECT, FUSED3):
        ts.run(cfg, x, w, b, poisoned((m, N), torch.float16, "cpu"), None, norm=(g32.half(), EPS))
        plans = len(ts._PLANS)
        out = ts.run(cfg, x, w, b, poisoned((m, N), torch.float16, "cpu"), None, norm=(g32, EPS))
        assert len(ts._PLANS) == plans + 1 and rel_err(out, ref) <= 2e-3
    i = N // 2
    tglu.glu(x, w, b, "gelu_tanh", config=GLU[0], out=poisoned((m, i), torch.float16, "cpu"), norm=(g32.half(), EPS))
    plans = len(tglu._PLANS)
    out = tglu.glu(x, w, b, "gelu_tanh", config=GLU[0], out=poisoned((m, i), torch.float16, "cpu"), norm=(g32, EPS))
    assert len(tglu._PLANS) == plans + 1
    z = ref
    want = F.gelu(z[:, :i], approximate="tanh") * z[:, i:]
    assert rel_err(out, want) <= 3e-3


@pytest.mark.parametrize("m", [1, 3, 17])
def test_a_norm_offset_forms_the_factor_in_the_kernel_as_torch_forms_it(m):
    """``norm=(g, eps, 1.0)`` (Gemma's weight as it is) gives bit for bit what ``norm=(1 + g
    in fp32, eps)`` gives (the factor formed by torch before the call), in every split-K mode
    and in the gated kernel, with a plan of its own; both against fp64."""
    x, w, b, _, r = _operands(m, N, K, torch.float16, bias=True)
    g = (0.5 * torch.randn(K, generator=torch.Generator().manual_seed(m + 10))).half()  # Gemma's w about 0
    factor = 1.0 + g.float()
    ref = _exact_norm(x, factor) @ w.double().T + b.double()
    for cfg in SPLITK:
        formed = ts.run(cfg, x, w, b, poisoned((m, N), torch.float16, "cpu"), None, norm=(factor, EPS))
        plans = len(ts._PLANS)
        got = ts.run(cfg, x, w, b, poisoned((m, N), torch.float16, "cpu"), None, norm=(g, EPS, 1.0))
        assert len(ts._PLANS) == plans + 1
        assert torch.equal(got, formed) and rel_err(got, ref) <= 2e-3
        with_res = ts.run(cfg, x, w, b, poisoned((m, N), torch.float16, "cpu"), None, norm=(g, EPS, 1.0), residual=r)
        assert torch.equal(with_res, ts.run(cfg, x, w, b, poisoned((m, N), torch.float16, "cpu"), None,
                                            norm=(factor, EPS), residual=r))
    i = N // 2
    for cfg in GLU:
        formed = tglu.glu(x, w, b, "gelu_tanh", config=cfg, out=poisoned((m, i), torch.float16, "cpu"),
                          norm=(factor, EPS))
        got = tglu.glu(x, w, b, "gelu_tanh", config=cfg, out=poisoned((m, i), torch.float16, "cpu"),
                       norm=(g, EPS, 1.0))
        assert torch.equal(got, formed)
        assert rel_err(got, F.gelu(ref[:, :i], approximate="tanh") * ref[:, i:]) <= 3e-3


@pytest.mark.parametrize("offset", [float("nan"), float("inf"), True, "1"])
def test_a_bad_norm_offset_is_refused(offset):
    x, w, b, g, _ = _operands(2, N, K, torch.float16, bias=False)
    with pytest.raises(ValueError, match="norm offset must be a finite number"):
        ts.run(DIRECT, x, w, b, torch.empty(2, N, dtype=torch.float16), None, norm=(g, EPS, offset))
    with pytest.raises(ValueError, match="norm offset must be a finite number"):
        tglu.glu(x, torch.cat([w, w]), None, "silu", config=GLU[0], norm=(g, EPS, offset))


_COMPILE_FP32_NORM_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_glu as tg
from hybridgemm.kernels import triton_splitk as ts

fn = ts._splitk_kernel
ptr = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
       "cnt_ptr": "*i32", "nw_ptr": "*fp32", "res_ptr": "*bf16", "res2_ptr": "*bf16",
       "cos_ptr": "*bf16", "sin_ptr": "*bf16",
       "kc_ptr": "*bf16", "vc_ptr": "*bf16", "base_ptr": "*i64", "qn_ptr": "*bf16", "kn_ptr": "*bf16",
       "sc_ptr": "*fp32"}
floats = {"inv_k", "eps", "res_scale", "qk_eps"}
consts = dict(BM=16, BN=64, BK=256, MODE=2, HAS_BIAS=False, ACT=0, PREC="tf32", EVEN_K=True, NORM=True, RESIDUAL=False,
              ROPE=False, KV=False, HD=2, PDL=True, QK_NORM=False, RES_SCALED=False, WSCALE=0, WINT=False,
              QK_FACTOR=False, QK_OFFSET=0.0, NW_OFFSET=1.0, GLU=0, PREFETCH=0, ROUTE=0, ROUTE_KP=1, RENORMALIZE=False,
              FIXUP=ts.fixup_group(16, 64, 4, 2), ROT=2, QG=0, PAIRS=False, RES2=False, TWO=False, HAS_BIAS2=False)
sig = {}
for n in fn.arg_names:
    sig[n] = "constexpr" if n in consts else ptr.get(n, "fp32" if n in floats else "i32")
c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})
assert c.asm["cubin"]
# the GLU epilogue over an e4m3 [gate; up] weight (FP8 decode's gate/up): x tiles of 1 and 8 rows,
# both single-pass reductions, each weight scale, the norm prologue on and off
for bm, mode, wscale, norm in ((1, 0, 1, True), (8, 2, 1, False), (1, 2, 2, True)):
    glu = dict(consts, BM=bm, BN=32, BK=128, MODE=mode, WSCALE=wscale, WINT=True, NW_OFFSET=0.0, NORM=norm,
               GLU=tg.ACTIVATIONS["silu"])
    glu_sig = dict(sig, w_ptr="*fp8e4nv", nw_ptr="*bf16")
    c = triton.compile(ASTSource(fn=fn, signature=glu_sig, constexprs=glu), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 2, "num_stages": 3})
    assert c.asm["cubin"]
# the rotary epilogue of the LayerNorm families: GPT-NeoX's per-head [q | k | v] rows rotated over
# 32 of 128 columns (a 64-wide tile, bias, single pass), Falcon-7B's multi-query heads of 64, its
# new architecture's rows grouped per KV head (the fused reduction), Cohere's neighbouring pairs
for mode, hd, rot, qg, bn, pairs in ((0, 128, 32, 1, 64, False), (2, 64, 64, 0, 64, False), (2, 64, 64, 8, 32, False),
                                     (0, 128, 128, 0, 64, True)):
    rope = dict(consts, BN=bn, BK=128, MODE=mode, HAS_BIAS=True, NORM=False, ROPE=True, KV=True, HD=hd, ROT=rot, QG=qg,
                PAIRS=pairs, FIXUP=ts.fixup_group(16, bn, 4, 2))
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=rope), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 4})
    assert c.asm["cubin"]
fn = tg._glu_kernel
ptr = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "nw_ptr": "*fp32"}
consts = dict(BM=16, BN=64, BK=64, GROUP_M=8, HAS_BIAS=False, ACT=0, PREC="tf32", EVEN_K=True, SWAP=True, NORM=True,
              NORM_PREC="tf32", PDL=True, NW_OFFSET=1.0)
sig = {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n in ("inv_k", "eps") else "i32") for n in fn.arg_names}
c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})
assert c.asm["cubin"]
print("compiled")
"""


def test_the_prologues_with_an_fp32_norm_factor_compile_for_hopper():
    """bf16 x with an fp32 norm factor and an offset (Gemma's 1 + w), both kernels, split-K's
    GLU epilogue over e4m3 weights and its rotary epilogue over a partial rotary, weight rows
    grouped per KV head and neighbouring pairs, compiled for sm_90 by Triton's bundled ptxas (no
    GPU needed; in a process without the interpreter)."""
    from helpers import compile_offline

    compile_offline(_COMPILE_FP32_NORM_FOR_HOPPER)
