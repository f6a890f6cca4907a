"""Table faults seen from the call path, on the CPU.

tests/test_table.py checks ``TuningTable.load``/``save`` against the fault catalogue (truncated
file, random bytes, wrong types, wrong schema, another GPU's table, concurrent writers). This
file checks what a *call* sees: the dispatcher's decision (``dispatch.choose``, rules 4-6)
with a faulty explicit or user table keeps working — it falls back to the size rule with
exactly one warning — and uses good entries next to bad ones; table entries whose config no
longer validates; a missing or read-only cache directory; readers during eight concurrent
tuners (never a torn file, never an entry lost); and that a table can never execute code.

No GPU is needed: the device signature, the device limits and the Triton backends'
availability are faked as on an H200 (``fake_h200``); nothing is launched.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import json
import multiprocessing
import os
import pickle
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_table import BAD_FILES, SIG, _writer, entry, filled_table, key

import hybridgemm.autotune_cache.table as T
from hybridgemm import backends, dispatch
from hybridgemm.autotune_cache import signature
from hybridgemm.autotune_cache.table import HybridGemmTableWarning, TableKey, TableWriteError, TuningTable, make_entry
from hybridgemm.kernels import cublaslt
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

# A device no shipped table matches (so only the tables a test writes are in play).
FAKE_SIG = {**SIG, "gpu_name": "hybridgemm test GPU"}
H200_LIMITS = {"smem_limit": 232448, "capability": (9, 0)}
M, N, K = 16, 384, 512
PROBLEM = Problem(m=M, n=N, k=K, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True), ldx=K, ldw=K, ldo=N)
KEY = TableKey.from_problem(PROBLEM)

SPLITK_RECORD = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4,
                 "num_warps": 4, "num_stages": 3}
GEMM_RECORD = {"kind": "triton_gemm", "block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 4,
               "num_stages": 3, "persistent": True, "use_tma": True, "epilogue_subtile": False}


@pytest.fixture
def fake_h200(monkeypatch, tmp_path):
    """The dispatcher's decision path as on an H200 with Triton (and without cuBLASLt, which
    needs a real device), reading tables from ``tmp_path`` only."""
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HYBRIDGEMM_TABLE", raising=False)
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: dict(FAKE_SIG))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(backends, "_device_limits", lambda index: dict(H200_LIMITS))
    monkeypatch.setattr(backends, "_num_sms", lambda index: 132)
    monkeypatch.setattr(cublaslt, "is_available", lambda: False)  # also on a GPU machine (alltests)
    real = backends.get_backend

    def get_backend(name):
        be = real(name)
        return dataclasses.replace(be, available=lambda: name != "cublaslt")

    monkeypatch.setattr(backends, "get_backend", get_backend)
    monkeypatch.setattr(dispatch, "_warned", set())  # the dispatcher warns once per key per process
    dispatch.set_table_path(None)
    yield tmp_path
    dispatch.set_table_path(None)


def _table(path, entries, sig=FAKE_SIG):
    t = TuningTable(sig)
    for k, e in entries.items():
        t.set(k, e)
    t.save(path)
    return path


def _choose_three_times(path=None):
    """Three decisions for PROBLEM (the third after reloading the tables, as a long-running
    process that calls ``reload_tables`` would): (choices, warnings raised)."""
    if path is not None:
        dispatch.set_table_path(path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        choices = [dispatch.choose(PROBLEM, 0), dispatch.choose(PROBLEM, 0)]
        dispatch.reload_tables()
        choices.append(dispatch.choose(PROBLEM, 0))
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
    path = _table(fake_h200 / "good.json", {KEY: make_entry("triton_splitk", SPLITK_RECORD, median_us=9.0,
                                                             spread_us=0.1)})
    choices, rec = _choose_three_times(path)
    assert not [str(w.message) for w in rec]
    for c in choices:
        assert (c.backend, c.source) == ("triton_splitk", "table")
        assert c.config.split_k == 4 and c.config.block_k == 128


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("case", sorted(BAD_FILES) + ["another-gpu"])
def test_bad_explicit_table_falls_back_with_one_warning(fake_h200, case):
    path = fake_h200 / f"{case}.json"
    if case == "another-gpu":  # valid, but tuned on an H100: its entry must not be used
        _table(path, {KEY: make_entry("triton_gemm", GEMM_RECORD, median_us=1.0, spread_us=0.1)},
               sig={**FAKE_SIG, "gpu_name": "NVIDIA H100 80GB HBM3"})
    else:
        path.write_bytes(BAD_FILES[case]())
    choices, rec = _choose_three_times(path)
    assert [c.source for c in choices] == ["rule"] * 3
    assert all(c.backend == "triton_splitk" for c in choices)  # the size rule at M = 16 without cuBLASLt
    msgs = _table_warnings(rec)
    assert len(msgs) == 1 and str(path) in msgs[0], msgs
    assert not [str(w.message) for w in rec if not issubclass(w.category, HybridGemmTableWarning)]


@pytest.mark.parametrize("case", ["truncated", "random-bytes", "pickle", "future-schema", "another-gpu"])
def test_bad_user_table_falls_back_with_one_warning(fake_h200, case):
    user = fake_h200 / "user-cache" / "table.json"
    user.parent.mkdir(parents=True)
    if case == "another-gpu":
        _table(user, {KEY: make_entry("triton_gemm", GEMM_RECORD, median_us=1.0, spread_us=0.1)},
               sig={**FAKE_SIG, "sm_count": 114})
    else:
        user.write_bytes(BAD_FILES[case]())
    choices, rec = _choose_three_times()
    assert [c.source for c in choices] == ["rule"] * 3
    msgs = _table_warnings(rec)
    assert len(msgs) == 1 and str(user) in msgs[0], msgs


def test_bad_entries_are_dropped_and_good_ones_still_used(fake_h200):
    """Valid JSON, wrong types in some entries: those are dropped (one warning for the file);
    the good entry next to them is still a table hit."""
    path = _table(fake_h200 / "partly-bad.json", {KEY: make_entry("triton_splitk", SPLITK_RECORD, median_us=9.0,
                                                                   spread_us=0.1)})
    doc = json.loads(path.read_text())
    good = doc["entries"][KEY.to_string()]
    doc["entries"][KEY.with_bucket(1).to_string()] = {**good, "median_us": "fast"}
    doc["entries"][KEY.with_bucket(2).to_string()] = {**good, "candidates": {}}
    doc["entries"]["linear|bf16|bias|N=384|K=512|M=3|c"] = good  # not a bucket
    path.write_text(json.dumps(doc))
    choices, rec = _choose_three_times(path)
    assert [(c.backend, c.source) for c in choices] == [("triton_splitk", "table")] * 3
    msgs = _table_warnings(rec)
    assert len(msgs) == 1 and "dropped 3 invalid entries" in msgs[0], msgs
    # the dropped M = 1 and M = 2 entries are not used for an M = 1 call: the tuned M = 16 is
    small = dataclasses.replace(PROBLEM, m=1)
    assert dispatch.choose(small, 0).source == "nearest"


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
}


@pytest.mark.parametrize("case", sorted(STALE))
def test_entry_whose_config_no_longer_validates(fake_h200, case):
    backend, record = STALE[case]
    path = _table(fake_h200 / "stale.json", {KEY: make_entry(backend, record, median_us=1.0, spread_us=0.1)})
    choices, rec = _choose_three_times(path)
    assert [c.source for c in choices] == ["rule"] * 3, [c.describe() for c in choices]
    assert all(c.backend == "triton_splitk" and c.config is not None for c in choices)
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
    assert [c.source for c in choices] == ["rule"] * 3
    assert not (fake_h200 / "no").exists(), "looking a table up must not create the cache directory"


def test_read_only_cache_dir_is_read_and_a_save_there_fails_cleanly(fake_h200, monkeypatch):
    cache = fake_h200 / "user-cache"
    user = _table(cache / "table.json", {KEY: make_entry("triton_splitk", SPLITK_RECORD, median_us=9.0,
                                                          spread_us=0.1)})
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
        tuner.set(KEY.with_bucket(1), make_entry("triton_splitk", SPLITK_RECORD, median_us=5.0, spread_us=0.1))

        def read_only_fs(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        with monkeypatch.context() as m:
            m.setattr(T.tempfile, "mkstemp", read_only_fs)
            with pytest.raises(TableWriteError, match="Read-only file system") as info:
                tuner.save(user)
        assert info.value.errno == errno.EROFS and str(user) in str(info.value)
        if os.geteuid() != 0:  # the real permissions, where they apply
            with pytest.raises(TableWriteError):
                tuner.save(user)
        assert user.read_bytes() == before, "a failed save must leave the table on disk as it was"
        assert not [p.name for p in cache.iterdir() if p.name.endswith(".tmp")]
        assert tuner.lookup(KEY.with_bucket(1))["median_us"] == 5.0  # the tuner's results are kept in memory
        assert dispatch.choose(PROBLEM, 0).source == "table"  # and calls go on
    finally:
        cache.chmod(0o755)
        user.chmod(0o644)


# ----------------------------------------------------------------------------- concurrent tuners


def test_readers_during_eight_concurrent_tuners_see_whole_tables(tmp_path, monkeypatch):
    """Eight processes save into one table (tests/test_table.py's writer) while this process
    keeps reading it strictly: every read is a complete, valid document (atomic replace), the
    number of entries never goes down (each save merges under the lock), and all 32 survive."""
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    path, workers, count = tmp_path / "shared.json", 8, 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_writer, args=(str(path), SIG, w, count, barrier)) for w in range(workers)]
    for p in procs:
        p.start()
    seen, reads, deadline = [], 0, time.time() + 180
    while any(p.is_alive() for p in procs) and time.time() < deadline:
        t = TuningTable.load(path, SIG, strict=True)  # raises TableError on a torn or partial file
        seen.append(len(t))
        reads += 1
        time.sleep(0.002)  # leave the (few) CPUs to the writers
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * workers
    final = TuningTable.load(path, SIG, strict=True)
    assert len(final) == workers * count
    assert seen == sorted(seen), f"an entry disappeared between two reads: {seen}"
    assert reads > 0


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
    payload = pickle.dumps({"schema": 1, "entries": _Canary(canary)})
    explicit = fake_h200 / "evil.json"
    explicit.write_bytes(payload)
    user = fake_h200 / "user-cache" / "table.json"
    user.parent.mkdir(parents=True)
    user.write_bytes(payload)
    # 2. JSON whose strings are code, in every place a value is read
    code = f"__import__('pathlib').Path({str(canary)!r}).touch()"
    doc = json.loads(filled_table([key()]).dumps())
    doc["signature"] = {**FAKE_SIG, "extra": code}
    doc["entries"][KEY.to_string()] = {**entry(), "backend": "triton_splitk",
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
    for module in ("table", "keys", "signature"):
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


# ----------------------------------------------------------------------------- nearest-bucket regime


def test_nearest_bucket_is_not_borrowed_across_the_decode_boundary(fake_h200):
    """A decode (split-K) entry is never borrowed for a prefill call, nor a large-M entry for
    a decode call: the size rule decides instead, and says why."""
    path = _table(fake_h200 / "regimes.json", {
        KEY: make_entry("triton_splitk", SPLITK_RECORD, median_us=9.0, spread_us=0.1),  # M bucket 16
        KEY.with_bucket(2048): make_entry("triton_gemm", GEMM_RECORD, median_us=90.0, spread_us=1.0),
    })
    dispatch.set_table_path(path)

    def choose(m):
        return dispatch.choose(dataclasses.replace(PROBLEM, m=m), 0)

    assert (choose(1).backend, choose(1).source) == ("triton_splitk", "nearest")
    assert (choose(64).backend, choose(64).source) == ("triton_splitk", "nearest")
    assert (choose(300).backend, choose(300).source) == ("triton_gemm", "nearest")  # bucket 512 -> 2048
    # bucket 128: log2-equidistant from 16 and 2048, the tie goes to the smaller bucket (16),
    # which is a decode entry: not borrowed
    c = choose(100)
    assert c.source == "rule" and "other side of M=64" in c.reason, c
    assert c.backend == "triton_gemm"  # the size rule above M = 64 (cuBLASLt is faked away)

    only_large = _table(fake_h200 / "large.json", {
        KEY.with_bucket(4096): make_entry("triton_gemm", GEMM_RECORD, median_us=90.0, spread_us=1.0)})
    dispatch.set_table_path(only_large)
    c = choose(8)
    assert c.source == "rule" and "other side of M=64" in c.reason and c.backend == "triton_splitk", c
