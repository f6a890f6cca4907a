"""Figures drawn from benchmark CSVs only (perf/csvio.py's long form): no GPU, no re-measuring.

    make_all_plots(["perf/results/h200/bench.csv", "perf/results/h200/attention_h200.csv"], "out/")

1. ``tflops_vs_m.png``: TFLOP/s vs M per projection shape, one line per provider (method
   ``gpu``), log-x, with two ceilings: HBM read bandwidth x arithmetic intensity (what bounds
   small M: the weights must be read once) and the measured GEMM peak.
2. ``dispatch_speedup.png``: speedup of ``dispatch`` over F.linear, heatmap shape x M.
3. ``attention_path.png``: the attention-layer projection path (perf/bench_attention.py's
   rows: providers ``stock``, ``naive_fused``, ``hybridgemm``), decode and prefill bars.
   Skipped with a note when no CSV holds such rows.
4. ``host_time.png``: host time per eager call per provider (method ``eager``), with
   F.linear's GPU time for reference: where a provider's line sits above it, the host is the
   bottleneck.
5. ``m_sweep.png`` (:func:`plot_m_sweep`, from perf/bench_msweep.py's own CSV, not through
   make_all_plots): speedup of the dispatched call over F.linear against M, one line per shape.
6. ``e2e.png`` (:func:`plot_e2e`, from perf/bench_e2e.py's CSV; make_all_plots draws it for
   such a CSV): whole-model ms per decode step and per prefill, stock vs hybridgemm, with the
   HBM floor of the weights.
Training rows (method ``fwd_bwd_events``: CUDA events around eager steps, which at small M
measure the host as much as the GPU) are tabulated by ``hybridgemm bench``, not drawn.
Several GPUs or dtypes in the CSVs give one file per (GPU, dtype), suffixed.
Matplotlib's object API with the Agg canvas: no pyplot, no global backend switch.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridgemm.perf.csvio import KEY_COLUMNS, read_rows
from hybridgemm.perf.timing import HBM_TBPS

PEAK_TFLOPS = {"bf16": 790.0, "fp16": 790.0}  # best measured dense GEMMs on the H200
ATTENTION_PROVIDERS = ("stock", "naive_fused", "hybridgemm")
PROVIDER_ORDER = ("flinear", "matmul_add", "cublaslt_heuristic", "cublaslt_best", "triton_best", "dispatch",
                  "compile_max_autotune", "hybridgemm_linear")
LABELS = {"flinear": "F.linear (baseline)", "matmul_add": "x @ W.T + b (unfused)",
          "cublaslt_heuristic": "cuBLASLt heuristic", "cublaslt_best": "cuBLASLt best algo",
          "triton_best": "Triton best config", "dispatch": "hybridgemm dispatch",
          "compile_max_autotune": "torch.compile max-autotune", "hybridgemm_linear": "hybridgemm.linear"}
ITEMSIZE = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "tf32": 4}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

BELOW = 0.97  # an M-sweep row under this speedup is counted (and drawn under the dashed line)


def shape_label(n, k, bias, models: str) -> str:
    """``"N x K (+bias) — models"`` (models given ';'-joined, shown ', '-joined)."""
    names = ", ".join(m for m in str(models).split(";") if m)
    return f"{n} x {k}{' (+bias)' if as_bool(bias) else ''}" + (f" — {names}" if names else "")


def as_bool(v) -> bool:
    """A bias flag from a row: a bool, or its CSV text ("True"/"False", "1"/"0", "yes"/"no")."""
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")



def load_rows(csv_paths) -> list[dict]:
    """Rows of every CSV (a later file's row replaces an earlier one of the same key), with
    M/N/K as ints and times as floats. Raises FileNotFoundError naming a missing file."""
    merged: dict[tuple, dict] = {}
    for p in csv_paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such CSV file: {p}")
        for r in read_rows(str(p)):
            for c in ("M", "N", "K"):
                r[c] = _int(r.get(c))
            for c in ("median_us", "spread_us", "tflops"):
                r[c] = _float(r.get(c))
            r["dtype"] = DTYPE_SHORT.get(r.get("dtype", ""), r.get("dtype", ""))
            merged[tuple(str(r.get(c, "")) for c in KEY_COLUMNS)] = r
    return list(merged.values())


def _int(v) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return 0


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


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


def caption(rows) -> str:
    """GPU and software versions the rows were measured with (every distinct value)."""
    def vals(col):
        return ", ".join(sorted({str(r.get(col) or "") for r in rows} - {""})) or "?"

    return (f"GPU: {vals('gpu')} | torch {vals('torch')} | Triton {vals('triton')} | cuBLASLt {vals('cublaslt')} | "
            f"nvmath-python {vals('nvmath')} | hybridgemm {vals('hybridgemm')}")


def _figure(n_panels: int, panel_w=5.0, panel_h=3.8, foot=0.75, ncols: int = 3):
    """A figure of panels (``body``, at most ``ncols`` a row) over a footer (``foot`` inches
    tall) that holds the legend and the caption: a fixed strip, so neither can overlap the
    panels or each other."""
    from matplotlib.figure import Figure

    ncols = min(ncols, max(1, n_panels))
    nrows = math.ceil(max(1, n_panels) / ncols)
    height = panel_h * nrows + 0.6
    fig = Figure(figsize=(panel_w * ncols, height + foot), layout="constrained")
    body, footer = fig.subfigures(2, 1, height_ratios=[height, foot])
    axes = body.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, body, footer, axes


def _save(fig, footer, path: Path, rows) -> Path:
    footer.text(0.5, 0.04, caption(rows), ha="center", va="bottom", fontsize=7, color="0.3")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def _style(provider: str) -> dict:
    if provider == "flinear":
        return dict(color="black", lw=2.4, marker="o", zorder=5)
    # crc32, not hash(): a provider keeps its colour from one run (process) to the next
    idx = PROVIDER_ORDER.index(provider) if provider in PROVIDER_ORDER else zlib.crc32(provider.encode()) % 10
    return dict(color=f"C{idx % 10}", lw=1.5, marker="os^vDP*X"[idx % 8], ms=4)


def _providers(rows) -> list[str]:
    names = {r["provider"] for r in rows}
    return [p for p in PROVIDER_ORDER if p in names] + sorted(names - set(PROVIDER_ORDER))


def _panels(rows) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["shape"], r["N"], r["K"], r.get("epilogue", "")), []).append(r)
    return out


def _m_axis(ax, ms) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("M (rows of x: tokens)")
    ax.grid(True, which="major", alpha=0.3)


def _lines(ax, rows, value: Callable[[dict], float]) -> None:
    for prov in _providers(rows):
        pts = sorted((r["M"], value(r)) for r in rows if r["provider"] == prov)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=LABELS.get(prov, prov), **_style(prov))


def _legend(footer, axes) -> None:
    seen = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    footer.legend(list(seen.values()), list(seen), loc="upper center", ncol=min(5, len(seen)), fontsize=8,
                  frameon=False)


def _log_y(ax) -> None:
    """Log y with plain numbers (5, 10, 20, 50 ...), not 2 x 10^1."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def plot_tflops(rows, path: Path) -> Path:
    panels = _panels(rows)
    fig, body, footer, axes = _figure(len(panels))
    dtype = rows[0].get("dtype", "")
    e = ITEMSIZE.get(dtype, 2)
    for ax, ((shape, n, k, epi), prs) in zip(axes, panels.items()):
        ms = sorted({r["M"] for r in prs})
        _lines(ax, prs, lambda r: 2 * r["M"] * r["N"] * r["K"] / r["median_us"] / 1e6)
        mm = np.geomspace(ms[0], ms[-1], 64)
        bias = n if epi.startswith("bias") else 0
        # bytes a GEMM must move at least: read x, W, bias once, write y once
        intensity = 2 * mm * n * k / (e * (mm * k + n * k + mm * n + bias))
        ax.plot(mm, HBM_TBPS * intensity, ls="--", color="0.45", lw=1.2,
                label=f"HBM read ceiling ({HBM_TBPS} TB/s x intensity)")
        if dtype in PEAK_TFLOPS:
            ax.axhline(PEAK_TFLOPS[dtype], ls=":", color="0.2", lw=1.2,
                       label=f"measured GEMM peak (~{PEAK_TFLOPS[dtype]:.0f} TFLOP/s)")
        _log_y(ax)
        top = max(PEAK_TFLOPS.get(dtype, 0.0), max(2 * r["M"] * n * k / r["median_us"] / 1e6 for r in prs))
        ax.set_ylim(top=1.8 * top)  # the HBM line runs off far above the peak at large M: cut it
        _m_axis(ax, ms)
        ax.set_ylabel("TFLOP/s (higher is better)")
        ax.set_title(f"{shape}: N={n}, K={k}, {epi}", fontsize=10)
    _legend(footer, axes)
    body.suptitle(f"Fused linear throughput vs M, {dtype}, GPU time L2-clean-cold (CUDA-graph replay, median)")
    return _save(fig, footer, path, rows)


def _heatmap(rows, path: Path, provider: str, baseline: str, title: str, what: str) -> Path | None:
    from matplotlib.colors import TwoSlopeNorm

    t = {(r["shape"], r["M"], r["provider"]): r["median_us"] for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["provider"] == provider))
    ms = sorted({r["M"] for r in rows if r["provider"] == provider})
    if not shapes:
        return None
    val = np.full((len(shapes), len(ms)), np.nan)
    for i, s in enumerate(shapes):
        for j, m in enumerate(ms):
            a, b = t.get((s, m, baseline)), t.get((s, m, provider))
            if a and b:
                val[i, j] = a / b
    if np.isnan(val).all():
        return None
    fig, body, footer, (ax,) = _figure(1, 1.1 * len(ms) + 4.5, 0.55 * len(shapes) + 1.6, foot=0.3)
    lo, hi = np.nanmin(val), np.nanmax(val)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.95), vmax=max(hi, 1.05))  # white = parity
    im = ax.imshow(np.ma.masked_invalid(val), cmap="RdYlGn", norm=norm, aspect="auto")
    for i in range(len(shapes)):
        for j in range(len(ms)):
            ax.text(j, i, "-" if np.isnan(val[i, j]) else f"{val[i, j]:.2f}x", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(ms)), [str(m) for m in ms])
    ax.set_yticks(range(len(shapes)), shapes)
    ax.set_xlabel("M (rows of x: tokens)")
    body.colorbar(im, ax=ax, label=f"{what} (> 1: faster)")
    ax.set_title(title, fontsize=10)
    return _save(fig, footer, path, rows)


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
    fig, body, footer, axes = _figure(len(parts), panel_w=max(4.0, 1.6 * max(len(p[1]) for p in parts)))
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
    _legend(footer, axes)
    body.suptitle("Attention-layer projections: stock PyTorch vs hybridgemm (labels: speedup over stock)")
    return _save(fig, footer, path, rows)


