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

For a few pairs (decode), the pair-major kernels (kernels/triton_moe_pairs.py, configs of
``block_m`` 1) skip the layout: one launch for every pair's gate/up and one for every token's
down projections, summed over its slots in the program. :func:`forward` runs either form.

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_e4m3 import tl_weight_values
from .triton_epilogue import tl_add_residual
from .triton_glu import ACTIVATIONS, tl_rounded_glu
from .triton_launch import interpreting
from .triton_moe_configs import (
    Operand,
    TritonMoeConfig,
    check_activation,
    check_weights,
    default_configs,
    fp8_fits,
    input_precision,
    operand,
    pair_major,
    rounds_product,
    wscale_args,
)
from .triton_moe_pairs import check_residual, run_pairs


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
        y = tl_rounded_glu(acc, acc_up, x_ptr.dtype.element_ty, ACT)
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


@triton.jit
def _moe_sum_slots_kernel(src_ptr, out_ptr, res_ptr, H, ldr, TOP_K: tl.constexpr, BH: tl.constexpr,
                          RESIDUAL: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    total = tl.zeros((BH,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # slot order
        total += tl.load(src_ptr + (t * TOP_K + slot).to(tl.int64) * H + offs, mask=ok, other=0.0)
    if RESIDUAL:  # the rounded sum plus the token's residual row, rounded (the decoder layer's add)
        total = tl_add_residual(total, res_ptr + t.to(tl.int64) * ldr + offs, ok, out_ptr.dtype.element_ty, 1.0, False)
    tl.store(out_ptr + t.to(tl.int64) * H + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def sum_slots(per_pair: torch.Tensor, top_k: int, dtype: torch.dtype,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] in ``dtype``: :func:`run_down`'s fp32 [T * k, H] rows summed over each token's k
    slots in slot order in fp32, rounded once (one launch: PyTorch's sum and cast are two);
    ``residual`` [T, H] of ``dtype``: added to the rounded sum, as ``residual + experts(...)``."""
    s, h = per_pair.shape
    if per_pair.dtype != torch.float32 or not per_pair.is_contiguous() or s % top_k:
        raise ValueError(f"moe: sum_slots takes contiguous fp32 [T * {top_k}, H] rows, got "
                         f"{per_pair.dtype} {tuple(per_pair.shape)}")
    out = torch.empty((s // top_k, h), dtype=dtype, device=per_pair.device)
    check_residual(residual, out.shape, out)
    res = out if residual is None else residual
    if out.numel():
        _moe_sum_slots_kernel[(s // top_k, triton.cdiv(h, 1024))](per_pair, out, res, h, res.stride(0), TOP_K=top_k,
                                                                   BH=1024, RESIDUAL=residual is not None)
    return out

def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up, w_down,
            activation: str, up: TritonMoeConfig, down: TritonMoeConfig, norm: tuple | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] in x's dtype with configs ``up`` and ``down`` (one
    ``block_m``): :func:`run_pairs` for ``block_m`` 1, else :func:`align`, :func:`run_gate_up`,
    :func:`run_down` and :func:`sum_slots`. The weights are stacked tensors of x's dtype or
    stacked ``fp8.FP8Weight``s. ``residual`` [T, H]: added to the output (its rounded sum) in
    the last launch; ``norm`` = (weight, eps): x RMS-normalised in the gate/up launch, which
    the pair-major kernels take (``block_m`` 1; larger blocks refuse it)."""
    if up.block_m != down.block_m:
        raise ValueError(f"moe: the gate/up and down configs differ in block_m ({up.block_m}, {down.block_m})")
    if up.block_m == 1:
        return run_pairs(up, x, w_gate_up, w_down, topk_ids, topk_weights, activation, down, norm, residual)
    if norm is not None:
        raise ValueError(f"moe: the grouped kernels (block_m {up.block_m}) take no norm prologue; normalise x first")
    k = topk_ids.shape[1]
    layout = align(topk_ids, operand(w_gate_up).data.shape[0], up.block_m)
    inter = run_gate_up(up, x, w_gate_up, layout, k, activation)
    return sum_slots(run_down(down, inter, w_down, layout, topk_weights), k, x.dtype, residual)


def run_gate_up(config: TritonMoeConfig, x: torch.Tensor, w_gate_up, layout: Layout, top_k: int,
                activation: str = "silu") -> torch.Tensor:
    """``inter`` [R, I] in x's dtype for the laid-out rows (padding rows hold zeros' product)."""
    w = operand(w_gate_up)
    _check(config, layout, x, w)
    e, two_i, k = w.data.shape
    check_activation(two_i, activation, w)
    i = two_i // 2
    out = torch.empty((layout.rows.numel(), i), dtype=x.dtype, device=x.device)
    grid = (layout.block_expert.numel(), triton.cdiv(i, config.block_n))
    _moe_kernel[grid](x, w.data, w.scale, out, layout.rows, layout.block_expert, out, layout.pairs, i, k, top_k,
                      x.stride(0), w.data.stride(0), w.data.stride(1), w.lse, w.lsn, out.stride(0), i, e,
                      BM=config.block_m, BN=config.block_n, BK=config.block_k, GLU=True,
                      ACT=ACTIVATIONS[activation], PREC=input_precision(x), ROUND_PRODUCT=False, **wscale_args(w, x),
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
    round_product = rounds_product(inter, rw)
    if rw.numel() != layout.pairs:
        raise ValueError(f"moe: {rw.numel()} routing weights for {layout.pairs} pairs")
    out = torch.empty((layout.pairs, h), dtype=torch.float32, device=inter.device)
    grid = (layout.block_expert.numel(), triton.cdiv(h, config.block_n))
    _moe_kernel[grid](inter, w.data, w.scale, out, layout.rows, layout.block_expert, rw.contiguous(), layout.pairs,
                      h, i, 1, inter.stride(0), w.data.stride(0), w.data.stride(1), w.lse, w.lsn, out.stride(0), 0,
                      e, BM=config.block_m, BN=config.block_n, BK=config.block_k, GLU=False, ACT=0,
                      PREC=input_precision(inter), ROUND_PRODUCT=round_product, **wscale_args(w, inter),
                      num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _check(config: TritonMoeConfig, layout: Layout, x: torch.Tensor, w: Operand) -> None:
    if config.mma:
        raise ValueError(f"moe: mma is a form of the pair-major kernels (block_m 1), not of {config}")
    if config.block_m != layout.block_m:
        raise ValueError(f"moe: config block_m {config.block_m} but the layout's blocks are {layout.block_m} rows")
    check_weights(config, x, w)


__all__ = ["ALIGN_CHUNK", "Layout", "Operand", "TritonMoeConfig", "align", "align_torch", "default_configs", "forward",
           "fp8_fits", "operand", "pair_major", "run_down", "run_gate_up", "sum_slots"]
