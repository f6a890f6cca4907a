"""cuBLASLt backend: ``act(x @ W.T + b)`` with the bias and activation in cuBLASLt's epilogue.

Reached through the raw ``nvmath.bindings.cublasLt`` bindings (nvmath's high-level
``Matmul.execute`` costs 63–83 µs of host time per call and its captured plans failed in
CUDA graphs on the H200; the raw call costs about what ``F.linear`` does).

Layout: cuBLASLt is column-major, so we compute ``D = op(A) @ op(B)`` with ``A = W`` seen as
a column-major ``(K, N)`` matrix (transposed: ``op(A) = W``, ``(N, K)``), ``B = x`` seen as a
column-major ``(K, M)`` matrix, and ``D`` column-major ``(N, M)`` — exactly row-major
``y (M, N)``. The bias runs along D's rows (length N), which is what ``*_BIAS`` epilogues do.

Epilogues: none, bias, relu, bias+relu, gelu_tanh, bias+gelu_tanh. cuBLASLt's GELU is the
tanh approximation; the exact (erf) GELU is not available here (Triton backend only).
Compute: fp32 accumulation for fp16/bf16; fp32 inputs use true fp32 (``COMPUTE_32F``) unless
``torch.backends.cuda.matmul.allow_tf32`` is set, then ``COMPUTE_32F_FAST_TF32`` as torch does.

Per exact operand signature (shapes, strides, pointer alignment classes, epilogue, dtype,
math mode) a :class:`~.cublaslt_plan.Plan` holds the descriptors and the algorithm; plans live
in a bounded LRU cache, and every launch goes through :meth:`Plan.call`. One 32 MiB workspace
per (device, stream), like PyTorch's own cuBLAS workspaces, kept for the life of the process
(kernels/cublaslt_runtime.py).
The call path does no host synchronisation and allocates only the output, through torch.

Determinism: cuBLASLt runs a fixed algorithm the same way every time (split-K reductions,
where an algorithm has them, are ordered: in-place with counters or through a workspace);
the same algorithm and problem give bit-identical results across calls and processes.
"""

from __future__ import annotations

import os

import torch

from .bounded_cache import BoundedCache
from .checks import (
    call_signature,
    check_gpu_kernel_args,
    contiguous_bias,
    flag_getter,
    flat_row_stride,
    operand_key,
    row_major,
    rows_2d,
    rows_are_flat,
)
from .cublaslt_algos import CublasLtAlgo, InvalidAlgorithm, read_algo_fields
from .cublaslt_plan import GemmSpec, Plan
from .cublaslt_runtime import (
    CUDA_DTYPE,
    OP_N,
    OP_T,
    WORKSPACE_BYTES,
    CublasLtUnavailable,
    CublasLtUnsupported,
    bindings,
    cublaslt_version,
    reduced_reduction_allowed,
    tf32_allowed,
)
from .epilogue import Activation, Epilogue, apply_activation
from .problem import Problem, dtype_name, pointer_alignment


def heuristic_workspace_bytes() -> int:
    """The workspace limit the heuristic ranks algorithms under (``heuristics()``, and so the
    untuned first choice): torch's cuBLASLt limit, ``CUBLASLT_WORKSPACE_SIZE`` KiB, 1 MiB when
    unset, at most :data:`WORKSPACE_BYTES`.

    Why not the 32 MiB we allocate: the limit changes the heuristic's ranking, and the bigger
    one is not better. Measured on the H200 (perf/results/h200/logs/diag_lt_heuristic.txt), 70b qkv M=16: under 32
    MiB the first pick is a 256x16 split-K=3 kernel, 1.09x F.linear's time; under 1 MiB it is
    the 128x16 no-split kernel F.linear runs. At M=1 the 1 MiB pick is F.linear's 512x8 split-K
    kernel. The tuner still times the 32 MiB ranking's algorithms too (cublaslt_search)."""
    try:
        kib = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024"))
    except ValueError:
        kib = 1024
    return max(0, min(WORKSPACE_BYTES, kib * 1024))


