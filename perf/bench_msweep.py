"""The M sweep: the dispatched call beside F.linear at many row counts, per projection shape.

    python -m hybridgemm.perf.bench_msweep --out DIR [--model NAME ...] [--points 64] [--random 64]
                                           [--seed 0] [--m-max 16384] [--dtype bf16] [--quick]
                                           [--weights fp8 [--granularity channel|block128]]
    hybridgemm bench --m-sweep [--model NAME ...] [--dtype bf16] [--out DIR/any.csv]
                     [--weights fp8 [--granularity channel|block128]]

What it shows: whether ``hybridgemm.dispatch.fused_linear(x, w, b)`` is slower than
``F.linear(x, w, b)`` at any M. Table entries serve M ranges and were timed at a few M of
each; the sweep times M values the tuner never saw (log-spaced and random), with the same
method but other operands.

- Shapes: every projection (q, kv, fused qkv, o) of the model presets (default: all of
  autotune_cache/presets.PRESETS), identical (N, K, bias) measured once; the row names every
  preset that has the shape (``models``, ';'-joined) and the projections (``projection``).
- M values: ``--points`` log-spaced integers in [1, ``--m-max``] (rounded and deduplicated,
  so fewer remain at small M: 57 of 64 by default), sample "log"; plus ``--random`` M drawn
  log-uniformly in [1, ``--m-max``] from ``numpy.random.default_rng(seed)`` (the same seed gives
  the same M), sample "random", skipping ones already drawn or in the log set.
- Timing: the tuner's method, ``autotune_cache/measure.placement_samples``: CUDA graphs of calls
  on rotating copies of x and W (every call reads them cold from HBM), F.linear and the
  dispatched call replayed in interleaved rounds on ``placements`` fresh sets of operands.
  Per round the dispatched time is divided by F.linear's time in that round, which cancels
  clock drift between rounds; ``speedup`` = 1 / median of those ratios, ``flinear_us`` =
  F.linear's median, ``dispatched_us`` = median ratio x ``flinear_us``.
- What ran: ``decide.choose`` for the same problem (backend, source: table or rule, and
  the entry's validated M range and worst ratio).
- Correctness: once per shape (at the swept M closest to 333), the dispatched result against
  an fp32 reference: relative Frobenius error ≤ 2 x F.linear's own + one rounding unit of the
  dtype; a failure is marked in the row's ``check`` column and makes the exit code 1.
- FP8 columns (``--weights fp8``, bf16/fp16 only): the same points also time
  ``hybridgemm.linear(x, fp8_weight, b)`` on the weight quantized per ``--granularity``
  (kernels/fp8.quantize_fp8), beside F.linear on the bf16 weight in the same rounds (a timing of
  its own, placements as above except that the FP8 copies are one set for all of them):
  ``fp8_us``, ``fp8_speedup`` = F.linear (bf16) / FP8 call, ``fp8_backend`` (the dispatcher's
  choice), ``fp8_read_us`` = the read ceiling of the FP8 bytes (N*K + the fp32 scales), timed
  once per shape (perf/read_ceiling.py), and ``fp8_of_read`` = fp8_read_us / fp8_us.
  ``fp8_check``: at the check's M, the FP8 call against x @ the dequantized weight in fp32,
  bounded by 2 x the error of F.linear on the weight dequantized to x's dtype + one rounding unit.

Writes into ``--out``: ``m_sweep_<gpu>.csv`` (one row per (shape, M), rewritten whole after
every shape: one file holds one run), ``m_sweep_summary.txt`` (what :func:`summary_lines`
prints) and ``m_sweep.png`` (perf/plots_models.plot_m_sweep). Exit code: 0, 1 when a correctness
check failed, 2 when it cannot run (no GPU, bad arguments).
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm import decide, dispatch
from hybridgemm.autotune_cache.measure import gpu_time_rotating, operands_for, placement_samples, rotation_copies
from hybridgemm.autotune_cache.presets import PRESETS, get_preset, preset_names
from hybridgemm.autotune_cache.tune_table import Progress
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.fp8 import FORMAT_OF, FP8Weight
from hybridgemm.kernels.problem import NAME_TO_DTYPE, Problem
from hybridgemm.perf import csvio
from hybridgemm.perf.plot_style import as_bool, shape_label  # noqa: F401 (as_bool used by callers too)
from hybridgemm.perf.plots_models import BELOW, plot_m_sweep  # noqa: F401 (BELOW used by callers too)
from hybridgemm.perf.read_ceiling import fp8_bytes, fp8_in_one_buffer, read_calls
from hybridgemm.perf.weight_formats import add_weight_options, resolve_weight_options, weight_options_problem

COLUMNS = ("models", "projection", "n", "k", "bias", "dtype", "m", "sample", "dispatched_us", "flinear_us", "speedup",
           "backend", "source", "range", "validated_worst", "placements", "replays", "retimed", "date", "commit",
           "check", "fp8_weights", "fp8_us", "fp8_speedup", "fp8_backend", "fp8_read_us", "fp8_of_read", "fp8_check")
SMALL_M = 16  # the decode regime's geomean is reported apart: there the dispatcher differs most from F.linear
CHECK_M = 333  # the correctness check runs at the swept M closest to this (partial tiles at every tile size)
POINTS, RANDOM, M_MAX = 64, 64, 16384
QUICK_POINTS, QUICK_RANDOM = 16, 8
PLACEMENTS, REPLAYS = 2, 3
# A row under RETIME_BELOW is timed again on RETIME_PLACEMENTS more placements (fresh operands)
# and decided on all its rounds pooled: the same kernel reads up to ~2% apart on two sets of
# operand addresses at these sizes (F.linear against itself read 0.978-1.008x over the 943 such
# rows of perf/results/h200/m_sweep_h200.csv).
RETIME_BELOW, RETIME_PLACEMENTS = 0.985, 4
QUICK_PLACEMENTS, QUICK_REPLAYS = 1, 3
CSV_STEM, SUMMARY_FILE = "m_sweep", "m_sweep_summary.txt"
# one rounding unit of the output dtype: the check's floor above 2 x F.linear's own error
ROUNDING_UNIT = {"bf16": 2.0**-9, "fp16": 2.0**-11, "fp32": 1e-5}
LARGE_BYTES = 256 * 2**20  # operands above this are returned to the driver between M values


# ----------------------------------------------------------------------------- shapes and M


@dataclass(frozen=True)
class SweepShape:
    """One (N, K, bias) problem and every preset / projection that has it."""

    n: int
    k: int
    bias: bool
    models: tuple[str, ...]
    projections: tuple[str, ...]

    @property
    def label(self) -> str:
        return shape_label(self.n, self.k, self.bias, ";".join(self.models))


def sweep_shapes(models: Iterable[str] | None = None) -> list[SweepShape]:
    """The projections of ``models`` (preset names; None: every preset), one per distinct
    (N, K, bias), in first-seen order, each naming every preset and projection that has it."""

    presets = list(PRESETS.values()) if models is None else [get_preset(m) for m in models]
    merged: dict[tuple[int, int, bool], tuple[list[str], list[str]]] = {}
    for preset in presets:
        for p in preset.projections:
            names, projs = merged.setdefault((p.n, p.k, p.bias), ([], []))
            if preset.name not in names:
                names.append(preset.name)
            if p.name not in projs:
                projs.append(p.name)
    return [SweepShape(n, k, b, tuple(names), tuple(projs)) for (n, k, b), (names, projs) in merged.items()]


def m_values(points: int = POINTS, random: int = RANDOM, seed: int = 0, m_max: int = M_MAX) -> list[tuple[int, str]]:
    """``(m, sample)`` sorted by m: ``points`` log-spaced integers in [1, m_max] (np.geomspace,
    rounded, deduplicated: fewer than ``points`` remain when they crowd at small M), sample
    "log"; then ``random`` draws log-uniform in [1, m_max] from ``default_rng(seed)``, rounded,
    sample "random", each kept only if not already in the list (so at most ``random``)."""

    if m_max < 1 or points < 0 or random < 0:
        raise ValueError(f"need m_max ≥ 1 and non-negative counts, got m_max={m_max}, points={points}, "
                         f"random={random}")
    log_ms = [int(v) for v in np.unique(np.rint(np.geomspace(1, m_max, points)))] if points else []
    seen = set(log_ms)
    drawn = []
    for v in np.exp(np.random.default_rng(seed).uniform(0.0, math.log(m_max), size=random)):
        m = int(min(max(round(float(v)), 1), m_max))
        if m not in seen:
            seen.add(m)
            drawn.append(m)
    return sorted([(m, "log") for m in log_ms] + [(m, "random") for m in drawn])


# ----------------------------------------------------------------------------- summary (no torch)


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def geomean(values: list[float]) -> float:
    """Geometric mean (nan for none)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def summarize(rows: Iterable[dict]) -> dict:
    """The sweep's numbers from its rows (dicts as written to or read from the CSV; numbers or
    their text). Rows without a positive, finite speedup are counted in ``unmeasured`` only.

    Returns ``rows`` (measured), ``unmeasured``, ``min`` (``{"speedup", "shape", "m"}`` of the
    slowest row, None without rows), ``geomean_all``, ``geomean_log`` / ``n_log`` (sample
    "log"), ``geomean_small_m`` / ``n_small_m`` (M ≤ SMALL_M), ``below`` (rows under
    BELOW), and ``shapes``: per (N, K, bias, dtype) in first-seen order ``{"shape", "rows",
    "min", "min_m", "geomean"}``. Speedup = F.linear time / dispatched time."""
    pts, unmeasured = [], 0
    for r in rows:
        sp, m = _num(r.get("speedup")), _num(r.get("m"))
        if not (math.isfinite(sp) and sp > 0 and math.isfinite(m)):
            unmeasured += 1
            continue
        key = (int(_num(r.get("n"))), int(_num(r.get("k"))), as_bool(r.get("bias")), str(r.get("dtype", "")))
        pts.append((key, str(r.get("models", "")), int(m), str(r.get("sample", "")), sp))
    dtypes = {p[0][3] for p in pts}
    labels: dict[tuple, str] = {}
    for key, models, *_ in pts:
        if key not in labels:
            labels[key] = shape_label(key[0], key[1], key[2], models) + (f" [{key[3]}]" if len(dtypes) > 1 else "")
    worst = min(pts, key=lambda p: (p[4], p[2]), default=None)
    shapes = []
    for key, label in labels.items():
        mine = [p for p in pts if p[0] == key]
        low = min(mine, key=lambda p: (p[4], p[2]))
        shapes.append({"shape": label, "rows": len(mine), "min": low[4], "min_m": low[2],
                       "geomean": geomean([p[4] for p in mine])})
    log_sp = [p[4] for p in pts if p[3] == "log"]
    small = [p[4] for p in pts if p[2] <= SMALL_M]
    return {
        "rows": len(pts), "unmeasured": unmeasured,
        "min": None if worst is None else {"speedup": worst[4], "shape": labels[worst[0]], "m": worst[2]},
        "geomean_all": geomean([p[4] for p in pts]),
        "geomean_log": geomean(log_sp), "n_log": len(log_sp),
        "geomean_small_m": geomean(small), "n_small_m": len(small),
        "below": sum(1 for p in pts if p[4] < BELOW),
        "shapes": shapes,
    }


