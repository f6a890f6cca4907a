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
     the backend's validity check (which warns once): F.linear itself (:func:`fallback_rule`).
Rules 1-3 are applied by the caller (fusion/dispatch.py) before it asks for a decision;
:func:`choose` is rules 4-5. Misses are logged once per key at debug level.

Gate/up of a gated MLP (the stacked gate and up weights): :func:`choose_gated`, the table's
gated entries at decode rows (autotune_cache/tune_glu.py), else one rule, picks the Triton
gated kernel and its config or two GEMMs through rules 1-5.

A GEMM of the fused decode step (a norm prologue, the rotary/cache or residual epilogue, which
only Triton split-K carries) asks :func:`choose_fusable`: the entry's split-K candidate where it
tied with the winner, and split-K's untuned config where no entry holds the shape at decode rows.

Tables: loaded lazily per device (:func:`table_for_device`: explicit path > user table >
shipped tables matching the device). ``HYBRIDGEMM_TABLE`` or :func:`set_table_path` names an
explicit table; :func:`reload_tables` re-reads them. Decisions already cached elsewhere stop
holding when the tables are reloaded or the mode switches: :func:`on_change` tells the cache
holders of both.

What lives elsewhere: the mode and its switches in fusion/mode_state.py; the batch-invariant
mode's decision, which replaces rules 4-5 (``batch_invariant_choice``), in fusion/modes.py;
``explain()``, which says which rule fired, in fusion/explain.py; ``warn_once`` in
fusion/diagnostics.py; ``uses_tf32`` in kernels/problem.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridgemm.autotune_cache import probe, signature, tune_glu
from hybridgemm.autotune_cache.keys import ShapeKey
from hybridgemm.autotune_cache.table import TuningTable, load_tables
from hybridgemm.autotune_cache.tuner import KERNEL_TIE
from hybridgemm.kernels import backends
from hybridgemm.kernels.backends import ConfigRejected
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import DECODE_MAX_M, Problem

from . import mode_state
from .diagnostics import warn_once

_log = logging.getLogger(__name__)

# A fused decode piece whose shape the table does not hold runs split-K's untuned config up to
# this M (the decode step's rows, fusion/models/decode_checks.DECODE_ROWS) in fp16/bf16.
FUSED_UNTUNED_MAX_M = 16
_HALF_DTYPES = (torch.float16, torch.bfloat16)

# Module state: containers are changed in place, so no name is ever rebound and every reader
# holds the same object.
_tables: dict[int, TuningTable] = {}  # per device index
_explicit_path: list[str | None] = [None]
_hooks: list[Callable[[str, bool], None]] = []


@dataclass(frozen=True)
class Choice:
    backend: str  # "cublaslt", "triton_gemm", "triton_splitk" or "torch"; gate/up: "triton_glu" or "torch"
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
        if self.config is not None and self.backend == "triton_glu":  # (not a backend of plain calls)
            cfg = f" [{self.config}]"
        elif self.config is not None:
            cfg = f" [{backends.get_backend(self.backend).describe(self.config)}]"
        elif self.backend == "cublaslt":
            cfg = " [heuristic at the exact M]"
        return f"{self.backend}{cfg} ({self.source}: {self.reason})"


# ----------------------------------------------------------------------------- changes


def on_change(hook: Callable[[str, bool], None]) -> None:
    """Call ``hook(mode, tables_reloaded)`` under the mode lock whenever decisions made so far
    stop holding: the tables reloaded (``True``: every mode's decisions; ``mode`` is the current
    one) or the mode switched (``False``; ``mode`` is the new one). How fusion/dispatch.py keeps
    its caches in step without this module importing it."""
    _hooks.append(hook)


def _mode_switched(mode: str) -> None:
    for hook in _hooks:
        hook(mode, False)


mode_state.on_switch(_mode_switched)


def set_table_path(path: str | os.PathLike | None) -> None:
    """Use this table (over the user and shipped ones) from now on; None: back to the default."""
    _explicit_path[0] = os.fspath(path) if path is not None else None
    reload_tables()


