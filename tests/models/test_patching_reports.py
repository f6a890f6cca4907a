"""``PatchReport.skipped`` names every module ``hybridgemm.patch`` leaves unpatched or unfused
that a user would expect it to speed up (fusion/models/unpatched.py), with the reason, for the
popular decoder families built from tiny transformers configs; ``strict=True`` raises on any.
Most models are built on the meta device: the report reads only the modules' structure."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

import hybridgemm
from hybridgemm.models import attention_forms
from hybridgemm.models.unpatched import is_decoder_layer
from hybridgemm.norm import GEMMA_NORM_CLASSES, OLMO2_NORM_CLASSES, RMS_NORM_CLASSES

transformers = pytest.importorskip("transformers")

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16}),
    "granite": ("GraniteConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {}),
    "ministral": ("MinistralConfig", {"head_dim": 16}),
    "cwm": ("CwmConfig", {}),
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0]}),
    "ministral3": ("Ministral3Config", {"head_dim": 16}),
    "glm": ("GlmConfig", {"head_dim": 16}),
    "helium": ("HeliumConfig", {"head_dim": 16}),
    "glm4": ("Glm4Config", {"head_dim": 16}),
    "ernie4_5": ("Ernie4_5Config", {"head_dim": 16}),
    "hunyuan": ("HunYuanDenseV1Config", {"head_dim": 16}),
    "exaone4": ("Exaone4Config", {"head_dim": 16}),
    "seed_oss": ("SeedOssConfig", {"head_dim": 16, "attention_bias": True, "residual_dropout": 0.1}),
    "hunyuan_moe": ("HunYuanMoEV1Config", {"head_dim": 16, "num_experts": 4, "moe_topk": 2}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                           "moe_num_shared_experts": 1, "moe_layer_start_index": 0}),
    "stablelm": ("StableLmConfig", {}),
    "cohere": ("CohereConfig", {}),
    "cohere2": ("Cohere2Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "falcon": ("FalconConfig", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "head_dim": 16}),
}

# Does this transformers' Falcon attention take the fused step (5.8-5.25's forms)?
FALCON_FUSED = attention_forms.why_not_attention_form(
    importlib.import_module("transformers.models.falcon.modeling_falcon").FalconAttention) is None
SUPPORTED = ("LlamaDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer, MistralDecoderLayer, GraniteDecoderLayer, "
             "Qwen3MoeDecoderLayer, MixtralDecoderLayer, Qwen2MoeDecoderLayer, GemmaDecoderLayer, Phi3DecoderLayer, "
             "Gemma2DecoderLayer, Gemma3DecoderLayer, Olmo2DecoderLayer, StableLmDecoderLayer, CohereDecoderLayer, "
             "GPTNeoXLayer, FalconDecoderLayer, OlmoeDecoderLayer, Glm4MoeDecoderLayer, Olmo3DecoderLayer, "
             "MinistralDecoderLayer, CwmDecoderLayer, SmolLM3DecoderLayer, Ministral3DecoderLayer, GlmDecoderLayer, "
             "HeliumDecoderLayer, Glm4DecoderLayer, Ernie4_5DecoderLayer, Ernie4_5_MoeDecoderLayer, "
             "HunYuanDenseV1DecoderLayer, HunYuanMoEV1DecoderLayer, Exaone4DecoderLayer, SeedOssDecoderLayer, "
             "Cohere2DecoderLayer")


def _layer(cls: str) -> str:
    return f"decoder layer not fused: its family ({cls}) is not supported by the fused decode step (it supports " \
           f"{SUPPORTED})"


def _norm(cls: str) -> str:
    count = len(RMS_NORM_CLASSES) + len(GEMMA_NORM_CLASSES) + len(OLMO2_NORM_CLASSES)
    return (f"norm not patched: {cls} is not one of the {count} RMSNorm classes of known formula hybridgemm "
            "recognises (hybridgemm.norm.RMS_NORM_CLASSES, GEMMA_NORM_CLASSES, OLMO2_NORM_CLASSES), nor does its "
            "forward compute Llama's formula or OLMo 2's with its weight and variance_epsilon, or Gemma's with its "
            "weight and eps")


def _moe(cls: str) -> str:
    return f"mixture-of-experts layer ({cls}): mixture-of-experts layers are not patched (their router and " \
           "experts run as the stock module computes them)"


ATTENTION = "; hybridgemm fuses separate plain nn.Linear q_proj/k_proj/v_proj (or query/key/value) children, and " \
            "GPT-2's Conv1D c_attn"
MLP = "; hybridgemm patches gated MLPs (plain nn.Linear gate_proj, up_proj and down_proj with a SiLU or GELU " \
      "act_fn), GPT-2's Conv1D c_fc/c_proj and BERT's intermediate.dense"
L = "model.layers.0"

# Every entry patch() reports for the one decoder layer of each family, in report order.
EXPECTED = {
    "llama": [], "qwen2": [], "mistral": [], "qwen3": [],
    "gemma": [],  # (1 + w) RMSNorms folded into the QKV and gate/up GEMMs, GeGLU in the gated kernel
    # its four (1 + w) norms, the post-norms applied to O's and down's outputs; the softcapped
    # attention in the decode attention kernel, of its sliding layers (the one layer here) where
    # the cache's window never fills (window_cache; per call, as for any cache)
    "gemma2": [],
    "granite": [],
    # its norms (weight in fp32) patched, the post-norms applied to O's and down's outputs; its
    # q/k norms over all heads run as modules in the static-cache step, after the Q/K/V GEMM
    "olmo2": [],
    "olmo3": [],  # OLMo 2's layer beside sliding-window ones (its norms recognised by running them)
    "ministral": [], "cwm": [],  # Llama's layer beside sliding-window ones
    "smollm3": [],  # Llama's layer, a NoPE layer beside one with the rotary
    "ministral3": [],  # Llama's layer, its queries scaled per position after the rotary
    "glm": [], "helium": [],  # Llama's layer (GLM's gate/up one linear), the rotary of neighbouring pairs
    "glm4": [],  # GLM's attention and MLP, Gemma 2's post-norm layer under other names
    "ernie4_5": [],  # Llama's layer, GLM's rotary of neighbouring pairs in fp32
    "hunyuan": [],  # Llama's layer, the q/k norms of the rotated heads
    "seed_oss": [],  # Llama's layer, q/k/v biases, dropouts of its attention's and MLP's outputs
    "exaone4": [],  # OLMo 2's layer, per-head q/k norms, a sliding layer with the rotary (its full ones have none)
    # the same attention; its experts run the grouped kernels, its router's linear as it is
    "hunyuan_moe": [("model.layers.0.mlp.gate.wg", "linear not patched: not part of an attention or MLP hybridgemm "
                                                   "recognises")],
    # the same attention; its experts run the grouped kernels, its router (fp32, a selection bias) as it is
    "ernie4_5_moe": [("model.layers.0.mlp.gate", "Ernie4_5_MoeTopKRouter: not a router of one [experts, hidden] "
                                                 "weight without bias")],
    # the layer fused, its LayerNorms called as the modules they are
    "stablelm": [(f"{L}.input_layernorm", _norm("LayerNorm")), (f"{L}.post_attention_layernorm", _norm("LayerNorm"))],
    "cohere": [(f"{L}.input_layernorm", _norm("CohereLayerNorm"))],  # the layer fused, its norm a module
    "cohere2": [(f"{L}.input_layernorm", _norm("Cohere2LayerNorm"))],  # the same, its rotary on sliding layers only
    # Q/K/V one linear already (swapped as it is): Phi-3's layer fused with its stacked gate/up;
    # GPT-NeoX's and Falcon's layers fused, their LayerNorms called as modules (Falcon's where its
    # attention is a form the step computes, transformers 5.8-5.25's; else its layer is reported)
    "phi3": [],
    "gpt_neox": [("gpt_neox.layers.0.input_layernorm", _norm("LayerNorm")),
                 ("gpt_neox.layers.0.post_attention_layernorm", _norm("LayerNorm"))],
    "falcon": [*([] if FALCON_FUSED else [("transformer.h.0", "decoder layer not fused: FalconDecoderLayer.forward is "
                                                              "not a decoder layer this step computes")]),
               ("transformer.h.0.input_layernorm", _norm("LayerNorm"))],
    # the stacked experts run the grouped kernels (fusion/experts.py) inside the fused decode
    # step, the router the dispatcher's GEMM and the routing kernel (fusion/router.py)
    "mixtral": [],
    "qwen3_moe": [],
    "olmoe": [],  # the same, its q/k norms over all heads as OLMo 2's (its Q/K/V clamp unset)
}


def build(kind: str, device: str = "meta", layers: int = 1) -> nn.Module:
    """A tiny causal LM of ``kind`` (random weights on the CPU; none on the meta device)."""
    name, extra = CONFIGS[kind]
    config = getattr(transformers, name)(**{**COMMON, "num_hidden_layers": layers, **extra})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval()


def _patch(model: nn.Module, **kw) -> hybridgemm.PatchReport:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # anything patched in every family: no "nothing patched" warning
        return hybridgemm.patch(model, **kw)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_every_module_left_unfused_is_reported_with_its_reason(kind):
    report = _patch(build(kind))
    assert report.skipped == EXPECTED[kind], "\n".join(report.skipped_lines())
    assert report.patched  # each family gets something (the LM head at least)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_strict_raises_naming_every_skipped_module_and_passes_without_any(kind):
    model = build(kind)
    if not EXPECTED[kind]:
        report = hybridgemm.patch(model, strict=True)
        assert report.skipped == [] and len(report.fused_layers) == 1
        return
    with pytest.raises(ValueError, match="strict=True") as info:
        hybridgemm.patch(model, strict=True)
    message = str(info.value)
    assert f"{len(EXPECTED[kind])} modules left unpatched or unfused" in message
    assert all(f"{name}: {why}" in message for name, why in EXPECTED[kind]), message
    assert "hybridgemm.patch: patched" in message  # what was patched stays patched, as the summary says


def test_per_head_qk_norms_of_a_2d_weight_are_reported_as_norms():
    """Cohere's use_qk_norm: its q/k norms are LayerNorms over [heads, head_dim] (a 2-D weight),
    named as norms in the report, beside the reason its attention step is not taken."""
    name, extra = CONFIGS["cohere"]
    config = getattr(transformers, name)(**{**COMMON, **extra, "use_qk_norm": True})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    report = _patch(model)
    reasons = dict(report.skipped)
    assert reasons[f"{L}.self_attn.q_norm"] == _norm("CohereLayerNorm") == reasons[f"{L}.self_attn.k_norm"]
    assert "use_qk_norm" in reasons[L] and report.fused_layers == [L]


def test_rotated_head_norms_of_another_kind_keep_hunyuans_attention_on_the_module_and_say_why():
    """Hunyuan's key_layernorm swapped for a LayerNorm (not an RMSNorm the epilogue computes): the
    layer stays fused, its attention on the module's computation, and the report names the norm by
    its Hunyuan name."""
    name, extra = CONFIGS["hunyuan"]
    config = getattr(transformers, name)(**{**COMMON, **extra})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.model.layers[0].self_attn.key_layernorm = nn.LayerNorm(16)
    report = _patch(model)
    reasons = dict(report.skipped)
    assert "its key_layernorm is not an RMSNorm over head_dim" in reasons[L] and report.fused_layers == [L]
    assert report.fused_attention == []


def test_every_layer_is_reported_and_later_layers_alike():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=3, n_head=4,
                                                                n_positions=32)).eval()
    report = _patch(gpt2)
    names = [n for n, _ in report.skipped]
    assert names == [f"transformer.h.{i}{part}" for i in range(3) for part in ("", ".ln_1", ".ln_2")]
    assert all("embed" not in n and "rotary" not in n and "dropout" not in n for n in names)


@pytest.mark.parametrize("kind", ["gpt_neox", "mixtral"])
def test_a_model_left_alone_still_computes_what_it_did(kind):
    """What the report lists is indeed left as it was: the patched model's logits on the CPU are
    the stock model's (fp32, fresh random weights and tokens)."""
    torch.manual_seed(0)
    stock = build(kind, "cpu", layers=2)
    model = copy.deepcopy(stock)
    report = _patch(model)
    listed = dict(report.skipped)
    stock_modules = dict(stock.named_modules())
    for name in listed:
        if name.endswith(("self_attn", "mlp")):
            assert type(model.get_submodule(name)) is type(stock_modules[name])
            assert all(type(c) is type(stock_modules[name].get_submodule(n))
                       for n, c in model.get_submodule(name).named_children())
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)


