"""FP8 weights: e4m3 data with fp32 scales, in the two layouts FP8 checkpoints use.

``w ≈ data.float() * scale`` (the scale multiplies to dequantize) with

- ``channel``: one scale per output row, ``scale`` of shape (N,) (compressed-tensors'
  ``float-quantized`` per-channel weights store it as (N, 1); both are accepted);
- ``block128``: one scale per 128 x 128 block of W, ``scale`` of shape
  (ceil(N / 128), ceil(K / 128)) (transformers' ``FineGrainedFP8Config``, whose checkpoints
  call it ``weight_scale_inv``).

A mixture-of-experts block's experts, stacked as transformers stores them ([E, N, K]), take
the same formats per expert, with the scales stacked too: (E, N) or (E, N, 1) per channel,
(E, ceil(N/128), ceil(K/128)) per block (transformers' ``FP8Experts``); :func:`quantize_fp8`
and :class:`FP8Weight` take both forms, ``hybridgemm.moe`` the stacked one. A stacked gate/up
weight ([E, 2I, H], gate rows first) in blocks needs I a multiple of 128
(:func:`gate_up_blocks_problem`): each half then holds whole blocks, as ``FP8Experts`` stores
them, and a pair-major MoE program reads one scale per K tile for each half.

:class:`FP8Weight` is what :func:`quantize_fp8` returns and what ``hybridgemm.linear`` and the
patched modules take in place of a bf16/fp16 weight. Its checks run when it is made (scale
shape against granularity and scale dtype; with :meth:`FP8Weight.from_tensors`, or when a
quantized weight or checkpoint is loaded, finite positive scales and no NaN data), not in the
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
# every 8-bit float dtype torch has: what an FP8 checkpoint's tensor may be (the kernels read E4M3)
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
E4M3_MAX = 448.0  # the largest finite e4m3fn value
BLOCK = 128  # the block granularity's tile edge, in both N and K
GRANULARITIES = ("channel", "block128")
# The weight formats a Problem and a table key name (kernels/problem.py, autotune_cache/keys.py).
FORMAT_OF = {"channel": "e4m3_channel", "block128": "e4m3_block128"}
GRANULARITY_OF_FORMAT = {fmt: g for g, fmt in FORMAT_OF.items()}
OUT_DTYPES = (torch.bfloat16, torch.float16)
# the gated products (act(gate) * up) that activation quantization forms on the way (kernels/fp8_quant.py)
QUANTIZED_GLUS = ("silu",)
_MIN_AMAX = 1e-12  # an all-zero row or block gets a tiny positive scale, so dequantize gives zeros


class FP8FormatError(ValueError):
    """FP8 data or scales that do not make a weight of the stated granularity."""


def granularity_of(data: torch.Tensor, scale: torch.Tensor) -> str:
    """The granularity that ``scale``'s shape states for ``data`` (N, K): (N,) or (N, 1) is
    ``channel``, (ceil(N/128), ceil(K/128)) is ``block128``. FP8FormatError otherwise, and for
    data that is not 2-D e4m3fn or scales that are not fp32 on data's device (shapes and dtypes
    only: no device work). :func:`stacked_granularity_of` reads experts' stacked weights."""
    return _granularity(data, scale, 2)


def stacked_granularity_of(data: torch.Tensor, scale: torch.Tensor) -> str:
    """:func:`granularity_of` for experts' weights stacked as (E, N, K), their scales (E, N),
    (E, N, 1) or (E, ceil(N/128), ceil(K/128))."""
    return _granularity(data, scale, 3)