def plot_host_time(rows, gpu_rows, path: Path) -> Path:
    panels = _panels(rows)
    fig, body, footer, axes = _figure(len(panels))
    gpu_fl = {(r["shape"], r["M"]): r["median_us"] for r in gpu_rows if r["provider"] == "flinear"}
    for ax, ((shape, n, k, epi), prs) in zip(axes, panels.items()):
        ms = sorted({r["M"] for r in prs})
        _lines(ax, prs, lambda r: r["median_us"])
        ref = [(m, gpu_fl[(shape, m)]) for m in ms if (shape, m) in gpu_fl]
        if ref:
            ax.plot([p[0] for p in ref], [p[1] for p in ref], ls=":", color="0.5", lw=1.5,
                    label="F.linear GPU time (for reference)")
        _log_y(ax)
        _m_axis(ax, ms)
        ax.set_ylabel("µs per call (lower is better)")
        ax.set_title(f"{shape}: N={n}, K={k}, {epi}", fontsize=10)
    _legend(footer, axes)
    body.suptitle("Host time per eager call: back-to-back calls, no sync, providers alternating in one loop")
    return _save(fig, footer, path, rows)


def make_all_plots(csv_paths, out_dir, log: Callable[[str], None] = print) -> list[Path]:
    """Draw every figure the CSVs have data for into ``out_dir``; return the files written.
    A figure without data is skipped with a note through ``log``. An end-to-end CSV
    (perf/bench_e2e.py) gives its own figure (:func:`plot_e2e`)."""
    out_dir = Path(out_dir)
    e2e = [p for p in csv_paths if os.path.isfile(p) and is_e2e_csv(p)]
    written = [plot_e2e(p, out_dir, "e2e.png" if len(e2e) == 1 else f"{Path(p).stem}.png") for p in e2e]
    csv_paths = [p for p in csv_paths if p not in e2e]
    if e2e and not csv_paths:
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


