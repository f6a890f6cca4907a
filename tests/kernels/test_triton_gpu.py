"""Triton backend on a real GPU (``pytest -m gpu``): bf16/fp16/fp32, both GEMM paths (TMA and
pointer), split-K, determinism, CUDA-graph capture, misaligned operands, TF32 control.

Errors are bounded relative to F.linear's own error on the same inputs, against an fp64
reference computed on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_chain_reads_its_producer
from hybridgemm.kernels import triton_gemm as tg
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation, reference_linear
from hybridgemm.kernels.problem import Problem
from hybridgemm.kernels.triton_launch import device_facts

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 1e-3, torch.float16: 2e-4, torch.float32: 2e-6}


def operands(m, n, k, dtype, bias=True):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    return x, w, b


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def problem_of(x, w, b, act=Activation.NONE, tf32=False):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return Problem.from_tensors(x, w, b, out, Epilogue(act, b is not None), tf32)


def check(module, cfg, x, w, b, act, tf32=False):
    """NaN-poisoned output, every element written, error ≤ 2 x F.linear's + eps."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device="cuda")
    module.run(cfg, x, w, b, out, act, tf32=tf32)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "some output elements were not written"
    ref = reference_linear(x, w, b, act)
    err = rel_err(out, ref)
    bound = 2 * rel_err(apply_activation(F.linear(x, w, b), act), ref) + EPS[x.dtype]
    assert err <= bound, f"rel err {err:.3g} > {bound:.3g} with {cfg}"
    return out


def gemm_configs(prob):
    """The default (TMA, persistent on Hopper) and the first pointer-path candidate."""
    found = tg.candidates(prob)
    pointer = next(c for c in found if not c.use_tma)
    return [found[0], pointer] if found[0] != pointer else [pointer]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(Activation), ids=lambda a: a.value)
def test_gemm_dtypes_activations(dtype, act):
    x, w, b = operands(300, 520, 384, dtype)  # M, N not multiples of the tiles
    for cfg in gemm_configs(problem_of(x, w, b, act)):
        check(tg, cfg, x, w, b, act)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_no_bias(dtype):
    x, w, b = operands(257, 384, 256, dtype, bias=False)
    for cfg in gemm_configs(problem_of(x, w, b)):
        check(tg, cfg, x, w, b, Activation.GELU)


def test_gemm_tma_path_on_hopper():
    x, w, b = operands(4096, 4096, 4096, torch.bfloat16)
    cfg = tg.default_config(problem_of(x, w, b))
    if torch.cuda.get_device_capability() >= (9, 0):
        assert cfg.use_tma and cfg.persistent  # many more tiles than SMs: programs loop
    check(tg, cfg, x, w, b, Activation.NONE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(Activation), ids=lambda a: a.value)
