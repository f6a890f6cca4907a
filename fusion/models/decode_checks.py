"""When a decoder layer runs the fused decode step (fusion/models/decode_step.py), and what
the step reads of the model: decided once when a layer is patched (source and structure
checks) and per call (device, dtype, rows, grad, hooks, the cache).

Patch time (:func:`why_not_fuse_layer`; the attention: fusion/models/attention_forms.py
``why_not_fuse_attention``): the layer's forward must be one the step computes (its statements
checked in its source: the pre-norm layer; Granite's with scaled residuals, Phi-3's with
residual dropouts, Gemma 2/3's post-norm one, OLMo 2's post-norm one without input norms),
its attention forward one of the forms ``AttentionForm`` describes (Q/K/V from three
projections or one: Phi-3's [q | k | v], GPT-NeoX's per head, Falcon's as its configuration
says), and its parts
fused by ``patch`` (Q/K/V and gate/up into one GEMM each or the checkpoint's stacked linears,
patched RMSNorms (fusion/norm.py PATCHED_NORMS), patched or row-parallel O and down; GPT-NeoX's
and Falcon's layers: fusion/models/layernorm_layers.py). The static-cache step (rotary and the
cache write in the QKV epilogue, the attention kernel) also needs transformers' ``StaticLayer``
and ``Cache.update`` as checked (or, for a sliding-window layer, a window that never fills:
fusion/models/window_cache.py), the standard ``rotate_half`` rotary, and q/k norms (if any)
that are patched RMSNorms over ``head_dim`` (Llama's formula, or Gemma 3's fp32 factor ``1 + w``).

Per call (:func:`takes_fused_path`: :func:`operands_allow`, :func:`modules_allow`;
:func:`kv_slot`): CUDA (:func:`on_kernel_device`), bf16
or fp32 with every weight in x's dtype (or e4m3 with bf16 x: fusion/fp8_modules.py), at most
:data:`DECODE_ROWS` rows, no gradient wanted (of x, or of a weight the step reads: the norms',
q/k norms' and projections'), no autocast, the default dispatch mode, no dropout that drops
(Phi-3's residual dropouts, Seed-OSS's of the attention's and MLP's outputs), and no hooks on the
modules the step does not call (norms, attention, its projections, the MLP, down). Elsewhere the
stock forward runs. The lists of a layer's parts those checks go through are kept between eager
calls while the layer's, its attention's and its MLP's children stay the same objects of the same
classes under the same names (:func:`layer_parts`); hooks, dtypes, gradients and LoRA layers are read at every call.

PEFT LoRA layers over the fused parts (the slices of Q/K/V and gate/up, O and down) keep the
step: it adds their terms itself (fusion/models/adapter_terms.py) where a call allows
(:func:`adapter_terms.computable`, no gradient wanted for the adapters); any other wrapper, or
a LoRA form the step does not compute, gives the layer's own forward for that call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

from hybridgemm.experts import HybridExperts
from hybridgemm.fp8_modules import FP8HybridLinear
from hybridgemm.fused_rows import FusedLinears, FusedSlice, adapter_base
from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES as _PLAIN
from hybridgemm.kernels.fp8 import E4M3
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.linear_layer import HybridLinear, PartialSumLinear
from hybridgemm.mlp import FUSED_GATE_UP, OUTPUT_DROPOUT, HybridGatedMLP, HybridPrefusedGatedMLP
from hybridgemm.mode_state import DEFAULT, get_mode
from hybridgemm.norm import PATCHED_NORMS

from . import adapter_terms, window_cache
from .attention_forms import (
    AttentionForm,
    _Transformers,
    attention_form,
    attention_kernel,
    clipped,
    rotary_columns,
    statements_match,
    why_clipped,
    why_not_attention_form,
)
from .checked_forms import (
    _CHOSEN_RESIDUAL_LAYER_BODY,
    _DROPOUT_LAYER_BODY,
    _LAYER_BODY,
    _PARALLEL_LAYER_BODY,
    _SCALED_LAYER_BODY,
    LAYER_NORM_NAMES,
    MLP_DROPOUT,
    NORMS_AS_MODULES,
    POST_NORM_FORMS,
    POST_NORMS,
    QKV_NAME,
    RESIDUAL_DROPOUTS,
    ROTATED_QK_NORM_NAMES,
)
from .source_forms import body_statements, source_text

DECODE_ROWS = 16  # rows up to which the fused path runs (the gated kernel's decode configs)
NOT_A_LAYER = "not a decoder layer"
# Instance attribute set when a layer is patched: its attention can take the static-cache step.
STATIC_STEP = "_hybridgemm_attention_step"
# Instance attribute set when a layer is patched: its forward scales the sublayer outputs (Granite).
SCALED_RESIDUALS = "_hybridgemm_scaled_residuals"
_LAYER_DTYPES = (torch.bfloat16, torch.float32)
_FP8_ACTIVATIONS = (torch.bfloat16,)  # x of an FP8-weight layer (fusion/fp8_modules.py)



def on_kernel_device(x: Tensor) -> bool:
    """Do the fused kernels run on x's device? (CUDA; the CPU tests widen it to the interpreter.)"""
    return x.is_cuda


