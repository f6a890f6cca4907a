"""hybridgemm.patch / unpatch on real clients: transformers Qwen2, Llama, GPT-2, BERT built
from tiny configs with random weights (no downloads), and nn.MultiheadAttention."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import hybridgemm
from helpers import assert_trains_as_stock
from hybridgemm import HybridLinear, HybridMultiheadAttention, dispatch
from hybridgemm.mlp import HybridGatedMLP
from hybridgemm.models.patching import FusedQKV, HybridConv1D, QKVSlice
from hybridgemm.norm import HybridRMSNorm

VOCAB = 97


def _tiny(kind: str, attn: str = "sdpa", layers: int = 2):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        raise AssertionError(kind)
    model.config._attn_implementation = attn
    return model.eval()


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _count_fused_calls(monkeypatch):
    calls = []
    real = dispatch.fused_linear
    monkeypatch.setattr(dispatch, "fused_linear", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("kind,attn", [("qwen2", "sdpa"), ("llama", "sdpa"), ("qwen2", "eager")])
def test_hf_causal_lm_logits_and_greedy_decode(kind, attn, monkeypatch):
    model = _tiny(kind, attn)
    before = _snapshot(model)
    params_before = {n: p for n, p in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)

    mlp_class = type(model.model.layers[0].mlp)
    report = hybridgemm.patch(model)
    assert report.fused_qkv == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert report.fused_mlp == ["model.layers.0.mlp", "model.layers.1.mlp"]
    layer_parts = ("self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj", "input_layernorm",
                   "post_attention_layernorm")
    layers = ["model.layers.0", "model.layers.1"]
    assert report.patched == [f"model.layers.{i}.{n}" for i in range(2) for n in layer_parts] + [
        "model.norm", "lm_head"] + layers
    assert report.fused_layers == layers  # norms and residual adds inside the GEMMs at decode sizes (CUDA)
    assert all(type(m) is HybridRMSNorm for m in (model.model.norm, model.model.layers[1].input_layernorm))
    attn0, mlp0 = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn0.q_proj, QKVSlice) and isinstance(attn0.qkv_proj, FusedQKV)
    assert type(attn0.o_proj) is HybridLinear and type(model.lm_head) is HybridLinear
    assert type(mlp0) is HybridGatedMLP and mlp0.glu_activation == "silu"
    assert isinstance(mlp0.gate_up_proj, FusedQKV) and type(mlp0.down_proj) is HybridLinear

    calls = _count_fused_calls(monkeypatch)
    with torch.no_grad():
        out = model(ids).logits
    # per layer: one fused QKV GEMM (4 + 2*2 heads of 16 = 128 rows), one O GEMM, the gate and up
    # GEMMs of gated_linear's halves path on the CPU (96 rows each, read from the one stacked
    # weight), one down GEMM; then the LM head (VOCAB rows); nothing else
    assert calls == [128, 64, 96, 96, 64] * 2 + [VOCAB]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)
    assert attn0.qkv_proj._rec is None  # every slice handed out: nothing kept alive

    restored = hybridgemm.unpatch(model)
    assert sorted(restored) == sorted(report.patched)
    assert all(type(getattr(attn0, n)) is nn.Linear for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert type(mlp0) is mlp_class and "glu_activation" not in mlp0.__dict__ and not hasattr(mlp0, "gate_up_proj")
    assert all(type(getattr(mlp0, n)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is params_before["lm_head.weight"]
    after = _snapshot(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params_before[n] and p.is_contiguous() for n, p in model.named_parameters())
    assert hybridgemm.unpatch(model) == []


def test_hf_training_grads_and_step_then_unpatch():
    stock = _tiny("qwen2")
    stock.train()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = torch.randint(0, VOCAB, (2, 9))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, patched)]
    for m in (stock, patched):
        m(ids, labels=ids).loss.backward()
    a_s, a_p = stock.model.layers[1].self_attn, patched.model.layers[1].self_attn
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):  # each part's gradient, through the one fused GEMM
        torch.testing.assert_close(getattr(a_p, n).weight.grad, getattr(a_s, n).weight.grad, rtol=1e-5, atol=1e-7)
        if n != "o_proj":
            torch.testing.assert_close(getattr(a_p, n).bias.grad, getattr(a_s, n).bias.grad, rtol=1e-5, atol=1e-7)
    for opt in opts:
        opt.step()
    hybridgemm.unpatch(patched)  # the originals get the trained values back
    ref, got = stock.state_dict(), patched.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("weights", ["fp32", "fp8"])
@pytest.mark.parametrize("clamped", ["before", "after"])
def test_olmo_clamping_its_fused_qkv_in_place_trains_as_stock(clamped, weights):
    """OLMo's forward clamps the raw outputs of q_proj, k_proj and v_proj in place where
    config.clip_qkv is set (before or after patching): Q/K/V are fused, and with gradients
    wanted the logits and every stock parameter's gradient are the unpatched model's (FP8
    weights: those of the same FP8 model with Q/K/V not fused, each projection's output a tensor
    of its own)."""
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(0)
    config = OlmoConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, clip_qkv=0.05 if clamped == "before" else None,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    stock = OlmoForCausalLM(config)
    model = copy.deepcopy(stock)
    if weights == "fp8":
        hybridgemm.patch(stock, weights="fp8", fuse_qkv=False)
    report = hybridgemm.patch(model, **({"weights": "fp8"} if weights == "fp8" else {}))
    assert report.fused_qkv == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    stock.config.clip_qkv = model.config.clip_qkv = 0.05  # (3/4 of q's and v's entries are larger)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    assert_trains_as_stock(model, stock, ids, logits_atol=1e-6, grad_atol=1e-7)


def test_hf_torch_compile_fullgraph_patched():
    torch._dynamo.reset()
    model = _tiny("llama", layers=1)
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        ref = model(ids).logits
        hybridgemm.patch(model)
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    hybridgemm.unpatch(model)


def test_gpt2_mlp_with_an_activation_no_epilogue_has_is_left_alone_and_reported():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=48, n_layer=1, n_head=4, n_positions=32, activation_function="silu")).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    mlp_class = type(gpt2.transformer.h[0].mlp)
    with torch.no_grad():
        ref = gpt2(ids).logits
        report = hybridgemm.patch(gpt2)
        out = gpt2(ids).logits
    reasons = dict(report.skipped)
    assert "has no fused epilogue" in reasons["transformer.h.0.mlp"]
    assert type(gpt2.transformer.h[0].mlp) is mlp_class and "transformer.h.0.mlp" not in report.patched
    assert report.patched == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "lm_head"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_gpt2_conv1d_and_bert():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4,
                                                                n_positions=32)).eval()
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=64)).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    gpt2_layer = ["attn.c_attn", "attn.c_proj", "mlp", "mlp.c_fc", "mlp.c_proj"]
    bert_layer = ["attention.self", "attention.output.dense", "intermediate.dense", "intermediate", "output.dense"]
    for model, get, expect in [
        (gpt2, lambda m: m(ids).logits,
         [f"transformer.h.{i}.{n}" for i in range(2) for n in gpt2_layer] + ["lm_head"]),
        (bert, lambda m: m(ids).last_hidden_state, [f"encoder.layer.{i}.{n}" for i in range(2) for n in bert_layer]),
    ]:
        before = _snapshot(model)
        classes = {n: type(m) for n, m in model.named_modules()}
        with torch.no_grad():
            ref = get(model)
            report = hybridgemm.patch(model)
            assert report.patched == expect
            torch.testing.assert_close(get(model), ref, rtol=1e-5, atol=1e-5)
        hybridgemm.unpatch(model)
        after = _snapshot(model)
        assert all(torch.equal(after[k], before[k]) and after[k].is_contiguous() for k in before)
        assert {n: type(m) for n, m in model.named_modules()} == classes
        assert not any("activation" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    assert type(gpt2.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    hybridgemm.patch(gpt2)
    hybridgemm.patch(bert)
    assert isinstance(gpt2.transformer.h[0].attn.c_attn, HybridConv1D)
    # the MLPs' GELUs run in the first GEMM's epilogue: gelu_new is the tanh form, BERT's the erf form
    mlp = gpt2.transformer.h[0].mlp
    assert mlp.c_fc.activation == "gelu_tanh" and mlp.c_proj.activation is None
    intermediate = bert.encoder.layer[0].intermediate
    assert intermediate.activation == "gelu" and intermediate.dense.activation is None
    assert gpt2.transformer.h[0].attn.c_attn.weight.t().is_contiguous()  # no per-call weight copy


def test_bert_cross_attention_not_fused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=48, is_decoder=True, add_cross_attention=True)
    model = transformers.BertModel(cfg).eval()
    ids, enc = torch.randint(0, VOCAB, (2, 5)), torch.randn(2, 7, 32)
    with torch.no_grad():
        ref = model(ids, encoder_hidden_states=enc).last_hidden_state
        report = hybridgemm.patch(model)
        out = model(ids, encoder_hidden_states=enc).last_hidden_state
    assert report.fused_qkv == ["encoder.layer.0.attention.self"]
    assert any("cross-attention" in why for _, why in report.skipped)
    assert type(model.encoder.layer[0].crossattention.self.key) is HybridLinear
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_move_while_patched_keeps_originals_in_step():
    model = _tiny("qwen2", layers=1)
    q_param = model.model.layers[0].self_attn.q_proj.weight
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        ref = model.double()(ids).logits
        model.float()
        hybridgemm.patch(model)
        model.double()  # new storage for the fused parameters: the originals follow
        fused = model.model.layers[0].self_attn.qkv_proj.weight
        assert q_param.dtype == torch.float64 and q_param.data_ptr() == fused.data_ptr()
        torch.testing.assert_close(model(ids).logits, ref)
    hybridgemm.unpatch(model)
    assert model.model.layers[0].self_attn.q_proj.weight is q_param and q_param.dtype == torch.float64
    assert q_param.data_ptr() != fused.data_ptr()  # own storage again


def test_fused_slices_never_mix_inputs():
    lin = [nn.Linear(16, n) for n in (16, 8, 8)]
    holder = nn.Module()
    for name, m in zip(("q_proj", "k_proj", "v_proj"), lin):
        holder.add_module(name, m)
    refs = copy.deepcopy(lin)
    hybridgemm.patch(holder)
    a, b = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(holder.q_proj(a), refs[0](a))
        torch.testing.assert_close(holder.k_proj(b), refs[1](b))  # another input: its own GEMM
        torch.testing.assert_close(holder.v_proj(a), refs[2](a))
        holder.q_proj(a)
        a.mul_(2)  # in-place change between the calls: the version counter catches it
        torch.testing.assert_close(holder.k_proj(a), refs[1](a))
        torch.testing.assert_close(holder.k_proj(a), refs[1](a))  # asked twice: recomputed
    assert holder.q_proj.weight.shape == (16, 16) and holder.v_proj.bias.shape == (8,)


def test_multihead_attention_variants(monkeypatch):
    import hybridgemm.attention as attention_mod

    fused = []
    real = attention_mod.attention_projection
    monkeypatch.setattr(attention_mod, "attention_projection", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    for batch_first in (True, False):
        mha = nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
        stock = copy.deepcopy(mha)
        report = hybridgemm.patch(mha)
        assert report.patched == ["(root)"] and type(mha) is HybridMultiheadAttention
        b, s = 3, 7
        x = torch.randn(b, s, 32) if batch_first else torch.randn(s, b, 32)
        kpm = torch.rand(b, s) < 0.3
        kpm[:, 0] = False
        causal = nn.Transformer.generate_square_subsequent_mask(s)
        cases = [dict(), dict(need_weights=False), dict(key_padding_mask=kpm), dict(attn_mask=causal.bool() * 1.0),
                 dict(attn_mask=causal == float("-inf"), key_padding_mask=kpm, average_attn_weights=False),
                 dict(attn_mask=causal, is_causal=True, need_weights=False),
                 dict(attn_mask=torch.randn(b * 4, s, s))]
        for kw in cases:
            n = len(fused)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, w = mha(x, x, x, **kw)
                ref, rw = stock(x, x, x, **kw)
            assert len(fused) == n + 1, kw
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            assert (w is None) == (rw is None)
            if w is not None:
                torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
        # unbatched, and cross-attention (delegated to the stock forward)
        with torch.no_grad():
            torch.testing.assert_close(mha(x[0], x[0], x[0])[0], stock(x[0], x[0], x[0])[0], rtol=1e-5, atol=1e-6)
            y = torch.randn_like(x)
            n = len(fused)
            torch.testing.assert_close(mha(x, y, y)[0], stock(x, y, y)[0])
            assert len(fused) == n
        assert hybridgemm.unpatch(mha) == ["(root)"] and type(mha) is nn.MultiheadAttention


def test_transformer_encoder_layer_training():
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=48, dropout=0.0, batch_first=True)
    stock = copy.deepcopy(layer)
    report = hybridgemm.patch(layer)
    assert report.patched == ["self_attn"]
    x = torch.randn(2, 5, 32)
    out, ref = layer(x), stock(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(layer.self_attn.in_proj_weight.grad, stock.self_attn.in_proj_weight.grad,
                               rtol=1e-5, atol=1e-6)


def test_nothing_to_patch_and_bad_input():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.warns(UserWarning, match="nothing patched"):
        report = hybridgemm.patch(model)
    assert not report and report.patched == []
    with pytest.raises(ValueError, match="nothing patched"):
        hybridgemm.patch(model, strict=True)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        hybridgemm.patch("model")
    assert hybridgemm.unpatch(model) == []

    class LoraLinear(nn.Linear):
        pass

    attn = nn.Module()
    for n in ("q_proj", "k_proj", "v_proj"):
        attn.add_module(n, LoraLinear(8, 8))
    with pytest.warns(UserWarning, match="not plain nn.Linear"):
        report = hybridgemm.patch(attn)
    assert report.skipped and "LoraLinear" in report.skipped[0][1]


def test_patch_twice_and_no_fuse_option():
    model = _tiny("qwen2", layers=1)
    keys = set(model.state_dict())
    report = hybridgemm.patch(model, fuse_qkv=False, mlp=False, lm_head=False, norm=False)
    assert report.fused_qkv == [] and len(report.patched) == 4
    assert set(model.state_dict()) == keys  # one-by-one swaps keep the checkpoint keys
    with pytest.warns(UserWarning, match="nothing patched"):
        again = hybridgemm.patch(model, mlp=False, lm_head=False, norm=False)
    assert not again
    third = hybridgemm.patch(model)  # what is new still gets patched
    assert third.fused_mlp == ["model.layers.0.mlp"]
    assert [n for n in third.patched if "norm" in n] == [
        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"]
    assert set(model.state_dict()) - keys == set()  # norms keep their weight keys
    hybridgemm.unpatch(model)
    assert all(type(m) not in (HybridLinear, HybridRMSNorm) for m in model.modules())
