"""Q/K norms over all heads, the rotary embedding and the KV-cache write of a decode step, in one
Triton launch (OLMo 2's attention after its Q/K/V projection; without the norms, StableLM's,
Cohere's, GPT-NeoX's and Falcon's where their Q/K/V GEMM's epilogue does not take them:
fusion/models/fused_pieces.py ``rope_qkv``).

OLMo 2 normalises q and k over all their columns (an RMSNorm of width ``heads * head_dim``,
before the head views), which a split-K tile of one head cannot compute in its epilogue
(kernels/triton_rope.py handles norms per head). What the stock attention then runs per token
is two norms (eight torch ops each, or one launch each patched), the rotary embedding of q and
k (about six ops each), ``index_copy_`` of k and v into the cache and the views in between: in
eager decode about twenty host dispatches on a few KB of data. This kernel computes the same
from the projection ``y`` ``[M, (heads + 2 * kv_heads) * head_dim]`` (M = B x S tokens,
batch-major), per token::

    q = ((y_q * rsqrt(mean(y_q²) + eps_q)) * (offset_q + g_q)).to(dtype)     # fp32, rounded once
    q = (q * cos + rotate_half(q) * sin).to(dtype)                           # per head
    k = the same with its own norm;  keys[b, :, base + s] = k;  values[b, :, base + s] = y_v

and returns the rotated q ``[M, heads * head_dim]``. The norm is the fp32-factor formula of
kernels/triton_rmsnorm.py (``fp32_factor=True``). The rotary follows Hugging Face's
``apply_rotary_pos_emb``: with fp32 cos/sin (OLMo 2's) the products and their sum in fp32,
rounded once; with cos/sin of the data's dtype each product and the sum rounded to it, as
torch's 16-bit ops round. ``rotate_half`` pairs column ``c`` of a head with column
``c ± head_dim / 2``: the kernel loads the partner column from memory (the row is a few KB,
read from L2) instead of shuffling registers. A token whose position ``base + s`` is outside
``[0, L)`` writes nothing and its q row is NaN (stock's ``index_copy_`` raises a device assert
there), as the rotary epilogue does. Without norms (``q_norm = k_norm = None``) q and k are
rotated as the projection left them. cos/sin of ``R < head_dim`` columns (a partial rotary:
StableLM's, GPT-NeoX's ``rotary_ndims``) rotate the first R columns of each head, pairing ``c``
with ``c ± R / 2``, and pass the others through unchanged, as the stock slice, rotate and
``torch.cat`` do. ``pairs`` (Cohere's rotary) pairs column ``2i`` with ``2i + 1`` instead (its
``rotate_half`` interleaves) and rotates in fp32, as its function does. ``group`` reads y's
columns grouped per KV head, ``[q x group | k | v]``: GPT-NeoX's ``query_key_value`` (``[q | k |
v]`` per head, group 1) and Falcon's new architecture's.

Grid ``(M, 3)``: per token one program for q, one for k, one for v. Inference only.

:func:`rope_qk` is the rotary alone (no norms, no cache), for layers whose cache layer writes
its own way (a sliding window's roll, a dynamic cache's concatenation): grid ``(M, 2)``, q and
k rotated into tensors of their own, about twelve torch ops of the stock rotary in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bounded_cache import BoundedCache
from .triton_config import next_pow2
from .triton_launch import Launcher
from .triton_plan import TritonPlan

__all__ = ["PLAN_CACHE_SIZE", "check", "check_rope", "qk_norm_rope_store", "rope_qk"]

PLAN_CACHE_SIZE = 1024
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _normed_rotated(row_ptr, w_ptr, cos_row, sin_row, idx, mask, inv_n, eps, offset, HD: tl.constexpr,
                    ROUND_EACH: tl.constexpr, NORM: tl.constexpr, ROT: tl.constexpr, PAIRS: tl.constexpr,
                    QG: tl.constexpr, GROUP: tl.constexpr):
    """Columns ``idx`` of the row at ``row_ptr`` (heads in groups of ``QG``, ``GROUP`` columns
    apart: head ``h``'s columns start at ``(h // QG) * GROUP + (h % QG) * HD``) normalised over
    the row (``mask``: its columns),
    scaled by ``offset + w`` in fp32, rounded to the row's dtype (without ``NORM``: as they are),
    then rotated per head over its first ``ROT`` columns (the rest passed as they are), column
    ``c`` paired with ``c ± ROT / 2`` (``PAIRS``: with its neighbour ``c ± 1``, ``c`` even first,
    Cohere's); fp32 values of the dtype's rounding before the last one."""
    dt = row_ptr.dtype.element_ty
    c = idx % HD
    rotated = c < ROT
    if PAIRS:
        lower = c % 2 == 0
        partner = tl.where(lower, idx + 1, idx - 1)
    else:
        lower = c < ROT // 2
        partner = tl.where(lower, idx + ROT // 2, idx - ROT // 2)
    spread = (idx // HD // QG) * (GROUP - QG * HD)  # (the partner is in the same head)
    n = tl.load(row_ptr + spread + idx, mask=mask, other=0.0).to(tl.float32)
    rot = tl.load(row_ptr + spread + partner, mask=mask & rotated, other=0.0).to(tl.float32)
    if NORM:
        # tl.math.rsqrt, the fp32 sum times fp32(1/N): triton_rmsnorm's formula
        rstd = tl.math.rsqrt(tl.sum(n * n, axis=0) * inv_n + eps)
        g = offset + tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        gp = offset + tl.load(w_ptr + partner, mask=mask & rotated, other=0.0).to(tl.float32)
        n = ((n * rstd) * g).to(dt).to(tl.float32)
        rot = ((rot * rstd) * gp).to(dt).to(tl.float32)
    rot = tl.where(lower, -rot, rot)
    cos = tl.load(cos_row + c, mask=mask & rotated, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + c, mask=mask & rotated, other=0.0).to(tl.float32)
    if ROUND_EACH:  # 16-bit cos/sin: torch rounds each product and the sum
        out = (n * cos).to(dt).to(tl.float32) + (rot * sin).to(dt).to(tl.float32)
    else:
        out = n * cos + rot * sin
    return tl.where(rotated, out, n)


@triton.jit
def _qk_norm_rope_store_kernel(y_ptr, qg_ptr, kg_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, base_ptr, q_ptr,
                               seq, ldy, q_cols, kv_cols, k_at, v_at, cs_b, cs_s, kc_b, kc_h, kc_s, vc_b, vc_h,
                               vc_s, cache_len, inv_q, inv_k, q_eps, k_eps, q_offset, k_offset, QB: tl.constexpr,
                               KB: tl.constexpr,
                               HD: tl.constexpr, ROUND_EACH: tl.constexpr, NORM: tl.constexpr, ROT: tl.constexpr,
                               PAIRS: tl.constexpr, QG: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b = row // seq
    s = row % seq
    pos = tl.load(base_ptr) + s
    in_cache = (pos >= 0) & (pos < cache_len)
    y_row = y_ptr + row * ldy
    cs = b * cs_b + s * cs_s
    dt = y_ptr.dtype.element_ty
    # y's columns in groups of GROUP, one per KV head: group g holds QG q heads, then k head g at
    # k_at + g * GROUP and v head g at v_at + g * GROUP. All q, then all k, then all v: QG = 1,
    # GROUP = HD (k_at, v_at after the q columns); GPT-NeoX's [q | k | v] per head: QG = 1,
    # GROUP = 3 * HD; Falcon's new architecture: QG = heads / kv_heads, GROUP = (QG + 2) * HD
    # (each branch names its own index and mask: the compiler types a name once across branches)
    if part == 0:
        qi = tl.arange(0, QB)
        q_mask = qi < q_cols
        q = _normed_rotated(y_row, qg_ptr, cos_ptr + cs, sin_ptr + cs, qi, q_mask, inv_q, q_eps, q_offset, HD,
                            ROUND_EACH, NORM, ROT, PAIRS, QG, GROUP)
        q = tl.where(in_cache, q, float("nan"))
        tl.store(q_ptr + row * q_cols + qi, q.to(dt), mask=q_mask)
    else:
        ki = tl.arange(0, KB)
        kv_mask = ki < kv_cols
        head = ki // HD
        c = ki % HD
        kpos = pos + tl.zeros([KB], dtype=tl.int64)  # a block: Triton 3.9's interpreter takes no scalar in a mask
        ok = kv_mask & (kpos >= 0) & (kpos < cache_len)
        if part == 1:
            k = _normed_rotated(y_row + k_at, kg_ptr, cos_ptr + cs, sin_ptr + cs, ki, kv_mask, inv_k, k_eps,
                                k_offset, HD, ROUND_EACH, NORM, ROT, PAIRS, 1, GROUP)
            tl.store(kc_ptr + b * kc_b + pos * kc_s + head * kc_h + c, k.to(dt), mask=ok)
        else:
            v = tl.load(y_row + v_at + head * (GROUP - HD) + ki, mask=kv_mask, other=0.0)
            tl.store(vc_ptr + b * vc_b + pos * vc_s + head * vc_h + c, v, mask=ok)


@triton.jit
def _qk_rope_kernel(y_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, seq, ldy, q_cols, kv_cols, cs_b, cs_s,
                    QB: tl.constexpr, KB: tl.constexpr, HD: tl.constexpr, ROUND_EACH: tl.constexpr,
                    ROT: tl.constexpr, PAIRS: tl.constexpr):
    # the rotary alone: program (token, 0) rotates the token's q columns, (token, 1) its k columns
    row = tl.program_id(0).to(tl.int64)
    b = row // seq
    s = row % seq
    y_row = y_ptr + row * ldy
    cs = b * cs_b + s * cs_s
    dt = y_ptr.dtype.element_ty
    if tl.program_id(1) == 0:
        qi = tl.arange(0, QB)
        q_mask = qi < q_cols
        q = _normed_rotated(y_row, y_ptr, cos_ptr + cs, sin_ptr + cs, qi, q_mask, 0.0, 0.0, 0.0, HD, ROUND_EACH,
                            False, ROT, PAIRS, 1, HD)
        tl.store(q_ptr + row * q_cols + qi, q.to(dt), mask=q_mask)
    else:
        ki = tl.arange(0, KB)
        k_mask = ki < kv_cols
        k = _normed_rotated(y_row + q_cols, y_ptr, cos_ptr + cs, sin_ptr + cs, ki, k_mask, 0.0, 0.0, 0.0, HD,
                            ROUND_EACH, False, ROT, PAIRS, 1, HD)
        tl.store(k_ptr + row * kv_cols + ki, k.to(dt), mask=k_mask)


def _why_not_rows(y: torch.Tensor) -> str | None:
    if y.dim() != 3 or y.dtype not in _FLOATS or y.stride(-1) != 1 or (y.shape[1] > 1 and y.stride(0) != y.shape[1]
                                                                      * y.stride(1)):
        return "y must be [B, S, N] of fp16/bf16/fp32 with rows that flatten"
    return None


def _why_not_cos(cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor, hd: int, fp32: bool) -> str | None:
    """cos/sin ``[B or 1, S, R]`` alike (R even, at most ``hd``: the first R columns of each head
    rotated), unit last stride, of y's dtype (or fp32 where ``fp32``)."""
    b, s = y.shape[:2]
    dtypes = (y.dtype, torch.float32) if fp32 else (y.dtype,)
    if cos.dim() != 3 or cos.shape != sin.shape or cos.stride() != sin.stride() or cos.shape[1] != s \
            or cos.shape[0] not in (1, b) or not 2 <= cos.shape[2] <= hd or cos.shape[2] % 2 or cos.stride(-1) != 1 \
            or cos.dtype not in dtypes or sin.dtype != cos.dtype:
        return f"cos/sin must be [B or 1, S, R] (R even, at most {hd} columns) with a unit last stride, of y's " \
               f"dtype{' or fp32' if fp32 else ''}"
    return None


def _row_stride(y: torch.Tensor) -> int:
    """y's token-row stride (one row's is never read: one plan for all)."""
    b, s, n = y.shape
    return n if b * s == 1 else y.stride(1) if s > 1 else y.stride(0)


def _meta(q_cols: int, kv_cols: int, hd: int, round_each: bool, rot: int, pairs: bool) -> dict:
    widest = max(q_cols, kv_cols)
    # no FMA: the products and sums round where torch's ops round (kernels/triton_rmsnorm.py says why)
    return dict(QB=next_pow2(q_cols), KB=next_pow2(kv_cols), HD=hd, ROUND_EACH=round_each, ROT=rot, PAIRS=pairs,
                num_warps=4 if widest <= 1024 else 8 if widest <= 4096 else 16, enable_fp_fusion=False)


def check(y: torch.Tensor, q_norm: tuple | None, k_norm: tuple | None, cos: torch.Tensor, sin: torch.Tensor,
          keys: torch.Tensor, values: torch.Tensor, base: torch.Tensor, heads: int,
          group: int = 0) -> str | None:
    """Why :func:`qk_norm_rope_store` cannot take these operands (None: it can). ``y`` [B, S, N]
    with a unit last stride and rows that flatten; ``q_norm``/``k_norm`` ``(g, eps, offset)``
    with g contiguous [heads * hd] / [kv_heads * hd], or both None; cos/sin [B or 1, S, R] (R
    even, at most hd) with a unit last stride, y's dtype or fp32; keys/values
    [B, kv_heads, L, hd] contiguous, y's dtype; ``base`` an int64 scalar; all on one device;
    ``group`` (y's columns grouped per KV head, :func:`qk_norm_rope_store`): heads =
    ``group`` x kv_heads."""
    why = _why_not_rows(y)
    if why is not None:
        return why
    b, _, n = y.shape
    if keys.dim() != 4 or keys.shape[0] != b or values.shape != keys.shape or keys.dtype != y.dtype \
            or values.dtype != y.dtype or not keys.is_contiguous() or not values.is_contiguous():
        return "keys/values must be contiguous [B, kv_heads, L, head_dim] of y's dtype"
    kv_heads, hd = keys.shape[1], keys.shape[3]
    if hd % 2 or not isinstance(heads, int) or heads < 1 or n != (heads + 2 * kv_heads) * hd:
        return f"y's {n} columns are not (heads + 2 * kv_heads) * head_dim with an even head_dim"
    if group and (not isinstance(group, int) or group < 0 or heads != group * kv_heads):
        return f"columns grouped per KV head ([q x {group} | k | v]) need {group} x {kv_heads} heads (got {heads})"
    if (q_norm is None) != (k_norm is None):
        return "q_norm and k_norm go together (both or neither)"
    for name, (g, eps, offset), width in (("q_norm", q_norm, heads * hd),
                                          ("k_norm", k_norm, kv_heads * hd)) if q_norm is not None else ():
        if g.shape != (width,) or not g.is_contiguous() or g.dtype not in _FLOATS or g.device != y.device:
            return f"{name} must be a contiguous [{width}] float tensor on y's device"
        if not (0 <= float(eps) < float("inf")) or not abs(float(offset or 0.0)) < float("inf"):
            return f"{name}'s eps and offset must be finite"
    why = _why_not_cos(cos, sin, y, hd, fp32=True)
    if why is not None:
        return why
    if base.numel() != 1 or base.dtype != torch.int64:
        return "base must be one int64 element"
    if any(t.device != y.device for t in (cos, sin, keys, values, base)):
        return "all operands must be on y's device"
    return None


def _make_plan(m: int, q_cols: int, kv_cols: int, hd: int, device: torch.device, round_each: bool, norm: bool,
               rot: int, pairs: bool, group: int) -> TritonPlan:
    # 1 / N as fp32 arguments: the mean as torch's CUDA mean computes it (triton_rmsnorm)
    meta = dict(_meta(q_cols, kv_cols, hd, round_each, rot, pairs), NORM=norm, QG=max(group, 1),
                GROUP=(group + 2) * hd if group else hd)
    return TritonPlan(device, Launcher(_qk_norm_rope_store_kernel, (m, 3), meta), scalars=(1.0 / q_cols, 1.0 / kv_cols))


# Plans by everything the compiled kernel is specialised on: every integer argument (Triton
# specialises ints on their value 1 and on divisibility by 16), dtypes, device, the pointers'
# 16-byte alignment.
_PLANS = BoundedCache(PLAN_CACHE_SIZE)


def qk_norm_rope_store(y: torch.Tensor, q_norm: tuple | None, k_norm: tuple | None, cos: torch.Tensor,
                       sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, base: torch.Tensor,
                       heads: int, pairs: bool = False, group: int = 0) -> torch.Tensor:
    """The rotated q ``[B, S, heads * hd]`` of the module docstring's computation, with k and v
    written into ``keys``/``values``; operands as :func:`check` accepts them (unchecked here:
    the caller checks once), ``q_norm``/``k_norm`` ``(g, eps, offset)`` (offset None: 0), or
    both None: q and k rotated as they are. cos/sin of R < hd columns rotate the first R
    columns of each head and pass the rest (StableLM's partial rotary). ``pairs``: Cohere's
    rotary, which pairs neighbouring columns (``2i``, ``2i + 1``) and rotates in fp32 whatever
    cos's dtype (its function rotates fp32 copies of q and k), rounding once. ``group``: y's
    columns are grouped per KV head, ``[q x group | k | v]`` (1: GPT-NeoX's ``query_key_value``,
    ``[q | k | v]`` per head; heads / kv_heads: Falcon's new architecture); 0: all q, all k,
    all v."""
    b, s, _ = y.shape
    kv_heads, cache_len, hd = keys.shape[1:]
    q_cols, kv_cols = heads * hd, kv_heads * hd
    m = b * s
    out = torch.empty((b, s, q_cols), dtype=y.dtype, device=y.device)
    if m == 0:
        return out
    norm = q_norm is not None
    (qg, q_eps, q_off), (kg, k_eps, k_off) = (q_norm, k_norm) if norm else ((y, 0.0, 0.0),) * 2
    rot = cos.shape[-1]
    cs_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    ldy = _row_stride(y)
    k_at, v_at = (group * hd, (group + 1) * hd) if group else (q_cols, q_cols + kv_cols)
    ints = (s, ldy, q_cols, kv_cols, k_at, v_at, cs_b, cos.stride(1), *keys.stride()[:3], *values.stride()[:3],
            cache_len)
    ptrs = (y, qg, kg, cos, sin, keys, values, base, out)
    round_each = cos.dtype != torch.float32 and not pairs
    key = (m, ints, y.dtype, qg.dtype, kg.dtype, cos.dtype, y.get_device(), round_each, norm, rot, pairs, group,
           tuple(not t.data_ptr() & 15 for t in ptrs))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _make_plan(m, q_cols, kv_cols, hd, y.device, round_each, norm, rot, pairs, group))
    plan.launch(*ptrs, *ints, *plan.scalars, float(q_eps), float(k_eps), float(q_off or 0.0), float(k_off or 0.0))
    return out


def check_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               fp32_cos: bool = False) -> str | None:
    """Why :func:`rope_qk` cannot take these operands (None: it can): ``y`` [B, S, N] as
    :func:`check` takes it, N = (heads + 2 * kv_heads) * hd with hd even, cos/sin
    [B or 1, S, R] (R even, at most hd) of y's dtype (or fp32 where ``fp32_cos``: rotated in fp32,
    rounded once) with a unit last stride, on y's device."""
    why = _why_not_rows(y)
    if why is not None:
        return why
    n = y.shape[2]
    counts = isinstance(heads, int) and isinstance(kv_heads, int) and heads > 0 and kv_heads > 0
    hd = n // (heads + 2 * kv_heads) if counts else 0
    if hd < 2 or hd % 2 or n != (heads + 2 * kv_heads) * hd:
        return f"y's {n} columns are not (heads + 2 * kv_heads) * head_dim with an even head_dim"
    why = _why_not_cos(cos, sin, y, hd, fp32=fp32_cos)
    if why is not None:
        return why
    if cos.device != y.device or sin.device != y.device:
        return "all operands must be on y's device"
    return None