@pytest.mark.parametrize("m", [1, 16])
def test_splitk_dtypes_activations(dtype, act, m):
    x, w, b = operands(m, 1064, 4096, dtype)
    prob = problem_of(x, w, b, act)
    direct = ts.TritonSplitKConfig(16, 64, 256 // x.element_size(), 1, 4, 4)
    for cfg in (ts.default_config(prob), direct):
        check(ts, cfg, x, w, b, act)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_splitk_70b_qkv(m):
    x, w, b = operands(m, 10240, 8192, torch.bfloat16)
    for cfg in ts.candidates(problem_of(x, w, b))[:3]:
        check(ts, cfg, x, w, b, Activation.NONE)


def test_misaligned_operands_use_pointer_path():
    m, n, k = 33, 520, 384
    buf = torch.randn(m, k + 1, device="cuda").to(torch.bfloat16)
    x = buf[:, 1:]  # 2 bytes off 16-byte alignment, row stride K + 1
    _, w, b = operands(m, n, k, torch.bfloat16)
    prob = problem_of(x, w, b)
    assert prob.align_x == 2
    cfg = tg.default_config(prob)
    assert not cfg.use_tma
    check(tg, cfg, x, w, b, Activation.RELU)
    tma_cfg = tg.default_config(problem_of(x.contiguous(), w, b))
    if tma_cfg.use_tma:
        with pytest.raises(ValueError, match="16-byte"):
            tg.run(tma_cfg, x, w, b, torch.empty(m, n, dtype=x.dtype, device="cuda"))
    xs = buf[:1, 1:]
    check(ts, ts.default_config(problem_of(xs, w, b)), xs, w, b, Activation.GELU_TANH)


@pytest.mark.parametrize("module, m", [(tg, 512), (ts, 1), (ts, 16)], ids=["gemm", "splitk1", "splitk16"])
def test_bit_identical_and_graph_replay(module, m):
    x, w, b = operands(m, 1024, 2048, torch.bfloat16)
    cfg = module.default_config(problem_of(x, w, b))
    out = torch.empty(m, 1024, dtype=x.dtype, device="cuda")
    first = module.run(cfg, x, w, b, out, "gelu").clone()
    for _ in range(3):
        assert torch.equal(module.run(cfg, x, w, b, out, "gelu"), first)
    graph_out = torch.full_like(out, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream's side, as torch advises
        module.run(cfg, x, w, b, graph_out, "gelu")
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        module.run(cfg, x, w, b, graph_out, "gelu")
    graph_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, first)
    x.copy_(torch.randn_like(x))  # the graph reads the live buffers
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, module.run(cfg, x, w, b, out, "gelu"))


def test_tf32_is_opt_in():
    x, w, b = operands(512, 512, 4096, torch.float32)
    ref = reference_linear(x, w, b)
    out = torch.empty(512, 512, device="cuda")
    cfg = tg.default_config(problem_of(x, w, b))
    tg.run(cfg, x, w, b, out)
    exact = rel_err(out, ref)
    tg.run(cfg, x, w, b, out, tf32=True)
    tf32 = rel_err(out, ref)
    assert exact < 1e-5, f"fp32 without TF32 should be exact-ish, got {exact:.3g}"
    assert tf32 < 5e-3 and tf32 > 4 * exact, (exact, tf32)


def test_device_facts():
    facts = device_facts(torch.device("cuda", torch.cuda.current_device()))
    assert facts.num_sms >= 1 and facts.smem_per_block >= 48 * 1024
    assert facts.capability == torch.cuda.get_device_capability()


# ----------------------------------------------------------------------------- split-K, one launch

FUSED = ts.TritonSplitKConfig(16, 32, 256, 4, 4, 4, fused_reduce=True)
TWO_PASS = ts.TritonSplitKConfig(16, 32, 256, 4, 4, 4)


def _counters_zero():
    from hybridgemm.kernels.triton_scratch import counters_snapshot

    torch.cuda.synchronize()
    return all(not buf.any() for buf in counters_snapshot())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 16, 37])
def test_splitk_fused_matches_two_pass(dtype, m):
    """Same partials, same order: the one-launch reduction gives the two-launch bits."""
    x, w, b = operands(m, 1064, 4096, dtype)
    bk = 512 // x.element_size()
    fused = ts.TritonSplitKConfig(16, 32, bk, 4, 4, 4, fused_reduce=True)
    two = ts.TritonSplitKConfig(16, 32, bk, 4, 4, 4)
    ref = check(ts, two, x, w, b, Activation.GELU_TANH)
    for _ in range(3):
        assert torch.equal(check(ts, fused, x, w, b, Activation.GELU_TANH), ref)
        assert _counters_zero()


@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 4096), (6144, 4096)], ids=str)
@pytest.mark.parametrize("m", [1, 16])
def test_splitk_every_candidate_runs(shape, m):
    """Every candidate the tuner will time compiles and is right (bf16, the 8b shapes)."""
    n, k = shape
    x, w, b = operands(m, n, k, torch.bfloat16)
    for cfg in ts.candidates(problem_of(x, w, b)):
        first = check(ts, cfg, x, w, b, Activation.NONE)
        assert torch.equal(check(ts, cfg, x, w, b, Activation.NONE), first), cfg
        assert _counters_zero(), cfg