def reload_tables() -> None:
    """Forget loaded tables and every cached decision (the next call re-reads the tables)."""
    with mode_state.held() as mode:
        _tables.clear()
        _gated.clear()
        for hook in _hooks:
            hook(mode, True)


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
    return Choice("torch", None, "rule", call_key(problem), f"{why}; F.linear")


def call_key(problem: Problem) -> str:
    """A decision's key when no table entry decided: the shape key and the M asked for."""
    return f"{ShapeKey.from_problem(problem).to_string()} at M={problem.m}"


def choose(problem: Problem, device_index: int) -> Choice:
    """Rules 4-5 for one problem (pure given the loaded table)."""
    table = table_for_device(device_index)
    hit = table.find(ShapeKey.from_problem(problem), problem.m)
    if hit is None:
        _log.debug("hybridgemm: no table entry for %s", call_key(problem))
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


def choose_fusable(problem: Problem, device_index: int) -> Choice:
    """:func:`choose` for a GEMM that carries work around it (the fused decode step's norm
    prologue, rotary/KV-cache or residual epilogue), which only Triton split-K can carry: where
    the table's winner is another backend, the entry's best split-K candidate if the tuner
    timed it tied with the winner by its own rule (worst ratio within ``KERNEL_TIE``, 3%,
    autotune_cache/tuner.py) -- the tie broken toward the kernel that also does the work
    around the GEMM, which the plain GEMM's timing does not count. No entry at this M:
    :func:`_untuned_fusable`. Anything else: ``choose``'s answer (the caller then composes the
    fusion around that GEMM)."""
    choice = choose(problem, device_index)
    if choice.backend == "triton_splitk":
        return choice
    table = table_for_device(device_index)
    hit = table.find(ShapeKey.from_problem(problem), problem.m)
    if hit is None:
        return _untuned_fusable(problem, device_index, choice)
    if choice.source != "table":
        return choice
    key, entry = hit
    tied = [c for c in entry.get("candidates", ()) if c.get("backend") == "triton_splitk"
            and isinstance(c.get("worst_ratio"), (int, float))
            and c["worst_ratio"] * (1 + KERNEL_TIE) >= entry["worst_ratio"]]
    if not tied:
        return choice
    best = max(tied, key=lambda c: c["worst_ratio"])
    if table.signature is not None and signature.entry_verdict(
            "triton_splitk", best["config"], table.tuned_triton(key, "triton_splitk"), table.signature)[0] \
            != signature.USE:
        return choice  # tuned under another Triton: not run unchecked
    try:
        be = backends.get_backend("triton_splitk")
        if not be.available():
            return choice
        cfg = be.config_from_record(best["config"], problem)
    except (ConfigRejected, ValueError, ImportError):
        return choice
    reason = (f"{choice.reason}; for a fused piece its split-K candidate, tied with the winner "
              f"({best['worst_ratio']:.3f}x against {entry['worst_ratio']:.3f}x)")
    return Choice("triton_splitk", cfg, "table", key.to_string(), reason, key.m_lo, key.m_hi, best["worst_ratio"])


def _untuned_fusable(problem: Problem, device_index: int, choice: Choice) -> Choice:
    """A fused piece whose shape no table entry holds at this M: split-K's untuned config
    (kernels/triton_splitk_configs.py ``untuned_config``, chosen from the shipped table's timings) for
    a bf16/fp16 weight at decode rows (at most :data:`FUSED_UNTUNED_MAX_M`), else ``choice``.
    Without it the piece would compose its fusion around F.linear (the plain rule 5), which
    measured slower than the stock layer end to end (gemma-7b before its entries were tuned:
    0.88x compiled decode, perf/results/h200/logs/bench_e2e_gemma-7b_untuned_9901807.txt)."""
    if problem.m > FUSED_UNTUNED_MAX_M or problem.weight_format or problem.dtype not in _HALF_DTYPES:
        return choice
    try:
        be = backends.get_backend("triton_splitk")
        if not be.available():
            return choice
        cfg = triton_module("triton_splitk").untuned_config(problem, num_sms=backends.num_sms(device_index),
                                                            **backends.device_limits(device_index))
        if cfg is None:
            return choice
        cfg = be.config_from_record(cfg.to_record(), problem)
    except (ConfigRejected, ValueError, ImportError):
        return choice
    return Choice("triton_splitk", cfg, "rule", choice.key,
                  f"no table entry holds this M; a fused piece at M <= {FUSED_UNTUNED_MAX_M} runs split-K's untuned "
                  "config")


