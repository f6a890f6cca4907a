"""An FP8 weight dequantized to bf16/fp16 in one pass (read the e4m3 bytes and their scales,
write the result once): the weight of an FP8 call that runs a bf16/fp16 GEMM instead of an
FP8 kernel (fusion/fp8_linear.py, past the rows the FP8 kernels serve). The same values as
kernels/fp8.py ``dequantize``, bit for bit: each e4m3 value is exact in bf16/fp16 and fp32,
is multiplied by its fp32 scale in fp32 and rounded once to the dtype. Where torch's
``dequantize`` makes an fp32 copy of the weight and multiplies it (several kernels, three
passes over an fp32 tensor), this reads 1 byte and writes 2 per value.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .fp8 import BLOCK
from .triton_e4m3 import integer_conversion, tl_weight_values

BLOCK_N, BLOCK_K = 32, 128  # a tile of whole 128-byte rows of W; a 128 x 128 scale block spans 4 tiles
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s, stride_o,
                       BN: tl.constexpr, BK: tl.constexpr, PER_BLOCK: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                       OUT_DTYPE: tl.constexpr, INTEGER: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=mask, other=0.0)
    v = tl_weight_values(w, OUT_DTYPE, INTEGER).to(tl.float32)
    if PER_BLOCK:
        s = tl.load(s_ptr + (rn // SCALE_BLOCK)[:, None] * stride_s + (rk // SCALE_BLOCK)[None, :], mask=mask,
                    other=0.0)
    else:
        s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)[:, None]
    tl.store(out_ptr + rn[:, None] * stride_o + rk[None, :], (v * s).to(OUT_DTYPE), mask=mask)


def dequantize(data: torch.Tensor, scale: torch.Tensor, granularity: str, dtype: torch.dtype) -> torch.Tensor:
    """``data`` (N, K) e4m3, rows contiguous, with ``scale`` as the kernels read it
    (kernels/fp8.py ``scale_vector``: (N,) per channel, (N/128, K/128) per block) as a new
    (N, K) tensor of ``dtype`` (bf16 or fp16) on the same CUDA device."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"triton_dequant.dequantize: dtype must be bfloat16 or float16, got {dtype}")
    if data.dim() != 2 or data.stride(1) != 1:
        raise ValueError("triton_dequant.dequantize: data must be 2-D with contiguous rows")
    n, k = data.shape
    out = torch.empty((n, k), dtype=dtype, device=data.device)
    if n == 0 or k == 0:
        return out
    per_block = granularity == "block128"
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
    with torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext():
        _dequantize_kernel[grid](data, scale, out, n, k, data.stride(0), scale.stride(0) if per_block else 0,
                                 out.stride(0), BN=BLOCK_N, BK=BLOCK_K, PER_BLOCK=per_block, SCALE_BLOCK=BLOCK,
                                 OUT_DTYPE=_TL_DTYPES[dtype], INTEGER=integer_conversion(dtype), num_warps=4)
    return out


__all__ = ["dequantize"]
