"""Decoder layers whose norms are LayerNorms, whose Q/K/V is one linear and whose MLP is two
linears with an activation between (GPT-NeoX's ``GPTNeoXLayer``: Pythia; Falcon's
``FalconDecoderLayer``) on the fused decode step. Each family is a :class:`LayerFamily`: where
its parts live, its forward's statements, which norms feed what and how its residual adds.

Per token, with a static cache::

    a = dense(attention(attention_norm(x)))
    parallel:   y = mlp(mlp_norm(x)) + a + x          # GPT-NeoX's use_parallel_residual; Falcon's
                                                       # parallel_attn and new architecture
    sequential: h = a + x;  y = mlp(mlp_norm(h)) + h

where ``mlp(t) = dense_4h_to_h(act(dense_h_to_4h(t)))``; Falcon's one-norm layers feed the MLP
the attention's normalised input. The step (:func:`layer_step`) runs the LayerNorms (no GEMM
prologue computes a LayerNorm): under torch.compile each norm of one input (Falcon's one
norm, a sequential layer's two) in one launch where it is a plain ``nn.LayerNorm``
(fusion/models/compiled_layer_norm.py), else, and where two norms read x (GPT-NeoX's parallel
layers: Inductor fuses them into one kernel), as the modules they are; then the shared pieces
of fusion/models/decode_step.py: the Q/K/V GEMM with the rotary and the cache write in its
epilogue (``rope_qkv``; GPT-NeoX's weight rows ``[q | k | v]`` per head and its partial rotary;
Falcon's ``[q | k | v]`` with one KV head (multi-query), grouped per KV head ``[q x n | k | v]``
(its new architecture) or per head; where the table's GEMM is not split-K, the GEMM and then
``rope_store``'s one launch), the one-launch decode attention,
``dense``, ``dense_h_to_4h`` with its activation in the epilogue (``HybridTwoLayerMLP.up``),
``dense_4h_to_h``. In a parallel layer ``dense_h_to_4h`` does not wait for the attention and
is launched right after it, before ``dense``: a CUDA graph recorded over the step runs the
attention kernel on a second stream beside it (``decode_step.static_attention_beside``).
The residual adds follow stock's order: sequential, ``x`` in ``dense``'s epilogue and ``h`` in
``dense_4h_to_h``'s; parallel, ``mlp + a`` and then ``x``, as stock's ``(mlp + a) + x`` adds
the two small terms first (``x`` first would round twice at the residual stream's magnitude):
under torch.compile ``dense`` and ``dense_4h_to_h`` are one split-K launch over both K sources,
``mlp + a`` summed in fp32 and ``x`` added in its epilogue; eager, ``a`` and then ``x`` in
``dense_4h_to_h``'s epilogue, each sum rounded (``decode_step.project_pair_add``).

Calls of up to ``decode_checks.DECODE_ROWS`` rows over a static cache that
``decode_checks.kv_slot`` accepts take the step (decode, or a short chunk appended to a filled
cache); any other call (a prompt's prefill, a dynamic cache, training with dropout, gradients
wanted, attention weights asked for, hooks on the modules the step does not call, a LoRA layer
over one of its linears) runs the layer's own forward over its patched linears. Not fused, with
the reason in the report: ALiBi, and, under transformers 5.8-5.24 (whose Falcon attention calls SDPA
itself: fusion/models/legacy_falcon.py), a new-architecture Falcon with fewer KV heads than query
heads (that release caches K and V copied to every query head). Decided as
for the other families (fusion/models/decode_checks.py): the forward statement by statement
when patched, the call's operands per call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor, nn

from hybridgemm.mlp import HybridTwoLayerMLP, activated_gemm

from . import attention_forms as forms
from . import decode_checks as checks
from . import decode_step
from .checked_forms import PER_HEAD_QKV_NAME
from .compiled_layer_norm import layer_norm
from .source_forms import body_statements


@dataclass(frozen=True)
class LayerFamily:
    """Where a family's decoder layer keeps what the step reads, and what its forward computes."""

    layer_class: str  # transformers' class name
    attention: str  # the layer's attention module
    body: tuple  # its forward, statement by statement (forms.statements_match)
    norms_as_modules: str  # its decode_checks.NORMS_AS_MODULES mark (its norms run as modules)
    # (attention norm, MLP norm or None: the attention's normalised input, parallel residual), or
    # why the instance's configuration is not one the step computes
    shape: Callable[[nn.Module], tuple[str, str | None, bool] | str]
    dropouts: tuple[str, ...] = ()  # its nn.Dropout modules (the residuals')
    dropping: Callable[[nn.Module], bool] = lambda layer: False  # does a call of it drop anything now
    returns_weights: bool = False  # its forward returns (hidden_states, attention weights)


