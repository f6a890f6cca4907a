"""The routing kernel (kernels/triton_router.py) against an fp64 reference: softmax, the k
largest with the lowest expert first among equal values, renormalised or not, weights in
fp32/fp16/bf16; T = 1, 3, 17, 333, expert counts that are not powers of two, strided rows, ties
(all logits equal, ties at the k-th place), NaN logits, the refusals; on the GPU also against
``torch.topk`` (the experts it selects, ties included) and the sm_90 build."""

from __future__ import annotations

import pytest
import torch

from hybridgemm.kernels import triton_router as tr
from hybridgemm.kernels.triton_launch import interpreting

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICES = [pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET=1")),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _logits(t, e, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * scale).to(dtype).to(device)


def _reference(logits, k, renormalize):
    """fp64: softmax of the logits' values, a stable descending sort (the lowest expert first
    among equal probabilities), the first k, renormalised."""
    p = torch.softmax(logits.double().cpu(), dim=-1)
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]
    w = p.gather(1, order)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return order, w


def _margin_ok(logits, k):
    """Rows whose k-th and (k+1)-th probabilities are apart by more than rounding (where any
    correct fp32 softmax selects the same experts)."""
    p = torch.softmax(logits.double().cpu(), dim=-1)
    top = torch.topk(p, min(k + 1, p.shape[1]), dim=-1).values
    if k == p.shape[1]:
        return torch.ones(p.shape[0], dtype=torch.bool)
    return (top[:, k - 1] - top[:, k]) > 1e-6 * top[:, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (3, 60, 4), (17, 128, 8), (333, 6, 3), (5, 1000, 10), (2, 5, 5),
                                   (4, 1, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("logits_dtype,weights_dtype", [(torch.float32, torch.float32),
                                                        (torch.float16, torch.float16),
                                                        (torch.bfloat16, torch.float32),
                                                        (torch.bfloat16, torch.bfloat16)])
def test_the_kernel_matches_fp64(device, t, e, k, renormalize, logits_dtype, weights_dtype):
    logits = _logits(t, e, logits_dtype, device, seed=t * 1000 + e)
    ids, weights = tr.route(logits, k, renormalize, weights_dtype)
    assert ids.dtype == torch.int64 and weights.dtype == weights_dtype
    assert ids.shape == weights.shape == (t, k) and ids.device == logits.device
    want_ids, want = _reference(logits, k, renormalize)
    ok = _margin_ok(logits, k)
    assert ok.float().mean() > 0.9  # the comparison covers most rows
    assert torch.equal(ids.cpu()[ok], want_ids[ok])
    # the weights' rounding, and fp32's in the exponent (|logit - max| up to ~20 ulps here)
    rtol = 4 * torch.finfo(weights_dtype).eps + 32 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(weights.cpu().double()[ok], want[ok], rtol=rtol, atol=1e-30)
    assert ((ids >= 0) & (ids < e)).all()
    assert all(len(set(row)) == k for row in ids.tolist())  # k different experts per token


@pytest.mark.parametrize("device", DEVICES)
def test_ties_take_the_lowest_experts_first(device):
    e, k = 12, 4
    logits = torch.zeros(4, e)
    logits[1] = torch.tensor([0., 1, 1, 0, 2, 1, 1, 0, 0, 1, 0, 0])  # three of five 1s reach the top 4
    logits[2, 7] = logits[2, 3] = 5.0  # two equal maxima, the rest equal
    logits[3] = -torch.arange(e, dtype=torch.float32)  # strictly ordered: experts 0..3
    ids, weights = tr.route(logits.to(device), k, renormalize=False)
    assert ids.tolist() == [[0, 1, 2, 3], [4, 1, 2, 5], [3, 7, 0, 1], [0, 1, 2, 3]]
    assert torch.equal(weights[0].cpu(), torch.full((k,), 1 / e))  # 1/12 in fp32, as softmax gives it


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_empty_input(device):
    wide = _logits(7, 40, torch.float32, device, seed=3)
    logits = wide[:, 5:29]  # rows 40 apart, experts contiguous
    ids, weights = tr.route(logits, 3)
    want_ids, want_w = tr.route(logits.contiguous(), 3)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    ids, weights = tr.route(logits[:0], 3)
    assert ids.shape == weights.shape == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's -inf - -inf
def test_nan_logits_give_nan_weights_and_experts_in_range(device):
    logits = _logits(3, 16, torch.float32, device, seed=4)
    logits[1, 5] = float("nan")
    logits[2] = float("-inf")
    ids, weights = tr.route(logits, 4)
    assert ((ids >= 0) & (ids < 16)).all()
    assert torch.isnan(weights[1]).all() and torch.isnan(weights[2]).all()
    assert torch.isfinite(weights[0]).all()


@pytest.mark.parametrize("change,match", [
    (lambda z: z[0], "must be \\[tokens, experts\\]"),
    (lambda z: torch.zeros(2, tr.MAX_EXPERTS + 1), "experts: the routing kernel holds"),
    (lambda z: z.to(torch.int32), "the kernel reads fp32, bf16 or fp16"),
    (lambda z: z.t(), "contiguous along the experts"),
])
def test_bad_operands_are_refused(change, match):
    logits = torch.randn(6, 6)
    with pytest.raises(ValueError, match=match):
        tr.route(change(logits), 2)
    with pytest.raises(ValueError, match="top_k 7 is not in 1..6"):
        tr.route(logits, 7)
    with pytest.raises(ValueError, match="top_k 33 is not in 1..32"):
        tr.route(torch.randn(2, 64), 33)
    with pytest.raises(ValueError, match="routing weights of torch.int64"):
        tr.route(logits, 2, weights_dtype=torch.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (128, 8)])
def test_the_experts_are_those_torch_topk_selects_on_cuda(e, k):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = _logits(4000, e, torch.bfloat16, "cuda", seed=e)  # bf16 logits: many exact ties in softmax
    logits[::7] = 0  # rows of all-equal logits
    logits[1::7, : e // 2] = logits[1::7, e // 2 - 1: e // 2]  # a run of equal maxima
    ids, weights = tr.route(logits, k)
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    same = torch.sort(ids, dim=-1).values == torch.sort(idx, dim=-1).values
    assert same.all(dim=-1).float().mean() > 0.999, "the selected experts differ from torch.topk's"
    tied = (probs == probs.gather(1, idx[:, -1:])).sum(dim=-1) > 1  # rows with ties at the k-th value
    assert tied.sum() >= 4000 // 7 and same[tied].all()
    torch.testing.assert_close(weights, top / top.sum(dim=-1, keepdim=True), rtol=2e-6, atol=0)


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_router as tr

fn = tr._route_kernel
sig = dict(zip(fn.arg_names, ["*bf16", "*i64", "*bf16", "i32", "i32"]))
for e, k in ((128, 8), (8, 2), (1000, 10)):
    consts = dict(TOP_K=k, EP=triton.next_power_of_2(e), KP=triton.next_power_of_2(k), RENORMALIZE=True, PDL=True)
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    try:
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if e > 256 else 1})
    except (TypeError, KeyError, AttributeError) as exc:
        raise SystemExit(f"API: {type(exc).__name__}: {exc}")
    assert c.asm["cubin"], e
