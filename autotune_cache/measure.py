"""How the tuner measures: CUDA graphs of calls on rotating copies of x and W, replayed in
interleaved rounds, each call scored against F.linear timed in the same rounds; and the
problems and operands it measures on. The benchmarks (perf/) time with the same functions.

Rotating copies: each call reads its own copy of x and W, cycling through enough copies (3x
the L2 size) that every call finds them cold in HBM, as a layer's weights are in a decode
step, with nothing subtracted (an L2 flush before each call would make a ~10 µs kernel the
difference of two ~1.4 ms replays). For an FP8 key (op ``linear_e4m3_*``) W is an
:class:`~hybridgemm.kernels.fp8.FP8Weight`: each copy holds its e4m3 data and its scales, and
the copies are counted by those bytes. Placements: the same kernel timed on operands at other
addresses, or with its output elsewhere, reads 1-3% apart at decode sizes, steady within a
run; :func:`placement_samples` times on several.

Nothing here runs at import time; the functions need a CUDA device when called.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import median

import torch

from hybridgemm.kernels.epilogue import Epilogue
from hybridgemm.kernels.fp8 import GRANULARITY_OF_FORMAT, FP8Weight, quantize_fp8
from hybridgemm.kernels.problem import NAME_TO_DTYPE, Problem

from .keys import TableKey, weight_format_of

PLACEMENTS = 3
PLACEMENT_REPLAYS = 4


@dataclass(frozen=True)
class Timing:
    median_us: float
    spread_us: float  # (max - min) over replays, per call
    replays: int

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "spread_us": self.spread_us, "replays": self.replays}


def elapsed_ms(fn: Callable[[], object]) -> float:
    """GPU time of one ``fn()`` on the current stream, by CUDA events around it (ms); returns
    once it has finished. The graph timings here and in perf/timing.py are built on it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def replay_ms(g: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """ms of each of ``replays`` replays of ``g``, one after the other."""
    return [elapsed_ms(g.replay) for _ in range(replays)]


def replay_interleaved(graphs: list[torch.cuda.CUDAGraph], replays: int) -> list[list[float]]:
    """ms per replay of each graph, over ``replays`` rounds that replay every graph once in
    order, so clock and thermal drift hit all alike; each graph is replayed once beforehand
    (the first replay uploads it) and that one is not counted."""
    for g in graphs:
        replay_ms(g, 1)
    samples: list[list[float]] = [[] for _ in graphs]
    for _ in range(replays):
        for s, g in zip(samples, graphs):
            s.append(elapsed_ms(g.replay))
    return samples


def warm_up(device: torch.device, calls: list[Callable[[], object]]) -> None:
    """Run ``calls`` on a side stream (compilation, plans, lazy allocations happen outside
    any capture), then wait for them."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def rotation_copies(weight_bytes: int, device: torch.device | str = "cuda", l2_multiple: float = 3.0,
                    most: int = 64) -> int:
    """How many copies of a weight to cycle through so that, between two uses of one copy,
    the others (``l2_multiple`` x the L2 size of bytes) have evicted it: each call then reads
    its weights cold from HBM, as with a flush, but with nothing to subtract."""
    device = torch.device(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    l2 = getattr(torch.cuda.get_device_properties(idx), "L2_cache_size", 0) or 64 * 2**20
    return int(min(most, max(2, math.ceil(l2_multiple * l2 / max(weight_bytes, 1)) + 1)))


def clone_operand(t):
    """A copy of x or W at new addresses: an FP8 weight's e4m3 data and its scales both."""
    if isinstance(t, FP8Weight):
        return replace(t, data=t.data.clone(), scale=t.scale.clone())
    return t.clone()


def rotation_lists(x: torch.Tensor, w) -> tuple[list, list]:
    """``(xs, ws)``: x and W themselves first, then clones, :func:`rotation_copies` of each
    (for :func:`gpu_time_rotating`'s ``call(i)``), counted by the bytes x and W hold (an FP8
    weight's e4m3 data and scales)."""
    copies = rotation_copies(x.nbytes + w.nbytes, x.device)
    return [x] + [x.clone() for _ in range(copies - 1)], [w] + [clone_operand(w) for _ in range(copies - 1)]


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
    time_placements).
    """
    device = torch.device(device)
    # compile, plan, and fill per-pointer caches for every copy
    warm_up(device, [lambda call=call: [call(i) for i in range(copies)] for call in calls])
    graphs, per_graph, pads = [], [], []
    for call in calls:
        def one_pass(call=call):
            for i in range(copies):
                call(i)

        passes = int(min(max_passes, max(1, math.ceil(min_graph_ms / max(elapsed_ms(one_pass), 1e-3)))))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            if skew_bytes:  # no kernel touches it; it only moves later allocations of this pool
                pads.append(torch.empty(skew_bytes, dtype=torch.uint8, device=device))
            for _ in range(passes):
                for i in range(copies):
                    call(i)
        graphs.append(g)
        per_graph.append(passes * copies)
    samples = [[t * 1000.0 / n for t in ms] for ms, n in zip(replay_interleaved(graphs, replays), per_graph)]
    if rounds is not None:  # per-round times, for ratios that cancel drift between rounds
        rounds.extend([s[r] for s in samples] for r in range(replays))
    del graphs, pads
    return [Timing(statistics.median(s), max(s) - min(s), replays) for s in samples]


def problem_for(key: TableKey, m: int | None = None) -> Problem:
    """The dense, aligned problem of ``key`` at ``m`` (default: the range's top edge), with the
    weight format its op names."""
    dtype = torch.float32 if key.dtype == "tf32" else NAME_TO_DTYPE[key.dtype]
    return Problem(m=key.m_hi if m is None else m, n=key.n, k=key.k, dtype=dtype,
                   epilogue=Epilogue.from_name(key.epilogue), ldx=key.k, ldw=key.k, ldo=key.n,
                   tf32=key.dtype == "tf32", weight_format=weight_format_of(key.op))


def random_operands(p: Problem, device: torch.device | str = "cuda"):
    """Random x, w, b (None without a bias) and an empty out for ``p``, on ``device``; for an
    FP8 weight format w is that random weight quantized (an FP8Weight computing in x's dtype)."""
    x = torch.randn(p.m, p.k, device=device).to(p.dtype)
    w = (torch.randn(p.n, p.k, device=device) / p.k**0.5).to(p.dtype)
    if p.weight_format:
        w = quantize_fp8(w, GRANULARITY_OF_FORMAT[p.weight_format])
    b = torch.randn(p.n, device=device).to(p.dtype) if p.epilogue.bias else None
    return x, w, b, torch.empty(p.m, p.n, device=device, dtype=p.dtype)


def dense_weight(w, dtype: torch.dtype) -> torch.Tensor:
    """W as F.linear takes it in ``dtype``: an FP8 weight dequantized (what the FP8 call's
    fallback runs before its GEMM), any other W cast (no copy where it has ``dtype``)."""
    return w.dequantize(dtype) if isinstance(w, FP8Weight) else w.to(dtype)


def run_config(backend, config, p: Problem, x: torch.Tensor, w, b, out: torch.Tensor):
    """``backend.run`` of ``config`` on one set of ``p``'s operands; an FP8 weight goes in as its
    e4m3 data with its scales as ``weight_scale``."""
    act = p.epilogue.activation
    if isinstance(w, FP8Weight):
        return backend.run(config, x, w.data, b, out, act, p.tf32, weight_scale=w.scale)
    return backend.run(config, x, w, b, out, act, p.tf32)


def operands_for(p: Problem):
    """:func:`random_operands` plus the rotation copies of (x, w) (:func:`gpu_time_rotating`),
    the first of which are x and w themselves."""
    x, w, b, out = random_operands(p)
    return (x, w, b, out, *rotation_lists(x, w))


def placement_skew(p: int) -> int:
    """Bytes placement ``p`` shifts what the timed calls allocate inside their graphs (0 for
    the first): multiples of 193 KiB (512-byte aligned, like the allocator's blocks) wrapped at
    2 MiB, so that small outputs land at other offsets of their 2 MiB segments."""
    return (p * 193 * 1024) % (2 << 20)


@dataclass
class PlacementSamples:
    """What :func:`placement_samples` measured: the reference's µs per round, every call's
    per-round ratio to the reference (index 0: the reference itself, all 1.0), and every
    call's median µs per placement."""

    ref_us: list[float]
    ratios: list[list[float]]
    per_placement: list[list[float]]

    def scores(self) -> list[tuple[float, float]]:
        """``(µs, spread)`` per call: its median ratio times the reference's median µs, and
        the max - min of its per-placement medians."""

        ref = median(self.ref_us)
        return [(median(r) * ref, max(s) - min(s)) for r, s in zip(self.ratios, self.per_placement)]


def placement_samples(calls, x, w, xs: list, ws: list, outs: list, placements: int = PLACEMENTS,
                      replays: int = PLACEMENT_REPLAYS, first: int = 0) -> PlacementSamples:
    """Times ``calls`` (each ``call(i)`` reads ``xs[i]``, ``ws[i]`` and writes ``outs[0]`` or
    an output it allocates; ``calls[0]`` is the reference, e.g. F.linear) with
    gpu_time_rotating on placements ``first .. first + placements - 1``: placement 0 is the
    operands as given, every other one fresh clones of x and W and a fresh output, allocated
    while the earlier sets are still held (so they land at new addresses), and what the calls
    allocate in their graphs moved by :func:`placement_skew`. The lists are restored before
    returning."""
    first_xs, first_ws, first_outs, held = list(xs), list(ws), list(outs), []
    rounds: list[list[float]] = []
    per_placement: list[list[float]] = [[] for _ in calls]
    try:
        for p in range(first, first + placements):
            if p:
                held.append((list(xs), list(ws), list(outs)))
                xs[:] = [x.clone() for _ in xs]
                ws[:] = [clone_operand(w) for _ in ws]
                outs[:] = [torch.empty_like(o) for o in outs]
            timed = gpu_time_rotating(calls, len(ws), replays=replays, rounds=rounds, skew_bytes=placement_skew(p))
            for s, t in zip(per_placement, timed):
                s.append(t.median_us)
    finally:
        xs[:], ws[:], outs[:] = first_xs, first_ws, first_outs
        del held
    ratios = [[r[j] / r[0] for r in rounds] for j in range(len(calls))]
    return PlacementSamples([r[0] for r in rounds], ratios, per_placement)


def time_placements(calls, x, w, xs: list, ws: list, outs: list, placements: int = PLACEMENTS,
                     replays: int = PLACEMENT_REPLAYS):
    """``(µs, spread)`` per call of ``calls``, timed by :func:`placement_samples`.

    Each call is scored by its time relative to the reference *in the same round*, the median
    of those ratios over all rounds of all placements, times the reference's median: drift of
    the GPU's clocks between rounds and placements (seen as 3-7% spreads at large M) moves
    every call of a round alike and cancels in the ratio. ``spread`` is the max - min of the
    per-placement medians, in µs."""
    return placement_samples(calls, x, w, xs, ws, outs, placements, replays).scores()
