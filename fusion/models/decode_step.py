"""The fused decode step of a decoder layer: :func:`layer_step` over five fused pieces.

A stock pre-norm layer runs, per token::

    h = x + o_proj(attn(qkv(rmsnorm1(x))))        # norm kernel, QKV GEMM, rotary, cache write, attention, O, add
    y = h + down(glu(gate_up(rmsnorm2(h))))       # norm kernel, gate/up GEMM, product, down GEMM, add

Here the same step is five launches where the decisions allow, the fused pieces of
fusion/models/fused_pieces.py: the QKV GEMM normalising x as it loads it, rotating q and k
and writing the cache in its epilogue (``norm_rope_qkv``), the attention in one launch
(``attend``), O with the residual in its epilogue (``linear_residual``), gate/up normalising h
on load with the GLU product in its epilogue (``gated_norm``), down with the residual.

Where the attention runs (:func:`attention`): with a static cache that
``decode_checks.kv_slot`` accepts, :func:`norm_rope_qkv` then :func:`attend` (or SDPA for
several tokens); with any other cache, the attention module's computation written out here
from its :class:`~hybridgemm.models.forms.AttentionForm` (the q/k/v head views, the
q/k norms where the module has them, the module's own rotary function, ``cache.update``, the
registered attention function), fed the normalised Q/K/V of :func:`norm_linear`; in eager
calls the standard rotary there is one launch and one new token's attention the decode
attention kernel over what the cache returned (:func:`_rope_in_kernel`,
:func:`_kernel_attention`). No value travels between the pieces on module attributes: each
returns what the next one takes.

An eager prefill (more rows than the step takes) of a pre-norm layer runs :func:`prefill_step`:
the stock forward's modules, with the attention's computation after Q/K/V written out as above,
so that the standard rotary is one launch rather than the stock function's several kernels.

Numerics: the residual is added to the GEMM result after its rounding, as the stock add does;
a fused norm rounds ``x * g`` once where the stock module rounds ``x * rstd`` and then the
product with g, so results agree with the stock layer's to the inputs' rounding, not bit for
bit. Inference only (no autograd).

LoRA (PEFT) layers over the projections: their terms are added to the fused GEMM's slices
before what follows the GEMM (the q/k norms, rotary and cache write of Q/K/V; the GLU product
of gate/up; the residual of O and down), as PEFT adds them to its base layer's output
(fusion/models/adapter_terms.py); a fused epilogue that would come before them runs apart.

Tensor parallel (``hybridgemm.parallelize``): O and down are row-parallel
(:class:`~hybridgemm.linear_layer.PartialSumLinear`); :func:`project_add` puts the residual
where the bias is (one rank's GEMM) or into the sum (``sums_residual``), so the sum holds the
residual and the bias once each and no separate add runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm.diagnostics import warn_once
from hybridgemm.fp8_modules import weight_scale_of
from hybridgemm.fused_rows import FusedLinears
from hybridgemm.linear_layer import PartialSumLinear
from hybridgemm.mlp import FUSED_GATE_UP, GLU_FUNCTIONS, ActivatedGemm, run_activated
from hybridgemm.norm import Fp32FactorRMSNorm, add_norm, norm_operand

from . import adapter_terms, moe_block
from . import attention_forms as forms
from . import decode_checks as checks
from .fused_pieces import (
    attend,
    attend_beside,
    gated_norm,
    linear_residual,
    norm_linear,
    norm_rope_qkv,
    normed,
    pair_residual,
    qk_rope_store,
    rope_qkv,
    rotate_store,
)

QKV_NAME = checks.QKV_NAME
# Keyword arguments of the attention forward that the stock one does not pass on to the
# attention function (or to cache.update).
_CONSUMED = ("hidden_states", "position_embeddings", "attention_mask", *checks.CACHE_ARGUMENTS, "cache_position")


def static_attention(attn: nn.Module, slot, x: Tensor, norm: nn.Module | None, qkv: nn.Module, kwargs: dict,
                     counters: Tensor | None) -> Tensor:
    """The attention sublayer's output before O with a static cache (``slot`` from
    ``decode_checks.kv_slot``), x normalised by ``norm`` in the Q/K/V GEMM's prologue (None: x
    as it is): ``[B, S, heads * hd]``."""
    return _static_attention(attn, slot, x, norm, qkv, kwargs, counters, None)[0]


def static_attention_beside(attn: nn.Module, slot, x: Tensor, qkv: nn.Module, kwargs: dict,
                            counters: Tensor | None, mlp_in: Tensor, up: ActivatedGemm) -> tuple[Tensor, Tensor]:
    """:func:`static_attention` of a parallel layer (x normalised already), and its MLP's first
    GEMM ``up`` of ``mlp_in``, which the attention does not feed: where the decode attention
    kernel runs, it runs beside that GEMM (``fused_pieces.attend_beside``), else one after the
    other. ``(attention output, up's output)``."""
    out, g = _static_attention(attn, slot, x, None, qkv, kwargs, counters, (mlp_in, up))
    return out, run_activated(mlp_in, *up) if g is None else g


def _static_attention(attn: nn.Module, slot, x: Tensor, norm: nn.Module | None, qkv: nn.Module, kwargs: dict,
                      counters: Tensor | None, beside: tuple[Tensor, ActivatedGemm] | None
                      ) -> tuple[Tensor, Tensor | None]:
    # (the output, and beside's GEMM where it ran beside the attention kernel, else None)
    layer, cos, sin, first = slot
    b, s = x.shape[:2]
    keys, values = layer.keys, layer.values
    hd = keys.shape[-1]  # (kv_slot checked it is the attention's head width)
    kv_heads = keys.shape[1]
    heads = qkv.weight.shape[0] // hd - 2 * kv_heads
    base = layer.cumulative_length
    qk = {}
    form = forms.attention_form(type(attn))
    if form.qk_norm:  # patched RMSNorms over head_dim of one formula and eps (forms.why_not_qk_norms)
        q_norm, k_norm = forms.qk_norms(attn, form)
        q_g, qk_eps, qk_offset = norm_operand(q_norm)
        qk = dict(q_norm=q_g, k_norm=norm_operand(k_norm)[0], qk_eps=float(qk_eps), qk_offset=qk_offset)
    slots = _slots(attn, qkv)
    adapters = any(adapter_terms.adds_terms(m) for m in slots)
    rotate = forms.rotates(attn, form)
    cos, sin = forms.kernel_cos_sin(form, cos, sin)  # (GLM's, Helium's, Ernie's interleaved)
    if not rotate and (qk or form.pair_rotary):
        # q/k norms without a rotary (EXAONE 4's global layers), or a rotary of neighbouring pairs
        # turned off (Cohere 2's global layers): the epilogue's tiles (whole heads for the norms)
        # rotate by cos 1, sin 0, which leaves every finite value as it is in fp32
        cos, sin, rotate = torch.ones_like(cos), torch.zeros_like(sin), True
    if form.full_qk_norm and not adapters and isinstance(attn.q_norm, Fp32FactorRMSNorm) \
            and isinstance(attn.k_norm, Fp32FactorRMSNorm):
        # q/k norms over all heads, which a tile of one head cannot compute: the GEMM, then the
        # norms, rotary and cache write in one more launch
        y = norm_linear(x, *_norm_args(norm), qkv.weight, qkv.bias, counters, weight_scale_of(qkv))
        q = qk_rope_store(y, attn.q_norm, attn.k_norm, cos, sin, keys, values, base, heads)
    elif adapters or form.full_qk_norm:
        # LoRA terms go in before the q/k norms and the rotary: the GEMM with its norm, the terms,
        # the norms, then the stock rotary and cache write (fused by Inductor under torch.compile)
        y = _qkv_with_adapters(x, norm, qkv, slots, counters) if adapters else \
            norm_linear(x, *_norm_args(norm), qkv.weight, qkv.bias, counters, weight_scale_of(qkv))
        y = rotate_store(y, cos, sin, keys, values, base, heads, kv_heads, qk.get("q_norm"), qk.get("k_norm"),
                          qk.get("qk_eps", 0.0), (attn.q_norm, attn.k_norm) if form.full_qk_norm else None,
                          qk.get("qk_offset"), form.pair_rotary, rotate, form.qk_after_rotary)
        q = y[..., : heads * hd]
    elif (form.partial_rotary or form.pair_rotary or form.per_head_qkv or form.layout_from_config) \
            and not form.cos_halved:
        # (StableLM's, Cohere's, GPT-NeoX's, Falcon's: their layers run the input norm as its module and
        # pass none; an RMSNorm operand given here would run apart first)
        q = rope_qkv(normed(x, *_norm_args(norm)), qkv.weight, qkv.bias, cos, sin, keys, values, base, heads, kv_heads,
                     forms.qkv_group(attn, form), form.pair_rotary, counters, weight_scale_of(qkv))
    else:
        y = norm_rope_qkv(x, *_norm_args(norm), qkv.weight, qkv.bias, cos, sin, keys, values,
                          base, heads, kv_heads, counters, weight_scale_of(qkv), **qk, rotate=rotate,
                          pairs=form.pair_rotary, qk_after_rotary=form.qk_after_rotary)
        q = y[..., : heads * hd]
    scale = forms.position_scale(attn, form, kwargs)
    if scale is not None:  # Ministral 3's factor per position, on the rotated queries as its forward has it
        q = (q.view(b, s, heads, hd) * scale.transpose(1, 2).to(q.dtype)).view(b, s, heads * hd)
    mask = kwargs.get("attention_mask")
    interface = form.attention_function(attn.config._attn_implementation)  # a user may have registered another
    sdpa = forms.computes_sdpa(interface)
    if s == 1 and (sdpa or checks.kernel_computes_eager(interface, form)):
        q = q.view(b, -1)
        if checks.kernel_takes(q, keys, values, mask, counters):
            # One launch: GQA without the expanded copy, the mask read as it is, and the
            # cache-length update (what StaticLayer.update does after computing the positions),
            # except a ``first`` layer's (kv_slot): the model derives the step's positions and
            # mask from that one's length, and Inductor may recompute a mask after this kernel,
            # so it stays a separate in-graph add whose ordering the compiler tracks.
            # (softcap: what the eager function computes; kv_slot turns a capped SDPA layer away)
            softcap = 0.0 if sdpa or not form.softcap else float(attn.attn_logit_softcapping or 0.0)
            scaling, step = float(form.scaling(attn)), 0 if first else s
            g = None
            if beside is None:
                out = attend(q, keys, values, mask, scaling, base, step, counters, softcap)
            else:
                out, g = attend_beside(q, keys, values, mask, scaling, base, step, counters, softcap, *beside)
            if first:
                base.add_(s)
            return out.view(b, 1, heads * hd), g
    base.add_(s)  # what StaticLayer.update does after computing the positions
    rep = heads // kv_heads
    shared_mask = mask is None or (mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
                                   and mask.shape[-1] == keys.shape[2])
    if s == 1 and b > 1 and rep > 1 and heads == rep * kv_heads and shared_mask and sdpa:
        # One query per sequence: the rep query heads that share a KV head become rep query rows
        # of that head (one row of the mask serves them all), so SDPA reads the cache as it is
        # instead of the rep-fold expanded copy that GQA otherwise makes of it. At batch 1 the
        # expanded copy is small, so batch 1 keeps the model's own SDPA call.
        q = q.reshape(b, kv_heads, rep, hd)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=form.scaling(attn))
        return out.reshape(b, 1, heads * hd), None
    q = q.reshape(b, s, heads, hd).transpose(1, 2)
    out, _ = interface(attn, q, keys, values, mask, dropout=0.0, scaling=form.scaling(attn),
                       **_function_kwargs(attn, form, _passed_kwargs(form, kwargs)))
    return out.reshape(b, s, -1).contiguous(), None


