"""Mixture-of-experts GEMMs pair-major, for a few pairs (decode): no layout, one launch for every
pair's gate/up (:func:`pairs_gate_up`) and one for every token's down projections summed over
its slots (:func:`pairs_down`); :func:`run_pairs` runs both. Configs of ``block_m`` 1
(kernels/triton_moe_configs.py ``TritonMoeConfig``; its ``mma`` picks the kernels' form). The
weights, FP8 formats, roundings and checks are those of kernels/triton_moe.py, whose
``forward`` runs these for ``block_m`` 1. Every output element is one program's fixed-order sum: results are
bit-identical run to run. Nothing touches a GPU at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .triton_e4m3 import tl_weight_values
from .triton_epilogue import tl_add_residual, tl_norm_tile_sq, tl_rstd
from .triton_glu import ACTIVATIONS, tl_rounded_glu
from .triton_launch import pdl_options
from .triton_moe_configs import (
    Operand,
    TritonMoeConfig,
    check_activation,
    check_weights,
    input_precision,
    operand,
    rounds_product,
    wscale_args,
)

# One program per (pair, column block) for gate/up and per (token, column block) for down, no
# layout: each pair streams its expert's weight rows once, dot products on the CUDA cores (an
# fp32 partial-sum tile per program, reduced along K once at the end, so the order of every
# sum is fixed by the config). Down also sums the token's k slots, in the program.
# PDL (programmatic dependent launch, triton_launch.pdl_enabled): nothing is read or written
# before the wait, and once a program's loop is done the next grid may get ready, so the
# boundary between gate/up and down overlaps the gate/up epilogue.

@triton.jit
def _pair_glu_operands(x_ptr, w_ptr, sc_ptr, ids_ptr, N, top_k, ldx, lde, ldw, lse, lsn, n_gate, BN: tl.constexpr,
                       BK: tl.constexpr):
    # what a gate/up program (pair p, column block) reads: its x row, its BN gate and up rows of
    # its expert's weight (rows past N clamped to 0, dropped at the store), BK at a time, and
    # their scales
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
    sc_base = sc_ptr + expert * lse
    sc_gate = sc_base + (pid_n * BN // 128) * lsn
    sc_up = sc_base + ((n_gate + pid_n * BN) // 128) * lsn
    return p, x_row, offs_n, n_ok, rows_n, offs_k, w_gate, w_up, sc_base, sc_gate, sc_up


@triton.jit
def _moe_pair_glu_kernel(x_ptr, w_ptr, sc_ptr, ids_ptr, out_ptr, nw_ptr, N, K, top_k, ldx, lde, ldw, lse, lsn, ldo,
                         n_gate, inv_k, eps, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
                         WSCALE: tl.constexpr, WINT: tl.constexpr, NORM: tl.constexpr):
    # WSCALE 2: the program's BN rows lie in one 128-row block (fp8_fits), so each K tile has one
    # scale for the gate rows and one for the up rows, applied to x's values. NORM: x is
    # RMS-normalised (weight nw, eps) as it is loaded (the split-K kernel's norm prologue:
    # x * nw rounded to x's dtype, its squares summed here, rstd applied after the loop)
    if PDL:
        gdc_wait()
    p, x_row, offs_n, n_ok, rows_n, offs_k, w_gate, w_up, sc_base, sc_gate, sc_up = _pair_glu_operands(
        x_ptr, w_ptr, sc_ptr, ids_ptr, N, top_k, ldx, lde, ldw, lse, lsn, n_gate, BN, BK)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    acc_up = tl.zeros((BN, BK), dtype=tl.float32)
    sq = tl.zeros((1, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        xr = tl.load(x_row + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0)
        if NORM:
            xr, sq = tl_norm_tile_sq(xr, tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0), sq)
        xv = xr.to(tl.float32)
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
    if NORM:
        rstd = tl_rstd(tl.sum(sq), inv_k, eps)
        gate = gate * rstd
        up = up * rstd
    y = tl_rounded_glu(gate, up, dt, ACT)
    tl.store(out_ptr + p.to(tl.int64) * ldo + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_pair_down_kernel(inter_ptr, w_ptr, sc_ptr, ids_ptr, rw_ptr, out_ptr, res_ptr, N, K, ldi, lde, ldw, lse, lsn,
                          ldo, ldr, TOP_K: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          ROUND_PRODUCT: tl.constexpr, PDL: tl.constexpr, WSCALE: tl.constexpr,
                          WINT: tl.constexpr, RESIDUAL: tl.constexpr):
    # all of a token's slots in one [KP, BN, BK] tile (KP: TOP_K to a power of two), so each
    # step of the K loop streams every slot's weight rows at once; WSCALE 2: one scale per slot
    # and K tile (fp8_fits), applied to inter's values. RESIDUAL: the token's row of res added
    # to the rounded sum (the decoder layer's residual add)
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
    if RESIDUAL:
        total = tl_add_residual(total, res_ptr + t.to(tl.int64) * ldr + offs_n, n_ok, dt, 1.0, False)
    tl.store(out_ptr + t.to(tl.int64) * ldo + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


# The tensor-core forms (configs with ``mma``): the same programs, each K tile's products by
# ``tl.dot`` with the weight tile as the MMA's first operand ([BN, BK] rows of W) and the one
# x row as its second (Triton pads that side to 8 rows), as the split-K kernel runs M = 1
# (kernels/triton_splitk.py). An e4m3 tile is converted once, then multiplied and summed along
# K by the tensor cores, where the CUDA-core forms spend a multiply-add and a share of the
# final reduction on every weight value. Down runs the token's slots one after another, each
# slot's GEMM rounded and weighted as above, summed in slot order.

@triton.jit
def _moe_pair_glu_mma_kernel(x_ptr, w_ptr, sc_ptr, ids_ptr, out_ptr, nw_ptr, N, K, top_k, ldx, lde, ldw, lse, lsn,
                             ldo, n_gate, inv_k, eps, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr,
                             PREC: tl.constexpr, PDL: tl.constexpr, WSCALE: tl.constexpr, WINT: tl.constexpr,
                             NORM: tl.constexpr):
    if PDL:
        gdc_wait()
    p, x_row, offs_n, n_ok, rows_n, offs_k, w_gate, w_up, sc_base, sc_gate, sc_up = _pair_glu_operands(
        x_ptr, w_ptr, sc_ptr, ids_ptr, N, top_k, ldx, lde, ldw, lse, lsn, n_gate, BN, BK)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BN, 1), dtype=tl.float32)
    acc_up = tl.zeros((BN, 1), dtype=tl.float32)
    sq = tl.zeros((1, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        xr = tl.load(x_row + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0)
        if NORM:  # as the CUDA-core form
            xr, sq = tl_norm_tile_sq(xr, tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0), sq)
        xt = tl.trans(xr)
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
    if NORM:
        rstd = tl_rstd(tl.sum(sq), inv_k, eps)
        acc = acc * rstd
        acc_up = acc_up * rstd
    y = tl_rounded_glu(acc, acc_up, dt, ACT)
    tl.store(out_ptr + p.to(tl.int64) * ldo + offs_n[:, None], y.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _moe_pair_down_mma_kernel(inter_ptr, w_ptr, sc_ptr, ids_ptr, rw_ptr, out_ptr, res_ptr, N, K, ldi, lde, ldw, lse,
                              lsn, ldo, ldr, TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              PREC: tl.constexpr, ROUND_PRODUCT: tl.constexpr, PDL: tl.constexpr,
                              WSCALE: tl.constexpr, WINT: tl.constexpr, RESIDUAL: tl.constexpr):
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
    if RESIDUAL:
        total = tl_add_residual(total, res_ptr + t.to(tl.int64) * ldr + offs_n[:, None], n_ok[:, None], dt, 1.0, False)
    tl.store(out_ptr + t.to(tl.int64) * ldo + offs_n[:, None], total.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None])


def run_pairs(config: TritonMoeConfig, x: torch.Tensor, w_gate_up, w_down, topk_ids: torch.Tensor,
              routing_weights: torch.Tensor, activation: str = "silu",
              down_config: TritonMoeConfig | None = None, norm: tuple | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] in x's dtype, pair-major (configs of ``block_m`` 1):
    :func:`pairs_gate_up` then :func:`pairs_down`. Weights: stacked tensors of x's dtype or
    stacked ``fp8.FP8Weight``s (module docstring). ``norm`` and ``residual``: as those take
    them (``residual + experts(rmsnorm(x))``, a mixture-of-experts decoder layer's second half)."""
    inter = pairs_gate_up(config, x, w_gate_up, topk_ids, activation, norm)
    return pairs_down(down_config or config, inter, w_down, topk_ids, routing_weights, residual)


