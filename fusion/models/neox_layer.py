"""GPT-NeoX's decoder layer (``GPTNeoXLayer``: Pythia) on the fused decode step.

Its layer, per token, with a static cache::

    a = dense(attention(input_layernorm(x)))            # query_key_value: [q | k | v] per head
    parallel:   y = mlp(post_attention_layernorm(x)) + a + x
    sequential: h = a + x;  y = mlp(post_attention_layernorm(h)) + h

where ``mlp(t) = dense_4h_to_h(act(dense_h_to_4h(t)))``. The step (:func:`layer_step`) runs the
LayerNorms as the modules they are (no GEMM prologue computes a LayerNorm), then the shared
pieces of fusion/models/decode_step.py: the Q/K/V GEMM, the partial rotary and the cache write of
its per-head layout in one launch (``rope_store(per_head=True)``), the one-launch decode
attention, ``dense``, ``dense_h_to_4h`` with its activation in the epilogue
(``HybridTwoLayerMLP.up``), ``dense_4h_to_h``. The residual adds follow stock's order:
sequential, ``x`` in ``dense``'s epilogue and ``h`` in ``dense_4h_to_h``'s; parallel, ``a`` in
``dense_4h_to_h``'s epilogue and ``x`` added after, as stock's ``(mlp + a) + x`` adds the two
small terms first (``x`` first would round twice at the residual stream's magnitude).

Calls of up to ``decode_checks.DECODE_ROWS`` rows over a static cache that
``decode_checks.kv_slot`` accepts take the step (decode, or a short chunk appended to a filled
cache); any other call (a prompt's prefill, a dynamic cache, training, gradients wanted, hooks
on the modules the step does not call, a LoRA layer over one of its linears) runs the layer's
own forward over its patched linears. GPT-NeoX-20B's ``gelu_fast`` activation has no fused
epilogue: its MLP, and so its layers, stay unpatched. Decided as for the other families
(fusion/models/decode_checks.py): the forward statement by statement when patched, the call's
operands per call. Decided as for the other families (fusion/models/decode_checks.py): the forward
statement by statement when patched, the call's operands per call.
"""

from __future__ import annotations

from torch import Tensor, nn

from hybridgemm.mlp import HybridTwoLayerMLP

from . import decode_checks as checks
from . import decode_step
from .source_forms import body_statements

LAYER_CLASS = "GPTNeoXLayer"
ATTENTION = "attention"  # the layer's attention module
DROPOUTS = ("post_attention_dropout", "post_mlp_dropout")
LAYER_NORM_NAMES = checks.LAYER_NORM_NAMES  # input_layernorm, post_attention_layernorm: LayerNorm modules
NORMS_AS_MODULES = "gpt_neox"  # the layer's decode_checks.NORMS_AS_MODULES mark: its norms run as modules
# transformers 5.3-5.25's GPTNeoXLayer.forward, statement by statement
_LAYER_BODY = (
    "attn_output,_=self.attention(self.input_layernorm(hidden_states),attention_mask=attention_mask,"
    "position_ids=position_ids,layer_past=layer_past,use_cache=use_cache,position_embeddings=position_embeddings,"
    "**kwargs)",
    "attn_output=self.post_attention_dropout(attn_output)",
    "ifself.use_parallel_residual:mlp_output=self.mlp(self.post_attention_layernorm(hidden_states))"
    "mlp_output=self.post_mlp_dropout(mlp_output)hidden_states=mlp_output+attn_output+hidden_states"
    "else:attn_output=attn_output+hidden_statesmlp_output=self.mlp(self.post_attention_layernorm(attn_output))"
    "mlp_output=self.post_mlp_dropout(mlp_output)hidden_states=mlp_output+attn_output",
    "returnhidden_states",
)


def is_neox_layer(mod: nn.Module) -> bool:
    t = type(mod)
    return t.__name__ == LAYER_CLASS and t.__module__.startswith("transformers")


def _parts(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module, nn.Module]:
    """(attention, query_key_value, dense, dense_h_to_4h, dense_4h_to_h) of ``layer``."""
    attn, mlp = layer._modules[ATTENTION], layer._modules["mlp"]
    return (attn, attn._modules.get(checks.PER_HEAD_QKV_NAME), attn._modules.get("dense"),
            mlp._modules.get("dense_h_to_4h"), mlp._modules.get("dense_4h_to_h"))


