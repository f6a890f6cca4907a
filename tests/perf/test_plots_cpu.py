"""The figures as a reader sees them, without a GPU: every ratio joins rows equal in all the
keys it depends on, each series has its own colour and marker, legends and captions stay
clear of each other and of the panels, footers name the commits their rows record, and the
figures the READMEs embed are all drawn from the committed CSVs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridgemm.perf import plot_style, plots, plots_models
from hybridgemm.perf.csvio import read_rows, write_csv, write_rows
from hybridgemm.perf.plots import figure_sources, load_rows, make_all_plots, speedup_grid

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "perf" / "results" / "h200"


def _row(shape, epilogue, m, provider, us, **extra):
    return dict(gpu="NVIDIA H200", shape=shape, N=1024, K=4096, M=m, dtype="bf16", epilogue=epilogue,
                provider=provider, method="gpu", status="ok", median_us=us, **extra)


# ----------------------------------------------------------------------------- joins


def test_the_dispatch_grid_divides_times_of_the_same_epilogue(tmp_path):
    """Two CSVs: a bench run without bias (F.linear and dispatch) and another benchmark's
    F.linear with bias, same shape name, GPU, dtype and M. Each cell divides the time of the
    same epilogue; the bias F.linear without a dispatch beside it makes no cell."""
    bench, other = tmp_path / "bench.csv", tmp_path / "other.csv"
    write_rows(str(bench), [_row("8b.kv", "none", 1, "flinear", 10.0), _row("8b.kv", "none", 1, "dispatch", 8.0),
                            _row("8b.kv", "none", 4096, "flinear", 51.0),
                            _row("8b.kv", "none", 4096, "dispatch", 50.0)])
    write_rows(str(other), [_row("8b.kv", "bias", 1, "flinear", 30.0), _row("8b.kv", "bias", 4096, "flinear", 46.0),
                            _row("8b.kv", "bias+relu", 1, "flinear", 12.0),
                            _row("8b.kv", "bias+relu", 1, "dispatch", 16.0)])
    for order in ([bench, other], [other, bench]):
        labels, ms, cells = speedup_grid(load_rows(order), "dispatch", "flinear")
        assert ms == [1, 4096]
        got = {(label, m): cells[i][j] for i, label in enumerate(labels) for j, m in enumerate(ms)}
        assert got[("8b.kv [none]", 1)] == pytest.approx(1.25)  # 10 / 8, not 30 / 8
        assert got[("8b.kv [none]", 4096)] == pytest.approx(51 / 50)  # not 46 / 50
        assert got[("8b.kv [bias+relu]", 1)] == pytest.approx(0.75)
        assert got[("8b.kv [bias+relu]", 4096)] != got[("8b.kv [bias+relu]", 4096)]  # NaN: no pair
        assert len(labels) == 2  # no row for the bias F.linear alone


def test_one_epilogue_keeps_plain_row_labels(tmp_path):
    path = tmp_path / "b.csv"
    write_rows(str(path), [_row("q", "none", 16, "flinear", 9.0), _row("q", "none", 16, "dispatch", 6.0)])
    labels, ms, cells = speedup_grid(load_rows([path]), "dispatch", "flinear")
    assert labels == ["q"] and ms == [16] and cells[0][0] == pytest.approx(1.5)


def test_the_committed_kv_cell_at_4096_is_its_own_epilogues_ratio():
    rows = [r for r in load_rows(sorted(map(str, H200.glob("*.csv")))) if r.get("method") == "gpu"
            and r.get("status", "ok") in ("", "ok")]
    labels, ms, cells = speedup_grid(rows, "dispatch", "flinear")
    i, j = labels.index("llama3-8b.kv [none]") if "llama3-8b.kv [none]" in labels else labels.index(
        "llama3-8b.kv"), ms.index(4096)
    bench = {(r["provider"]): float(r["median_us"]) for r in read_rows(str(H200 / "bench_h200.csv"))
             if r["shape"] == "llama3-8b.kv" and r["M"] == "4096" and r["method"] == "gpu"}
    assert cells[i][j] == pytest.approx(bench["flinear"] / bench["dispatch"])


# ----------------------------------------------------------------------------- how the figures look


@pytest.fixture
def drawn(monkeypatch):
    """Every figure saved through perf/plot_style.save, with its footer and caption text."""
    seen = []
    real = plot_style.save

    def recording(fig, footer, path, rows, text=None):
        out = real(fig, footer, path, rows, text)
        seen.append((path.name, fig, footer, footer.texts[-1].get_text()))
        return out

    for module in (plots, plots_models):
        monkeypatch.setattr(module, "save", recording)
    return seen


def _legend_styles(footer) -> list[tuple]:
    """(label, colour, marker, line style) of every legend entry drawn as a line or a bar."""
    from matplotlib.colors import to_rgba

    legend = footer.legends[0]
    out = []
    for handle, text in zip(legend.legend_handles, legend.get_texts()):
        if hasattr(handle, "get_marker"):
            out.append((text.get_text(), to_rgba(handle.get_color()), handle.get_marker(), handle.get_linestyle()))
        else:
            out.append((text.get_text(), to_rgba(handle.get_facecolor()), None, None))
    return out


def _check_layout(name, fig, footer) -> None:
    """The legend, the caption and the panels' boxes (labels included) do not overlap."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    caption = footer.texts[-1].get_window_extent(renderer)
    assert caption.y0 >= 0, name
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible()]
    for legend in footer.legends:
        box = legend.get_window_extent(renderer)
        assert not box.overlaps(caption), f"{name}: the caption overlaps the legend"
        assert box.y0 > caption.y1, f"{name}: the legend does not end above the caption"
        for ax_box in boxes:
            assert not box.overlaps(ax_box), f"{name}: the legend overlaps a panel"
    for ax_box in boxes:
        assert not caption.overlaps(ax_box), f"{name}: the caption overlaps a panel"


