"""One cuBLASLt GEMM as descriptors plus the algorithm that runs it: the plan type of the forward
(kernels/cublaslt.py) and the backward (kernels/cublaslt_grad.py), and :meth:`Plan.call`, the
one launch every cuBLASLt GEMM here goes through.

A plan is ``D = op(A) @ op(B)`` in cuBLASLt's column-major terms (C = D, alpha 1, beta 0) with
an epilogue, described by a :class:`GemmSpec`: which operands are transposed, each matrix's
(rows, cols, leading dimension), the epilogue, the pointer alignments promised to the
heuristic, the compute mode and the workspace the heuristic may rank algorithms under. The
module that builds the spec says what A, B and D are.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import torch

from .cublaslt_algos import CublasLtAlgo, InvalidAlgorithm
from .cublaslt_runtime import (
    COMPUTE_32F,
    COMPUTE_32F_FAST_TF32,
    CUDA_DTYPE,
    CUDA_R_32F,
    DESC_BIAS_POINTER,
    WORKSPACE_BYTES,
    CublasLtUnsupported,
    bindings,
    cublaslt_version,
    current_device,
    current_stream,
    handle,
    set_attr,
    workspace_ptr,
    workspace_ptrs,
)
from .process_memory import per_call

HEURISTIC_COUNT = 16


class GemmSpec(NamedTuple):
    """Everything a :class:`Plan`'s descriptors depend on."""

    dtype: torch.dtype  # of A, B and D
    tf32: bool  # fp32: COMPUTE_32F_FAST_TF32 instead of COMPUTE_32F
    transa: int  # OP_N or OP_T
    transb: int
    epilogue: str  # a cublasLtEpilogue_t name: DEFAULT, BIAS, RELU_BIAS, GELU_BIAS, BGRADB, ...
    a: tuple[int, int, int]  # (rows, cols, leading dimension), column-major, before op()
    b: tuple[int, int, int]
    d: tuple[int, int, int]
    aligns: tuple[int, int, int, int]  # minimum pointer alignment in bytes of A, B, C, D
    workspace: int  # bytes of workspace the heuristic may rank algorithms under
    reduced: bool = True  # may split-K reduce in the output type (torch's reduced-precision flag)