M_SWEEP_MARKERS = "os^vDP*Xph<>d8H"


def _m_sweep_colours(n: int) -> list:
    """``n`` colours, all distinct up to 27 series (tab10, then Dark2 and Set1), then repeating
    (the markers keep later series apart)."""
    from matplotlib import colormaps

    palette = [*colormaps["tab10"].colors, *colormaps["Dark2"].colors, *colormaps["Set1"].colors]
    return [palette[i % len(palette)] for i in range(n)]


def plot_m_sweep(csv_path, out_dir) -> Path:
    """``m_sweep.png`` in ``out_dir`` from perf/bench_msweep.py's CSV: speedup of the dispatched
    call over F.linear (F.linear time / dispatched time) against M on a log2 axis, one line per
    shape ("N x K (+bias) — models"), a dashed line at the 0.97x mark and a light one at parity.
    Raises FileNotFoundError for a missing file, ValueError when no row holds M and a speedup."""

    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"no such CSV file: {csv_path}")
    rows = read_rows(str(csv_path))
    series: dict[tuple, list[tuple[int, float]]] = {}
    models: dict[tuple, str] = {}
    for r in rows:
        m, sp = _int(r.get("m")), _float(r.get("speedup"))
        if m < 1 or not (math.isfinite(sp) and sp > 0):
            continue
        key = (_int(r.get("n")), _int(r.get("k")), as_bool(r.get("bias")), r.get("dtype", ""))
        series.setdefault(key, []).append((m, sp))
        models.setdefault(key, r.get("models", ""))
    if not series:
        raise ValueError(f"{csv_path}: no rows with an M and a speedup (not an M-sweep CSV?)")
    dtypes = sorted({key[3] for key in series})
    n_legend = len(series) + 1
    fig, body, footer, (ax,) = _figure(1, panel_w=11.0, panel_h=6.0, foot=0.45 + 0.2 * math.ceil(n_legend / 3))
    for (key, pts), colour, marker in zip(series.items(), _m_sweep_colours(len(series)),
                                          (M_SWEEP_MARKERS[i % len(M_SWEEP_MARKERS)] for i in range(len(series)))):
        pts.sort()
        label = shape_label(*key[:3], models[key]) + (f" [{key[3]}]" if len(dtypes) > 1 else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, marker=marker, ms=3.5, lw=1.2, label=label)
    ax.axhline(1.0, color="0.6", lw=0.8, zorder=0)
    ax.axhline(BELOW, ls="--", color="crimson", lw=1.3, label=f"{BELOW}x F.linear")
    sps = [p[1] for pts in series.values() for p in pts]
    top_m = max(p[0] for pts in series.values() for p in pts)
    _m_axis(ax, [2**i for i in range(max(0, math.ceil(math.log2(top_m))) + 1)])
    ax.set_ylim(min(0.9, min(sps) - 0.02), max(1.1, max(sps) + 0.02))
    ax.set_ylabel("speedup: F.linear time / dispatched time (> 1: faster)")
    handles: dict = {}
    for h, lab in zip(*ax.get_legend_handles_labels()):
        handles.setdefault(lab, h)
    footer.legend(list(handles.values()), list(handles), loc="upper center", ncol=3, fontsize=8, frameon=False)
    stem = Path(csv_path).stem
    gpu = stem[len("m_sweep_"):] if stem.startswith("m_sweep_") else ""
    body.suptitle(f"hybridgemm.dispatch.fused_linear vs F.linear across M, {'/'.join(dtypes)}"
                  + (f", {gpu.upper() if gpu == 'h200' else gpu}" if gpu else "")
                  + "\nGPU time per call: CUDA-graph replay, L2-cold rotating operands, "
                    "median of per-round ratios to F.linear")

    def vals(col):
        return ", ".join(sorted({str(r.get(col) or "") for r in rows} - {""})) or "?"

    n_ms = len({p[0] for pts in series.values() for p in pts})
    footer.text(0.5, 0.04, f"{len(series)} shapes x {n_ms} M values (log-spaced and log-uniform random) | "
                f"placements {vals('placements')} x replays {vals('replays')} | {vals('date')} | "
                f"commit {vals('commit')}", ha="center", va="bottom", fontsize=7, color="0.3")
    path = Path(out_dir) / "m_sweep.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


