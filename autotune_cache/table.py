"""The persisted, deterministic tuning table: keys, entries, load/save, and where tables live.

**Document.** ``{"schema": 1, "signature": {...}, "entries": {key: entry}}``, JSON only
(``json.loads`` and strict type checks: a table is data and can never run code).
Written canonically: ``json.dumps(sort_keys=True, indent=1)`` plus a newline, timings
rounded to 4 significant digits, so re-tuning diffs cleanly and save → load → save is
byte-identical. The signature rules are in :mod:`.signature`.

**Key.** ``op|dtype|epilogue|N=..|K=..|M=..|layout``, e.g.
``linear|bf16|bias|N=6144|K=4096|M=16|c``. ``dtype`` is ``bf16``, ``fp16``, ``fp32``, or
``tf32`` (fp32 inputs with TF32 allowed: a different race from exact fp32). ``epilogue`` is
``Epilogue.name``. ``M`` is the bucket: powers of two 1..16384, a runtime M uses the
smallest bucket ≥ M, past 16384 the last bucket.

**Layout class** (:func:`layout_class`): ``a`` = the largest power of two, capped at 16
bytes, dividing every pointer (x, W, out, bias) and every row stride in bytes. 16 bytes
is what TMA and 128-bit vector loads need, so nothing above it matters.

- ``c``: dense rows (``ldx == K``, ``ldw == K``, ``ldo == N``) and ``a == 16``: the usual case;
- ``a1``/``a2``/``a4``/``a8``: dense rows, weaker alignment (odd K or N, offset views);
- ``s16``, ``s8``, ...: strided rows (some leading dimension exceeds its width, e.g. a
  slice of a fused QKV output), with alignment ``a``.

**Lookup and the miss rule.** :meth:`TuningTable.lookup` is a pure dictionary read.
:meth:`TuningTable.nearest` keeps everything but the M bucket and returns the tuned bucket
nearest in log2 distance (buckets are powers of two, so 8 is as far from 16 as 32 is);
ties go to the smaller bucket: the runtime M is at most its bucket, so in log2 terms it
is at least as close to the smaller one. Nothing is timed.

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
``filelock``, merging with what is on disk: entries set in this session win, entries only
on disk are kept. Failure to write raises :class:`TableWriteError` (an ``OSError``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import types
import warnings
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .keys import _NAME_RE, DTYPES, M_BUCKETS, TableError, TableKey, layout_class, m_bucket  # noqa: F401 (re-exported)
from .signature import signature_matches, validate_signature

SCHEMA_VERSION = 1
SIGNIFICANT_DIGITS = 4
CACHE_DIR_ENV = "HYBRIDGEMM_CACHE_DIR"
LOCK_TIMEOUT_S = 120.0

_log = logging.getLogger(__name__)
_ENTRY_FIELDS = {"backend", "config", "candidates", "median_us", "spread_us", "tuned_at"}
_CANDIDATE_FIELDS = {"backend", "config", "median_us", "spread_us"}


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


def _time(obj: Mapping, field: str, where: str) -> float:
    v = obj.get(field)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise TableError(f"{where}{field} must be a finite number ≥ 0, got {v!r}")
    return _round(float(v))


def _record(obj: Mapping, where: str) -> tuple[str, dict]:
    backend, config = obj.get("backend"), obj.get("config")
    if not isinstance(backend, str) or not _NAME_RE.match(backend):
        raise TableError(f"{where}backend must be a lowercase name, got {backend!r}")
    if not isinstance(config, dict):
        raise TableError(f"{where}config must be an object, got {type(config).__name__}")
    return backend, config


def normalize_entry(entry: Any) -> dict:
    """Validate ``entry`` and return its canonical form (a fresh, JSON-safe deep copy with
    rounded timings). Raises :class:`TableError` naming the first problem."""
    try:  # JSON round trip: a deep copy, tuples -> lists, and proof that it serialises
        entry = json.loads(json.dumps(entry, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TableError(f"entry is not JSON data: {e}") from None
    if not isinstance(entry, dict):
        raise TableError(f"entry must be an object, got {type(entry).__name__}")
    if entry.get("flinear_us", 0) is None:
        del entry["flinear_us"]  # optional: absent and null mean the same; store absent
    fields = set(entry)
    if not _ENTRY_FIELDS <= fields <= _ENTRY_FIELDS | {"flinear_us"}:
        missing, extra = _ENTRY_FIELDS - fields, fields - _ENTRY_FIELDS - {"flinear_us"}
        raise TableError(f"entry fields: missing {sorted(missing)}, unknown {sorted(extra)}")
    backend, config = _record(entry, "")
    out: dict[str, Any] = {
        "backend": backend, "config": config,
        "median_us": _time(entry, "median_us", ""), "spread_us": _time(entry, "spread_us", ""),
    }
    if "flinear_us" in entry:
        out["flinear_us"] = _time(entry, "flinear_us", "")
    tuned_at = entry["tuned_at"]
    if not isinstance(tuned_at, str):
        raise TableError(f"tuned_at must be an ISO date string, got {tuned_at!r}")
    try:
        datetime.fromisoformat(tuned_at.replace("Z", "+00:00"))
    except ValueError:
        raise TableError(f"tuned_at is not an ISO date: {tuned_at!r}") from None
    out["tuned_at"] = tuned_at
    candidates = entry["candidates"]
    if not isinstance(candidates, list):
        raise TableError("candidates must be a list")
    out["candidates"] = []
    for i, c in enumerate(candidates):  # order is the ranking (best first): keep it
        where = f"candidates[{i}]."
        if not isinstance(c, dict) or set(c) != _CANDIDATE_FIELDS:
            raise TableError(f"{where[:-1]} must be an object with {sorted(_CANDIDATE_FIELDS)}")
        b, cfg = _record(c, where)
        out["candidates"].append({"backend": b, "config": cfg,
                                  "median_us": _time(c, "median_us", where),
                                  "spread_us": _time(c, "spread_us", where)})
    return out


def make_entry(backend: str, config: Mapping, *, median_us: float, spread_us: float,
               candidates: Iterable[Mapping] = (), flinear_us: float | None = None,
               tuned_at: str | None = None) -> dict:
    """Build a canonical entry; ``tuned_at`` defaults to today's UTC date."""
    return normalize_entry({
        "backend": backend, "config": dict(config), "median_us": median_us,
        "spread_us": spread_us, "candidates": [dict(c) for c in candidates],
        "flinear_us": flinear_us,
        "tuned_at": tuned_at or datetime.now(timezone.utc).date().isoformat(),
    })


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