def hooked(mod: nn.Module | None) -> bool:
    """Has ``mod`` forward hooks or a replaced forward (a fused path that skips it must not run)?
    transformers' output-capturing hook (which a model installs on its attention modules the
    first time it is asked for attentions or hidden states) counts only while a call is
    capturing attentions: otherwise it records nothing."""
    if mod is None:
        return False
    if mod._forward_pre_hooks or "forward" in mod.__dict__:
        return True
    hooks = mod._forward_hooks  # (empty on nearly every call: no generator then; eager decode is host-bound)
    return bool(hooks) and any(not _idle_capture(hook) for hook in hooks.values())


def _idle_capture(hook) -> bool:
    if getattr(hook, "__name__", None) != "output_capturing_hook" \
            or getattr(hook, "__module__", None) != "transformers.utils.output_capturing":
        return False
    collector = _Transformers.collector
    if collector is None:
        return False
    collected = collector.get()
    return collected is None or "attentions" not in collected


# ------------------------------------------------------------------------------- per call

def takes_static_step(layer: nn.Module) -> bool:
    return bool(layer.__dict__.get(STATIC_STEP))


def rotary_cache(cos: Tensor, sin: Tensor, heads: int, kv_heads: int, keys: Tensor, values: Tensor, base: Tensor,
                 q_norm: Tensor | None = None, k_norm: Tensor | None = None, qk_eps: float = 0.0,
                 qk_offset: float | None = None, group: int = 0, pairs: bool = False, rotate: bool = True,
                 qk_after_rotary: bool = False):
    """The rotary/cache operand of split-K's ``rope=`` fusion (with the q/k norms' operand:
    weights or factors, eps, offset; norm.norm_operand; ``group``: the weight's rows grouped per
    KV head; ``pairs``: Cohere's rotary of neighbouring columns; ``rotate``: False for a layer
    without positional embedding, the cache write alone; ``qk_after_rotary``: the q/k norms of the
    rotated heads; triton_rope.RotaryCache)."""
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    return triton_module("triton_rope").RotaryCache(cos, sin, heads, kv_heads, keys.shape[-1], keys, values, base,
                                                    q_norm, k_norm, qk_eps, qk_offset, group, pairs, rotate,
                                                    qk_after_rotary)


def kernel_computes_eager(interface, form: AttentionForm) -> bool:
    """Is ``interface`` the module's own eager attention function, of a form the decode attention kernel computes?"""
    return interface is form.eager and form.kernel_eager


def kernel_takes(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, counters: Tensor | None) -> bool:
    """Does the decode-attention kernel take these operands?"""
    return on_kernel_device(q) and attention_kernel().why_not(q, keys, values, mask) is None \
        and (counters is None or counters.numel() >= keys.shape[0] * keys.shape[1])


CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")  # what a layer's call names its cache (by version, family)


def cache_of(kwargs: dict):
    """The cache a decoder layer's call passes (None: none)."""
    return next((kwargs[k] for k in CACHE_ARGUMENTS if kwargs.get(k) is not None), None)


