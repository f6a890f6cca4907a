"""Mixture-of-experts GEMMs: every (token, expert) pair of a routing, grouped by expert or pair-major.

Routing gives each of T tokens ``top_k`` experts (``topk_ids`` [T, k]) and weights. The
S = T * k pairs (pair ``p`` is token ``p // k``, slot ``p % k``) are sorted by expert, stably
(ties in pair order), and laid out in blocks of ``block_m`` rows, each block one expert's
(:func:`align`; padding rows hold S). Then, with the experts' weights stacked as transformers
stores them (``w_gate_up`` [E, 2I, H], gate rows first; ``w_down`` [E, H, I]):

* :func:`run_gate_up`: ``inter[r] = act(x[token(r)] @ Wg[e].T) * (x[token(r)] @ Wu[e].T)`` for
  each laid-out row ``r`` of expert ``e``, x's rows read where they are (no gathered copy),
  gate and up in two fp32 accumulators of one program, rounded to x's dtype as the stock
  module rounds them (the GEMM's output, the activation, the product);
* :func:`run_down`: ``out[p] = (inter[r] @ Wd[e].T) * weight[p]``, the GEMM rounded to x's
  dtype, the product with the routing weight in fp32, stored at the pair's own row ``p`` of an
  fp32 [S, H] result, which :func:`sum_slots` sums over the k slots in slot order.

For a few pairs (decode), :func:`run_pairs` skips the layout: one launch per pair's gate/up and
one per token's down projections, summed over its slots in the program (configs of
``block_m`` 1).

Every output element is one program's fixed-order sum (no atomics, no split of K), and the
layout depends only on ``topk_ids``: results are bit-identical run to run. Programs whose
block is padding past the last expert's rows return at once. Nothing touches a GPU at import.

FP8 experts (kernels/fp8.py ``FP8Weight`` of stacked [E, N, K] e4m3 data) are read as bytes,
converted to x's dtype in registers (kernels/triton_e4m3.py) and scaled in fp32 (``WSCALE``):
per output row once the K loop is done (``channel``), or per 128 x 128 block as each K tile's
products are added (``block128``; tiles of at most 128 columns that never cross a block, and in
the pair-major kernels column blocks that never cross a 128-row block: :func:`fp8_fits`).
Block-scaled gate/up weights need I a multiple of 128 (``fp8.gate_up_blocks_problem``): a
pair-major program reads one scale per K tile for its gate columns and one for its up columns,
which holds only where each half is whole blocks (as transformers' ``FP8Experts`` stores them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import fp8
from .triton_e4m3 import integer_conversion, tl_weight_values
from .triton_glu import ACTIVATIONS, _gate_act
from .triton_launch import interpreting, pdl_options


@dataclass(frozen=True)
class TritonMoeConfig:
    block_m: int  # laid-out rows per program (the layout's block: one expert per block); 1: pair-major
    block_n: int  # output columns per program
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    mma: bool = False  # pair-major only: the tensor-core forms of the kernels (see "pair-major" below)


def pair_major(pairs: int, experts: int) -> bool:
    """Do ``pairs`` pairs over ``experts`` experts run pair-major by default? Where pairs are at
    most half the experts (decode: few experts take two pairs, and a pair-major launch streams
    an expert's weights once per pair, but needs no layout's launches) and at most 64."""
    return pairs <= 64 and 2 * pairs <= experts


# Pair-major configs, from scripts/moe_config_probe.py on the H200 (2026-12-05, cold launches,
# µs; perf/results/h200/moe_config_probe_pairs_h200.csv) at the Qwen3-30B-A3B and Mixtral-8x7B
# experts, 1 and 8 tokens. Gate/up: the tensor-core form with 16 x 256 W tiles on one warp is
# within 2.3% of the fastest config in all eight cases (bf16 and e4m3 per channel; e.g. Qwen3 at
# one token 13.9 bf16 and 10.5 e4m3, against 15.4 and 13.5 for the CUDA-core 8 x 128 tiles).
# Down: the tensor-core form runs a token's slots one after another, so at one token it has
# too few programs (Qwen3: 16.5 bf16, 20.6 e4m3) and the CUDA-core form with all slots in one
# tile wins (9.6 bf16 with 4 x 256 tiles, 8.0 e4m3 with 8 x 256); from two tokens on the
# tensor-core 16 x 128 tiles (Qwen3 at 8 tokens: 43.2 bf16 against 47.4, 28.9 e4m3 against
# 52.0). With these, 64 e4m3 pairs (Qwen3, 8 tokens) take 76.5 pair-major against 91.9 for the
# layout and the grouped launches. Block-scaled e4m3 experts take tiles 128 columns deep (fp8_fits).
_PAIR_UP = TritonMoeConfig(1, 16, 256, 1, 4, mma=True)
_PAIR_DOWN_MANY_TOKENS = TritonMoeConfig(1, 16, 128, 1, 4, mma=True)
_PAIR_DOWN_ONE_TOKEN = {"": TritonMoeConfig(1, 4, 256, 8, 2),
                        fp8.FORMAT_OF["channel"]: TritonMoeConfig(1, 8, 256, 8, 4),
                        fp8.FORMAT_OF["block128"]: TritonMoeConfig(1, 8, 128, 8, 4)}


def default_configs(pairs: int, experts: int, weight_format: str = "", *,
                    top_k: int = 1) -> tuple[TritonMoeConfig, TritonMoeConfig]:
    """(gate/up, down) configs for ``pairs`` (token, expert) pairs of ``top_k`` per token over
    ``experts`` experts: pair-major (``block_m`` 1, no layout) where :func:`pair_major` (the
    measured configs above), else one block size for both (they share the layout) by the rows an
    expert gets on average, each expert's rows padded to whole blocks. The fastest or within 5%
    of it for the Qwen3-30B-A3B and Mixtral-8x7B experts at 1, 8, 64 and 2048 tokens
    (scripts/moe_config_probe.py on the H200). Block-scaled FP8 experts (``weight_format``
    ``e4m3_block128``) take tiles 128 columns deep (:func:`fp8_fits`); per-channel ones past
    48 rows an expert the 64 x 128 x 64 tiles however many rows it gets."""
    if pair_major(pairs, experts):
        block = weight_format == fp8.FORMAT_OF["block128"]
        up = dataclasses.replace(_PAIR_UP, block_k=128) if block else _PAIR_UP
        return up, _PAIR_DOWN_ONE_TOKEN[weight_format] if pairs <= top_k else _PAIR_DOWN_MANY_TOKENS
    per_expert = -(-pairs // max(experts, 1))
    if per_expert <= 8:
        both = TritonMoeConfig(16, 64, 128, 4, 3)
    elif per_expert <= 48:
        both = TritonMoeConfig(32, 64, 128, 4, 3)
    elif per_expert <= 96 or weight_format == fp8.FORMAT_OF["channel"]:
        both = TritonMoeConfig(64, 128, 64, 4, 4)
    else:
        return TritonMoeConfig(128, 128, 64, 8, 4), TritonMoeConfig(128, 256, 64, 8, 3)
    return both, both


# the kernels' WSCALE per weight format: 0 a weight of x's dtype, 1 per output row, 2 per block
_WSCALE = {"": 0, fp8.FORMAT_OF["channel"]: 1, fp8.FORMAT_OF["block128"]: 2}


def fp8_fits(config: TritonMoeConfig, weight_format: str) -> str | None:
    """Why ``config`` cannot read block-scaled FP8 experts (None: it can, or the weights are not
    block-scaled): its K tiles must not cross a 128-column block of scales, and a pair-major
    program's columns must lie in one 128-row block (one scale per program and K tile)."""
    if weight_format != fp8.FORMAT_OF["block128"]:
        return None
    if fp8.BLOCK % config.block_k:
        return f"block_k={config.block_k} crosses the {fp8.BLOCK}-column blocks of the scales"
    if config.block_m == 1 and fp8.BLOCK % config.block_n:
        return f"block_n={config.block_n} crosses the {fp8.BLOCK}-row blocks of the scales (pair-major)"
    return None


