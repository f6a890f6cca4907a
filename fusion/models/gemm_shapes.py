"""The GEMM shapes a patched model runs, read from the modules :func:`hybridgemm.patch` put in
place (what ``hybridgemm autotune --hf-config`` tunes: the model built from the config on the
meta device and patched, fusion/cli/patch_command.py): a fused Q/K/V or gate/up weight, each
dispatched linear (:class:`~hybridgemm.HybridLinear`, FP8 included), GPT-2's Conv1D
stand-ins and mixture-of-experts routers (their logits GEMM). Modules patch left alone run
no dispatched GEMM and give no shape.

Names follow the presets' (autotune_cache/presets.py): ``qkv`` (a fused Q/K/V), ``o``,
``gate_up`` (one part's shape: the gated product runs two GEMMs of it past the gated
kernel's rows, fusion/mlp.py), ``down``, ``router``, ``lm_head``; other linears by their
attribute name. A linear whose epilogue carries its MLP's activation (GPT-NeoX's and Falcon's
``dense_h_to_4h``, BERT's intermediate ``dense``, GPT-2's ``c_fc``) gives its shape with that
activation: its table key is the activated epilogue's.
A shape belongs to attention when its module sits under a module named like an attention
block (``self_attn``, ``attn``, ``attention``, ...), else to the MLP and LM head group.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from hybridgemm.autotune_cache.presets import ProjectionShape
from hybridgemm.fused_rows import FusedLinears
from hybridgemm.linear_layer import HybridLinear
from hybridgemm.mlp import FUSED_GATE_UP, HybridIntermediate, HybridTwoLayerMLP
from hybridgemm.norm import Fp32FactorRMSNorm
from hybridgemm.router import HybridTopKRouter

from . import decode_checks
from .decoder_layer import HybridDecoderLayer
from .patching import HybridConv1D

ATTENTION_BLOCKS = frozenset({"self_attn", "attn", "attention", "self_attention", "cross_attn", "encoder_attn"})
_ROLES = {"o_proj": "o", "out_proj": "o", "dense": "o", "c_proj": "o", "c_attn": "qkv", "qkv_proj": "qkv",
          "query_key_value": "qkv", "Wqkv": "qkv", "down_proj": "down", "lm_head": "lm_head", "embed_out": "lm_head",
          "c_fc": "up", "dense_h_to_4h": "up", "dense_4h_to_h": "down"}
_ORDER = ("qkv", "o", "gate_up", "up", "down", "router", "lm_head")


def _role(name: str, attention: bool) -> str:
    attr = name.rpartition(".")[2]
    if attr == "c_proj" and not attention:
        return "down"
    if attr == "dense" and not attention:
        return "down" if name.endswith("output.dense") else "up"
    return _ROLES.get(attr, attr)


def _activated_linears(model: nn.Module) -> dict[str, str]:
    """{name of a linear whose GEMM carries its MLP's activation: the activation}."""
    out = {}
    for name, mod in model.named_modules():
        child = "dense_h_to_4h" if isinstance(mod, HybridTwoLayerMLP) else \
            "dense" if isinstance(mod, HybridIntermediate) else None
        if child is not None and mod.activation:
            out[f"{name}.{child}" if name else child] = mod.activation
    return out


def patched_gemms(model: nn.Module) -> tuple[list[ProjectionShape], list[ProjectionShape]]:
    """(attention shapes, MLP and LM head shapes) of the dispatched GEMMs of the patched
    ``model``, each (N, K, bias, activation) once, in module order (a shape of both groups counts as
    attention's)."""
    groups: tuple[list, list] = ([], [])
    seen: set[tuple[int, int, bool, str]] = set()
    activated = _activated_linears(model)
    for name, mod in model.named_modules():
        attention = not ATTENTION_BLOCKS.isdisjoint(name.split(".")[:-1])
        if isinstance(mod, FusedLinears):
            k, bias = mod.weight.shape[1], mod.bias is not None
            gate_up = name.rpartition(".")[2] == FUSED_GATE_UP
            shape = ProjectionShape("gate_up", mod.sizes[0], k, bias) if gate_up \
                else ProjectionShape("qkv", sum(mod.sizes), k, bias)
        elif isinstance(mod, HybridLinear) and name.rpartition(".")[2] == FUSED_GATE_UP:
            # a model's own stacked gate/up (Phi-3): the gated product runs GEMMs of one half's shape
            shape = ProjectionShape("gate_up", mod.out_features // 2, mod.in_features, mod.bias is not None)
        elif isinstance(mod, HybridLinear):
            shape = ProjectionShape(_role(name, attention), mod.out_features, mod.in_features, mod.bias is not None,
                                    activated.get(name, "none"))
        elif isinstance(mod, HybridConv1D):
            shape = ProjectionShape(_role(name, attention), mod.nf, mod.nx, mod.bias is not None,
                                    mod.activation or "none")
        elif isinstance(mod, HybridTopKRouter):  # a mixture-of-experts router's logits
            shape = ProjectionShape("router", *mod.weight.shape, False)
        else:
            continue
        key = (shape.n, shape.k, shape.bias, shape.activation)
        if key not in seen:
            seen.add(key)
            groups[0 if attention else 1].append(shape)
    for group in groups:  # the presets' order; a stable sort keeps module order among the rest
        group.sort(key=lambda p: _ORDER.index(p.name) if p.name in _ORDER else len(_ORDER))
    return groups


class GatedShape(NamedTuple):
    """A gate/up the gated kernel runs: I, K, its bias, and its norm prologues (autotune_cache/
    tune_glu.py ``NORM_OPS``: None when called as a module, "x" or "fp32" in the fused decode step)."""

    intermediate: int
    k: int
    bias: bool
    norms: tuple


def gated_shapes(model: nn.Module) -> list[GatedShape]:
    """The gate/up GEMMs of the patched ``model`` that the gated kernel runs (fused or a
    checkpoint's stacked ``gate_up_proj``), each (I, K, bias) once with every norm prologue it
    is called with: none as a module, and in a fused decoder layer the norm before its MLP
    (``post_attention_layernorm``, a post-norm layer's ``pre_feedforward_layernorm``; none
    where the layer has none, OLMo 2, or calls its norms as modules, Cohere and StableLM)."""
    found: dict[tuple[int, int, bool], set] = {}
    prologue: dict[int, str | None] = {}  # id(gate/up module) -> the decode step's prologue
    for layer in model.modules():
        if isinstance(layer, HybridDecoderLayer) and not decode_checks.moe_block(layer.mlp):
            gate_up = layer.mlp._modules.get(FUSED_GATE_UP)
            norm = decode_checks.layer_norms(layer)[2 if decode_checks.post_norms(layer) else 1]
            if decode_checks.norm_modules(layer):  # Cohere's, StableLM's norms run as modules: no prologue
                norm = None
            if gate_up is not None:  # (by the norm's class: a model built in fp32 has fp32 weights everywhere)
                prologue[id(gate_up)] = None if norm is None else "fp32" if isinstance(norm, Fp32FactorRMSNorm) \
                    else "x"
    for name, mod in model.named_modules():
        if name.rpartition(".")[2] != FUSED_GATE_UP or not isinstance(mod, (FusedLinears, HybridLinear)):
            continue
        shape = (mod.weight.shape[0] // 2, mod.weight.shape[1], mod.bias is not None)
        found.setdefault(shape, {None}).add(prologue.get(id(mod)))
    return [GatedShape(*shape, tuple(sorted(norms, key=lambda n: (n is not None, n or ""))))
            for shape, norms in found.items()]


__all__ = ["ATTENTION_BLOCKS", "GatedShape", "gated_shapes", "patched_gemms"]
