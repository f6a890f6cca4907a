"""Scratch memory of the kernels that split a reduction over several programs, and the
arrival-counter protocol that lets the last of them merge the parts in the same launch.

Serves triton_splitk and triton_gemm (split-K: fp32 partials of an output tile, summed in split
order by :func:`tl_split_fixup`) and triton_decode_attention (spans of cache positions, merged
in span order): their workspaces and counters come from :func:`split_scratch` (or
:func:`plan_scratch` for a launch plan), and their last arrivals are told by
:func:`tl_last_arrival`.

Scratch memory:
  - an fp32 workspace for the parts (split-K: ``[SPLIT_K, M, N]`` partials);
  - for a one-launch merge, an int32 arrival counter per merged unit (an output tile, a
    sequence's KV head). A counter only signals "every part of this unit is written"; it never
    carries values. The program that arrives last resets it to 0 and merges the parts in a
    fixed order, so the buffer is all zeros between calls (what the next call and graph
    replays need) and the result does not depend on which program arrived last.

Both are kept per (device, stream) from torch's caching allocator and never freed: a CUDA
graph captured with such a call bakes in their addresses. Calls from compiled regions take
fresh ones per call instead (kernels/process_memory.py). Graphs captured on one stream share
them: do not replay such graphs concurrently with each other or with eager calls on that stream.

Counters must be zero before the first use. A buffer created eagerly is zeroed eagerly. One
created while the stream is being captured is zeroed by a memset *inside that graph*; it is
reused by later captures on that stream (which then rely on that graph, or any eager/replayed
call using the buffer, having run first) but never by eager calls, which get a fresh buffer.
Warm up eagerly before capturing (torch's advice anyway) and none of this matters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .process_memory import per_call
from .triton_config import next_pow2
from .triton_launch import get_raw_stream
from .triton_plan import TritonPlan

_WORKSPACES: dict[tuple, torch.Tensor] = {}
_COUNTERS: dict[tuple, tuple[torch.Tensor, bool]] = {}
_RETIRED: list[torch.Tensor] = []  # replaced counter buffers a captured graph may still use


def _stream_key(device: torch.device) -> tuple:
    if device.type != "cuda":
        return (device.type, device.index, 0)
    # torch.cuda.current_stream() builds a Stream object (~10 µs on a slow host, once per
    # split-K call); the raw getter returns the same cudaStream_t as an int.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if get_raw_stream is not None:
        return (device.type, index, get_raw_stream(index))
    return (device.type, index, torch.cuda.current_stream(index).cuda_stream)


def workspace(device: torch.device, numel: int, stream_key: tuple | None = None) -> torch.Tensor:
    """An fp32 buffer of ≥ ``numel`` elements for the current stream; sizes are bucketed to
    powers of two (≥ 1 MiB) so varying M reuses a few buffers. Never freed (see above)."""
    nbytes = max(1 << 20, next_pow2(numel * 4))
    key = (stream_key or _stream_key(device)) + (nbytes,)
    buf = _WORKSPACES.get(key)
    if buf is None:
        buf = _WORKSPACES[key] = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    return buf


def split_counters(device: torch.device, numel: int, stream_key: tuple | None = None) -> torch.Tensor:
    """A zero-filled int32 buffer of ≥ ``numel`` arrival counters for the current stream."""
    key = stream_key or _stream_key(device)
    entry = _COUNTERS.get(key)
    if entry is not None and entry[0].numel() >= numel and not entry[1]:
        return entry[0]  # the common case: an eagerly zeroed buffer, no capture query needed
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if entry is not None and entry[0].numel() >= numel and capturing:
        return entry[0]
    if entry is not None:
        _RETIRED.append(entry[0])
    buf = torch.zeros(max(1024, next_pow2(numel)), dtype=torch.int32, device=device)
    _COUNTERS[key] = (buf, capturing)
    return buf


def split_scratch(device: torch.device, ws_numel: int, counters: int) -> tuple:
    """(workspace, counters or None) for a split-K launch on the current stream; fresh ones,
    dropped after the call, inside ``process_memory.per_call_scratch`` (compiled regions)."""
    if per_call():
        ws = torch.empty(ws_numel, dtype=torch.float32, device=device)
        return ws, (torch.zeros(counters, dtype=torch.int32, device=device) if counters else None)
    key = _stream_key(device)
    ws = workspace(device, ws_numel, key)
    return ws, (split_counters(device, counters, key) if counters else None)


def workspace_bytes() -> int:
    """Bytes held by cached split-K workspaces (for tests and memory accounting)."""
    return sum(b.numel() * 4 for b in _WORKSPACES.values())


def counters_snapshot() -> list[torch.Tensor]:
    """The live counter buffers (tests check that every call leaves them all zero)."""
    return [buf for buf, _ in _COUNTERS.values()]


def clear_workspaces() -> None:
    """Drop cached workspaces and counters. Unsafe while a captured CUDA graph still uses one."""
    _WORKSPACES.clear()
    _COUNTERS.clear()
    _RETIRED.clear()


def plan_scratch(plan: TritonPlan, placeholder: torch.Tensor, counters: torch.Tensor | None = None) -> tuple:
    """(workspace, counters) for a launch of ``plan`` on the current stream; ``placeholder``
    for each that the plan does not use (never dereferenced). ``counters``: the caller's own
    zeroed int32 arrival counters, used in compiled regions (``per_call_scratch``) when the plan
    needs no more than they hold (the kernels leave them zero again), in place of a zero-filled
    buffer per call; eager calls use their stream's (a caller's buffer is not per stream)."""
    if not plan.ws_numel:
        return placeholder, placeholder
    if counters is not None and plan.counters and counters.numel() >= plan.counters and per_call():
        ws, _ = split_scratch(plan.device, plan.ws_numel, 0)
        return ws, counters
    ws, cnt = split_scratch(plan.device, plan.ws_numel, plan.counters)
    return ws, (ws if cnt is None else cnt)


# ----------------------------------------------------------------------------- arrival counters


@triton.jit
def tl_last_arrival(cnt_ptr, arrivals):
    """The arrival-counter protocol, after a program has stored its part of a merged unit:
    count it in at ``cnt_ptr`` and return True in the program that arrives last of
    ``arrivals``, which has then reset the counter to 0 (every arrival is counted; the next
    launch on the stream starts after this one ends, PDL's wait included) and may read every
    part. The others return False and must not touch the unit again.

    Ordering: the barrier makes the whole CTA's part stores happen before thread 0's release
    (acq_rel, GPU scope) increment; the last program's acquire makes the other programs' parts
    visible to it, and its loads of them should bypass L1 (``.cg``).
    """
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call
    return last


# Partials loaded ahead of their adds: up to this many fp32 registers a thread (the loads of a
# group are issued together, so a merge of S parts waits for about S / group L2 round trips
# instead of S - 1; more in flight would spill beside the accumulator).
FIXUP_REGS = 64
MAX_FIXUP_GROUP = 8
TL_MAX_FIXUP_GROUP = tl.constexpr(MAX_FIXUP_GROUP)  # the group of small parts (a row's sums of squares)


def fixup_group(block_m: int, block_n: int, num_warps: int, split: int) -> int:
    """How many of ``split`` partials of a ``block_m x block_n`` fp32 tile over ``num_warps`` warps
    a merge loads before adding them (:func:`tl_sum_parts`' GROUP): 1 to :data:`MAX_FIXUP_GROUP`,
    no more than there are partials (a larger group only compiles loads that never run)."""
    per_thread = max(1, block_m * block_n // (32 * num_warps))
    return max(1, min(MAX_FIXUP_GROUP, FIXUP_REGS // per_thread, split))


@triton.jit
def tl_sum_parts(zeros, part_ptrs, part_stride, mask, count, GROUP: tl.constexpr):
    """The sum of parts ``0 .. count - 1`` at ``part_ptrs + s * part_stride`` (``zeros``: fp32
    zeros of their shape), added one at a time in index order: part 0, then + part 1, and so on
    (the bits do not depend on GROUP or on any timing). The loads of GROUP consecutive parts are
    issued before their adds, so the sum waits for about count / GROUP L2 round trips, not one a
    part (nothing else goes between them: a part taken from registers would need its layout converted
    through shared memory, a barrier that the next loads would not cross). A part past ``count``
    adds nothing. Loads bypass L1 (``.cg``): the parts were written by other programs."""
    total = zeros
    for s0 in range(0, count, GROUP):
        for j in tl.static_range(GROUP):
            s = s0 + j
            # where(c, mask, False), not mask & c: same PTX; Triton 3.9's interpreter rejects mask & c as an int32 mask
            part = tl.load(part_ptrs + s * part_stride, mask=tl.where(s < count, mask, False), other=0.0,
                           cache_modifier=".cg")
            # part 0 as it is (0.0 + -0.0 would be +0.0)
            total = tl.where(s < count, tl.where(s == 0, part, total + part), total)
    return total


@triton.jit
def tl_split_fixup(acc, ws_ptr, offs, mask, split_stride, cnt_ptr, pid_s, split_k, GROUP: tl.constexpr):
    """Single-pass deterministic split-K reduction of one output tile.

    Every split program stores its fp32 partial ``acc`` at ``ws_ptr + pid_s * split_stride +
    offs`` and arrives at the tile's counter (:func:`tl_last_arrival`). The last to arrive
    returns ``(sum of the partials in split order 0..split_k-1, True)`` (:func:`tl_sum_parts`,
    its own partial read back like the others: the barrier before its arrival orders its
    threads' stores before their loads); the others return ``(acc, False)`` and must not store.
    Which program finishes the tile varies from run to run, the sum and its order do not:
    bit-identical results. Positions outside ``mask`` hold 0. GROUP: :func:`fixup_group`.
    """
    tl.store(ws_ptr + pid_s * split_stride + offs, acc, mask=mask)
    last = tl_last_arrival(cnt_ptr, split_k)
    total = acc
    if last:
        total = tl_sum_parts(tl.zeros_like(acc), ws_ptr + offs, split_stride, mask, split_k, GROUP)
    return total, last


__all__ = [
    "FIXUP_REGS", "MAX_FIXUP_GROUP", "TL_MAX_FIXUP_GROUP", "clear_workspaces", "counters_snapshot", "fixup_group",
    "plan_scratch", "split_counters", "split_scratch", "tl_last_arrival", "tl_split_fixup", "tl_sum_parts",
    "workspace", "workspace_bytes",
]