E2E_DECODE_MODES = ("eager_generate", "eager_static", "compiled_static")
E2E_VARIANTS = (("stock", "0.25"), ("hybridgemm", "C3"))


def is_e2e_csv(path) -> bool:
    """Whether the CSV at ``path`` holds perf/bench_e2e.py's rows (its header has mode and variant)."""
    with open(path, newline="") as f:
        header = f.readline()
    return {"mode", "variant"} <= {c.strip() for c in header.split(",")}


def _e2e_bars(ax, groups: list[tuple], rows: dict, labels: list[str]) -> None:
    """Stock and hybridgemm bars per group (``rows[(group, variant)]``: ms), the speedup over
    stock written above each hybridgemm bar."""
    x = np.arange(len(groups))
    width = 0.38
    for i, (variant, colour) in enumerate(E2E_VARIANTS):
        ys = [rows.get((g, variant), np.nan) for g in groups]
        pos = x + (i - 0.5) * width
        ax.bar(pos, ys, width, label=variant, color=colour)
        for xp, g, y in zip(pos, groups, ys):
            stock = rows.get((g, "stock"))
            if variant != "stock" and stock and y == y:
                ax.annotate(f"{stock / y:.2f}x", (xp, y), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
            elif variant != "stock" and stock:  # no time: the row failed (its note in the CSV says why)
                ax.annotate("no result\n(see CSV)", (xp, stock), ha="center", va="top", fontsize=7, color=colour)
    ax.set_xticks(x, labels)
    ax.grid(True, axis="y", alpha=0.3)


def plot_e2e(csv_path, out_dir, name: str = "e2e.png") -> Path:
    """``name`` (default ``e2e.png``) in ``out_dir`` from perf/bench_e2e.py's CSV: per (GPU,
    model, layers), ms per decode step for each decode mode and batch (stock and hybridgemm
    bars, log scale, the HBM floor of the weights as a dashed line), and ms per prefill beside
    it. Rows whose status is not ok have no bar; a hybridgemm bar missing beside a stock one is
    marked. Raises FileNotFoundError for a missing file, ValueError when no row holds a time."""

    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"no such CSV file: {csv_path}")
    rows = [r for r in read_rows(str(csv_path)) if r.get("status") == "ok" and _float(r.get("ms_per_token")) > 0]
    if not rows:
        raise ValueError(f"{csv_path}: no rows with a time (not an end-to-end CSV?)")
    models: dict[tuple, list[dict]] = {}
    for r in rows:
        models.setdefault((r.get("gpu", "?"), r.get("model", "?"), r.get("layers", "?")), []).append(r)
    panels = []
    for key, mine in models.items():
        panels.append((key, "decode", [r for r in mine if r.get("mode") in E2E_DECODE_MODES]))
        panels.append((key, "prefill", [r for r in mine if r.get("mode") == "prefill"]))
    panels = [p for p in panels if p[2]]
    fig, body, footer, axes = _figure(len(panels), panel_w=6.5, panel_h=4.2, ncols=2)
    for ax, ((gpu, model, layers), kind, prs) in zip(axes, panels):
        ms = {((r["mode"], _int(r["batch"])), r["variant"]): _float(r["ms_per_token"]) for r in prs}
        order = {m: i for i, m in enumerate(E2E_DECODE_MODES)}
        groups = sorted({g for g, _ in ms}, key=lambda g: (order.get(g[0], 9), g[1]))
        if kind == "decode":
            _e2e_bars(ax, groups, ms, [f"{m.replace('_', chr(10))}\nB={b}" for m, b in groups])
            floors = {_float(r.get("hbm_floor_ms")) for r in prs} - {math.nan}
            floors = {f for f in floors if f > 0}
            if floors:
                ax.axhline(min(floors), ls="--", color="crimson", lw=1.3,
                           label=f"HBM floor: weights / {HBM_TBPS} TB/s")
            _log_y(ax)
            ax.set_ylabel("ms per decode step (lower is better)")
            ax.set_title(f"{model}, {layers} layers: decode" + (f" ({gpu})" if gpu else ""), fontsize=10)
        else:
            _e2e_bars(ax, groups, ms, [f"B={b}, {prs[0].get('tokens', '?')} tokens" for _, b in groups])
            ax.set_xlim(-1.5, len(groups) + 0.5)  # one group: keep its bars as narrow as the decode ones
            ax.set_ylabel("ms per prefill (lower is better)")
            ax.set_title(f"{model}, {layers} layers: prefill" + (f" ({gpu})" if gpu else ""), fontsize=10)
    _legend(footer, axes)
    body.suptitle("End to end: stock vs hybridgemm.patch, same weights, one process (labels: speedup over stock)")
    return _save(fig, footer, Path(out_dir) / name, rows)


