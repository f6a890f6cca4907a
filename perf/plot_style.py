"""What every figure of perf/plots.py and perf/plots_models.py shares: a figure of panels over a
fixed footer strip (legend and caption), the caption of versions, the M axis, log-y ticks,
and the parsing of CSV cells. Matplotlib's object API with the Agg canvas: no pyplot, no
global backend switch.
"""

from __future__ import annotations

import math
from pathlib import Path

ITEMSIZE = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "tf32": 4}


DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def shape_label(n, k, bias, models: str) -> str:
    """``"N x K (+bias) — models"`` (models given ';'-joined, shown ', '-joined)."""
    names = ", ".join(m for m in str(models).split(";") if m)
    return f"{n} x {k}{' (+bias)' if as_bool(bias) else ''}" + (f" — {names}" if names else "")


def as_bool(v) -> bool:
    """A bias flag from a row: a bool, or its CSV text ("True"/"False", "1"/"0", "yes"/"no")."""
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def to_int(v) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return 0


def to_float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def caption(rows) -> str:
    """GPU and software versions the rows were measured with (every distinct value)."""
    def vals(col):
        return ", ".join(sorted({str(r.get(col) or "") for r in rows} - {""})) or "?"

    return (f"GPU: {vals('gpu')} | torch {vals('torch')} | Triton {vals('triton')} | cuBLASLt {vals('cublaslt')} | "
            f"nvmath-python {vals('nvmath')} | hybridgemm {vals('hybridgemm')}")


def figure(n_panels: int, panel_w=5.0, panel_h=3.8, foot=0.75, ncols: int = 3):
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


def save(fig, footer, path: Path, rows) -> Path:
    footer.text(0.5, 0.04, caption(rows), ha="center", va="bottom", fontsize=7, color="0.3")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def m_axis(ax, ms) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("M (rows of x: tokens)")
    ax.grid(True, which="major", alpha=0.3)


def legend(footer, axes) -> None:
    seen = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    footer.legend(list(seen.values()), list(seen), loc="upper center", ncol=min(5, len(seen)), fontsize=8,
                  frameon=False)


def log_y(ax) -> None:
    """Log y with plain numbers (5, 10, 20, 50 ...), not 2 x 10^1."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