def kv_slot(attn: nn.Module, x: Tensor, kwargs: dict):
    """``(cache layer, cos, sin, first)`` when this call can take the static-cache step, else
    None; ``first``: the layer is the cache's first. Only for an attention
    ``why_not_fuse_attention`` accepted when it was patched."""
    cache = cache_of(kwargs)
    pe = kwargs.get("position_embeddings")
    implementation = attn.config._attn_implementation
    form = attention_form(type(attn))
    # eager: a function the decode attention kernel computes, or transformers 5.8-5.24's Falcon
    # scores (legacy_falcon.eager_attention) over the cache the step wrote
    eager_ok = form.kernel_eager or form.split_heads_falcon
    if cache is None or pe is None or x.dim() != 3 or attn.training \
            or not (implementation == "sdpa" or implementation == "eager" and eager_ok):
        return None
    if implementation == "sdpa" and form.softcap and getattr(attn, "attn_logit_softcapping", None) is not None:
        return None  # stock's SDPA function refuses a softcap: the module's computation says so
    layers = getattr(cache, "layers", None)
    if not _Transformers.static_ok or not isinstance(layers, list) or attn.layer_idx >= len(layers):
        return None
    layer = layers[attn.layer_idx]
    # a sliding-window layer only over a window that never fills (fusion/models/window_cache.py),
    # which computes what StaticLayer computes: its mask holds the window
    kind = type(layer)
    if not (kind is _Transformers.static_layer_cls and not form.slides(attn)
            or window_cache.is_device_length(kind)) or not layer.is_initialized \
            or getattr(cache, "offloading", False) or type(cache).update is not _Transformers.cache_cls.update:
        return None
    keys, values, base = layer.keys, layer.values, layer.cumulative_length
    b, hd = x.shape[0], form.head_dim(attn)
    # Head counts from the fused weight and the cache, which hold this process's heads (all of
    # them, or a tensor-parallel rank's share, where the config still gives the whole model's).
    rows, kv_heads = attn._modules[form.qkv_name].weight.shape[0], keys.shape[1]
    groups = form.kv_groups(attn)
    if not isinstance(groups, int) or groups < 1 or rows != (groups + 2) * kv_heads * hd:
        return None  # a cache (or fused weight) of other head counts: the module's computation says what is wrong
    if keys.dtype != x.dtype or values.dtype != x.dtype or keys.shape[0] != b or keys.shape[-1] != hd \
            or values.shape != keys.shape or not keys.is_contiguous() or not values.is_contiguous():
        return None
    if not isinstance(base, Tensor) or base.dtype != torch.int64 or base.numel() != 1 or base.device != x.device:
        return None
    cos, sin = pe
    # fp32 cos/sin: OLMo 2's rotary embedding, which rotates in fp32 and rounds back (its step: the
    # rotary as torch ops after the norms), and Ernie 4.5's, whose function rotates pairs in fp32
    # (the pair epilogue's fp32 rotation, from its fp32 cos/sin)
    cos_dtypes = (x.dtype, torch.float32) if form.full_qk_norm or form.fp32_halved else (x.dtype,)
    if cos.dim() != 3 or cos.shape[-1] != rotary_columns(attn, form, cos.shape[-1]) or cos.shape[1] != x.shape[1] \
            or cos.dtype not in cos_dtypes or cos.shape != sin.shape or sin.dtype != cos.dtype:
        return None
    # ``first``: a layer whose length the model reads for the step's positions and mask: the cache's
    # first (Cache.get_seq_length) and its first full-attention and first sliding-window one
    # (masking_utils, transformers >= 5.25)
    return layer, cos, sin, layer is layers[0] or layer is next(la for la in layers if type(la) is kind)


_ATTENTION_SLOTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_SLOTS = ("gate_proj", "up_proj", "down_proj")


# transformers' sparse MoE blocks whose forward is router, then experts (Qwen2-MoE's also its
# gated shared expert, Ernie 4.5's and Hunyuan's their shared experts), one tensor out: the step
# calls the block itself after the post-attention norm (or computes it: moe_block.why_not_fuse_block)
MOE_BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "OlmoeSparseMoeBlock",
              "Glm4MoeMoE", "Ernie4_5_MoeSparseMoeBlock", "HunYuanMoEV1Moe")


def moe_block(mlp: nn.Module | None) -> bool:
    """Is ``mlp`` a sparse MoE block whose experts patch swapped for :class:`HybridExperts`?"""
    return (type(mlp).__name__ in MOE_BLOCKS and type(mlp).__module__.startswith("transformers")
            and isinstance(mlp._modules.get("experts"), HybridExperts))


def projection_base(mod: nn.Module | None) -> nn.Module | None:
    """The linear the step computes for a projection slot: what a LoRA layer wraps, else itself."""
    return adapter_base(mod) if adapter_terms.is_lora_linear(mod) else mod


# The attention's q/k norm modules by the names the forms give them (Qwen3's and OLMo 2's, Hunyuan's of
# the rotated heads): the step reads their weights (in the Q/K/V epilogue, or calls them as modules)
_QK_NORM_NAMES = ("q_norm", "k_norm", *ROTATED_QK_NORM_NAMES)