def test_parts_switched_off_are_not_reported():
    """attention=False, mlp=False, norm=False, layers=False: what the caller left out is no
    skip; the other parts still are."""
    report = _patch(build("gpt_neox"), attention=False, layers=False)
    assert [n for n, _ in report.skipped] == ["gpt_neox.layers.0.input_layernorm",
                                              "gpt_neox.layers.0.post_attention_layernorm"]
    report = _patch(build("gpt_neox"), attention=False, norm=False, layers=False)
    assert report.skipped == [] and "gpt_neox.layers.0.attention.query_key_value" not in report.patched
    report = _patch(build("cohere"), attention=False, layers=False)
    assert [n for n, _ in report.skipped] == [f"{L}.input_layernorm"]
    report = _patch(build("mixtral"), mlp=False, norm=False)
    assert [n for n, _ in report.skipped] == [L]
    report = _patch(build("llama"), attention=False, mlp=False, norm=False, layers=False)
    assert report.skipped == [] and report.patched == ["lm_head"]


def test_unrecognised_linears_and_lm_head_are_reported():
    class LoraLinear(nn.Linear):
        pass

    def lora(lin: nn.Linear) -> LoraLinear:
        new = LoraLinear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        return new

    model = build("llama")
    attn = model.model.layers[0].self_attn
    attn.o_proj = lora(attn.o_proj)  # Q/K/V still fuse; O is left alone
    model.lm_head = lora(model.lm_head)
    model.model.layers[0].extra_proj = nn.Linear(64, 64, device="meta")  # a linear of no recognised part
    report = _patch(model)
    reasons = dict(report.skipped)
    assert report.fused_qkv == [f"{L}.self_attn"]
    assert reasons[f"{L}.self_attn.o_proj"] == "linear not patched: LoraLinear is not a plain nn.Linear"
    assert reasons[f"{L}.extra_proj"] == "linear not patched: not part of an attention or MLP hybridgemm recognises"
    assert reasons["lm_head"] == "LM head not patched: LoraLinear is not a plain nn.Linear"
    # the layer keeps its own reason (its O projection), no second entry
    assert reasons[L] == "decoder layer not fused: its o_proj is a LoraLinear, not a patched or row-parallel nn.Linear"
    assert [n for n, _ in report.skipped].count(L) == 1


