"""Models loaded from FP8 checkpoints: :func:`hybridgemm.patch` takes their e4m3 weights and
scales as they are (no bf16 copy) and runs them through hybridgemm's FP8 modules.

Two formats, recognised by what a module holds (an ``nn.Linear`` whose ``weight`` is e4m3,
with a ``weight_scale`` or ``weight_scale_inv``), never by model or class name; neither
transformers nor compressed-tensors is imported here:

* compressed-tensors ``float-quantized`` (the "-FP8" and "-FP8-dynamic" releases of Llama,
  Qwen, ...): transformers keeps each quantized projection an ``nn.Linear`` holding ``weight``
  e4m3 and ``weight_scale`` in the model's dtype, per output channel (N, 1), per tensor (1,)
  or per 128 x 128 block, an ``input_scale`` where the activations were calibrated statically,
  its ``quantization_scheme`` (which states the strategy) and a quantizing forward; the model
  decompresses every module that still has a scheme to its dtype on its first forward (a
  forward pre-hook on the model, ``ct_decompress_hook``). Its own ``nn.Linear`` subclasses
  (weight_scale (1, N) fp32) hold the same tensors.
* transformers' fine-grained FP8 (``FineGrainedFP8Config``): ``FP8Linear`` (an ``nn.Linear``
  subclass) holds ``weight`` e4m3 and ``weight_scale_inv`` fp32 per ``block_size`` block
  ((ceil(N/128), ceil(K/128)) for 128 x 128; one scale where ``block_size`` is None), and an
  ``activation_scale`` for static activations.

:func:`prepare` runs before ``patch`` looks at the model: it checks every such module (a
scale whose shape does not fit the weight, or NaN, Inf or non-positive scales:
:class:`~hybridgemm.kernels.fp8.FP8FormatError` naming the module, raised before anything is
changed), computes its scales in the kernels' layout (kernels/fp8.py: fp32, (N,) or
(N/128, K/128); a per-tensor scale becomes N equal ones) and gives it the class ``nn.Linear``
while ``patch`` runs, so that Q/K/V and gate/up fuse and O, down and the LM head are swapped
as plain linears are (fusion/fused_rows.py fuses FP8 parts whose scales agree in granularity
and, per block, hold whole blocks of rows). :func:`adopt` runs after: each swapped one becomes
an :class:`~hybridgemm.fp8_modules.FP8HybridLinear`, each fused one an
:class:`~hybridgemm.fp8_modules.FP8FusedLinears` (the parts' e4m3 rows concatenated once, the
originals then viewing them; the scale rows concatenated too), each with the checkpoint's
:class:`~hybridgemm.fp8_modules.ScaleFormat`, so ``state_dict()`` writes the checkpoint's own
keys, dtypes and bytes. Those that ``patch`` left alone get their class back. Static
activation scales (``input_scale``, ``activation_scale``) stay in the state dict, as buffers,
but hybridgemm's FP8 kernels take the activations as they are (W8A16) where the checkpoint's
runtime quantizes them to e4m3 (W8A8): each such module is listed in ``report.skipped`` with
that reason. Layouts the kernels do not read (ue8m0 scales, blocks other than 128 x 128,
group-wise scales, nonzero zero points, tensors of other kinds) are left as loaded, with the
reason in ``report.skipped``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from hybridgemm.fp8_experts import check_fp8_experts, why_not_fp8_experts
from hybridgemm.fp8_modules import (
    KERNEL_SCALE,
    SCALE_NAMES,
    FP8FusedLinears,
    FP8HybridLinear,
    ScaleFormat,
    data_error,
    freeze_parts,
    is_fp8,
    scales_error,
)
from hybridgemm.fused_rows import FP8_SOURCE, FusedLinears, qual, records
from hybridgemm.kernels import fp8
from hybridgemm.linear_layer import HybridLinear

# Tensors an FP8 linear of a checkpoint may hold beside weight, bias and its scales: static
# activation scales (W8A8 calibration) and zero points (all zero in a symmetric FP8 scheme).
ACTIVATION_TENSORS = ("input_scale", "activation_scale", "input_zero_point")
WEIGHT_ZERO_POINT = "weight_zero_point"
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # converted to fp32 and back exactly
# compressed-tensors' per-module state: its quantizing forward (an instance attribute) and its
# bookkeeping; a module that keeps quantization_scheme is decompressed by the model's first forward.
_CT_ATTRS = ("forward", "quantization_scheme", "quantization_status")
_CT_HOOK = "ct_decompress_hook"


@dataclass
class FP8Source:
    """An FP8 linear of a checkpoint as :func:`prepare` found it."""

    name: str
    module: nn.Module
    cls: type
    scale_name: str
    kernel_scale: Tensor  # fp32, the kernels' layout
    fmt: ScaleFormat
    extras: tuple[str, ...]  # the other tensors it holds (activation scales, zero points)

    @property
    def granularity(self) -> str:
        return self.fmt.granularity


def _state_tensors(mod: nn.Module) -> dict[str, Tensor]:
    """The module's own state-dict tensors by local name, in state-dict order."""
    out = {n: p for n, p in mod._parameters.items() if p is not None}
    out.update((n, b) for n, b in mod._buffers.items() if b is not None and n not in mod._non_persistent_buffers_set)
    return out


