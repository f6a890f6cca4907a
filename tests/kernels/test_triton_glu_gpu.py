"""Triton gated-MLP projection (kernels/triton_glu.py) on a real GPU (``pytest -m gpu``): every
candidate config compiles and is right in bf16/fp16/fp32 at Llama-3-8B's MLP shape (I = 14336,
K = 4096) and at an odd shape, repeated calls are bit-identical, CUDA-graph replay equals
eager, TF32 only when torch allows it.

References are fp64 on the GPU from the same (rounded) inputs; the bound is elementwise,
|out - ref| <= RTOL |ref| + ATOL, with RTOL about twice the output dtype's rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_chain_reads_its_producer
from hybridgemm.kernels import triton_glu as tglu

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# bf16 rounds the output to 2**-9 relative (8-bit significand), fp16 to 2**-12; the fp32 sums
# of K = 4096 products stay near 1e-6 of their magnitude (O(1) here), which ATOL covers.
TOL = {torch.bfloat16: (8e-3, 2e-3), torch.float16: (2e-3, 5e-4), torch.float32: (1e-4, 1e-4)}
LLAMA3_8B = (14336, 4096)  # I, K: w is (28672, 4096), 235 MB in bf16
ODD = (1000, 520)  # I, K: not a multiple of any block
REF_ACT = {"silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "gelu": F.gelu}


def operands(m, i, k, dtype, bias=True):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(2 * i, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(2 * i, device="cuda").to(dtype) if bias else None
    return x, w, b


def reference(x, w, b, act):
    i = w.shape[0] // 2
    z = x.double() @ w.double().T
    if b is not None:
        z += b.double()
    return REF_ACT[act](z[:, :i]) * z[:, i:]


def assert_close(out, ref, dtype, what=""):
    assert torch.isfinite(out).all(), f"{what}: some output elements were not written"
    rtol, atol = TOL[dtype]
    ratio = ((out.double() - ref).abs() / (rtol * ref.abs() + atol)).max().item()
    assert ratio <= 1, f"{what}: error {ratio:.3g} x the bound"


def run_poisoned(cfg, x, w, b, act):
    out = torch.full((x.shape[0], w.shape[0] // 2), float("nan"), dtype=x.dtype, device="cuda")
    assert tglu.glu(x, w, b, act, config=cfg, out=out) is out
    torch.cuda.synchronize()
    return out


def check_every_candidate(m, i, k, dtype, bias, act):
    x, w, b = operands(m, i, k, dtype, bias)
    ref = reference(x, w, b, act)
    found = tglu.candidates(m, i, k, dtype)
    assert found
    for cfg in found:
        first = run_poisoned(cfg, x, w, b, act)
        assert_close(first, ref, dtype, f"{cfg} m={m}")
        assert torch.equal(run_poisoned(cfg, x, w, b, act), first), f"{cfg}: not bit-identical"


@pytest.mark.parametrize("m", [1, 8, 333])
def test_llama3_8b_every_candidate(m, no_tf32):
    """SwiGLU as Llama-3-8B runs it: bf16, no bias, every config the tuner will time."""
    check_every_candidate(m, *LLAMA3_8B, torch.bfloat16, False, "silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 333])
def test_odd_shape_every_candidate(dtype, m, no_tf32):
    check_every_candidate(m, *ODD, dtype, True, "gelu_tanh")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(REF_ACT))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("m", [5, 300])
def test_default_config_acts(dtype, act, bias, m, no_tf32):
    x, w, b = operands(m, *ODD, dtype, bias)
    assert_close(run_poisoned(None, x, w, b, act), reference(x, w, b, act), dtype, f"{act} m={m}")


def test_leading_dims_and_strided_x(no_tf32):
    i, k = ODD
    _, w, b = operands(1, i, k, torch.bfloat16)
    buf = torch.randn(2, 3, k + 8, device="cuda").to(torch.bfloat16)
    x = buf[..., 1:1 + k]  # misaligned, padded rows: read in place
    out = tglu.glu(x, w, b, "gelu")
    assert out.shape == (2, 3, i)
    assert_close(out.reshape(6, i), reference(x.reshape(6, k), w, b, "gelu"), torch.bfloat16)


@pytest.mark.parametrize("m", [1, 333])
def test_graph_replay_equals_eager(m):
    x, w, b = operands(m, *LLAMA3_8B, torch.bfloat16, bias=False)
    out = torch.empty(m, LLAMA3_8B[0], dtype=x.dtype, device="cuda")
    eager = tglu.glu(x, w, b, "silu")  # compiles and builds the plan the capture reuses
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tglu.glu(x, w, b, "silu", out=out)

    def replayed():
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        return out

    assert torch.equal(replayed(), eager)
    assert torch.equal(replayed(), eager)
    x.copy_(torch.randn_like(x))  # the graph reads the live buffers
    assert torch.equal(replayed(), tglu.glu(x, w, b, "silu"))


def test_tf32_is_opt_in():
    i, k = 1024, 4096
    x, w, b = operands(64, i, k, torch.float32)
    ref = reference(x, w, b, "silu")
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        exact = tglu.glu(x, w, b).double()
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = tglu.glu(x, w, b).double()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    err_exact = ((exact - ref).norm() / ref.norm()).item()
    err_tf32 = ((tf32 - ref).norm() / ref.norm()).item()
    assert err_exact < 1e-5, f"fp32 without TF32 should be exact-ish, got {err_exact:.3g}"
    assert 4 * err_exact < err_tf32 < 5e-3, (err_exact, err_tf32)


def test_pdl_chain_reads_its_producer():
    """Programmatic dependent launch: each gated grid may start while the previous kernel
    finishes, so a chain of calls each reading the last one's output (with a torch kernel in
    between writing what the next grid reads) is where an early read would show. Eager and
    graph-replayed, against the same chain in fp32 with the same bf16 roundings; a grid that
    read stale or half-written input would be off by O(1) in relative error."""
    from hybridgemm.kernels import triton_launch

    facts = triton_launch.device_facts(torch.device("cuda"))
    assert triton_launch.pdl_enabled(facts.capability) == (facts.capability >= (9, 0))
    torch.manual_seed(0)
    width, depth = 384, 6  # I = K: each output feeds the next call
    # 0.5 / sqrt(K) weights keep the gated product's RMS near 1 over the chain (it is quadratic
    # in its input: with 1 / sqrt(K) the values grow past bf16's range within six calls)
    ws = [(0.5 * torch.randn(2 * width, width, device="cuda") / width**0.5).to(torch.bfloat16) for _ in range(depth)]
    bs = [torch.randn(2 * width, device="cuda").to(torch.bfloat16) for _ in range(depth)]
    cfgs = [tglu.default_config(4, width, width, torch.bfloat16), tglu.TritonGluConfig(16, 64, 128, 4, 3)]
    x0 = torch.randn(4, width, device="cuda").to(torch.bfloat16)
    outs = [torch.empty(4, width, device="cuda", dtype=torch.bfloat16) for _ in range(depth)]

    def chain(x):
        for i in range(depth):
            tglu.run(cfgs[i % 2], x if i == 0 else outs[i - 1], ws[i], bs[i], outs[i], "silu")
            if i == 2:
                outs[i].mul_(2.0)  # a torch kernel in between, writing what the next grid reads
        return outs[-1]

    def expected(x):
        for i in range(depth):
            z = F.linear(x.float(), ws[i].float(), bs[i].float())
            x = (F.silu(z[:, :width]) * z[:, width:]).to(torch.bfloat16)
            if i == 2:
                x = x * 2.0
        return x

    assert 0.1 < expected(x0).float().pow(2).mean().sqrt() < 10  # the chain keeps a signal to compare
    assert_chain_reads_its_producer(chain, expected, x0, outs[-1])