def _neox_shape(layer: nn.Module):
    parallel = getattr(layer, "use_parallel_residual", None)
    if not isinstance(parallel, bool):
        return f"its use_parallel_residual is {parallel!r}, not a bool"
    return "input_layernorm", "post_attention_layernorm", parallel


def _falcon_shape(layer: nn.Module):
    config = layer.config
    new, parallel = config.new_decoder_architecture, config.parallel_attn
    norms = getattr(config, "num_ln_in_parallel_attn", None)
    if new and norms == 2:
        return "ln_attn", "ln_mlp", True
    if new and not (parallel and norms == 1):
        return f"its configuration (new_decoder_architecture, parallel_attn {parallel!r}, num_ln_in_parallel_attn " \
               f"{norms!r}) gives its MLP no input"
    if new or parallel:
        return "input_layernorm", None, True
    return "input_layernorm", "post_attention_layernorm", False


def _falcon_dropping(layer: nn.Module) -> bool:
    return layer.training and (layer.config.attention_dropout > 0 or layer.config.hidden_dropout > 0)


_NEOX_CALL = ("attn_output,_=self.attention(self.input_layernorm(hidden_states),attention_mask=attention_mask,"
              "position_ids=position_ids,layer_past=layer_past,use_cache=use_cache,"
              "position_embeddings=position_embeddings,**kwargs)")
FAMILIES = {f.layer_class: f for f in (
    # transformers 5.8-5.25's GPTNeoXLayer.forward
    LayerFamily("GPTNeoXLayer", "attention", (
        _NEOX_CALL,
        "attn_output=self.post_attention_dropout(attn_output)",
        "ifself.use_parallel_residual:mlp_output=self.mlp(self.post_attention_layernorm(hidden_states))"
        "mlp_output=self.post_mlp_dropout(mlp_output)hidden_states=mlp_output+attn_output+hidden_states"
        "else:attn_output=attn_output+hidden_statesmlp_output=self.mlp(self.post_attention_layernorm(attn_output))"
        "mlp_output=self.post_mlp_dropout(mlp_output)hidden_states=mlp_output+attn_output",
        "returnhidden_states"), "gpt_neox", _neox_shape, dropouts=("post_attention_dropout", "post_mlp_dropout")),
    # transformers 5.8-5.25's FalconDecoderLayer.forward (dropout_add: _DROPOUT_ADD); before 5.25 it
    # passes its attention the ALiBi tensor (None for the rotary models the step takes: step_slot)
    LayerFamily("FalconDecoderLayer", "self_attention", (
        "residual=hidden_states",
        "ifself.config.new_decoder_architectureandself.config.num_ln_in_parallel_attn==2:attention_layernorm_out="
        "self.ln_attn(hidden_states)mlp_layernorm_out=self.ln_mlp(hidden_states)else:attention_layernorm_out="
        "self.input_layernorm(hidden_states)",
        ("attention_output,attn_weights=self.self_attention(attention_layernorm_out,layer_past=layer_past,"
         "attention_mask=attention_mask,position_ids=position_ids,use_cache=use_cache,"
         "output_attentions=output_attentions,position_embeddings=position_embeddings)",
         "attention_output,attn_weights=self.self_attention(attention_layernorm_out,layer_past=layer_past,"
         "attention_mask=attention_mask,position_ids=position_ids,alibi=alibi,use_cache=use_cache,"
         "output_attentions=output_attentions,position_embeddings=position_embeddings)"),
        "ifnotself.config.new_decoder_architecture:ifself.config.parallel_attn:mlp_layernorm_out="
        "attention_layernorm_outelse:residual=dropout_add(attention_output,residual,self.config.attention_dropout,"
        "training=self.training)mlp_layernorm_out=self.post_attention_layernorm(residual)",
        "ifself.config.new_decoder_architectureandself.config.parallel_attnand(self.config.num_ln_in_parallel_attn"
        "==1):mlp_layernorm_out=attention_layernorm_out",
        "mlp_output=self.mlp(mlp_layernorm_out)",
        "ifself.config.new_decoder_architectureorself.config.parallel_attn:mlp_output+=attention_output",
        "output=dropout_add(mlp_output,residual,self.config.hidden_dropout,training=self.training)",
        "return(output,attn_weights)"), "falcon", _falcon_shape, dropping=_falcon_dropping,
        returns_weights=True),
)}
# Falcon's residual add: the dropout's output added to the residual (x + out)
_DROPOUT_ADD = ("out=F.dropout(x,p=prob,training=training)", "out=residual+out", "returnout")


_FAMILY_OF_CLASS: dict[type, LayerFamily | None] = {}


