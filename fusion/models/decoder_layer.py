"""The fused decoder layer: a recognised transformers decoder-layer class with
:class:`HybridDecoderLayer` mixed in (:func:`fused_class`), whose forward runs the fused decode
step (fusion/models/decode_step.py) where a call allows it (fusion/models/decode_checks.py), an
eager call of more rows (a prefill) of a pre-norm layer its modules with the rotary in one launch
(``decode_step.prefill_step``), and the class's own forward everywhere else (compiled prefill,
training, fp16, CPU, hooks). Part of :func:`hybridgemm.patch` (``layers=True``).

Recognised: transformers' ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``,
``MistralDecoderLayer``, ``GemmaDecoderLayer`` (its (1 + w) RMSNorms' fp32 factor in the QKV
and gate/up prologues, fusion/norm.py), ``GraniteDecoderLayer`` (its ``residual_multiplier`` in
the O and down epilogues), ``Phi3DecoderLayer`` (its Q/K/V and gate/up each one linear in the
checkpoint, run as they are; its residual dropouts the identity in inference),
``Gemma2DecoderLayer`` and ``Gemma3DecoderLayer`` (each sublayer's output normalised before
its residual add; their attention the module's function over the fused Q/K/V),
``Olmo2DecoderLayer`` (the same without input norms; its q/k norms over all heads, run as
modules on the fused Q/K/V), ``StableLmDecoderLayer`` (its LayerNorms called as the modules they
are, its residual parallel or sequential as the instance says, its rotary over the first
``rotary_ndims`` columns of each head in the Q/K/V GEMM's epilogue), ``CohereDecoderLayer``
(the same with its parallel residual and its rotary of neighbouring columns), ``GPTNeoXLayer``
and ``FalconDecoderLayer`` (their LayerNorms apart, their Q/K/V layouts and rotary in the
Q/K/V GEMM's epilogue; fusion/models/layernorm_layers.py, static caches only) and the
mixture-of-experts ``Qwen3MoeDecoderLayer``, ``MixtralDecoderLayer``, ``Qwen2MoeDecoderLayer`` and
``OlmoeDecoderLayer`` (their sparse block called as a module, its experts the grouped kernels;
OLMoE's q/k norms over all heads as OLMo 2's, where its Q/K/V clamp ``clip_qkv`` is unset) and
``Glm4MoeDecoderLayer`` (GLM-4.5-MoE: its rotary over the first half of each head in the Q/K/V
epilogue, a dense MLP or a block of shared and routed experts with DeepSeek-V3's router; per-head
q/k norms, where ``use_qk_norm``, leave the attention to the module) whose forwards are the
ones the step computes (checked in their source when patched, so a release that changes them
is left alone, with the reason in the report), with the parts :func:`hybridgemm.patch` fused:
Q/K/V, gate/up (or the experts), HybridRMSNorm, HybridGemmaRMSNorm or HybridOlmo2RMSNorm norms.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from . import attention_forms as forms
from . import decode_checks, decode_step, layernorm_layers, window_cache

# Recognised layer classes and the transformers module of each (to rebuild the fused class
# when a pickled model is loaded in a new process).
LAYER_MODULES = {"LlamaDecoderLayer": "llama", "Qwen2DecoderLayer": "qwen2", "Qwen3DecoderLayer": "qwen3",
                 "MistralDecoderLayer": "mistral", "GraniteDecoderLayer": "granite",
                 "Qwen3MoeDecoderLayer": "qwen3_moe", "MixtralDecoderLayer": "mixtral",
                 "Qwen2MoeDecoderLayer": "qwen2_moe", "GemmaDecoderLayer": "gemma", "Phi3DecoderLayer": "phi3",
                 "Gemma2DecoderLayer": "gemma2", "Gemma3DecoderLayer": "gemma3", "Olmo2DecoderLayer": "olmo2",
                 "StableLmDecoderLayer": "stablelm", "CohereDecoderLayer": "cohere", "GPTNeoXLayer": "gpt_neox",
                 "FalconDecoderLayer": "falcon", "OlmoeDecoderLayer": "olmoe", "Glm4MoeDecoderLayer": "glm4_moe",
                 "Olmo3DecoderLayer": "olmo3", "MinistralDecoderLayer": "ministral", "CwmDecoderLayer": "cwm",
                 "SmolLM3DecoderLayer": "smollm3", "Ministral3DecoderLayer": "ministral3", "GlmDecoderLayer": "glm",
                 "HeliumDecoderLayer": "helium", "Glm4DecoderLayer": "glm4", "Ernie4_5DecoderLayer": "ernie4_5",
                 "Ernie4_5_MoeDecoderLayer": "ernie4_5_moe", "HunYuanDenseV1DecoderLayer": "hunyuan_v1_dense",
                 "HunYuanMoEV1DecoderLayer": "hunyuan_v1_moe",
                 "Exaone4DecoderLayer": "exaone4", "SeedOssDecoderLayer": "seed_oss",
                 "Cohere2DecoderLayer": "cohere2"}
LAYER_CLASSES = tuple(LAYER_MODULES)
# A fused layer's int32 buffer (not in the state dict) of split-K arrival counters for its
# GEMMs, which run one after another and leave it zero: a compiled decode step then needs no
# zero-filled counters per GEMM (a fill kernel each).
COUNTERS = "_hybridgemm_counters"
COUNTER_SLOTS = 4096
# A layer class's attention module, where it is not self_attn
_ATTENTION_NAMES = {name: family.attention for name, family in layernorm_layers.FAMILIES.items()}


def attention_of(layer: nn.Module) -> nn.Module:
    """A recognised decoder layer's attention module."""
    return layer._modules[_ATTENTION_NAMES.get(type(layer).__name__, "self_attn")]


