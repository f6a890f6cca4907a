"""The attention forms the fused decode step computes (fusion/models/decode_step.py), read once
per attention class when a layer is patched: :class:`AttentionForm` (what the class's forward
computes, from its statements in its source: Q/K/V from three projections or one, Phi-3's
[q | k | v], GPT-NeoX's per head, Falcon's as its configuration says; q/k norms; the rotary;
the cache update; the sliding window; Gemma 2's soft-cap), the checks that the step can compute
an attention module (:func:`why_not_fuse_attention`: transformers' ``StaticLayer`` and
``Cache.update`` as checked, the standard ``rotate_half`` rotary or Cohere's, q/k norms that
are patched RMSNorms over ``head_dim``), transformers' objects a call reads
(:class:`_Transformers`), and the decode attention kernels' modules. The per-call checks and
the layer forms are fusion/models/decode_checks.py's.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from hybridgemm.kernels.lazy import triton_module
from hybridgemm.norm import Fp32FactorRMSNorm, HybridRMSNorm, norm_operand

from . import legacy_falcon, window_cache
from .checked_forms import (
    _ATTENTION_BODY,
    _CACHE_UPDATE_STATEMENTS,
    _CLIPPED_FULL_QK_NORMS,
    _CONFIG_LAYOUT_ATTENTION_BODY,
    _EAGER_BODY,
    _FLAGGED_ROTARY,
    _FP32_HALVED_PAIR_ROTARY_BODY,
    _FULL_QK_NORMS,
    _HALVED_PAIR_PARTIAL_BODY,
    _HALVED_PAIR_ROTARY_BODY,
    _INTERLEAVED_ROTATE_HALF,
    _LATE_QK_NORMS,
    _LEGACY_FALCON_ATTENTION_BODY,
    _LEGACY_FALCON_SPLIT_BODY,
    _NO_GQA_EAGER_BODY,
    _NORMED_K,
    _NORMED_Q,
    _OUTPUT_DROPOUT,
    _PAIR_ROTARY_ATTENTION_BODY,
    _PAIR_ROTARY_STATEMENTS,
    _PAIR_ROTATE_HALF_STATEMENTS,
    _PARTIAL_ROTARY_ATTENTION_BODY,
    _PARTIAL_ROTARY_BODY,
    _PER_HEAD_ATTENTION_BODY,
    _PLAIN_K,
    _PLAIN_Q,
    _POSITION_Q_SCALE,
    _POSITION_SCALE_BODY,
    _PREFUSED_ATTENTION_BODY,
    _ROTARY_STATEMENTS,
    _ROTATE_HALF_STATEMENTS,
    _ROTATED_QK_NORMS,
    _SLIDING_ROTARY,
    _SOFTCAP_CALL,
    _SOFTCAP_EAGER_BODY,
    _SPLIT_PARTIAL_ROTARY_BODY,
    _STATIC_UPDATE_STATEMENTS,
    _WINDOWED_ROTARY,
    PER_HEAD_QKV_NAME,
    QKV_NAME,
    ROTATED_QK_NORM_NAMES,
    UPDATE_FORMS,
    WINDOW_FORMS,
)
from .source_forms import body_statements, has_statements

NO_WINDOW = object()  # AttentionForm.sliding_window: the stock forward passes none


def statements_match(statements: list[str] | None, forms: tuple) -> bool:
    """Is ``statements`` exactly ``forms``, statement by statement (a tuple: one of its forms)?"""
    return statements is not None and len(statements) == len(forms) and all(
        s in f if isinstance(f, tuple) else s == f for s, f in zip(statements, forms))


# --------------------------------------------------------------------- transformers' objects

class _Transformers:
    """transformers' objects a call reads, looked up once (never per call), under a lock and
    published last, so a concurrent first call never sees half of them; ``static_ok``:
    ``Cache.update`` and ``StaticLayer.update`` are the checked ones; ``collector``: the
    context variable of transformers' output-capturing hooks (None where it has none)."""

    lock = threading.Lock()
    loaded = False
    static_ok = False
    cache_cls = static_layer_cls = attention_functions = stock_sdpa = collector = None

    @classmethod
    def load(cls) -> bool:
        if not cls.loaded:
            with cls.lock:
                if not cls.loaded:
                    cls._import()
                    cls.loaded = True
        return cls.attention_functions is not None

    @classmethod
    def _import(cls) -> None:
        try:
            from transformers.cache_utils import Cache, StaticLayer
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError:
            return
        try:
            from transformers.utils.output_capturing import _active_collector as collector
        except ImportError:
            collector = None
        cls.cache_cls, cls.static_layer_cls, cls.collector = Cache, StaticLayer, collector
        cls.static_ok = has_statements(Cache.update, _CACHE_UPDATE_STATEMENTS) \
            and has_statements(StaticLayer.update, _STATIC_UPDATE_STATEMENTS)
        cls.stock_sdpa = sdpa_attention_forward
        cls.attention_functions = ALL_ATTENTION_FUNCTIONS