def test_a_module_patch_listed_itself_is_not_listed_again():
    """An attention whose q/k/v are LoRA linears is reported once, by the patching rules (not
    again by the attention rule, nor its linears one by one)."""
    class LoraLinear(nn.Linear):
        pass

    model = build("mistral")
    attn = model.model.layers[0].self_attn
    for n in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, n)
        setattr(attn, n, LoraLinear(old.in_features, old.out_features, bias=False, device="meta"))
    report = _patch(model)
    names = [n for n, _ in report.skipped]
    assert names == [f"{L}.self_attn", L], report.skipped_lines()
    assert "not plain nn.Linear" in report.skipped[0][1] and "Q/K/V are not fused" in report.skipped[1][1]


def test_encoders_and_plain_modules_have_no_decoder_layers():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=48))
    assert not any(is_decoder_layer(m) for m in bert.modules())
    assert _patch(bert).skipped == []
    encoder = nn.TransformerEncoderLayer(32, 4, dim_feedforward=48, batch_first=True)
    assert _patch(encoder).skipped == []


def test_patching_twice_reports_nothing_new():
    model = build("gemma2")
    first = _patch(model)
    with pytest.warns(UserWarning, match="nothing patched"):
        again = hybridgemm.patch(model)
    assert again.skipped == first.skipped  # what is left alone is still left alone, the same entries
    assert sorted(again.already_patched) == sorted(first.patched)


