"""Gated MLP projection with the gate/up product fused into the GEMM epilogue (SwiGLU, GeGLU).

    out[M, I] = act(x @ Wg.T + bg) * (x @ Wu.T + bu)

``w`` is one stacked (2I, K) weight, gate rows 0..I-1 then up rows I..2I-1 (what
``torch.cat([gate_proj.weight, up_proj.weight])`` gives), ``b`` the matching (2I,) bias. The
separate form runs two GEMMs, writes both (M, I) results and reads them back for the product;
here each program owns a BM x BN tile of ``out`` and keeps two fp32 accumulators, one for the
BN gate rows and one for the BN up rows at the same offsets, so every x tile it loads feeds
both dots and neither intermediate leaves registers. ``act`` (silu, gelu_tanh, gelu) and the
product run in fp32; the result is stored in x's dtype. fp32 inputs use TF32 tensor cores only
while ``torch.backends.cuda.matmul.allow_tf32`` is set (or ``tf32=True`` is passed to run).

Decode (M of 1..16) is the case that matters: Llama-3-8B's stacked weight is 28672 x 4096
bf16, 235 MB read once per token, so the kernel is a weight stream. The small-M configs use
narrow tiles over N (BN 16..128, hundreds of programs) with 256-1024 bytes of K per row per
pipeline stage, so every SM keeps tens of KB of W in flight; W loads are marked
``evict_first`` (read once), x loads ``evict_last`` (re-read by every program). For block_m
of 32 or less the dots are computed swapped, ``acc[BN, BM] = W_tile @ x_tile.T``, so that W's
rows fill the MMA's wide side (wgmma on Hopper) and the few x rows its narrow side (the same
orientation as triton_splitk). Larger M uses 64/128-row tiles in the usual orientation, in
grouped order (GROUP_M tile-rows walked column by column) so concurrent programs share W
tiles in L2. On Hopper the kernel is launched with programmatic dependent launch, like
triton_splitk (``triton_launch.pdl_enabled``).

Deterministic: no atomics, no split of K; every output element is one program's fixed-order
sum. Nothing touches a GPU at import time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .checks import check_linear_args, contiguous_bias, row_major, rows_2d
from .epilogue import GLU_ACTIVATIONS, Activation, Epilogue
from .problem import DTYPE_NAMES, Problem, dtype_name, pointer_alignment
from .triton_config import (
    HOPPER_NUM_SMS,
    HOPPER_SMEM_PER_BLOCK,
    check_pow2,
    check_range,
    config_from_record,
    config_to_record,
    dot_precision,
    next_pow2,
    problem_limits,
)
from .triton_epilogue import ACT_CODE, tl_activation, tl_diagonal, tl_norm_factor, tl_norm_tile_mma, tl_rstd
from .triton_launch import Launcher, device_facts, interpreting, pdl_enabled
from .triton_plan import PlanCache, TritonPlan, check_fusion, plan_meta
from .triton_prefetch import prefetch_elements, tl_prefetch_rows

__all__ = ["ACTIVATIONS", "KIND", "TritonGluConfig", "candidates", "default_config", "glu", "run"]

KIND = "triton_glu"
MAX_ACC_REGS = 128  # fp32 registers per thread for the two accumulators together
MAX_CANDIDATES = 12
GROUP_M = 8  # tile-rows per group in the grouped program order (large M)
SWAP_MAX_BM = 32  # block_m up to this: swapped dots (W rows on the MMA's wide side)

# Gate activation -> the constexpr code the kernel branches on: triton_epilogue's codes for the
# two GELUs, one more for SiLU (which tl_activation does not have).
SILU_CODE = max(ACT_CODE.values()) + 1
ACTIVATIONS = {"silu": SILU_CODE, "gelu_tanh": ACT_CODE[Activation.GELU_TANH], "gelu": ACT_CODE[Activation.GELU]}
_SILU = tl.constexpr(SILU_CODE)  # what the kernel compares against (jit code reads only constexpr globals)


@dataclass(frozen=True)
class TritonGluConfig:
    block_m: int
    block_n: int  # output columns per program: BN gate rows and BN up rows of w
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        check_pow2("block_m", self.block_m, 16, 128)
        check_pow2("block_n", self.block_n, 16, 256)
        check_pow2("block_k", self.block_k, 16, 512)
        check_pow2("num_warps", self.num_warps, 1, 16)
        check_range("num_stages", self.num_stages, 1, 8)

    def smem_bytes(self, itemsize: int) -> int:
        """x tile and both W tiles per pipeline stage, plus the fp32 output tile staged for the store."""
        pipeline = self.num_stages * (self.block_m + 2 * self.block_n) * self.block_k * itemsize
        return pipeline + self.block_m * self.block_n * 4

    def supports(self, m: int, i: int, k: int, dtype: torch.dtype, *,
                 smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> tuple[bool, str]:
        """Can this config run x (m, k) against a stacked (2i, k) weight, contiguous operands, on
        a device with ``smem_limit`` bytes of shared memory per block? (ok, reason)."""
        reason = problem_limits(_problem(m, i, k, dtype, False, k, k, i))
        if reason:
            return False, reason
        smem = self.smem_bytes(dtype.itemsize)
        if smem > smem_limit:
            return False, f"needs ~{smem} bytes of shared memory, over the {smem_limit} limit"
        regs = 2 * self.block_m * self.block_n // (32 * self.num_warps)
        if regs > MAX_ACC_REGS:
            return False, f"the two accumulators need {regs} registers per thread (> {MAX_ACC_REGS})"
        return True, ""

    def to_record(self) -> dict:
        return config_to_record(self, KIND)

    @classmethod
    def from_record(cls, record: dict) -> TritonGluConfig:
        return config_from_record(cls, KIND, record)


def _problem(m, i, k, dtype, has_bias, ldx, ldw, ldo, tf32=False) -> Problem:
    """The stacked GEMM x @ w.T (N = 2I) as a Problem, for triton_config's limit and precision rules."""
    return Problem(m, 2 * i, k, dtype, Epilogue(Activation.NONE, has_bias), ldx, ldw, ldo, tf32=tf32)


