"""Table keys: ``(op, dtype, epilogue, N, K, M bucket, layout class)``, M buckets and layout
classes (autotune_cache/table.py's docstring says what each means)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hybridgemm.kernels.epilogue import ALL_EPILOGUES
from hybridgemm.kernels.problem import DTYPE_NAMES

M_BUCKETS = tuple(1 << i for i in range(15))  # 1, 2, 4, ..., 16384
DTYPES = ("bf16", "fp16", "fp32", "tf32")

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_LAYOUT_RE = re.compile(r"^(c|a(1|2|4|8)|s(1|2|4|8|16))$")
_EPILOGUE_NAMES = frozenset(e.name for e in ALL_EPILOGUES)
_INT_RE = re.compile(r"^[1-9][0-9]*$")


class TableError(ValueError):
    """A table document (or entry, or key) is malformed."""


def m_bucket(m: int) -> int:
    """Smallest bucket ≥ ``m``; past the last bucket, the last. ``m ≤ 0`` is an error
    (callers handle empty inputs before looking anything up)."""
    if isinstance(m, bool) or not isinstance(m, int):
        raise TypeError(f"m must be an int, got {type(m).__name__}")
    if m <= 0:
        raise ValueError(f"m must be positive to pick an M bucket, got {m}")
    return min(1 << (m - 1).bit_length(), M_BUCKETS[-1])


def layout_class(problem: Any) -> str:
    """The layout/alignment class of a :class:`~hybridgemm.kernels.problem.Problem`
    (see the module docstring)."""
    e = problem.dtype.itemsize
    a = 16
    for v in (problem.align_x, problem.align_w, problem.align_out, problem.align_bias,
              problem.ldx * e, problem.ldw * e, problem.ldo * e):
        a = min(a, v & -v) if v > 0 else a
    dense = problem.ldx == problem.k and problem.ldw == problem.k and problem.ldo == problem.n
    if dense:
        return "c" if a == 16 else f"a{a}"
    return f"s{a}"


@dataclass(frozen=True)
class TableKey:
    op: str
    dtype: str
    epilogue: str
    n: int
    k: int
    m_bucket: int
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
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise TableError(f"bad {name.upper()} {v!r}")
        if type(self.m_bucket) is not int or self.m_bucket not in M_BUCKETS:
            raise TableError(f"bad M bucket {self.m_bucket!r}; buckets are powers of 2, 1..16384")
        if not isinstance(self.layout, str) or not _LAYOUT_RE.match(self.layout):
            raise TableError(f"bad layout class {self.layout!r}")

    def to_string(self) -> str:
        return (f"{self.op}|{self.dtype}|{self.epilogue}|N={self.n}|K={self.k}"
                f"|M={self.m_bucket}|{self.layout}")

    @classmethod
    def from_string(cls, text: str) -> TableKey:
        parts = text.split("|") if isinstance(text, str) else []
        if len(parts) != 7:
            raise TableError(f"bad key {text!r}: expected op|dtype|epilogue|N=|K=|M=|layout")
        ints = []
        for part, label in zip(parts[3:6], ("N=", "K=", "M=")):
            if not part.startswith(label) or not _INT_RE.match(part[2:]):
                raise TableError(f"bad key {text!r}: expected {label}<positive int>")
            ints.append(int(part[2:]))
        return cls(parts[0], parts[1], parts[2], ints[0], ints[1], ints[2], parts[6])

    @classmethod
    def from_problem(cls, problem: Any, op: str = "linear") -> TableKey:
        dtype = DTYPE_NAMES[problem.dtype]
        if dtype == "fp32" and problem.tf32:
            dtype = "tf32"
        return cls(op, dtype, problem.epilogue.name, problem.n, problem.k,
                   m_bucket(problem.m), layout_class(problem))

    def with_bucket(self, bucket: int) -> TableKey:
        return TableKey(self.op, self.dtype, self.epilogue, self.n, self.k, bucket, self.layout)
