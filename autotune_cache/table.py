"""The persisted, deterministic tuning table: keys, entries, load/save, and where tables live.

**Document.** ``{"schema": 2, "signature": {...}, "entries": {key: entry}}``, JSON only
(``json.loads`` and strict type checks: a table is data and can never run code).
Written canonically: ``json.dumps(sort_keys=True, indent=1)`` plus a newline, timings
rounded to 4 significant digits, so re-tuning diffs cleanly and save → load → save is
byte-identical. The signature rules are in :mod:`.signature`.

**Key.** ``op|dtype|epilogue|N=..|K=..|M=lo-hi|layout``, e.g.
``linear|bf16|bias|N=6144|K=4096|M=9-16|c``. ``dtype`` is ``bf16``, ``fp16``, ``fp32``, or
``tf32`` (fp32 inputs with TF32 allowed: a different race from exact fp32). ``epilogue`` is
``Epilogue.name``. ``M=lo-hi`` is the range of M the entry serves, and was validated on.

**Entry.** The winner (``backend``, ``config``: a backend's record, an object whose values
are JSON scalars or lists of scalars; ``{}`` for cuBLASLt means its heuristic asked at the
exact M of each call, and backend ``torch`` means F.linear itself), the M values it was
timed at (``m_points``, both edges of the range among them), its speed ratio to F.linear at
each (``ratios``: F.linear time / its time, > 1 is faster), ``worst_ratio`` (their minimum),
``median_us``/``spread_us``/``flinear_us`` at the top point, the runner-up candidates, and
``tuned_at``. A Triton entry tuned under another Triton than the one in the table's signature
says which in ``triton_version`` (absent otherwise): a table merged or re-saved after a
Triton upgrade keeps, entry by entry, what each config was tuned under.

**Layout class** (:func:`layout_class`): ``a`` = the largest power of two, capped at 16
bytes, dividing every pointer (x, W, out, bias) and every row stride in bytes. 16 bytes
is what TMA and 128-bit vector loads need, so nothing above it matters.

- ``c``: dense rows (``ldx == K``, ``ldw == K``, ``ldo == N``) and ``a == 16``: the usual case;
- ``a1``/``a2``/``a4``/``a8``: dense rows, weaker alignment (odd K or N, offset views);
- ``s16``, ``s8``, ...: strided rows (some leading dimension exceeds its width, e.g. a
  slice of a fused QKV output), with alignment ``a``.

**Lookup.** :meth:`TuningTable.find` returns the entry whose range holds the call's M, for
the same op, dtype, epilogue, N, K and layout, or nothing: an entry is never used outside
the range it was validated on. Ranges of one shape never overlap: storing or merging an
entry drops the entries whose ranges it overlaps (the newer or higher-precedence one wins).

**Schema 1** tables (one entry per power-of-two M bucket, timed at that M alone) are read
with one warning: an entry is kept only for the one M it was timed at, and only when it
recorded a ratio to F.linear of at least ``V1_MIN_RATIO``.

**Library versions.** A table applies to a device when the device fields of its signature
match; cuBLASLt and Triton versions are judged per entry (:mod:`.signature`,
:meth:`TuningTable.entry_status`): a pinned cuBLASLt record of another cuBLASLt runs F.linear,
a Triton config tuned under another Triton is probed once before use. :func:`load_tables`
says so once per table (one :class:`HybridGemmTableWarning`), with how many entries it affects.

**Where tables live, and precedence** (:func:`load_tables` merges key by key, higher wins):

1. an explicit path (argument) — a missing or foreign file warns once;
2. the user table, ``$HYBRIDGEMM_CACHE_DIR/table.json`` if the variable is set, else
   ``platformdirs.user_cache_dir("hybridgemm")/table.json`` — a foreign or corrupt one warns
   once, a missing one is silent;
3. shipped tables, ``hybridgemm/autotune_cache/tables/*.json``. Tables for other GPUs are
   expected there, so one whose signature does not match is skipped quietly (debug log);
   a corrupt shipped table warns. Matching shipped tables merge in file-name order.

A bad table never raises on load (unless ``strict=True``): it is ignored with exactly one
:class:`HybridGemmTableWarning` per path per process. :meth:`TuningTable.save` writes
atomically (temp file in the same directory + ``os.replace``) under a cross-process
``filelock``, merging with what is on disk: entries set on this table win, entries only
on disk are kept unless a new entry's range overlaps them. Failure to write raises
:class:`TableWriteError` (an ``OSError``).

**Reading a file** (every read in this module goes through one helper, ``_read_table_bytes``):

- only a regular file is read. The path is ``os.stat``-ed first (symlinks followed); a FIFO,
  socket, device (e.g. a link to ``/dev/zero``) or directory is rejected with its kind as the
  reason and never opened for reading. The file is opened ``O_RDONLY | O_NONBLOCK |
  O_CLOEXEC`` and ``fstat``-ed again (it may have been swapped between the two calls), so
  not even a FIFO swapped in late can block the caller;
- a table is at most ``MAX_TABLE_BYTES`` = 16 MiB. A larger file is rejected from its size,
  and at most ``MAX_TABLE_BYTES + 1`` bytes are ever read (a file that grows, or reports
  size 0 like ``/proc`` files, is still cut off). A document with more than
  ``MAX_TABLE_ENTRIES`` entries (more than 16 MiB of valid ones could hold) is rejected
  before they are validated, so the worst file under the cap parses in about a second;
- any failure to parse or validate — whatever Python raises on hostile JSON (huge
  numbers, deep nesting, ``1e400`` read as infinity, ``MemoryError``...) — is reported as a
  :class:`TableError`: the file is ignored with one warning naming it and the reason, or,
  with ``strict=True``, the ``TableError`` is raised. A failure inside one entry drops that
  entry only;
- text is UTF-8; one leading UTF-8 byte-order mark is accepted and skipped. A JSON object
  with the same name twice (anywhere in the document) makes the document ambiguous and
  rejects it. Strings are data: one holding an escaped lone surrogate (``"\\ud800"``: not
  encodable as UTF-8) rejects its entry (or, in the signature, the file); terminal escape
  sequences are kept as data and only ever shown through ``repr``.

Each call reads each file once; nothing here caches a result: the caller (the dispatcher's
``table_for_device``) keeps the loaded table, and :func:`load_tables` never raises on a bad
file, so a bad table is read once per load, not once per call.

**Stale temp files.** A writer killed between creating its temp file and the replace leaves
``.{table name}.<random>.tmp`` behind (the name ``_atomic_write`` gives it). ``save`` removes
such files from the table's directory when they are regular files (not followed if they are
symlinks) last modified over ``STALE_TEMP_S`` = 60 s ago; errors while cleaning are ignored.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import logging
import math
import os
import re
import reprlib
import stat
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import platformdirs
from filelock import FileLock, Timeout

from .keys import (  # noqa: F401 (re-exported)
    _NAME_RE,
    DTYPES,
    M_MAX,
    OCTAVE_TOPS,
    SCHEMA_VERSION,
    ShapeKey,
    TableError,
    TableKey,
    layout_class,
    octave,
)
from .signature import (
    FLINEAR,
    USE,
    entry_verdict,
    is_triton_backend,
    signature_matches,
    validate_signature,
)

SIGNIFICANT_DIGITS = 4
CACHE_DIR_ENV = "HYBRIDGEMM_CACHE_DIR"
LOCK_TIMEOUT_S = 120.0
V1_MIN_RATIO = 0.97  # a schema-1 entry is kept (at its one M) only if it was at least this fast
MAX_US = 1e9  # a timing above this (over 16 minutes per call) is not a timing
MAX_RATIO = 1e3
MAX_TABLE_BYTES = 16 * 1024 * 1024  # a table file larger than this is rejected unread (module docstring)
# More entries than a 16 MiB file of valid entries can hold (each takes over 160 bytes): a
# document with more is not a table, and is rejected before validating them one by one.
MAX_TABLE_ENTRIES = 1 << 17
STALE_TEMP_S = 60.0  # a temp file of ours older than this (mtime) is a killed writer's

_log = logging.getLogger(__name__)
_ENTRY_FIELDS = {"backend", "config", "candidates", "median_us", "spread_us", "tuned_at", "m_points", "ratios",
                 "worst_ratio"}
_OPTIONAL_FIELDS = {"flinear_us", "triton_version"}
MAX_VERSION_CHARS = 40
_CANDIDATE_FIELDS = {"backend", "config", "median_us", "spread_us"}
_V1_ENTRY_FIELDS = {"backend", "config", "candidates", "median_us", "spread_us", "tuned_at"}


# Values in messages: bounded in length and depth (a repr of a 900-deep list would itself
# raise RecursionError), escapes shown as escapes.
_brief_repr = reprlib.Repr()
_brief_repr.maxlevel, _brief_repr.maxlist, _brief_repr.maxdict = 2, 6, 4
_brief_repr.maxstring, _brief_repr.maxlong, _brief_repr.maxother = 60, 40, 60


def _brief(v: Any) -> str:
    try:
        return _brief_repr.repr(v)
    except Exception:  # never let describing a bad value fail
        return f"<{type(v).__name__}>"


def _is_text(s: str) -> bool:
    """Whether ``s`` is encodable as UTF-8 (JSON's ``"\\ud800"`` gives a lone surrogate, which is not)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class HybridGemmTableWarning(UserWarning):
    """A tuning table was ignored (in whole or in part)."""


class TableWriteError(OSError):
    """A table could not be written; ``.filename`` is the table's path."""

    def __init__(self, path: os.PathLike | str, reason: object):
        self.message = (f"cannot write tuning table {os.fspath(path)}: {reason} "
                        f"(set {CACHE_DIR_ENV} to a writable directory, or pass another path)")
        # Keep the cause's errno so callers can still tell EACCES from EROFS from ENOSPC.
        super().__init__(getattr(reason, "errno", None), self.message, os.fspath(path))

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------- entries


def _round(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")


def _number(v: Any, where: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """``v`` as a float in [lo, hi] (or (lo, hi]); TableError otherwise. Checks the range
    before converting: a 400-digit integer must not raise OverflowError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TableError(f"{where} must be a number, got {_brief(v)}")
    if isinstance(v, int) and not -10**12 < v < 10**12:
        raise TableError(f"{where} is out of range: {_brief(v)}")
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise TableError(f"{where} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r:.40}")
    return _round(v)


def _time(obj: Mapping, name: str, where: str) -> float:
    return _number(obj.get(name), f"{where}{name}", 0.0, MAX_US)


_SCALAR_TYPES = frozenset({str, int, float, bool, type(None)})


def _flat_record(config: dict) -> bool:
    """Whether every value of ``config`` is a JSON scalar or a list of scalars, as every
    backend's record is (``to_record`` in kernels/). Nothing nested: re-dumping it can never
    recurse deeply, and checking it stops at the first nested value."""
    for v in config.values():
        if type(v) is list:
            if not set(map(type, v)) <= _SCALAR_TYPES:
                return False
        elif type(v) not in _SCALAR_TYPES:
            return False
    return True


def _record(obj: Mapping, where: str) -> tuple[str, dict]:
    backend, config = obj.get("backend"), obj.get("config")
    if not isinstance(backend, str) or not _NAME_RE.match(backend):
        raise TableError(f"{where}backend must be a lowercase name, got {_brief(backend)}")
    if not isinstance(config, dict):
        raise TableError(f"{where}config must be an object, got {type(config).__name__}")
    if not _flat_record(config):
        raise TableError(f"{where}config values must be numbers, strings, booleans, null or lists of those")
    return backend, config


def _json_copy(entry: Any) -> Any:
    # JSON round trip: a deep copy, tuples -> lists, and proof that it serialises (finite
    # numbers, string keys, strings that are Unicode text).
    try:
        text = json.dumps(entry, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise TableError(f"entry is not JSON data: {str(e)[:120]}") from None
    if not _is_text(text):
        raise TableError("entry is not JSON data: a string holds a lone surrogate (not Unicode text)")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TableError(f"entry is not JSON data: {str(e)[:120]}") from None


def _tuned_at(entry: Mapping) -> str:
    tuned_at = entry["tuned_at"]
    if not isinstance(tuned_at, str) or len(tuned_at) > 40:
        raise TableError(f"tuned_at must be an ISO date string, got {_brief(tuned_at)}")
    try:
        datetime.fromisoformat(tuned_at.replace("Z", "+00:00"))
    except ValueError:
        raise TableError(f"tuned_at is not an ISO date: {_brief(tuned_at)}") from None
    return tuned_at


def _candidates(entry: Mapping) -> list[dict]:
    candidates = entry["candidates"]
    if not isinstance(candidates, list):
        raise TableError("candidates must be a list")
    out = []
    for i, c in enumerate(candidates):  # order is the ranking (best first): keep it
        where = f"candidates[{i}]."
        if not isinstance(c, dict) or not _CANDIDATE_FIELDS <= set(c) <= _CANDIDATE_FIELDS | {"worst_ratio"}:
            raise TableError(f"{where[:-1]} must be an object with {sorted(_CANDIDATE_FIELDS)} (+ worst_ratio)")
        b, cfg = _record(c, where)
        row = {"backend": b, "config": cfg, "median_us": _time(c, "median_us", where),
               "spread_us": _time(c, "spread_us", where)}
        if "worst_ratio" in c:
            row["worst_ratio"] = _number(c["worst_ratio"], f"{where}worst_ratio", 0.0, MAX_RATIO, lo_open=True)
        out.append(row)
    return out


def normalize_entry(entry: Any, key: TableKey | None = None) -> dict:
    """Validate ``entry`` and return its canonical form (a fresh, JSON-safe deep copy with
    rounded numbers). With ``key``, its ``m_points`` must lie in the key's range and include
    both edges. Raises :class:`TableError` naming the first problem."""
    return _normalize(_json_copy(entry), key)


def _normalize(entry: Any, key: TableKey | None) -> dict:
    # ``entry`` is JSON data of its own (a _json_copy, or fresh from parsing a document
    # that holds no lone surrogate and no non-finite number): it is validated, not copied.
    if not isinstance(entry, dict):
        raise TableError(f"entry must be an object, got {type(entry).__name__}")
    for name in _OPTIONAL_FIELDS:  # optional: absent and null mean the same; store absent
        if name in entry and entry[name] is None:
            del entry[name]
    fields = set(entry)
    if not _ENTRY_FIELDS <= fields <= _ENTRY_FIELDS | _OPTIONAL_FIELDS:
        missing, extra = _ENTRY_FIELDS - fields, fields - _ENTRY_FIELDS - _OPTIONAL_FIELDS
        raise TableError(f"entry fields: missing {sorted(missing)}, unknown {sorted(extra)[:8]}")
    backend, config = _record(entry, "")
    out: dict[str, Any] = {
        "backend": backend, "config": config,
        "median_us": _time(entry, "median_us", ""), "spread_us": _time(entry, "spread_us", ""),
    }
    if "flinear_us" in entry:
        out["flinear_us"] = _time(entry, "flinear_us", "")
    if "triton_version" in entry:
        tuned = entry["triton_version"]
        if not is_triton_backend(backend):
            raise TableError(f"triton_version is recorded on Triton entries only, not on {backend!r}")
        if not isinstance(tuned, str) or not 0 < len(tuned) <= MAX_VERSION_CHARS:
            raise TableError(f"triton_version must be a version string, got {_brief(tuned)}")
        out["triton_version"] = tuned
    points, ratios = entry["m_points"], entry["ratios"]
    if not isinstance(points, list) or not points or len(points) > 64:
        raise TableError("m_points must be a non-empty list (at most 64)")
    if any(type(m) is not int or not 1 <= m <= M_MAX for m in points) or points != sorted(set(points)):
        raise TableError(f"m_points must be increasing ints in 1..{M_MAX}, got {_brief(points)}")
    if not isinstance(ratios, list) or len(ratios) != len(points):
        raise TableError("ratios must be a list with one ratio per m_point")
    out["m_points"] = points
    out["ratios"] = [_number(r, "ratios[]", 0.0, MAX_RATIO, lo_open=True) for r in ratios]
    out["worst_ratio"] = _number(entry["worst_ratio"], "worst_ratio", 0.0, MAX_RATIO, lo_open=True)
    if out["worst_ratio"] != min(out["ratios"]):
        raise TableError(f"worst_ratio {out['worst_ratio']} is not the least of ratios {out['ratios']}")
    if key is not None and (points[0] != key.m_lo or points[-1] != key.m_hi):
        raise TableError(f"m_points {points[0]}..{points[-1]} do not span the key's range {key.m_lo}-{key.m_hi}")
    out["tuned_at"] = _tuned_at(entry)
    out["candidates"] = _candidates(entry)
    return out


def make_entry(backend: str, config: Mapping, *, m_points: Iterable[int], ratios: Iterable[float],
               median_us: float, spread_us: float, candidates: Iterable[Mapping] = (),
               flinear_us: float | None = None, tuned_at: str | None = None) -> dict:
    """Build a canonical entry (``worst_ratio`` is the least of ``ratios``); ``tuned_at``
    defaults to today's UTC date."""
    ratios = [_number(r, "ratios[]", 0.0, MAX_RATIO, lo_open=True) for r in ratios]
    return normalize_entry({
        "backend": backend, "config": dict(config), "m_points": [int(m) for m in m_points], "ratios": ratios,
        "worst_ratio": min(ratios) if ratios else None, "median_us": median_us,
        "spread_us": spread_us, "candidates": [dict(c) for c in candidates],
        "flinear_us": flinear_us,
        "tuned_at": tuned_at or datetime.now(timezone.utc).date().isoformat(),
    })


def _migrate_v1_entry(text: str, value: Any) -> tuple[TableKey, dict | None]:
    """A schema-1 entry as a one-M range entry, or ``(key, None)`` when it recorded no ratio
    to F.linear of at least ``V1_MIN_RATIO`` (nothing shows it is safe to run)."""
    key = TableKey.from_v1_string(text)
    if not isinstance(value, dict) or not _V1_ENTRY_FIELDS <= set(value) <= _V1_ENTRY_FIELDS | _OPTIONAL_FIELDS:
        raise TableError("not a schema-1 entry")
    median = _time(value, "median_us", "")
    flinear = value.get("flinear_us")
    if flinear is None or median <= 0:
        return key, None
    ratio = _number(flinear, "flinear_us", 0.0, MAX_US) / median
    if ratio < V1_MIN_RATIO:
        return key, None
    return key, normalize_entry({**value, "m_points": [key.m_lo], "ratios": [_round(ratio)],
                                 "worst_ratio": _round(ratio)}, key)


# --------------------------------------------------------------------------- documents

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(path: Path, reason: str, kind: str = "load") -> None:
    # One warning per path (and kind: reading vs replacing on save) per process: a bad
    # table is looked at on every load_tables() call and must not flood the log.
    key = (os.path.abspath(path), kind)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"hybridgemm tuning table {path}: {reason}", HybridGemmTableWarning,
                  stacklevel=3)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in a tuning table")


class _Refused(ValueError):
    """Valid JSON syntax that a table may not hold (raised by the parser's hooks)."""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        name = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"the name {_brief(name)} appears twice in one object (ambiguous)")
    return obj


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e400 parses as infinity, like the NaN/Infinity constants refused
        raise _Refused(f"the number {text[:40]} is out of range (not a finite double)")
    return v


# A JSON escape that can make a lone surrogate (\ud800-\udfff); documents without one are
# Unicode text throughout and skip the per-entry check.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _Unreadable(TableError):
    """The file exists but cannot, or must not, be read (an OSError, or not a regular file).
    ``errno`` is the OSError's, if any."""

    def __init__(self, reason: str, errno: int | None = None):
        super().__init__(reason)
        self.errno = errno


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def _read_table_bytes(path: Path) -> bytes | None:
    """The bytes of the table file at ``path``, or ``None`` when there is no such file.

    Raises :class:`_Unreadable` (a :class:`TableError`) when the file cannot be read or is
    not a regular file, and :class:`TableError` when it is larger than ``MAX_TABLE_BYTES``
    (module docstring: never a blocking open, never more than the cap + 1 bytes read)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise _Unreadable(f"cannot be read ({e})", getattr(e, "errno", None)) from None
    if not stat.S_ISREG(st.st_mode):
        raise _Unreadable(f"cannot be read: it is {_file_kind(st.st_mode)}, not a regular file")
    if st.st_size > MAX_TABLE_BYTES:
        raise TableError(f"is {st.st_size} bytes, larger than a table may be ({MAX_TABLE_BYTES} bytes)")
    flags = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0))
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:  # removed since the stat: as if it had never been there
        return None
    except OSError as e:
        raise _Unreadable(f"cannot be read ({e})", e.errno) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between stat and open
            raise _Unreadable(f"cannot be read: it is {_file_kind(st.st_mode)}, not a regular file")
        chunks, left = [], MAX_TABLE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise _Unreadable(f"cannot be read ({e})", e.errno) from None
    finally:
        os.close(fd)
    if left <= 0:
        raise TableError(f"is larger than a table may be ({MAX_TABLE_BYTES} bytes)")
    return b"".join(chunks)


@dataclass
class ParsedTable:
    """:func:`parse_document`'s result. ``dropped`` describes entries that failed validation
    (or overlapped an earlier one); ``note`` is set when a schema-1 table was migrated."""

    signature: dict
    entries: dict[TableKey, dict]
    dropped: list[str] = field(default_factory=list)
    note: str = ""


def _failure(e: BaseException) -> str:
    """A reason for an unexpected exception met while parsing (never raises)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, MemoryError):
        return "too large to hold in memory"
    try:
        text = str(e)
    except Exception:
        text = ""
    return f"{type(e).__name__}: {text[:120]}" if text else type(e).__name__


