"""Process-wide device buffers stay out of CUDA-graph memory pools (``pytest -m gpu``).

torch.compile's CUDA graph trees refuse a recording that leaves a tensor of their private pool
alive. The cuBLASLt workspaces and the split-K scratch live for the process and are first made
wherever the first call runs, which under graph trees is inside their pool's warm-up or capture.
Here they are first made during a capture into a private pool; each must land in the ordinary
pool, and the captured graph must replay to the eager call's bits.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_counters_zero, make_operands
from hybridgemm.kernels import cublaslt_runtime, triton_common
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.epilogue import Activation

pytestmark = pytest.mark.gpu


def _pool_id(ptr: int) -> tuple:
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg.get("segment_pool_id", (0, 0)))
    raise AssertionError(f"address {ptr:#x} is in no segment of torch's allocator")


def _capture(fn) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        fn()
    return graph


def test_splitk_scratch_first_made_during_capture_is_outside_the_graph_pool():
    x, w, b = make_operands(3, 1064, 8192, torch.bfloat16, "cuda")
    cfg = ts.TritonSplitKConfig(16, 32, 128, 8, 4, 3, fused_reduce=True)
    eager = torch.full((3, 1064), float("nan"), dtype=x.dtype, device="cuda")
    ts.run(cfg, x, w, b, eager, Activation.GELU_TANH)  # compiles the kernel; scratch of this stream
    before = {id(t) for t in triton_common._WORKSPACES.values()} | {id(t) for t, _ in triton_common._COUNTERS.values()}
    out = torch.full_like(eager, float("nan"))
    graph = _capture(lambda: ts.run(cfg, x, w, b, out, Activation.GELU_TANH))  # the capture stream's own
    made = [t for t in triton_common._WORKSPACES.values() if id(t) not in before]
    made += [t for t, _ in triton_common._COUNTERS.values() if id(t) not in before]
    assert len(made) == 2, "the capture did not make its own workspace and counters"
    for buf in made:
        assert _pool_id(buf.data_ptr()) == (0, 0), "split-K scratch was allocated in the graph's pool"
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert_counters_zero()


def test_cublaslt_workspace_first_made_during_capture_is_outside_the_graph_pool():
    lt = pytest.importorskip("hybridgemm.kernels.cublaslt")
    if not lt.is_available():
        pytest.skip("nvmath-python's cuBLASLt bindings are not installed")
    x, w, b = make_operands(17, 1000, 960, torch.bfloat16, "cuda")
    eager = lt.linear(x, w, b, "relu")
    before = set(cublaslt_runtime.workspaces)
    out = torch.full_like(eager, float("nan"))
    graph = _capture(lambda: lt.linear(x, w, b, "relu", out=out))
    made = [cublaslt_runtime.workspaces[k] for k in set(cublaslt_runtime.workspaces) - before]
    assert made, "the capture did not make its own workspace"
    for buf in made:
        assert _pool_id(buf.data_ptr()) == (0, 0), "the cuBLASLt workspace was allocated in the graph's pool"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
