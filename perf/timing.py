"""The timing method every number of this project is measured with (DESIGN.md, "How we measure").

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
    return gpu_time_many([fn], device, reps, replays, warmup, flush_l2)[0]


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
    _warm_up(device, [lambda fn=fn: [fn() for _ in range(warmup)] for fn in fns])
    graphs = [_capture(fn, flusher, reps) for fn in fns]
    g_base = _capture(lambda: None, flusher, reps) if flusher is not None else None
    for g in (*graphs, *([g_base] if g_base is not None else [])):
        _replay_ms(g, 1)  # first replay uploads the graph
    samples: list[list[float]] = [[] for _ in fns]
    base: list[float] = []
    for _ in range(replays):  # interleave so drift hits all alike
        for i, g in enumerate(graphs):
            samples[i] += _replay_ms(g, 1)
        if g_base is not None:
            base += _replay_ms(g_base, 1)
    base_ms = statistics.median(base) if base else 0.0
    out = []
    for s in samples:
        per_call = [(t - base_ms) * 1000.0 / reps for t in s]
        out.append(Timing(max(statistics.median(per_call), 0.0), max(per_call) - min(per_call), replays))
    del graphs, g_base
    return out


def _warm_up(device: torch.device, calls: list[Callable[[], object]]) -> None:
    """Run ``calls`` on a side stream (compilation, plans, lazy allocations happen outside
    any capture), then wait for them."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- rotating weights


def rotation_copies(weight_bytes: int, device: torch.device | str = "cuda", l2_multiple: float = 3.0,
                    most: int = 64) -> int:
    """How many copies of a weight to cycle through so that, between two uses of one copy,
    the others (``l2_multiple`` x the L2 size of bytes) have evicted it: each call then reads
    its weights cold from HBM, as with a flush, but with nothing to subtract."""
    device = torch.device(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    l2 = getattr(torch.cuda.get_device_properties(idx), "L2_cache_size", 0) or 64 * 2**20
    return int(min(most, max(2, math.ceil(l2_multiple * l2 / max(weight_bytes, 1)) + 1)))


def rotation_lists(x: torch.Tensor, w: torch.Tensor) -> tuple[list, list]:
    """``(xs, ws)``: x and W themselves first, then clones, :func:`rotation_copies` of each
    (for :func:`gpu_time_rotating`'s ``call(i)``)."""
    copies = rotation_copies((x.numel() + w.numel()) * x.element_size(), x.device)
    return [x] + [x.clone() for _ in range(copies - 1)], [w] + [w.clone() for _ in range(copies - 1)]


def gpu_time_rotating(
    calls: list[Callable[[int], object]],
    copies: int,
    device: torch.device | str = "cuda",
    replays: int = 9,
    min_graph_ms: float = 1.0,
    max_passes: int = 50,
    rounds: list | None = None,
    skew_bytes: int = 0,
) -> list[Timing]:
    """GPU time per call (µs) of each ``call(i)``, which must run on copy ``i`` of its weights
    (0 <= i < ``copies``, see :func:`rotation_copies`).

    Each callable is captured as one CUDA graph of ``passes x [call(0), ..., call(copies-1)]``
    (enough passes for ``min_graph_ms``); the graphs are replayed in ``replays`` interleaved
    rounds and the median replay / calls is reported. Against the flush method
    (:func:`gpu_time`) nothing is subtracted, so a ~10 µs kernel is not measured as the small
    difference of two ~1.4 ms replays; the tuner and the dispatch benchmark use this one.
    ``rounds``, when given, receives one list per round: each call's µs in that round.
    ``skew_bytes``: each capture first allocates (and holds) that many bytes from its graph's
    memory pool, so what the calls allocate inside it (outputs, split-K scratch) lands that
    far along: a way to time the same calls with their outputs elsewhere (see
    tuner.time_placements).
    """
    device = torch.device(device)
    # compile, plan, and fill per-pointer caches for every copy
    _warm_up(device, [lambda call=call: [call(i) for i in range(copies)] for call in calls])
    graphs, per_graph, pads = [], [], []
    for call in calls:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(copies):
            call(i)
        end.record()
        end.synchronize()
        passes = int(min(max_passes, max(1, math.ceil(min_graph_ms / max(start.elapsed_time(end), 1e-3)))))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            if skew_bytes:  # no kernel touches it; it only moves later allocations of this pool
                pads.append(torch.empty(skew_bytes, dtype=torch.uint8, device=device))
            for _ in range(passes):
                for i in range(copies):
                    call(i)
        graphs.append(g)
        per_graph.append(passes * copies)
    for g in graphs:
        _replay_ms(g, 1)  # uploads
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(replays):
        for s, g, n in zip(samples, graphs, per_graph):
            s.append(_replay_ms(g, 1)[0] * 1000.0 / n)
        if rounds is not None:  # per-round times, for ratios that cancel drift between rounds
            rounds.append([s[-1] for s in samples])
    del graphs, pads
    return [Timing(statistics.median(s), max(s) - min(s), replays) for s in samples]
