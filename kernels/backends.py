"""The backends behind one interface, for the dispatcher and the tuner.

Each backend adapts a kernels/ module to: ``available()``, ``candidates(problem)``,
``config_from_record(record, problem)`` (restore + validate: the same predicate the tuner
pruned with), ``run(config, x, w, b, out, act, tf32)`` and ``describe(config)``.
``PREFERENCE`` is the fixed order that breaks ties between candidates within measured
noise (written down so re-tuning reproduces the table): cuBLASLt first (the library F.linear
itself uses), then the Triton split-K and tiled kernels. A cuBLASLt config of ``None``
(record ``{}``) is its heuristic, asked at each call's exact M.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridgemm.kernels import cublaslt as lt
from hybridgemm.kernels import cublaslt_search as lts
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
    # Triton is imported on first use: importing hybridgemm must work where Triton is absent.
    from .triton_common import device_facts

    facts = device_facts(torch.device("cuda", device_index))
    return {"smem_limit": facts.smem_per_block, "capability": tuple(facts.capability)}


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _cublaslt() -> Backend:
    def candidates(problem: Problem, heuristic_count: int = 8, exhaustive_limit: int = 0):
        if not lt.supports(problem)[0]:
            return []
        return lts.candidates(problem, torch.cuda.current_device(), heuristic_count, exhaustive_limit)

    def from_record(record: dict, problem: Problem):
        ok, why = lt.supports(problem)
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

    return Backend("cublaslt", lt.is_available, candidates, from_record, run, lambda c: c.describe(), bind)


def _triton(module_name: str) -> Backend:
    mod = importlib.import_module(f"hybridgemm.kernels.{module_name}")
    cfg_cls = mod.TritonGemmConfig if module_name == "triton_gemm" else mod.TritonSplitKConfig

    def available() -> bool:
        return torch.cuda.is_available()

    def candidates(problem: Problem):
        limits = device_limits(torch.cuda.current_device())
        if module_name == "triton_splitk":
            limits = {**limits, "num_sms": num_sms(torch.cuda.current_device())}
        return mod.candidates(problem, **limits)

    def from_record(record: dict, problem: Problem):
        try:
            cfg = cfg_cls.from_record(record)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigRejected(f"bad {module_name} record: {e}") from None
        ok, why = cfg.supports(problem, **device_limits(torch.cuda.current_device()))
        if not ok:
            raise ConfigRejected(why)
        return cfg

    def run(config, x, w, b, out, act, tf32=False):
        return mod.run(config, x, w, b, out, act, tf32=tf32)

    def describe(cfg) -> str:
        rec = cfg.to_record()
        return " ".join(f"{k}={v}" for k, v in rec.items() if k != "kind")

    bind = None
    if hasattr(mod, "bind"):
        def bind(config, x, w, b, out, act, tf32=False):
            return mod.bind(config, x, w, b, out, act, tf32=tf32)

    return Backend(module_name, available, candidates, from_record, run, describe, bind)


PREFERENCE = ("cublaslt", "triton_splitk", "triton_gemm")
_FACTORIES = {"cublaslt": _cublaslt, "triton_gemm": lambda: _triton("triton_gemm"),
              "triton_splitk": lambda: _triton("triton_splitk")}


@functools.cache
def get_backend(name: str) -> Backend:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(PREFERENCE)}") from None


def available_backends() -> list[Backend]:
    """The backends that can run here, in preference order (import errors skip a backend)."""
    out = []
    for name in PREFERENCE:
        try:
            be = get_backend(name)
        except ImportError:
            continue
        if be.available():
            out.append(be)
    return out