@contextlib.contextmanager
def _cyclic_gc_paused() -> Any:
    """Pause the cyclic garbage collector (if it runs) for the block. Parsing a 16 MiB table
    creates millions of containers, and each full collection they trigger walks the whole
    heap (torch's included): with torch imported that doubled the parse time. A parsed JSON
    tree holds no reference cycles, so nothing is left uncollected; reference counting
    still frees everything as usual, and the collector is back on when the block ends."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def parse_document(data: bytes) -> ParsedTable:
    """Parse table bytes. Raises :class:`TableError` — and nothing else, whatever the bytes —
    if the document is unusable. A schema-1 document is migrated (module docstring) and its
    signature re-labelled as this schema."""
    try:
        with _cyclic_gc_paused():
            return _parse_document(data)
    except TableError:
        raise
    except Exception as e:  # hostile input must not reach the caller as anything else
        raise TableError(f"cannot be parsed ({_failure(e)})") from None


def _check_signature_values(sig: dict) -> None:
    # validate_signature allows unknown scalar fields: also require them to be writable
    # back (finite numbers, strings that are Unicode text).
    for name, value in sig.items():
        if not _is_text(name) or (isinstance(value, str) and not _is_text(value)):
            raise TableError(f"signature field {_brief(name)} holds a lone surrogate (not Unicode text)")
        if isinstance(value, float) and not math.isfinite(value):
            raise TableError(f"signature field {_brief(name)} is not a finite number")


def _parse_document(data: bytes) -> ParsedTable:
    try:  # "utf-8-sig": one leading byte-order mark is skipped (module docstring)
        source = bytes(data).decode("utf-8-sig")
        doc = json.loads(source, parse_constant=_reject_constant, parse_float=_finite_float,
                         object_pairs_hook=_unique_object)
    except UnicodeDecodeError:
        raise TableError("not UTF-8 text") from None
    except _Refused as e:
        raise TableError(f"not a table's JSON: {e}") from None
    except RecursionError:
        raise TableError("not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise TableError(f"not valid JSON ({str(e)[:120]})") from None
    if not isinstance(doc, dict):
        raise TableError(f"top level is {type(doc).__name__}, not an object")
    schema = doc.get("schema")
    if type(schema) is not int or schema not in (1, SCHEMA_VERSION):
        raise TableError(f"schema version {_brief(schema)}; this hybridgemm reads {SCHEMA_VERSION} (and 1)")
    if set(doc) != {"schema", "signature", "entries"}:
        names = ", ".join(_brief(n) for n in sorted(doc)[:6])
        raise TableError(f"top-level fields [{names}]; expected entries, schema, signature")
    reason = validate_signature(doc["signature"])
    if reason:
        raise TableError(reason)
    _check_signature_values(doc["signature"])
    if not isinstance(doc["entries"], dict):
        raise TableError("entries is not an object")
    if len(doc["entries"]) > MAX_TABLE_ENTRIES:
        raise TableError(f"{len(doc['entries'])} entries; a table holds at most {MAX_TABLE_ENTRIES}")
    signature = dict(doc["signature"])
    check_text = _SURROGATE_ESCAPE.search(source) is not None
    del source
    entries: dict[TableKey, dict] = {}
    # Kept ranges per shape, sorted by m_lo; they never overlap, so they are sorted by m_hi
    # too and one bisection finds a clash (a linear scan per entry is quadratic: 16 MiB of
    # one-M entries of one shape would take minutes).
    kept: dict[tuple, tuple[list[int], list[TableKey]]] = {}
    dropped: list[str] = []
    unsafe = 0
    for text, value in sorted(doc["entries"].items()):
        try:
            if schema == 1:
                key, entry = _migrate_v1_entry(text, value)
                if entry is None:
                    unsafe += 1
                    continue
            else:
                key = TableKey.from_string(text)
                if key.to_string() != text:
                    raise TableError("key is not in canonical form")
                entry = _normalize(_json_copy(value) if check_text else value, key)
            los, keys = kept.setdefault(_shape_of(key), ([], []))
            i = bisect.bisect_right(los, key.m_hi)  # keys[:i] start at or below our top
            if i and keys[i - 1].m_hi >= key.m_lo:
                raise TableError(f"its M range overlaps {keys[i - 1].to_string()}")
            entries[key] = entry
            los.insert(i, key.m_lo)
            keys.insert(i, key)
        except Exception as e:  # one bad entry, whatever it raised, drops that entry only
            reason = str(e) if isinstance(e, TableError) else _failure(e)
            dropped.append(f"{repr(text[:120])}: {reason}")
    note = ""
    if schema == 1:
        signature["schema"] = SCHEMA_VERSION
        note = (f"schema-1 table: each entry was timed at one M only; kept {len(entries)} of "
                f"{len(doc['entries'])} entries, each for exactly the M it was timed at "
                f"({unsafe} without a recorded ratio to F.linear >= {V1_MIN_RATIO} dropped); "
                "run `hybridgemm autotune --force` to tune whole M ranges")
    return ParsedTable(signature, entries, dropped, note)


def dump_document(signature: Mapping, entries: Mapping[TableKey, dict]) -> str:
    """Canonical text of a table document."""
    doc = {"schema": SCHEMA_VERSION, "signature": {**signature, "schema": SCHEMA_VERSION},
           "entries": {k.to_string(): v for k, v in entries.items()}}
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n"


def _overlap(a: TableKey, b: TableKey) -> bool:
    return a.m_lo <= b.m_hi and b.m_lo <= a.m_hi


def _shape_of(k: TableKey) -> tuple:
    # ``k.shape`` as a plain tuple: building a ShapeKey per key is most of the cost of
    # merging tens of thousands of entries.
    return k.op, k.dtype, k.epilogue, k.n, k.k, k.layout


def _overlay(base: dict[TableKey, dict], new: Mapping[TableKey, dict]) -> dict[TableKey, dict]:
    """``base`` with ``new``'s entries set, dropping every entry of ``base`` whose range
    overlaps a new entry of the same shape (ranges of one shape never overlap)."""
    if not base or not new:
        return {**base, **new}
    # Per shape: the new ranges sorted by m_lo, and the running maximum of their m_hi. A
    # range [lo, hi] overlaps one of them iff among those starting at or below hi, the
    # highest top reaches lo: one bisection per entry of base, not a scan of new.
    by_shape: dict[tuple, list[tuple[int, int]]] = {}
    for k in new:
        by_shape.setdefault(_shape_of(k), []).append((k.m_lo, k.m_hi))
    index: dict[tuple, tuple[list[int], list[int]]] = {}
    for shape, rngs in by_shape.items():
        rngs.sort()
        tops, top = [], 0
        for _, hi in rngs:
            top = max(top, hi)
            tops.append(top)
        index[shape] = ([lo for lo, _ in rngs], tops)

    def overlapped(k: TableKey) -> bool:
        found = index.get(_shape_of(k))
        if found is None:
            return False
        los, tops = found
        i = bisect.bisect_right(los, k.m_hi)
        return i > 0 and tops[i - 1] >= k.m_lo

    out = {k: v for k, v in base.items() if k in new or not overlapped(k)}
    out.update(new)
    return out


def _triton_of(signature: Mapping | None) -> str | None:
    v = signature.get("triton_version") if isinstance(signature, Mapping) else None
    return v if isinstance(v, str) else None


def _rebased(entry: dict, from_triton: str | None, to_triton: str | None) -> dict:
    """``entry`` of a table whose signature names Triton ``from_triton``, as an entry of one
    naming ``to_triton``: a Triton entry records the Triton it was tuned under exactly when
    that differs from its table's (a new dict when that changes anything, else ``entry``)."""
    if not is_triton_backend(entry["backend"]):
        return entry
    tuned = entry.get("triton_version") or from_triton or "unknown"
    if tuned == to_triton:
        if "triton_version" not in entry:
            return entry
        return {k: v for k, v in entry.items() if k != "triton_version"}
    if entry.get("triton_version") == tuned:
        return entry
    return {**entry, "triton_version": tuned}


