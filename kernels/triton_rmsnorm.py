"""RMSNorm in one Triton launch, with the formula of Hugging Face's LlamaRMSNorm (also
Qwen2RMSNorm, Qwen3RMSNorm and MistralRMSNorm)::

    xf = x.to(float32)
    y = (xf * rsqrt(mean(xf * xf, -1) + eps)).to(x.dtype)   # rounded to x's dtype first
    out = weight * y                                        # torch's promotion of (weight, x)

The product is computed in fp32 and rounded once to ``torch.promote_types(weight.dtype,
x.dtype)``; for 16-bit operands that is what torch does (the product of two 16-bit values is
exact in fp32). The mean is the fp32 sum times fp32(1/H), as torch's CUDA mean computes it;
the order of the sum differs from torch's, so fp32 results can differ in the last bits.

With ``fp32_factor=True``, the formula of Gemma's and OLMo 2's norms, whose factor is
``offset + weight`` in fp32 (Gemma: ``offset`` 1, OLMo 2: 0; the sum is formed in registers,
rounded to fp32 as torch's ``1.0 + weight.float()`` rounds it)::

    out = ((xf * rsqrt(mean(xf * xf, -1) + eps)) * (offset + weight.float())).to(x.dtype)   # rounded once

With a ``residual`` (the post-norm layers' ``residual + norm(x)``: Gemma 2/3, OLMo 2), the
normalised row is rounded to the output dtype and added to the residual row in fp32, rounded
once, as torch's add of two 16-bit tensors computes it.

Compiled without floating-point contraction (``enable_fp_fusion=False``): with it, the
compiler fuses a product and the add that follows into one FMA across a rounding that torch
makes (the weight's product and the residual add become one ``fma.rn.bf16``; the mean and eps
one ``fma.rn.f32``), so the results would depend on the variant compiled. Without it, every
operation rounds where torch's ops round: the 16-bit products and sums the compiler narrows
are exact or rounded once in a way that equals fp32-then-round (a sum of two bf16/fp16
values in fp32 then rounded to 16 bits is the correctly rounded sum).

Why: a decode step in eager mode runs HF's RMSNorm as about eight torch ops (to fp32, pow,
mean, add, rsqrt, mul, to, mul), each a kernel launch and a host dispatch, on a few KB of
data; the host time is the cost. This is one launch, through a cached plan.

Inference only: no autograd. Callers use torch's own ops when a gradient is wanted, and under
torch.compile, which fuses the norm by itself. Nothing touches a GPU at import time.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from .bounded_cache import BoundedCache
from .problem import DTYPE_NAMES
from .triton_config import next_pow2
from .triton_launch import Launcher, interpreting
from .triton_plan import TritonPlan

__all__ = ["PLAN_CACHE_SIZE", "out_dtype", "rms_norm", "run"]

SINGLE_PASS_MAX = 16384  # widest row kept in registers (16 warps: 32 fp32 values per thread)
CHUNK = 4096  # elements per step of the two-pass loop over wider rows
PLAN_CACHE_SIZE = 1024  # plans kept, oldest evicted first (varying M in a server makes new keys)


@triton.jit
def _scale_store(xf, rstd, x_row, w_ptr, out_row, res_row, cols, mask, offset, ROUND_FIRST: tl.constexpr,
                 ADD: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_row.dtype.element_ty
    if ROUND_FIRST:  # Llama's: the normalised row rounded to x's dtype before the weight multiplies it
        y = (xf * rstd).to(x_row.dtype.element_ty).to(tl.float32)
        v = (w * y).to(dt)
    else:  # Gemma's / OLMo 2's: in fp32 in torch's order, (x * rstd) * (offset + w), one rounding at the end
        v = ((xf * rstd) * (offset + w)).to(dt)
    if ADD:  # residual + the rounded norm, in fp32, rounded once
        v = (tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32) + v.to(tl.float32)).to(dt)
    tl.store(out_row + cols, v, mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, H, ldx, ldr, inv_h, eps, offset, BLOCK: tl.constexpr,
                     CHUNKED: tl.constexpr, ROUND_FIRST: tl.constexpr, ADD: tl.constexpr):
    # One program per row. 64-bit row offsets: M * ldx may pass 2**31 elements.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * ldx
    out_row = out_ptr + row * H
    res_row = res_ptr + row * ldr
    cols = tl.arange(0, BLOCK)
    # tl.math.rsqrt, not 1 / sqrt: torch's CUDA rsqrt calls rsqrtf, the same hardware approximation.
    if CHUNKED:  # rows too wide for registers: sum of squares, then a second read to normalise
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, H, BLOCK):
            mask = start + cols < H
            xf = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            acc += xf * xf
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) * inv_h + eps)
        for start in range(0, H, BLOCK):
            mask = start + cols < H
            xf = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            _scale_store(xf, rstd, x_row, w_ptr + start, out_row + start, res_row + start, cols, mask, offset,
                         ROUND_FIRST, ADD)
    else:  # the row is read once and stays in registers
        mask = cols < H
        xf = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_h + eps)
        _scale_store(xf, rstd, x_row, w_ptr, out_row, res_row, cols, mask, offset, ROUND_FIRST, ADD)


def _make_plan(m: int, h: int, ldx: int, device: torch.device, fp32_factor: bool = False,
               ldr: int | None = None) -> TritonPlan:
    if m == 0 or h == 0:
        return TritonPlan(device, empty=True)
    chunked = h > SINGLE_PASS_MAX
    block = CHUNK if chunked else next_pow2(h)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    meta = dict(BLOCK=block, CHUNKED=chunked, ROUND_FIRST=not fp32_factor, ADD=ldr is not None, num_warps=warps,
                enable_fp_fusion=False)  # (module docstring: no FMA, torch's roundings)
    # 1 / H as an fp32 argument: torch's CUDA mean multiplies the sum by fp32(1/N)
    return TritonPlan(device, Launcher(_rms_norm_kernel, (m,), meta), scalars=(h, ldx, ldr or 0, 1.0 / h))


# Plans by everything the compiled kernel is specialised on: (M, H, ldx, the three dtypes,
# device index, 16-byte alignment of each pointer, the formula). triton_plan.PlanCache keys GEMM operands
# (config, bias, activation, tf32), so this kernel builds its own keys.
_PLANS = BoundedCache(PLAN_CACHE_SIZE)


def run(x2d: torch.Tensor, weight: torch.Tensor, out2d: torch.Tensor, eps: float,
        fp32_factor: bool = False, offset: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out2d[:] = rms_norm(x2d, weight, eps, fp32_factor=fp32_factor, offset=offset)``, plus
    ``residual`` (M, H) where given (unit column stride, out2d's dtype); returns ``out2d``.
    The backend contract, unchecked: x2d (M, H) with unit column stride (any row stride), weight
    a contiguous (H,) vector, out2d a contiguous (M, H) of :func:`out_dtype`, all on the current
    device."""
    m, h = x2d.shape
    ldx = x2d.stride(0) if m > 1 else h  # a single row's stride is never used: one plan for all
    ldr = None if residual is None else residual.stride(0) if m > 1 else h
    res = out2d if residual is None else residual  # (not read without ADD)
    key = (m, h, ldx, ldr, x2d.dtype, weight.dtype, out2d.dtype, x2d.get_device(),
           not x2d.data_ptr() & 15, not weight.data_ptr() & 15, not out2d.data_ptr() & 15, not res.data_ptr() & 15,
           fp32_factor)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _make_plan(m, h, ldx, x2d.device, fp32_factor, ldr))
    if not plan.empty:
        # float(): an int eps would be specialised by Triton (1 becomes a constant), unlike the
        # fp32 argument the cached launch was compiled for.
        plan.launch(x2d, weight, out2d, res, *plan.scalars, float(eps), float(offset))
    return out2d


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"rms_norm: {name} has unsupported dtype {dtype}; expected float16, bfloat16 or float32")


