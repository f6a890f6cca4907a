"""Deterministic split-K Triton GEMM for decode-sized M (≤ 64): ``out = act(x @ W.T + b)``.

At small M the GEMM is a stream over W (N x K): the kernel's only job is to keep enough
bytes of W in flight on every SM. N alone gives too few tiles (70b qkv: 160 tiles of 64
rows for 132 SMs), so K is split as well: program (n-tile, split, m-tile) multiplies a
BLOCK_N x (K / SPLIT_K) slab of W with the matching columns of x and writes its fp32 partial
to a workspace ``[SPLIT_K, M, N]``. A second small kernel adds the splits **in index order**
(bit-identical results for a fixed config, no atomics), then bias, activation and the cast.
With ``split_k == 1`` the first kernel applies the epilogue itself (one launch, no workspace).

The dot is computed "swapped", ``acc[BN, BM] = W_tile @ x_tile.T``: W's 64-128 rows are the
MMA's M side (so Hopper can use wgmma) and the handful of x rows, padded to 16, its N side.
W tiles are loaded whole (``BLOCK_K`` contiguous elements per row, 16-byte vectors) and
pipelined through shared memory with ``num_stages`` buffers.

Workspace: from torch's caching allocator, kept per (device, stream, size bucket) and reused,
never freed. Graph-capture caveat: a graph captured with a split-K call bakes in the workspace
address, so the buffer must outlive the graph; keeping it cached forever guarantees that
(``clear_workspaces`` is for tests and must not be called while such graphs exist). Graphs
captured on the same stream share one workspace: do not replay them concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .epilogue import Activation, Epilogue
from .problem import Problem
from .triton_common import (
    ACT_CODE,
    HOPPER_NUM_SMS,
    HOPPER_SMEM_PER_BLOCK,
    INT32_LIMIT,
    check_operands,
    check_pow2,
    check_range,
    config_from_record,
    config_to_record,
    device_facts,
    dot_precision,
    next_pow2,
    operand_key,
    parse_activation,
    problem_limits,
    tl_activation,
)

KIND = "triton_splitk"
MAX_M = 64  # candidates() offers split-K up to this M; past it the tiled GEMM wins
MAX_ACC_REGS = 128


@dataclass(frozen=True)
class TritonSplitKConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        check_pow2("block_m", self.block_m, 16, 128)
        check_pow2("block_n", self.block_n, 16, 256)
        check_pow2("block_k", self.block_k, 16, 512)
        check_range("split_k", self.split_k, 1, 64)
        check_pow2("num_warps", self.num_warps, 1, 16)
        check_range("num_stages", self.num_stages, 1, 8)

    def to_record(self) -> dict:
        return config_to_record(self, KIND)

    @classmethod
    def from_record(cls, record: dict) -> TritonSplitKConfig:
        return config_from_record(cls, KIND, record)

    def smem_bytes(self, itemsize: int) -> int:
        """W and x tiles per pipeline stage, plus the fp32 accumulator staged for the store."""
        pipeline = self.num_stages * (self.block_n + self.block_m) * self.block_k * itemsize
        return pipeline + self.block_n * self.block_m * 4

    def supports(
        self, problem: Problem, *, smem_limit: int = HOPPER_SMEM_PER_BLOCK,
        capability: tuple[int, int] = (9, 0),
    ) -> tuple[bool, str]:
        """Can this config run ``problem``? (ok, reason). Any alignment works (pointer loads)."""
        reason = problem_limits(problem)
        if reason:
            return False, reason
        k_blocks = triton.cdiv(problem.k, self.block_k)
        if self.split_k > 1 and self.split_k > k_blocks:
            return False, f"split_k={self.split_k} exceeds the {k_blocks} blocks of K"
        if self.split_k * problem.m * problem.n > INT32_LIMIT:
            return False, "workspace spans more than 2**31 elements"
        smem = self.smem_bytes(problem.itemsize)
        if smem > smem_limit:
            return False, f"needs ~{smem} bytes of shared memory, over the {smem_limit} limit"
        regs = self.block_m * self.block_n // (32 * self.num_warps)
        if regs > MAX_ACC_REGS:
            return False, f"accumulator needs {regs} registers per thread (> {MAX_ACC_REGS})"
        return True, ""


# (block_n, bytes of K per row per stage, num_warps, num_stages): W tiles of 16-32 KB per stage.
_SHAPES = ((64, 256, 4, 4), (64, 512, 4, 3), (128, 256, 4, 4), (32, 512, 4, 4))


def _split_for(waves: float, tiles: int, k_blocks: int, num_sms: int) -> int:
    """split_k giving about ``waves`` waves of programs, keeping ≥ 2 K blocks per split so the
    pipeline has something to overlap."""
    return max(1, min(max(1, k_blocks // 2), round(waves * num_sms / max(1, tiles))))


def candidates(
    problem: Problem, *, num_sms: int = HOPPER_NUM_SMS, smem_limit: int = HOPPER_SMEM_PER_BLOCK,
    capability=(9, 0),
) -> list[TritonSplitKConfig]:
    """Configs worth timing for decode-sized ``problem`` (≤ 12; none past M = 64)."""
    if problem.m > MAX_M or problem_limits(problem):
        return []
    bm = min(64, max(16, next_pow2(problem.m)))
    found: list[TritonSplitKConfig] = []
    for bn, k_bytes, warps, stages in _SHAPES:
        bk = k_bytes // problem.itemsize
        tiles = triton.cdiv(problem.n, bn) * triton.cdiv(problem.m, bm)
        k_blocks = triton.cdiv(problem.k, bk)
        for split in sorted({_split_for(w, tiles, k_blocks, num_sms) for w in (1, 2, 4)}):
            cfg = TritonSplitKConfig(bm, bn, bk, split, warps, stages)
            ok, _ = cfg.supports(problem, smem_limit=smem_limit, capability=capability)
            if ok and cfg not in found:
                found.append(cfg)
    return found[:12]


def default_config(problem: Problem, *, num_sms: int = HOPPER_NUM_SMS, **limits):
    """A sensible pick without timing: 64-row W tiles, 256 bytes of K per stage, ~2 waves."""
    bm = min(64, max(16, next_pow2(problem.m)))
    bn, k_bytes, warps, stages = _SHAPES[0]
    bk = max(16, k_bytes // problem.itemsize)
    tiles = triton.cdiv(problem.n, bn) * triton.cdiv(problem.m, bm)
    split = _split_for(2, tiles, triton.cdiv(problem.k, bk), num_sms)
    cfg = TritonSplitKConfig(bm, bn, bk, split, warps, stages)
    ok, reason = cfg.supports(problem, **limits)
    if not ok:
        raise ValueError(f"no Triton split-K config supports {problem}: {reason}")
    return cfg


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, M, N, K, ldx, ldw, ldo, k_per_split,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DIRECT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
                   EVEN_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < N
    m_ok = offs_m < M
    # W rows past N are clamped (re-read row 0, dropped at the store) so full-K W loads carry
    # no mask at all; x rows past M are masked, so the padding rows of a 1-row x cost nothing.
    rows_n = tl.where(n_ok, offs_n, 0)
    k0 = pid_s * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    w_ptrs = w_ptr + rows_n[:, None] * ldw + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * ldx + (k0 + offs_k)[None, :]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k in range(k0, k1, BK):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
        w_ptrs += BK
        x_ptrs += BK
    mask = n_ok[:, None] & m_ok[None, :]
    if DIRECT:  # split_k == 1: the epilogue runs here, no workspace
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        acc = tl_activation(acc, ACT)
        ptrs = out_ptr + offs_m[None, :] * ldo + offs_n[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + (pid_s * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=mask)


@triton.jit
def _reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, ldo, split_k,
                   BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.load(ws_ptr + m * N + offs, mask=ok, other=0.0)
    for s in range(1, split_k):  # fixed order: the result never depends on timing
        acc += tl.load(ws_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    acc = tl_activation(acc, ACT)
    tl.store(out_ptr + m * ldo + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- launcher

_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """An fp32 buffer of ≥ ``numel`` elements for the current stream; sizes are bucketed to
    powers of two (≥ 1 MiB) so varying M reuses a few buffers. Never freed (graph caveat above)."""
    nbytes = max(1 << 20, next_pow2(numel * 4))
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream, nbytes)
    buf = _WORKSPACES.get(key)
    if buf is None:
        buf = _WORKSPACES[key] = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    return buf


def workspace_bytes() -> int:
    """Bytes held by cached workspaces (for tests and memory accounting)."""
    return sum(b.numel() * 4 for b in _WORKSPACES.values())


def clear_workspaces() -> None:
    """Drop cached workspaces. Unsafe while a captured CUDA graph still uses one."""
    _WORKSPACES.clear()


@dataclass(frozen=True)
class _Plan:
    """Per (config, operand layout, activation): grids, scalar args, constexprs, computed once
    (no Problem, supports() check or device query on a repeated call)."""

    device: torch.device
    grid: tuple
    scalars: tuple
    meta: dict
    ws_numel: int  # 0 when split_k == 1 (no workspace, no reduce launch)
    reduce_grid: tuple
    reduce_scalars: tuple  # (M, N, ldo, split_k)
    reduce_meta: dict
    empty: bool


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _make_plan(config, x, weight, bias, out, act, tf32) -> _Plan:
    check_operands(x, weight, bias, out)
    problem = Problem.from_tensors(x, weight, bias, out, Epilogue(act, bias is not None), tf32)
    if problem.m == 0 or problem.n == 0:
        return _Plan(x.device, (), (), {}, 0, (), (), {}, empty=True)
    facts = device_facts(x.device)
    ok, reason = config.supports(problem, smem_limit=facts.smem_per_block,
                                 capability=facts.capability)
    if not ok:
        raise ValueError(f"{config} does not support {problem}: {reason}")
    m, n, k, split = problem.m, problem.n, problem.k, config.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, config.block_k), split) * config.block_k
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.block_m))
    meta = dict(
        BM=config.block_m, BN=config.block_n, BK=config.block_k, DIRECT=split == 1,
        HAS_BIAS=bias is not None, ACT=ACT_CODE[act], PREC=dot_precision(problem),
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    block = min(1024, next_pow2(n))
    reduce_meta = dict(BLOCK=block, HAS_BIAS=bias is not None, ACT=ACT_CODE[act],
                       num_warps=4)
    return _Plan(
        device=x.device, grid=grid,
        scalars=(m, n, k, problem.ldx, problem.ldw, problem.ldo, k_per_split), meta=meta,
        ws_numel=split * m * n if split > 1 else 0,
        reduce_grid=(triton.cdiv(n, block), m), reduce_scalars=(m, n, problem.ldo, split),
        reduce_meta=reduce_meta, empty=False,
    )


def run(
    config: TritonSplitKConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    activation: Activation | str | None = None,
    *,
    tf32: bool = False,
) -> torch.Tensor:
    """``out[:] = act(x @ weight.T + bias)`` with ``config``; returns ``out``.

    Deterministic for a fixed config. ``tf32`` (fp32 inputs) allows TF32 tensor cores.
    Raises ValueError/TypeError naming the problem when operands or config do not fit.
    """
    act = parse_activation(activation)
    key = (config, act, bool(tf32)) + operand_key(x, weight, bias, out)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(config, x, weight, bias, out, act, bool(tf32))
    if plan.empty:
        return out
    b = out if bias is None else bias  # placeholder pointer when HAS_BIAS is False
    ws = _workspace(plan.device, plan.ws_numel) if plan.ws_numel else out
    _splitk_kernel[plan.grid](x, weight, b, out, ws, *plan.scalars, **plan.meta)
    if plan.ws_numel:
        _reduce_kernel[plan.reduce_grid](ws, b, out, *plan.reduce_scalars, **plan.reduce_meta)
    return out
