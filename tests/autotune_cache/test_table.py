import json
import multiprocessing
import os
import re
import stat
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from tuning_tables import (
    BAD_FILES,
    HUGE,
    SIG,
    V1_ENTRIES,
    V1_PREFIX,
    V1_SIG,
    entry,
    entry_for,
    filled_table,
    key,
    v1_doc,
    v1_entry,
    valid_text,
)

from hybridgemm.autotune_cache import table as T
from hybridgemm.autotune_cache.keys import M_MAX, ShapeKey, octave, sample_points, split_range
from hybridgemm.autotune_cache.signature import (
    KERNEL_ABI,
    current_signature,
    signature_matches,
    validate_signature,
)
from hybridgemm.autotune_cache.table import (
    HybridGemmTableWarning,
    TableError,
    TableKey,
    TableWriteError,
    TuningTable,
    layout_class,
    load_tables,
    make_entry,
    parse_document,
    shipped_table_paths,
    user_table_path,
)
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

H100 = {**SIG, "gpu_name": "NVIDIA H100 80GB HBM3", "sm_count": 132}
SHAPE = ShapeKey("linear", "bf16", "bias", 6144, 4096, "c")


KEY = key()  # linear|bf16|bias|N=6144|K=4096|M=257-512|c


def table_warnings(records):
    return [w for w in records if issubclass(w.category, HybridGemmTableWarning)]


def ranges(table, shape=SHAPE):
    """{(m_lo, m_hi): median_us} of ``shape``'s entries."""
    return {(k.m_lo, k.m_hi): e["median_us"] for k, e in table.entries.items() if k.shape == shape}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # Never touch the real user cache dir.
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))


# ---------------------------------------------------------------- ranges, keys, layouts


@pytest.mark.parametrize("m, rng", [(1, (1, 1)), (2, (2, 2)), (3, (3, 4)), (4, (3, 4)), (5, (5, 8)),
                                    (256, (129, 256)), (257, (257, 512)), (512, (257, 512)),
                                    (513, (513, 1024)), (1024, (513, 1024)), (1025, (1025, 2048)),
                                    (8193, (8193, 16384)), (16384, (8193, 16384)),
                                    (16385, None), (10**9, None)])
def test_octave_edges(m, rng):
    assert octave(m) == rng


def test_octave_rejects_nonpositive_and_non_ints():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            octave(bad)
    for bad in (1.0, True, "4"):
        with pytest.raises(TypeError):
            octave(bad)
    assert M_MAX == 16384


@pytest.mark.parametrize("lo, hi, pts", [
    (1, 1, [1]), (2, 2, [2]), (3, 4, [3, 4]), (5, 8, [5, 6, 8]),  # sqrt(40) = 6.3
    (9, 16, [9, 12, 16]), (257, 512, [257, 363, 512]),  # sqrt(257 * 512) = 362.7
    (8193, 16384, [8193, 11586, 16384]),  # sqrt(8193 * 16384) = 11585.9
])
def test_sample_points(lo, hi, pts):
    assert sample_points(lo, hi) == pts


@pytest.mark.parametrize("lo, hi, halves", [
    (257, 512, ((257, 363), (364, 512))), (9, 16, ((9, 12), (13, 16))), (1, 8, ((1, 3), (4, 8))),
    (8193, 16384, ((8193, 11586), (11587, 16384))),
    (5, 8, None), (3, 4, None), (16, 16, None), (10, 16, None),  # narrower than 8: not halved
])
def test_split_range(lo, hi, halves):
    assert split_range(lo, hi) == halves


def test_key_string_round_trip_and_canonical_form():
    assert KEY.to_string() == "linear|bf16|bias|N=6144|K=4096|M=257-512|c"
    assert TableKey.from_string(KEY.to_string()) == KEY
    gelu = TableKey("linear", "tf32", "bias+gelu_tanh", 8, 8, 16384, 16384, "s4")
    assert gelu.to_string() == "linear|tf32|bias+gelu_tanh|N=8|K=8|M=16384-16384|s4"
    assert TableKey.from_string(gelu.to_string()) == gelu
    for bad in ["linear|bf16|bias|N=6144|K=4096|M=257-512", "linear|bf16|bias|N=06144|K=4096|M=1-1|c",
                "linear|bf16|bias|N=6144|K=4096|M=16|c",  # a schema-1 key is not a schema-2 key
                "linear|bf16|bias|N=6144|K=4096|M=512-257|c", "linear|bf16|bias|N=6144|K=4096|M=0-4|c",
                "linear|bf16|bias|N=6144|K=4096|M=1-16385|c", "linear|bf16|bias|N=6144|K=4096|M=01-4|c",
                "linear|bf16|bias|N=6144|K=4096|M=1-4-8|c", "linear|bf16|bias|N=6144|K=4096|M=-4|c",
                "linear|int8|bias|N=1|K=1|M=1-1|c", "linear|bf16|gelu+bias|N=1|K=1|M=1-1|c",
                "linear|bf16|bias|N=1|K=1|M=1-1|x", "Linear|bf16|bias|N=1|K=1|M=1-1|c",
                "linear|bf16|bias|K=1|N=1|M=1-1|c", "linear|bf16|bias|N=1|K=1|1-1|c"]:
        with pytest.raises(TableError):
            TableKey.from_string(bad)
    for lo, hi in [(16.0, 16), (16, 16.0), (0, 4), (8, 4), (1, 16385), (True, 1)]:
        with pytest.raises(TableError, match="M range"):
            TableKey("linear", "bf16", "bias", 1, 1, lo, hi, "c")