def why_not_fuse(layer: nn.Module) -> str | None:
    """Why the GPT-NeoX layer ``layer`` cannot take the step (None: it can): its forward must be
    :data:`_LAYER_BODY`, its attention GPT-NeoX's form able to take the static-cache step, its
    linears the ones ``patch`` made (the activation in ``dense_h_to_4h``'s epilogue), its norms
    modules and its dropouts ``nn.Dropout``. Raises nothing."""
    if not checks.statements_match(body_statements(type(layer).forward), _LAYER_BODY):
        return f"{type(layer).__name__}.forward is not a decoder layer this step computes"
    attn, mlp = layer._modules.get(ATTENTION), layer._modules.get("mlp")
    if attn is None or type(mlp) is not HybridTwoLayerMLP:
        return "its MLP's dense_h_to_4h and dense_4h_to_h are not patched"
    why = checks.why_not_attention_form(type(attn))
    if why is not None:
        return why
    if not checks.attention_form(type(attn)).per_head_qkv:
        return f"its {type(attn).__name__} is not GPT-NeoX's attention"
    why = _why_not_parts(layer)
    if why is not None:
        return why
    attn, qkv = _parts(layer)[:2]
    if not all(isinstance(layer._modules.get(n), nn.Module) for n in LAYER_NORM_NAMES):
        return f"it has no {' and '.join(LAYER_NORM_NAMES)} modules"
    if not all(type(layer._modules.get(n)) is nn.Dropout for n in DROPOUTS):
        return f"its {' and '.join(DROPOUTS)} are not nn.Dropout modules"
    if not isinstance(getattr(layer, "use_parallel_residual", None), bool):
        return f"its use_parallel_residual is {getattr(layer, 'use_parallel_residual', None)!r}, not a bool"
    heads, hd = getattr(attn.config, "num_attention_heads", None), getattr(attn, "head_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (heads, hd)) or qkv.weight.shape[0] != 3 * heads * hd:
        return f"its {checks.PER_HEAD_QKV_NAME}'s {qkv.weight.shape[0]} rows are not the config's q, k and v heads"
    return checks.why_not_fuse_attention(attn)


def _why_not_parts(layer: nn.Module) -> str | None:
    """Why the linears the step runs are not the ones patch made (None: they are): patched (FP8
    included) or row-parallel, none wrapped since (a LoRA layer over one: the layer's own forward
    runs it) nor replaced."""
    _, qkv, dense, up, down = _parts(layer)
    for name, proj, fits in ((checks.PER_HEAD_QKV_NAME, qkv, checks.own_projection),
                             ("dense_h_to_4h", up, checks.own_projection),
                             ("dense", dense, checks.fusable_projection),
                             ("dense_4h_to_h", down, checks.fusable_projection)):
        if not fits(proj):
            return f"its {name} is a {type(proj).__module__}.{type(proj).__qualname__}, not a linear hybridgemm " \
                   "patched"
    return None


def step_slot(layer: nn.Module, x: Tensor, kwargs: dict):
    """The static-cache slot (``decode_checks.kv_slot``) when this call of a fused GPT-NeoX layer
    takes the step, else None (the layer's own forward runs)."""
    if not checks.takes_static_step(layer) or not checks.operands_allow(layer, x, DROPOUTS):
        return None
    if type(layer._modules.get("mlp")) is not HybridTwoLayerMLP or _why_not_parts(layer) is not None:
        return None
    attn, qkv, dense, up, down = _parts(layer)
    # the modules whose forwards the step does not call (it calls the norms, and dense_h_to_4h
    # where hooked); the norms' parameters count as the GEMMs' do (dtype, gradients wanted)
    norms = [layer._modules[n] for n in LAYER_NORM_NAMES]
    skipped = [attn, qkv, dense, layer._modules["mlp"], down, *(layer._modules.get(n) for n in DROPOUTS)]
    if not checks.modules_allow(x, [*norms, qkv, dense, up, down], skipped):
        return None
    return checks.kv_slot(attn, x, kwargs)


def layer_step(layer: nn.Module, x: Tensor, slot, kwargs: dict, counters: Tensor | None) -> Tensor:
    """The layer for a call :func:`step_slot` accepted (``slot``: its static-cache slot)."""
    attn, qkv, dense, _, down = _parts(layer)
    mlp = layer._modules["mlp"]
    o = decode_step.static_attention(attn, slot, layer.input_layernorm(x), None, qkv, kwargs, counters)
    if layer.use_parallel_residual:  # (mlp + a) + x, as stock adds it: the small terms first
        a = decode_step.project(dense, o, counters)
        return decode_step.project_add(down, mlp.up(layer.post_attention_layernorm(x)), a, counters) + x
    h = decode_step.project_add(dense, o, x, counters)
    return decode_step.project_add(down, mlp.up(layer.post_attention_layernorm(h)), h, counters)


__all__ = ["LAYER_CLASS", "is_neox_layer", "layer_step", "step_slot", "why_not_fuse"]