def _fused_parts(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    parts = [*layer_norms(layer)[:1], attn._modules[QKV_NAME], projection_base(attn.o_proj)]
    # (a q/k norm of another dtype, or one that trains, would not be computed as its module computes it)
    parts += [m for m in map(attn._modules.get, _QK_NORM_NAMES) if hasattr(m, "weight")]
    if moe_block(mlp):  # the norm and the router run as modules, the experts in moe_block.block_step
        return [p for p in parts if p is not None]
    parts += [*layer_norms(layer)[1:], mlp._modules[FUSED_GATE_UP], projection_base(mlp.down_proj)]
    return [p for p in parts if p is not None]


def post_norms(layer: nn.Module) -> tuple | None:
    """The names of ``layer``'s norms where it is of a post-norm form (Gemma 2/3's, GLM-4's,
    OLMo 2's: checked_forms.POST_NORM_FORMS), as patch marked it (:data:`POST_NORMS`); else None."""
    return layer.__dict__.get(POST_NORMS)


def layer_norms(layer: nn.Module) -> list[nn.Module | None]:
    """The layer's norms, its input norm first: the pre-norm layer's two, a post-norm layer's four
    in the order its forward applies them (None for the two an OLMo 2 layer does not have)."""
    names = post_norms(layer) or LAYER_NORM_NAMES
    return [None if n is None else layer._modules.get(n) for n in names]


def normalises_outputs(cls: type) -> tuple | None:
    """The names of ``cls.forward``'s norms where it is a post-norm form (checked_forms.POST_NORM_FORMS:
    Gemma 2/3's, GLM-4's, OLMo 2's without input norms), else None. Read from the source when patched."""
    statements = body_statements(cls.forward)
    return next((names for names, body in POST_NORM_FORMS.items() if statements_match(statements, body)), None)


def _adapters(layer: nn.Module) -> list[nn.Module]:
    """The LoRA layers over the layer's projections."""
    slots = [layer.self_attn._modules.get(n) for n in _ATTENTION_SLOTS]
    slots += [layer.mlp._modules.get(n) for n in _MLP_SLOTS]  # (None in a MoE block)
    return [m for m in slots if adapter_terms.is_lora_linear(m)]


def _in_place(mod: nn.Module | None, made: Callable[[nn.Module | None], bool]) -> bool:
    """``mod`` is what patch made (``made``), or a LoRA layer over one whose terms the step
    adds in this call."""
    if made(mod):
        return True
    return adapter_terms.is_lora_linear(mod) and made(adapter_base(mod)) and adapter_terms.computable(mod)


def _slice(mod) -> bool:
    return type(mod) is FusedSlice


def own_projection(mod) -> bool:
    return type(mod) in (HybridLinear, FP8HybridLinear)


def _parts_in_place(layer: nn.Module) -> bool:
    """Are the modules the step stands for still the ones patch made, or LoRA layers over them
    whose terms the step adds (none wrapped or replaced otherwise since)? A LoRA layer over a
    row-parallel O or down is not computed here; one over a prefused Q/K/V or gate/up (Phi-3's)
    not at all."""
    attn, mlp = layer.self_attn._modules, layer.mlp._modules
    o, down = attn.get("o_proj"), mlp.get("down_proj")
    if isinstance(attn.get(QKV_NAME), FusedLinears):
        qkv = all(_in_place(attn.get(n), _slice) for n in ("q_proj", "k_proj", "v_proj"))
    else:
        qkv = own_projection(attn.get(QKV_NAME))
    attention = qkv and (fusable_projection(o) or _in_place(o, own_projection))
    if moe_block(layer.mlp):
        return attention and type(layer.post_attention_layernorm) in PATCHED_NORMS
    if isinstance(mlp.get(FUSED_GATE_UP), FusedLinears):
        gate_up = all(_in_place(mlp.get(n), _slice) for n in ("gate_proj", "up_proj"))
    else:
        gate_up = own_projection(mlp.get(FUSED_GATE_UP))
    return attention and gate_up and (fusable_projection(down) or _in_place(down, own_projection))


def _skipped_modules(layer: nn.Module) -> list[nn.Module | None]:
    """The modules whose forward the step does not call (their hooks would not run): with a
    LoRA layer in a slot, also the linear it wraps and its adapters' own modules."""
    attn, mlp = layer.self_attn, layer.mlp
    slots = [*(attn._modules.get(n) for n in _ATTENTION_SLOTS), *(mlp._modules.get(n) for n in _MLP_SLOTS)]
    wrapped = [m for s in slots if adapter_terms.is_lora_linear(s)
               for m in (adapter_base(s), *s.lora_A.values(), *s.lora_B.values(), *s.lora_dropout.values())]
    attention = [layer._modules.get("input_layernorm"), attn, *slots, *wrapped,
                 *map(attn._modules.get, _QK_NORM_NAMES),
                 attn._modules.get(QKV_NAME),
                 *(layer._modules.get(n) for n in (*RESIDUAL_DROPOUTS, MLP_DROPOUT))]
    if moe_block(mlp):  # the norm and the router are called as modules; moe_block.block_step checks the block's
        # and its experts' hooks itself (with any, it calls the block as a module)
        return attention
    return [*attention, *layer_norms(layer)[1:], mlp, mlp._modules.get(FUSED_GATE_UP)]


def takes_fused_path(layer: nn.Module, x) -> bool:
    """Does this call of a fused layer run the decode step (else the stock forward)? (Not where
    its Q/K/V clamp has been set since it was patched: attention_forms.clipped.)"""
    return _layer_allows(layer, x, DECODE_ROWS)


def takes_prefill_step(layer: nn.Module, x) -> bool:
    """Does this eager call of a fused layer that :func:`takes_fused_path` refused run
    ``decode_step.prefill_step`` (else the stock forward)? Where the call has more rows than
    :data:`DECODE_ROWS` and allows all else the step asks, of a pre-norm layer (neither post-norm,
    nor norms called as modules, nor scaled residuals) with no LoRA layer over its projections."""
    if torch.compiler.is_compiling() or post_norms(layer) or norm_modules(layer) \
            or layer.__dict__.get(SCALED_RESIDUALS):
        return False
    return _layer_allows(layer, x, None, adapters_allowed=False)


def _layer_allows(layer: nn.Module, x, rows: int | None, adapters_allowed: bool = True) -> bool:
    # what both steps ask of the call and the layer's modules (rows: as operands_allow takes it)
    if not operands_allow(layer, x, (*RESIDUAL_DROPOUTS, MLP_DROPOUT), rows):
        return False
    parts = layer_parts(layer)
    if parts.adapters and not adapters_allowed:
        return False
    return parts.in_place and not clipped(layer.self_attn) and not drops_outputs(layer) \
        and modules_allow(x, parts.fused, parts.skipped, parts.adapters)


class LayerParts(NamedTuple):
    """What the per-call checks read of a fused layer's module structure: the LoRA layers over
    its projections, whether its fused parts are still patch's (:func:`_parts_in_place`), the
    modules the step computes with (:func:`_fused_parts`) and those whose forwards it skips
    (:func:`_skipped_modules`)."""

    adapters: tuple[nn.Module, ...]
    in_place: bool
    fused: tuple[nn.Module, ...]
    skipped: tuple[nn.Module | None, ...]


# Instance attribute of a fused layer: ``(structure, LayerParts)`` as read at its last eager
# check. Rebuilding the lists costs about as much host time as the rest of the checks together
# (eager decode and prefill are host-bound), and they change only when a child of the layer,
# its attention or its MLP is replaced, renamed or changes class (torch's parametrizations and
# ``hybridgemm.unpatch`` swap classes in place), which changes the structure (:func:`_structure`).
# ``unpatch`` drops it.
PARTS_SEEN = "_hybridgemm_parts_seen"
_APART = "|"  # (between the three children lists of a structure; a string survives a deep copy)


def _children(mod: nn.Module | None) -> tuple:
    """``mod``'s children: their names, the objects and their classes (none for no module)."""
    if mod is None:
        return ()
    children = mod._modules
    return (*children, *children.values(), *map(type, children.values()))


def _structure(layer: nn.Module) -> tuple:
    """The layer's class and the children (by name, identity and class) of ``layer``, its
    attention and its MLP, and patch's post-norm mark: everything :class:`LayerParts` is read
    from, but for the LoRA layers' own state, which is read per call (a layer with LoRA layers is
    never kept)."""
    return (type(layer), *_children(layer), _APART, *_children(layer._modules.get("self_attn")), _APART,
            *_children(layer._modules.get("mlp")), _APART, layer.__dict__.get(POST_NORMS))


def layer_parts(layer: nn.Module) -> LayerParts:
    """:class:`LayerParts` of ``layer`` now: the ones kept from its last eager call where its
    structure is the same and it has no LoRA layer, else read anew (and kept, outside a traced
    call). The kept structure holds the children it names until the next check sees others."""
    if torch.compiler.is_compiling():
        return _read_parts(layer)
    structure = _structure(layer)
    seen = layer.__dict__.get(PARTS_SEEN)
    if seen is not None and seen[0] == structure:
        return seen[1]
    parts = _read_parts(layer)
    if parts.adapters:
        layer.__dict__.pop(PARTS_SEEN, None)
    else:
        layer.__dict__[PARTS_SEEN] = (structure, parts)
    return parts


def _read_parts(layer: nn.Module) -> LayerParts:
    # (the lists only of parts in place: a replaced attention or MLP may lack the children they name)
    adapters, in_place = tuple(_adapters(layer)), _parts_in_place(layer)
    if not in_place:
        return LayerParts(adapters, False, (), ())
    return LayerParts(adapters, True, tuple(_fused_parts(layer)), tuple(_skipped_modules(layer)))


def operands_allow(layer: nn.Module, x, dropouts: tuple[str, ...], rows: int | None = DECODE_ROWS) -> bool:
    """Does this call of a fused ``layer`` allow its decode step, as far as its operands say: a
    plain tensor ``x`` of a layer dtype on the kernels' device with at most ``rows`` rows (None:
    more than :data:`DECODE_ROWS`), no autocast, the default dispatch mode, none of the layer's
    ``dropouts`` (child names) dropping? (Cheap: checked before :func:`modules_allow`.)"""
    if not torch.compiler.is_compiling() and type(x) not in _PLAIN:
        return False
    if x.dtype not in _LAYER_DTYPES or x.dim() < 2 or not on_kernel_device(x):
        return False
    k = x.shape[-1]
    if not k:
        return False
    m = x.numel() // k
    if m <= DECODE_ROWS if rows is None else m > rows:
        return False
    if torch.is_autocast_enabled(x.device.type) or get_mode() != DEFAULT:
        return False
    return not (layer.training and any(_dropping(layer._modules.get(n)) for n in dropouts))


def modules_allow(x, parts: list[nn.Module], skipped: list[nn.Module | None], adapters: list[nn.Module] = ()) -> bool:
    """Do the layer's modules allow this call's decode step: the parameters of ``parts`` (the
    modules the step computes with) of x's dtype (or e4m3 weights with bf16 x), no gradient
    wanted of x, them or the LoRA ``adapters``' parameters, and no hooks on the ``skipped``
    modules (whose forwards the step does not call) nor global ones?"""
    dtype, grad = x.dtype, torch.is_grad_enabled()
    if grad and x.requires_grad:
        return False
    for m in parts:
        for t in (m.weight, _bias(m)):
            if t is not None and (t.dtype != dtype and not (t.dtype == E4M3 and dtype in _FP8_ACTIVATIONS)
                                  or grad and t.requires_grad):
                return False
    if grad and any(p.requires_grad for m in adapters for p in adapter_terms.lora_parameters(m)):
        return False
    if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
        return False
    for m in skipped:  # (a loop, not any() over a generator: host time per layer call)
        if hooked(m):
            return False
    return True


def _bias(mod: nn.Module) -> Tensor | None:
    """``mod.bias``, None where it has none (a norm's: without the exception that getattr's
    default costs per call, about 1.3 us on the host)."""
    if "bias" in mod._parameters:
        return mod._parameters["bias"]
    if "bias" in mod._buffers:
        return mod._buffers["bias"]
    return getattr(mod, "bias", None) if hasattr(type(mod), "bias") or "bias" in mod.__dict__ else None


def drops_outputs(layer: nn.Module) -> bool:
    """Does a dropout in the forward of ``layer``'s attention or MLP drop anything now (Seed-OSS's
    of their outputs: AttentionForm.output_dropout, mlp.OUTPUT_DROPOUT)? The steps compute neither.
    (Of a layer whose parts are in place: its attention is the patched one.)"""
    attn, mlp = layer.self_attn, layer.mlp
    if not (attn.training or mlp.training):  # (eval: no attribute read)
        return False
    return attn.training and attention_form(type(attn)).output_dropout and attn.residual_dropout > 0 \
        or mlp.training and OUTPUT_DROPOUT in mlp.__dict__ and mlp.residual_dropout > 0


def _dropping(mod: nn.Module | None) -> bool:
    """Does residual dropout ``mod`` (an nn.Dropout, checked when patched) drop anything now?"""
    return mod is not None and mod.training and mod.p > 0


def qkv_sizes(attn: nn.Module, qkv: nn.Module) -> tuple[int, int, int]:
    """The q, k and v column counts of the fused Q/K/V output: the parts patch fused, or for a
    prefused linear (Phi-3's qkv_proj) the heads its attention slices it into."""
    sizes = getattr(qkv, "sizes", None)
    if sizes is not None:
        return tuple(sizes)
    kv = attn.num_key_value_heads * attn.head_dim
    return qkv.weight.shape[0] - 2 * kv, kv, kv


def fusable_projection(proj) -> bool:
    """An O or down projection the step computes: patched, or row-parallel."""
    return type(proj) in (HybridLinear, FP8HybridLinear) or isinstance(proj, PartialSumLinear)


def norm_modules_form(cls: type) -> str | None:
    """``"parallel"`` where ``cls.forward`` is Cohere's form of the layer (:data:`_PARALLEL_LAYER_BODY`),
    ``"chosen"`` where StableLM's (:data:`_CHOSEN_RESIDUAL_LAYER_BODY`), else None. Read from the
    source when a layer is patched."""
    statements = body_statements(cls.forward)
    if statements_match(statements, _PARALLEL_LAYER_BODY):
        return "parallel"
    return "chosen" if statements_match(statements, _CHOSEN_RESIDUAL_LAYER_BODY) else None


def norm_modules(layer: nn.Module) -> str | None:
    """The residual form of a layer whose norms the step calls as modules, as patch marked it
    (:data:`NORMS_AS_MODULES`): "parallel", "chosen", "gpt_neox" or "falcon"
    (fusion/models/layernorm_layers.py) or None (another form)."""
    return layer.__dict__.get(NORMS_AS_MODULES)


def scales_residuals(cls: type) -> bool:
    """Is ``cls.forward`` Granite's form of the layer (each sublayer's output times
    ``residual_multiplier`` before its add)? Read from the source when a layer is patched."""
    return statements_match(body_statements(cls.forward), _SCALED_LAYER_BODY)


def residual_multiplier(layer: nn.Module) -> float | None:
    """The factor a fused layer's sublayer outputs take before their residual adds: its
    ``residual_multiplier`` where patch marked it (:data:`SCALED_RESIDUALS`), else None."""
    return float(layer.residual_multiplier) if layer.__dict__.get(SCALED_RESIDUALS) else None


def why_not_fuse_layer(mod: nn.Module, layer_classes) -> str | None:
    """Why the decoder layer ``mod`` cannot be fused (None: it can); raises nothing. A module
    whose class is not in ``layer_classes`` gives :data:`NOT_A_LAYER`."""
    t = type(mod)
    if t.__name__ not in layer_classes or not t.__module__.startswith("transformers"):
        return NOT_A_LAYER
    attn, mlp = mod._modules.get("self_attn"), mod._modules.get("mlp")
    norms = [mod._modules.get(n) for n in ("input_layernorm", "post_attention_layernorm")]
    qkv = attn._modules.get(QKV_NAME) if attn is not None else None
    if not isinstance(qkv, FusedLinears) and not own_projection(qkv):
        return "its Q/K/V are not fused into one GEMM"
    for owner, child in ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"), (mlp, "gate_proj"),
                         (mlp, "up_proj"), (mlp, "down_proj")):
        wrapper = owner._modules.get(child)
        if adapter_base(wrapper) is not None and not adapter_terms.is_lora_linear(wrapper):
            return (f"its {child} carries an adapter ({type(wrapper).__module__}.{type(wrapper).__qualname__}), "
                    "which the layer's own forward runs")
        if adapter_terms.is_lora_linear(wrapper) and isinstance(adapter_base(wrapper), PartialSumLinear):
            return f"its {child} carries a LoRA adapter over a row-parallel projection, which the layer's forward runs"
    o_proj, down_proj = projection_base(attn._modules.get("o_proj")), projection_base(mlp._modules.get("down_proj"))
    if not fusable_projection(o_proj):
        return f"its o_proj is a {type(o_proj).__name__}, not a patched or row-parallel nn.Linear"
    moe = moe_block(mlp)
    gate_up = mlp._modules.get(FUSED_GATE_UP) if mlp is not None else None
    if not moe and not ((type(mlp) is HybridGatedMLP and isinstance(gate_up, FusedLinears))
                        or (type(mlp) is HybridPrefusedGatedMLP and own_projection(gate_up))):
        return ("its MoE block's experts are not the patched grouped kernels" if type(mlp).__name__ in MOE_BLOCKS
                else "its MLP's gate/up are not fused into one GEMM")
    if not moe and not fusable_projection(down_proj):
        return f"its down_proj is a {type(down_proj).__name__}, not a patched or row-parallel nn.Linear"
    scaled = scales_residuals(t)
    statements = body_statements(t.forward)
    dropouts = not scaled and statements_match(statements, _DROPOUT_LAYER_BODY)
    post = None if scaled or dropouts else normalises_outputs(t)
    modules = None if scaled or dropouts or post else norm_modules_form(t)
    if not (scaled or dropouts or post or modules or statements_match(statements, _LAYER_BODY)):
        return f"{t.__name__}.forward is not a decoder layer this step computes"
    if modules:
        return _why_not_norm_modules(mod, modules, moe) or _why_not_attention(attn, qkv)
    if post:
        norms = [mod._modules.get(n) for n in post if n is not None]
        if moe or any(isinstance(p, PartialSumLinear) for p in (o_proj, down_proj)):
            return "its post-norms follow a mixture of experts or a row-parallel projection (not fused)"
    if not all(type(n) in PATCHED_NORMS for n in norms):
        return "its norms are not RMSNorms of a formula the step computes (Llama's, Gemma's)"
    if dropouts and not all(type(mod._modules.get(n)) is nn.Dropout for n in RESIDUAL_DROPOUTS):
        return f"its {' and '.join(RESIDUAL_DROPOUTS)} are not nn.Dropout modules"
    if scaled:
        m = getattr(mod, "residual_multiplier", None)
        if not isinstance(m, (int, float)) or isinstance(m, bool) or not math.isfinite(m):
            return f"its residual_multiplier is {m!r}, not a finite number"
        if any(isinstance(p, PartialSumLinear) for p in (o_proj, down_proj)):
            return "its residual_multiplier scales the output of a row-parallel projection (not fused)"
    return _why_not_attention(attn, qkv)


