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

Per exact problem (shape, strides, pointer alignment class, epilogue, dtype, math mode) a
:class:`Plan` holds the descriptors and the algorithm; plans live in a bounded LRU cache.
One 32 MiB workspace per (device, stream), like PyTorch's own cuBLAS workspaces, and kept
for the life of the process (a CUDA graph captured with it may replay any time).
The call path does no host synchronisation and allocates only the output, through torch.

Determinism: cuBLASLt runs a fixed algorithm the same way every time (split-K reductions,
where an algorithm has them, are ordered: in-place with counters or through a workspace);
the same algorithm and problem give bit-identical results across calls and processes.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np
import torch

from .checks import (
    call_signature,
    check_gpu_kernel_args,
    contiguous_bias,
    flat_row_stride,
    row_major,
    rows_2d,
    rows_are_flat,
)
from .cublaslt_algos import CublasLtAlgo, InvalidAlgorithm, read_algo_fields
from .epilogue import Activation, Epilogue, apply_activation
from .problem import MAX_ALIGNMENT, Problem, dtype_name

WORKSPACE_BYTES = 32 * 1024 * 1024  # allocated per device+stream: what cuBLAS recommends on Hopper


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
HEURISTIC_COUNT = 16

_CUDA_R_16F, _CUDA_R_32F, _CUDA_R_16BF = 2, 0, 14
_CUDA_DTYPE = {torch.float16: _CUDA_R_16F, torch.bfloat16: _CUDA_R_16BF, torch.float32: _CUDA_R_32F}
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_OP_N, _OP_T = 0, 1

# (activation, bias) -> cublasLtEpilogue_t name
_EPILOGUE_NAMES = {
    (Activation.NONE, False): "DEFAULT",
    (Activation.NONE, True): "BIAS",
    (Activation.RELU, False): "RELU",
    (Activation.RELU, True): "RELU_BIAS",
    (Activation.GELU_TANH, False): "GELU",
    (Activation.GELU_TANH, True): "GELU_BIAS",
}


class CublasLtUnavailable(RuntimeError):
    """nvmath-python (cuBLASLt bindings) or a CUDA device is missing."""


class CublasLtUnsupported(ValueError):
    """cuBLASLt offers no algorithm for this problem (the caller may fall back)."""


def _lt():
    try:
        from nvmath.bindings import cublasLt
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise CublasLtUnavailable(
            "the cuBLASLt backend needs nvmath-python: pip install 'hybridgemm[cu13]' "
            f"(or [cu12]) on a CUDA machine ({e})"
        ) from e
    return cublasLt


def is_available() -> bool:
    """True when a CUDA device and nvmath-python's cuBLASLt bindings are both present."""
    if not torch.cuda.is_available():
        return False
    try:
        _lt()
    except CublasLtUnavailable:
        return False
    return cublaslt_version() is not None


_VERSION: list[int | None] = []


def cublaslt_version() -> int | None:
    """The loaded cuBLASLt's version (e.g. 130100), or None where it cannot be loaded."""
    if not _VERSION:
        try:
            _VERSION.append(int(_lt().get_version()))
        except Exception:  # no nvmath, or no libcublasLt on this machine
            _VERSION.append(None)
    return _VERSION[0]


def epilogue_supported(epilogue: Epilogue) -> bool:
    return (epilogue.activation, epilogue.bias) in _EPILOGUE_NAMES


def supports(problem: Problem) -> tuple[bool, str]:
    """Can cuBLASLt run this problem at all? (Which algorithm fits is asked of cuBLASLt.)"""
    if problem.dtype not in _CUDA_DTYPE:
        return False, f"dtype {problem.dtype} not supported (fp16, bf16, fp32)"
    if not epilogue_supported(problem.epilogue):
        return False, f"epilogue {problem.epilogue.name!r} has no cuBLASLt equivalent"
    if min(problem.m, problem.n, problem.k) < 1:
        return False, "empty problem (handled without a GEMM)"
    return True, ""


# ---------------------------------------------------------------------------------------
# Per-device handles and per-(device, stream) workspaces

_lock = threading.Lock()
_handles: dict[int, int] = {}
_workspaces: dict[tuple[int, int], torch.Tensor] = {}


def _handle(device_index: int) -> int:
    h = _handles.get(device_index)
    if h is None:
        with _lock, torch.cuda.device(device_index):
            h = _handles.get(device_index)
            if h is None:
                h = _handles[device_index] = int(_lt().create())
    return h