def _rebase(entries: dict[TableKey, dict], from_sig: Mapping | None, to_sig: Mapping | None) -> dict[TableKey, dict]:
    """Every entry of ``entries`` (a table tuned on ``from_sig``) through :func:`_rebased`
    for a table with ``to_sig``; ``entries`` itself is updated and returned. Unchanged when
    ``to_sig`` is None (a table without a signature has no Triton to compare with)."""
    if to_sig is None:
        return entries
    from_triton, to_triton = _triton_of(from_sig), _triton_of(to_sig)
    for k, e in entries.items():
        new = _rebased(e, from_triton, to_triton)
        if new is not e:
            entries[k] = new
    return entries


@dataclass(frozen=True)
class VersionEffect:
    """Entries of a table that a library version changes (:meth:`TuningTable.version_effects`):
    ``count`` entries of ``library`` ("cuBLASLt" or "Triton") tuned under version ``tuned``,
    in a process running ``running`` (``None``: that library is not available), which
    ``status`` (``PROBE`` or ``FLINEAR``) says how they now run."""

    library: str
    tuned: str
    running: str | None
    status: str
    count: int

    def describe(self) -> str:
        n = f"{self.count} entr{'y' if self.count == 1 else 'ies'}"
        if self.running is None:
            return f"{self.library} is not available here: its {n} run F.linear"
        if self.status == FLINEAR:
            return (f"{self.library} records tuned under {self.library} {self.tuned} (here {self.running}): "
                    f"{n} run F.linear")
        return (f"{self.library} configs tuned under {self.library} {self.tuned} (here {self.running}): {n} "
                "checked once against an fp32 reference before first use")