def summary_lines(s: dict) -> list[str]:
    """:func:`summarize`'s numbers as the text printed at the end and saved to m_sweep_summary.txt."""
    lines = ["M sweep: hybridgemm.dispatch.fused_linear vs F.linear, speedup = F.linear µs / dispatched µs "
             "(> 1: dispatched is faster)",
             f"rows: {s['rows']} over {len(s['shapes'])} shapes" + (f" ({s['unmeasured']} without a time)"
                                                                    if s["unmeasured"] else "")]
    if s["min"] is None:
        return [*lines, "no measured rows"]
    lines += [
        f"minimum speedup: {s['min']['speedup']:.3f}x at M={s['min']['m']} ({s['min']['shape']})",
        f"geomean speedup: {s['geomean_all']:.3f}x over all {s['rows']} rows; "
        f"{s['geomean_log']:.3f}x over the {s['n_log']} sample=log rows; "
        f"{s['geomean_small_m']:.3f}x over the {s['n_small_m']} rows with M ≤ {SMALL_M}",
        f"rows below {BELOW}x: {s['below']}",
        "per shape:",
    ]
    width = max(len(sh["shape"]) for sh in s["shapes"])
    lines += [f"  {sh['shape']:{width}s}  min {sh['min']:.3f}x (M={sh['min_m']})  geomean {sh['geomean']:.3f}x  "
              f"rows {sh['rows']}" for sh in s["shapes"]]
    return lines