@dataclass(frozen=True)
class Operand:
    """A stacked expert weight as the kernels take it: ``data`` [E, N, K] (x's dtype or e4m3),
    ``scale`` (the data itself where there are none: never read), the format's ``WSCALE`` and
    the scales' strides per expert and per row."""

    data: torch.Tensor
    scale: torch.Tensor
    wscale: int
    lse: int
    lsn: int
    dtype: torch.dtype  # the dtype the products are computed and rounded in

    @property
    def weight_format(self) -> str:
        return next(fmt for fmt, mode in _WSCALE.items() if mode == self.wscale)


def operand(w) -> Operand:
    """:class:`Operand` of a stacked weight tensor or a stacked ``fp8.FP8Weight``."""
    if isinstance(w, fp8.FP8Weight):
        if w.experts is None:
            raise ValueError(f"moe: an FP8 expert weight must be stacked [E, N, K], got {tuple(w.shape)}")
        sc = w.scale
        return Operand(w.data, sc, _WSCALE[w.weight_format], sc.stride(0), sc.stride(1) if sc.dim() == 3 else 0,
                       w.dtype)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"moe: expert weights must be tensors or FP8Weights, got {type(w).__name__}")
    if w.dtype == fp8.E4M3:
        raise ValueError("moe: e4m3 expert weights need their scales: pass a kernels.fp8.FP8Weight "
                         "(hybridgemm.quantize_fp8, or FP8Weight.from_tensors for a checkpoint's)")
    return Operand(w, w, 0, 0, 0, w.dtype)


