"""The decode attention beside a parallel layer's first MLP GEMM (``fused_pieces.attend_beside``):
the same outputs, bits included, as the attention and the GEMM one after the other; in a
captured CUDA graph the attention runs on a second stream; eagerly, and on the CPU (the
interpreter, against an fp64 reference), one after the other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridgemm.kernels import triton_decode_attention
from hybridgemm.kernels.fp8 import quantize_fp8
from hybridgemm.mlp import ActivatedGemm, run_activated
from hybridgemm.models import fused_pieces

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _operands(device, dtype, batch, heads, kv_heads, hd, filled, k, n, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads * hd, device=device, generator=g).to(dtype)
    keys = torch.randn(batch, kv_heads, filled + 7, hd, device=device, generator=g).to(dtype)
    values = torch.randn(batch, kv_heads, filled + 7, hd, device=device, generator=g).to(dtype)
    mask = (torch.arange(filled + 7, device=device) < filled).view(1, 1, 1, -1).expand(batch, 1, 1, -1)
    x = torch.randn(batch, 1, k, device=device, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device=device, generator=g).to(dtype)
    return q, keys, values, mask, x, w, b


@pytest.mark.parametrize("batch,heads,kv_heads,hd,filled", [(1, 3, 1, 16, 5), (2, 4, 2, 32, 17)])
def test_on_the_cpu_both_are_computed_one_after_the_other(batch, heads, kv_heads, hd, filled):
    """CPU tensors (the kernels under the interpreter): the attention against fp64 SDPA and
    gelu(x W^T + b) against fp64, the cache length moved by ``step``."""
    q, keys, values, mask, x, w, b = _operands("cpu", torch.float32, batch, heads, kv_heads, hd, filled, 40, 24,
                                               filled)
    base = torch.tensor(filled, dtype=torch.int64)
    out, up = fused_pieces.attend_beside(q, keys, values, mask, hd**-0.5, base, 1, None, 0.0, x,
                                         ActivatedGemm(w, b, "gelu", None, False))
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(
        q.double().reshape(batch, heads, 1, hd), keys.double().repeat_interleave(rep, 1),
        values.double().repeat_interleave(rep, 1), attn_mask=mask, scale=hd**-0.5).reshape(batch, -1)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(up.double(), F.gelu(x.double() @ w.double().T + b.double()), rtol=1e-4, atol=1e-5)
    assert up.shape == (batch, 1, 24) and int(base) == filled + 1


def _serial(q, keys, values, mask, scale, base, x, up):
    return fused_pieces.attend(q, keys, values, mask, scale, base, 1, None), run_activated(x, *up)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("batch,heads,kv_heads,hd,filled", [(1, 71, 1, 64, 100), (2, 32, 32, 128, 30)])
def test_on_the_gpu_the_attention_runs_on_a_second_stream_with_the_serial_bits(batch, heads, kv_heads, hd, filled,
                                                                               weights, monkeypatch):
    """Falcon-7B's (71 heads on one KV head) and Pythia's (32/32, heads of 128) layouts, the up
    GEMM bf16 or FP8 (its scale in the epilogue): eagerly (one stream), in a replayed CUDA graph
    (the attention captured on another stream than the GEMM) and under
    torch.compile(mode="reduce-overhead", fullgraph=True), both outputs equal the serial ones
    bit for bit and the cache length moves once per call."""
    dev = "cuda"
    q, keys, values, mask, x, w, b = _operands(dev, torch.bfloat16, batch, heads, kv_heads, hd, filled, 512, 1000,
                                               filled)
    up = ActivatedGemm(w, b, "gelu", None, False)
    if weights == "fp8":
        fw = quantize_fp8(w, "channel")
        up = ActivatedGemm(fw.data, b, "gelu", fw.scale, False)
    scale = hd**-0.5
    base = torch.zeros((), dtype=torch.int64, device=dev)
    want_out, want_up = _serial(q, keys, values, mask, scale, base, x, up)

    streams = []
    real = triton_decode_attention.decode_attention

    def spy(*a, **kw):
        streams.append(torch.cuda.current_stream().cuda_stream)
        return real(*a, **kw)

    monkeypatch.setattr(triton_decode_attention, "decode_attention", spy)
    main = torch.cuda.current_stream().cuda_stream
    out, got_up = fused_pieces.attend_beside(q, keys, values, mask, scale, base, 1, None, 0.0, x, up)
    torch.cuda.synchronize()
    assert streams == [main]  # eagerly one after the other
    assert torch.equal(out, want_out) and torch.equal(got_up, want_up)
    assert int(base) == 2

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capturing = torch.cuda.current_stream().cuda_stream
        g_out, g_up = fused_pieces.attend_beside(q, keys, values, mask, scale, base, 1, None, 0.0, x, up)
    assert len(streams) == 2 and streams[-1] != capturing  # captured beside the GEMM
    g_out.fill_(float("nan"))
    g_up.fill_(float("nan"))
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, want_out) and torch.equal(g_up, want_up)
    assert int(base) == 2 + 5

    torch._dynamo.reset()
    fn = torch.compile(lambda *a: fused_pieces.attend_beside(*a, 0.0, x, up), mode="reduce-overhead",
                       fullgraph=True)
    for _ in range(3):  # warm-up, recording, replay
        c_out, c_up = fn(q, keys, values, mask, scale, base, 1, None)
        c_out, c_up = c_out.clone(), c_up.clone()
    torch.cuda.synchronize()
    torch._dynamo.reset()
    assert torch.equal(c_out, want_out) and torch.equal(c_up, want_up)
    assert int(base) == 2 + 5 + 3