def fp8_summary_lines(rows: Iterable[dict]) -> list[str]:
    """The FP8 columns' numbers (none without them): per FP8 format, the geomean speedup of the
    FP8 call over F.linear on the bf16 weight, overall and at M ≤ SMALL_M, and its fraction of
    the FP8 bytes' read ceiling at M ≤ SMALL_M (lowest, geomean, per shape's lowest)."""
    pts: dict[str, list[tuple]] = {}
    for r in rows:
        sp, of_read, m = _num(r.get("fp8_speedup")), _num(r.get("fp8_of_read")), _num(r.get("m"))
        if r.get("fp8_weights") and math.isfinite(sp) and sp > 0 and math.isfinite(m):
            label = shape_label(int(_num(r.get("n"))), int(_num(r.get("k"))), as_bool(r.get("bias")),
                                str(r.get("models", "")))
            pts.setdefault(str(r["fp8_weights"]), []).append((label, int(m), sp, of_read))
    lines = []
    for fmt, mine in pts.items():
        small = [p for p in mine if p[1] <= SMALL_M]
        lines.append(f"FP8 weights ({fmt}): hybridgemm.linear on the e4m3 weight vs F.linear on the bf16 weight: "
                     f"geomean {geomean([p[2] for p in mine]):.3f}x over {len(mine)} rows; "
                     f"{geomean([p[2] for p in small]):.3f}x over the {len(small)} rows with M ≤ {SMALL_M}")
        reads = [p for p in small if math.isfinite(p[3]) and p[3] > 0]
        if reads:
            low = min(reads, key=lambda p: p[3])
            lines.append(f"  of the FP8 bytes' read ceiling at M ≤ {SMALL_M}: geomean "
                         f"{geomean([p[3] for p in reads]):.1%}, lowest {low[3]:.1%} at M={low[1]} ({low[0]})")
    return lines


