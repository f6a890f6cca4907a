"""The tuning table's exact rules (autotune_cache/table.py), pure CPU: the message of every
rejection (a warning names the file and this reason, so it must say what is wrong), the edge
values of every limit, the flags and names of the files a load opens and a save writes, and
which warnings a load or a save gives. tests/autotune_cache/test_table.py covers the API, and
tests/autotune_cache/test_table_hostile.py the hostile-file corpus.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import stat
import sys
import threading
import warnings
from pathlib import Path

import pytest
from filelock import FileLock
from tuning_tables import SIG, V1_ENTRIES, entry, key, v1_doc, v1_entry

import hybridgemm.autotune_cache.table as T
import hybridgemm.autotune_cache.table_document as D
import hybridgemm.autotune_cache.table_entries as E
import hybridgemm.autotune_cache.table_locations as L
from hybridgemm.autotune_cache.signature import validate_signature
from hybridgemm.autotune_cache.table import (
    HybridGemmTableWarning,
    TableError,
    TableKey,
    TableWriteError,
    TuningTable,
    load_tables,
    make_entry,
    normalize_entry,
    parse_document,
)

DIGIT_LIMIT = getattr(sys, "get_int_max_str_digits", lambda: 0)() != 0  # ints past it cannot be printed


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(D, "_warned", set())  # each test sees its own first warnings


def doc(entries=None, signature=None, schema=2, **top) -> bytes:
    return json.dumps({"schema": schema, "signature": SIG if signature is None else signature,
                       "entries": {} if entries is None else entries, **top}).encode()


def parse_error(data: bytes) -> str:
    with pytest.raises(TableError) as info:
        parse_document(data)
    return str(info.value)


def table_warnings(records) -> list[str]:
    return [str(w.message) for w in records if issubclass(w.category, HybridGemmTableWarning)]


def raw_entry(**changes) -> dict:
    """A valid entry for key()'s range 257-512 as plain JSON data, with ``changes``."""
    return {**json.loads(json.dumps(entry())), **changes}


def entry_error(value, k=None) -> str:
    with pytest.raises(TableError) as info:
        normalize_entry(value, k)
    return str(info.value)


# ---------------------------------------------------------------- whole documents


INT_LIMIT_TEXT = ("Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits; "
                  "use sys.set_int_max_str_digits() to increase the limit")
EXTRA_NAMES = {name: 1 for name in "abcdefg"}  # with entries, schema, signature: 10 names, 6 shown
DOCUMENT_ERRORS = [
    ("not-utf8", b'{"schema": 2, "x": "\xff"}', "not UTF-8 text"),
    ("duplicate-name", b'{"a": 1, "a": 2}', "not a table's JSON: the name 'a' appears twice in one object (ambiguous)"),
    ("duplicate-after-others", b'{"a": 1, "b": 2, "b": 3}',
     "not a table's JSON: the name 'b' appears twice in one object (ambiguous)"),
    ("deep", b"[" * 100_000, "not valid JSON (nested too deeply)"),
    ("syntax", b"{", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("nan", b"NaN", "not valid JSON (NaN is not allowed in a tuning table)"),
    ("infinity", b"[-Infinity]", "not valid JSON (-Infinity is not allowed in a tuning table)"),
    ("1e400", b"[1e400]", "not a table's JSON: the number 1e400 is out of range (not a finite double)"),
    ("long-number", b"[1" + b"0" * 50 + b"e400]",
     "not a table's JSON: the number 1" + "0" * 39 + " is out of range (not a finite double)"),
    ("list", b"[1, 2]", "top level is list, not an object"),
    ("string", b'"table"', "top level is str, not an object"),
    ("schema-3", doc(schema=3), "schema version 3; this hybridgemm reads 2 (and 1)"),
    ("schema-text", doc(schema="2"), "schema version '2'; this hybridgemm reads 2 (and 1)"),
    ("extra-names", doc(**EXTRA_NAMES),
     "top-level fields ['a', 'b', 'c', 'd', 'e', 'entries']; expected entries, schema, signature"),
    ("one-extra-name", doc(extra=1), "top-level fields ['entries', 'extra', 'schema', 'signature']; "
     "expected entries, schema, signature"),
    ("entries-list", doc(entries=[]), "entries is not an object"),
    ("surrogate-value", doc(signature={**SIG, "gpu_name": "\ud800"}),
     "signature field 'gpu_name' holds a lone surrogate (not Unicode text)"),
    ("surrogate-name", doc(signature={**SIG, "x\udfff": 1}),
     f"signature field {'x' + chr(0xdfff)!r} holds a lone surrogate (not Unicode text)"),
]


@pytest.mark.parametrize("data, message", [c[1:] for c in DOCUMENT_ERRORS], ids=[c[0] for c in DOCUMENT_ERRORS])
def test_document_rejections_say_why(data, message):
    assert parse_error(data) == message


@pytest.mark.skipif(not DIGIT_LIMIT, reason="this Python has no int digit limit")
def test_a_number_python_cannot_convert_is_reported_in_120_characters():
    assert INT_LIMIT_TEXT.startswith(str(pytest.raises(ValueError, json.loads, "9" * 5000).value)[:120])
    assert parse_error(b"[" + b"9" * 5000 + b"]") == f"not valid JSON ({INT_LIMIT_TEXT[:120]})"


def test_a_bad_signature_gives_the_signature_rule():
    bad = {**SIG, "sm_count": "132"}
    reason = validate_signature(bad)
    assert reason and parse_error(doc(signature=bad)) == reason


def test_a_signature_may_carry_finite_extra_numbers():
    parsed = parse_document(doc(signature={**SIG, "clock_ghz": 1.98, "boost": 2}))
    assert parsed.signature["clock_ghz"] == 1.98 and parsed.dropped == [] and parsed.note == ""


def test_the_entry_count_limit_is_exact(monkeypatch):
    monkeypatch.setattr(D, "MAX_TABLE_ENTRIES", 2)
    two = {key(1, 1).to_string(): entry(lo=1, hi=1), key(2, 2).to_string(): entry(lo=2, hi=2)}
    assert len(parse_document(doc(two)).entries) == 2
    three = {**two, key(3, 4).to_string(): entry(lo=3, hi=4)}
    assert parse_error(doc(three)) == "3 entries; a table holds at most 2"


def test_an_unexpected_failure_is_named():
    def boom(*a, **k):
        raise KeyError("boom")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "_parse_document", boom)
        assert parse_error(b"{}") == "cannot be parsed (KeyError: 'boom')"


