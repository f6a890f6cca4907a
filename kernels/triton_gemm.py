"""Triton GEMM with a fused bias + activation epilogue for medium and large M (Hopper first).

``out = act(x @ W.T + b)``: x (M, K) with unit column stride, W (N, K), out (M, N), fp32
accumulation, output in the input dtype.

One kernel, specialised by constexprs:

- ``persistent``: a grid of ``min(#SMs, #tiles)`` programs, each walking tiles with stride
  #programs in grouped (GROUP_M-swizzled) order, so that tiles running at the same time share
  rows of x and columns of W in L2. Triton flattens the tile loop and the K loop into one
  software pipeline, so the next tile's loads overlap this tile's epilogue.
- ``use_tma``: x, W and out are read/written through TMA tensor descriptors (Hopper+, 16-byte
  aligned pointers and row strides); otherwise masked pointer loads (any alignment, any GPU).
  Out-of-range rows/columns of edge tiles are zero-filled by TMA on load and clipped on store.
- ``epilogue_subtile``: the accumulator is stored as two BM x BN/2 halves, halving the
  epilogue's shared-memory staging so that more pipeline stages fit.
- ``split_k`` (non-persistent only): when M x N makes too few tiles to fill the SMs (8b kv,
  N = 1024, at M = 1024: 64 tiles of 128 x 128 for 132 SMs), K is split too. Each program
  writes its fp32 partial tile to a workspace and bumps the tile's arrival counter; the last
  one adds the partials in split order 0..S-1 and runs the epilogue (``tl_split_fixup`` in
  triton_scratch: deterministic, counters only signal, one launch).

Why host-side descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) rather than
``tl.make_tensor_descriptor``: device-side descriptors need ``triton.set_allocator``, a
context variable (per thread, and shared with every other Triton user in the process), plus a
scratch allocation per launch and a descriptor build + fence in every program. Host-side
descriptors are kernel parameters passed by value: no global state, nothing allocated, and a
CUDA graph captures them like any other argument. Their cost is host time per call (building
the objects; Triton encodes the CUtensorMap at launch), which ``_desc`` keeps small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .epilogue import Activation
from .problem import Problem
from .triton_config import (
    HOPPER_NUM_SMS,
    HOPPER_SMEM_PER_BLOCK,
    INT32_LIMIT,
    check_pow2,
    check_range,
    config_from_record,
    config_to_record,
    problem_limits,
    tma_reason,
    tma_row_stride,
)
from .triton_epilogue import tl_activation
from .triton_launch import Launcher
from .triton_plan import PlanCache, TritonPlan, plan_meta, plan_problem, split_extent
from .triton_scratch import fixup_group, plan_scratch, tl_split_fixup

KIND = "triton_gemm"
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread beyond which the kernel spills


@dataclass(frozen=True)
class TritonGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent: bool
    use_tma: bool
    epilogue_subtile: bool = False
    split_k: int = 1  # > 1: split K too, reduced in the same launch (non-persistent only)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            check_pow2(name, getattr(self, name), 16, 256)
        check_pow2("num_warps", self.num_warps, 1, 16)
        check_range("group_m", self.group_m, 1, 64)
        check_range("num_stages", self.num_stages, 1, 8)
        if self.epilogue_subtile and self.block_n < 32:
            raise ValueError("epilogue_subtile needs block_n >= 32")
        check_range("split_k", self.split_k, 1, 16)
        if self.split_k > 1 and self.persistent:
            raise ValueError("split_k > 1 needs persistent=False")

    def to_record(self) -> dict:
        return config_to_record(self, KIND)

    @classmethod
    def from_record(cls, record: dict) -> TritonGemmConfig:
        return config_from_record(cls, KIND, record)

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory estimate: one buffer per stage for the x and W tiles, plus the output
        tile staged for the (TMA or coalesced) store."""
        pipeline = self.num_stages * (self.block_m + self.block_n) * self.block_k * itemsize
        store_n = self.block_n // 2 if self.epilogue_subtile else self.block_n
        return pipeline + self.block_m * store_n * itemsize

    def supports(
        self, problem: Problem, *, smem_limit: int = HOPPER_SMEM_PER_BLOCK,
        capability: tuple[int, int] = (9, 0),
    ) -> tuple[bool, str]:
        """Can this config run ``problem`` (on a device with these limits)? (ok, reason)."""
        reason = problem_limits(problem)
        if reason:
            return False, reason
        if self.use_tma:
            if tuple(capability) < (9, 0):
                return False, f"TMA needs compute capability >= 9.0, device has {capability}"
            reason = tma_reason(problem)
            if reason:
                return False, reason
        smem = self.smem_bytes(problem.itemsize)
        if smem > smem_limit:
            return False, f"needs ~{smem} bytes of shared memory, over the {smem_limit} limit"
        if self.split_k > 1:
            k_blocks = triton.cdiv(problem.k, self.block_k)
            if self.split_k > k_blocks:
                return False, f"split_k={self.split_k} exceeds the {k_blocks} blocks of K"
            if self.split_k * problem.m * problem.n > INT32_LIMIT:
                return False, "workspace spans more than 2**31 elements"
        regs = self.block_m * self.block_n // (32 * self.num_warps)
        if regs > MAX_ACC_REGS:
            return False, f"accumulator needs {regs} registers per thread (> {MAX_ACC_REGS})"
        return True, ""


