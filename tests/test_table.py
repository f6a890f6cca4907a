import json
import multiprocessing
import os
import pickle
import random
import re
import warnings
from pathlib import Path

import pytest
import torch

from hybridgemm.autotune_cache import table as T
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
    m_bucket,
    make_entry,
    shipped_table_paths,
    user_table_path,
)
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

SIG = {
    "schema": 1, "kernel_abi": KERNEL_ABI, "gpu_name": "NVIDIA H200",
    "compute_capability": "9.0", "sm_count": 132, "cublaslt_version": 130100,
    "triton_version": "3.6.0", "torch_version": "2.11.0+cu130", "package_version": "0.1.0",
}
H100 = {**SIG, "gpu_name": "NVIDIA H100 80GB HBM3", "sm_count": 132}


def key(n=6144, k=4096, m=16, epi="bias", layout="c", dtype="bf16"):
    return TableKey("linear", dtype, epi, n, k, m, layout)


def entry(us=10.0, backend="triton_splitk", **config):
    cands = [{"backend": backend, "config": config or {"split": 4}, "median_us": us,
              "spread_us": 0.1},
             {"backend": "cublaslt", "config": {"algo": [1, 2, 3]}, "median_us": us * 1.2,
              "spread_us": 0.2}]
    return make_entry(backend, config or {"split": 4}, median_us=us, spread_us=0.1,
                      candidates=cands, flinear_us=us * 1.5, tuned_at="2026-11-29")


def table_warnings(records):
    return [w for w in records if issubclass(w.category, HybridGemmTableWarning)]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # Never touch the real user cache dir.
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))


# ---------------------------------------------------------------- buckets, keys, layouts


@pytest.mark.parametrize("m, b", [(1, 1), (2, 2), (3, 4), (5, 8), (1024, 1024), (1025, 2048),
                                  (16384, 16384), (16385, 16384), (10**9, 16384)])
def test_m_bucket_edges(m, b):
    assert m_bucket(m) == b


def test_m_bucket_rejects_nonpositive_and_non_ints():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            m_bucket(bad)
    for bad in (1.0, True, "4"):
        with pytest.raises(TypeError):
            m_bucket(bad)


def test_key_string_round_trip_and_canonical_form():
    k = key()
    assert k.to_string() == "linear|bf16|bias|N=6144|K=4096|M=16|c"
    assert TableKey.from_string(k.to_string()) == k
    gelu = TableKey("linear", "tf32", "bias+gelu_tanh", 8, 8, 16384, "s4")
    assert TableKey.from_string(gelu.to_string()) == gelu
    for bad in ["linear|bf16|bias|N=6144|K=4096|M=16", "linear|bf16|bias|N=06144|K=4096|M=16|c",
                "linear|bf16|bias|N=6144|K=4096|M=3|c", "linear|int8|bias|N=1|K=1|M=1|c",
                "linear|bf16|gelu+bias|N=1|K=1|M=1|c", "linear|bf16|bias|N=1|K=1|M=1|x",
                "Linear|bf16|bias|N=1|K=1|M=1|c", "linear|bf16|bias|K=1|N=1|M=1|c"]:
        with pytest.raises(TableError):
            TableKey.from_string(bad)
    with pytest.raises(TableError):
        TableKey("linear", "bf16", "bias", 1, 1, 16.0, "c")


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
    p = problem(m=3)
    assert TableKey.from_problem(p).to_string() == "linear|bf16|bias+relu|N=64|K=32|M=4|c"
    p32 = problem(m=20000, dtype=torch.float32, tf32=True)
    assert TableKey.from_problem(p32, op="qkv").to_string() == (
        "qkv|tf32|bias+relu|N=64|K=32|M=16384|c")


# ---------------------------------------------------------------- entries


def test_entry_is_canonicalised():
    e = make_entry("cublaslt", {"algo": (1, 2)}, median_us=12.345678, spread_us=0.0123456,
                   flinear_us=None, tuned_at="2026-11-29")
    assert e == {"backend": "cublaslt", "config": {"algo": [1, 2]}, "median_us": 12.35,
                 "spread_us": 0.01235, "candidates": [], "tuned_at": "2026-11-29"}
    assert "flinear_us" not in e


