"""FP8 weights in a patched model. ``patch(model, weights="fp8")`` quantizes the weights of the
projections it patched (fused Q/K/V and gate/up, O, down, separately swapped linears; the LM
head on request); ``patch`` of a model loaded from an FP8 checkpoint takes its e4m3 weights
and scales as they are (fusion/models/fp8_checkpoints.py). Either way each module gets the
FP8 variant of its class:

* :class:`FP8HybridLinear` (a :class:`~hybridgemm.HybridLinear`): ``weight`` e4m3, frozen,
  and the buffer ``weight_scale``;
* :class:`FP8FusedLinears` (a fused Q/K/V or gate/up weight): the same, over the stacked rows.

``weight_scale`` is always fp32 in the kernels' layout ((N,) per channel, (N/128, K/128) per
block; kernels/fp8.py). How the source stored the scales is the module's
:class:`ScaleFormat` (per fused part for a fused weight): its state dict writes them that way
(name, shape, dtype) and loads them from that layout, so a patched model's ``state_dict()``
round-trips in its checkpoint's own format; for a quantized model that format is the kernels'
layout under ``weight_scale``. A load checks what an FP8 weight needs (e4m3 data, scales of
the stored shape, finite and > 0) and reports the rest as torch does.

Both compute through fusion/fp8_linear.py; the fused decode step reads the scales with
:func:`weight_scale_of`. ``fp8_activations`` (set by ``patch(..., activations="fp8")``): past the
decode rows the module's GEMM quantizes x to e4m3 and runs on the FP8 tensor cores (W8A8;
fusion/fp8_linear.py ``quantize_input``). The bf16 weights are gone once quantized (that is the memory the
format saves), so such a model cannot be unpatched back to them: :func:`unpatch` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hybridgemm.fused_rows import FusedLinears, refuse, save_in_order
from hybridgemm.kernels import fp8
from hybridgemm.linear_layer import HybridLinear

from .fp8_linear import SCALE_NAMES, keep_fp8_dtypes, linear_fp8

KERNEL_SCALE = "weight_scale"  # the buffer that holds the scales in the kernels' layout


def weight_scale_of(module: nn.Module) -> Tensor | None:
    """The FP8 scales of ``module``'s weight as the kernels read them ((N,) per channel, a view
    of an (N, 1) buffer; (N/128, K/128) per block), or None for a weight of x's dtype."""
    buffers = module._buffers
    scale = buffers.get("weight_scale")
    if scale is None:
        scale = buffers.get("weight_scale_inv")
        if scale is None:
            return None
    # (N, 1) is per channel; (N/128, 1) with N > 128 is per block over a K of at most 128
    per_channel_column = scale.dim() == 2 and scale.shape[1] == 1 and scale.shape[0] == module.weight.shape[0]
    return scale.reshape(-1) if per_channel_column else scale


@dataclass(frozen=True)
class ScaleFormat:
    """How a checkpoint stores the scales of one FP8 weight of ``rows`` output rows: under
    ``name``, of ``shape`` and ``dtype``; ``granularity`` is that of the kernels' layout they
    map to. A per-tensor scale (``per_tensor``, stored (1,) or ()) maps to ``rows`` equal
    per-channel scales. ``key_order``: the source module's state-dict names, in its order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: str
    rows: int
    per_tensor: bool = False
    key_order: tuple[str, ...] = ()

    @classmethod
    def of_kernel_scale(cls, scale: Tensor, granularity: str, rows: int) -> ScaleFormat:
        """The kernels' own layout, under ``weight_scale`` (a quantized weight's format)."""
        return cls(KERNEL_SCALE, tuple(scale.shape), torch.float32, granularity, rows)

    def to_kernel(self, stored: Tensor) -> Tensor:
        """The stored scales in the kernels' layout (a view where they already are)."""
        t = stored.to(torch.float32)
        if self.per_tensor:
            return t.reshape(1).expand(self.rows).contiguous()
        return t.reshape(-1) if self.granularity == "channel" else t

    def to_stored(self, kernel: Tensor) -> Tensor:
        """The kernels' scales as the checkpoint stores them (exact: the kernels' fp32 came
        from this dtype)."""
        if self.per_tensor:
            kernel = kernel[:1]
        return kernel.reshape(self.shape).to(self.dtype)

    def error(self, key: str, t) -> str | None:
        """Why the checkpoint's ``t`` cannot be these scales (None: it can): its type, shape,
        dtype, and values (finite and > 0; read here, before anything is copied)."""
        if not isinstance(t, Tensor):
            return f'While copying the parameter named "{key}", expected torch.Tensor from checkpoint but received ' \
                   f"{type(t)}"
        if tuple(t.shape) != self.shape:
            return (f"size mismatch for {key}: copying a param with shape {t.shape} from checkpoint, the shape in "
                    f"current model is {torch.Size(self.shape)}.")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"{key}: FP8 weight scales load from float32, bfloat16 or float16, the checkpoint holds {t.dtype}"
        return scales_error(key, t)