def out_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype, fp32_factor: bool = False) -> torch.dtype:
    """The output dtype: x's with ``fp32_factor`` (the module rounds once to it), else torch's
    promotion of (weight, x), as Llama's ``weight * y`` promotes."""
    return x_dtype if fp32_factor else torch.promote_types(weight_dtype, x_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
             fp32_factor: bool = False, offset: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RMSNorm of x (..., H) with weight (H,): a tensor of x's shape and dtype
    :func:`out_dtype` (``out`` when given: contiguous, that shape, dtype and device); Llama's
    formula, or with ``fp32_factor`` Gemma's / OLMo 2's with factor ``offset + weight`` (the
    module docstring's; ``offset`` is ignored without it); plus ``residual`` (x's shape, the
    output dtype) where given. x and residual are read in
    place when the last dim has unit stride and the leading dims flatten to one row stride,
    else copied. Bad arguments raise TypeError/ValueError naming the argument."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rms_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1:
        raise ValueError("rms_norm: x must have at least 1 dimension (..., H), got a scalar")
    h = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != h:
        raise ValueError(f"rms_norm: weight must have shape ({h},) to match x's last dim (x shape "
                         f"{tuple(x.shape)}), got {tuple(weight.shape)}")
    _check_dtype("x", x.dtype)
    _check_dtype("weight", weight.dtype)
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device} but x is on {x.device}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        raise ValueError(f"rms_norm: x must be a CUDA tensor (or a CPU one under TRITON_INTERPRET=1), "
                         f"got one on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"rms_norm: eps must be a real number, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"rms_norm: eps must be finite and non-negative, got {eps!r}")
    if not isinstance(fp32_factor, bool):
        raise TypeError(f"rms_norm: fp32_factor must be a bool, got {type(fp32_factor).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real) or not math.isfinite(offset):
        raise TypeError(f"rms_norm: offset must be a finite real number, got {offset!r}")
    dtype = out_dtype(x.dtype, weight.dtype, fp32_factor)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"rms_norm: out must be a torch.Tensor or None, got {type(out).__name__}")
    elif out.dtype != dtype:
        why = "x's, with fp32_factor" if fp32_factor else f"torch's promotion of weight {weight.dtype} and x {x.dtype}"
        raise TypeError(f"rms_norm: out has dtype {out.dtype}, expected {dtype} ({why})")
    elif out.shape != x.shape or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"rms_norm: out must be a contiguous tensor of shape {tuple(x.shape)} on {x.device}, "
                         f"got {tuple(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}")
    r2d = None
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"rms_norm: residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape or residual.dtype != dtype or residual.device != x.device:
            raise ValueError(f"rms_norm: residual must have x's shape {tuple(x.shape)}, the output dtype {dtype} "
                             f"and x's device, got {tuple(residual.shape)} {residual.dtype} on {residual.device}")
        r2d = residual.reshape(-1, h)
        if h > 1 and r2d.stride(1) != 1:
            r2d = r2d.contiguous()
    if out.numel() == 0:
        return out
    x2d = x.reshape(-1, h)  # a view where the leading dims flatten to one row stride
    if h > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if x.is_cuda and x.get_device() != torch.cuda.current_device():
        with torch.cuda.device(x.device):  # the launch goes to the current device's stream
            run(x2d, w, out.view(-1, h), eps, fp32_factor, offset, r2d)
    else:
        run(x2d, w, out.view(-1, h), eps, fp32_factor, offset, r2d)
    return out