@pytest.mark.parametrize("mutate, match", [
    (lambda e: e.update(median_us="fast"), "median_us"),
    (lambda e: e.update(median_us=True), "median_us"),
    (lambda e: e.update(spread_us=-1.0), "spread_us"),
    (lambda e: e.update(median_us=float("nan")), "JSON"),
    (lambda e: e.update(backend="Cu BLAS"), "backend"),
    (lambda e: e.update(config=[1]), "config"),
    (lambda e: e.update(tuned_at="yesterday"), "tuned_at"),
    (lambda e: e.update(tuned_at=20261129), "tuned_at"),
    (lambda e: e.update(extra=1), "unknown"),
    (lambda e: e.pop("candidates"), "missing"),
    (lambda e: e.update(candidates={}), "candidates"),
    (lambda e: e["candidates"][0].pop("spread_us"), r"candidates\[0\]"),
    (lambda e: e["candidates"][1].update(median_us=None), r"candidates\[1\]\.median_us"),
    (lambda e: e.update(config={"f": object()}), "JSON"),
])
def test_bad_entries_are_rejected(mutate, match):
    e = entry()
    mutate(e)
    with pytest.raises(TableError, match=match):
        T.normalize_entry(e)


# ---------------------------------------------------------------- serialisation


def filled_table(keys=None):
    t = TuningTable(SIG)
    for i, k in enumerate(keys or [key(m=1), key(m=16), key(n=1024, m=4096), key(epi="none")]):
        t.set(k, entry(us=5.0 + i * 3.333333))
    return t


def test_round_trip_and_byte_identical_resave(tmp_path):
    p1, p2 = tmp_path / "a.json", tmp_path / "b.json"
    t = filled_table()
    t.save(p1)
    loaded = TuningTable.load(p1, SIG, strict=True)
    assert dict(loaded.entries) == dict(t.entries)
    assert loaded.lookup(key(m=16))["median_us"] == 8.333
    loaded.save(p2)
    assert p1.read_bytes() == p2.read_bytes()
    text = p1.read_text()
    assert text.endswith("}\n") and json.loads(text)["schema"] == 1
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=1) + "\n"


def test_insertion_order_does_not_change_the_bytes():
    keys = [key(m=1), key(m=16), key(n=1024, m=4096)]
    a, b = TuningTable(SIG), TuningTable(SIG)
    for k in keys:
        a.set(k, entry(us=3.0))
    for k in reversed(keys):
        b.set(k, entry(us=3.0))
    assert a.dumps() == b.dumps()


def test_lookup_is_pure_and_misses_return_none():
    t = filled_table()
    assert t.lookup(key(m=16)) is t.lookup(key(m=16))
    assert t.lookup(key(m=32)) is None
    assert t.lookup(key(layout="s16")) is None
    with pytest.raises(TypeError):
        t.entries[key(m=2)] = {}


# ---------------------------------------------------------------- bad files


def valid_text():
    return filled_table().dumps()


def _doc(**changes):
    d = json.loads(valid_text())
    d.update(changes)
    return json.dumps(d).encode()


