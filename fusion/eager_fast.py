"""Eager fast paths of the attention projection (modules that own their weights).

Inference: cached raw launches (below). Training: :class:`QKVProjection` and
:class:`OutProjection`, one autograd node per projection, whose forward is the same cached
launch.

Why: a decode step's projections are host-bound. ``hybridgemm.linear`` already skips the
dispatcher's decision for a repeated call signature, but it still builds a generic key, goes
through Triton's or the cuBLASLt plan's Python, and the attention path then needs three view
ops to cut ``q``, ``k``, ``v`` out of the result. A module that knows its own layout can do
better: one key of its own, the kernel's raw launch with data pointers
(``dispatch.fused_linear_and_launch``), the output allocated directly in the layout the caller
returns (head-major views need one ``split``).

Validity: a cached launch is reused only for an identical key: the input's shape, strides,
dtype, device and pointer alignment class; the weight's and bias's data pointers, shapes,
strides and dtypes; torch's matmul math flag for the dtype; and ``dispatch.generation()``
(bumped when tables are reloaded or the dispatch mode changes). The launch takes the pointers
from the key, so a weight replaced or moved is a miss, never a stale read. Anything else
(autograd wanted, ``torch.compile``, autocast, tensor subclasses, CPU) takes the general path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridgemm import dispatch
from hybridgemm.kernels.bounded_cache import BoundedCache
from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES as _PLAIN
from hybridgemm.kernels.checks import flag_getter, operand_key

from . import backward

_C = torch._C
MAX_ENTRIES = 8  # per module: a few batch sizes / sequence lengths in a serving loop


def eligible(x, w: Tensor, b: Tensor | None) -> bool:
    """May this call take a cached raw launch? CUDA, plain tensors, no gradient wanted, not
    traced by torch.compile, no autocast."""
    if type(x) not in _PLAIN or type(w) not in _PLAIN or (b is not None and type(b) not in _PLAIN):
        return False
    if not x.is_cuda:
        return False
    if _C.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return False
    return not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cuda")


def eager_training(x, w: Tensor, b: Tensor | None) -> bool:
    """Does this call record autograd in plain eager mode (the fused one-node Functions of the
    attention projection)? Plain tensors, a gradient wanted, not traced by torch.compile (which
    keeps the custom ops), no autocast (``hybridgemm.linear`` casts under it)."""
    if type(x) not in _PLAIN or type(w) not in _PLAIN or (b is not None and type(b) not in _PLAIN):
        return False
    if not _C.is_grad_enabled() or not (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return False
    return (not torch.compiler.is_compiling() and not torch.is_autocast_enabled(x.device.type)
            and x.dtype == w.dtype and (b is None or b.dtype == x.dtype))


def signature(x: Tensor, w: Tensor, b: Tensor | None) -> tuple[tuple, int]:
    """``(key, x data pointer)``; see the module docstring for what the key covers. The weight
    and bias are keyed by their data pointers (``by_pointer``): the cached launch takes them
    from the cache entry."""
    xp = x.data_ptr()
    key = operand_key(x, xp, w, w.data_ptr(), b, None, 255, True)
    flag = flag_getter(key[2])  # x's dtype, already read
    return (key, dispatch.generation(), None if flag is None else flag()), xp


class LaunchCache(BoundedCache):
    """key -> (raw launch, weight pointer, bias pointer, output layout); the oldest entry goes
    first past :data:`MAX_ENTRIES` (stale generations simply stop matching)."""

    def __init__(self):
        super().__init__(MAX_ENTRIES)


def pointers(w: Tensor, b: Tensor | None) -> tuple[int, int]:
    return w.data_ptr(), (0 if b is None else b.data_ptr())


def head_views(y: Tensor, h: int, hkv: int, d: int):
    """``q, k, v`` (..., heads, S, D) views of a fused (..., S, (H+2Hkv)*D) GEMM output."""
    heads = y.view(*y.shape[:-1], h + 2 * hkv, d)  # splitting the last dim is always a view
    if y.requires_grad:
        # Split before transposing: the backward of the split is then one cat written
        # straight in y's (..., S, heads, D) layout, with no extra copy before the GEMMs.
        q, k, v = heads.split_with_sizes((h, hkv, hkv), dim=-2)
        return q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
    # No autograd: one transpose, then the split; the same views with fewer ops (host time
    # matters in decode).
    q, k, v = heads.transpose(-3, -2).split_with_sizes((h, hkv, hkv), dim=-3)
    return q, k, v


def qkv_launch(cache: LaunchCache, x: Tensor, w: Tensor, b: Tensor | None, h: int, hkv: int, d: int):
    """``q, k, v`` (no autograd) through the cached raw launch for x's signature, which writes
    straight into the head-major views: one allocation, one launch, one split. A miss runs
    the dispatcher's general path and caches its launch where it has one."""
    key, xp = signature(x, w, b)
    hit = cache.get(key)
    if hit is not None:
        raw, wp, bp, shape, stride = hit
        y = x.new_empty_strided(shape, stride)  # (..., H+2Hkv, S, D) over (..., S, H+2Hkv, D) memory
        raw(xp, wp, bp, y.data_ptr())
        return y.split_with_sizes((h, hkv, hkv), dim=-3)
    y, raw = dispatch.fused_linear_and_launch(x, w, b, None)
    if raw is not None:
        lead, s = tuple(x.shape[:-2]), x.shape[-2]
        ht = h + 2 * hkv
        strides = [s * ht * d]
        for size in reversed(lead[1:]):  # x's leading dims, row-major over (S, H+2Hkv, D) blocks
            strides.insert(0, strides[0] * size)
        layout = (lead + (ht, s, d), tuple(strides[:len(lead)]) + (d, ht * d, 1))
        cache.put(key, (raw, *pointers(w, b), *layout))
    return head_views(y, h, hkv, d)


