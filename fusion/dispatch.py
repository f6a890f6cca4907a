"""The dispatcher: which backend and configuration runs a given linear call.

``fused_linear(x, weight, bias, activation)`` is the forward GEMM behind ``hybridgemm.linear``
and the attention projection. The choice is a pure function of the loaded tuning table and
the problem; nothing is timed at call time.

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
Misses are logged once per key at debug level. ``explain()`` says which rule fired, and for
a table hit the range the entry was validated on and its worst measured ratio.

In ``batch_invariant`` mode (fusion/modes.py) rules 4-5 are replaced by one: the Triton tiled
kernel with the fixed config of :func:`hybridgemm.modes.fixed_config` (the same for every M),
else PyTorch with a warning. Cached decisions are kept per mode, so switching modes never
reuses a decision made in the other one.

Tables: loaded lazily per device (``load_tables``: explicit path > user table > shipped
tables matching the device). ``HYBRIDGEMM_TABLE`` or :func:`set_table_path` names an explicit
table; :func:`reload_tables` re-reads and clears every cached decision.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache import signature
from hybridgemm.autotune_cache.keys import ShapeKey
from hybridgemm.autotune_cache.table import TuningTable, load_tables
from hybridgemm.kernels import backends, cublaslt
from hybridgemm.kernels.backends import ConfigRejected
from hybridgemm.kernels.checks import (
    call_signature,
    check_gpu_kernel_args,
    check_linear_args,
    contiguous_bias,
    row_major,
    rows_2d,
    rows_are_flat,
)
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.problem import DTYPE_NAMES, NAME_TO_DTYPE, Problem

from . import modes

_log = logging.getLogger(__name__)
CACHE_SIZE = 1024


def torch_linear(x, weight, bias, activation: Activation) -> torch.Tensor:
    """The reference path: F.linear then the activation (CPU tensors, unsupported dtypes)."""
    return apply_activation(F.linear(x, weight, bias), activation)


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

    def describe(self) -> str:
        cfg = ""
        if self.config is not None:
            cfg = f" [{backends.get_backend(self.backend).describe(self.config)}]"
        elif self.backend == "cublaslt":
            cfg = " [heuristic at the exact M]"
        return f"{self.backend}{cfg} ({self.source}: {self.reason})"


class _Bounded(OrderedDict):
    mode = modes.DEFAULT  # the dispatch mode whose decisions this cache holds

    def put(self, key, value):
        self[key] = value
        while len(self) > CACHE_SIZE:
            self.popitem(last=False)


def _mode_caches(mode: str) -> tuple[_Bounded, _Bounded]:
    choices, fast = _Bounded(), _Bounded()
    choices.mode = fast.mode = mode
    return choices, fast


_lock = threading.Lock()
_tables: dict[int, Any] = {}
# Per mode: (decisions per problem, launchers per call signature). ``_choices``/``_fast`` are
# the current mode's; the hot path reads ``_fast`` once and the slow path works with that
# cache's ``.mode``, so a call racing a mode switch stays within one mode's decisions.
_MODE_CACHES = {m: _mode_caches(m) for m in modes.MODES}
_mode = [modes.DEFAULT]
_choices, _fast = _MODE_CACHES[_mode[0]]
_warned: set = set()
_generation = [0]  # see generation()
_explicit_path: list[str | None] = [None]


def set_table_path(path: str | os.PathLike | None) -> None:
    """Use this table (over the user and shipped ones) from now on; None: back to the default."""
    _explicit_path[0] = os.fspath(path) if path is not None else None
    reload_tables()


def reload_tables() -> None:
    """Forget loaded tables and every cached decision (the next call re-reads the tables)."""
    with _lock:
        _generation[0] += 1
        _tables.clear()
        for caches in _MODE_CACHES.values():
            for cache in caches:
                cache.clear()


def get_mode() -> str:
    """The current dispatch mode, ``"default"`` or ``"batch_invariant"`` (process-global)."""
    return _mode[0]


def set_mode(name: str) -> str:
    """Switch the dispatch mode for the whole process; returns the previous mode.

    ``"batch_invariant"``: rows of ``hybridgemm.linear`` are bit-identical for every M (the
    policy and its limits: fusion/modes.py). ``"default"``: the tuned kernels. Each mode keeps
    its own cached decisions, so a switch never reuses the other mode's.
    """
    global _choices, _fast
    if name not in modes.MODES:
        raise ValueError(f"unknown hybridgemm mode {name!r}; valid modes: {', '.join(map(repr, modes.MODES))}")
    with _lock:
        previous = _mode[0]
        _mode[0] = name
        _choices, _fast = _MODE_CACHES[name]
        _generation[0] += 1
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


def table_for_device(device_index: int):
    table = _tables.get(device_index)
    if table is None:
        explicit = _explicit_path[0] or os.environ.get("HYBRIDGEMM_TABLE") or None
        try:
            table = load_tables(signature.current_signature(device_index), explicit)
        except Exception as e:  # no device facts, no tables: every call runs F.linear, and says so once
            _warn_once(("tables", device_index), f"hybridgemm: tuning tables not loaded for device {device_index} "
                       f"({type(e).__name__}: {e}); every call runs F.linear")
            table = TuningTable(None)
        _tables[device_index] = table
    return table


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


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
    try:
        be = backends.get_backend(entry["backend"])
        if not be.available():
            raise ConfigRejected(f"backend {entry['backend']} is not available here")
        cfg = be.config_from_record(entry["config"], problem)
    except (ConfigRejected, ValueError, ImportError) as e:
        _warn_once(("rejected", key), f"hybridgemm: table entry for {key.to_string()} cannot be used ({e}); "
                   "falling back to F.linear")
        return fallback_rule(problem, "table entry rejected")
    return Choice(entry["backend"], cfg, "table", key.to_string(), reason, lo, hi, worst)


def _runner(choice: Choice):
    if choice.source == modes.SOURCE:
        return modes.run  # the tiled kernel, in row chunks past 32-bit offsets
    return backends.get_backend(choice.backend).run


def _run_choice(choice: Choice, x2, w2, b2, out, act, tf32) -> None:
    if choice.backend == "torch":
        out.copy_(torch_linear(x2, w2, b2, act))
        return
    _runner(choice)(choice.config, x2, w2, b2, out, act, tf32)


def _bindable(choice: Choice, x, w, b) -> bool:
    """Can calls of this signature skip every copy (x's rows flat, W row-major, the bias
    unit-stride and 16-byte aligned) and run the chosen kernel as it is?"""
    if choice.backend == "torch" or not rows_are_flat(x) or w.stride(1) != 1:
        return False
    n, k = w.shape
    return not ((n > 1 and w.stride(0) < k) or (b is not None and (b.stride(0) != 1 or b.data_ptr() % 16)))


def _raw_launch(choice: Choice, x2, w2, b2, out, act, tf32):
    """The backend's ``fn(xp, wp, bp, op)`` for this signature (see Backend.bind), or None."""
    if choice.source == modes.SOURCE:
        return None  # batch-invariant runs go through modes.run (row chunks)
    bind = backends.get_backend(choice.backend).bind
    return None if bind is None else bind(choice.config, x2, w2, b2, out, act, tf32)


