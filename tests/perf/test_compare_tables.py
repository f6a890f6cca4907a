"""perf/compare_tables.py: agreement between two tuning runs, and near-ties judged by each
run's own timing of the other's choice."""

from __future__ import annotations

import json
from importlib import resources

from hybridgemm.autotune_cache import tables
from hybridgemm.autotune_cache.keys import TableKey, sample_points
from hybridgemm.autotune_cache.table import TuningTable, make_entry
from hybridgemm.perf import compare_tables as ct

# The shipped H200 table's device signature: these tables are saved, never used on a device.
SIGNATURE = json.loads((resources.files(tables) / "h200.json").read_text())["signature"]
SK_A = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 256, "split_k": 2, "num_warps": 4,
        "num_stages": 3, "fused_reduce": True}
SK_B = {**SK_A, "block_k": 128, "num_stages": 6}
SK_C = {**SK_A, "split_k": 8, "block_n": 16}


def _key(lo, hi, n=4096):
    return TableKey("linear", "bf16", "none", n, 4096, lo, hi, "c")


def _entry(config, score, others, lo=1, hi=1):
    cands = [{"backend": "triton_splitk", "config": config, "median_us": 10.0, "spread_us": 0.1,
              "worst_ratio": score}]
    cands += [{"backend": "triton_splitk", "config": c, "median_us": 10.0, "spread_us": 0.1, "worst_ratio": s}
              for c, s in others]
    points = sample_points(lo, hi)
    return make_entry("triton_splitk", config, m_points=points, ratios=[score] * len(points), median_us=10.0,
                      spread_us=0.1, candidates=cands, flinear_us=12.0)


def _save(tmp_path, name, entries):
    t = TuningTable(signature=SIGNATURE)
    for k, e in entries.items():
        t.set(k, e)
    path = tmp_path / name
    t.save(path)
    return str(path)


def test_agreement_near_ties_and_far_disagreements(tmp_path, capsys):
    a = _save(tmp_path, "a.json", {
        _key(1, 1): _entry(SK_A, 1.25, [(SK_B, 1.26)]),        # B chose SK_B: A timed it +0.8%
        _key(2, 2): _entry(SK_A, 1.25, [(SK_B, 1.10)], 2, 2),        # B chose SK_B: A timed it -12%
        _key(3, 4): _entry(SK_A, 1.20, [], 3, 4),                    # same choice
        _key(5, 8): _entry(SK_A, 1.20, [], 5, 8),                    # B's choice not among A's candidates
    })
    b = _save(tmp_path, "b.json", {
        _key(1, 1): _entry(SK_B, 1.24, [(SK_A, 1.23)]),
        _key(2, 2): _entry(SK_B, 1.24, [(SK_A, 1.22)], 2, 2),
        _key(3, 4): _entry(SK_A, 1.21, [], 3, 4),
        _key(5, 8): _entry(SK_C, 1.30, [(SK_A, 1.28)], 5, 8),
    })
    r = ct.compare_tables(a, b)
    assert (r["ranges"], r["same"], r["near_ties"]) == (4, 1, 1)
    by_key = {d[0]: d for d in r["differ"]}
    one = by_key[_key(1, 1).to_string()]
    assert abs(one[3] - 1.26 / 1.25) < 1e-9 and abs(one[4] - 1.23 / 1.24) < 1e-9
    assert abs(by_key[_key(2, 2).to_string()][3] - 1.10 / 1.25) < 1e-9
    assert by_key[_key(5, 8).to_string()][3] is None
    assert ct.main([a, b]) == 0
    out = capsys.readouterr().out
    assert out.startswith("same choice on 1/4 ranges (25.0%); 1 of the other 3 are near-ties")
    assert "same or near-tie on 50.0%" in out and "-12.0%" in out


def test_split_ranges_have_no_cross_score(tmp_path):
    a = _save(tmp_path, "a.json", {_key(17, 32): _entry(SK_A, 1.2, [(SK_B, 1.2)], 17, 32)})
    b = _save(tmp_path, "b.json", {_key(17, 23): _entry(SK_B, 1.2, [], 17, 23),
                                   _key(24, 32): _entry(SK_A, 1.2, [], 24, 32)})
    r = ct.compare_tables(a, b)
    assert (r["ranges"], r["same"], r["near_ties"]) == (1, 0, 0)
    assert r["differ"][0][3] is None and r["differ"][0][4] is None


def test_unreadable_table_is_an_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert ct.main([str(bad), str(bad)]) == 2
    assert capsys.readouterr().err.startswith("compare_tables: ")