def _any_cache_attention(attn: nn.Module, x: Tensor, norm: nn.Module, qkv: nn.Module, kwargs: dict,
                         counters: Tensor | None) -> Tensor:
    """The attention sublayer's output before O with any cache (or none), as the module's own
    forward computes it (``forms.AttentionForm``), from the normalised Q/K/V of one
    :func:`norm_linear` launch: ``[B, S, heads * hd]``."""
    slots = _slots(attn, qkv)
    if any(adapter_terms.adds_terms(m) for m in slots):
        y = _qkv_with_adapters(x, norm, qkv, slots, counters)
    else:
        y = norm_linear(x, *_norm_args(norm), qkv.weight, qkv.bias, counters, weight_scale_of(qkv))
    return _attention_of_qkv(attn, y, checks.qkv_sizes(attn, qkv), kwargs, counters)


def _attention_of_qkv(attn: nn.Module, y: Tensor, sizes: tuple[int, int, int], kwargs: dict,
                      counters: Tensor | None) -> Tensor:
    """What the attention module's forward computes after its Q/K/V projection, whose output ``y``
    ``[B, S, sum(sizes)]`` holds q, k and v side by side: ``[B, S, heads * hd]``, before O."""
    form = forms.attention_form(type(attn))
    input_shape = y.shape[:-1]
    hidden_shape = (*input_shape, -1, attn.head_dim)
    cos, sin = kwargs["position_embeddings"]
    head_norms = form.partial_rotary and attn.qk_layernorm  # StableLM's per-head LayerNorms
    # norms on the head views before the rotary (Cohere's too; Hunyuan's come after it)
    view_norms = form.qk_norm and not form.qk_after_rotary or form.flagged_qk_norm and attn.use_qk_norm
    in_modules = form.full_qk_norm or view_norms or head_norms  # norms before the rotary: the module's rotary
    rotate = forms.rotates(attn, form)
    rotated = None if in_modules or not rotate else _rope_in_kernel(attn, form, y, cos, sin, sizes)
    q, k, v = y.split(sizes, dim=-1)
    if rotated is not None:
        q, k = rotated
    if form.full_qk_norm:  # over all the q (k) columns, before the head views (OLMo 2)
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if view_norms:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if head_norms:  # over the [B, heads, S, hd] views, as its forward calls them
        q, k = attn.q_layernorm(q), attn.k_layernorm(k)
    if rotated is None and rotate:
        q, k = _module_rotary(attn, form, q, k, cos, sin)
    if form.qk_after_rotary:  # over the rotated [B, heads, S, hd] views, as Hunyuan's forward calls them
        q_norm, k_norm = forms.qk_norms(attn, form)
        q, k = q_norm(q), k_norm(k)
    scale = forms.position_scale(attn, form, kwargs)
    if scale is not None:
        q = q * scale.to(q.dtype)
    rest = _passed_kwargs(form, kwargs)
    cache = checks.cache_of(kwargs)
    if cache is not None:  # as the module's forward calls it (checked_forms.UPDATE_FORMS)
        if form.update == "kwargs":
            k, v = cache.update(k, v, attn.layer_idx, kwargs={} if form.partial_rotary else rest)
        elif form.update == "cache_kwargs":
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
            k, v = cache.update(k, v, attn.layer_idx, cache_kwargs)
        else:
            k, v = cache.update(k, v, attn.layer_idx)
    interface = form.attention_function(attn.config._attn_implementation)
    if q.shape[2] == 1 and not attn.training and not torch.compiler.is_compiling():
        out = _kernel_attention(attn, form, interface, q, k, v, kwargs.get("attention_mask"), counters)
        if out is not None:
            return out.view(*input_shape, -1)
    out, _ = interface(attn, q, k, v, kwargs.get("attention_mask"),
                       dropout=0.0 if not attn.training else attn.attention_dropout, scaling=form.scaling(attn),
                       **_function_kwargs(attn, form, rest))
    return out.reshape(*input_shape, -1).contiguous()


