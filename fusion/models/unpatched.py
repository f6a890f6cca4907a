"""What :func:`hybridgemm.patch` left as it was, among the modules a user would expect it to
speed up: the entries it adds to ``PatchReport.skipped`` after patching, found by structure
(what the modules hold), never by the model's name.

Looked at: every decoder layer, a module one of whose direct children is an attention with
``is_causal`` set to True (transformers' decoder attentions all carry it; an encoder's is False)
that holds a weight matrix. In each:

* the layer itself, where it does not run the fused decode step (its family is none the step
  supports; a supported layer that could not be fused is already reported by ``patch``);
* its attention children (a child with an ``is_causal`` attribute or a Q/K/V projection
  child), where none of their projections was patched;
* its other children holding a weight matrix: a mixture-of-experts block (one holding an
  ``experts`` module or a 3-D weight) where its experts were not patched (a list of expert MLPs
  that were, each, counts as patched), any other module (an MLP) where none of its projections
  was patched;
* norms (a torch norm class, or a leaf module whose ``weight`` is 1-D and whose parameters are
  all 1-D) that were not patched, inside or outside those children;
* any other leaf module with a 2-D ``weight`` (a linear; embeddings aside) that was not patched
  and lies in no module listed already.

Besides the layers, an ``lm_head`` module holding a 2-D weight that was not patched. A part that
the caller switched off (``attention=False``, ...) is not listed, nor is anything inside a module
``patch`` listed itself (TorchScript, a tie, an activation without an epilogue, ...). Embeddings,
rotary embeddings, dropout and activations are not listed: they are neither GEMMs nor norms.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridgemm.fused_rows import adapter_base, qual
from hybridgemm.norm import GEMMA_NORM_CLASSES, OLMO2_NORM_CLASSES, RMS_NORM_CLASSES

from .decoder_layer import LAYER_CLASSES

# Children of an attention module that project Q, K and V (one of these names marks an attention
# that has no ``is_causal`` attribute): separate, and pre-fused in one matrix.
QKV_CHILDREN = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv_proj", "query_key_value", "c_attn",
                "Wqkv", "W_pack", "qkv")
_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def is_patched(mod: nn.Module) -> bool:
    """Is ``mod`` one of hybridgemm's modules (a swapped class or a module ``patch`` put in place)?"""
    return type(mod).__module__.partition(".")[0] == "hybridgemm"


def _children(mod: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, c) for n, c in mod._modules.items() if c is not None]


def _holds_matrix(mod: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in mod.parameters())


def _is_attention(mod: nn.Module) -> bool:
    return isinstance(getattr(mod, "is_causal", None), bool) or any(n in mod._modules for n in QKV_CHILDREN)


def _causal_attention(mod: nn.Module) -> bool:
    return getattr(mod, "is_causal", None) is True and _holds_matrix(mod)


def is_decoder_layer(mod: nn.Module) -> bool:
    """Does ``mod`` hold a causal attention as a direct child (see the module docstring)?"""
    return any(_causal_attention(c) for _, c in _children(mod))


def _experts(mod: nn.Module) -> list[nn.Module]:
    """The modules of a mixture-of-experts block that hold its experts: named ``experts``, or
    holding a 3-D weight (all experts' matrices stacked); empty for any other module."""
    return [m for n, m in mod.named_modules() if n.rpartition(".")[2] == "experts"
            or any(p.dim() >= 3 for p in m._parameters.values() if p is not None)]


def _experts_patched(experts: nn.Module) -> bool:
    """Were the experts patched: the module, or each expert module it holds (a list of gated
    MLPs, say), and no weight matrix of its own left?"""
    if is_patched(experts):
        return True
    parts = [c for _, c in _children(experts) if _holds_matrix(c)]
    own = any(p.dim() >= 2 for p in experts._parameters.values() if p is not None)
    return bool(parts) and not own and all(_touched(c) for c in parts)


def _is_norm(mod: nn.Module) -> bool:
    """A norm: torch's, or a leaf with a weight whose parameters are all vectors, or whose class is
    named as one (Cohere's per-head LayerNorm holds a [heads, head_dim] weight)."""
    if isinstance(mod, _TORCH_NORMS):
        return True
    weight = mod._parameters.get("weight")
    return not mod._modules and weight is not None and (type(mod).__name__.endswith("Norm") or weight.dim() == 1
                                                        and all(p.dim() == 1 for p in mod._parameters.values()
                                                                if p is not None))


def _is_linear(mod: nn.Module) -> bool:
    weight = mod._parameters.get("weight")
    return weight is not None and weight.dim() == 2 and not isinstance(mod, (nn.Embedding, nn.EmbeddingBag))


def _touched(mod: nn.Module) -> bool:
    """Was ``mod`` patched, or one of its direct children (a fused or swapped projection)?"""
    return is_patched(mod) or any(is_patched(c) for _, c in _children(mod))


def _matrices(mod: nn.Module) -> str:
    """``name (Class)`` of each direct child that holds a weight matrix."""
    return ", ".join(f"{n} ({type(c).__name__})" for n, c in _children(mod) if _holds_matrix(c)) or "no projections"


