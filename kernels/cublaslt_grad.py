"""cuBLASLt GEMMs for the backward pass of ``y = act(x @ W.T + b)``.

Given ``dz`` (M, N), the gradient at the pre-activation (``dy`` itself without activation):

* :func:`grad_input`:  ``dx = dz @ W``   (M, K), a plain GEMM;
* :func:`grad_weight`: ``dW = dz.T @ x`` (N, K) **and** ``db = dz.sum(0)`` (N,) in one GEMM,
  the bias gradient fused through cuBLASLt's ``BGRADB`` epilogue (it reduces the GEMM's B
  operand, here ``dz``, over the reduction dimension M while it streams through the GEMM).

Column-major view (as in kernels/cublaslt.py): row-major ``T (R, C)`` is column-major
``(C, R)``. ``dx``: ``D (K, M) = W_cm (K, N) @ dz_cm (N, M)``, no transposes.
``dW``: ``D (K, N) = x_cm (K, M) @ op(dz_cm) (M, N)`` with ``op = T``; BGRADB sums
``op(B)`` over M, giving N values.

The algorithm is cuBLASLt's heuristic first choice for the exact problem (deterministic for a
given library); plans are cached per problem like the forward's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from .checks import row_major
from .cublaslt import (
    _COMPUTE_32F,
    _COMPUTE_32F_FAST_TF32,
    _CUDA_DTYPE,
    _CUDA_R_32F,
    _OP_N,
    _OP_T,
    WORKSPACE_BYTES,
    CublasLtUnsupported,
    _align,
    _current_stream,
    _handle,
    _lt,
    _set_attr,
    _tf32_allowed,
    _workspace_ptr,
    _workspace_ptrs,
)

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 256
_lock = threading.Lock()


class _GemmPlan:
    """``D = op(A) @ op(B)`` column-major, epilogue DEFAULT or BGRADB, heuristic algorithm."""

    def __init__(self, dev, dtype, transa, transb, a_shape, b_shape, d_shape, epilogue: str, tf32, aligns):
        lt = _lt()
        self._lt, self.dev = lt, dev
        self.handle = _handle(dev)
        dt = _CUDA_DTYPE[dtype]
        D = lt.MatmulDescAttribute
        self.desc = lt.matmul_desc_create(_COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F, _CUDA_R_32F)
        _set_attr(lt.matmul_desc_set_attribute, self.desc, D.TRANSA, transa, np.int32)
        _set_attr(lt.matmul_desc_set_attribute, self.desc, D.TRANSB, transb, np.int32)
        _set_attr(lt.matmul_desc_set_attribute, self.desc, D.EPILOGUE, int(lt.Epilogue[epilogue]), np.uint32)
        self.layouts = [lt.matrix_layout_create(dt, *s) for s in (a_shape, b_shape, d_shape)]
        P = lt.MatmulPreferenceAttribute
        pref = lt.matmul_preference_create()
        _set_attr(lt.matmul_preference_set_attribute, pref, P.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES, np.uint64)
        for attr, a in zip((P.MIN_ALIGNMENT_A_BYTES, P.MIN_ALIGNMENT_B_BYTES, P.MIN_ALIGNMENT_C_BYTES,
                            P.MIN_ALIGNMENT_D_BYTES), aligns):
            _set_attr(lt.matmul_preference_set_attribute, pref, attr, a, np.uint32)
        results = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        found = np.zeros(1, dtype=np.int32)
        a, b, d = self.layouts
        try:
            lt.matmul_algo_get_heuristic(self.handle, self.desc, a, b, d, d, pref, 1, results.ctypes.data,
                                         found.ctypes.data)
        except lt.cuBLASLtError as e:
            raise CublasLtUnsupported(f"cuBLASLt has no {epilogue} algorithm for this gradient GEMM: {e}") from None
        finally:
            lt.matmul_preference_destroy(pref)
        if int(found[0]) < 1:
            raise CublasLtUnsupported(f"cuBLASLt has no {epilogue} algorithm for this gradient GEMM")
        self._algo = np.array(results[0]["algo"]["data_"], dtype=np.uint64)
        self._scalars = np.array([1.0, 0.0], dtype=np.float32)
        self._holder = np.zeros(1, dtype=np.int64)
        # Raw addresses, read once: numpy's .ctypes builds an object per access, which cost
        # several µs per call on the H200 machine's CPU.
        self._alpha_ptr = self._scalars.ctypes.data
        self._algo_ptr = self._algo.ctypes.data
        self._holder_ptr = self._holder.ctypes.data
        self._last_bias = 0
        self._call_lock = threading.Lock()

    def launch(self, a_ptr, b_ptr, d_ptr, bias_ptr, stream):
        lt = self._lt
        a, b, d = self.layouts
        ws = _workspace_ptrs.get((self.dev, stream)) or _workspace_ptr(self.dev, stream)
        alpha = self._alpha_ptr
        with self._call_lock:
            # The bias-gradient pointer is a descriptor attribute: set it only when it moves
            # (torch's caching allocator usually hands a training loop the same block).
            if bias_ptr and bias_ptr != self._last_bias:
                self._holder[0] = bias_ptr
                lt.matmul_desc_set_attribute(self.desc, 8, self._holder_ptr, 8)  # BIAS_POINTER
                self._last_bias = bias_ptr
            lt.matmul(self.handle, self.desc, alpha, a_ptr, a, b_ptr, b, alpha + 4, d_ptr, d, d_ptr, d,
                      self._algo_ptr, ws, WORKSPACE_BYTES, stream)

    def __del__(self):
        try:
            for lay in self.layouts:
                self._lt.matrix_layout_destroy(lay)
            self._lt.matmul_desc_destroy(self.desc)
        except Exception:  # interpreter shutdown
            pass


def _plan(key, *args) -> _GemmPlan:
    plan = _PLANS.get(key)
    if plan is None:
        plan = _GemmPlan(*args)
        with _lock:
            _PLANS[key] = plan
            while len(_PLANS) > _MAX_PLANS:
                _PLANS.popitem(last=False)
    return plan


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _launch(plan: _GemmPlan, dev: int, *ptrs) -> None:
    # Enter a device context only when needed: the backward runs on autograd's device
    # thread, which already has the right device, and the context manager costs host time.
    if _current_device() == dev:
        plan.launch(*ptrs, _current_stream(dev))
    else:
        with torch.cuda.device(dev):
            plan.launch(*ptrs, _current_stream(dev))


def grad_input(dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dz (M, N) @ weight (N, K) -> (M, K)`` through cuBLASLt."""
    dz, weight = row_major(dz), row_major(weight)
    m, n = dz.shape
    k = weight.shape[1]
    dx = torch.empty((m, k), dtype=dz.dtype, device=dz.device)
    if min(m, n, k) == 0:
        return dx.zero_()
    dev = dz.device.index
    tf32 = dz.dtype == torch.float32 and _tf32_allowed()
    ldz = dz.stride(0) if m > 1 else n
    ldw = weight.stride(0) if n > 1 else k
    aligns = (_align(weight.data_ptr()), _align(dz.data_ptr()), 256, 256)
    key = ("dx", dev, dz.dtype, m, n, k, ldz, ldw, tf32, aligns)
    plan = _plan(key, dev, dz.dtype, _OP_N, _OP_N, (k, n, ldw), (n, m, ldz), (k, m, k), "DEFAULT", tf32, aligns)
    _launch(plan, dev, weight.data_ptr(), dz.data_ptr(), dx.data_ptr(), 0)
    return dx