# ---------------------------------------------------------------- entries inside a document


def test_ranges_that_share_one_m_overlap():
    low, high = key(1, 8), key(8, 16)
    parsed = parse_document(doc({low.to_string(): entry(lo=1, hi=8), high.to_string(): entry(lo=8, hi=16)}))
    assert list(parsed.entries) == [low]
    assert parsed.dropped == [f"{high.to_string()!r}: its M range overlaps {low.to_string()}"]
    apart = key(9, 16)
    parsed = parse_document(doc({low.to_string(): entry(lo=1, hi=8), apart.to_string(): entry(lo=9, hi=16)}))
    assert set(parsed.entries) == {low, apart} and parsed.dropped == []


def test_a_dropped_entry_names_its_key_in_120_characters():
    text = "linear|bf16|bias|N=6144|K=4096|M=257-512|" + "x" * 110
    parsed = parse_document(doc({text: entry()}))
    assert parsed.dropped == [f"{text[:120]!r}: bad layout class {'x' * 110!r}"]


def test_an_entry_failing_with_any_exception_is_dropped_with_its_type(monkeypatch):
    real = D._normalize

    def normalize(value, k):
        if k is not None and k.m_lo == 1:
            raise KeyError("boom")
        return real(value, k)

    monkeypatch.setattr(D, "_normalize", normalize)
    parsed = parse_document(doc({key(1, 1).to_string(): entry(lo=1, hi=1), key().to_string(): entry()}))
    assert list(parsed.entries) == [key()]
    assert parsed.dropped == [f"{key(1, 1).to_string()!r}: KeyError: 'boom'"]


def test_schema_1_note_counts_what_was_kept_and_dropped():
    parsed = parse_document(v1_doc(V1_ENTRIES))
    assert len(parsed.entries) == 2 and parsed.dropped == []
    assert parsed.note == ("schema-1 table: each entry was timed at one M only; kept 2 of 6 entries, each for "
                           "exactly the M it was timed at (4 without a recorded ratio to F.linear >= 0.97 "
                           "dropped); run `hybridgemm autotune --force` to tune whole M ranges")


V1_KEY = "linear|bf16|bias|N=6144|K=4096|M=16|c"


@pytest.mark.parametrize("value, reason", [
    ([1], "not a schema-1 entry"),
    ({**v1_entry(10.0, 12.0), "extra": 1}, "not a schema-1 entry"),
    (v1_entry("fast", 12.0), "median_us must be a number, got 'fast'"),
    (v1_entry(10.0, "x"), "flinear_us must be a number, got 'x'"),
    (v1_entry(10.0, -1.0), "flinear_us must be in [0, 1e+09], got -1.0"),
])
def test_schema_1_entry_rejections(value, reason):
    parsed = parse_document(v1_doc({V1_KEY: value}))
    assert parsed.entries == {} and parsed.dropped == [f"{V1_KEY!r}: {reason}"]


def test_schema_1_entry_slower_than_f_linear_is_unsafe_not_invalid():
    parsed = parse_document(v1_doc({V1_KEY: v1_entry(1.0, 0.5)}))  # 0.5x F.linear
    assert parsed.entries == {} and parsed.dropped == [] and "(1 without a recorded ratio" in parsed.note
    kept = parse_document(v1_doc({V1_KEY: v1_entry(8.0, 10.0)})).entries
    assert [(k.m_lo, k.m_hi, e["m_points"], e["ratios"]) for k, e in kept.items()] == [(16, 16, [16], [1.25])]


# ---------------------------------------------------------------- one entry


