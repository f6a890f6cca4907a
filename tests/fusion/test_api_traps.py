"""API traps, each checked against the stock PyTorch module on the same random input (CPU):
nn.MultiheadAttention layouts and dropout, tied q/k/v weights under patch/unpatch, unpatch
of a root after a patch of a submodule, and what patch/unpatch say about non-modules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridgemm
from hybridgemm import AttentionProjection, HybridLinear, HybridMultiheadAttention
from hybridgemm.models.patching import FusedQKV, QKVSlice

E, H = 16, 2  # embed dim, heads
B, S = 3, 5  # batch, sequence
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _layout(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """(B, S, E) data in the module's layout: as it is, or (S, B, E) in its own memory."""
    return x if batch_first else x.transpose(0, 1).contiguous()


# ---------------------------------------------------------------- 1. nn.MultiheadAttention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch_first", [True, False])
def test_from_multihead_attention_keeps_the_layout(batch_first, dtype):
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=dtype).eval()
    mod = AttentionProjection.from_multihead_attention(mha)
    x = _layout(torch.randn(B, S, E, dtype=dtype), batch_first)
    with torch.no_grad():
        ref = mha(x, x, x, need_weights=False)[0]
        out = mod(x)
        assert out.shape == ref.shape == x.shape
        torch.testing.assert_close(out, ref, **TOL[dtype])
        # the pieces take the same layout: forward_out(attention(forward_qkv(x))) == forward(x)
        q, k, v = mod.forward_qkv(x)
        assert q.shape == (B, H, S, E // H)
        torch.testing.assert_close(mod.forward_out(F.scaled_dot_product_attention(q, k, v)), ref, **TOL[dtype])
        # unbatched (S, E) input is the same in both layouts
        torch.testing.assert_close(mod(x[:, 0] if not batch_first else x[0]),
                                   mha(*(x[:, 0] if not batch_first else x[0],) * 3, need_weights=False)[0],
                                   **TOL[dtype])
    assert mod.batch_first is batch_first and not mod.training


@pytest.mark.parametrize("batch_first", [True, False])
def test_from_multihead_attention_keeps_dropout(batch_first):
    """Training mode: the same attention dropout as the stock module (same masks from the
    same seed); eval mode: none, as in the stock module."""
    dtype = torch.float64
    mha = nn.MultiheadAttention(E, H, dropout=0.3, batch_first=batch_first, dtype=dtype)
    mod = AttentionProjection.from_multihead_attention(mha)
    x = _layout(torch.randn(B, S, E, dtype=dtype), batch_first)
    xr = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    torch.manual_seed(1234)
    ref = mha(xr, xr, xr, need_weights=False)[0]
    torch.manual_seed(1234)
    out = mod(x)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert mod.dropout == 0.3 and mod.training
    g = torch.randn_like(out)
    ref.backward(g)
    out.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, **TOL[dtype])
    torch.testing.assert_close(mod.qkv_proj.weight.grad, mha.in_proj_weight.grad, **TOL[dtype])
    with torch.no_grad():
        clean = mha.eval()(x, x, x, need_weights=False)[0]
        assert (ref - clean).abs().max() > 1e-3  # dropout did change the training output
        mod.eval()
        torch.testing.assert_close(mod(x), clean, **TOL[dtype])
        torch.testing.assert_close(mod(x), clean, **TOL[dtype])  # eval: nothing random


