"""GPU tests of the user-facing layer: linear (forward + backward), attention_projection,
patched transformers models, CUDA-graph capture of a decode step, torch.compile (inductor).

Run on the GPU machine: ``pytest -m gpu tests/fusion/test_fusion_gpu.py``. Errors are bounded
relative to PyTorch's own error on the same inputs (tests/helpers.py), never by a fixed
loose tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from helpers import FLOORS, check_close_to_reference, make_operands, rel_err, torch_linear
from hybridgemm import AttentionProjection, attention_projection, dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]  # fp32 references stay fp32

DTYPES = [torch.bfloat16, torch.float16]
ACTS = [None, "relu", "gelu_tanh", "gelu"]
DEV = "cuda"




@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("m", [1, 3, 17, 300])
@pytest.mark.parametrize("n,k", [(200, 136), (96, 70), (512, 256)])
def test_linear_forward(dtype, activation, m, n, k):
    x, w, b = make_operands(m, n, k, dtype, DEV)
    out = hybridgemm.linear(x, w, b, activation)
    assert out.shape == (m, n) and out.dtype == dtype and out.device.type == "cuda"
    check_close_to_reference(out, x, w, b, activation, f"{dtype} {activation} {m}x{n}x{k}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_forward_leading_dims_and_strides(dtype):
    base = torch.randn(6, 40, 136, device=DEV).to(dtype)
    x = base.transpose(0, 1)[::3]  # (14, 6, 136), non-contiguous
    _, w, b = make_operands(1, 200, 136, dtype, DEV)
    out = hybridgemm.linear(x, w, b, "relu")
    assert out.shape == (14, 6, 200)
    check_close_to_reference(out.reshape(-1, 200), x.reshape(-1, 136), w, b, "relu", "strided")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("m", [1, 17, 300])
def test_linear_backward(dtype, activation, m):
    n, k = 200, 136
    x, w, b = make_operands(m, n, k, dtype, DEV)
    gy = torch.randn(m, n, device=DEV).to(dtype)
    ours = [t.clone().requires_grad_(True) for t in (x, w, b)]
    hybridgemm.linear(*ours, activation).backward(gy)
    stock = [t.clone().requires_grad_(True) for t in (x, w, b)]
    torch_linear(*stock, activation).backward(gy)
    ref = [t.double().requires_grad_(True) for t in (x, w, b)]
    torch_linear(*ref, activation).backward(gy.double())
    for name, o, s, r in zip("xwb", ours, stock, ref):
        theirs = rel_err(s.grad, r.grad)
        err = rel_err(o.grad, r.grad)
        assert err <= max(2 * theirs, FLOORS[dtype]), f"d{name}: {err:.3g} vs torch {theirs:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_projection_equals_separate_linears(dtype):
    hidden, h, hkv, d = 512, 8, 2, 64
    x, w, b = make_operands(2 * 33, (h + 2 * hkv) * d, hidden, dtype, DEV)
    x = x.view(2, 33, hidden)
    q, k, v = attention_projection(x, w, b, h, hkv)
    sizes = [h * d, hkv * d, hkv * d]
    for name, got, wi, bi, heads in zip("qkv", (q, k, v), w.split(sizes), b.split(sizes), (h, hkv, hkv)):
        assert got.shape == (2, heads, 33, d)
        flat = got.transpose(1, 2).reshape(-1, heads * d)
        check_close_to_reference(flat, x.reshape(-1, hidden), wi, bi, None, name)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.isfinite(out).all()


def _tiny_hf(kind: str, dtype, layers: int = 2):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    cls, cfg = {"qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig)}[kind]
    model = cls(cfg(**common)).eval()
    model.config._attn_implementation = "sdpa"
    return model.to(DEV, dtype)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_patched_hf_logits_within_bound(kind, dtype):
    model = _tiny_hf(kind, torch.float32)
    ids = torch.randint(0, 1000, (2, 37), device=DEV)
    with torch.no_grad():
        ref = model(ids).logits.double()  # fp32 model, TF32 off
        model.to(dtype)
        stock = model(ids).logits
        report = hybridgemm.patch(model)
        assert len(report.fused_qkv) == 2
        ours = model(ids).logits
    theirs = rel_err(stock, ref)
    assert rel_err(ours, ref) <= max(2 * theirs, FLOORS[dtype]), f"torch's own: {theirs:.3g}"
    hybridgemm.unpatch(model)


def test_decode_step_graph_capture_replays():
    """A decode step (QKV, KV-cache write, attention, O) captured in a CUDA graph replays
    exactly what eager computes, for fresh inputs copied into the static buffers."""
    dtype, hidden, h, hkv, d, ctx = torch.bfloat16, 512, 8, 2, 64, 64
    mod = AttentionProjection(hidden, h, hkv, qkv_bias=True, out_bias=False, device=DEV, dtype=dtype).eval()
    kc = torch.zeros(1, hkv, ctx, d, device=DEV, dtype=dtype)
    vc = torch.zeros_like(kc)
    x_static = torch.randn(1, 1, hidden, device=DEV, dtype=dtype)
    pos = torch.zeros((), dtype=torch.long, device=DEV)

    def step(x, kc, vc):
        q, k, v = mod.forward_qkv(x)
        kc.index_copy_(2, pos.view(1), k)
        vc.index_copy_(2, pos.view(1), v)
        mask = (torch.arange(ctx, device=DEV) <= pos).view(1, 1, 1, ctx)  # SDPA wants a 4-D mask
        o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
        return mod.forward_out(o)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step(x_static, kc.clone(), vc.clone())
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static = step(x_static, kc, vc)
        kc.zero_()
        vc.zero_()
        kc_e, vc_e = kc.clone(), vc.clone()
        for p in range(4):
            x = torch.randn(1, 1, hidden, device=DEV, dtype=dtype)
            pos.fill_(p)
            want = step(x, kc_e, vc_e)
            x_static.copy_(x)
            y_static.fill_(float("nan"))  # poison: replay must overwrite it
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_static, want), f"step {p}"
            assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e)


def test_patched_hf_attention_graph_capture():
    model = _tiny_hf("qwen2", torch.bfloat16, layers=1)
    hybridgemm.patch(model)
    attn = model.model.layers[0].self_attn
    hs = torch.randn(1, 1, 256, device=DEV, dtype=torch.bfloat16)
    pos_ids = torch.zeros(1, 1, dtype=torch.long, device=DEV)
    cos, sin = model.model.rotary_emb(hs, pos_ids)
    with torch.no_grad():
        want = attn(hs, (cos, sin), None)[0]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                attn(hs, (cos, sin), None)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = attn(hs, (cos, sin), None)[0]
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_eager_no_grad_skips_custom_op(monkeypatch):
    called = []
    real = dispatch.fused_linear
    monkeypatch.setattr(dispatch, "fused_linear", lambda *a, **kw: called.append(1) or real(*a, **kw))
    x, w, b = make_operands(1, 256, 256, torch.bfloat16, DEV)
    hybridgemm.linear(x, w, b)
    assert called == [1]


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_torch_compile_inductor_fullgraph(dtype):
    torch._dynamo.reset()
    mod = AttentionProjection(256, 8, 2, qkv_bias=True, out_bias=False, device=DEV, dtype=dtype)
    ref_mod = copy.deepcopy(mod)
    x = torch.randn(2, 33, 256, device=DEV, dtype=dtype, requires_grad=True)
    compiled = torch.compile(mod, fullgraph=True)
    out = compiled(x, is_causal=True)
    out.float().square().sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    ref = ref_mod(xr, is_causal=True)
    ref.float().square().sum().backward()
    assert rel_err(out, ref) <= FLOORS[dtype]
    for p, r in zip(mod.parameters(), ref_mod.parameters()):
        assert rel_err(p.grad, r.grad) <= FLOORS[dtype]
    assert rel_err(x.grad, xr.grad) <= FLOORS[dtype]

    model = _tiny_hf("llama", dtype, layers=1)
    ids = torch.randint(0, 1000, (1, 9), device=DEV)
    with torch.no_grad():
        hybridgemm.patch(model)
        eager = model(ids).logits
        comp = torch.compile(model, fullgraph=True)(ids).logits
    assert rel_err(comp, eager) <= FLOORS[dtype]
