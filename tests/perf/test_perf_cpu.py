"""The perf harness without a GPU: CSV schema and upsert, figures from the committed fixture,
CLI errors, the provider registry, and the sweep's bookkeeping with injected timers."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import bench_cli
from hybridgemm.autotune_cache.presets import ProjectionShape
from hybridgemm.perf import providers as P
from hybridgemm.perf.bench import print_summary, run_bench, shapes_for
from hybridgemm.perf.csvio import KEY_COLUMNS, command_as_run, environment_columns, read_rows, write_csv, write_rows
from hybridgemm.perf.plots import load_rows, make_all_plots
from hybridgemm.perf.timing import Timing

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "bench_fixture.csv"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("tflops_vs_m.png", "dispatch_speedup.png", "attention_path.png", "host_time.png")



def _row(gpu, m, provider, us, **extra):
    return dict(gpu=gpu, shape="s", N=64, K=32, M=m, dtype="bf16", epilogue="bias", provider=provider,
                method="gpu", status="ok", median_us=us, **extra)


# ----------------------------------------------------------------------------- CSV


def test_csv_upsert_keeps_other_gpus_and_replaces_same_key(tmp_path):
    path = str(tmp_path / "r.csv")
    write_rows(path, [_row("GPU-A", 1, "flinear", 10.0), _row("GPU-A", 16, "flinear", 11.0)])
    write_rows(path, [_row("GPU-B", 1, "flinear", 20.0, note="other box")])
    write_rows(path, [_row("GPU-A", 1, "flinear", 9.5)])  # re-measured: replaces, never duplicates
    rows = read_rows(path)
    got = {(r["gpu"], r["M"]): float(r["median_us"]) for r in rows}
    assert got == {("GPU-A", "1"): 9.5, ("GPU-A", "16"): 11.0, ("GPU-B", "1"): 20.0}
    header = list(rows[0])
    assert header[: len(KEY_COLUMNS)] == list(KEY_COLUMNS) and header[len(KEY_COLUMNS)] == "status"
    assert [r["note"] for r in rows if r["gpu"] == "GPU-B"] == ["other box"]  # union of columns


def test_csv_upsert_refuses_a_csv_whose_rows_it_would_merge(tmp_path):
    """An end-to-end CSV (no GEMM key columns) or new rows sharing a key: a clear error, the
    file as it was."""
    path = tmp_path / "e2e.csv"
    path.write_text("model,mode,batch,ms_per_token\nm,compiled,1,2.0\nm,compiled,8,3.0\n")
    before = path.read_text()
    with pytest.raises(ValueError, match="share a key"):
        write_rows(str(path), [_row("GPU-A", 1, "flinear", 10.0)])
    assert path.read_text() == before
    with pytest.raises(ValueError, match="new rows share a key"):
        write_rows(str(tmp_path / "r.csv"), [_row("GPU-A", 1, "flinear", 10.0), _row("GPU-A", 1, "flinear", 9.0)])
    assert not (tmp_path / "r.csv").exists()


def test_environment_columns_name_the_machine_and_command():
    env = environment_columns("hybridgemm bench --model gpt2")
    assert env["command"] == command_as_run("hybridgemm bench --model gpt2")
    assert env["torch"] == torch.__version__ and env["gpu"] and env["hybridgemm"]


def test_a_rows_command_carries_the_hybridgemm_switches_it_ran_under(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("HYBRIDGEMM_")]:
        monkeypatch.delenv(k)
    assert command_as_run("hybridgemm bench --e2e") == "hybridgemm bench --e2e"
    monkeypatch.setenv("HYBRIDGEMM_PDL_PREFETCH", "1")
    monkeypatch.setenv("HYBRIDGEMM_TABLE", "/tmp/my table.json")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/x")  # not ours: left out
    monkeypatch.setenv("HYBRIDGEMM_TEST_SEED", "7")  # the test harness's: left out
    env = environment_columns("hybridgemm bench --e2e")
    assert env["command"] == "HYBRIDGEMM_PDL_PREFETCH=1 HYBRIDGEMM_TABLE='/tmp/my table.json' hybridgemm bench --e2e"
    assert command_as_run("") == "HYBRIDGEMM_PDL_PREFETCH=1 HYBRIDGEMM_TABLE='/tmp/my table.json'"


def test_fixture_has_the_documented_content():
    rows = load_rows([FIXTURE])
    gpu = [r for r in rows if r["method"] == "gpu" and r["status"] == "ok"
           and r["provider"] not in ("stock", "naive_fused", "hybridgemm")]
    assert {r["shape"] for r in gpu} >= {"llama3-8b.qkv", "llama3-8b.q/o"}
    assert {r["M"] for r in gpu} == {1, 128, 4096}
    assert {"flinear", "cublaslt_heuristic", "triton_best", "dispatch"} <= {r["provider"] for r in gpu}
    assert any(r["method"] == "eager" for r in rows) and any(r["provider"] == "stock" for r in rows)
    assert all(r["median_us"] > 0 for r in gpu)


# ----------------------------------------------------------------------------- plots


def test_make_all_plots_from_fixture_writes_every_figure(tmp_path):
    written = make_all_plots([FIXTURE], tmp_path, log=lambda s: None)
    assert sorted(p.name for p in written) == sorted(FIGURES)
    for p in written:
        data = p.read_bytes()
        assert len(data) > 10_000 and data[:8] == PNG_MAGIC, p


def test_attention_figure_skipped_with_a_note_without_its_rows(tmp_path):
    only_linear = tmp_path / "linear.csv"
    write_rows(str(only_linear), [r for r in read_rows(str(FIXTURE)) if r["provider"] not in ("stock", "hybridgemm",
                                                                                              "naive_fused")])
    notes = []
    written = make_all_plots([only_linear], tmp_path / "out", log=notes.append)
    assert "attention_path.png" not in {p.name for p in written}
    assert any("attention" in n for n in notes)
    assert "tflops_vs_m.png" in {p.name for p in written}


def test_tensor_parallel_and_error_only_csvs(tmp_path):
    """A bench_tp CSV gets the tensor-parallel figure, not the end-to-end one; a bench_tp or
    bench_e2e CSV of error modes only (no timed row) gets none, with a note, and stops nothing."""
    tp_csv = Path(__file__).resolve().parents[2] / "perf/results/h200x2/tp_h200x2.csv"
    errors = Path(__file__).resolve().parents[2] / "perf/results/h200/tp_errors_one_gpu_h200.csv"
    e2e_errors = tmp_path / "e2e_errors.csv"
    e2e_rows = [r for r in read_rows(str(Path(__file__).resolve().parents[2] / "perf/results/h200/e2e_h200.csv"))
                if r["mode"] in ("logits_error", "decode_error")]
    write_csv(e2e_errors, list(e2e_rows[0]), e2e_rows)
    notes: list = []
    written = make_all_plots([str(tp_csv), str(errors), str(e2e_errors)], tmp_path / "out", log=notes.append)
    assert [p.name for p in written] == ["tp.png"] and written[0].read_bytes()[:8] == PNG_MAGIC
    assert sum("no timed rows" in n for n in notes) == 2, notes


def test_two_gpus_in_one_csv_give_one_figure_each(tmp_path):
    rows = read_rows(str(FIXTURE))
    other = [dict(r, gpu="NVIDIA H100 80GB HBM3") for r in rows if r["method"] == "gpu"]
    path = tmp_path / "two.csv"
    write_rows(str(path), rows + other)
    names = {p.name for p in make_all_plots([path], tmp_path / "out", log=lambda s: None)}
    assert {"tflops_vs_m_nvidia-h200_bf16.png", "tflops_vs_m_nvidia-h100-80gb-hbm3_bf16.png"} <= names


def test_plot_cli_works_and_missing_file_is_a_clear_error(tmp_path, capsys):
    assert bench_cli("plot", str(FIXTURE), "--out", str(tmp_path)) == 0
    assert "tflops_vs_m.png" in capsys.readouterr().out
    assert bench_cli("plot", str(tmp_path / "nope.csv"), "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "no such CSV file" in err and "nope.csv" in err


# ----------------------------------------------------------------------------- bench CLI


def test_bench_without_gpu_says_so_and_returns_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cli("bench", "--model", "llama3-8b", "--m", "1", "16") == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_unknown_provider_is_rejected_before_anything_runs(capsys):
    assert bench_cli("bench", "--providers", "flinear", "warp_drive") == 2
    err = capsys.readouterr().err
    assert "warp_drive" in err and "cublaslt_best" in err  # names the known ones


def test_bench_list_providers_works_anywhere(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cli("bench", "--list-providers") == 0
    out = capsys.readouterr().out
    for name in P.provider_names():
        assert name in out
    assert "skipped here: needs a CUDA GPU" in out and "opt-in" in out


# ----------------------------------------------------------------------------- registry


def test_registry_names_defaults_and_baseline_first():
    names = P.provider_names()
    assert {"flinear", "matmul_add", "cublaslt_heuristic", "cublaslt_best", "triton_best", "dispatch",
            "compile_max_autotune"} <= set(names)
    default = [p.name for p in P.select(None)]
    assert default[0] == "flinear" and "compile_max_autotune" not in default
    assert [p.name for p in P.select(["dispatch", "compile_max_autotune"])] == ["flinear", "dispatch",
                                                                                "compile_max_autotune"]
    with pytest.raises(ValueError, match="unknown provider"):
        P.select(["nope"])


def test_unavailable_providers_are_skipped_with_a_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, skipped = P.split_available(P.select(P.provider_names()))
    assert {p.name for p in ok} == {"flinear", "matmul_add"}
    assert all("CUDA" in note for note in skipped.values()) and "dispatch" in skipped
    pt = P.make_problem_tensors("t", 2, 8, 16, torch.float32, True, device="cpu")
    with pytest.raises(P.ProviderSkip, match="CUDA"):
        P.build(P.PROVIDERS["cublaslt_best"], pt)


def test_missing_nvmath_is_a_note_not_an_error(monkeypatch):
    from hybridgemm.kernels import cublaslt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cublaslt, "is_available", lambda: False)
    assert "nvmath" in P.PROVIDERS["cublaslt_heuristic"].unavailable()
    assert P.PROVIDERS["triton_best"].unavailable() is None


def test_problem_tensors_bound_follows_flinear_error():
    pt = P.make_problem_tensors("t", 4, 32, 64, torch.bfloat16, True, "relu", device="cpu")
    assert pt.bound >= P.ERR_FLOOR[torch.bfloat16] and pt.bound >= 2 * pt.flinear_err
    assert pt.passes(P.build(P.PROVIDERS["flinear"], pt)())[0]
    assert pt.passes(P.build(P.PROVIDERS["matmul_add"], pt)())[0]
    assert not pt.passes(pt.ref * 1.05)[0]
    assert pt.rel_err(torch.full_like(pt.ref, float("nan"))) == float("inf")


# ----------------------------------------------------------------------------- sweep bookkeeping


def _fake_timers():
    """Timers whose 'GPU time' is a fn's ``fake_us`` attribute (10 µs by default)."""
    def gpu(fn, reps=1, replays=7):
        return Timing(getattr(fn, "fake_us", 10.0), 0.1, replays)

    def eager(fns, calls=200):
        return {name: Timing(20.0 + i, 0.5, 7) for i, name in enumerate(fns)}

    return P.Timers(gpu=gpu, eager=eager, events=lambda fn: (fn(), Timing(30.0, 1.0, 25))[1], reps=lambda fn: 1)


