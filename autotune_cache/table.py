"""The persisted, deterministic tuning table: lookup, load/save, and the merged view of every table.

A :class:`TuningTable` holds entries by key (:mod:`.keys`: what a key and a layout class
are), with the device signature they were tuned on. Its parts live in their own modules, and
every name callers use is importable from here: one entry (its fields, validation, schema-1
migration) in :mod:`.table_entries`; the document and how a file is read, parsed and
written in :mod:`.table_document`; where tables live in :mod:`.table_locations`; the
signature rules in :mod:`.signature`.

**Lookup.** :meth:`TuningTable.find` returns the entry whose range holds the call's M, for
the same op, dtype, epilogue, N, K and layout, or nothing: an entry is never used outside
the range it was validated on. Ranges of one shape never overlap: storing or merging an
entry drops the entries whose ranges it overlaps (the newer or higher-precedence one wins).

**Library versions.** A table applies to a device when the device fields of its signature
match; cuBLASLt and Triton versions are judged per entry (:mod:`.signature`,
:meth:`TuningTable.entry_status`): a pinned cuBLASLt record of another cuBLASLt runs F.linear,
a Triton config tuned under another Triton is probed once before use. :func:`load_tables`
says so once per table (one :class:`HybridGemmTableWarning`), with how many entries it affects.

**Precedence** (:func:`load_tables` merges key by key, higher wins; where each table lives is
:mod:`.table_locations`):

1. an explicit path (argument) — a missing or foreign file warns once;
2. the user table (:func:`user_table_path`) — a foreign or corrupt one warns once, a missing
   one is silent;
3. shipped tables (:func:`shipped_table_paths`). Tables for other GPUs are expected there, so
   one whose signature does not match is skipped quietly (debug log); a corrupt shipped table
   warns. Matching shipped tables merge in file-name order.

A bad table never raises on load (unless ``strict=True``): it is ignored with exactly one
:class:`HybridGemmTableWarning` per path per process. :meth:`TuningTable.save` writes
atomically (temp file in the same directory + ``os.replace``) under a cross-process
``filelock``, merging with what is on disk: entries set on this table win, entries only
on disk are kept unless a new entry's range overlaps them; stale temp files of killed
writers are removed first (:mod:`.table_document`). Failure to write raises
:class:`TableWriteError` (an ``OSError``).

Each call reads each file once; nothing here caches a result: the caller (the dispatcher's
``table_for_device``) keeps the loaded table, and :func:`load_tables` never raises on a bad
file, so a bad table is read once per load, not once per call.
"""

from __future__ import annotations

import bisect
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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
from .signature import FLINEAR, USE, entry_verdict, is_triton_backend, signature_matches
from .table_document import (  # noqa: F401 (re-exported)
    MAX_TABLE_BYTES,
    MAX_TABLE_ENTRIES,
    STALE_TEMP_S,
    HybridGemmTableWarning,
    ParsedTable,
    _atomic_write,
    _failure,
    _file_kind,
    _log,
    _read_table_bytes,
    _remove_stale_temps,
    _shape_of,
    _Unreadable,
    _warn_once,
    dump_document,
    parse_document,
)
from .table_entries import (  # noqa: F401 (re-exported)
    MAX_RATIO,
    MAX_US,
    MAX_VERSION_CHARS,
    SIGNIFICANT_DIGITS,
    V1_MIN_RATIO,
    _rebase,
    _rebased,
    _triton_of,
    make_entry,
    normalize_entry,
)
from .table_locations import (  # noqa: F401 (re-exported)
    CACHE_DIR_ENV,
    device_slug,
    shipped_devices,
    shipped_table_dir,
    shipped_table_for_device,
    shipped_table_paths,
    user_table_path,
)

LOCK_TIMEOUT_S = 120.0


class TableWriteError(OSError):
    """A table could not be written; ``.filename`` is the table's path. ``advice`` says what
    to do about it; by default, where to write instead (the cause is usually a directory this
    process cannot write)."""

    def __init__(self, path: os.PathLike | str, reason: object, advice: str | None = None):
        if advice is None:
            advice = f"set {CACHE_DIR_ENV} to a writable directory, or pass another path"
        self.message = f"cannot write tuning table {os.fspath(path)}: {reason} ({advice})"
        # Keep the cause's errno so callers can still tell EACCES from EROFS from ENOSPC.
        super().__init__(getattr(reason, "errno", None), self.message, os.fspath(path))

    def __str__(self) -> str:
        return self.message


def _overlap(a: TableKey, b: TableKey) -> bool:
    return a.m_lo <= b.m_hi and b.m_lo <= a.m_hi


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
    def tuned_triton(self, key: TableKey, backend: str | None = None) -> str | None:
        """The Triton version the entry at ``key`` was tuned under (Triton entries; else None).
        ``backend``: for one of the entry's candidates of that backend instead (timed in the
        same run as its winner)."""
        entry = self._entries[key]
        if not is_triton_backend(backend or entry["backend"]):
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
        removed first (:mod:`.table_document`). Save a table loaded from ``path``
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
            # Another location would not help: the directory is writable, a writer is busy.
            lock = f"{path}.lock"
            raise TableWriteError(path, f"lock {lock} not acquired within {LOCK_TIMEOUT_S:.0f} s",
                                  "another process holds it, such as another `hybridgemm autotune` saving to this "
                                  f"table: retry when it has finished, or remove {lock} if no such process "
                                  "is running") from None
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


# --------------------------------------------------------------------------- the merged view


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
