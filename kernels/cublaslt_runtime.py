"""What every cuBLASLt module here shares: the bindings, library constants, per-device handles,
per-(device, stream) workspaces, stream and device queries, descriptor attribute setting, and
the torch math flags the descriptors mirror.

The bindings are nvmath-python's raw ``nvmath.bindings.cublasLt``, imported on first use (it
may be absent: ``import hybridgemm`` needs neither it nor a GPU). Nothing here touches a GPU
at import time; handles and workspaces are made on first use and kept for the process (a CUDA
graph captured with a workspace may replay at any time).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .checks import MATH_FLAG

WORKSPACE_BYTES = 32 * 1024 * 1024  # allocated per device+stream: what cuBLAS recommends on Hopper

# cudaDataType_t, cublasComputeType_t and cublasOperation_t values the plans use
CUDA_R_16F, CUDA_R_32F, CUDA_R_16BF = 2, 0, 14
CUDA_DTYPE = {torch.float16: CUDA_R_16F, torch.bfloat16: CUDA_R_16BF, torch.float32: CUDA_R_32F}
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
OP_N, OP_T = 0, 1
DESC_BIAS_POINTER = 8  # CUBLASLT_MATMUL_DESC_BIAS_POINTER: set per call, so by number (no enum lookup)


class CublasLtUnavailable(RuntimeError):
    """nvmath-python (cuBLASLt bindings) or a CUDA device is missing."""


class CublasLtUnsupported(ValueError):
    """cuBLASLt offers no algorithm for this problem (the caller may fall back)."""


def bindings():
    """nvmath-python's ``cublasLt`` bindings module; :class:`CublasLtUnavailable` without it."""
    try:
        from nvmath.bindings import cublasLt
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise CublasLtUnavailable(
            "the cuBLASLt backend needs nvmath-python: pip install 'hybridgemm[cu13]' "
            f"(or [cu12]) on a CUDA machine ({e})"
        ) from e
    return cublasLt


_VERSION: list[int | None] = []


def cublaslt_version() -> int | None:
    """The loaded cuBLASLt's version (e.g. 130100), or None where it cannot be loaded."""
    if not _VERSION:
        try:
            _VERSION.append(int(bindings().get_version()))
        except Exception:  # no nvmath, or no libcublasLt on this machine
            _VERSION.append(None)
    return _VERSION[0]


# ---------------------------------------------------------------------------------------
# Per-device handles and per-(device, stream) workspaces

_lock = threading.Lock()
handles: dict[int, int] = {}
workspaces: dict[tuple[int, int], torch.Tensor] = {}  # keeps the memory alive for the process
workspace_ptrs: dict[tuple[int, int], int] = {}  # the same buffers' addresses, read per call


def handle(device_index: int) -> int:
    """The cuBLASLt handle of a device, created once (under a lock, on that device)."""
    h = handles.get(device_index)
    if h is None:
        with _lock, torch.cuda.device(device_index):
            h = handles.get(device_index)
            if h is None:
                h = handles[device_index] = int(bindings().create())
    return h


def workspace_ptr(device_index: int, stream: int) -> int:
    """The address of the :data:`WORKSPACE_BYTES` workspace of ``(device, stream)``, allocated
    through torch on first use and never freed."""
    ptr = workspace_ptrs.get((device_index, stream))
    if ptr is None:
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device_index))
        workspaces[(device_index, stream)] = ws
        ptr = workspace_ptrs[(device_index, stream)] = ws.data_ptr()
    return ptr


def _stream_object(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# The current cudaStream_t of a device as an int, and the current device index: torch's raw
# getters where this torch has them (no Stream object built per call), else the public API.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_object
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def set_attr(setter, obj: int, attr, value, dtype) -> None:
    """``setter(obj, attr, &value, sizeof value)`` for one scalar of numpy ``dtype`` (the
    descriptor and preference setters of the bindings all take this form)."""
    buf = np.array([value], dtype=dtype)
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


# ---------------------------------------------------------------------------------------
# torch's math flags, as the descriptors mirror them


def tf32_allowed() -> bool:
    """fp32 GEMMs may run on TF32 tensor cores (``COMPUTE_32F_FAST_TF32``), as torch's do."""
    return bool(MATH_FLAG[torch.float32]())


def reduced_reduction_allowed(dtype: torch.dtype) -> bool:
    """torch's setting for reduced-precision split-K reductions of fp16/bf16 GEMMs (mirrored
    in the forward plan's preference); True for other dtypes."""
    if dtype not in (torch.bfloat16, torch.float16):
        return True
    return bool(MATH_FLAG[dtype]()[0])
