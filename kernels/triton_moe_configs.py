"""The mixture-of-experts kernels' shared parts (kernels/triton_moe.py, grouped; kernels/triton_moe_pairs.py,
pair-major): their configs (:class:`TritonMoeConfig`) and defaults (:func:`default_configs`), the
stacked expert weights as the kernels take them (:func:`operand`, bf16/fp16 or e4m3 with scales),
and the checks and constexprs both kernel modules apply. Nothing touches a GPU at import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import fp8
from .triton_e4m3 import integer_conversion
from .triton_glu import ACTIVATIONS


@dataclass(frozen=True)
class TritonMoeConfig:
    block_m: int  # laid-out rows per program (the layout's block: one expert per block); 1: pair-major
    block_n: int  # output columns per program
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    mma: bool = False  # pair-major only: the tensor-core forms of the kernels (see "pair-major" below)


def pair_major(pairs: int, experts: int) -> bool:
    """Do ``pairs`` pairs over ``experts`` experts run pair-major by default? Where pairs are at
    most half the experts (decode: few experts take two pairs, and a pair-major launch streams
    an expert's weights once per pair, but needs no layout's launches) and at most 64."""
    return pairs <= 64 and 2 * pairs <= experts


# Pair-major configs, from scripts/moe_config_probe.py on the H200 (2026-12-05, cold launches,
# µs; perf/results/h200/moe_config_probe_pairs_h200.csv) at the Qwen3-30B-A3B and Mixtral-8x7B
# experts, 1 and 8 tokens. Gate/up: the tensor-core form with 16 x 256 W tiles on one warp is
# within 2.3% of the fastest config in all eight cases (bf16 and e4m3 per channel; e.g. Qwen3 at
# one token 13.9 bf16 and 10.5 e4m3, against 15.4 and 13.5 for the CUDA-core 8 x 128 tiles).
# Down: the tensor-core form runs a token's slots one after another, so at one Qwen3 token it
# has too few programs (16.5 bf16, 20.6 e4m3) and the CUDA-core form with all slots in one tile
# wins; its default tiles (4 x 256 for bf16, 8 x 256 for e4m3, 8 warps) take 9.6 and 8.0 there
# and 69.1 and 56.5 at one Mixtral token, all within 20% of the fastest probed config
# (bf16 Mixtral's fastest: the tensor-core form, 57.4). From two tokens on, the tensor-core
# 16 x 128 tiles (Qwen3 at 8 tokens: 43.2 bf16 against 47.4, 28.9 e4m3 against 52.0). With
# these, 64 e4m3 pairs (Qwen3, 8 tokens) take 76.5 pair-major against 91.9 for the layout and
# the grouped launches. Block-scaled e4m3 experts take tiles 128 columns deep (fp8_fits).
_PAIR_UP = TritonMoeConfig(1, 16, 256, 1, 4, mma=True)
_PAIR_DOWN_MANY_TOKENS = TritonMoeConfig(1, 16, 128, 1, 4, mma=True)
_PAIR_DOWN_ONE_TOKEN = {"": TritonMoeConfig(1, 4, 256, 8, 2),
                        fp8.FORMAT_OF["channel"]: TritonMoeConfig(1, 8, 256, 8, 4),
                        fp8.FORMAT_OF["block128"]: TritonMoeConfig(1, 8, 128, 8, 4)}


def default_configs(pairs: int, experts: int, weight_format: str = "", *,
                    top_k: int = 1) -> tuple[TritonMoeConfig, TritonMoeConfig]:
    """(gate/up, down) configs for ``pairs`` (token, expert) pairs of ``top_k`` per token over
    ``experts`` experts: pair-major (``block_m`` 1, no layout) where :func:`pair_major` (the
    measured configs above), else one block size for both (they share the layout) by the rows an
    expert gets on average, each expert's rows padded to whole blocks: the fastest or within 5%
    of it for the Qwen3-30B-A3B and Mixtral-8x7B experts at 8, 64 and 2048 tokens
    (scripts/moe_config_probe.py on the H200). Block-scaled FP8 experts (``weight_format``
    ``e4m3_block128``) take tiles 128 columns deep (:func:`fp8_fits`); per-channel ones past
    48 rows an expert the 64 x 128 x 64 tiles however many rows it gets."""
    if pair_major(pairs, experts):
        block = weight_format == fp8.FORMAT_OF["block128"]
        up = dataclasses.replace(_PAIR_UP, block_k=128) if block else _PAIR_UP
        return up, _PAIR_DOWN_ONE_TOKEN[weight_format] if pairs <= top_k else _PAIR_DOWN_MANY_TOKENS
    per_expert = -(-pairs // max(experts, 1))
    if per_expert <= 8:
        both = TritonMoeConfig(16, 64, 128, 4, 3)
    elif per_expert <= 48:
        both = TritonMoeConfig(32, 64, 128, 4, 3)
    elif per_expert <= 96 or weight_format == fp8.FORMAT_OF["channel"]:
        both = TritonMoeConfig(64, 128, 64, 4, 4)
    else:
        return TritonMoeConfig(128, 128, 64, 8, 4), TritonMoeConfig(128, 256, 64, 8, 3)
    return both, both


# the kernels' WSCALE per weight format: 0 a weight of x's dtype, 1 per output row, 2 per block
_WSCALE = {"": 0, fp8.FORMAT_OF["channel"]: 1, fp8.FORMAT_OF["block128"]: 2}


def fp8_fits(config: TritonMoeConfig, weight_format: str) -> str | None:
    """Why ``config`` cannot read block-scaled FP8 experts (None: it can, or the weights are not
    block-scaled): its K tiles must not cross a 128-column block of scales, and a pair-major
    program's columns must lie in one 128-row block (one scale per program and K tile)."""
    if weight_format != fp8.FORMAT_OF["block128"]:
        return None
    if fp8.BLOCK % config.block_k:
        return f"block_k={config.block_k} crosses the {fp8.BLOCK}-column blocks of the scales"
    if config.block_m == 1 and fp8.BLOCK % config.block_n:
        return f"block_n={config.block_n} crosses the {fp8.BLOCK}-row blocks of the scales (pair-major)"
    return None


