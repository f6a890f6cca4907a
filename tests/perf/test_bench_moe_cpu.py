"""perf/bench_moe.py and its figure without a GPU: the figure from a CSV of its rows (one per
shape, provider, method and token count; recognised by make_all_plots), its errors, the CLI's
refusals."""

from __future__ import annotations

import csv

import pytest

from hybridgemm.perf import bench_moe, plots
from hybridgemm.perf.csvio import write_rows
from hybridgemm.perf.plots_models import is_moe_csv, moe_floors, plot_moe


def _rows():
    return [dict(gpu="G", shape=shape, hidden=h, experts=e, intermediate=i, top_k=k, M=m, experts_hit=min(e, m * k),
                 floor_us=10.0 * m, dtype="bf16", provider=p, method=method, status="ok", median_us=us * m)
            for shape, h, e, i, k in [("qwen3-30b-a3b", 2048, 128, 768, 8), ("mixtral-8x7b", 4096, 8, 14336, 2)]
            for m in (1, 8, 2048) for method in ("graph", "events")
            for p, us in [("transformers_grouped_mm", 50.0), ("hybridgemm", 20.0)]]


def test_plot_moe_draws_each_shape_and_make_all_plots_finds_it(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "moe_x.csv"
    write_rows(str(path), _rows())
    assert is_moe_csv(path)
    with open(path) as f:
        assert len(list(csv.DictReader(f))) == len(_rows())  # M is part of each row's key
    out = plots.make_all_plots([path], tmp_path / "plots", log=lambda s: None)
    assert [p.name for p in out] == ["moe.png"] and out[0].stat().st_size > 10_000


def test_plot_moe_draws_fp8_rows_with_their_own_floor(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(r, weights="bf16") for r in _rows()]
    rows += [dict(r, provider="hybridgemm_fp8_channel", weights="e4m3_channel", floor_us=r["floor_us"] / 2,
                  median_us=r["median_us"] / 2) for r in rows if r["provider"] == "hybridgemm"]
    path = tmp_path / "moe_fp8.csv"
    write_rows(str(path), rows)
    out = plot_moe(path, tmp_path)
    assert out.stat().st_size > 10_000
    qwen = [r for r in rows if r["shape"] == "qwen3-30b-a3b"]
    floors = {label: points for label, _, points in moe_floors(qwen)}
    assert floors == {"HBM floor (experts hit)": [(1, 10.0), (8, 80.0), (2048, 20480.0)],
                      "HBM floor (experts hit, FP8 per channel)": [(1, 5.0), (8, 40.0), (2048, 10240.0)]}
    assert [label for label, _, _ in moe_floors(_rows())] == ["HBM floor (experts hit)"]  # rows of old CSVs


def test_plot_moe_errors(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(FileNotFoundError):
        plot_moe(tmp_path / "missing.csv", tmp_path)
    path = tmp_path / "failed.csv"
    write_rows(str(path), [dict(_rows()[0], status="error", median_us="")])
    with pytest.raises(ValueError, match="no rows with a time"):
        plot_moe(path, tmp_path)


def test_cli_without_a_gpu_and_bad_tokens(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_moe.torch.cuda, "is_available", lambda: False)
    assert bench_moe.main(["--out", str(tmp_path / "x.csv")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_moe.main(["--tokens", "0", "--out", str(tmp_path / "x.csv")])
    assert e.value.code == 2 and "positive" in capsys.readouterr().err


def test_bench_shape_rows_on_the_cpu_with_stand_in_timings(monkeypatch):
    """One shape's rows end to end (the CPU computes, the timings are stand-ins): every provider
    per method, each with its own floor and the fraction of it, the FP8 rows with their error
    against their dequantized weights."""
    from types import SimpleNamespace

    monkeypatch.setitem(bench_moe.SHAPES, "tiny", (256, 4, 128, 2))  # floors of 0.1 µs or more
    timing = SimpleNamespace(median_us=5.0, spread_us=0.5)
    monkeypatch.setattr(bench_moe, "events_time_interleaved", lambda fns, rounds: dict.fromkeys(fns, timing))
    monkeypatch.setattr(bench_moe, "gpu_time_many", lambda fns, replays: [timing] * len(fns))
    rows = bench_moe.bench_shape("tiny", 3, {"gpu": "cpu"}, rounds=1, weights_kinds=("bf16", "fp8"), device="cpu")
    by = {(r["method"], r["provider"]): r for r in rows}
    ours = [p for _, p in by if p.startswith("hybridgemm")]
    assert {"hybridgemm", "hybridgemm_fp8_channel", "hybridgemm_fp8_block128"} <= set(ours)
    for method in ("graph", "events"):
        for prov in ("hybridgemm", "hybridgemm_fp8_channel", "hybridgemm_fp8_block128"):
            r = by[(method, prov)]
            assert r["status"] == "ok" and r["median_us"] == 5.0
            assert abs(r["fraction_of_floor"] - r["floor_us"] / 5.0) < 2e-3 and r["floor_us"] > 0
    bf16, channel = by[("graph", "hybridgemm")], by[("graph", "hybridgemm_fp8_channel")]
    assert channel["floor_us"] < bf16["floor_us"]  # the e4m3 bytes and their scales
    assert float(channel["rel_err_dequantized"]) < 1e-2 and "rel_err_dequantized" not in bf16  # bf16 rounding