def _passed_kwargs(form: forms.AttentionForm, kwargs: dict) -> dict:
    """The keyword arguments of the layer's call that the module's attention forward passes on
    to its attention function: all the step does not consume, or StableLM's and Falcon's
    ``position_ids`` alone (their layers pass their attentions no others)."""
    if form.partial_rotary or form.layout_from_config:
        return {"position_ids": kwargs.get("position_ids")}
    return {k: v for k, v in kwargs.items() if k not in _CONSUMED}


def _module_rotary(attn: nn.Module, form: forms.AttentionForm, q: Tensor, k: Tensor, cos: Tensor,
                   sin: Tensor) -> tuple[Tensor, Tensor]:
    """The module's rotary function over q and k [B, heads, S, hd] as its forward applies it: to
    the first ``rotary_ndims`` columns of each head, the rest concatenated after (StableLM), or
    to the whole heads."""
    rotary = forms.module_rotary(attn, form)
    if not form.partial_rotary:
        return rotary(q, k, cos, sin)
    r = attn.rotary_ndims
    q_rot, k_rot = rotary(q[..., :r], k[..., :r], cos, sin)
    return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


def _rope_in_kernel(attn: nn.Module, form: forms.AttentionForm, y: Tensor, cos: Tensor, sin: Tensor,
                    sizes: tuple[int, int, int]) -> tuple[Tensor, Tensor] | None:
    """The module's rotary embedding of the q and k columns of ``y`` in one launch
    (kernels/triton_qk_rope.py ``rope_qk``) in an eager call on the kernels' device, where the
    module's function is the standard one and cos/sin are of y's dtype (fp32 for Ernie 4.5's) over
    the columns its forward rotates (whole heads, StableLM's first ``rotary_ndims``, or cos's own width
    where the module's function rotates that many: ``forms.rotary_columns``); None otherwise (the
    caller runs the module's function)."""
    if torch.compiler.is_compiling() or not checks.on_kernel_device(y) or forms.why_not_rotary(attn) is not None \
            or cos.shape[-1] != forms.rotary_columns(attn, form, cos.shape[-1]):
        return None
    hd = attn.head_dim
    cos, sin = forms.kernel_cos_sin(form, cos, sin)
    kernel = forms.qk_rope_kernel()
    if sizes[0] % hd or sizes[1] % hd or kernel.check_rope(y, cos, sin, sizes[0] // hd, sizes[1] // hd,
                                                          fp32_cos=form.fp32_halved) is not None:
        return None
    return kernel.rope_qk(y, cos, sin, sizes[0] // hd, sizes[1] // hd, form.pair_rotary,
                          not form.cos_halved or form.fp32_halved)