_workspace_ptrs: dict[tuple[int, int], int] = {}


def _workspace_ptr(device_index: int, stream: int) -> int:
    ptr = _workspace_ptrs.get((device_index, stream))
    if ptr is None:
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device_index))
        _workspaces[(device_index, stream)] = ws  # keeps the memory alive for the process
        ptr = _workspace_ptrs[(device_index, stream)] = ws.data_ptr()
    return ptr


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _set_attr(setter, obj: int, attr, value, dtype) -> None:
    buf = np.array([value], dtype=dtype)
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


# ---------------------------------------------------------------------------------------
# Plans: descriptors for one exact problem plus the algorithm to run


class Plan:
    """cuBLASLt descriptors for one problem; ``algo`` is set by :meth:`use`."""

    def __init__(self, problem: Problem, device_index: int, allow_reduced_reduction: bool = True):
        ok, why = supports(problem)
        if not ok:
            raise CublasLtUnsupported(why)
        lt = _lt()
        self.problem = problem
        self.device_index = device_index
        self.handle = _handle(device_index)
        self._lt = lt
        self._destroyed = False
        p = problem
        dt = _CUDA_DTYPE[p.dtype]
        compute = _COMPUTE_32F_FAST_TF32 if p.tf32 else _COMPUTE_32F
        self.compute_type, self.scale_type, self.data_type = compute, _CUDA_R_32F, dt
        D = lt.MatmulDescAttribute
        self.desc = lt.matmul_desc_create(compute, _CUDA_R_32F)
        _set_attr(lt.matmul_desc_set_attribute, self.desc, D.TRANSA, _OP_T, np.int32)
        _set_attr(lt.matmul_desc_set_attribute, self.desc, D.TRANSB, _OP_N, np.int32)
        epi = lt.Epilogue[_EPILOGUE_NAMES[(p.epilogue.activation, p.epilogue.bias)]]
        _set_attr(lt.matmul_desc_set_attribute, self.desc, D.EPILOGUE, int(epi), np.uint32)
        self.adesc = lt.matrix_layout_create(dt, p.k, p.n, p.ldw)
        self.bdesc = lt.matrix_layout_create(dt, p.k, p.m, p.ldx)
        self.ddesc = lt.matrix_layout_create(dt, p.n, p.m, p.ldo)
        P = lt.MatmulPreferenceAttribute
        self.pref = lt.matmul_preference_create()
        self._heuristic_ws = heuristic_workspace_bytes()
        _set_attr(lt.matmul_preference_set_attribute, self.pref, P.MAX_WORKSPACE_BYTES,
                  self._heuristic_ws, np.uint64)
        for attr, align in ((P.MIN_ALIGNMENT_A_BYTES, p.align_w), (P.MIN_ALIGNMENT_B_BYTES, p.align_x),
                            (P.MIN_ALIGNMENT_C_BYTES, p.align_out), (P.MIN_ALIGNMENT_D_BYTES, p.align_out)):
            _set_attr(lt.matmul_preference_set_attribute, self.pref, attr, align, np.uint32)
        if not allow_reduced_reduction:  # as torch does when reduced-precision reduction is off
            mask = int(lt.ReductionScheme.MASK) & ~int(lt.ReductionScheme.OUTPUT_TYPE)
            _set_attr(lt.matmul_preference_set_attribute, self.pref, P.REDUCTION_SCHEME_MASK,
                      mask, np.uint32)
        # Host buffers and their addresses, read once: numpy's .ctypes.data costs ~1 µs a call.
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        self._bias_holder = np.zeros(1, dtype=np.int64)
        self._alpha_ptr, self._beta_ptr = self._alpha.ctypes.data, self._beta.ctypes.data
        self._bias_holder_ptr = self._bias_holder.ctypes.data
        self._matmul = lt.matmul
        self._set_desc_attr = lt.matmul_desc_set_attribute
        self._last_bias = -1
        self._call_lock = threading.Lock()
        self.algo: CublasLtAlgo | None = None
        self._algo_buf: np.ndarray | None = None

    # -- algorithms --------------------------------------------------------------------
    def heuristics(self, count: int = HEURISTIC_COUNT, max_workspace: int | None = None) -> list[CublasLtAlgo]:
        """cuBLASLt's heuristic ranking, best first (deterministic for a given library), for
        algorithms needing at most ``max_workspace`` bytes (default: heuristic_workspace_bytes())."""
        lt = self._lt
        results = np.zeros(count, dtype=lt.matmul_heuristic_result_dtype)
        n_found = np.zeros(1, dtype=np.int32)
        limit = self._heuristic_ws if max_workspace is None else min(int(max_workspace), WORKSPACE_BYTES)
        P = lt.MatmulPreferenceAttribute
        if limit != self._heuristic_ws:
            _set_attr(lt.matmul_preference_set_attribute, self.pref, P.MAX_WORKSPACE_BYTES, limit, np.uint64)
        try:
            lt.matmul_algo_get_heuristic(self.handle, self.desc, self.adesc, self.bdesc, self.ddesc,
                                         self.ddesc, self.pref, count, results.ctypes.data,
                                         n_found.ctypes.data)
        except lt.cuBLASLtError as e:
            raise CublasLtUnsupported(f"cuBLASLt heuristic found no algorithm: {e}") from None
        finally:
            if limit != self._heuristic_ws:
                _set_attr(lt.matmul_preference_set_attribute, self.pref, P.MAX_WORKSPACE_BYTES,
                          self._heuristic_ws, np.uint64)
        version = cublaslt_version()
        algos = []
        for r in results[: int(n_found[0])]:
            if int(r["state"]) != 0:
                continue
            algos.append(CublasLtAlgo.from_buffer(np.array(r["algo"]["data_"], dtype=np.uint64),
                                                  version, int(r["workspace_size"]), "heuristic"))
        return algos

    def check(self, algo: CublasLtAlgo) -> int:
        """``cublasLtMatmulAlgoCheck``: workspace bytes the algorithm needs for this problem;
        raises :class:`InvalidAlgorithm` with the reason when it does not fit."""
        lt = self._lt
        result = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        buf = algo.buffer()
        try:
            lt.matmul_algo_check(self.handle, self.desc, self.adesc, self.bdesc, self.ddesc,
                                 self.ddesc, buf.ctypes.data, result.ctypes.data)
        except lt.cuBLASLtError as e:
            raise InvalidAlgorithm(f"algorithm {algo.describe()} does not fit {_describe(self.problem)}: {e}") from None
        if int(result[0]["state"]) != 0:
            raise InvalidAlgorithm(f"algorithm {algo.describe()} rejected: status {int(result[0]['state'])}")
        ws = int(result[0]["workspace_size"])
        if ws > WORKSPACE_BYTES:
            raise InvalidAlgorithm(f"algorithm {algo.describe()} needs {ws} bytes of workspace "
                                   f"(> {WORKSPACE_BYTES})")
        return ws

    def use(self, algo: CublasLtAlgo | None) -> Plan:
        """Run with ``algo`` (checked first), or with the heuristic's first choice if None."""
        if algo is None:
            found = self.heuristics(1)
            if not found:
                raise CublasLtUnsupported(f"cuBLASLt has no algorithm for {_describe(self.problem)}")
            algo = found[0]
        else:
            self.check(algo)
        self.algo = algo
        self._algo_buf = algo.buffer()
        self._algo_ptr = self._algo_buf.ctypes.data
        return self

    # -- the call ------------------------------------------------------------------------
    def launch(self, x_ptr: int, w_ptr: int, bias_ptr: int, out_ptr: int, stream: int) -> None:
        ws = _workspace_ptrs.get((self.device_index, stream)) or _workspace_ptr(self.device_index, stream)
        # The bias pointer is a descriptor attribute: set it only when it changes (weights
        # rarely move), under a lock so two threads sharing a plan cannot interleave.
        with self._call_lock:
            if bias_ptr != self._last_bias:
                self._bias_holder[0] = bias_ptr
                self._set_desc_attr(self.desc, 8, self._bias_holder_ptr, 8)  # CUBLASLT_MATMUL_DESC_BIAS_POINTER
                self._last_bias = bias_ptr
            self._matmul(self.handle, self.desc, self._alpha_ptr, w_ptr, self.adesc, x_ptr, self.bdesc,
                         self._beta_ptr, out_ptr, self.ddesc, out_ptr, self.ddesc, self._algo_ptr, ws,
                         WORKSPACE_BYTES, stream)

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        try:
            lt = self._lt
            lt.matmul_preference_destroy(self.pref)
            for d in (self.adesc, self.bdesc, self.ddesc):
                lt.matrix_layout_destroy(d)
            lt.matmul_desc_destroy(self.desc)
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def __del__(self):
        self.destroy()