def data_error(key: str, t) -> str | None:
    """Why the checkpoint's ``t`` cannot be an FP8 weight's data (None: it can): anything but
    e4m3 would be converted by the copy into e4m3 values without scales; NaN values
    (fp8.check_data) would be read as finite ones. Data on the meta device cannot be read and
    passes."""
    if isinstance(t, Tensor) and t.dtype != fp8.E4M3:
        return (f"{key}: an FP8 weight loads e4m3 ({fp8.E4M3}) data, the checkpoint holds {t.dtype} (load it into "
                "the model before patching it with weights='fp8', or quantize it first)")
    if isinstance(t, Tensor) and t.device.type != "meta":
        try:
            fp8.check_data(t)
        except fp8.FP8FormatError as e:
            return f"{key}: {e}"
    return None


def scales_error(key: str, scale: Tensor) -> str | None:
    """Why scales are unusable (NaN, Inf, <= 0), or None; scales on the meta device cannot be
    read and pass."""
    if scale.device.type == "meta":
        return None
    try:
        fp8.check_scales(scale)
    except fp8.FP8FormatError as e:
        return f"{key}: {e}"
    return None


def refuse_bad_fp8(state_dict: dict, prefix: str, data_names, scale_names, error_msgs: list) -> None:
    """In a ``_load_from_state_dict``: report and take out of ``state_dict`` each of the module's
    e4m3 tensors ``data_names`` that :func:`data_error` refuses and each of its scales
    ``scale_names`` that :func:`scales_error` refuses, before torch copies anything (a copy would
    turn bf16 values into unscaled e4m3 ones, or take NaN scales)."""
    for names, why in ((data_names, data_error), (scale_names, scales_error)):
        for key in (prefix + n for n in names):
            t = state_dict.get(key)
            message = why(key, t) if isinstance(t, Tensor) else None
            if message is not None:
                error_msgs.append(message)
                state_dict.pop(key)


def format_of(module: nn.Module) -> ScaleFormat:
    """The module's :class:`ScaleFormat` (the kernels' layout where none was recorded)."""
    fmt = module.__dict__.get("scale_format")
    if fmt is None:
        scale = module._buffers[KERNEL_SCALE]
        fmt = ScaleFormat.of_kernel_scale(scale, "block128" if scale.dim() == 2 else "channel", module.weight.shape[0])
    return fmt


def _quantize_into(module: nn.Module, granularity: str) -> None:
    """Replace ``module.weight`` by its e4m3 data (same parameter name, frozen) and register
    its scales as the buffer ``weight_scale``."""
    q = fp8.quantize_fp8(module.weight.detach(), granularity)
    module.weight = nn.Parameter(q.data, requires_grad=False)
    module.register_buffer(KERNEL_SCALE, q.scale)
    module.fp8_dtype = q.dtype
    if module.bias is not None:
        module.bias.requires_grad_(False)


class FP8HybridLinear(HybridLinear):
    """A patched linear whose weight is FP8 (see the module docstring)."""

    fp8_dtype = torch.bfloat16
    fp8_activations = False

    def _apply(self, fn, *args, **kwargs):
        return super()._apply(keep_fp8_dtypes(self, fn), *args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return linear_fp8(x, self.weight, weight_scale_of(self), self.bias, self.activation, self.fp8_activations)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        fmt, own = format_of(self), {}
        super()._save_to_state_dict(own, "", keep_vars)
        own[fmt.name] = fmt.to_stored(own.pop(KERNEL_SCALE))
        save_in_order(destination, prefix, own, fmt.key_order)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        fmt = format_of(self)
        key, data_key = prefix + fmt.name, prefix + "weight"
        refused = set()
        if key in state_dict:
            t = state_dict.pop(key)
            why = fmt.error(key, t)
            if why is None:
                state_dict[prefix + KERNEL_SCALE] = fmt.to_kernel(t)
            else:
                error_msgs.append(why)
                refused.add(prefix + KERNEL_SCALE)
        refuse(state_dict, data_key, data_error(data_key, state_dict.get(data_key)), error_msgs, refused)
        missing = []
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected_keys,
                                      error_msgs)
        missing_keys.extend(key if m == prefix + KERNEL_SCALE else m for m in missing if m not in refused)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={format_of(self).granularity}"