def _torch_launcher(act: Activation):
    def launch_torch(x, w, b, xp, wp):
        return torch_linear(x, w, b, act)

    return launch_torch


def _launcher(choice: Choice, x, w, b, act, tf32, raw=None):
    """A no-checks callable for calls with this exact signature (the caller has checked
    :func:`_bindable`): ``raw`` wrapped with the output allocation when there is one."""
    n, k = w.shape
    m = x.numel() // k
    out_shape = (*x.shape[:-1], n)
    if raw is not None:
        def launch_raw(x, w, b, xp, wp):
            out = x.new_empty(out_shape)
            raw(xp, wp, 0 if b is None else b.data_ptr(), out.data_ptr())
            return out

        return launch_raw
    if choice.backend == "cublaslt":
        return cublaslt.launcher_for(x, w, b, act, choice.config)
    run, cfg = _runner(choice), choice.config

    def launch(x, w, b, xp, wp):
        out = x.new_empty((m, n))  # x's dtype and device; cheaper than torch.empty(dtype=, device=)
        run(cfg, x.reshape(m, k), w, b, out, act, tf32)
        return out.view(out_shape)

    return launch


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation=None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` for any leading dims of ``x``, on the chosen backend."""
    if x.device.type != "cuda" or x.dtype not in DTYPE_NAMES:
        check_linear_args(x, weight, bias, "hybridgemm.linear")
        return torch_linear(x, weight, bias, Activation.parse(activation))
    key, xp, wp = call_signature(x, weight, bias, activation)
    fast = _fast
    fn = fast.get(key)
    if fn is not None:
        return fn(x, weight, bias, xp, wp)
    return _fused_linear_slow(x, weight, bias, activation, key, fast.mode)


def _fused_linear_slow(x, weight, bias, activation, fast_key, mode: str = modes.DEFAULT, want_raw: bool = False):
    choices, fast = _MODE_CACHES[mode]
    invariant = mode == modes.BATCH_INVARIANT
    check_gpu_kernel_args(x, weight, bias, "hybridgemm.linear")
    act = Activation.parse(activation)
    lead = x.shape[:-1]
    n, k = weight.shape
    x2 = row_major(rows_2d(x))
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        y = torch_linear(x, weight, bias, act)
        return (y, None) if want_raw else y
    w2, b2 = row_major(weight), contiguous_bias(bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tf32 = x.dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)
    problem = Problem.from_tensors(x2, w2, b2, out, Epilogue(act, bias is not None), tf32)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    choice = choices.get((dev, problem))
    if choice is None:
        with torch.cuda.device(dev):
            choice = batch_invariant_choice(problem, dev) if invariant else choose(problem, dev)
        if invariant and choice.backend == "torch":
            _warn_once(("invariant", problem.n, problem.k, problem.dtype),
                       f"hybridgemm: batch_invariant mode cannot run {choice.key} on Triton; {choice.reason}")
        choices.put((dev, problem), choice)
    if choice.backend == "torch":  # F.linear itself: no output of ours to fill, no copy
        if fast_key is not None:
            fast.put(fast_key, _torch_launcher(act))
        y = torch_linear(x, weight, bias, act)
        return (y, None) if want_raw else y
    copied = invariant and choice.backend == "triton_gemm" and modes.needs_dense_x(choice.config, x2)
    if copied:  # one load path for every call: copy an x that TMA cannot describe
        x2 = x2.clone(memory_format=torch.contiguous_format)
    try:
        _run_choice(choice, x2, w2, b2, out, act, tf32)
    except ValueError as e:  # e.g. cuBLASLt has no algorithm for these alignments
        _warn_once(("run", problem), f"hybridgemm: {choice.backend} could not run {choice.key} ({e}); "
                   "computing this shape with PyTorch" + (" (NOT batch-invariant)" if invariant else ""))
        choice = Choice("torch", None, "rule", choice.key, f"{choice.backend} failed: {e}")
        choices.put((dev, problem), choice)
        out = torch_linear(x2, w2, b2, act)
    raw = None
    if not copied and _bindable(choice, x, weight, bias):
        raw = _raw_launch(choice, x2, w2, b2, out, act, tf32)
        launcher = _launcher(choice, x, weight, bias, act, tf32, raw)
        if launcher is not None and fast_key is not None:
            fast.put(fast_key, launcher)
    if want_raw:
        return out.reshape(*lead, n), raw
    return out.reshape(*lead, n)


def fused_linear_and_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            activation=None):
    """``(y, raw)``: ``y = fused_linear(x, weight, bias, activation)`` and the kernel that
    computed it as ``raw(xp, wp, bp, op)`` (raw data pointers, ``bp`` 0 without a bias; the
    output (M, N) row-major at ``op``), valid for later calls with operands of exactly this
    signature (shapes, strides, dtypes, devices, alignment classes) while :func:`generation`
    is unchanged; ``raw`` is None where no such launch exists (PyTorch computes it, a copy
    is needed, a backend without raw launches). For callers that keep their own per-signature
    cache and allocate the output in their own layout (the attention projection)."""
    if x.device.type != "cuda" or x.dtype not in DTYPE_NAMES:
        return fused_linear(x, weight, bias, activation), None
    return _fused_linear_slow(x, weight, bias, activation, None, _fast.mode, want_raw=True)


def generation() -> int:
    """Bumped whenever cached decisions become invalid (tables reloaded, mode switched)."""
    return _generation[0]


def explain(x_shape, w_shape, dtype: torch.dtype | str = torch.bfloat16, bias: bool = True,
            activation=None, device: int | None = None) -> str:
    """Which kernel ``hybridgemm.linear`` runs for these shapes, and why (a table hit with the
    M range it was validated on and its worst measured ratio to F.linear, or the fallback
    rule). Works without a GPU (it then says PyTorch runs).

    ``x_shape`` is one or more non-negative ints (``(..., K)``), ``w_shape`` two (``(N, K)``),
    with the same K; ``dtype`` a ``torch.dtype``, one of ``bf16``/``fp16``/``fp32``, or the name
    of a torch dtype (``bfloat16``, ``float16``, ``float32``, ``float64``, ...; a ``torch.``
    prefix is allowed). Anything else raises ValueError naming the argument and what it takes."""
    import operator

    def dims(shape, what: str, example: str) -> tuple[int, ...]:
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

    accepted = ("a torch.dtype, or one of bf16, fp16, fp32, bfloat16, float16, float32, float64 "
                "(or another torch dtype's name)")
    if isinstance(dtype, str):
        name = dtype.strip().removeprefix("torch.")
        found = NAME_TO_DTYPE.get(name)
        if found is None:
            found = vars(torch).get(name)  # a lookup, not getattr: never imports or runs anything
        if not isinstance(found, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r:.40}; expected {accepted}")
        dtype = found
    elif not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be {accepted}; got {dtype!r:.60}")
    x_dims = dims(x_shape, "x_shape", "(16, 4096) or (2, 8, 4096)")
    w_dims = dims(w_shape, "w_shape", "(6144, 4096)")
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
                      tf32=dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32))
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
