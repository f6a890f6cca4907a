"""The backends behind one interface, for the dispatcher and the tuner.

Each backend adapts a kernels/ module to: ``available()``, ``candidates(problem)``,
``config_from_record(record, problem)`` (restore + validate: the same predicate the tuner
pruned with), ``run(config, x, w, b, out, act, tf32)`` and ``describe(config)``.
``PREFERENCE`` is the fixed order that breaks ties between candidates within measured
noise (written down so re-tuning reproduces the table): cuBLASLt first (the library F.linear
itself uses), then the Triton split-K and tiled kernels. A cuBLASLt config of ``None``
(record ``{}``) is its heuristic, asked at each call's exact M.

FP8 weights (``problem.weight_format`` set, kernels/fp8.py): only the backends of
``FP8_BACKENDS`` read them (``run(..., weight_scale=scales)`` with the e4m3 data as ``w``); the
others offer no candidates for such a problem and reject its records. ``cublaslt_fp8``
(kernels/cublaslt_fp8.py) serves FP8 weights only, with one config, its heuristic (record ``{}``,
config ``None``).

A backend that cannot run here is skipped by :func:`available_backends`;
:func:`unavailable_backends` says why, with the fix (nvmath-python missing or broken,
Triton missing or too old, no CUDA device, ...), and :func:`warn_unavailable_once` says it
once per process as a :class:`BackendUnavailableWarning`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridgemm.kernels import cublaslt as lt
from hybridgemm.kernels import cublaslt_fp8 as lt8
from hybridgemm.kernels import cublaslt_search as lts
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import Problem


class ConfigRejected(ValueError):
    """A recorded configuration that does not fit the problem at hand (with the reason)."""


@dataclass(frozen=True)
class Backend:
    name: str
    available: Callable[[], bool]
    candidates: Callable[[Problem], list]
    config_from_record: Callable[[dict, Problem], Any]
    run: Callable[..., torch.Tensor]
    describe: Callable[[Any], str]
    # bind(config, x, w, b, out, act, tf32) -> fn(xp, wp, bp, op) or None: ``run`` for operands
    # of exactly this signature as raw pointers, once ``run`` has run it (the eager fast paths)
    bind: Callable[..., Any] | None = None


@functools.cache
def device_limits(device_index: int) -> dict:
    facts = triton_module("triton_launch").device_facts(torch.device("cuda", device_index))
    return {"smem_limit": facts.smem_per_block, "capability": tuple(facts.capability)}


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _format_refusal(name: str, problem: Problem) -> str:
    """Why backend ``name`` cannot take ``problem``'s weight ("" where it can): an FP8 weight
    is read by the backends of ``FP8_BACKENDS`` only."""
    if problem.weight_format and name not in FP8_BACKENDS:
        return f"{name} takes a weight of x's dtype, not {problem.weight_format}"
    return ""


def _cublaslt() -> Backend:
    def supports(problem: Problem) -> tuple[bool, str]:
        why = _format_refusal("cublaslt", problem)
        return (False, why) if why else lt.supports(problem)

    def candidates(problem: Problem, heuristic_count: int = 8, exhaustive_limit: int = 0):
        if not supports(problem)[0]:
            return []
        return lts.candidates(problem, torch.cuda.current_device(), heuristic_count, exhaustive_limit)

    def from_record(record: dict, problem: Problem):
        ok, why = supports(problem)
        if not ok:
            raise ConfigRejected(why)
        if not record:  # {}: the heuristic, asked at each call's exact M (what F.linear runs)
            return None
        try:
            return lts.restore_algo(record, problem, torch.cuda.current_device())
        except lt.InvalidAlgorithm as e:
            raise ConfigRejected(str(e)) from None

    def run(config, x, w, b, out, act, tf32=False):  # tf32 comes from torch's flag inside lt.run
        return lt.run(config, x, w, b, out, act)

    def bind(config, x, w, b, out, act, tf32=False):
        return lt.bind(config, x, w, b, out, act)

    # availability looked up at each call, not bound once: the registry is built on first use
    # and must not keep whatever ``lt.is_available`` was at that moment
    return Backend("cublaslt", lambda: lt.is_available(), candidates, from_record, run, lambda c: c.describe(), bind)


def _triton(mod) -> Backend:
    """The backend of a Triton GEMM module (triton_gemm or triton_splitk)."""
    module_name = mod.KIND
    cfg_cls = mod.TritonGemmConfig if module_name == "triton_gemm" else mod.TritonSplitKConfig

    def available() -> bool:
        return torch.cuda.is_available()

    def candidates(problem: Problem):
        if _format_refusal(module_name, problem):
            return []
        limits = device_limits(torch.cuda.current_device())
        if module_name == "triton_splitk":
            limits = {**limits, "num_sms": num_sms(torch.cuda.current_device())}
        return mod.candidates(problem, **limits)

    def from_record(record: dict, problem: Problem):
        why = _format_refusal(module_name, problem)
        if why:
            raise ConfigRejected(why)
        try:
            cfg = cfg_cls.from_record(record)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigRejected(f"bad {module_name} record: {e}") from None
        ok, why = cfg.supports(problem, **device_limits(torch.cuda.current_device()))
        if not ok:
            raise ConfigRejected(why)
        return cfg

    def run(config, x, w, b, out, act, tf32=False, **fusion):
        # fusion: split-K's norm=/residual=/rope=/counters= (the decode step's fused GEMMs)
        return mod.run(config, x, w, b, out, act, tf32=tf32, **fusion)

    def describe(cfg) -> str:
        rec = cfg.to_record()
        return " ".join(f"{k}={v}" for k, v in rec.items() if k != "kind")

    bind = None
    if hasattr(mod, "bind"):
        def bind(config, x, w, b, out, act, tf32=False, **fusion):
            # fusion: split-K's norm=/residual=/residual_scale= (the decode step's eager calls)
            return mod.bind(config, x, w, b, out, act, tf32=tf32, **fusion)

    return Backend(module_name, available, candidates, from_record, run, describe, bind)


class _Heuristic:
    """The one candidate of a backend that pins no algorithm: its heuristic, asked at each
    call's exact M (record ``{}``, restored as config ``None``)."""

    def to_record(self) -> dict:
        return {}