BAD_FILES = {
    "truncated": lambda: valid_text()[: len(valid_text()) // 2].encode(),
    "empty": lambda: b"",
    "random-bytes": lambda: random.Random(0).randbytes(4096),
    "pickle": lambda: pickle.dumps({"schema": 1}),
    "top-level-list": lambda: b"[1, 2]",
    "old-schema": lambda: _doc(schema=0),
    "future-schema": lambda: _doc(schema=2),
    "schema-as-string": lambda: _doc(schema="1"),
    "schema-as-float": lambda: _doc(schema=1.0),
    "entries-as-list": lambda: _doc(entries=[]),
    "signature-wrong-type": lambda: _doc(signature={**SIG, "sm_count": "132"}),
    "signature-missing-field": lambda: _doc(signature={"gpu_name": "x"}),
    "extra-top-level-field": lambda: _doc(code="import os"),
    "nan-constant": lambda: valid_text().replace('"median_us": 5.0', '"median_us": NaN').encode(),
    "deep-nesting": lambda: b"[" * 100000,
}


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
    assert len(t1) == len(t2) == 0 and t1.lookup(key()) is None
    t1.set(key(), entry())  # the empty table is still usable
    assert t1.lookup(key())["backend"] == "triton_splitk"
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
    d["entries"]["linear|bf16|bias|N=1|K=1|M=3|c"] = entry()
    first = next(iter(d["entries"]))
    d["entries"]["linear|bf16|bias|N=2|K=1|M=1|c"] = {**d["entries"][first], "median_us": "x"}
    path = tmp_path / "partly-bad.json"
    path.write_text(json.dumps(d))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        t = TuningTable.load(path, SIG)
        TuningTable.load(path, SIG)
    ws = table_warnings(rec)
    assert len(ws) == 1 and "dropped 2 invalid entries" in str(ws[0].message)
    assert len(t) == good


def test_missing_file_is_silently_empty(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = TuningTable.load(tmp_path / "nope.json", SIG, strict=True)
    assert len(t) == 0 and t.signature == SIG


def test_directory_instead_of_file_warns(tmp_path):
    with pytest.warns(HybridGemmTableWarning, match="cannot be read"):
        assert len(TuningTable.load(tmp_path, SIG)) == 0


# ---------------------------------------------------------------- nearest bucket


def test_nearest_bucket_rule():
    t = TuningTable(SIG)
    for m in (1, 16, 256):
        t.set(key(m=m), entry(us=float(m)))
    t.set(key(n=1024, m=4096), entry())

    def near(m, **kw):
        found = t.nearest(key(m=m, **kw))
        return None if found is None else found[0].m_bucket

    assert near(16) == 16  # exact hit
    assert near(2) == 1
    assert near(4) == 1  # 4 is two doublings from 1 and from 16: tie -> smaller
    assert near(8) == 16
    assert near(64) == 16  # tie between 16 and 256 -> smaller
    assert near(128) == 256
    assert near(16384) == 256
    assert near(1, n=1024) == 4096
    assert near(16, layout="s16") is None and near(16, k=8192) is None
    assert t.nearest(key(m=64))[1]["median_us"] == 16.0
    t.set(key(m=64), entry())  # the index follows updates
    assert near(64) == 64 and near(32) == 16


# ---------------------------------------------------------------- saving and merging


def test_save_merges_with_disk(tmp_path):
    path = tmp_path / "t.json"
    filled_table([key(m=1), key(m=2)]).save(path)
    mine = TuningTable.load(path, SIG)
    other = TuningTable.load(path, SIG)
    other.set(key(m=2), entry(us=99.0))  # someone else re-tunes M=2 and adds M=4
    other.set(key(m=4), entry(us=4.0))
    other.save(path)
    mine.set(key(m=1), entry(us=1.0))  # we re-tune M=1 and add M=8
    mine.set(key(m=8), entry(us=8.0))
    mine.save(path)
    final = TuningTable.load(path, SIG)
    assert {k.m_bucket: e["median_us"] for k, e in final.entries.items()} == {
        1: 1.0, 2: 99.0, 4: 4.0, 8: 8.0}
    assert dict(mine.entries) == dict(final.entries)


def test_save_replaces_a_foreign_table_with_a_warning(tmp_path):
    path = tmp_path / "t.json"
    foreign = filled_table([key(m=1)])
    foreign.signature = H100
    foreign.save(path)
    ours = filled_table([key(m=2)])
    with pytest.warns(HybridGemmTableWarning, match="tuned elsewhere"):
        ours.save(path)
    final = TuningTable.load(path, SIG, strict=True)
    assert [k.m_bucket for k in final.entries] == [2]


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


def _writer(path, sig, worker, count, barrier):
    from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry

    table = TuningTable.load(path, sig)
    barrier.wait()
    for i in range(count):
        k = TableKey("linear", "bf16", "bias", 64 * (worker + 1), 4096, 1 << i, "c")
        table.set(k, make_entry("cublaslt", {"w": worker, "i": i}, median_us=1.0 + i,
                                spread_us=0.0, tuned_at="2026-11-29"))
        table.save(path)


def test_concurrent_writers_lose_no_entries(tmp_path):
    path, workers, count = tmp_path / "shared.json", 8, 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_writer, args=(str(path), SIG, w, count, barrier))
             for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * workers
    final = TuningTable.load(path, SIG, strict=True)
    assert len(final) == workers * count
    assert {(e["config"]["w"], e["config"]["i"]) for e in final.entries.values()} == {
        (w, i) for w in range(workers) for i in range(count)}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------- locations, precedence


def test_user_table_path_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "c"))
    assert user_table_path() == tmp_path / "c" / "table.json"
    monkeypatch.delenv("HYBRIDGEMM_CACHE_DIR")
    p = user_table_path()
    assert p.name == "table.json" and "hybridgemm" in str(p.parent)


