"""Figures drawn from benchmark CSVs only: no GPU, no re-measuring.

    make_all_plots(figure_sources("perf/results/h200"), "out/")

From the long-form CSVs (perf/csvio.py: bench, attention benchmark):

1. ``tflops_vs_m.png``: TFLOP/s vs M per projection shape, one line per provider (method
   ``gpu``), log-x, with two ceilings: HBM read bandwidth x arithmetic intensity (what bounds
   small M: the weights must be read once) and the measured GEMM peak.
2. ``dispatch_speedup.png``: speedup of ``dispatch`` over F.linear, heatmap (shape, epilogue)
   x M; each cell divides two rows equal in GPU, dtype, shape, N, K, epilogue and M.
3. ``attention_path.png``: the attention-layer projection path (perf/bench_attention.py's
   rows: providers ``stock``, ``naive_fused``, ``hybridgemm``), decode and prefill bars.
   Skipped with a note when no CSV holds such rows.
4. ``host_time.png``: host time per eager call per provider (method ``eager``), with
   F.linear's GPU time for reference: where a provider's line sits above it, the host is the
   bottleneck.
5. ``m_sweep.png``, ``mlp.png``, ``e2e.png``, ``tp.png`` for an M-sweep (perf/bench_msweep.py),
   MLP (perf/bench_mlp.py), end-to-end (perf/bench_e2e.py) or tensor-parallel
   (perf/bench_tp.py) CSV among the inputs, each drawn from its own CSV by perf/plots_models.py.
What all figures share is in perf/plot_style.py. :func:`figure_sources` names the CSVs of a
results folder the READMEs' figures come from (the main job redraws them).
Training rows (method ``fwd_bwd_events``: CUDA events around eager steps, which at small M
measure the host as much as the GPU) are tabulated by ``hybridgemm bench``, not drawn.
Several GPUs or dtypes in the CSVs give one file per (GPU, dtype), suffixed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridgemm.perf.csvio import KEY_COLUMNS, read_rows
from hybridgemm.perf.plot_style import (
    DTYPE_SHORT,
    ITEMSIZE,
    MARKERS,
    figure,
    legend,
    log_y,
    m_axis,
    save,
    series_styles,
    to_float,
    to_int,
)
from hybridgemm.perf.plots_models import (
    csv_header,
    has_times,
    is_e2e_csv,
    is_m_sweep_csv,
    is_mlp_csv,
    is_moe_csv,
    is_tp_csv,
    plot_e2e,
    plot_m_sweep,
    plot_mlp,
    plot_moe,
    plot_tp,
)
from hybridgemm.perf.timing import HBM_TBPS

PEAK_TFLOPS = {"bf16": 790.0, "fp16": 790.0}  # best measured dense GEMMs on the H200


ATTENTION_PROVIDERS = ("stock", "naive_fused", "hybridgemm")


PROVIDER_ORDER = ("flinear", "matmul_add", "cublaslt_heuristic", "cublaslt_best", "triton_best", "dispatch",
                  "compile_max_autotune", "hybridgemm_linear")


LABELS = {"flinear": "F.linear (baseline)", "matmul_add": "x @ W.T + b (unfused)",
          "cublaslt_heuristic": "cuBLASLt heuristic", "cublaslt_best": "cuBLASLt best algo",
          "triton_best": "Triton best config", "dispatch": "hybridgemm dispatch",
          "compile_max_autotune": "torch.compile max-autotune", "hybridgemm_linear": "hybridgemm.linear"}


def load_rows(csv_paths) -> list[dict]:
    """Rows of every CSV (a later file's row replaces an earlier one of the same key), with
    M/N/K as ints and times as floats. Raises FileNotFoundError naming a missing file."""
    merged: dict[tuple, dict] = {}
    for p in csv_paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such CSV file: {p}")
        for r in read_rows(str(p)):
            for c in ("M", "N", "K"):
                r[c] = to_int(r.get(c))
            for c in ("median_us", "spread_us", "tflops"):
                r[c] = to_float(r.get(c))
            r["dtype"] = DTYPE_SHORT.get(r.get("dtype", ""), r.get("dtype", ""))
            merged[tuple(str(r.get(c, "")) for c in KEY_COLUMNS)] = r
    return list(merged.values())


def measured(rows, method: str) -> list[dict]:
    """Rows of ``method`` that hold a time: status ok (or none recorded) and a positive median."""
    return [r for r in rows if r.get("method") == method and r.get("status", "ok") in ("", "ok")
            and r["median_us"] > 0]


def _groups(rows) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r.get("gpu", "?"), r.get("dtype", "?")), []).append(r)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def _path(out_dir: Path, stem: str, group: tuple, n_groups: int) -> Path:
    return out_dir / (f"{stem}.png" if n_groups == 1 else f"{stem}_{_slug(group[0])}_{group[1]}.png")


# Fixed styles of the known providers: the same in every figure; any other provider takes a
# colour and marker none of these (nor another provider of its figure) has.
PROVIDER_STYLES = {"flinear": dict(color="black", marker="o", lw=2.4, zorder=5),
                   **{p: dict(color=f"C{i}", marker=MARKERS[i]) for i, p in enumerate(PROVIDER_ORDER) if i}}


def _styles(rows) -> dict[str, dict]:
    """One style per provider of ``rows`` (a whole figure's: its panels share the legend)."""
    styles = series_styles(_providers(rows), PROVIDER_STYLES)
    return {p: {"lw": 1.5, "ms": 4, **st} for p, st in styles.items()}


def _providers(rows) -> list[str]:
    names = {r["provider"] for r in rows}
    return [p for p in PROVIDER_ORDER if p in names] + sorted(names - set(PROVIDER_ORDER))


def _panel_key(r: dict) -> tuple:
    """What a time depends on besides M, the provider and the method (the figure's GPU and
    dtype are fixed): rows are compared only where all of it is equal."""
    return r["shape"], r["N"], r["K"], r.get("epilogue", "")


def _panels(rows) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(_panel_key(r), []).append(r)
    return out


def _lines(ax, rows, value: Callable[[dict], float], styles: dict[str, dict]) -> None:
    for prov in _providers(rows):
        pts = sorted((r["M"], value(r)) for r in rows if r["provider"] == prov)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=LABELS.get(prov, prov), **styles[prov])


def plot_tflops(rows, path: Path) -> Path:
    panels = _panels(rows)
    fig, body, footer, axes = figure(len(panels))
    dtype = rows[0].get("dtype", "")
    e = ITEMSIZE.get(dtype, 2)
    styles = _styles(rows)
    for ax, ((shape, n, k, epi), prs) in zip(axes, panels.items()):
        ms = sorted({r["M"] for r in prs})
        _lines(ax, prs, lambda r: 2 * r["M"] * r["N"] * r["K"] / r["median_us"] / 1e6, styles)
        mm = np.geomspace(ms[0], ms[-1], 64)
        bias = n if epi.startswith("bias") else 0
        # bytes a GEMM must move at least: read x, W, bias once, write y once
        intensity = 2 * mm * n * k / (e * (mm * k + n * k + mm * n + bias))
        ax.plot(mm, HBM_TBPS * intensity, ls="--", color="0.45", lw=1.2,
                label=f"HBM read ceiling (the H200's {HBM_TBPS} TB/s x intensity)")
        if dtype in PEAK_TFLOPS:
            ax.axhline(PEAK_TFLOPS[dtype], ls=":", color="0.2", lw=1.2,
                       label=f"measured GEMM peak (~{PEAK_TFLOPS[dtype]:.0f} TFLOP/s)")
        log_y(ax)
        top = max(PEAK_TFLOPS.get(dtype, 0.0), max(2 * r["M"] * n * k / r["median_us"] / 1e6 for r in prs))
        ax.set_ylim(top=1.8 * top)  # the HBM line runs off far above the peak at large M: cut it
        m_axis(ax, ms)
        ax.set_ylabel("TFLOP/s (higher is better)")
        ax.set_title(f"{shape}: N={n}, K={k}, {epi}", fontsize=10)
    legend(footer, axes)
    body.suptitle(f"Fused linear throughput vs M, {dtype}, GPU time L2-clean-cold (CUDA-graph replay, median)")
    return save(fig, footer, path, rows)


def speedup_grid(rows, provider: str, baseline: str) -> tuple[list[str], list[int], np.ndarray]:
    """``baseline`` time / ``provider`` time for every (shape, epilogue) that ``provider`` has
    rows for (the row labels: the shape, with ``[epilogue]`` when there are several) and every
    M it has (the columns). A cell divides two rows equal in shape, N, K, epilogue and M
    (:func:`_panel_key`; the caller fixes GPU, dtype and method), NaN where one is missing."""
    t = {(*_panel_key(r), r["M"], r["provider"]): r["median_us"] for r in rows
         if r.get("provider") in (provider, baseline)}
    panels = list(dict.fromkeys(_panel_key(r) for r in rows if r.get("provider") == provider))
    ms = sorted({r["M"] for r in rows if r.get("provider") == provider})
    val = np.full((len(panels), len(ms)), np.nan)
    for i, panel in enumerate(panels):
        for j, m in enumerate(ms):
            a, b = t.get((*panel, m, baseline)), t.get((*panel, m, provider))
            if a and b:
                val[i, j] = a / b
    several = len({p[3] for p in panels}) > 1
    return [f"{p[0]} [{p[3]}]" if several else p[0] for p in panels], ms, val


def _heatmap(rows, path: Path, provider: str, baseline: str, title: str, what: str) -> Path | None:
    """:func:`speedup_grid` as a heatmap; None when it has no cell."""
    from matplotlib.colors import TwoSlopeNorm

    labels, ms, val = speedup_grid(rows, provider, baseline)
    if not labels or np.isnan(val).all():
        return None
    epilogues = {r.get("epilogue", "") for r in rows if r.get("provider") == provider}
    if len(epilogues) == 1:
        title += f", epilogue {next(iter(epilogues))}"
    fig, body, footer, (ax,) = figure(1, 1.1 * len(ms) + 4.5, 0.55 * len(labels) + 1.6)
    lo, hi = np.nanmin(val), np.nanmax(val)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.95), vmax=max(hi, 1.05))  # white = parity
    im = ax.imshow(np.ma.masked_invalid(val), cmap="RdYlGn", norm=norm, aspect="auto")
    for i in range(len(labels)):
        for j in range(len(ms)):
            ax.text(j, i, "-" if np.isnan(val[i, j]) else f"{val[i, j]:.2f}x", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(ms)), [str(m) for m in ms])
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("M (rows of x: tokens)")
    body.colorbar(im, ax=ax, label=f"{what} (> 1: faster)")
    ax.set_title(title, fontsize=10)
    return save(fig, footer, path, rows)


