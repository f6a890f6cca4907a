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
bits, run after run. Messages the one-shot kernel cannot take go to NCCL (torch's: other
dtypes than bf16 and fp32, larger than the buffer, not a multiple of 16 bytes; the push
kernel's: other dtypes than fp16, bf16 and fp32, larger than the buffer), as does everything
on a group where symmetric memory is not enabled (gloo, CPU, a torch without it).

Two one-shot kernels can serve a group (``kernel`` of :func:`enable_one_shot`): ``"torch"``,
the op above, and ``"push"``, hybridgemm's own (:mod:`hybridgemm.kernels.triton_push_sum`):
each rank writes its tensor into the other ranks' buffers and raises a flag there, waits only
for the flags in its own memory, and alternates buffer slots between calls instead of a
closing barrier; it also takes part in programmatic dependent launch. Both sum in rank order
and give the same bits for two ranks. The push kernel can also add a residual to the fp32 sum
before its one rounding (:func:`tp_sum_residual`), which a fused decoder layer uses for its
O and down projections (fusion/parallel/tensor_parallel.py says why).

One buffer serves every sum over its group, in stream order: two models sharing a group and
summing on different streams at the same time would race on it (NCCL would serialise them).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import Tensor

from hybridgemm.kernels import triton_push_sum as push_sum_kernel

ONE_SHOT_MAX_BYTES = 256 * 1024  # (8, 8192) bf16 is 128 KiB: the largest decode message of a 70B at batch 8
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what torch's kernel is built for
ONE_SHOT_KERNELS = ("torch", "push")

_BUFFERS: dict[str, Tensor] = {}  # group name -> this rank's symmetric buffer (uint8)
# group name -> capacity in bytes: a plain value, so that torch.compile reads it as a constant
_CAPACITY: dict[str, int] = {}
_GROUPS: dict[str, dist.ProcessGroup] = {}  # group name -> the group the buffer was exchanged over
_KERNEL: dict[str, str] = {}  # group name -> "torch" or "push"
# group name -> the push kernel's state: (every rank's buffer address, this rank's call
# counters, rank, world size, the symmetric-memory handle that keeps the peers mapped)
_PUSH: dict[str, tuple] = {}


def one_shot_unavailable(group: dist.ProcessGroup, kernel: str = "torch") -> str | None:
    """Why one-shot ``kernel`` cannot serve ``group`` here, or None when it can."""
    if dist.get_backend(group) != "nccl":  # first: a gloo group never initialises CUDA here
        return f"the group's backend is {dist.get_backend(group)}, not nccl"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
        if kernel == "torch":
            torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018
        else:  # the push kernel needs only the buffers and their exchange
            symm_mem.empty, symm_mem.rendezvous  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this torch has no symmetric-memory one-shot all-reduce ({type(e).__name__}: {e})"
    return None


def _all_ranks(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a collective): the ranks must all take
    the one-shot path or all not, or the first sum would hang."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def enable_one_shot(group: dist.ProcessGroup, max_bytes: int = ONE_SHOT_MAX_BYTES,
                    device: torch.device | None = None, kernel: str = "torch") -> str | None:
    """Allocate this rank's symmetric buffer for sums of up to ``max_bytes`` over ``group`` on
    ``device`` (default: the current CUDA device) and exchange it with the other ranks. A
    collective: every rank of the group calls it, with the same arguments, in the same order
    as its other collectives; the ranks agree on the outcome, so either all use the buffer or
    none does. ``kernel`` picks the one-shot kernel (``ONE_SHOT_KERNELS``). Returns None when
    enabled (or already enabled alike for this group), else why not; then the group keeps
    using NCCL. ``ValueError`` for an unknown ``kernel``."""
    if kernel not in ONE_SHOT_KERNELS:
        raise ValueError(f"hybridgemm: one-shot kernel {kernel!r} is not one of {ONE_SHOT_KERNELS}")
    if max_bytes <= 0:
        return "disabled (max_bytes <= 0)"
    why = one_shot_unavailable(group, kernel)
    if why is not None:
        return why
    name = group.group_name
    if _GROUPS.get(name) is group and _KERNEL.get(name) == kernel and _CAPACITY.get(name) == max_bytes:
        return None
    release(name)  # a buffer of an earlier group of the same name, or of other arguments
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
    world = dist.get_world_size(group)
    why = None if kernel == "torch" else push_sum_kernel.group_why_not(world, max_bytes)
    buf = handle = None
    if why is None:
        try:
            nbytes = max_bytes if kernel == "torch" else push_sum_kernel.buffer_bytes(world, max_bytes)
            buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        except Exception as e:
            why = f"the symmetric buffer could not be allocated ({type(e).__name__}: {e})"[:300]
    if not _all_ranks(why is None, group, device):
        return why or "another rank could not allocate its symmetric buffer"
    try:
        handle = symm_mem.rendezvous(buf, group)
        if kernel == "push":
            _PUSH[name] = _push_state(buf, handle, device)
    except Exception as e:  # a driver or fabric without peer access: NCCL still works
        why = f"symmetric memory could not be set up ({type(e).__name__}: {e})"[:300]
        _PUSH.pop(name, None)
    # also the barrier after which every rank's flags are zero: no rank pushes before it
    if not _all_ranks(why is None, group, device):
        _PUSH.pop(name, None)
        return why or "another rank could not set up symmetric memory"
    _BUFFERS[name], _CAPACITY[name], _GROUPS[name], _KERNEL[name] = buf, max_bytes, group, kernel
    return None