class FP8FusedLinears(FusedLinears):
    """A fused projection (Q/K/V, gate/up) whose stacked weight is FP8; ``part_formats``
    holds each part's :class:`ScaleFormat` (its slice saves and loads its rows of the scales
    that way)."""

    fp8_dtype = torch.bfloat16
    fp8_activations = False
    STOCK_TENSORS = (KERNEL_SCALE,)

    def _apply(self, fn, *args, **kwargs):
        return super()._apply(keep_fp8_dtypes(self, fn), *args, **kwargs)

    def part_apply(self, piece: nn.Module, fn):
        return keep_fp8_dtypes(piece, fn)  # the parts' e4m3 only move

    def stacked_output(self, x: Tensor) -> Tensor:
        return linear_fp8(x, self.weight, weight_scale_of(self), self.bias, None, self.fp8_activations)

    def part_rows(self, attr: str, t: Tensor) -> tuple[Tensor, ...]:
        if attr == KERNEL_SCALE and t.dim() == 2:  # per 128 x 128 block: every part holds whole blocks of rows
            return t.split([s // fp8.BLOCK for s in self.sizes])
        return t.split(self.sizes)

    def stock_name(self, attr: str, idx: int) -> str:
        return self.part_formats[idx].name if attr == KERNEL_SCALE else attr

    def stock_part(self, attr: str, idx: int) -> Tensor | None:
        t = super().stock_part(attr, idx)
        return self.part_formats[idx].to_stored(t) if attr == KERNEL_SCALE else t

    def from_stock(self, attr: str, idx: int, t: Tensor) -> Tensor:
        return self.part_formats[idx].to_kernel(t) if attr == KERNEL_SCALE else t

    def stock_error(self, attr: str, idx: int, key: str, t) -> str | None:
        if attr == KERNEL_SCALE:
            return self.part_formats[idx].error(key, t)
        return super().stock_error(attr, idx, key, t) or (data_error(key, t) if attr == "weight" else None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The fused keys themselves (a state dict of the fused layout, or the pre-hook's
        # concatenation of checked parts): checked before torch copies them.
        refuse_bad_fp8(state_dict, prefix, ("weight",), (KERNEL_SCALE,), error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def freeze_parts(fused: FusedLinears, attrs=FusedLinears.PART_TENSORS) -> None:
    """``requires_grad=False`` on the parts' parameters ``attrs`` of ``fused``."""
    for attr in attrs:
        if fused.stacked(attr) is not None:
            for p in fused.parts(attr):
                p.requires_grad_(False)


def kernel_part_formats(fused: FusedLinears, scale: Tensor, granularity: str) -> tuple[ScaleFormat, ...]:
    """Each part of a fused weight quantized to ``scale`` stores its rows of it as they are."""
    rows = FP8FusedLinears.part_rows(fused, KERNEL_SCALE, scale)
    return tuple(ScaleFormat.of_kernel_scale(r, granularity, n) for r, n in zip(rows, fused.sizes))


def quantize_patched(modules: dict[str, nn.Module], granularity: str, lm_head: bool) -> list[str]:
    """Quantize every patched projection among ``modules`` (name -> module): each
    :class:`~hybridgemm.HybridLinear` (an ``lm_head`` only with ``lm_head``) and each fused
    Q/K/V or gate/up weight. Returns the names quantized. A block-scaled fused weight needs
    every part's rows to be a multiple of 128 (each scale block then lies in one part);
    otherwise that module is quantized per channel."""
    done = []
    for name, mod in modules.items():
        if type(mod) is FusedLinears:
            gran = granularity if all(s % fp8.BLOCK == 0 for s in mod.sizes) else "channel"
            q = fp8.quantize_fp8(mod.stacked("weight").detach(), gran)
            mod.set_stacked("weight", q.data, requires_grad=False)  # the parts now view the e4m3 rows
            mod.register_buffer(KERNEL_SCALE, q.scale)
            mod.fp8_dtype = q.dtype
            freeze_parts(mod, ("bias",))
            mod.part_formats = kernel_part_formats(mod, mod.weight_scale, gran)
            mod.__class__ = FP8FusedLinears
            done.append(name)
        elif type(mod) is HybridLinear and (lm_head or name.rpartition(".")[2] != "lm_head"):
            _quantize_into(mod, granularity)
            mod.__class__ = FP8HybridLinear
            done.append(name)
    return done


def is_fp8(module: nn.Module) -> bool:
    return isinstance(module, (FP8HybridLinear, FP8FusedLinears))


__all__ = ["FP8FusedLinears", "FP8HybridLinear", "KERNEL_SCALE", "SCALE_NAMES", "ScaleFormat", "format_of",
           "freeze_parts", "is_fp8", "kernel_part_formats", "quantize_patched", "weight_scale_of"]