# the routing in split-K's epilogue, in each fused router's config: bf16 x and weight, bf16 logits
from hybridgemm.kernels import triton_splitk as ts
fn = ts._splitk_kernel
ptr = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
       "cnt_ptr": "*i32", "ids_ptr": "*i64", "rw_ptr": "*fp32"}
for m, e, hidden, k in ((1, 128, 2048, 8), (8, 8, 4096, 2), (16, 60, 2048, 4)):
    cfg = ts.route_config(m, e, hidden, 2)
    consts = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, MODE=2 if cfg.fused_reduce else 0, HAS_BIAS=False,
                  ACT=0, PREC="tf32", EVEN_K=True, NORM=False, RESIDUAL=False, ROPE=False, KV=False, HD=2, PDL=True,
                  QK_NORM=False, RES_SCALED=False, WSCALE=0, WINT=False, QK_FACTOR=False, QK_OFFSET=0.0,
                  NW_OFFSET=0.0, GLU=0, PREFETCH=0, ROUTE=k, ROUTE_KP=triton.next_power_of_2(k), RENORMALIZE=True,
                  FIXUP=ts.fixup_group(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.split_k), ROT=2, QG=0, PAIRS=False,
                  RES2=False, TWO=False, HAS_BIAS2=False)
    floats = ("inv_k", "eps", "res_scale", "qk_eps")
    sig = {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert c.asm["cubin"], (m, e)
print("compiled")
"""


def test_the_kernel_compiles_for_hopper():
    """Built for sm_90 by Triton's ptxas (no GPU needed), with PDL: Qwen3-30B-A3B's 128 experts
    top-8, Mixtral's 8 top-2, 1000 experts top-10; and split-K with the routing in its epilogue
    at Qwen3-30B-A3B's, Mixtral's and Qwen2-MoE's router shapes."""
    from helpers import compile_offline

    compile_offline(_COMPILE_FOR_HOPPER)


# ----------------------------------------------------------------------------- in split-K's epilogue

def _fused_route(x, w, k, renormalize, weights_dtype, config=None):
    from hybridgemm.kernels import triton_splitk as ts

    m, e = x.shape[0], w.shape[0]
    config = config or ts.route_config(m, e, x.shape[1], x.element_size())
    logits = torch.full((m, e), float("nan"), dtype=x.dtype, device=x.device)  # poisoned outputs
    ids = torch.full((m, k), -7, dtype=torch.int64, device=x.device)
    weights = torch.full((m, k), float("nan"), dtype=weights_dtype, device=x.device)
    ts.run(config, x, w, None, logits, None, route=(ids, weights, renormalize))
    return logits, ids, weights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,e,hidden,k", [(1, 128, 256, 8), (3, 60, 200, 4), (17, 8, 512, 2), (2, 5, 96, 5)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_router_gemm_routes_in_its_epilogue(device, m, e, hidden, k, renormalize):
    """``triton_splitk.run(route=)``: the logits as the GEMM alone gives them (fp64 product,
    rounded once), and the routing of those rounded logits as the routing kernel gives it."""
    g = torch.Generator().manual_seed(m * 100 + e)
    dt = torch.float16
    x = torch.randn(m, hidden, generator=g).to(dt).to(device)
    w = (torch.randn(e, hidden, generator=g) * 3 / hidden ** 0.5).to(dt).to(device)
    logits, ids, weights = _fused_route(x, w, k, renormalize, torch.float32)
    want_logits = (x.double() @ w.double().T).to(dt)
    torch.testing.assert_close(logits, want_logits, rtol=1e-3, atol=1e-3)
    want_ids, want = tr.route(logits, k, renormalize, torch.float32)  # the routing of what was stored
    ok = _margin_ok(logits, k)
    assert ok.float().mean() > 0.6
    assert torch.equal(ids[ok], want_ids[ok])
    torch.testing.assert_close(weights[ok], want[ok], rtol=8 * torch.finfo(torch.float32).eps, atol=1e-30)
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_routing_resolves_ties_and_splits_as_the_kernel(device):
    """Equal rows of the router's weight give equal logits: the lowest expert first, as the
    routing kernel takes them, with one pass and with the fused reduction; 16-bit weights are the
    fp32 ones rounded."""
    from hybridgemm.kernels import triton_splitk as ts

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(12, 128, generator=g) / 8).half()
    w[7] = w[3]
    w[9] = w[3]  # three equal experts
    x = torch.randn(4, 128, generator=g).half()
    x[1] = (w[3].float() * 40).half()  # token 1 prefers the tied experts
    x, w = x.to(device), w.to(device)
    runs = [_fused_route(x, w, 4, True, torch.float32, c) for c in
            (ts.TritonSplitKConfig(16, 16, 32, 1, 4, 2), ts.TritonSplitKConfig(16, 16, 32, 4, 4, 2, fused_reduce=True))]
    for logits, ids, weights in runs:
        want_ids, want = tr.route(logits, 4, True, torch.float32)
        assert torch.equal(ids, want_ids)
        # sums over a [experts, tokens] tile, not one token's row: the last bit may differ
        torch.testing.assert_close(weights, want, rtol=8 * torch.finfo(torch.float32).eps, atol=1e-30)
        assert ids[1, :3].tolist() == [3, 7, 9]
    # one pass and four splits add in another order (on a GPU): the logits agree to their rounding
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-3, atol=1e-3)
    half = torch.bfloat16 if device == "cuda" else torch.float16  # (the interpreter rounds bf16 casts otherwise)
    _, ids16, weights16 = _fused_route(x, w, 4, True, half, ts.TritonSplitKConfig(16, 16, 32, 1, 4, 2))
    assert torch.equal(ids16, runs[0][1]) and torch.equal(weights16, runs[0][2].to(half))