def _push_state(buf: Tensor, handle, device: torch.device) -> tuple:
    """The push kernel's table of every rank's buffer address (as this process maps it) and
    its zeroed call counters; zeroes this rank's flags and waits for that to finish."""
    rank, world = handle.rank, handle.world_size
    addrs = [buf.data_ptr() if r == rank else handle.get_remote_tensor(r, buf.shape, buf.dtype).data_ptr()
             for r in range(world)]
    table = torch.tensor(addrs, dtype=torch.int64, device=device)
    epochs = torch.zeros(push_sum_kernel.MAX_PROGRAMS, dtype=torch.int32, device=device)
    buf[:push_sum_kernel.FLAG_BYTES].zero_()
    torch.cuda.synchronize(device)
    return table, epochs, rank, world, handle


def one_shot_capacity(group: dist.ProcessGroup) -> int:
    """The largest sum in bytes that goes one-shot over ``group`` (0: not enabled)."""
    return _CAPACITY.get(group.group_name, 0) if _GROUPS.get(group.group_name) is group else 0


def one_shot_kernel(group: dist.ProcessGroup) -> str | None:
    """Which one-shot kernel serves ``group`` ("torch" or "push"), None when not enabled."""
    return _KERNEL.get(group.group_name) if _GROUPS.get(group.group_name) is group else None


def fits_one_shot(y: Tensor, group_name: str) -> bool:
    """Whether ``y`` goes through the one-shot kernel of group ``group_name``: by its dtype
    and size only, the same on every rank (and answerable for a fake tensor while compiling)."""
    cap = _CAPACITY.get(group_name, 0)
    nbytes = y.numel() * y.element_size()
    if _KERNEL.get(group_name) == "push":
        return y.dtype in push_sum_kernel.DTYPES and 0 < nbytes <= cap
    # a whole number of 16-byte vectors: the kernel's widest loads, and an alignment its check accepts
    return y.dtype in ONE_SHOT_DTYPES and 0 < nbytes <= cap and nbytes % 16 == 0


def _buffer_for(y: Tensor, group_name: str) -> Tensor:
    """The group's symmetric buffer; a RuntimeError when ``y`` is on another device than it."""
    buf = _BUFFERS[group_name]
    if y.device != buf.device:
        raise RuntimeError(
            f"hybridgemm.parallel: the one-shot buffer of process group {group_name!r} is on {buf.device}, "
            f"but this rank's tensor is on {y.device}: call torch.cuda.set_device(local_rank) before "
            "parallelize and keep the model on that device, or parallelize with one_shot_bytes=0")
    return buf


