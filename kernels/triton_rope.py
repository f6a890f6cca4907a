"""Rotary embedding and the KV-cache write, fused into the epilogue of a Q/K/V projection
(``triton_splitk.run(rope=...)``, the decoder-layer fusion's attention part).

The QKV GEMM's output columns are ``[q heads | k heads | v heads]``, each head ``head_dim``
wide. Hugging Face's rotary embedding (``q * cos + rotate_half(q) * sin``) pairs column ``c``
of a q or k head with column ``c ± R / 2`` of the same head (R = cos's width: ``head_dim``, or
fewer for a partial rotary, GPT-NeoX's and StableLM's, whose columns from R on pass through),
which a tile of contiguous columns does not hold together. So a q/k tile takes its ``BN``
weight rows as two half-blocks, each pair's lower column in the first and its partner at the
same place in the second (:func:`tl_rope_columns`); pointer loads take any row order, the
bytes of W read are the same. The epilogue then has both members of every pair in its fp32
tile and rotates in registers (:func:`tl_rotate_half_rows`), before the one rounding to the
output dtype. The v tiles keep contiguous columns and are not rotated. Cohere's rotary pairs
neighbouring columns ``2i`` and ``2i + 1`` instead (``pairs``): a tile's even columns, then its
odd ones, rotated in fp32 from the accumulator and rounded once (Cohere's function rotates fp32
copies of the projection already rounded to the dtype: one rounding more). A layer without
positional embedding (``rotate=False``: SmolLM3's NoPE layers) rotates no tile: the epilogue
then writes the cache alone.

A weight whose rows are grouped per KV head, ``[q x group | k | v]`` (GPT-NeoX's
``query_key_value``, ``[q | k | v]`` per head, group 1; Falcon's new architecture, group
heads / kv_heads), is read in that order (:func:`tl_grouped_rows` maps each output column to
its weight row and bias entry) while the output keeps the ``[q | k | v]`` columns above: the
same bytes of W, and q contiguous for the attention.

With q/k norms (Qwen3's ``q_norm``/``k_norm``: an RMSNorm over each head's ``head_dim``
columns, before the rotary), a q/k tile holds one whole head (``block_n == head_dim``): the
epilogue rounds the projection to the output dtype, normalises each token's head in fp32,
rounds, multiplies by the norm weight and rounds again, the roundings stock's bf16 modules
make, then rotates.

With a cache, the k and v columns are also stored into a static KV cache
(``keys``/``values`` ``[B, kv_heads, L, head_dim]``) at position ``base + s`` for token s of
each sequence, ``base`` a device scalar (transformers' ``StaticLayer.cumulative_length``),
read by the kernel so a CUDA graph replays it correctly. A position outside ``[0, L)`` is not
written and that token's whole output row is NaN instead (stock's ``index_copy_`` raises a
device assert there): a cache that overflows shows in the logits, never as silently missing
keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_epilogue import tl_rstd

_INT64 = torch.int64


@dataclass(frozen=True)
class RotaryCache:
    """What the epilogue needs: ``cos``/``sin`` ``[B or 1, S, R]`` of x's dtype or fp32 (x's rows
    are B x S tokens, batch-major, as a ``[B, S, D]`` hidden state flattens; R even, at most
    ``head_dim``: the rotated columns of each head), the head counts and, for the cache write,
    ``keys``/``values`` ``[B, kv_heads, L, head_dim]`` and ``base`` (an int64 device scalar).
    Without ``keys`` only the rotary embedding is applied."""

    cos: torch.Tensor
    sin: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    base: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim] RMSNorm weights of the q and k heads (both or neither)
    k_norm: torch.Tensor | None = None
    qk_eps: float = 0.0
    # the q/k norms' formula, as fusion/norm.py prologue_norm reads a norm operand: None and
    # weights of x's dtype, Llama's (the normalised head rounded, times the weight); a float
    # (or fp32 weights with None: a factor already formed), Gemma's (times qk_offset + weight
    # in fp32, rounded once)
    qk_offset: float | None = None
    group: int = 0  # the weight's rows grouped per KV head, [q x group | k | v]; 0: all q, all k, all v
    # Cohere's rotary: column 2i paired with 2i + 1 (its rotate_half interleaves; cos/sin hold each
    # frequency twice), over all of each head, or over its first R columns with tiles of at most R
    pairs: bool = False
    # False: q and k pass unrotated (a layer without positional embedding: SmolLM3's NoPE layers);
    # cos/sin are checked as ever but not read
    rotate: bool = True
    # the q/k norms applied to the rotated heads (Hunyuan's), else before the rotary (Qwen3's)
    qk_after_rotary: bool = False


@dataclass(frozen=True)
class RopeLayout:
    """The integers of a :class:`RotaryCache` call that the kernel is compiled or launched with
    (part of the split-K plan's key): sizes, strides, pointer alignment."""

    head_dim: int
    heads: int
    kv_heads: int
    seq: int
    cos_strides: tuple[int, int]
    kv: bool
    k_strides: tuple[int, int, int] = (0, 0, 0)
    v_strides: tuple[int, int, int] = (0, 0, 0)
    cache_len: int = 0
    aligned: tuple[bool, ...] = ()  # 16-byte alignment of cos, sin (and keys, values; q_norm, k_norm), each
    qk_norm: bool = False
    qk_eps: float = 0.0
    qk_factor: bool = False  # Gemma's formula (RotaryCache.qk_offset), with the offset below
    qk_offset: float = 0.0
    rot: int = 0  # the rotated columns of each head (cos's width); 0: all, head_dim
    group: int = 0  # RotaryCache.group
    pairs: bool = False  # RotaryCache.pairs
    rotate: bool = True  # RotaryCache.rotate
    cos_fp32: bool = False  # cos/sin fp32 (Ernie 4.5's), else of x's dtype: the kernel's pointer type
    qk_after_rotary: bool = False  # RotaryCache.qk_after_rotary

    def scalars(self, block_n: int) -> tuple:
        """The kernel's rotary arguments (integers, then the q/k norms' eps), in signature order;
        without ``rotate`` no tile is a rotated one (the epilogue then only writes the cache)."""
        q_cols = self.heads * self.head_dim
        rope_tiles = (self.heads + self.kv_heads) * self.head_dim // block_n if self.rotate else 0
        return (self.seq, *self.cos_strides, *self.k_strides, *self.v_strides, q_cols,
                q_cols + self.kv_heads * self.head_dim, self.cache_len, rope_tiles, self.qk_eps)


def rope_layout(rc: RotaryCache, x: torch.Tensor, out: torch.Tensor, block_n: int, who: str) -> RopeLayout:
    """Check ``rc`` against x (M x K), out (M x N) and the config's ``block_n``; ValueError or
    TypeError naming what does not fit."""
    if not isinstance(rc, RotaryCache):
        raise TypeError(f"{who}: rope must be a RotaryCache, got {type(rc).__name__}")
    hd, h, hkv = rc.head_dim, rc.heads, rc.kv_heads
    if not all(isinstance(v, int) and v > 0 for v in (hd, h, hkv)) or hd % 2:
        raise ValueError(f"{who}: rope needs positive head counts and an even head_dim, got heads={h}, "
                         f"kv_heads={hkv}, head_dim={hd}")
    if out.shape[1] != (h + 2 * hkv) * hd:
        raise ValueError(f"{who}: rope: the output's {out.shape[1]} columns are not (heads + 2 * kv_heads) * "
                         f"head_dim = {(h + 2 * hkv) * hd}")
    if block_n > hd or hd % block_n:
        raise ValueError(f"{who}: rope needs tiles within one head: block_n={block_n} does not divide "
                         f"head_dim={hd}")
    group = rc.group
    if not isinstance(group, int) or group < 0 or group and h != group * hkv:
        raise ValueError(f"{who}: rope group must be 0 or heads / kv_heads = {h // hkv if h % hkv == 0 else '-'} "
                         f"(the query heads of each KV head), got {group!r}")
    norms = _qk_norms(rc, x, block_n, who)
    if not isinstance(rc.rotate, bool) or not rc.rotate and (norms or rc.pairs):
        raise ValueError(f"{who}: rope rotate must be a bool, False only without q/k norms and pairs, got "
                         f"{rc.rotate!r}")
    if not isinstance(rc.qk_after_rotary, bool) or rc.qk_after_rotary and not norms:
        raise ValueError(f"{who}: rope qk_after_rotary must be a bool, True only with q/k norms, got "
                         f"{rc.qk_after_rotary!r}")
    m = x.shape[0]
    cos, sin = rc.cos, rc.sin
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not 2 <= t.shape[-1] <= hd or t.shape[-1] % 2 \
                or t.stride(-1) != 1:
            raise ValueError(f"{who}: rope {name} must be [B or 1, S, R] (R even, at most head_dim {hd}) with unit "
                             "last stride")
        if t.dtype not in (x.dtype, torch.float32) or t.device != x.device:
            raise TypeError(f"{who}: rope {name} must have x's dtype (or fp32) and x's device ({x.dtype}, {x.device})")
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.dtype != sin.dtype:
        raise ValueError(f"{who}: rope cos and sin must have the same shape, strides and dtype")
    rot = cos.shape[-1]
    if not isinstance(rc.pairs, bool) or rc.pairs and rot != hd and block_n > rot:
        raise ValueError(f"{who}: rope pairs (neighbouring columns) must be a bool, True only for cos/sin over all "
                         f"{hd} columns of each head or tiles within the rotated {rot}, got {rc.pairs!r} with "
                         f"block_n={block_n}")
    if rot % block_n if block_n <= rot else block_n % rot:
        raise ValueError(f"{who}: rope over {rot} of each head's columns needs tiles of a width that divides it or "
                         f"that it divides: block_n={block_n}")
    seq = cos.shape[1]
    batch = m // seq if seq else 0
    if not seq or batch * seq != m or cos.shape[0] not in (1, batch):
        raise ValueError(f"{who}: rope cos {tuple(cos.shape)} does not fit x's {m} rows as [B, S] tokens")
    cos_strides = (0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1))
    ptrs = [cos, sin]
    factor = bool(norms) and (rc.qk_offset is not None or rc.q_norm.dtype != x.dtype)
    qk = dict(qk_norm=bool(norms), qk_eps=float(rc.qk_eps) if norms else 0.0, qk_factor=factor,
              qk_offset=float(rc.qk_offset or 0.0) if factor else 0.0, rot=rot, group=group, pairs=rc.pairs,
              rotate=rc.rotate, cos_fp32=cos.dtype != x.dtype, qk_after_rotary=rc.qk_after_rotary)
    if rc.keys is None:
        if rc.values is not None or rc.base is not None:
            raise ValueError(f"{who}: rope: values and base need keys")
        return RopeLayout(hd, h, hkv, seq, cos_strides, False, aligned=_aligned(ptrs + norms), **qk)
    keys, values, base = rc.keys, rc.values, rc.base
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != batch or t.shape[1] != hkv \
                or t.shape[3] != hd or t.stride(3) != 1:
            raise ValueError(f"{who}: rope {name} must be [{batch}, {hkv}, L, {hd}] with unit last stride")
        if t.dtype != out.dtype or t.device != out.device:
            raise TypeError(f"{who}: rope {name} must have the output's dtype and device ({out.dtype}, {out.device})")
    if keys.shape[2] != values.shape[2]:
        raise ValueError(f"{who}: rope keys and values must hold the same number of positions")
    if not isinstance(base, torch.Tensor) or base.numel() != 1 or base.dtype != _INT64 or base.device != x.device:
        raise ValueError(f"{who}: rope base must be one int64 element on x's device")
    ptrs += [keys, values]
    return RopeLayout(hd, h, hkv, seq, cos_strides, True, tuple(keys.stride()[:3]), tuple(values.stride()[:3]),
                      keys.shape[2], _aligned(ptrs + norms), **qk)