def _layer_reason(layer: nn.Module) -> str:
    return (f"decoder layer not fused: its family ({type(layer).__name__}) is not supported by the fused decode "
            f"step (it supports {', '.join(LAYER_CLASSES)})")


def _attention_reason(attn: nn.Module) -> str:
    return (f"attention not patched: {type(attn).__name__} holds {_matrices(attn)}; hybridgemm fuses separate "
            "plain nn.Linear q_proj/k_proj/v_proj (or query/key/value) children, and GPT-2's Conv1D c_attn")


def _moe_reason(block: nn.Module) -> str:
    return (f"mixture-of-experts layer ({type(block).__name__}): mixture-of-experts layers are not patched "
            "(their router and experts run as the stock module computes them)")


def _mlp_reason(mlp: nn.Module) -> str:
    return (f"MLP not patched: {type(mlp).__name__} holds {_matrices(mlp)}; hybridgemm patches gated MLPs (plain "
            "nn.Linear gate_proj, up_proj and down_proj with a SiLU or GELU act_fn), GPT-2's Conv1D c_fc/c_proj and "
            "BERT's intermediate.dense")


def _norm_reason(norm: nn.Module) -> str:
    return (f"norm not patched: {type(norm).__name__} is not one of the "
            f"{len(RMS_NORM_CLASSES) + len(GEMMA_NORM_CLASSES) + len(OLMO2_NORM_CLASSES)} RMSNorm classes of known "
            "formula hybridgemm recognises (hybridgemm.norm.RMS_NORM_CLASSES, GEMMA_NORM_CLASSES, OLMO2_NORM_CLASSES), "
            "nor does its forward compute Llama's formula or OLMo 2's with its weight and variance_epsilon, or Gemma's "
            "with its weight and eps")


def _linear_reason(lin: nn.Module) -> str:
    if type(lin) is nn.Linear:
        return "linear not patched: not part of an attention or MLP hybridgemm recognises"
    return f"linear not patched: {type(lin).__name__} is not a plain nn.Linear"


def _part(child: nn.Module) -> tuple[str, bool, str]:
    """(which switch of ``patch`` governs a layer's child, was it left unpatched, why) for a
    child holding a weight matrix that is no leaf linear."""
    if _is_attention(child):
        return "attention", not _touched(child), _attention_reason(child)
    experts = _experts(child)
    if experts:
        return "mlp", not all(_experts_patched(m) for m in experts), _moe_reason(child)
    return "mlp", not _touched(child), _mlp_reason(child)


def unpatched(model: nn.Module, skipped: list[tuple[str, str]], *, attention: bool = True, mlp: bool = True,
              norm: bool = True, lm_head: bool = True, layers: bool = True) -> list[tuple[str, str]]:
    """``(name, reason)`` for each module of ``model`` (patched as :func:`hybridgemm.patch` left it)
    that the module docstring's rules list and ``skipped`` (what ``patch`` reported) does not
    name already: layer by layer (the layer, its attention, MLP or mixture-of-experts children,
    then its norms and linears in module order), then the LM head."""
    modules = dict(model.named_modules())
    switches = {"attention": attention, "mlp": mlp}
    found: list[tuple[str, str]] = []
    named = {n for n, _ in skipped}
    layer_names = [n for n, m in modules.items() if is_decoder_layer(m) and not isinstance(m, torch.jit.ScriptModule)]
    # A module named in the report, or switched off, stands for everything inside it (a
    # decoder layer's entry does not: its parts are reported on their own).
    covers = sorted(named - set(layer_names))

    def listed(name: str) -> bool:
        return any(name == p or not p or name.startswith(p + ".") for p in covers)

    for lname in layer_names:
        layer = modules[lname]
        if listed(lname):
            continue
        if layers and not is_patched(layer) and lname not in named:
            found.append((lname, _layer_reason(layer)))
        for cname, child in _children(layer):
            name = qual(lname, cname)
            if listed(name) or not _holds_matrix(child) or _is_linear(child):
                continue  # a leaf linear is looked at with the norms below
            switch, left, reason = _part(child)
            if switches[switch] and left:
                found.append((name, reason))
            if left or not switches[switch]:
                covers.append(name)
        # an adapter's own modules (LoRA's A and B) run as the adapter defines: not the model's projections
        adapter_parts = tuple(qual(qual(lname, sub), c) + "." for sub, m in layer.named_modules()
                              if adapter_base(m) is not None for c in m._modules if c != "base_layer")
        for sub, mod in layer.named_modules():
            name = qual(lname, sub)
            if not sub or is_patched(mod) or listed(name) or (name + ".").startswith(adapter_parts):
                continue
            if _is_norm(mod):
                if norm:
                    found.append((name, _norm_reason(mod)))
            elif _is_linear(mod):
                found.append((name, _linear_reason(mod)))
    if lm_head:
        for name, mod in modules.items():
            if name.rpartition(".")[2] == "lm_head" and _is_linear(mod) and not is_patched(mod) \
                    and name not in named and not listed(name):
                why = "" if type(mod) is nn.Linear else f": {type(mod).__name__} is not a plain nn.Linear"
                found.append((name, "LM head not patched" + why))
    return found


__all__ = ["QKV_CHILDREN", "is_decoder_layer", "is_patched", "unpatched"]
