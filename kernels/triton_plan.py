"""Launch plans of the Triton kernels: per operand layout, everything a call needs besides its
data pointers (launchers, integer arguments, scratch sizes, TMA descriptor shapes), built once
after the operand checks and kept in a bounded cache, so that a repeated call does no Problem
construction, no ``supports`` check, no device query and no grid arithmetic.

Serves triton_gemm, triton_splitk and triton_glu (:class:`PlanCache`, the operand and fusion
checks, the constexprs they share) and triton_rmsnorm (:class:`TritonPlan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from .bounded_cache import BoundedCache
from .checks import operand_key
from .epilogue import Activation, Epilogue
from .problem import Problem, dtype_name
from .triton_config import dot_precision
from .triton_epilogue import ACT_CODE
from .triton_launch import Launcher, device_facts, interpreting

PLAN_CACHE_SIZE = 4096  # plans per kernel: varying M in a server makes new keys; rebuilding is cheap


@dataclass(frozen=True)
class TritonPlan:
    """Everything about a launch that depends only on (config, operand layout, activation,
    tf32), computed once, so that a repeated call does no Problem construction, no
    ``supports`` check, no device query and no grid arithmetic."""

    device: torch.device
    launch: Launcher | None = None
    scalars: tuple = ()  # the kernel's integer arguments
    ws_numel: int = 0  # split-K workspace elements (0 without a split)
    counters: int = 0  # split-K arrival counters (output tiles of a one-launch reduction, else 0)
    descs: tuple | None = None  # TMA: per operand (shape, strides, block_shape)
    reduce: Launcher | None = None  # the second launch of a two-launch split-K reduction
    reduce_scalars: tuple = ()
    empty: bool = False  # M or N is 0: nothing to launch


class PlanCache(BoundedCache):
    """One kernel's plans by (config, activation, tf32, operand layout): ``operand_key`` with
    16-byte pointer classes (what Triton specialises pointer arguments on and TMA needs).
    Two threads missing the same key both build a plan, and either is valid."""

    def __init__(self, build, max_size: int = PLAN_CACHE_SIZE):
        super().__init__(max_size)
        self.build = build  # (config, x, weight, bias, out, act, tf32) -> TritonPlan

    def plan(self, config, x, weight, bias, out, activation, tf32, build: bool = True) -> TritonPlan | None:
        """The plan for these operands, built on a miss (None on a miss when not ``build``)."""
        act = parse_activation(activation)
        tf32 = bool(tf32)
        key = (config, act, tf32, operand_key(x, x.data_ptr(), weight, weight.data_ptr(), bias, out, 15))
        plan = self.get(key)
        if plan is None and build:
            plan = self.put(key, self.build(config, x, weight, bias, out, act, tf32))
        return plan


def plan_problem(config, x, weight, bias, out, act: Activation, tf32: bool, weight_format: str = "",
                 glu: bool = False):
    """What building any plan starts with: the operand checks (clear errors), the Problem, and
    ``config.supports`` on x's device. ``(problem, device facts)``, or None for an empty output
    (M or N is 0). Raises ValueError when the config cannot run the problem there.
    ``weight_format``: W is FP8 in that format (kernels/fp8.py), x and out bf16/fp16. ``glu``:
    W is a stacked [gate; up] and out holds the product's N / 2 columns."""
    check_operands(x, weight, bias, out, weight_format, glu)
    problem = Problem.from_tensors(x, weight, bias, out, Epilogue(act, bias is not None), tf32, weight_format)
    if problem.m == 0 or problem.n == 0:
        return None
    facts = device_facts(x.device)
    ok, reason = config.supports(problem, smem_limit=facts.smem_per_block, capability=facts.capability)
    if not ok:
        raise ValueError(f"{config} does not support {problem}: {reason}")
    return problem, facts


def plan_meta(config, problem: Problem, act: Activation, has_bias: bool) -> dict:
    """The constexprs and launch options both kernels take, from a config with block_m/n/k,
    num_warps and num_stages."""
    return dict(BM=config.block_m, BN=config.block_n, BK=config.block_k, HAS_BIAS=has_bias, ACT=ACT_CODE[act],
                PREC=dot_precision(problem), EVEN_K=problem.k % config.block_k == 0,
                num_warps=config.num_warps, num_stages=config.num_stages)


def split_extent(k: int, block_k: int, split: int) -> int:
    """Elements of K per split: whole blocks, spread evenly over ``split`` programs."""
    return triton.cdiv(triton.cdiv(k, block_k), split) * block_k


# ----------------------------------------------------------------------------- operands


