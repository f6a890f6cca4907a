"""The offline tuner: for each M range of a shape, time every candidate of every backend
against F.linear at several M across the range, and keep the one that is fastest where it is
slowest.

Selection rule (written down so a re-run reproduces the table):
  1. A range ``[lo, hi]`` is timed at ``keys.sample_points``: both edges and the geometric
     middle. Candidates are the union of every backend's candidates at those M (cuBLASLt:
     its heuristic asked at each call's exact M, then pinned algorithms from its rankings,
     at most ``MAX_PINNED_CUBLASLT``), and each must restore, and match an fp32 reference,
     at every point; a candidate that fails anywhere is dropped.
  2. Timing: measure.gpu_time_rotating. Each call reads its own copy of x and W, cycling
     through enough copies (3x the L2 size) that every call finds them cold in HBM; each
     candidate is one CUDA graph of such calls, and the graphs of all candidates and F.linear
     are replayed in interleaved rounds, so clock and power drift hit all alike. A candidate's
     ratio at a point is F.linear's time over its own in the same round (median over rounds),
     and its score is the least of its ratios over the points.
  3. The screen: ``SCREEN_REPLAYS`` rounds per point. The finalists (scores within
     ``FINALIST_WINDOW`` of the best, at least 3 and at most 6) are timed again at every
     point on ``PLACEMENTS`` placements (fresh operand copies, outputs moved; see
     :func:`placement_samples`), ``PLACEMENT_REPLAYS`` rounds each, and scored again.
     Measured on the H200: llama3-8b's 45 ranges took 74.5 s with a cold Triton cache, 19.5 s
     of it compiling 565 kernels on 8 processes (perf/results/h200/logs/autotune_presets.txt).
  4. F.linear itself is a candidate with ratio 1 everywhere. A kernel is eligible only when
     its score beats F.linear by more than ``ELIGIBLE_MARGIN`` (3%); among the eligible, those
     within ``KERNEL_TIE`` (3%) of the best are ties and the fixed preference order decides:
     backend (cuBLASLt, Triton split-K, Triton tiled), then the backend's own candidate order
     (cuBLASLt's heuristic first). With none eligible, F.linear serves the range. Both
     margins are as wide as the 1-3% that one kernel's ratio moves between processes (see
     placements below), so that a re-run mostly lands on the same side of them.
  5. Validation: a kernel that won is timed beside F.linear at ``keys.validation_points``
     (every M of a range up to 24 wide, else 12 more log-spaced M) and kept only if it is at least
     ``VALIDATE_FLOOR`` of F.linear's speed at each. F.linear's own kernel changes at M values
     no formula predicts, so three points are not enough to trust a pinned config between
     them. A winner that fails is replaced by the next eligible finalist (at most
     ``MAX_VALIDATED`` are tried), else by F.linear.
  6. Where a candidate beat the winner by ``SPLIT_GAIN`` (8%) at some point, or the winner
     failed validation, one config does not serve the whole range: it is halved
     (``keys.split_range``, while at least ``keys.MIN_SPLIT_WIDTH`` wide, up to
     ``split_depth`` times) and each half tuned anew; halves that chose the same kernel are
     joined again.
FP8 keys (op ``linear_e4m3_channel`` / ``linear_e4m3_block128``): W is a random weight
quantized (kernels/fp8.py), and "F.linear" above is what an FP8 call without a usable entry
falls back to past the decode rows: the weight dequantized to x's dtype inside each timed call,
then F.linear, so ratios and the never-slower rule are against that fallback. The reference is
the fp32 product with the weight dequantized in fp32; the candidates are those of the backends
that read an FP8 weight (kernels/backends.py ``FP8_BACKENDS``).
Why ranges timed at several M: a config timed at one M and used for a whole range can be far
slower elsewhere in it, while F.linear asks cuBLAS's heuristic for each exact M and its kernel
changes at M values no formula predicts (:func:`keys.validation_points`). Why
placements: the same kernel timed on operands at other addresses differs by 1-3% at decode
sizes, steady within a run.
Triton candidates are compiled first on worker processes (precompile.py); tuning many
ranges into a table file (resume, progress, saving) is tune_table.py. Nothing here runs at
call time.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hybridgemm.kernels.epilogue import apply_activation
from hybridgemm.kernels.problem import Problem

from .keys import TableKey, sample_points, split_range, validation_points
from .measure import (
    PLACEMENT_REPLAYS,
    PLACEMENTS,
    dense_weight,
    gpu_time_rotating,
    operands_for,
    placement_samples,
    problem_for,
    run_config,
)
from .table import make_entry

ELIGIBLE_MARGIN = 0.03
KERNEL_TIE = 0.03
SCREEN_REPLAYS = 3
FINALIST_WINDOW = 0.06
MIN_FINALISTS, MAX_FINALISTS = 3, 6
SPLIT_GAIN = 0.08
SPLIT_DEPTH = 1
VALIDATE_FLOOR = 0.99
VALIDATE_REPLAYS = 3
MAX_VALIDATED = 2
MAX_PINNED_CUBLASLT = 6
KEEP_CANDIDATES = 5
ERR_FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
TORCH_RANK = (-1, 0)  # F.linear's place in the preference order: first


@dataclass
class Candidate:
    """One candidate of a range: its backend and record (``{}``: cuBLASLt's heuristic), its
    place in the preference order, and its ratio to F.linear (> 1 is faster), µs and spread
    at each of the range's points (screen values until the finals replace them)."""

    backend: str
    record: dict
    rank: tuple[int, int]
    describe: str
    ratios: list[float] = field(default_factory=list)
    us: list[float] = field(default_factory=list)
    spread: list[float] = field(default_factory=list)
    final: bool = False

    @property
    def score(self) -> float:
        return min(self.ratios) if self.ratios else 0.0


@dataclass
class KeyResult:
    key: TableKey
    winner: dict | None = None  # {"backend", "config", "median_us", "spread_us", "describe", "worst_ratio"}
    m_points: list[int] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # the winner's, per point
    runner_up: float | None = None  # the best score among the others
    flinear_us: float | None = None  # at the top point
    timed: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    skipped: bool = False
    split_hint: bool = False  # a candidate beat the winner by SPLIT_GAIN at some point, or it failed validation

    @property
    def worst_ratio(self) -> float | None:
        return min(self.ratios) if self.ratios else None


def finalist_count(scores: list[float]) -> int:
    """How many of the screened candidates (best first) are re-timed: those whose score is
    within ``FINALIST_WINDOW`` of the best, clamped to [MIN_FINALISTS, MAX_FINALISTS]."""
    if not scores:
        return 0
    best = max(scores)
    n = sum(1 for s in scores if s >= best * (1 - FINALIST_WINDOW))
    return min(len(scores), max(MIN_FINALISTS, min(MAX_FINALISTS, n)))


def pick_winner(rows: list[tuple[float, tuple[int, int]]]) -> int:
    """Index of the winner among ``(score, preference rank)`` rows (higher score is better),
    one of which is F.linear's (``TORCH_RANK``, score 1): a kernel must beat F.linear by more
    than ``ELIGIBLE_MARGIN`` at its worst point to be eligible; among the eligible, the earliest
    in preference order within ``KERNEL_TIE`` of the best wins; with none, F.linear."""
    torch_at = next((i for i, (_, r) in enumerate(rows) if r == TORCH_RANK), None)
    eligible = [i for i, (s, r) in enumerate(rows) if r != TORCH_RANK and s > 1 + ELIGIBLE_MARGIN]
    if not eligible:
        if torch_at is not None:
            return torch_at
        eligible = list(range(len(rows)))
    best = max(rows[i][0] for i in eligible)
    ties = [i for i in eligible if rows[i][0] * (1 + KERNEL_TIE) >= best]
    return min(ties, key=lambda i: rows[i][1])


def ratios_of(rounds: list[list[float]], j: int) -> float:
    """F.linear's time over call ``j``'s, per round, median: > 1 means call j is faster."""
    return 1.0 / statistics.median(r[j] / r[0] for r in rounds)


@dataclass
class _Point:
    """One M of a range: its problem, operands (rotation copies) and the candidates' calls."""

    m: int
    problem: Problem
    x: Any
    w: Any
    b: Any
    xs: list
    ws: list
    outs: list
    baseline: Callable[[int], Any]
    err: Callable[[Any], float]
    bound: float
    fns: dict = field(default_factory=dict)  # candidate index -> call(i)


def setup_point(key: TableKey, m: int) -> _Point:
    """``key``'s problem at ``m`` with its operands, the fp32 reference and the baseline: F.linear,
    or for an FP8 key what its fallback runs, the weight dequantized to x's dtype inside each
    call, then F.linear (the reference: the fp32 product with the weight dequantized in fp32)."""
    p = problem_for(key, m)
    act = p.epilogue.activation
    x, w, b, out, xs, ws = operands_for(p)
    outs = [out]  # a list, so that placement_samples can move the output too
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = apply_activation(F.linear(x.float(), dense_weight(w, torch.float32),
                                        b.float() if b is not None else None), act)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    ref_norm = ref.norm().item() or 1.0

    def err(y):
        return (y.float() - ref).norm().item() / ref_norm

    def baseline(i=0):
        return apply_activation(F.linear(xs[i], dense_weight(ws[i], p.dtype), b), act)

    bound = max(2 * err(baseline()), ERR_FLOOR[p.dtype])
    return _Point(m, p, x, w, b, xs, ws, outs, baseline, err, bound)


def _record_key(name: str, record: dict) -> tuple[str, str]:
    return name, json.dumps(record, sort_keys=True)


def gather_candidates(backends, points: list[_Point], rejected: list) -> list[Candidate]:
    """The union of every backend's candidates at the points, in preference order: cuBLASLt's
    heuristic (asked at each call's exact M) first, then per backend its candidates at the top
    point, then those only other points list (for cuBLASLt only their first two: its ranking at
    another M), each once."""
    out: list[Candidate] = []
    seen: set = set()
    top = points[-1]
    for rank_b, be in enumerate(backends):
        per_point = []
        for pt in [top, *points[:-1]]:
            try:
                per_point.append(list(be.candidates(pt.problem)))
            except Exception as e:  # a backend that cannot enumerate is reported, not fatal
                rejected.append((be.name, "candidates", f"M={pt.m}: {e}"[:200]))
                per_point.append([])
        if be.name == "cublaslt":
            records = [{}] if any(per_point) else []
            records += [c.to_record() for c in per_point[0]]
            for cands in per_point[1:]:
                records += [c.to_record() for c in cands[:2]]
        else:
            records = [c.to_record() for cands in per_point for c in cands]
        pinned = 0
        for record in records:
            ident = _record_key(be.name, record)
            if ident in seen:
                continue
            if be.name == "cublaslt" and record:
                if pinned >= MAX_PINNED_CUBLASLT:
                    continue
                pinned += 1
            seen.add(ident)
            out.append(Candidate(be.name, record, (rank_b, len(out)), ""))
    return out


def _bind_candidates(backends, cands: list[Candidate], points: list[_Point], rejected: list) -> list[Candidate]:
    """Restore every candidate at every point, check it against the reference there and warm
    its calls; keep those that pass everywhere (each point's ``fns`` gets their calls)."""
    by_name = {be.name: be for be in backends}
    valid = []
    for c in cands:
        be = by_name[c.backend]
        calls = []
        try:
            for pt in points:
                cfg = be.config_from_record(c.record, pt.problem)
                if not c.describe:
                    c.describe = "heuristic at the exact M" if cfg is None else be.describe(cfg)
                fn = (lambda i=0, be=be, cfg=cfg, pt=pt:
                      run_config(be, cfg, pt.problem, pt.xs[i], pt.ws[i], pt.b, pt.outs[0]))
                pt.outs[0].fill_(float("nan"))
                fn()
                e = pt.err(pt.outs[0])
                if not e <= pt.bound:
                    raise ValueError(f"M={pt.m}: rel err {e:.2e} > {pt.bound:.2e}")
                for i in range(1, len(pt.ws)):  # every copy runs too (plans, launchers per pointer)
                    fn(i)
                calls.append(fn)
            torch.cuda.synchronize()
        except Exception as ex:  # restore/compile failure, launch error, wrong result: drop it
            rejected.append((c.backend, c.describe or json.dumps(c.record)[:80], f"{type(ex).__name__}: {ex}"[:300]))
            continue
        for pt, fn in zip(points, calls):
            pt.fns[len(valid)] = fn
        valid.append(c)
    return valid


def measure_range(key: TableKey, backends, res: KeyResult) -> list[Candidate]:
    """Steps 1-3 of the rule for ``key``'s range: the valid candidates with their final (for
    the finalists) or screen ratios per point; ``res`` gets the points, F.linear's µs at the
    top point and the rejections."""
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        ms = sample_points(key.m_lo, key.m_hi)
        points = []
        for m in ms:
            p = problem_for(key, m)
            torch.backends.cuda.matmul.allow_tf32 = p.tf32
            points.append(setup_point(key, m))
        res.m_points = ms
        valid = _bind_candidates(backends, gather_candidates(backends, points, res.rejected), points, res.rejected)
        flinear = []
        for pt in points:  # the screen
            rounds: list = []
            calls = [pt.baseline] + [pt.fns[j] for j in range(len(valid))]
            times = gpu_time_rotating(calls, len(pt.ws), replays=SCREEN_REPLAYS, rounds=rounds)
            flinear.append(times[0].median_us)
            for j, c in enumerate(valid):
                c.ratios.append(ratios_of(rounds, j + 1))
                c.us.append(times[j + 1].median_us)
                c.spread.append(times[j + 1].spread_us)
        res.flinear_us = flinear[-1] if flinear else None
        ranked = sorted(range(len(valid)), key=lambda j: (-valid[j].score, valid[j].rank))
        finalists = ranked[:finalist_count([valid[j].score for j in ranked])]
        if finalists:
            for c in (valid[j] for j in finalists):
                c.ratios, c.us, c.spread, c.final = [], [], [], True
            top_ref = []
            for pt in points:  # the finals
                calls = [pt.baseline] + [pt.fns[j] for j in finalists]
                s = placement_samples(calls, pt.x, pt.w, pt.xs, pt.ws, pt.outs, placements=PLACEMENTS,
                                      replays=PLACEMENT_REPLAYS)
                ref = statistics.median(s.ref_us)
                top_ref.append(ref)
                for k, j in enumerate(finalists):
                    ratio = statistics.median(s.ratios[k + 1])
                    valid[j].ratios.append(1.0 / ratio)
                    valid[j].us.append(ratio * ref)
                    valid[j].spread.append(max(s.per_placement[k + 1]) - min(s.per_placement[k + 1]))
            res.flinear_us = top_ref[-1]
        return valid
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


def decide(res: KeyResult, cands: list[Candidate], excluded: tuple = ()) -> Candidate:
    """Step 4 (and the split hint of step 5): fill ``res``'s winner, its ratios and the kept
    candidates from ``cands`` (finalists scored on their final timings, the rest on the
    screen), never one of ``excluded`` (winners that failed validation). Returns the winner."""
    n = len(res.m_points)
    torch_row = Candidate("torch", {}, TORCH_RANK, "F.linear", [1.0] * n,
                          [res.flinear_us or 0.0] * n, [0.0] * n, True)
    rows = [torch_row] + [c for c in cands if c.final and c not in excluded]
    winner = rows[pick_winner([(c.score, c.rank) for c in rows])]
    others = sorted((c for c in [torch_row, *cands] if c is not winner), key=lambda c: (-c.score, c.rank))
    res.runner_up = others[0].score if others else None
    res.ratios = list(winner.ratios[:n])
    gain = 1 + SPLIT_GAIN
    res.split_hint = bool(excluded) or any(
        c.ratios[i] >= max(res.ratios[i], 1.0) * gain for c in cands for i in range(min(n, len(c.ratios))))

    def row(c: Candidate) -> dict:
        return {"backend": c.backend, "config": c.record, "median_us": c.us[n - 1] if len(c.us) >= n else 0.0,
                "spread_us": c.spread[n - 1] if len(c.spread) >= n else 0.0, "worst_ratio": c.score,
                "describe": c.describe}

    res.timed = [row(c) for c in [winner] + others[: KEEP_CANDIDATES - 1]]
    res.winner = res.timed[0]
    return winner


def validate(key: TableKey, res: KeyResult, winner: Candidate, backends) -> bool:
    """Time ``winner`` beside F.linear at ``keys.validation_points`` of the range (a fresh x
    and W per point, ``VALIDATE_REPLAYS`` interleaved rounds, checked against the reference
    first). True, with the points and ratios added to ``res``, when it was at least
    ``VALIDATE_FLOOR`` of F.linear's speed at every one; False (``res`` unchanged) otherwise."""
    be = next(b for b in backends if b.name == winner.backend)
    got = []
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for m in validation_points(key.m_lo, key.m_hi):
            pt = setup_point(key, m)
            torch.backends.cuda.matmul.allow_tf32 = pt.problem.tf32
            cfg = be.config_from_record(winner.record, pt.problem)

            def fn(i=0, cfg=cfg, pt=pt):
                return run_config(be, cfg, pt.problem, pt.xs[i], pt.ws[i], pt.b, pt.outs[0])

            pt.outs[0].fill_(float("nan"))
            fn()
            if not pt.err(pt.outs[0]) <= pt.bound:
                res.rejected.append((winner.backend, winner.describe, f"M={m}: wrong result"))
                return False
            rounds: list = []
            gpu_time_rotating([pt.baseline, fn], len(pt.ws), replays=VALIDATE_REPLAYS, rounds=rounds)
            got.append((m, ratios_of(rounds, 1)))
            if got[-1][1] < VALIDATE_FLOOR:
                res.rejected.append((winner.backend, winner.describe,
                                     f"M={m}: {got[-1][1]:.3f}x F.linear (validation floor {VALIDATE_FLOOR})"))
                return False
    except Exception as e:  # a config that cannot run at some M of the range cannot serve it
        res.rejected.append((winner.backend, winner.describe, f"validation: {type(e).__name__}: {e}"[:300]))
        return False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    merged = sorted([*zip(res.m_points, res.ratios), *got])
    res.m_points, res.ratios = [m for m, _ in merged], [r for _, r in merged]
    res.winner["worst_ratio"] = min(res.ratios)
    return True


def merge_results(results: list[KeyResult]) -> list[KeyResult]:
    """Adjacent results with the same winner (backend and config) as one result over their
    joined range, timed at all their points: a split that chose the same kernel twice."""
    out: list[KeyResult] = []
    for r in results:
        prev = out[-1] if out else None
        if (prev is not None and r.winner and prev.winner and prev.key.m_hi + 1 == r.key.m_lo
                and (prev.winner["backend"], prev.winner["config"]) == (r.winner["backend"], r.winner["config"])):
            joined = KeyResult(prev.key.with_range(prev.key.m_lo, r.key.m_hi), m_points=prev.m_points + r.m_points,
                               ratios=prev.ratios + r.ratios, flinear_us=r.flinear_us,
                               rejected=prev.rejected + r.rejected)
            joined.runner_up = max(x for x in (prev.runner_up, r.runner_up) if x is not None) \
                if prev.runner_up is not None or r.runner_up is not None else None
            joined.timed = [dict(r.timed[0], worst_ratio=min(joined.ratios))] + r.timed[1:]
            joined.winner = joined.timed[0]
            out[-1] = joined
        else:
            out.append(r)
    return out


def tune_range(key: TableKey, backends, log: Callable[[str], None] = lambda s: None,
               split_depth: int = SPLIT_DEPTH) -> list[KeyResult]:
    """Tune ``key``'s range (the rule above); where one config cannot serve it whole, its
    halves instead. Returns one result per range decided (halves that chose the same kernel
    joined again)."""
    res = KeyResult(key)
    cands = measure_range(key, backends, res)
    excluded: list[Candidate] = []
    winner = decide(res, cands)
    halves = split_range(key.m_lo, key.m_hi) if split_depth > 0 else None
    while winner.backend != "torch":
        if validate(key, res, winner, backends):
            break
        excluded.append(winner)
        if halves is not None or len(excluded) >= MAX_VALIDATED:
            winner = decide(res, [], tuple(excluded))  # F.linear; the halves may still do better
            break
        winner = decide(res, cands, tuple(excluded))
    if halves is None or not res.split_hint:
        return [res]
    log(f"{key.to_string()}: one config does not serve the whole range; tuning its halves")
    out = []
    for lo, hi in halves:
        out += tune_range(key.with_range(lo, hi), backends, log, split_depth - 1)
    return merge_results(out)


def entry_of(res: KeyResult) -> dict:
    w = res.winner
    cands = [{k: c[k] for k in ("backend", "config", "median_us", "spread_us", "worst_ratio")} for c in res.timed]
    return make_entry(w["backend"], w["config"], m_points=res.m_points, ratios=res.ratios,
                      median_us=w["median_us"], spread_us=w["spread_us"], candidates=cands,
                      flinear_us=res.flinear_us)