def _cublaslt_fp8() -> Backend:
    """cuBLASLt's FP8 GEMM for an FP8 weight (x quantized to e4m3 on the way in)."""

    def candidates(problem: Problem):
        return [_Heuristic()] if lt8.supports(problem)[0] else []

    def from_record(record: dict, problem: Problem):
        ok, why = lt8.supports(problem)
        if not ok:
            raise ConfigRejected(why)
        if record:
            raise ConfigRejected(f"cublaslt_fp8 pins no algorithm (record {{}}), got fields {sorted(record)}")
        return None

    def run(config, x, w, b, out, act, tf32=False, weight_scale=None, glu=None):
        # glu: x is a gated MLP's gate and up, whose product is formed as x is quantized (lt8.run)
        if weight_scale is None:
            raise ValueError("cublaslt_fp8 runs an e4m3 weight: weight_scale (its fp32 scales) is required")
        return lt8.run(x, w, weight_scale, b, out, act, glu=glu)

    return Backend("cublaslt_fp8", lambda: lt8.is_available(), candidates, from_record, run,
                   lambda c: "heuristic at the exact M")


PREFERENCE = ("cublaslt", "triton_splitk", "triton_gemm")
# The backends that read an FP8 weight. cublaslt_fp8 serves nothing else, so it stays out of
# PREFERENCE (the backends `hybridgemm show` lists and warn_unavailable_once checks for every
# process) and comes after them in the tuner's order (:func:`available_backends` with ``fp8``):
# among FP8 candidates within noise, split-K, which reads the weight as stored, where cuBLASLt's
# FP8 GEMM first quantizes x in a launch of its own.
FP8_BACKENDS = ("triton_splitk", "cublaslt_fp8")
FP8_ONLY = ("cublaslt_fp8",)
# The Triton modules are imported when their backend is first asked for: importing hybridgemm
# must work where Triton is absent.
_FACTORIES = {"cublaslt": _cublaslt, "triton_gemm": lambda: _triton(triton_module("triton_gemm")),
              "triton_splitk": lambda: _triton(triton_module("triton_splitk")), "cublaslt_fp8": _cublaslt_fp8}


@functools.cache
def get_backend(name: str) -> Backend:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_FACTORIES)}") from None


def available_backends(fp8: bool = False) -> list[Backend]:
    """The backends that can run here, in preference order (import errors skip a backend);
    with ``fp8`` also those only FP8 weights use (``FP8_ONLY``), last."""
    out = []
    for name in PREFERENCE + (FP8_ONLY if fp8 else ()):
        try:
            be = get_backend(name)
        except ImportError:
            continue
        if be.available():
            out.append(be)
    return out


# ------------------------------------------------------------------ why a backend is unavailable

LABELS = {"cublaslt": "cuBLASLt", "triton_splitk": "Triton split-K", "triton_gemm": "Triton tiled"}
_NVMATH_FIX = "pip install nvmath-python (Linux x86-64/aarch64), or pip install 'hybridgemm[cu13]'"
_TRITON_FIX = "pip install 'triton>=3.6' (Linux)"