@dataclass(frozen=True)
class Layout:
    """Pairs laid out by expert in blocks (:func:`align`): ``rows`` [R] pair ids (S for
    padding), ``block_expert`` [R / block_m] the expert of each block (E past the last)."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    pairs: int
    block_m: int


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Layout:
    """The block layout of the pairs of ``topk_ids`` [T, k] (int, values in [0, E)), on its
    device, of a size that depends only on T, k, E and ``block_m`` (CUDA-graph friendly).
    On CUDA (and under the interpreter) two Triton launches, :func:`align_torch` elsewhere."""
    if not (topk_ids.is_cuda or interpreting()):
        return align_torch(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).contiguous()
    s = flat.numel()
    chunks = triton.cdiv(s, ALIGN_CHUNK)
    ep = triton.next_power_of_2(num_experts)
    counts = torch.empty((chunks, ep), dtype=torch.int32, device=flat.device)
    _moe_count_kernel[(chunks,)](flat, counts, s, EP=ep, CHUNK=ALIGN_CHUNK)
    cap = _layout_rows(s, num_experts, block_m)
    rows = torch.full((cap,), s, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty((cap // block_m,), dtype=torch.int32, device=flat.device)
    _moe_place_kernel[(chunks,)](flat, counts, rows, block_expert, s, num_experts, chunks, cap // block_m, block_m,
                                 EP=ep, CHUNK=ALIGN_CHUNK, CT=32, BT=64, num_warps=8)
    return Layout(rows, block_expert, s, block_m)


def align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Layout:
    """:func:`align` in PyTorch ops (the reference the Triton launches are tested against)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    s = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)  # pair ids by expert, ties in pair order
    expert_of = flat[order]
    # each expert's first position in `order` and its count, by search (no bincount: its size
    # would depend on the values, a host sync)
    bounds = torch.searchsorted(expert_of, torch.arange(num_experts + 1, device=dev))
    first = bounds[:-1]
    counts = bounds[1:] - first
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    dest = (padded_end - padded)[expert_of] + torch.arange(s, device=dev) - first[expert_of]
    cap = _layout_rows(s, num_experts, block_m)
    rows = torch.full((cap,), s, dtype=torch.int32, device=dev)
    rows[dest] = order.to(torch.int32)
    starts = torch.arange(0, cap, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return Layout(rows, block_expert, s, block_m)


def _layout_rows(pairs: int, num_experts: int, block_m: int) -> int:
    # at most min(E, S) experts hold pairs, each padded by fewer than block_m rows
    return -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m


# pairs per program of the layout's launches
ALIGN_CHUNK = 128


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, S, EP: tl.constexpr, CHUNK: tl.constexpr):
    # counts[c, e]: the pairs of chunk c routed to expert e
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < S
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    hist = tl.histogram(ids, EP)
    experts = tl.arange(0, EP)
    hist -= tl.where(experts == 0, CHUNK - tl.sum(ok.to(tl.int32), axis=0), 0)  # the masked lanes counted as 0
    tl.store(counts_ptr + c * EP + experts, hist)


@triton.jit
def _moe_place_kernel(ids_ptr, counts_ptr, rows_ptr, block_expert_ptr, S, E, C, NB, BLOCK_M, EP: tl.constexpr,
                      CHUNK: tl.constexpr, CT: tl.constexpr, BT: tl.constexpr):
    # chunk c's pairs to their rows: expert e's rows start at its padded offset, then the
    # pairs of e in earlier chunks, then those earlier in this chunk (a stable order)
    c = tl.program_id(0)
    experts = tl.arange(0, EP)
    total = tl.zeros((EP,), dtype=tl.int32)
    before = tl.zeros((EP,), dtype=tl.int32)
    for c0 in range(0, C, CT):
        cr = c0 + tl.arange(0, CT)
        cnt = tl.load(counts_ptr + cr[:, None] * EP + experts[None, :], mask=(cr < C)[:, None], other=0)
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where((cr < c)[:, None], cnt, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    start = padded_end - padded + before
    i = tl.arange(0, CHUNK)
    offs = c * CHUNK + i
    ok = offs < S
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    dest = tl.sum(tl.where(ids[:, None] == experts[None, :], start[None, :], 0), axis=1) + rank
    tl.store(rows_ptr + dest, offs, mask=ok)
    # each block's expert: the experts whose padded rows end at or before the block's first row
    ends = tl.where(experts < E, padded_end, 2147483647)
    for b0 in range(c * BT, NB, C * BT):
        b = b0 + tl.arange(0, BT)
        expert_of = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, expert_of, mask=b < NB)