def _cfg(bm, bn, bk, stages, warps, persistent, tma, subtile=False, split=1) -> TritonGemmConfig:
    return TritonGemmConfig(bm, bn, bk, 8, warps, stages, persistent, tma, subtile, split)


def _tiles(problem: Problem, bm: int, bn: int) -> int:
    return triton.cdiv(problem.m, bm) * triton.cdiv(problem.n, bn)


def _split_for(problem: Problem, bm: int, bn: int, bk: int, waves: float, num_sms: int) -> int:
    """split_k for about ``waves`` waves of BM x BN tiles, keeping ≥ 8 K blocks per split."""
    most = max(1, min(16, triton.cdiv(problem.k, bk) // 8))
    return max(1, min(most, round(waves * num_sms / _tiles(problem, bm, bn))))


def _few_tiles(problem: Problem, bk: int, num_sms: int) -> list[TritonGemmConfig]:
    """Large M, small N (8b kv at M = 1024): 128 x 128 tiles make under ~1.5 waves. Smaller
    tiles (4 warps; several CTAs per SM fit) with deep K stages, and/or a split of K, reduced
    in one launch.

    Measured on the H200 at 8b kv M = 1024 (perf/sweep_configs.py, 105 configs,
    perf/results/h200/sweep_triton_gemm.csv): what matters is bytes in flight per SM. 64 x 128
    tiles with 256 bytes of K per stage (BK = 128 bf16) x 4 stages run at 0.975x F.linear;
    the same tile with BK = 64 at 0.69x (5 stages: 0.85x); every split-K variant ≤ 0.75x."""
    def split(bm, bn, waves=1.0, k=bk):
        return _split_for(problem, bm, bn, k, waves, num_sms)

    return [
        _cfg(64, 128, 2 * bk, 4, 4, False, True),
        _cfg(64, 128, 2 * bk, 4, 4, True, True),
        _cfg(64, 128, bk, 5, 4, False, True),
        _cfg(128, 64, 2 * bk, 4, 4, False, True),
        _cfg(128, 64, bk, 5, 4, False, True),
        _cfg(64, 128, bk, 4, 4, False, True, split=split(64, 128, 2)),
        _cfg(128, 128, bk, 5, 8, False, True, split=split(128, 128)),
        _cfg(128, 128, 2 * bk, 3, 8, False, True, split=split(128, 128, k=2 * bk)),
        _cfg(64, 256, bk, 4, 8, False, True, split=split(64, 256)),
        _cfg(128, 128, bk, 4, 8, False, True, split=split(128, 128, 2)),
        _cfg(64, 128, 2 * bk, 4, 4, False, False),
        _cfg(128, 128, bk, 4, 8, False, False, split=split(128, 128)),
    ]


def candidates(
    problem: Problem, *, smem_limit: int = HOPPER_SMEM_PER_BLOCK, capability=(9, 0),
    num_sms: int = HOPPER_NUM_SMS,
) -> list[TritonGemmConfig]:
    """Configs worth timing for ``problem`` (≤ 12), most promising first, all supported.

    Tile shapes feed wgmma (BM 64/128/256 with 4-8 warps, BK = 128 bytes of K). When TMA does
    not apply (misaligned operands, pre-Hopper), each TMA config is offered on the pointer path.
    When big tiles would leave SMs idle, smaller tiles and split-K configs are offered.
    """
    bk = 128 // problem.itemsize  # 64 for fp16/bf16, 32 for fp32
    if problem.m > 256 and _tiles(problem, 128, 128) < 1.5 * num_sms:
        shapes = _few_tiles(problem, bk, num_sms)
    elif problem.m > 256:
        shapes = [
            _cfg(128, 256, bk, 3, 8, True, True),
            _cfg(128, 256, bk, 4, 8, True, True, subtile=True),
            _cfg(128, 128, bk, 4, 8, True, True),
            _cfg(128, 128, 2 * bk, 3, 8, True, True),
            _cfg(128, 128, bk, 4, 4, True, True),
            _cfg(256, 128, bk, 3, 8, True, True),
            _cfg(128, 256, bk, 3, 8, False, True),
            _cfg(128, 128, bk, 4, 8, False, True),
            _cfg(128, 256, bk, 3, 8, True, False),
            _cfg(128, 128, bk, 4, 8, True, False),
            _cfg(128, 128, bk, 4, 4, False, False),
        ]
    else:  # medium M: fewer rows, so narrower BM to fill the SMs
        shapes = [
            _cfg(64, 128, bk, 4, 4, True, True),
            _cfg(64, 256, bk, 4, 4, True, True),
            _cfg(128, 128, bk, 4, 8, True, True),
            _cfg(64, 64, bk, 4, 4, True, True),
            _cfg(64, 128, bk, 4, 4, False, True),
            _cfg(128, 128, bk, 4, 8, False, True),
            _cfg(64, 256, bk, 3, 4, False, True),
            _cfg(64, 128, bk, 4, 4, True, False),
            _cfg(64, 64, bk, 4, 4, False, False),
            _cfg(128, 128, bk, 4, 8, True, False),
        ]
        if _tiles(problem, 64, 128) < num_sms:  # few tiles even at BM = 64: split K as well
            shapes[5:7] = [
                _cfg(64, 128, bk, 4, 4, False, True, split=_split_for(problem, 64, 128, bk, 1, num_sms)),
                _cfg(64, 64, bk, 4, 4, False, True, split=_split_for(problem, 64, 64, bk, 1, num_sms)),
            ]
    out: list[TritonGemmConfig] = []
    for cfg in shapes:
        ok, _ = cfg.supports(problem, smem_limit=smem_limit, capability=capability)
        if not ok and cfg.use_tma:
            cfg = TritonGemmConfig(**{**cfg.__dict__, "use_tma": False})
            ok, _ = cfg.supports(problem, smem_limit=smem_limit, capability=capability)
        if ok and cfg not in out:
            out.append(cfg)
    return out[:12]


def default_config(problem: Problem, **limits) -> TritonGemmConfig:
    """A sensible config without timing: the first candidate."""
    found = candidates(problem, **limits)
    if not found:
        raise ValueError(f"no Triton GEMM config supports {problem}: {problem_limits(problem)}")
    return found[0]


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M tile-rows are walked column by column, so concurrent tiles reuse
    # the same W columns and x rows from L2.
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@triton.jit
def _store_tile(acc, out_src, bias_ptr, off_m, off_n, M, N, ldo, BM: tl.constexpr,
                WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                USE_TMA: tl.constexpr):
    offs_n = off_n + tl.arange(0, WIDTH)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    acc = tl_activation(acc, ACT)
    if USE_TMA:
        out_src.store([off_m, off_n], acc.to(out_src.dtype))
    else:
        offs_m = off_m + tl.arange(0, BM)
        ptrs = out_src + offs_m[:, None] * ldo + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(ptrs, acc.to(out_src.dtype.element_ty), mask=mask)


@triton.jit
def _finish_tile(acc, out_src, bias_ptr, off_m, off_n, M, N, ldo, BM: tl.constexpr,
                 BN: tl.constexpr, SUBTILE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACT: tl.constexpr, USE_TMA: tl.constexpr):
    if SUBTILE:
        halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(halves)
        _store_tile(acc0, out_src, bias_ptr, off_m, off_n, M, N, ldo, BM, BN // 2,
                    HAS_BIAS, ACT, USE_TMA)
        _store_tile(acc1, out_src, bias_ptr, off_m, off_n + BN // 2, M, N, ldo, BM, BN // 2,
                    HAS_BIAS, ACT, USE_TMA)
    else:
        _store_tile(acc, out_src, bias_ptr, off_m, off_n, M, N, ldo, BM, BN, HAS_BIAS, ACT, USE_TMA)


@triton.jit
def _gemm_tile(tile, x_src, w_src, out_src, bias_ptr, ws_ptr, cnt_ptr, M, N, K, ldx, ldw, ldo,
               k_per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, SUBTILE: tl.constexpr,
               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
               EVEN_K: tl.constexpr, SPLIT: tl.constexpr, FIXUP: tl.constexpr):
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if SPLIT:  # this program's share of K: blocks [k_lo, k_hi)
        pid_s = tl.program_id(1)
        k_lo = pid_s * (k_per_split // BK)
        k_tiles = tl.minimum(k_lo + k_per_split // BK, tl.cdiv(K, BK))
    else:
        k_lo = 0
        k_tiles = tl.cdiv(K, BK)
    if USE_TMA:
        for ki in range(k_lo, k_tiles):
            a = x_src.load([off_m, ki * BK])
            b = w_src.load([off_n, ki * BK])
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    else:
        # Rows past M (N) are clamped to row 0: loads need no row mask, the store drops them.
        rows_m = off_m + tl.arange(0, BM)
        rows_n = off_n + tl.arange(0, BN)
        rows_m = tl.where(rows_m < M, rows_m, 0)
        rows_n = tl.where(rows_n < N, rows_n, 0)
        offs_k = tl.arange(0, BK)
        x_ptrs = x_src + rows_m[:, None] * ldx + (k_lo * BK + offs_k)[None, :]
        w_ptrs = w_src + rows_n[:, None] * ldw + (k_lo * BK + offs_k)[None, :]
        for ki in range(k_lo, k_tiles):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                k_ok = offs_k[None, :] < K - ki * BK
                a = tl.load(x_ptrs, mask=k_ok, other=0.0)
                b = tl.load(w_ptrs, mask=k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
            x_ptrs += BK
            w_ptrs += BK
    if SPLIT:
        offs_m = off_m + tl.arange(0, BM)
        offs_n = off_n + tl.arange(0, BN)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        acc, last = tl_split_fixup(acc, ws_ptr, offs_m[:, None] * N + offs_n[None, :], mask,
                                   M * N, cnt_ptr + tile, pid_s, tl.num_programs(1), FIXUP)
        if last:
            _finish_tile(acc, out_src, bias_ptr, off_m, off_n, M, N, ldo, BM, BN, SUBTILE,
                         HAS_BIAS, ACT, USE_TMA)
    else:
        _finish_tile(acc, out_src, bias_ptr, off_m, off_n, M, N, ldo, BM, BN, SUBTILE, HAS_BIAS,
                     ACT, USE_TMA)


@triton.jit
def _gemm_kernel(x_src, w_src, out_src, bias_ptr, ws_ptr, cnt_ptr, M, N, K, ldx, ldw, ldo,
                 num_progs, k_per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, USE_TMA: tl.constexpr,
                 SUBTILE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                 PREC: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, FIXUP: tl.constexpr):
    # x_src/w_src/out_src are pointers, or TMA descriptors when USE_TMA. ws_ptr/cnt_ptr are
    # the split-K workspace and arrival counters (placeholders unless SPLIT).
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), num_tiles, num_progs, flatten=True):
            _gemm_tile(tile, x_src, w_src, out_src, bias_ptr, ws_ptr, cnt_ptr, M, N, K, ldx, ldw,
                       ldo, k_per_split, BM, BN, BK, GROUP_M, USE_TMA, SUBTILE, HAS_BIAS, ACT,
                       PREC, EVEN_K, False, FIXUP)
    else:
        _gemm_tile(tl.program_id(0), x_src, w_src, out_src, bias_ptr, ws_ptr, cnt_ptr, M, N, K,
                   ldx, ldw, ldo, k_per_split, BM, BN, BK, GROUP_M, USE_TMA, SUBTILE, HAS_BIAS,
                   ACT, PREC, EVEN_K, SPLIT, FIXUP)


# ----------------------------------------------------------------------------- launcher


def _desc(base: torch.Tensor, spec: tuple) -> TensorDescriptor:
    # The plan's first call built the same descriptor through TensorDescriptor's validating
    # constructor; from then on skip its re-validation (~1.5 µs per descriptor): only the base
    # pointer differs and its 16-byte alignment is part of the plan key.
    d = TensorDescriptor.__new__(TensorDescriptor)
    d.base, (d.shape, d.strides, d.block_shape) = base, spec
    d.padding = "zero"
    return d


def _make_plan(config, x, weight, bias, out, act, tf32) -> TritonPlan:
    found = plan_problem(config, x, weight, bias, out, act, tf32)
    if found is None:
        return TritonPlan(x.device, empty=True)
    problem, facts = found
    m, n, k = problem.m, problem.n, problem.k
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    progs = min(tiles, facts.num_sms) if config.persistent else tiles
    split = config.split_k
    descs = None
    if config.use_tma:
        store_n = config.block_n // 2 if config.epilogue_subtile else config.block_n
        e = problem.itemsize
        descs = (
            ([m, k], [tma_row_stride(m, problem.ldx, k, e), 1], [config.block_m, config.block_k]),
            ([n, k], [tma_row_stride(n, problem.ldw, k, e), 1], [config.block_n, config.block_k]),
            ([m, n], [tma_row_stride(m, problem.ldo, n, e), 1], [config.block_m, store_n]),
        )
        for t, (shape, strides, block) in zip((x, weight, out), descs):
            TensorDescriptor(t, shape, strides, block)  # Triton's own checks, once per plan
    meta = dict(plan_meta(config, problem, act, bias is not None), GROUP_M=config.group_m,
                PERSISTENT=config.persistent, USE_TMA=config.use_tma, SUBTILE=config.epilogue_subtile,
                SPLIT=split > 1, FIXUP=fixup_group(config.block_m, config.block_n, config.num_warps, split))
    scalars = (m, n, k, problem.ldx, problem.ldw, problem.ldo, progs, split_extent(k, config.block_k, split))
    grid = (progs, split) if split > 1 else (progs,)
    return TritonPlan(x.device, Launcher(_gemm_kernel, grid, meta), scalars,
                      ws_numel=split * m * n if split > 1 else 0, counters=tiles if split > 1 else 0, descs=descs)


# Plans per (config, activation, tf32, operand layout): a repeated call builds the key, builds
# three descriptors when TMA is on, and launches.
_PLANS = PlanCache(_make_plan)


def run(
    config: TritonGemmConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    activation: Activation | str | None = None,
    *,
    tf32: bool = False,
) -> torch.Tensor:
    """``out[:] = act(x @ weight.T + bias)`` with ``config``; returns ``out``.

    ``tf32`` (fp32 inputs only) allows TF32 tensor cores; the caller decides, e.g. from
    ``torch.backends.cuda.matmul.allow_tf32``. Raises ValueError/TypeError naming the problem
    when the operands or the config do not fit. No host sync, no allocation: capturable.
    """
    plan = _PLANS.plan(config, x, weight, bias, out, activation, tf32)
    if plan.empty:
        return out
    if plan.descs is None:
        srcs = (x, weight, out)
    else:
        srcs = (_desc(x, plan.descs[0]), _desc(weight, plan.descs[1]), _desc(out, plan.descs[2]))
    b = out if bias is None else bias  # placeholder pointer when HAS_BIAS is False
    ws, cnt = plan_scratch(plan, b)
    plan.launch(*srcs, b, ws, cnt, *plan.scalars)
    return out
