"""Hostile tuning tables: files no tuner wrote, read through both entry points.

Every case of the corpus is loaded through ``TuningTable.load(path, SIG)`` and through
``load_tables(SIG, explicit_path=path)``, each on a fresh path (a file that is not a valid
table twice: the second load must not warn again), in a worker thread that must finish within
``HANG_S`` (a blocking read fails the test instead of hanging the run). Each load must return
a ``TuningTable`` holding exactly the entries expected (none, or the valid ones), and raise at
most one ``HybridGemmTableWarning`` naming the path; ``strict=True`` must raise
``TableError`` (never another type) for every case that is not a valid table.

Also here: the CPU time of a load grows linearly with the table (many shapes, or many entries
of one shape), truncation of a small valid table at every byte offset, unreadable files (real
permissions, and ``os.open`` failing, so the branch runs as root too), a file swapped
between ``stat`` and ``open``, the read bound, saving over hostile files, each file read once
per ``load_tables``, and the removal of stale temp files by ``save``.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from tuning_tables import SIG

import hybridgemm.autotune_cache.table as T
import hybridgemm.autotune_cache.table_document as D
from hybridgemm.autotune_cache.table import (
    MAX_TABLE_BYTES,
    HybridGemmTableWarning,
    TableError,
    TableKey,
    TableWriteError,
    TuningTable,
    load_tables,
    make_entry,
)

# A hang guard: the largest table allowed loads in ~1 s on a quiet 2-core machine (a few seconds
# on a busy one); a load still running after this is blocked (a FIFO, /dev/zero): the test fails.
HANG_S = 300.0
GOOD = TableKey("linear", "bf16", "bias", 6144, 4096, 257, 512, "c")  # the valid entry next to bad ones
BAD = "linear|bf16|bias|N=2|K=1|M=257-512|c"  # another shape: a bad entry here overlaps nothing
DIGITS = "9" * 5000  # more digits than Python's int/str conversion limit (4300) by default
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"  # set the terminal title, clear the screen, red
NO_DIGIT_LIMIT = getattr(sys, "get_int_max_str_digits", lambda: 0)() == 0


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))  # missing: silent


def good_entry(lo=257, hi=512, **config):
    return make_entry("triton_splitk", config or {"split": 4}, m_points=[lo, hi], ratios=[1.25, 1.5],
                      median_us=10.0, spread_us=0.1, flinear_us=15.0, tuned_at="2026-11-29",
                      candidates=[{"backend": "cublaslt", "config": {"algo": [1, 2, 3]}, "median_us": 12.0,
                                   "spread_us": 0.2}])


def doc_text(entries=None, signature=None, **top) -> str:
    """A schema-2 document with GOOD's valid entry plus ``entries`` (key text -> value)."""
    d = {"schema": 2, "signature": SIG if signature is None else signature,
         "entries": {GOOD.to_string(): good_entry(), **(entries or {})}, **top}
    return json.dumps(d, indent=1)


def same_path(p, path) -> bool:
    """Whether the argument ``p`` of an os function names ``path`` (not a file descriptor)."""
    return isinstance(p, (str, bytes, os.PathLike)) and os.fsdecode(p) == str(path)


def with_bad(**changes):
    """A document holding GOOD's entry and one bad entry: GOOD's fields with ``changes``."""
    return doc_text({BAD: {**good_entry(), **changes}})


def table_warnings(records):
    return [str(w.message) for w in records if issubclass(w.category, HybridGemmTableWarning)]


def bounded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a worker thread: (result, exception). Fails the test if it is
    still running after HANG_S (the thread is left blocked, a daemon)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed back to the test thread
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_S)
    if worker.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {HANG_S} s: it blocked")
    return box.get("value"), box.get("error")


