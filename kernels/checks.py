"""Argument checks and operand normalisation shared by every entry point.

Errors name the problem (which argument, its shape/dtype/device, what was expected), so a
bad call fails at the boundary with a message a user can act on, never inside a kernel.
"""

from __future__ import annotations

import math

import torch

from .problem import DTYPE_NAMES

# The tensor types the eager fast paths take as they are (``type(t) in PLAIN_TENSOR_TYPES``, an
# exact type test): anything else, a subclass such as a FakeTensor or DTensor, goes through
# the general path, whose torch ops dispatch on it.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class LinearArgumentError(RuntimeError):
    """Arguments that ``F.linear``'s rules refuse: a shape, dtype or device. A RuntimeError,
    as ``F.linear``'s own errors for these are, so code that catches those catches this; the
    message names the argument and what was expected. (An argument that is not a tensor is a
    TypeError, again as in ``F.linear``.)"""


def _check_operands(x, weight, bias, who: str, vector_weight: bool) -> None:
    """What every form of a linear call needs: tensors; x at least 1-D and weight 2-D (or 1-D
    where ``vector_weight``), with as many input features; one dtype, one device. The bias's
    shape is the caller's to check."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{who}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if x.dim() < 1:
        raise LinearArgumentError(f"{who}: x must have at least 1 dimension (..., in_features), got a scalar")
    if weight.dim() != 2 and not (vector_weight and weight.dim() == 1):
        either = " or 1-D (in_features,)" if vector_weight else ""
        raise LinearArgumentError(f"{who}: weight must be 2-D (out_features, in_features){either}, "
                                  f"got shape {tuple(weight.shape)}")
    k = weight.shape[-1]
    if x.shape[-1] != k:
        raise LinearArgumentError(f"{who}: x has {x.shape[-1]} input features (shape {tuple(x.shape)}) but "
                                  f"weight expects {k} (shape {tuple(weight.shape)})")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        got = f"x={x.dtype}, weight={weight.dtype}" + (f", bias={bias.dtype}" if bias is not None else "")
        raise LinearArgumentError(f"{who}: x, weight and bias must share one dtype, got {got}")
    devices = {x.device, weight.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        got = f"x={x.device}, weight={weight.device}" + (f", bias={bias.device}" if bias is not None else "")
        raise LinearArgumentError(f"{who}: x, weight and bias must be on one device, got {got}")


def _bias_length_error(who: str, n: int, bias) -> LinearArgumentError:
    return LinearArgumentError(f"{who}: bias must have shape ({n},) to match weight's {n} out_features, "
                               f"got {tuple(bias.shape)}")


def check_linear_args(x, weight, bias, who: str = "linear") -> None:
    """The operands a kernel takes, under ``F.linear``'s rules: x (..., K), weight (N, K), bias
    (N,) or None; one dtype, one device. (:func:`linear_operands` brings ``F.linear``'s other
    forms to this one.)"""
    _check_operands(x, weight, bias, who, vector_weight=False)
    n = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise _bias_length_error(who, n, bias)


def kernel_form(weight, bias) -> bool:
    """Is a call in the form every kernel takes, weight (N, K) and bias (N,) or None? Shapes
    only (:func:`check_linear_args` checks the rest); tensors assumed."""
    return weight.dim() == 2 and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]))


def linear_operands(x, weight, bias, who: str):
    """``F.linear(input, weight, bias)``'s arguments in the form the kernels take, checked:
    ``(x, weight (N, K), bias (N,) or None, squeeze)``, whose product (..., N) is the call's
    result, with its last dim dropped where ``squeeze`` (a 1-D weight (K,): F.linear's result
    is then (...)). The views keep autograd's path to the caller's tensors.

    A bias that holds one value per output feature in a shape F.linear broadcasts over the
    input the same way whatever its layout ((), (1,), and with an input of 2+ dims (1, 1) and
    (1, N)) becomes that (N,) vector. None where only F.linear's own broadcasting says what
    the call means (another bias shape; any bias with a 1-D weight, or a 2-D+ bias with a 1-D
    input, where F.linear's answer depends on the input's dims and layout): the caller runs
    F.linear itself. Raises :class:`LinearArgumentError` (TypeError for a non-tensor) on
    what F.linear refuses whatever the layout: a scalar input, a weight of 0 or 3+ dims, a
    feature count mismatch, mixed dtypes or devices, a 1-D bias that is neither (N,) nor (1,),
    with a 2-D weight a bias that does not broadcast to the result's shape (..., N)."""
    _check_operands(x, weight, bias, who, vector_weight=True)
    squeeze = weight.dim() == 1
    if squeeze:
        if bias is not None:
            return None
        weight = weight.unsqueeze(0)
    if bias is None:
        return x, weight, None, squeeze
    n = weight.shape[0]
    if bias.dim() == 1 and bias.shape[0] == n:
        return x, weight, bias, squeeze
    if bias.dim() <= 1 and bias.numel() == 1:
        return x, weight, bias.reshape(()).expand(n), squeeze  # one value for every feature
    if bias.dim() == 1:
        raise _bias_length_error(who, n, bias)
    if x.dim() == 1:
        return None  # F.linear's rules for a 2-D bias with a 1-D input have exceptions: (1, N) yes, (1, 1) no
    if bias.shape == (1, 1):
        return x, weight, bias.reshape(()).expand(n), squeeze
    if bias.shape == (1, n):
        return x, weight, bias.reshape(n), squeeze
    out = (*x.shape[:-1], n)
    if bias.dim() > len(out) or any(b not in (1, o) for b, o in zip(reversed(bias.shape), reversed(out))):
        raise LinearArgumentError(f"{who}: bias of shape {tuple(bias.shape)} does not broadcast to the output's "
                                  f"shape {out} (a bias is ({n},), one value, or a shape that broadcasts so)")
    return None