NINE_UNKNOWN = {f"u{i}": 1 for i in range(9)}
ENTRY_ERRORS = [
    ("not-object", [1], "entry must be an object, got list"),
    ("nine-unknown", raw_entry(**NINE_UNKNOWN),
     "entry fields: missing [], unknown ['u0', 'u1', 'u2', 'u3', 'u4', 'u5', 'u6', 'u7']"),
    ("missing", {k: v for k, v in raw_entry().items() if k != "tuned_at"},
     "entry fields: missing ['tuned_at'], unknown []"),
    ("backend", raw_entry(backend="Cu BLAS"), "backend must be a lowercase name, got 'Cu BLAS'"),
    ("config-list", raw_entry(config=[1]), "config must be an object, got list"),
    ("config-nested", raw_entry(config={"a": {"b": 1}}),
     "config values must be numbers, strings, booleans, null or lists of those"),
    ("median-text", raw_entry(median_us="fast"), "median_us must be a number, got 'fast'"),
    ("spread-negative", raw_entry(spread_us=-1), "spread_us must be in [0, 1e+09], got -1.0"),
    ("flinear-text", raw_entry(flinear_us="x"), "flinear_us must be a number, got 'x'"),
    ("median-int-top", raw_entry(median_us=10**12), "median_us is out of range: 1000000000000"),
    ("median-int-below-top", raw_entry(median_us=10**12 - 1), "median_us must be in [0, 1e+09], got 999999999999.0"),
    ("median-int-bottom", raw_entry(median_us=-10**12), "median_us is out of range: -1000000000000"),
    ("median-int-above-bottom", raw_entry(median_us=-10**12 + 1),
     "median_us must be in [0, 1e+09], got -999999999999.0"),
    ("median-past-max", raw_entry(median_us=10**9 + 1), "median_us must be in [0, 1e+09], got 1000000001.0"),
    ("worst-zero", raw_entry(worst_ratio=0), "worst_ratio must be in (0, 1000], got 0.0"),
    ("ratio-zero", raw_entry(ratios=[0.0, 1.5]), "ratios[] must be in (0, 1000], got 0.0"),
    ("ratio-past-max", raw_entry(ratios=[1000.5, 1.5]), "ratios[] must be in (0, 1000], got 1000.5"),
    ("points-65", raw_entry(m_points=list(range(1, 66)), ratios=[1.0] * 65, worst_ratio=1.0),
     "m_points must be a non-empty list (at most 64)"),
    ("points-empty", raw_entry(m_points=[], ratios=[]), "m_points must be a non-empty list (at most 64)"),
    ("points-order", raw_entry(m_points=[512, 257]), "m_points must be increasing ints in 1..16384, got [512, 257]"),
    ("ratios-count", raw_entry(ratios=[1.5]), "ratios must be a list with one ratio per m_point"),
    ("worst-not-least", raw_entry(worst_ratio=1.5), "worst_ratio 1.5 is not the least of ratios [1.25, 1.5]"),
    ("tuned-at-41", raw_entry(tuned_at="2026-11-29T12:34:56.12345+00:00:00.000000"),
     "tuned_at must be an ISO date string, got '2026-11-29T12:34:56.12345+00:00:00.000000'"),
    ("tuned-at-word", raw_entry(tuned_at="yesterday"), "tuned_at is not an ISO date: 'yesterday'"),
    ("tuned-at-lowercase-z", raw_entry(tuned_at="2026-11-29t10:00:00z"),
     "tuned_at is not an ISO date: '2026-11-29t10:00:00z'"),
    ("candidates-object", raw_entry(candidates={}), "candidates must be a list"),
    ("candidate-backend", raw_entry(candidates=[{"backend": "X", "config": {}, "median_us": 1, "spread_us": 0}]),
     "candidates[0].backend must be a lowercase name, got 'X'"),
    ("candidate-spread", raw_entry(candidates=[{"backend": "torch", "config": {}, "median_us": 1, "spread_us": -1}]),
     "candidates[0].spread_us must be in [0, 1e+09], got -1.0"),
    ("candidate-worst", raw_entry(candidates=[{"backend": "torch", "config": {}, "median_us": 1, "spread_us": 0,
                                               "worst_ratio": 0}]),
     "candidates[0].worst_ratio must be in (0, 1000], got 0.0"),
    ("set", raw_entry(config={"a": {1, 2}}), "entry is not JSON data: Object of type set is not JSON serializable"),
    ("nan", raw_entry(median_us=float("nan")),
     "entry is not JSON data: Out of range float values are not JSON compliant"),
    ("surrogate", raw_entry(config={"s": "\ud800"}),
     "entry is not JSON data: a string holds a lone surrogate (not Unicode text)"),
]


@pytest.mark.parametrize("value, message", [c[1:] for c in ENTRY_ERRORS], ids=[c[0] for c in ENTRY_ERRORS])
def test_entry_rejections_say_why(value, message):
    assert entry_error(value) == message


@pytest.mark.skipif(not DIGIT_LIMIT, reason="this Python has no int digit limit")
def test_a_number_too_long_to_print_is_shown_by_its_type():
    with pytest.raises(TableError) as info:  # make_entry checks the ratios it is given before anything
        make_entry("torch", {}, m_points=[1], ratios=[10**5000], median_us=1, spread_us=0)
    assert str(info.value) == "ratios[] is out of range: <int>"
    # inside an entry the JSON round trip refuses it first
    assert entry_error(raw_entry(median_us=10**5000)).startswith("entry is not JSON data: Exceeds the limit")


@pytest.mark.parametrize("changes, check", [
    ({"median_us": 10**9}, lambda e: e["median_us"] == 1e9),  # the top of [0, 1e9] is in
    ({"median_us": 200}, lambda e: e["median_us"] == 200.0),
    ({"median_us": 0}, lambda e: e["median_us"] == 0.0),  # a closed bottom for times
    ({"ratios": [1000, 1000.0], "worst_ratio": 1000}, lambda e: e["worst_ratio"] == 1000.0),
    ({"m_points": list(range(257, 321)) + [512], "ratios": [1.0] * 65, "worst_ratio": 1.0}, None),
    ({"m_points": [257, *range(450, 512), 512], "ratios": [1.0] * 64, "worst_ratio": 1.0},
     lambda e: len(e["m_points"]) == 64),
    ({"config": {"mix": ["a", 1, 1.5, True, None]}}, lambda e: e["config"] == {"mix": ["a", 1, 1.5, True, None]}),
    ({"tuned_at": "2026-11-29T12:34:56.1234+00:00:00.000000"}, lambda e: len(e["tuned_at"]) == 40),
    ({"tuned_at": "2026-11-29T10:00:00Z"}, lambda e: e["tuned_at"] == "2026-11-29T10:00:00Z"),
    ({"flinear_us": None}, lambda e: "flinear_us" not in e),
])
def test_entry_edges_that_are_valid(changes, check):
    value = raw_entry(**changes)
    if check is None:  # 65 points: one past the limit
        assert entry_error(value) == "m_points must be a non-empty list (at most 64)"
        return
    assert check(normalize_entry(value, key()))


def test_make_entry_checks_its_ratios_first():
    with pytest.raises(TableError) as info:
        make_entry("torch", {}, m_points=[1], ratios=[0], median_us=1, spread_us=0)
    assert str(info.value) == "ratios[] must be in (0, 1000], got 0.0"
    with pytest.raises(TableError) as info:  # no ratios at all: still a TableError, not min()'s ValueError
        make_entry("torch", {}, m_points=[], ratios=[], median_us=1, spread_us=0)
    assert str(info.value) == "m_points must be a non-empty list (at most 64)"


