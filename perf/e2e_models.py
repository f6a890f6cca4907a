"""Decoder models for the end-to-end benchmark (perf/bench_e2e.py), built from a transformers
config with random weights (nothing is downloaded), and the calls whose spelling differs
across transformers versions.

Sizes: hidden size, heads, KV heads, head dim, attention biases and, for a mixture of
experts, the expert count, experts per token and expert width come from
autotune_cache/presets.py; :data:`SIZES` adds what a whole model needs beyond those (family,
dense MLP width, layer count, vocabulary, RoPE base), from each model's published
``config.json``, and :data:`FAMILIES` how each family's transformers config spells them.

Version differences are looked up from signatures, not version numbers, so that one code path
serves transformers 4.4x and 5.x: the cache keyword of ``forward`` (``past_key_values``, or
``cache`` since 5.x), whether ``forward`` takes ``cache_position`` (4.x: the static cache
writes there; 5.x: the cache keeps its own position), ``logits_to_keep`` or its older name
``num_logits_to_keep``, and ``StaticCache``'s constructor (batch size, device and dtype up
front in 4.x; allocated on first use in 5.x). ``transformers`` is imported on first use: it
is a test dependency, not one of the package's.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridgemm.autotune_cache.presets import get_preset
from hybridgemm.fp8_experts import SCALE_SUFFIX
from hybridgemm.fp8_modules import SCALE_NAMES


@dataclass(frozen=True)
class ModelSizes:
    family: str  # a key of FAMILIES
    intermediate: int | None  # the dense MLP's width (gate, up: hidden -> intermediate; down: back); see SIZES
    layers: int
    vocab: int
    rope_theta: float
    rms_eps: float
    max_positions: int


@dataclass(frozen=True)
class Family:
    """How a family's transformers config is filled from a preset and :class:`ModelSizes`."""

    config: str  # the transformers config class
    head_dim: bool  # its model reads config.head_dim (else heads x head_dim must be the hidden size)
    qkv_bias: bool | None  # the q/k/v bias its attention hard-codes; None: set from the preset (attention_bias)
    # Mixture of experts: its config's fields for the expert count, experts per token and expert width
    experts: tuple[str, str, str] | None = None
    fixed: tuple[tuple[str, object], ...] = ()  # fields set alike for every model of the family here
    bias_field: str = "attention_bias"  # the config field of the q/k/v biases (where qkv_bias is None)
    bias_sets_o: bool = True  # that field switches o_proj's bias too (not GLM's)
    eps_field: str = "rms_norm_eps"  # the config field of the norms' eps
    # the config field of the KV head count (None: the config has as many as heads), and of a
    # multi-query switch (one KV head) where it has one
    kv_heads_field: str | None = "num_key_value_heads"
    multi_query_field: str | None = None
    intermediate_field: str = "intermediate_size"  # the config field of the dense MLP's width


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", head_dim=True, qkv_bias=None, fixed=(("mlp_bias", False),)),
    "qwen2": Family("Qwen2Config", head_dim=False, qkv_bias=True, fixed=(("use_sliding_window", False),)),
    "qwen3": Family("Qwen3Config", head_dim=True, qkv_bias=None, fixed=(("use_sliding_window", False),)),
    # Gemma: (1 + w) RMSNorms, GeGLU (tanh GELU), embeddings scaled by sqrt(hidden); head_dim 256
    "gemma": Family("GemmaConfig", head_dim=True, qkv_bias=None, fixed=(("hidden_activation", "gelu_pytorch_tanh"),)),
    # Granite 3.x: the multipliers of its published configs (embeddings x 12, attention scale 1/128,
    # sublayer outputs x 0.22 before each residual add, logits / 16)
    "granite": Family("GraniteConfig", head_dim=False, qkv_bias=None,
                      fixed=(("embedding_multiplier", 12.0), ("attention_multiplier", 0.0078125),
                             ("residual_multiplier", 0.22), ("logits_scaling", 16.0), ("mlp_bias", False))),
    # Gemma 2: Gemma's norms and GeGLU, post-norms, sliding-window layers (every other one), the
    # attention and final-logit softcaps of its published configs
    "gemma2": Family("Gemma2Config", head_dim=True, qkv_bias=None,
                     fixed=(("hidden_activation", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256),
                            ("sliding_window", 4096), ("attn_logit_softcapping", 50.0),
                            ("final_logit_softcapping", 30.0))),
    # Gemma 3: Gemma 2's norms, GeGLU and post-norms, q/k norms ((1 + w) over each head), five
    # sliding-window layers (window 1024) to each full one, no softcaps: its published configs
    "gemma3": Family("Gemma3TextConfig", head_dim=True, qkv_bias=None,
                     fixed=(("hidden_activation", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256),
                            ("sliding_window", 1024))),
    # Phi-3: Q/K/V and gate/up one linear each in the checkpoint; heads of 96 (its hidden size / heads)
    "phi3": Family("Phi3Config", head_dim=False, qkv_bias=False, fixed=(("pad_token_id", 32000),)),
    # OLMo 2: no input norms, each sublayer's output normalised before its residual add, q/k
    # norms over all heads (its RMSNorms scale by the weight in fp32)
    "olmo2": Family("Olmo2Config", head_dim=False, qkv_bias=None),
    # OLMo 3: OLMo 2's layer, three sliding-window layers (window 4096) to each full one
    "olmo3": Family("Olmo3Config", head_dim=False, qkv_bias=None, fixed=(("sliding_window", 4096),)),
    # Ministral (8B): Llama's layer, sliding-window layers of 32768 (MinistralConfig's default
    # layer types: every layer sliding; the release interleaves full layers)
    "ministral": Family("MinistralConfig", head_dim=True, qkv_bias=None, fixed=(("sliding_window", 32768),)),
    # Phi-4-mini: Phi-3's layer, the rotary over the first three quarters of each head's columns
    "phi4": Family("Phi3Config", head_dim=False, qkv_bias=False,
                   fixed=(("pad_token_id", 199999), ("partial_rotary_factor", 0.75))),
    # SmolLM3: Llama's layer, every fourth layer without positional embedding (its NoPE layers), no
    # sliding window (SmolLM3-3B's published config)
    "smollm3": Family("SmolLM3Config", head_dim=False, qkv_bias=None,
                      fixed=(("use_sliding_window", False), ("no_rope_layer_interval", 4))),
    # GLM (GLM-4-9B's chat-hf form): Llama's layer with Phi-3's one gate/up linear, q/k/v biases (no o
    # bias), the rotary over the first half of each head, neighbouring columns paired
    "glm": Family("GlmConfig", head_dim=True, qkv_bias=None, bias_sets_o=False),
    # GLM-4 (0414): GLM's attention and MLP, each sublayer's output normalised before its residual add
    "glm4": Family("Glm4Config", head_dim=True, qkv_bias=None, bias_sets_o=False),
    # Ernie 4.5 (0.3B): Llama's layer, GLM's rotary of neighbouring pairs over whole heads in fp32 from
    # fp32 cos/sin, no biases (use_bias switches every linear's)
    "ernie4_5": Family("Ernie4_5Config", head_dim=True, qkv_bias=False, fixed=(("use_bias", False),)),
    # Ministral 3 (its text model): Llama's layer, YaRN's rotary, the queries scaled per position past
    # 16384 (Ministral3Config's defaults: Ministral 3 8B's published text config)
    "ministral3": Family("Ministral3Config", head_dim=True, qkv_bias=False),
    # StableLM: LayerNorms, the rotary over the first quarter of each head's columns, the residual
    # sequential (StableLM 2 1.6B's and 3B-4E1T's published configs)
    "stablelm": Family("StableLmConfig", head_dim=False, qkv_bias=None, bias_field="use_qkv_bias",
                       eps_field="layer_norm_eps",
                       fixed=(("partial_rotary_factor", 0.25), ("use_parallel_residual", False),
                              ("qk_layernorm", False))),
    # Cohere (Aya 23): its LayerNorm, the attention and the MLP in parallel, the rotary of
    # neighbouring columns, logits scaled by 1/16 (its published config)
    "cohere": Family("CohereConfig", head_dim=False, qkv_bias=None, eps_field="layer_norm_eps",
                     fixed=(("use_qk_norm", False), ("logit_scale", 0.0625))),
    # GPT-NeoX (Pythia): LayerNorms, Q/K/V one linear of [q | k | v] per head, the rotary over the
    # first quarter of each head, the attention and the MLP (GELU) in parallel, biases throughout
    "gpt_neox": Family("GPTNeoXConfig", head_dim=False, qkv_bias=None, eps_field="layer_norm_eps", kv_heads_field=None,
                       fixed=(("rotary_pct", 0.25), ("use_parallel_residual", True), ("hidden_act", "gelu"))),
    # Falcon (7B): LayerNorms, Q/K/V one linear (multi-query: one KV head), the attention and the
    # MLP (GELU) of one normalised input in parallel, no biases (its published config)
    "falcon": Family("FalconConfig", head_dim=False, qkv_bias=None, bias_field="bias", eps_field="layer_norm_epsilon",
                     kv_heads_field="num_kv_heads", multi_query_field="multi_query",
                     intermediate_field="ffn_hidden_size",
                     fixed=(("parallel_attn", True), ("new_decoder_architecture", False), ("alibi", False))),
    # Qwen3MoeConfig's signature has no head_dim, but its attention reads config.head_dim when set.
    # Every layer sparse (no dense mlp_only_layers), top-k weights renormalised: Qwen3-MoE's published configs.
    "qwen3_moe": Family("Qwen3MoeConfig", head_dim=True, qkv_bias=None,
                        experts=("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
                        fixed=(("use_sliding_window", False), ("norm_topk_prob", True), ("decoder_sparse_step", 1),
                               ("mlp_only_layers", []))),
    # Mixtral v0.1: full attention (sliding_window null); intermediate_size is each expert's width.
    "mixtral": Family("MixtralConfig", head_dim=True, qkv_bias=False,
                      experts=("num_local_experts", "num_experts_per_tok", "intermediate_size"),
                      fixed=(("sliding_window", None),)),
}

