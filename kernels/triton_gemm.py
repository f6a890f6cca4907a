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

from .epilogue import Activation, Epilogue
from .problem import Problem
from .triton_common import (
    ACT_CODE,
    HOPPER_SMEM_PER_BLOCK,
    check_operands,
    check_pow2,
    check_range,
    config_from_record,
    config_to_record,
    device_facts,
    dot_precision,
    operand_key,
    parse_activation,
    problem_limits,
    tl_activation,
    tma_reason,
    tma_row_stride,
)

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

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            check_pow2(name, getattr(self, name), 16, 256)
        check_pow2("num_warps", self.num_warps, 1, 16)
        check_range("group_m", self.group_m, 1, 64)
        check_range("num_stages", self.num_stages, 1, 8)
        if self.epilogue_subtile and self.block_n < 32:
            raise ValueError("epilogue_subtile needs block_n >= 32")

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
        regs = self.block_m * self.block_n // (32 * self.num_warps)
        if regs > MAX_ACC_REGS:
            return False, f"accumulator needs {regs} registers per thread (> {MAX_ACC_REGS})"
        return True, ""


def _cfg(bm, bn, bk, stages, warps, persistent, tma, subtile=False) -> TritonGemmConfig:
    return TritonGemmConfig(bm, bn, bk, 8, warps, stages, persistent, tma, subtile)


def candidates(
    problem: Problem, *, smem_limit: int = HOPPER_SMEM_PER_BLOCK, capability=(9, 0)
) -> list[TritonGemmConfig]:
    """Configs worth timing for ``problem`` (≤ 12), most promising first, all supported.

    Tile shapes feed wgmma (BM 64/128/256 with 4-8 warps, BK = 128 bytes of K). When TMA does
    not apply (misaligned operands, pre-Hopper), each TMA config is offered on the pointer path.
    """
    bk = 128 // problem.itemsize  # 64 for fp16/bf16, 32 for fp32
    if problem.m > 256:
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
def _gemm_tile(tile, x_src, w_src, out_src, bias_ptr, M, N, K, ldx, ldw, ldo,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               USE_TMA: tl.constexpr, SUBTILE: tl.constexpr, HAS_BIAS: tl.constexpr,
               ACT: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BK)
    if USE_TMA:
        for ki in range(k_tiles):
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
        x_ptrs = x_src + rows_m[:, None] * ldx + offs_k[None, :]
        w_ptrs = w_src + rows_n[:, None] * ldw + offs_k[None, :]
        for ki in range(k_tiles):
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
def _gemm_kernel(x_src, w_src, out_src, bias_ptr, M, N, K, ldx, ldw, ldo, num_progs,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PERSISTENT: tl.constexpr, USE_TMA: tl.constexpr, SUBTILE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
                 EVEN_K: tl.constexpr):
    # x_src/w_src/out_src are pointers, or TMA descriptors when USE_TMA.
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), num_tiles, num_progs, flatten=True):
            _gemm_tile(tile, x_src, w_src, out_src, bias_ptr, M, N, K, ldx, ldw, ldo, BM, BN, BK,
                       GROUP_M, USE_TMA, SUBTILE, HAS_BIAS, ACT, PREC, EVEN_K)
    else:
        _gemm_tile(tl.program_id(0), x_src, w_src, out_src, bias_ptr, M, N, K, ldx, ldw, ldo,
                   BM, BN, BK, GROUP_M, USE_TMA, SUBTILE, HAS_BIAS, ACT, PREC, EVEN_K)


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class _Plan:
    """Everything about a launch that depends only on (config, operand layout): computed once.

    Cached per ``operand_key`` (dtypes, shapes, strides, devices, 16-byte alignment) plus
    config, activation and tf32, so a repeated call does no Problem construction, no
    ``supports`` check, no device query and no grid arithmetic: it builds the key, builds
    three descriptors when TMA is on, and launches.
    """

    grid: tuple[int]
    scalars: tuple
    meta: dict
    descs: tuple | None  # per operand (shape, strides, block_shape) when use_tma
    empty: bool


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096  # varying M in a server makes new keys; bound the memory, rebuilding is cheap


def _desc(base: torch.Tensor, spec: tuple) -> TensorDescriptor:
    # The plan's first call built the same descriptor through TensorDescriptor's validating
    # constructor; from then on skip its re-validation (~1.5 µs per descriptor): only the base
    # pointer differs and its 16-byte alignment is part of the plan key.
    d = TensorDescriptor.__new__(TensorDescriptor)
    d.base, (d.shape, d.strides, d.block_shape) = base, spec
    d.padding = "zero"
    return d


def _make_plan(config, x, weight, bias, out, act, tf32) -> _Plan:
    check_operands(x, weight, bias, out)
    problem = Problem.from_tensors(x, weight, bias, out, Epilogue(act, bias is not None), tf32)
    if problem.m == 0 or problem.n == 0:
        return _Plan((0,), (), {}, None, empty=True)
    facts = device_facts(x.device)
    ok, reason = config.supports(problem, smem_limit=facts.smem_per_block,
                                 capability=facts.capability)
    if not ok:
        raise ValueError(f"{config} does not support {problem}: {reason}")
    m, n, k = problem.m, problem.n, problem.k
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    progs = min(tiles, facts.num_sms) if config.persistent else tiles
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
    meta = dict(
        BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=config.group_m,
        PERSISTENT=config.persistent, USE_TMA=config.use_tma, SUBTILE=config.epilogue_subtile,
        HAS_BIAS=bias is not None, ACT=ACT_CODE[act], PREC=dot_precision(problem),
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    scalars = (m, n, k, problem.ldx, problem.ldw, problem.ldo, progs)
    return _Plan((progs,), scalars, meta, descs, empty=False)


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
    act = parse_activation(activation)
    key = (config, act, bool(tf32)) + operand_key(x, weight, bias, out)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(config, x, weight, bias, out, act, bool(tf32))
    if plan.empty:
        return out
    if plan.descs is None:
        srcs = (x, weight, out)
    else:
        srcs = (_desc(x, plan.descs[0]), _desc(weight, plan.descs[1]), _desc(out, plan.descs[2]))
    _gemm_kernel[plan.grid](*srcs, out if bias is None else bias, *plan.scalars, **plan.meta)
    return out