def _norm_args(x: torch.Tensor, norm: tuple | None) -> tuple:
    """The gate/up kernels' ``nw_ptr, inv_k, eps`` for ``norm`` = (weight [K] of x's dtype or
    fp32, eps), or None (placeholders the kernel does not read)."""
    k = x.shape[1]
    if norm is None:
        return x, 1.0, 0.0
    g, eps = norm
    if not isinstance(g, torch.Tensor) or g.shape != (k,) or g.dtype not in (x.dtype, torch.float32) \
            or g.device != x.device or g.stride(0) != 1:
        raise ValueError(f"moe: the norm weight must be a [{k}] vector of x's dtype or float32 on x's device, "
                         f"got {getattr(g, 'dtype', type(g).__name__)} {tuple(getattr(g, 'shape', ()))}")
    return g, 1.0 / k, float(eps)  # inv_k: fp32(1/K) as the kernel receives it, as triton_splitk passes it


def pairs_gate_up(config: TritonMoeConfig, x: torch.Tensor, w_gate_up, topk_ids: torch.Tensor,
                  activation: str = "silu", norm: tuple | None = None) -> torch.Tensor:
    """``inter`` [T * k, I] in x's dtype, row ``p`` for pair ``p``: one launch for every pair.
    ``norm`` = (weight, eps): x RMS-normalised as the kernel loads it, as the split-K kernel's
    norm prologue computes ``rmsnorm(x) @ W.T`` (``rstd * ((x * weight) @ W.T)``)."""
    w = operand(w_gate_up)
    _check_pairs(config, x, w, topk_ids)
    e, two_i, k = w.data.shape
    check_activation(two_i, activation, w)
    i = two_i // 2
    t, top_k = topk_ids.shape
    nw, inv_k, eps = _norm_args(x, norm)
    inter = torch.empty((t * top_k, i), dtype=x.dtype, device=x.device)
    if config.mma:
        kernel, form = _moe_pair_glu_mma_kernel, {"PREC": input_precision(x)}
    else:
        kernel, form = _moe_pair_glu_kernel, {}
    kernel[(t * top_k, triton.cdiv(i, config.block_n))](
        x, w.data, w.scale, topk_ids.contiguous(), inter, nw, i, k, top_k, x.stride(0), w.data.stride(0),
        w.data.stride(1), w.lse, w.lsn, inter.stride(0), i, inv_k, eps, BN=config.block_n, BK=config.block_k,
        ACT=ACTIVATIONS[activation], **form, **wscale_args(w, x), NORM=norm is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(x))
    return inter