def _kernel_attention(attn: nn.Module, form: forms.AttentionForm, interface, q: Tensor, k: Tensor, v: Tensor,
                      mask: Tensor | None, counters: Tensor | None) -> Tensor | None:
    """What the module's attention function computes for one query token per sequence (q
    ``[B, heads, 1, hd]``) over the keys and values its cache returned (a sliding-window layer's
    window, a dynamic cache's concatenation), in one launch of the decode attention kernel
    (eager calls: host-bound, where SDPA's GQA expansion or the eager function's ops are many
    launches): the function must compute SDPA (``forms.computes_sdpa``) without a softcap, or be
    the module's eager function of a form the kernel computes; the mask (which holds any sliding
    window) is read as it is. None where it is not, or where the kernel refuses the operands: the
    caller runs the function."""
    sdpa = forms.computes_sdpa(interface)
    if sdpa and form.softcap and getattr(attn, "attn_logit_softcapping", None) is not None:
        return None  # stock's SDPA function raises on a softcap: the call says so
    if not (sdpa or checks.kernel_computes_eager(interface, form)):
        return None
    b = q.shape[0]
    q2 = q.transpose(1, 2).reshape(b, -1)
    if not checks.kernel_takes(q2, k, v, mask, counters):
        return None
    from triton.errors import TritonError

    softcap = 0.0 if sdpa or not form.softcap else float(attn.attn_logit_softcapping or 0.0)
    try:
        return forms.attention_kernel().decode_attention(q2, k, v, mask, float(form.scaling(attn)),
                                                          q2.new_empty(q2.shape), step=0, counters=counters,
                                                          softcap=softcap)
    except (ValueError, TritonError) as e:  # refused or not compiled: nothing was launched
        warn_once(("decode_attention", tuple(k.shape), q2.shape[1], q2.dtype),
                  f"hybridgemm: the decode attention kernel could not run for keys of {tuple(k.shape)} ({e}); "
                  "that layer's attention runs on its attention function")
        return None


