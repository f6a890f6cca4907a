"""The device signature a tuning table is tied to, and the rule for when a table still applies.

A signature is a flat JSON object::

    {"schema": 1, "kernel_abi": 1, "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
     "sm_count": 132, "cublaslt_version": 130100, "triton_version": "3.6.0",
     "torch_version": "2.11.0+cu130", "package_version": "0.1.0"}

Which fields must match (``MUST_MATCH``) and why:

- ``schema``: the table's own format; a reader cannot trust entries of another format.
- ``kernel_abi``: :data:`KERNEL_ABI`, bumped by hand whenever a kernel, a ``Config``
  record format or a candidate list changes so that tuned choices may be wrong or invalid.
  This replaces matching ``package_version``: a patch release that only fixes the CLI or
  the docs must not throw away hours of tuning.
- ``gpu_name``, ``compute_capability``, ``sm_count``: timings and the validity of configs
  (shared memory, persistent grid size) depend on the exact part; an H100 PCIe and an
  H100 SXM share a capability but not an SM count or bandwidth.
- ``cublaslt_version``: cuBLASLt algorithm records are only meaningful for the cuBLAS
  version that produced them, and its kernels change between releases. Compared exactly;
  ``None`` (cuBLASLt unavailable) only matches ``None``: a table tuned with cuBLASLt in the
  race was chosen against it, so it is not the right table for a machine without it.
- ``triton_version``: Triton's code generation changes performance and which configs
  compile, so a Triton upgrade invalidates Triton choices.

Informational only (recorded for audit, not compared): ``torch_version`` (our kernels do
not call torch's GEMMs; the cuBLAS that torch loads is covered by ``cublaslt_version``,
and torch pins its Triton, which is compared) and ``package_version`` (see ``kernel_abi``).

Nothing here touches the GPU at import time; :func:`current_signature` queries the device
on first call and caches the answer per device index.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

from hybridgemm.kernels import cublaslt
from hybridgemm.kernels.version import __version__

from .keys import SCHEMA_VERSION

#: Bump when kernels or config records change in a way that invalidates tuned choices.
KERNEL_ABI = 1

MUST_MATCH = (
    "schema",
    "kernel_abi",
    "gpu_name",
    "compute_capability",
    "sm_count",
    "cublaslt_version",
    "triton_version",
)
INFORMATIONAL = ("torch_version", "package_version")

# Expected types of the known fields; ``None`` allowed where a component may be absent.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (int,),
    "kernel_abi": (int,),
    "gpu_name": (str,),
    "compute_capability": (str,),
    "sm_count": (int,),
    "cublaslt_version": (int, type(None)),
    "triton_version": (str, type(None)),
    "torch_version": (str,),
    "package_version": (str,),
}
_CC_RE = re.compile(r"^[0-9]+\.[0-9]+$")

_cache: dict[int, dict[str, Any]] = {}
_cache_lock = threading.Lock()
_MISSING = object()


def _cublaslt_version() -> int | None:
    # The cuBLASLt backend is optional (nvmath-python); any failure to ask it means
    # "no cuBLASLt here", which is itself part of the signature.
    try:
        v = cublaslt.cublaslt_version()
    except Exception:
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _triton_version() -> str | None:
    try:  # Triton is optional off Linux: imported only when a signature is asked for
        import triton
    except Exception:
        return None
    return str(getattr(triton, "__version__", None) or "") or None


def current_signature(device_index: int | None = None) -> dict[str, Any] | None:
    """Signature of CUDA device ``device_index`` (default: the current device), or ``None``
    when there is no CUDA device. Cached per device index; returns a fresh copy each call."""

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device_index is None else int(device_index)
    with _cache_lock:
        cached = _cache.get(index)
    if cached is None:
        props = torch.cuda.get_device_properties(index)
        cached = {
            "schema": SCHEMA_VERSION,
            "kernel_abi": KERNEL_ABI,
            "gpu_name": str(props.name),
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": int(props.multi_processor_count),
            "cublaslt_version": _cublaslt_version(),
            "triton_version": _triton_version(),
            "torch_version": str(torch.__version__),
            "package_version": str(__version__),
        }
        with _cache_lock:
            cached = _cache.setdefault(index, cached)
    return dict(cached)


def validate_signature(sig: Any) -> str | None:
    """``None`` if ``sig`` is a well-formed signature, else the reason it is not.

    Known fields must have their types; unknown extra fields are allowed when they are
    JSON scalars (a later version may record more facts without breaking old readers)."""
    if not isinstance(sig, dict):
        return f"signature is {type(sig).__name__}, not an object"
    for field, value in sig.items():
        if not isinstance(field, str):
            return f"signature field name {field!r} is not a string"
        types = _FIELD_TYPES.get(field)
        if types is None:
            if not (value is None or isinstance(value, (str, int, float, bool))):
                return f"signature field {field!r} is not a JSON scalar"
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            return f"signature field {field!r} has type {type(value).__name__}"
    for field in MUST_MATCH:
        if field not in sig:
            return f"signature lacks field {field!r}"
    if not _CC_RE.match(sig["compute_capability"]):
        return f"bad compute_capability {sig['compute_capability']!r}"
    return None


def signature_matches(table_sig: Any, running_sig: dict[str, Any]) -> tuple[bool, str]:
    """Whether a table tuned on ``table_sig`` applies to a device with ``running_sig``.

    Returns ``(ok, reason)``; ``reason`` names the first differing field of
    :data:`MUST_MATCH` (in that order) with both values, or is ``""`` when they match."""
    if not isinstance(table_sig, dict):
        return False, "the table has no device signature"
    for field in MUST_MATCH:
        ours = table_sig.get(field, _MISSING)
        theirs = running_sig.get(field, _MISSING)
        if ours is _MISSING:
            return False, f"the table's signature lacks {field!r}"
        if ours != theirs or type(ours) is not type(theirs):
            shown = "nothing" if theirs is _MISSING else repr(theirs)
            return False, f"{field} differs: table has {ours!r}, this device has {shown}"
    return True, ""