def _push(y: Tensor, out: Tensor, group_name: str, residual: Tensor | None = None) -> Tensor:
    """The push kernel's sum of ``y`` (+ ``residual``) over the group, into ``out``."""
    table, epochs, rank, world, _ = _PUSH[group_name]
    return push_sum_kernel.push_sum(y, out, table, epochs, rank, world, _CAPACITY[group_name], residual)


def _nccl_sum(y: Tensor, group_name: str) -> Tensor:
    out = y.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=dist.distributed_c10d._resolve_process_group(group_name))
    return out


@torch.library.custom_op("hybridgemm::tp_sum", mutates_args=())
def tp_sum(y: Tensor, group_name: str) -> Tensor:
    """The sum of ``y`` over the ranks of group ``group_name``, as a new tensor: one-shot
    through the group's symmetric buffer where :func:`fits_one_shot`, NCCL otherwise.

    The choice depends only on what every rank shares (dtype, byte count, the group), never
    on an address: a rank in the one-shot kernel's barrier while another waits in NCCL would
    hang both. A ``y`` that is not contiguous from a 16-byte aligned start is copied first; a
    ``y`` on another GPU than the buffer is a RuntimeError."""
    nbytes = y.numel() * y.element_size()
    if fits_one_shot(y, group_name):
        buf = _buffer_for(y, group_name)
        if not (y.is_contiguous() and y.storage_offset() == 0 and y.data_ptr() % 16 == 0):
            y = y.clone(memory_format=torch.contiguous_format)  # new storage: offset 0, allocator-aligned
        out = torch.empty_like(y, memory_format=torch.contiguous_format)
        if group_name in _PUSH:
            return _push(y, out, group_name)
        staged = buf[:nbytes].view(y.dtype).view(y.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, y, "sum", group_name, out)
    return _nccl_sum(y, group_name)


@tp_sum.register_fake
def _(y: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def push_fits(y: Tensor, group_name: str) -> bool:
    """Whether :func:`tp_sum_residual` can sum ``y``: the group's one-shot kernel is the push
    kernel and ``y`` fits it (by dtype and size only, the same on every rank)."""
    return group_name in _PUSH and fits_one_shot(y, group_name)


@torch.library.custom_op("hybridgemm::tp_sum_residual", mutates_args=())
def tp_sum_residual(y: Tensor, residual: Tensor, group_name: str) -> Tensor:
    """``residual`` plus the sum of ``y`` over the ranks of group ``group_name``, in fp32 and
    rounded once to y's dtype (rank order), as a new tensor, by the push kernel; only where
    :func:`push_fits` (a ValueError otherwise). ``residual``: this rank's, of y's shape and
    dtype (the same on every rank)."""
    if not push_fits(y, group_name):
        raise ValueError(f"hybridgemm: tp_sum_residual needs the push kernel on group {group_name!r} "
                         f"and a message it takes ({tuple(y.shape)} {y.dtype})")
    _buffer_for(y, group_name)
    y = y.contiguous()
    # push_sum checks the residual's shape and dtype against y
    return _push(y, torch.empty_like(y), group_name, residual.contiguous())


@tp_sum_residual.register_fake
def _(y: Tensor, residual: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def release(group_name: str) -> None:
    """Forget ``group_name``'s buffer (for a group about to be destroyed): later sums over a
    group of that name use NCCL until :func:`enable_one_shot` is called for it again. Waits
    for this rank's queued work on the buffer's device first: a push kernel still queued
    reads the peers' mappings and the address table that go with the buffer. CUDA graphs
    captured with the buffer must not be replayed after it."""
    buf = _BUFFERS.get(group_name)
    if buf is not None and buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    for table in (_CAPACITY, _BUFFERS, _GROUPS, _KERNEL, _PUSH):
        table.pop(group_name, None)


__all__ = ["ONE_SHOT_KERNELS", "ONE_SHOT_MAX_BYTES", "enable_one_shot", "fits_one_shot", "one_shot_capacity",
           "one_shot_kernel", "one_shot_unavailable", "push_fits", "release", "tp_sum", "tp_sum_residual"]
