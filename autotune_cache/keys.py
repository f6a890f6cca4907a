"""Table keys: ``(op, dtype, epilogue, N, K, M range, layout class)``, M ranges and layout
classes.

**Key.** ``op|dtype|epilogue|N=..|K=..|M=lo-hi|layout``, e.g.
``linear|bf16|bias|N=6144|K=4096|M=9-16|c``. ``op`` carries the weight format (:func:`op_for`):
``linear`` for a weight of x's dtype, ``linear_e4m3_channel`` / ``linear_e4m3_block128`` for an
FP8 weight (kernels/fp8.py). ``dtype`` (x's and the output's) is ``bf16``, ``fp16``, ``fp32``, or
``tf32`` (fp32 inputs with TF32 allowed: a different race from exact fp32). ``epilogue`` is
``Epilogue.name``. ``M=lo-hi`` is the range of M the entry serves, and was validated on.

**Layout class** (:func:`layout_class`): ``a`` = the largest power of two, capped at 16
bytes, dividing every pointer (x, W, out, bias) and every row stride in bytes. 16 bytes
is what TMA and 128-bit vector loads need, so nothing above it matters.

- ``c``: dense rows (``ldx == K``, ``ldw == K``, ``ldo == N``) and ``a == 16``: the usual case;
- ``a1``/``a2``/``a4``/``a8``: dense rows, weaker alignment (odd K or N, offset views);
- ``s16``, ``s8``, ...: strided rows (some leading dimension exceeds its width, e.g. a
  slice of a fused QKV output), with alignment ``a``.

An entry serves the M range in its key, ``M=lo-hi``, and only that range: the tuner timed it
at several M across the range (``sample_points``) against F.linear. The default grid is
octaves, ``[2^(i-1) + 1, 2^i]`` (``[1, 1]`` and ``[2, 2]`` first) up to ``M_MAX``; the tuner
halves an octave that one config cannot serve whole (:func:`split_range`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from hybridgemm.kernels.epilogue import ALL_EPILOGUES
from hybridgemm.kernels.fp8 import FORMAT_OF
from hybridgemm.kernels.problem import DTYPE_NAMES

SCHEMA_VERSION = 2  # the table document format (autotune_cache/table_document.py)
M_MAX = 16384
OCTAVE_TOPS = tuple(1 << i for i in range(15))  # 1, 2, 4, ..., 16384: the default ranges' top edges
DTYPES = ("bf16", "fp16", "fp32", "tf32")
MIN_SPLIT_WIDTH = 8  # a range narrower than this is not halved

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_LAYOUT_RE = re.compile(r"^(c|a(1|2|4|8)|s(1|2|4|8|16))$")
_EPILOGUE_NAMES = frozenset(e.name for e in ALL_EPILOGUES)
_INT_RE = re.compile(r"^[1-9][0-9]{0,9}$")  # N and K are checked below 2**31 by TableKey
_RANGE_RE = re.compile(r"^([1-9][0-9]{0,4})-([1-9][0-9]{0,4})$")


class TableError(ValueError):
    """A table document (or entry, or key) is malformed."""


def _check_m(m: int) -> int:
    if isinstance(m, bool) or not isinstance(m, int):
        raise TypeError(f"m must be an int, got {type(m).__name__}")
    if m <= 0:
        raise ValueError(f"m must be positive to pick an M range, got {m}")
    return m


def octave(m: int) -> tuple[int, int] | None:
    """The default-grid range ``(lo, hi)`` holding ``m``: ``hi`` the smallest power of two ≥ m,
    ``lo = hi // 2 + 1`` (``(1, 1)`` for m = 1). ``None`` past ``M_MAX``: no range covers it."""
    if _check_m(m) > M_MAX:
        return None
    hi = 1 << (m - 1).bit_length()
    return (hi // 2 + 1 if hi > 1 else 1), hi


def sample_points(lo: int, hi: int) -> list[int]:
    """The M values a range is timed at: both edges and the geometric middle (fewer where the
    range is narrower). The low edge of an octave (2^i + 1) is the M that wastes most of a
    power-of-two tile, the top edge the most work: between them a config's ratio to F.linear
    moves the most."""
    mid = int(round(math.sqrt(lo * hi)))
    return sorted({lo, min(max(mid, lo), hi), hi})


def validation_points(lo: int, hi: int, count: int = 12) -> list[int]:
    """The further M a pinned winner is checked at beyond :func:`sample_points`: every M of a
    range up to ``2 * count`` wide, else ``count`` log-spaced M strictly inside it. F.linear
    asks cuBLAS's heuristic for each exact M and its kernel changes at M values no formula
    predicts (on the H200 it ran 4096 x 4096 at 11.3 µs for M = 25-30 but 13.8 µs at M = 32;
    perf/results/h200/m_sweep_h200.csv), so a config is only kept where it was measured at least
    as fast at all of these."""
    sampled = set(sample_points(lo, hi))
    if hi - lo + 1 <= 2 * count:
        return [m for m in range(lo, hi + 1) if m not in sampled]
    step = (hi / lo) ** (1 / (count + 1))
    found = {min(max(int(round(lo * step ** i)), lo + 1), hi - 1) for i in range(1, count + 1)}
    return sorted(found - sampled)


def split_range(lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The two halves of ``[lo, hi]`` (split at the geometric middle), or None when the range
    is narrower than ``MIN_SPLIT_WIDTH``."""
    if hi - lo + 1 < MIN_SPLIT_WIDTH:
        return None
    mid = min(max(int(round(math.sqrt(lo * hi))), lo), hi - 1)
    return (lo, mid), (mid + 1, hi)


def op_for(op: str, weight_format: str) -> str:
    """The key's op for a weight format: ``linear`` for a weight of x's dtype, ``linear_<format>``
    (e.g. ``linear_e4m3_channel``) for an FP8 weight, so FP8 entries never serve bf16 calls."""
    return f"{op}_{weight_format}" if weight_format else op


def weight_format_of(op: str) -> str:
    """The weight format a key's op names (:func:`op_for`'s inverse): an FP8 format for
    ``linear_e4m3_channel`` / ``linear_e4m3_block128``, ``""`` for ``linear``."""
    return next((fmt for fmt in FORMAT_OF.values() if op.endswith(f"_{fmt}")), "")


def layout_class(problem: Any) -> str:
    """The layout/alignment class of a :class:`~hybridgemm.kernels.problem.Problem`
    (module docstring)."""
    e = problem.dtype.itemsize
    a = 16
    for v in (problem.align_x, problem.align_w, problem.align_out, problem.align_bias,
              problem.ldx * e, problem.ldw * problem.w_itemsize, problem.ldo * e):
        a = min(a, v & -v) if v > 0 else a
    dense = problem.ldx == problem.k and problem.ldw == problem.k and problem.ldo == problem.n
    if dense:
        return "c" if a == 16 else f"a{a}"
    return f"s{a}"


@dataclass(frozen=True)
class ShapeKey:
    """Everything of a key but the M range: what a call is looked up by, with its M."""

    op: str
    dtype: str
    epilogue: str
    n: int
    k: int
    layout: str = "c"

    def to_string(self) -> str:
        return f"{self.op}|{self.dtype}|{self.epilogue}|N={self.n}|K={self.k}|{self.layout}"

    @classmethod
    def from_problem(cls, problem: Any, op: str = "linear") -> ShapeKey:
        dtype = DTYPE_NAMES[problem.dtype]
        if dtype == "fp32" and problem.tf32:
            dtype = "tf32"
        return cls(op_for(op, problem.weight_format), dtype, problem.epilogue.name, problem.n, problem.k,
                   layout_class(problem))


@dataclass(frozen=True)
class TableKey:
    op: str
    dtype: str
    epilogue: str
    n: int
    k: int
    m_lo: int
    m_hi: int
    layout: str = "c"

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not _NAME_RE.match(self.op):
            raise TableError(f"bad op {self.op!r}")
        if self.dtype not in DTYPES:
            raise TableError(f"bad dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.epilogue not in _EPILOGUE_NAMES:
            raise TableError(f"bad epilogue {self.epilogue!r}")
        for name in ("n", "k"):
            v = getattr(self, name)
            if type(v) is not int or not 0 < v < 2**31:
                raise TableError(f"bad {name.upper()} {v!r}")
        lo, hi = self.m_lo, self.m_hi
        if type(lo) is not int or type(hi) is not int or not 1 <= lo <= hi <= M_MAX:
            raise TableError(f"bad M range {lo!r}-{hi!r}; expected 1 <= lo <= hi <= {M_MAX}")
        if not isinstance(self.layout, str) or not _LAYOUT_RE.match(self.layout):
            raise TableError(f"bad layout class {self.layout!r}")

    @property
    def shape(self) -> ShapeKey:
        return ShapeKey(self.op, self.dtype, self.epilogue, self.n, self.k, self.layout)

    def covers(self, m: int) -> bool:
        return self.m_lo <= m <= self.m_hi

    def to_string(self) -> str:
        return (f"{self.op}|{self.dtype}|{self.epilogue}|N={self.n}|K={self.k}"
                f"|M={self.m_lo}-{self.m_hi}|{self.layout}")

    @classmethod
    def from_string(cls, text: str) -> TableKey:
        parts = text.split("|") if isinstance(text, str) and len(text) < 200 else []
        if len(parts) != 7:
            raise TableError(f"bad key {text!r:.120}: expected op|dtype|epilogue|N=|K=|M=lo-hi|layout")
        n, k = (_int_field(text, part, label) for part, label in zip(parts[3:5], ("N=", "K=")))
        m = _RANGE_RE.match(parts[5][2:]) if parts[5].startswith("M=") else None
        if m is None:
            raise TableError(f"bad key {text!r}: expected M=<lo>-<hi>")
        return cls(parts[0], parts[1], parts[2], n, k, int(m.group(1)), int(m.group(2)), parts[6])

    @classmethod
    def from_v1_string(cls, text: str) -> TableKey:
        """A schema-1 key (``...|M=<bucket>|...``, one M each) as the one-M range it was timed at."""
        parts = text.split("|") if isinstance(text, str) and len(text) < 200 else []
        if len(parts) != 7:
            raise TableError(f"bad key {text!r:.120}: expected op|dtype|epilogue|N=|K=|M=|layout")
        n, k, m = (_int_field(text, part, label) for part, label in zip(parts[3:6], ("N=", "K=", "M=")))
        return cls(parts[0], parts[1], parts[2], n, k, m, m, parts[6])

    @classmethod
    def for_range(cls, shape: ShapeKey, lo: int, hi: int) -> TableKey:
        return cls(shape.op, shape.dtype, shape.epilogue, shape.n, shape.k, lo, hi, shape.layout)

    @classmethod
    def from_problem(cls, problem: Any, op: str = "linear") -> TableKey:
        """The default-grid (octave) key holding ``problem.m``; ValueError past ``M_MAX``."""
        rng = octave(problem.m)
        if rng is None:
            raise ValueError(f"M={problem.m} is past the last tuned range (M ≤ {M_MAX})")
        return cls.for_range(ShapeKey.from_problem(problem, op), *rng)

    def with_range(self, lo: int, hi: int) -> TableKey:
        return TableKey.for_range(self.shape, lo, hi)


def _int_field(text: str, part: str, label: str) -> int:
    if not part.startswith(label) or not _INT_RE.match(part[2:]):
        raise TableError(f"bad key {text!r:.120}: expected {label}<positive int>")
    return int(part[2:])