def test_fastest_keeps_the_fastest_correct_candidate():
    pt = P.make_problem_tensors("t", 4, 32, 64, torch.float32, True, device="cpu", timers=_fake_timers())
    x, w, b = pt.x, pt.w, pt.b
    slow, fast, wrong = (lambda: F.linear(x, w, b)), (lambda: F.linear(x, w, b)), (lambda: F.linear(x, w, b) * 2)
    slow.fake_us, fast.fake_us, wrong.fake_us = 9.0, 5.0, 1.0

    def broken():
        raise RuntimeError("does not compile")

    best = P.fastest(pt, [("slow", slow), ("wrong", wrong), ("broken", broken), ("fast", fast)], "test")
    assert best is fast and P.config_of(best) == "fast (best of 2, 2 rejected)"
    with pytest.raises(P.ProviderSkip, match="no test candidate ran"):
        P.fastest(pt, [("wrong", wrong)], "test")


def test_sweep_records_ok_failed_and_skipped_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def bad(pt):  # a provider with a wrong result must be recorded as failed and not timed
        x, w, b = pt.x, pt.w, pt.b
        return lambda: F.linear(x, w, b) * 1.5

    monkeypatch.setitem(P.PROVIDERS, "bad", P.Provider("bad", bad, "wrong on purpose"))
    out = tmp_path / "bench.csv"
    res = run_bench([ProjectionShape("tiny", 48, 64, True)], [1, 8], ["matmul_add", "bad", "dispatch"], "bf16",
                    str(out), training=True, progress=False, device="cpu", timers=_fake_timers(),
                    command="hybridgemm bench --shape 48,64", log=lambda s: None)
    rows = read_rows(str(out))
    by = {(r["provider"], r["method"], r["M"]): r for r in rows}
    assert by[("flinear", "gpu", "1")]["status"] == "ok" and float(by[("flinear", "gpu", "1")]["median_us"]) == 10.0
    assert by[("matmul_add", "eager", "8")]["status"] == "ok"
    assert by[("bad", "gpu", "1")]["status"] == "failed" and by[("bad", "gpu", "1")]["median_us"] == ""
    assert ("bad", "eager", "1") not in by
    assert by[("dispatch", "gpu", "8")]["status"] == "skipped" and "CUDA" in by[("dispatch", "gpu", "8")]["note"]
    assert by[("flinear", "fwd_bwd_events", "8")]["status"] == "ok"
    assert ("hybridgemm_linear", "fwd_bwd_events", "8") in by
    assert all(r["command"] == command_as_run("hybridgemm bench --shape 48,64") for r in rows)
    assert [s["failed"] for s in res.summary] == [["bad"], ["bad"]]
    buf = io.StringIO()
    from rich.console import Console

    print_summary(res, Console(file=buf, width=200))
    assert "tiny" in buf.getvalue() and "winner" in buf.getvalue()


