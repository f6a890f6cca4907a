"""LoRA adapters inside the fused decode step: the terms PEFT's LoRA ``Linear`` adds to the
output of the linear it wraps, computed by the step on its fused GEMM's slice of the output, so
a layer whose projections carry adapters keeps its fused GEMMs, norms and attention.

PEFT's ``lora.Linear.forward`` (peft 0.21) computes, for a layer with unmerged adapters on::

    result = base_layer(x)                        # in the base's dtype
    for name in active_adapters (those with weights in this layer):
        x = x.to(lora_A[name].weight.dtype)       # unless input casting is turned off
        result = result + lora_B[name](lora_A[name](lora_dropout[name](x))) * scaling[name]
    result = result.to(the base's dtype)

and nothing beyond ``base_layer(x)`` when its adapters are disabled or merged into the base
weight. :func:`add_terms` makes that sequence of operations on the step's base result, so
given the same base result it gives the layer's own result bit for bit. What the step does not
compute makes :func:`computable` False and the decoder layer runs its own forward for that call:
a LoRA variant (DoRA and the others PEFT keeps in ``lora_variant``), a disabled layer that is
still merged (PEFT unmerges it on its next call), any other adapter type. Per-request adapter
names (PEFT's forward pre-hook) show as a hooked module (decode_checks.hooked).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")


_IS_LORA: dict[type, bool] = {}  # by class: the per-call checks of the decode step ask for every slot


def is_lora_linear(mod: nn.Module | None) -> bool:
    """Is ``mod`` PEFT's LoRA layer for an ``nn.Linear`` (exactly that class)?"""
    t = type(mod)
    known = _IS_LORA.get(t)
    if known is None:
        known = _IS_LORA[t] = (t.__module__, t.__name__) == _LORA_LINEAR
    return known


def _active(mod: nn.Module) -> list[str]:
    names = mod.lora_A.keys()
    return [n for n in mod.active_adapters if n in names]


def computable(mod: nn.Module) -> bool:
    """Can the step add what the LoRA layer ``mod`` adds to its base (read per call: adapters
    are switched, merged and disabled between calls)?"""
    if not is_lora_linear(mod):
        return False
    if mod.disable_adapters:
        return not mod.merged
    if mod.merged:
        return True
    variants = getattr(mod, "lora_variant", {})
    return not any(n in variants for n in _active(mod))


def adds_terms(mod: nn.Module | None) -> bool:
    """Does the LoRA layer ``mod`` add anything to its base's output in this call? False for
    anything else (an unwrapped slice, say)."""
    return is_lora_linear(mod) and not mod.disable_adapters and not mod.merged and bool(_active(mod))


# Under torch.compile, "reduce" writes each adapter's two low-rank products as multiply-and-sum
# expressions, which Inductor generates as reductions fused with what reads them (the products
# of one fused projection's slices share their input), where "mm" leaves two GEMM launches
# per adapter. Eager calls always take the modules' own GEMMs.
COMPILED_FORM = "reduce"


def _low_rank(mod: nn.Module, name: str, x: Tensor) -> Tensor:
    lora_a, lora_b = mod.lora_A[name], mod.lora_B[name]
    x = mod.lora_dropout[name](x)
    if COMPILED_FORM != "reduce" or not torch.compiler.is_compiling() \
            or not (type(lora_a) is type(lora_b) is nn.Linear) or lora_a.bias is not None:
        return lora_b(lora_a(x))
    xa = (x.unsqueeze(-2) * lora_a.weight).sum(-1)  # [..., r]
    t = (xa.unsqueeze(-2) * lora_b.weight).sum(-1)  # [..., N]
    return t if lora_b.bias is None else t + lora_b.bias


def add_terms(mod: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """``y`` (the base's output for the layer input ``x``) with the LoRA layer ``mod``'s active
    adapter terms added as PEFT adds them; for a call where :func:`computable` holds."""
    dtype = y.dtype
    for name in _active(mod):
        lora_a = mod.lora_A[name]
        if getattr(mod, "cast_input_dtype_enabled", True):
            x = x.to(lora_a.weight.dtype)
        y = y + _low_rank(mod, name, x) * mod.scaling[name]
    return y.to(dtype)


def add_slice_terms(mods, x: Tensor, y: Tensor, sizes) -> Tensor:
    """``y``, a fused GEMM's output whose column slices ``sizes`` belong to ``mods`` in order,
    with each slice's adapter terms added (:func:`add_terms`; a slice without any stays as it
    is)."""
    parts = y.split(list(sizes), dim=-1)
    return torch.cat([add_terms(m, x, p) if adds_terms(m) else p for m, p in zip(mods, parts)], dim=-1)


def lora_parameters(mod: nn.Module | None):
    """The adapter parameters of a LoRA layer (none for anything else)."""
    if not is_lora_linear(mod):
        return ()
    return (p for name in ("lora_A", "lora_B") for p in mod._modules[name].parameters())


__all__ = ["add_slice_terms", "add_terms", "adds_terms", "computable", "is_lora_linear", "lora_parameters"]