# ----------------------------------------------------------------------------- files


def gpu_label(name: str) -> str:
    """The CSV's GPU suffix: "h200" for any H200, else the device name lower-cased with every
    run of other characters as one '-' ("NVIDIA A100-SXM4-80GB" -> "nvidia-a100-sxm4-80gb")."""
    if "H200" in name.upper():
        return "h200"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def csv_path(out_dir, gpu_name: str) -> Path:
    return Path(out_dir) / f"{CSV_STEM}_{gpu_label(gpu_name)}.csv"


def write_csv(path, rows: list[dict]) -> None:
    """Write ``rows`` (columns :data:`COLUMNS`) to ``path``, replacing it atomically. Not
    perf/csvio.write_rows: that one upserts on the bench's key columns (gpu, shape, N, K, M,
    provider, method), which these rows do not have."""
    csvio.write_csv(path, COLUMNS, rows)


def git_commit() -> str:
    """The source tree's commit (its hash, never a tag's name), ``-dirty`` appended where its
    files differ from it (``git describe --always --dirty``), or "unknown" (no git, not a
    checkout)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
                             cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ----------------------------------------------------------------------------- measuring (GPU)


def problem_for_m(m: int, n: int, k: int, bias: bool, dtype: str = "bf16"):
    """The Problem of ``F.linear(x[m, k], W[n, k], b)`` on dense operands, built as
    autotune_cache/measure.problem_for builds a key's (with an explicit M)."""

    dt = NAME_TO_DTYPE[dtype]
    tf32 = dt == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)  # as the dispatcher decides it
    return Problem(m=m, n=n, k=k, dtype=dt, epilogue=Epilogue(Activation.NONE, bias), ldx=k, ldw=k, ldo=n, tf32=tf32)


