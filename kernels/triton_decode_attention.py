"""Attention of one new token per sequence over a static KV cache, in one launch.

At decode, after the Q/K/V projection has written the new keys and values into the cache,
stock runs: a mask kernel (the boolean mask turned into what the SDPA backend takes), GQA's
expansion of the cache (``repeat_kv``: a copy of every key and value per query head of a
group), the SDPA kernel (and a memset of its scratch), and the cache-length update. Each is
a few microseconds, and each kernel boundary costs about one more on the H200.
:func:`decode_attention` does all of it in one grid:

- a program takes one (sequence, KV head) pair and a span of cache positions; the query
  heads that share the KV head are the rows of its tiles (GQA without a copy), so the cache
  is read once;
- the boolean mask (True: attend), ``[B or 1, 1, 1, L]``, is read directly; a block of
  positions that it masks entirely is skipped, so a long static cache costs only the
  positions filled so far;
- spans of one pair are merged by the last of their programs to finish (an arrival
  counter: ``triton_scratch.tl_last_arrival``), in span order: the result does not depend on
  which finished last, bit for bit;
- with ``base``, one program adds ``step`` to it (transformers' ``cumulative_length += S``,
  which the Q/K/V kernel before it has already read).

Scores and the softmax are fp32 (exp2 with the scale folded in), the probabilities are
rounded to the cache's dtype for the product with V, as flash-attention kernels do. A query
row whose mask admits no position gives zeros, as PyTorch's math SDPA does (torch >= 2.5).

Gemma 2's form, which transformers computes in its eager attention function, is taken too:
logits soft-capped (``softcap * tanh(scores / softcap)``, tanh from exp2) and an additive
floating mask (transformers' eager mask: 0 where a position is attended, the dtype's minimum
where not), added after the cap. A position whose mask value is at or below
:func:`masked_at` (-1e30; float16's minimum for a float16 mask) counts as masked, for block
skipping and for a row's emptiness, as a boolean mask's False does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .bounded_cache import BoundedCache
from .process_memory import per_call
from .triton_config import INT32_LIMIT
from .triton_launch import Launcher, device_facts, pdl_enabled
from .triton_scratch import split_scratch, tl_last_arrival

_LOG2E = 1.4426950408889634
_BLOCK_T = 64  # cache positions per step of a program's loop
_BLOCK_T_WIDE = 32  # the same for heads of 256 (Gemma's): the K and V tiles' shared memory halved
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# query heads per KV head, the rows of a program's tiles: up to 64, and up to 128 for heads of at
# most 64 columns (Falcon-7B's multi-query: 71, in tiles of 128 rows on 8 warps). Offline sm_90
# SASS, bf16, 8 warps: 71 x 64 keeps no local memory at one span or four; 128 rows of heads of 128
# or 256 spill (2 and 6 local loads/stores at four spans)
_MAX_REP, _MAX_REP_NARROW, _NARROW_HEAD = 64, 128, 64


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, ws_ptr, cnt_ptr, base_ptr,
                             L, span, step, qk_scale, softcap, hide_at,
                             kv_heads, q_sb, k_sb, k_sh, k_st, v_sb, v_sh, v_st, m_sb, m_st, o_sb,
                             REP: tl.constexpr, RP: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                             BT: tl.constexpr,
                             HAS_MASK: tl.constexpr, ADD_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                             SPLITS: tl.constexpr, INC: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # the Q/K/V kernel before this one has written q and the cache
    pid_g = tl.program_id(0)  # (sequence, KV head)
    sp = tl.program_id(1)  # span of cache positions
    b = pid_g // kv_heads
    h = pid_g % kv_heads
    if INC:
        if pid_g == 0 and sp == 0:
            tl.store(base_ptr, tl.load(base_ptr) + step)
    rows = tl.arange(0, RP)
    cols = tl.arange(0, HDP)  # HD padded to a power of two (Phi-3's 96: 128); the padding is masked
    row_ok = rows < REP
    col_ok = cols < HD
    io_ok = row_ok[:, None] & col_ok[None, :]
    q = tl.load(q_ptr + b * q_sb + (h * REP + rows)[:, None] * HD + cols[None, :], mask=io_ok, other=0.0)
    k_base = k_ptr + b * k_sb + h * k_sh
    v_base = v_ptr + b * v_sb + h * v_sh
    m_i = tl.full((RP,), float("-inf"), tl.float32)
    l_i = tl.zeros((RP,), tl.float32)
    acc = tl.zeros((RP, HDP), tl.float32)
    t0 = sp * span
    t1 = tl.minimum(t0 + span, L)
    for t in range(t0, t1, BT):
        offs_t = t + tl.arange(0, BT)
        ok = offs_t < t1
        if HAS_MASK:
            if ADD_MASK:  # additive (in the scores' units), after the cap
                bias = tl.load(m_ptr + b * m_sb + offs_t * m_st, mask=ok, other=float("-inf")).to(tl.float32)
                ok = ok & (bias > hide_at)
            else:
                ok = ok & (tl.load(m_ptr + b * m_sb + offs_t * m_st, mask=ok, other=0) != 0)
        if tl.max(ok.to(tl.int32), axis=0) > 0:  # a block masked entirely is not read
            k = tl.load(k_base + offs_t[:, None] * k_st + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            if SOFTCAP or ADD_MASK:  # qk_scale is the plain scale here; log2(e) comes after the cap and the mask
                if SOFTCAP:  # softcap * tanh(s / softcap), tanh(u) = 1 - 2 / (exp(2u) + 1)
                    s = softcap * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0))
                if ADD_MASK:
                    s = s + bias[None, :]
                s = s * 1.4426950408889634
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            v = tl.load(v_base + offs_t[:, None] * v_st + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    if PDL:
        gdc_launch_dependents()
    o_ptrs = o_ptr + b * o_sb + (h * REP + rows)[:, None] * HD + cols[None, :]
    if SPLITS == 1:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # no position admitted (or a padding row): acc is 0
        tl.store(o_ptrs, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=io_ok)
    else:
        # this span's (acc, m, l) for rows < REP; the pair's last program merges them in span order
        part = REP * HD + 2 * REP
        pair_ws = ws_ptr + pid_g * SPLITS * part
        here = pair_ws + sp * part
        tl.store(here + rows[:, None] * HD + cols[None, :], acc, mask=io_ok)
        tl.store(here + REP * HD + rows, m_i, mask=row_ok)
        tl.store(here + REP * HD + REP + rows, l_i, mask=row_ok)
        if tl_last_arrival(cnt_ptr + pid_g, SPLITS):
            m_all = tl.full((RP,), float("-inf"), tl.float32)
            for s_ in range(SPLITS):
                m_s = tl.load(pair_ws + s_ * part + REP * HD + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                m_all = tl.maximum(m_all, m_s)
            m_all = tl.where(m_all > float("-inf"), m_all, 0.0)  # no span admitted a position: weights 0
            l_all = tl.zeros((RP,), tl.float32)
            o = tl.zeros((RP, HDP), tl.float32)
            for s_ in range(SPLITS):  # span order: the same sum whoever arrived last
                src = pair_ws + s_ * part
                w = tl.math.exp2(tl.load(src + REP * HD + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                                 - m_all)
                l_all += w * tl.load(src + REP * HD + REP + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                o += w[:, None] * tl.load(src + rows[:, None] * HD + cols[None, :], mask=io_ok,
                                          other=0.0, cache_modifier=".cg")
            l_all = tl.where(l_all > 0, l_all, 1.0)  # no position admitted (or a padding row): o is 0
            tl.store(o_ptrs, (o / l_all[:, None]).to(o_ptr.dtype.element_ty), mask=io_ok)


def _extent(t: torch.Tensor) -> int:
    """The largest element offset a kernel computes into ``t`` from its sizes and strides."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0)