# intermediate: a dense model's MLP width; for Qwen3-30B-A3B config.json's intermediate_size,
# the width of the dense MLP of the layers listed in mlp_only_layers (none: every layer runs
# the experts); Mixtral has no dense MLP (its intermediate_size is the experts' width, from the
# preset). Bytes of the whole model in bf16: Qwen3-30B-A3B ~60 GB, Mixtral-8x7B ~93 GB, so
# bench_e2e (two bf16 copies, and an fp32 one in the error modes) runs them with --layers.
SIZES: dict[str, ModelSizes] = {
    "qwen2.5-7b": ModelSizes("qwen2", 18944, 28, 152064, 1e6, 1e-6, 32768),
    "llama3-8b": ModelSizes("llama", 14336, 32, 128256, 5e5, 1e-5, 8192),
    "llama3-70b": ModelSizes("llama", 28672, 80, 128256, 5e5, 1e-5, 8192),  # ~141 GB in bf16: tensor parallel only
    "qwen3-8b": ModelSizes("qwen3", 12288, 36, 151936, 1e6, 1e-6, 40960),  # q/k norms per head
    "granite-8b": ModelSizes("granite", 12800, 40, 49155, 1e7, 1e-5, 131072),  # Granite 3.1 8B; LM head tied
    "phi3-mini": ModelSizes("phi3", 8192, 32, 32064, 1e4, 1e-5, 4096),  # Phi-3-mini-4k
    "gemma2-9b": ModelSizes("gemma2", 14336, 42, 256000, 1e4, 1e-6, 8192),  # its LM head tied in the release
    "gemma-7b": ModelSizes("gemma", 24576, 28, 256000, 1e4, 1e-6, 8192),  # its LM head tied in the release
    "gemma3-4b": ModelSizes("gemma3", 10240, 34, 262208, 1e6, 1e-6, 131072),  # its LM head tied in the release
    "olmo2-7b": ModelSizes("olmo2", 11008, 32, 100352, 5e5, 1e-6, 4096),  # OLMo-2-1124-7B
    "olmo3-7b": ModelSizes("olmo3", 11008, 32, 100278, 5e5, 1e-6, 65536),  # Olmo-3-1025-7B
    "ministral-8b": ModelSizes("ministral", 12288, 36, 131072, 1e8, 1e-5, 32768),  # Ministral-8B-Instruct-2410
    "phi4-mini": ModelSizes("phi4", 8192, 32, 200064, 1e4, 1e-5, 131072),  # its LM head tied in the release
    "smollm3-3b": ModelSizes("smollm3", 11008, 36, 128256, 5e6, 1e-6, 65536),  # its LM head tied in the release
    "ministral3-8b": ModelSizes("ministral3", 14336, 34, 131072, 1e6, 1e-5, 262144),  # Ministral-3-8B-*-2512
    "glm4-9b": ModelSizes("glm", 13696, 40, 151552, 1e4, 1.5625e-7, 131072),  # glm-4-9b-chat-hf
    "glm4-9b-0414": ModelSizes("glm4", 13696, 40, 151552, 1e4, 1e-5, 32768),  # GLM-4-9B-0414
    "ernie4.5-0.3b": ModelSizes("ernie4_5", 3072, 18, 103424, 5e5, 1e-5, 131072),  # its LM head tied in the release
    "stablelm-2-1.6b": ModelSizes("stablelm", 5632, 24, 100352, 1e4, 1e-5, 4096),  # q/k/v biases
    "stablelm-3b": ModelSizes("stablelm", 6912, 32, 50304, 1e4, 1e-5, 4096),  # StableLM-3B-4E1T; heads of 80
    "aya-23-8b": ModelSizes("cohere", 14336, 32, 256000, 1e4, 1e-5, 8192),  # its LM head tied in the release
    "pythia-6.9b": ModelSizes("gpt_neox", 16384, 32, 50432, 1e4, 1e-5, 2048),
    "falcon-7b": ModelSizes("falcon", 18176, 32, 65024, 1e4, 1e-5, 2048),
    "qwen3-30b-a3b": ModelSizes("qwen3_moe", 6144, 48, 151936, 1e6, 1e-6, 40960),  # q/k norms; 128 experts, 8 a token
    "mixtral-8x7b": ModelSizes("mixtral", None, 32, 32000, 1e6, 1e-5, 32768),  # 8 experts, 2 a token
}