def test_v1_key_reads_as_the_one_m_it_was_timed_at():
    assert TableKey.from_v1_string("linear|bf16|bias|N=6144|K=4096|M=16|c") == key(16, 16)
    assert TableKey.from_v1_string("linear|fp16|none|N=8|K=8|M=16384|a2").to_string() == (
        "linear|fp16|none|N=8|K=8|M=16384-16384|a2")
    for bad in ["linear|bf16|bias|N=6144|K=4096|M=1-16|c", "linear|bf16|bias|N=6144|K=4096|M=16",
                "linear|bf16|bias|N=6144|K=4096|M=16385|c", "linear|bf16|bias|N=6144|K=4096|M=0|c"]:
        with pytest.raises(TableError):
            TableKey.from_v1_string(bad)


def test_shape_key_covers_and_with_range():
    assert KEY.shape == SHAPE and SHAPE.to_string() == "linear|bf16|bias|N=6144|K=4096|c"
    assert [m for m in (1, 256, 257, 300, 363, 364, 512, 513, 16384) if KEY.covers(m)] == [257, 300, 363, 364, 512]
    half = KEY.with_range(257, 363)
    assert half.to_string() == "linear|bf16|bias|N=6144|K=4096|M=257-363|c" and half.shape == SHAPE
    assert TableKey.for_range(SHAPE, 364, 512) == key(364, 512)
    with pytest.raises(TableError):
        KEY.with_range(513, 512)


def problem(m=16, n=64, k=32, dtype=torch.bfloat16, **kw):
    kw.setdefault("ldx", k)
    kw.setdefault("ldw", k)
    kw.setdefault("ldo", n)
    return Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(Activation.RELU, True), **kw)


def test_layout_classes():
    assert layout_class(problem()) == "c"
    assert layout_class(problem(k=33, ldx=33, ldw=33)) == "a2"  # odd K in bf16
    assert layout_class(problem(dtype=torch.float32, k=34, ldx=34, ldw=34)) == "a8"
    assert layout_class(problem(align_x=8)) == "a8"
    assert layout_class(problem(align_bias=4)) == "a4"
    assert layout_class(problem(ldx=96)) == "s16"  # a slice of a wider buffer
    assert layout_class(problem(ldo=200, align_out=2)) == "s2"


def test_layout_class_from_tensors():
    x, w, out = torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(32, 64), torch.empty(4, 32)
    w, out = w.bfloat16(), out.bfloat16()
    b = torch.empty(32, dtype=torch.bfloat16)
    epi = Epilogue(bias=True)
    assert layout_class(Problem.from_tensors(x, w, b, out, epi)) == "c"
    wide = torch.empty(4, 192, dtype=torch.bfloat16)
    assert layout_class(Problem.from_tensors(wide[:, :64], w, b, out, epi)) == "s16"
    assert layout_class(Problem.from_tensors(wide[:, 1:65], w, b, out, epi)) == "s2"


def test_key_from_problem():
    assert TableKey.from_problem(problem(m=3)).to_string() == "linear|bf16|bias+relu|N=64|K=32|M=3-4|c"
    assert TableKey.from_problem(problem(m=256)).to_string() == "linear|bf16|bias+relu|N=64|K=32|M=129-256|c"
    assert TableKey.from_problem(problem(m=257)).to_string() == "linear|bf16|bias+relu|N=64|K=32|M=257-512|c"
    p32 = problem(m=16384, dtype=torch.float32, tf32=True)
    assert TableKey.from_problem(p32, op="qkv").to_string() == "qkv|tf32|bias+relu|N=64|K=32|M=8193-16384|c"
    assert ShapeKey.from_problem(p32, op="qkv").to_string() == "qkv|tf32|bias+relu|N=64|K=32|c"
    with pytest.raises(ValueError, match="past the last tuned range"):
        TableKey.from_problem(problem(m=16385))


# ---------------------------------------------------------------- entries


def test_entry_is_canonicalised():
    e = make_entry("cublaslt", {"algo": (1, 2)}, m_points=(257, 363, 512), ratios=[1.23456789, 0.98765432, 1.1],
                   median_us=12.345678, spread_us=0.0123456, flinear_us=None, tuned_at="2026-11-29")
    assert e == {"backend": "cublaslt", "config": {"algo": [1, 2]}, "median_us": 12.35,
                 "spread_us": 0.01235, "m_points": [257, 363, 512], "ratios": [1.235, 0.9877, 1.1],
                 "worst_ratio": 0.9877, "candidates": [], "tuned_at": "2026-11-29"}
    assert "flinear_us" not in e
    heuristic = make_entry("cublaslt", {}, m_points=[1], ratios=[1], median_us=3, spread_us=0, flinear_us=3,
                           candidates=[{"backend": "torch", "config": {}, "median_us": 3, "spread_us": 0,
                                        "worst_ratio": 1}], tuned_at="2026-11-29")
    assert heuristic["config"] == {} and heuristic["worst_ratio"] == 1.0 and heuristic["flinear_us"] == 3.0
    assert heuristic["candidates"] == [{"backend": "torch", "config": {}, "median_us": 3.0, "spread_us": 0.0,
                                        "worst_ratio": 1.0}]
    assert T.normalize_entry(e, KEY) == e  # canonical form is a fixed point, and spans KEY's range