def _function_kwargs(attn: nn.Module, form: forms.AttentionForm, rest: dict) -> dict:
    """``rest`` with the window and softcap the module's forward gives its attention function."""
    window = form.sliding_window(attn)
    if window is not forms.NO_WINDOW:
        rest["sliding_window"] = window
    if form.softcap:
        rest["softcap"] = attn.attn_logit_softcapping
    return rest


def _norm_args(norm: nn.Module | None) -> tuple[Tensor | None, float, float | None]:
    """The norm operand ``(norm_weight, eps, norm_offset)`` a piece takes for the layer's ``norm``
    (none: no prologue; norm.norm_operand)."""
    return (None, 0.0, None) if norm is None else norm_operand(norm)


def _slots(owner: nn.Module, fused: nn.Module) -> list[nn.Module]:
    """The modules in the slots of a fused GEMM's parts (a slice, or the LoRA layer over it);
    none for a linear the checkpoint holds fused (Phi-3's)."""
    return [owner._modules[name.split(".")[0]] for name in getattr(fused, "names", ())]


def _qkv_with_adapters(x: Tensor, norm: nn.Module, qkv: nn.Module, slots: list[nn.Module],
                       counters: Tensor | None) -> Tensor:
    """The Q/K/V projection of ``rmsnorm(x)`` (x without a norm) in one launch, plus the terms
    of the LoRA layers in ``slots`` (which take the normalised x, as in the stock attention);
    for a call where some of them add terms."""
    y = norm_linear(x, *_norm_args(norm), qkv.weight, qkv.bias, counters, weight_scale_of(qkv))
    return adapter_terms.add_slice_terms(slots, normed(x, *_norm_args(norm)), y, qkv.sizes)


