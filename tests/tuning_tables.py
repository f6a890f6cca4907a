"""Tuning tables as the tests write them: the device signature they are recorded for, keys and
valid entries, whole tables, broken files, and schema-1 documents."""

from __future__ import annotations

import json
import pickle
import random

from hybridgemm.autotune_cache.signature import KERNEL_ABI
from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry

# The running device's signature (schema 2, what current_signature() reports today).
SIG = {
    "schema": 2, "kernel_abi": KERNEL_ABI, "gpu_name": "NVIDIA H200",
    "compute_capability": "9.0", "sm_count": 132, "cublaslt_version": 130100,
    "triton_version": "3.6.0", "torch_version": "2.11.0+cu130", "package_version": "0.1.0",
}
V1_SIG = {**SIG, "schema": 1}  # the same device, as a schema-1 table recorded it
HUGE = 10**400  # a valid JSON number that float() cannot hold


def key(lo=257, hi=512, n=6144, k=4096, epi="bias", layout="c", dtype="bf16"):
    return TableKey("linear", dtype, epi, n, k, lo, hi, layout)


def points(lo, hi):
    """The M values an entry for [lo, hi] was 'timed' at here: both edges."""
    return [lo] if lo == hi else [lo, hi]


def entry(us=10.0, backend="triton_splitk", *, lo=257, hi=512, ratios=None, **config):
    """A valid entry for the range [lo, hi] (by default ``key()``'s)."""
    pts = points(lo, hi)
    ratios = ratios or [1.25, 1.5][: len(pts)]
    cands = [{"backend": backend, "config": config or {"split": 4}, "median_us": us,
              "spread_us": 0.1, "worst_ratio": min(ratios)},
             {"backend": "cublaslt", "config": {"algo": [1, 2, 3]}, "median_us": us * 1.2,
              "spread_us": 0.2}]
    return make_entry(backend, config or {"split": 4}, m_points=pts, ratios=ratios, median_us=us,
                      spread_us=0.1, candidates=cands, flinear_us=us * 1.5, tuned_at="2026-11-29")


def entry_for(k, us=10.0, **kw):
    return entry(us, lo=k.m_lo, hi=k.m_hi, **kw)


def filled_table(keys=None):
    t = TuningTable(SIG)
    for i, k in enumerate(keys or [key(1, 1), key(9, 16), key(2049, 4096, n=1024), key(epi="none")]):
        t.set(k, entry_for(k, us=5.0 + i * 3.333333))
    return t


# ---------------------------------------------------------------- bad files


def valid_text():
    return filled_table().dumps()


def _doc(**changes):
    d = json.loads(valid_text())
    d.update(changes)
    return json.dumps(d).encode()


def _nan_text():
    text = valid_text()
    assert '"median_us": 5.0' in text
    return text.replace('"median_us": 5.0', '"median_us": NaN').encode()


# name -> the file's bytes: none of them a table that loads
BAD_FILES = {
    "truncated": lambda: valid_text()[: len(valid_text()) // 2].encode(),
    "empty": lambda: b"",
    "random-bytes": lambda: random.Random(0).randbytes(4096),
    "pickle": lambda: pickle.dumps({"schema": 2}),
    "top-level-list": lambda: b"[1, 2]",
    "old-schema": lambda: _doc(schema=0),
    "future-schema": lambda: _doc(schema=3),
    "schema-as-string": lambda: _doc(schema="2"),
    "schema-as-float": lambda: _doc(schema=2.0),
    "schema-huge": lambda: _doc(schema=HUGE),
    "entries-as-list": lambda: _doc(entries=[]),
    "signature-wrong-type": lambda: _doc(signature={**SIG, "sm_count": "132"}),
    "signature-missing-field": lambda: _doc(signature={"gpu_name": "x"}),
    "extra-top-level-field": lambda: _doc(code="import os"),
    "nan-constant": _nan_text,
    "deep-nesting": lambda: b"[" * 100000,
}


# ---------------------------------------------------------------- schema 1


def v1_entry(median_us, flinear_us="absent", backend="triton_splitk", config=None):
    e = {"backend": backend, "config": config or {"split": 4}, "median_us": median_us, "spread_us": 0.1,
         "candidates": [{"backend": backend, "config": config or {"split": 4}, "median_us": median_us,
                         "spread_us": 0.1}], "tuned_at": "2025-06-01"}
    if flinear_us != "absent":
        e["flinear_us"] = flinear_us
    return e


def v1_doc(entries, sig=V1_SIG) -> bytes:
    return json.dumps({"schema": 1, "signature": sig, "entries": entries}, indent=1).encode()


V1_PREFIX = "linear|bf16|bias|N=6144|K=4096|"
V1_ENTRIES = {
    V1_PREFIX + "M=16|c": v1_entry(10.0, 12.0),  # 1.2x F.linear: kept, for M = 16 only
    V1_PREFIX + "M=64|c": v1_entry(20.0, 19.4),  # 0.97x: the threshold itself, kept
    V1_PREFIX + "M=256|c": v1_entry(10.0, 9.6),  # 0.96x: slower than F.linear, dropped
    V1_PREFIX + "M=1024|c": v1_entry(10.0),  # no ratio recorded: dropped
    V1_PREFIX + "M=4096|c": v1_entry(10.0, None),  # null: the same
    V1_PREFIX + "M=8192|c": v1_entry(0.0, 5.0),  # a zero time is no evidence: dropped
}