PLAN_CACHE_SIZE = 512

# (activation, bias) -> cublasLtEpilogue_t name
_EPILOGUE_NAMES = {
    (Activation.NONE, False): "DEFAULT",
    (Activation.NONE, True): "BIAS",
    (Activation.RELU, False): "RELU",
    (Activation.RELU, True): "RELU_BIAS",
    (Activation.GELU_TANH, False): "GELU",
    (Activation.GELU_TANH, True): "GELU_BIAS",
}


def is_available() -> bool:
    """True when a CUDA device and nvmath-python's cuBLASLt bindings are both present."""
    if not torch.cuda.is_available():
        return False
    try:
        bindings()
    except CublasLtUnavailable:
        return False
    return cublaslt_version() is not None


def epilogue_supported(epilogue: Epilogue) -> bool:
    return (epilogue.activation, epilogue.bias) in _EPILOGUE_NAMES


def supports(problem: Problem) -> tuple[bool, str]:
    """Can cuBLASLt run this problem at all? (Which algorithm fits is asked of cuBLASLt.)"""
    if problem.dtype not in CUDA_DTYPE:
        return False, f"dtype {problem.dtype} not supported (fp16, bf16, fp32)"
    if not epilogue_supported(problem.epilogue):
        return False, f"epilogue {problem.epilogue.name!r} has no cuBLASLt equivalent"
    if min(problem.m, problem.n, problem.k) < 1:
        return False, "empty problem (handled without a GEMM)"
    return True, ""


# ---------------------------------------------------------------------------------------
# The forward plan


def forward_plan(problem: Problem, device_index: int, reduced: bool = True) -> Plan:
    """The plan of ``out = act(x @ W.T + b)`` for ``problem`` (algorithm not yet chosen:
    :meth:`Plan.use`). Column-major: ``D (N, M) = op(A) @ B`` with A = W seen as ``(K, N)``,
    transposed; B = x seen as ``(K, M)``; D = out seen as ``(N, M)``. ``reduced``: torch's
    reduced-precision reduction flag for the dtype (:func:`reduced_reduction_allowed`)."""
    ok, why = supports(problem)
    if not ok:
        raise CublasLtUnsupported(why)
    p = problem
    spec = GemmSpec(p.dtype, p.tf32, OP_T, OP_N, _EPILOGUE_NAMES[(p.epilogue.activation, p.epilogue.bias)],
                    (p.k, p.n, p.ldw), (p.k, p.m, p.ldx), (p.n, p.m, p.ldo),
                    (p.align_w, p.align_x, p.align_out, p.align_out), heuristic_workspace_bytes(), reduced)
    return Plan(spec, device_index, _describe(p))


def _describe(p: Problem) -> str:
    return (f"{dtype_name(p.dtype)} M={p.m} N={p.n} K={p.k} epilogue={p.epilogue.name} "
            f"ld(x,w,out)=({p.ldx},{p.ldw},{p.ldo}) align(x,w,out)=({p.align_x},{p.align_w},{p.align_out})")


# Least recently used plans go first: a plan is rebuilt with a heuristic query.
_plans = BoundedCache(PLAN_CACHE_SIZE, lru=True)


def clear_caches() -> None:
    """Drop every cached plan (workspaces stay: captured graphs may still use them)."""
    _fast.clear()
    _plans.clear()


# ---------------------------------------------------------------------------------------
# The call path