def computes_sdpa(interface) -> bool:
    """Is ``interface`` an attention function that computes SDPA over the cache (transformers'
    own, or the one standing in for transformers 5.8-5.24's Falcon attention)?"""
    return interface is _Transformers.stock_sdpa or interface is legacy_falcon.sdpa_attention


# ------------------------------------------------------------------------- attention forms

@dataclass(frozen=True)
class AttentionForm:
    """What an attention class's forward computes, read once from it (the step then computes
    the same): q/k norms on the head views or none, the rotary, eager and attention-function
    registry its forward's module uses, how it calls ``cache.update`` (:data:`UPDATE_FORMS`)
    and where its sliding window comes from (:data:`WINDOW_FORMS`)."""

    qk_norm: bool
    prefused: bool  # Q/K/V one linear in the checkpoint (Phi-3's qkv_proj), not three that patch fused
    rotary: Callable
    eager: Callable
    functions: object  # the forward's ALL_ATTENTION_FUNCTIONS
    update: str  # "kwargs", "cache_kwargs" or "none"
    # "module" (attn.sliding_window), "config" (attn.config.sliding_window), "flagged" (attn.sliding_window
    # where attn.is_sliding, else none: EXAONE 4's), None
    window_from: str | None
    softcap: bool = False  # the call passes softcap=attn.attn_logit_softcapping (Gemma 2)
    full_qk_norm: bool = False  # q_norm/k_norm over all q (k) columns, before the head views (OLMo 2)
    # then Q, K and V clamped where config.clip_qkv is set (OLMoE): the step takes such a layer
    # only while it is None (patch: why_clipped; a call after it is set runs the layer's own
    # forward, decode_checks.takes_fused_path); its fused Q/K/V hand out copies to autograd
    # (fused_rows.FusedLinears.own_parts)
    clip_qkv: bool = False
    kernel_eager: bool = False  # its module's eager function is one the decode attention kernel computes
    # the rotary over the first attn.rotary_ndims columns of each head, per-head q/k LayerNorms
    # where attn.qk_layernorm, and only position_ids for the attention function (StableLM)
    partial_rotary: bool = False
    # the rotary pairs neighbouring columns (2i, 2i + 1) and rotates in fp32 (Cohere; GLM's and
    # Helium's, cos_halved, in the step too)
    pair_rotary: bool = False
    # the rotary pairs neighbouring columns from cos/sin in the standard layout, the first half of
    # which it repeats per pair (GLM's, Helium's): the step interleaves them so (interleaved_cos) and
    # rotates as Cohere's, in fp32 rounded once (where the module rounds in the dtype)
    cos_halved: bool = False
    # the rotary of halved cos/sin over whole heads (Helium's form) computed by the module in fp32 from
    # its fp32 cos/sin, rounded once (Ernie 4.5's; with cos_halved): the step passes them as they are
    fp32_halved: bool = False
    # per-head q/k norms on the head views where attn.use_qk_norm (Cohere's, GLM-4-MoE's)
    flagged_qk_norm: bool = False
    # its module's rotary function rotates the first cos.shape[-1] columns of each head and passes
    # the rest (a partial rotary whose width the rotary embedding's cos says: GLM-4-MoE's)
    rotary_by_cos: bool = False
    # Q/K/V one linear whose columns are [q | k | v] per head, rotated over the first
    # attn.rotary_ndims columns of each head (GPT-NeoX's query_key_value; its head width head_size)
    per_head_qkv: bool = False
    # Q/K/V one linear whose layout the instance says (Falcon's: grouped per KV head in its new
    # architecture, multi-query's [q | k | v] with one KV head, else per head: qkv_group)
    layout_from_config: bool = False
    qkv_name: str = QKV_NAME  # the attention's Q/K/V module
    head_dim_name: str = "head_dim"  # the attention's attribute that holds the head width
    scaling_name: str = "scaling"  # the attention's attribute that holds the scores' scale
    # transformers 5.8-5.24's Falcon attention (its _split_heads form): attention functions
    # legacy_falcon's, its eager one computed by the step too (decode_checks.kv_slot), KV groups
    # from its head counts, and the new architecture's K and V cached copied to every query head
    split_heads_falcon: bool = False
    # where the rotary runs (rotates()): always (None), where the instance's use_rope is true ("use_rope":
    # SmolLM3's NoPE layers have none), where it has no window or its layer slides ("sliding": EXAONE 4's
    # global layers have none, their q/k norms still run), where it has a window ("windowed": Cohere 2's)
    rotary_when: str | None = None
    # after the rotary, q times a factor per position, its module's get_llama_4_attn_scale of the
    # call's position_ids and two rope_parameters (Ministral 3's; position_scale())
    position_scale: Callable | None = None
    # with qk_norm: the attention's q/k norm modules, and whether they normalise the rotated heads
    # (Hunyuan's query_layernorm/key_layernorm after its rotary) or the heads before it (Qwen3's)
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")
    qk_after_rotary: bool = False
    # the output through a dropout of the instance's residual_dropout before the return (Seed-OSS's):
    # a layer whose dropout drops runs its own forward (decode_checks.drops_outputs)
    output_dropout: bool = False

    def head_dim(self, attn: nn.Module) -> int:
        return getattr(attn, self.head_dim_name)

    def scaling(self, attn: nn.Module) -> float:
        return getattr(attn, self.scaling_name)

    def kv_groups(self, attn: nn.Module) -> int | None:
        """Query heads per KV head: 1 for GPT-NeoX's per-head layout, else the attention's
        ``num_key_value_groups`` (transformers 5.8-5.24's Falcon has none: its heads over its KV heads)."""
        if self.per_head_qkv:
            return 1
        if self.split_heads_falcon:
            heads, kv_heads = getattr(attn, "num_heads", None), getattr(attn, "num_kv_heads", None)
            ints = isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0
            return heads // kv_heads if ints and heads % kv_heads == 0 else None
        return getattr(attn, "num_key_value_groups", None)

    def attention_function(self, implementation: str):
        return self.functions.get_interface(implementation, self.eager)

    def sliding_window(self, attn: nn.Module):
        if self.window_from == "module":
            return attn.sliding_window
        if self.window_from == "config":
            return getattr(attn.config, "sliding_window", None)
        if self.window_from == "flagged":
            return attn.sliding_window if attn.is_sliding else None
        return NO_WINDOW

    def slides(self, attn: nn.Module) -> bool:
        """Is ``attn``'s a sliding-window layer (its cache layer one of a window)? Its ``sliding_window``
        is set, and for the "flagged" form its ``is_sliding`` too."""
        window = getattr(attn, "sliding_window", None)
        return window is not None and (self.window_from != "flagged" or bool(getattr(attn, "is_sliding", False)))