def family_of(mod: nn.Module) -> LayerFamily | None:
    """The :class:`LayerFamily` of ``mod``, a transformers decoder layer of one of these families
    or the fused class patch made of one (None: neither); looked up once per class."""
    t = type(mod)
    if t not in _FAMILY_OF_CLASS:
        _FAMILY_OF_CLASS[t] = next((FAMILIES[c.__name__] for c in t.__mro__ if c.__name__ in FAMILIES
                                    and c.__module__.startswith("transformers")), None)
    return _FAMILY_OF_CLASS[t]


def norm_names(layer: nn.Module) -> tuple[str, ...]:
    """The names of the norms a fused ``layer``'s step calls as modules: its family's (as its
    configuration says), else a pre-norm layer's two (decode_checks.LAYER_NORM_NAMES)."""
    family = family_of(layer)
    shape = family.shape(layer) if family is not None else None
    if shape is None or isinstance(shape, str):
        return checks.LAYER_NORM_NAMES
    return tuple(n for n in shape[:2] if n is not None)


def _parts(layer: nn.Module, family: LayerFamily) -> tuple[nn.Module, ...]:
    """(attention, query_key_value, dense, dense_h_to_4h, dense_4h_to_h) of ``layer``."""
    attn, mlp = layer._modules[family.attention], layer._modules["mlp"]
    return (attn, attn._modules.get(PER_HEAD_QKV_NAME), attn._modules.get("dense"),
            mlp._modules.get("dense_h_to_4h"), mlp._modules.get("dense_4h_to_h"))


def why_not_fuse(layer: nn.Module) -> str | None:
    """Why the layer ``layer`` of a :class:`LayerFamily` cannot take the step (None: it can): its
    forward must be its family's, its configuration one the step computes, its attention a form
    able to take the static-cache step, its linears the ones ``patch`` made, its norms modules
    and its dropouts ``nn.Dropout``. Raises nothing."""
    family = family_of(layer)
    forward = type(layer).forward
    if family is None or not forms.statements_match(body_statements(forward), family.body):
        return f"{type(layer).__name__}.forward is not a decoder layer this step computes"
    if family.returns_weights and not forms.statements_match(
            body_statements(getattr(inspect.unwrap(forward), "__globals__", {}).get("dropout_add")), _DROPOUT_ADD):
        return f"{type(layer).__name__}'s dropout_add is not the residual add this step computes"
    shape = family.shape(layer)
    if isinstance(shape, str):
        return shape
    attn, mlp = layer._modules.get(family.attention), layer._modules.get("mlp")
    if attn is None or type(mlp) is not HybridTwoLayerMLP:
        return "its MLP's dense_h_to_4h and dense_4h_to_h are not patched"
    why = forms.why_not_attention_form(type(attn)) or _why_not_layout(attn)
    if why is not None:
        return why
    why = _why_not_parts(layer, family)
    if why is not None:
        return why
    norms = [n for n in shape[:2] if n is not None]
    if not all(isinstance(layer._modules.get(n), nn.Module) for n in norms):
        return f"it has no {' and '.join(norms)} modules"
    if not all(type(layer._modules.get(n)) is nn.Dropout for n in family.dropouts):
        return f"its {' and '.join(family.dropouts)} are not nn.Dropout modules"
    return forms.why_not_fuse_attention(attn)


def _why_not_layout(attn: nn.Module) -> str | None:
    """Why the rotary/cache launch cannot read ``attn``'s Q/K/V columns (None: it can): GPT-NeoX's
    per head, or Falcon's as its instance says (``forms.qkv_group``), with rows for the
    config's heads and no ALiBi; under transformers 5.8-5.24 not a new-architecture Falcon with
    fewer KV heads than heads (that release caches its K and V copied to every query head)."""
    form = forms.attention_form(type(attn))
    if not (form.per_head_qkv or form.layout_from_config):
        return f"its {type(attn).__name__} is not one of these families' attentions"
    qkv = attn._modules.get(PER_HEAD_QKV_NAME)
    heads, hd = getattr(attn.config, "num_attention_heads", None), getattr(attn, form.head_dim_name, None)
    kv_heads = heads
    if form.layout_from_config:
        if getattr(attn.config, "alibi", False):
            return "it uses ALiBi, not a rotary embedding"
        kv_heads = attn.num_kv_heads
        if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
            return f"its {kv_heads!r} key/value heads do not divide its {heads} heads"
        if form.split_heads_falcon and attn.new_decoder_architecture and kv_heads != heads:
            return "its cache holds K and V copied to each of its query heads (this transformers release's Falcon " \
                   "attention), which the step's cache write does not make"
    if not all(isinstance(v, int) and v > 0 for v in (heads, hd)) or getattr(qkv, "weight", None) is None \
            or qkv.weight.shape[0] != (heads + 2 * kv_heads) * hd:
        return f"its {PER_HEAD_QKV_NAME}'s rows are not the config's q, k and v heads"
    return None