class BackendUnavailableWarning(RuntimeWarning):
    """A backend cannot run in this process; calls it would serve run another kernel or F.linear."""


def _error_text(e: BaseException) -> str:
    text = " ".join(str(e).split())[:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _module_missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent that fails to import, or a broken __spec__
        return False


def _import_failure(name: str, e: BaseException) -> str:
    """Why importing backend ``name``'s module failed, and the fix."""
    missing = getattr(e, "name", None)
    if isinstance(e, ModuleNotFoundError) and missing and missing.split(".")[0] == "triton":
        if missing == "triton" or _module_missing("triton"):
            return f"Triton is not installed ({_TRITON_FIX})"
    if isinstance(e, ImportError) and "tensor_descriptor" in str(e):
        return (f"Triton {_triton_version_text()} lacks triton.tools.tensor_descriptor, which the tiled "
                f"kernel needs ({_TRITON_FIX})")
    if _module_missing("triton") and name.startswith("triton"):
        return f"Triton is not installed ({_TRITON_FIX})"
    return f"its module failed to import ({_error_text(e)})"


def _triton_version_text() -> str:
    try:
        import triton

        return str(triton.__version__)
    except Exception:
        return "(version unknown)"


def _cublaslt_problems() -> list[str]:
    """What keeps cuBLASLt from running here, most actionable first."""
    problems = []
    if _module_missing("nvmath"):
        problems.append(f"nvmath-python is not installed ({_NVMATH_FIX})")
    else:
        try:
            from nvmath.bindings import cublasLt
        except Exception as e:
            problems.append(f"nvmath-python failed to import ({_error_text(e)}; reinstall it: {_NVMATH_FIX})")
        else:
            if torch.cuda.is_available():
                try:
                    cublasLt.get_version()
                except Exception as e:
                    problems.append(f"libcublasLt could not be loaded ({_error_text(e)}; pip install "
                                    "'hybridgemm[cu13]' or '[cu12]' for the CUDA libraries)")
    return problems


def _not_available_reason(name: str) -> str:
    """Why backend ``name`` (imported fine) says it is not available."""
    problems = _cublaslt_problems() if name == "cublaslt" else []
    if not torch.cuda.is_available():
        problems.append("no CUDA device")
    return "; ".join(problems) or "its availability check says no"


def unavailable_backends() -> dict[str, str]:
    """Each backend that cannot run here (in preference order), with why and how to fix it;
    ``{}`` when every backend can run. Touches no GPU: it imports the backends' libraries and
    asks whether a CUDA device exists."""
    out = {}
    for name in PREFERENCE:
        try:
            be = get_backend(name)
        except Exception as e:
            out[name] = _import_failure(name, e) + ("" if torch.cuda.is_available() else "; no CUDA device")
            continue
        try:
            ok = bool(be.available())
        except Exception as e:
            out[name] = f"its availability check failed ({_error_text(e)})"
            continue
        if not ok:
            out[name] = _not_available_reason(name)
    return out


def describe_unavailable(missing: dict[str, str]) -> str:
    """One sentence naming the backends in ``missing`` (from :func:`unavailable_backends`)
    and why; backends that share a reason are named together."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in missing.items():
        by_reason.setdefault(reason, []).append(f"{LABELS.get(name, name)} ({name})")
    parts = []
    for reason, names in by_reason.items():
        who = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        parts.append(f"{who} unavailable: {reason}")
    return "; ".join(parts)


_warned_unavailable = threading.Event()
_warn_lock = threading.Lock()


def warn_unavailable_once(stacklevel: int = 2) -> dict[str, str]:
    """The first call in a process: if some backend cannot run here, one
    :class:`BackendUnavailableWarning` naming each and why, with the fix; returns what it
    warned about. Every later call returns ``{}`` at once (cheap enough for a hot path).
    ``stacklevel`` as for :func:`warnings.warn` (2: the caller's line)."""
    if _warned_unavailable.is_set():
        return {}
    with _warn_lock:
        if _warned_unavailable.is_set():
            return {}
        try:
            missing = unavailable_backends()
        finally:
            _warned_unavailable.set()
    if missing:
        warnings.warn(f"hybridgemm: {describe_unavailable(missing)}. The calls "
                      f"{'this backend' if len(missing) == 1 else 'these backends'} would serve run another "
                      "backend or F.linear; `hybridgemm show` lists the backends.",
                      BackendUnavailableWarning, stacklevel=stacklevel)
    return missing