def why_not(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            out: torch.Tensor | None = None) -> str | None:
    """Why :func:`decode_attention` cannot take these operands (None: it can; ``out`` None: one
    to be allocated)."""
    if keys.dim() != 4 or values.shape != keys.shape:
        return "keys and values must be [B, kv_heads, L, head_dim] of one shape"
    b, kv_heads, length, hd = keys.shape
    if hd < 16 or hd % 16 or hd > 256:
        return f"head_dim {hd} is not a multiple of 16 in [16, 256]"
    if q.dim() != 2 or q.shape[0] != b or q.shape[1] % (kv_heads * hd) or q.stride(1) != 1:
        return f"q must be [{b}, heads * {hd}] with unit column stride, heads a multiple of {kv_heads}"
    if out is not None and (out.shape != q.shape or not out.is_contiguous() or out.dtype != q.dtype):
        return "out must be contiguous, of q's shape and dtype"
    if not (q.dtype == keys.dtype == values.dtype) or q.dtype not in _DTYPES:
        return "q, keys, values and out must share a dtype: float16, bfloat16 or float32"
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        return "keys and values need unit stride along head_dim"
    most = _MAX_REP_NARROW if hd <= _NARROW_HEAD else _MAX_REP
    if q.shape[1] // hd // kv_heads > most:
        return f"more than {most} query heads per KV head (heads of {hd}; up to {_MAX_REP_NARROW} for heads of at " \
               f"most {_NARROW_HEAD})"
    if mask is not None and (mask.dtype not in (torch.bool, q.dtype, torch.float32) or mask.dim() != 4
                             or mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, b) or mask.shape[3] != length):
        return f"the mask must be boolean or additive (of q's dtype or float32) [1 or {b}, 1, 1, {length}]"
    if length == 0:
        return "the cache is empty"
    if max(_extent(t) for t in (q, keys, values, mask, out) if t is not None) > INT32_LIMIT:
        return "offsets past 2**31 elements"
    return None