# ----------------------------------------------------------------------------- FP8 weights


def choose_fp8(problem: Problem, device_index: int) -> Choice:
    """Rules 4-5 for an FP8 weight (``problem.weight_format`` set; the caller has checked that
    the device runs FP8 kernels). Rule 4 as for any call, on the format's own key
    (``linear_e4m3_channel|...``). Rule 5: at decode rows (M ≤ DECODE_MAX_M) the Triton split-K
    kernel streaming the e4m3 bytes (default config), which reads half the weight bytes of the
    bf16 GEMM and none of a dequantized copy; past them ``torch``: the weight dequantized to
    x's dtype, then that dtype's decision."""
    choice = choose(problem, device_index)
    if choice.source == "table" or choice.backend != "torch":
        return choice
    config = fp8_decode_config(problem, backends.num_sms(device_index), **backends.device_limits(device_index))
    if config is not None:
        return Choice("triton_splitk", config, "rule", choice.key,
                      f"no table entry for this FP8 weight; M={problem.m} <= {DECODE_MAX_M}: the split-K kernel "
                      "streaming e4m3 (default config, one-launch reduction)")
    return dataclasses.replace(choice, reason=f"no table entry for this FP8 weight at M={problem.m}; "
                               "dequantize, then that dtype's decision")


def fp8_decode_config(problem: Problem, num_sms: int | None, **limits):
    """The split-K config rule 5 runs for an FP8 weight without a table entry on a GPU of
    ``num_sms`` SMs (None: an H100/H200's) and ``limits`` (backends.device_limits; the kernel's
    defaults where absent): at decode rows (M ≤ DECODE_MAX_M) the default config
    (kernels/triton_splitk_configs.py ``default_config``: 64-row tiles, 256 e4m3 bytes of K per stage,
    about two waves) with the one-launch reduction, which the decode step's rotary/KV-cache
    epilogue needs; None past the decode rows or where split-K cannot run the problem."""
    if problem.m > DECODE_MAX_M:
        return None
    splitk = triton_module("triton_splitk")
    try:
        cfg = splitk.default_config(problem, **({} if num_sms is None else {"num_sms": num_sms}), **limits)
    except ValueError:
        return None
    return dataclasses.replace(cfg, fused_reduce=cfg.split_k > 1)


# ------------------------------------------------------------------------- the gated rule

# Rows of x up to which gate/up without a norm prologue runs the Triton gated kernel (the
# product in its epilogue, kernels/triton_glu.py) rather than two GEMMs and a separate product.
# Measured on the H200 at Llama-3-8B's gate/up (I = 14336, K = 4096, bf16), the stock module's
# GPU time / the kernel's: 1.15x at M = 1 and 1.12x at M = 8 (perf/results/h200/sweep_triton_glu.csv),
# 1.19x at M = 64, but 0.68x at M = 333 (perf/results/h200/mlp_h200.csv).
TRITON_GLU_MAX_M = 64
_GLU_DTYPES = (torch.float16, torch.bfloat16)