def grad_weight(dz: torch.Tensor, x: torch.Tensor, bias_grad: bool = True):
    """``(dz.T @ x, dz.sum(0) or None)``: dW (N, K) and the bias gradient (N,) fused (BGRADB)."""
    dz, x = row_major(dz), row_major(x)
    m, n = dz.shape
    k = x.shape[1]
    dw = torch.empty((n, k), dtype=dz.dtype, device=dz.device)
    db = torch.empty((n,), dtype=dz.dtype, device=dz.device) if bias_grad else None
    if min(m, n, k) == 0:
        dw.zero_()
        if db is not None:
            db.copy_(dz.sum(0))
        return dw, db
    dev = dz.device.index
    tf32 = dz.dtype == torch.float32 and _tf32_allowed()
    ldz = dz.stride(0) if m > 1 else n
    ldx = x.stride(0) if m > 1 else k
    aligns = (_align(x.data_ptr()), _align(dz.data_ptr()), 256, 256)
    epi = "BGRADB" if bias_grad else "DEFAULT"
    key = ("dw", dev, dz.dtype, m, n, k, ldz, ldx, tf32, aligns, epi)
    plan = _plan(key, dev, dz.dtype, _OP_N, _OP_T, (k, m, ldx), (n, m, ldz), (k, n, k), epi, tf32, aligns)
    _launch(plan, dev, x.data_ptr(), dz.data_ptr(), dw.data_ptr(), db.data_ptr() if db is not None else 0)
    return dw, db
