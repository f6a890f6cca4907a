"""Figures of whole models and single-op sweeps, each from its own benchmark's CSV: the M sweep
of the dispatcher (perf/bench_msweep.py), end to end stock vs patched (perf/bench_e2e.py), the
MLP GEMMs and the LM head (perf/bench_mlp.py), tensor parallelism (perf/bench_tp.py) and the
routed experts of a mixture-of-experts block (perf/bench_moe.py).
No GPU, no re-measuring.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from hybridgemm.perf.csvio import read_rows
from hybridgemm.perf.plot_style import (
    as_bool,
    distinct,
    figure,
    legend,
    log_y,
    m_axis,
    save,
    series_styles,
    shape_label,
    to_float,
    to_int,
)
from hybridgemm.perf.timing import HBM_TBPS

BELOW = 0.97  # an M-sweep row under this speedup is counted (and drawn under the dashed line)


def plot_m_sweep(csv_path, out_dir, name: str = "m_sweep.png") -> Path:
    """``name`` (default ``m_sweep.png``) in ``out_dir`` from perf/bench_msweep.py's CSV: speedup
    of the dispatched call over F.linear (F.linear time / dispatched time) against M on a log2
    axis, one line per shape ("N x K (+bias) — models"), a dashed line at the 0.97x mark and a
    light one at parity; the footer names the dates and commits of the rows.
    Raises FileNotFoundError for a missing file, ValueError when no row holds M and a speedup."""

    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"no such CSV file: {csv_path}")
    rows = read_rows(str(csv_path))
    series: dict[tuple, list[tuple[int, float]]] = {}
    models: dict[tuple, str] = {}
    for r in rows:
        m, sp = to_int(r.get("m")), to_float(r.get("speedup"))
        if m < 1 or not (math.isfinite(sp) and sp > 0):
            continue
        key = (to_int(r.get("n")), to_int(r.get("k")), as_bool(r.get("bias")), r.get("dtype", ""))
        series.setdefault(key, []).append((m, sp))
        models.setdefault(key, r.get("models", ""))
    if not series:
        raise ValueError(f"{csv_path}: no rows with an M and a speedup (not an M-sweep CSV?)")
    dtypes = sorted({key[3] for key in series})
    fig, body, footer, (ax,) = figure(1, panel_w=11.0, panel_h=6.0)
    styles = series_styles(series)
    for key, pts in series.items():
        pts.sort()
        label = shape_label(*key[:3], models[key]) + (f" [{key[3]}]" if len(dtypes) > 1 else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=3.5, lw=1.2, label=label, **styles[key])
    ax.axhline(1.0, color="0.6", lw=0.8, zorder=0)
    ax.axhline(BELOW, ls="--", color="crimson", lw=1.3, label=f"{BELOW}x F.linear")
    sps = [p[1] for pts in series.values() for p in pts]
    top_m = max(p[0] for pts in series.values() for p in pts)
    m_axis(ax, [2**i for i in range(max(0, math.ceil(math.log2(top_m))) + 1)])
    ax.set_ylim(min(0.9, min(sps) - 0.02), max(1.1, max(sps) + 0.02))
    ax.set_ylabel("speedup: F.linear time / dispatched time (> 1: faster)")
    legend(footer, [ax], ncol=3)
    stem = Path(csv_path).stem
    gpu = stem[len("m_sweep_"):] if stem.startswith("m_sweep_") else ""
    body.suptitle(f"hybridgemm.dispatch.fused_linear vs F.linear across M, {'/'.join(dtypes)}"
                  + (f", {gpu.upper() if gpu == 'h200' else gpu}" if gpu else "")
                  + "\nGPU time per call: CUDA-graph replay, L2-cold rotating operands, "
                    "median of per-round ratios to F.linear")
    n_ms = len({p[0] for pts in series.values() for p in pts})
    text = (f"{len(series)} shapes x {n_ms} M values (log-spaced and log-uniform random) | "
            f"placements {distinct(rows, 'placements')} x replays {distinct(rows, 'replays')} | "
            f"{distinct(rows, 'date')} | commit {distinct(rows, 'commit')}")
    return save(fig, footer, Path(out_dir) / name, rows, text)


E2E_DECODE_MODES = ("eager_generate", "eager_static", "compiled_static")


E2E_VARIANTS = (("stock", "0.25"), ("hybridgemm", "C3"))
LORA_VARIANTS = (("stock_peft", "0.25"), ("hybridgemm_peft", "C3"))  # perf/bench_lora.py's rows


def csv_header(path) -> set[str]:
    """The column names in the first line of the CSV at ``path``."""
    with open(path, newline="", errors="replace") as f:
        return {c.strip().strip('"') for c in f.readline().split(",")}


def is_m_sweep_csv(path) -> bool:
    """Whether the CSV at ``path`` holds perf/bench_msweep.py's rows (m, speedup, dispatched_us)."""
    return {"m", "n", "k", "speedup", "dispatched_us"} <= csv_header(path)