def plot_attention(rows, path: Path) -> Path | None:
    if not rows:
        return None
    methods = {r["method"] for r in rows}
    method = "gpu" if "gpu" in methods else sorted(methods)[0]
    rows = [r for r in rows if r["method"] == method]
    provs = [p for p in ATTENTION_PROVIDERS if any(r["provider"] == p for r in rows)]
    t = {(r["shape"], r["provider"]): r["median_us"] for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    parts = [("decode", [s for s in shapes if s.startswith("decode")]),
             ("prefill / training", [s for s in shapes if not s.startswith("decode")])]
    parts = [p for p in parts if p[1]]
    fig, body, footer, axes = figure(len(parts), panel_w=max(4.0, 1.6 * max(len(p[1]) for p in parts)))
    width = 0.8 / max(1, len(provs))
    for ax, (label, shs) in zip(axes, parts):
        x = np.arange(len(shs))
        for i, prov in enumerate(provs):
            ys = [t.get((s, prov), np.nan) for s in shs]
            pos = x + (i - (len(provs) - 1) / 2) * width
            ax.bar(pos, ys, width, label=prov, color="0.25" if prov == "stock" else f"C{i + 1}")
            for xp, s, y in zip(pos, shs, ys):
                stock = t.get((s, "stock"))
                if prov != "stock" and stock and y == y:
                    ax.annotate(f"{stock / y:.2f}x", (xp, y), ha="center", va="bottom", fontsize=7,
                                xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(x, shs, rotation=15)
        ax.set_ylabel(f"{'GPU' if method == 'gpu' else method} time per layer call (µs; lower is better)")
        ax.set_title(f"attention projection path, {label}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    legend(footer, axes)
    body.suptitle("Attention-layer projections: stock PyTorch vs hybridgemm (labels: speedup over stock)")
    return save(fig, footer, path, rows)


def plot_host_time(rows, gpu_rows, path: Path) -> Path:
    panels = _panels(rows)
    fig, body, footer, axes = figure(len(panels))
    gpu_fl = {(*_panel_key(r), r["M"]): r["median_us"] for r in gpu_rows if r["provider"] == "flinear"}
    styles = _styles(rows)
    for ax, (panel, prs) in zip(axes, panels.items()):
        shape, n, k, epi = panel
        ms = sorted({r["M"] for r in prs})
        _lines(ax, prs, lambda r: r["median_us"], styles)
        ref = [(m, gpu_fl[(*panel, m)]) for m in ms if (*panel, m) in gpu_fl]
        if ref:
            ax.plot([p[0] for p in ref], [p[1] for p in ref], ls=":", color="0.5", lw=1.5,
                    label="F.linear GPU time (for reference)")
        log_y(ax)
        m_axis(ax, ms)
        ax.set_ylabel("µs per call (lower is better)")
        ax.set_title(f"{shape}: N={n}, K={k}, {epi}", fontsize=10)
    legend(footer, axes)
    body.suptitle("Host time per eager call: back-to-back calls, no sync, providers alternating in one loop")
    return save(fig, footer, path, rows)


# CSVs that each give a figure of their own: (recogniser, plotter, the figure's name when one
# CSV of the kind is given; with several, each is named after its CSV: _figure_name).
OWN_FIGURES = ((is_m_sweep_csv, plot_m_sweep, "m_sweep.png"), (is_mlp_csv, plot_mlp, "mlp.png"),
               (is_e2e_csv, plot_e2e, "e2e.png"), (is_tp_csv, plot_tp, "tp.png"), (is_moe_csv, plot_moe, "moe.png"))


# The committed measurements, one folder per GPU (perf/results/<gpu>/: in the source tree, not
# in an installed wheel).
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# The CSVs of a results folder (``perf/results/<gpu>/<source>_<gpu>.csv``) that the figures
# embedded in README.md and perf/results/<gpu>/README.md are drawn from.
FIGURE_SOURCES = ("bench", "attention", "m_sweep", "mlp", "e2e", "e2e_families")


def figure_sources(results_dir) -> list[Path]:
    """The CSVs of ``results_dir`` that the READMEs' figures are drawn from, those present."""
    d = Path(results_dir)
    return [d / f"{s}_{d.name}.csv" for s in FIGURE_SOURCES if (d / f"{s}_{d.name}.csv").is_file()]


def is_long_form_csv(path) -> bool:
    """Whether the CSV at ``path`` holds perf/csvio.py's long-form rows (provider, method, time)."""
    return {"provider", "method", "median_us"} <= csv_header(path)


def _figure_name(csv_path) -> str:
    """The figure of one of several CSVs of a kind: named after the CSV, less the GPU folder's
    suffix that a results folder's CSVs carry (perf/results/h200/e2e_families_h200.csv:
    e2e_families.png)."""
    p = Path(csv_path)
    suffix = f"_{p.parent.name}"
    return f"{p.stem[:-len(suffix)] if p.stem.endswith(suffix) else p.stem}.png"


def make_all_plots(csv_paths, out_dir, log: Callable[[str], None] = print) -> list[Path]:
    """Draw every figure the CSVs have data for into ``out_dir``; return the files written.
    An M-sweep, MLP, end-to-end, tensor-parallel or MoE CSV gives its own figure (:data:`OWN_FIGURES`;
    one with no timed row, none); the long-form CSVs together give the kernel figures. A figure
    without data, and a CSV no figure reads, are skipped with a note through ``log``.
    Raises FileNotFoundError naming a missing file."""
    out_dir = Path(out_dir)
    for p in csv_paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such CSV file: {p}")
    written: list[Path] = []
    rest = list(csv_paths)
    for recognise, plot, name in OWN_FIGURES:
        mine = [p for p in rest if recognise(p)]
        rest = [p for p in rest if p not in mine]
        if plot in (plot_e2e, plot_tp):  # a run of error modes only has nothing to draw
            for p in [p for p in mine if not has_times(p)]:
                log(f"{p}: no timed rows (error modes only): no figure")
            mine = [p for p in mine if has_times(p)]
        for p in mine:
            try:
                written.append(plot(p, out_dir, name if len(mine) == 1 else _figure_name(p)))
            except ValueError as e:  # recognised by its header, but no row to draw
                log(f"{p}: no figure ({e})")
    for p in [p for p in rest if not is_long_form_csv(p)]:
        log(f"{p}: no figure reads this CSV: skipped")
    csv_paths = [p for p in rest if is_long_form_csv(p)]
    if not csv_paths:
        return written
    rows = load_rows(csv_paths)
    attention = [r for r in rows if r.get("provider") in ATTENTION_PROVIDERS]
    linear = [r for r in rows if r.get("provider") not in ATTENTION_PROVIDERS]
    gpu, eager = measured(linear, "gpu"), measured(linear, "eager")
    if not gpu:
        log("note: no GPU-time rows (method 'gpu') in the CSVs: skipping the TFLOP/s and dispatch figures")
    groups = _groups(gpu)
    for g, grows in groups.items():
        written.append(plot_tflops(grows, _path(out_dir, "tflops_vs_m", g, len(groups))))
        p = _heatmap(grows, _path(out_dir, "dispatch_speedup", g, len(groups)), "dispatch", "flinear",
                     f"hybridgemm dispatch vs F.linear, {g[1]}, {g[0]}\nGPU time ratio F.linear / dispatch",
                     "speedup")
        if p is None:
            log(f"note: no dispatch and F.linear rows for {g}: skipping the dispatch heatmap")
        else:
            written.append(p)
    att = [r for r in attention if r.get("status", "ok") in ("", "ok") and r["median_us"] > 0]
    p = plot_attention(att, out_dir / "attention_path.png")  # GPU-time rows if any, else what there is
    if p is None:
        log("note: no attention-layer rows (providers stock/hybridgemm, from perf/bench_attention.py's CSV): "
            "skipping the attention figure")
    else:
        written.append(p)
    groups = _groups(eager)
    if not eager:
        log("note: no eager rows: skipping the host-time figure")
    for g, grows in groups.items():
        written.append(plot_host_time(grows, gpu, _path(out_dir, "host_time", g, len(groups))))
    return written
