"""The decision: which backend and configuration runs a given linear call, and why.

A decision is a pure function of the loaded tuning table, the dispatch mode and the problem;
nothing is timed at call time. fusion/dispatch.py runs the decisions and caches them; this
module never imports it.

Rules, in order:
  1. F.linear's argument rules (clear errors naming dtype, shape, device).
  2. CPU tensors, or a dtype no kernel takes (e.g. float64): PyTorch computes it.
  3. Empty problems (M, N or K = 0): PyTorch's semantics, no GEMM.
  4. Table hit: the entry for (op, dtype, epilogue, N, K, layout class) whose M range holds
     the call's M (autotune_cache/table.py). Its winner was timed against F.linear at several
     M across that range and chosen on its worst ratio there; it may be F.linear itself
     (backend ``torch``) or cuBLASLt's heuristic asked at the call's exact M.
  5. No entry holds M (nothing is borrowed from another range), or the entry's config fails
     the backend's validity check (which warns once): F.linear itself (``fallback_rule``).
Rules 1-3 are applied by the caller (fusion/dispatch.py) before it asks for a decision;
:func:`choose` is rules 4-5. Misses are logged once per key at debug level. ``explain()``
says which rule fired, and for a table hit the range the entry was validated on and its worst
measured ratio.

In ``batch_invariant`` mode (fusion/modes.py) rules 4-5 are replaced by one
(:func:`batch_invariant_choice`): the Triton tiled kernel with the fixed config of
:func:`hybridgemm.modes.fixed_config` (the same for every M), else PyTorch with a warning.

Tables: loaded lazily per device (``load_tables``: explicit path > user table > shipped
tables matching the device). ``HYBRIDGEMM_TABLE`` or :func:`set_table_path` names an explicit
table; :func:`reload_tables` re-reads them. Decisions already cached elsewhere stop holding
when the tables are reloaded or the mode switches: :func:`on_change` tells the cache holders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybridgemm.autotune_cache import probe, signature
from hybridgemm.autotune_cache.keys import ShapeKey
from hybridgemm.autotune_cache.table import TuningTable, load_tables
from hybridgemm.kernels import backends
from hybridgemm.kernels.backends import ConfigRejected
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import DTYPE_NAMES, NAME_TO_DTYPE, Problem, uses_tf32

from . import modes
from .diagnostics import warn_once

_log = logging.getLogger(__name__)

# Module state: containers are changed in place and scalars live in one-element lists, so no
# name is ever rebound and every reader holds the same object.
_lock = threading.Lock()
_tables: dict[int, TuningTable] = {}  # per device index
_explicit_path: list[str | None] = [None]
_mode: list[str] = [modes.DEFAULT]
_hooks: list[Callable[[str, bool], None]] = []


@dataclass(frozen=True)
class Choice:
    backend: str  # "cublaslt", "triton_gemm", "triton_splitk" or "torch"
    config: Any  # the backend's restored config (None: cuBLASLt heuristic at the exact M / torch)
    source: str  # "table" or "rule" (or the batch-invariant mode's)
    key: str  # the table key that decided, or the shape and M asked for
    reason: str
    m_lo: int | None = None  # a table entry's validated M range and worst ratio to F.linear there
    m_hi: int | None = None
    worst_ratio: float | None = None
    provisional: bool = False  # not to be cached: asked again on the next call (e.g. a probe deferred)

    def describe(self) -> str:
        cfg = ""
        if self.config is not None:
            cfg = f" [{backends.get_backend(self.backend).describe(self.config)}]"
        elif self.backend == "cublaslt":
            cfg = " [heuristic at the exact M]"
        return f"{self.backend}{cfg} ({self.source}: {self.reason})"


# ----------------------------------------------------------------------------- state changes


def on_change(hook: Callable[[str, bool], None]) -> None:
    """Call ``hook(mode, tables_reloaded)`` under the lock whenever decisions made so far stop
    holding: the tables reloaded (``True``: every mode's decisions) or the mode switched
    (``False``; ``mode`` is the new one). How fusion/dispatch.py keeps its caches in step
    without this module importing it."""
    _hooks.append(hook)


def set_table_path(path: str | os.PathLike | None) -> None:
    """Use this table (over the user and shipped ones) from now on; None: back to the default."""
    _explicit_path[0] = os.fspath(path) if path is not None else None
    reload_tables()


def reload_tables() -> None:
    """Forget loaded tables and every cached decision (the next call re-reads the tables)."""
    with _lock:
        _tables.clear()
        for hook in _hooks:
            hook(_mode[0], True)


def get_mode() -> str:
    """The current dispatch mode, ``"default"`` or ``"batch_invariant"`` (process-global)."""
    return _mode[0]


def set_mode(name: str) -> str:
    """Switch the dispatch mode for the whole process; returns the previous mode.

    ``"batch_invariant"``: rows of ``hybridgemm.linear`` are bit-identical for every M (the
    policy and its limits: fusion/modes.py). ``"default"``: the tuned kernels. Each mode keeps
    its own cached decisions, so a switch never reuses the other mode's.
    """
    if name not in modes.MODES:
        raise ValueError(f"unknown hybridgemm mode {name!r}; valid modes: {', '.join(map(repr, modes.MODES))}")
    with _lock:
        previous = _mode[0]
        _mode[0] = name
        for hook in _hooks:
            hook(name, False)
    return previous


@contextlib.contextmanager
def mode(name: str) -> Iterator[str]:
    """``with hybridgemm.mode("batch_invariant"): ...``: the mode inside the block, the
    previous one restored on exit (exceptions included). Process-global, like set_mode."""
    previous = set_mode(name)
    try:
        yield name
    finally:
        set_mode(previous)


# ----------------------------------------------------------------------------- the rules


def table_for_device(device_index: int) -> TuningTable:
    table = _tables.get(device_index)
    if table is None:
        explicit = _explicit_path[0] or os.environ.get("HYBRIDGEMM_TABLE") or None
        try:
            table = load_tables(signature.current_signature(device_index), explicit)
        except Exception as e:  # no device facts, no tables: every call runs F.linear, and says so once
            warn_once(("tables", device_index), f"hybridgemm: tuning tables not loaded for device {device_index} "
                      f"({type(e).__name__}: {e}); every call runs F.linear")
            table = TuningTable(None)
        _tables[device_index] = table
    return table


def fallback_rule(problem: Problem, why: str) -> Choice:
    """Rule 5, no usable table entry: F.linear itself (then the activation). Not cuBLASLt's
    heuristic asked for the exact M: for GEMMs without a bias F.linear does not run cuBLASLt's
    heuristic choice, and that choice was measured at 0.63x F.linear's speed (N=1024, K=8192,
    M=645, H200; perf/results/h200/README.md). The tuner still times the heuristic as a
    candidate, so it runs wherever it was measured faster."""
    return Choice("torch", None, "rule", _call_string(problem), f"{why}; F.linear")


def batch_invariant_choice(problem: Problem, device_index: int | None) -> Choice:
    """The batch-invariant mode's decision: the Triton tiled kernel with the fixed config for
    (N, K, dtype, epilogue, W layout), never the table or cuBLASLt (which picks per M); PyTorch
    when no config can take the problem. ``device_index`` None: assume an H100/H200."""
    key = _call_string(problem)
    try:
        if device_index is None:
            limits = modes.HOPPER_LIMITS
        else:
            limits = {**backends.device_limits(device_index), "num_sms": backends.num_sms(device_index)}
        cfg, why = modes.fixed_config(problem, **limits)
    except ImportError as e:
        cfg, why = None, f"Triton is not available ({e})"
    if cfg is None:
        return Choice("torch", None, modes.SOURCE, key,
                      f"no Triton config takes this problem ({why}); PyTorch computes it, deterministic "
                      "but NOT batch-invariant")
    return Choice("triton_gemm", cfg, modes.SOURCE, key, modes.rule_text(problem))


def _call_string(problem: Problem) -> str:
    return f"{ShapeKey.from_problem(problem).to_string()} at M={problem.m}"


def choose(problem: Problem, device_index: int) -> Choice:
    """Rules 4-5 for one problem (pure given the loaded table)."""
    table = table_for_device(device_index)
    hit = table.find(ShapeKey.from_problem(problem), problem.m)
    if hit is None:
        _log.debug("hybridgemm: no table entry for %s", _call_string(problem))
        return fallback_rule(problem, "no table entry holds this M")
    key, entry = hit
    lo, hi, worst = key.m_lo, key.m_hi, entry["worst_ratio"]
    points = ",".join(str(m) for m in entry["m_points"])
    reason = (f"tuned for M {lo}-{hi}, timed at M={points}: worst {worst:.3f}x F.linear's speed there")
    if entry["backend"] == "torch":
        return Choice("torch", None, "table", key.to_string(), reason + "; runs F.linear", lo, hi, worst)
    status, why = table.entry_status(key)
    if status == signature.FLINEAR:  # e.g. a cuBLASLt algorithm tuned under another cuBLASLt (load_tables warned)
        return fallback_rule(problem, f"table entry {key.to_string()}: {why}")
    try:
        be = backends.get_backend(entry["backend"])
        if not be.available():
            raise ConfigRejected(f"backend {entry['backend']} is not available here")
        cfg = be.config_from_record(entry["config"], problem)
    except (ConfigRejected, ValueError, ImportError) as e:
        warn_once(("rejected", key), f"hybridgemm: table entry for {key.to_string()} cannot be used ({e}); "
                  "falling back to F.linear")
        return fallback_rule(problem, "table entry rejected")
    if status == signature.PROBE:  # a Triton config tuned under another Triton: run once against a reference
        verdict = probe.probe_entry(key, entry, be, cfg, problem, torch.device("cuda", device_index))
        if not verdict:
            if verdict.cached:
                warn_once(("probe", key), f"hybridgemm: table entry for {key.to_string()} ({why}) failed its "
                          f"correctness probe ({verdict.reason}); falling back to F.linear")
            choice = fallback_rule(problem, f"Triton config tuned under another Triton version, not probed or "
                                   f"failed its probe ({verdict.reason})")
            return dataclasses.replace(choice, provisional=not verdict.cached)
        reason += f"; {why}, passed its correctness probe"
    return Choice(entry["backend"], cfg, "table", key.to_string(), reason, lo, hi, worst)


# ----------------------------------------------------------------------------- explain


def _dims(shape, what: str, example: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or ValueError naming ``what``."""

    def bad() -> ValueError:
        return ValueError(f"{what} must be a sequence of non-negative ints such as {example}, got {shape!r:.80}")

    if isinstance(shape, (str, bytes)):
        raise bad()
    try:
        items = tuple(shape)
    except TypeError:
        raise bad() from None
    out = []
    for d in items:
        try:
            v = None if isinstance(d, bool) else operator.index(d)
        except TypeError:
            v = None
        if v is None or v < 0:
            raise bad()
        out.append(v)
    return tuple(out)


