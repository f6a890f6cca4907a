"""What every figure of perf/plots.py and perf/plots_models.py shares: a figure of panels over a
footer strip sized to its legend (legend above, caption below), the caption of versions and
commits, one colour and marker per series, the M axis, log-y ticks, and the parsing of CSV
cells. Matplotlib's object API with the Agg canvas: no pyplot, no global backend switch.
"""

from __future__ import annotations

import math
import weakref
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


def distinct(rows, col: str) -> str:
    """Every distinct non-empty value of ``col`` in ``rows``, sorted and comma-joined ("?" if none)."""
    return ", ".join(sorted({str(r.get(col) or "") for r in rows} - {""})) or "?"


def caption(rows) -> str:
    """GPU and software versions the rows were measured with (every distinct value; a field no
    row records is left out), and the commits they were measured at where the rows record one."""
    fields = (("GPU: ", "gpu"), ("torch ", "torch"), ("Triton ", "triton"), ("cuBLASLt ", "cublaslt"),
              ("nvmath-python ", "nvmath"), ("hybridgemm ", "hybridgemm"), ("commit ", "commit"))
    parts = [f"{label}{distinct(rows, col)}" for label, col in fields if any(r.get(col) for r in rows)]
    return " | ".join(parts) or "no versions recorded"


# Series styles: every series of a figure gets its own colour and its own marker (up to
# len(PALETTE) and len(MARKERS) series; past that the (colour, marker) pairs still differ).
PALETTE = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9",
           "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d",
           "#e41a1c", "#377eb8", "#4daf4a", "#984ea3", "#ff7f00", "#a65628", "#f781bf")
MARKERS = "os^vDP*Xph<>d8H"


def series_styles(names, fixed: dict | None = None) -> dict[str, dict]:
    """``{name: {"color", "marker"}}`` for every name, no two alike: names in ``fixed`` keep
    their style, the others take, in order, colours and markers no fixed style uses."""
    from matplotlib.colors import to_rgb

    fixed = fixed or {}
    taken_colours = {to_rgb(st["color"]) for st in fixed.values() if "color" in st}
    taken_markers = {st["marker"] for st in fixed.values() if "marker" in st}
    colours = [c for c in PALETTE if to_rgb(c) not in taken_colours] or list(PALETTE)
    markers = [m for m in MARKERS if m not in taken_markers] or list(MARKERS)
    styles, i = {}, 0
    for name in dict.fromkeys(names):
        if name in fixed:
            styles[name] = dict(fixed[name])
            continue
        styles[name] = {"color": colours[i % len(colours)], "marker": markers[i % len(markers)]}
        i += 1
    return styles


CAPTION_IN = 0.3      # the caption's strip at the bottom of the footer, inches
LEGEND_ROW_IN = 0.2   # one legend row (fontsize 8, markers included)
LEGEND_PAD_IN = 0.15
_GRIDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # footer -> (figure, its grid, body inches)


def figure(n_panels: int, panel_w=5.0, panel_h=3.8, ncols: int = 3):
    """A figure of panels (``body``, at most ``ncols`` a row) over a footer strip for the
    legend and the caption. The strip is the caption's height until :func:`legend` fills it,
    which makes it as tall as its rows need: neither can overlap the panels or each other."""
    from matplotlib.figure import Figure

    ncols = min(ncols, max(1, n_panels))
    nrows = math.ceil(max(1, n_panels) / ncols)
    height = panel_h * nrows + 0.6
    fig = Figure(figsize=(panel_w * ncols, height + CAPTION_IN), layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=[height, CAPTION_IN], hspace=0)
    body, footer = fig.add_subfigure(grid[0, 0]), fig.add_subfigure(grid[1, 0])
    _GRIDS[footer] = (fig, grid, height)
    axes = body.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, body, footer, axes


def save(fig, footer, path: Path, rows, text: str | None = None) -> Path:
    """Write the figure to ``path`` with ``text`` (default: :func:`caption` of ``rows``) at the
    bottom of the footer."""
    footer.text(0.5, 0.5 * CAPTION_IN / footer_inches(footer), caption(rows) if text is None else text,
                ha="center", va="center", fontsize=7, color="0.3", wrap=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def footer_inches(footer) -> float:
    _, grid, _ = _GRIDS[footer]
    return grid.get_height_ratios()[1]


def m_axis(ax, ms) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("M (rows of x: tokens)")
    ax.grid(True, which="major", alpha=0.3)


def legend(footer, axes, ncol: int = 5) -> None:
    """One legend for all ``axes`` (each label once) at the top of the footer, ``ncol``
    entries a row; the footer (and the figure) grows by the rows it takes, so the caption
    below keeps its own strip."""
    seen = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if not seen:
        return
    ncol = min(ncol, len(seen))
    rows = math.ceil(len(seen) / ncol)
    fig, grid, body_in = _GRIDS[footer]
    foot_in = CAPTION_IN + LEGEND_PAD_IN + LEGEND_ROW_IN * rows
    grid.set_height_ratios([body_in, foot_in])
    fig.set_size_inches(fig.get_size_inches()[0], body_in + foot_in)
    footer.legend(list(seen.values()), list(seen), loc="upper center", ncol=ncol, fontsize=8, frameon=False,
                  bbox_to_anchor=(0.5, 1.0), borderaxespad=0.3)


def log_y(ax) -> None:
    """Log y with plain numbers (5, 10, 20, 50 ...), not 2 x 10^1."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