def check_gpu_kernel_args(x, weight, bias, who: str) -> None:
    """What a GPU kernel needs beyond F.linear's rules: CUDA tensors of a supported dtype."""
    check_linear_args(x, weight, bias, who)
    if x.device.type != "cuda":
        raise ValueError(f"{who}: needs CUDA tensors, got {x.device} (use hybridgemm.linear, "
                         "which falls back to torch on the CPU)")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"{who}: dtype {x.dtype} is not supported (float16, bfloat16, float32)")


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """Flatten leading dims: (..., K) -> (M, K), a view where strides allow."""
    k = x.shape[-1]
    return x.reshape(math.prod(x.shape[:-1]), k)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (R, C) if it is row-major with unit column stride and non-overlapping rows
    (a row stride ≥ C, as after slicing columns), else a contiguous copy."""
    r, c = t.shape
    if t.stride(1) == 1 and (r <= 1 or t.stride(0) >= c):
        return t
    return t.contiguous()


def contiguous_bias(bias: torch.Tensor | None, min_align: int = 16) -> torch.Tensor | None:
    """Bias as a unit-stride vector whose address is ``min_align``-byte aligned (copied if not:
    N elements, negligible next to the GEMM; torch allocations are 512-byte aligned)."""
    if bias is None or (bias.stride(0) == 1 and bias.data_ptr() % min_align == 0):
        return bias
    out = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
    out.copy_(bias)
    return out


def flat_row_stride(x: torch.Tensor) -> int | None:
    """The row stride with which x (..., K) reads as an (M, K) row-major matrix without a
    copy, or None when no single stride does. Dims of size 1 are skipped (their strides are
    arbitrary: attention's (B, H, 1, D) output transposed and flattened for the O projection
    is (B, 1, H*D) with a meaningless stride on the 1); with no row dim above 1 it is K."""
    if x.dim() == 0:
        return None
    k = x.shape[-1]
    if x.stride(-1) != 1 and k > 1:
        return None
    ld = expect = None
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 0:
            return k  # no rows at all
        if size == 1:
            continue
        if ld is None:
            if stride < k:
                return None  # rows would overlap
            ld, expect = stride, stride * size
        elif stride != expect:
            return None
        else:
            expect *= size
    return k if ld is None else ld


def rows_are_flat(x: torch.Tensor) -> bool:
    """Can x (..., K) be read as an (M, K) row-major matrix with one row stride, no copy?"""
    return flat_row_stride(x) is not None


_C = torch._C

# The math flag a cached decision for each dtype depends on: TF32 for fp32 (the compute type of
# cuBLASLt and Triton's dot precision), torch's reduced-precision reduction switch for bf16 and
# fp16 (cuBLASLt's reduction scheme). One flag read per call instead of three.
MATH_FLAG = {torch.float32: _C._get_cublas_allow_tf32,
             torch.bfloat16: _C._get_cublas_allow_bf16_reduced_precision_reduction,
             torch.float16: _C._get_cublas_allow_fp16_reduced_precision_reduction}
# A dtype's flag getter (None for other dtypes): MATH_FLAG.get bound once, one attribute lookup
# less per call on the fast paths.
flag_getter = MATH_FLAG.get


def operand_key(x, xp: int, w, wp: int, b, out=None, mask: int = 255, by_pointer: bool = False) -> tuple:
    """The operand part of every cached-decision key (fast paths and plan caches), as a tuple:
    for x, the weight w, the bias b (None without one) and ``out`` (when given), the shape,
    strides, dtype, device index and a pointer class.

    ``xp`` and ``wp`` are x's and w's data pointers, which callers need anyway. The pointer
    class of x, w and out is the residue ``ptr & mask``: ``255`` for the alignment class up to
    256 bytes (what cuBLASLt's heuristics see), ``15`` for the 16-byte alignment Triton
    specialises on and TMA needs; the bias's is its residue mod 16 (every kernel takes a
    16-byte aligned bias). ``by_pointer``: w and b are keyed by their whole data pointers
    instead (for launches that bake those addresses in); a whole pointer also names the
    device (one address space under UVA), so theirs is left out. About 1 µs on the fast paths:
    one tuple, one branch."""
    if by_pointer:
        return (x.shape, x.stride(), x.dtype, x.get_device(), xp & mask, w.shape, w.stride(), w.dtype, wp,
                None if b is None else (b.shape, b.stride(), b.dtype, b.data_ptr()))
    key = (x.shape, x.stride(), x.dtype, x.get_device(), xp & mask,
           w.shape, w.stride(), w.dtype, w.get_device(), wp & mask,
           None if b is None else (b.shape, b.stride(), b.dtype, b.get_device(), b.data_ptr() & 15))
    if out is None:
        return key
    return key + (out.shape, out.stride(), out.dtype, out.get_device(), out.data_ptr() & mask)


def call_signature(x, weight, bias, activation) -> tuple[tuple, int, int]:
    """Everything a cached launch decision of ``linear(x, weight, bias, activation)`` depends
    on, as a hashable tuple (plus the x and W data pointers, which the caller needs anyway):
    :func:`operand_key` (pointer residues mod 256 for x and W, mod 16 for the bias), the
    activation, and torch's matmul math flag for the dtype (:data:`MATH_FLAG`). The key of the
    fast paths."""
    xp, wp = x.data_ptr(), weight.data_ptr()
    key = operand_key(x, xp, weight, wp, bias)
    flag = flag_getter(key[2])  # x's dtype, already read
    return (key, activation, None if flag is None else flag()), xp, wp