def _why_not_parts(layer: nn.Module, family: LayerFamily) -> str | None:
    """Why the linears the step runs are not the ones patch made (None: they are): patched (FP8
    included) or row-parallel, none wrapped since (a LoRA layer over one: the layer's own forward
    runs it) nor replaced."""
    _, qkv, dense, up, down = _parts(layer, family)
    for name, proj, fits in ((PER_HEAD_QKV_NAME, qkv, checks.own_projection),
                             ("dense_h_to_4h", up, checks.own_projection),
                             ("dense", dense, checks.fusable_projection),
                             ("dense_4h_to_h", down, checks.fusable_projection)):
        if not fits(proj):
            return f"its {name} is a {type(proj).__module__}.{type(proj).__qualname__}, not a linear hybridgemm " \
                   "patched"
    return None


class StepCall(NamedTuple):
    """What :func:`step_slot` read of a call that takes the step, for :func:`layer_step`."""

    family: LayerFamily
    shape: tuple[str, str | None, bool]  # LayerFamily.shape
    parts: tuple[nn.Module, ...]  # _parts
    slot: tuple  # decode_checks.kv_slot


def step_slot(layer: nn.Module, x: Tensor, kwargs: dict) -> StepCall | None:
    """What :func:`layer_step` needs when this call of a fused layer takes the step (its
    static-cache slot: ``decode_checks.kv_slot``), else None (the layer's own forward runs)."""
    family = family_of(layer)
    if not checks.takes_static_step(layer) or not checks.operands_allow(layer, x, family.dropouts) \
            or family.dropping(layer) or kwargs.get("output_attentions") or kwargs.get("alibi") is not None:
        return None
    if type(layer._modules.get("mlp")) is not HybridTwoLayerMLP or _why_not_parts(layer, family) is not None:
        return None
    shape = family.shape(layer)
    if isinstance(shape, str):
        return None
    parts = attn, qkv, dense, up, down = _parts(layer, family)
    # the modules whose forwards the step does not call (it calls the norms, and dense_h_to_4h
    # where hooked); the norms' parameters count as the GEMMs' do (dtype, gradients wanted)
    norms = [layer._modules[n] for n in shape[:2] if n is not None]
    skipped = [attn, qkv, dense, layer._modules["mlp"], down, *(layer._modules.get(n) for n in family.dropouts)]
    if not checks.modules_allow(x, [*norms, qkv, dense, up, down], skipped):
        return None
    slot = checks.kv_slot(attn, x, kwargs)
    return None if slot is None else StepCall(family, shape, parts, slot)


def layer_step(layer: nn.Module, x: Tensor, call: StepCall, kwargs: dict, counters: Tensor | None):
    """The layer for a call :func:`step_slot` accepted (``call``: what it read): its output, with
    ``None`` for the attention weights where its forward returns them."""
    attn, qkv, dense, _, down = call.parts
    attention_norm, mlp_norm, parallel = call.shape
    slot = call.slot
    mlp = layer._modules["mlp"]
    if parallel and mlp_norm is not None:
        # two norms of x: Inductor computes both in one kernel, which measured faster than the
        # LayerNorm kernel's launches (pythia-6.9b, perf/results/h200/README.md)
        n, mlp_in = layer._modules[attention_norm](x), layer._modules[mlp_norm](x)
    else:
        n = layer_norm(layer._modules[attention_norm], x)
        mlp_in = n
    up = activated_gemm(mlp, "dense_h_to_4h", mlp.activation) if parallel else None
    if up is not None:  # the MLP's first GEMM does not wait for the attention: they run side by side
        o, g = decode_step.static_attention_beside(attn, slot, n, qkv, kwargs, counters, mlp_in, up)
    else:
        o = decode_step.static_attention(attn, slot, n, None, qkv, kwargs, counters)
    if parallel:  # (mlp + a) + x, as stock adds it: the small terms first
        y = decode_step.project_pair_add(down, mlp.up(mlp_in) if up is None else g, dense, o, x, counters)
    else:
        h = decode_step.project_add(dense, o, x, counters)
        y = decode_step.project_add(down, mlp.up(layer_norm(layer._modules[mlp_norm], h)), h, counters)
    return (y, None) if call.family.returns_weights else y


__all__ = ["FAMILIES", "LayerFamily", "StepCall", "family_of", "layer_step", "norm_names", "step_slot", "why_not_fuse"]