def is_mlp_csv(path) -> bool:
    """Whether the CSV at ``path`` holds perf/bench_mlp.py's rows (model, op, variant, us)."""
    return {"model", "op", "m", "variant", "us", "speedup"} <= csv_header(path)


def is_e2e_csv(path) -> bool:
    """Whether the CSV at ``path`` holds perf/bench_e2e.py's rows (its header has mode, variant
    and ms_per_token; perf/e2e_profile.py's kernel rows have the first two only; perf/bench_tp.py's
    rows have a tp column besides)."""
    header = csv_header(path)
    return {"mode", "variant", "ms_per_token"} <= header and "tp" not in header


def is_tp_csv(path) -> bool:
    """Whether the CSV at ``path`` holds perf/bench_tp.py's rows (mode, variant, ms_per_token, tp)."""
    return {"mode", "variant", "ms_per_token", "tp"} <= csv_header(path)


def has_times(path) -> bool:
    """Whether the CSV at ``path`` has an ok row with a time (an error-mode run has none)."""
    return any(r.get("status") == "ok" and to_float(r.get("ms_per_token")) > 0 for r in read_rows(str(path)))


def _e2e_bars(ax, groups: list[tuple], rows: dict, labels: list[str], variants=E2E_VARIANTS) -> None:
    """Baseline and hybridgemm bars per group (``rows[(group, variant)]``: ms; ``variants``:
    the baseline's name and colour first), the speedup over the baseline written above each
    hybridgemm bar."""
    x = np.arange(len(groups))
    width = 0.38
    baseline = variants[0][0]
    for i, (variant, colour) in enumerate(variants):
        ys = [rows.get((g, variant), np.nan) for g in groups]
        pos = x + (i - 0.5) * width
        ax.bar(pos, ys, width, label=variant, color=colour)
        for xp, g, y in zip(pos, groups, ys):
            stock = rows.get((g, baseline))
            if variant != baseline and stock and y == y:
                ax.annotate(f"{stock / y:.2f}x", (xp, y), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
            elif variant != baseline and stock:  # no time: the row failed (its note in the CSV says why)
                ax.annotate("no result\n(see CSV)", (xp, stock), ha="center", va="top", fontsize=7, color=colour)
    ax.set_xticks(x, labels)
    ax.grid(True, axis="y", alpha=0.3)


# The decode modes of the per-model summary panel (one token per step, B = 1), with their colours.
SUMMARY_MODES = (("compiled_static", "C1"), ("eager_static", "C0"))


def _speedups(rows) -> dict[tuple[str, str], float]:
    """``{(model, mode): stock ms / hybridgemm ms}`` of the :data:`SUMMARY_MODES` at B = 1, for
    each model measured at its full depth (the largest layer count the CSV has for it)."""
    depth: dict[str, int] = {}
    for r in rows:
        depth[r.get("model", "?")] = max(depth.get(r.get("model", "?"), 0), to_int(r.get("layers")) or 0)
    ms = {(r.get("model", "?"), r["mode"], r["variant"]): to_float(r["ms_per_token"]) for r in rows
          if to_int(r.get("batch")) == 1 and r.get("mode") in dict(SUMMARY_MODES)
          and (to_int(r.get("layers")) or 0) == depth[r.get("model", "?")]}
    return {(model, mode): ms[(model, mode, "stock")] / t for (model, mode, variant), t in ms.items()
            if variant == "hybridgemm" and t > 0 and ms.get((model, mode, "stock"))}


def _summary_bars(ax, speedups: dict[tuple[str, str], float]) -> None:
    """One group per model, a bar per decode mode: hybridgemm's speedup over stock at B = 1."""
    from matplotlib.ticker import FuncFormatter

    models = list(dict.fromkeys(m for m, _ in speedups))
    x = np.arange(len(models))
    width = 0.38
    for i, (mode, colour) in enumerate(SUMMARY_MODES):
        ys = [speedups.get((m, mode), np.nan) for m in models]
        pos = x + (i - 0.5) * width
        ax.bar(pos, ys, width, label=f"{mode}, B=1", color=colour)
        for xp, y in zip(pos, ys):
            if y == y:
                ax.annotate(f"{y:.2f}x", (xp, y), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
    ax.axhline(1.0, color="black", lw=1)
    # ratios on a log scale: a 10x beside 1.2x ones leaves both readable
    ax.set_yscale("log", base=2)
    top = max([y for y in speedups.values() if y == y] + [1.0])
    ax.set_ylim(min([y for y in speedups.values() if y == y] + [1.0]) / 1.25, top * 1.6)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xticks(x, models, fontsize=8, rotation=30, ha="right")
    ax.set_ylabel("speedup over stock (higher is better)")
    ax.set_title("decode at B=1, every model: hybridgemm over stock", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)


def plot_e2e(csv_path, out_dir, name: str = "e2e.png") -> Path:
    """``name`` (default ``e2e.png``) in ``out_dir`` from perf/bench_e2e.py's CSV: per (GPU,
    model, layers), ms per decode step for each decode mode and batch (stock and hybridgemm
    bars, log scale, the HBM floor of the weights as a dashed line), and ms per prefill beside
    it; with several models, a first panel of hybridgemm's compiled and eager static-cache decode
    speedup at B = 1 per model (each at the largest layer count the CSV has for it). Rows whose
    status is not ok have no bar; a hybridgemm bar missing beside a stock one is marked.
    perf/bench_lora.py's CSV (variants stock_peft and hybridgemm_peft) draws the same way, stock
    PEFT as the baseline. Raises FileNotFoundError for a missing file, ValueError when
    no row holds a time."""

    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"no such CSV file: {csv_path}")
    rows = [r for r in read_rows(str(csv_path)) if r.get("status") == "ok" and to_float(r.get("ms_per_token")) > 0]
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
    speedups = _speedups(rows)
    if len({m for m, _ in speedups}) > 1:
        panels.insert(0, (None, "summary", speedups))
    lora = any(r.get("variant") == LORA_VARIANTS[0][0] for r in rows)
    variants = LORA_VARIANTS if lora else E2E_VARIANTS
    fig, body, footer, axes = figure(len(panels), panel_w=6.5, panel_h=4.2, ncols=2)
    for ax, (key, kind, prs) in zip(axes, panels):
        if kind == "summary":
            _summary_bars(ax, prs)
            continue
        gpu, model, layers = key
        ms = {((r["mode"], to_int(r["batch"])), r["variant"]): to_float(r["ms_per_token"]) for r in prs}
        order = {m: i for i, m in enumerate(E2E_DECODE_MODES)}
        groups = sorted({g for g, _ in ms}, key=lambda g: (order.get(g[0], 9), g[1]))
        if kind == "decode":
            _e2e_bars(ax, groups, ms, [f"{m.replace('_', chr(10))}\nB={b}" for m, b in groups], variants)
            floors = [(f, r) for r in prs for f in [to_float(r.get("hbm_floor_ms"))] if f > 0]
            if floors:
                floor, row = min(floors, key=lambda fr: fr[0])
                # that row's read rate (a row from before that column: the H200's figure it used)
                rate = to_float(row.get("read_tbps"))
                rate = rate if rate > 0 else HBM_TBPS
                ax.axhline(floor, ls="--", color="crimson", lw=1.3, label=f"HBM floor: weights / {rate:.2f} TB/s")
            log_y(ax)
            ax.set_ylabel("ms per decode step (lower is better)")
            ax.set_title(f"{model}, {layers} layers: decode" + (f" ({gpu})" if gpu else ""), fontsize=10)
        else:
            _e2e_bars(ax, groups, ms, [f"B={b}, {prs[0].get('tokens', '?')} tokens" for _, b in groups], variants)
            ax.set_xlim(-1.5, len(groups) + 0.5)  # one group: keep its bars as narrow as the decode ones
            ax.set_ylabel("ms per prefill (lower is better)")
            ax.set_title(f"{model}, {layers} layers: prefill" + (f" ({gpu})" if gpu else ""), fontsize=10)
    legend(footer, axes)
    body.suptitle("One LoRA adapter (PEFT): stock vs patched,\nsame weights and adapter (labels: speedup)" if lora else
                  "End to end: stock vs hybridgemm.patch, same weights, one process\n(labels: speedup over stock)")
    return save(fig, footer, Path(out_dir) / name, rows)


# Fixed styles of bench_mlp's variants (any other variant takes one of its own: series_styles).
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
    rows = [r for r in read_rows(str(csv_path)) if to_float(r.get("us")) > 0]
    if not rows:
        raise ValueError(f"{csv_path}: no rows with a time (not a bench_mlp CSV?)")
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault((r["model"], r["op"], r["n"], r["k"]), []).append(r)
    fig, body, footer, axes = figure(len(panels), panel_w=5.0, panel_h=3.6)
    variants = [v for v in MLP_STYLES if any(r["variant"] == v for r in rows)]
    variants += sorted({r["variant"] for r in rows} - set(variants))
    styles = series_styles(variants, MLP_STYLES)
    for ax, ((model, op, n, k), prows) in zip(axes, panels.items()):
        for variant in [v for v in variants if any(r["variant"] == v for r in prows)]:
            pts = sorted((to_int(r["m"]), to_float(r["speedup"])) for r in prows if r["variant"] == variant)
            style = {"ms": 4, "lw": 1.4, **styles[variant]}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=variant, **style)
        ax.axhline(1.0, color="0.6", lw=0.8, zorder=0)
        m_axis(ax, sorted({to_int(r["m"]) for r in prows}))
        hbm = {to_int(r["m"]): to_float(r["fraction_of_hbm"]) for r in prows if r["variant"] == "stock"}
        ax.set_title(f"{model} {op} (N={n}, K={k})\nstock at M=1: {hbm.get(min(hbm), float('nan')):.0%} of HBM",
                     fontsize=9)
        ax.set_ylabel("stock time / variant time")
    legend(footer, axes)
    body.suptitle("MLP GEMMs and LM head, bf16, GPU time (CUDA graphs, L2-cold rotating weights)")
    return save(fig, footer, Path(out_dir) / name, rows)