@pytest.mark.parametrize("m", [1024, 256])
def test_gemm_few_tiles_candidates_run(m):
    """8b kv (N = 1024): the small-tile and split-K candidates compile, are right, repeat."""
    x, w, b = operands(m, 1024, 4096, torch.bfloat16)
    found = tg.candidates(problem_of(x, w, b))
    assert any(c.split_k > 1 for c in found)
    for cfg in found:
        first = check(tg, cfg, x, w, b, Activation.RELU)
        assert torch.equal(check(tg, cfg, x, w, b, Activation.RELU), first), cfg
        assert _counters_zero(), cfg


def _capture_and_replay(module, cfg, x, w, b, out, warm_stream: bool):
    """Capture one call on a fresh stream (optionally warmed up there first), replay it twice
    (same bits both times, counters back to 0), then with new x (the eager result)."""
    expected = module.run(cfg, x, w, b, torch.empty_like(out), "gelu").clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if warm_stream:
        with torch.cuda.stream(stream):
            module.run(cfg, x, w, b, out, "gelu")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        module.run(cfg, x, w, b, out, "gelu")
    for _ in range(2):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert _counters_zero()
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, module.run(cfg, x, w, b, torch.empty_like(out), "gelu"))
    return g


@pytest.mark.parametrize("warm_stream", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("m", [1, 16])
def test_splitk_fused_graph_replay(m, warm_stream):
    x, w, b = operands(m, 1024, 4096, torch.bfloat16)
    out = torch.empty(m, 1024, dtype=x.dtype, device="cuda")
    g = _capture_and_replay(ts, FUSED, x, w, b, out, warm_stream)
    # an eager call on the capturing stream's neighbour and another replay still agree
    again = ts.run(FUSED, x, w, b, torch.empty_like(out), "gelu")
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, again)


@pytest.mark.parametrize("warm_stream", [True, False], ids=["warm", "cold"])
def test_gemm_split_graph_replay(warm_stream):
    x, w, b = operands(1024, 1024, 4096, torch.bfloat16)
    out = torch.empty(1024, 1024, dtype=x.dtype, device="cuda")
    cfg = next(c for c in tg.candidates(problem_of(x, w, b)) if c.split_k > 1)
    _capture_and_replay(tg, cfg, x, w, b, out, warm_stream)


def test_fast_launch_defers_to_triton_when_a_launch_hook_is_set():
    """The direct launcher skips Triton's runner only while no launch hook is installed; a
    profiler's hook (proton, a user's) must still see every launch, and results stay right."""
    from triton import knobs

    x, w, b = operands(16, 320, 448, torch.bfloat16)
    cfg = ts.default_config(problem_of(x, w, b))
    out = torch.full((16, 320), float("nan"), device="cuda", dtype=torch.bfloat16)
    ts.run(cfg, x, w, b, out)  # compiles and sets up the fast path
    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out.fill_(float("nan"))
        ts.run(cfg, x, w, b, out)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) >= 1
    ref = reference_linear(x, w, b)
    assert rel_err(out, ref) < 2e-2
    seen.clear()
    ts.run(cfg, x, w, b, out)  # hook removed: the direct path again, and no calls
    torch.cuda.synchronize()
    assert seen == []


