"""Tuning a set of M ranges into a table file, one range at a time by :mod:`.tuner`'s rule:
which ranges the table already covers (an interrupted run resumes there), compiling the Triton
candidates first on worker processes, progress with an ETA, saving under the file lock every
few ranges and at the end (a range that runs out of GPU memory is logged and left to F.linear),
the default keys of a set of shapes, and re-timing a table's entries (``hybridgemm autotune
--check``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Iterable

import torch

from hybridgemm.kernels.backends import available_backends, get_backend
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import NAME_TO_DTYPE, Problem

from . import tune_glu, tune_moe, tuner
from .keys import OCTAVE_TOPS, TableKey, octave, weight_format_of
from .measure import gpu_time_rotating, problem_for, run_config
from .precompile import compile_tasks, default_jobs, precompile
from .signature import USE
from .table import TuningTable


def covered(table: TuningTable, key: TableKey) -> bool:
    """Whether ``table``'s entries of ``key``'s shape cover every M of ``key``'s range. An
    entry that the running library versions do not trust as it is (``entry_status`` other
    than USE: a cuBLASLt record or Triton config tuned under another version) covers
    nothing: re-tuning replaces it."""
    m = key.m_lo
    for k in table.covering(key):
        if table.entry_status(k)[0] != USE:
            continue
        if k.m_lo > m:
            return False
        m = max(m, k.m_hi + 1)
    return m > key.m_hi


def with_exhaustive(backends: list, limit: int) -> list:
    """``backends`` with cuBLASLt's candidates extended by up to ``limit`` exhaustively
    enumerated algorithms (``limit`` ≤ 0: unchanged)."""
    if limit <= 0:
        return list(backends)
    return [dataclasses.replace(be, candidates=functools.partial(be.candidates, exhaustive_limit=limit))
            if be.name == "cublaslt" else be for be in backends]


def tune(keys: Iterable[TableKey], table: TuningTable, path, *, force: bool = False, backends=None,
         save_every: int = 16, progress: bool = True, log: Callable[[str], None] = print,
         jobs: int | None = None, exhaustive: int = 0, split_depth: int = tuner.SPLIT_DEPTH) -> list[tuner.KeyResult]:
    """Tune ``keys`` (M ranges) into ``table`` and save it to ``path`` (merged under the file
    lock) every ``save_every`` results and at the end. Ranges the table already covers are
    skipped unless ``force`` (so an interrupted run resumes where it stopped). Triton
    candidates are compiled first on ``jobs`` worker processes (default: half the CPUs, at
    most 8; 1 compiles lazily in this process). ``exhaustive``: also time up to that many
    cuBLASLt algorithms from the exhaustive enumeration. ``split_depth``: how many times a
    range may be halved (step 6 of the rule in :mod:`.tuner`)."""
    keys = list(keys)
    if backends is None:  # the FP8-only backends where some key is of an FP8 weight
        backends = available_backends(fp8=any(weight_format_of(k.op) for k in keys))
    backends = with_exhaustive(backends, exhaustive)
    results: list[tuner.KeyResult] = []
    todo = [k for k in keys if force or not covered(table, k)]
    for k in keys:
        if k not in todo:
            results.append(tuner.KeyResult(k, skipped=True))
    t0 = time.time()
    if todo:
        # Write the table once before any timing: an unwritable path (read-only cache dir,
        # a file where a folder should be) fails now, not after the first 16 tuned ranges.
        table.save(path)
    jobs = default_jobs() if jobs is None else jobs
    if todo and jobs > 1:
        tasks = compile_tasks(todo, backends)
        with Progress(progress, len(tasks), "compiling") as advance:
            precompile(todo, backends, jobs, log=log, advance=advance, tasks=tasks)
    unsaved = 0
    with Progress(progress, len(todo), "tuning") as advance:
        for key in todo:
            out_of_memory = None
            try:
                for res in tuner.tune_range(key, backends, log, split_depth):
                    results.append(res)
                    if res.winner is not None:
                        table.set(res.key, tuner.entry_of(res))
                        unsaved += 1
                    else:
                        log(f"no candidate ran for {res.key.to_string()}: {res.rejected[:3]}")
            except torch.OutOfMemoryError as e:
                # A range's operands, outputs and fp32 references at every sample point (an LM
                # head at M = 16384: GBs each) may not fit beside the rotation copies. The range
                # keeps no entry, so F.linear serves it; the ranges tuned so far are kept.
                out_of_memory = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
            if out_of_memory is not None:
                # Outside the except block: its traceback holds the failed range's frames and
                # their tensors, which the cache could not release while it is alive.
                log(f"{key.to_string()}: out of GPU memory while tuning ({out_of_memory}); no entry, "
                    "F.linear serves it")
                results.append(tuner.KeyResult(key, rejected=[("all", "", f"out of GPU memory: {out_of_memory}")]))
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            if unsaved >= save_every:
                table.save(path)
                unsaved = 0
            advance(key.to_string())
    if unsaved or not todo:
        table.save(path)
    split = sum(1 for r in results if not r.skipped and (r.key.m_lo, r.key.m_hi) != octave(r.key.m_hi))
    log(f"tuned {len(todo)} ranges ({len(keys) - len(todo)} already in the table) in {time.time() - t0:.1f} s"
        + (f"; {split} entries are halves of a range one config could not serve" if split else ""))
    return results


class Progress:
    """A rich progress bar with ETA (plain log lines when rich is missing or disabled)."""

    def __init__(self, enabled: bool, total: int, label: str = "tuning"):
        self.enabled, self.total, self.label, self.done, self._p = enabled, total, label, 0, None

    def __enter__(self):
        if self.enabled:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self._p = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                   TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"))
                self._p.start()
                self._task = self._p.add_task("", total=self.total)
            except ImportError:
                self._p = None
        return self.advance

    def advance(self, what: str) -> None:
        self.done += 1
        if self._p is not None:
            self._p.update(self._task, advance=1, description=what)

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.stop()


def keys_for(shapes, ms: Iterable[int] | None = None, dtypes=("bf16",), epilogues=None,
             op: str = "linear", weight_format: str = "") -> list[TableKey]:
    """Table keys for (N, K, bias, activation) shapes x the default-grid ranges holding ``ms`` (default:
    every range, 1 to 16384) x dtypes, for dense, aligned operands (the layout class follows
    from the shape, e.g. an odd K is not 16-byte aligned). The epilogue follows each shape's
    bias and activation unless ``epilogues`` (names) is given. ``weight_format``: an FP8 format
    (kernels/fp8.py FORMAT_OF) gives that format's keys (op ``linear_e4m3_channel``, ...)."""
    ranges = sorted({octave(m) for m in (OCTAVE_TOPS if ms is None else ms)} - {None})
    if weight_format and not set(dtypes) <= {"bf16", "fp16"}:
        raise ValueError(f"an FP8 weight ({weight_format}) computes in bf16 or fp16, not {', '.join(dtypes)}")
    keys = []
    for shape in shapes:
        epis = [Epilogue.from_name(e) for e in epilogues] if epilogues \
            else [Epilogue(Activation.parse(shape.activation), shape.bias)]
        for dt in dtypes:
            dtype = torch.float32 if dt == "tf32" else NAME_TO_DTYPE[dt]
            for epi in epis:
                for lo, hi in ranges:
                    p = Problem(m=hi, n=shape.n, k=shape.k, dtype=dtype, epilogue=epi, ldx=shape.k, ldw=shape.k,
                                ldo=shape.n, tf32=dt == "tf32", weight_format=weight_format)
                    keys.append(TableKey.from_problem(p, op=op).with_range(lo, hi))
    return keys