def _describe(p: Problem) -> str:
    return (f"{dtype_name(p.dtype)} M={p.m} N={p.n} K={p.k} epilogue={p.epilogue.name} "
            f"ld(x,w,out)=({p.ldx},{p.ldw},{p.ldo}) align(x,w,out)=({p.align_x},{p.align_w},{p.align_out})")


_C = torch._C


def _tf32_allowed() -> bool:
    return bool(_C._get_cublas_allow_tf32())


def _reduced_reduction_allowed(dtype: torch.dtype) -> bool:
    """torch's setting for reduced-precision split-K reductions (mirrored in our preference)."""
    if dtype == torch.bfloat16:
        return bool(_C._get_cublas_allow_bf16_reduced_precision_reduction()[0])
    if dtype == torch.float16:
        return bool(_C._get_cublas_allow_fp16_reduced_precision_reduction()[0])
    return True


class _PlanCache:
    """Bounded LRU of plans keyed by (device, problem, algorithm bytes)."""

    def __init__(self, capacity: int = PLAN_CACHE_SIZE):
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        plan = self._d.get(key)
        if plan is not None:
            try:
                self._d.move_to_end(key)
            except KeyError:  # another thread's put() evicted it in between: still a valid plan
                pass
        return plan

    def put(self, key, plan: Plan) -> None:
        with self._lock:
            self._d[key] = plan
            self._d.move_to_end(key)
            while len(self._d) > self.capacity:
                # No explicit destroy: linear()'s fast path may still hold the plan; its
                # descriptors are freed by Plan.__del__ once nothing refers to it.
                self._d.popitem(last=False)

    def __len__(self):
        return len(self._d)

    def clear(self):
        with self._lock:
            self._d.clear()