@pytest.mark.parametrize("mutate, match", [
    (lambda e: e.update(median_us="fast"), "median_us"),
    (lambda e: e.update(median_us=True), "median_us"),
    (lambda e: e.update(spread_us=-1.0), "spread_us"),
    (lambda e: e.update(median_us=float("nan")), "JSON"),
    (lambda e: e.update(median_us=HUGE), "median_us is out of range"),
    (lambda e: e.update(flinear_us=-HUGE), "flinear_us is out of range"),
    (lambda e: e.update(backend="Cu BLAS"), "backend"),
    (lambda e: e.update(config=[1]), "config"),
    (lambda e: e.update(tuned_at="yesterday"), "tuned_at"),
    (lambda e: e.update(tuned_at=20261129), "tuned_at"),
    (lambda e: e.update(extra=1), "unknown"),
    (lambda e: e.pop("candidates"), "missing"),
    (lambda e: e.pop("m_points"), "missing"),
    (lambda e: e.pop("worst_ratio"), "missing"),
    (lambda e: e.update(candidates={}), "candidates"),
    (lambda e: e["candidates"][0].pop("spread_us"), r"candidates\[0\]"),
    (lambda e: e["candidates"][1].update(median_us=None), r"candidates\[1\]\.median_us"),
    (lambda e: e["candidates"][0].update(worst_ratio=0), r"candidates\[0\]\.worst_ratio"),
    (lambda e: e["candidates"][0].update(extra=1), r"candidates\[0\]"),
    (lambda e: e.update(config={"f": object()}), "JSON"),
    (lambda e: e.update(m_points=[]), "m_points"),
    (lambda e: e.update(m_points=[512, 257]), "m_points must be increasing"),
    (lambda e: e.update(m_points=[257, 257]), "m_points must be increasing"),
    (lambda e: e.update(m_points=[257.0, 512]), "m_points must be increasing ints"),
    (lambda e: e.update(m_points=[0, 512]), "m_points"),
    (lambda e: e.update(m_points=[257, HUGE]), "m_points"),
    (lambda e: e.update(m_points=257), "m_points"),
    (lambda e: e.update(ratios=[1.25]), "one ratio per m_point"),
    (lambda e: e.update(ratios=[0, 1.5], worst_ratio=0), "ratios"),
    (lambda e: e.update(ratios=[-1.25, 1.5], worst_ratio=-1.25), "ratios"),
    (lambda e: e.update(ratios=[HUGE, 1.5], worst_ratio=1.5), "ratios.* out of range"),
    (lambda e: e.update(ratios=[float("inf"), 1.5], worst_ratio=1.5), "JSON"),
    (lambda e: e.update(ratios=["1.25", 1.5]), "ratios"),
    (lambda e: e.update(worst_ratio=1.5), "not the least of ratios"),
    (lambda e: e.update(worst_ratio=HUGE), "worst_ratio is out of range"),
])
def test_bad_entries_are_rejected(mutate, match):
    e = entry()
    mutate(e)
    with pytest.raises(TableError, match=match):
        T.normalize_entry(e)


@pytest.mark.parametrize("pts", [[257, 363], [300, 512], [257, 363, 600], [256, 512], [1]])
def test_m_points_must_span_the_key_range(pts):
    e = {**entry(), "m_points": pts, "ratios": [1.25] * len(pts), "worst_ratio": 1.25}
    T.normalize_entry(e)  # well-formed in itself
    with pytest.raises(TableError, match="do not span the key's range 257-512"):
        T.normalize_entry(e, KEY)
    t = TuningTable(SIG)
    with pytest.raises(TableError, match="span"):
        t.set(KEY, e)
    assert len(t) == 0


# ---------------------------------------------------------------- serialisation


def test_round_trip_and_byte_identical_resave(tmp_path):
    p1, p2 = tmp_path / "a.json", tmp_path / "b.json"
    t = filled_table()
    t.save(p1)
    loaded = TuningTable.load(p1, SIG, strict=True)
    assert dict(loaded.entries) == dict(t.entries)
    e = loaded.lookup(key(9, 16))
    assert (e["median_us"], e["m_points"], e["ratios"], e["worst_ratio"]) == (8.333, [9, 16], [1.25, 1.5], 1.25)
    loaded.save(p2)
    assert p1.read_bytes() == p2.read_bytes()
    text = p1.read_text()
    doc = json.loads(text)
    assert text.endswith("}\n") and doc["schema"] == 2 and doc["signature"]["schema"] == 2
    assert text == json.dumps(doc, sort_keys=True, indent=1) + "\n"
    assert sorted(doc["entries"]) == [
        "linear|bf16|bias|N=1024|K=4096|M=2049-4096|c", "linear|bf16|bias|N=6144|K=4096|M=1-1|c",
        "linear|bf16|bias|N=6144|K=4096|M=9-16|c", "linear|bf16|none|N=6144|K=4096|M=257-512|c"]


def test_insertion_order_does_not_change_the_bytes():
    keys = [key(1, 1), key(9, 16), key(2049, 4096, n=1024)]
    a, b = TuningTable(SIG), TuningTable(SIG)
    for k in keys:
        a.set(k, entry_for(k, us=3.0))
    for k in reversed(keys):
        b.set(k, entry_for(k, us=3.0))
    assert a.dumps() == b.dumps()


def test_lookup_is_exact_and_misses_return_none():
    t = filled_table()
    assert t.lookup(key(9, 16)) is t.lookup(key(9, 16))
    assert t.lookup(key(9, 12)) is None  # lookup is by exact key: a sub-range is another key
    assert t.lookup(key(17, 32)) is None
    assert t.lookup(key(9, 16, layout="s16")) is None
    with pytest.raises(TypeError):
        t.entries[key(2, 2)] = {}


# ---------------------------------------------------------------- the range rule


def test_an_entry_serves_exactly_its_range():
    t = TuningTable(SIG, {KEY: entry()})
    for m in (257, 300, 363, 512):
        assert t.find(SHAPE, m) == (KEY, t.lookup(KEY)), m
    for m in (1, 128, 256, 513, 1024, 16384, 16385):  # nothing borrowed from a neighbouring range
        assert t.find(SHAPE, m) is None, m
    for other in (ShapeKey("linear", "bf16", "bias", 6144, 4096, "s16"),
                  ShapeKey("linear", "bf16", "bias", 6144, 8192, "c"),
                  ShapeKey("linear", "fp16", "bias", 6144, 4096, "c"),
                  ShapeKey("linear", "bf16", "none", 6144, 4096, "c"),
                  ShapeKey("qkv", "bf16", "bias", 6144, 4096, "c")):
        assert t.find(other, 300) is None, other


