"""The perf harness end to end on a GPU: a tiny sweep writes a CSV of finite, positive times
and the figures are drawn from it. Run on the GPU machine: ``pytest -m gpu tests/test_perf_gpu.py``."""

from __future__ import annotations

import argparse
import math

import pytest

from hybridgemm.autotune_cache.presets import ProjectionShape
from hybridgemm.perf.csvio import read_rows

pytestmark = pytest.mark.gpu

SMALL = ProjectionShape("small", 512, 256, True)


def _ok_times(rows, method="gpu"):
    return {(r["provider"], int(r["M"])): float(r["median_us"]) for r in rows
            if r["method"] == method and r["status"] == "ok"}


def test_tiny_sweep_writes_csv_and_plots(tmp_path):
    from hybridgemm.perf.bench import run_bench
    from hybridgemm.perf.plots import make_all_plots

    out = tmp_path / "bench.csv"
    res = run_bench([SMALL], [1, 64], ["flinear", "cublaslt_heuristic", "dispatch"], "bf16", str(out),
                    progress=False, command="pytest tiny sweep")
    rows = read_rows(str(out))
    gpu, eager = _ok_times(rows), _ok_times(rows, "eager")
    for m in (1, 64):
        assert ("flinear", m) in gpu and ("dispatch", m) in gpu, rows
        lt = [r for r in rows if r["provider"] == "cublaslt_heuristic" and r["M"] == str(m) and r["method"] == "gpu"]
        assert lt and (lt[0]["status"] == "ok" or (lt[0]["status"] == "skipped" and "nvmath" in lt[0]["note"]))
    for t in [*gpu.values(), *eager.values()]:
        assert math.isfinite(t) and t > 0
    assert set(eager) == set(gpu)  # every timed provider also has its host time
    assert not any(s["failed"] for s in res.summary)
    assert all(r["gpu"] != "cpu" and r["command"] == "pytest tiny sweep" for r in rows)
    names = {p.name for p in make_all_plots([out], tmp_path / "fig", log=lambda s: None)}
    assert {"tflops_vs_m.png", "dispatch_speedup.png", "host_time.png"} <= names


def test_bench_cli_with_training_and_plot(tmp_path):
    from hybridgemm.perf.cli_commands import add_bench_parser

    ap = argparse.ArgumentParser()
    add_bench_parser(ap.add_subparsers())
    out = tmp_path / "r.csv"
    args = ap.parse_args(["bench", "--shape", "512,256", "--m", "64", "--providers", "flinear", "matmul_add",
                          "--out", str(out), "--training", "--no-progress", "--plot", str(tmp_path / "fig")])
    assert args.fn(args) == 0
    rows = read_rows(str(out))
    train = _ok_times(rows, "fwd_bwd_events")
    assert ("flinear", 64) in train and all(t > 0 for t in train.values())
    assert rows[0]["command"].startswith("hybridgemm bench --shape 512,256")
    assert (tmp_path / "fig" / "tflops_vs_m.png").stat().st_size > 0


def test_best_of_providers_pick_a_correct_candidate(tmp_path):
    """Slower (compiles every Triton candidate): the best-of providers time their candidates
    and keep one that passed the error check."""
    from hybridgemm.perf.bench import run_bench

    res = run_bench([SMALL], [16], ["triton_best", "cublaslt_best"], "bf16", None, progress=False)
    rows = {r["provider"]: r for r in res.rows if r["method"] == "gpu"}
    assert rows["triton_best"]["status"] == "ok" and "best of" in rows["triton_best"]["config"]
    assert rows["cublaslt_best"]["status"] in ("ok", "skipped")
    assert float(rows["triton_best"]["rel_err"]) <= float(rows["triton_best"]["err_bound"])