def test_precedence_explicit_over_user_over_shipped(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()

    def write(path, marks, sig=SIG):
        t = TuningTable(sig)
        for m, us in marks.items():
            t.set(key(m=m), entry(us=us))
        t.save(path)

    write(shipped / "h200.json", {1: 100.0, 2: 100.0, 4: 100.0})
    write(shipped / "h100.json", {1: 500.0, 8: 500.0}, sig=H100)  # skipped quietly
    write(user_table_path(), {2: 200.0, 4: 200.0})
    write(tmp_path / "mine.json", {4: 300.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = load_tables(SIG, tmp_path / "mine.json", shipped_dir=shipped)
    assert {k.m_bucket: e["median_us"] for k, e in t.entries.items()} == {
        1: 100.0, 2: 200.0, 4: 300.0}
    assert t.signature == SIG and len(t.sources) == 3
    # Without a device signature, shipped tables are skipped and the rest read unchecked.
    assert {k.m_bucket for k in load_tables(None, shipped_dir=shipped).entries} == {2, 4}


def test_foreign_user_table_and_missing_explicit_path_warn(tmp_path):
    t = filled_table([key(m=1)])
    t.signature = H100
    t.save(user_table_path())
    with pytest.warns(HybridGemmTableWarning) as rec:
        merged = load_tables(SIG, tmp_path / "missing.json", shipped_dir=tmp_path)
    messages = [str(w.message) for w in rec]
    assert len(messages) == 2
    assert "gpu_name" in messages[0] and "does not exist" in messages[1]
    assert len(merged) == 0


def test_shipped_tables_are_valid():
    for path in shipped_table_paths():
        TuningTable.load(path, strict=True)
    assert all(p.suffix == ".json" for p in shipped_table_paths())
    assert shipped_table_paths(Path("/nonexistent")) == []


# ---------------------------------------------------------------- signatures


def test_signature_rules():
    assert validate_signature(SIG) is None
    assert signature_matches(SIG, dict(SIG)) == (True, "")
    # Informational fields may differ: a patch release or a torch upgrade keeps the table.
    assert signature_matches(SIG, {**SIG, "torch_version": "2.12", "package_version": "0.1.1"})[0]
    for field, value in [("gpu_name", "NVIDIA H100"), ("compute_capability", "9.1"),
                         ("sm_count", 114), ("cublaslt_version", None),
                         ("triton_version", "3.7.0"), ("kernel_abi", KERNEL_ABI + 1),
                         ("schema", 2)]:
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
    assert sig["package_version"] == hybridgemm.__version__ and sig["schema"] == T.SCHEMA_VERSION
    sig["gpu_name"] = "mutated"  # callers get copies; the cache is per device index
    assert current_signature(0)["gpu_name"] == "NVIDIA H200"
    current_signature(1)
    assert calls == [0, 1]