def run(config: CublasLtAlgo | None, x: torch.Tensor, weight: torch.Tensor,
        bias: torch.Tensor | None, out: torch.Tensor, activation=None) -> torch.Tensor:
    """Backend contract: ``out[:] = act(x @ weight.T + bias)`` with algorithm ``config``
    (None: the heuristic's first choice). ``x`` (M, K), ``weight`` (N, K) and ``out`` (M, N)
    are CUDA, row-major with unit column stride (``row_major``), M, N, K ≥ 1, and ``bias``
    unit-stride and 16-byte aligned (``contiguous_bias``). No checks beyond that: the
    caller (``linear`` or the dispatcher) has made them."""
    act = activation if isinstance(activation, Activation) else Activation.parse(activation)
    xp, wp = x.data_ptr(), weight.data_ptr()
    key = _plan_key(config, x, xp, weight, wp, bias, out, act)
    plan = _plans.get(key)
    if plan is None:
        problem = Problem.from_tensors(x, weight, bias, out, Epilogue(act, bias is not None), tf32_allowed())
        plan = forward_plan(problem, x.device.index, reduced_reduction_allowed(x.dtype)).use(config)
        _plans.put(key, plan)
    plan.call(wp, xp, out.data_ptr(), bias.data_ptr() if bias is not None else 0)  # A = W, B = x, D = out
    return out


def _plan_key(config, x, xp: int, weight, wp: int, bias, out, act: Activation) -> tuple:
    """The plan key of :func:`run`, :func:`bind` (``out`` given) and :func:`launcher_for` (no
    ``out``: a fresh row-major output): the operands (``operand_key``: pointer alignment
    classes up to 256 bytes), the activation, torch's math flag for the dtype (TF32 for fp32,
    reduced-precision reduction for fp16/bf16), the algorithm."""
    key = operand_key(x, xp, weight, wp, bias, out)
    flag = flag_getter(key[2])  # x's dtype, already read
    return key, act, None if flag is None else flag(), None if config is None else config.data


def bind(config: CublasLtAlgo | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor, activation=None):
    """``fn(xp, wp, bp, op)``: :func:`run` for operands of exactly this signature (shapes,
    strides, dtype, device, pointer alignment classes) given as raw data pointers (``bp`` 0
    without a bias); no checks, no allocation. None unless :func:`run` has run this signature
    (it builds the plan)."""
    act = activation if isinstance(activation, Activation) else Activation.parse(activation)
    plan = _plans.get(_plan_key(config, x, x.data_ptr(), weight, weight.data_ptr(), bias, out, act))
    if plan is None:
        return None
    call = plan.call

    def launch(xp, wp, bp, op):  # A = W, B = x, D = out (see forward_plan)
        call(wp, xp, op, bp)

    return launch


# Fast path: a launcher per call signature (shapes, strides, dtypes, devices, pointer
# residues, activation, math flags; see checks.call_signature) so that a repeated call
# costs one dict lookup, the output allocation and the launch. Bounded.
_FAST_CACHE_SIZE = 1024
_fast = BoundedCache(_FAST_CACHE_SIZE)