def _declared_layout(mod: nn.Module) -> str | None:
    """The scale layout the module states: compressed-tensors' ``quantization_scheme.weights``
    (strategy, block structure), transformers' ``block_size``; None where it states none."""
    weights = getattr(getattr(mod, "quantization_scheme", None), "weights", None)
    strategy = getattr(weights, "strategy", None)
    if strategy is not None:
        strategy = str(getattr(strategy, "value", strategy)).lower()
        if strategy == "block":
            block = tuple(getattr(weights, "block_structure", None) or ())
            return "block" if block == (fp8.BLOCK, fp8.BLOCK) else f"block {block}"
        return strategy
    if "block_size" in mod.__dict__:
        block = mod.__dict__["block_size"]
        if block is None:
            return "tensor"
        return "block" if tuple(block) == (fp8.BLOCK, fp8.BLOCK) else f"block {tuple(block)}"
    return None


def _scale_format(name: str, mod: nn.Module, scale_name: str, scale: Tensor, n: int, k: int) -> ScaleFormat | str:
    """The checkpoint's scale layout of ``mod`` (weight (n, k)); a str: why the kernels cannot
    read it; FP8FormatError: a scale whose shape fits no layout (or not the stated one)."""
    shape = tuple(scale.shape)
    nb, kb = -(-n // fp8.BLOCK), -(-k // fp8.BLOCK)
    fits = {"tensor": scale.numel() == 1 and len(shape) <= 2, "channel": shape in ((n,), (n, 1), (1, n)),
            "block": shape == (nb, kb)}
    declared = _declared_layout(mod)
    if declared is None:
        layout = next((kind for kind, ok in fits.items() if ok), None)
    elif declared in fits:
        layout = declared if fits[declared] else None
    else:
        return f"its scales are {declared}-wise; hybridgemm's FP8 kernels read per-tensor, per-channel and " \
               f"128x128-block scales"
    if layout is None:
        stated = f" (its quantization states {declared})" if declared else ""
        raise fp8.FP8FormatError(
            f"hybridgemm.patch: {name}.{scale_name} has shape {shape}, which does not fit its ({n}, {k}) e4m3 "
            f"weight{stated}: per channel ({n}, 1), ({n},) or (1, {n}); per tensor (1,); per 128x128 block "
            f"({nb}, {kb})")
    if scale.dtype not in _SCALE_DTYPES:
        return f"its {scale_name} is {scale.dtype}; hybridgemm's FP8 kernels take float32, bfloat16 or float16 scales"
    granularity = "block128" if layout == "block" else "channel"
    return ScaleFormat(scale_name, shape, scale.dtype, granularity, n, per_tensor=layout == "tensor")


def find_source(name: str, mod: nn.Module) -> FP8Source | str | None:
    """``mod`` as an FP8 linear of a checkpoint; a str: one the kernels cannot run (why);
    None: not one. FP8FormatError for scales that are malformed (shape, NaN, Inf, <= 0)."""
    if not isinstance(mod, nn.Linear) or records(mod) or is_fp8(mod):
        return None
    tensors = _state_tensors(mod)
    weight = tensors.get("weight")
    if weight is None or weight.dtype not in fp8.FP8_DTYPES:
        return None
    scale_names = [s for s in SCALE_NAMES if s in tensors]
    if weight.dtype != fp8.E4M3:
        return f"its weight is {weight.dtype}; hybridgemm's FP8 kernels read {fp8.E4M3}"
    if len(scale_names) != 1 or weight.dim() != 2:
        return "an e4m3 weight without one weight_scale or weight_scale_inv"
    scale_name = scale_names[0]
    extras = tuple(t for t in tensors if t not in ("weight", "bias", scale_name))
    unknown = [t for t in extras if t not in (*ACTIVATION_TENSORS, WEIGHT_ZERO_POINT)]
    if unknown:
        return f"it holds {', '.join(unknown)}, which hybridgemm's FP8 modules do not apply"
    zero = tensors.get(WEIGHT_ZERO_POINT)
    if zero is not None and zero.device.type != "meta" and bool(zero.ne(0).any()):
        return "nonzero weight_zero_point (asymmetric quantization)"
    scale = tensors[scale_name].detach()
    fmt = _scale_format(name, mod, scale_name, scale, *weight.shape)
    if isinstance(fmt, str):
        return fmt
    kernel = fmt.to_kernel(scale)
    why = (scales_error(f"hybridgemm.patch: {qual(name, scale_name)}", kernel)
           or data_error(f"hybridgemm.patch: {qual(name, 'weight')}", weight.detach()))
    if why is not None:
        raise fp8.FP8FormatError(why)
    fp8.granularity_of(weight, kernel)  # the device and layout the kernels need
    return FP8Source(name, mod, type(mod), scale_name, kernel, replace(fmt, key_order=tuple(tensors)), extras)


class FP8LinearAsLoaded(nn.Linear):
    """The class an FP8 linear that the kernels cannot run has while ``patch`` runs (so that
    ``patch`` does not take it for a plain linear); it gets its own class back after."""


@dataclass
class Prepared:
    """What :func:`prepare` changed, for :func:`adopt` to finish or undo."""

    sources: list[FP8Source] = field(default_factory=list)
    held: list[tuple[nn.Module, type]] = field(default_factory=list)  # left as loaded: (module, its class)


def prepare(model: nn.Module, report) -> Prepared:
    """Find and check every FP8 linear of a checkpoint under ``model`` (see the module
    docstring) and give each the class ``nn.Linear`` for the time ``patch`` runs; nothing is
    changed when one is malformed. Those the kernels cannot run go to ``report.skipped`` and
    are hidden from ``patch`` (:class:`FP8LinearAsLoaded`) until :func:`adopt`."""
    prepared = Prepared()
    for name, mod in model.named_modules():
        if why_not_fp8_experts(mod)[0] is not None:  # experts the MoE kernels run: their values checked now
            check_fp8_experts(name, mod)
        found = find_source(name, mod)
        if isinstance(found, str):
            report.skipped.append((name, f"FP8 linear left as loaded: {found}"))
            prepared.held.append((mod, type(mod)))
        elif found is not None:
            prepared.sources.append(found)
    for src in prepared.sources:
        src.module.__dict__[FP8_SOURCE] = src
        src.module.__class__ = nn.Linear
    for mod, _ in prepared.held:
        mod.__class__ = FP8LinearAsLoaded
    return prepared


def adopt(model: nn.Module, prepared: Prepared, report) -> list[str]:
    """After ``patch``: the FP8 linears it fused or swapped become hybridgemm's FP8 modules,
    the others get their class back (see the module docstring). Returns the names of the
    FP8 modules made (as ``report.fp8`` lists them)."""
    for mod, cls in prepared.held:
        mod.__class__ = cls
    sources = prepared.sources
    if not sources:
        return []
    dtype = _activation_dtype(model)
    made, adopted = [], set()
    for pname, parent in model.named_modules():
        for cname, child in parent._modules.items():
            originals = getattr(child, "_originals", ())
            if type(child) is FusedLinears and originals and all(FP8_SOURCE in o.__dict__ for o in originals):
                srcs = [o.__dict__.pop(FP8_SOURCE) for o in originals]
                _adopt_fused(child, [parent._modules[n] for n in child.names], srcs, dtype)
                made.append(qual(pname, cname))
                adopted.update(id(src.module) for src in srcs)
    for name, mod in model.named_modules():
        src = mod.__dict__.get(FP8_SOURCE)
        if src is not None and type(mod) is HybridLinear:
            del mod.__dict__[FP8_SOURCE]
            _adopt_linear(mod, src, dtype)
            made.append(name)
            adopted.add(id(mod))
    for src in sources:
        if id(src.module) not in adopted:
            src.module.__dict__.pop(FP8_SOURCE, None)
            src.module.__class__ = src.cls
            report.skipped.append((src.name, "FP8 linear left as loaded: patch did not patch this projection"))
            continue
        static = [t for t in src.extras if t in ACTIVATION_TENSORS]
        if static:
            report.skipped.append((src.name, f"static activation scale ({', '.join(static)}) kept in the state "
                                             f"dict, not applied: hybridgemm's FP8 kernels take {str(dtype)[6:]} "
                                             "activations as they are (W8A16), the checkpoint's runtime quantizes "
                                             "them to e4m3"))
    _drop_decompress_hook(model)
    return made


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: that of its first floating parameter wider than 8 bits."""
    for p in model.parameters():
        if p.is_floating_point() and p.element_size() > 1:
            return p.dtype
    return torch.bfloat16


def _strip(mod: nn.Module) -> None:
    """Drop compressed-tensors' per-module state, so that the model's decompression hook
    leaves the module alone and its forward is the class's."""
    for attr in _CT_ATTRS:
        mod.__dict__.pop(attr, None)


def _adopt_linear(mod: nn.Module, src: FP8Source, dtype: torch.dtype) -> None:
    tensors = _state_tensors(mod)
    for t in (src.scale_name, *src.extras):
        mod._parameters.pop(t, None)
        mod._buffers.pop(t, None)
    mod.weight.requires_grad_(False)
    if mod.bias is not None:
        mod.bias.requires_grad_(False)
    mod.register_buffer(KERNEL_SCALE, src.kernel_scale)
    for t in src.extras:
        mod.register_buffer(t, tensors[t].detach())
    _strip(mod)
    mod.scale_format = src.fmt
    mod.fp8_dtype = dtype
    mod.__class__ = FP8HybridLinear


def _adopt_fused(fused: FusedLinears, slices: list[nn.Module], srcs: list[FP8Source], dtype: torch.dtype) -> None:
    """The fused weight already holds the parts' e4m3 rows (fusion/fused_rows.py ``fuse``); the
    scale rows are stacked the same way, and each slice takes its part's other tensors."""
    with torch.no_grad():
        fused.register_buffer(KERNEL_SCALE, torch.cat([src.kernel_scale for src in srcs]))
    freeze_parts(fused)
    fused.part_formats = tuple(src.fmt for src in srcs)
    fused.fp8_dtype = dtype
    fused.__class__ = FP8FusedLinears
    for piece, src in zip(slices, srcs):
        tensors = _state_tensors(src.module)
        for t in src.extras:
            piece.register_buffer(t, tensors[t].detach())
        piece.key_order = src.fmt.key_order
        src.module.__class__ = src.cls  # the replaced linear, kept (viewing the fused rows) for the record only


def _drop_decompress_hook(model: nn.Module) -> None:
    """Remove compressed-tensors' decompress-on-first-forward hook once no module under
    ``model`` is left for it to decompress."""
    if any(hasattr(m, "quantization_scheme") for m in model.modules()):
        return
    for m in model.modules():
        handle = m.__dict__.pop(_CT_HOOK, None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()


__all__ = ["FP8LinearAsLoaded", "FP8Source", "Prepared", "adopt", "find_source", "prepare"]