def choose_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 norm_weight: torch.Tensor | None = None, tuned: bool = True, *, fp32_factor: bool = False) -> Choice:
    """Gate/up of a gated MLP over the stacked weight (2I, K); ``norm_weight``: x is RMS-normalised
    in the kernel's prologue by this factor (the fused decode step, which has checked its own
    conditions: CUDA inference at decode rows), ``fp32_factor``: by a factor formed from it in
    fp32 (a Gemma / OLMo 2 norm's weight: the table's fp32-norm entries whatever its dtype). Rule 4, at decode rows (M ≤
    ``tune_glu.GLU_M_MAX``) of fp16/bf16 inference in the default mode: the table's entry for the
    shape and prologue (autotune_cache/tune_glu.py): the gated kernel with its config, or
    ``torch`` (with a prologue: the norm apart, then gate/up as decided without one). Otherwise
    the rules: with a prologue the gated kernel; without, the gated kernel for inference on
    CUDA fp16/bf16 at M ≤ :data:`TRITON_GLU_MAX_M` in the default mode with unit-stride weight
    rows; else ``torch``: two GEMMs through the dispatcher and the product in x's dtype
    (``hybridgemm.gated_linear``'s halves). A rule's kernel runs its default config.
    ``tuned=False``: the rules alone (what a torch.compile trace asks: the table is read when
    the op runs, not baked into the graph)."""
    key = f"glu|N={weight.shape[0] // 2}|K={weight.shape[-1]}"
    m = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    kernel_ok = (x.is_cuda and x.dtype in _GLU_DTYPES and weight.dtype == x.dtype and not grad
                 and isinstance(m, int) and weight.stride(-1) == 1 and mode_state.get_mode() == mode_state.DEFAULT
                 and (bias is None or bias.dtype == x.dtype))
    if tuned and kernel_ok and 1 <= m <= tune_glu.GLU_M_MAX:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        entry_choice = tuned_gated(index, x.dtype, weight.shape[0] // 2, weight.shape[1], bias is not None,
                                   "fp32" if fp32_factor and norm_weight is not None
                                   else tune_glu.norm_kind(norm_weight, x.dtype), m)
        if entry_choice is not None:
            return entry_choice
    if norm_weight is not None:
        return Choice("triton_glu", None, "rule", key, "the decode step's gated kernel with the norm prologue")
    if kernel_ok and 1 <= m <= TRITON_GLU_MAX_M:
        return Choice("triton_glu", None, "rule", key, f"inference at M={m} <= {TRITON_GLU_MAX_M}")
    return Choice("torch", None, "rule", key, "two GEMMs through the dispatcher, the product apart")


# gated decisions from the table per (device, dtype, I, K, bias, prologue, M) (None: a miss);
# emptied when the tables are reloaded (reload_tables)
_gated: dict[tuple, Choice | None] = {}
_UNDECIDED = object()


def tuned_gated(device_index: int, dtype: torch.dtype, intermediate: int, k: int, bias: bool, norm: str | None,
                m: int) -> Choice | None:
    """The table's decision for a gated call at decode rows (:func:`choose_gated`; ``norm`` the
    prologue's kind, tune_glu.norm_kind), None on a miss or a bad entry (which warns once)."""
    memo = (device_index, dtype, intermediate, k, bias, norm, m)
    known = _gated.get(memo, _UNDECIDED)  # (one read: another thread may empty the cache)
    if known is not _UNDECIDED:
        return known
    key = tune_glu.glu_key(norm, dtype, intermediate, k, 1, 1, bias)
    found = table_for_device(device_index).find(key.shape, m)
    choice = None
    if found is not None:
        hit, entry = found
        tail = f"table entry {hit.to_string()} (worst {entry['worst_ratio']:.3f}x its baseline)"
        if entry["backend"] == "torch":
            how = "the norm apart, then gate/up as decided without it" if norm else "two GEMMs, the product apart"
            choice = Choice("torch", None, "table", hit.to_string(), f"{tail}: {how}", hit.m_lo, hit.m_hi,
                            entry["worst_ratio"])
        elif entry["backend"] != tune_glu.BACKEND:
            warn_once(("glu-entry", hit), f"hybridgemm: {hit.to_string()}: backend {entry['backend']!r} is not one "
                      f"of a gated entry's (torch, {tune_glu.BACKEND}); the gated rule decides")
        else:
            try:
                cfg = tune_glu.config_of(entry["config"])
                ok, why = cfg.supports(m, intermediate, k, dtype,
                                       smem_limit=backends.device_limits(device_index)["smem_limit"])
                if not ok:
                    raise ValueError(f"{cfg} cannot run it: {why}")
                choice = Choice("triton_glu", cfg, "table", hit.to_string(), f"{tail}: triton_glu {cfg}", hit.m_lo,
                                hit.m_hi, entry["worst_ratio"])
            except ValueError as exc:
                warn_once(("glu-entry", hit), f"hybridgemm: {hit.to_string()}: {exc}; the gated rule decides")
    if len(_gated) > 4096:
        _gated.clear()
    _gated[memo] = choice
    return choice