def test_shapes_for_merges_identical_projections():
    shapes = shapes_for(["llama3-8b"], ["6144,4096"])
    assert [s.name for s in shapes] == ["llama3-8b.q/o", "llama3-8b.kv", "llama3-8b.qkv", "6144,4096"]
    assert not shapes[0].bias and shapes[3].bias
    assert all(s.bias for s in shapes_for(["llama3-8b"], bias="on"))
    with pytest.raises(ValueError, match="unknown model preset"):
        shapes_for(["gpt-9"])


# ----------------------------------------------------------------------------- bench_modes


def test_bench_modes_arguments_and_no_gpu_message(monkeypatch, capsys, tmp_path):
    from hybridgemm.perf import bench_modes as BM

    args = BM.parse_args(["--out", str(tmp_path)])
    assert args.ms == (1, 16, 1024, 4096, 16384) and not args.quick
    assert BM.parse_args(["--out", "d", "--quick"]).ms == BM.QUICK_MS
    assert BM.parse_args(["--out", "d", "--m", "8", "2048"]).ms == (8, 2048)
    for bad in ([], ["--out", "d", "--m", "0"], ["--out", "d", "--m", "x"]):
        with pytest.raises(SystemExit):
            BM.parse_args(bad)
    capsys.readouterr()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert BM.main(["--out", str(tmp_path), "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written without a GPU


def test_bench_modes_shapes_and_summary():
    from hybridgemm.perf import bench_modes as BM

    assert BM.bench_shapes() == [("llama3-8b.q/o", 4096, 4096), ("llama3-8b.kv", 1024, 4096),
                                 ("llama3-8b.qkv", 6144, 4096), ("llama3-70b.qkv", 10240, 8192),
                                 ("llama3-70b.o", 8192, 8192)]
    assert BM.gpu_slug("NVIDIA H200") == "h200" and BM.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    times = {("a", 1): {"batch_invariant": 20.0, "default": 10.0},  # M < 1024: not in the worst
             ("a", 1024): {"batch_invariant": 10.0, "default": 9.0},
             ("b", 4096): {"batch_invariant": 12.0, "default": 6.0},
             ("b", 16384): {"default": 6.0}}  # batch_invariant failed: no ratio
    lines, worst = BM.summarize(times)
    assert worst == (0.5, "b M=4096")
    assert "0.900x" in lines[1] and "0.500x" in lines[1] and "0.500x" in lines[2] and "-" in lines[2]


def test_plotting_every_committed_csv_succeeds(tmp_path):
    """`hybridgemm plot` over every committed H200 CSV (kernel benchmarks, the M sweeps, MLP,
    end to end, and CSVs no figure reads, such as the e2e profile's kernel rows): none of them
    may stop it."""
    committed = sorted(Path(__file__).resolve().parents[2].joinpath("perf/results/h200").glob("*.csv"))
    assert any(p.name == "e2e_profile_h200.csv" for p in committed) and any(p.name == "e2e_h200.csv" for p in committed)
    written = make_all_plots([str(p) for p in committed], tmp_path, log=lambda s: None)
    assert {"e2e.png", "e2e_fp8.png"} <= {p.name for p in written}  # two e2e CSVs: named after each
