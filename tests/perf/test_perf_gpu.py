"""The perf harness end to end on a GPU: a tiny sweep writes a CSV of finite, positive times
and the figures are drawn from it. Run on the GPU machine: ``pytest -m gpu tests/perf/test_perf_gpu.py``."""

from __future__ import annotations

import argparse
import math

import pytest

from hybridgemm.autotune_cache.presets import ProjectionShape
from hybridgemm.perf.csvio import command_as_run, read_rows

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
    assert all(r["gpu"] != "cpu" and r["command"] == command_as_run("pytest tiny sweep") for r in rows)
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
    assert rows[0]["command"].startswith(command_as_run("hybridgemm bench --shape 512,256"))
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


@pytest.mark.gpu_alone  # timed: other kernels beside it would share the HBM bandwidth and the L2
def test_rotating_timing_reads_weights_cold():
    """gpu_time_rotating: enough copies to exceed the L2 several times, and every call reads
    its weights from HBM: no faster than the bytes at the H200's 4.8 TB/s peak (a 32 MiB
    weight left in the 60 MB L2 would read at L2 speed, several times faster), and a weight
    twice as big measures clearly slower."""
    import torch
    import torch.nn.functional as F

    from hybridgemm.perf.timing import gpu_time_many, gpu_time_rotating, rotation_copies

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert rotation_copies(1 << 40) == 2 and rotation_copies(1) == 64
    small, big = (4096, 4096), (8192, 4096)  # 32 MiB and 64 MiB of bf16 weights
    ws = {s: [torch.randn(*s, device="cuda", dtype=torch.bfloat16) for _ in range(rotation_copies(s[0] * s[1] * 2))]
          for s in (small, big)}
    for s in ws:
        assert (len(ws[s]) - 1) * s[0] * s[1] * 2 >= 3 * l2
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    t_small, t_big = gpu_time_rotating([lambda i: F.linear(x, ws[small][i % len(ws[small])]),
                                        lambda i: F.linear(x, ws[big][i % len(ws[big])])],
                                       max(len(v) for v in ws.values()), replays=5)
    peak = 4.8e12 / 1e6  # bytes per µs
    assert t_small.median_us >= 4096 * 4096 * 2 / peak and t_big.median_us >= 8192 * 4096 * 2 / peak, (t_small, t_big)
    assert t_big.median_us > 1.2 * t_small.median_us, (t_small, t_big)
    # the flush method (weights cold after an L2-evicting read) measures the same kernel alike
    flushed = gpu_time_many([lambda: F.linear(x, ws[small][0])], replays=5)[0]
    assert 0.7 < t_small.median_us / flushed.median_us < 1.3, (t_small, flushed)


def test_rotating_skew_moves_what_the_calls_allocate_inside_the_graph():
    """measure.time_placements relies on skew_bytes landing a call's own allocations (outputs)
    elsewhere in the graph's pool: record where F.linear's output lands during capture."""
    import torch
    import torch.nn.functional as F

    from hybridgemm.perf.timing import gpu_time_rotating

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    where: dict[int, set] = {}
    for skew in (0, 193 * 1024):
        seen = where.setdefault(skew, set())

        def call(i, seen=seen):
            y = F.linear(x, ws[i])
            if torch.cuda.is_current_stream_capturing():
                seen.add(y.data_ptr() % (2 << 20))
            return y

        t = gpu_time_rotating([call], len(ws), replays=2, skew_bytes=skew)[0]
        assert math.isfinite(t.median_us) and t.median_us > 0
    assert where[0] and where[193 * 1024] and not where[0] & where[193 * 1024], where