def test_table_constructor_and_set_check_keys_and_ranges():
    with pytest.raises(TypeError) as info:
        TuningTable(SIG, {"linear|bf16": entry()})
    assert str(info.value) == "keys must be TableKey, got str"
    with pytest.raises(TableError, match="do not span the key's range 1-8"):
        TuningTable(SIG, {key(1, 8): entry()})  # an entry timed at 257-512 for the range 1-8
    with pytest.raises(TypeError) as info:
        TuningTable(SIG).set("linear|bf16", entry())
    assert str(info.value) == "key must be a TableKey, got str"


# ---------------------------------------------------------------- reasons for exceptions and file kinds


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize("exc, reason", [
    (RecursionError("deep"), "nested too deeply"),
    (MemoryError(), "too large to hold in memory"),
    (KeyError("k"), "KeyError: 'k'"),
    (ValueError(), "ValueError"),
    (_Unprintable(), "_Unprintable"),
    (OSError("x" * 200), "OSError: " + "x" * 120),
])
def test_failure_reasons(exc, reason):
    assert T._failure(exc) == reason


@pytest.mark.parametrize("mode, kind", [
    (stat.S_IFDIR, "a directory"), (stat.S_IFIFO, "a FIFO (named pipe)"), (stat.S_IFSOCK, "a socket"),
    (stat.S_IFCHR, "a character device"), (stat.S_IFBLK, "a block device"), (stat.S_IFLNK, "not a regular file"),
])
def test_file_kinds(mode, kind):
    assert T._file_kind(mode | 0o644) == kind


def test_special_files_are_named_in_the_warning(tmp_path):
    sock_path = tmp_path / "socket.json"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(sock_path))
        fifo = tmp_path / "fifo.json"
        os.mkfifo(fifo)
        for path, kind in ((sock_path, "a socket"), (fifo, "a FIFO (named pipe)"), (tmp_path, "a directory"),
                           (Path(os.devnull), "a character device")):
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                TuningTable.load(path, SIG)
            assert table_warnings(rec) == [
                f"hybridgemm tuning table {path}: cannot be read: it is {kind}, not a regular file; ignoring it"]
    finally:
        sock.close()


# ---------------------------------------------------------------- reading a file