def _granularity(data: torch.Tensor, scale: torch.Tensor, dims: int) -> str:
    if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError(f"FP8 data and scale must be tensors, got {type(data).__name__}, {type(scale).__name__}")
    if data.dtype != E4M3:
        raise FP8FormatError(f"FP8 weight data must be {E4M3} (e4m3fn), got {data.dtype}")
    if data.dim() != dims:
        what = "(out_features, in_features)" if dims == 2 else "(experts, out_features, in_features)"
        raise FP8FormatError(f"FP8 weight data must be {dims}-D {what}, got {tuple(data.shape)}")
    if scale.dtype != torch.float32:
        raise FP8FormatError(f"FP8 weight scales must be float32, got {scale.dtype}")
    if scale.device != data.device:
        raise FP8FormatError(f"FP8 weight scales are on {scale.device} but the data is on {data.device}")
    lead, (n, k) = tuple(data.shape[:-2]), data.shape[-2:]
    shape = tuple(scale.shape)
    if shape in (lead + (n,), lead + (n, 1)):
        # (N, 1) with N = ceil(N/128) and K <= 128 would also read as block128: one 128-row block
        # of N = 1 rows; channel is the same numbers there.
        return "channel"
    blocks = lead + (-(-n // BLOCK), -(-k // BLOCK))
    if shape == blocks:
        return "block128"
    raise FP8FormatError(f"FP8 weight scale of shape {shape} fits neither granularity of a {tuple(data.shape)} "
                         f"weight: channel wants {lead + (n,)} or {lead + (n, 1)}, block128 wants {blocks}")


def gate_up_blocks_problem(two_i: int) -> str | None:
    """Why a stacked gate/up weight of ``two_i`` rows per expert cannot take 128 x 128 block
    scales (None: it can): see the module docstring."""
    if two_i % 2 or (two_i // 2) % BLOCK:
        return (f"block-scaled FP8 gate/up weights need I a multiple of {BLOCK} (each half whole blocks of "
                f"scales), got {two_i} rows (I = {two_i / 2:g})")
    return None


def check_scales(scale: torch.Tensor) -> None:
    """FP8FormatError unless every scale is finite and > 0 (a NaN, Inf, zero or negative scale
    would turn a whole row or block into garbage without an error). Reads the scales: one
    device sync, so it runs when a weight is made or loaded, not per call."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        count = int(bad.sum())
        first = scale.flatten()[bad.flatten()][0].item()
        raise FP8FormatError(f"FP8 weight scales must be finite and > 0: {count} of {scale.numel()} are not "
                             f"(e.g. {first!r})")


def check_data(data: torch.Tensor) -> None:
    """FP8FormatError if ``data`` (e4m3) holds a NaN code (0x7f or 0xff): quantization never
    writes one, the kernels' integer conversion (kernels/triton_e4m3.py) would read it as -/+480,
    and a NaN weight is a broken checkpoint either way. Reads the data: one pass and one device
    sync, so it runs when a weight is loaded, not per call."""
    nan = (data.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        raise FP8FormatError(f"FP8 weight data holds {int(nan.sum())} NaN values (e4m3 codes 0x7f / 0xff) in "
                             f"{data.numel()}")


def scale_vector(scale: torch.Tensor, granularity: str, experts: bool = False) -> torch.Tensor:
    """The scale as the kernels read it: (N,) contiguous for ``channel``, (N/128, K/128)
    row-major for ``block128``; with ``experts``, the same with a leading (E,)."""
    lead = (scale.shape[0],) if experts else ()
    if granularity == "channel":
        return scale.reshape(*lead, -1).contiguous()
    return scale.reshape(*lead, scale.shape[len(lead)], -1).contiguous()


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``data * scale`` in fp32, rounded once to ``dtype``: the reference every FP8 kernel is
    checked against, and the fallback path's weight. Stacked experts' (E, N, K) data too."""
    stacked = data.dim() == 3
    granularity = (stacked_granularity_of if stacked else granularity_of)(data, scale)
    w = data.to(torch.float32)
    n, k = data.shape[-2:]
    if granularity == "channel":
        w = w * scale.reshape(*data.shape[:-1], 1)
    else:
        w = w * scale.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
    return w.to(dtype)


@dataclass(frozen=True, eq=False)
class FP8Weight:
    """An e4m3 weight (N, K), or experts' weights stacked (E, N, K), with its fp32 scales;
    ``dtype`` is the activations' and the output's dtype (bf16 or fp16). Made by
    :func:`quantize_fp8` or from a checkpoint's tensors (:meth:`from_tensors`); checked once,
    when made."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise FP8FormatError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        stacked = isinstance(self.data, torch.Tensor) and self.data.dim() == 3
        stated = (stacked_granularity_of if stacked else granularity_of)(self.data, self.scale)
        lead, (n, k) = tuple(self.data.shape[:-2]), self.data.shape[-2:]
        both = n == 1 and k <= BLOCK and tuple(self.scale.shape) == lead + (1, 1)  # one row, one block: either
        if stated != self.granularity and not both:
            raise FP8FormatError(f"a scale of shape {tuple(self.scale.shape)} is {stated} granularity, "
                                 f"not {self.granularity}")
        if self.dtype not in OUT_DTYPES:
            raise FP8FormatError(f"an FP8 weight computes in bfloat16 or float16, got {self.dtype}")
        if self.data.stride(-1) != 1:
            object.__setattr__(self, "data", self.data.contiguous())
        object.__setattr__(self, "scale", scale_vector(self.scale, self.granularity, stacked))

    @classmethod
    def from_tensors(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     check: bool = True) -> FP8Weight:
        """A checkpoint's e4m3 ``data`` and ``scale`` (granularity read from the scale's shape);
        ``check`` also verifies that every scale is finite and positive and that no value is
        NaN (a pass over the data and a device sync)."""
        read = stacked_granularity_of if isinstance(data, torch.Tensor) and data.dim() == 3 else granularity_of
        weight = cls(data, scale, read(data, scale), dtype)
        if check:
            check_scales(weight.scale)
            check_data(weight.data)
        return weight

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def experts(self) -> int | None:
        """E for experts' stacked weights (E, N, K), None for one weight (N, K)."""
        return self.data.shape[0] if self.data.dim() == 3 else None

    @property
    def weight_format(self) -> str:
        return FORMAT_OF[self.granularity]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.data, self.scale, dtype or self.dtype)

    def __repr__(self) -> str:
        return (f"FP8Weight(shape={tuple(self.shape)}, granularity={self.granularity!r}, dtype={self.dtype}, "
                f"device={self.device})")


def quantize_fp8(weight: torch.Tensor, granularity: str = "channel") -> FP8Weight:
    """``weight`` (N, K), or experts' weights stacked (E, N, K), bf16/fp16/fp32, as an
    :class:`FP8Weight`: per output row (``channel``) or per 128 x 128 block (``block128``; per
    expert for stacked weights), scale = amax / 448 so the largest magnitude maps to e4m3's
    largest finite value, data = round-to-nearest(w / scale). The result computes in the
    weight's dtype (fp32 weights: bf16)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"quantize_fp8 takes a tensor, got {type(weight).__name__}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if weight.dim() not in (2, 3) or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_fp8 takes a 2-D (N, K) or stacked 3-D (E, N, K) bf16/fp16/fp32 weight, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_fp8: the weight holds NaN or Inf")
    dtype = weight.dtype if weight.dtype in OUT_DTYPES else torch.bfloat16
    if weight.dim() == 2:
        return FP8Weight(*_quantized(weight.detach(), granularity), granularity, dtype)
    # experts one at a time: an fp32 temporary of one expert's weight, not of the whole stack
    n, k = weight.shape[1:]
    scale_shape = (n,) if granularity == "channel" else (-(-n // BLOCK), -(-k // BLOCK))
    data = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
    scale = torch.empty((weight.shape[0], *scale_shape), dtype=torch.float32, device=weight.device)
    for e in range(weight.shape[0]):
        data[e], scale[e] = _quantized(weight[e].detach(), granularity)
    return FP8Weight(data, scale, granularity, dtype)


def scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, floor) / 448``, IEEE-rounded on every device (kernels/fp8_quant.py computes
    the activations' scales so). The divisor is a 0-dim tensor on amax's device: torch's CUDA
    division by a Python number multiplies by its reciprocal, a rounding off by one ulp for some
    values."""
    return amax.clamp_min(_MIN_AMAX) / amax.new_full((), E4M3_MAX)


def _quantized(weight: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data, fp32 scales) of one (N, K) weight (:func:`quantize_fp8`)."""
    w = weight.to(torch.float32)
    n, k = w.shape
    if granularity == "channel":
        scale = scale_of_amax(w.abs().amax(dim=1))
        return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    scale = scale_of_amax(blocks.abs().amax(dim=(1, 3)))
    data = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return data.view(nb * BLOCK, kb * BLOCK)[:n, :k].to(E4M3).contiguous(), scale


__all__ = [
    "BLOCK", "E4M3", "E4M3_MAX", "FORMAT_OF", "FP8FormatError", "FP8Weight", "FP8_DTYPES", "GRANULARITIES",
    "GRANULARITY_OF_FORMAT", "QUANTIZED_GLUS", "check_data", "check_scales", "dequantize", "gate_up_blocks_problem",
    "granularity_of", "quantize_fp8", "scale_of_amax", "scale_vector", "stacked_granularity_of",
]