def out_cached(cache: LaunchCache, attn: Tensor, w: Tensor, b: Tensor | None) -> Tensor | None:
    """The O projection of ``attn`` through its cached raw launch, or None on a miss."""
    key, ap = signature(attn, w, b)
    hit = cache.get(key)
    if hit is None:
        return None
    raw, wp, bp, shape = hit
    y = attn.new_empty(shape)
    raw(ap, wp, bp, y.data_ptr())
    return y


def out_bind(cache: LaunchCache, attn: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """The O projection of a validated ``attn`` (no autograd) through the general path, caching
    its launch when the flatten is a view (the launch then reads attn itself)."""
    # (..., H, S, D) -> (..., S, H*D): a view when attn is laid out (..., S, H, D) in memory
    # (SDPA's flash/cuDNN outputs are), else one copy inside the flatten.
    x = attn.transpose(-3, -2).flatten(-2)
    y, raw = dispatch.fused_linear_and_launch(x, w, b, None)
    if raw is not None and x.data_ptr() == attn.data_ptr():
        key, _ = signature(attn, w, b)
        cache.put(key, (raw, *pointers(w, b), tuple(y.shape)))
    return y


class QKVProjection(torch.autograd.Function):
    """Eager training: the fused QKV GEMM and its head views as ONE autograd node.

    Through ``linear`` + view/split/transpose, a step records six nodes (a Python one for
    the GEMM, five C++ ones for the views) and their backward: host time that made the
    4096-token training step host-bound on the H200 machine's CPU. Here the forward is the
    inference fast path (``cache``: the module's launches; None for the functional form),
    and the backward gets ``dq, dk, dv``, joins them with one ``cat`` straight into ``y``'s
    (..., S, H+2Hkv, D) layout (the kernel the split's backward runs too), and runs the dx
    and dW (+ fused bias gradient) GEMMs (``backward.linear_backward``)."""

    @staticmethod
    def forward(ctx, x, w, b, h, hkv, d, cache):
        if cache is not None:
            q, k, v = qkv_launch(cache, x, w, b, h, hkv, d)
        else:
            q, k, v = head_views(dispatch.fused_linear(x, w, b, None), h, hkv, d)
        ctx.save_for_backward(x if w.requires_grad else None, w if x.requires_grad else None)
        ctx.has_bias = b is not None
        ctx.qkv_shapes = (q.shape, k.shape, v.shape)  # for a gradient autograd leaves out
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, w = ctx.saved_tensors
        like = next(g for g in (dq, dk, dv) if g is not None)
        parts = [(g if g is not None else like.new_zeros(shape)).transpose(-3, -2)
                 for g, shape in zip((dq, dk, dv), ctx.qkv_shapes)]
        dy = torch.cat(parts, dim=-2).flatten(-2)  # (..., S, (H+2Hkv)*D), y's layout
        nx, nw, nb = ctx.needs_input_grad[:3]
        dx, dw, db = backward.linear_backward(dy, x, w, None, "none", (nx, nw, nb and ctx.has_bias))
        return dx, dw, db, None, None, None, None


class OutProjection(torch.autograd.Function):
    """Eager training: the O projection of an (..., H, S, D) attention output as one node
    (the transpose/flatten views folded in; see :class:`QKVProjection`)."""

    @staticmethod
    def forward(ctx, attn, w, b, cache):
        if cache is None:
            y = dispatch.fused_linear(attn.transpose(-3, -2).flatten(-2), w, b, None)
        else:
            y = out_cached(cache, attn, w, b)
            y = out_bind(cache, attn, w, b) if y is None else y
        ctx.save_for_backward(attn if w.requires_grad else None, w if attn.requires_grad else None)
        ctx.has_bias = b is not None
        ctx.attn_shape = attn.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        attn, w = ctx.saved_tensors
        x = attn.transpose(-3, -2).flatten(-2) if attn is not None else None
        nx, nw, nb = ctx.needs_input_grad[:3]
        dx, dw, db = backward.linear_backward(dy, x, w, None, "none", (nx, nw, nb and ctx.has_bias))
        if dx is not None:
            *lead, h, s, d = ctx.attn_shape
            dx = dx.view(*lead, s, h, d).transpose(-3, -2)
        return dx, dw, db, None


__all__ = ["LaunchCache", "OutProjection", "QKVProjection", "eager_training", "eligible", "head_views",
           "out_bind", "out_cached", "pointers", "qkv_launch", "signature"]
