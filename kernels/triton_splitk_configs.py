"""Configs of the split-K GEMM (kernels/triton_splitk.py): :class:`TritonSplitKConfig`, what the
tuner times (:func:`candidates`), the picks without timing (:func:`default_config`,
:func:`untuned_config`), and the configs a fused epilogue derives from a tuned one (whole-head
tiles for q/k norms, a router's one tile of all its experts) or keeps (:func:`prologue_fits`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import triton

from . import fp8
from .fp8 import FORMAT_OF
from .problem import DECODE_MAX_M, Problem
from .triton_config import (
    HOPPER_NUM_SMS,
    HOPPER_SMEM_PER_BLOCK,
    INT32_LIMIT,
    check_pow2,
    check_range,
    config_from_record,
    config_to_record,
    next_pow2,
    problem_limits,
)

KIND = "triton_splitk"
MAX_M = DECODE_MAX_M  # candidates() offers split-K up to this M; past it the tiled GEMM wins
MAX_ACC_REGS = 128
MAX_CANDIDATES = 16
_WSCALE = {"": 0, FORMAT_OF["channel"]: 1, FORMAT_OF["block128"]: 2}  # the kernel's WSCALE per weight format


@dataclass(frozen=True)
class TritonSplitKConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    fused_reduce: bool = False  # split_k > 1: reduce in the same launch (arrival counters)

    def __post_init__(self):
        check_pow2("block_m", self.block_m, 1, 128)
        check_pow2("block_n", self.block_n, 16, 256)
        check_pow2("block_k", self.block_k, 16, 512)
        check_range("split_k", self.split_k, 1, 64)
        check_pow2("num_warps", self.num_warps, 1, 16)
        check_range("num_stages", self.num_stages, 1, 8)
        if self.fused_reduce and self.split_k == 1:
            raise ValueError("fused_reduce needs split_k > 1 (split_k == 1 has nothing to reduce)")

    def to_record(self) -> dict:
        return config_to_record(self, KIND)

    @classmethod
    def from_record(cls, record: dict) -> TritonSplitKConfig:
        return config_from_record(cls, KIND, record)

    def smem_bytes(self, itemsize: int, w_itemsize: int | None = None) -> int:
        """W and x tiles per pipeline stage, plus the fp32 accumulator staged for the store
        (``w_itemsize``: W's bytes per element where they differ from x's, an FP8 weight)."""
        w_itemsize = itemsize if w_itemsize is None else w_itemsize
        pipeline = self.num_stages * (self.block_n * w_itemsize + self.block_m * itemsize) * self.block_k
        return pipeline + self.block_n * self.block_m * 4

    def supports(
        self, problem: Problem, *, smem_limit: int = HOPPER_SMEM_PER_BLOCK,
        capability: tuple[int, int] = (9, 0),
    ) -> tuple[bool, str]:
        """Can this config run ``problem``? (ok, reason). Any alignment works (pointer loads)."""
        reason = problem_limits(problem)
        if reason:
            return False, reason
        if problem.weight_format not in _WSCALE:
            return False, f"no split-K kernel for weight format {problem.weight_format!r}"
        if problem.weight_format == FORMAT_OF["block128"] and self.block_k > fp8.BLOCK:
            return False, f"block_k={self.block_k} spans more than one {fp8.BLOCK}-column block of scales"
        k_blocks = triton.cdiv(problem.k, self.block_k)
        if self.split_k > 1 and self.split_k > k_blocks:
            return False, f"split_k={self.split_k} exceeds the {k_blocks} blocks of K"
        if self.split_k * problem.m * problem.n > INT32_LIMIT:
            return False, "workspace spans more than 2**31 elements"
        smem = self.smem_bytes(problem.itemsize, problem.w_itemsize)
        if smem > smem_limit:
            return False, f"needs ~{smem} bytes of shared memory, over the {smem_limit} limit"
        regs = self.block_m * self.block_n // (32 * self.num_warps)
        if regs > MAX_ACC_REGS:
            return False, f"accumulator needs {regs} registers per thread (> {MAX_ACC_REGS})"
        return True, ""


# The default config's shape: (block_n, bytes of K per row per stage, num_warps, num_stages).
_DEFAULT_SHAPE = (64, 256, 4, 4)  # bf16/fp16 weights

# What candidates() offers, most promising first: (block_n, bytes of K per row per stage,
# num_warps, num_stages, waves of programs to aim for, single-pass reduction). W bytes in flight
# per program = block_n x bytes x (num_stages - 1). At 1 wave a big N needs no split (one launch,
# no workspace); a small N (8b kv) needs a split either way. More waves = more programs per SM
# (narrow tiles fit 2-4 CTAs per SM) = more loads in flight and a shorter tail. 0 waves = no split.
_PLAN = (
    (64, 512, 4, 4, 0, False),    # no split, even with few tiles: best at qwen2.5-7b o and qkv
                                  # (56/72 programs; sweep_triton_splitk.csv) and at 8b q M <= 16
    (32, 512, 4, 4, 1, True),     # 8b q/o (split 1 there): within ~2% of the one above
    (64, 512, 4, 3, 1, True),     # 8b qkv, 70b o
    (64, 256, 4, 4, 1, False),    # 70b qkv (split 1); 8b kv two-pass split 8
    (32, 512, 4, 4, 2, True),
    (64, 256, 4, 4, 2, True),
    (16, 512, 2, 4, 2, True),
    (32, 1024, 4, 3, 1, True),    # 512 bf16 elements of K per stage
    (32, 512, 4, 6, 2, True),
    (64, 512, 4, 4, 4, True),
    (16, 1024, 2, 4, 4, True),
    (128, 256, 4, 4, 2, True),
    (64, 256, 4, 6, 1, True),
    (64, 512, 4, 3, 2, False),
    (32, 256, 2, 6, 4, True),
    (64, 1024, 4, 3, 1, True),
    (16, 512, 1, 6, 4, True),
    (32, 512, 4, 4, 4, True),
    (64, 256, 4, 4, 4, False),
)


# What candidates() offers for an FP8 weight, in _PLAN's terms (e4m3 bytes of K per stage). From
# scripts/fp8_kernel_probe.py on the H200 (2026-12-02, x tiles of 1 and 8 rows): 64-row tiles
# with 256 bytes and ~2 waves (the default) within 0-12% of the fastest at every llama3-8b
# projection; narrow tiles with one warp per 16 rows and no split lead at 8b qkv and gate/up.
_FP8_PLAN = (
    (64, 256, 4, 3, 2, True),     # the default: 8b o and down (M = 1, 8), 8b qkv M = 8
    (32, 256, 2, 3, 1, True),     # 8b gate/up M = 1 (split 1 there)
    (16, 512, 1, 4, 1, True),     # 8b qkv M = 1
    (128, 256, 8, 3, 1, True),    # 8b gate/up M = 8
    (128, 512, 8, 3, 2, True),    # 8b down M = 1
    (64, 512, 4, 4, 2, True),     # 8b o M = 8
    (32, 512, 2, 3, 1, True),     # 8b qkv M = 8
    (64, 256, 4, 4, 1, True),
    (16, 512, 1, 3, 1, True),
    (64, 256, 2, 3, 1, True),
    (32, 256, 1, 3, 1, True),
    (128, 256, 4, 3, 1, True),
    (64, 256, 4, 3, 4, True),
    (32, 256, 2, 4, 2, True),
    (64, 512, 4, 3, 2, False),
    (16, 256, 1, 3, 2, True),
)


def _split_for(waves: float, tiles: int, k_blocks: int, num_sms: int) -> int:
    """split_k giving about ``waves`` waves of programs, keeping ≥ 2 K blocks per split so the
    pipeline has something to overlap."""
    return max(1, min(max(1, k_blocks // 2), round(waves * num_sms / max(1, tiles))))


def _block_k(problem: Problem, k_bytes: int) -> int:
    """Elements of K per stage for ``k_bytes`` of W per row (at most one 128-column block of
    scales for a block-scaled FP8 weight)."""
    cap = fp8.BLOCK if problem.weight_format == FORMAT_OF["block128"] else 512
    return min(cap, max(16, k_bytes // problem.w_itemsize))


def _block_m(problem: Problem) -> int:
    """Rows of x per program: M's power of two, from 16 for a bf16/fp16 weight and from 1 for
    an FP8 one (see kernels/triton_splitk.py's module docstring)."""
    return min(64, max(1 if problem.weight_format else 16, next_pow2(problem.m)))


def candidates(
    problem: Problem, *, num_sms: int = HOPPER_NUM_SMS, smem_limit: int = HOPPER_SMEM_PER_BLOCK,
    capability=(9, 0),
) -> list[TritonSplitKConfig]:
    """Configs worth timing for decode-sized ``problem`` (≤ 16; none past M = 64)."""
    if problem.m > MAX_M or problem_limits(problem):
        return []
    found: list[TritonSplitKConfig] = []
    for shape in _FP8_PLAN if problem.weight_format else _PLAN:
        cfg = _plan_config(problem, shape, num_sms)
        if cfg is None:
            continue  # no split with this few programs cannot keep HBM busy
        ok, _ = cfg.supports(problem, smem_limit=smem_limit, capability=capability)
        if ok and cfg not in found:
            found.append(cfg)
    return found[:MAX_CANDIDATES]


def _plan_config(problem: Problem, shape: tuple, num_sms: int) -> TritonSplitKConfig | None:
    """The config of a plan ``shape`` (block_n, bytes of K per row per stage, num_warps,
    num_stages, waves, single-pass reduction) for ``problem``; None for a no-split shape (0
    waves) with under a quarter wave of tiles."""
    bn, k_bytes, warps, stages, waves, fused = shape
    bm, bk = _block_m(problem), _block_k(problem, k_bytes)
    tiles = triton.cdiv(problem.n, bn) * triton.cdiv(problem.m, bm)
    if waves == 0 and tiles < num_sms // 4:
        return None
    split = _split_for(waves, tiles, triton.cdiv(problem.k, bk), num_sms)
    return TritonSplitKConfig(bm, bn, bk, split, warps, stages, fused and split > 1)

def default_config(problem: Problem, *, num_sms: int = HOPPER_NUM_SMS, **limits):
    """A sensible pick without timing: 64-row W tiles, 256 bytes of K per stage, ~2 waves,
    two-launch reduction (for an FP8 weight: the first of _FP8_PLAN's shapes)."""
    bm = _block_m(problem)
    bn, k_bytes, warps, stages = _FP8_PLAN[0][:4] if problem.weight_format else _DEFAULT_SHAPE
    bk = _block_k(problem, k_bytes)
    tiles = triton.cdiv(problem.n, bn) * triton.cdiv(problem.m, bm)
    split = _split_for(2, tiles, triton.cdiv(problem.k, bk), num_sms)
    cfg = TritonSplitKConfig(bm, bn, bk, split, warps, stages)
    ok, reason = cfg.supports(problem, **limits)
    if not ok:
        raise ValueError(f"no Triton split-K config supports {problem}: {reason}")
    return cfg


# A fused decode piece (fusion/models/fused_pieces.py) on a shape the table does not hold runs
# this _PLAN shape (decide.choose_fusable): 64-row tiles, 256 bytes of K per stage, 6 stages,
# about one wave, single-pass reduction (which the rotary/cache epilogue needs). In the shipped
# H200 table (273 bf16 entries at M <= 16, 2026-12-03) it was among an entry's five timed
# finalists in 162 (more than any shape with a single-pass reduction), at 1.002-4.6x F.linear
# (median 1.09x) and a median 0.996x of the entry's best split-K config.
_UNTUNED_SHAPE = (64, 256, 4, 6, 1, True)
assert _UNTUNED_SHAPE in _PLAN


def untuned_config(problem: Problem, *, num_sms: int = HOPPER_NUM_SMS, **limits) -> TritonSplitKConfig | None:
    """The config a fused decode piece runs where the table holds no entry for its shape
    (:data:`_UNTUNED_SHAPE`), or None where that shape does not fit ``problem``."""
    if problem.m > MAX_M or problem_limits(problem):
        return None
    cfg = _plan_config(problem, _UNTUNED_SHAPE, num_sms)
    return cfg if cfg.supports(problem, **limits)[0] else None


MAX_ROUTE_EXPERTS = 256  # a router's logits in one tile (the routing holds [experts, tokens] in registers)


@functools.lru_cache(maxsize=256)
def route_config(m: int, n: int, k: int, itemsize: int) -> TritonSplitKConfig | None:
    """The config a router's GEMM with its routing in the epilogue runs (``run(route=)``): one
    tile of all ``n`` experts, x tiles of M's power of two from 16, 128 bytes of K per row per
    stage, K split so that each program streams at least two stages (at most 32 programs),
    the reduction in the same launch. None past ``MAX_ROUTE_EXPERTS`` experts or decode's M."""
    if n > MAX_ROUTE_EXPERTS or not 1 <= m <= MAX_M:
        return None
    bk = max(16, 128 // itemsize)
    split = max(1, min(32, triton.cdiv(k, bk) // 2))
    return TritonSplitKConfig(max(16, next_pow2(m)), max(16, next_pow2(n)), bk, split, 4, 3, fused_reduce=split > 1)


# The RMSNorm prologue (NORM) costs about nothing beside the bare GEMM in one config shape and
# about as much again as the GEMM in every other one measured: Q/K/V at M = 1 on the H200
# (scripts/qkv_fusion_probe.py, perf/results/h200/logs/qkv_fusion_probe_c11e645.txt) with 64-row
# tiles, 512 bytes of K per row per stage, 4 warps and 4 stages +0.6 us on 14.2 (llama3-8b; the
# tuned entries of llama3-8b and qwen2.5-7b run it, +0.7 and +1.6 us in layer_fusion_h200.csv);
# with 32- or 64-row tiles of 256 bytes, or 32-row tiles of 512, +17 to +23 us on 14.8-17.9,
# whether or not the rotary/cache epilogue (+0.5 to +1.7 us) is fused too.
_CHEAP_PROLOGUE = (64, 512, 4, 4)  # (block_n, bytes of K per row per stage, num_warps, num_stages)


def prologue_fits(config: TritonSplitKConfig, itemsize: int) -> bool:
    """Does the RMSNorm prologue cost about nothing beside the GEMM with ``config`` (x of
    ``itemsize`` bytes)? Only in :data:`_CHEAP_PROLOGUE`'s shape; elsewhere the caller normalises
    x in a launch of its own first (fusion/dispatch.py ``fused_splitk``)."""
    return (config.block_n, config.block_k * itemsize, config.num_warps, config.num_stages) == _CHEAP_PROLOGUE


@functools.lru_cache(maxsize=256)
def _whole_head_config(config: TritonSplitKConfig, head_dim: int, k: int, itemsize: int,
                       w_itemsize: int) -> TritonSplitKConfig:
    """``config`` with tiles of one whole head (``block_n = head_dim``), as the q/k norms of the
    rotary epilogue need; warps doubled while the accumulator would take more than
    MAX_ACC_REGS registers a thread, then stages and K tiles cut while the stages would not
    fit in shared memory (what is left, ``supports`` reports). Tiles ``f`` times as wide make
    ``f`` times fewer of them, so K is split ``f`` times as often (as far as ``k`` of two K tiles
    a split allows, at most 64, each split given K tiles, and always with the one-launch
    reduction the rotary epilogue needs): the programs the tuned config ran over the weight,
    which a Q/K/V stream needs to keep HBM busy (Qwen3-30B-A3B's 5120 x 2048 at M = 1, tuned to
    80 programs of 64 rows, would otherwise run 40 of 128), where K is long enough."""
    c = dataclasses.replace(config, block_n=head_dim)
    while c.block_m * c.block_n // (32 * c.num_warps) > MAX_ACC_REGS and c.num_warps < 16:
        c = dataclasses.replace(c, num_warps=c.num_warps * 2)
    while c.smem_bytes(itemsize, w_itemsize) > HOPPER_SMEM_PER_BLOCK and (c.num_stages > 2 or c.block_k > 32):
        c = dataclasses.replace(c, num_stages=c.num_stages - 1) if c.num_stages > 2 else \
            dataclasses.replace(c, block_k=c.block_k // 2)
    if head_dim > config.block_n:
        k_tiles = triton.cdiv(k, c.block_k)
        split = max(c.split_k, min(config.split_k * (head_dim // config.block_n), max(1, k_tiles // 2), 64))
        split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # the splits that get K tiles
        c = dataclasses.replace(c, split_k=split, fused_reduce=split > 1)
    return c
