"""How often two tuning runs made the same choice.

    python -m hybridgemm.perf.compare_tables A.json B.json

Per default-grid range (``1, 2, 3-4, ..., 8193-16384``) of every shape both tables cover,
the runs agree when the entries covering it are the same: the same sub-ranges (a range may
have been halved) with the same backend and config each. Where they differ it prints both
choices and each one's recorded worst ratio to F.linear, so the size of a disagreement shows.
"""

from __future__ import annotations

import argparse
import sys

from hybridgemm.autotune_cache.keys import octave
from hybridgemm.autotune_cache.table import TuningTable


def _choices(table, key) -> tuple:
    return tuple((k.m_lo, k.m_hi, table.entries[k]["backend"], repr(sorted(table.entries[k]["config"].items())))
                 for k in table.covering(key))


def _describe(table, key) -> str:
    return "; ".join(f"{k.m_lo}-{k.m_hi} {table.entries[k]['backend']} worst {table.entries[k]['worst_ratio']:.3f}x"
                     for k in table.covering(key))


def compare_tables(path_a: str, path_b: str) -> dict:
    """``{"ranges": n, "same": n, "differ": [(range key, A's choices, B's choices)]}``."""

    a, b = TuningTable.load(path_a, strict=True), TuningTable.load(path_b, strict=True)
    octaves = set()
    for k in set(a.entries) | set(b.entries):
        lo_range, hi_range = octave(k.m_lo), octave(k.m_hi)
        octaves |= {k.with_range(*lo_range), k.with_range(*hi_range)}
    keys = sorted((k for k in octaves if a.covering(k) and b.covering(k)), key=lambda k: (k.to_string(), k.m_lo))
    same, differ = 0, []
    for k in keys:
        if _choices(a, k) == _choices(b, k):
            same += 1
        else:
            differ.append((k.to_string(), _describe(a, k), _describe(b, k)))
    return {"ranges": len(keys), "same": same, "differ": differ}


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
    print(f"same choice on {r['same']}/{r['ranges']} ranges ({r['same'] / max(r['ranges'], 1):.1%})")
    for key, da, db in r["differ"]:
        print(f"  {key}\n    A: {da}\n    B: {db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
