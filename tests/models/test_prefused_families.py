"""Families whose Q/K/V (and Phi-3's gate/up) are one linear in the checkpoint already: Phi-3,
GPT-NeoX, Falcon (both layer forms). ``patch`` runs those linears through the dispatcher as
they are, Phi-3's stacked gate/up through the gated kernel, GPT-NeoX's and Falcon's GELU in the
first MLP GEMM's epilogue (CPU, fp32: the patched model computes what the stock one does;
which modules changed, the state dict, unpatch, greedy generation).
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from hybridgemm.linear_layer import HybridLinear
from hybridgemm.mlp import HybridPrefusedGatedMLP, HybridTwoLayerMLP

transformers = pytest.importorskip("transformers")

VOCAB = 97
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
CONFIGS = {
    "phi3": lambda: transformers.Phi3Config(**TINY, intermediate_size=96, num_key_value_heads=2, pad_token_id=0),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**TINY, intermediate_size=96),
    "falcon": lambda: transformers.FalconConfig(**TINY, new_decoder_architecture=True, num_kv_heads=2),
    "falcon_parallel_mqa": lambda: transformers.FalconConfig(**TINY, multi_query=True, parallel_attn=True, bias=True),
}
# (attention, its Q/K/V linear, its output linear, the MLP, what patch makes of the MLP)
PARTS = {
    "phi3": ("model.layers.{}.self_attn", "qkv_proj", "o_proj", "model.layers.{}.mlp", HybridPrefusedGatedMLP),
    "gpt_neox": ("gpt_neox.layers.{}.attention", "query_key_value", "dense", "gpt_neox.layers.{}.mlp",
                 HybridTwoLayerMLP),
    "falcon": ("transformer.h.{}.self_attention", "query_key_value", "dense", "transformer.h.{}.mlp",
               HybridTwoLayerMLP),
    "falcon_parallel_mqa": ("transformer.h.{}.self_attention", "query_key_value", "dense", "transformer.h.{}.mlp",
                            HybridTwoLayerMLP),
}


def _models(kind: str):
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones
        for p in stock.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    patched = copy.deepcopy(stock)
    return stock, patched, hybridgemm.patch(patched)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_prefused_projections_are_dispatched_and_compute_what_stock_does(kind):
    stock, patched, report = _models(kind)
    attn, qkv, out, mlp, mlp_class = PARTS[kind]
    for i in range(2):
        a = patched.get_submodule(attn.format(i))
        assert type(a._modules[qkv]) is HybridLinear and type(a._modules[out]) is HybridLinear
        assert type(patched.get_submodule(mlp.format(i))) is mlp_class
    if mlp_class is HybridTwoLayerMLP:
        first = patched.get_submodule(mlp.format(0)).dense_h_to_4h
        # the MLP's GELU in dense_h_to_4h's epilogue, named on the MLP (what it applies after a wrapper there)
        assert type(first) is HybridLinear and first.activation is None
        assert patched.get_submodule(mlp.format(0)).activation == "gelu"
    else:
        assert report.fused_mlp == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(patched.generate(ids[:1, :4], max_new_tokens=5, do_sample=False),
                           stock.generate(ids[:1, :4], max_new_tokens=5, do_sample=False))
    sd, ref = patched.state_dict(), stock.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_unpatch_restores_every_class(kind):
    stock, patched, _ = _models(kind)
    hybridgemm.unpatch(patched)
    types = {n: type(m) for n, m in stock.named_modules()}
    assert {n: type(m) for n, m in patched.named_modules()} == types  # FalconLinear comes back too


def test_a_wrapped_stacked_gate_up_runs_its_own_computation():
    """Phi-3's gate_up_proj hooked after patching: the MLP calls it (the hook runs) and computes
    the stock product."""
    stock, patched, _ = _models("phi3")
    seen = []
    patched.model.layers[0].mlp.gate_up_proj.register_forward_hook(lambda *a: seen.append(1))
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    assert seen == [1]


@pytest.mark.parametrize("kind", ["gpt_neox", "falcon_parallel_mqa", "bert"])
def test_lora_after_patch_on_the_activated_linear_goes_in_before_the_activation(kind):
    """A PEFT LoRA layer put over the first MLP linear after ``patch`` (whose GELU the patched
    MLP runs in that GEMM's epilogue): its term goes in before the GELU, as in the stock model
    with the same adapter."""
    peft = pytest.importorskip("peft")
    if kind == "bert":
        torch.manual_seed(0)
        stock = transformers.BertModel(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)).eval()
        patched = copy.deepcopy(stock)
        hybridgemm.patch(patched)
        target = "intermediate.dense"
    else:
        stock, patched, _ = _models(kind)
        target = "dense_h_to_4h"
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[target], init_lora_weights=False)
    torch.manual_seed(1)
    stock = peft.get_peft_model(stock, config)
    torch.manual_seed(1)
    patched = peft.get_peft_model(patched, config)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if kind == "bert":
            got, want = patched(input_ids=ids).last_hidden_state, stock(input_ids=ids).last_hidden_state
            with stock.disable_adapter():
                base = stock(input_ids=ids).last_hidden_state
        else:
            got, want = patched(ids).logits, stock(ids).logits
            with stock.disable_adapter():
                base = stock(ids).logits
    assert (want - base).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hf_config_tuning_takes_the_prefused_shapes(tmp_path):
    """What autotune --hf-config would tune for Phi-3: the fused projections as the checkpoint
    holds them, gate/up as the gated kernel's halves."""
    from hybridgemm.models.gemm_shapes import patched_gemms

    _, patched, _ = _models("phi3")
    attention, rest = patched_gemms(patched)
    assert [(s.name, s.n, s.k) for s in attention] == [("qkv", 128, 64), ("o", 64, 64)]
    assert [(s.name, s.n, s.k) for s in rest] == [("gate_up", 96, 64), ("down", 64, 96), ("lm_head", VOCAB, 64)]
