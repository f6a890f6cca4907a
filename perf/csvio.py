"""Long-form benchmark CSVs: one row per (GPU, shape, M, dtype, epilogue, provider, method).

Writing upserts: rows of the same key are replaced, every other row (other GPUs, other
shapes) is kept, so several machines can share one file. Columns are the union of all rows,
in a stable order (known columns first, then the rest sorted).
"""

from __future__ import annotations

import csv
import os
import platform
import shlex
import tempfile

import torch

import hybridgemm
from hybridgemm.kernels.cublaslt import cublaslt_version

KEY_COLUMNS = ("gpu", "shape", "N", "K", "M", "dtype", "epilogue", "provider", "method")
# status: ok | failed (wrong result, not timed) | skipped (cannot run here; see note) | error
FIRST_COLUMNS = (*KEY_COLUMNS, "status", "median_us", "spread_us", "speedup_vs_flinear", "tflops", "gbps", "config",
                 "rel_err", "err_bound")
TAIL_COLUMNS = ("note", "torch", "triton", "cublaslt", "nvmath", "hybridgemm", "host", "command")


SWITCH_PREFIX = "HYBRIDGEMM_"
# variables of the test harness (tests/), not of what a bench runs
_NOT_SWITCHES = ("HYBRIDGEMM_TEST_", "HYBRIDGEMM_DETERMINISM_")


def command_as_run(command: str) -> str:
    """``command`` with this process's ``HYBRIDGEMM_*`` environment variables before it, as a shell
    takes them (``HYBRIDGEMM_PDL_PREFETCH=1 hybridgemm bench ...``): the table, the opt-in kernels
    and the read rate a row was measured with are part of its command (the test harness's own
    variables are not)."""
    switches = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                if k.startswith(SWITCH_PREFIX) and not k.startswith(_NOT_SWITCHES)]
    return " ".join([*switches, command] if command else switches)


def environment_columns(command: str) -> dict:
    """GPU and versions, so that every row says where and with what it was measured; ``command``
    as :func:`command_as_run` writes it."""

    env = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "hybridgemm": hybridgemm.__version__,
           "host": platform.node(), "command": command_as_run(command)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = ""
    try:
        import nvmath

        env["nvmath"] = nvmath.__version__
    except ImportError:
        env["nvmath"] = ""

    env.setdefault("cublaslt", cublaslt_version() or "")
    return env


def _key(row: dict) -> tuple:
    return tuple(str(row.get(c, "")) for c in KEY_COLUMNS)


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path: str, rows: list[dict]) -> None:
    """Upsert ``rows`` into the CSV at ``path`` (atomic replace), one row per :data:`KEY_COLUMNS`.
    ValueError, the file untouched, where two rows of the file or two of ``rows`` share a key
    (a CSV of another kind, such as an end-to-end one: upserting would drop rows)."""
    existing = read_rows(path)
    for what, group in ((path, existing), ("the new rows", rows)):
        if len({_key(r) for r in group}) < len(group):
            raise ValueError(f"write_rows: rows of {what} share a key {KEY_COLUMNS}: not a CSV these rows upsert into")
    merged = {_key(r): r for r in existing}
    for r in rows:
        merged[_key(r)] = {k: v for k, v in r.items() if v is not None}
    cols = set().union(*(r.keys() for r in merged.values())) if merged else set()
    order = [c for c in FIRST_COLUMNS if c in cols]
    order += sorted(c for c in cols if c not in FIRST_COLUMNS and c not in TAIL_COLUMNS)
    order += [c for c in TAIL_COLUMNS if c in cols]
    write_csv(path, order, merged.values())


def write_csv(path, fieldnames: list[str], rows) -> None:
    """Write ``rows`` (dicts; columns ``fieldnames``, others ignored) to the CSV at ``path``,
    replacing it atomically (temp file in the same folder + ``os.replace``)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".csv")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(fieldnames), extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