def _qk_norms(rc: RotaryCache, x: torch.Tensor, block_n: int, who: str) -> list[torch.Tensor]:
    """``[q_norm, k_norm]`` checked (empty without them): both or neither, [head_dim] contiguous
    on x's device, of x's dtype (or fp32: Gemma's formula), a finite positive eps and offset,
    and tiles of one whole head."""
    if rc.q_norm is None and rc.k_norm is None:
        if rc.qk_offset is not None:
            raise ValueError(f"{who}: rope qk_offset needs q_norm and k_norm")
        return []
    hd = rc.head_dim
    for name, t in (("q_norm", rc.q_norm), ("k_norm", rc.k_norm)):
        if not isinstance(t, torch.Tensor) or t.shape != (hd,) or not t.is_contiguous():
            raise ValueError(f"{who}: rope {name} must be a contiguous [{hd}] tensor (q_norm and k_norm go together)")
        if t.dtype not in (x.dtype, torch.float32) or t.device != x.device:
            raise TypeError(f"{who}: rope {name} must have x's dtype (or fp32) and x's device ({x.dtype}, "
                            f"{x.device}), got {t.dtype} on {t.device}")
    if rc.q_norm.dtype != rc.k_norm.dtype:
        raise TypeError(f"{who}: rope q_norm and k_norm must have one dtype, got {rc.q_norm.dtype} and "
                        f"{rc.k_norm.dtype}")
    if not isinstance(rc.qk_eps, (int, float)) or not 0 <= rc.qk_eps < float("inf"):
        raise ValueError(f"{who}: rope qk_eps must be a finite number >= 0, got {rc.qk_eps!r}")
    if rc.qk_offset is not None and (not isinstance(rc.qk_offset, (int, float))
                                     or not abs(rc.qk_offset) < float("inf")):
        raise ValueError(f"{who}: rope qk_offset must be a finite number or None, got {rc.qk_offset!r}")
    if block_n != hd:
        raise ValueError(f"{who}: rope with q/k norms needs tiles of one whole head: block_n={block_n}, "
                         f"head_dim={hd}")
    return [rc.q_norm, rc.k_norm]