_LAUNCHERS = BoundedCache(1024)  # launchers per shape, strides and alignment (varying batch and cache sizes)


def masked_at(dtype: torch.dtype) -> float:
    """The additive mask value at or below which a position counts as masked: -1e30 (bfloat16's and
    float32's minima are below it), float16's minimum (-65504) for a float16 mask."""
    return max(-1e30, torch.finfo(dtype).min)


def _block_t(hd: int) -> int:
    return _BLOCK_T if hd <= 128 else _BLOCK_T_WIDE


# Spans per pair for tiles of more than 64 query heads: a pair's last program merges every span's
# fp32 partial (rep x head_dim values) alone, 18 KB a span for Falcon-7B's 71 x 64, so at the
# two-programs-per-SM rule (264 spans for one sequence on 132 SMs, one per 64 positions of a long
# cache) that one program would read MBs; four spans keep it under 80 KB
_WIDE_TILE_SPANS = 4


def _splits(pairs: int, length: int, num_sms: int, block_t: int, rep: int = 1) -> int:
    """Spans per (sequence, KV head): about two programs per SM in all, no more spans than
    blocks of positions, at most :data:`_WIDE_TILE_SPANS` for more than 64 query heads per KV
    head. Each span is a whole number of blocks, so a last span may start past the cache's end:
    it merges as empty."""
    spans = max(1, min(triton.cdiv(length, block_t), triton.cdiv(2 * num_sms, pairs)))
    return min(spans, _WIDE_TILE_SPANS) if rep > _MAX_REP else spans


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, out: torch.Tensor, *, base: torch.Tensor | None = None, step: int = 1,
                     counters: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """``out[b] = softmax(cap(q[b] k[b].T * scale) + mask) v[b]`` for one query per sequence, GQA
    heads grouped (query head ``j`` reads KV head ``j // (heads / kv_heads)``), as
    ``F.scaled_dot_product_attention(..., enable_gqa=True)`` with a boolean mask computes it
    (``cap``: the identity, or ``softcap * tanh(s / softcap)`` for ``softcap > 0``).

    ``q``/``out`` ``[B, heads * head_dim]`` (q's rows may be strided: the q columns of a fused
    Q/K/V output), ``keys``/``values`` ``[B, kv_heads, L, head_dim]``, ``mask`` None (every
    position), boolean or additive ``[B or 1, 1, 1, L]``. ``base`` (an int64 device scalar) gets
    ``step`` added. ``counters``: a zeroed int32 buffer of at least B * kv_heads entries for a
    compiled region, left zero (eager calls use their stream's). Raises ValueError naming the problem.
    """
    reason = why_not(q, keys, values, mask, out)
    if reason is None and not (isinstance(softcap, (int, float)) and 0 <= softcap < float("inf")):
        reason = f"softcap must be a finite number >= 0 (0: none), got {softcap!r}"
    if reason is None and base is not None and (base.dtype != torch.int64 or base.numel() != 1
                                                 or base.device != q.device):
        reason = f"base must be a one-element int64 tensor on {q.device}"
    if reason is not None:
        raise ValueError(f"decode_attention: {reason}")
    b, kv_heads, length, hd = keys.shape
    if counters is not None and (counters.numel() < b * kv_heads or counters.dtype != torch.int32
                                 or counters.device != q.device or not counters.is_contiguous()):
        raise ValueError(f"decode_attention: counters must be a contiguous int32 tensor on {q.device} with at least "
                         f"{b * kv_heads} entries")
    rep = q.shape[1] // hd // kv_heads
    facts = device_facts(q.device)
    bt = _block_t(hd)
    splits = _splits(b * kv_heads, length, facts.num_sms, bt, rep)
    pdl = pdl_enabled(facts.capability) and q.is_cuda
    m_sb, m_st = (0, 0) if mask is None else (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(3))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    ints = (length, triton.cdiv(triton.cdiv(length, splits), bt) * bt, step, kv_heads, q.stride(0),
            *keys.stride()[:3], *values.stride()[:3], m_sb, m_st, out.stride(0))
    ptrs = (q, keys, values, mask, out, base)
    aligned = tuple(None if t is None else t.data_ptr() % 16 == 0 for t in ptrs)
    add_mask = mask is not None and mask.dtype != torch.bool
    capped = softcap > 0
    key = (q.device, q.dtype, b, rep, hd, splits, pdl, ints, aligned, None if mask is None else mask.dtype, capped)
    launch = _LAUNCHERS.get(key)
    if launch is None:
        meta = dict(REP=rep, RP=max(16, triton.next_power_of_2(rep)), HD=hd, HDP=triton.next_power_of_2(hd), BT=bt,
                    HAS_MASK=mask is not None, ADD_MASK=add_mask, SOFTCAP=capped, SPLITS=splits,
                    INC=base is not None and step != 0, PREC=prec, PDL=pdl, num_warps=8 if rep > _MAX_REP else 4,
                    num_stages=2)
        if pdl:
            meta["launch_pdl"] = True
        launch = _LAUNCHERS.put(key, Launcher(_decode_attention_kernel, (b * kv_heads, splits), meta))
    if splits > 1:
        # the caller's counters only in compiled regions, as split-K's (triton_scratch.plan_scratch)
        own = counters is not None and per_call()
        ws, cnt = split_scratch(q.device, b * kv_heads * splits * (rep * hd + 2 * rep), 0 if own else b * kv_heads)
        if own:
            cnt = counters
    else:
        ws = cnt = out
    # the plain scale where the cap or the mask comes between it and log2(e) (the kernel applies it after them)
    qk_scale = float(scale) if capped or add_mask else float(scale) * _LOG2E
    launch(q, keys, values, out if mask is None else mask, out, ws, cnt, out if base is None else base,
           length, ints[1], step, qk_scale, float(softcap) if capped else 1.0,
           masked_at(mask.dtype) if add_mask else 0.0, *ints[3:])
    return out


__all__ = ["decode_attention", "masked_at", "why_not"]