def rope_qk(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
            pairs: bool = False, fp32_pairs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's rotary embedding of the q and k columns of the Q/K/V projection ``y``
    ``[B, S, N]`` (per head; cos/sin of y's dtype: each product and the sum rounded as torch's
    16-bit ops round; fp32 cos/sin: in fp32, rounded once; cos/sin of R < hd columns: the first
    R columns of each head, the rest as they are; ``pairs``: neighbouring columns paired, rotated in
    fp32 and rounded once as Cohere's function does, as :func:`qk_norm_rope_store` says (fp32
    cos/sin: Ernie 4.5's), or with ``fp32_pairs`` False rounded as the standard rotary, GLM's and
    Helium's functions), in one launch:
    ``(q [B, S, heads * hd], k [B, S, kv_heads * hd])``; operands as :func:`check_rope` accepts
    them (unchecked here)."""
    b, s, n = y.shape
    hd, rot = n // (heads + 2 * kv_heads), cos.shape[-1]
    q_cols, kv_cols = heads * hd, kv_heads * hd
    m = b * s
    q = torch.empty((b, s, q_cols), dtype=y.dtype, device=y.device)
    k = torch.empty((b, s, kv_cols), dtype=y.dtype, device=y.device)
    if m == 0:
        return q, k
    ldy = _row_stride(y)
    ints = (s, ldy, q_cols, kv_cols, 0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1))
    ptrs = (y, cos, sin, q, k)
    # (fp32 cos/sin: the rotary in fp32, rounded once, whatever the pairing)
    round_each = y.dtype != torch.float32 and cos.dtype != torch.float32 and not (pairs and fp32_pairs)
    key = ("rope", m, ints, hd, rot, pairs, round_each, y.dtype, cos.dtype, y.get_device(),
           tuple(not t.data_ptr() & 15 for t in ptrs))
    plan = _PLANS.get(key)
    if plan is None:
        meta = _meta(q_cols, kv_cols, hd, round_each, rot, pairs)
        plan = _PLANS.put(key, TritonPlan(y.device, Launcher(_qk_rope_kernel, (m, 2), meta)))
    plan.launch(*ptrs, *ints)
    return q, k