def test_what_the_fused_routing_refuses():
    from hybridgemm.kernels import triton_splitk as ts

    x, w = torch.randn(2, 64).half(), torch.randn(40, 64).half()
    out = torch.empty(2, 40, dtype=torch.float16)
    ids, weights = torch.empty(2, 4, dtype=torch.int64), torch.empty(2, 4)
    one_tile = ts.TritonSplitKConfig(16, 64, 32, 1, 4, 2)
    with pytest.raises(ValueError, match="all 40 experts in one tile"):
        ts.run(ts.TritonSplitKConfig(16, 32, 32, 1, 4, 2), x, w, None, out, None, route=(ids, weights, True))
    with pytest.raises(ValueError, match="fused reduction"):
        ts.run(ts.TritonSplitKConfig(16, 64, 32, 2, 4, 2), x, w, None, out, None, route=(ids, weights, True))
    with pytest.raises(ValueError, match="no residual"):
        ts.run(one_tile, x, w, None, out, "relu", route=(ids, weights, True))
    with pytest.raises(ValueError, match=r"k in 1\.\.32"):
        ts.run(one_tile, x, w, None, out, None, route=(torch.empty(2, 33, dtype=torch.int64), torch.empty(2, 33), True))
    with pytest.raises(TypeError, match="int64"):
        ts.run(one_tile, x, w, None, out, None, route=(ids.int(), weights, True))
    with pytest.raises(TypeError, match="ids, weights, renormalize"):
        ts.run(one_tile, x, w, None, out, None, route=(ids, weights))
    assert ts.route_config(1, 257, 2048, 2) is None and ts.route_config(65, 128, 2048, 2) is None
    cfg = ts.route_config(1, 128, 2048, 2)
    assert cfg.block_n == 128 and cfg.fused_reduce and cfg.split_k == 16


def test_a_plan_serves_one_weights_dtype_and_alignment():
    """The routing's outputs are not among the operands a plan is keyed by: their dtype and
    16-byte alignment are in its fusion key, so a launch never reuses a kernel compiled for
    another (on a GPU a plan's launch reuses its compiled kernel unchecked)."""
    from hybridgemm.kernels import triton_splitk as ts

    x, w = torch.randn(2, 64).half(), torch.randn(24, 64).half()
    cfg = ts.TritonSplitKConfig(16, 32, 32, 1, 4, 2)
    ts._PLANS.clear()
    ids = torch.empty(2, 3, dtype=torch.int64)
    for weights in (torch.empty(2, 3), torch.empty(2, 3, dtype=torch.float16), torch.empty(7)[1:7].view(2, 3)):
        ts.run(cfg, x, w, None, torch.empty(2, 24, dtype=torch.float16), None, route=(ids, weights, True))
    assert len(ts._PLANS) == 3
    ts._PLANS.clear()
