"""How the benchmarks time: the flush method and eager host time here, the rotating-copies
method of autotune_cache/measure.py (re-exported).

GPU time, L2-clean-cold: capture ``[flush, call] x R`` and ``[flush] x R`` in two CUDA graphs,
replay each several times, and report ``(median(with) - median(flush only)) / R``.
The flush *reads* a 512 MiB buffer (a sum into a preallocated scalar), which evicts the
50 MB L2 without leaving it dirty, like a decode step whose next layer's weights are cold.

Eager time: back-to-back calls with no synchronisation, wall time per call, so host
overhead (Python, argument checks, launch) shows.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

# The rotating-copies method and its Timing record live with the tuner, which measures with
# them; the benchmarks use the same functions through this module.
from hybridgemm.autotune_cache.measure import (  # noqa: F401 (re-exported)
    Timing,
    elapsed_ms,
    gpu_time_rotating,
    replay_interleaved,
    rotation_copies,
    rotation_lists,
    warm_up,
)

FLUSH_BYTES = 512 * 1024 * 1024
HBM_TBPS = 4.23  # the H200's measured HBM read ceiling (perf/results/h200/README.md), for roofline figures


class L2Flusher:
    """Reads a 512 MiB buffer; one per device, created lazily (never at import time)."""

    _cache: dict[int, L2Flusher] = {}

    def __init__(self, device: torch.device):
        self.buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
        self.sink = torch.empty((), dtype=torch.float32, device=device)

    def __call__(self) -> None:
        torch.sum(self.buf, dim=0, out=self.sink)

    @classmethod
    def for_device(cls, device: torch.device) -> L2Flusher:
        idx = torch.device(device).index
        if idx is None:
            idx = torch.cuda.current_device()
        if idx not in cls._cache:
            cls._cache[idx] = cls(torch.device("cuda", idx))
        return cls._cache[idx]


def _capture(fn: Callable[[], object], flusher: L2Flusher | None, reps: int) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            if flusher is not None:
                flusher()
            fn()
    return g


def gpu_time(
    fn: Callable[[], object],
    device: torch.device | str = "cuda",
    reps: int = 10,
    replays: int = 7,
    warmup: int = 3,
    flush_l2: bool = True,
) -> Timing:
    """L2-clean-cold GPU time per call of ``fn`` (µs), by CUDA-graph replay.

    ``fn`` must be capturable: no host synchronisation, no allocation outside torch's
    caching allocator. It is called ``warmup`` times eagerly first (compilation, plans).
    """
    return gpu_time_many([fn], device, reps, replays, warmup, flush_l2)[0]


def _rounds(fns: dict[str, Callable[[], object]], rounds: int, warmup: int,
            measure: Callable[[Callable[[], object]], list[float]]) -> dict[str, list[float]]:
    """Each callable run ``warmup`` times, then ``rounds`` rounds in which each in turn is
    measured once (``measure(fn)``: µs samples), so drift falls on each alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name] += measure(fn)
    return samples


def eager_time_interleaved(
    fns: dict[str, Callable[[], object]], calls: int = 200, rounds: int = 7, warmup: int = 20
) -> dict[str, Timing]:
    """Eager time of several callables measured in alternating rounds of one loop, so that
    CPU clock and load drift affect each alike (the fair way to compare host overhead)."""

    def wall_us(fn) -> list[float]:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return [(time.perf_counter() - t0) * 1e6 / calls]

    samples = _rounds(fns, rounds, warmup, wall_us)
    return {
        name: Timing(statistics.median(s), max(s) - min(s), rounds) for name, s in samples.items()
    }


def gpu_time_many(
    fns: list[Callable[[], object]],
    device: torch.device | str = "cuda",
    reps: int = 10,
    replays: int = 9,
    warmup: int = 2,
    flush_l2: bool = True,
) -> list[Timing]:
    """:func:`gpu_time` of several callables measured together: each is captured once, then
    the graphs are replayed in rounds (``fn_0, fn_1, ..., flush-only``) so that clock and
    thermal drift hit every candidate alike. Comparing candidates this way is what the tuner
    needs: the noise that matters is the one *between* them, and interleaving cancels the
    common part of it. (:func:`gpu_time` is the one-callable case.)"""
    device = torch.device(device)
    flusher = L2Flusher.for_device(device) if flush_l2 else None
    warm_up(device, [lambda fn=fn: [fn() for _ in range(warmup)] for fn in fns])
    graphs = [_capture(fn, flusher, reps) for fn in fns]
    g_base = _capture(lambda: None, flusher, reps) if flusher is not None else None
    # interleaved so drift hits all alike; the flush-only graph last in each round
    samples = replay_interleaved(graphs + ([g_base] if g_base is not None else []), replays)
    base = samples.pop() if g_base is not None else []
    base_ms = statistics.median(base) if base else 0.0
    out = []
    for s in samples:
        per_call = [(t - base_ms) * 1000.0 / reps for t in s]
        out.append(Timing(max(statistics.median(per_call), 0.0), max(per_call) - min(per_call), replays))
    del graphs, g_base
    return out


def reps_for(fn: Callable[[], object], target_ms: float = 1.0, most: int = 10) -> int:
    """Calls per captured graph so one replay lasts about ``target_ms``: a few-µs kernel needs
    several calls for its difference against the flush-only graph to rise above replay jitter."""
    fn()

    def three_calls():
        for _ in range(3):
            fn()

    per_call_ms = max(elapsed_ms(three_calls) / 3, 1e-3)
    return int(min(most, max(1, math.ceil(target_ms / per_call_ms))))


def events_time(fn: Callable[[], object], iters: int = 25, warmup: int = 5) -> Timing:
    """GPU time of ``fn`` by CUDA events around each call, L2 flushed (read) before each, median.
    For training steps, which autograd cannot run inside a captured graph as they are."""
    return events_time_interleaved({"fn": fn}, rounds=1, iters=iters, warmup=warmup)["fn"]


def events_time_interleaved(fns: dict[str, Callable[[], object]], rounds: int = 7, iters: int = 5,
                            warmup: int = 3) -> dict[str, Timing]:
    """:func:`events_time` for several callables in alternating rounds of ``iters`` steps, so
    clock drift under sustained load (power, temperature) falls on each alike; median over all
    of a callable's steps, spread = max - min."""
    flush = L2Flusher.for_device(torch.device("cuda", torch.cuda.current_device()))

    def steps_us(fn) -> list[float]:
        # events around every step, one wait after the round's last
        pairs = []
        for _ in range(iters):
            flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            pairs.append((s, e))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1000.0 for s, e in pairs]

    us = _rounds(fns, rounds, warmup, steps_us)
    return {name: Timing(statistics.median(v), max(v) - min(v), len(v)) for name, v in us.items()}
