"""The device signature a tuning table is tied to, and the rules for when a table and each of
its entries still apply.

A signature is a flat JSON object::

    {"schema": 1, "kernel_abi": 1, "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
     "sm_count": 132, "cublaslt_version": 130100, "triton_version": "3.6.0",
     "torch_version": "2.11.0+cu130", "package_version": "0.1.0"}

Its fields fall in three groups: what decides whether a table applies at all, what decides
whether one entry may be trusted, and what is recorded for audit only.

**The table applies** only when these match (``MUST_MATCH``): they decide whether the
choices are valid at all, and nothing per entry could repair a difference.

- ``schema``: the table's own format; a reader cannot trust entries of another format.
- ``kernel_abi``: :data:`KERNEL_ABI`, bumped by hand whenever a kernel, a ``Config``
  record format or a candidate list changes so that tuned choices may be wrong or invalid.
  This replaces matching ``package_version``: a patch release that only fixes the CLI or
  the docs must not throw away hours of tuning.
- ``gpu_name``, ``compute_capability``, ``sm_count``: timings and the validity of configs
  (shared memory, persistent grid size) depend on the exact part; an H100 PCIe and an
  H100 SXM share a capability but not an SM count or bandwidth.

**Per entry** (``PER_ENTRY``): a library upgrade can make one kind of entry untrustworthy
while leaving the others as good as they were, so these fields are judged entry by entry
(:func:`entry_verdict`) and never reject a table.

- ``cublaslt_version``: a pinned cuBLASLt algorithm record is opaque bytes that only the
  cuBLASLt version which produced them can interpret (each record carries that version).
  Under another version the entry runs F.linear: the tuner validated that exact algorithm,
  not whatever cuBLASLt would pick instead, and F.linear is the dispatcher's fallback
  everywhere else. An entry of cuBLASLt's heuristic (record ``{}``) asks the running cuBLASLt
  at each call and is kept: a new version may change its speed, not its correctness.
- ``triton_version``: Triton's code generation changes the speed of a config and, rarely,
  which configs compile or compute correctly. A Triton entry tuned under another Triton is
  used when the backend's own validity check accepts its config and the config passes a
  one-time correctness probe (:mod:`.probe`), with one warning per table; it may no longer
  be the fastest choice, which re-tuning fixes. A table records, per Triton entry, the
  Triton it was tuned under when that differs from the table's own (autotune_cache/table_entries.py).
- Entries of F.linear (backend ``torch``) depend on neither.

When the running process has no cuBLASLt (``cublaslt_version`` ``None``) or no Triton, the
entries of that backend run F.linear; the rest of the table applies.

**Informational only** (recorded for audit, not compared): ``torch_version`` (our kernels
do not call torch's GEMMs; the cuBLAS that torch loads is covered by ``cublaslt_version``)
and ``package_version`` (see ``kernel_abi``).

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
)
PER_ENTRY = ("cublaslt_version", "triton_version")
INFORMATIONAL = ("torch_version", "package_version")

# What a difference in each of MUST_MATCH means, in words for `hybridgemm show`.
_MISMATCH_LABELS = {
    "schema": "other table format",
    "kernel_abi": "other kernel ABI (tuned for another hybridgemm's kernels)",
    "gpu_name": "other GPU",
    "compute_capability": "other compute capability",
    "sm_count": "other SM count",
}

# entry_verdict's answers: run the entry as recorded, probe its config once first, or run F.linear.
USE, PROBE, FLINEAR = "use", "probe", "flinear"

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
    for field in MUST_MATCH + PER_ENTRY:
        if field not in sig:
            return f"signature lacks field {field!r}"
    if not _CC_RE.match(sig["compute_capability"]):
        return f"bad compute_capability {sig['compute_capability']!r}"
    return None


def signature_matches(table_sig: Any, running_sig: dict[str, Any]) -> tuple[bool, str]:
    """Whether a table tuned on ``table_sig`` applies to a device with ``running_sig``.

    Returns ``(ok, reason)``; ``reason`` names the first differing field of
    :data:`MUST_MATCH` (in that order) with both values, or is ``""`` when they match.
    Library versions (``PER_ENTRY``) are not compared here: see :func:`entry_verdict`."""
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


def why_not_applicable(table_sig: Any, running_sig: dict[str, Any] | None) -> str:
    """``""`` when a table tuned on ``table_sig`` applies to the device with ``running_sig``,
    else why not in words (``"no CUDA GPU on this machine"``, ``"other GPU (...)"``, ...)."""
    if running_sig is None:
        return "no CUDA GPU on this machine"
    ok, reason = signature_matches(table_sig, running_sig)
    if ok:
        return ""
    field = reason.split(" ", 1)[0]
    label = _MISMATCH_LABELS.get(field)
    return f"{label} ({reason})" if label else reason


def is_triton_backend(backend: str) -> bool:
    """Whether entries of ``backend`` are Triton kernels (``triton_gemm``, ``triton_splitk``):
    the backends whose configs are judged by the Triton version."""
    return backend.startswith("triton")


def entry_verdict(backend: str, config: Any, tuned_triton: str | None,
                  running_sig: dict[str, Any]) -> tuple[str, str]:
    """How an entry may run in a process with ``running_sig`` (module docstring, "per entry").

    ``backend``/``config``: the entry's winner; ``tuned_triton``: the Triton version the entry
    was tuned under (Triton entries). Returns ``(USE, "")``, ``(PROBE, reason)`` (a Triton
    config tuned under another Triton: check it once before use) or ``(FLINEAR, reason)``
    (run F.linear for this entry)."""
    if backend == "cublaslt":
        running = running_sig.get("cublaslt_version")
        if running is None:
            return FLINEAR, "no cuBLASLt in this process"
        if not config:  # {}: the heuristic, asked of the running cuBLASLt at each call
            return USE, ""
        tuned = config.get("cublaslt_version") if isinstance(config, dict) else None
        if tuned != running or type(tuned) is not type(running):
            return FLINEAR, (f"cuBLASLt algorithm record tuned under cuBLASLt {tuned!r}, "
                             f"this process runs {running!r}")
        return USE, ""
    if is_triton_backend(backend):
        running = running_sig.get("triton_version")
        if running is None:
            return FLINEAR, "no Triton in this process"
        if tuned_triton != running:
            return PROBE, f"Triton config tuned under Triton {tuned_triton}, this process runs {running}"
    return USE, ""