_FORMS: dict[type, AttentionForm | str] = {}


def _read_form(cls: type) -> AttentionForm | str:
    forward = cls.forward
    statements = body_statements(forward)
    if statements_match(statements, _PARTIAL_ROTARY_ATTENTION_BODY):
        return _functions_form(cls, UPDATE_FORMS[statements[14]], None, False, partial_rotary=True)
    if statements_match(statements, _PAIR_ROTARY_ATTENTION_BODY):
        return _functions_form(cls, UPDATE_FORMS[statements[11]], None, False, pair_rotary=_pairs_neighbours(cls),
                               flagged_qk_norm=True)
    if statements_match(statements, _PER_HEAD_ATTENTION_BODY):
        return _functions_form(cls, "none", None, False, prefused=True, per_head_qkv=True, qkv_name=PER_HEAD_QKV_NAME,
                               head_dim_name="head_size")
    if statements_match(statements, _CONFIG_LAYOUT_ATTENTION_BODY):
        return _functions_form(cls, "none", None, False, prefused=True, layout_from_config=True,
                               qkv_name=PER_HEAD_QKV_NAME)
    if statements_match(statements, _LEGACY_FALCON_ATTENTION_BODY) \
            and statements_match(body_statements(getattr(cls, "_split_heads", None)), _LEGACY_FALCON_SPLIT_BODY):
        rotary = getattr(inspect.unwrap(cls.forward), "__globals__", {}).get("apply_rotary_pos_emb")
        if not callable(rotary):
            return f"{cls.__name__}.forward's module has no apply_rotary_pos_emb"
        return AttentionForm(False, True, rotary, legacy_falcon.eager_attention, legacy_falcon.FUNCTIONS, "none",
                             None, layout_from_config=True, qkv_name=PER_HEAD_QKV_NAME,
                             scaling_name="inv_norm_factor", split_heads_falcon=True)
    output_dropout = statements is not None and len(statements) > 2 and statements[-2] == _OUTPUT_DROPOUT
    if output_dropout:  # (the identity wherever the step runs: decode_checks.drops_outputs)
        statements = [*statements[:-2], statements[-1]]
    rotary_when = None
    if statements is not None and len(statements) > 5 and statements[5] == _FLAGGED_ROTARY:
        rotary_when = "use_rope"  # the rotary's two statements, run where use_rope says (rotates())
        statements = [*statements[:5], *_ATTENTION_BODY[5:7], *statements[6:]]
    elif statements is not None and (_SLIDING_ROTARY in statements or _WINDOWED_ROTARY in statements):
        # the rotary's statement, run where the layer slides or has no window (EXAONE 4's), where it
        # has a window (Cohere 2's)
        rotary_when = "sliding" if _SLIDING_ROTARY in statements else "windowed"
        statements = [_ATTENTION_BODY[6] if st in (_SLIDING_ROTARY, _WINDOWED_ROTARY) else st for st in statements]
    position_scale = None
    if statements is not None and len(statements) > 7 and statements[7] == _POSITION_Q_SCALE:
        position_scale = getattr(inspect.unwrap(forward), "__globals__", {}).get("get_llama_4_attn_scale")
        if not statements_match(body_statements(position_scale), _POSITION_SCALE_BODY):
            return f"{cls.__name__}.forward scales its queries by a get_llama_4_attn_scale of another form"
        statements = [*statements[:7], *statements[8:]]  # the scale applied after the rotary (position_scale())
    rotated_norms = statements is not None and tuple(statements[7:9]) == _ROTATED_QK_NORMS \
        and statements[2:4] == [_PLAIN_Q, _PLAIN_K]
    if rotated_norms:  # the q/k norms of the rotated heads (qk_after_rotary), taken out
        statements = [*statements[:7], *statements[9:]]
    prefused = statements_match(statements, _PREFUSED_ATTENTION_BODY)
    clip_qkv = statements is not None and tuple(statements[2:9]) == _CLIPPED_FULL_QK_NORMS
    full_qk_norm = clip_qkv or statements is not None and tuple(statements[2:8]) == _FULL_QK_NORMS
    if prefused:  # from the rotary on, the statements of _ATTENTION_BODY
        statements = [*_ATTENTION_BODY[:2], _PLAIN_Q, _PLAIN_K, _ATTENTION_BODY[4], *statements[10:]]
    elif full_qk_norm:  # the same with the norms (and the clamp) taken out, as checked above
        statements = [*statements[:2], _PLAIN_Q, _PLAIN_K, _ATTENTION_BODY[4], *statements[9 if clip_qkv else 8:]]
    elif statements is not None and tuple(statements[5:7]) == _LATE_QK_NORMS \
            and statements[2:4] == [_PLAIN_Q, _PLAIN_K]:
        statements = [*statements[:2], _NORMED_Q, _NORMED_K, *statements[4:5], *statements[7:]]
    if not statements_match(statements, _ATTENTION_BODY):
        return f"{cls.__name__}.forward is not an attention this step computes"
    if rotated_norms and (rotary_when or position_scale is not None):
        return f"{cls.__name__}.forward's q/k norms after a rotary it may skip or a query scale are not a form this " \
               "step computes"
    pairs = _pairs_neighbours(cls)
    if pairs and (statements[2] == _NORMED_Q or rotated_norms or full_qk_norm):
        return f"{cls.__name__}.forward's q/k norms with Cohere's rotary of neighbouring pairs are not a form this " \
               "step computes"
    names = dict(qk_norm_names=ROTATED_QK_NORM_NAMES, qk_after_rotary=True) if rotated_norms else {}
    return _functions_form(cls, UPDATE_FORMS[statements[7]], WINDOW_FORMS[statements[9]],
                           statements[9] == _SOFTCAP_CALL, qk_norm=statements[2] == _NORMED_Q or rotated_norms,
                           prefused=prefused, full_qk_norm=full_qk_norm, clip_qkv=clip_qkv,
                           rotary_when=rotary_when, position_scale=position_scale,
                           output_dropout=output_dropout, pair_rotary=pairs, **names)