def test_every_committed_figure_one_style_per_series_and_clear_captions(tmp_path, drawn):
    """Every committed H200 CSV at once (the most series a figure gets: other benchmarks'
    providers join the host-time figure), then each figure checked as drawn."""
    written = make_all_plots(sorted(map(str, H200.glob("*.csv"))), tmp_path, log=lambda s: None)
    assert {p.name for p in written} >= {"m_sweep.png", "mlp.png", "e2e.png", "e2e_families.png", "tflops_vs_m.png",
                                          "dispatch_speedup.png", "attention_path.png", "host_time.png"}
    assert len(drawn) == len(written)
    biggest = 0
    for name, fig, footer, _ in drawn:
        _check_layout(name, fig, footer)
        if not footer.legends:
            continue
        styles = _legend_styles(footer)
        labels = [s[0] for s in styles]
        assert len(set(labels)) == len(labels), name
        marked = [s[1:3] for s in styles if s[2] not in (None, "None", "", " ")]
        assert len(set(c for c, _ in marked)) == len(marked), f"{name}: two series share a colour"
        assert len(set(m for _, m in marked)) == len(marked) or len(marked) > len(plot_style.MARKERS), name
        unmarked = [s[1:] for s in styles if s[2] in (None, "None", "", " ")]
        assert len(set(unmarked)) == len(unmarked), f"{name}: two reference lines or bars look alike"
        biggest = max(biggest, len(styles))
    assert biggest >= 15  # the host-time figure with the cuBLASLt benchmark's host rows


def test_series_styles_are_distinct_and_keep_fixed_ones():
    fixed = {"a": dict(color="black", marker="o"), "b": dict(color="C1", marker="s")}
    names = ["a", "b", *(f"p{i}" for i in range(len(plot_style.MARKERS) - 2))]
    styles = plot_style.series_styles(names, fixed)
    assert styles["a"] == fixed["a"] and styles["b"] == fixed["b"]
    from matplotlib.colors import to_rgb

    assert len({to_rgb(s["color"]) for s in styles.values()}) == len(names)
    assert len({s["marker"] for s in styles.values()}) == len(names)
    many = plot_style.series_styles(range(60))
    assert len({(to_rgb(s["color"]), s["marker"]) for s in many.values()}) == 60


# ----------------------------------------------------------------------------- footers


def test_the_m_sweep_footer_names_the_commit_of_its_rows(tmp_path, drawn):
    rows = read_rows(str(H200 / "m_sweep_h200.csv"))
    path = tmp_path / "m_sweep_x.csv"
    cols = list(rows[0])
    from hybridgemm.perf.csvio import write_csv

    write_csv(str(path), cols, [dict(r, commit="abc1234") for r in rows[:40]] + [dict(r, commit="fed4321")
                                                                                 for r in rows[40:80]])
    make_all_plots([str(path)], tmp_path / "out", log=lambda s: None)
    (name, _, _, text), = drawn
    assert name == "m_sweep.png" and text.endswith("| commit abc1234, fed4321")
    committed = {r["commit"] for r in rows}
    drawn.clear()
    make_all_plots([str(H200 / "m_sweep_h200.csv")], tmp_path / "h200", log=lambda s: None)
    assert drawn[0][3].endswith(f"| commit {', '.join(sorted(committed))}")