# What candidates() offers for M <= 16, fastest first: (block_n, bytes of K per row per stage,
# num_warps, num_stages). Timed at M = 1 and 8 on the H200 over Llama-3-8B, Qwen2.5-7B and
# their tp=2 shards and Llama-3-70B's tp=2 shard (perf/results/h200/sweep_triton_glu.csv): the
# first is within 3.8% of the fastest config at every one of those shapes, at 3.85-4.3 TB/s;
# the small-footprint stages (~60 KB of shared memory) let three programs share an SM, so the
# last wave of programs is short whatever I is.
_DECODE = (
    (32, 256, 2, 3), (64, 256, 4, 3), (32, 256, 4, 3), (64, 256, 4, 4), (128, 256, 4, 3), (64, 512, 4, 3),
    (16, 512, 2, 4), (32, 512, 4, 4),
)

# M of 17..64: (block_n, bytes of K per row per stage, num_warps, num_stages). Both W tiles
# together hold 2 x block_n rows, so block_n = 32 with 512 bytes puts the same 32 KB of W in
# each stage as triton_splitk's measured best no-split decode shape (64 rows x 512 bytes x 4
# stages).
_SMALL_M = (
    (32, 512, 4, 4), (64, 256, 4, 4), (32, 256, 4, 5), (64, 512, 4, 3),
    (16, 512, 4, 4), (128, 256, 4, 3), (32, 512, 4, 3), (64, 256, 4, 5),
    (16, 1024, 4, 3), (16, 1024, 4, 4), (16, 512, 2, 4), (32, 256, 4, 3),
)