def release(path: Path) -> None:
    """Unblock a reader stuck opening a FIFO (if the code under test ever blocks on one)."""
    try:
        if stat.S_ISFIFO(os.lstat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def check(tmp_path: Path, name: str, make, kept=frozenset(), valid=False) -> None:
    """The corpus contract for one case (module docstring). ``make(path)`` creates the file;
    ``kept``: the entries both loads must return; ``valid``: a table that loads without a
    warning (strict too)."""
    shipped = tmp_path / "no-shipped-tables"  # only the case's file in play
    shipped.mkdir(exist_ok=True)
    loaders = {
        "load": lambda p: TuningTable.load(p, SIG),
        "load_tables": lambda p: load_tables(SIG, explicit_path=p, shipped_dir=shipped),
    }
    for how, load in loaders.items():
        path = tmp_path / how / name  # a fresh path per loader: the warn-once memory hides nothing
        path.parent.mkdir(exist_ok=True)
        make(path)
        try:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                for attempt in range(1 if valid else 2):  # the second load of a bad file must not warn again
                    table, error = bounded(load, path)
                    assert error is None, f"{how} raised {error!r}"
                    assert isinstance(table, TuningTable) and table.signature == SIG
                    assert set(table.entries) == set(kept), (how, attempt, sorted(map(str, table.entries))[:4])
            msgs = table_warnings(rec)
            assert len(msgs) == (0 if valid else 1), (how, msgs)
            assert len(rec) == len(msgs), [str(w.message) for w in rec]  # nothing else is warned
            assert all(str(path) in m for m in msgs), msgs
            assert not any("\x1b" in m for m in msgs), "a warning must not carry raw terminal escapes"
            if how == "load":
                table, error = bounded(TuningTable.load, path, SIG, strict=True)
                if valid:
                    assert error is None and set(table.entries) == set(kept)
                else:
                    assert isinstance(error, TableError), f"strict raised {error!r}, not TableError"
                    assert str(path) in str(error)
        finally:
            release(path)


# ----------------------------------------------------------------------------- the corpus


def _write(data):
    """``make`` for a file holding ``data`` (bytes or text, or a function giving them: built
    when the case runs)."""
    def make(path):
        d = data() if callable(data) else data
        path.write_bytes(d.encode("utf-8") if isinstance(d, str) else d)
    return make


def _fifo(path):
    os.mkfifo(path)


def _dev_zero(path):
    path.symlink_to("/dev/zero")


def _directory(path):
    path.mkdir()


def _over_cap(path):
    with open(path, "wb") as f:  # sparse: no 16 MiB written
        f.truncate(MAX_TABLE_BYTES + 1)


def _many_shapes_text(n: int) -> bytes:
    """A canonical valid table of ``n`` entries, each its own shape."""
    e = good_entry()
    return T.dump_document(SIG, {TableKey("linear", "bf16", "bias", 100000 + i, 4096, 257, 512, "c"): e
                                 for i in range(n)}).encode()


def _entries_under_the_cap() -> int:
    """How many entries ``_many_shapes_text`` fits in MAX_TABLE_BYTES - 1 bytes."""
    base, one = len(_many_shapes_text(0)), len(_many_shapes_text(2)) - len(_many_shapes_text(1))
    return (MAX_TABLE_BYTES - 1 - base) // one


@functools.cache
def _near_cap_text() -> bytes:
    """A canonical valid table of MAX_TABLE_BYTES - 1 bytes: as many entries as fit (each its own
    shape), padded with trailing whitespace."""
    data = _many_shapes_text(_entries_under_the_cap())
    assert len(data) <= MAX_TABLE_BYTES - 1
    data = data[:-1] + b" " * (MAX_TABLE_BYTES - 1 - len(data)) + b"\n"
    assert len(data) == MAX_TABLE_BYTES - 1
    return data


def _near_cap(path):
    path.write_bytes(_near_cap_text())


def _near_cap_keys():
    return {TableKey.from_string(k) for k in json.loads(_near_cap_text())["entries"]}


def _one_m_entries_one_shape(count: int = 16384) -> str:
    """``count`` valid one-M entries of a single shape (M = 1 to ``count``; 16384: every M)."""
    e = {"backend": "torch", "config": {}, "m_points": [1], "ratios": [1.0], "worst_ratio": 1.0, "median_us": 1.0,
         "spread_us": 0.0, "candidates": [], "tuned_at": "2026-11-29"}
    entries = {f"linear|bf16|bias|N=8|K=8|M={m}-{m}|c": {**e, "m_points": [m]} for m in range(1, count + 1)}
    return json.dumps({"schema": 2, "signature": SIG, "entries": entries}, separators=(",", ":"))


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


_HUGE_INT_KEPT = frozenset({GOOD}) if NO_DIGIT_LIMIT else frozenset()  # parsed (and dropped) or unparsable

EMPTY = frozenset()
KEPT = frozenset({GOOD})

# name -> (make(path), the entries loaded, whether it is a valid table)
CORPUS = {
    # not regular files: rejected from their stat, never opened for a blocking read
    "fifo": (_fifo, EMPTY, False),
    "symlink-to-dev-zero": (_dev_zero, EMPTY, False),
    "directory": (_directory, EMPTY, False),
    # size
    "16-MiB-plus-one-byte-sparse": (_over_cap, EMPTY, False),
    "empty-file": (_write(b""), EMPTY, False),
    "whitespace-only": (_write(b" \n\t\n"), EMPTY, False),
    "more-entries-than-a-table-holds": (_write(lambda: json.dumps(
        {"schema": 2, "signature": SIG, "entries": {f"k{i}": 0 for i in range(T.MAX_TABLE_ENTRIES + 1)}})),
        EMPTY, False),
    # huge numbers
    "5000-digit-int-in-a-key": (_write(doc_text({f"linear|bf16|bias|N={DIGITS}|K=1|M=257-512|c": good_entry()})),
                                KEPT, False),
    "5000-digit-int-in-median_us": (_write(with_bad(median_us="@INT@").replace('"@INT@"', DIGITS)),
                                    _HUGE_INT_KEPT, False),
    "5000-digit-int-in-ratios": (_write(with_bad(ratios=[1.25, "@INT@"]).replace('"@INT@"', DIGITS)),
                                 _HUGE_INT_KEPT, False),
    "5000-digit-int-in-m_points": (_write(with_bad(m_points=[257, "@INT@"]).replace('"@INT@"', DIGITS)),
                                   _HUGE_INT_KEPT, False),
    "5000-digit-int-in-the-signature": (_write(doc_text(signature={**SIG, "sm_count": "@INT@"})
                                               .replace('"@INT@"', DIGITS)), EMPTY, False),
    "400-digit-int-in-median_us": (_write(with_bad(median_us="@INT@").replace('"@INT@"', "9" * 400)), KEPT, False),
    "1e400-in-median_us": (_write(with_bad(median_us="@F@").replace('"@F@"', "1e400")), EMPTY, False),
    "-1e400-in-ratios": (_write(with_bad(ratios=[1.25, "@F@"]).replace('"@F@"', "-1e400")), EMPTY, False),
    "1e400-in-a-config": (_write(with_bad(config={"split": "@F@"}).replace('"@F@"', "1e400")), EMPTY, False),
    "1e400-in-a-signature-extra-field": (_write(doc_text(signature={**SIG, "x": "@F@"}).replace('"@F@"', "1e400")),
                                         EMPTY, False),
    "NaN-constant": (_write(with_bad(median_us="@F@").replace('"@F@"', "NaN")), EMPTY, False),
    "Infinity-constant": (_write(with_bad(median_us="@F@").replace('"@F@"', "-Infinity")), EMPTY, False),
    "1e-400-underflows-to-zero": (_write(with_bad(ratios=[1.25, "@F@"]).replace('"@F@"', "1e-400")), KEPT, False),
    # nesting
    "100000-open-brackets": (_write(b"[" * 100000), EMPTY, False),
    "100000-deep-array-in-an-entry": (_write(with_bad(config="@N@").replace('"@N@"', _nested(100000))), EMPTY, False),
    "500-deep-array-in-a-config": (_write(with_bad(config={"a": "@N@"}).replace('"@N@"', _nested(500))), KEPT, False),
    "500-deep-array-in-median_us": (_write(with_bad(median_us="@N@").replace('"@N@"', _nested(500))), KEPT, False),
    "500-deep-array-as-schema": (_write(doc_text().replace('"schema": 2', '"schema": ' + _nested(500))),
                                 EMPTY, False),
    "500-deep-array-in-the-signature": (_write(doc_text(signature={**SIG, "x": "@N@"})
                                               .replace('"@N@"', _nested(500))), EMPTY, False),
    "nested-object-in-a-config": (_write(with_bad(config={"a": {"b": 1}})), KEPT, False),
    # encodings
    "utf-8-bom": (_write(b"\xef\xbb\xbf" + doc_text().encode()), KEPT, True),
    "two-utf-8-boms": (_write(b"\xef\xbb\xbf" * 2 + doc_text().encode()), EMPTY, False),
    "utf-16": (_write(doc_text().encode("utf-16")), EMPTY, False),
    "latin-1-byte-in-a-string": (_write(with_bad(tuned_at="@S@").encode().replace(b'"@S@"', b'"caf\xe9"')),
                                 EMPTY, False),
    "0xff-bytes": (_write(doc_text().encode().replace(b'"triton_splitk"', b'"\xff\xfe"', 1)), EMPTY, False),
    "overlong-utf-8": (_write(doc_text().encode().replace(b"triton_splitk", b"\xc0\xaf", 1)), EMPTY, False),
    "utf-8-encoded-surrogate": (_write(doc_text().encode().replace(b"triton_splitk", b"\xed\xa0\x80", 1)),
                                EMPTY, False),
    "lone-surrogate-escape-in-a-config": (_write(with_bad(config={"note": "\ud800"})), KEPT, False),
    "lone-low-surrogate-escape-in-a-candidate": (_write(with_bad(candidates=[
        {"backend": "torch", "config": {"note": "x\udfff"}, "median_us": 1.0, "spread_us": 0.0}])), KEPT, False),
    "lone-surrogate-escape-in-a-key": (_write(doc_text({"linear|bf16|bias|N=2|K=1|M=257-512|\ud800": good_entry()})),
                                       KEPT, False),
    "lone-surrogate-escape-in-the-signature": (_write(doc_text(signature={**SIG, "gpu_name": "\udc80"})), EMPTY, False),
    "lone-surrogate-escape-in-a-signature-extra-field": (_write(doc_text(signature={**SIG, "x\ud800": 1})),
                                                         EMPTY, False),
    "surrogate-pair-escape-is-text": (_write(doc_text({"linear|bf16|bias|N=2|K=1|M=257-512|c": good_entry(
        note="\U0001F600")})), KEPT | {TableKey.from_string(BAD)}, True),
    # terminal escape sequences: data, loaded as data; never raw in a message
    "terminal-escapes-in-a-config": (_write(doc_text({BAD: good_entry(note=ESC)})),
                                     KEPT | {TableKey.from_string(BAD)}, True),
    "terminal-escapes-in-a-key": (_write(doc_text({BAD.replace("|c", "|" + ESC): good_entry()})), KEPT, False),
    "terminal-escapes-in-a-backend": (_write(with_bad(backend=ESC)), KEPT, False),
    "terminal-escapes-in-tuned_at": (_write(with_bad(tuned_at=ESC)), KEPT, False),
    "terminal-escapes-as-schema": (_write(doc_text().replace('"schema": 2', '"schema": ' + json.dumps(ESC))),
                                   EMPTY, False),
    "terminal-escapes-as-a-top-level-name": (_write(doc_text(**{ESC: 1})), EMPTY, False),
    "terminal-escapes-in-the-gpu-name": (_write(doc_text(signature={**SIG, "gpu_name": ESC})), EMPTY, False),
    # duplicate names: an ambiguous document
    "duplicate-entry-key": (_write(doc_text().replace('"entries": {', '"entries": {' + json.dumps(GOOD.to_string())
                                                      + ": {},", 1)), EMPTY, False),
    "duplicate-top-level-name": (_write(doc_text().replace('"schema": 2', '"schema": 2, "schema": 2')),
                                 EMPTY, False),
    "duplicate-name-in-a-config": (_write(doc_text().replace('"split": 4', '"split": 4, "split": 8', 1)),
                                   EMPTY, False),
    # many entries
    "valid-table-just-under-the-cap": (_near_cap, None, True),  # kept: every entry (filled in below)
    "16384-one-M-entries-of-one-shape": (_write(_one_m_entries_one_shape), None, True),
}


WRONG_TYPES = {
    # the document (whole file ignored)
    "top-level-list": ('[{"schema": 2}]', EMPTY),
    "top-level-string": ('"table"', EMPTY),
    "top-level-number": ("2", EMPTY),
    "top-level-null": ("null", EMPTY),
    "top-level-true": ("true", EMPTY),
    "schema-string": (doc_text().replace('"schema": 2', '"schema": "2"'), EMPTY),
    "schema-float": (doc_text().replace('"schema": 2', '"schema": 2.0'), EMPTY),
    "schema-true": (doc_text().replace('"schema": 2', '"schema": true'), EMPTY),
    "schema-null": (doc_text().replace('"schema": 2', '"schema": null'), EMPTY),
    "schema-object": (doc_text().replace('"schema": 2', '"schema": {"v": 2}'), EMPTY),
    "signature-list": (doc_text(signature=[SIG]), EMPTY),
    "signature-string": (doc_text(signature="NVIDIA H200"), EMPTY),
    "signature-empty": (doc_text(signature={}), EMPTY),
    "signature-gpu-name-int": (doc_text(signature={**SIG, "gpu_name": 200}), EMPTY),
    "signature-sm-count-string": (doc_text(signature={**SIG, "sm_count": "132"}), EMPTY),
    "signature-sm-count-bool": (doc_text(signature={**SIG, "sm_count": True}), EMPTY),
    "signature-cc-float": (doc_text(signature={**SIG, "compute_capability": 9.0}), EMPTY),
    "signature-extra-object": (doc_text(signature={**SIG, "x": {"y": 1}}), EMPTY),
    "entries-list": (json.dumps({"schema": 2, "signature": SIG, "entries": [good_entry()]}), EMPTY),
    "entries-string": (json.dumps({"schema": 2, "signature": SIG, "entries": "x"}), EMPTY),
    "entries-null": (json.dumps({"schema": 2, "signature": SIG, "entries": None}), EMPTY),
    # one entry (that entry dropped, GOOD kept)
    "entry-list": (doc_text({BAD: [good_entry()]}), KEPT),
    "entry-string": (doc_text({BAD: "entry"}), KEPT),
    "entry-number": (doc_text({BAD: 1}), KEPT),
    "entry-null": (doc_text({BAD: None}), KEPT),
    "backend-int": (with_bad(backend=1), KEPT),
    "backend-null": (with_bad(backend=None), KEPT),
    "backend-list": (with_bad(backend=["torch"]), KEPT),
    "config-list": (with_bad(config=[4]), KEPT),
    "config-string": (with_bad(config="split=4"), KEPT),
    "config-null": (with_bad(config=None), KEPT),
    "config-list-of-objects": (with_bad(config={"algo": [{"id": 1}]}), KEPT),
    "m_points-object": (with_bad(m_points={"257": 512}), KEPT),
    "m_points-string": (with_bad(m_points="257-512"), KEPT),
    "m_points-floats": (with_bad(m_points=[257.0, 512.0]), KEPT),
    "m_points-bools": (with_bad(m_points=[True, 512]), KEPT),
    "m_points-nested": (with_bad(m_points=[[257], 512]), KEPT),
    "ratios-object": (with_bad(ratios={"a": 1.5}), KEPT),
    "ratios-string": (with_bad(ratios="1.25,1.5"), KEPT),
    "ratios-null-item": (with_bad(ratios=[None, 1.5]), KEPT),
    "ratios-nested": (with_bad(ratios=[[1.25], 1.5]), KEPT),
    "worst_ratio-string": (with_bad(worst_ratio="1.25"), KEPT),
    "worst_ratio-list": (with_bad(worst_ratio=[1.25]), KEPT),
    "median_us-string": (with_bad(median_us="fast"), KEPT),
    "median_us-bool": (with_bad(median_us=True), KEPT),
    "median_us-object": (with_bad(median_us={}), KEPT),
    "spread_us-null": (with_bad(spread_us=None), KEPT),
    "flinear_us-string": (with_bad(flinear_us="x"), KEPT),
    "candidates-object": (with_bad(candidates={}), KEPT),
    "candidates-string": (with_bad(candidates="x"), KEPT),
    "candidates-ints": (with_bad(candidates=[1]), KEPT),
    "candidate-backend-int": (with_bad(candidates=[{"backend": 1, "config": {}, "median_us": 1.0,
                                                    "spread_us": 0.0}]), KEPT),
    "candidate-null": (with_bad(candidates=[None]), KEPT),
    "tuned_at-int": (with_bad(tuned_at=20261129), KEPT),
    "tuned_at-null": (with_bad(tuned_at=None), KEPT),
    "tuned_at-list": (with_bad(tuned_at=["2026-11-29"]), KEPT),
    "tuned_at-not-a-date": (with_bad(tuned_at="2026-13-45"), KEPT),
    "key-not-canonical": (doc_text({"linear|bf16|bias|N=02|K=1|M=257-512|c": good_entry()}), KEPT),
    "key-empty": (doc_text({"": good_entry()}), KEPT),
    "key-schema-1-form": (doc_text({"linear|bf16|bias|N=2|K=1|M=512|c": good_entry()}), KEPT),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_hostile_table(tmp_path, case):
    make, kept, valid = CORPUS[case]
    if case == "symlink-to-dev-zero" and not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    if kept is None:  # the many-entries cases: every entry loads
        kept = _near_cap_keys() if case.startswith("valid-table") else {
            TableKey("linear", "bf16", "bias", 8, 8, m, m, "c") for m in range(1, 16385)}
    check(tmp_path, case, make, kept, valid)


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrong_types(tmp_path, case):
    text, kept = WRONG_TYPES[case]
    check(tmp_path, case, _write(text), kept)


# ----------------------------------------------------------------------------- the work of a load

GROWTH = 8  # the larger table of each pair holds GROWTH times the entries (and bytes) of the smaller


def _load_cpu_seconds(path: Path, shipped: Path, entries: int) -> float:
    """CPU seconds this process spends loading ``path`` through both entry points (each load
    checked to hold all ``entries``): CPU time, not wall-clock, so that other processes on the
    machine do not count, the least of three tries."""
    tries = []
    for _ in range(3):
        start = time.process_time()
        assert len(TuningTable.load(path, SIG, strict=True)) == entries
        assert len(load_tables(SIG, explicit_path=path, shipped_dir=shipped)) == entries
        tries.append(time.process_time() - start)
    return min(tries)


@pytest.mark.parametrize("layout", ["entries-of-many-shapes", "one-M-entries-of-one-shape"])
def test_load_work_grows_linearly_with_the_table(tmp_path, layout):
    """A table GROWTH times larger costs about GROWTH times the CPU time to load (7-11x measured
    on a 2-core machine, busy or not); work that grows faster than the file (a quadratic parse, an
    overlap check comparing every pair of one shape's entries, a merge that rescans the table per
    entry) costs up to GROWTH**2 times as much. The bound, 3 * GROWTH, sits between the two. Many
    shapes: a quarter of the largest table allowed and a thirty-second; one shape: every M (16384
    one-M entries) and an eighth of them."""
    if layout == "entries-of-many-shapes":
        big = _entries_under_the_cap() // 4
        make = _many_shapes_text
    else:
        big = 16384
        make = _one_m_entries_one_shape
    shipped = tmp_path / "no-shipped-tables"
    shipped.mkdir()
    seconds = {}
    for n in (big // GROWTH, big):
        path = tmp_path / f"{n}.json"
        data = make(n)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        seconds[n] = _load_cpu_seconds(path, shipped, n)
    ratio = seconds[big] / seconds[big // GROWTH]
    assert ratio < 3 * GROWTH, f"{GROWTH}x the entries took {ratio:.1f}x the CPU time to load: {seconds}"


def test_every_bad_entry_at_once_is_one_warning(tmp_path):
    """All the entry-level wrong types in one document: the good entry is kept, one warning
    for the file counts them."""
    entries = {}
    for i, (name, (text, kept)) in enumerate(sorted(WRONG_TYPES.items())):
        if kept == KEPT and not name.startswith("key-"):
            entries[f"linear|bf16|bias|N={100 + i}|K=1|M=257-512|c"] = json.loads(text)["entries"][BAD]
    path = tmp_path / "all-bad.json"
    path.write_text(doc_text(entries))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        table = TuningTable.load(path, SIG)
        TuningTable.load(path, SIG)
    msgs = table_warnings(rec)
    assert len(msgs) == 1 and f"dropped {len(entries)} invalid entries" in msgs[0], msgs
    assert set(table.entries) == {GOOD}


def test_terminal_escapes_are_kept_as_data(tmp_path):
    path = tmp_path / "esc.json"
    path.write_text(doc_text({BAD: good_entry(note=ESC)}))
    table = TuningTable.load(path, SIG, strict=True)
    assert table.lookup(TableKey.from_string(BAD))["config"] == {"note": ESC}
    table.save(path)  # and written back as JSON escapes, byte for byte the same data
    assert b"\x1b" not in path.read_bytes()
    assert TuningTable.load(path, SIG, strict=True).lookup(TableKey.from_string(BAD))["config"] == {"note": ESC}


def test_a_bom_is_skipped_and_not_written_back(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + doc_text().encode())
    table = TuningTable.load(path, SIG, strict=True)
    assert set(table.entries) == {GOOD}
    table.save(path)
    assert not path.read_bytes().startswith(b"\xef\xbb\xbf")


# ----------------------------------------------------------------------------- truncation


def test_truncation_at_every_byte_offset(tmp_path):
    """Every prefix of a small valid table: never raises, at most one warning per path (a
    fresh path per prefix and loader), strict raises TableError or loads the whole table."""
    t = TuningTable(SIG)
    t.set(GOOD, good_entry())
    t.set(GOOD.with_range(1, 1), make_entry("torch", {}, m_points=[1], ratios=[1.0], median_us=2.0, spread_us=0.0,
                                            tuned_at="2026-11-29"))
    data = t.dumps().encode()
    full = set(t.entries)
    shipped = tmp_path / "no-shipped"
    shipped.mkdir()
    for i in range(len(data) + 1):
        prefix = data[:i]
        whole = prefix.strip() == data.strip()
        for how in ("load", "load_tables"):
            path = tmp_path / f"{how}-{i}.json"
            path.write_bytes(prefix)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                for _ in range(2):
                    if how == "load":
                        table = TuningTable.load(path, SIG)
                    else:
                        table = load_tables(SIG, explicit_path=path, shipped_dir=shipped)
                    assert set(table.entries) == (full if whole else set()), i
            assert len(table_warnings(rec)) == (0 if whole else 1), (i, how, table_warnings(rec))
        try:
            strict = TuningTable.load(tmp_path / f"load-{i}.json", SIG, strict=True)
        except TableError:
            assert not whole, i
        else:
            assert whole and set(strict.entries) == full, i


# ----------------------------------------------------------------------------- how files are read


def _assert_ignored(path, reason):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert len(TuningTable.load(path, SIG)) == 0
        assert len(load_tables(SIG, explicit_path=path, shipped_dir=path.parent / "none")) == 0
    msgs = table_warnings(rec)
    assert len(msgs) == 1 and str(path) in msgs[0] and reason in msgs[0], msgs
    with pytest.raises(TableError, match=re.escape(reason)):
        TuningTable.load(path, SIG, strict=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions (the os.open test covers the branch)")
def test_unreadable_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(doc_text())
    path.chmod(0)
    try:
        _assert_ignored(path, "Permission denied")
    finally:
        path.chmod(0o644)


def test_unreadable_file_simulated(tmp_path, monkeypatch):
    """``os.open`` failing with EACCES (what chmod 000 gives a user; root is not refused)."""
    path = tmp_path / "t.json"
    path.write_text(doc_text())
    real_open = os.open

    def refuse(file, flags, *args, **kwargs):
        if same_path(file, path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(T.os, "open", refuse)
    _assert_ignored(path, "Permission denied")
    # a save does not replace a table it could not read: it fails, and the file is kept
    before = path.read_bytes()
    t = TuningTable(SIG)
    t.set(GOOD.with_range(1, 1), make_entry("torch", {}, m_points=[1], ratios=[1.0], median_us=2.0, spread_us=0.0))
    with pytest.raises(TableWriteError, match="Permission denied") as info:
        t.save(path)
    assert info.value.errno == errno.EACCES and path.read_bytes() == before


def test_the_file_is_opened_non_blocking_and_checked_again_after_open(tmp_path, monkeypatch):
    """A FIFO swapped in between the stat and the open: the open does not block (O_NONBLOCK),
    and the fstat of the opened file rejects it."""
    fifo = tmp_path / "swapped.json"
    os.mkfifo(fifo)
    regular = tmp_path / "regular.json"
    regular.write_text(doc_text())
    real_stat = os.stat
    opened = []
    real_open = os.open

    def stat_sees_a_regular_file(p, *args, **kwargs):
        return real_stat(regular if same_path(p, fifo) else p, *args, **kwargs)

    def record_open(file, flags, *args, **kwargs):
        if same_path(file, fifo):
            opened.append(flags)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(T.os, "stat", stat_sees_a_regular_file)
    monkeypatch.setattr(T.os, "open", record_open)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            table, error = bounded(TuningTable.load, fifo, SIG)
        assert error is None and len(table) == 0
        msgs = table_warnings(rec)
        assert len(msgs) == 1 and "FIFO" in msgs[0], msgs
        assert opened and all(f & os.O_NONBLOCK and f & os.O_CLOEXEC for f in opened)
        _, error = bounded(TuningTable.load, fifo, SIG, strict=True)
        assert isinstance(error, TableError) and "FIFO" in str(error)
    finally:
        release(fifo)


def test_an_oversized_file_is_not_opened(tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    _over_cap(path)
    opened = []
    real_open = os.open
    monkeypatch.setattr(T.os, "open", lambda f, *a, **k: (opened.append(os.fsdecode(f)), real_open(f, *a, **k))[1])
    _assert_ignored(path, f"larger than a table may be ({MAX_TABLE_BYTES} bytes)")
    assert str(path) not in opened  # rejected from its size: never opened, nothing read


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_at_most_cap_plus_one_bytes_are_read(tmp_path, monkeypatch):
    """A regular file whose size says 0 but that reads on (a /proc file): cut off after the
    cap + 1 bytes, and rejected."""
    path = tmp_path / "proc.json"
    path.symlink_to("/proc/self/maps")
    assert os.stat(path).st_size == 0 and len(Path("/proc/self/maps").read_bytes()) > 200
    monkeypatch.setattr(D, "MAX_TABLE_BYTES", 100)
    asked = []
    real_read = os.read
    monkeypatch.setattr(T.os, "read", lambda fd, n: (asked.append(n), real_read(fd, n))[1])
    _assert_ignored(path, "larger than a table may be (100 bytes)")
    assert asked and sum(asked) <= 3 * 101  # three loads, each asking for at most cap + 1 bytes in all


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-dev-zero", "directory"])
def test_saving_over_a_special_file_fails_cleanly(tmp_path, kind):
    """A table path that is not a regular file is not read and not replaced: the save raises
    TableWriteError (without blocking), and leaves it as it was."""
    path = tmp_path / "table.json"
    {"fifo": _fifo, "symlink-to-dev-zero": _dev_zero, "directory": _directory}[kind](path)
    before = os.lstat(path).st_mode
    t = TuningTable(SIG)
    t.set(GOOD, good_entry())
    try:
        _, error = bounded(t.save, path)
    finally:
        release(path)
    assert isinstance(error, TableWriteError) and "not a regular file" in str(error), repr(error)
    assert os.lstat(path).st_mode == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_saving_over_an_oversized_file_replaces_it_with_one_warning(tmp_path):
    path = tmp_path / "table.json"
    _over_cap(path)
    t = TuningTable(SIG)
    t.set(GOOD, good_entry())
    with pytest.warns(HybridGemmTableWarning, match="larger than a table may be.*replacing it"):
        t.save(path)
    assert set(TuningTable.load(path, SIG, strict=True).entries) == {GOOD}


def test_load_tables_reads_each_file_once_and_warns_once(tmp_path, monkeypatch):
    """The dispatcher calls load_tables once per device (and again after reload_tables): each
    call reads each table once, and a bad table warns once per process however often."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    ours = TuningTable(SIG)
    ours.set(GOOD, good_entry())
    ours.save(shipped / "a-ours.json")
    other = TuningTable({**SIG, "gpu_name": "NVIDIA H100 80GB HBM3"})
    other.set(GOOD, good_entry())
    other.save(shipped / "b-other-gpu.json")
    (shipped / "c-corrupt.json").write_bytes(b"{")
    (shipped / "d-dev-zero.json").symlink_to("/dev/zero")
    user = T.user_table_path()
    user.parent.mkdir(parents=True)
    user.write_bytes(b"\xef\xbb\xbf[")
    explicit = tmp_path / "explicit.json"
    os.mkfifo(explicit)
    reads: dict[str, int] = {}
    real = T._read_table_bytes

    def counting(path):
        reads[str(path)] = reads.get(str(path), 0) + 1
        return real(path)

    monkeypatch.setattr(T, "_read_table_bytes", counting)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for call in range(1, 4):
                merged, error = bounded(load_tables, SIG, explicit, shipped_dir=shipped)
                assert error is None
                assert set(merged.entries) == {GOOD}
                assert set(reads.values()) == {call}, reads  # every file once per call
        msgs = table_warnings(rec)
        bad = [shipped / "c-corrupt.json", shipped / "d-dev-zero.json", user, explicit]
        assert len(msgs) == len(bad), msgs
        for path in bad:
            assert sum(str(path) in m for m in msgs) == 1, (path, msgs)
    finally:
        release(explicit)


# ----------------------------------------------------------------------------- stale temp files


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_save_removes_only_its_own_stale_temp_files(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    table_path = cache / "table.json"
    stale = cache / ".table.json.abc.tmp"
    stale.write_text('{"schema": 2, "sig')  # what a killed writer leaves
    _age(stale, 120)
    stale_mkstemp = cache / ".table.json.x7_k2q9z.tmp"
    stale_mkstemp.write_text("")
    _age(stale_mkstemp, 61)
    fresh = cache / ".table.json.def.tmp"  # a writer at work right now
    fresh.write_text("")
    _age(fresh, 30)
    others = [".table.json.abc.tmp.bak", "table.json.abc.tmp", ".other.json.abc.tmp", ".table.json..tmp",
              ".table.json.v2.abc.tmp",  # table.json.v2's temp file, not ours
              ".table.json.abc.TMP", ".Table.json.abc.tmp", "keep.txt"]
    for name in others:
        (cache / name).write_text("not ours")
        _age(cache / name, 3600)
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    _age(target, 3600)
    link = cache / ".table.json.lnk.tmp"
    link.symlink_to(target)
    _age(link, 3600)
    dangling = cache / ".table.json.dng.tmp"
    dangling.symlink_to(tmp_path / "nowhere")
    _age(dangling, 3600)
    directory = cache / ".table.json.dir.tmp"
    directory.mkdir()
    (directory / "inside").write_text("x")
    _age(directory, 3600)

    before = {p.name for p in cache.iterdir()}
    t = TuningTable(SIG)
    t.set(GOOD, good_entry())
    t.save(table_path)

    assert {p.name for p in cache.iterdir()} == before - {stale.name, stale_mkstemp.name} | {
        "table.json", "table.json.lock"}  # and the save's own temp file is gone
    assert not stale.exists() and not stale_mkstemp.exists()
    assert fresh.exists()
    assert all((cache / name).read_text() == "not ours" for name in others)
    assert link.is_symlink() and target.read_text() == "keep me"
    assert dangling.is_symlink()
    assert (directory / "inside").read_text() == "x"
    assert set(TuningTable.load(table_path, SIG, strict=True).entries) == {GOOD}


@pytest.mark.parametrize("failing", ["scandir", "unlink", "lstat"])
def test_cleanup_errors_never_fail_a_save(tmp_path, monkeypatch, failing):
    stale = tmp_path / ".table.json.abc.tmp"
    stale.write_text("")
    _age(stale, 120)
    path = tmp_path / "table.json"
    if failing == "scandir":
        real = os.scandir

        def fake(p=".", *a):
            if same_path(p, tmp_path):
                raise PermissionError(errno.EACCES, "Permission denied", str(p))
            return real(p, *a)
        monkeypatch.setattr(T.os, "scandir", fake)
    elif failing == "unlink":
        real_unlink = os.unlink

        def fake_unlink(p, *a, **k):
            if same_path(p, stale):
                raise PermissionError(errno.EPERM, "Operation not permitted", str(p))
            return real_unlink(p, *a, **k)
        monkeypatch.setattr(T.os, "unlink", fake_unlink)
    else:  # the entry vanishes (another process cleaned it) between the listing and the stat
        real_scandir = os.scandir

        class Vanished:
            def __init__(self, entry):
                self.name, self.path = entry.name, entry.path

            def stat(self, follow_symlinks=True):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", self.path)

        class Listing:
            def __init__(self, p):
                self._it = real_scandir(p)

            def __enter__(self):
                return (Vanished(e) for e in self._it)

            def __exit__(self, *exc):
                self._it.close()

        monkeypatch.setattr(T.os, "scandir", lambda p=".": Listing(p) if same_path(p, tmp_path) else real_scandir(p))
    t = TuningTable(SIG)
    t.set(GOOD, good_entry())
    t.save(path)
    assert set(TuningTable.load(path, SIG, strict=True).entries) == {GOOD}
    assert stale.exists()  # not removed, and the save went through