def _check(x, w_ref, b, baseline, result, dtype: str) -> tuple[bool, float, float]:
    """``(ok, rel_err, bound)``: ``result``'s relative Frobenius error against
    ``x @ w_ref.T + b`` in fp32 (TF32 off), bounded by 2 x ``baseline``'s error + one rounding
    unit of ``dtype``."""

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = F.linear(x.float(), w_ref.float(), b.float() if b is not None else None)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    norm = ref.norm().item() or 1.0

    def err(y) -> float:
        return (y.float() - ref).norm().item() / norm

    bound = 2 * err(baseline) + ROUNDING_UNIT[dtype]
    e = err(result)
    return e <= bound, e, bound


def check_dispatched(x, w, b, dtype: str) -> tuple[bool, float, float]:
    """``(ok, rel_err, bound)``: the dispatched result's relative Frobenius error against an
    fp32 reference, bounded by 2 x F.linear's own error + one rounding unit of ``dtype``."""
    return _check(x, w, b, F.linear(x, w, b), dispatch.fused_linear(x, w, b), dtype)


def check_fp8(x, weight: FP8Weight, b, dtype: str) -> tuple[bool, float, float]:
    """``(ok, rel_err, bound)`` of ``hybridgemm.linear(x, weight, b)`` against x @ the weight
    dequantized in fp32, bounded by 2 x the error of F.linear on the weight dequantized to x's
    dtype (what the FP8 path computes where it runs no FP8 kernel) + one rounding unit."""
    return _check(x, weight.dequantize(torch.float32), b, F.linear(x, weight.dequantize(x.dtype), b),
                  hybridgemm.linear(x, weight, b), dtype)


def _verdict(ok: bool, e: float, bound: float) -> str:
    return f"{'ok' if ok else 'FAILED'} (rel err {e:.2e} {'<=' if ok else '>'} {bound:.2e})"


def _choice_columns(problem) -> dict:
    """What the dispatcher runs for ``problem``: backend, source, validated M range, worst ratio."""

    c = decide.choose(problem, torch.cuda.current_device())
    lo, hi, worst = (getattr(c, name, None) for name in ("m_lo", "m_hi", "worst_ratio"))
    return {"backend": c.backend, "source": c.source,
            "range": f"{lo}-{hi}" if lo is not None and hi is not None else "",
            "validated_worst": "" if worst is None else worst}


def _time_pair(p, dtype: str, placements: int, replays: int, check: bool) -> tuple[list, list, str, int]:
    """``(F.linear µs per round, dispatched / F.linear ratio per round, check text, operand
    bytes)`` for problem ``p`` on fresh operands, which are released when this returns."""

    x, w, b, out, xs, ws = operands_for(p)
    verdict = ""
    if check:
        verdict = _verdict(*check_dispatched(x, w, b, dtype))
    calls = [lambda i: F.linear(xs[i], ws[i], b),
             lambda i: dispatch.fused_linear(xs[i], ws[i], b)]  # allocates its own output, as a caller's call does
    samples = placement_samples(calls, x, w, xs, ws, [out], placements=placements, replays=replays)
    nbytes = sum(t.numel() * t.element_size() for t in (*xs, *ws, out))
    return samples.ref_us, samples.ratios[1], verdict, nbytes