MLP_STYLES = {"stock": dict(color="black", lw=2.2, marker="o"), "hybridgemm": dict(color="C3", marker="s"),
              "halves": dict(color="C0", marker="^"), "gemm_act": dict(color="C1", marker="v"),
              "triton_glu": dict(color="C2", marker="D")}


def plot_mlp(csv_path, out_dir, name: str = "mlp.png") -> Path:
    """``name`` in ``out_dir`` from perf/bench_mlp.py's CSV: per model and op (gate_up, down,
    lm_head), each variant's speedup over stock (stock time / variant time) against M, and
    stock's fraction of the HBM ceiling. Raises FileNotFoundError for a missing file,
    ValueError when no row holds a time."""
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"no such CSV file: {csv_path}")
    rows = [r for r in read_rows(str(csv_path)) if _float(r.get("us")) > 0]
    if not rows:
        raise ValueError(f"{csv_path}: no rows with a time (not a bench_mlp CSV?)")
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault((r["model"], r["op"], r["n"], r["k"]), []).append(r)
    fig, body, footer, axes = _figure(len(panels), panel_w=5.0, panel_h=3.6)
    for ax, ((model, op, n, k), prows) in zip(axes, panels.items()):
        for variant in [v for v in MLP_STYLES if any(r["variant"] == v for r in prows)]:
            pts = sorted((_int(r["m"]), _float(r["speedup"])) for r in prows if r["variant"] == variant)
            style = {"ms": 4, "lw": 1.4, **MLP_STYLES[variant]}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=variant, **style)
        ax.axhline(1.0, color="0.6", lw=0.8, zorder=0)
        _m_axis(ax, sorted({_int(r["m"]) for r in prows}))
        hbm = {_int(r["m"]): _float(r["fraction_of_hbm"]) for r in prows if r["variant"] == "stock"}
        ax.set_title(f"{model} {op} (N={n}, K={k})\nstock at M=1: {hbm.get(min(hbm), float('nan')):.0%} of HBM",
                     fontsize=9)
        ax.set_ylabel("stock time / variant time")
    _legend(footer, axes)
    body.suptitle("MLP GEMMs and LM head, bf16, GPU time (CUDA graphs, L2-cold rotating weights)")
    return _save(fig, footer, Path(out_dir) / name, rows)