def attention(layer: nn.Module, x: Tensor, kwargs: dict, counters: Tensor | None, normed: bool = False) -> Tensor:
    """The attention sublayer of ``layer`` before O, for ``x`` normalised by the layer's input
    norm in the Q/K/V GEMM's prologue (``normed``: x is already normalised): the static-cache
    step where ``layer`` takes it and the call's cache allows, else the module's computation."""
    attn = layer.self_attn
    norm = None if normed else layer._modules.get("input_layernorm")  # (OLMo 2's layer has none)
    qkv = attn._modules[QKV_NAME]
    slot = checks.kv_slot(attn, x, kwargs) if checks.takes_static_step(layer) else None
    if slot is not None:
        return static_attention(attn, slot, x, norm, qkv, kwargs, counters)
    return _any_cache_attention(attn, x, norm, qkv, kwargs, counters)


# ------------------------------------------------------------------------------ the residuals

def project_add(proj: nn.Module, x: Tensor, residual: Tensor, counters: Tensor | None,
                residual_scale: float | None = None, residual2: Tensor | None = None) -> Tensor:
    """``residual + proj(x)`` for the layer's O or down projection. A row-parallel projection
    (:class:`PartialSumLinear`) whose sum adds the residual (``sums_residual``) gets it there:
    every rank's GEMM adds nothing but the one rank's bias. Otherwise the residual goes into
    the epilogue of the one rank's GEMM that adds the bias and the other ranks' GEMMs add
    nothing. Either way the sum over the ranks holds the residual and the bias once each, and
    no separate add runs. Every rank must take the same path (the decoder layer's conditions
    are the same on every rank, as the collectives already require). ``residual_scale``: the
    layer scales the projection before the add (Granite; never with a row-parallel one:
    decode_checks.why_not_fuse_layer). ``residual2``: then added to that sum (a parallel-residual
    layer's ``(mlp + a) + x``; in the one launch where the residual is, else after)."""
    scale = weight_scale_of(proj)
    if isinstance(proj, PartialSumLinear):
        y = _partial_sum_add(proj, x, residual, counters)
        return y if residual2 is None else y + residual2
    return linear_residual(x, proj.weight, proj.bias, residual, counters, scale, residual_scale, residual2)


def project_pair_add(proj: nn.Module, x: Tensor, proj2: nn.Module, x2: Tensor, residual: Tensor,
                     counters: Tensor | None, residual_first: bool = False) -> Tensor:
    """``(proj(x) + proj2(x2)) + residual`` for a parallel-residual layer's down (``proj``) and
    O (``proj2``) projections: both GEMMs in one launch under torch.compile where their weights
    are of x's dtype and neither is row-parallel (``fused_pieces.pair_residual``), else apart,
    each sum rounded as stock's: ``(mlp + a) + x`` (GPT-NeoX, Falcon), or with
    ``residual_first`` ``(x + a) + mlp`` (Cohere, StableLM)."""
    if isinstance(proj, PartialSumLinear) or isinstance(proj2, PartialSumLinear) \
            or weight_scale_of(proj) is not None or weight_scale_of(proj2) is not None:
        if residual_first:
            return project_add(proj, x, project_add(proj2, x2, residual, counters), counters)
        return project_add(proj, x, project(proj2, x2, counters), counters, residual2=residual)
    return pair_residual(x, proj.weight, proj.bias, x2, proj2.weight, proj2.bias, residual, counters, residual_first)


def _partial_sum_add(proj: PartialSumLinear, x: Tensor, residual: Tensor, counters: Tensor | None) -> Tensor:
    if proj.sums_residual:
        part = linear_residual(x, proj.weight, proj.bias if proj.adds_bias else None, None, counters)
        return proj.sum_parts_residual(part, residual)
    if proj.adds_bias:
        return proj.sum_parts(linear_residual(x, proj.weight, proj.bias, residual, counters))
    return proj.sum_parts(linear_residual(x, proj.weight, None, None, counters))