TP_VARIANTS = (("tp1_hybridgemm", "0.55"), ("tp2_hybridgemm", "C3"), ("tp2_hybridgemm_push", "C2"),
               ("tp2_hybridgemm_nccl", "C1"), ("tp2_stock", "C0"))


def _tp_bars(ax, groups: list[tuple], rows: dict) -> None:
    """One bar per variant per group (``rows[(group, variant)]``: the CSV row), each tp=2 bar
    labelled with its speedup over tp1_hybridgemm (its ``speedup_vs_tp1``; where tp=1 has no
    time, the hybridgemm bar gets its speedup over tp2_stock instead). A variant without a time
    gets its status (skipped, error) written where its bar would stand."""
    x = np.arange(len(groups))
    width = 0.8 / len(TP_VARIANTS)
    for i, (variant, colour) in enumerate(TP_VARIANTS):
        pos = x + (i - (len(TP_VARIANTS) - 1) / 2) * width
        ys = [to_float(rows[(g, variant)].get("ms_per_token")) if (g, variant) in rows else np.nan for g in groups]
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
            label = f"{to_float(row.get('speedup_vs_tp1')):.2f}x" if to_float(row.get("speedup_vs_tp1")) > 0 else ""
            stock = to_float(rows.get((g, "tp2_stock"), {}).get("ms_per_token"))
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
    rows = [r for r in read_rows(str(csv_path)) if r.get("variant") in known
            and r.get("mode") not in ("logits_error", "decode_error")]
    if not any(r.get("status") == "ok" and to_float(r.get("ms_per_token")) > 0 for r in rows):
        raise ValueError(f"{csv_path}: no rows with a time (not a bench_tp CSV?)")
    models: dict[tuple, list[dict]] = {}
    for r in rows:
        models.setdefault((r.get("gpu", "?"), r.get("model", "?"), r.get("layers", "?")), []).append(r)
    panels = [(key, kind, [r for r in mine if (r.get("mode") == "prefill") == (kind == "prefill")])
              for key, mine in models.items() for kind in ("decode", "prefill")]
    panels = [p for p in panels if any(r.get("status") == "ok" for r in p[2])]
    fig, body, footer, axes = figure(len(panels), panel_w=6.5, panel_h=4.2, ncols=2)
    order = {m: i for i, m in enumerate(E2E_DECODE_MODES)}
    for ax, ((gpu, model, layers), kind, prs) in zip(axes, panels):
        by = {((r["mode"], to_int(r["batch"])), r["variant"]): r for r in prs}
        timed = {g for (g, _), r in by.items() if r.get("status") == "ok"}  # a group of skips only: not drawn
        groups = sorted(timed, key=lambda g: (order.get(g[0], 9), g[1]))
        _tp_bars(ax, groups, by)
        if kind == "decode":
            ax.set_xticks(np.arange(len(groups)), [f"{m.replace('_', chr(10))}\nB={b}" for m, b in groups])
            ax.set_ylabel("ms per decode step (lower is better)")
            floors = {_tp_of(r["variant"]): to_float(r.get("hbm_floor_ms_per_gpu")) for r in prs
                      if to_float(r.get("hbm_floor_ms_per_gpu")) > 0}
            floor = ", ".join(f"tp={tp} {f:.3f} ms" for tp, f in sorted(floors.items()))
            ax.set_title(f"{model}, {layers} layers: decode ({gpu})" + (f"\nHBM floor per GPU: {floor}" if floor
                                                                          else ""), fontsize=9)
        else:
            length = next((r["tokens"] for r in prs if r.get("tokens")), "?")  # skipped rows have none
            ax.set_xticks(np.arange(len(groups)), [f"B={b}, {length} tokens" for _, b in groups])
            ax.set_xlim(-1.5, len(groups) + 0.5)
            ax.set_ylabel("ms per prefill (lower is better)")
            ax.set_title(f"{model}, {layers} layers: prefill ({gpu})", fontsize=9)
    legend(footer, axes)
    body.suptitle("Tensor parallelism: tp=1 vs tp=2 with hybridgemm.parallelize and torch's DTensor TP "
                  "(labels: speedup over tp=1)")
    return save(fig, footer, Path(out_dir) / name, [r for r in rows if r.get("status") == "ok"])


