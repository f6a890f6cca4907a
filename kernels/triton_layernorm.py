"""LayerNorm in one Triton launch: ``torch.nn.functional.layer_norm`` over the last dim with a
weight and a bias::

    xf = x.to(float32);  d = xf - mean(xf)
    out = (w * (d * rsqrt(mean(d * d) + eps)) + b).to(x.dtype)

The mean and the (biased) variance are fp32 sums over the row times fp32(1/H), the variance
of the centred values (two passes over the row in registers); torch's CUDA kernel accumulates
them by Welford's method, so results can differ from torch's in the last bit of the output.

Why: a compiled decode step of a LayerNorm model (Falcon) runs each layer's norm as an
Inductor reduction kernel of about 3.3-4.5 us on the H200 for one 9 KB row, this kernel in
2.7 us (perf/results/h200/e2e_profile_families_h200.csv). Inference only: no autograd; rows
wider than :data:`SINGLE_PASS_MAX` are refused (the caller runs torch's). Nothing touches a
GPU at import time.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["SINGLE_PASS_MAX", "layer_norm"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, H, ldx, inv_h, eps, BLOCK: tl.constexpr):
    # One program per row; 64-bit row offsets (M * ldx may pass 2**31 elements).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    xf = tl.load(x_ptr + row * ldx + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(xf, axis=0) * inv_h
    d = tl.where(mask, xf - mean, 0.0)
    xhat = d * tl.math.rsqrt(tl.sum(d * d, axis=0) * inv_h + eps)  # rsqrtf, as torch's kernel
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * xhat + b).to(out_ptr.dtype.element_ty), mask=mask)


def _make_plan(m: int, h: int, ldx: int, device: torch.device) -> TritonPlan:
    if m == 0:
        return TritonPlan(device, empty=True)
    block = next_pow2(h)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    meta = dict(BLOCK=block, num_warps=warps)
    # 1 / H as an fp32 argument: the mean is the fp32 sum times fp32(1/H)
    return TritonPlan(device, Launcher(_layer_norm_kernel, (m,), meta), scalars=(h, ldx, 1.0 / h))


# Plans by what the compiled kernel is specialised on: (M, H, ldx, the dtypes, device index,
# 16-byte alignment of each pointer).
_PLANS = BoundedCache(PLAN_CACHE_SIZE)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.layer_norm(x, (H,), weight, bias, eps)`` in one launch: a tensor of x's shape and
    dtype. x (..., H) is read in place where its last dim has unit stride and its leading dims
    flatten to one row stride, else copied. x a CUDA tensor (a CPU one under
    TRITON_INTERPRET=1) of float16, bfloat16 or float32, weight and bias (H,) of x's dtype and
    device, H at most :data:`SINGLE_PASS_MAX`. Bad arguments raise TypeError/ValueError naming
    the argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"layer_norm: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"layer_norm: x must be a float16/bfloat16/float32 tensor (..., H), got {x.dtype} "
                         f"of shape {tuple(x.shape)}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        raise ValueError(f"layer_norm: x must be a CUDA tensor (or a CPU one under TRITON_INTERPRET=1), "
                         f"got one on {x.device}")
    h = x.shape[-1]
    if not 1 <= h <= SINGLE_PASS_MAX:
        raise ValueError(f"layer_norm: the last dim must be 1..{SINGLE_PASS_MAX}, got {h}")
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) or t.shape != (h,) or t.dtype != x.dtype or t.device != x.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"layer_norm: {name} must be an ({h},) tensor of x's dtype {x.dtype} on {x.device}, "
                             f"got {got}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"layer_norm: eps must be a finite number >= 0, got {eps!r}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2d = x.reshape(-1, h)
    if h > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    ldx = x2d.stride(0) if m > 1 else h  # (one row's stride is never used: one plan for all)
    w, b = weight.contiguous(), bias.contiguous()
    key = (m, h, ldx, x.dtype, x.get_device(), *(not t.data_ptr() & 15 for t in (x2d, w, b, out)))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _make_plan(m, h, ldx, x.device))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (x's device's stream)
        plan.launch(x2d, w, b, out, *plan.scalars, float(eps))
    return out