def test_captions_name_commits_only_where_rows_record_them():
    with_commit = [{"gpu": "G", "torch": "2.11", "commit": "b"}, {"gpu": "G", "torch": "2.11", "commit": "a"}]
    assert plot_style.caption(with_commit) == "GPU: G | torch 2.11 | commit a, b"
    assert "commit" not in plot_style.caption([{"gpu": "G", "torch": "2.11", "nvmath": ""}])
    assert "nvmath" not in plot_style.caption([{"gpu": "G", "nvmath": ""}])  # a field no row records


# ----------------------------------------------------------------------------- the READMEs' figures


def _embedded(readme: Path) -> set[str]:
    return set(re.findall(r"!\[[^\]]*\]\((?:[^)]*/)?plots/([^)/]+\.png)\)", readme.read_text()))


def test_the_committed_sources_draw_every_figure_the_readmes_embed(tmp_path):
    embedded = _embedded(ROOT / "README.md") | _embedded(H200 / "README.md")
    assert {"m_sweep.png", "attention_path.png", "e2e.png"} <= embedded
    written = {p.name for p in make_all_plots([str(p) for p in figure_sources(H200)], tmp_path, log=lambda s: None)}
    assert embedded <= written
    assert all((H200 / "plots" / name).is_file() for name in embedded)  # and each is committed


def test_a_lora_csv_draws_against_stock_peft(tmp_path, monkeypatch):
    """perf/bench_lora.py's rows: stock PEFT is the baseline each patched bar's label divides."""
    rows = [dict(gpu="NVIDIA H200", model="llama3-8b", layers=32, rank=16, mode=mode, batch=b, variant=v,
                 status="ok", ms_per_token=ms)
            for mode, b, v, ms in (("compiled_static", 1, "stock_peft", 6.6), ("compiled_static", 1, "hybridgemm_peft",
                                                                               5.0),
                                   ("eager_static", 8, "stock_peft", 50.0), ("eager_static", 8, "hybridgemm_peft",
                                                                             62.5))]
    path = tmp_path / "lora.csv"
    write_csv(str(path), list(rows[0]), rows)
    drawn = {}
    real = plots_models.save
    monkeypatch.setattr(plots_models, "save", lambda fig, *a: drawn.setdefault("fig", fig) and real(fig, *a))
    png = plots_models.plot_e2e(path, tmp_path, "lora.png")
    assert png.is_file()
    texts = {t.get_text() for ax in drawn["fig"].axes for t in ax.texts}
    assert {"1.32x", "0.80x"} <= texts
    assert {c.get_label() for ax in drawn["fig"].axes for c in ax.containers} == {"stock_peft", "hybridgemm_peft"}


def test_several_models_get_a_speedup_panel_at_their_full_depth(tmp_path, monkeypatch):
    """An end-to-end CSV of several models: a first panel of hybridgemm's speedup over stock
    per model in compiled and eager static-cache decode at B = 1, from each model's deepest
    rows (an 8-layer run of the same model beside its full depth does not count there)."""
    spec = [("gemma-7b", 28, "compiled_static", 1, 5.8, 5.0), ("gemma-7b", 28, "eager_static", 1, 30.0, 24.0),
            ("qwen3-8b", 36, "compiled_static", 1, 6.0, 4.8), ("qwen3-8b", 8, "compiled_static", 1, 2.0, 1.0),
            ("qwen3-8b", 36, "compiled_static", 8, 7.0, 3.5)]
    rows = [dict(gpu="NVIDIA H200", model=m, layers=n, mode=mode, batch=b, variant=v, status="ok", ms_per_token=ms)
            for m, n, mode, b, stock, ours in spec for v, ms in (("stock", stock), ("hybridgemm", ours))]
    assert plots_models._speedups(rows) == pytest.approx({("gemma-7b", "compiled_static"): 5.8 / 5.0,
                                                          ("gemma-7b", "eager_static"): 30.0 / 24.0,
                                                          ("qwen3-8b", "compiled_static"): 6.0 / 4.8})
    path = tmp_path / "e2e_families.csv"
    write_csv(str(path), list(rows[0]), rows)
    drawn = {}
    real = plots_models.save
    monkeypatch.setattr(plots_models, "save", lambda fig, *a: drawn.setdefault("fig", fig) and real(fig, *a))
    assert plots_models.plot_e2e(path, tmp_path).is_file()
    summary = drawn["fig"].axes[0]
    assert [t.get_text() for t in summary.get_xticklabels()] == ["gemma-7b", "qwen3-8b"]
    assert {t.get_text() for t in summary.texts} == {"1.16x", "1.25x"}