def new_counters(device) -> torch.Tensor:
    return torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)


class HybridDecoderLayer(nn.Module):
    """Mixed in before a recognised decoder-layer class (:func:`fused_class`): the fused
    decode step where it applies, the prefill step where that applies, the class's own forward
    everywhere else."""

    def _apply(self, fn, *args, **kwargs):
        # The counters must be zero before a kernel uses them. A move keeps them so, but
        # to_empty() (a model built on the meta device) leaves them uninitialised, and
        # load_state_dict(assign=True) does not touch a non-persistent buffer, so a model built
        # on meta still holds meta counters when it is moved: those are made anew, as zeros
        # beside the moved parameters (a meta tensor has no values to move).
        counters = self._buffers.get(COUNTERS)
        remake = counters is not None and counters.is_meta
        if remake:
            self._buffers[COUNTERS] = None
        try:
            out = super()._apply(fn, *args, **kwargs)
        finally:
            if remake:
                param = next(self.parameters(), None)
                self._buffers[COUNTERS] = new_counters(param.device if param is not None else "meta")
        counters = self._buffers.get(COUNTERS)
        if counters is not None and not counters.is_meta:
            with torch.no_grad():
                counters.zero_()
        return out

    def __setstate__(self, state):
        super().__setstate__(state)
        # Unpickled (in a new process, say): what the step reads of transformers is read now,
        # not inside the first call, which may be a compiled region's trace.
        forms.why_not_attention_form(type(attention_of(self)))
        if decode_checks.takes_static_step(self):
            forms.why_not_load_kernels()

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if not torch.compiler.is_compiling() and decode_checks.takes_static_step(self):
            # a static cache whose sliding windows never fill counts on the device from here on,
            # so a compiled step over it reads no Python int (fusion/models/window_cache.py)
            window_cache.adopt(decode_checks.cache_of(kwargs))
        if args or not decode_checks.takes_fused_path(self, hidden_states):
            if not args and decode_checks.takes_prefill_step(self, hidden_states):
                return decode_step.prefill_step(self, hidden_states, kwargs, self._buffers.get(COUNTERS))
            return super().forward(hidden_states, *args, **kwargs)
        return decode_step.layer_step(self, hidden_states, kwargs, self._buffers.get(COUNTERS))


class HybridLayerNormLayer(HybridDecoderLayer):
    """:class:`HybridDecoderLayer` for GPT-NeoX's and Falcon's layers: the step of
    fusion/models/layernorm_layers.py for a call with a static cache it takes, the class's own
    forward for any other."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        call = None if args else layernorm_layers.step_slot(self, hidden_states, kwargs)
        if call is None:
            return super(HybridDecoderLayer, self).forward(hidden_states, *args, **kwargs)
        return layernorm_layers.layer_step(self, hidden_states, call, kwargs, self._buffers.get(COUNTERS))


# by layer class: the mixin, where not HybridDecoderLayer
_MIXINS = dict.fromkeys(layernorm_layers.FAMILIES, HybridLayerNormLayer)
_FUSED_CLASSES: dict[type, type] = {}


def fused_class(cls: type) -> type:
    """The class a recognised layer of class ``cls`` gets: :class:`HybridDecoderLayer` mixed in,
    still an instance of ``cls`` and named like it (what name-based checks such as a model's
    ``_no_split_modules`` read). Pickled as ``hybridgemm.models.decoder_layer.<name>``, which
    this module resolves (:func:`__getattr__`)."""
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        mixin = _MIXINS.get(cls.__name__, HybridDecoderLayer)
        fused = _FUSED_CLASSES[cls] = type(cls.__name__, (mixin, cls),
                                           {"__module__": __name__, "__qualname__": cls.__name__})
        globals()[cls.__name__] = fused
    return fused


def __getattr__(name: str):
    # A pickled patched model names its layers' class hybridgemm.models.decoder_layer.<name>:
    # rebuild it from transformers' class of that name.
    family = LAYER_MODULES.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    stock = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    return fused_class(stock)


def why_not_fuse_layer(mod: nn.Module) -> str | None:
    """Why the decoder layer ``mod`` cannot be fused (None: it can); raises nothing. A module
    that is no recognised decoder layer gives ``decode_checks.NOT_A_LAYER``."""
    if layernorm_layers.family_of(mod) is not None:
        return layernorm_layers.why_not_fuse(mod)
    return decode_checks.why_not_fuse_layer(mod, LAYER_CLASSES)


__all__ = ["COUNTERS", "LAYER_CLASSES", "HybridDecoderLayer", "attention_of", "fused_class", "new_counters",
           "why_not_fuse_layer"]