def check_operands(x, weight, bias, out, weight_format: str = "", glu: bool = False) -> None:
    """Clear TypeError/ValueError for anything the kernels cannot take. Run once per plan.
    With a ``weight_format`` W is e4m3 and x bf16/fp16; otherwise all share x's dtype. ``glu``:
    W's N rows are a stacked [gate; up] (N even) and out has N / 2 columns."""
    named = {"x": x, "weight": weight, "out": out} | ({} if bias is None else {"bias": bias})
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or weight.dim() != 2 or out.dim() != 2:
        raise ValueError(
            f"x, weight and out must be 2-D, got x{tuple(x.shape)}, weight{tuple(weight.shape)}, "
            f"out{tuple(out.shape)}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if glu and n % 2:
        raise ValueError(f"a GLU weight stacks gate and up rows: N={n} must be even")
    cols = n // 2 if glu else n
    if weight.shape[1] != k or tuple(out.shape) != (m, cols):
        raise ValueError(
            f"shape mismatch: x{tuple(x.shape)} @ weight{tuple(weight.shape)}.T -> out{tuple(out.shape)}"
            + (f" (the GLU product's {cols} columns)" if glu else "")
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or (n > 1 and bias.stride(0) != 1)):
        raise ValueError(f"bias must be a contiguous vector of {n} elements, got {tuple(bias.shape)}")
    dtype_name(x.dtype)  # TypeError for anything but fp16/bf16/fp32
    if weight_format:
        if weight.dtype != torch.float8_e4m3fn or x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"an FP8 weight ({weight_format}) needs e4m3fn W and bf16/fp16 x, got W {weight.dtype}, "
                            f"x {x.dtype}")
    elif weight.dtype == torch.float8_e4m3fn:
        raise TypeError("an e4m3fn weight needs its scales (kernels/fp8.py FP8Weight)")
    for name, t in named.items():
        if t.dtype != x.dtype and not (name == "weight" and weight_format):
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; all must match")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if (k > 1 and (x.stride(1) != 1 or weight.stride(1) != 1)) or (cols > 1 and out.stride(1) != 1):
        raise ValueError("x, weight and out need unit column stride (rows may be padded)")
    if m > 1 and out.stride(0) < cols:
        raise ValueError(f"out rows overlap (row stride {out.stride(0)} < {cols} columns)")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (got {x.device}) or TRITON_INTERPRET=1")


# Activation is a str enum, so this dict answers Activation members and their string values
# alike with one hash lookup (Activation.parse costs ~0.5 µs per call).
_ACTIVATIONS = {None: Activation.NONE, **{a.value: a for a in Activation}}


def parse_activation(activation) -> Activation:
    try:
        return _ACTIVATIONS[activation]
    except (KeyError, TypeError):
        return Activation.parse(activation)


def check_fusion(x: torch.Tensor, out: torch.Tensor, norm: tuple | None, residual: torch.Tensor | None,
                 who: str) -> None:
    """ValueError/TypeError unless ``norm`` is None or (a contiguous K-vector of x's dtype or
    fp32 on x's device, a finite eps ≥ 0[, a finite offset: the prologue's factor is then
    ``offset + g`` in fp32]) and ``residual`` is None or an (M, N) tensor like ``out`` with unit
    column stride."""
    if norm is not None:
        if not (isinstance(norm, tuple) and len(norm) in (2, 3)):
            raise TypeError(f"{who}: norm must be a (weight, eps) pair or (weight, eps, offset), got "
                            f"{type(norm).__name__}")
        nw, eps = norm[:2]
        offset = norm[2] if len(norm) == 3 else 0.0
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
            raise ValueError(f"{who}: norm offset must be a finite number, got {offset!r}")
        if not isinstance(nw, torch.Tensor) or nw.dim() != 1 or nw.shape[0] != x.shape[1] or nw.stride(0) != 1:
            raise ValueError(f"{who}: the norm weight must be a contiguous vector of {x.shape[1]} elements (x's K)")
        if nw.dtype not in (x.dtype, torch.float32) or nw.device != x.device:
            raise TypeError(f"{who}: the norm weight must have x's dtype (or float32) and device ({x.dtype}, "
                            f"{x.device}), got {nw.dtype} on {nw.device}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
            raise ValueError(f"{who}: norm eps must be a finite number ≥ 0, got {eps!r}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{who}: residual must be a tensor, got {type(residual).__name__}")
        if residual.shape != out.shape or residual.dtype != out.dtype or residual.device != out.device:
            raise ValueError(f"{who}: residual must match the output ({tuple(out.shape)}, {out.dtype}, {out.device}), "
                             f"got {tuple(residual.shape)}, {residual.dtype}, {residual.device}")
        if residual.stride(1) != 1 or (residual.shape[0] > 1 and residual.stride(0) < residual.shape[1]):
            raise ValueError(f"{who}: residual rows must be row-major with unit column stride")


__all__ = [
    "PLAN_CACHE_SIZE", "PlanCache", "TritonPlan", "check_fusion", "check_operands", "parse_activation", "plan_meta",
    "plan_problem", "split_extent",
]