def launcher_for(x, weight, bias, act: Activation, algo: CublasLtAlgo | None = None):
    """A callable ``(x, weight, bias, xp, wp) -> y`` that runs this exact call signature with no
    checks, or None where the operands cannot be passed as they are (a copy is needed, or the
    problem is empty). Valid only for operands of the same signature (the caller's key)."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    if m == 0 or n == 0 or k == 0 or x.device.type != "cuda" or not rows_are_flat(x):
        return None
    if weight.stride(1) != 1 or (n > 1 and weight.stride(0) < k):
        return None
    if bias is not None and (bias.stride(0) != 1 or bias.data_ptr() % 16):
        return None
    dtype = x.dtype
    xp, wp = x.data_ptr(), weight.data_ptr()
    key = _plan_key(algo, x, xp, weight, wp, bias, None, act)
    plan = _plans.get(key)
    if plan is None:
        ldx = flat_row_stride(x) if m > 1 else k
        ldw = weight.stride(0) if n > 1 else k
        problem = Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(act, bias is not None), ldx=ldx,
                          ldw=ldw, ldo=n, align_x=pointer_alignment(xp), align_w=pointer_alignment(wp),
                          tf32=dtype == torch.float32 and tf32_allowed())
        plan = forward_plan(problem, x.device.index, reduced_reduction_allowed(dtype)).use(algo)
        _plans.put(key, plan)
    out_shape = (*x.shape[:-1], n)
    call = plan.call

    def launch(x, weight, bias, xp, wp):
        y = x.new_empty(out_shape)  # ~1.3 µs cheaper than torch.empty(dtype=, device=) (host breakdown)
        call(wp, xp, y.data_ptr(), bias.data_ptr() if bias is not None else 0)  # A = W, B = x, D = y
        return y

    return launch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation=None, *, algo: CublasLtAlgo | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` through cuBLASLt, for CUDA fp16/bf16/fp32 tensors.

    ``x`` may have any leading dims and any strides (copied only when its rows are not
    row-major); misaligned pointers are passed to cuBLASLt's alignment-aware heuristics and,
    if it has no algorithm for them, copied to aligned storage. ``algo`` pins an algorithm
    (from :func:`candidates` or :func:`restore_algo`); ``out`` (M, N), if given, receives
    the result. M = 0 or N = 0 give an empty result; K = 0 gives ``act(bias)`` broadcast
    (zeros without bias), as ``F.linear`` does.
    """
    if out is not None:
        return _linear_checked(x, weight, bias, activation, algo, out)
    key, xp, wp = call_signature(x, weight, bias, activation)
    key = (key, algo.data if algo is not None else None)
    fn = _fast.get(key)
    if fn is not None:
        return fn(x, weight, bias, xp, wp)
    y = _linear_checked(x, weight, bias, activation, algo, None)
    fn = launcher_for(x, weight, bias, Activation.parse(activation), algo)
    if fn is not None:
        _fast.put(key, fn)
    return y


def _linear_checked(x, weight, bias, activation, algo, out) -> torch.Tensor:
    check_gpu_kernel_args(x, weight, bias, "cublaslt.linear")
    act = Activation.parse(activation)
    epi = Epilogue(act, bias is not None)
    if not epilogue_supported(epi):
        raise ValueError(f"cublaslt.linear: epilogue {epi.name!r} is not available in cuBLASLt "
                         "(exact GELU: use activation='gelu_tanh' or the Triton backend)")
    lead = x.shape[:-1]
    n, k = weight.shape
    x2 = row_major(rows_2d(x))
    m = x2.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"cublaslt.linear: out must be a ({m}, {n}) {x.dtype} tensor on {x.device} "
                         f"with unit column stride, got {tuple(out.shape)} {out.dtype} {out.device}")
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        z = bias.to(torch.float32).expand(m, n) if bias is not None else \
            torch.zeros((m, n), dtype=torch.float32, device=x.device)
        out.copy_(apply_activation(z, act))
        return out.reshape(*lead, n)
    w = row_major(weight)
    b = contiguous_bias(bias)
    try:
        run(algo, x2, w, b, out, act)
    except CublasLtUnsupported:
        # No algorithm for these alignments: retry on freshly allocated (512-byte aligned) copies.
        if algo is not None or min(pointer_alignment(p) for p in (x2.data_ptr(), w.data_ptr(), out.data_ptr())) >= 16:
            raise
        tmp = torch.empty((m, n), dtype=x.dtype, device=x.device)
        run(None, x2.contiguous().clone(), w.contiguous().clone(), b, tmp, act)
        out.copy_(tmp)
    return out.reshape(*lead, n)


__all__ = [
    "WORKSPACE_BYTES", "CublasLtAlgo", "CublasLtUnavailable", "CublasLtUnsupported", "InvalidAlgorithm", "Plan",
    "clear_caches", "cublaslt_version", "epilogue_supported", "forward_plan", "heuristic_workspace_bytes",
    "is_available", "launcher_for", "linear", "read_algo_fields", "run", "supports",
]
