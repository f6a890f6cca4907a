"""Deterministic split-K Triton GEMM for decode-sized M (≤ 64): ``out = act(x @ W.T + b)``,
optionally with an RMSNorm of x fused in front, a residual added after, for a Q/K/V
projection the rotary embedding and the KV-cache write, and for a stacked gate/up weight the
GLU product (``run(norm=, residual=, rope=, glu=)``, the decoder-layer fusion of
fusion/models/decoder_layer.py; ``glu`` serves e4m3 gate/up weights, which the gated kernel,
kernels/triton_glu.py, does not read); for a mixture-of-experts router, its softmax-top-k
routing (``run(route=)``, :func:`route_config`); a second product over its own K columns
summed into the same output tiles (``run(second=)``: a parallel-residual layer's attention
output and MLP down projections in one launch).

At small M the GEMM is a stream over W (N x K): the kernel's only job is to keep enough
bytes of W in flight on every SM. N alone gives too few tiles (70b qkv: 160 tiles of 64
rows for 132 SMs), so K is split as well: program (n-tile, split, m-tile) multiplies a
BLOCK_N x (K / SPLIT_K) slab of W with the matching columns of x and writes its fp32 partial
to a workspace ``[SPLIT_K, M, N]``. A second small kernel adds the splits **in index order**
(bit-identical results for a fixed config, no atomics), then bias, activation and the cast.
With ``split_k == 1`` the first kernel applies the epilogue itself (one launch, no workspace).
With ``fused_reduce`` the second launch goes away: each split program writes its partial, bumps
a per-output-tile arrival counter (signalling only, see ``triton_scratch.tl_split_fixup``), and
the program that arrives last adds the partials in split order 0..S-1 and runs the epilogue.
Same sums in the same order as the two-launch path, so the same bits.

The dot is computed "swapped", ``acc[BN, BM] = W_tile @ x_tile.T``: W's 64-128 rows are the
MMA's M side (so Hopper can use wgmma) and the handful of x rows, padded to 16, its N side.
W tiles are loaded whole (``BLOCK_K`` contiguous elements per row, 16-byte vectors) and
pipelined through shared memory with ``num_stages`` buffers. W is read once per call, so its
loads are marked ``evict_first``; x is re-read by every program (``evict_last``).
An FP8 weight (``weight_scale=``, kernels/fp8.py) is loaded as e4m3 bytes, converted to x's
dtype in registers (by integer ops for bf16, kernels/triton_e4m3.py) and scaled in fp32 (see the
kernel's WSCALE). Its configs take x tiles of M's power of two from 1 row (``block_m``; Triton
pads the MMA's x side to 8): at M = 1 a 16-row tile would stage and multiply 15 rows of zeros,
and the W tile would be converted once per 8-row half of it.

Workspace and counters: from torch's caching allocator, kept per (device, stream) and reused,
never freed (``triton_scratch``: graph-capture caveats). ``clear_workspaces`` is for tests and
must not be called while graphs captured with split-K calls exist.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import fp8
from .epilogue import Activation
from .fp8 import FORMAT_OF
from .triton_config import next_pow2
from .triton_e4m3 import integer_conversion, tl_weight_values
from .triton_epilogue import ACT_CODE, tl_activation, tl_add_residual, tl_norm_factor, tl_norm_tile_sq, tl_rstd
from .triton_glu import ACTIVATIONS as GLU_CODES
from .triton_glu import tl_glu_halves, tl_glu_rows, tl_rounded_glu
from .triton_launch import Launcher, pdl_enabled
from .triton_plan import (
    PlanCache,
    TritonPlan,
    check_fusion,
    check_operands,
    parse_activation,
    plan_meta,
    plan_problem,
    split_extent,
)
from .triton_prefetch import prefetch_elements, tl_prefetch_rows
from .triton_rope import RopeLayout, RotaryCache, rope_layout, tl_grouped_rows, tl_rope_columns, tl_rope_epilogue
from .triton_router import MAX_TOP_K, tl_route_tile
from .triton_scratch import (
    TL_MAX_FIXUP_GROUP,
    clear_workspaces,
    fixup_group,
    plan_scratch,
    split_scratch,
    tl_split_fixup,
    tl_sum_parts,
    workspace_bytes,
)
from .triton_splitk_configs import (  # (re-exported: the split-K backend's public names)
    _WSCALE,
    KIND,
    MAX_M,
    MAX_ROUTE_EXPERTS,
    TritonSplitKConfig,
    _whole_head_config,
    candidates,
    default_config,
    prologue_fits,
    route_config,
    untuned_config,
)

__all__ = [
    "KIND", "MAX_M", "MAX_ROUTE_EXPERTS", "Fusion", "TritonSplitKConfig", "candidates", "clear_workspaces",
    "default_config", "fusion_of", "pdl_enabled", "prologue_fits", "rope_config", "route_config", "run",
    "untuned_config", "workspace_bytes",
]

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, nw_ptr, res_ptr, res2_ptr, cos_ptr, sin_ptr,
                   kc_ptr, vc_ptr, base_ptr, qn_ptr, kn_ptr, sc_ptr, ids_ptr, rw_ptr, x2_ptr, w2_ptr, bias2_ptr,
                   M, N, K, ldx, ldw, ldo, k_per_split, inv_k, eps, ldr, res_scale, ldr2, seq, cs_b, cs_s, kc_b, kc_h,
                   kc_s, vc_b, vc_h, vc_s, q_cols, v_start, cache_len, rope_tiles, qk_eps, lds, K2, ldx2, ldw2,
                   splits1,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                   PREC: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                   ROPE: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, PDL: tl.constexpr,
                   QK_NORM: tl.constexpr, RES_SCALED: tl.constexpr, WSCALE: tl.constexpr,
                   WINT: tl.constexpr, QK_FACTOR: tl.constexpr, QK_OFFSET: tl.constexpr, NW_OFFSET: tl.constexpr,
                   GLU: tl.constexpr, PREFETCH: tl.constexpr, ROUTE: tl.constexpr, ROUTE_KP: tl.constexpr,
                   RENORMALIZE: tl.constexpr, FIXUP: tl.constexpr, ROT: tl.constexpr, QG: tl.constexpr,
                   PAIRS: tl.constexpr, RES2: tl.constexpr, TWO: tl.constexpr, HAS_BIAS2: tl.constexpr,
                   QK_AFTER: tl.constexpr = False):
    # Arguments in groups (see "launch arguments" below): the pointers, then the integers.
    # MODE 0: split_k == 1, epilogue here. 1: write the partial for _reduce_kernel.
    # 2: write the partial; the last split program of the tile reduces and runs the epilogue.
    # NORM: x is RMS-normalised (norm weight nw, eps): the dot takes x * nw (NW_OFFSET + nw in
    # fp32 with an offset, triton_epilogue.tl_norm_factor), each program sums
    # the squares of its slice of x, and whoever runs the epilogue scales the rows by 1/rms of
    # the summed squares (triton_epilogue.tl_norm_tile_sq). Split programs leave their sums after
    # the partials in the workspace: [S, M] for the reduce kernel (MODE 1), [tiles, S, BM]
    # for the tile's last program (MODE 2). RESIDUAL: the epilogue adds res (ldr) to the
    # rounded result (RES_SCALED: times res_scale first); RES2: then res2 (ldr2) to that sum,
    # rounded (a parallel-residual layer's (mlp + a) + x, as stock rounds it). ROPE: the rotary embedding of the q/k
    # heads (tiles of paired columns), after their RMSNorms with QK_NORM, and, with KV, the k/v
    # heads stored into a static cache (triton_rope); ROT: the rotated columns of a head; QG > 0:
    # W's rows grouped per KV head, [q x QG | k | v], the output's columns [q | k | v]; PAIRS:
    # Cohere's rotary of neighbouring columns.
    # WSCALE: W is e4m3 (kernels/fp8.py), converted to x's dtype in registers (exact: every e4m3
    # value is a bf16/fp16 value) and scaled in fp32: 1 per output row (sc[N]) once after the
    # loop; 2 per 128x128 block (sc[N/128, lds]) per K tile, which lies inside one block (BK
    # divides 128 and each split starts on a block edge), so acc += (W8 @ x.T) * s[row block].
    # WINT: the e4m3 -> bf16 conversion by integer ops (triton_e4m3), else Triton's cast.
    # ROUTE (top k, 0 for none): the N outputs are a router's logits for its N experts, all in one
    # tile; the epilogue also routes each token from its rounded logits (triton_router.tl_route_tile:
    # softmax, top ROUTE, RENORMALIZE) and stores the expert ids (int64) and weights [M, ROUTE].
    # GLU (an activation code of triton_glu, 0 for none): W is a stacked [gate; up] of N rows and
    # out has N / 2 columns, act(gate) * up; a tile multiplies the gate rows of BN / 2 output
    # columns and the up rows of the same columns (triton_glu.tl_glu_rows), so the epilogue has
    # both halves of its columns at hand (with the transformers GLU's roundings, tl_rounded_glu).
    # PDL (programmatic dependent launch): this grid may start while the previous kernel on
    # the stream finishes; nothing the previous kernel writes is read, and nothing is written,
    # before the wait, which returns once that kernel has completed and its writes are visible
    # (see pdl_enabled()). PREFETCH (W elements
    # per row, 0 for none): before the wait, L2 is asked for the first of this program's W bytes
    # (triton_prefetch), which no earlier kernel writes.
    # TWO: a second product x2 @ W2.T (K2 columns, its bias2 with HAS_BIAS2) summed into the same
    # tiles: splits 0..splits1-1 cover x @ W.T, splits1.. cover x2 @ W2.T with the same K extent
    # each, and the partials are added in split order as for one GEMM (never MODE 0).
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    if ROPE:
        offs_n = tl_rope_columns(pid_n, offs_n, rope_tiles, BN, HD, ROT, PAIRS)
    n_ok = offs_n < N
    if GLU != 0:
        offs_n, n_ok = tl_glu_rows(pid_n, N // 2, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    # W rows past N are clamped (re-read row 0, dropped at the store) so full-K W loads carry
    # no mask at all; x rows past M are masked, so the padding rows of a 1-row x cost nothing.
    rows_n = tl.where(n_ok, offs_n, 0)
    if QG != 0:
        rows_n = tl_grouped_rows(rows_n, q_cols, v_start, HD, QG)
    ks = pid_s
    if TWO:  # a split of the second product: its operands, from its column 0 (selects, not branches)
        second = pid_s >= splits1
        x_ptr = tl.where(second, x2_ptr, x_ptr)
        w_ptr = tl.where(second, w2_ptr, w_ptr)
        ldx = tl.where(second, ldx2, ldx)
        ldw = tl.where(second, ldw2, ldw)
        K = tl.where(second, K2, K)
        ks = tl.where(second, pid_s - splits1, pid_s)
    k0 = ks * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    if PREFETCH:
        tl_prefetch_rows(w_ptr + rows_n * ldw + k0, tl.minimum(k1 - k0, PREFETCH))
    if PDL:
        gdc_wait()
    w_ptrs = w_ptr + rows_n[:, None] * ldw + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * ldx + (k0 + offs_k)[None, :]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    sq = tl.zeros((BM, BK), dtype=tl.float32)  # NORM: this slice's squares of x, rows summed after the loop
    for k in range(k0, k1, BK):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0, eviction_policy="evict_last")
            if NORM:
                x, sq = tl_norm_tile_sq(x, tl_norm_factor(tl.load(nw_ptr + k + offs_k), NW_OFFSET), sq)
        else:
            k_ok = (k + offs_k) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_last")
            if NORM:
                g = tl_norm_factor(tl.load(nw_ptr + k + offs_k, mask=k_ok, other=0.0), NW_OFFSET)
                x, sq = tl_norm_tile_sq(x, g, sq)
        if WSCALE == 0:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
        elif WSCALE == 1:
            acc = tl.dot(tl_weight_values(w, x.dtype, WINT), tl.trans(x), acc, input_precision=PREC)
        else:
            s = tl.load(sc_ptr + (rows_n // 128) * lds + k // 128)
            acc += tl.dot(tl_weight_values(w, x.dtype, WINT), tl.trans(x), input_precision=PREC) * s[:, None]
        w_ptrs += BK
        x_ptrs += BK
    if WSCALE == 1:  # before the partial is stored: the splits then add scaled partials
        acc = acc * tl.load(sc_ptr + rows_n)[:, None]
    if PDL:
        gdc_launch_dependents()  # only the epilogue is left: let the next grid get ready
    mask = n_ok[:, None] & m_ok[None, :]
    ws_offs = offs_m[None, :] * N + offs_n[:, None]
    ss = tl.sum(sq, axis=1)
    split_k = tl.num_programs(1)
    ss_ptr = ws_ptr + split_k * M * N  # NORM: the sums of squares, after the partials
    if MODE == 1:
        tl.store(ws_ptr + pid_s * M * N + ws_offs, acc, mask=mask)
        if NORM and pid_n == 0:
            tl.store(ss_ptr + pid_s * M + offs_m, ss, mask=m_ok)
    else:
        last = True
        if MODE == 2:
            tile = pid_m * tl.num_programs(0) + pid_n
            tile_ss = ss_ptr + tile * split_k * BM + tl.arange(0, BM)
            if NORM:  # stored before the fixup's barrier and release, like the partial
                tl.store(tile_ss + pid_s * BM, ss)
            acc, last = tl_split_fixup(acc, ws_ptr, ws_offs, mask, M * N, cnt_ptr + tile, pid_s, split_k, FIXUP)
            if NORM and last:  # split order, as the partials
                ss = tl_sum_parts(tl.zeros_like(ss), tile_ss, BM, tl.arange(0, BM) < BM, split_k, TL_MAX_FIXUP_GROUP)
        if last:
            if NORM:
                acc = acc * tl_rstd(ss, inv_k, eps)[None, :]
            if HAS_BIAS:
                bias_at = rows_n if QG != 0 else offs_n  # (a weight's grouped rows: their bias entries)
                bias = tl.load(bias_ptr + bias_at, mask=n_ok, other=0.0).to(tl.float32)
                acc = acc + bias[:, None]
            if HAS_BIAS2:
                acc = acc + tl.load(bias2_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            acc = tl_activation(acc, ACT)
            if ROPE:
                acc = tl_rope_epilogue(acc, offs_n, offs_m, mask, pid_n, cos_ptr, sin_ptr, kc_ptr, vc_ptr, base_ptr,
                                       qn_ptr, kn_ptr, seq, cs_b, cs_s, kc_b, kc_h, kc_s, vc_b, vc_h, vc_s, q_cols,
                                       v_start, cache_len, rope_tiles, qk_eps, KV, BN, BM, HD, QK_NORM,
                                       QK_FACTOR, QK_OFFSET, ROT, QK_AFTER)
            if RESIDUAL:
                acc = tl_add_residual(acc, res_ptr + offs_m[None, :] * ldr + offs_n[:, None], mask,
                                      out_ptr.dtype.element_ty, res_scale, RES_SCALED)
            if RES2:
                acc = tl_add_residual(acc, res2_ptr + offs_m[None, :] * ldr2 + offs_n[:, None], mask,
                                      out_ptr.dtype.element_ty, 1.0, False)
            if GLU != 0:
                gate, up = tl_glu_halves(acc, BN, BM)
                cols = pid_n * (BN // 2) + tl.arange(0, BN // 2)
                ptrs = out_ptr + offs_m[None, :] * ldo + cols[:, None]
                tl.store(ptrs, tl_rounded_glu(gate, up, out_ptr.dtype.element_ty, GLU).to(out_ptr.dtype.element_ty),
                         mask=(cols < N // 2)[:, None] & m_ok[None, :])
            else:
                ptrs = out_ptr + offs_m[None, :] * ldo + offs_n[:, None]
                tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            if ROUTE != 0:  # from the logits as stored, as the router's softmax reads them
                ids, weights = tl_route_tile(acc.to(out_ptr.dtype.element_ty).to(tl.float32), n_ok, ROUTE, ROUTE_KP,
                                             RENORMALIZE)
                slots = tl.arange(0, ROUTE_KP)[:, None]
                taken = (slots < ROUTE) & m_ok[None, :]
                at = offs_m[None, :].to(tl.int64) * ROUTE + slots
                tl.store(ids_ptr + at, ids.to(tl.int64), mask=taken)
                tl.store(rw_ptr + at, weights.to(rw_ptr.dtype.element_ty), mask=taken)


@triton.jit
def _reduce_kernel(ws_ptr, bias_ptr, out_ptr, res_ptr, res2_ptr, bias2_ptr, M, N, ldo, ldr, res_scale, ldr2, split_k,
                   inv_k, eps, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
                   RESIDUAL: tl.constexpr, RES_SCALED: tl.constexpr, PDL: tl.constexpr, RES2: tl.constexpr,
                   HAS_BIAS2: tl.constexpr):
    if PDL:
        gdc_wait()
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    # fixed order: the result never depends on timing (the loads of up to MAX_FIXUP_GROUP parts go
    # ahead of their adds as far as ptxas schedules them: about 2 for a BLOCK of 1024 on sm_90)
    zeros = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl_sum_parts(zeros, ws_ptr + m * N + offs, M * N, ok, split_k, TL_MAX_FIXUP_GROUP)
    if NORM:  # the row's sum of squares, from the [S, M] sums after the partials (read by every lane)
        ss = tl_sum_parts(zeros, ws_ptr + split_k * M * N + m + offs * 0, M, ok, split_k, TL_MAX_FIXUP_GROUP)
        acc = acc * tl_rstd(ss, inv_k, eps)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS2:
        acc += tl.load(bias2_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    acc = tl_activation(acc, ACT)
    if RESIDUAL:
        acc = tl_add_residual(acc, res_ptr + m * ldr + offs, ok, out_ptr.dtype.element_ty, res_scale, RES_SCALED)
    if RES2:
        acc = tl_add_residual(acc, res2_ptr + m * ldr2 + offs, ok, out_ptr.dtype.element_ty, 1.0, False)
    tl.store(out_ptr + m * ldo + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class Fusion:
    """What a plan fuses around the GEMM, part of its cache key: an RMSNorm of x in the prologue
    (``norm_eps`` not None; the norm weight's 16-byte alignment), a residual added in the
    epilogue (``residual_ld`` not None: its row stride; its 16-byte alignment; ``residual2_ld``:
    a second one added to that rounded sum, as a parallel-residual layer's ``(mlp + a) + x``), the rotary
    embedding and KV-cache write of a Q/K/V projection (``rope``). ``norm_fp32``: the norm
    weight is fp32 (a Gemma norm's kept ``1 + weight``), not x's dtype (Triton
    compiles the prologue for its pointer type); ``norm_offset``: the prologue's factor is
    ``norm_offset + weight`` in fp32, formed in registers (a Gemma norm's weight as it is);
    ``glu``: the GLU product's activation (triton_glu.ACTIVATIONS) over a stacked [gate; up]
    weight, the output N / 2 columns wide; ``route``: (top k, renormalise, the weights' dtype,
    the ids' and the weights' 16-byte alignment) of a router's routing in the epilogue (what
    the kernel is compiled for: a plan's launch reuses its kernel unchecked)."""

    norm_eps: float | None = None
    norm_aligned: bool = True
    residual_ld: int | None = None
    residual_aligned: bool = True
    rope: RopeLayout | None = None
    residual_scale: float | None = None  # the residual adds y * residual_scale (Granite's residual_multiplier)
    norm_fp32: bool = False
    norm_offset: float = 0.0
    glu: str | None = None
    route: tuple | None = None
    residual2_ld: int | None = None  # a second residual added after the first (its row stride)
    residual2_aligned: bool = True
    # a second product x2 @ W2.T (+ bias2) summed in: (K2, x2's and W2's row strides, has bias2,
    # x2's, W2's and bias2's 16-byte alignment), what the kernel specialises on
    second: tuple | None = None


_NO_FUSION = Fusion()


# ----------------------------------------------------------------------------- launch arguments
#
# _splitk_kernel takes its arguments in groups, all the pointers first, then the integers in
# the same group order:
#
#   group      pointers (per call)               integers (per plan: TritonPlan.scalars)
#   GEMM       x, w, bias, out                   M, N, K, ldx, ldw, ldo
#   split      ws (workspace), cnt (counters)    k_per_split
#   NORM       nw (the norm weight)              inv_k, eps
#   RESIDUAL   res, res2                         ldr, res_scale, ldr2
#   ROPE       cos, sin, keys, values, base,     seq, cos/sin strides, keys/values strides,
#              q_norm, k_norm                    q_cols, v_start, cache_len, rope_tiles, qk_eps
#   FP8        sc (W's scales)                   lds (block scales' row stride)
#   ROUTE      ids, rw (the routing's outputs)
#   SECOND     x2, w2, bias2                     K2, ldx2, ldw2, splits1
#
# A pointer the call does not use (no bias, no split, a fusion not asked for) gets a stand-in,
# ``out`` (the workspace for the counters of a two-launch split): the constexprs (HAS_BIAS,
# MODE, NORM, RESIDUAL, ROPE, KV, QK_NORM, WSCALE) keep the kernel from touching it.

_NO_ROPE_SCALARS = (1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0)  # ROPE's scalars without it: one specialisation


def _fusion_pointers(unused, norm: tuple | None = None, residual=None, rope: RotaryCache | None = None,
                     weight_scale=None, route: tuple | None = None, residual2=None,
                     second: tuple | None = None) -> tuple:
    """The pointers of the NORM, RESIDUAL, ROPE, FP8, ROUTE and SECOND groups for a call's ``norm=(weight, eps[,
    offset])``, ``residual`` and ``residual2``, ``rope``, ``weight_scale``, ``route`` and ``second``
    (``unused`` standing in for each one it does not take)."""
    if rope is None:
        rope_ptrs = (unused,) * 7
    else:
        cache = (unused,) * 3 if rope.keys is None else (rope.keys, rope.values, rope.base)  # rotary only: no cache
        norms = (unused,) * 2 if rope.q_norm is None else (rope.q_norm, rope.k_norm)
        rope_ptrs = (rope.cos, rope.sin, *cache, *norms)
    return (unused if norm is None else norm[0], unused if residual is None else residual,
            unused if residual2 is None else residual2, *rope_ptrs,
            unused if weight_scale is None else weight_scale, *((unused,) * 2 if route is None else route[:2]),
            *((unused,) * 3 if second is None else (second[0], second[1], unused if second[2] is None else second[2])))


_FUSION_POINTERS = len(_fusion_pointers(None))  # what a call without fusions passes ``unused`` for


def _row_stride(t: torch.Tensor | None) -> int | None:
    return None if t is None else (t.stride(0) if t.shape[0] > 1 else t.shape[1])  # (one row: never used)


def fusion_of(norm: tuple | None, residual: torch.Tensor | None, rope: RopeLayout | None = None,
              residual_scale: float | None = None, glu: str | None = None, route: tuple | None = None,
              residual2: torch.Tensor | None = None, second: tuple | None = None) -> Fusion:
    """The :class:`Fusion` of a call's ``norm=(weight, eps[, offset])``, ``residual``,
    ``residual_scale``, ``glu``, ``route=(ids, weights, renormalize)``, ``residual2`` and
    ``second=(x2, weight2, bias2)`` arguments and its checked rotary layout."""
    if norm is None and residual is None and rope is None and glu is None and route is None and residual2 is None \
            and second is None:
        return _NO_FUSION
    return Fusion(None if norm is None else float(norm[1]), norm is None or norm[0].data_ptr() % 16 == 0,
                  _row_stride(residual), residual is None or residual.data_ptr() % 16 == 0, rope,
                  None if residual_scale is None else float(residual_scale),
                  norm is not None and norm[0].dtype == torch.float32,
                  float(norm[2]) if norm is not None and len(norm) == 3 else 0.0, glu,
                  None if route is None else (route[0].shape[1], bool(route[2]), route[1].dtype,
                                              route[0].data_ptr() % 16 == 0, route[1].data_ptr() % 16 == 0),
                  _row_stride(residual2), residual2 is None or residual2.data_ptr() % 16 == 0,
                  None if second is None else _second_key(*second))


def _second_key(x2: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None) -> tuple:
    return (x2.shape[1], _row_stride(x2), _row_stride(w2), b2 is not None, x2.data_ptr() % 16 == 0,
            w2.data_ptr() % 16 == 0, b2 is None or b2.data_ptr() % 16 == 0)


def _make_plan(key, x, weight, bias, out, act, tf32) -> TritonPlan:
    config, fusion, weight_format = key
    found = plan_problem(config, x, weight, bias, out, act, tf32, weight_format, fusion.glu is not None)
    if found is None:
        return TritonPlan(x.device, empty=True)
    problem, facts = found
    m, n, k, split = problem.m, problem.n, problem.k, config.split_k
    blocks = weight_format == FORMAT_OF["block128"]  # each split starts on a 128-column scale block
    extent = split_extent(k, max(config.block_k, fp8.BLOCK) if blocks else config.block_k, split)
    second = fusion.second  # (_second_key) its splits follow x @ W.T's, of the same extent
    if second is not None:
        extent = max(extent, config.block_k)  # (K = 0: the second product's splits still cover K2)
    splits = split if second is None else split + triton.cdiv(second[0], extent)
    two = splits > split
    grid = (triton.cdiv(n, config.block_n), splits, triton.cdiv(m, config.block_m))
    # with a second product the splits' sums are added in one launch where the config has one
    # split of its own (its two-launch reduction would be a launch more than the plain GEMM)
    mode = 0 if splits == 1 else (2 if config.fused_reduce or (two and split == 1) else 1)
    pdl = pdl_enabled(facts.capability)
    launch_opts = dict(launch_pdl=True) if pdl else {}
    norm, residual, residual2 = fusion.norm_eps is not None, fusion.residual_ld is not None, \
        fusion.residual2_ld is not None
    rope = fusion.rope
    prefetch = prefetch_elements(pdl, problem.align_w, problem.ldw, extent, problem.w_itemsize,
                                 config.block_k * config.num_stages)
    if two and not (second[5] and prefetch_elements(pdl, 16, second[2], extent, problem.w_itemsize, 1)):
        prefetch = 0  # (W2's rows must start on 16 bytes too)
    meta = dict(plan_meta(config, problem, act, bias is not None), MODE=mode, NORM=norm,
                RESIDUAL=residual and mode != 1, ROPE=rope is not None, KV=rope is not None and rope.kv,
                HD=rope.head_dim if rope is not None else 2, QK_NORM=rope is not None and rope.qk_norm,
                QK_FACTOR=rope is not None and rope.qk_factor, QK_OFFSET=rope.qk_offset if rope is not None else 0.0,
                QK_AFTER=rope is not None and rope.qk_after_rotary,
                RES_SCALED=fusion.residual_scale is not None, PDL=pdl, NW_OFFSET=fusion.norm_offset,
                WSCALE=_WSCALE[weight_format],
                WINT=bool(weight_format) and integer_conversion(x.dtype),
                GLU=GLU_CODES[fusion.glu] if fusion.glu is not None else 0,
                PREFETCH=prefetch,
                ROUTE=fusion.route[0] if fusion.route else 0,
                ROUTE_KP=next_pow2(fusion.route[0]) if fusion.route else 1,
                RENORMALIZE=bool(fusion.route and fusion.route[1]),
                FIXUP=fixup_group(config.block_m, config.block_n, config.num_warps, splits),
                ROT=(rope.rot or rope.head_dim) if rope is not None else 2, QG=rope.group if rope is not None else 0,
                PAIRS=rope is not None and rope.pairs, RES2=residual2 and mode != 1, TWO=two,
                HAS_BIAS2=second is not None and second[3], **launch_opts)
    if two and second[0] % config.block_k:
        meta["EVEN_K"] = False
    # the integer groups (see "launch arguments")
    gemm_ints = (m, n, k, problem.ldx, problem.ldw, problem.ldo)
    split_ints = (extent,)
    norm_ints = (1.0 / max(k, 1), fusion.norm_eps or 0.0)  # inv_k: fp32(1/K), as triton_rmsnorm computes the mean
    residual_ints = (fusion.residual_ld if residual else problem.ldo,
                     1.0 if fusion.residual_scale is None else fusion.residual_scale,
                     fusion.residual2_ld if residual2 else problem.ldo)
    rope_ints = _NO_ROPE_SCALARS if rope is None else rope.scalars(config.block_n)
    second_ints = (second[0], second[1], second[2], split) if two else (0, 0, 0, splits)
    reduce = None
    if mode == 1:
        block = min(1024, next_pow2(n))
        reduce = Launcher(_reduce_kernel, (triton.cdiv(n, block), m),
                          dict(BLOCK=block, HAS_BIAS=bias is not None, ACT=ACT_CODE[act], NORM=norm,
                               RESIDUAL=residual, RES_SCALED=fusion.residual_scale is not None, PDL=pdl,
                               RES2=residual2, HAS_BIAS2=second is not None and second[3], num_warps=4,
                               **launch_opts))
    # the norm's sums of squares after the partials: [S, M] (MODE 1) or [tiles, S, BM] (MODE 2)
    ss_numel = (splits * m if mode == 1 else grid[0] * grid[2] * splits * config.block_m) if norm and splits > 1 else 0
    return TritonPlan(
        x.device, Launcher(_splitk_kernel, grid, meta),
        scalars=gemm_ints + split_ints + norm_ints + residual_ints + rope_ints + (triton.cdiv(k, fp8.BLOCK),)
        + second_ints,
        ws_numel=splits * m * n + ss_numel if splits > 1 else 0,
        counters=grid[0] * grid[2] if mode == 2 else 0,
        reduce=reduce, reduce_scalars=(m, n, problem.ldo, *residual_ints, splits, *norm_ints),
    )


# Plans per (config, activation, tf32, operand layout): launchers (grids, constexprs), scalar
# arguments and scratch sizes, so a repeated call does none of that work.
_PLANS = PlanCache(_make_plan)


def run(
    config: TritonSplitKConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    activation: Activation | str | None = None,
    *,
    tf32: bool = False,
    norm: tuple | None = None,
    residual: torch.Tensor | None = None,
    rope: RotaryCache | None = None,
    counters: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    residual_scale: float | None = None,
    glu: str | None = None,
    route: tuple | None = None,
    residual2: torch.Tensor | None = None,
    second: tuple | None = None,
) -> torch.Tensor:
    """``out[:] = act(rmsnorm(x) @ weight.T + bias) + residual`` with ``config``; returns ``out``.

    ``norm=(g, eps)``: x is first normalised as Hugging Face's Llama-style RMSNorm does it
    (``g`` x's dtype, K elements); ``norm=(g, eps, offset)``: by the factor ``offset + g`` in
    fp32 (Gemma's norm: offset 1), formed in the kernel's registers; ``residual`` (like
    ``out``): added after the rounding to the output dtype, as ``residual + linear(...)`` adds
    it (``residual_scale``: ``residual + linear(...) * residual_scale``, each product rounded as
    Granite's layers compute it). ``rope``: x @ W.T is a Q/K/V
    projection whose q and k heads get the rotary embedding, and whose k and v heads are also
    written to a static KV cache when it holds one (``triton_rope``; not with an activation,
    a residual or the two-launch reduction; with q/k norms in ``rope``, tiles of one whole
    head: a config of other ``block_n`` runs with ``block_n = head_dim``, see
    ``_whole_head_config``). Any may be None (plain GEMM). ``counters``: a
    zeroed int32 tensor on x's device for the fused reduction's arrival counters in compiled
    regions (left zero; not to be shared with a launch running at the same time), instead of
    a zero-filled one per call; eager calls use their stream's. ``weight_scale``: ``weight`` is
    e4m3 and these are its fp32 scales, (N,) per channel or (N/128, K/128) per block, contiguous
    (kernels/fp8.py; x and out bf16/fp16). ``glu`` ("silu", "gelu_tanh" or "gelu"): ``weight`` is
    a stacked [gate; up] (N even) and ``out`` (M, N / 2) gets ``glu(gate) * up`` with the
    roundings of transformers' GLU (each GEMM output, then the activation, rounded to out's
    dtype; triton_glu.tl_rounded_glu), as :func:`hybridgemm.gated_linear` computes it; not with
    an activation, a residual, rope or the two-launch reduction. ``route=(ids, weights,
    renormalize)``: ``weight`` is a softmax-top-k router's (N experts, one tile of ``block_n``
    holding all of them: :func:`route_config`); besides the logits in ``out``, each token's top
    ``k`` experts (ids int64 [M, k], contiguous) and their probabilities (weights [M, k] fp32,
    bf16 or fp16; renormalised to sum 1 if asked) are written, from the logits as rounded to
    out's dtype (kernels/triton_router.py's routing); not with a residual, rope, glu, an
    activation or the two-launch reduction. ``residual2`` (like ``out``, with a ``residual`` and no
    ``residual_scale``): added to the rounded ``residual + linear(...)``, rounded again, as a
    parallel-residual layer's ``(mlp + a) + x`` rounds it. ``second=(x2, weight2, bias2)`` (x's dtype;
    x2 [M, K2], weight2 [N, K2], bias2 None or N): ``x2 @ weight2.T + bias2`` is added to the
    product in fp32 before the bias, activation and residuals, in the same launch: its K is
    split in ``config``'s extent per split after x @ weight.T's splits, and the sum taken in
    split order as for one GEMM (a parallel-residual layer's attention output projection and
    MLP down projection in one launch); not with a norm, rope, glu, route or an FP8 weight.
    Deterministic for a fixed config. ``tf32`` (fp32 inputs) allows TF32 tensor cores.
    Raises ValueError/TypeError naming the problem when operands or config do not fit.
    """
    if norm is not None or residual is not None:
        check_fusion(x, out, norm, residual, "triton_splitk")
    if residual2 is not None:
        if residual is None or residual_scale is not None:
            raise ValueError("triton_splitk: residual2 comes with a residual and no residual_scale")
        check_fusion(x, out, None, residual2, "triton_splitk residual2")
    if residual_scale is not None and (residual is None or not isinstance(residual_scale, (int, float))
                                       or isinstance(residual_scale, bool) or not math.isfinite(residual_scale)):
        raise ValueError("triton_splitk: residual_scale must be a finite number and comes with a residual")
    layout = None
    weight_format = "" if weight_scale is None else _scale_format(weight, weight_scale)
    if rope is not None:
        check_operands(x, weight, bias, out, weight_format)
        config = rope_config(config, rope, x, weight)
        layout = rope_layout(rope, x, out, config.block_n, "triton_splitk")
        if residual is not None or parse_activation(activation) != Activation.NONE:
            raise ValueError("triton_splitk: rope takes no residual and no activation")
        _check_single_pass(config, "rope")
    if glu is not None:
        _check_glu(config, glu, residual, rope, activation)
    if route is not None:
        _check_route(config, route, x, weight, out, residual, rope, glu, activation)
    if second is not None:
        _check_second(config, second, out, norm, rope, glu, route, weight_format)
    plan = _PLANS.plan((config, fusion_of(norm, residual, layout, residual_scale, glu, route, residual2, second),
                        weight_format), x, weight, bias, out, activation, tf32)
    if plan.empty:
        return out
    if counters is not None and (counters.dtype != torch.int32 or counters.device != out.device
                                 or not counters.is_contiguous()):
        raise ValueError("triton_splitk: counters must be a contiguous int32 tensor on the output's device")
    b = out if bias is None else bias  # the stand-in pointers: see "launch arguments"
    ws, cnt = plan_scratch(plan, out, counters)
    plan.launch(x, weight, b, out, ws, cnt,
                *_fusion_pointers(out, norm, residual, rope, weight_scale, route, residual2, second), *plan.scalars)
    if plan.reduce is not None:
        b2 = out if second is None or second[2] is None else second[2]
        plan.reduce(ws, b, out, out if residual is None else residual, out if residual2 is None else residual2, b2,
                    *plan.reduce_scalars)
    return out


def _check_glu(config: TritonSplitKConfig, glu, residual, rope, activation) -> None:
    if not isinstance(glu, str) or glu not in GLU_CODES:
        raise ValueError(f"triton_splitk: glu must be one of {sorted(GLU_CODES)}, got {glu!r}")
    if residual is not None or rope is not None or parse_activation(activation) != Activation.NONE:
        raise ValueError("triton_splitk: glu takes no residual, no rope and no activation")
    _check_single_pass(config, "glu")


def _check_second(config: TritonSplitKConfig, second, out, norm, rope, glu, route, weight_format: str) -> None:
    if not (isinstance(second, tuple) and len(second) == 3):
        raise TypeError("triton_splitk: second must be (x2, weight2, bias2)")
    x2, w2, b2 = second
    if norm is not None or rope is not None or glu is not None or route is not None or weight_format:
        raise ValueError("triton_splitk: second takes no norm, rope, glu, route or FP8 weight")
    # the operand checks of x2 @ weight2.T + bias2 into out, and the config's tiles on that problem
    # (its splits are counted in the first product's extent: _make_plan)
    # (out has x's rows and dtype: so has x2 once these pass)
    plan_problem(dataclasses.replace(config, split_k=1, fused_reduce=False), x2, w2, b2, out, Activation.NONE, False)


def _check_single_pass(config: TritonSplitKConfig, what: str) -> None:
    """An epilogue that needs a tile's whole sum in one program: no two-launch reduction."""
    if config.split_k > 1 and not config.fused_reduce:
        raise ValueError(f"triton_splitk: {what} needs split_k == 1 or the fused reduction (fused_reduce=True)")


_ROUTE_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16)


def _check_route(config: TritonSplitKConfig, route, x, weight, out, residual, rope, glu, activation) -> None:
    if not (isinstance(route, tuple) and len(route) == 3 and all(isinstance(t, torch.Tensor) for t in route[:2])):
        raise TypeError("triton_splitk: route must be (ids, weights, renormalize)")
    ids, weights, _ = route
    m, n = x.shape[0], weight.shape[0]
    if residual is not None or rope is not None or glu is not None or parse_activation(activation) != Activation.NONE:
        raise ValueError("triton_splitk: route takes no residual, rope, glu or activation")
    if ids.dim() != 2 or ids.shape[0] != m or not 1 <= ids.shape[1] <= min(n, MAX_TOP_K):
        raise ValueError(f"triton_splitk: route ids must be [M={m}, k] with k in 1..{min(n, MAX_TOP_K)}, "
                         f"got {tuple(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"triton_splitk: route weights must have the ids' shape {tuple(ids.shape)}, "
                         f"got {tuple(weights.shape)}")
    if ids.dtype != torch.int64 or weights.dtype not in _ROUTE_WEIGHTS:
        raise TypeError("triton_splitk: route ids must be int64 and weights fp32, bf16 or fp16")
    if not (ids.is_contiguous() and weights.is_contiguous()) or ids.device != out.device \
            or weights.device != out.device:
        raise ValueError("triton_splitk: route ids and weights must be contiguous, on the output's device")
    if n > config.block_n or n > MAX_ROUTE_EXPERTS:
        raise ValueError(f"triton_splitk: route needs all {n} experts in one tile (block_n {config.block_n}; "
                         f"at most {MAX_ROUTE_EXPERTS})")
    _check_single_pass(config, "route")


def rope_config(config: TritonSplitKConfig, rope: RotaryCache, x: torch.Tensor,
                weight: torch.Tensor) -> TritonSplitKConfig:
    """The config :func:`run` launches for ``rope``: ``config``, or with q/k norms in ``rope``
    its whole-head form (``_whole_head_config``)."""
    if getattr(rope, "q_norm", None) is not None and config.block_n != rope.head_dim:
        return _whole_head_config(config, rope.head_dim, x.shape[1], x.element_size(), weight.element_size())
    return config


def _scale_format(weight: torch.Tensor, weight_scale: torch.Tensor) -> str:
    """The weight format ``weight_scale`` states for ``weight`` (FP8FormatError if none), the
    scales contiguous as the kernel reads them."""
    if not isinstance(weight_scale, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("triton_splitk: weight and weight_scale must be tensors")
    granularity = fp8.granularity_of(weight, weight_scale)
    if weight_scale.dim() != (1 if granularity == "channel" else 2) or not weight_scale.is_contiguous():
        raise ValueError("triton_splitk: weight_scale must be contiguous, (N,) per channel or (N/128, K/128) "
                         "per block (kernels/fp8.py scale_vector)")
    return FORMAT_OF[granularity]


def bind(config: TritonSplitKConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor, activation: Activation | str | None = None, *, tf32: bool = False,
         norm: tuple | None = None, residual: torch.Tensor | None = None,
         residual_scale: float | None = None, residual2: torch.Tensor | None = None):
    """``fn(xp, wp, bp, op, gp=0, rp=0, r2p=0)``: :func:`run` for operands of exactly this signature
    (dtypes, shapes, strides, device, 16-byte alignment) and these fusions (``norm``'s eps,
    ``residual``'s and ``residual2``'s layouts, ``residual_scale``; no rotary, no FP8 weight) given as
    raw data pointers (``bp`` 0 without a bias; ``gp`` the norm's weight, ``rp`` and ``r2p`` the
    residuals, where the bound call had them), with no checks and no Triton Python per call. None until :func:`run`
    has launched this signature once, or where Triton offers no raw launch (interpreter)."""
    fusion = fusion_of(norm, residual, None, residual_scale, residual2=residual2)
    plan = _PLANS.plan((config, fusion, ""), x, weight, bias, out, activation, tf32, build=False)
    if plan is None or plan.empty:
        return None
    main = plan.launch.raw()
    reduce = plan.reduce.raw() if plan.reduce is not None else None
    if main is None or (plan.reduce is not None and reduce is None):
        return None
    dev, scalars, rest = x.device.index, plan.scalars, _FUSION_POINTERS - 3
    # the GEMM's and the split's pointers, then the norm's and the residuals', then op for the
    # other fusions' (see "launch arguments")
    if not plan.ws_numel:
        def launch(xp, wp, bp, op, gp=0, rp=0, r2p=0):
            main(dev, xp, wp, bp or op, op, op, op, gp or op, rp or op, r2p or op, *(op,) * rest, *scalars)
        return launch

    device, ws_numel, counters, reduce_scalars = plan.device, plan.ws_numel, plan.counters, plan.reduce_scalars

    def launch_split(xp, wp, bp, op, gp=0, rp=0, r2p=0):
        ws, cnt = split_scratch(device, ws_numel, counters)  # of dev's current stream, as main launches on
        wsp = ws.data_ptr()
        cntp = wsp if cnt is None else cnt.data_ptr()
        main(dev, xp, wp, bp or op, op, wsp, cntp, gp or op, rp or op, r2p or op, *(op,) * rest, *scalars)
        if reduce is not None:
            reduce(dev, wsp, bp or op, op, rp or op, r2p or op, op, *reduce_scalars)

    return launch_split