def pairs_down(config: TritonMoeConfig, inter: torch.Tensor, w_down, topk_ids: torch.Tensor,
               routing_weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] in inter's dtype: every token's down projections, each times its routing weight as
    :func:`run_down` makes it, summed over its slots in fp32 in one program (a fixed order).
    ``residual`` [T, H] of inter's dtype: added to the rounded sum in the same program, as the
    decoder layer's ``residual + block(...)`` adds it (the same bits)."""
    w = operand(w_down)
    _check_pairs(config, inter, w, topk_ids)
    t, top_k = topk_ids.shape
    rw = routing_weights.reshape(-1).contiguous()
    if inter.shape[0] != t * top_k or rw.numel() != t * top_k:
        raise ValueError(f"moe: {inter.shape[0]} rows of inter and {rw.numel()} routing weights for "
                         f"{t * top_k} pairs")
    h = w.data.shape[1]
    check_residual(residual, (t, h), inter)
    out = torch.empty((t, h), dtype=inter.dtype, device=inter.device)
    if config.mma:
        kernel, form = _moe_pair_down_mma_kernel, {"PREC": input_precision(inter)}
    else:
        kernel, form = _moe_pair_down_kernel, {"KP": triton.next_power_of_2(top_k)}
    res = out if residual is None else residual
    kernel[(t, triton.cdiv(h, config.block_n))](
        inter, w.data, w.scale, topk_ids.contiguous(), rw, out, res, h, w.data.shape[2], inter.stride(0),
        w.data.stride(0), w.data.stride(1), w.lse, w.lsn, out.stride(0), res.stride(0), TOP_K=top_k,
        BN=config.block_n, BK=config.block_k, ROUND_PRODUCT=rounds_product(inter, rw), **form,
        **wscale_args(w, inter), RESIDUAL=residual is not None, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_options(inter))
    return out


def check_residual(residual: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> None:
    """A residual the kernels add: [T, H] of the output's dtype and device, unit column stride."""
    if residual is not None and (not isinstance(residual, torch.Tensor) or tuple(residual.shape) != tuple(shape)
                                 or residual.dtype != like.dtype or residual.device != like.device
                                 or residual.stride(-1) != 1):
        raise ValueError(f"moe: the residual must be {list(shape)} of {like.dtype} with unit column stride, got "
                         f"{getattr(residual, 'dtype', type(residual).__name__)} "
                         f"{tuple(getattr(residual, 'shape', ()))}")


def _check_pairs(config: TritonMoeConfig, x: torch.Tensor, w: Operand, topk_ids: torch.Tensor) -> None:
    if config.block_m != 1:
        raise ValueError(f"moe: the pair-major kernels take configs of block_m 1, not {config.block_m}")
    if config.mma and min(config.block_n, config.block_k) < 16:
        raise ValueError(f"moe: a tensor-core (mma) config needs block_n and block_k of at least 16, got {config}")
    check_weights(config, x, w)
    if topk_ids.dim() != 2:
        raise ValueError(f"moe: topk_ids must be [tokens, k], got {tuple(topk_ids.shape)}")


__all__ = ["check_residual", "pairs_down", "pairs_gate_up", "run_pairs"]