def parse_document(data: bytes) -> tuple[dict, dict[TableKey, dict], list[str]]:
    """Parse table bytes into ``(signature, entries, dropped)``; ``dropped`` describes
    entries that failed validation. Raises :class:`TableError` if the document is unusable."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise TableError("not UTF-8 text") from None
    except (ValueError, RecursionError) as e:
        raise TableError(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise TableError(f"top level is {type(doc).__name__}, not an object")
    schema = doc.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise TableError(f"schema version {schema!r}; this hybridgemm reads {SCHEMA_VERSION}")
    if set(doc) != {"schema", "signature", "entries"}:
        raise TableError(f"top-level fields {sorted(doc)}; expected entries, schema, signature")
    reason = validate_signature(doc["signature"])
    if reason:
        raise TableError(reason)
    if not isinstance(doc["entries"], dict):
        raise TableError("entries is not an object")
    entries, dropped = {}, []
    for text, value in doc["entries"].items():
        try:
            key = TableKey.from_string(text)
            if key.to_string() != text:
                raise TableError("key is not in canonical form")
            entries[key] = normalize_entry(value)
        except TableError as e:
            dropped.append(f"{text!r}: {e}")
    return doc["signature"], entries, dropped


def dump_document(signature: Mapping, entries: Mapping[TableKey, dict]) -> str:
    """Canonical text of a table document."""
    doc = {"schema": SCHEMA_VERSION, "signature": dict(signature),
           "entries": {k.to_string(): v for k, v in entries.items()}}
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n"


# --------------------------------------------------------------------------- the table


class TuningTable:
    """Entries keyed by :class:`TableKey`, with the device signature they were tuned on."""

    def __init__(self, signature: dict | None = None,
                 entries: Mapping[TableKey, dict] | None = None):
        self.signature = dict(signature) if signature is not None else None
        self._entries: dict[TableKey, dict] = {}
        self._dirty: set[TableKey] = set()  # keys set in this session: they win on save
        self._index: dict[tuple, list[int]] | None = None
        self.sources: list[Path] = []  # files this table's entries came from
        for key, entry in (entries or {}).items():
            if not isinstance(key, TableKey):
                raise TypeError(f"keys must be TableKey, got {type(key).__name__}")
            self._entries[key] = normalize_entry(entry)

    # ---- reading
    @classmethod
    def load(cls, path: os.PathLike | str, signature: dict | None = None,
             strict: bool = False) -> TuningTable:
        """Load one table. A missing file gives an empty table, silently. A bad file
        (unreadable, not JSON, wrong types or schema, or — when ``signature`` is given —
        tuned on another device) gives an empty table and one warning per path per process,
        or raises :class:`TableError` when ``strict``. Invalid entries alone are dropped.
        With ``signature``, the loaded table carries it (it is now this device's table);
        without, the file's own signature."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(signature)
        except OSError as e:
            return cls._reject(path, f"cannot be read ({e})", signature, strict)
        try:
            file_sig, entries, dropped = parse_document(data)
        except TableError as e:
            return cls._reject(path, str(e), signature, strict)
        if signature is not None:
            ok, reason = signature_matches(file_sig, signature)
            if not ok:
                return cls._reject(path, f"tuned for another device or version: {reason}",
                                   signature, strict)
        if dropped:
            msg = f"dropped {len(dropped)} invalid entr{'y' if len(dropped) == 1 else 'ies'}"
            if strict:
                raise TableError(f"{path}: {msg}: {dropped[0]}")
            _warn_once(path, f"{msg} (first: {dropped[0]})")
        table = cls(signature if signature is not None else file_sig)
        table._entries = entries
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
        """The entry for exactly ``key``, or ``None``. Pure; do not mutate the result."""
        return self._entries.get(key)

    def nearest(self, key: TableKey) -> tuple[TableKey, dict] | None:
        """The entry with the same op, dtype, epilogue, N, K and layout whose M bucket is
        nearest to ``key.m_bucket`` in log2 distance (ties: the smaller bucket); ``None``
        if no bucket of that shape is tuned. An exact hit is its own nearest."""
        if self._index is None:
            index: dict[tuple, list[int]] = {}
            for k in self._entries:
                index.setdefault(_shape_of(k), []).append(k.m_bucket)
            self._index = {s: sorted(b) for s, b in index.items()}
        buckets = self._index.get(_shape_of(key))
        if not buckets:
            return None
        target = key.m_bucket.bit_length()
        best = min(buckets, key=lambda b: (abs(b.bit_length() - target), b))
        found = key.with_bucket(best)
        return found, self._entries[found]

    # ---- writing
    def set(self, key: TableKey, entry: Mapping) -> None:
        """Store a validated copy of ``entry``; it wins over disk on the next save."""
        if not isinstance(key, TableKey):
            raise TypeError(f"key must be a TableKey, got {type(key).__name__}")
        self._entries[key] = normalize_entry(entry)
        self._dirty.add(key)
        self._index = None

    def update(self, other: TuningTable) -> None:
        """Merge ``other``'s entries over ours (used to layer tables; not marked dirty)."""
        self._entries.update(other._entries)
        self.sources.extend(other.sources)
        self._index = None

    def dumps(self) -> str:
        if self.signature is None:
            raise ValueError("a tuning table needs a device signature to be serialised")
        return dump_document(self.signature, self._entries)

    def save(self, path: os.PathLike | str) -> None:
        """Merge with the table on disk under a cross-process lock, then replace it
        atomically. Our session's entries win; entries only on disk are kept; a disk table
        for another signature, or an unreadable one, is replaced (with a warning).
        Save a table loaded from ``path`` itself, not a :func:`load_tables` view: a view's
        entries (shipped ones included) would all be copied into ``path``."""
        from filelock import FileLock, Timeout

        if self.signature is None:
            raise ValueError("a tuning table needs a device signature to be saved")
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(os.fspath(path) + ".lock", timeout=LOCK_TIMEOUT_S):
                merged = dict(self._entries)
                merged.update(self._read_for_merge(path))
                merged.update({k: self._entries[k] for k in self._dirty})
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

    def _read_for_merge(self, path: Path) -> dict[TableKey, dict]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            disk_sig, entries, _dropped = parse_document(data)
        except TableError as e:
            _warn_once(path, f"{e}; replacing it", kind="save")
            return {}
        ok, reason = signature_matches(disk_sig, self.signature)
        if not ok:
            _warn_once(path, f"replacing a table tuned elsewhere ({reason})", kind="save")
            return {}
        return entries


def _shape_of(key: TableKey) -> tuple:
    return (key.op, key.dtype, key.epilogue, key.n, key.k, key.layout)


def _atomic_write(path: Path, text: str) -> None:
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


def user_table_path() -> Path:
    """``$HYBRIDGEMM_CACHE_DIR/table.json`` if set, else the platform's user cache dir."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser() / "table.json"
    import platformdirs

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
        try:
            file_sig, _, _ = parse_document(path.read_bytes())
        except (OSError, TableError) as e:
            _warn_once(path, f"shipped table is unusable ({e}); ignoring it")
            continue
        ok, reason = signature_matches(file_sig, signature)
        if not ok:
            _log.debug("skipping shipped table %s: %s", path, reason)
            continue
        merged.update(TuningTable.load(path, signature))
    merged.update(TuningTable.load(user_table_path(), signature))
    if explicit_path is not None:
        explicit_path = Path(explicit_path)
        if not explicit_path.exists():
            _warn_once(explicit_path, "does not exist; ignoring it")
        else:
            merged.update(TuningTable.load(explicit_path, signature))
    return merged