def _time_fp8(p, dtype: str, granularity: str, placements: int, replays: int, check: bool
              ) -> tuple[list, list, str, str]:
    """``(F.linear µs per round, FP8 call / F.linear ratio per round, check text, the
    dispatcher's backend for the FP8 weight)`` for problem ``p``: F.linear on rotating bf16
    copies of W and ``hybridgemm.linear`` on an FP8 quantization of each copy, timed together;
    the operands are released when this returns."""

    x, w, b, out, xs, ws = operands_for(p)
    fp8s = [fp8_in_one_buffer(wi, granularity)[0] for wi in ws]
    verdict = _verdict(*check_fp8(x, fp8s[0], b, dtype)) if check else ""
    choice = dispatch.decision_for(x, fp8s[0].data, b, out, None, fp8s[0].weight_format)
    calls = [lambda i: F.linear(xs[i], ws[i], b), lambda i: hybridgemm.linear(xs[i], fp8s[i], b)]
    samples = placement_samples(calls, x, w, xs, ws, [out], placements=placements, replays=replays)
    return samples.ref_us, samples.ratios[1], verdict, choice.backend


def fp8_read_us(shape: SweepShape, granularity: str, dtype: str = "bf16") -> float:
    """The read ceiling of ``shape``'s FP8 weight (µs): the fastest grid of perf/read_ceiling's
    reading kernel over rotating copies of its bytes (e4m3 data and fp32 scales in one buffer)."""

    device = torch.device("cuda", torch.cuda.current_device())
    copies = rotation_copies(fp8_bytes(shape.n, shape.k, granularity), device)
    bufs = [fp8_in_one_buffer(torch.randn(shape.n, shape.k, device=device).to(NAME_TO_DTYPE[dtype]), granularity)[1]
            for _ in range(copies)]
    return min(t.median_us for t in gpu_time_rotating(read_calls(bufs, device), copies, device))


def fp8_columns(ref_us: list, ratios: list, verdict: str, backend: str, granularity: str, read_us: float) -> dict:
    """The FP8 columns of a row from :func:`_time_fp8`'s timing and the shape's read ceiling."""
    flinear_us, ratio = statistics.median(ref_us), statistics.median(ratios)
    fp8_us = ratio * flinear_us
    return {"fp8_weights": FORMAT_OF[granularity], "fp8_us": fp8_us, "fp8_speedup": 1.0 / ratio,
            "fp8_backend": backend, "fp8_read_us": read_us, "fp8_of_read": read_us / fp8_us, "fp8_check": verdict}


def measure_point(shape: SweepShape, m: int, sample: str, dtype: str = "bf16", placements: int = PLACEMENTS,
                  replays: int = REPLAYS, check: bool = False, extra: dict | None = None,
                  fp8: str | None = None, read_us: float = math.nan) -> dict:
    """One row: F.linear and the dispatched call at ``m`` rows, timed together by
    measure.placement_samples (calls[0] F.linear, the reference of every round's ratio); a row
    under RETIME_BELOW is timed again on RETIME_PLACEMENTS more placements and its rounds
    pooled (``retimed``). With ``check``, the dispatched result is first checked
    (:func:`check_dispatched`) and the row's ``check`` column says how it went ("ok ..." or
    "FAILED ..."). ``extra``: more columns. ``fp8``: a granularity, whose FP8 call is timed
    too (:func:`_time_fp8`; the FP8 columns, ``read_us`` the shape's FP8 read ceiling)."""

    p = problem_for_m(m, shape.n, shape.k, shape.bias, dtype)
    ref_us, ratios, verdict, nbytes = _time_pair(p, dtype, placements, replays, check)
    retimed = 1.0 / statistics.median(ratios) < RETIME_BELOW
    if retimed:
        more_ref, more, _, _ = _time_pair(p, dtype, RETIME_PLACEMENTS, replays, False)
        ref_us, ratios = ref_us + more_ref, ratios + more
    if nbytes > LARGE_BYTES:
        torch.cuda.empty_cache()  # the next M's operands differ in size: give these back to the driver
    flinear_us, ratio = statistics.median(ref_us), statistics.median(ratios)
    return {**(extra or {}), "models": ";".join(shape.models), "projection": "/".join(shape.projections),
            "n": shape.n, "k": shape.k, "bias": shape.bias, "dtype": dtype, "m": m, "sample": sample,
            "dispatched_us": ratio * flinear_us, "flinear_us": flinear_us, "speedup": 1.0 / ratio,
            **_choice_columns(p), "placements": placements + (RETIME_PLACEMENTS if retimed else 0),
            "replays": replays, "retimed": retimed, "check": verdict,
            **(fp8_columns(*_time_fp8(p, dtype, fp8, placements, replays, check), fp8, read_us) if fp8 else {})}


