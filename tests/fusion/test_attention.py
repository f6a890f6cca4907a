"""attention_projection and AttentionProjection on the CPU: one GEMM, views, GQA, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridgemm
from hybridgemm import AttentionProjection, attention_projection, dispatch
from hybridgemm.attention import fuse_qkv_state_dict, split_qkv_state_dict
from hybridgemm.eager_fast import OutProjection as _OutProjection


def make_linears(hidden, h, hkv, d, qkv_bias=True, o_bias=True, dtype=torch.float32):
    q = nn.Linear(hidden, h * d, bias=qkv_bias, dtype=dtype)
    k = nn.Linear(hidden, hkv * d, bias=qkv_bias, dtype=dtype)
    v = nn.Linear(hidden, hkv * d, bias=qkv_bias, dtype=dtype)
    o = nn.Linear(h * d, hidden, bias=o_bias, dtype=dtype)
    return q, k, v, o


def stock_qkv(x, q, k, v, d):
    """What Llama/Qwen2 do: three linears, view, transpose."""
    shape = (*x.shape[:-1], -1, d)
    return tuple(lin(x).view(shape).transpose(-3, -2) for lin in (q, k, v))


def fused_weights(q, k, v):
    w = torch.cat([q.weight, k.weight, v.weight]).detach()
    b = torch.cat([q.bias, k.bias, v.bias]).detach() if q.bias is not None else None
    return w, b


# (hidden, H, Hkv, head_dim): MHA, GQA, MQA, head_dim != hidden // H, odd sizes
HEADS = [(48, 4, 4, None), (64, 8, 2, None), (40, 5, 1, None), (36, 4, 2, 12), (30, 3, 3, None)]


@pytest.mark.parametrize("hidden,h,hkv,d", HEADS)
@pytest.mark.parametrize("bs", [(1, 1), (3, 17), (2, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_separate_linears(hidden, h, hkv, d, bs, bias):
    dd = d or hidden // h
    q, k, v, _ = make_linears(hidden, h, hkv, dd, qkv_bias=bias)
    x = torch.randn(*bs, hidden)
    w, b = fused_weights(q, k, v)
    with torch.no_grad():
        ours = attention_projection(x, w, b, h, hkv, d)
        ref = stock_qkv(x, q, k, v, dd)
    for name, o, r, heads in zip("qkv", ours, ref, (h, hkv, hkv)):
        assert o.shape == (bs[0], heads, bs[1], dd), name
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)


def test_one_gemm_and_views(monkeypatch):
    calls = []
    real = dispatch.fused_linear
    monkeypatch.setattr(dispatch, "fused_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    hidden, h, hkv, d = 64, 8, 2, 8
    w, b = torch.randn((h + 2 * hkv) * d, hidden), torch.randn((h + 2 * hkv) * d)
    x = torch.randn(2, 5, hidden)
    q, k, v = attention_projection(x, w, b, h, hkv)
    assert len(calls) == 1
    # no copies: all three are views of the one GEMM output, with unit last-dim stride
    ptr = q.untyped_storage().data_ptr()
    assert k.untyped_storage().data_ptr() == ptr and v.untyped_storage().data_ptr() == ptr
    assert q.stride() == (5 * (h + 2 * hkv) * d, d, (h + 2 * hkv) * d, 1)
    assert not q.is_contiguous() and q.stride(-1) == 1
    # SDPA takes the views as they are and gives what contiguous copies give
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    ref = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), enable_gqa=True,
                                         is_causal=True)
    torch.testing.assert_close(out, ref)


def test_unbatched_input():
    w = torch.randn((2 + 2 * 1) * 8, 16)
    q, k, v = attention_projection(torch.randn(7, 16), w, None, 2, 1)
    assert q.shape == (2, 7, 8) and k.shape == v.shape == (1, 7, 8)


def test_gradients_match_separate_linears():
    hidden, h, hkv, d = 24, 4, 2, 6
    q, k, v, _ = make_linears(hidden, h, hkv, d, dtype=torch.float64)
    w, b = fused_weights(q, k, v)
    x = torch.randn(2, 3, hidden, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x, w, b: torch.cat([t.flatten() for t in attention_projection(x, w, b, h, hkv)]),
        (x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)))
    grads = [torch.randn(2, n, 3, d, dtype=torch.float64) for n in (h, hkv, hkv)]
    xs = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(stock_qkv(xs, q, k, v, d), grads)
    x.grad = w.grad = b.grad = None
    torch.autograd.backward(attention_projection(x, w, b, h, hkv), grads)
    torch.testing.assert_close(x.grad, xs.grad)
    torch.testing.assert_close(w.grad, torch.cat([q.weight.grad, k.weight.grad, v.weight.grad]))
    torch.testing.assert_close(b.grad, torch.cat([q.bias.grad, k.bias.grad, v.bias.grad]))


def test_training_is_one_autograd_node_per_projection():
    """Eager training records the fused QKV GEMM and its head views as one node, and the O
    projection with its transpose/flatten as one; gradients stay those of stock autograd."""
    hidden, h, hkv, d = 24, 4, 2, 6
    mod = AttentionProjection(hidden, h, hkv, d, qkv_bias=True, out_bias=False, dtype=torch.float64)
    x = torch.randn(2, 3, hidden, dtype=torch.float64, requires_grad=True)
    q, k, v = mod.forward_qkv(x)
    assert q.grad_fn is k.grad_fn is v.grad_fn and "QKVProjection" in type(q.grad_fn).__name__
    attn_bshd = torch.randn(2, 3, h, d, dtype=torch.float64, requires_grad=True)
    y = mod.forward_out(attn_bshd.transpose(1, 2))
    assert "OutProjection" in type(y.grad_fn).__name__
    assert torch.autograd.gradcheck(lambda a, w: _OutProjection.apply(a.transpose(1, 2), w, None, None),
                                    (attn_bshd, mod.o_proj.weight))
    assert torch.autograd.gradcheck(lambda a, w, b: _OutProjection.apply(a, w, b, None),
                                    (torch.randn(2, h, 3, d, dtype=torch.float64, requires_grad=True),
                                     mod.o_proj.weight, torch.randn(hidden, dtype=torch.float64, requires_grad=True)))
    # only q feeds the loss: k and v get no gradient from autograd, the fused dW rows stay 0
    w, b = mod.qkv_proj.weight, mod.qkv_proj.bias
    x.grad = w.grad = b.grad = None
    mod.forward_qkv(x)[0].square().sum().backward()
    xr, wr, br = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    F.linear(xr, wr[: h * d], br[: h * d]).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad[: h * d], wr.grad[: h * d])
    assert not w.grad[h * d:].any() and not b.grad[h * d:].any()
    # frozen weights (LoRA-style): only x gets a gradient, the weight none
    w.requires_grad_(False)
    b.requires_grad_(False)
    x.grad = None
    sum(t.sum() for t in mod.forward_qkv(x)).backward()
    assert x.grad is not None and w.grad is not None  # untouched from before
    torch.testing.assert_close(x.grad, w.sum(0).expand_as(x))


def test_errors():
    x = torch.randn(2, 3, 64)
    w, b = torch.randn(96, 64), torch.randn(96)  # (8 + 2*2) * 8
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        attention_projection(x, w, b, 0, 2)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        attention_projection(x, w, b, 8, 2.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attention_projection(x, w, b, 8, 3)
    with pytest.raises(ValueError, match="not divisible by num_heads 7"):
        attention_projection(x, torch.randn(63, 64), None, 7, 7)
    with pytest.raises(ValueError, match=r"expected \(num_heads \+ 2 \* num_kv_heads\) \* head_dim"):
        attention_projection(x, w, b, 8, 4)
    # the projection's GEMM under F.linear's rules: their error, a RuntimeError as F.linear's
    with pytest.raises(hybridgemm.LinearArgumentError, match="input features"):
        attention_projection(x, torch.randn(96, 60), None, 8, 2, head_dim=8)
    with pytest.raises(hybridgemm.LinearArgumentError, match="bias must have shape"):
        attention_projection(x, w, torch.randn(95), 8, 2)
    with pytest.raises(hybridgemm.LinearArgumentError, match="one dtype"):
        attention_projection(x, w.double(), b, 8, 2)
    with pytest.raises(hybridgemm.LinearArgumentError, match="one device"):
        attention_projection(x, w.to("meta"), None, 8, 2)
    with pytest.raises(ValueError, match="seq, hidden"):
        attention_projection(torch.randn(64), w, b, 8, 2)
    with pytest.raises(ValueError, match="2-D tensor"):
        attention_projection(x, w.flatten(), b, 8, 2)


# -------------------------------------------------------------------- AttentionProjection

def stock_attention(x, q, k, v, o, h, hkv, d, **sdpa):
    qs, ks, vs = stock_qkv(x, q, k, v, d)
    ks, vs = ks.repeat_interleave(h // hkv, dim=1), vs.repeat_interleave(h // hkv, dim=1)
    out = F.scaled_dot_product_attention(qs, ks, vs, **sdpa)
    return o(out.transpose(1, 2).reshape(*x.shape[:-1], h * d))


@pytest.mark.parametrize("hidden,h,hkv,d", HEADS)
@pytest.mark.parametrize("qkv_bias,o_bias", [(True, False), (True, True), (False, False)])
def test_module_from_linears(hidden, h, hkv, d, qkv_bias, o_bias):
    dd = d or hidden // h
    lins = make_linears(hidden, h, hkv, dd, qkv_bias, o_bias)
    mod = AttentionProjection.from_linears(*lins, num_heads=h, num_kv_heads=hkv)  # head_dim inferred
    assert (mod.num_heads, mod.num_kv_heads, mod.head_dim) == (h, hkv, dd)
    x = torch.randn(2, 9, hidden)
    with torch.no_grad():
        torch.testing.assert_close(mod(x, is_causal=True), stock_attention(x, *lins, h, hkv, dd, is_causal=True),
                                   rtol=1e-5, atol=1e-6)
    back = mod.to_linears()
    for a, b in zip(lins, back):
        assert type(b) is nn.Linear
        assert a.state_dict().keys() == b.state_dict().keys()
        for key in a.state_dict():
            assert torch.equal(a.state_dict()[key], b.state_dict()[key])


def test_module_state_dict_keys_and_conversion():
    h, hkv, d, hidden = 4, 2, 8, 32
    q, k, v, o = make_linears(hidden, h, hkv, d, True, False)
    mod = AttentionProjection.from_linears(q, k, v, o, h, hkv)
    sd = mod.state_dict()
    assert set(sd) == {"qkv_proj.weight", "qkv_proj.bias", "o_proj.weight"}
    assert sd["qkv_proj.weight"].shape == ((h + 2 * hkv) * d, hidden)
    hf = {f"self_attn.{p}_proj.{n}": t for p, lin in zip("qkvo", (q, k, v, o)) for n, t in lin.state_dict().items()}
    fused = fuse_qkv_state_dict(hf, prefix="self_attn.")
    assert set(fused) == set(sd) and all(torch.equal(fused[key], sd[key]) for key in sd)
    split = split_qkv_state_dict(sd, h, hkv, d, prefix="self_attn.")
    assert set(split) == set(hf) and all(torch.equal(split[key], hf[key]) for key in hf)
    fresh = AttentionProjection(hidden, h, hkv, qkv_bias=True, out_bias=False)
    fresh.load_state_dict(fused)
    x = torch.randn(1, 4, hidden)
    torch.testing.assert_close(fresh(x), mod(x))


def test_module_forward_pieces_and_training():
    mod = AttentionProjection(32, 4, 2, dtype=torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    q, k, v = mod.forward_qkv(x)
    assert q.shape == (2, 4, 5, 8) and k.shape == (2, 2, 5, 8)
    attn = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    y = mod.forward_out(attn)
    torch.testing.assert_close(y, mod(x))
    y.square().sum().backward()
    assert all(p.grad is not None for p in mod.parameters())
    with pytest.raises(ValueError, match="forward_out: expected"):
        mod.forward_out(torch.randn(2, 3, 5, 8, dtype=torch.float64))
    custom = mod(x, attn_fn=lambda q, k, v: torch.zeros_like(q))
    torch.testing.assert_close(custom, mod.o_proj.bias.expand(2, 5, 32))


def test_module_from_multihead_attention():
    mha = nn.MultiheadAttention(24, 3, batch_first=True).eval()
    mod = AttentionProjection.from_multihead_attention(mha)
    x = torch.randn(2, 6, 24)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), mha(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kdim/vdim"):
        AttentionProjection.from_multihead_attention(nn.MultiheadAttention(24, 3, kdim=12, vdim=12))
    with pytest.raises(ValueError, match="add_bias_kv"):
        AttentionProjection.from_multihead_attention(nn.MultiheadAttention(24, 3, add_bias_kv=True))
    with pytest.raises(TypeError, match="expected nn.MultiheadAttention"):
        AttentionProjection.from_multihead_attention(nn.Linear(2, 2))


def test_module_construction_errors():
    q, k, v, o = make_linears(32, 4, 2, 8)
    with pytest.raises(ValueError, match="all have a bias or none"):
        AttentionProjection.from_linears(q, nn.Linear(32, 16, bias=False), v, o, 4, 2)
    with pytest.raises(ValueError, match="k.weight has shape"):
        AttentionProjection.from_linears(q, k, v, o, 4, 4)
    with pytest.raises(ValueError, match="o.weight has 16 input features"):
        AttentionProjection.from_linears(q, k, v, nn.Linear(16, 32), 4, 2)
    with pytest.raises(TypeError, match="one dtype"):
        AttentionProjection.from_linears(q, k, v.double(), o, 4, 2)
    with pytest.raises(TypeError, match="nn.Linear-like"):
        AttentionProjection.from_linears(q, k, v, "o", 4, 2)
    with pytest.raises(ValueError, match="not divisible by num_heads 5"):
        AttentionProjection(32, 5)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        AttentionProjection(32, 4, 3)


def test_module_compiles_fullgraph():
    torch._dynamo.reset()
    mod = AttentionProjection(32, 4, 2, qkv_bias=True, out_bias=False)
    x = torch.randn(2, 5, 32, requires_grad=True)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    out = compiled(x, is_causal=True)
    out.sum().backward()
    grads = [p.grad.clone() for p in mod.parameters()] + [x.grad.clone()]
    mod.zero_grad()
    x.grad = None
    ref = mod(x, is_causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, [p.grad for p in mod.parameters()] + [x.grad]):
        torch.testing.assert_close(g, r)


def test_exports():
    assert hybridgemm.AttentionProjection is AttentionProjection
    assert callable(hybridgemm.linear) and callable(hybridgemm.patch) and callable(hybridgemm.unpatch)


def test_bench_attention_check_only_runs_on_cpu(capsys):
    from hybridgemm.perf import bench_attention

    assert bench_attention.main(["--check-only", "--tiny", "--scenarios", "decode_b8", "train_4096"]) == 0
    assert "train_4096: rel err" in capsys.readouterr().out
