"""How often two tuning runs made the same choice.

    python -m hybridgemm.perf.compare_tables A.json B.json

Per default-grid range (``1, 2, 3-4, ..., 8193-16384``) of every shape both tables cover,
the runs agree when the entries covering it are the same: the same sub-ranges (a range may
have been halved) with the same backend and config each. Where they differ it prints both
choices and each one's recorded worst ratio to F.linear, so the size of a disagreement shows,
and, where each run covers the range with one entry, how the other run's choice scored in
this run's own timing (entries keep their best few candidates): a near-tie is a disagreement
where each run measured the other's choice within ``NEAR_TIE`` of its own.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridgemm.autotune_cache.keys import octave
from hybridgemm.autotune_cache.table import TuningTable

NEAR_TIE = 0.03


def _choices(table, key) -> tuple:
    return tuple((k.m_lo, k.m_hi, table.entries[k]["backend"], repr(sorted(table.entries[k]["config"].items())))
                 for k in table.covering(key))


def _describe(table, key) -> str:
    return "; ".join(f"{k.m_lo}-{k.m_hi} {table.entries[k]['backend']} worst {table.entries[k]['worst_ratio']:.3f}x"
                     for k in table.covering(key))


def _ident(backend: str, config: dict) -> str:
    return backend + json.dumps(config, sort_keys=True)


def cross_score(table, key, other) -> float | None:
    """How ``table``'s own timing scored ``other``'s choice for ``key``, relative to its own
    choice (1.0: the same; 0.97: 3% slower at its worst point), or None where either run
    split the range or ``other``'s choice is not among ``table``'s kept candidates."""
    mine, theirs = table.covering(key), other.covering(key)
    if len(mine) != 1 or len(theirs) != 1:
        return None
    entry, want = table.entries[mine[0]], other.entries[theirs[0]]
    scores = {_ident(c["backend"], c["config"]): c["worst_ratio"] for c in entry.get("candidates", [])}
    scores.setdefault(_ident("torch", {}), 1.0)
    own = scores.get(_ident(entry["backend"], entry["config"]), entry["worst_ratio"])
    got = scores.get(_ident(want["backend"], want["config"]))
    return None if got is None or not own else got / own


def compare_tables(path_a: str, path_b: str) -> dict:
    """``{"ranges": n, "same": n, "near_ties": n, "differ": [(range key, A's choices, B's
    choices, A's score of B's choice, B's score of A's choice)]}``."""

    a, b = TuningTable.load(path_a, strict=True), TuningTable.load(path_b, strict=True)
    octaves = set()
    for k in set(a.entries) | set(b.entries):
        lo_range, hi_range = octave(k.m_lo), octave(k.m_hi)
        octaves |= {k.with_range(*lo_range), k.with_range(*hi_range)}
    keys = sorted((k for k in octaves if a.covering(k) and b.covering(k)), key=lambda k: (k.to_string(), k.m_lo))
    same, near, differ = 0, 0, []
    for k in keys:
        if _choices(a, k) == _choices(b, k):
            same += 1
            continue
        ab, ba = cross_score(a, k, b), cross_score(b, k, a)
        if ab is not None and ba is not None and min(ab, ba) >= 1 - NEAR_TIE:
            near += 1
        differ.append((k.to_string(), _describe(a, k), _describe(b, k), ab, ba))
    return {"ranges": len(keys), "same": same, "near_ties": near, "differ": differ}


def _pct(score: float | None) -> str:
    return "not among its kept candidates, or a split range" if score is None else f"{(score - 1) * 100:+.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args(argv)
    try:
        r = compare_tables(args.a, args.b)
    except (ValueError, OSError) as e:
        print(f"compare_tables: {e}", file=sys.stderr)
        return 2
    n = max(r["ranges"], 1)
    print(f"same choice on {r['same']}/{r['ranges']} ranges ({r['same'] / n:.1%}); "
          f"{r['near_ties']} of the other {len(r['differ'])} are near-ties (each run timed the other's "
          f"choice within {NEAR_TIE:.0%} of its own): same or near-tie on {(r['same'] + r['near_ties']) / n:.1%}")
    for key, da, db, ab, ba in r["differ"]:
        print(f"  {key}\n    A: {da}\n    B: {db}\n    A timed B's choice at {_pct(ab)}; B timed A's at {_pct(ba)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
