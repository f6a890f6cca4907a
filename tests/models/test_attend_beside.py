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


class _Stream:
    """A stand-in CUDA stream that records the waits and which stream is current."""

    current = None

    def __init__(self, name, log):
        self.name, self.log, self.cuda_stream, self.device_index = name, log, id(self), 0

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


def _fake_capture(monkeypatch, log):
    import contextlib

    main, side = _Stream("main", log), _Stream("side", log)
    _Stream.current = main

    @contextlib.contextmanager
    def on(stream):
        before, _Stream.current = _Stream.current, stream
        try:
            yield
        finally:
            _Stream.current = before

    monkeypatch.setattr(fused_pieces, "_capturing", lambda q: True)
    monkeypatch.setattr(fused_pieces, "_side_stream", lambda *a: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: main)
    monkeypatch.setattr(torch.cuda, "stream", on)


@pytest.mark.parametrize("gemm_fails", [False, True], ids=["both-run", "the-gemm-raises"])
def test_a_capture_forks_the_attention_onto_the_side_stream_and_always_joins(gemm_fails, monkeypatch):
    """The capture branch's order, with stand-in streams (CPU): the side stream waits for the
    main one, the attention runs on the side stream with scratch of its own per call and writes
    the output the main stream allocated, the GEMM runs on the main stream, and the main stream
    waits for the side one before anything is returned, or raised."""
    from hybridgemm.kernels.process_memory import per_call

    log = []
    _fake_capture(monkeypatch, log)

    def attend(q, keys, values, mask, scale, base, step, counters, softcap, into=None):
        log.append(f"attention on {_Stream.current.name}, per call {per_call()}")
        return into.fill_(7.0)

    def gemm(x, *a):
        log.append(f"gemm on {_Stream.current.name}")
        if gemm_fails:
            raise RuntimeError("the GEMM failed")
        return x * 2

    monkeypatch.setattr(fused_pieces, "_attend", attend)
    monkeypatch.setattr(fused_pieces, "run_activated", gemm)
    q, x = torch.zeros(1, 8), torch.ones(1, 1, 4)
    call = lambda: fused_pieces._attend_beside(q, None, None, None, 1.0, None, 1, None, 0.0, x, None, None,  # noqa: E731
                                               "gelu", None, False)
    if gemm_fails:
        with pytest.raises(RuntimeError, match="the GEMM failed"):
            call()
    else:
        out, up = call()
        assert torch.equal(out, torch.full((1, 8), 7.0)) and torch.equal(up, x * 2)
    assert log == ["side waits main", "attention on side, per call True", "gemm on main", "main waits side"]


def test_a_refused_attention_kernel_fills_the_given_output(monkeypatch):
    """Where the kernel refuses (or fails to compile), the PyTorch form's result lands in the
    output the caller passed (the one the capture branch returns), not in a tensor of its own."""
    import warnings

    def refuse(*a, **kw):
        raise ValueError("refused")

    monkeypatch.setattr(fused_pieces.forms.attention_kernel(), "decode_attention", refuse)
    q, keys, values, mask, _, _, _ = _operands("cpu", torch.float32, 1, 4, 2, 16, 9, 8, 8, 3)
    into = torch.full_like(q, float("nan"))
    base = torch.tensor(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fused_pieces._attend(q, keys, values, mask, 0.25, base, 1, None, 0.0, into)
    want = F.scaled_dot_product_attention(q.reshape(1, 4, 1, 16), keys.repeat_interleave(2, 1),
                                          values.repeat_interleave(2, 1), attn_mask=mask, scale=0.25).reshape(1, -1)
    assert got is into and torch.allclose(into, want) and int(base) == 10


def test_the_custom_op_passes_opcheck():
    """``hybridgemm::attend_beside_fwd``: schema (``base`` mutated), fake tensors and autograd
    registration checked by torch.library.opcheck (the CPU form)."""
    q, keys, values, mask, x, w, b = _operands("cpu", torch.float32, 1, 4, 2, 16, 9, 32, 24, 5)
    torch.library.opcheck(torch.ops.hybridgemm.attend_beside_fwd,
                          (q, keys, values, mask, 0.25, torch.tensor(9), 1, None, 0.0, x, w, b, "gelu", None, False))


def test_activated_applies_the_activation_module_where_no_epilogue_activation_is_named():
    """``mlp.activated`` with ``act`` None runs the child and then the activation module (no GEMM
    spec: activated_gemm gives None); with an epilogue activation, the GEMM carries it."""
    from torch import nn

    from hybridgemm import HybridLinear
    from hybridgemm.mlp import activated, activated_gemm

    torch.manual_seed(0)
    owner = nn.Module()
    owner.fc = HybridLinear.from_linear(nn.Linear(32, 24))
    x = torch.randn(3, 32)
    want = F.gelu(x.double() @ owner.fc.weight.double().T + owner.fc.bias.double())
    assert activated_gemm(owner, "fc", None) is None
    torch.testing.assert_close(activated(owner, "fc", None, nn.GELU(), x).double(), want, rtol=1e-4, atol=1e-5)
    assert activated_gemm(owner, "fc", "gelu") is not None
    torch.testing.assert_close(activated(owner, "fc", "gelu", nn.Identity(), x).double(), want, rtol=1e-4, atol=1e-5)