def _why_not_norm_modules(mod: nn.Module, form: str, moe: bool) -> str | None:
    """Why a layer of Cohere's or StableLM's form (``form``: :func:`norm_modules_form`) cannot be
    fused: the norms the step calls as the modules they are must be there (one, or StableLM's
    two where its residual is sequential), StableLM's MLP dropout an nn.Dropout."""
    names = ("input_layernorm",)
    if form == "chosen":
        parallel = getattr(mod, "use_parallel_residual", None)
        if not isinstance(parallel, bool):
            return f"its use_parallel_residual is {parallel!r}, not a bool"
        if type(mod._modules.get(MLP_DROPOUT)) is not nn.Dropout:
            return f"its {MLP_DROPOUT} is not an nn.Dropout module"
        names = names if parallel else (*names, "post_attention_layernorm")
    if moe or not all(isinstance(mod._modules.get(n), nn.Module) for n in names):
        return f"it has no {' and '.join(names)} module"
    return None


def _why_not_attention(attn: nn.Module, qkv: nn.Module) -> str | None:
    if not all(isinstance(getattr(attn, a, None), int) for a in ("head_dim", "layer_idx")):
        return f"its {type(attn).__name__} has no integer head_dim and layer_idx"
    why = why_not_attention_form(type(attn)) or why_clipped(attn)
    if why is not None:
        return why
    prefused = attention_form(type(attn)).prefused
    if prefused == isinstance(qkv, FusedLinears):
        return f"its {QKV_NAME} is not what its attention's forward computes Q/K/V with"
    if prefused:
        heads, kv = getattr(attn.config, "num_attention_heads", None), getattr(attn, "num_key_value_heads", None)
        if not all(isinstance(v, int) and v > 0 for v in (heads, kv)) \
                or qkv.weight.shape[0] != (heads + 2 * kv) * attn.head_dim:
            return f"its {QKV_NAME}'s {qkv.weight.shape[0]} rows are not the config's q, k and v heads"
    return None


__all__ = ["DECODE_ROWS", "MOE_BLOCKS", "NOT_A_LAYER", "QKV_NAME", "STATIC_STEP", "hooked", "kv_slot", "moe_block",
           "on_kernel_device", "projection_base", "source_text", "takes_fused_path", "takes_prefill_step",
           "why_not_fuse_layer"]
