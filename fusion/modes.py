"""Dispatch modes: what ``hybridgemm.linear`` optimises for.

``"default"``
    The fastest kernel per shape: the tuning table's entry for the call's M range, else
    F.linear (fusion/decide.py). Every call is deterministic, but calls with different numbers
    of rows M may run different kernels (cuBLASLt picks per M, split-K for decode, other tiles),
    so the same input row can come out different in the last bits in an M = 1 call and
    inside an M = 64 batch.

``"batch_invariant"``
    Each output row of ``hybridgemm.linear`` / ``dispatch.fused_linear`` (and so of the
    attention projections) is bit-identical whatever M of the call: the dispatcher ignores
    the tuning table and cuBLASLt and runs the Triton tiled kernel (kernels/triton_gemm.py)
    with ONE config per (N, K, dtype, epilogue, W layout) that does not depend on M: no
    split-K, one BLOCK_K, one tile shape, one load path (see :func:`fixed_config`). Every
    output tile then runs the same instruction sequence over K, and a row's result depends
    only on that row of x, W and the bias. :func:`batch_invariant_choice` is the decision
    (it replaces rules 4-5 of fusion/decide.py); :func:`run` runs it.

The mode is process-global (one setting shared by every thread; fusion/mode_state.py holds
it): switch it at start-up, or around whole phases with ``hybridgemm.mode``; two threads that
switch it concurrently see each other's setting. Switching is safe for calls in flight: the
dispatcher keeps its cached decisions per mode, so a call never runs a decision made in the
other mode.

Limits of the guarantee (batch_invariant mode):

- Same GPU model and SM count, same Triton version and same hybridgemm version (the config
  rule may change between versions): compiled code differs across these.
- CPU tensors and dtypes no kernel takes (e.g. float64) are computed by PyTorch exactly as
  in the default mode, and PyTorch does not promise batch invariance (on the CPU its BLAS
  blocks the M dimension differently for different M). ``explain()`` says so.
- fp32: exact fp32 (``input_precision="ieee"``, FMAs in a fixed K order; slow) unless
  ``torch.backends.cuda.matmul.allow_tf32`` is set, then TF32 tensor cores; both are
  batch-invariant, but the two give different bits (the flag is part of the decision).
- A problem the Triton kernel cannot take for every M (no Triton, W spanning 2**31 elements
  or more, no config fitting the device) falls back to PyTorch (cuBLAS: deterministic for a
  given shape, NOT batch-invariant), with one RuntimeWarning per shape and a line in
  ``explain()``. A call whose own launch fails is computed by PyTorch too (warned once).
- Only the forward. The backward (autograd) is unchanged: dX and dW are the cuBLASLt (or
  torch) GEMMs of the default mode, whose kernels vary with M; dW sums over the rows anyway.
- Cost: one fixed tile shape for every M, no split-K: decode (M ≤ 64) is slower than the
  default mode's split-K kernels, and shapes that make few tiles fill the GPU less well.
  Measured: see perf/results/h200/modes_h200.csv (``python -m hybridgemm.perf.bench_modes``).
"""

from __future__ import annotations

import dataclasses

from hybridgemm.kernels import backends
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import DTYPE_NAMES, MAX_ALIGNMENT, Problem

from .decide import Choice, call_key
from .mode_state import BATCH_INVARIANT

SOURCE = BATCH_INVARIANT  # Choice.source of the batch-invariant mode's decisions

# H200 limits, for decisions made without a device (explain() on a CPU machine, tests).
# Literals rather than triton_config's constants so importing this module needs no Triton.
HOPPER_LIMITS = {"smem_limit": 232448, "capability": (9, 0), "num_sms": 132}

# The wide 128 x 256 tile (fp16/bf16) is used from N = 4096 on, and only if a REF_M-row call
# fills at least WAVE_FILL of its last wave of SMs with such tiles: measured on the H200
# (perf/bench_modes.py), 128 x 256 is ~10% faster than 128 x 128 at M >= 4096, but at
# M = 1024 a poorly filled last wave costs more (llama3-8b qkv, N = 6144: 192 tiles on 132
# SMs, 0.78x of default speed vs 0.92x with 128 x 128). REF_M is a constant, not the call's M.
WIDE_N = 4096
REF_M = 1024
WAVE_FILL = 0.75
PERSISTENT = True  # a persistent grid walks tiles in grouped order; the per-tile code is the same

# ----------------------------------------------------------------------------- the fixed config