_plans = _PlanCache()


def clear_caches() -> None:
    """Drop every cached plan (workspaces stay: captured graphs may still use them)."""
    _fast.clear()
    _plans.clear()


# ---------------------------------------------------------------------------------------
# The call path


def _align(ptr: int) -> int:
    return min(MAX_ALIGNMENT, ptr & -ptr) if ptr else MAX_ALIGNMENT


def run(config: CublasLtAlgo | None, x: torch.Tensor, weight: torch.Tensor,
        bias: torch.Tensor | None, out: torch.Tensor, activation=None) -> torch.Tensor:
    """Backend contract: ``out[:] = act(x @ weight.T + bias)`` with algorithm ``config``
    (None: the heuristic's first choice). ``x`` (M, K), ``weight`` (N, K) and ``out`` (M, N)
    are CUDA, row-major with unit column stride (``row_major``), M, N, K ≥ 1, and ``bias``
    unit-stride and 16-byte aligned (``contiguous_bias``). No checks beyond that: the
    caller (``linear`` or the dispatcher) has made them."""
    act = activation if isinstance(activation, Activation) else Activation.parse(activation)
    key = _run_key(config, x, weight, bias, out, act)
    plan = _plans.get(key)
    if plan is None:
        dev, dtype, act, has_bias, m, n, k, ldx, ldw, ldo, ax, aw, ao, tf32, reduced, _ = key
        problem = Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(act, has_bias), ldx=ldx, ldw=ldw,
                          ldo=ldo, align_x=ax, align_w=aw, align_out=ao, tf32=tf32)
        plan = Plan(problem, dev, reduced).use(config)
        _plans.put(key, plan)
    _launch_on_device(plan, key[0], x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else 0,
                      out.data_ptr())
    return out


def _run_key(config, x, weight, bias, out, act: Activation) -> tuple:
    """The plan key of :func:`run`: device, dtype, epilogue, M, N, K, leading dims, pointer
    alignment classes, math mode, algorithm."""
    m, k = x.shape
    n = weight.shape[0]
    dtype = x.dtype
    return (x.device.index, dtype, act, bias is not None, m, n, k,
            x.stride(0) if m > 1 else k, weight.stride(0) if n > 1 else k,
            out.stride(0) if m > 1 else n, _align(x.data_ptr()), _align(weight.data_ptr()),
            _align(out.data_ptr()), dtype == torch.float32 and _tf32_allowed(), _reduced_reduction_allowed(dtype),
            config.data if config is not None else None)