def _pairs_neighbours(cls: type) -> bool:
    """Is the rotary function of ``cls.forward``'s module Cohere's (neighbouring columns paired,
    in fp32; else the standard or partial rotate_half one is what why_not_rotary accepts)?"""
    rope = getattr(inspect.unwrap(cls.forward), "__globals__", {}).get("apply_rotary_pos_emb")
    return callable(rope) and statements_match(body_statements(plain_function(rope)), _PAIR_ROTARY_STATEMENTS)


def _halved_pairs(rotary) -> dict:
    """The form fields of ``rotary`` where it is GLM's, Helium's or Ernie 4.5's rotary function
    (neighbouring columns paired, cos/sin halved and repeated per pair: AttentionForm.cos_halved;
    Ernie's in fp32: fp32_halved), statement by statement, with its module's rotate_half; else {}."""
    rope = plain_function(rotary)
    rotate = getattr(inspect.unwrap(rope), "__globals__", {}).get("rotate_half") if callable(rope) else None
    if rotate is None or not statements_match(body_statements(rotate), _INTERLEAVED_ROTATE_HALF):
        return {}
    body = body_statements(rope)
    if any(statements_match(body, form) for form in (_HALVED_PAIR_ROTARY_BODY, _HALVED_PAIR_PARTIAL_BODY)):
        return dict(pair_rotary=True, cos_halved=True)
    if statements_match(body, _FP32_HALVED_PAIR_ROTARY_BODY):
        return dict(pair_rotary=True, cos_halved=True, fp32_halved=True)
    return {}