# M > 64: (block_m, block_n, bytes of K per row per stage, num_warps, num_stages); 128 bytes of
# K (64 bf16) per stage feeds wgmma, 64/128-row tiles with 4-8 warps.
_LARGE_M = (
    (128, 64, 128, 8, 4), (128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),
    (64, 64, 128, 4, 4), (128, 128, 128, 8, 4), (128, 64, 256, 8, 3), (64, 64, 256, 4, 3),
    (128, 32, 128, 4, 4),
)


def candidates(m: int, i: int, k: int, dtype: torch.dtype, *,
               smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> list[TritonGluConfig]:
    """Configs worth timing for x (m, k) against a stacked (2i, k) weight (≤ 12, all supported),
    most promising first. Empty for an unsupported dtype."""
    if dtype not in DTYPE_NAMES:
        return []
    e = dtype.itemsize
    if m <= 64:
        bm = max(16, next_pow2(m))
        shapes = [(bm, bn, k_bytes, w, s) for bn, k_bytes, w, s in (_DECODE if m <= 16 else _SMALL_M)]
    else:
        shapes = list(_LARGE_M)
    found: list[TritonGluConfig] = []
    for bm, bn, k_bytes, warps, stages in shapes:
        cfg = TritonGluConfig(bm, bn, min(512, k_bytes // e), warps, stages)
        if cfg not in found and cfg.supports(m, i, k, dtype, smem_limit=smem_limit)[0]:
            found.append(cfg)
    return found[:MAX_CANDIDATES]


@functools.lru_cache(maxsize=1024)
def default_config(m: int, i: int, k: int, dtype: torch.dtype, *, num_sms: int = HOPPER_NUM_SMS,
                   smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> TritonGluConfig:
    """A pick without timing: the first candidate that gives every SM a program, else the
    candidate with the most programs (a small I)."""
    found = candidates(m, i, k, dtype, smem_limit=smem_limit)
    if not found:
        raise ValueError(f"no Triton GLU config supports m={m}, i={i}, k={k}, {dtype}")

    def programs(c):
        return triton.cdiv(m, c.block_m) * triton.cdiv(i, c.block_n)

    return next((c for c in found if programs(c) >= num_sms), max(found, key=programs))


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _gate_act(z, ACT: tl.constexpr):
    """The gate's activation on fp32 values: SiLU here, the GELUs from triton_epilogue."""
    if ACT == _SILU:  # z * sigmoid(z); very negative z gives -0 (z / inf), not nan
        z = z / (1.0 + tl.exp(-z))
    else:
        z = tl_activation(z, ACT)
    return z


@triton.jit
def tl_rounded_glu(gate, up, dtype: tl.constexpr, ACT: tl.constexpr):
    """``act(gate) * up`` in fp32 with transformers' experts' roundings: the GEMMs' outputs
    ``gate`` and ``up`` (fp32) and the activation each rounded to ``dtype`` (the MoE kernels)."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    return _gate_act(gate, ACT).to(dtype).to(tl.float32) * up


@triton.jit
def tl_glu_rows(pid_n, half, BN: tl.constexpr):
    """The stacked weight's rows a GEMM tile ``pid_n`` of ``BN`` rows multiplies to end in the GLU
    product (triton_splitk's GLU): the gate rows of ``BN / 2`` output columns, then the up rows
    (``half`` further on) of the same columns. ``(rows, ok)``: ``ok`` is False past the
    ``half`` output columns."""
    j = tl.arange(0, BN)
    col = pid_n * (BN // 2) + j % (BN // 2)
    return tl.where(j < BN // 2, col, col + half), col < half


@triton.jit
def tl_glu_halves(acc, BN: tl.constexpr, BM: tl.constexpr):
    """The gate and up halves ([BN/2, BM] each) of a [BN, BM] tile laid out by :func:`tl_glu_rows`."""
    return tl.split(tl.permute(tl.reshape(acc, (2, BN // 2, BM)), (1, 2, 0)))


@triton.jit
def _tile_grid(offs_m, offs_n, SWAP: tl.constexpr):
    """The tile's M and N offsets as a column and a row (or a row and a column when SWAP), so
    that they broadcast against the accumulator: [BM, BN], or [BN, BM] when swapped."""
    if SWAP:
        grid_m = offs_m[None, :]
        grid_n = offs_n[:, None]
    else:
        grid_m = offs_m[:, None]
        grid_n = offs_n[None, :]
    return grid_m, grid_n


@triton.jit
def _mma(w, xt, acc, PREC: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.dot(w, tl.trans(xt), acc, input_precision=PREC)  # [BN, BM]
    else:
        acc = tl.dot(xt, tl.trans(w), acc, input_precision=PREC)  # [BM, BN]
    return acc


@triton.jit
def _glu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, nw_ptr, M, N, K, ldx, ldw, ldo, inv_k, eps,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
                SWAP: tl.constexpr, NORM: tl.constexpr, NORM_PREC: tl.constexpr, PDL: tl.constexpr,
                NW_OFFSET: tl.constexpr, PREFETCH: tl.constexpr):
    # N = I, the output width: gate rows of w are 0..N-1, up rows N..2N-1.
    # NORM: x is RMS-normalised (norm weight nw, eps): the dots take x * nw and the rows of the
    # accumulators are scaled by 1/rms after the loop (triton_epilogue.tl_norm_tile_mma); NW_OFFSET + nw
    # in fp32 with an offset (tl_norm_factor).
    # One program per BM x BN tile of out, in grouped order (a no-op when M fits one tile-row).
    # PDL: nothing the previous kernel writes is read before the wait (triton_launch.pdl_enabled);
    # with PREFETCH (W elements per row, 0 for none) L2 is first asked for the start of this
    # program's gate and up rows (triton_prefetch).
    num_n = tl.cdiv(N, BN)
    tile = tl.program_id(0)
    pid_m, pid_n = tl.swizzle2d(tile // num_n, tile % num_n, tl.cdiv(M, BM), num_n, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    # W rows past N are clamped to row 0 (re-read, dropped at the store) so that full-K W loads
    # carry no mask; x rows past M are masked, so a 1-row x loads one row.
    rows_n = tl.where(offs_n < N, offs_n, 0)
    if PREFETCH:
        tl_prefetch_rows(w_ptr + rows_n * ldw, tl.minimum(K, PREFETCH))
        tl_prefetch_rows(w_ptr + (rows_n + N) * ldw, tl.minimum(K, PREFETCH))
    if PDL:
        gdc_wait()
    x_ptrs = x_ptr + offs_m[:, None] * ldx + offs_k[None, :]
    wg_ptrs = w_ptr + rows_n[:, None] * ldw + offs_k[None, :]
    wu_ptrs = wg_ptrs + N * ldw  # the up row of each gate row
    if SWAP:
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    sq = tl.zeros((BM, BM), dtype=tl.float32)  # NORM: x @ x.T, the rows' sums of squares on its diagonal
    for k in range(0, K, BK):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0, eviction_policy="evict_last")
            wg = tl.load(wg_ptrs, eviction_policy="evict_first")
            wu = tl.load(wu_ptrs, eviction_policy="evict_first")
            if NORM:
                xt, sq = tl_norm_tile_mma(xt, tl_norm_factor(tl.load(nw_ptr + k + offs_k), NW_OFFSET), sq, NORM_PREC)
        else:
            k_ok = offs_k < K - k
            xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_last")
            wg = tl.load(wg_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            wu = tl.load(wu_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            if NORM:
                g = tl_norm_factor(tl.load(nw_ptr + k + offs_k, mask=k_ok, other=0.0), NW_OFFSET)
                xt, sq = tl_norm_tile_mma(xt, g, sq, NORM_PREC)
        acc_g = _mma(wg, xt, acc_g, PREC, SWAP)
        acc_u = _mma(wu, xt, acc_u, PREC, SWAP)
        x_ptrs += BK
        wg_ptrs += BK
        wu_ptrs += BK
    if PDL:
        gdc_launch_dependents()  # only the epilogue is left: let the next grid get ready
    grid_m, grid_n = _tile_grid(offs_m, offs_n, SWAP)
    in_n = grid_n < N
    if NORM:  # 1/rms per row of x, in the accumulators' orientation
        rstd = tl_rstd(tl_diagonal(sq, BM), inv_k, eps)
        if SWAP:
            rstd = rstd[None, :]
        else:
            rstd = rstd[:, None]
        acc_g = acc_g * rstd
        acc_u = acc_u * rstd
    if HAS_BIAS:  # loaded in the accumulator's orientation, [BN, 1] or [1, BN]
        acc_g += tl.load(b_ptr + grid_n, mask=in_n, other=0.0).to(tl.float32)
        acc_u += tl.load(b_ptr + N + grid_n, mask=in_n, other=0.0).to(tl.float32)
    h = _gate_act(acc_g, ACT) * acc_u
    tl.store(out_ptr + grid_m * ldo + grid_n, h.to(out_ptr.dtype.element_ty), mask=(grid_m < M) & in_n)


# ----------------------------------------------------------------------------- launcher


def _make_plan(key, x, w, b, out, _act, tf32) -> TritonPlan:
    """A launch plan; ``key`` is (config, gate activation name, norm: None or (eps, weight
    16-byte aligned, its dtype, offset)), the PlanCache's config slot."""
    config, act, norm = key
    m, k = x.shape
    i = out.shape[1]
    if m == 0 or i == 0:
        return TritonPlan(x.device, empty=True)
    ldx = x.stride(0) if m > 1 else k
    ldw = w.stride(0)
    ldo = out.stride(0) if m > 1 else i
    problem = _problem(m, i, k, x.dtype, b is not None, ldx, ldw, ldo, tf32 and x.dtype == torch.float32)
    facts = device_facts(x.device)
    reason = problem_limits(problem)
    if not reason:
        reason = config.supports(m, i, k, x.dtype, smem_limit=facts.smem_per_block)[1]
    if reason:
        raise ValueError(f"{config} cannot run glu with m={m}, i={i}, k={k}, {x.dtype}: {reason}")
    pdl = pdl_enabled(facts.capability)
    meta = dict(plan_meta(config, problem, Activation.NONE, b is not None), ACT=ACTIVATIONS[act],
                GROUP_M=GROUP_M, SWAP=config.block_m <= SWAP_MAX_BM, NORM=norm is not None,
                NORM_PREC="ieee" if x.dtype == torch.float32 else dot_precision(problem), PDL=pdl,
                NW_OFFSET=0.0 if norm is None else norm[3],
                PREFETCH=prefetch_elements(pdl, pointer_alignment(w.data_ptr()), ldw, 0, w.element_size(),
                                           config.block_k * config.num_stages),
                **(dict(launch_pdl=True) if pdl else {}))
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(i, config.block_n),)
    inv_k, eps = 1.0 / max(k, 1), 0.0 if norm is None else norm[0]  # fp32(1/K), as triton_rmsnorm's mean
    return TritonPlan(x.device, Launcher(_glu_kernel, grid, meta), scalars=(m, i, k, ldx, ldw, ldo, inv_k, eps))


# Plans per ((config, act), tf32, operand layout): a repeated call looks up the key and launches.
_PLANS = PlanCache(_make_plan)
_allow_tf32 = torch._C._get_cublas_allow_tf32


def run(config: TritonGluConfig, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
        act: str = "silu", *, tf32: bool | None = None, norm: tuple | None = None) -> torch.Tensor:
    """``out[:] = act(x @ w[:I].T + b[:I]) * (x @ w[I:].T + b[I:])``; returns ``out``.
    ``norm=(g, eps)``: x is RMS-normalised first, as Hugging Face's Llama-style RMSNorm does it
    (``g`` a contiguous K-vector of x's dtype; the caller checks it); ``(g, eps, offset)``: by the
    factor ``offset + g`` in fp32, formed in registers (Gemma's norm).

    The backend contract, unchecked: x (M, K) and w (2I, K) with unit column stride (rows may
    be padded), b None or a contiguous (2I,) vector, out (M, I) with unit column stride, one
    dtype and device, ``act`` a key of :data:`ACTIVATIONS`. ``tf32`` (fp32 inputs): None
    follows ``torch.backends.cuda.matmul.allow_tf32``. A config that cannot run the problem
    raises ValueError when its plan is built.
    """
    if tf32 is None:
        tf32 = x.dtype is torch.float32 and _allow_tf32()
    norm_key = None if norm is None else (float(norm[1]), norm[0].data_ptr() % 16 == 0, norm[0].dtype,
                                          float(norm[2]) if len(norm) == 3 else 0.0)
    plan = _PLANS.plan((config, act, norm_key), x, w, b, out, None, tf32)
    if plan.empty:
        return out
    # out: placeholder for the bias and the norm weight when there is none
    plan.launch(x, w, out if b is None else b, out, out if norm is None else norm[0], *plan.scalars)
    return out


def glu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, act: str = "silu", *,
        config: TritonGluConfig | None = None, out: torch.Tensor | None = None,
        norm: tuple | None = None) -> torch.Tensor:
    """``act(x @ Wg.T + bg) * (x @ Wu.T + bu)`` for x (..., K), stacked w (2I, K) = [Wg; Wu] and
    b (2I,) = [bg; bu] or None; returns (..., I) in x's dtype (``out`` when given: contiguous,
    that shape and dtype). ``act``: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU).

    ``norm=(g, eps)``: x is RMS-normalised first (Hugging Face's Llama-style RMSNorm: ``g`` a
    contiguous K-vector of x's dtype), the norm that precedes the MLP in a decoder layer;
    ``(g, eps, offset)``: the factor ``offset + g`` in fp32 (Gemma's ``1 + w``).
    x is copied only when its rows cannot be read with one row stride and unit column stride.
    ``config`` defaults to :func:`default_config` for the shape and device. Bad arguments raise
    TypeError/ValueError naming the argument.
    """
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"glu: unknown act {act!r}; expected one of {', '.join(map(repr, ACTIVATIONS))}")
    check_linear_args(x, w, b, "glu")
    rows, k = w.shape
    if rows % 2:
        raise ValueError(f"glu: w must stack gate and up weights, an even number of rows, got {tuple(w.shape)}")
    dtype_name(x.dtype)  # TypeError for anything but fp16/bf16/fp32
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"glu: needs CUDA tensors, got {x.device}")
    if config is not None and not isinstance(config, TritonGluConfig):
        raise TypeError(f"glu: config must be a TritonGluConfig or None, got {type(config).__name__}")
    i = rows // 2
    shape = (*x.shape[:-1], i)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"glu: out must be a torch.Tensor or None, got {type(out).__name__}")
    elif out.dtype != x.dtype:
        raise TypeError(f"glu: out has dtype {out.dtype} but x has {x.dtype}; they must match")
    elif tuple(out.shape) != shape or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"glu: out must be a contiguous tensor of shape {shape} on {x.device}, got "
                         f"{tuple(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}")
    if out.numel() == 0:
        return out
    if k == 0:  # empty sums: act(bg) * bu, zeros without a bias
        if b is None:
            return out.zero_()
        bf = b.float()
        return out.copy_((GLU_ACTIVATIONS[act](bf[:i]) * bf[i:]).expand(shape))
    x2 = row_major(rows_2d(x))
    out2 = out.view(-1, i)
    if norm is not None:
        check_fusion(x2, out2, norm, None, "glu")
    if config is None:
        facts = device_facts(x.device)
        config = default_config(x2.shape[0], i, k, x.dtype, num_sms=facts.num_sms, smem_limit=facts.smem_per_block)
    run(config, x2, row_major(w), contiguous_bias(b), out2, act, norm=norm)
    return out