def check_table(table: TuningTable, keys: Iterable[TableKey] | None = None, log=print) -> list[dict]:
    """Re-time each entry's winner beside F.linear at its range's points (the screen's method)
    and report its worst ratio now against the one recorded."""
    rows = []
    for key in keys if keys is not None else sorted(table.entries, key=lambda k: k.to_string()):
        entry = table.lookup(key)
        if entry is None or tune_moe.parse_moe_op(key.op) or tune_glu.is_glu_op(key.op):
            continue  # MoE and gated entries: re-tuned by autotune --moe and --mlp
        if key.layout != TableKey.from_problem(problem_for(key)).layout:
            continue  # a strided/misaligned layout: not reproducible from the key alone
        ratios = []
        try:
            for m in entry["m_points"]:
                pt = tuner.setup_point(key, m)
                if entry["backend"] == "torch":
                    fn = pt.baseline
                else:
                    be = get_backend(entry["backend"])
                    cfg = be.config_from_record(entry["config"], pt.problem)
                    fn = (lambda i, be=be, cfg=cfg, pt=pt: run_config(be, cfg, pt.problem, pt.xs[i], pt.ws[i], pt.b,
                                                                      pt.outs[0]))
                rounds: list = []
                gpu_time_rotating([pt.baseline, fn], len(pt.ws), replays=9, rounds=rounds)
                ratios.append(tuner.ratios_of(rounds, 1))
        except Exception as e:
            rows.append({"key": key.to_string(), "status": f"rejected: {e}"})
            continue
        worst = min(ratios)
        drift = worst / entry["worst_ratio"] - 1
        rows.append({"key": key.to_string(), "backend": entry["backend"], "recorded_worst": entry["worst_ratio"],
                     "now_worst": worst, "drift": drift, "status": "ok" if drift >= -0.05 else "DRIFT"})
        log(f"{key.to_string():52s} {entry['backend']:14s} worst {entry['worst_ratio']:.3f}x -> {worst:.3f}x "
            f"F.linear ({drift:+.1%})")
    return rows
