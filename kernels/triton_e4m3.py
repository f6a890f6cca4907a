"""e4m3 weight values in registers, for the kernels that read FP8 weights (triton_splitk).

Triton's cast of an e4m3 tensor to bf16 is three conversion instructions per two values on
Hopper (``cvt.rn.f16x2.e4m3x2``, then ``cvt.bf16.f16`` twice). The conversion unit issues
16 of them per clock per SM, so a weight stream of 16 e4m3 bytes per clock per SM (the H200's
HBM bandwidth spread over its 132 SMs) cannot be converted that way. :func:`tl_e4m3_to_bf16`
does it with integer ops instead (byte permute, mask, shift; 2 per value) and one packed bf16
multiply per two values, all on units that issue 64-128 per clock:

    e4m3  s eeee mmm              (bias 7; subnormals at e = 0: m * 2**-9)
    bf16  s 0000eeee mmm0000      = the same bits, read with bf16's bias 127: value * 2**-120
    x 2**120 (bf16, exact)        = the e4m3 value, subnormals and zeros included

Exact for every finite e4m3 value: the result equals ``w.to(tl.bfloat16)`` bit for bit. The
NaN bytes (0x7f, 0xff) come out as -/+480 instead of NaN; FP8 weights are checked for them
when they are made or loaded (kernels/fp8.py check_fp8). Inline PTX does not run in Triton's
CPU interpreter: :func:`integer_conversion` says when a kernel may take this path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import interpreting

# Whether kernels convert e4m3 to bf16 with integer ops (tl_e4m3_to_bf16) where they can; False
# makes them use Triton's cast (the same values), which GPU tests compare against.
INTEGER_CONVERSION = True


def integer_conversion(dtype: torch.dtype) -> bool:
    """Can a kernel computing in ``dtype`` convert its e4m3 weight with :func:`tl_e4m3_to_bf16`?
    bf16 only (an fp16 cast is one conversion per two values already), and not in the
    interpreter (no inline PTX there)."""
    return INTEGER_CONVERSION and dtype == torch.bfloat16 and not interpreting()


@triton.jit
def tl_e4m3_to_bf16(w):
    """``w`` (uint8 tensor: e4m3 bytes) as bf16 values, four bytes per 32-bit register: the two
    high bytes of each 16-bit half are placed by ``prmt``, the sign set aside, the exponent and
    mantissa shifted into bf16's fields, the sign put back, and each pair multiplied by 2**120
    (``fma`` with -0 so that a zero keeps its sign)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a<2>, s<2>, k, z;
        prmt.b32 a0, 0, $2, 0x5140;
        prmt.b32 a1, 0, $2, 0x7362;
        shr.b32 a0, a0, 4;
        shr.b32 a1, a1, 4;
        and.b32 s0, a0, 0x08000800;
        and.b32 s1, a1, 0x08000800;
        mad.lo.u32 a0, s0, 15, a0;
        mad.lo.u32 a1, s1, 15, a1;
        mov.b32 k, 0x7b807b80;
        mov.b32 z, 0x80008000;
        fma.rn.bf16x2 $0, a0, k, z;
        fma.rn.bf16x2 $1, a1, k, z;
        }""",
        constraints="=r,=r,r",
        args=[w],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def tl_weight_values(w, dtype: tl.constexpr, INTEGER: tl.constexpr):
    """A loaded e4m3 weight tile as ``dtype`` values: with ``INTEGER`` (bf16 only; see
    :func:`integer_conversion`) by :func:`tl_e4m3_to_bf16`, else by Triton's cast."""
    if INTEGER:
        return tl_e4m3_to_bf16(w.to(tl.uint8, bitcast=True))
    else:
        return w.to(dtype)