class Plan:
    """cuBLASLt descriptors for one :class:`GemmSpec` on one device; ``algo`` is set by
    :meth:`use`. ``what`` names the GEMM in error messages."""

    _destroyed = False

    def __init__(self, spec: GemmSpec, device_index: int, what: str = "this GEMM"):
        lt = bindings()
        self.spec, self.device_index, self.what = spec, device_index, what
        self.handle = handle(device_index)
        self._lt = lt
        dt = CUDA_DTYPE[spec.dtype]
        compute = COMPUTE_32F_FAST_TF32 if spec.tf32 else COMPUTE_32F
        self.compute_type, self.scale_type, self.data_type = compute, CUDA_R_32F, dt
        D = lt.MatmulDescAttribute
        self.desc = lt.matmul_desc_create(compute, CUDA_R_32F)
        set_attr(lt.matmul_desc_set_attribute, self.desc, D.TRANSA, spec.transa, np.int32)
        set_attr(lt.matmul_desc_set_attribute, self.desc, D.TRANSB, spec.transb, np.int32)
        set_attr(lt.matmul_desc_set_attribute, self.desc, D.EPILOGUE, int(lt.Epilogue[spec.epilogue]), np.uint32)
        self.adesc = lt.matrix_layout_create(dt, *spec.a)
        self.bdesc = lt.matrix_layout_create(dt, *spec.b)
        self.ddesc = lt.matrix_layout_create(dt, *spec.d)
        P = lt.MatmulPreferenceAttribute
        self.pref = lt.matmul_preference_create()
        set_attr(lt.matmul_preference_set_attribute, self.pref, P.MAX_WORKSPACE_BYTES, spec.workspace, np.uint64)
        for attr, align in zip((P.MIN_ALIGNMENT_A_BYTES, P.MIN_ALIGNMENT_B_BYTES, P.MIN_ALIGNMENT_C_BYTES,
                                P.MIN_ALIGNMENT_D_BYTES), spec.aligns):
            set_attr(lt.matmul_preference_set_attribute, self.pref, attr, align, np.uint32)
        if not spec.reduced:  # as torch does when reduced-precision reduction is off
            mask = int(lt.ReductionScheme.MASK) & ~int(lt.ReductionScheme.OUTPUT_TYPE)
            set_attr(lt.matmul_preference_set_attribute, self.pref, P.REDUCTION_SCHEME_MASK, mask, np.uint32)
        # Host buffers and their addresses, read once: numpy's .ctypes.data costs ~1 µs a call.
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        self._bias_holder = np.zeros(1, dtype=np.int64)
        self.alpha_ptr, self.beta_ptr = self._alpha.ctypes.data, self._beta.ctypes.data
        self._bias_holder_ptr = self._bias_holder.ctypes.data
        self._matmul = lt.matmul
        self._set_desc_attr = lt.matmul_desc_set_attribute
        self._last_bias = -1
        self._call_lock = threading.Lock()
        self.algo: CublasLtAlgo | None = None
        self.algo_buf: np.ndarray | None = None
        self.algo_ptr = 0

    # -- algorithms --------------------------------------------------------------------
    def heuristics(self, count: int = HEURISTIC_COUNT, max_workspace: int | None = None) -> list[CublasLtAlgo]:
        """cuBLASLt's heuristic ranking, best first (deterministic for a given library), for
        algorithms needing at most ``max_workspace`` bytes (default: the spec's workspace)."""
        lt = self._lt
        results = np.zeros(count, dtype=lt.matmul_heuristic_result_dtype)
        n_found = np.zeros(1, dtype=np.int32)
        default = self.spec.workspace
        limit = default if max_workspace is None else min(int(max_workspace), WORKSPACE_BYTES)
        P = lt.MatmulPreferenceAttribute
        if limit != default:
            set_attr(lt.matmul_preference_set_attribute, self.pref, P.MAX_WORKSPACE_BYTES, limit, np.uint64)
        try:
            lt.matmul_algo_get_heuristic(self.handle, self.desc, self.adesc, self.bdesc, self.ddesc,
                                         self.ddesc, self.pref, count, results.ctypes.data,
                                         n_found.ctypes.data)
        except lt.cuBLASLtError as e:
            raise CublasLtUnsupported(f"cuBLASLt heuristic found no algorithm for {self.what}: {e}") from None
        finally:
            if limit != default:
                set_attr(lt.matmul_preference_set_attribute, self.pref, P.MAX_WORKSPACE_BYTES, default, np.uint64)
        version = cublaslt_version()
        algos = []
        for r in results[: int(n_found[0])]:
            if int(r["state"]) != 0:
                continue
            algos.append(CublasLtAlgo.from_buffer(np.array(r["algo"]["data_"], dtype=np.uint64),
                                                  version, int(r["workspace_size"]), "heuristic"))
        return algos

    def check(self, algo: CublasLtAlgo) -> int:
        """``cublasLtMatmulAlgoCheck``: workspace bytes the algorithm needs for this GEMM;
        raises :class:`InvalidAlgorithm` with the reason when it does not fit."""
        lt = self._lt
        result = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        buf = algo.buffer()
        try:
            lt.matmul_algo_check(self.handle, self.desc, self.adesc, self.bdesc, self.ddesc,
                                 self.ddesc, buf.ctypes.data, result.ctypes.data)
        except lt.cuBLASLtError as e:
            raise InvalidAlgorithm(f"algorithm {algo.describe()} does not fit {self.what}: {e}") from None
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
                raise CublasLtUnsupported(f"cuBLASLt has no algorithm for {self.what}")
            algo = found[0]
        else:
            self.check(algo)
        self.algo = algo
        self.algo_buf = algo.buffer()
        self.algo_ptr = self.algo_buf.ctypes.data
        return self

    # -- the call ------------------------------------------------------------------------
    def call(self, a_ptr: int, b_ptr: int, d_ptr: int, bias_ptr: int = 0) -> None:
        """``D = epilogue(op(A) @ op(B))`` on the current stream of the plan's device; ``bias_ptr``:
        the epilogue's bias (or bias gradient) vector, 0 if none. The one launch of every
        cuBLASLt GEMM here: the forward's (``run``, its bound raw launch, its fast launchers)
        and the backward's. cuBLASLt launches into the current CUDA context, so the device is
        entered first when it is not current (the context manager costs host time, so only
        then)."""
        dev = self.device_index
        if current_device() != dev:
            with torch.cuda.device(dev):
                self.call(a_ptr, b_ptr, d_ptr, bias_ptr)
            return
        stream = current_stream(dev)
        scratch = None
        if per_call():  # a compiled region: a workspace for this call only (kernels/process_memory.py)
            scratch = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", dev))
            ws = scratch.data_ptr()
        else:
            ws = workspace_ptrs.get((dev, stream)) or workspace_ptr(dev, stream)
        # The bias pointer is a descriptor attribute: set it only when it changes (weights
        # rarely move), under a lock so two threads sharing a plan cannot interleave.
        with self._call_lock:
            if bias_ptr != self._last_bias:
                self._bias_holder[0] = bias_ptr
                self._set_desc_attr(self.desc, DESC_BIAS_POINTER, self._bias_holder_ptr, 8)
                self._last_bias = bias_ptr
            self._matmul(self.handle, self.desc, self.alpha_ptr, a_ptr, self.adesc, b_ptr, self.bdesc,
                         self.beta_ptr, d_ptr, self.ddesc, d_ptr, self.ddesc, self.algo_ptr, ws,
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
        except Exception:  # a failed constructor, or interpreter shutdown (the library may be gone)
            pass

    def __del__(self):
        self.destroy()