def _aligned(tensors) -> tuple[bool, ...]:
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


@triton.jit
def tl_rope_columns(pid_n, offs_n, rope_tiles, BN: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                    PAIRS: tl.constexpr):
    """The output columns of tile ``pid_n``: for a q/k tile (``pid_n < rope_tiles``) that holds
    rotated columns (the first ``ROT`` of its head), the lower columns of its pairs, then their
    partners ``ROT / 2`` further, in the same order; the contiguous ``offs_n`` otherwise. A tile
    of ``BN <= ROT`` columns takes ``BN / 2`` pairs; a wider one (``ROT`` divides ``BN``) spans
    ``BN / ROT`` groups of ``ROT`` columns, the first of them rotated. ``PAIRS`` (Cohere's):
    the tile's even columns, then the odd ones, each its lower neighbour's partner."""
    j = tl.arange(0, BN)
    per_head: tl.constexpr = HD // BN
    half: tl.constexpr = BN // 2
    t = pid_n % per_head
    start = (pid_n // per_head) * HD
    if PAIRS:
        paired = pid_n * BN + (j % half) * 2 + j // half
    elif BN <= ROT:
        paired = start + (j // half) * (ROT // 2) + t * half + j % half
    else:
        paired = start + t * BN + ((j % half) // (ROT // 2)) * ROT + (j // half) * (ROT // 2) + j % (ROT // 2)
    return tl.where((pid_n < rope_tiles) & (t * BN < ROT), paired, offs_n)


@triton.jit
def tl_grouped_rows(cols, q_cols, v_start, HD: tl.constexpr, QG: tl.constexpr):
    """The weight rows of output columns ``cols`` (``[q | k | v]``, heads of ``HD``) in a weight
    grouped per KV head, ``[q x QG | k | v]``: KV head g's rows start at ``g * (QG + 2) * HD``."""
    is_q = cols < q_cols
    is_v = cols >= v_start
    head = (cols - tl.where(is_q, 0, tl.where(is_v, v_start, q_cols))) // HD
    group = tl.where(is_q, head // QG, head)
    part = tl.where(is_q, head % QG, tl.where(is_v, QG + 1, QG))
    return (group * (QG + 2) + part) * HD + cols % HD


@triton.jit
def tl_rotate_half_rows(acc, BN: tl.constexpr, BM: tl.constexpr):
    """``rotate_half`` of a [BN, BM] tile laid out by :func:`tl_rope_columns`: row i of the
    first half becomes ``-row(BN/2 + i)``, row ``BN/2 + i`` becomes row i."""
    pairs = tl.permute(tl.reshape(acc, (2, BN // 2, BM)), (1, 2, 0))
    first, second = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(-second, first), (2, 0, 1)), (BN, BM))


@triton.jit
def _tl_qk_norm(acc, c, pid_n, qn_ptr, kn_ptr, q_cols, qk_eps, dt: tl.constexpr, BN: tl.constexpr, HD: tl.constexpr,
                QK_FACTOR: tl.constexpr, QK_OFFSET: tl.constexpr):
    # stock: the head (rounded to dt) -> fp32 rms over the head -> ...
    y = acc.to(dt).to(tl.float32)
    rstd = tl_rstd(tl.sum(y * y, axis=0), 1.0 / HD, qk_eps)
    g = tl.where(pid_n * BN < q_cols, tl.load(qn_ptr + c), tl.load(kn_ptr + c)).to(tl.float32)
    if QK_FACTOR:  # ... times (offset + weight) in fp32, rounded once (Gemma 3)
        return (y * rstd[None, :] * (g + QK_OFFSET)[:, None]).to(dt).to(tl.float32)
    # ... rounded, times the weight, rounded (Llama's formula: Qwen3)
    return ((y * rstd[None, :]).to(dt).to(tl.float32) * g[:, None]).to(dt).to(tl.float32)


@triton.jit
def tl_rope_epilogue(acc, offs_n, offs_m, mask, pid_n, cos_ptr, sin_ptr, kc_ptr, vc_ptr, base_ptr, qn_ptr, kn_ptr,
                     seq, cs_b, cs_s, kc_b, kc_h, kc_s, vc_b, vc_h, vc_s, q_cols, v_start, cache_len, rope_tiles,
                     qk_eps, KV: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, HD: tl.constexpr,
                     QK_NORM: tl.constexpr, QK_FACTOR: tl.constexpr, QK_OFFSET: tl.constexpr, ROT: tl.constexpr,
                     QK_AFTER: tl.constexpr = False):
    """Rotate a q/k tile's fp32 accumulator [BN, BM] (columns from :func:`tl_rope_columns`,
    tokens ``offs_m``; the first ``ROT`` columns of each head) after its q/k norm (``QK_NORM``:
    ``BN == HD``, one head per tile; Llama's formula, or with ``QK_FACTOR`` Gemma's, factor
    ``QK_OFFSET + weight``; with ``QK_AFTER`` the norm of the rotated head instead) and, with
    ``KV``, store a k or v tile into the cache. Returns the tile, NaN in the rows of tokens whose
    cache position is outside ``[0, cache_len)``."""
    b = (offs_m // seq).to(tl.int64)
    s = offs_m % seq
    if pid_n < rope_tiles:
        tok = b * cs_b + s * cs_s
        c = offs_n % HD
        if QK_NORM and not QK_AFTER:
            acc = _tl_qk_norm(acc, c, pid_n, qn_ptr, kn_ptr, q_cols, qk_eps, kc_ptr.dtype.element_ty, BN, HD,
                              QK_FACTOR, QK_OFFSET)
        cs = tok[None, :] + c[:, None]
        if ROT == HD:
            cos = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
            acc = acc * cos + tl_rotate_half_rows(acc, BN, BM) * sin
        else:  # a partial rotary: columns from ROT on pass through
            rotated = (c < ROT)[:, None]
            cos = tl.load(cos_ptr + cs, mask=mask & rotated, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + cs, mask=mask & rotated, other=0.0).to(tl.float32)
            acc = tl.where(rotated, acc * cos + tl_rotate_half_rows(acc, BN, BM) * sin, acc)
        if QK_NORM and QK_AFTER:  # the rotated head (rounded) normalised, as Hunyuan's norms after its rotary
            acc = _tl_qk_norm(acc, c, pid_n, qn_ptr, kn_ptr, q_cols, qk_eps, kc_ptr.dtype.element_ty, BN, HD,
                              QK_FACTOR, QK_OFFSET)
    if KV:
        pos = tl.load(base_ptr) + s
        in_cache = (pos >= 0) & (pos < cache_len)
        acc = tl.where(in_cache[None, :], acc, float("nan"))
        if pid_n * BN >= q_cols:  # a k or v tile (tiles never straddle a head)
            is_v = pid_n * BN >= v_start
            col = offs_n - tl.where(is_v, v_start, q_cols)
            head = (col // HD).to(tl.int64)
            c = col % HD
            ok = mask & in_cache[None, :]
            val = acc.to(kc_ptr.dtype.element_ty)
            if is_v:
                tl.store(vc_ptr + (b * vc_b + pos * vc_s)[None, :] + (head * vc_h + c)[:, None], val, mask=ok)
            else:
                tl.store(kc_ptr + (b * kc_b + pos * kc_s)[None, :] + (head * kc_h + c)[:, None], val, mask=ok)
    return acc


__all__ = ["RopeLayout", "RotaryCache", "rope_layout", "tl_grouped_rows", "tl_rope_columns", "tl_rope_epilogue",
           "tl_rotate_half_rows"]