def _tp_of(variant: str) -> str:
    """The tensor-parallel degree in a bench_tp variant's name (``tp2_stock`` -> ``"2"``)."""
    m = re.match(r"tp(\d+)_", variant)
    return m.group(1) if m else "?"


MOE_STYLES = {"transformers_grouped_mm (CUDA graph)": {"color": "0.25", "marker": "s"},
              "transformers_grouped_mm (eager, events)": {"color": "0.55", "marker": "D"},
              "transformers_eager (eager, events)": {"color": "0.75", "marker": "v"},
              "hybridgemm (CUDA graph)": {"color": "C3", "marker": "o"},
              "hybridgemm (eager, events)": {"color": "C1", "marker": "^"}}
_MOE_METHODS = {"graph": "CUDA graph", "events": "eager, events"}  # bench_moe's methods, as labelled


def is_moe_csv(path) -> bool:
    """Whether the CSV at ``path`` holds perf/bench_moe.py's rows (experts_hit, top_k, floor_us)."""
    return {"experts_hit", "top_k", "floor_us"} <= csv_header(path)


def moe_floors(rows: list[dict]) -> list[tuple[str, str, list[tuple[int, float]]]]:
    """The HBM-floor lines of one shape's bench_moe rows: ``(label, color, [(M, floor µs)])`` for
    the bf16 experts, and for the FP8 ones per channel where there are such rows (each M's
    floor once)."""
    out = []
    for weights, color, label in (("bf16", "k", "HBM floor (experts hit)"),
                                  ("e4m3_channel", "0.55", "HBM floor (experts hit, FP8 per channel)")):
        points = sorted({(to_int(r["M"]), to_float(r["floor_us"])) for r in rows
                         if (r.get("weights") or "bf16") == weights})
        if points:
            out.append((label, color, points))
    return out