def project(proj: nn.Module, x: Tensor, counters: Tensor | None) -> Tensor:
    """``proj(x)`` for the layer's O or down projection, no residual (as :func:`project_add`;
    a row-parallel one's sum holds its bias once)."""
    if isinstance(proj, PartialSumLinear):
        return proj.sum_parts(linear_residual(x, proj.weight, proj.bias if proj.adds_bias else None, None, counters))
    return linear_residual(x, proj.weight, proj.bias, None, counters, weight_scale_of(proj))


def _slot_add(proj: nn.Module, x: Tensor, residual: Tensor, counters: Tensor | None,
              residual_scale: float | None) -> Tensor:
    """:func:`project_add` for the module in an O or down slot. A LoRA layer there that adds
    terms in this call: its base's GEMM, its terms added to the rounded result (as PEFT does),
    then the residual."""
    if not adapter_terms.adds_terms(proj):
        return project_add(checks.projection_base(proj), x, residual, counters, residual_scale)
    base = proj.base_layer
    y = adapter_terms.add_terms(proj, x, linear_residual(x, base.weight, base.bias, None, counters,
                                                         weight_scale_of(base)))
    return residual + (y if residual_scale is None else y * residual_scale)


def _mlp_inner(mlp: nn.Module, norm: nn.Module, h: Tensor, counters: Tensor | None) -> Tensor:
    """``glu(gate_up(norm2(h)))`` (``norm`` None: of h itself): one gated launch, or with LoRA
    terms on gate or up the GEMM with its norm, the terms (on the normalised h), then the product.
    ``counters``: the layer's, for the split-K launch of an FP8 gate/up."""
    gate_up = mlp._modules[FUSED_GATE_UP]
    slots = _slots(mlp, gate_up)
    if not any(adapter_terms.adds_terms(m) for m in slots):
        return gated_norm(h, *_norm_args(norm), gate_up.weight, gate_up.bias, mlp.glu_activation,
                          weight_scale_of(gate_up), counters)
    y = norm_linear(h, *_norm_args(norm), gate_up.weight, gate_up.bias, counters, weight_scale_of(gate_up))
    y = adapter_terms.add_slice_terms(slots, normed(h, *_norm_args(norm)), y, gate_up.sizes)
    gate, up = y.split(list(gate_up.sizes), dim=-1)
    return GLU_FUNCTIONS[mlp.glu_activation](gate) * up


def _slot_project(proj: nn.Module, x: Tensor, counters: Tensor | None) -> Tensor:
    """The O or down projection alone, for a post-norm layer (which normalises it before the
    add): its GEMM, and a LoRA layer's terms there added to the rounded result (as PEFT does)."""
    y = project(checks.projection_base(proj), x, counters)
    return adapter_terms.add_terms(proj, x, y) if adapter_terms.adds_terms(proj) else y


def _post_norm_step(layer: nn.Module, x: Tensor, kwargs: dict, counters: Tensor | None) -> Tensor:
    """Gemma 2/3's layer: ``h = x + post_attn_norm(O(attention(input_norm(x))))``,
    ``y = h + post_ff_norm(down(glu(gate_up(pre_ff_norm(h)))))`` (GLM-4's under other names; OLMo 2's:
    the same without the input norms); the norms of the outputs as the modules compute them, each
    with its add one Triton launch in eager calls (norm.add_norm; under torch.compile torch ops,
    which Inductor fuses)."""
    _, attention_norm, mlp_norm, output_norm = checks.layer_norms(layer)
    o = _slot_project(layer.self_attn.o_proj, attention(layer, x, kwargs, counters), counters)
    h = add_norm(x, attention_norm, o)
    down = _slot_project(layer.mlp.down_proj, _mlp_inner(layer.mlp, mlp_norm, h, counters), counters)
    return add_norm(h, output_norm, down)


