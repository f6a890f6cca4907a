"""The split-K kernel's W prefetch before the PDL wait (triton_splitk.PREFETCH_W) on a GPU: a
hint that must not change a bit of the result, for bf16 and FP8 weights, every reduction mode,
eager and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from hybridgemm.kernels import triton_splitk as sk
from hybridgemm.kernels.fp8 import quantize_fp8

pytestmark = pytest.mark.gpu

CONFIGS = [
    sk.TritonSplitKConfig(16, 64, 256, 1, 4, 3),
    sk.TritonSplitKConfig(1, 64, 256, 4, 4, 3, fused_reduce=True),
    sk.TritonSplitKConfig(16, 32, 128, 3, 4, 3),
]


def _run_both(monkeypatch, cfg, x, w, b, scale):
    outs = []
    for prefetch in (True, False):
        monkeypatch.setattr(sk, "PREFETCH_W", prefetch)
        sk._PLANS.clear()
        out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
        sk.run(cfg, x, w, b, out, None, weight_scale=scale)
        graph_out = torch.full_like(out, float("nan"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sk.run(cfg, x, w, b, graph_out, None, weight_scale=scale)
        g.replay()
        torch.cuda.synchronize()
        outs += [out, graph_out]
    sk._PLANS.clear()
    return outs


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["one-pass", "fused-reduce", "two-launch"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (3, 333, 1024)])
def test_the_prefetch_changes_no_bit(monkeypatch, fp8, cfg, m, n, k):
    if not sk.pdl_enabled(torch.cuda.get_device_capability()):
        pytest.skip("no programmatic dependent launch on this GPU (the prefetch runs only with it)")
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    scale = None
    if fp8:
        q = quantize_fp8(w)
        w, scale = q.data, q.scale
    outs = _run_both(monkeypatch, cfg, x, w, b, scale)
    ref = x.double() @ (q.dequantize(torch.float32) if fp8 else w.float()).double().T + b.double()
    torch.testing.assert_close(outs[0].double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().mean()))
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
