"""perf/bench_mlp.py and plots_models.plot_mlp without a GPU: the plot from a CSV, the CLI's answers."""

from __future__ import annotations

import csv

import pytest

from hybridgemm.perf import bench_mlp
from hybridgemm.perf.plots_models import plot_mlp


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bench_mlp.COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in bench_mlp.COLUMNS})


def test_plot_mlp_draws_each_model_and_op(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(gpu="G", model="llama3-8b", op=op, m=m, n=n, k=k, variant=v, us=us, fraction_of_hbm=0.8,
                 speedup=sp)
            for op, n, k in [("gate_up", 28672, 4096), ("down", 4096, 14336)]
            for m in (1, 64) for v, us, sp in [("stock", 70.0, 1.0), ("halves", 69.0, 70 / 69)]]
    path = tmp_path / "mlp.csv"
    _write(path, rows)
    out = plot_mlp(path, tmp_path / "plots")
    assert out.is_file() and out.stat().st_size > 10_000


def test_plot_mlp_errors(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(FileNotFoundError):
        plot_mlp(tmp_path / "missing.csv", tmp_path)
    path = tmp_path / "empty.csv"
    _write(path, [])
    with pytest.raises(ValueError, match="no rows with a time"):
        plot_mlp(path, tmp_path)


def test_cli_without_a_gpu_and_bad_m(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_mlp.torch.cuda, "is_available", lambda: False)
    assert bench_mlp.main(["--out", str(tmp_path / "x.csv")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(bench_mlp.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        bench_mlp.main(["--m", "0", "--out", str(tmp_path / "x.csv")])
    assert e.value.code == 2 and "at least 1" in capsys.readouterr().err