@pytest.mark.parametrize("fused", [False, True])
def test_splitk_pdl_chain_reads_its_producer(fused):
    """Programmatic dependent launch: each split-K grid may start while the previous kernel
    finishes, so a chain of calls each reading the last one's output (and sharing the stream's
    split-K scratch) is where an early read would show. Eager and graph-replayed, against the
    same chain computed by torch in fp32 with the same bf16 roundings."""
    facts = device_facts(torch.device("cuda"))
    assert ts.pdl_enabled(facts.capability) == (facts.capability >= (9, 0))
    torch.manual_seed(0)
    width, depth = 384, 6
    ws = [(torch.randn(width, width, device="cuda") / width**0.5).to(torch.bfloat16) for _ in range(depth)]
    bs = [torch.randn(width, device="cuda").to(torch.bfloat16) for _ in range(depth)]
    cfgs = [ts.TritonSplitKConfig(16, 64, 64, 3, 4, 3, fused), ts.TritonSplitKConfig(16, 32, 128, 1, 4, 3)]
    x0 = torch.randn(4, width, device="cuda").to(torch.bfloat16)
    outs = [torch.empty(4, width, device="cuda", dtype=torch.bfloat16) for _ in range(depth)]

    def chain(x):
        for i in range(depth):
            ts.run(cfgs[i % 2], x if i == 0 else outs[i - 1], ws[i], bs[i], outs[i], "relu")
            if i == 2:
                outs[i].mul_(0.5)  # a torch kernel in between, writing what the next grid reads
        return outs[-1]

    def reference(x):
        for i in range(depth):
            x = torch.relu(F.linear(x.float(), ws[i].float(), bs[i].float())).to(torch.bfloat16)
            if i == 2:
                x = x * 0.5
        return x

    assert_chain_reads_its_producer(chain, reference, x0, outs[-1])


@pytest.mark.parametrize("k", [512, 300], ids=["aligned-rows", "rows-off-16-bytes"])
def test_weight_prefetch_before_the_pdl_wait_changes_no_bit(k, monkeypatch):
    """``HYBRIDGEMM_PDL_PREFETCH=1`` (kernels/triton_prefetch.py): split-K (bf16 and e4m3, each
    reduction) and the gated kernel take the prefetch where every row starts on 16 bytes (Hopper:
    with PDL), and give the bits they give without it, eagerly and in a replayed CUDA graph;
    rows of 600 bytes run without it."""
    from hybridgemm.kernels import triton_glu as tglu
    from hybridgemm.kernels import triton_launch
    from hybridgemm.kernels.fp8 import quantize_fp8

    facts = device_facts(torch.device("cuda"))
    torch.manual_seed(k)
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(320, k, device="cuda") / k**0.5).to(torch.bfloat16)
    q = quantize_fp8(w, "channel")
    cfgs = [ts.TritonSplitKConfig(16, 64, 64, 1, 4, 3), ts.TritonSplitKConfig(16, 32, 64, 2, 4, 3),
            ts.TritonSplitKConfig(16, 32, 64, 2, 4, 3, fused_reduce=True)]

    def outputs():
        ys = [ts.run(c, x, w, None, torch.empty(3, 320, device="cuda", dtype=torch.bfloat16)) for c in cfgs]
        ys += [ts.run(c, x, q.data, None, torch.empty(3, 160, device="cuda", dtype=torch.bfloat16),
                      weight_scale=q.scale, glu="silu") for c in (cfgs[0], cfgs[2])]
        ys.append(tglu.run(tglu.TritonGluConfig(16, 32, 64, 4, 3), x, w, None,
                           torch.empty(3, 160, device="cuda", dtype=torch.bfloat16), "silu"))
        return ys

    def prefetching():
        plans = list(ts._PLANS.values()) + list(tglu._PLANS.values())
        return [p.launch.meta["PREFETCH"] for p in plans if not p.empty]

    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("HYBRIDGEMM_PDL_PREFETCH", flag)
        ts._PLANS.clear()
        tglu._PLANS.clear()
        eager = outputs()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graphed = outputs()
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
        takes = flag == "1" and k == 512 and triton_launch.pdl_enabled(facts.capability)
        assert all((n > 0) == takes for n in prefetching()), prefetching()
        results[flag] = eager
    assert all(torch.equal(a, b) for a, b in zip(results["0"], results["1"]))
    ts._PLANS.clear()
    tglu._PLANS.clear()