def test_a_halved_range_sends_its_halves_to_different_entries():
    t = TuningTable(SIG)
    low, high = key(257, 363), key(364, 512)
    t.set(high, entry_for(high, us=2.0))
    t.set(low, entry_for(low, us=1.0))
    found = {m: t.find(SHAPE, m)[0] for m in (257, 300, 363, 364, 400, 512)}
    assert found == {257: low, 300: low, 363: low, 364: high, 400: high, 512: high}
    assert t.find(SHAPE, 363)[1]["median_us"] == 1.0 and t.find(SHAPE, 364)[1]["median_us"] == 2.0
    assert t.find(SHAPE, 256) is None and t.find(SHAPE, 513) is None


def test_find_on_the_whole_default_grid():
    t = TuningTable(SIG)
    grid = [(1, 1), (2, 2)] + [((1 << i) // 2 + 1, 1 << i) for i in range(2, 15)]
    assert grid[2:4] == [(3, 4), (5, 8)] and grid[-1] == (8193, 16384)
    for lo, hi in grid:
        t.set(key(lo, hi), entry(lo=lo, hi=hi))
    assert len(t) == 15
    holder = {m: (lo, hi) for lo, hi in grid for m in range(lo, hi + 1)}
    assert len(holder) == M_MAX
    for m in range(1, M_MAX + 1):
        k, _ = t.find(SHAPE, m)
        assert (k.m_lo, k.m_hi) == holder[m], m
    assert t.find(SHAPE, M_MAX + 1) is None and t.find(SHAPE, 0) is None


def test_the_index_follows_updates():
    t = TuningTable(SIG, {KEY: entry()})
    assert t.find(SHAPE, 257)[0] == KEY
    t.set(key(300, 400), entry(lo=300, hi=400))  # drops 257-512, which it overlaps
    assert t.find(SHAPE, 257) is None and t.find(SHAPE, 512) is None
    assert t.find(SHAPE, 300)[0] == key(300, 400) == t.find(SHAPE, 400)[0]
    other = TuningTable(SIG, {key(401, 512): entry(lo=401, hi=512)})
    t.update(other)
    assert t.find(SHAPE, 512)[0] == key(401, 512) and t.find(SHAPE, 400)[0] == key(300, 400)


def test_storing_an_entry_drops_the_entries_it_overlaps():
    t = TuningTable(SIG)
    for k in (key(1, 1), key(257, 363), key(364, 512), key(513, 1024), key(257, 512, epi="none")):
        t.set(k, entry_for(k))
    t.set(KEY, entry(us=7.0))  # the whole octave again: both halves go, neighbours stay
    assert sorted(t.entries, key=lambda k: (k.epilogue, k.m_lo)) == [
        key(1, 1), KEY, key(513, 1024), key(257, 512, epi="none")]
    t.set(key(500, 600), entry(lo=500, hi=600))  # straddles two entries: drops both
    assert sorted((k.m_lo, k.m_hi) for k in t.entries if k.shape == SHAPE) == [(1, 1), (500, 600)]
    assert key(257, 512, epi="none") in t  # another shape is never touched


def test_covering_lists_the_overlapping_keys_lowest_first():
    t = TuningTable(SIG)
    for k in (key(1, 1), key(257, 363), key(364, 512), key(513, 1024), key(257, 512, n=1024)):
        t.set(k, entry_for(k))
    assert t.covering(key(300, 600)) == [key(257, 363), key(364, 512), key(513, 1024)]
    assert t.covering(KEY) == [key(257, 363), key(364, 512)]
    assert t.covering(key(512, 512)) == [key(364, 512)]
    assert t.covering(key(2, 256)) == []
    assert t.covering(key(1, 16384, n=1024)) == [key(257, 512, n=1024)]


def test_update_drops_overlapped_entries_and_keeps_the_rest():
    base = TuningTable(SIG, {KEY: entry(us=1.0), key(1, 1): entry(us=1.0, lo=1, hi=1)})
    base.update(TuningTable(SIG, {key(300, 400): entry(us=2.0, lo=300, hi=400)}))
    assert ranges(base) == {(1, 1): 1.0, (300, 400): 2.0}


# ---------------------------------------------------------------- bad files


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_gives_empty_table_and_warns_once(tmp_path, case):
    path = tmp_path / f"{case}.json"
    path.write_bytes(BAD_FILES[case]())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        t1 = TuningTable.load(path, SIG)
        t2 = TuningTable.load(path, SIG)
    ws = table_warnings(rec)
    assert len(ws) == 1, [str(w.message) for w in rec]
    assert str(path) in str(ws[0].message)
    assert len(t1) == len(t2) == 0 and t1.lookup(KEY) is None and t1.find(SHAPE, 300) is None
    t1.set(KEY, entry())  # the empty table is still usable
    assert t1.find(SHAPE, 300)[1]["backend"] == "triton_splitk"
    with pytest.raises(TableError, match=re.escape(str(path))):
        TuningTable.load(path, SIG, strict=True)


def test_foreign_signature_is_ignored_with_one_warning(tmp_path):
    path = tmp_path / "h100.json"
    t = filled_table()
    t.signature = H100
    t.save(path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert len(TuningTable.load(path, SIG)) == 0
        assert len(TuningTable.load(path, SIG)) == 0
    ws = table_warnings(rec)
    assert len(ws) == 1 and "gpu_name" in str(ws[0].message)
    assert len(TuningTable.load(path)) == 4  # no signature given: inspection, unchecked


def test_invalid_entries_are_dropped_with_one_warning(tmp_path):
    d = json.loads(valid_text())
    good = len(d["entries"])
    first = d["entries"]["linear|bf16|bias|N=6144|K=4096|M=1-1|c"]
    d["entries"]["linear|bf16|bias|N=1|K=1|M=3|c"] = entry(lo=3, hi=3)  # a schema-1 key
    d["entries"]["linear|bf16|bias|N=2|K=1|M=1-1|c"] = {**first, "median_us": "x"}
    path = tmp_path / "partly-bad.json"
    path.write_text(json.dumps(d))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        t = TuningTable.load(path, SIG)
        TuningTable.load(path, SIG)
    ws = table_warnings(rec)
    assert len(ws) == 1 and "dropped 2 invalid entries" in str(ws[0].message)
    assert len(t) == good


# One entry each, for N=2 and the range 257-512; a file holding it next to a good entry.
BAD_ENTRIES = {
    "m-points-short-of-the-top": ({"m_points": [257, 363], "ratios": [1.25, 1.5]}, "do not span"),
    "m-points-past-the-top": ({"m_points": [257, 363, 600], "ratios": [1.25, 1.5, 1.3]}, "do not span"),
    "m-points-above-the-bottom": ({"m_points": [300, 512]}, "do not span"),
    "worst-is-not-the-least": ({"worst_ratio": 1.5}, "not the least of ratios"),
    "ratio-zero": ({"ratios": [0, 1.5], "worst_ratio": 0}, "ratios"),
    "ratio-negative": ({"ratios": [-0.5, 1.5], "worst_ratio": -0.5}, "ratios"),
    "huge-int-median": ({"median_us": HUGE}, "median_us is out of range"),
    "huge-int-ratio": ({"ratios": [HUGE, 1.5], "worst_ratio": 1.5}, "ratios.* out of range"),
    "huge-int-worst": ({"worst_ratio": HUGE}, "worst_ratio is out of range"),
    "huge-int-m-point": ({"m_points": [257, HUGE]}, "m_points"),
    "huge-int-candidate": ({"candidates": [{"backend": "torch", "config": {}, "median_us": 1.0, "spread_us": 0.1,
                                            "worst_ratio": HUGE}]}, "candidates"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_malformed_entry_is_dropped_not_raised(tmp_path, case):
    changes, match = BAD_ENTRIES[case]
    d = json.loads(valid_text())
    bad_key = "linear|bf16|bias|N=2|K=1|M=257-512|c"
    d["entries"][bad_key] = {**entry(), **changes}
    data = json.dumps(d).encode()
    parsed = parse_document(data)  # no OverflowError, ValueError or TypeError escapes
    assert len(parsed.entries) == 4 and TableKey.from_string(bad_key) not in parsed.entries
    assert len(parsed.dropped) == 1 and re.search(match, parsed.dropped[0]), parsed.dropped
    path = tmp_path / f"{case}.json"
    path.write_bytes(data)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        t = TuningTable.load(path, SIG)
        TuningTable.load(path, SIG)
    ws = table_warnings(rec)
    assert len(ws) == 1 and "dropped 1 invalid entry " in str(ws[0].message), [str(w.message) for w in ws]
    assert len(t) == 4 and t.find(ShapeKey("linear", "bf16", "bias", 2, 1, "c"), 300) is None
    with pytest.raises(TableError, match=re.escape(str(path))):
        TuningTable.load(path, SIG, strict=True)


def test_overlapping_ranges_in_one_file_keep_the_first(tmp_path):
    d = json.loads(valid_text())
    # sorted key order: "M=257-512" < "M=300-400" < "M=400-600"; "M=1025-2048" sorts first of all
    d["entries"]["linear|bf16|bias|N=6144|K=4096|M=257-512|c"] = entry(us=1.0)
    d["entries"]["linear|bf16|bias|N=6144|K=4096|M=300-400|c"] = entry(us=2.0, lo=300, hi=400)
    d["entries"]["linear|bf16|bias|N=6144|K=4096|M=400-600|c"] = entry(us=3.0, lo=400, hi=600)
    d["entries"]["linear|bf16|bias|N=6144|K=4096|M=1025-2048|c"] = entry(us=4.0, lo=1025, hi=2048)
    d["entries"]["linear|bf16|bias|N=6144|K=4096|M=513-1024|c"] = entry(us=5.0, lo=513, hi=1024)  # touches
    parsed = parse_document(json.dumps(d).encode())
    assert ranges(TuningTable(SIG, parsed.entries)) == {(1, 1): 5.0, (9, 16): 8.333, (257, 512): 1.0,
                                                         (513, 1024): 5.0, (1025, 2048): 4.0}
    assert len(parsed.dropped) == 2
    assert "M=300-400" in parsed.dropped[0] and "overlaps linear|bf16|bias|N=6144|K=4096|M=257-512|c" in (
        parsed.dropped[0])
    assert "M=400-600" in parsed.dropped[1] and "overlaps" in parsed.dropped[1]
    path = tmp_path / "overlap.json"
    path.write_text(json.dumps(d))
    with pytest.warns(HybridGemmTableWarning, match="dropped 2 invalid entries"):
        t = TuningTable.load(path, SIG)
    assert t.find(SHAPE, 350)[0] == KEY and t.find(SHAPE, 550)[0] == key(513, 1024)


def test_missing_file_is_silently_empty(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = TuningTable.load(tmp_path / "nope.json", SIG, strict=True)
    assert len(t) == 0 and t.signature == SIG


def test_directory_instead_of_file_warns(tmp_path):
    with pytest.warns(HybridGemmTableWarning, match="cannot be read"):
        assert len(TuningTable.load(tmp_path, SIG)) == 0


# ---------------------------------------------------------------- schema 1


def test_schema_1_document_is_migrated_to_one_m_ranges():
    parsed = parse_document(v1_doc(V1_ENTRIES))
    assert parsed.dropped == []  # nothing malformed: 4 entries were merely not safe to keep
    assert parsed.signature == {**V1_SIG, "schema": 2}  # relabelled: it now matches a schema-2 device
    assert signature_matches(parsed.signature, SIG) == (True, "")
    assert parsed.entries == {
        key(16, 16): {"backend": "triton_splitk", "config": {"split": 4}, "median_us": 10.0, "spread_us": 0.1,
                      "flinear_us": 12.0, "m_points": [16], "ratios": [1.2], "worst_ratio": 1.2,
                      "tuned_at": "2025-06-01",
                      "candidates": [{"backend": "triton_splitk", "config": {"split": 4}, "median_us": 10.0,
                                      "spread_us": 0.1}]},
        key(64, 64): {"backend": "triton_splitk", "config": {"split": 4}, "median_us": 20.0, "spread_us": 0.1,
                      "flinear_us": 19.4, "m_points": [64], "ratios": [0.97], "worst_ratio": 0.97,
                      "tuned_at": "2025-06-01",
                      "candidates": [{"backend": "triton_splitk", "config": {"split": 4}, "median_us": 20.0,
                                      "spread_us": 0.1}]},
    }
    assert "schema-1" in parsed.note and "kept 2 of 6" in parsed.note and "4 without" in parsed.note
    assert T.V1_MIN_RATIO == 0.97


def test_schema_1_malformed_entries_are_dropped():
    entries = {
        V1_PREFIX + "M=16|c": v1_entry(10.0, 12.0),
        V1_PREFIX + "M=32|c": {**v1_entry(10.0, 12.0), "m_points": [32]},  # schema-2 fields in a v1 entry
        V1_PREFIX + "M=64|c": v1_entry(10.0, HUGE),
        V1_PREFIX + "M=128|c": v1_entry(HUGE, 12.0),
        V1_PREFIX + "M=1-4|c": v1_entry(10.0, 12.0),  # a schema-2 key in a schema-1 table
        V1_PREFIX + "M=512|c": v1_entry(0.001, 5.0),  # a 5000x ratio is not a measurement
    }
    parsed = parse_document(v1_doc(entries))
    assert list(parsed.entries) == [key(16, 16)]
    assert len(parsed.dropped) == 5, parsed.dropped
    assert "kept 1 of 6" in parsed.note


def test_schema_1_table_loads_with_one_warning_and_serves_only_its_ms(tmp_path):
    path = tmp_path / "v1.json"
    path.write_bytes(v1_doc(V1_ENTRIES))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        t = TuningTable.load(path, SIG, strict=True)  # migration is not an error, even when strict
        for _ in range(3):
            TuningTable.load(path, SIG)
        load_tables(SIG, path, shipped_dir=tmp_path / "none")
    ws = table_warnings(rec)
    assert len(ws) == 1, [str(w.message) for w in ws]
    assert str(path) in str(ws[0].message) and "schema-1" in str(ws[0].message)
    assert "hybridgemm autotune --force" in str(ws[0].message)
    assert t.signature == SIG and sorted(t.entries, key=lambda k: k.m_lo) == [key(16, 16), key(64, 64)]
    for m, hit in [(15, None), (16, key(16, 16)), (17, None), (9, None), (63, None), (64, key(64, 64)),
                   (65, None), (256, None), (1024, None), (4096, None), (8192, None)]:
        found = t.find(SHAPE, m)
        assert (found and found[0]) == hit, m
    # inspection without a device signature: the file's own, relabelled
    assert TuningTable.load(path).signature == {**V1_SIG, "schema": 2}
    # another GPU's schema-1 table is still another GPU's
    other = tmp_path / "v1-h100.json"
    other.write_bytes(v1_doc(V1_ENTRIES, sig={**H100, "schema": 1}))
    with pytest.warns(HybridGemmTableWarning, match="gpu_name"):
        assert len(TuningTable.load(other, SIG)) == 0


def test_migrated_table_saves_as_schema_2(tmp_path):
    path = tmp_path / "table.json"
    path.write_bytes(v1_doc(V1_ENTRIES))
    with pytest.warns(HybridGemmTableWarning, match="schema-1"):
        t = TuningTable.load(path, SIG)
    t.set(KEY, entry())
    t.save(path)  # merging with the schema-1 file on disk keeps its migrated entries, not the dropped ones
    doc = json.loads(path.read_text())
    assert doc["schema"] == 2 and doc["signature"] == SIG
    assert sorted(doc["entries"]) == [V1_PREFIX + "M=16-16|c", V1_PREFIX + "M=257-512|c",
                                      V1_PREFIX + "M=64-64|c"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(TuningTable.load(path, SIG, strict=True)) == 3


# ---------------------------------------------------------------- saving and merging


def test_save_merges_with_disk(tmp_path):
    path = tmp_path / "t.json"
    filled_table([key(1, 1), key(2, 2)]).save(path)
    mine = TuningTable.load(path, SIG)
    other = TuningTable.load(path, SIG)
    other.set(key(2, 2), entry(us=99.0, lo=2, hi=2))  # someone else re-tunes M=2 and adds 3-4
    other.set(key(3, 4), entry(us=4.0, lo=3, hi=4))
    other.save(path)
    mine.set(key(1, 1), entry(us=1.0, lo=1, hi=1))  # we re-tune M=1 and add 5-8
    mine.set(key(5, 8), entry(us=8.0, lo=5, hi=8))
    mine.save(path)
    final = TuningTable.load(path, SIG)
    assert ranges(final) == {(1, 1): 1.0, (2, 2): 99.0, (3, 4): 4.0, (5, 8): 8.0}
    assert dict(mine.entries) == dict(final.entries)


def test_save_drops_disk_entries_that_a_new_range_overlaps(tmp_path):
    path = tmp_path / "t.json"
    start = TuningTable(SIG)
    for k, us in [(key(1, 1), 1.0), (KEY, 50.0), (key(513, 1024), 60.0)]:
        start.set(k, entry_for(k, us=us))
    start.save(path)
    stale = TuningTable.load(path, SIG)  # a second tuner, loaded before the split below
    splitter = TuningTable.load(path, SIG)
    splitter.set(key(257, 363), entry(us=10.0, lo=257, hi=363))  # halves 257-512
    splitter.set(key(364, 512), entry(us=11.0, lo=364, hi=512))
    splitter.save(path)
    assert ranges(TuningTable.load(path, SIG)) == {(1, 1): 1.0, (257, 363): 10.0, (364, 512): 11.0,
                                                    (513, 1024): 60.0}
    # The stale tuner adds a range; its old copy of 257-512 (not set by it) must not come back.
    stale.set(key(1025, 2048), entry(us=70.0, lo=1025, hi=2048))
    stale.save(path)
    expected = {(1, 1): 1.0, (257, 363): 10.0, (364, 512): 11.0, (513, 1024): 60.0, (1025, 2048): 70.0}
    assert ranges(TuningTable.load(path, SIG)) == expected == ranges(stale)
    # A range set in memory (not yet saved) wins over the disk's and drops what it overlaps there.
    whole = TuningTable.load(path, SIG)
    whole.set(key(300, 600), entry(us=80.0, lo=300, hi=600))
    whole.save(path)
    assert ranges(TuningTable.load(path, SIG)) == {(1, 1): 1.0, (300, 600): 80.0, (1025, 2048): 70.0}


def test_save_replaces_a_foreign_table_with_a_warning(tmp_path):
    path = tmp_path / "t.json"
    foreign = filled_table([key(1, 1)])
    foreign.signature = H100
    foreign.save(path)
    ours = filled_table([key(2, 2)])
    with pytest.warns(HybridGemmTableWarning, match="tuned elsewhere"):
        ours.save(path)
    final = TuningTable.load(path, SIG, strict=True)
    assert list(final.entries) == [key(2, 2)]


def test_save_needs_a_signature(tmp_path):
    with pytest.raises(ValueError, match="signature"):
        TuningTable(None).save(tmp_path / "t.json")


def test_unwritable_location_raises_a_clear_oserror(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    target = blocker / "table.json"
    with pytest.raises(TableWriteError, match="cannot write tuning table") as info:
        filled_table().save(target)
    assert isinstance(info.value, OSError) and info.value.filename == str(target)
    assert info.value.errno is not None
    assert str(target) in str(info.value) and "HYBRIDGEMM_CACHE_DIR" in str(info.value)


def test_failed_replace_leaves_no_temp_file(tmp_path, monkeypatch):
    def deny(*a):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(T.os, "replace", deny)
    with pytest.raises(TableWriteError, match="Permission denied"):
        filled_table().save(tmp_path / "t.json")
    assert [p.name for p in tmp_path.iterdir()] == ["t.json.lock"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(TableWriteError, match=re.escape(str(ro))):
            filled_table().save(ro / "table.json")
    finally:
        ro.chmod(0o755)


def test_the_temp_files_mode_is_set_through_its_descriptor_not_its_name(tmp_path, monkeypatch):
    """The temp file is made 0644 through its open descriptor. Its name is no proof of what
    it names: here a symlink to another file replaces it just after it is created (as another
    process sharing the directory could), and the mode change must not reach the link's target."""
    victim, moved = tmp_path / "private", tmp_path / "moved.tmp"
    victim.write_text("not the table")
    victim.chmod(0o600)
    real_mkstemp = tempfile.mkstemp

    def mkstemp_then_swap(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        os.rename(name, moved)
        os.symlink(victim, name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_swap)
    table = filled_table()
    table.save(tmp_path / "t.json")
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "not the table"
    assert stat.S_IMODE(moved.stat().st_mode) == 0o644 and moved.read_text() == table.dumps()


def writer_range(worker, i, count):
    """The range worker ``worker`` writes as its ``i``-th entry: all workers share one shape,
    and their ranges tile 1..2 * workers * count without overlapping."""
    j = worker * count + i
    return 2 * j + 1, 2 * j + 2


def _writer(path, sig, worker, count, barrier):
    from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry

    table = TuningTable.load(path, sig)
    barrier.wait()
    for i in range(count):
        lo, hi = writer_range(worker, i, count)
        k = TableKey("linear", "bf16", "bias", 4096, 4096, lo, hi, "c")
        table.set(k, make_entry("cublaslt", {"w": worker, "i": i}, m_points=[lo, hi], ratios=[1.0, 1.0 + i / 8],
                                median_us=1.0 + i, spread_us=0.0, tuned_at="2026-11-29"))
        table.save(path)


def test_concurrent_writers_lose_no_entries_and_readers_see_whole_tables(tmp_path):
    """Eight processes save into one table while this process keeps reading it strictly: every
    read is a complete, valid document (atomic replace), the number of entries never goes down
    (each save merges under the lock), and every writer's entries survive, each where it wrote it."""
    path, workers, count = tmp_path / "shared.json", 8, 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_writer, args=(str(path), SIG, w, count, barrier))
             for w in range(workers)]
    for p in procs:
        p.start()
    seen, deadline = [], time.monotonic() + 600  # a hang guard: the writers take seconds
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        seen.append(len(TuningTable.load(path, SIG, strict=True)))  # TableError on a torn or partial file
        time.sleep(0.002)  # leave the (few) CPUs to the writers
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * workers
    assert seen and seen == sorted(seen), f"an entry disappeared between two reads: {seen}"
    final = TuningTable.load(path, SIG, strict=True)
    assert len(final) == workers * count
    assert {(k.m_lo, k.m_hi, e["config"]["w"], e["config"]["i"]) for k, e in final.entries.items()} == {
        (*writer_range(w, i, count), w, i) for w in range(workers) for i in range(count)}
    shape = ShapeKey("linear", "bf16", "bias", 4096, 4096, "c")
    assert [final.find(shape, m)[0].m_lo for m in (1, 2, 3, 64)] == [1, 1, 3, 63] and not final.find(shape, 65)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------- locations, precedence


def test_user_table_path_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "c"))
    assert user_table_path() == tmp_path / "c" / "table.json"
    monkeypatch.delenv("HYBRIDGEMM_CACHE_DIR")
    p = user_table_path()
    assert p.name == "table.json" and "hybridgemm" in str(p.parent)


def _write(path, marks, sig=SIG):
    t = TuningTable(sig)
    for (lo, hi), us in marks.items():
        t.set(key(lo, hi), entry(us=us, lo=lo, hi=hi))
    t.save(path)


def test_precedence_explicit_over_user_over_shipped(tmp_path):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    _write(shipped / "h200.json", {(1, 1): 100.0, (2, 2): 100.0, (3, 4): 100.0})
    _write(shipped / "h100.json", {(1, 1): 500.0, (5, 8): 500.0}, sig=H100)  # skipped quietly
    _write(user_table_path(), {(2, 2): 200.0, (3, 4): 200.0})
    _write(tmp_path / "mine.json", {(3, 4): 300.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = load_tables(SIG, tmp_path / "mine.json", shipped_dir=shipped)
    assert ranges(t) == {(1, 1): 100.0, (2, 2): 200.0, (3, 4): 300.0}
    assert t.signature == SIG and len(t.sources) == 3
    # Without a device signature, shipped tables are skipped and the rest read unchecked.
    assert ranges(load_tables(None, shipped_dir=shipped)) == {(2, 2): 200.0, (3, 4): 200.0}


def test_precedence_drops_lower_ranges_a_higher_table_overlaps(tmp_path):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    _write(shipped / "h200.json", {(257, 512): 100.0, (513, 1024): 100.0})
    _write(user_table_path(), {(257, 363): 200.0})  # the user halved 257-512 and tuned one half
    t = load_tables(SIG, shipped_dir=shipped)
    assert ranges(t) == {(257, 363): 200.0, (513, 1024): 100.0}
    # the shipped 257-512 is gone as a whole: 364-512 is no longer covered by anything
    assert t.find(SHAPE, 300)[0] == key(257, 363) and t.find(SHAPE, 400) is None


def test_foreign_user_table_and_missing_explicit_path_warn(tmp_path):
    t = filled_table([key(1, 1)])
    t.signature = H100
    t.save(user_table_path())
    with pytest.warns(HybridGemmTableWarning) as rec:
        merged = load_tables(SIG, tmp_path / "missing.json", shipped_dir=tmp_path)
    messages = [str(w.message) for w in rec]
    assert len(messages) == 2
    assert "gpu_name" in messages[0] and "does not exist" in messages[1]
    assert len(merged) == 0


def test_shipped_tables_are_valid():
    with warnings.catch_warnings(record=True) as rec:  # a schema-1 shipped table warns (migration)
        warnings.simplefilter("always")
        for path in shipped_table_paths():
            t = TuningTable.load(path, strict=True)
            assert t.signature["schema"] == 2 and validate_signature(t.signature) is None
            for k, e in t.entries.items():
                assert T.normalize_entry(e, k) == e
    assert all("schema-1" in str(w.message) for w in table_warnings(rec))
    assert all(p.suffix == ".json" for p in shipped_table_paths())
    assert shipped_table_paths(Path("/nonexistent")) == []


# ---------------------------------------------------------------- signatures


def test_signature_rules():
    assert validate_signature(SIG) is None
    assert signature_matches(SIG, dict(SIG)) == (True, "")
    # Informational fields may differ: a patch release or a torch upgrade keeps the table.
    assert signature_matches(SIG, {**SIG, "torch_version": "2.12", "package_version": "0.1.1"})[0]
    # Library versions are judged entry by entry (tests/autotune_cache/test_upgrade.py), never for the whole table.
    assert signature_matches(SIG, {**SIG, "cublaslt_version": None, "triton_version": "3.7.0"})[0]
    for field, value in [("gpu_name", "NVIDIA H100"), ("compute_capability", "9.1"),
                         ("sm_count", 114), ("kernel_abi", KERNEL_ABI + 1),
                         ("schema", 1), ("schema", 3)]:
        ok, reason = signature_matches(SIG, {**SIG, field: value})
        assert not ok and reason.startswith(field), reason
    ok, reason = signature_matches({k: v for k, v in SIG.items() if k != "sm_count"}, SIG)
    assert not ok and "sm_count" in reason
    assert signature_matches(None, SIG)[0] is False
    assert validate_signature({**SIG, "extra": "driver 580"}) is None
    assert validate_signature({**SIG, "extra": [1]}) is not None
    assert validate_signature({**SIG, "compute_capability": "sm90"}) is not None
    assert validate_signature({**SIG, "sm_count": True}) is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_signature_without_cuda():
    assert current_signature() is None


def test_current_signature_with_a_fake_device(monkeypatch):
    import types

    import hybridgemm
    from hybridgemm.autotune_cache import signature as S

    calls = []

    def props(index):
        calls.append(index)
        return types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0,
                                     multi_processor_count=132)

    monkeypatch.setattr(S, "_cache", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    sig = current_signature()
    assert validate_signature(sig) is None
    assert sig["compute_capability"] == "9.0" and sig["sm_count"] == 132
    assert sig["package_version"] == hybridgemm.__version__
    assert sig["schema"] == T.SCHEMA_VERSION == SIG["schema"] == 2  # SIG is a running device's signature
    sig["gpu_name"] = "mutated"  # callers get copies; the cache is per device index
    assert current_signature(0)["gpu_name"] == "NVIDIA H200"
    current_signature(1)
    assert calls == [0, 1]


def test_make_entry_rejects_out_of_range_ratios_with_a_table_error():
    for bad in (10**400, 0, -1.0, float("nan")):
        with pytest.raises(TableError):
            make_entry("torch", {}, m_points=[1], ratios=[bad], median_us=1.0, spread_us=0.0)


def test_keys_with_large_n_and_k_round_trip_and_past_31_bits_are_refused():
    big = TableKey("linear", "bf16", "none", 1_000_000, 2**31 - 1, 1, 1)
    assert TableKey.from_string(big.to_string()) == big
    with pytest.raises(TableError):
        TableKey.from_string(big.to_string().replace(f"K={2**31 - 1}", f"K={2**31}"))