def plot_moe(csv_path, out_dir, name: str = "moe.png") -> Path:
    """``name`` in ``out_dir`` from perf/bench_moe.py's CSV: per shape, each provider's GPU time
    against the tokens, CUDA-graph replay solid and eager events dashed, and the HBM floor of
    the experts hit. Raises FileNotFoundError for a missing file, ValueError when no row holds
    a time."""
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"no such CSV file: {csv_path}")
    rows = [r for r in read_rows(str(csv_path)) if r.get("status") == "ok" and to_float(r.get("median_us")) > 0]
    if not rows:
        raise ValueError(f"{csv_path}: no rows with a time (not a bench_moe CSV?)")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, body, footer, axes = figure(len(shapes), panel_w=5.5, panel_h=3.8)

    def series(r) -> str:
        return f"{r['provider']} ({_MOE_METHODS.get(r['method'], r['method'])})"

    labels = list(dict.fromkeys(series(r) for r in rows))
    styles = series_styles([s for s in MOE_STYLES if s in labels] + sorted(set(labels) - set(MOE_STYLES)), MOE_STYLES)
    for ax, shape in zip(axes, shapes):
        srows = [r for r in rows if r["shape"] == shape]
        for label in dict.fromkeys(series(r) for r in srows):
            pts = sorted((to_int(r["M"]), to_float(r["median_us"])) for r in srows if series(r) == label)
            ls = "--" if label.endswith(f"({_MOE_METHODS['events']})") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, ms=4, lw=1.4, label=label, **styles[label])
        for label, color, floor in moe_floors(srows):
            ax.plot([p[0] for p in floor], [p[1] for p in floor], color=color, lw=0.8, ls=":", label=label)
        m_axis(ax, sorted({to_int(r["M"]) for r in srows}))
        log_y(ax)
        r0 = srows[0]
        ax.set_title(f"{shape}: H={r0['hidden']}, {r0['experts']} experts of {r0['intermediate']}, top-{r0['top_k']}",
                     fontsize=9)
        ax.set_ylabel("µs per MoE block (routed experts)")
    legend(footer, axes, ncol=3)
    kinds = "bf16 and FP8 experts" if any((r.get("weights") or "bf16") != "bf16" for r in rows) else "bf16"
    body.suptitle(f"Mixture-of-experts block, {kinds}: transformers vs hybridgemm.moe (same weights and routing)")
    return save(fig, footer, Path(out_dir) / name, rows)