def test_batch_first_false_refuses_other_ranks():
    mod = AttentionProjection.from_multihead_attention(nn.MultiheadAttention(E, H))
    with pytest.raises(ValueError, match=r"batch_first=False.*\(seq, batch, hidden\)"):
        mod(torch.randn(2, S, B, E))
    with pytest.raises(ValueError, match="batch_first=False"):
        mod.forward_out(torch.randn(1, B, H, S, E // H))
    with pytest.raises(ValueError, match="dropout must be a probability"):
        AttentionProjection(E, H, dropout=1.5)
    with pytest.raises(TypeError, match="batch_first must be a bool"):
        AttentionProjection(E, H, batch_first="no")


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_patched_multihead_attention_matches_stock(batch_first, training, need_weights):
    dtype = torch.float64
    stock = nn.MultiheadAttention(E, H, dropout=0.25, batch_first=batch_first, dtype=dtype).train(training)
    mha = copy.deepcopy(stock)
    assert hybridgemm.patch(mha).patched == ["(root)"] and type(mha) is HybridMultiheadAttention
    x = _layout(torch.randn(B, S, E, dtype=dtype), batch_first)
    torch.manual_seed(99)
    ref, ref_w = stock(x, x, x, need_weights=need_weights)
    torch.manual_seed(99)
    out, w = mha(x, x, x, need_weights=need_weights)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert (w is None) == (ref_w is None)
    if w is not None:
        torch.testing.assert_close(w, ref_w, **TOL[dtype])
    g = torch.randn_like(out)
    ref.backward(g)
    out.backward(g)
    torch.testing.assert_close(mha.in_proj_weight.grad, stock.in_proj_weight.grad, **TOL[dtype])
    assert hybridgemm.unpatch(mha) == ["(root)"] and type(mha) is nn.MultiheadAttention


# ---------------------------------------------------------------- 2. tied q/k/v


class TinyAttention(nn.Module):
    """Llama-style q_proj/k_proj/v_proj/o_proj, with the weights tied as ``tie`` says."""

    def __init__(self, tie: str = "none"):
        super().__init__()
        self.q_proj = nn.Linear(E, E)
        if tie == "module":  # one nn.Linear for Q, K and V
            self.k_proj = self.v_proj = self.q_proj
        else:
            self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E)
        if tie == "weight":  # separate modules, one weight for Q and K
            self.k_proj.weight = self.q_proj.weight
        self.o_proj = nn.Linear(E, E)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, H, E // H).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, E))


class TwoLayers(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return self.b(self.a(x))


def _sgd_step(model: nn.Module, x: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().sum().backward()
    opt.step()


def _cross_layer_tie() -> nn.Module:
    a, b = TinyAttention(), TinyAttention()
    b.v_proj.weight = a.v_proj.weight
    return TwoLayers(a, b)


@pytest.mark.parametrize("make,tied", [
    (lambda: TinyAttention("module"), lambda m: m.k_proj is m.q_proj and m.v_proj is m.q_proj),
    (lambda: TinyAttention("weight"), lambda m: m.k_proj.weight is m.q_proj.weight),
    (_cross_layer_tie, lambda m: m.b.v_proj.weight is m.a.v_proj.weight),
], ids=["shared_linear", "shared_weight", "tied_across_layers"])
def test_tied_qkv_stay_tied_through_training_and_unpatch(make, tied):
    stock = make()
    patched = copy.deepcopy(stock)
    assert tied(stock) and tied(patched)
    report = hybridgemm.patch(patched)
    x = torch.randn(B, S, E)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), stock(x), **TOL[torch.float32])
    _sgd_step(stock, x)
    _sgd_step(patched, x)
    tied_while_patched = tied(patched)
    hybridgemm.unpatch(patched)
    assert not any(isinstance(m, HybridLinear) for m in patched.modules())
    x2 = torch.randn(B, S, E)
    with torch.no_grad():
        torch.testing.assert_close(patched(x2), stock(x2), **TOL[torch.float32])
    for (n, p), (_, r) in zip(patched.named_parameters(), stock.named_parameters()):
        torch.testing.assert_close(p, r, **TOL[torch.float32], msg=n)
    assert tied(patched) and tied_while_patched
    # not fused, and the report says why
    assert report.fused_qkv == []
    assert report.skipped and all("fusing would untie" in why for _, why in report.skipped)


def test_untied_qkv_still_fused_and_trained():
    stock = TinyAttention()
    patched = copy.deepcopy(stock)
    assert hybridgemm.patch(patched).fused_qkv == ["(root)"]
    x = torch.randn(B, S, E)
    _sgd_step(stock, x)
    _sgd_step(patched, x)
    hybridgemm.unpatch(patched)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), stock(x), **TOL[torch.float32])


# ---------------------------------------------------------------- 3. unpatch of a root, patch twice


def _assert_stock(model: nn.Module) -> None:
    for m in model.modules():
        assert type(m) not in (HybridLinear, HybridMultiheadAttention, FusedQKV, QKVSlice), type(m)
        assert "_hybridgemm_undo" not in m.__dict__


def _model():
    return TwoLayers(TinyAttention(), nn.TransformerEncoderLayer(E, H, dim_feedforward=24, dropout=0.0,
                                                                 batch_first=True))