@dataclass
class SweepResult:
    rows: list[dict] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "shape M=m: check text" of failed checks


def run_sweep(shapes: list[SweepShape], ms: list[tuple[int, str]], dtype: str = "bf16",
              placements: int = PLACEMENTS, replays: int = REPLAYS, progress: bool = True,
              log: Callable[[str], None] = print, extra: dict | None = None,
              on_shape: Callable[[list[dict]], None] | None = None, fp8: str | None = None) -> SweepResult:
    """:func:`measure_point` for every shape x ``(m, sample)``, the correctness check at the M
    closest to CHECK_M; ``on_shape(rows so far)`` after each shape (to save them). ``fp8``: a
    granularity whose FP8 call every point times too, its read ceiling timed once per shape."""

    res = SweepResult()
    check_m = min((m for m, _ in ms), key=lambda m: (abs(math.log(m / CHECK_M)), m), default=None)
    with Progress(progress, len(shapes) * len(ms), "m-sweep") as advance:
        for shape in shapes:
            read_us = fp8_read_us(shape, fp8, dtype) if fp8 else math.nan
            for m, sample in ms:
                row = measure_point(shape, m, sample, dtype, placements, replays, check=m == check_m, extra=extra,
                                    fp8=fp8, read_us=read_us)
                res.rows.append(row)
                for col in ("check", "fp8_check"):
                    if row.get(col, "").startswith("FAILED"):
                        res.failed.append(f"{shape.label} M={m}{' fp8' if col == 'fp8_check' else ''}: {row[col]}")
                where = f"{row['backend']} ({row['source']}{', M ' + row['range'] if row['range'] else ''})"
                flag = "  BELOW" if row["speedup"] < BELOW else ""
                log(f"{shape.label:44s} M={m:<6d} {sample:6s} F.linear {row['flinear_us']:9.2f} µs  dispatched "
                    f"{row['dispatched_us']:9.2f} µs  {row['speedup']:6.3f}x  {where}{flag}"
                    + (f"  check {row['check']}" if row["check"] else "")
                    + (f"  | {row['fp8_weights']} {row['fp8_us']:9.2f} µs {row['fp8_speedup']:6.3f}x, "
                       f"{row['fp8_of_read']:.1%} of its read ceiling ({row['fp8_backend']})"
                       + (f"  check {row['fp8_check']}" if row["fp8_check"] else "") if fp8 else ""))
                advance(f"{shape.n}x{shape.k} M={m}")
            if on_shape is not None:
                on_shape(res.rows)
    return res


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.bench_msweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for m_sweep_<gpu>.csv, m_sweep_summary.txt, m_sweep.png")
    ap.add_argument("--model", action="append",
                    help=f"model preset (repeatable; default: all of {', '.join(preset_names())})")
    ap.add_argument("--points", type=int, help=f"log-spaced M values before deduplication (default {POINTS}; "
                                               f"--quick {QUICK_POINTS})")
    ap.add_argument("--random", type=int,
                    help=f"log-uniform random M values (default {RANDOM}; --quick {QUICK_RANDOM})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random M values (default 0)")
    ap.add_argument("--m-max", type=int, default=M_MAX, help=f"largest M (default {M_MAX})")
    ap.add_argument("--dtype", default="bf16", choices=sorted(ROUNDING_UNIT))
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_PLACEMENTS} placement, {QUICK_REPLAYS} replays, "
                                                         "fewer M values")
    ap.add_argument("--placements", type=int, help=f"operand placements per M (default {PLACEMENTS}; "
                                                   f"--quick {QUICK_PLACEMENTS})")
    ap.add_argument("--replays", type=int, help=f"rounds per placement (default {REPLAYS})")
    ap.add_argument("--table", help="tuning table for the dispatcher (default: the usual lookup)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plot", action="store_true", help="write the CSV and summary only")
    add_weight_options(ap, "every point also times hybridgemm.linear on the weight quantized to e4m3 (the "
                       "fp8_* columns)")
    args = ap.parse_args(argv)
    problem = weight_options_problem(args.weights, args.granularity, args.dtype)
    if problem:
        ap.error(problem)
    resolve_weight_options(args)
    q = args.quick
    args.points = (QUICK_POINTS if q else POINTS) if args.points is None else args.points
    args.random = (QUICK_RANDOM if q else RANDOM) if args.random is None else args.random
    args.placements = (QUICK_PLACEMENTS if q else PLACEMENTS) if args.placements is None else args.placements
    args.replays = (QUICK_REPLAYS if q else REPLAYS) if args.replays is None else args.replays
    if args.m_max < 1:
        ap.error("--m-max must be ≥ 1")
    if args.points < 0 or args.random < 0 or args.points + args.random < 1:
        ap.error("--points and --random must be ≥ 0, and one of them ≥ 1")
    if args.placements < 1 or args.replays < 1:
        ap.error("--placements and --replays must be ≥ 1")
    try:
        args.model = [get_preset(m).name for m in args.model] if args.model else None
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_msweep: needs a CUDA GPU (none found here): it times the dispatched call and F.linear on the GPU",
              file=sys.stderr)
        return 2

    if args.table:
        decide.set_table_path(args.table)
    shapes = sweep_shapes(args.model)
    ms = m_values(args.points, args.random, args.seed, args.m_max)
    n_log = sum(1 for _, s in ms if s == "log")
    print(f"M sweep on {torch.cuda.get_device_name()}, {args.dtype}: {len(shapes)} shapes x {len(ms)} M values "
          f"({n_log} of {args.points} log-spaced remain after rounding; {len(ms) - n_log} of {args.random} random "
          f"with seed {args.seed} not already there), M in [1, {args.m_max}]; {args.placements} placement(s) x "
          f"{args.replays} replays" + (f"; FP8 weights ({args.granularity}) too" if args.granularity else ""),
          flush=True)
    path = csv_path(args.out, torch.cuda.get_device_name())
    extra = {"date": datetime.date.today().isoformat(), "commit": git_commit()}
    res = run_sweep(shapes, ms, args.dtype, args.placements, args.replays, progress=not args.no_progress,
                    extra=extra, on_shape=lambda rows: write_csv(path, rows), fp8=args.granularity)
    write_csv(path, res.rows)
    lines = summary_lines(summarize(res.rows)) + fp8_summary_lines(res.rows)
    print("\n" + "\n".join(lines))
    (Path(args.out) / SUMMARY_FILE).write_text("\n".join(lines) + "\n")
    print(f"wrote {path} ({len(res.rows)} rows) and {Path(args.out) / SUMMARY_FILE}")
    if not args.no_plot:
        try:

            print(f"wrote {plot_m_sweep(path, args.out)}")
        except ImportError:
            print("note: no matplotlib: skipping m_sweep.png (pip install 'hybridgemm[plot]'; "
                  "perf/plots_models.plot_m_sweep draws it from the CSV anywhere)", file=sys.stderr)
    if res.failed:
        print("bench_msweep: dispatched results failed the correctness check: " + "; ".join(res.failed),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