def interleaved_cos(t: Tensor) -> Tensor:
    """cos (or sin) ``[..., R]`` in the standard layout as a rotary of neighbouring pairs takes it:
    its first half, each frequency repeated for the two columns of its pair (what GLM's and
    Helium's rotary functions make of it)."""
    return t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1)


def kernel_cos_sin(form: AttentionForm, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The call's cos/sin in the layout the rotary kernels take for ``form`` (cos_halved: interleaved)."""
    return (interleaved_cos(cos), interleaved_cos(sin)) if form.cos_halved else (cos, sin)


def _functions_form(cls: type, update: str, window_from: str | None, softcap: bool, **form) -> AttentionForm | str:
    """The :class:`AttentionForm` of ``cls`` with the functions its forward's module holds."""
    names = getattr(inspect.unwrap(cls.forward), "__globals__", {})
    rotary, eager = names.get("apply_rotary_pos_emb"), names.get("eager_attention_forward")
    functions = names.get("ALL_ATTENTION_FUNCTIONS")
    if not callable(rotary) or not callable(eager) or not callable(getattr(functions, "get_interface", None)):
        return f"{cls.__name__}.forward's module has no apply_rotary_pos_emb, eager_attention_forward and " \
               "ALL_ATTENTION_FUNCTIONS.get_interface"
    eager_body = body_statements(eager)
    kernel_eager = statements_match(eager_body, _SOFTCAP_EAGER_BODY) if softcap else \
        statements_match(eager_body, _NO_GQA_EAGER_BODY if form.get("per_head_qkv") else _EAGER_BODY)
    rope_body = body_statements(plain_function(rotary))
    by_cos = any(statements_match(rope_body, body) for body in (_PARTIAL_ROTARY_BODY, _SPLIT_PARTIAL_ROTARY_BODY,
                                                                _HALVED_PAIR_PARTIAL_BODY))
    form.update(_halved_pairs(rotary))
    return AttentionForm(form.pop("qk_norm", False), form.pop("prefused", False), rotary, eager, functions, update,
                         window_from, softcap, kernel_eager=kernel_eager, rotary_by_cos=by_cos, **form)


def attention_form(cls: type) -> AttentionForm:
    """The form of attention class ``cls`` (read once per class); the layer was patched only
    where :func:`why_not_attention_form` found one."""
    form = _FORMS.get(cls)
    if form is None:
        form = _FORMS[cls] = _read_form(cls)
    if isinstance(form, str):
        raise RuntimeError(f"hybridgemm: the fused decode step cannot compute this attention: {form}")
    return form


def why_not_attention_form(cls: type) -> str | None:
    """Why the step cannot compute attention class ``cls`` (None: it can); reads transformers'
    objects (:class:`_Transformers`) and the class's form once."""
    _Transformers.load()
    form = _FORMS.get(cls)
    if form is None:
        form = _FORMS[cls] = _read_form(cls)
    return form if isinstance(form, str) else None


def why_not_fuse_attention(attn: nn.Module) -> str | None:
    """Why ``attn`` cannot take the static-cache step (None: it can); raises nothing. Read once
    when a layer is patched (source inspection), not per call."""
    cls = type(attn)
    _Transformers.load()
    if not _Transformers.static_ok:
        return "this transformers version's StaticCache update is not the one checked"
    why = why_not_attention_form(cls)
    if why is not None:
        return why
    if attention_form(cls).softcap and attn.attn_logit_softcapping is not None \
            and not attention_form(cls).kernel_eager:
        return "its attention logits are soft-capped by an eager attention function of a form the decode attention " \
               "kernel does not compute (the module's attention function runs over the fused Q/K/V)"
    why = why_clipped(attn)
    if why is not None:
        return why
    if attention_form(cls).qk_norm:
        why = why_not_qk_norms(attn)
        if why is not None:
            return why
    if attention_form(cls).partial_rotary:
        why = why_not_partial_rotary(attn)
        if why is not None:
            return why
    if attention_form(cls).per_head_qkv:
        why = why_not_rotary_columns(attn, getattr(attn, "head_size", None))
        if why is not None:
            return why
    if attention_form(cls).flagged_qk_norm and getattr(attn, "use_qk_norm", None) is not False:
        return "its per-head q/k norms (use_qk_norm) run as modules (the module's attention computation over the " \
               "fused Q/K/V)"
    why = why_not_rotary(attn)
    if why is not None:
        return why
    head_dim_name = attention_form(cls).head_dim_name
    if not all(isinstance(getattr(attn, a, None), int) for a in (head_dim_name, "layer_idx")):
        return f"it has no integer {head_dim_name} and layer_idx"
    if attention_form(cls).slides(attn) and window_cache.device_length_class() is None:
        return "it is a sliding-window layer, whose cache layer in this transformers version is not the one checked " \
               "(the module's attention function runs over the fused Q/K/V)"
    return why_not_load_kernels()


_STANDARD_ROTARY: dict[type, bool] = {}  # by attention class: its module's apply_rotary_pos_emb read once


def clipped(attn: nn.Module) -> bool:
    """Does ``attn``'s forward clamp its Q/K/V, of a form that does so where config.clip_qkv is
    set, and is it set? (A dictionary lookup and an attribute: cheap per call.)"""
    return attention_form(type(attn)).clip_qkv and getattr(attn.config, "clip_qkv", None) is not None


def why_clipped(attn: nn.Module) -> str | None:
    """Why ``attn``'s layer cannot take the static-cache step for its Q/K/V clamp (None: it has none set)."""
    if not clipped(attn):
        return None
    return f"its Q/K/V are clamped to config.clip_qkv ({attn.config.clip_qkv}), which the fused layer does not compute"


def qk_norms(attn: nn.Module, form: AttentionForm) -> tuple[nn.Module, nn.Module]:
    """``attn``'s per-head q and k norm modules (a form with ``qk_norm``)."""
    return getattr(attn, form.qk_norm_names[0]), getattr(attn, form.qk_norm_names[1])


def rotates(attn: nn.Module, form: AttentionForm) -> bool:
    """Does ``attn``'s forward rotate q and k (not a layer whose ``use_rope`` is off: SmolLM3's NoPE
    layers; nor one with a window that does not slide: EXAONE 4's global layers; nor Cohere 2's
    without a window)?"""
    if form.rotary_when == "use_rope":
        return bool(attn.use_rope)
    if form.rotary_when == "sliding":
        return attn.sliding_window is None or bool(attn.is_sliding)
    if form.rotary_when == "windowed":
        return attn.sliding_window is not None
    return True


def position_scale(attn: nn.Module, form: AttentionForm, kwargs: dict) -> Tensor | None:
    """The factor ``attn``'s forward multiplies its rotated queries by, ``[B or 1, 1, S, 1]`` as its
    module's function computes it from the call's ``position_ids`` (Ministral 3's), None where it
    has none; a call it cannot compute for raises as the module's forward does."""
    if form.position_scale is None:
        return None
    rope = attn.config.rope_parameters
    return form.position_scale(kwargs.get("position_ids"), rope.get("llama_4_scaling_beta"),
                               rope.get("original_max_position_embeddings"))


def why_not_rotary(attn: nn.Module) -> str | None:
    """Why ``attn``'s rotary embedding is not Hugging Face's standard ``rotate_half`` one, which
    the kernels compute (None: it is): the module's function (or its partial form), read once
    per class, and no Hub kernel bound on the instance. Cheap per call after the first."""
    cls = type(attn)
    form = attention_form(cls)
    if _rotary_kernelized(attn, form):
        return "its rotary embedding is a kernel from the Hugging Face Hub (kernels.kernelize), not the stock function"
    standard = _STANDARD_ROTARY.get(cls)
    if standard is None:
        rope = plain_function(form.rotary)
        rotate = getattr(inspect.unwrap(rope), "__globals__", {}).get("rotate_half")
        if form.cos_halved:  # GLM's, Helium's, Ernie 4.5's (read with the form)
            standard = True
        elif form.pair_rotary:  # Cohere's, statement by statement
            standard = rope is not None and rotate is not None and statements_match(
                body_statements(rotate), _PAIR_ROTATE_HALF_STATEMENTS) and statements_match(body_statements(rope),
                                                                                     _PAIR_ROTARY_STATEMENTS)
        else:
            rope_body = body_statements(rope)
            standard = rope is not None and rotate is not None and has_statements(
                rotate, _ROTATE_HALF_STATEMENTS) and (has_statements(rope, _ROTARY_STATEMENTS)
                                                      or statements_match(rope_body, _PARTIAL_ROTARY_BODY)
                                                      or statements_match(rope_body, _SPLIT_PARTIAL_ROTARY_BODY))
        _STANDARD_ROTARY[cls] = standard
    return None if standard else "its rotary embedding is not the standard rotate_half one (nor Cohere's, GLM's, " \
        "Ernie 4.5's)"


def plain_function(fn):
    """The function behind ``fn``. With Hugging Face's kernels installed (a dependency of transformers >= 5.25),
    ``@use_kernel_forward_from_hub`` turns a function such as apply_rotary_pos_emb into a module instance whose
    class's forward calls the function (a closure cell, ``func``); without it, ``fn`` is the function."""
    if isinstance(fn, nn.Module):
        return inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
    return fn


def _rotary_wrapper(attn: nn.Module, form: AttentionForm) -> nn.Module | None:
    # kernels' @use_kernelized_func gives each instance a wrapper of its own, keyed by the layer name
    name = getattr(form.rotary, "kernel_layer_name", None)
    return getattr(attn, "_kernel_funcs", {}).get(name) if name is not None else None


def module_rotary(attn: nn.Module, form: AttentionForm) -> Callable:
    """What ``attn``'s forward calls as apply_rotary_pos_emb: the instance's own wrapper where kernels gave it
    one (the module's forward routes the global's calls to it), else the global."""
    wrapper = _rotary_wrapper(attn, form)
    return form.rotary if wrapper is None else wrapper


def _rotary_kernelized(attn: nn.Module, form: AttentionForm) -> bool:
    # kernels.kernelize binds a Hub kernel's forward on the instance's wrapper
    wrapper = _rotary_wrapper(attn, form)
    return wrapper is not None and "forward" in vars(wrapper)


def why_not_qk_norms(attn: nn.Module) -> str | None:
    """Why the rotary epilogue cannot apply ``attn``'s q/k norms (None: it can): both must be
    patched RMSNorms of one class and eps over ``head_dim`` with a weight: Llama's formula
    (Qwen3, Hunyuan) or the fp32 factor (Gemma 3's ``1 + w``; fusion/norm.py)."""
    hd = getattr(attn, "head_dim", None)
    names = attention_form(type(attn)).qk_norm_names
    norms = [getattr(attn, name, None) for name in names]
    for name, norm in zip(names, norms):
        weight = getattr(norm, "weight", None)
        if not isinstance(norm, (HybridRMSNorm, Fp32FactorRMSNorm)) or not isinstance(weight, Tensor) \
                or tuple(weight.shape) != (hd,):
            return f"its {name} is not an RMSNorm over head_dim with a weight that hybridgemm patched " \
                   f"({type(norm).__name__})"
    if type(norms[0]) is not type(norms[1]) or norm_operand(norms[0])[1:] != norm_operand(norms[1])[1:]:
        return f"its {names[0]} and {names[1]} are not one formula with one eps"
    return None


def why_not_partial_rotary(attn: nn.Module) -> str | None:
    """Why the static-cache step cannot run StableLM's attention ``attn`` (None: it can): its
    per-head q/k LayerNorms (``qk_layernorm``), which the step leaves to the module's computation,
    or a ``rotary_ndims`` that is not an even count of columns within a head."""
    if getattr(attn, "qk_layernorm", None) is not False:
        return "its per-head q/k LayerNorms (qk_layernorm) run as modules (the module's attention computation over " \
               "the fused Q/K/V)"
    return why_not_rotary_columns(attn, getattr(attn, "head_dim", None))


def why_not_rotary_columns(attn: nn.Module, hd) -> str | None:
    """Why ``attn.rotary_ndims`` is not an even count of columns within a head of ``hd`` (None: it is)."""
    rot = getattr(attn, "rotary_ndims", None)
    if not isinstance(rot, int) or not isinstance(hd, int) or rot % 2 or not 2 <= rot <= hd:
        return f"its rotary_ndims ({rot!r}) is not an even count of columns within a head of {hd!r}"
    return None


def qkv_group(attn: nn.Module, form: AttentionForm) -> int:
    """How ``attn``'s Q/K/V columns are grouped per KV head, ``[q x n | k | v]``: n (GPT-NeoX's
    and Falcon's ``[q | k | v]`` per head: 1; Falcon's new architecture: heads / kv_heads), or 0
    for all q, all k, all v (Falcon's multi-query too, with its one KV head)."""
    if form.per_head_qkv:
        return 1
    if not form.layout_from_config or attn.multi_query and not attn.new_decoder_architecture:
        return 0
    return attn.num_heads // attn.num_kv_heads if attn.new_decoder_architecture else 1


def rotary_columns(attn: nn.Module, form: AttentionForm, cos_width: int) -> int:
    """The columns of each head that ``attn``'s rotary embedding rotates, the width its cos/sin
    must have: StableLM's and GPT-NeoX's ``rotary_ndims``; ``cos_width`` itself where the
    module's rotary function rotates the first ``cos.shape[-1]`` columns (GLM-4-MoE's partial
    rotary: an even width up to the head's); else the whole head."""
    if form.partial_rotary or form.per_head_qkv:
        return attn.rotary_ndims
    if form.rotary_by_cos and 2 <= cos_width <= attn.head_dim and cos_width % 2 == 0:
        return cos_width
    return attn.head_dim


def why_not_load_kernels() -> str | None:
    """Load the kernel modules the static-cache step reads outside its custom ops (None: loaded):
    a compiled decode step's trace cannot import a module (Dynamo does not trace
    ``importlib.import_module``), so this runs when a layer is patched or unpickled."""
    try:
        attention_kernel()
        qk_rope_kernel()
    except ImportError as e:
        return f"the decode attention kernels cannot be imported ({e})"
    return None


def attention_kernel():
    return triton_module("triton_decode_attention")  # on first use: importing hybridgemm needs no Triton


def qk_rope_kernel():
    return triton_module("triton_qk_rope")  # (as attention_kernel)