def _norm_modules_step(layer: nn.Module, x: Tensor, kwargs: dict, counters: Tensor | None) -> Tensor:
    """Cohere's and StableLM's layers: ``n = input_norm(x)``, ``h = x + O(attention(n))``, then
    ``y = h + down(glu(gate_up(n)))`` (parallel: Cohere's, and StableLM's where its
    ``use_parallel_residual`` says so) or ``y = h + down(glu(gate_up(post_attention_norm(h))))``;
    their norms (LayerNorms) called as the modules they are (as stock), StableLM's MLP dropout
    the identity (checked per call). The stock parallel sum ``x + attention + mlp`` adds left to
    right, rounding after each add: the O epilogue's ``x + O`` and the down epilogue's add of the
    MLP round the same way. Under torch.compile a parallel layer without LoRA terms on O or down
    takes both in one launch (:func:`project_pair_add`): ``(mlp + attention) + x``, the two small
    terms summed in fp32 and rounded once, then ``x``."""
    n = layer.input_layernorm(x)
    o = attention(layer, n, kwargs, counters, normed=True)
    parallel = checks.norm_modules(layer) == "parallel" or layer.use_parallel_residual
    o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
    if parallel and not (adapter_terms.adds_terms(o_proj) or adapter_terms.adds_terms(down)):
        return project_pair_add(checks.projection_base(down), _mlp_inner(layer.mlp, None, n, counters),
                                checks.projection_base(o_proj), o, x, counters, residual_first=True)
    h = _slot_add(o_proj, o, x, counters, None)
    mlp_in = n if parallel else layer.post_attention_layernorm(h)
    return _slot_add(down, _mlp_inner(layer.mlp, None, mlp_in, counters), h, counters, None)


def prefill_step(layer: nn.Module, x: Tensor, kwargs: dict, counters: Tensor | None = None) -> Tensor:
    """A pre-norm layer for an eager call of more rows than the step takes (a prefill), as its
    forward computes it, ``h = x + O(attention(norm1(x)))``, ``y = h + mlp(norm2(h))``: the norms,
    Q/K/V's one GEMM, O and the MLP called as the modules they are; what the attention module does
    after its projection as :func:`_attention_of_qkv` computes it, the standard rotary one launch
    (kernels/triton_qk_rope.py ``rope_qk``, rounded as torch's ops round: the same bits as the
    stock functions' several element-wise kernels). For a call ``decode_checks.takes_prefill_step``
    accepted."""
    attn = layer.self_attn
    qkv = attn._modules[QKV_NAME]
    normed_x = layer.input_layernorm(x)
    y = qkv.stacked_output(normed_x) if isinstance(qkv, FusedLinears) else qkv(normed_x)
    h = _add_into(attn.o_proj(_attention_of_qkv(attn, y, checks.qkv_sizes(attn, qkv), kwargs, counters)), x)
    return _add_into(layer.mlp(layer.post_attention_layernorm(h)), h)


def _add_into(out: Tensor, residual: Tensor) -> Tensor:
    """``residual + out``, added into ``out`` (a sublayer's fresh output: one allocation and its
    host time fewer; the sum's bits are the same either way round) where it is a plain tensor of
    the sum's shape and dtype, else a new tensor."""
    if type(out) is Tensor and out.shape == residual.shape and out.dtype == residual.dtype and out.is_contiguous() \
            and out.data_ptr() != residual.data_ptr():
        return out.add_(residual)
    return residual + out


def layer_step(layer: nn.Module, x: Tensor, kwargs: dict, counters: Tensor | None = None) -> Tensor:
    """The whole decoder layer for a call ``decode_checks.takes_fused_path`` accepted:
    ``h = x + O(attention(norm1(x)))``, ``y = h + down(glu(gate_up(norm2(h))))`` (Granite:
    ``O(...)`` and ``down(...)`` times the layer's ``residual_multiplier``; Gemma 2/3: each
    normalised before its add, :func:`_post_norm_step`; Cohere, StableLM: :func:`_norm_modules_step`),
    with the terms of the LoRA layers over its projections (fusion/models/adapter_terms.py). A mixture-of-experts
    layer: ``y = h + moe_block(norm2(h))``, the add in the experts' down launch where
    fusion/models/moe_block.py takes the block, else the block (its router, the grouped expert
    kernels) and the norm called as the modules they are."""
    if checks.post_norms(layer):
        return _post_norm_step(layer, x, kwargs, counters)
    if checks.norm_modules(layer):
        return _norm_modules_step(layer, x, kwargs, counters)
    m = checks.residual_multiplier(layer)
    h = _slot_add(layer.self_attn.o_proj, attention(layer, x, kwargs, counters), x, counters, m)
    if checks.moe_block(layer.mlp):
        y = moe_block.block_step(layer, h)
        return h + layer.mlp(layer.post_attention_layernorm(h)) if y is None else y
    return _slot_add(layer.mlp.down_proj, _mlp_inner(layer.mlp, layer.post_attention_layernorm, h, counters), h,
                     counters, m)


__all__ = ["QKV_NAME", "attention", "layer_step", "prefill_step", "project", "project_add", "static_attention"]