def test_unpatch_root_undoes_patch_of_submodule():
    stock = _model()
    model = copy.deepcopy(stock)
    assert hybridgemm.patch(model.a).fused_qkv == ["(root)"]
    assert hybridgemm.patch(model.b.self_attn).patched == ["(root)"]
    restored = hybridgemm.unpatch(model)
    assert sorted(restored) == ["a", "a.o_proj", "b.self_attn"]
    _assert_stock(model)
    assert hybridgemm.unpatch(model) == []
    x = torch.randn(B, S, E)
    with torch.no_grad():
        torch.testing.assert_close(model(x), stock(x), **TOL[torch.float32])


def test_patch_submodule_then_root_then_unpatch_root():
    stock = _model()
    model = copy.deepcopy(stock)
    hybridgemm.patch(model.a)
    fused = model.a.qkv_proj
    report = hybridgemm.patch(model)
    assert report.patched == ["b.self_attn"] and sorted(report.already_patched) == ["a", "a.o_proj"]
    assert model.a.qkv_proj is fused  # left as it was
    x = torch.randn(B, S, E)
    with torch.no_grad():
        torch.testing.assert_close(model(x), stock(x), **TOL[torch.float32])
    assert sorted(hybridgemm.unpatch(model)) == ["a", "a.o_proj", "b.self_attn"]
    _assert_stock(model)


def test_patch_root_then_unpatch_submodule():
    model = _model()
    hybridgemm.patch(model)
    assert sorted(hybridgemm.unpatch(model.a)) == ["(root)", "o_proj"]
    _assert_stock(model.a)
    assert type(model.b.self_attn) is HybridMultiheadAttention
    assert hybridgemm.unpatch(model) == ["b.self_attn"]
    _assert_stock(model)


@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_patch_twice_is_idempotent(fuse_qkv):
    stock = _model()
    model = copy.deepcopy(stock)
    first = hybridgemm.patch(model, fuse_qkv=fuse_qkv)
    state = {id(m): type(m) for m in model.modules()}
    with pytest.warns(UserWarning, match="nothing patched.*already patched"):
        again = hybridgemm.patch(model, fuse_qkv=fuse_qkv)
    assert not again and again.skipped == [] and sorted(again.already_patched) == sorted(first.patched)
    assert {id(m): type(m) for m in model.modules()} == state
    x = torch.randn(B, S, E)
    with torch.no_grad():
        torch.testing.assert_close(model(x), stock(x), **TOL[torch.float32])
    assert sorted(hybridgemm.unpatch(model)) == sorted(first.patched)
    _assert_stock(model)


# ---------------------------------------------------------------- 4. what patch/unpatch accept


@pytest.mark.parametrize("fn", [hybridgemm.patch, hybridgemm.unpatch], ids=["patch", "unpatch"])
def test_not_a_module(fn):
    for bad, said in [(None, "got None"), (object(), "got object"), ("model", "got str"),
                      (nn.Linear, "got the class Linear")]:
        with pytest.raises(TypeError, match=f"expected an nn.Module, {said}"):
            fn(bad)

    class Uninitialised(nn.Module):
        def __init__(self):
            pass

    with pytest.raises(TypeError, match=r"super\(\).__init__\(\)"):
        fn(Uninitialised())


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")
def test_scripted_module_refused():
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=24, batch_first=True)
    scripted = torch.jit.script(layer)
    with pytest.raises(TypeError, match="TorchScript.*Patch the eager nn.Module"):
        hybridgemm.patch(scripted)
    with pytest.raises(TypeError, match="TorchScript"):
        hybridgemm.unpatch(scripted)
    traced = torch.jit.trace(TinyAttention(), torch.randn(B, S, E))
    with pytest.raises(TypeError, match="TorchScript"):
        hybridgemm.patch(traced)


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")
def test_scripted_submodule_skipped_rest_patched():
    stock = TwoLayers(TinyAttention(), torch.jit.script(nn.TransformerEncoderLayer(E, H, dim_feedforward=24,
                                                                                   batch_first=True).eval()))
    model = TwoLayers(copy.deepcopy(stock.a), stock.b)
    report = hybridgemm.patch(model)
    assert report.fused_qkv == ["a"]
    assert [n for n, _ in report.skipped] == ["b"] and "TorchScript" in report.skipped[0][1]
    x = torch.randn(B, S, E)
    with torch.no_grad():
        torch.testing.assert_close(model(x), stock(x), **TOL[torch.float32])
    assert sorted(hybridgemm.unpatch(model)) == ["a", "a.o_proj"]
