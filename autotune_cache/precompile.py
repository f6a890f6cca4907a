"""Compile the Triton candidates of a tuning run in parallel worker processes, before timing.

A cold tune compiles a Triton kernel for each candidate config (565 for llama3-8b's 45
ranges). Compilation is CPU work that parallelises across processes: on the H200 machine 8
workers compiled those 565 in 19.5 s of a 74.5 s cold run
(perf/results/h200/logs/autotune_presets.txt). Each worker builds the kernels of a share of
the candidates, and Triton's on-disk cache (shared by every process of the user) hands
the binaries to the tuner, whose own "compile" is then a cache load. Timing stays in the
single tuner process, one kernel at a time, so the measurements are unchanged.

Workers are spawned (not forked: the parent holds a CUDA context) and each runs every
kernel once on small random operands, which is what makes Triton compile it; a candidate
that fails here is left for the tuner to report.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from hybridgemm.kernels.backends import get_backend

from .keys import TableKey, sample_points
from .measure import problem_for, random_operands, run_config

TRITON_BACKENDS = ("triton_splitk", "triton_gemm")


def default_jobs() -> int:
    """Half the CPUs (the other half keeps the tuner and the driver responsive), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _m_class(m: int) -> int:
    # Triton specialises integer arguments equal to 1 and divisible by 16; values of M that
    # agree on both compile to the same kernel, so one of them is enough.
    return 1 if m == 1 else (16 if m % 16 == 0 else 0)


def compile_tasks(keys: Iterable, backends) -> list[tuple[str, str, dict, int]]:
    """(key, backend, config record, M) per distinct Triton kernel the tuner will launch: every
    candidate at every M a range is timed at, one M per specialisation class."""
    tasks, seen = [], set()
    for key in keys:
        for m in sample_points(key.m_lo, key.m_hi):
            p = problem_for(key, m)
            for be in backends:
                if be.name not in TRITON_BACKENDS:
                    continue
                try:
                    cands = be.candidates(p)
                except Exception:  # the tuner reports it
                    continue
                for cfg in cands:
                    rec = cfg.to_record()
                    ident = (be.name, repr(sorted(rec.items())), key.n, key.k, key.dtype, key.epilogue, key.layout,
                             _m_class(m))
                    if ident not in seen:
                        seen.add(ident)
                        tasks.append((key.to_string(), be.name, rec, m))
    return tasks


def _compile_one(task: tuple[str, str, dict, int]) -> tuple[bool, str]:
    """Worker: run one candidate once (compiling it into Triton's cache)."""
    key_text, backend, record, m = task
    try:
        key = TableKey.from_string(key_text)
        p = problem_for(key, m)
        be = get_backend(backend)
        cfg = be.config_from_record(record, p)
        x, w, b, out = random_operands(p)
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = p.tf32
        try:
            run_config(be, cfg, p, x, w, b, out)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        torch.cuda.synchronize()
        return True, ""
    except Exception as e:  # compile error or unsupported: the tuner will say which and why
        return False, f"{key_text} {backend}: {type(e).__name__}: {e}"[:200]


def _worker_init() -> None:
    torch.cuda.init()


def precompile(keys: Iterable, backends, jobs: int | None = None, log: Callable[[str], None] = print,
               advance: Callable[[str], None] | None = None, tasks: list | None = None) -> dict:
    """Compile every Triton candidate of ``keys`` on ``jobs`` worker processes. Returns
    counts; ``jobs <= 1`` (or nothing to compile) does nothing and the tuner compiles lazily."""
    jobs = default_jobs() if jobs is None else jobs
    tasks = compile_tasks(keys, backends) if tasks is None else tasks
    if jobs <= 1 or not tasks:
        return {"kernels": len(tasks), "failed": 0, "seconds": 0.0, "jobs": 1}
    t0 = time.time()
    failed = 0
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init) as pool:
        futures = [pool.submit(_compile_one, t) for t in tasks]
        for fut in as_completed(futures):
            ok, _ = fut.result()
            failed += not ok
            if advance is not None:
                advance("compiling")
    secs = time.time() - t0
    log(f"compiled {len(tasks)} Triton kernels on {jobs} worker processes in {secs:.1f} s ({failed} failed; "
        "the tuner reports those)")
    return {"kernels": len(tasks), "failed": failed, "seconds": secs, "jobs": jobs}
