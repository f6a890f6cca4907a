"""Table faults seen from the call path, on the CPU.

tests/autotune_cache/test_table.py checks ``TuningTable.load``/``save`` against the fault catalogue (truncated
file, random bytes, wrong types, wrong schema, another GPU's table, concurrent writers). This
file checks what a *call* sees: the dispatcher's decision (``decide.choose``, rules 4-5)
with a faulty explicit or user table keeps working — it falls back to the fallback rule
(F.linear itself, never a pinned config) with exactly one warning — and
uses good entries next to bad ones; table entries whose config no longer validates; an entry
used for exactly the M range it was validated on and nowhere else; a schema-1 table read
through the call path; a missing or read-only cache directory; and that a table can never
execute code. (Readers during eight concurrent tuners: test_table.py.)

No GPU is needed: the device signature, the device limits and the Triton backends'
availability are faked as on an H200 (``fake_h200``); nothing is launched.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import errno
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from fake_device import FAKE_SIG, GEMM_RECORD, KEY, PROBLEM, SPLITK_RECORD, K, M, N, save_table, tuned
from tuning_tables import BAD_FILES, entry, filled_table, key, v1_doc, v1_entry

import hybridgemm.autotune_cache.table as T
import hybridgemm.autotune_cache.table_document as D
from hybridgemm import decide, explain
from hybridgemm.autotune_cache import signature
from hybridgemm.autotune_cache.table import HybridGemmTableWarning, TableWriteError, TuningTable
from hybridgemm.kernels import cublaslt

R257 = KEY.with_range(257, 512)  # linear|bf16|bias|N=384|K=512|M=257-512|c


def choose_at(m):
    return decide.choose(dataclasses.replace(PROBLEM, m=m), 0)


def miss(m, why="no table entry holds this M"):
    """The fallback rule's decision at M = ``m``, F.linear (hand-written, not asked of the dispatcher)."""
    return decide.Choice("torch", None, "rule", f"linear|bf16|bias|N={N}|K={K}|c at M={m}", f"{why}; F.linear")


