"""The sum of one tensor over the ranks of a tensor-parallel group, in one Triton launch
that each rank runs on its own GPU: every rank writes its tensor into the other ranks'
buffers and raises a flag there, then waits for the others' flags in its own memory and
sums the ranks' tensors in rank order.

Why: at decode, a row-parallel output is a few KB and its sum costs latency, not bandwidth.
torch's one-shot all-reduce (``symm_mem::one_shot_all_reduce_copy_out``) crosses the link
three times a call: a barrier before it reads the peers' buffers, the reads themselves, and
a barrier after, so that no rank overwrites its buffer while another still reads it. Here a
rank's data and flag go out in one posted write each, and nothing waits for a read to come
back; the buffer slots alternate between consecutive calls (their parity), so a rank never
writes into a slot that a peer may still be reading, with no closing barrier. The kernel
also takes part in programmatic dependent launch like the GEMMs around it.

Layout of each rank's buffer (``buffer_bytes``): ``FLAG_BYTES`` of int32 flags
``[2 parities][world][MAX_PROGRAMS]``, then the data slots ``[2 parities][world][capacity]``
in the sum's dtype. The message is cut into chunks of ``CHUNK_BYTES``; program ``p`` always
moves chunk ``p`` of whatever message is summed, and counts its own calls in ``epochs[p]``
(this rank's, local): call ``e`` (from 1) of program ``p`` writes into slot parity ``e & 1``
and sets the flag to ``e``. Why a slot is free when written: a peer writes call ``e`` only
after its call ``e - 1`` received this rank's flag ``e - 1``, which this rank raised after
its call ``e - 2`` had finished reading that same slot (kernels on a stream finish in
order). A flag is compared for equality, so the int32 counts may wrap.

Every rank must make the same sequence of calls with the same sizes: a program waits for
the same program of every other rank. Progress needs every program of a call to become
resident on each GPU (at most :data:`MAX_PROGRAMS` of 4 warps, a fraction of one wave of an
H200): a program waits for its peers, never for another program of its own rank. The flags
and counters start at zero (the caller zeroes them on every rank, then synchronises the ranks
once, before the first sum).

The sum is fp32 in rank order ``y_0 + y_1 + ...``, plus ``residual`` when one is given (this
rank's own tensor, the same on every rank: a decoder layer's residual stream), then rounded
once: every rank holds the same bits. For two ranks the partials' sum is commutative, so it is
the fp32 sum NCCL computes; the residual then adds no second rounding at the stream's
magnitude, which adding it to one rank's partial before the sum would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .bounded_cache import BoundedCache
from .triton_launch import Launcher, device_facts, interpreting, pdl_enabled

__all__ = ["CHUNK_BYTES", "DTYPES", "FLAG_BYTES", "MAX_PROGRAMS", "MAX_WORLD", "buffer_bytes", "flag_view",
           "group_why_not", "push_sum", "why_not"]

CHUNK_BYTES = 2048  # one 16-byte vector per thread of 4 warps: the message a program moves
MAX_WORLD = 8
MAX_PROGRAMS = 256  # chunks per message: 512 KiB at most
FLAG_BYTES = 2 * MAX_WORLD * MAX_PROGRAMS * 4
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def buffer_bytes(world: int, capacity: int) -> int:
    """Bytes of the symmetric buffer each rank needs for sums of up to ``capacity`` bytes."""
    return FLAG_BYTES + 2 * world * capacity


def flag_view(buf: torch.Tensor, world: int) -> torch.Tensor:
    """The int32 flags ``[2 parities][world][MAX_PROGRAMS]`` at the start of a rank's uint8
    buffer (the layout above)."""
    return buf[:FLAG_BYTES].view(torch.int32)[: 2 * world * MAX_PROGRAMS].view(2, world, MAX_PROGRAMS)


@triton.jit
def _push_sum_kernel(y_ptr, out_ptr, res_ptr, table_ptr, epoch_ptr, n,
                     RANK: tl.constexpr, WORLD: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                     MAXP: tl.constexpr, FLAG_BYTES: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # the GEMM before this kernel has written y
    pid = tl.program_id(0)
    e = tl.load(epoch_ptr + pid) + 1  # this program's call count (only this program touches it)
    tl.store(epoch_ptr + pid, e)
    par = e & 1
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask)
    dt = y_ptr.dtype.element_ty
    # 1. this rank's chunk into slot [par][RANK] of every other rank's buffer
    for r in tl.static_range(WORLD):
        if r != RANK:
            base = tl.load(table_ptr + r).to(tl.pointer_type(tl.int8))
            slot = (base + FLAG_BYTES).to(tl.pointer_type(dt)) + (par * WORLD + RANK) * CAP
            tl.store(slot + offs, y, mask=mask)
    # every thread's stores are ordered before the one thread's release below (bar.sync,
    # then a release at system scope, which is cumulative)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != RANK:
            base = tl.load(table_ptr + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(base + (par * WORLD + RANK) * MAXP + pid, e, sem="release", scope="sys")
    if PDL:
        gdc_launch_dependents()  # the next kernel may launch while this one waits for the peers
    # 2. wait for every other rank's flag of this call in this rank's buffer, then sum in rank order
    own = tl.load(table_ptr + RANK)
    flags = own.to(tl.pointer_type(tl.int32))
    data = (own.to(tl.pointer_type(tl.int8)) + FLAG_BYTES).to(tl.pointer_type(dt))
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = flags + (par * WORLD + r) * MAXP + pid
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen != e:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # every thread reads after the acquire
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += y.to(tl.float32)
        else:
            # .cg: from L2, where the peer's writes land, never from a stale L1 line
            acc += tl.load(data + (par * WORLD + r) * CAP + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(dt), mask=mask)


def group_why_not(world: int, capacity: int) -> str | None:
    """Why the kernel cannot serve a group of ``world`` ranks with sums of up to ``capacity``
    bytes, or None."""
    if not 2 <= world <= MAX_WORLD:
        return f"a group of {world} ranks (the push kernel takes 2 to {MAX_WORLD})"
    if not 16 <= capacity <= MAX_PROGRAMS * CHUNK_BYTES or capacity % 16:
        return (f"sums of up to {capacity} bytes (the push kernel takes a multiple of 16 bytes up to "
                f"{MAX_PROGRAMS * CHUNK_BYTES})")
    return None


def why_not(y: torch.Tensor, out: torch.Tensor, world: int, capacity: int,
            residual: torch.Tensor | None = None) -> str | None:
    """Why :func:`push_sum` cannot sum ``y`` (plus ``residual``) into ``out`` over a group of
    ``world`` ranks with buffers for ``capacity`` bytes, or None."""
    why = group_why_not(world, capacity)
    if why is not None:
        return why
    if y.dtype not in DTYPES:
        return f"dtype {y.dtype} (the kernel sums float16, bfloat16 and float32)"
    nbytes = y.numel() * y.element_size()
    if nbytes > capacity:
        return f"{nbytes} bytes, above the buffer's {capacity}"
    if not (y.is_contiguous() and out.is_contiguous()) or out.shape != y.shape or out.dtype != y.dtype:
        return "y and out must be contiguous tensors of one shape and dtype"
    if residual is not None and (not residual.is_contiguous() or residual.shape != y.shape
                                 or residual.dtype != y.dtype):
        return "residual must be a contiguous tensor of y's shape and dtype"
    if out.device != y.device or (residual is not None and residual.device != y.device):
        return f"out and residual must be on y's device ({y.device})"
    if y.device.type != "cuda" and not interpreting():
        return f"y is on {y.device}: the kernel needs CUDA tensors (or TRITON_INTERPRET=1)"
    return None


_LAUNCHERS = BoundedCache(1024)  # launchers per size, rank, group and alignment


def push_sum(y: torch.Tensor, out: torch.Tensor, table: torch.Tensor, epochs: torch.Tensor, rank: int,
             world: int, capacity: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out = y_0 + y_1 + ... + y_{world-1} (+ residual)`` over the ranks (rank order, fp32,
    rounded once), where this rank holds ``y`` and ``residual``.

    ``table``: int64 ``[world]`` on y's device, the address of every rank's buffer as this
    process sees it (its own at ``rank``), each of ``buffer_bytes(world, capacity)`` bytes with
    zeroed flags; ``epochs``: this rank's int32 ``[MAX_PROGRAMS]`` counters, zeroed with the
    flags and used only by these sums. A ValueError names what the kernel cannot take."""
    why = why_not(y, out, world, capacity, residual)
    if why is None and not 0 <= rank < world:
        why = f"rank {rank} outside a group of {world}"
    if why is None and (table.dtype != torch.int64 or table.numel() != world or table.device != y.device
                        or epochs.dtype != torch.int32 or epochs.numel() < MAX_PROGRAMS or epochs.device != y.device):
        why = f"table must be int64 [{world}] and epochs int32 [{MAX_PROGRAMS}], both on {y.device}"
    if why is not None:
        raise ValueError(f"push_sum: {why}")
    n = y.numel()
    if n == 0:
        return out
    chunk = CHUNK_BYTES // y.element_size()
    programs = triton.cdiv(n, chunk)
    pdl = pdl_enabled(device_facts(y.device).capability) and y.is_cuda
    # the launcher skips Triton's per-call specialisation: every integer value and pointer
    # alignment it would specialise on is in the key
    res = out if residual is None else residual  # a placeholder pointer without one
    key = (y.device, y.dtype, n, rank, world, capacity, pdl, residual is not None,
           *(t.data_ptr() % 16 for t in (y, out, res, table, epochs)))
    launch = _LAUNCHERS.get(key)
    if launch is None:
        meta = dict(RANK=rank, WORLD=world, CAP=capacity // y.element_size(), CHUNK=chunk, MAXP=MAX_PROGRAMS,
                    FLAG_BYTES=FLAG_BYTES, HAS_RES=residual is not None, PDL=pdl, num_warps=4)
        if pdl:
            meta["launch_pdl"] = True
        launch = _LAUNCHERS.put(key, Launcher(_push_sum_kernel, (programs,), meta))
    launch(y, out, res, table, epochs, n)
    return out
