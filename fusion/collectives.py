"""The sum over tensor-parallel ranks that :class:`~hybridgemm.parallel.RowParallelLinear`
needs after each partial product: NCCL, or a one-shot all-reduce through symmetric memory
for decode-sized messages.

Why: at decode a row-parallel output is a few KB ((batch, hidden) in bf16). NCCL's time for
such a message is its latency, paid twice per layer; torch's one-shot all-reduce
(``torch.ops.symm_mem.one_shot_all_reduce_copy_out``) is one kernel that copies this rank's
tensor into a buffer every rank can read over NVLink, waits for the others at a barrier,
sums the ranks' buffers in rank order into the output and waits again, so that no rank
overwrites its buffer while another still reads it. One buffer per process group is reused
by every call; it is allocated and exchanged once (:func:`enable_one_shot`, a collective),
before any CUDA graph is captured.

The order of the sum is rank 0 + rank 1 + ... on every rank, so every rank gets the same
bits, run after run. Messages the one-shot kernel cannot take (other dtypes than bf16 and
fp32, larger than the buffer, not 16-byte aligned, on another device) go to NCCL, as does
everything on a group where symmetric memory is not enabled (gloo, CPU, a torch without it).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import Tensor

ONE_SHOT_MAX_BYTES = 256 * 1024  # (8, 8192) bf16 is 128 KiB: the largest decode message of a 70B at batch 8
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what torch's kernel is built for

_BUFFERS: dict[str, Tensor] = {}  # group name -> this rank's symmetric buffer (uint8)
# group name -> (device, capacity in bytes): plain values, so that torch.compile reads them as constants
_SPECS: dict[str, tuple[torch.device, int]] = {}


def one_shot_unavailable(group: dist.ProcessGroup) -> str | None:
    """Why the one-shot all-reduce cannot serve ``group`` here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if dist.get_backend(group) != "nccl":
        return f"the group's backend is {dist.get_backend(group)}, not nccl"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this torch has no symmetric-memory one-shot all-reduce ({type(e).__name__}: {e})"
    return None


def enable_one_shot(group: dist.ProcessGroup, max_bytes: int = ONE_SHOT_MAX_BYTES) -> str | None:
    """Allocate this rank's symmetric buffer of ``max_bytes`` for ``group`` on the current
    CUDA device and exchange it with the other ranks (a collective: every rank of the group
    calls it, in the same order as its other collectives). Returns None when enabled (or
    already enabled), else why not; then the group keeps using NCCL."""
    if max_bytes <= 0:
        return "disabled (max_bytes <= 0)"
    why = one_shot_unavailable(group)
    if why is not None:
        return why
    name = group.group_name
    if name in _BUFFERS:
        return None
    symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
    try:
        buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        symm_mem.rendezvous(buf, group)
    except Exception as e:  # a driver or fabric without peer access: NCCL still works
        return f"symmetric memory could not be set up ({type(e).__name__}: {e})"[:300]
    _BUFFERS[name] = buf
    _SPECS[name] = (buf.device, max_bytes)
    return None


def one_shot_enabled(group: dist.ProcessGroup) -> bool:
    return group.group_name in _SPECS


def fits_one_shot(y: Tensor, group_name: str) -> bool:
    """Whether ``y`` can go through the one-shot kernel of group ``group_name`` by its
    dtype, size and device (also true of a fake tensor while compiling; the address is
    checked when the op runs)."""
    spec = _SPECS.get(group_name)
    return (spec is not None and y.dtype in ONE_SHOT_DTYPES and y.device == spec[0]
            and 0 < y.numel() * y.element_size() <= spec[1])


def _nccl_sum(y: Tensor, group_name: str) -> Tensor:
    out = y.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=dist.distributed_c10d._resolve_process_group(group_name))
    return out


@torch.library.custom_op("hybridgemm::tp_sum", mutates_args=())
def tp_sum(y: Tensor, group_name: str) -> Tensor:
    """The sum of ``y`` over the ranks of group ``group_name``, as a new tensor: one-shot
    through the group's symmetric buffer where :func:`fits_one_shot` and the address is
    16-byte aligned, NCCL otherwise."""
    nbytes = y.numel() * y.element_size()
    if (fits_one_shot(y, group_name) and y.is_contiguous() and y.storage_offset() == 0
            and y.data_ptr() % 16 == 0 and nbytes % 16 == 0):
        staged = _BUFFERS[group_name][:nbytes].view(y.dtype).view(y.shape)
        out = torch.empty_like(y, memory_format=torch.contiguous_format)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, y, "sum", group_name, out)
    return _nccl_sum(y, group_name)


@tp_sum.register_fake
def _(y: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def release(group_name: str) -> None:
    """Forget ``group_name``'s buffer (for a group about to be destroyed): later sums over a
    group of that name use NCCL."""
    _SPECS.pop(group_name, None)
    _BUFFERS.pop(group_name, None)


__all__ = ["ONE_SHOT_MAX_BYTES", "enable_one_shot", "fits_one_shot", "one_shot_enabled", "one_shot_unavailable",
           "release", "tp_sum"]