def model_names() -> list[str]:
    return list(SIZES)


def is_moe(name: str) -> bool:
    """Is model ``name``'s MLP a mixture of experts?"""
    return get_preset(canonical_name(name)).moe


def dense_model_names() -> list[str]:
    """The models whose decoder layers have a dense gated MLP (the benchmarks that time or
    shard gate/up/down take only these; GPT-NeoX's MLP is not gated)."""
    return [name for name in SIZES if get_preset(name).intermediate is not None]


def canonical_name(name: str) -> str:
    """The benchmark's name for ``name`` (case and ``_``/``-`` do not matter, as for presets);
    ``ValueError`` naming the known models otherwise."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(SIZES)}")
    return key


def hf_config(name: str, layers: int | None = None):
    """The transformers config of model ``name`` (see :data:`SIZES`), ``layers`` decoder
    layers (default: the model's own count), filled as its family's :class:`Family` says.
    Untied LM head; q/k/v biases as the preset has them (set through ``attention_bias``, or
    checked against what the family's attention hard-codes); ``head_dim`` set where the family's
    model reads it (a hidden size other than heads x head_dim needs that); the experts of a
    mixture-of-experts preset."""
    import transformers

    key = canonical_name(name)
    preset, sizes = get_preset(key), SIZES[key]
    family = FAMILIES[sizes.family]
    if not family.head_dim and preset.hidden != preset.heads * preset.head_dim:
        raise ValueError(f"{name}: hidden {preset.hidden} != heads x head_dim, and {family.config} has no head_dim")
    if family.qkv_bias is not None and family.qkv_bias != preset.qkv_bias:
        raise ValueError(f"{name}: {family.config}'s attention has q/k/v biases {family.qkv_bias}, the preset "
                         f"{preset.qkv_bias}")
    if (family.experts is not None) != preset.moe or (family.experts is None and sizes.intermediate is None):
        raise ValueError(f"{name}: {family.config} and the preset disagree on whether the model is a mixture of "
                         "experts (a dense model needs its MLP width)")
    if family.multi_query_field is not None:
        kv = {family.multi_query_field: preset.kv_heads == 1}
        if preset.kv_heads != 1:
            kv[family.kv_heads_field] = preset.kv_heads
    elif family.kv_heads_field is not None:
        kv = {family.kv_heads_field: preset.kv_heads}
    elif preset.kv_heads != preset.heads:
        raise ValueError(f"{name}: {family.config} has as many key/value heads as heads, the preset "
                         f"{preset.kv_heads} of {preset.heads}")
    else:
        kv = {}
    kw = dict(hidden_size=preset.hidden, num_attention_heads=preset.heads, **kv,
              num_hidden_layers=layers or sizes.layers, vocab_size=sizes.vocab,
              max_position_embeddings=sizes.max_positions, rope_theta=sizes.rope_theta,
              tie_word_embeddings=False, **{family.eps_field: sizes.rms_eps}, **copy.deepcopy(dict(family.fixed)))
    if sizes.intermediate is not None:
        kw[family.intermediate_field] = sizes.intermediate
    if family.head_dim:
        kw["head_dim"] = preset.head_dim
    if family.qkv_bias is None:
        if family.bias_field == "attention_bias" and family.bias_sets_o and preset.o_bias != preset.qkv_bias:
            # (attention_bias switches o_proj's bias with q/k/v's in every family here that reads it)
            raise ValueError(f"{name}: {family.config}'s attention_bias sets the q/k/v and o biases alike, the preset "
                             f"has q/k/v {preset.qkv_bias} and o {preset.o_bias}")
        kw[family.bias_field] = preset.qkv_bias
    if family.experts is not None:
        kw.update(zip(family.experts, (preset.experts, preset.experts_per_token, preset.expert_intermediate)))
    return getattr(transformers, family.config)(**kw)


def rope_theta(config) -> float | None:
    """The RoPE base of ``config``: ``rope_theta`` (4.x) or ``rope_parameters["rope_theta"]`` (5.x)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return theta


# Families transformers runs with its eager attention only (Gemma 2: its attention softcap).
EAGER_ONLY = ("gemma2",)


def build_model(config, dtype: torch.dtype, device) -> nn.Module:
    """A causal LM of ``config`` with random weights (transformers' own init, from the global
    torch seed), created directly on ``device`` in ``dtype`` (no full-size copy in another
    dtype or on the host first), SDPA attention (eager for :data:`EAGER_ONLY`), eval mode.
    RoPE's inverse frequencies stay fp32, as from_pretrained leaves them."""
    import transformers

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation="eager" if config.model_type in EAGER_ONLY else "sdpa")
    finally:
        torch.set_default_dtype(old)
    if any(p.dtype != dtype for p in model.parameters()):  # a version that picks the dtype itself
        model.to(dtype)
    return model.eval()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds: a tensor subclass that flattens into inner tensors (torchao's
    quantized weights: data, scales, zero points) counts theirs, whatever dtype it reports."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


# What a decode step reads of each stacked-experts module (:func:`decode_weight_bytes`): a
# count of experts for every such module, or a function of (module name, its expert count).
ExpertsRead = float | Callable[[str, int], float] | None


def stacked_experts(mod: nn.Module) -> int | None:
    """The expert count of a stacked-experts module (transformers' ``MixtralExperts``,
    ``Qwen3MoeExperts``, and hybridgemm's patched class of them: 3-D parameters ``gate_up_proj``
    and ``down_proj`` with one leading size, the experts); None for any other module."""
    up, down = mod._parameters.get("gate_up_proj"), mod._parameters.get("down_proj")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3 or up.shape[0] != down.shape[0]:
        return None
    return up.shape[0]


def decode_weight_bytes(model: nn.Module, experts_read: ExpertsRead = None) -> int:
    """Bytes of the weights one decode step reads: every parameter once (shared ones once),
    and the FP8 scales of weights ``patch(weights="fp8")`` quantized (their buffers,
    fusion/fp8_modules.SCALE_NAMES; of FP8 experts, fusion/fp8_experts.SCALE_SUFFIX), except the
    input embedding table, of which a step reads
    one row per token, unless the LM head is tied to it (then the head streams all of it).

    Of a stacked-experts module (:func:`stacked_experts`, E experts) a step reads only the
    experts its tokens are routed to, which depends on the routing: ``experts_read`` says how
    many, as a number for every such module or a function of (the module's name, E); the
    parameters of the module whose leading size is E count that many E-ths (at most all of
    them). None: every expert, the bytes of a step that reaches them all. A fractional count
    (an expectation) gives the nearest whole number of bytes."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = set()
    if emb is not None and not (head is not None and head.weight is emb.weight):
        skip.add(id(emb.weight))
    share: dict[int, float] = {}  # id of a per-expert parameter: the fraction of it a step reads
    if experts_read is not None:
        for name, mod in model.named_modules():
            experts = stacked_experts(mod)
            if experts is None:
                continue
            read = experts_read(name, experts) if callable(experts_read) else experts_read
            if not read >= 0:  # NaN too
                raise ValueError(f"decode_weight_bytes: {read} experts read of {name}")
            for p in (*mod.parameters(recurse=False), *mod.buffers(recurse=False)):
                if p.dim() >= 1 and p.shape[0] == experts:
                    share[id(p)] = min(read, experts) / experts
    tensors = {id(p): p for p in model.parameters() if id(p) not in skip}
    tensors.update({id(b): b for name, b in model.named_buffers()
                    if name.rpartition(".")[2] in SCALE_NAMES or name.endswith(SCALE_SUFFIX)})
    return round(sum(tensor_bytes(t) * share.get(key, 1.0) for key, t in tensors.items()))


def experts_per_token(config) -> int | None:
    """How many experts each token is routed to (``num_experts_per_tok``) in a
    mixture-of-experts config; None for a dense one."""
    k = getattr(config, "num_experts_per_tok", None)
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None


def expected_experts(experts: int, per_token: int, tokens: int) -> float:
    """Expected number of distinct experts ``tokens`` tokens reach when each is routed to
    ``per_token`` of ``experts`` at random, uniformly and independently: an expert is missed by
    one token with probability 1 - k/E, by all of them with (1 - k/E)^B, so E * (1 - (1 - k/E)^B)
    (k at B = 1, towards E as B grows)."""
    if not 0 < per_token <= experts or tokens < 0:
        raise ValueError(f"expected_experts: {per_token} of {experts} experts for {tokens} tokens")
    return experts * (1 - (1 - per_token / experts) ** tokens)


def uniform_experts_read(config, tokens: int) -> ExpertsRead:
    """``experts_read`` of :func:`decode_weight_bytes` for a forward of ``tokens`` tokens under
    uniform routing (:func:`expected_experts`, per stacked-experts module); None (every weight
    read) for a dense ``config``."""
    k = experts_per_token(config)
    return None if k is None else (lambda name, experts: expected_experts(experts, k, tokens))


def floor_assumption(config, tokens: int) -> str:
    """What the bytes of :func:`uniform_experts_read` assume, for a log or a CSV cell: "" for a
    dense ``config`` (every weight read once), else the expected experts a layer reads."""
    k = experts_per_token(config)
    experts = next((e for e in (getattr(config, n, None) for n in ("num_local_experts", "num_experts"))
                    if isinstance(e, int) and not isinstance(e, bool) and e > 0), None)
    if k is None or experts is None:
        return ""
    return (f"uniform routing: {expected_experts(experts, k, tokens):.2f} of {experts} experts per layer read "
            f"for {tokens} tokens, E*(1-(1-k/E)^B) with k={k}")


@dataclass(frozen=True)
class ForwardApi:
    cache_kw: str  # "cache" (transformers 5) or "past_key_values"
    cache_position: bool  # forward takes cache_position (transformers 4)
    keep_kw: str | None  # "logits_to_keep", "num_logits_to_keep" or None


def forward_api(model: nn.Module) -> ForwardApi:
    params = inspect.signature(model.forward).parameters
    return ForwardApi(cache_kw="cache" if "cache" in params else "past_key_values",
                      cache_position="cache_position" in params,
                      keep_kw=next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None))


def static_cache(model: nn.Module, batch: int, max_len: int):
    """A ``StaticCache`` for ``model``, ``batch`` sequences of up to ``max_len`` tokens, in the
    model's dtype and on its device (arguments the installed version does not take are left out)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    p = next(model.parameters())
    kw = {"config": model.config, "max_cache_len": max_len}
    for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", p.device), ("dtype", p.dtype)):
        if name in params and not (name == "batch_size" and "max_batch_size" in kw):
            kw[name] = value
    return StaticCache(**kw)


def cached_forward(model: nn.Module, api: ForwardApi, ids: torch.Tensor, cache, positions: torch.Tensor):
    """Logits of ``model(ids)`` appending to ``cache``; ``positions``: the 1-D positions of
    ``ids``' tokens (a device tensor, the same for every sequence)."""
    kw = {api.cache_kw: cache, "use_cache": True, "position_ids": positions.view(1, -1)}
    if api.cache_position:
        kw["cache_position"] = positions
    return model(input_ids=ids, **kw).logits


def full_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position of ``ids``, no cache."""
    return model(input_ids=ids, use_cache=False).logits


def decode_logits(model: nn.Module, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits (fp32) of the positions ``prompt_len - 1 .. T - 2`` of ``ids`` (B, T) as a decode
    loop computes them: the first ``prompt_len`` tokens prefilled into a ``StaticCache``, then
    one token per forward, each the next of ``ids`` (teacher forced, so every model compared
    is fed the same tokens). (B, T - prompt_len, V): the prompt's last logits, then those of
    every one-token step but the last token's."""
    api, (batch, total) = forward_api(model), ids.shape
    if not 0 < prompt_len < total:
        raise ValueError(f"decode_logits: prompt_len {prompt_len} must be in 1 .. {total - 1}")
    cache = static_cache(model, batch, -(-total // 64) * 64)
    device = ids.device
    out = [cached_forward(model, api, ids[:, :prompt_len], cache, torch.arange(prompt_len, device=device))[:, -1:]]
    for p in range(prompt_len, total - 1):
        out.append(cached_forward(model, api, ids[:, p:p + 1], cache, torch.arange(p, p + 1, device=device)))
    return torch.cat([o.float() for o in out], dim=1)


def prefill_forward(model: nn.Module, api: ForwardApi, ids: torch.Tensor) -> torch.Tensor:
    """One forward of a prompt as ``generate`` runs it: logits of the last position only
    (where the installed version can skip the others), no cache kept."""
    kw = {api.keep_kw: 1} if api.keep_kw else {}
    return model(input_ids=ids, use_cache=False, **kw).logits


def generate(model: nn.Module, ids: torch.Tensor, new_tokens: int, streamer=None) -> torch.Tensor:
    """HF ``generate``, greedy, exactly ``new_tokens`` new tokens (an end-of-sequence token
    does not stop it early), default (dynamic) cache; ``streamer`` as HF takes one."""
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=streamer)


class TokenClock:
    """An HF streamer that notes the host clock as each new token reaches the host (generate
    copies every token to the CPU for its streamer, which waits for the step's GPU work): the
    gaps between new tokens are the decode steps' wall times, the prompt's forward excluded."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first put is the prompt, before any forward
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def ms_per_step(self) -> float:
        """Mean ms between consecutive new tokens (needs at least two)."""
        if len(self.stamps) < 2:
            raise ValueError(f"{len(self.stamps)} new tokens were streamed; a step time needs at least 2")
        return (self.stamps[-1] - self.stamps[0]) * 1e3 / (len(self.stamps) - 1)