_get_device = getattr(_C, "_cuda_getDevice", None)


def bind(config: CublasLtAlgo | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor, activation=None):
    """``fn(xp, wp, bp, op)``: :func:`run` for operands of exactly this signature (shapes,
    strides, dtype, device, pointer alignment classes) given as raw data pointers (``bp`` 0
    without a bias); no checks, no allocation. None unless :func:`run` has run this signature
    (it builds the plan)."""
    act = activation if isinstance(activation, Activation) else Activation.parse(activation)
    plan = _plans.get(_run_key(config, x, weight, bias, out, act))
    if plan is None:
        return None
    dev, plan_launch = x.device.index, plan.launch
    get_device = _get_device if _get_device is not None else torch.cuda.current_device
    stream_of = _raw_stream if _raw_stream is not None else _current_stream

    def launch(xp, wp, bp, op):
        if get_device() == dev:
            plan_launch(xp, wp, bp, op, stream_of(dev))
        else:
            _launch_on_device(plan, dev, xp, wp, bp, op)

    return launch


def _launch_on_device(plan: Plan, dev: int, xp: int, wp: int, bp: int, op: int) -> None:
    # cuBLASLt launches into the current CUDA context: make it the tensors' device.
    if (_get_device() if _get_device is not None else torch.cuda.current_device()) == dev:
        plan.launch(xp, wp, bp, op, _current_stream(dev))
    else:
        with torch.cuda.device(dev):
            plan.launch(xp, wp, bp, op, _current_stream(dev))


# Fast path: a launcher per call signature (shapes, strides, dtypes, devices, pointer
# residues, activation, math flags; see checks.call_signature) so that a repeated call
# costs one dict lookup, the output allocation and the launch. Bounded.
_fast: OrderedDict = OrderedDict()
_FAST_CACHE_SIZE = 1024


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
    dev, dtype = x.device.index, x.dtype
    ldx = flat_row_stride(x) if m > 1 else k
    ldw = weight.stride(0) if n > 1 else k
    tf32 = dtype == torch.float32 and _tf32_allowed()
    reduced = _reduced_reduction_allowed(dtype)
    problem = Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(act, bias is not None), ldx=ldx, ldw=ldw,
                      ldo=n, align_x=_align(x.data_ptr()), align_w=_align(weight.data_ptr()), tf32=tf32)
    pkey = (dev, dtype, act, bias is not None, m, n, k, ldx, ldw, n, problem.align_x, problem.align_w,
            MAX_ALIGNMENT, tf32, reduced, algo.data if algo is not None else None)
    plan = _plans.get(pkey)
    if plan is None:
        plan = Plan(problem, dev, reduced).use(algo)
        _plans.put(pkey, plan)
    out_shape = (*x.shape[:-1], n)

    plan_launch = plan.launch
    get_device = _get_device if _get_device is not None else torch.cuda.current_device
    stream_of = _raw_stream if _raw_stream is not None else _current_stream

    def launch(x, weight, bias, xp, wp):
        y = x.new_empty(out_shape)  # ~1.3 µs cheaper than torch.empty(dtype=, device=) (host breakdown)
        bp = bias.data_ptr() if bias is not None else 0
        if get_device() == dev:  # the common case, inlined: every µs here is host overhead
            plan_launch(xp, wp, bp, y.data_ptr(), stream_of(dev))
        else:
            _launch_on_device(plan, dev, xp, wp, bp, y.data_ptr())
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
        _fast[key] = fn
        while len(_fast) > _FAST_CACHE_SIZE:
            _fast.popitem(last=False)
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
        if algo is not None or min(_align(x2.data_ptr()), _align(w.data_ptr()), _align(out.data_ptr())) >= 16:
            raise
        tmp = torch.empty((m, n), dtype=x.dtype, device=x.device)
        run(None, x2.contiguous().clone(), w.contiguous().clone(), b, tmp, act)
        out.copy_(tmp)
    return out.reshape(*lead, n)


__all__ = [
    "CublasLtAlgo", "CublasLtUnavailable", "CublasLtUnsupported", "InvalidAlgorithm", "Plan",
    "clear_caches", "cublaslt_version", "epilogue_supported", "is_available", "launcher_for", "linear",
    "read_algo_fields", "run", "supports",
]