def canonical_problem(problem: Problem) -> Problem:
    """``problem`` without anything that varies from call to call of one layer: two dense
    rows of x and out, 256-byte aligned (the dispatcher allocates out, and copies an x that
    TMA cannot describe). Keeps W's layout and the epilogue. The fixed config is chosen for
    this, so it cannot depend on M: in particular TMA's one-row relaxation (a 1 x K x whose
    row stride is not a multiple of 16 bytes still qualifies) never applies, so an M = 1 call
    takes the same load path as every other M."""
    return dataclasses.replace(problem, m=2, ldx=problem.k, ldo=problem.n, align_x=MAX_ALIGNMENT,
                               align_out=MAX_ALIGNMENT)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _last_wave_fill(m: int, n: int, bm: int, bn: int, num_sms: int) -> float:
    tiles = -(-m // bm) * -(-n // bn)
    return tiles / (-(-tiles // num_sms) * num_sms)


def _tile_ladder(n: int, k: int, itemsize: int, num_sms: int) -> list[tuple[int, int, int, int, int, bool]]:
    """(BM, BN, BK, stages, warps, epilogue_subtile), best first; the first one the device
    takes wins.

    BK = 128 bytes of K (64 for fp16/bf16, 32 for fp32: one wgmma-friendly swizzle row),
    lowered to K's next power of two (≥ 16) for tiny K. BN: 256 for fp16/bf16 when N ≥ WIDE_N
    and the wave-fill test above passes (4 stages, the output stored in two halves so that
    they fit), else 128, lowered to N's next power of two (≥ 16) for narrow N. BM = 128 with 8
    warps (two warpgroups of wgmma). Fewer stages and a 64 x 64 tile follow for devices with
    less shared memory than Hopper's 227 KiB.
    """
    bk = max(16, min(128 // itemsize, _next_pow2(k)))
    bn = min(128, max(16, _next_pow2(n)))
    ladder = []
    if itemsize == 2 and n >= WIDE_N and _last_wave_fill(REF_M, n, 128, 256, num_sms) >= WAVE_FILL:
        ladder += [(128, 256, bk, 4, 8, True), (128, 256, bk, 3, 8, False)]
    ladder += [(128, bn, bk, 4, 8, False), (128, bn, bk, 2, 8, False), (64, min(64, bn), bk, 2, 4, False)]
    return ladder


def fixed_config(problem: Problem, *, smem_limit: int = HOPPER_LIMITS["smem_limit"],
                 capability: tuple[int, int] = HOPPER_LIMITS["capability"], num_sms: int = HOPPER_LIMITS["num_sms"]):
    """The batch-invariant mode's Triton tiled config for ``problem``: ``(config, "")``, or
    ``(None, why not)``. A function of (N, K, dtype, epilogue, W's layout, device: shared
    memory, compute capability, SM count) only: M and x's layout do not enter
    (:func:`canonical_problem`).

    Rule: the first tile of :func:`_tile_ladder` that the device supports, split_k = 1,
    GROUP_M = 8, persistent grid; TMA loads and stores where the canonical problem allows
    them (Hopper+, K, N and W's row stride multiples of 16 bytes, W 16-byte aligned), else the
    pointer path, for every M alike. Raises ImportError without Triton.
    """
    # Triton is imported on first use: importing hybridgemm must work where Triton is absent.
    TritonGemmConfig = triton_module("triton_gemm").TritonGemmConfig

    canon = canonical_problem(problem)
    reason = triton_module("triton_config").problem_limits(canon)
    if reason:
        return None, reason
    why = "no tile fits the device"
    for bm, bn, bk, stages, warps, subtile in _tile_ladder(problem.n, problem.k, problem.itemsize, num_sms):
        for tma in (True, False):
            cfg = TritonGemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=warps,
                                   num_stages=stages, persistent=PERSISTENT, use_tma=tma, epilogue_subtile=subtile)
            ok, why = cfg.supports(canon, smem_limit=smem_limit, capability=capability)
            if ok:
                return cfg, ""
    return None, why


def needs_dense_x(config, x) -> bool:
    """True when ``config`` uses TMA and this call's x (2-D) cannot be described by a TMA
    descriptor (misaligned pointer, row stride not a multiple of 16 bytes): the dispatcher
    then copies x rather than switch load path for this call."""
    if not config.use_tma:
        return False
    e = x.element_size()
    return x.data_ptr() % 16 != 0 or (x.shape[0] > 1 and (x.stride(0) * e) % 16 != 0)


def _chunk_rows(x, out) -> int:
    """Rows per launch so that x and out span < 2**31 elements (the kernel's 32-bit offsets),
    a multiple of 16 so every chunk keeps 16-byte alignment."""
    span = max(x.stride(0), out.stride(0), 1)
    return max(16, (2**31 - 1) // span // 16 * 16)


def run(config, x, weight, bias, out, activation=None, tf32: bool = False):
    """``triton_gemm.run`` with the fixed config; a call too tall for 32-bit offsets runs in
    row chunks, which changes nothing for any row (a row's arithmetic does not depend on the
    rows around it)."""
    triton_gemm = triton_module("triton_gemm")  # on first use, as in fixed_config

    m = x.shape[0]
    step = _chunk_rows(x, out)
    if m <= step:
        return triton_gemm.run(config, x, weight, bias, out, activation, tf32=tf32)
    for r in range(0, m, step):
        triton_gemm.run(config, x[r:r + step], weight, bias, out[r:r + step], activation, tf32=tf32)
    return out


def batch_invariant_choice(problem: Problem, device_index: int | None) -> Choice:
    """The batch-invariant mode's decision: the Triton tiled kernel with the fixed config for
    (N, K, dtype, epilogue, W layout), never the table or cuBLASLt (which picks per M); PyTorch
    when no config can take the problem. ``device_index`` None: assume an H100/H200."""
    key = call_key(problem)
    try:
        if device_index is None:
            limits = HOPPER_LIMITS
        else:
            limits = {**backends.device_limits(device_index), "num_sms": backends.num_sms(device_index)}
        cfg, why = fixed_config(problem, **limits)
    except ImportError as e:
        cfg, why = None, f"Triton is not available ({e})"
    if cfg is None:
        return Choice("torch", None, SOURCE, key,
                      f"no Triton config takes this problem ({why}); PyTorch computes it, deterministic "
                      "but NOT batch-invariant")
    return Choice("triton_gemm", cfg, SOURCE, key, rule_text(problem))


def rule_text(problem: Problem) -> str:
    """One line for explain(): why this config, and that it is the same for every M."""

    return (f"fixed config for N={problem.n}, K={problem.k}, {DTYPE_NAMES.get(problem.dtype, problem.dtype)}, "
            f"{problem.epilogue.name}: split_k=1, same kernel for every M")