TP_VARIANTS = (("tp1_hybridgemm", "0.55"), ("tp2_hybridgemm", "C3"), ("tp2_hybridgemm_nccl", "C1"),
               ("tp2_stock", "C0"))


def _tp_bars(ax, groups: list[tuple], rows: dict) -> None:
    """One bar per variant per group (``rows[(group, variant)]``: the CSV row), each tp=2 bar
    labelled with its speedup over tp1_hybridgemm (its ``speedup_vs_tp1``; where tp=1 has no
    time, the hybridgemm bar gets its speedup over tp2_stock instead). A variant without a time
    gets its status (skipped, error) written where its bar would stand."""
    x = np.arange(len(groups))
    width = 0.8 / len(TP_VARIANTS)
    for i, (variant, colour) in enumerate(TP_VARIANTS):
        pos = x + (i - (len(TP_VARIANTS) - 1) / 2) * width
        ys = [_float(rows[(g, variant)].get("ms_per_token")) if (g, variant) in rows else np.nan for g in groups]
        ys = [y if rows.get((g, variant), {}).get("status") == "ok" else np.nan for g, y in zip(groups, ys)]
        ax.bar(pos, ys, width, label=variant, color=colour)
        for xp, g, y in zip(pos, groups, ys):
            row = rows.get((g, variant))
            if row is None:
                continue
            if y != y:
                ax.annotate(row.get("status") or "no time", (xp, 0), ha="center", va="bottom", rotation=90,
                            fontsize=7, color=colour, xytext=(0, 3), textcoords="offset points")
                continue
            label = f"{_float(row.get('speedup_vs_tp1')):.2f}x" if _float(row.get("speedup_vs_tp1")) > 0 else ""
            stock = _float(rows.get((g, "tp2_stock"), {}).get("ms_per_token"))
            if not label and variant == "tp2_hybridgemm" and stock > 0:
                label = f"{stock / y:.2f}x\nvs stock"
            if label and variant != "tp1_hybridgemm":
                ax.annotate(label, (xp, y), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
    ax.grid(True, axis="y", alpha=0.3)


def plot_tp(csv_path, out_dir, name: str = "tp.png") -> Path:
    """``name`` (default ``tp.png``) in ``out_dir`` from perf/bench_tp.py's CSV: per (GPU, model,
    layers), ms per decode step for each decode mode and batch, and ms per prefill beside it,
    one bar per variant (:data:`TP_VARIANTS`), each tp=2 bar labelled with
    its speedup over tp=1 (see :func:`_tp_bars`); the title gives each variant's HBM floor per
    GPU. Raises FileNotFoundError for a missing file, ValueError when no row holds a time."""
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"no such CSV file: {csv_path}")
    known = dict(TP_VARIANTS)
    rows = [r for r in read_rows(str(csv_path)) if r.get("variant") in known and r.get("mode") != "logits_error"]
    if not any(r.get("status") == "ok" and _float(r.get("ms_per_token")) > 0 for r in rows):
        raise ValueError(f"{csv_path}: no rows with a time (not a bench_tp CSV?)")
    models: dict[tuple, list[dict]] = {}
    for r in rows:
        models.setdefault((r.get("gpu", "?"), r.get("model", "?"), r.get("layers", "?")), []).append(r)
    panels = [(key, kind, [r for r in mine if (r.get("mode") == "prefill") == (kind == "prefill")])
              for key, mine in models.items() for kind in ("decode", "prefill")]
    panels = [p for p in panels if any(r.get("status") == "ok" for r in p[2])]
    fig, body, footer, axes = _figure(len(panels), panel_w=6.5, panel_h=4.2, ncols=2)
    order = {m: i for i, m in enumerate(E2E_DECODE_MODES)}
    for ax, ((gpu, model, layers), kind, prs) in zip(axes, panels):
        by = {((r["mode"], _int(r["batch"])), r["variant"]): r for r in prs}
        timed = {g for (g, _), r in by.items() if r.get("status") == "ok"}  # a group of skips only: not drawn
        groups = sorted(timed, key=lambda g: (order.get(g[0], 9), g[1]))
        _tp_bars(ax, groups, by)
        if kind == "decode":
            ax.set_xticks(np.arange(len(groups)), [f"{m.replace('_', chr(10))}\nB={b}" for m, b in groups])
            ax.set_ylabel("ms per decode step (lower is better)")
            floors = {_tp_of(r["variant"]): _float(r.get("hbm_floor_ms_per_gpu")) for r in prs
                      if _float(r.get("hbm_floor_ms_per_gpu")) > 0}
            floor = ", ".join(f"tp={tp} {f:.3f} ms" for tp, f in sorted(floors.items()))
            ax.set_title(f"{model}, {layers} layers: decode ({gpu})" + (f"\nHBM floor per GPU: {floor}" if floor
                                                                          else ""), fontsize=9)
        else:
            length = next((r["tokens"] for r in prs if r.get("tokens")), "?")  # skipped rows have none
            ax.set_xticks(np.arange(len(groups)), [f"B={b}, {length} tokens" for _, b in groups])
            ax.set_xlim(-1.5, len(groups) + 0.5)
            ax.set_ylabel("ms per prefill (lower is better)")
            ax.set_title(f"{model}, {layers} layers: prefill ({gpu})", fontsize=9)
    _legend(footer, axes)
    body.suptitle("Tensor parallelism: tp=1 vs tp=2 with hybridgemm.parallelize and torch's DTensor TP "
                  "(labels: speedup over tp=1)")
    return _save(fig, footer, Path(out_dir) / name, [r for r in rows if r.get("status") == "ok"])


def _tp_of(variant: str) -> str:
    """The tensor-parallel degree in a bench_tp variant's name (``tp2_stock`` -> ``"2"``)."""
    m = re.match(r"tp(\d+)_", variant)
    return m.group(1) if m else "?"