class _Attention(nn.Module):
    is_causal = True

    def __init__(self, d: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))


class _GatedExpert(nn.Module):
    def __init__(self, d: int, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        for n in names:
            self.add_module(n, nn.Linear(d, d, bias=False))
        self.act_fn = nn.SiLU()

    def forward(self, x):  # Llama's statements (the w1/w3/w2 layout is not called here)
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class _MoE(nn.Module):
    def __init__(self, d: int, names):
        super().__init__()
        self.gate = nn.Linear(d, 4, bias=False)
        self.experts = nn.ModuleList(_GatedExpert(d, names) for _ in range(4))


class _Layer(nn.Module):
    def __init__(self, d: int, names):
        super().__init__()
        self.self_attn = _Attention(d)
        self.block_sparse_moe = _MoE(d, names)
        self.ln = nn.LayerNorm(d)


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_a_list_of_experts_counts_as_patched_where_every_expert_is(names):
    """An older mixture-of-experts layout (``block_sparse_moe`` holding a router and a list of
    expert MLPs): experts that are gated MLPs get patched one by one, and the block is not
    listed, only its router; experts of another layout leave the block listed."""
    model = nn.ModuleList([_Layer(32, names)])
    report = _patch(model)
    reasons = dict(report.skipped)
    assert reasons["0"] == _layer("_Layer") and reasons["0.ln"] == _norm("LayerNorm")
    if names[0] == "gate_proj":
        assert len(report.fused_mlp) == 4 and "0.block_sparse_moe" not in reasons
        assert reasons["0.block_sparse_moe.gate"] == \
            "linear not patched: not part of an attention or MLP hybridgemm recognises"
        assert len(report.skipped) == 3
    else:
        assert report.fused_mlp == [] and reasons["0.block_sparse_moe"] == _moe("_MoE")
        assert len(report.skipped) == 3  # nothing inside the listed block again
