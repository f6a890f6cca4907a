"""The one-time correctness probe for a table entry tuned under another Triton version.

A Triton config that the backend's validity check accepts is still only known to compute
correctly under the Triton it was tuned with: the tuner checked it against an fp32 reference
there. Under another Triton, :func:`probe_entry` runs it once, before first use, on fresh
random operands of the call's problem (same M, N, K, dtype, epilogue, row strides and pointer
alignments) and compares it with an fp32 reference under the tuner's own bound
(``tuner.ERR_FLOOR``; ``max(2 x F.linear's own error, ERR_FLOOR[dtype])``). The answer is
cached per device, entry and config, so each entry is probed once per process.

The operands come from a private generator with a fixed seed: probing never advances the
caller's random number generators. Nothing is probed while a CUDA graph is being captured
(synchronising would break the capture): the result then says so and is not cached.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridgemm.kernels.epilogue import apply_activation
from hybridgemm.kernels.fp8 import GRANULARITY_OF_FORMAT, quantize_fp8
from hybridgemm.kernels.problem import MAX_ALIGNMENT, Problem

from .keys import TableKey
from .tuner import ERR_FLOOR

PROBE_SEED = 20240917


@dataclass(frozen=True)
class ProbeResult:
    """``ok``: the config matched the reference; ``reason``: why not (or the error measured).
    True in a boolean context exactly when ``ok``."""

    ok: bool
    reason: str = ""
    cached: bool = True  # False: not a verdict on the config (e.g. asked during graph capture)

    def __bool__(self) -> bool:
        return self.ok


_cache: dict[tuple, ProbeResult] = {}
_cache_lock = threading.Lock()


def _strided(rows: int, cols: int, ld: int, align: int, dtype: torch.dtype, device, gen) -> torch.Tensor:
    """A (rows, cols) view with row stride ``ld`` whose data pointer is aligned to exactly
    ``align`` bytes (below MAX_ALIGNMENT; CUDA allocations themselves are aligned further),
    filled with standard normal values (NaN without a generator)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    offset = align // itemsize if itemsize <= align < MAX_ALIGNMENT else 0
    ld = max(ld, cols)
    size = offset + (rows - 1) * ld + cols
    if gen is None:
        flat = torch.full((size,), float("nan"), device=device, dtype=dtype)
    else:
        flat = torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return flat.as_strided((rows, cols), (ld, 1), offset)


def operands(problem: Problem, device: torch.device | str, seed: int = PROBE_SEED):
    """Random ``x``, ``w``, ``b`` (None without a bias) and a NaN-filled ``out`` with the
    problem's shapes, row strides and pointer alignments, from a private generator."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    p = problem
    x = _strided(p.m, p.k, p.ldx, p.align_x, p.dtype, device, gen)
    w = _strided(p.n, p.k, p.ldw, p.align_w, p.dtype, device, gen)
    with torch.no_grad():
        w.mul_(p.k ** -0.5)
    b = _strided(1, p.n, p.n, p.align_bias, p.dtype, device, gen)[0] if p.epilogue.bias else None
    out = _strided(p.m, p.n, p.ldo, p.align_out, p.dtype, device, None)
    return x, w, b, out


def probe_config(backend: Any, config: Any, problem: Problem, device: torch.device | str | None = None) -> ProbeResult:
    """Run ``backend.run(config, ...)`` once on fresh operands of ``problem`` on ``device``
    (default: the current CUDA device) and compare with an fp32 reference under the tuner's
    bound. Never raises for a failing kernel: an exception is a failed probe. Uncached."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return ProbeResult(False, "not probed: a CUDA graph is being captured", cached=False)
    act = problem.epilogue.activation
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        with torch.no_grad():
            x, w, b, out = operands(problem, device)
            run_w, w_ref, w_base, scale = w, w.float(), w, None
            if problem.weight_format:  # an FP8 entry: the FP8 kernel on e4m3 data, against its dequantized weight
                q = quantize_fp8(w.contiguous(), GRANULARITY_OF_FORMAT[problem.weight_format])
                run_w, w_ref, w_base, scale = q.data, q.dequantize(torch.float32), q.dequantize(problem.dtype), q.scale
            torch.backends.cuda.matmul.allow_tf32 = False
            ref = apply_activation(F.linear(x.float(), w_ref, b.float() if b is not None else None), act)
            torch.backends.cuda.matmul.allow_tf32 = problem.tf32
            baseline = apply_activation(F.linear(x, w_base, b), act)
            torch.backends.cuda.matmul.allow_tf32 = old_tf32
            norm = ref.norm().item() or 1.0
            bound = max(2 * (baseline.float() - ref).norm().item() / norm, ERR_FLOOR[problem.dtype])
            del baseline
            if scale is None:
                backend.run(config, x, run_w, b, out, act, problem.tf32)
            else:
                backend.run(config, x, run_w, b, out, act, problem.tf32, weight_scale=scale)
            err = (out.float() - ref).norm().item() / norm
    except torch.cuda.OutOfMemoryError:
        return ProbeResult(False, "not probed: out of GPU memory for the probe's operands", cached=False)
    except Exception as e:  # a config that does not compile or launch under this Triton
        return ProbeResult(False, f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    if not err <= bound:  # NaN (an output element never written) fails too
        return ProbeResult(False, f"relative error {err:.2e} > {bound:.2e} against the fp32 reference")
    return ProbeResult(True, f"relative error {err:.2e} <= {bound:.2e}")


def probe_entry(key: TableKey, entry: dict, backend: Any, config: Any, problem: Problem,
                device: torch.device | str | None = None) -> ProbeResult:
    """:func:`probe_config` for the table entry ``entry`` at ``key`` (its restored ``config``
    on ``backend``, for the call's ``problem``), once per process per device, entry and
    config: later calls return the first verdict."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    ident = (str(device), key, entry.get("backend"), json.dumps(entry.get("config"), sort_keys=True))
    with _cache_lock:
        found = _cache.get(ident)
    if found is not None:
        return found
    result = probe_config(backend, config, problem, device)
    if result.cached:
        with _cache_lock:
            result = _cache.setdefault(ident, result)
    return result


def clear_cache() -> None:
    """Forget every verdict (the next :func:`probe_entry` of each entry probes again)."""
    with _cache_lock:
        _cache.clear()
