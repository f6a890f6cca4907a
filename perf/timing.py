"""The timing method every number of this project is measured with (DESIGN.md, "How we measure").

GPU time, L2-clean-cold: capture ``[flush, call] x R`` and ``[flush] x R`` in two CUDA graphs,
replay each several times, and report ``(median(with) - median(flush only)) / R``.
The flush *reads* a 512 MiB buffer (a sum into a preallocated scalar), which evicts the
50 MB L2 without leaving it dirty, like a decode step whose next layer's weights are cold.

Eager time: back-to-back calls with no synchronisation, wall time per call, so host
overhead (Python, argument checks, launch) shows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLUSH_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    median_us: float
    spread_us: float  # (max - min) over replays, per call
    replays: int

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "spread_us": self.spread_us, "replays": self.replays}


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


def _replay_ms(g: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


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
    device = torch.device(device)
    flusher = L2Flusher.for_device(device) if flush_l2 else None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    g_call = _capture(fn, flusher, reps)
    g_base = _capture(lambda: None, flusher, reps) if flusher is not None else None
    _replay_ms(g_call, 1)  # first replay uploads the graph
    if g_base is not None:
        _replay_ms(g_base, 1)
    with_call, base = [], []
    for _ in range(replays):  # interleave so drift hits both alike
        with_call += _replay_ms(g_call, 1)
        if g_base is not None:
            base += _replay_ms(g_base, 1)
    base_ms = statistics.median(base) if base else 0.0
    per_call = [(t - base_ms) * 1000.0 / reps for t in with_call]
    del g_call, g_base
    return Timing(
        median_us=max(statistics.median(per_call), 0.0),
        spread_us=max(per_call) - min(per_call),
        replays=replays,
    )


def eager_time(fn: Callable[[], object], calls: int = 200, rounds: int = 5, warmup: int = 20) -> Timing:
    """Wall time per call of back-to-back eager calls (µs): host overhead plus queueing."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    return Timing(statistics.median(per_call), max(per_call) - min(per_call), rounds)


def eager_time_interleaved(
    fns: dict[str, Callable[[], object]], calls: int = 200, rounds: int = 7, warmup: int = 20
) -> dict[str, Timing]:
    """Eager time of several callables measured in alternating rounds of one loop, so that
    CPU clock and load drift affect each alike (the fair way to compare host overhead)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - t0) * 1e6 / calls)
    return {
        name: Timing(statistics.median(s), max(s) - min(s), rounds) for name, s in samples.items()
    }