@dataclass(frozen=True)
class Operand:
    """A stacked expert weight as the kernels take it: ``data`` [E, N, K] (x's dtype or e4m3),
    ``scale`` (the data itself where there are none: never read), the format's ``WSCALE`` and
    the scales' strides per expert and per row."""

    data: torch.Tensor
    scale: torch.Tensor
    wscale: int
    lse: int
    lsn: int
    dtype: torch.dtype  # the dtype the products are computed and rounded in

    @property
    def weight_format(self) -> str:
        return next(fmt for fmt, mode in _WSCALE.items() if mode == self.wscale)


def operand(w) -> Operand:
    """:class:`Operand` of a stacked weight tensor or a stacked ``fp8.FP8Weight``."""
    if isinstance(w, fp8.FP8Weight):
        if w.experts is None:
            raise ValueError(f"moe: an FP8 expert weight must be stacked [E, N, K], got {tuple(w.shape)}")
        sc = w.scale
        return Operand(w.data, sc, _WSCALE[w.weight_format], sc.stride(0), sc.stride(1) if sc.dim() == 3 else 0,
                       w.dtype)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"moe: expert weights must be tensors or FP8Weights, got {type(w).__name__}")
    if w.dtype == fp8.E4M3:
        raise ValueError("moe: e4m3 expert weights need their scales: pass a kernels.fp8.FP8Weight "
                         "(hybridgemm.quantize_fp8, or FP8Weight.from_tensors for a checkpoint's)")
    return Operand(w, w, 0, 0, 0, w.dtype)


def input_precision(x: torch.Tensor) -> str:
    return "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def wscale_args(w: Operand, x: torch.Tensor) -> dict:
    """The kernels' FP8 constexprs for weight ``w`` and activations ``x``."""
    return {"WSCALE": w.wscale, "WINT": w.wscale != 0 and integer_conversion(x.dtype)}


def rounds_product(x: torch.Tensor, routing_weights: torch.Tensor) -> bool:
    return torch.promote_types(x.dtype, routing_weights.dtype) != torch.float32


def check_activation(two_i: int, activation: str, w: Operand) -> None:
    if two_i % 2:
        raise ValueError(f"moe: w_gate_up has {two_i} rows per expert, not gate and up halves")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    why = fp8.gate_up_blocks_problem(two_i) if w.wscale == _WSCALE[fp8.FORMAT_OF["block128"]] else None
    if why:
        raise ValueError(f"moe: {why}")


def check_weights(config: TritonMoeConfig, x: torch.Tensor, w: Operand) -> None:
    data = w.data
    if x.dim() != 2 or data.dim() != 3 or x.shape[1] != data.shape[2]:
        raise ValueError(f"moe: x {tuple(x.shape)} and stacked expert weights {tuple(data.shape)} do not fit "
                         "([rows, K] and [E, N, K])")
    if x.dtype != w.dtype:
        raise ValueError(f"moe: x is {x.dtype} but the expert weights compute in {w.dtype}")
    if x.stride(1) != 1 or data.stride(2) != 1 or data.stride(1) != data.shape[2]:
        raise ValueError("moe: x and the expert weights must be row-major (unit stride along K)")
    if x.device != data.device:
        raise ValueError(f"moe: x is on {x.device} but the expert weights are on {data.device}")
    why = fp8_fits(config, w.weight_format)
    if why is not None:
        raise ValueError(f"moe: config {config} cannot read block-scaled FP8 experts: {why}")


__all__ = ["Operand", "TritonMoeConfig", "check_activation", "check_weights", "default_configs", "fp8_fits",
           "input_precision", "operand", "pair_major", "rounds_product", "wscale_args"]