@triton.jit
def _moe_kernel(x_ptr, w_ptr, sc_ptr, out_ptr, rows_ptr, expert_ptr, rw_ptr, S, N, K, top_k, ldx, lde, ldw, lse, lsn,
                ldo, n_gate, num_experts, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GLU: tl.constexpr,
                ACT: tl.constexpr, PREC: tl.constexpr, ROUND_PRODUCT: tl.constexpr, WSCALE: tl.constexpr,
                WINT: tl.constexpr):
    # GLU: x rows are tokens (row r reads x[rows[r] // top_k]); two accumulators over W rows n
    # and n_gate + n; out row r. Else: x rows are the laid-out rows; out row rows[r], times the
    # routing weight rw[rows[r]], in fp32 (ROUND_PRODUCT: the product rounded to x's dtype, as
    # transformers computes it for routing weights in x's dtype). WSCALE (module docstring):
    # W e4m3 with scales sc[expert] per row (1) or per 128 x 128 block (2, row stride lsn).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    if expert >= num_experts:
        return
    offs_r = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(rows_ptr + offs_r)
    valid = pair < S
    if GLU:
        x_rows = tl.where(valid, pair // top_k, 0)
    else:
        x_rows = offs_r
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    w_base = w_ptr + expert.to(tl.int64) * lde
    rows_n = tl.where(n_ok, offs_n, 0)
    sc_base = sc_ptr + expert.to(tl.int64) * lse
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        xt = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * ldx + (k0 + offs_k)[None, :],
                     mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + rows_n[:, None] * ldw + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0)
        if WSCALE == 0:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision=PREC)
        elif WSCALE == 1:
            acc = tl.dot(xt, tl.trans(tl_weight_values(w, xt.dtype, WINT)), acc, input_precision=PREC)
        else:
            s = tl.load(sc_base + (rows_n // 128) * lsn + k0 // 128)
            acc += tl.dot(xt, tl.trans(tl_weight_values(w, xt.dtype, WINT)), input_precision=PREC) * s[None, :]
        if GLU:
            wu = tl.load(w_base + (n_gate + rows_n)[:, None] * ldw + (k0 + offs_k)[None, :], mask=k_ok[None, :],
                         other=0.0)
            if WSCALE == 0:
                acc_up = tl.dot(xt, tl.trans(wu), acc_up, input_precision=PREC)
            elif WSCALE == 1:
                acc_up = tl.dot(xt, tl.trans(tl_weight_values(wu, xt.dtype, WINT)), acc_up, input_precision=PREC)
            else:
                su = tl.load(sc_base + ((n_gate + rows_n) // 128) * lsn + k0 // 128)
                acc_up += tl.dot(xt, tl.trans(tl_weight_values(wu, xt.dtype, WINT)),
                                 input_precision=PREC) * su[None, :]
    if WSCALE == 1:
        acc = acc * tl.load(sc_base + rows_n)[None, :]
        if GLU:
            acc_up = acc_up * tl.load(sc_base + n_gate + rows_n)[None, :]
    dt = out_ptr.dtype.element_ty
    if GLU:
        gate = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(x_ptr.dtype.element_ty).to(tl.float32)
        act = _gate_act(gate, ACT).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = act * up
        out_rows = offs_r
        mask = n_ok[None, :] & (offs_r[:, None] >= 0)
    else:
        routing = tl.load(rw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        y = acc.to(x_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]
        if ROUND_PRODUCT:
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        out_rows = tl.where(valid, pair, 0)
        mask = n_ok[None, :] & valid[:, None]
    tl.store(out_ptr + out_rows[:, None].to(tl.int64) * ldo + offs_n[None, :], y.to(dt), mask=mask)


# ----------------------------------------------------------------------------- pair-major (decode)
# One program per (pair, column block) for gate/up and per (token, column block) for down, no
# layout: each pair streams its expert's weight rows once, dot products on the CUDA cores (an
# fp32 partial-sum tile per program, reduced along K once at the end, so the order of every
# sum is fixed by the config). Down also sums the token's k slots, in the program.
# PDL (programmatic dependent launch, triton_launch.pdl_enabled): nothing is read or written
# before the wait, and once a program's loop is done the next grid may get ready, so the
# boundary between gate/up and down overlaps the gate/up epilogue.

@triton.jit
def _moe_pair_glu_kernel(x_ptr, w_ptr, sc_ptr, ids_ptr, out_ptr, N, K, top_k, ldx, lde, ldw, lse, lsn, ldo, n_gate,
                         BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
                         WSCALE: tl.constexpr, WINT: tl.constexpr):
    # WSCALE 2: the program's BN rows lie in one 128-row block (fp8_fits), so each K tile has one
    # scale for the gate rows and one for the up rows, applied to x's values
    if PDL:
        gdc_wait()
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // top_k).to(tl.int64) * ldx
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    rows_n = tl.where(n_ok, offs_n, 0)
    offs_k = tl.arange(0, BK)
    w_gate = w_ptr + expert * lde + rows_n[:, None] * ldw
    w_up = w_gate + n_gate * ldw
    dt = x_ptr.dtype.element_ty
    sc_base = sc_ptr + expert * lse
    sc_gate = sc_base + (pid_n * BN // 128) * lsn
    sc_up = sc_base + ((n_gate + pid_n * BN) // 128) * lsn
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    acc_up = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        xv = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        wg = tl.load(w_gate + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0)
        wu = tl.load(w_up + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0)
        if WSCALE == 0:
            acc += wg.to(tl.float32) * xv
            acc_up += wu.to(tl.float32) * xv
        elif WSCALE == 1:
            acc += tl_weight_values(wg, dt, WINT).to(tl.float32) * xv
            acc_up += tl_weight_values(wu, dt, WINT).to(tl.float32) * xv
        else:
            acc += tl_weight_values(wg, dt, WINT).to(tl.float32) * (xv * tl.load(sc_gate + k0 // 128))
            acc_up += tl_weight_values(wu, dt, WINT).to(tl.float32) * (xv * tl.load(sc_up + k0 // 128))
    if PDL:
        gdc_launch_dependents()
    gate = tl.sum(acc, axis=1)
    up = tl.sum(acc_up, axis=1)
    if WSCALE == 1:
        gate = gate * tl.load(sc_base + rows_n)
        up = up * tl.load(sc_base + n_gate + rows_n)
    gate = gate.to(dt).to(tl.float32)
    up = up.to(dt).to(tl.float32)
    act = _gate_act(gate, ACT).to(dt).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * ldo + offs_n, (act * up).to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_pair_down_kernel(inter_ptr, w_ptr, sc_ptr, ids_ptr, rw_ptr, out_ptr, N, K, ldi, lde, ldw, lse, lsn, ldo,
                          TOP_K: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          ROUND_PRODUCT: tl.constexpr, PDL: tl.constexpr, WSCALE: tl.constexpr,
                          WINT: tl.constexpr):
    # all of a token's slots in one [KP, BN, BK] tile (KP: TOP_K to a power of two), so each
    # step of the K loop streams every slot's weight rows at once; WSCALE 2: one scale per slot
    # and K tile (fp8_fits), applied to inter's values
    if PDL:
        gdc_wait()
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, KP)
    s_ok = slots < TOP_K
    p = t * TOP_K + slots
    experts = tl.load(ids_ptr + p, mask=s_ok, other=0).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    rows_n = tl.where(n_ok, offs_n, 0)
    offs_k = tl.arange(0, BK)
    w_rows = w_ptr + experts[:, None, None] * lde + rows_n[None, :, None] * ldw
    i_rows = inter_ptr + p.to(tl.int64)[:, None] * ldi
    dt = inter_ptr.dtype.element_ty
    sc_rows = sc_ptr + experts * lse
    sc_blocks = sc_rows + (pid_n * BN // 128) * lsn
    acc = tl.zeros((KP, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        iv = tl.load(i_rows + (k0 + offs_k)[None, :], mask=s_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + (k0 + offs_k)[None, None, :], mask=s_ok[:, None, None] & k_ok[None, None, :], other=0.0)
        if WSCALE == 0:
            acc += w.to(tl.float32) * iv[:, None, :]
        elif WSCALE == 1:
            acc += tl_weight_values(w, dt, WINT).to(tl.float32) * iv[:, None, :]
        else:
            s = tl.load(sc_blocks + k0 // 128, mask=s_ok, other=0.0)
            acc += tl_weight_values(w, dt, WINT).to(tl.float32) * (iv * s[:, None])[:, None, :]
    if PDL:
        gdc_launch_dependents()
    routing = tl.load(rw_ptr + p, mask=s_ok, other=0.0).to(tl.float32)
    y = tl.sum(acc, axis=2)
    if WSCALE == 1:
        y = y * tl.load(sc_rows[:, None] + rows_n[None, :], mask=s_ok[:, None], other=0.0)
    y = y.to(dt).to(tl.float32) * routing[:, None]
    if ROUND_PRODUCT:
        y = y.to(dt).to(tl.float32)
    total = tl.sum(y, axis=0)  # padded slots add zeros
    tl.store(out_ptr + t.to(tl.int64) * ldo + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


# The tensor-core forms (configs with ``mma``): the same programs, each K tile's products by
# ``tl.dot`` with the weight tile as the MMA's first operand ([BN, BK] rows of W) and the one
# x row as its second (Triton pads that side to 8 rows), as the split-K kernel runs M = 1
# (kernels/triton_splitk.py). An e4m3 tile is converted once, then multiplied and summed along
# K by the tensor cores, where the CUDA-core forms spend a multiply-add and a share of the
# final reduction on every weight value. Down runs the token's slots one after another, each
# slot's GEMM rounded and weighted as above, summed in slot order.

@triton.jit
def _moe_pair_glu_mma_kernel(x_ptr, w_ptr, sc_ptr, ids_ptr, out_ptr, N, K, top_k, ldx, lde, ldw, lse, lsn, ldo,
                             n_gate, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
                             PDL: tl.constexpr, WSCALE: tl.constexpr, WINT: tl.constexpr):
    if PDL:
        gdc_wait()
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // top_k).to(tl.int64) * ldx
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    rows_n = tl.where(n_ok, offs_n, 0)
    offs_k = tl.arange(0, BK)
    w_gate = w_ptr + expert * lde + rows_n[:, None] * ldw
    w_up = w_gate + n_gate * ldw
    dt = x_ptr.dtype.element_ty
    sc_base = sc_ptr + expert * lse
    sc_gate = sc_base + (pid_n * BN // 128) * lsn
    sc_up = sc_base + ((n_gate + pid_n * BN) // 128) * lsn
    acc = tl.zeros((BN, 1), dtype=tl.float32)
    acc_up = tl.zeros((BN, 1), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        xt = tl.trans(tl.load(x_row + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0))
        wg = tl.load(w_gate + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        wu = tl.load(w_up + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if WSCALE == 0:
            acc = tl.dot(wg, xt, acc, input_precision=PREC)
            acc_up = tl.dot(wu, xt, acc_up, input_precision=PREC)
        elif WSCALE == 1:
            acc = tl.dot(tl_weight_values(wg, dt, WINT), xt, acc, input_precision=PREC)
            acc_up = tl.dot(tl_weight_values(wu, dt, WINT), xt, acc_up, input_precision=PREC)
        else:
            acc += tl.dot(tl_weight_values(wg, dt, WINT), xt, input_precision=PREC) * tl.load(sc_gate + k0 // 128)
            acc_up += tl.dot(tl_weight_values(wu, dt, WINT), xt, input_precision=PREC) * tl.load(sc_up + k0 // 128)
    if PDL:
        gdc_launch_dependents()
    if WSCALE == 1:
        acc = acc * tl.load(sc_base + rows_n)[:, None]
        acc_up = acc_up * tl.load(sc_base + n_gate + rows_n)[:, None]
    gate = acc.to(dt).to(tl.float32)
    up = acc_up.to(dt).to(tl.float32)
    act = _gate_act(gate, ACT).to(dt).to(tl.float32)
    y = act * up
    tl.store(out_ptr + p.to(tl.int64) * ldo + offs_n[:, None], y.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _moe_pair_down_mma_kernel(inter_ptr, w_ptr, sc_ptr, ids_ptr, rw_ptr, out_ptr, N, K, ldi, lde, ldw, lse, lsn,
                              ldo, TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                              ROUND_PRODUCT: tl.constexpr, PDL: tl.constexpr, WSCALE: tl.constexpr,
                              WINT: tl.constexpr):
    if PDL:
        gdc_wait()
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    rows_n = tl.where(n_ok, offs_n, 0)
    offs_k = tl.arange(0, BK)
    dt = inter_ptr.dtype.element_ty
    total = tl.zeros((BN, 1), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # slot order
        p = t * TOP_K + slot
        expert = tl.load(ids_ptr + p).to(tl.int64)
        w_rows = w_ptr + expert * lde + rows_n[:, None] * ldw
        i_row = inter_ptr + p.to(tl.int64) * ldi
        sc_rows = sc_ptr + expert * lse
        sc_block = sc_rows + (pid_n * BN // 128) * lsn
        acc = tl.zeros((BN, 1), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = (k0 + offs_k) < K
            it = tl.trans(tl.load(i_row + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0))
            w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            if WSCALE == 0:
                acc = tl.dot(w, it, acc, input_precision=PREC)
            elif WSCALE == 1:
                acc = tl.dot(tl_weight_values(w, dt, WINT), it, acc, input_precision=PREC)
            else:
                acc += tl.dot(tl_weight_values(w, dt, WINT), it, input_precision=PREC) * tl.load(sc_block + k0 // 128)
        if WSCALE == 1:
            acc = acc * tl.load(sc_rows + rows_n)[:, None]
        y = acc.to(dt).to(tl.float32) * tl.load(rw_ptr + p).to(tl.float32)
        if ROUND_PRODUCT:
            y = y.to(dt).to(tl.float32)
        total += y
    if PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + t.to(tl.int64) * ldo + offs_n[:, None], total.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None])


def run_pairs(config: TritonMoeConfig, x: torch.Tensor, w_gate_up, w_down, topk_ids: torch.Tensor,
              routing_weights: torch.Tensor, activation: str = "silu",
              down_config: TritonMoeConfig | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] in x's dtype, pair-major (configs of ``block_m`` 1):
    :func:`pairs_gate_up` then :func:`pairs_down`. Weights: stacked tensors of x's dtype or
    stacked ``fp8.FP8Weight``s (module docstring)."""
    inter = pairs_gate_up(config, x, w_gate_up, topk_ids, activation)
    return pairs_down(down_config or config, inter, w_down, topk_ids, routing_weights)


def pairs_gate_up(config: TritonMoeConfig, x: torch.Tensor, w_gate_up, topk_ids: torch.Tensor,
                  activation: str = "silu") -> torch.Tensor:
    """``inter`` [T * k, I] in x's dtype, row ``p`` for pair ``p``: one launch for every pair."""
    w = operand(w_gate_up)
    _check_pairs(config, x, w, topk_ids)
    e, two_i, k = w.data.shape
    _check_activation(two_i, activation, w)
    i = two_i // 2
    t, top_k = topk_ids.shape
    inter = torch.empty((t * top_k, i), dtype=x.dtype, device=x.device)
    kernel, form = (_moe_pair_glu_mma_kernel, {"PREC": _precision(x)}) if config.mma else (_moe_pair_glu_kernel, {})
    kernel[(t * top_k, triton.cdiv(i, config.block_n))](
        x, w.data, w.scale, topk_ids.contiguous(), inter, i, k, top_k, x.stride(0), w.data.stride(0),
        w.data.stride(1), w.lse, w.lsn, inter.stride(0), i, BN=config.block_n, BK=config.block_k,
        ACT=ACTIVATIONS[activation], **form, **_wscale(w, x), num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_options(x))
    return inter


def pairs_down(config: TritonMoeConfig, inter: torch.Tensor, w_down, topk_ids: torch.Tensor,
               routing_weights: torch.Tensor) -> torch.Tensor:
    """[T, H] in inter's dtype: every token's down projections, each times its routing weight as
    :func:`run_down` makes it, summed over its slots in fp32 in one program (a fixed order)."""
    w = operand(w_down)
    _check_pairs(config, inter, w, topk_ids)
    t, top_k = topk_ids.shape
    rw = routing_weights.reshape(-1).contiguous()
    if inter.shape[0] != t * top_k or rw.numel() != t * top_k:
        raise ValueError(f"moe: {inter.shape[0]} rows of inter and {rw.numel()} routing weights for "
                         f"{t * top_k} pairs")
    h = w.data.shape[1]
    out = torch.empty((t, h), dtype=inter.dtype, device=inter.device)
    if config.mma:
        kernel, form = _moe_pair_down_mma_kernel, {"PREC": _precision(inter)}
    else:
        kernel, form = _moe_pair_down_kernel, {"KP": triton.next_power_of_2(top_k)}
    kernel[(t, triton.cdiv(h, config.block_n))](
        inter, w.data, w.scale, topk_ids.contiguous(), rw, out, h, w.data.shape[2], inter.stride(0),
        w.data.stride(0), w.data.stride(1), w.lse, w.lsn, out.stride(0), TOP_K=top_k, BN=config.block_n,
        BK=config.block_k, ROUND_PRODUCT=_rounds_product(inter, rw), **form, **_wscale(w, inter),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(inter))
    return out


@triton.jit
def _moe_sum_slots_kernel(src_ptr, out_ptr, H, TOP_K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    total = tl.zeros((BH,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # slot order
        total += tl.load(src_ptr + (t * TOP_K + slot).to(tl.int64) * H + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def sum_slots(per_pair: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in ``dtype``: :func:`run_down`'s fp32 [T * k, H] rows summed over each token's k
    slots in slot order in fp32, rounded once (one launch: PyTorch's sum and cast are two)."""
    s, h = per_pair.shape
    if per_pair.dtype != torch.float32 or not per_pair.is_contiguous() or s % top_k:
        raise ValueError(f"moe: sum_slots takes contiguous fp32 [T * {top_k}, H] rows, got "
                         f"{per_pair.dtype} {tuple(per_pair.shape)}")
    out = torch.empty((s // top_k, h), dtype=dtype, device=per_pair.device)
    if out.numel():
        _moe_sum_slots_kernel[(s // top_k, triton.cdiv(h, 1024))](per_pair, out, h, TOP_K=top_k, BH=1024)
    return out

def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up, w_down,
            activation: str, up: TritonMoeConfig, down: TritonMoeConfig) -> torch.Tensor:
    """The routed experts' output [T, H] in x's dtype with configs ``up`` and ``down`` (one
    ``block_m``): :func:`run_pairs` for ``block_m`` 1, else :func:`align`, :func:`run_gate_up`,
    :func:`run_down` and :func:`sum_slots`. The weights are stacked tensors of x's dtype or
    stacked ``fp8.FP8Weight``s."""
    if up.block_m != down.block_m:
        raise ValueError(f"moe: the gate/up and down configs differ in block_m ({up.block_m}, {down.block_m})")
    if up.block_m == 1:
        return run_pairs(up, x, w_gate_up, w_down, topk_ids, topk_weights, activation, down)
    k = topk_ids.shape[1]
    layout = align(topk_ids, operand(w_gate_up).data.shape[0], up.block_m)
    inter = run_gate_up(up, x, w_gate_up, layout, k, activation)
    return sum_slots(run_down(down, inter, w_down, layout, topk_weights), k, x.dtype)


def _precision(x: torch.Tensor) -> str:
    return "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _wscale(w: Operand, x: torch.Tensor) -> dict:
    """The kernels' FP8 constexprs for weight ``w`` and activations ``x``."""
    return {"WSCALE": w.wscale, "WINT": w.wscale != 0 and integer_conversion(x.dtype)}


def run_gate_up(config: TritonMoeConfig, x: torch.Tensor, w_gate_up, layout: Layout, top_k: int,
                activation: str = "silu") -> torch.Tensor:
    """``inter`` [R, I] in x's dtype for the laid-out rows (padding rows hold zeros' product)."""
    w = operand(w_gate_up)
    _check(config, layout, x, w)
    e, two_i, k = w.data.shape
    _check_activation(two_i, activation, w)
    i = two_i // 2
    out = torch.empty((layout.rows.numel(), i), dtype=x.dtype, device=x.device)
    grid = (layout.block_expert.numel(), triton.cdiv(i, config.block_n))
    _moe_kernel[grid](x, w.data, w.scale, out, layout.rows, layout.block_expert, out, layout.pairs, i, k, top_k,
                      x.stride(0), w.data.stride(0), w.data.stride(1), w.lse, w.lsn, out.stride(0), i, e,
                      BM=config.block_m, BN=config.block_n, BK=config.block_k, GLU=True,
                      ACT=ACTIVATIONS[activation], PREC=_precision(x), ROUND_PRODUCT=False, **_wscale(w, x),
                      num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def run_down(config: TritonMoeConfig, inter: torch.Tensor, w_down, layout: Layout,
             routing_weights: torch.Tensor) -> torch.Tensor:
    """``out`` [S, H] fp32: each pair's down projection (rounded to inter's dtype) times its
    routing weight, at its row; the product is rounded to inter's dtype where the weights' and
    inter's dtypes promote to a 16-bit one (transformers' ``proj_out * weights``)."""
    w = operand(w_down)
    _check(config, layout, inter, w)
    e, h, i = w.data.shape
    if inter.shape != (layout.rows.numel(), i):
        raise ValueError(f"moe: inter is {tuple(inter.shape)}, expected {(layout.rows.numel(), i)}")
    rw = routing_weights.reshape(-1)
    round_product = _rounds_product(inter, rw)
    if rw.numel() != layout.pairs:
        raise ValueError(f"moe: {rw.numel()} routing weights for {layout.pairs} pairs")
    out = torch.empty((layout.pairs, h), dtype=torch.float32, device=inter.device)
    grid = (layout.block_expert.numel(), triton.cdiv(h, config.block_n))
    _moe_kernel[grid](inter, w.data, w.scale, out, layout.rows, layout.block_expert, rw.contiguous(), layout.pairs,
                      h, i, 1, inter.stride(0), w.data.stride(0), w.data.stride(1), w.lse, w.lsn, out.stride(0), 0,
                      e, BM=config.block_m, BN=config.block_n, BK=config.block_k, GLU=False, ACT=0,
                      PREC=_precision(inter), ROUND_PRODUCT=round_product, **_wscale(w, inter),
                      num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _rounds_product(x: torch.Tensor, routing_weights: torch.Tensor) -> bool:
    return torch.promote_types(x.dtype, routing_weights.dtype) != torch.float32


def _check_activation(two_i: int, activation: str, w: Operand) -> None:
    if two_i % 2:
        raise ValueError(f"moe: w_gate_up has {two_i} rows per expert, not gate and up halves")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    why = fp8.gate_up_blocks_problem(two_i) if w.wscale == _WSCALE[fp8.FORMAT_OF["block128"]] else None
    if why:
        raise ValueError(f"moe: {why}")


def _check_pairs(config: TritonMoeConfig, x: torch.Tensor, w: Operand, topk_ids: torch.Tensor) -> None:
    if config.block_m != 1:
        raise ValueError(f"moe: the pair-major kernels take configs of block_m 1, not {config.block_m}")
    if config.mma and min(config.block_n, config.block_k) < 16:
        raise ValueError(f"moe: a tensor-core (mma) config needs block_n and block_k of at least 16, got {config}")
    _check_weights(config, x, w)
    if topk_ids.dim() != 2:
        raise ValueError(f"moe: topk_ids must be [tokens, k], got {tuple(topk_ids.shape)}")


def _check(config: TritonMoeConfig, layout: Layout, x: torch.Tensor, w: Operand) -> None:
    if config.mma:
        raise ValueError(f"moe: mma is a form of the pair-major kernels (block_m 1), not of {config}")
    if config.block_m != layout.block_m:
        raise ValueError(f"moe: config block_m {config.block_m} but the layout's blocks are {layout.block_m} rows")
    _check_weights(config, x, w)


def _check_weights(config: TritonMoeConfig, x: torch.Tensor, w: Operand) -> None:
    data = w.data
    if x.dim() != 2 or data.dim() != 3 or x.shape[1] != data.shape[2]:
        raise ValueError(f"moe: x {tuple(x.shape)} and stacked expert weights {tuple(data.shape)} do not fit "
                         "([rows, K] and [E, N, K])")
    if x.dtype != w.dtype:
        raise ValueError(f"moe: x is {x.dtype} but the expert weights compute in {w.dtype}")
    if x.stride(1) != 1 or data.stride(2) != 1 or data.stride(1) != data.shape[2]:
        raise ValueError("moe: x and the expert weights must be row-major (unit stride along K)")
    if x.device != data.device:
        raise ValueError(f"moe: x is on {x.device} but the expert weights are on {data.device}")
    why = fp8_fits(config, w.weight_format)
    if why is not None:
        raise ValueError(f"moe: config {config} cannot read block-scaled FP8 experts: {why}")


__all__ = ["ALIGN_CHUNK", "Layout", "Operand", "TritonMoeConfig", "align", "align_torch", "default_configs",
           "forward", "fp8_fits", "operand", "pair_major", "pairs_down", "pairs_gate_up", "run_down", "run_gate_up",
           "run_pairs", "sum_slots"]
