"""One entry of a tuning table: what it holds, how it is validated, and how a schema-1 entry is read.

An entry comes from a file anyone may have written, so every field is checked here, by type
and range, before anything uses it: :func:`normalize_entry` returns the entry's canonical
form (a fresh JSON-safe copy, numbers rounded) or raises :class:`TableError` naming the first
problem. How the document around the entries is read is :mod:`.table_document`'s part.

**Entry.** The winner (``backend``, ``config``: a backend's record, an object whose values
are JSON scalars or lists of scalars; ``{}`` for cuBLASLt means its heuristic asked at the
exact M of each call, and backend ``torch`` means F.linear itself), the M values it was
timed at (``m_points``, both edges of the range among them), its speed ratio to F.linear at
each (``ratios``: F.linear time / its time, > 1 is faster), ``worst_ratio`` (their minimum),
``median_us``/``spread_us``/``flinear_us`` at the top point, the runner-up candidates, and
``tuned_at``. A Triton entry tuned under another Triton than the one in the table's signature
says which in ``triton_version`` (absent otherwise): a table merged or re-saved after a
Triton upgrade keeps, entry by entry, what each config was tuned under.

**Schema 1** tables (one entry per power-of-two M bucket, timed at that M alone) are read
with one warning: an entry is kept only for the one M it was timed at, and only when it
recorded a ratio to F.linear of at least ``V1_MIN_RATIO``.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from .keys import _NAME_RE, M_MAX, TableError, TableKey
from .signature import is_triton_backend

SIGNIFICANT_DIGITS = 4
V1_MIN_RATIO = 0.97  # a schema-1 entry is kept (at its one M) only if it was at least this fast
MAX_US = 1e9  # a timing above this (over 16 minutes per call) is not a timing
MAX_RATIO = 1e3
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