def test_a_table_is_opened_with_exactly_these_flags(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    TuningTable(SIG, {key(): entry()}).save(path)
    opened, real = [], os.open

    def spy(p, flags, *a, **k):
        if isinstance(p, (str, os.PathLike)) and os.fspath(p) == str(path):
            opened.append(flags)
        return real(p, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    assert len(TuningTable.load(path, SIG)) == 1
    want = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | getattr(os, "O_BINARY", 0)
    assert opened == [want]


def test_the_size_limit_is_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "MAX_TABLE_BYTES", 100)
    exact, over = tmp_path / "exact", tmp_path / "over"
    exact.write_bytes(b"x" * 100)
    over.write_bytes(b"x" * 101)
    assert T._read_table_bytes(exact) == b"x" * 100
    with pytest.raises(TableError) as info:
        T._read_table_bytes(over)
    assert str(info.value) == "is 101 bytes, larger than a table may be (100 bytes)"


def test_a_file_reading_past_its_size_is_cut_off_at_the_limit(monkeypatch):
    proc = Path("/proc/self/status")  # reports size 0, reads about a kilobyte
    if not proc.exists() or proc.stat().st_size != 0 or len(proc.read_bytes()) <= 101:
        pytest.skip("needs a /proc file that reports size 0")
    monkeypatch.setattr(D, "MAX_TABLE_BYTES", 100)
    with pytest.raises(TableError) as info:
        T._read_table_bytes(proc)
    assert str(info.value) == "is larger than a table may be (100 bytes)"


def test_a_table_larger_than_one_read_loads_whole(tmp_path):
    keys = [TableKey("linear", "bf16", "bias", n, 4096, 257, 512, "c") for n in range(1, 9)]
    table = TuningTable(SIG)
    for k in keys:
        table.set(k, entry(pad=list(range(25_000))))  # a long config list: few entries, many bytes
    path = tmp_path / "big.json"
    table.save(path)
    assert path.stat().st_size > 1 << 20  # more than one read of 1 MiB
    assert set(TuningTable.load(path, SIG, strict=True).entries) == set(keys)


def test_a_path_stat_cannot_follow_is_unreadable_with_its_errno(tmp_path):
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    with pytest.raises(T._Unreadable) as info:
        T._read_table_bytes(loop)
    assert info.value.errno == errno.ELOOP
    assert str(info.value) == f"cannot be read ([Errno {errno.ELOOP}] {os.strerror(errno.ELOOP)}: '{loop}')"
    with pytest.raises(TableWriteError) as info:  # a save never replaces what it could not read
        TuningTable(SIG, {key(): entry()}).save(loop)
    assert info.value.errno == errno.ELOOP


def test_an_open_that_fails_keeps_its_errno(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    TuningTable(SIG, {key(): entry()}).save(path)
    real = os.open

    def refuse(p, flags, *a, **k):
        if isinstance(p, (str, os.PathLike)) and os.fspath(p) == str(path) and not flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(p, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(T._Unreadable) as info:
        T._read_table_bytes(path)
    assert info.value.errno == errno.EACCES
    assert str(info.value) == f"cannot be read ([Errno {errno.EACCES}] Permission denied: '{path}')"
    with pytest.raises(TableWriteError) as info:
        TuningTable(SIG, {key(9, 16): entry(lo=9, hi=16)}).save(path)
    assert info.value.errno == errno.EACCES


# ---------------------------------------------------------------- writing a file


def test_save_writes_through_a_temp_file_of_ours_next_to_the_table(tmp_path, monkeypatch):
    path = tmp_path / "deep" / "er" / "table.json"  # missing parents are created
    replaced, real = [], os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((Path(src), Path(dst))), real(src, dst))[1])
    TuningTable(SIG, {key(): entry()}).save(path)
    [(src, dst)] = replaced
    assert dst == path and src.parent == path.parent
    assert re.fullmatch(r"\.table\.json\.[a-z0-9_]+\.tmp", src.name), src.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_bytes() == TuningTable.load(path, SIG).dumps().encode()


def test_save_and_dumps_need_a_signature(tmp_path):
    with pytest.raises(ValueError) as info:
        TuningTable(None).save(tmp_path / "t.json")
    assert str(info.value) == "a tuning table needs a device signature to be saved"
    with pytest.raises(ValueError) as info:
        TuningTable(None).dumps()
    assert str(info.value) == "a tuning table needs a device signature to be serialised"


def test_a_signature_json_cannot_hold_is_never_written(tmp_path):
    table = TuningTable({**SIG, "clock_ghz": float("nan")}, {key(): entry()})
    with pytest.raises(ValueError):
        table.dumps()
    with pytest.raises(ValueError):
        table.save(tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_a_held_lock_times_out_with_a_write_error(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "LOCK_TIMEOUT_S", 0.6)
    path = tmp_path / "t.json"
    box = {}

    def save():
        try:
            TuningTable(SIG, {key(): entry()}).save(path)
        except BaseException as e:
            box["error"] = e

    with FileLock(str(path) + ".lock"):
        worker = threading.Thread(target=save, daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "save waited for the lock without a limit"
    e = box["error"]
    assert isinstance(e, TableWriteError) and e.errno is None and e.filename == str(path)
    # a busy writer, not an unwritable place: no advice to write elsewhere
    assert str(e) == (f"cannot write tuning table {path}: lock {path}.lock not acquired within 1 s (another "
                      "process holds it, such as another `hybridgemm autotune` saving to this table: retry when it "
                      f"has finished, or remove {path}.lock if no such process is running)")
    assert not path.exists()


def test_write_error_fields():
    e = TableWriteError("/x/t.json", "no reason with an errno")
    assert e.errno is None and e.filename == "/x/t.json" and e.strerror == str(e)
    assert str(e).startswith("cannot write tuning table /x/t.json: no reason with an errno (set ")
    e = TableWriteError(Path("/x/t.json"), OSError(errno.ENOSPC, "No space left on device"))
    assert e.errno == errno.ENOSPC and e.filename == "/x/t.json"


def test_a_table_can_be_looked_up_after_a_save(tmp_path):
    table = TuningTable(SIG, {key(): entry()})
    assert table.find(key().shape, 300)[0] == key()
    table.set(key(1, 8), entry(lo=1, hi=8))
    table.save(tmp_path / "t.json")
    assert table.find(key().shape, 5)[0] == key(1, 8) and table.find(key().shape, 300)[0] == key()


def test_merging_tables_does_not_make_their_entries_win_on_save(tmp_path):
    path = tmp_path / "t.json"
    TuningTable(SIG, {key(): entry(us=10.0)}).save(path)
    mine, theirs = TuningTable.load(path, SIG), TuningTable.load(path, SIG)
    theirs.set(key(), entry(us=7.0))
    theirs.save(path)  # a newer result on disk
    mine.update(TuningTable(SIG, {key(1, 8): entry(lo=1, hi=8)}))  # layered, not set: not ours to force
    mine.save(path)
    on_disk = TuningTable.load(path, SIG).entries
    assert on_disk[key()]["median_us"] == 7.0 and key(1, 8) in on_disk


def test_touching_ranges_overlap_when_set_and_covered():
    table = TuningTable(SIG, {key(1, 8): entry(lo=1, hi=8), key(9, 16): entry(lo=9, hi=16)})
    assert table.covering(key(8, 9)) == [key(1, 8), key(9, 16)]
    assert table.covering(key(16, 20)) == [key(9, 16)]
    table.set(key(8, 8), entry(lo=8, hi=8))  # shares M = 8 with 1-8: that entry goes
    assert sorted((k.m_lo, k.m_hi) for k in table.entries) == [(8, 8), (9, 16)]
    table.set(key(1, 9), entry(lo=1, hi=9))  # its top is 9-16's bottom: 9-16 goes too
    assert sorted((k.m_lo, k.m_hi) for k in table.entries) == [(1, 9)]


# ---------------------------------------------------------------- warnings of a load and a save


def test_a_table_warned_about_at_load_is_warned_about_again_when_a_save_replaces_it(tmp_path):
    path = tmp_path / "t.json"
    path.write_bytes(b"[1, 2]")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        TuningTable.load(path, SIG)
        TuningTable(SIG, {key(): entry()}).save(path)
    assert table_warnings(rec) == [f"hybridgemm tuning table {path}: top level is list, not an object; ignoring it",
                                   f"hybridgemm tuning table {path}: top level is list, not an object; replacing it"]
    other = tmp_path / "other.json"
    TuningTable({**SIG, "sm_count": 114}, {key(): entry()}).save(other)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        TuningTable.load(other, SIG)
        TuningTable(SIG, {key(): entry()}).save(other)
    found = table_warnings(rec)
    assert len(found) == 2 and "sm_count" in found[0] and found[0].endswith("; ignoring it")
    assert found[1].startswith(f"hybridgemm tuning table {other}: replacing a table tuned elsewhere (sm_count")


def test_a_schema_1_table_with_a_bad_entry_gives_both_warnings(tmp_path):
    path = tmp_path / "v1.json"
    path.write_bytes(v1_doc({**V1_ENTRIES, "linear|bf16|bias|N=6144|K=4096|M=32|c": [1]}))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        table = TuningTable.load(path, SIG)
    found = table_warnings(rec)
    assert len(table) == 2 and len(found) == 2
    assert found[0] == (f"hybridgemm tuning table {path}: dropped 1 invalid entry "
                        "(first: 'linear|bf16|bias|N=6144|K=4096|M=32|c': not a schema-1 entry)")
    assert found[1].startswith(f"hybridgemm tuning table {path}: schema-1 table: ")


def test_a_loaded_table_carries_the_running_signature_and_its_source(tmp_path):
    path = tmp_path / "t.json"
    TuningTable({**SIG, "torch_version": "2.10.0"}, {key(): entry()}).save(path)  # informational: still ours
    table = TuningTable.load(path, SIG)
    assert table.signature == SIG and table.sources == [path]
    assert TuningTable.load(path).signature["torch_version"] == "2.10.0"  # no signature: the file's own


def test_a_missing_explicit_table_warns_and_strict_raises(tmp_path):
    missing = tmp_path / "missing.json"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert len(load_tables(SIG, explicit_path=missing, shipped_dir=tmp_path)) == 0
    assert table_warnings(rec) == [f"hybridgemm tuning table {missing}: does not exist; ignoring it"]
    with pytest.raises(TableError) as info:
        TuningTable._load(missing, SIG, True, missing="does not exist; ignoring it")
    assert str(info.value) == f"{missing}: does not exist; ignoring it"


def test_shipped_tables_one_bad_entry_one_vanished_file(tmp_path, monkeypatch, caplog):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    gone, good = shipped / "a.json", shipped / "b.json"
    gone.write_bytes(doc())
    good.write_bytes(doc({key().to_string(): entry(), "linear|bf16|bias|N=1|K=1|M=1-1|c": [1]}))
    real = T._read_table_bytes
    monkeypatch.setattr(T, "_read_table_bytes", lambda p: None if p == gone else real(p))  # removed meanwhile
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        merged = load_tables(SIG, shipped_dir=shipped)
    assert set(merged.entries) == {key()} and merged.sources == [good]
    assert table_warnings(rec) == [f"hybridgemm tuning table {good}: dropped 1 invalid entry (first: "
                                   "'linear|bf16|bias|N=1|K=1|M=1-1|c': entry must be an object, got list)"]


def test_shipped_table_messages(tmp_path, caplog):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    bad, foreign = shipped / "a.json", shipped / "b.json"
    bad.write_bytes(b"[1]")
    foreign.write_bytes(doc({key().to_string(): entry()}, signature={**SIG, "sm_count": 114}))
    with warnings.catch_warnings(record=True) as rec, caplog.at_level(logging.DEBUG, logger=T.__name__):
        warnings.simplefilter("always")
        assert len(load_tables(SIG, shipped_dir=shipped)) == 0
        assert len(load_tables(None, shipped_dir=shipped)) == 0
    assert table_warnings(rec) == [
        f"hybridgemm tuning table {bad}: shipped table is unusable (top level is list, not an object); ignoring it"]
    logged = [r.getMessage() for r in caplog.records if r.name == T.__name__]
    assert any(m.startswith(f"skipping shipped table {foreign}: sm_count") for m in logged), logged
    assert f"skipping shipped table {bad}: no device signature to match" in logged
    assert f"skipping shipped table {foreign}: no device signature to match" in logged


def test_a_user_table_that_cannot_be_located_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", "~no_such_user_hybridgemm/cache")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert len(load_tables(SIG, shipped_dir=tmp_path)) == 0
    [message] = table_warnings(rec)
    assert re.fullmatch(r"hybridgemm tuning table ~no_such_user_hybridgemm/cache: cannot locate the user table "
                        r"\(.+\); ignoring it", message), message


def test_where_tables_live(monkeypatch):
    shipped = T.shipped_table_dir()
    assert shipped == Path(T.__file__).resolve().parent / "tables"
    assert T.shipped_table_paths() and all(p.parent == shipped for p in T.shipped_table_paths())
    monkeypatch.delenv("HYBRIDGEMM_CACHE_DIR")
    user = T.user_table_path()
    assert user.name == "table.json" and user.parent.name == "hybridgemm"


# ---------------------------------------------------------------- stale temp files


def _stale(directory: Path, name: str, mtime: float) -> Path:
    p = directory / name
    p.write_text("{}")
    os.utime(p, (mtime, mtime))
    return p


def test_stale_temp_age_limit_is_exact(tmp_path, monkeypatch):
    now = 2_000_000_000.0
    monkeypatch.setattr(D.time, "time", lambda: now)
    at_limit = _stale(tmp_path, ".table.json.atlimit.tmp", now - T.STALE_TEMP_S)
    older = _stale(tmp_path, ".table.json.older.tmp", now - T.STALE_TEMP_S - 1)
    T._remove_stale_temps(tmp_path / "table.json")
    assert at_limit.exists() and not older.exists()


def test_one_temp_file_that_cannot_be_removed_does_not_stop_the_others(tmp_path, monkeypatch):
    old = os.path.getmtime(tmp_path) - 3600
    files = [_stale(tmp_path, f".table.json.f{i}.tmp", old) for i in range(3)]
    real, refused = os.unlink, []

    def unlink(p, *a, **k):
        if not refused:
            refused.append(Path(p))
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real(p, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    T._remove_stale_temps(tmp_path / "table.json")
    assert [p for p in files if p.exists()] == refused


def test_a_failed_cleanup_is_logged(tmp_path, monkeypatch, caplog):
    def scandir(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "scandir", scandir)
    with caplog.at_level(logging.DEBUG, logger=T.__name__):
        T._remove_stale_temps(tmp_path / "table.json")
    assert [r.getMessage() for r in caplog.records if r.name == T.__name__] == [
        f"cleaning stale temp files next to {tmp_path / 'table.json'}: [Errno {errno.EACCES}] Permission denied: "
        f"'{tmp_path}'"]


# ---------------------------------------------------------------- more reading faults


def test_a_read_that_fails_keeps_its_errno(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    TuningTable(SIG, {key(): entry()}).save(path)
    real = os.read

    def failing_read(fd, n):
        if os.path.samefile(f"/proc/self/fd/{fd}", path):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n)

    monkeypatch.setattr(os, "read", failing_read)
    with pytest.raises(T._Unreadable) as info:
        T._read_table_bytes(path)
    assert info.value.errno == errno.EIO and str(info.value) == "cannot be read ([Errno 5] Input/output error)"
    with pytest.raises(TableWriteError) as info:  # not replaced: its entries could not be seen
        TuningTable(SIG, {key(9, 16): entry(lo=9, hi=16)}).save(path)
    assert info.value.errno == errno.EIO


def test_short_reads_are_still_cut_off_at_the_limit(monkeypatch):
    proc = Path("/proc/self/status")
    if not proc.exists() or proc.stat().st_size != 0 or len(proc.read_bytes()) <= 101:
        pytest.skip("needs a /proc file that reports size 0")
    monkeypatch.setattr(D, "MAX_TABLE_BYTES", 100)
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: real(fd, min(n, 50)))  # a reader that returns 50 bytes at most
    with pytest.raises(TableError) as info:
        T._read_table_bytes(proc)
    assert str(info.value) == "is larger than a table may be (100 bytes)"


def test_a_path_with_a_nul_byte_is_unreadable_not_an_error(tmp_path):
    bad = tmp_path / "a\0b.json"
    with pytest.raises(T._Unreadable) as info:
        T._read_table_bytes(bad)
    assert info.value.errno is None and str(info.value) == "cannot be read (embedded null byte)"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert len(TuningTable.load(bad, SIG)) == 0
    assert len(table_warnings(rec)) == 1


def test_an_entry_that_json_cannot_write_is_named_in_120_characters():
    odd = type("Long" * 40, (), {})()
    text = f"Object of type {type(odd).__name__} is not JSON serializable"
    assert entry_error(raw_entry(config={"x": odd})) == f"entry is not JSON data: {text[:120]}"


def test_a_user_table_whose_location_cannot_be_found_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDGEMM_CACHE_DIR")

    def no_cache_dir(name):
        raise RuntimeError("no home directory")

    monkeypatch.setattr(L.platformdirs, "user_cache_dir", no_cache_dir)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert len(load_tables(SIG, shipped_dir=tmp_path)) == 0
    assert table_warnings(rec) == [
        "hybridgemm tuning table .: cannot locate the user table (no home directory); ignoring it"]


def test_make_entry_dates_an_entry_in_utc(monkeypatch):
    from datetime import datetime, timedelta, timezone

    instant = datetime(2026, 11, 30, 23, 30, tzinfo=timezone.utc)  # December 1 at UTC+10, the faked local time

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return instant.astimezone(tz) if tz is not None else (instant + timedelta(hours=10)).replace(tzinfo=None)

    monkeypatch.setattr(E, "datetime", Clock)
    e = make_entry("torch", {}, m_points=[1], ratios=[1.0], median_us=1, spread_us=0)
    assert e["tuned_at"] == "2026-11-30"


# ---------------------------------------------------------------- library versions on entries

TRITON_SIG = {**SIG, "triton_version": "3.6.0"}
SPLIT_RECORD = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4,
                "num_warps": 4, "num_stages": 4}


def triton_entry(lo=257, hi=512, **fields):
    return {**make_entry("triton_splitk", SPLIT_RECORD, m_points=[lo, hi], ratios=[1.2, 1.2], median_us=9.0,
                         spread_us=0.1, tuned_at="2026-11-29"), **fields}


@pytest.mark.parametrize("version", ["3", "x" * 40, "3.6.0"])
def test_triton_version_lengths_that_are_valid(version):
    e = normalize_entry(triton_entry(triton_version=version, flinear_us=9.5), key())  # every optional field
    assert e["triton_version"] == version and e["flinear_us"] == 9.5


@pytest.mark.parametrize("value, message", [
    ("", "triton_version must be a version string, got ''"),
    ("x" * 41, f"triton_version must be a version string, got {'x' * 41!r}"),
    (5, "triton_version must be a version string, got 5"),
])
def test_triton_version_rejections(value, message):
    assert entry_error(triton_entry(triton_version=value)) == message


def test_triton_version_only_on_triton_entries():
    assert entry_error(raw_entry(backend="cublaslt", triton_version="3.6.0")) == (
        "triton_version is recorded on Triton entries only, not on 'cublaslt'")


def test_an_entry_records_its_triton_only_where_it_differs_from_the_tables():
    native = TuningTable(TRITON_SIG, {key(): triton_entry(triton_version="3.6.0")})
    assert "triton_version" not in native.entries[key()] and native.tuned_triton(key()) == "3.6.0"
    assert not native.foreign_triton
    native.set(key(1, 8), triton_entry(1, 8, triton_version="3.5.0"))
    assert native.entries[key(1, 8)]["triton_version"] == "3.5.0" and native.foreign_triton
    assert native.tuned_triton(key(1, 8)) == "3.5.0"


def test_a_triton_entry_of_a_table_without_a_triton_is_of_an_unknown_one():
    bare = TuningTable(None, {key(): triton_entry()})
    assert bare.tuned_triton(key()) == "unknown" and bare.entry_status(key()) == ("use", "")
    no_triton = TuningTable({**SIG, "triton_version": None}, {key(): triton_entry()})
    merged = TuningTable(TRITON_SIG)
    merged.update(no_triton)
    assert merged.entries[key()]["triton_version"] == "unknown" and merged.tuned_triton(key()) == "unknown"


def test_merging_a_table_of_another_triton_keeps_what_each_entry_was_tuned_under():
    older = TuningTable({**SIG, "triton_version": "3.5.0"}, {key(): triton_entry(), key(1, 8): raw_entry(
        backend="torch", config={}, m_points=[1, 8])})
    merged = TuningTable(TRITON_SIG)
    assert not merged.foreign_triton
    merged.update(older)
    assert merged.entries[key()]["triton_version"] == "3.5.0" and merged.foreign_triton
    assert "triton_version" not in merged.entries[key(1, 8)]  # not a Triton entry
    same = TuningTable(TRITON_SIG)
    same.update(TuningTable(TRITON_SIG, {key(): triton_entry()}))
    assert "triton_version" not in same.entries[key()]


def test_foreign_triton_is_recomputed_after_a_save(tmp_path):
    table = TuningTable(TRITON_SIG, {key(): triton_entry()})
    assert not table.foreign_triton
    path = tmp_path / "t.json"
    TuningTable(TRITON_SIG, {key(1, 8): triton_entry(1, 8, triton_version="3.5.0")}).save(path)
    table.save(path)  # merges the foreign entry on disk
    assert table.foreign_triton


def test_version_effects_of_a_library_this_process_lacks():
    pinned = {"kind": "cublaslt", "cublaslt_version": 130000, "algo_id": 1}
    table = TuningTable(SIG, {key(): raw_entry(backend="cublaslt", config=pinned)})
    [effect] = table.version_effects({**SIG, "cublaslt_version": None})
    assert effect == T.VersionEffect("cuBLASLt", "", None, "flinear", 1)
    assert effect.describe() == "cuBLASLt is not available here: its 1 entry run F.linear"
    [effect] = table.version_effects()
    assert effect == T.VersionEffect("cuBLASLt", "130000", str(SIG["cublaslt_version"]), "flinear", 1)


def test_one_table_warns_once_about_every_library_version_it_holds(tmp_path):
    pinned = {"kind": "cublaslt", "cublaslt_version": 130000, "algo_id": 1}
    path = tmp_path / "t.json"
    TuningTable(TRITON_SIG, {key(): raw_entry(backend="cublaslt", config=pinned),
                             key(1, 8): triton_entry(1, 8, triton_version="3.5.0")}).save(path)
    data = json.loads(path.read_text())
    data["entries"]["linear|bf16|bias|N=1|K=1|M=1-1|c"] = [1]  # and one bad entry: its own warning
    path.write_text(json.dumps(data))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        load_tables(TRITON_SIG, explicit_path=path, shipped_dir=tmp_path / "none")
    found = table_warnings(rec)
    assert len(found) == 2 and found[0].startswith(f"hybridgemm tuning table {path}: dropped 1 invalid entry")
    assert found[1] == (f"hybridgemm tuning table {path}: " + "; ".join(e.describe() for e in
                        TuningTable.load(path, TRITON_SIG).version_effects())
                        + "; run `hybridgemm autotune` (the same --model or --shape) to re-tune them")
    assert found[1].count("; ") == 2


def test_the_user_tables_version_warning_names_it(tmp_path):
    user = tmp_path / "user-cache" / "table.json"
    pinned = {"kind": "cublaslt", "cublaslt_version": 130000, "algo_id": 1}
    TuningTable(SIG, {key(): raw_entry(backend="cublaslt", config=pinned)}).save(user)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        load_tables(SIG, shipped_dir=tmp_path / "none")
    [message] = table_warnings(rec)
    assert message.startswith(f"hybridgemm tuning table {user}: cuBLASLt records tuned under cuBLASLt 130000")


# ---------------------------------------------------------------- shipped tables by device


@pytest.mark.parametrize("name, slug", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
                                        ("nvidia-h200", "h200"), ("H200 NVL", "h200-nvl"), (None, ""), (200, "")])
def test_device_slugs(name, slug):
    assert T.device_slug(name) == slug


def test_shipped_devices_and_lookup_by_gpu_name(tmp_path, caplog):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    TuningTable({**SIG, "gpu_name": "NVIDIA H200"}, {key(): entry()}).save(shipped / "hopper.json")
    (shipped / "broken.json").write_bytes(b"[1]")
    with caplog.at_level(logging.DEBUG, logger=T.__name__):
        found = T.shipped_devices(shipped)
    assert found == {"broken": (shipped / "broken.json", ""), "hopper": (shipped / "hopper.json", "NVIDIA H200")}
    assert f"shipped table {shipped / 'broken.json'}: no GPU name (top level is list, not an object)" in [
        r.getMessage() for r in caplog.records if r.name == T.__name__]
    assert T.shipped_table_for_device("NVIDIA H200", shipped) == shipped / "hopper.json"  # by its signature
    assert T.shipped_table_for_device("hopper", shipped) == shipped / "hopper.json"  # by its file name
    assert T.shipped_table_for_device("NVIDIA H100", shipped) is None
    assert T.shipped_table_for_device("", shipped) is None


def test_an_entry_of_a_backend_this_version_does_not_know_is_no_version_effect():
    pinned = {"kind": "cublaslt", "cublaslt_version": 130000, "algo_id": 1}
    table = TuningTable(SIG)
    table.set(key(1, 8), raw_entry(backend="future_kernel", config={}, m_points=[1, 8]))  # judged first
    table.set(key(), raw_entry(backend="cublaslt", config=pinned))
    assert table.entry_status(key(1, 8)) == ("use", "")
    assert [(e.library, e.count) for e in table.version_effects()] == [("cuBLASLt", 1)]


def test_without_triton_here_or_in_the_table_its_triton_entries_run_f_linear():
    no_triton = {**SIG, "triton_version": None}
    for table in (TuningTable(no_triton, {key(): triton_entry()}), TuningTable(None, {key(): triton_entry()})):
        assert table.version_effects(no_triton) == [T.VersionEffect("Triton", "", None, "flinear", 1)]


def test_merging_a_table_without_a_signature_leaves_its_entries_as_they_are():
    merged = TuningTable(TRITON_SIG)
    merged.update(TuningTable(None, {key(): triton_entry()}))
    assert "triton_version" not in merged.entries[key()] and merged.tuned_triton(key()) == "3.6.0"
