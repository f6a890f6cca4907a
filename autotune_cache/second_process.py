"""Re-time close finalists in a second process, so a choice does not rest on one process's luck.

Why: a kernel's speed can shift for the life of a process. One cuBLASLt algorithm (llama3-8b q,
M=256) read 17.0 µs in one tuning process and 16.0 in the next, steady within each (per-placement
spread 0.1 µs), and 16.9 in a third; a run that saw it fast chose it over a kernel 7% faster
(logs/tune_compare_inprocess_duel.txt). No number of placements inside one process samples that. So
after the tuner has timed every key, the keys whose finalists are close (two or more within
``TIE_TOLERANCE + DUEL_MARGIN`` of the fastest) are timed again here, in one child process
(the same method, on placements the parent did not use), and the parent decides on the rounds of
both processes pooled, each process weighing the same.

    python -m hybridgemm.autotune_cache.second_process JOBS.json RESULTS.json --device N

JOBS.json: ``{"jobs": [{"key": "<table key>", "calls": [{"backend": name, "config": record}, ...]}]}``.
RESULTS.json: ``{"results": [{"ref_us": [...], "ratios": [[...], ...], "per_placement": [[...], ...]}
or {"error": "..."}]}``, one per job, calls in job order after the reference (F.linear). The
child prints ``done <i>`` per job for the parent's progress bar.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

CHILD_TIMEOUT_S = 600


def job_for(key_string: str, finalists: list[tuple[str, dict]]) -> dict:
    return {"key": key_string, "calls": [{"backend": b, "config": c} for b, c in finalists]}


def _child_command(jobs_path: str, out_path: str, device: int) -> list[str]:
    return [sys.executable, "-m", "hybridgemm.autotune_cache.second_process", jobs_path, out_path,
            "--device", str(device)]


def retime(jobs: list[dict], device: int, advance: Callable[[str], None] = lambda s: None,
           log: Callable[[str], None] = print, timeout_s: float = CHILD_TIMEOUT_S) -> list:
    """PlacementSamples (or None where the child could not time it) per job, from one child
    process on GPU ``device``. Never raises for the child's failures: the caller then decides
    on its own process's timings, and says so."""
    from .tuner import PlacementSamples

    if not jobs:
        return []
    with tempfile.TemporaryDirectory(prefix="hybridgemm-retime-") as tmp:
        jobs_path, out_path = os.path.join(tmp, "jobs.json"), os.path.join(tmp, "results.json")
        with open(jobs_path, "w") as f:
            json.dump({"jobs": jobs}, f)
        err_path = os.path.join(tmp, "stderr.txt")
        # stderr to a file, not a pipe: a chatty child (warnings) must not fill a pipe nobody
        # reads while this process reads its progress lines
        with open(err_path, "w") as err_file:
            try:
                proc = subprocess.Popen(_child_command(jobs_path, out_path, device), stdout=subprocess.PIPE,
                                        stderr=err_file, text=True)
            except OSError as e:
                log(f"second process could not start ({e}); deciding on this process's timings alone")
                return [None] * len(jobs)
            watchdog = threading.Timer(timeout_s, proc.kill)  # a hung child must not hang the tuner
            watchdog.start()
            done = 0
            try:
                for line in proc.stdout:  # one "done <i>" per job
                    if line.startswith("done "):
                        done += 1
                        advance(jobs[min(done, len(jobs)) - 1]["key"])
                proc.wait()
            finally:
                watchdog.cancel()
        if proc.returncode != 0 or not os.path.exists(out_path):
            with open(err_path) as f:
                err = f.read()
            if proc.returncode is not None and proc.returncode < 0:
                err += f"\nkilled (signal {-proc.returncode}; the limit is {timeout_s:.0f} s)"
            tail = err.strip().splitlines()[-3:]
            log(f"second process failed (exit {proc.returncode}: {' | '.join(tail)}); "
                "deciding on this process's timings alone")
            return [None] * len(jobs)
        with open(out_path) as f:
            results = json.load(f)["results"]
    out = []
    for job, r in zip(jobs, results):
        if "error" in r:
            log(f"second process could not time {job['key']}: {r['error']}")
            out.append(None)
        else:
            out.append(PlacementSamples(r["ref_us"], r["ratios"], r["per_placement"]))
    return out + [None] * (len(jobs) - len(out))


def _time_job(job: dict) -> dict:
    import torch

    from .table import TableKey
    from .tuner import DUEL_PLACEMENTS, PLACEMENTS, placement_samples, problem_for, record_calls

    p = problem_for(TableKey.from_string(job["key"]))
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = p.tf32
    try:
        x, w, xs, ws, outs, calls = record_calls(p, [(c["backend"], c["config"]) for c in job["calls"]])
        s = placement_samples(calls, x, w, xs, ws, outs, placements=DUEL_PLACEMENTS, first=PLACEMENTS)
        return {"ref_us": s.ref_us, "ratios": s.ratios, "per_placement": s.per_placement}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


def main(argv=None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs")
    ap.add_argument("results")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("second_process: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    with open(args.jobs) as f:
        jobs = json.load(f)["jobs"]
    results = []
    for i, job in enumerate(jobs):
        try:
            results.append(_time_job(job))
        except Exception as e:  # one bad job is reported, the others still count
            results.append({"error": f"{type(e).__name__}: {e}"[:300]})
        print(f"done {i}", flush=True)
    tmp = args.results + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"results": results}, f)
    os.replace(tmp, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