_ACCEPTED_DTYPES = ("a torch.dtype, or one of bf16, fp16, fp32, bfloat16, float16, float32, float64 "
                    "(or another torch dtype's name)")


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        name = dtype.strip().removeprefix("torch.")
        found = NAME_TO_DTYPE.get(name)
        if found is None:
            found = vars(torch).get(name)  # a lookup, not getattr: never imports or runs anything
        if not isinstance(found, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r:.40}; expected {_ACCEPTED_DTYPES}")
        return found
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be {_ACCEPTED_DTYPES}; got {dtype!r:.60}")
    return dtype


def explain(x_shape, w_shape, dtype: torch.dtype | str = torch.bfloat16, bias: bool = True,
            activation=None, device: int | None = None) -> str:
    """Which kernel ``hybridgemm.linear`` runs for these shapes, and why (a table hit with the
    M range it was validated on and its worst measured ratio to F.linear, or the fallback
    rule). Works without a GPU (it then says PyTorch runs).

    ``x_shape`` is one or more non-negative ints (``(..., K)``), ``w_shape`` two (``(N, K)``),
    with the same K; ``dtype`` a ``torch.dtype``, one of ``bf16``/``fp16``/``fp32``, or the name
    of a torch dtype (``bfloat16``, ``float16``, ``float32``, ``float64``, ...; a ``torch.``
    prefix is allowed). Anything else raises ValueError naming the argument and what it takes."""
    dtype = _parse_dtype(dtype)
    x_dims = _dims(x_shape, "x_shape", "(16, 4096) or (2, 8, 4096)")
    w_dims = _dims(w_shape, "w_shape", "(6144, 4096)")
    if not x_dims:
        raise ValueError("x_shape needs at least one dimension (its last is K), got ()")
    if len(w_dims) != 2:
        raise ValueError(f"w_shape must be two ints (N, K), got {w_dims}")
    act = Activation.parse(activation)
    bias = bool(bias)
    m = 1
    for d in x_dims[:-1]:
        m *= d
    n, k = w_dims
    if x_dims[-1] != k:
        raise ValueError(f"x_shape {x_dims} has {x_dims[-1]} features, w_shape expects {k}")
    problem = Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(act, bias), ldx=k, ldw=k, ldo=n,
                      tf32=uses_tf32(dtype))
    head = f"linear {DTYPE_NAMES.get(dtype, dtype)} M={m} N={n} K={k} epilogue={problem.epilogue.name}"
    if m == 0 or n == 0 or k == 0:
        return f"{head}: empty problem (M, N or K = 0), so PyTorch computes it (no GEMM)"
    invariant = get_mode() == modes.BATCH_INVARIANT
    if not torch.cuda.is_available():
        line = f"{head}: no CUDA device here, so PyTorch (F.linear) computes it on the CPU"
        if invariant and dtype in DTYPE_NAMES:
            line += (f"\n  batch_invariant mode: {batch_invariant_choice(problem, None).describe()} on an "
                     "H100/H200-class GPU; PyTorch on the CPU is not guaranteed batch-invariant")
        return line
    if dtype not in DTYPE_NAMES:
        tail = " (not guaranteed batch-invariant)" if invariant else ""
        return f"{head}: dtype not taken by any kernel, so PyTorch computes it{tail}"
    dev = torch.cuda.current_device() if device is None else device
    with torch.cuda.device(dev):
        if invariant:
            choice = batch_invariant_choice(problem, dev)
            return f"{head}\n  key {choice.key}\n  batch_invariant mode: {choice.describe()}"
        choice = choose(problem, dev)
    return f"{head}\n  key {choice.key}\n  runs {choice.describe()}"
