"""LayerNorm in one Triton launch: ``torch.nn.functional.layer_norm`` over the last dim with a
weight and a bias, of one input row into one or two outputs (two LayerNorms of the same input,
as GPT-NeoX's parallel layers normalise x twice)::

    xf = x.to(float32);  d = xf - mean(xf)
    out = (w * (d * rsqrt(mean(d * d) + eps)) + b).to(x.dtype)

The mean and the (biased) variance are fp32 sums over the row times fp32(1/H), the variance
of the centred values (two passes over the row in registers); torch's CUDA kernel accumulates
them by Welford's method, so results can differ from torch's in the last bit of the output.

Why: a compiled decode step of a LayerNorm model (GPT-NeoX, Falcon) runs each layer's norms as
one Inductor reduction kernel of about 3.3-4.5 us on the H200 for one 4-9 KB row
(perf/results/h200/e2e_profile_families_h200.csv); the row here is read once and stays in
registers. Inference only: no autograd; rows wider than :data:`SINGLE_PASS_MAX` are refused
(the caller runs the modules). Nothing touches a GPU at import time.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from .bounded_cache import BoundedCache
from .triton_config import next_pow2
from .triton_launch import Launcher, interpreting
from .triton_plan import TritonPlan
from .triton_rmsnorm import PLAN_CACHE_SIZE, SINGLE_PASS_MAX

__all__ = ["SINGLE_PASS_MAX", "layer_norms"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _affine_store(xhat, w_ptr, b_ptr, out_row, cols, mask):
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_row + cols, (w * xhat + b).to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_kernel(x_ptr, w1_ptr, b1_ptr, o1_ptr, w2_ptr, b2_ptr, o2_ptr, H, ldx, inv_h, eps,
                       BLOCK: tl.constexpr, TWO: tl.constexpr):
    # One program per row; 64-bit row offsets (M * ldx may pass 2**31 elements).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    xf = tl.load(x_ptr + row * ldx + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(xf, axis=0) * inv_h
    d = tl.where(mask, xf - mean, 0.0)
    xhat = d * tl.math.rsqrt(tl.sum(d * d, axis=0) * inv_h + eps)  # rsqrtf, as torch's kernel
    _affine_store(xhat, w1_ptr, b1_ptr, o1_ptr + row * H, cols, mask)
    if TWO:
        _affine_store(xhat, w2_ptr, b2_ptr, o2_ptr + row * H, cols, mask)


def _make_plan(m: int, h: int, ldx: int, two: bool, device: torch.device) -> TritonPlan:
    if m == 0:
        return TritonPlan(device, empty=True)
    block = next_pow2(h)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    meta = dict(BLOCK=block, TWO=two, num_warps=warps)
    # 1 / H as an fp32 argument: the mean is the fp32 sum times fp32(1/H)
    return TritonPlan(device, Launcher(_layer_norm_kernel, (m,), meta), scalars=(h, ldx, 1.0 / h))


# Plans by what the compiled kernel is specialised on: (M, H, ldx, the dtypes, device index,
# 16-byte alignment of each pointer, one or two outputs).
_PLANS = BoundedCache(PLAN_CACHE_SIZE)


def _aligned(*tensors) -> tuple:
    return tuple(not t.data_ptr() & 15 for t in tensors)


def layer_norms(x: torch.Tensor, params: list[tuple[torch.Tensor, torch.Tensor]], eps: float) -> list[torch.Tensor]:
    """``[F.layer_norm(x, (H,), w, b, eps) for w, b in params]`` (one or two (weight, bias)
    pairs of (H,) vectors) in one launch: tensors of x's shape and dtype. x (..., H) is read in
    place where its last dim has unit stride and its leading dims flatten to one row stride,
    else copied. x a CUDA tensor (a CPU one under TRITON_INTERPRET=1) of float16, bfloat16 or
    float32, the weights and biases of x's dtype and device, H at most :data:`SINGLE_PASS_MAX`.
    Bad arguments raise TypeError/ValueError naming the argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"layer_norms: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"layer_norms: x must be a float16/bfloat16/float32 tensor (..., H), got {x.dtype} "
                         f"of shape {tuple(x.shape)}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        raise ValueError(f"layer_norms: x must be a CUDA tensor (or a CPU one under TRITON_INTERPRET=1), "
                         f"got one on {x.device}")
    h = x.shape[-1]
    if not 1 <= h <= SINGLE_PASS_MAX:
        raise ValueError(f"layer_norms: the last dim must be 1..{SINGLE_PASS_MAX}, got {h}")
    if not isinstance(params, (list, tuple)) or len(params) not in (1, 2):
        raise ValueError("layer_norms: params must hold one or two (weight, bias) pairs")
    for i, pair in enumerate(params):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise TypeError(f"layer_norms: params[{i}] must be a (weight, bias) pair")
        for name, t in zip(("weight", "bias"), pair):
            if not isinstance(t, torch.Tensor) or t.shape != (h,) or t.dtype != x.dtype or t.device != x.device:
                got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"layer_norms: params[{i}]'s {name} must be an ({h},) tensor of x's dtype "
                                 f"{x.dtype} on {x.device}, got {got}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"layer_norms: eps must be a finite number >= 0, got {eps!r}")
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in params]
    if x.numel() == 0:
        return outs
    x2d = x.reshape(-1, h)
    if h > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    ldx = x2d.stride(0) if m > 1 else h  # (one row's stride is never used: one plan for all)
    flat = [(w.contiguous(), b.contiguous()) for w, b in params]
    second = flat[1] if len(flat) == 2 else flat[0]
    o2 = outs[1] if len(outs) == 2 else outs[0]
    key = (m, h, ldx, x.dtype, x.get_device(), len(flat) == 2,
           _aligned(x2d, *flat[0], *second, outs[0], o2))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _make_plan(m, h, ldx, len(flat) == 2, x.device))
    if x.is_cuda and x.get_device() != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            plan.launch(x2d, *flat[0], outs[0], *second, o2, *plan.scalars, float(eps))
    else:
        plan.launch(x2d, *flat[0], outs[0], *second, o2, *plan.scalars, float(eps))
    return outs
