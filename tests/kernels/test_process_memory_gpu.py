"""Scratch memory of calls from compiled regions (``pytest -m gpu``, kernels/process_memory.py).

Inside ``per_call_scratch`` (what the ``hybridgemm::`` custom ops run under), split-K and
cuBLASLt calls must cache no workspace or counters: under torch.compile's CUDA graph trees a
cached buffer made during warm-up or capture is a pool tensor kept alive, which graph trees
refuse. Here such calls are captured into a CUDA graph: the caches must not grow, and the graph
must replay to the eager call's bits.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_counters_zero, make_operands
from hybridgemm.kernels import cublaslt_runtime, triton_scratch
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.epilogue import Activation
from hybridgemm.kernels.process_memory import per_call_scratch

pytestmark = pytest.mark.gpu


def _cached() -> set:
    return ({id(t) for t in triton_scratch._WORKSPACES.values()} | {id(t) for t, _ in triton_scratch._COUNTERS.values()}
            | {id(t) for t in cublaslt_runtime.workspaces.values()})


def _capture(fn) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # its own capture stream: a stream no cached scratch belongs to
        fn()
    return graph


def test_splitk_per_call_scratch_is_not_cached_and_replays_bitwise():
    x, w, b = make_operands(3, 1064, 8192, torch.bfloat16, "cuda")
    cfg = ts.TritonSplitKConfig(16, 32, 128, 8, 4, 3, fused_reduce=True)
    eager = torch.full((3, 1064), float("nan"), dtype=x.dtype, device="cuda")
    ts.run(cfg, x, w, b, eager, Activation.GELU_TANH)  # compiles the kernel
    before = _cached()
    out = torch.full_like(eager, float("nan"))
    with per_call_scratch():
        graph = _capture(lambda: ts.run(cfg, x, w, b, out, Activation.GELU_TANH))
    assert _cached() == before, "a call under per_call_scratch cached split-K scratch"
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert_counters_zero()


def test_cublaslt_per_call_workspace_is_not_cached_and_replays_bitwise():
    lt = pytest.importorskip("hybridgemm.kernels.cublaslt")
    if not lt.is_available():
        pytest.skip("nvmath-python's cuBLASLt bindings are not installed")
    x, w, b = make_operands(17, 1000, 960, torch.bfloat16, "cuda")
    eager = lt.linear(x, w, b, "relu")
    before = _cached()
    out = torch.full_like(eager, float("nan"))
    with per_call_scratch():
        graph = _capture(lambda: lt.linear(x, w, b, "relu", out=out))
    assert _cached() == before, "a call under per_call_scratch cached a cuBLASLt workspace"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