def _choose_three_times(path=None):
    """Three decisions for PROBLEM (the third after reloading the tables, as a long-running
    process that calls ``reload_tables`` would): (choices, warnings raised)."""
    if path is not None:
        decide.set_table_path(path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        choices = [decide.choose(PROBLEM, 0), decide.choose(PROBLEM, 0)]
        decide.reload_tables()
        choices.append(decide.choose(PROBLEM, 0))
    return choices, rec


def _table_warnings(rec):
    return [str(w.message) for w in rec if issubclass(w.category, HybridGemmTableWarning)]


def _rejection_warnings(rec):
    return [str(w.message) for w in rec
            if issubclass(w.category, RuntimeWarning) and "cannot be used" in str(w.message)]


# ----------------------------------------------------------------------------- control


def test_a_good_table_is_used(fake_h200):
    """The control for everything below: with a valid table the entry runs (so a fallback in
    the other tests is the fault's doing, not the harness's)."""
    path = save_table(fake_h200 / "good.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)})
    choices, rec = _choose_three_times(path)
    assert not [str(w.message) for w in rec]
    for c in choices:
        assert (c.backend, c.source, c.key, c.m_lo, c.m_hi, c.worst_ratio) == (
            "triton_splitk", "table", "linear|bf16|bias|N=384|K=512|M=9-16|c", 9, 16, 1.1)
        assert c.config.split_k == 4 and c.config.block_k == 128


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("case", sorted(BAD_FILES) + ["another-gpu"])
def test_bad_explicit_table_falls_back_with_one_warning(fake_h200, case):
    path = fake_h200 / f"{case}.json"
    if case == "another-gpu":  # valid, but tuned on an H100: its entry must not be used
        save_table(path, {KEY: tuned("triton_gemm", GEMM_RECORD, us=1.0)},
                   sig={**FAKE_SIG, "gpu_name": "NVIDIA H100 80GB HBM3"})
    else:
        path.write_bytes(BAD_FILES[case]())
    choices, rec = _choose_three_times(path)
    assert choices == [miss(M)] * 3  # F.linear: the fallback rule
    msgs = _table_warnings(rec)
    assert len(msgs) == 1 and str(path) in msgs[0], msgs
    assert not [str(w.message) for w in rec if not issubclass(w.category, HybridGemmTableWarning)]


@pytest.mark.parametrize("case", ["truncated", "random-bytes", "pickle", "future-schema", "another-gpu"])
def test_bad_user_table_falls_back_with_one_warning(fake_h200, case):
    user = fake_h200 / "user-cache" / "table.json"
    user.parent.mkdir(parents=True)
    if case == "another-gpu":
        save_table(user, {KEY: tuned("triton_gemm", GEMM_RECORD, us=1.0)}, sig={**FAKE_SIG, "sm_count": 114})
    else:
        user.write_bytes(BAD_FILES[case]())
    choices, rec = _choose_three_times()
    assert choices == [miss(M)] * 3
    msgs = _table_warnings(rec)
    assert len(msgs) == 1 and str(user) in msgs[0], msgs


def test_bad_entries_are_dropped_and_good_ones_still_used(fake_h200):
    """Valid JSON, wrong types in some entries: those are dropped (one warning for the file);
    the good entry next to them is still a table hit."""
    path = save_table(fake_h200 / "partly-bad.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)})
    doc = json.loads(path.read_text())
    good = doc["entries"][KEY.to_string()]
    one = {**good, "m_points": [1], "ratios": [1.1]}
    doc["entries"][KEY.with_range(1, 1).to_string()] = {**one, "median_us": "fast"}
    doc["entries"][KEY.with_range(2, 2).to_string()] = {**one, "m_points": [2], "candidates": {}}
    doc["entries"]["linear|bf16|bias|N=384|K=512|M=3|c"] = one  # a schema-1 key in a schema-2 table
    doc["entries"][KEY.with_range(17, 32).to_string()] = good  # its m_points (9, 16) are not its range
    doc["entries"][KEY.with_range(33, 64).to_string()] = {**good, "m_points": [33, 64], "worst_ratio": 1.2}
    path.write_text(json.dumps(doc))
    choices, rec = _choose_three_times(path)
    assert [(c.backend, c.source) for c in choices] == [("triton_splitk", "table")] * 3
    msgs = _table_warnings(rec)
    assert len(msgs) == 1 and "dropped 5 invalid entries" in msgs[0], msgs
    # the dropped entries are not used, and the good 9-16 entry is not borrowed for their Ms
    assert [choose_at(m) for m in (1, 2, 3, 20, 40)] == [miss(m) for m in (1, 2, 3, 20, 40)]


# ----------------------------------------------------------------------------- stale entries


STALE = {
    # tuned when the kernel allowed it; now needs more shared memory than an H200 has
    "too-much-shared-memory": ("triton_gemm", {**GEMM_RECORD, "block_m": 256, "block_n": 256, "block_k": 256,
                                               "num_stages": 8}),
    "field-with-wrong-type": ("triton_splitk", {**SPLITK_RECORD, "block_m": "16"}),
    "field-out-of-range": ("triton_splitk", {**SPLITK_RECORD, "block_n": 48}),
    "field-removed": ("triton_splitk", {k: v for k, v in SPLITK_RECORD.items() if k != "num_stages"}),
    "field-added-by-a-newer-version": ("triton_splitk", {**SPLITK_RECORD, "swizzle": 2}),
    "record-of-the-other-kernel": ("triton_gemm", SPLITK_RECORD),
    "split-k-past-the-blocks-of-k": ("triton_splitk", {**SPLITK_RECORD, "split_k": 64}),
    "unknown-backend": ("cutlass", SPLITK_RECORD),
    "backend-unavailable-here": ("cublaslt", {"kind": "cublaslt", "cublaslt_version": 130100}),
    "heuristic-unavailable-here": ("cublaslt", {}),
}


@pytest.mark.parametrize("case", sorted(STALE))
def test_entry_whose_config_no_longer_validates(fake_h200, case):
    backend, record = STALE[case]
    path = save_table(fake_h200 / "stale.json", {KEY: tuned(backend, record, us=1.0)})
    choices, rec = _choose_three_times(path)
    assert choices == [miss(M, "table entry rejected")] * 3, [c.describe() for c in choices]
    msgs = _rejection_warnings(rec)
    assert len(msgs) == 1 and KEY.to_string() in msgs[0], [str(w.message) for w in rec]
    assert not _table_warnings(rec)  # the file itself is fine


# ----------------------------------------------------------------------------- cache directory


def test_missing_cache_dir_is_silent_and_not_created(fake_h200, monkeypatch):
    missing = fake_h200 / "no" / "such" / "dir"
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(missing))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choices, _ = _choose_three_times()
    assert choices == [miss(M)] * 3
    assert not (fake_h200 / "no").exists(), "looking a table up must not create the cache directory"


def test_read_only_cache_dir_is_read_and_a_save_there_fails_cleanly(fake_h200, monkeypatch):
    cache = fake_h200 / "user-cache"
    user = save_table(cache / "table.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)})
    before = user.read_bytes()
    user.chmod(0o444)
    cache.chmod(0o555)
    try:
        choices, rec = _choose_three_times()
        assert [(c.backend, c.source) for c in choices] == [("triton_splitk", "table")] * 3
        assert not [str(w.message) for w in rec]
        # A tuner saving there. As root the permissions do not stop a write, so the read-only
        # file system is simulated too (EROFS from the temp file), whoever runs the test.
        tuner = TuningTable.load(user, FAKE_SIG, strict=True)
        tuner.set(KEY.with_range(1, 8), tuned("triton_splitk", SPLITK_RECORD, KEY.with_range(1, 8), us=5.0))

        def read_only_fs(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        with monkeypatch.context() as m:
            m.setattr(D.tempfile, "mkstemp", read_only_fs)
            with pytest.raises(TableWriteError, match="Read-only file system") as info:
                tuner.save(user)
        assert info.value.errno == errno.EROFS and str(user) in str(info.value)
        if os.geteuid() != 0:  # the real permissions, where they apply
            with pytest.raises(TableWriteError):
                tuner.save(user)
        assert user.read_bytes() == before, "a failed save must leave the table on disk as it was"
        assert not [p.name for p in cache.iterdir() if p.name.endswith(".tmp")]
        assert tuner.lookup(KEY.with_range(1, 8))["median_us"] == 5.0  # the tuner's results are kept in memory
        assert decide.choose(PROBLEM, 0).source == "table"  # and calls go on
    finally:
        cache.chmod(0o755)
        user.chmod(0o644)


# ----------------------------------------------------------------------------- no code runs


class _Canary:
    """Unpickling this creates ``path`` (what a table that could run code would do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_table_never_executes_code(fake_h200):
    canary = fake_h200 / "canary"
    # 1. a pickle whose loading would create the canary, as the explicit and the user table
    payload = pickle.dumps({"schema": 2, "entries": _Canary(canary)})
    explicit = fake_h200 / "evil.json"
    explicit.write_bytes(payload)
    user = fake_h200 / "user-cache" / "table.json"
    user.parent.mkdir(parents=True)
    user.write_bytes(payload)
    # 2. JSON whose strings are code, in every place a value is read
    code = f"__import__('pathlib').Path({str(canary)!r}).touch()"
    doc = json.loads(filled_table([key()]).dumps())
    doc["signature"] = {**FAKE_SIG, "extra": code}
    doc["entries"][KEY.to_string()] = {**entry(lo=KEY.m_lo, hi=KEY.m_hi), "backend": "triton_splitk",
                                       "config": {**SPLITK_RECORD, "block_m": code}, "tuned_at": "2026-11-29"}
    code_json = fake_h200 / "code.json"
    code_json.write_text(json.dumps(doc))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for path in (explicit, code_json):
            _choose_three_times(path)
            TuningTable.load(path, FAKE_SIG)
            TuningTable.load(path)
    assert not canary.exists(), "loading a table ran code from it"
    pickle.loads(payload)["entries"].close()  # the payload is live: loading it the unsafe way
    assert canary.exists()  # creates the canary, so the check above can fail
    # 3. and the readers have no way to: no pickle/marshal/yaml import, no eval/exec/compile
    for module in ("table", "table_entries", "table_document", "table_locations", "keys", "signature"):
        src = (Path(T.__file__).parent / f"{module}.py").read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                bad = {n.split(".")[0] for n in names if n} & {"pickle", "marshal", "shelve", "dill", "yaml",
                                                               "importlib", "runpy"}
                assert not bad, f"autotune_cache/{module}.py imports {bad}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"eval", "exec", "compile", "__import__"}, \
                    f"autotune_cache/{module}.py calls {node.func.id}()"


# ----------------------------------------------------------------------------- the range rule


def test_an_entry_is_used_only_inside_its_range(fake_h200):
    """Rule 4 uses the entry whose range holds M, at both edges; one M outside (either side)
    goes to the fallback rule: nothing is borrowed from a neighbouring range, so a decode
    (split-K) entry never runs a prefill call nor a prefill entry a decode call."""
    path = save_table(fake_h200 / "ranges.json", {
        KEY: tuned("triton_splitk", SPLITK_RECORD),  # 9-16
        R257: tuned("triton_gemm", GEMM_RECORD, R257, us=90.0, m_points=[257, 363, 512], ratios=[1.2, 1.05, 1.3]),
    })
    decide.set_table_path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m in (257, 300, 363, 512):
            c = choose_at(m)
            assert (c.backend, c.source, c.key, c.m_lo, c.m_hi, c.worst_ratio) == (
                "triton_gemm", "table", "linear|bf16|bias|N=384|K=512|M=257-512|c", 257, 512, 1.05), m
            assert (c.config.block_m, c.config.block_n, c.config.persistent) == (64, 128, True)
        for m in (9, 16):
            assert (choose_at(m).backend, choose_at(m).source) == ("triton_splitk", "table")
        for m in (1, 8, 17, 64, 256, 513, 2048, 16384, 16385):
            assert choose_at(m) == miss(m), m


def test_a_halved_range_sends_each_half_to_its_own_entry(fake_h200):
    low, high = KEY.with_range(257, 363), KEY.with_range(364, 512)
    path = save_table(fake_h200 / "halves.json", {
        low: tuned("triton_gemm", GEMM_RECORD, low, ratios=[1.2, 1.15]),
        high: tuned("torch", {}, high, ratios=[1.0, 1.0]),  # F.linear itself won the upper half
    })
    decide.set_table_path(path)
    for m in (257, 363):
        c = choose_at(m)
        assert (c.backend, c.source, c.m_lo, c.m_hi, c.worst_ratio) == ("triton_gemm", "table", 257, 363, 1.15)
    for m in (364, 512):
        assert choose_at(m) == decide.Choice(
            "torch", None, "table", "linear|bf16|bias|N=384|K=512|M=364-512|c",
            "tuned for M 364-512, timed at M=364,512: worst 1.000x F.linear's speed there; runs F.linear",
            364, 512, 1.0)
    assert choose_at(256) == miss(256) and choose_at(513) == miss(513)


def test_the_reason_names_the_range_the_points_and_the_worst_ratio(fake_h200, monkeypatch):
    path = save_table(fake_h200 / "reason.json", {
        R257: tuned("triton_gemm", GEMM_RECORD, R257, m_points=[257, 363, 512], ratios=[1.25, 0.987, 1.1])})
    decide.set_table_path(path)
    c = choose_at(300)
    assert c.reason == "tuned for M 257-512, timed at M=257,363,512: worst 0.987x F.linear's speed there"
    assert "M 257-512" in c.reason and "0.987x" in c.reason and c.worst_ratio == 0.987
    assert c.describe().startswith("triton_gemm [") and c.describe().endswith(f"(table: {c.reason})")
    # explain() prints the same, given a (faked) device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    text = explain((3, 100, K), (N, K), "bf16")
    assert text.splitlines()[0] == f"linear bf16 M=300 N={N} K={K} epilogue=bias"
    assert "key linear|bf16|bias|N=384|K=512|M=257-512|c" in text
    assert "runs triton_gemm [" in text and "tuned for M 257-512" in text and "worst 0.987x" in text
    miss_text = explain((513, K), (N, K), "bf16")
    assert "at M=513" in miss_text and "runs torch (rule: no table entry holds this M; F.linear)" in miss_text


# ----------------------------------------------------------------------------- with cuBLASLt present


def test_a_miss_runs_f_linear_even_where_cublaslt_is_available(fake_h200_lt):
    """Rule 5 is F.linear itself: not a pinned config, and not cuBLASLt's heuristic either
    (measured slower than F.linear for some shapes; see ``decide.fallback_rule``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [choose_at(m) for m in (1, 16, 300, 16384)] == [miss(m) for m in (1, 16, 300, 16384)]
        assert choose_at(300).describe() == "torch (rule: no table entry holds this M; F.linear)"


def test_a_cublaslt_heuristic_entry(fake_h200_lt, monkeypatch):
    """A cuBLASLt entry with config {} is its heuristic at the call's exact M (config None);
    where cuBLASLt cannot take the problem, it is rejected with one warning, not run."""
    path = save_table(fake_h200_lt / "heuristic.json", {KEY: tuned("cublaslt", {}, ratios=[1.02, 1.01])})
    choices, rec = _choose_three_times(path)
    assert not [str(w.message) for w in rec]
    assert choices == [decide.Choice(
        "cublaslt", None, "table", KEY.to_string(),
        "tuned for M 9-16, timed at M=9,16: worst 1.010x F.linear's speed there", 9, 16, 1.01)] * 3
    assert choices[0].describe().startswith("cublaslt [heuristic at the exact M] (table: tuned for M 9-16")
    assert choose_at(17) == miss(17)  # and only inside 9-16
    monkeypatch.setattr(cublaslt, "supports", lambda problem: (False, "no algorithm for these alignments"))
    choices, rec = _choose_three_times()
    assert choices == [miss(M, "table entry rejected")] * 3
    msgs = _rejection_warnings(rec)
    assert len(msgs) == 1 and "no algorithm for these alignments" in msgs[0], msgs


def test_a_stale_entry_falls_back_to_f_linear_with_cublaslt_present(fake_h200_lt):
    backend, record = STALE["too-much-shared-memory"]
    path = save_table(fake_h200_lt / "stale.json", {KEY: tuned(backend, record)})
    choices, rec = _choose_three_times(path)
    assert choices == [miss(M, "table entry rejected")] * 3
    assert len(_rejection_warnings(rec)) == 1


# ----------------------------------------------------------------------------- schema 1 in the call path


def test_a_schema_1_table_serves_only_the_ms_it_was_timed_at(fake_h200):
    prefix = f"linear|bf16|bias|N={N}|K={K}|"
    path = fake_h200 / "v1.json"
    path.write_bytes(v1_doc({
        prefix + "M=16|c": v1_entry(9.0, 12.0, config=SPLITK_RECORD),  # 1.333x: kept for M = 16
        prefix + "M=512|c": v1_entry(90.0, 135.0, "triton_gemm", GEMM_RECORD),  # 1.5x: kept for M = 512
        prefix + "M=64|c": v1_entry(9.0, config=SPLITK_RECORD),  # no ratio recorded: dropped
        prefix + "M=256|c": v1_entry(90.0, 80.0, "triton_gemm", GEMM_RECORD),  # 0.889x: dropped
    }, sig={**FAKE_SIG, "schema": 1}))
    choices, rec = _choose_three_times(path)
    assert [(c.backend, c.source, c.key, c.m_lo, c.m_hi, c.worst_ratio) for c in choices] == [
        ("triton_splitk", "table", "linear|bf16|bias|N=384|K=512|M=16-16|c", 16, 16, 1.333)] * 3
    assert choices[0].reason == "tuned for M 16-16, timed at M=16: worst 1.333x F.linear's speed there"
    msgs = _table_warnings(rec)
    assert len(msgs) == 1 and str(path) in msgs[0] and "kept 2 of 4" in msgs[0], msgs
    assert [str(w.message) for w in rec if not issubclass(w.category, HybridGemmTableWarning)] == []
    c = choose_at(512)
    assert (c.backend, c.source, c.m_lo, c.m_hi) == ("triton_gemm", "table", 512, 512)
    for m in (15, 17, 9, 64, 256, 257, 511, 513):  # the octave around a one-M entry is not its range
        assert choose_at(m) == miss(m), m


def test_tables_that_cannot_be_loaded_leave_every_call_on_f_linear(fake_h200, monkeypatch):
    """A device whose signature cannot be read: one warning, the fallback for every problem,
    and nothing retried per call."""
    calls = []

    def broken(device_index=None):
        calls.append(device_index)
        raise RuntimeError("driver query failed")

    monkeypatch.setattr(signature, "current_signature", broken)
    decide.reload_tables()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = [choose_at(m) for m in (16, 16, 300)]
    assert got == [miss(16), miss(16), miss(300)]
    assert len(calls) == 1 and len([w for w in rec if "not loaded" in str(w.message)]) == 1
