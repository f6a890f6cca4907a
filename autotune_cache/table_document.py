"""A tuning table's file: reading its bytes safely, its JSON document, and writing it atomically.

A file at a table's path may hold anything: a table a tuner wrote, one cut short by a crash,
or bytes crafted to hurt whoever reads them. This is where those bytes are met: what leaves
:func:`parse_document` is a :class:`ParsedTable` of validated entries, or a
:class:`TableError`, never another exception. What one entry may hold is
:mod:`.table_entries`' part.

**Document.** ``{"schema": 2, "signature": {...}, "entries": {key: entry}}``, JSON only
(``json.loads`` and strict type checks: a table is data and can never run code).
Written canonically: ``json.dumps(sort_keys=True, indent=1)`` plus a newline, timings
rounded to 4 significant digits, so re-tuning diffs cleanly and save → load → save is
byte-identical. The signature rules are in :mod:`.signature`.

**Reading a file** (every read of a table file goes through one helper, ``_read_table_bytes``):

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

A file found bad is reported once: one :class:`HybridGemmTableWarning` per path (and kind of
report) per process, so a table looked at on every load does not flood the log.

**Writing a file.** ``_atomic_write`` writes the document to a temp file in the table's
directory, flushes it to disk and ``os.replace``-s the table with it: a reader sees the old
document or the new one, whole. The lock around a save and the merge with what is on disk
are :meth:`~.table.TuningTable.save`'s part.

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
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .keys import SCHEMA_VERSION, TableError, TableKey
from .signature import validate_signature
from .table_entries import V1_MIN_RATIO, _brief, _is_text, _json_copy, _migrate_v1_entry, _normalize

MAX_TABLE_BYTES = 16 * 1024 * 1024  # a table file larger than this is rejected unread (module docstring)
# More entries than a 16 MiB file of valid entries can hold (each takes over 160 bytes): a
# document with more is not a table, and is rejected before validating them one by one.
MAX_TABLE_ENTRIES = 1 << 17
STALE_TEMP_S = 60.0  # a temp file of ours older than this (mtime) is a killed writer's

# The tuning table's logger, hybridgemm.autotune_cache.table: the table's modules log under
# that one name, so one name configures (or filters) every message about tables.
_log = logging.getLogger(f"{__package__}.table")


class HybridGemmTableWarning(UserWarning):
    """A tuning table was ignored (in whole or in part)."""


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
    if the document is unusable. A schema-1 document is migrated (:mod:`.table_entries`) and
    its signature re-labelled as this schema."""
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


def _shape_of(k: TableKey) -> tuple:
    # ``k.shape`` as a plain tuple: building a ShapeKey per key is most of the cost of
    # merging tens of thousands of entries.
    return k.op, k.dtype, k.epilogue, k.n, k.k, k.layout


# --------------------------------------------------------------------------- writing


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
            # mkstemp makes 0600; a table is not a secret. Through the descriptor: the name
            # could meanwhile point elsewhere (a symlink put there), whose target chmod would change.
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
