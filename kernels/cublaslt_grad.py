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
given library), ranked under the whole workspace. The plans are the forward's type
(kernels/cublaslt_plan.py), cached per input signature in a cache of their own.
"""

from __future__ import annotations

import torch

from .bounded_cache import BoundedCache
from .checks import operand_key, row_major
from .cublaslt_plan import GemmSpec, Plan
from .cublaslt_runtime import OP_N, OP_T, WORKSPACE_BYTES, tf32_allowed
from .problem import MAX_ALIGNMENT, pointer_alignment

GRAD_PLAN_CACHE_SIZE = 256

# Plans by (GEMM, tf32, [epilogue], operand_key of the two inputs): the output is always a fresh
# row-major tensor (256-byte aligned, as torch allocates), so the inputs say everything.
_plans = BoundedCache(GRAD_PLAN_CACHE_SIZE, lru=True)


def _new_plan(key, spec: GemmSpec, device_index: int, what: str) -> Plan:
    plan = Plan(spec, device_index, what).use(None)  # the heuristic's first choice
    _plans.put(key, plan)
    return plan


def grad_input(dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dz (M, N) @ weight (N, K) -> (M, K)`` through cuBLASLt."""
    dz, weight = row_major(dz), row_major(weight)
    m, n = dz.shape
    k = weight.shape[1]
    dx = torch.empty((m, k), dtype=dz.dtype, device=dz.device)
    if min(m, n, k) == 0:
        return dx.zero_()
    zp, wp = dz.data_ptr(), weight.data_ptr()
    tf32 = dz.dtype == torch.float32 and tf32_allowed()
    key = ("dx", tf32, operand_key(dz, zp, weight, wp, None))
    plan = _plans.get(key)
    if plan is None:
        ldz = dz.stride(0) if m > 1 else n
        ldw = weight.stride(0) if n > 1 else k
        spec = GemmSpec(dz.dtype, tf32, OP_N, OP_N, "DEFAULT", (k, n, ldw), (n, m, ldz), (k, m, k),
                        (pointer_alignment(wp), pointer_alignment(zp), MAX_ALIGNMENT, MAX_ALIGNMENT),
                        WORKSPACE_BYTES)
        plan = _new_plan(key, spec, dz.device.index, f"the dx GEMM M={m} N={n} K={k}")
    plan.call(wp, zp, dx.data_ptr())  # A = W, B = dz, D = dx
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
    zp, xp = dz.data_ptr(), x.data_ptr()
    tf32 = dz.dtype == torch.float32 and tf32_allowed()
    epi = "BGRADB" if bias_grad else "DEFAULT"
    key = ("dw", tf32, epi, operand_key(dz, zp, x, xp, None))
    plan = _plans.get(key)
    if plan is None:
        ldz = dz.stride(0) if m > 1 else n
        ldx = x.stride(0) if m > 1 else k
        spec = GemmSpec(dz.dtype, tf32, OP_N, OP_T, epi, (k, m, ldx), (n, m, ldz), (k, n, k),
                        (pointer_alignment(xp), pointer_alignment(zp), MAX_ALIGNMENT, MAX_ALIGNMENT),
                        WORKSPACE_BYTES)
        plan = _new_plan(key, spec, dz.device.index, f"the dW GEMM ({epi}) M={m} N={n} K={k}")
    plan.call(xp, zp, dw.data_ptr(), db.data_ptr() if db is not None else 0)  # A = x, B = dz, D = dW
    return dw, db