# --------------------------------------------------------------------------- the table


class TuningTable:
    """Entries keyed by :class:`TableKey`, with the device signature they were tuned on."""

    def __init__(self, signature: dict | None = None,
                 entries: Mapping[TableKey, dict] | None = None):
        self.signature = dict(signature) if signature is not None else None
        self._entries: dict[TableKey, dict] = {}
        self._dirty: set[TableKey] = set()  # keys set on this table: they win on save
        self._index: dict[ShapeKey, tuple[list[int], list[TableKey]]] | None = None
        self.sources: list[Path] = []  # files this table's entries came from
        self._foreign_triton: bool | None = None  # computed on first use (foreign_triton)
        for key, entry in (entries or {}).items():
            if not isinstance(key, TableKey):
                raise TypeError(f"keys must be TableKey, got {type(key).__name__}")
            self._entries = _overlay(self._entries, {key: self._native(normalize_entry(entry, key))})

    def _native(self, entry: dict) -> dict:
        """A new entry of this table: ``triton_version`` only where it differs from ours."""
        if self.signature is None:
            return entry
        triton = _triton_of(self.signature)
        return _rebased(entry, entry.get("triton_version") or triton, triton)

    # ---- reading
    @classmethod
    def load(cls, path: os.PathLike | str, signature: dict | None = None,
             strict: bool = False) -> TuningTable:
        """Load one table. A missing file gives an empty table, silently. A bad file
        (unreadable, not JSON, wrong types or schema, or — when ``signature`` is given —
        tuned on another device) gives an empty table and one warning per path per process,
        or raises :class:`TableError` when ``strict``. Invalid entries alone are dropped.
        With ``signature``, the loaded table carries it (it is now this device's table; other
        library versions are judged per entry, :meth:`entry_status`); without, the file's
        own signature."""
        return cls._load(Path(path), signature, strict)

    @classmethod
    def _load(cls, path: Path, signature: dict | None, strict: bool,
              missing: str | None = None) -> TuningTable:
        """:meth:`load`; ``missing``: the warning for a missing file (default: silent)."""
        try:
            data = _read_table_bytes(path)
            if data is None:
                if missing is not None:
                    if strict:
                        raise TableError(missing)
                    _warn_once(path, missing)
                return cls(signature)
            parsed = parse_document(data)
        except TableError as e:
            return cls._reject(path, str(e), signature, strict)
        if signature is not None:
            ok, reason = signature_matches(parsed.signature, signature)
            if not ok:
                return cls._reject(path, f"tuned for another device or kernel ABI: {reason}", signature, strict)
        return cls._from_parsed(path, parsed, signature, strict)

    @classmethod
    def _from_parsed(cls, path: Path, parsed: ParsedTable, signature: dict | None,
                     strict: bool) -> TuningTable:
        if parsed.dropped:
            n = len(parsed.dropped)
            msg = f"dropped {n} invalid entr{'y' if n == 1 else 'ies'}"
            if strict:
                raise TableError(f"{path}: {msg}: {parsed.dropped[0]}")
            _warn_once(path, f"{msg} (first: {parsed.dropped[0]})")
        if parsed.note:
            _warn_once(path, parsed.note, kind="schema")
        table = cls(signature if signature is not None else parsed.signature)
        table._entries = _rebase(parsed.entries, parsed.signature, table.signature)
        table.sources.append(path)
        return table

    @classmethod
    def _reject(cls, path: Path, reason: str, signature: dict | None,
                strict: bool) -> TuningTable:
        if strict:
            raise TableError(f"{path}: {reason}")
        _warn_once(path, f"{reason}; ignoring it")
        return cls(signature)

    @property
    def entries(self) -> Mapping[TableKey, dict]:
        """Read-only view of all entries (entries themselves must not be mutated)."""
        return types.MappingProxyType(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def lookup(self, key: TableKey) -> dict | None:
        """The entry for exactly ``key`` (same range), or ``None``. Do not mutate the result."""
        return self._entries.get(key)

    def find(self, shape: ShapeKey, m: int) -> tuple[TableKey, dict] | None:
        """The entry of ``shape`` whose M range holds ``m``, or ``None``: nothing outside
        the range an entry was validated on."""
        if self._index is None:
            groups: dict[ShapeKey, list[TableKey]] = {}
            for k in self._entries:
                groups.setdefault(k.shape, []).append(k)
            self._index = {}
            for s, keys in groups.items():
                keys.sort(key=lambda k: k.m_lo)
                self._index[s] = ([k.m_lo for k in keys], keys)
        found = self._index.get(shape)
        if found is None:
            return None
        los, keys = found
        i = bisect.bisect_right(los, m) - 1
        if i < 0 or not keys[i].covers(m):
            return None
        return keys[i], self._entries[keys[i]]

    def covering(self, key: TableKey) -> list[TableKey]:
        """The keys of ``key``'s shape whose ranges overlap ``key``'s, lowest first."""
        return sorted((k for k in self._entries if k.shape == key.shape and _overlap(k, key)),
                      key=lambda k: k.m_lo)

    # ---- library versions
    def tuned_triton(self, key: TableKey) -> str | None:
        """The Triton version the entry at ``key`` was tuned under (Triton entries; else None)."""
        entry = self._entries[key]
        if not is_triton_backend(entry["backend"]):
            return None
        return entry.get("triton_version") or _triton_of(self.signature) or "unknown"

    def entry_status(self, key: TableKey, running: Mapping | None = None) -> tuple[str, str]:
        """How the entry at ``key`` may run under the library versions of ``running`` (default:
        this table's signature, which a table loaded for a device carries): ``(USE, "")``,
        ``(PROBE, reason)`` — a Triton config tuned under another Triton: run it only once
        :func:`~hybridgemm.autotune_cache.probe.probe_entry` passed — or ``(FLINEAR, reason)``:
        run F.linear for this entry (a cuBLASLt record of another cuBLASLt, or a backend this
        process lacks). KeyError for a key not in the table."""
        entry = self._entries[key]
        running = self.signature if running is None else running
        if running is None:
            return USE, ""
        return entry_verdict(entry["backend"], entry["config"], self.tuned_triton(key), running)

    @property
    def foreign_triton(self) -> bool:
        """Whether some entry is a Triton config tuned under another Triton than this table's
        signature names (its :meth:`entry_status` is ``PROBE``)."""
        if self._foreign_triton is None:
            self._foreign_triton = (self.signature is not None and _triton_of(self.signature) is not None
                                    and any("triton_version" in e for e in self._entries.values()))
        return self._foreign_triton

    def version_effects(self, running: Mapping | None = None) -> list[VersionEffect]:
        """The entries whose :meth:`entry_status` under ``running`` (default: this table's
        signature) is not ``USE``, grouped by library and the version they were tuned under."""
        running = self.signature if running is None else running
        if running is None:
            return []
        counts: dict[tuple[str, str, str | None, str], int] = {}
        lt_now, triton_now = running.get("cublaslt_version"), running.get("triton_version")
        ours = _triton_of(self.signature)
        for key, entry in self._entries.items():
            backend, config = entry["backend"], entry["config"]
            # the common cases first, without entry_status: a table may hold 10^5 entries
            if backend == "torch" or (backend == "cublaslt" and lt_now is not None
                                      and (not config or config.get("cublaslt_version") == lt_now)):
                continue
            if (triton_now is not None and is_triton_backend(backend)
                    and (entry.get("triton_version") or ours) == triton_now):
                continue
            status, _ = self.entry_status(key, running)
            if status == USE:
                continue
            if backend == "cublaslt":
                library, now, tuned = "cuBLASLt", lt_now, config.get("cublaslt_version") if config else None
            else:
                library, now, tuned = "Triton", triton_now, self.tuned_triton(key)
            group = (library, "" if now is None else str(tuned), None if now is None else str(now), status)
            counts[group] = counts.get(group, 0) + 1
        return [VersionEffect(*group, count) for group, count in sorted(counts.items(), key=repr)]

    # ---- writing
    def set(self, key: TableKey, entry: Mapping) -> None:
        """Store a validated copy of ``entry`` (dropping entries whose range it overlaps);
        it wins over disk on the next save."""
        if not isinstance(key, TableKey):
            raise TypeError(f"key must be a TableKey, got {type(key).__name__}")
        self._entries = _overlay(self._entries, {key: self._native(normalize_entry(entry, key))})
        self._dirty = {k for k in self._dirty if k in self._entries} | {key}
        self._index = None
        self._foreign_triton = None

    def update(self, other: TuningTable) -> None:
        """Merge ``other``'s entries over ours (used to layer tables; not marked dirty). Its
        Triton entries keep the Triton they were tuned under (``triton_version``)."""
        theirs = other._entries
        if (self.signature is not None and other.signature is not None
                and _triton_of(other.signature) != _triton_of(self.signature)):
            theirs = _rebase(dict(theirs), other.signature, self.signature)
        self._entries = _overlay(self._entries, theirs)
        self._dirty &= set(self._entries)
        self.sources.extend(other.sources)
        self._index = None
        self._foreign_triton = None

    def dumps(self) -> str:
        if self.signature is None:
            raise ValueError("a tuning table needs a device signature to be serialised")
        return dump_document(self.signature, self._entries)

    def save(self, path: os.PathLike | str) -> None:
        """Merge with the table on disk under a cross-process lock, then replace it
        atomically. Our session's entries win (and drop disk entries whose ranges they
        overlap); entries only on disk are kept; a disk table for another signature, or a
        corrupt or oversized one, is replaced (with a warning). One that cannot be read, or
        is not a regular file (a FIFO, a device, a directory), is neither read nor replaced:
        the save raises :class:`TableWriteError`. Stale temp files of killed writers are
        removed first (module docstring). Save a table loaded from ``path``
        itself, not a :func:`load_tables` view: a view's entries (shipped ones included)
        would all be copied into ``path``."""

        if self.signature is None:
            raise ValueError("a tuning table needs a device signature to be saved")
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(os.fspath(path) + ".lock", timeout=LOCK_TIMEOUT_S):
                _remove_stale_temps(path)
                merged = _overlay(dict(self._entries), self._read_for_merge(path))
                merged = _overlay(merged, {k: self._entries[k] for k in self._dirty})
                text = dump_document(self.signature, merged)
                _atomic_write(path, text)
        except Timeout:
            msg = f"lock {path}.lock not acquired within {LOCK_TIMEOUT_S:.0f} s"
            raise TableWriteError(path, msg) from None
        except TableWriteError:
            raise
        except OSError as e:
            raise TableWriteError(path, e) from e
        self._entries = merged
        self._index = None
        self._foreign_triton = None

    def _read_for_merge(self, path: Path) -> dict[TableKey, dict]:
        """The entries on disk to merge with. A file that cannot be read, or is not a
        regular file, is not replaced: the save fails (``TableWriteError``) rather than
        overwrite entries it could not see. A corrupt or oversized one is replaced."""
        try:
            data = _read_table_bytes(path)
            if data is None:
                return {}
            parsed = parse_document(data)
        except _Unreadable as e:
            raise TableWriteError(path, e) from None
        except TableError as e:
            _warn_once(path, f"{e}; replacing it", kind="save")
            return {}
        ok, reason = signature_matches(parsed.signature, self.signature)
        if not ok:
            _warn_once(path, f"replacing a table tuned elsewhere ({reason})", kind="save")
            return {}
        return _rebase(parsed.entries, parsed.signature, self.signature)


def _remove_stale_temps(path: Path) -> None:
    """Remove the temp files killed writers of ``path`` left (module docstring). Best effort:
    never raises."""
    try:
        pattern = re.compile(re.escape(f".{path.name}.") + r"[A-Za-z0-9_]+\.tmp")
        cutoff = time.time() - STALE_TEMP_S
        with os.scandir(path.parent) as it:
            for item in it:
                if not pattern.fullmatch(item.name):
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                        os.unlink(item.path)  # unlink removes a name; it never follows a link
                except OSError:
                    continue
    except Exception as e:
        _log.debug("cleaning stale temp files next to %s: %s", path, e)


def _atomic_write(path: Path, text: str) -> None:
    # The temp file is named ".{name}.<random>.tmp" (mkstemp's random part is [a-z0-9_]):
    # _remove_stale_temps relies on it.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a table is not a secret
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------- locations


def shipped_table_dir() -> Path:
    return Path(__file__).resolve().parent / "tables"


def shipped_table_paths(directory: os.PathLike | str | None = None) -> list[Path]:
    """The shipped tables, sorted by file name."""
    d = Path(directory) if directory is not None else shipped_table_dir()
    return sorted(d.glob("*.json")) if d.is_dir() else []


def device_slug(name: str) -> str:
    """A GPU name as shipped tables are named: lowercase words joined by ``-``, without the
    vendor (``"NVIDIA H200"`` → ``"h200"``, ``"NVIDIA H100 80GB HBM3"`` → ``"h100-80gb-hbm3"``)."""
    words = re.findall(r"[a-z0-9]+", name.lower()) if isinstance(name, str) else []
    return "-".join(w for w in words if w != "nvidia")


def shipped_devices(directory: os.PathLike | str | None = None) -> dict[str, tuple[Path, str]]:
    """The GPU models shipped tables are for: the table's file-name stem (``h200``) → (its
    path, the GPU name its signature records; ``""`` for a table that cannot be read, which
    its file name still names, so that loading it can say what is wrong)."""
    found = {}
    for path in shipped_table_paths(directory):
        gpu = ""
        try:
            data = _read_table_bytes(path)
            if data is not None:
                gpu = parse_document(data).signature.get("gpu_name", "")
        except TableError as e:
            _log.debug("shipped table %s: no GPU name (%s)", path, e)
        found[path.stem] = (path, gpu if isinstance(gpu, str) else "")
    return found


def shipped_table_for_device(name: str, directory: os.PathLike | str | None = None) -> Path | None:
    """The shipped table for the GPU model ``name``, matched case-insensitively on the table's
    file name (``h200``) or on the GPU name its signature records (``"NVIDIA H200"``,
    ``nvidia-h200``), or ``None``."""
    slug = device_slug(name)
    if not slug:
        return None
    for stem, (path, gpu) in shipped_devices(directory).items():
        if slug in (device_slug(stem), device_slug(gpu)):
            return path
    return None


def user_table_path() -> Path:
    """``$HYBRIDGEMM_CACHE_DIR/table.json`` if set, else the platform's user cache dir."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser() / "table.json"

    return Path(platformdirs.user_cache_dir("hybridgemm")) / "table.json"


def load_tables(signature: dict | None, explicit_path: os.PathLike | str | None = None,
                *, shipped_dir: os.PathLike | str | None = None) -> TuningTable:
    """The merged view: explicit > user > shipped (see the module docstring).

    ``signature`` is the running device's (:func:`.signature.current_signature`). With
    ``None`` (no device, or tooling that wants to inspect tables), shipped tables are
    skipped — there is no device to pick one for — and the user/explicit tables are read
    without a signature check."""
    merged = TuningTable(signature)
    for path in shipped_table_paths(shipped_dir):
        if signature is None:
            _log.debug("skipping shipped table %s: no device signature to match", path)
            continue
        try:  # read once: the signature check and the entries come from the same bytes
            data = _read_table_bytes(path)
            if data is None:
                continue  # removed since the directory was listed
            parsed = parse_document(data)
        except TableError as e:
            _warn_once(path, f"shipped table is unusable ({e}); ignoring it")
            continue
        ok, reason = signature_matches(parsed.signature, signature)
        if not ok:
            _log.debug("skipping shipped table %s: %s", path, reason)
            continue
        merged.update(_warn_versions(path, TuningTable._from_parsed(path, parsed, signature, strict=False)))
    try:
        user = user_table_path()
    except Exception as e:  # e.g. "~nosuchuser" in HYBRIDGEMM_CACHE_DIR
        _warn_once(Path(os.environ.get(CACHE_DIR_ENV, "")), f"cannot locate the user table ({e}); ignoring it")
    else:
        merged.update(_warn_versions(user, TuningTable._load(user, signature, strict=False)))
    if explicit_path is not None:
        path = Path(explicit_path)
        merged.update(_warn_versions(path, TuningTable._load(path, signature, strict=False,
                                                             missing="does not exist; ignoring it")))
    return merged


def _warn_versions(path: Path, table: TuningTable) -> TuningTable:
    """One warning per table (per process) whose entries other library versions affect
    (:meth:`TuningTable.version_effects`), saying how many and what they run now. A library
    missing from this process is not repeated here: the backend warning says it."""
    effects = [e for e in table.version_effects() if e.running is not None]
    if effects:
        _warn_once(path, "; ".join(e.describe() for e in effects)
                   + "; run `hybridgemm autotune` (the same --model or --shape) to re-tune them", kind="versions")
    return table
