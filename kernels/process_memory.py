"""Device buffers that live for the whole process: cuBLASLt workspaces and split-K scratch.

A CUDA graph captured with such a buffer bakes in its address, so it is allocated once and never
freed. It must also stay out of any CUDA-graph memory pool: torch.compile's CUDA graph trees
allocate everything a compiled region creates (during its eager warm-up and its capture) from a
private pool, and refuse a recording that leaves a pool tensor alive that is not one of the
graph's outputs ("Detected N tensor(s) in the cudagraph pool not tracked as outputs"). The
allocator routes an allocation to a graph pool by the stream it is made on, so these buffers are
allocated on a side stream of their own, which no capture or pool ever targets. Allocating
issues no kernel; callers that need zeros fill the buffer on their own stream.
"""

from __future__ import annotations

import torch

_ALLOC_STREAMS: dict[int, torch.cuda.Stream] = {}


def process_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D buffer that is never in a CUDA-graph pool (see the module doc)."""
    if device.type != "cuda":
        return torch.empty(numel, dtype=dtype, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _ALLOC_STREAMS.get(index)
    if stream is None:
        stream = _ALLOC_STREAMS[index] = torch.cuda.Stream(index)
    with torch.cuda.stream(stream):
        return torch.empty(numel, dtype=dtype, device=torch.device("cuda", index))


def release_wait(device: torch.device) -> None:
    """Before dropping process buffers: wait for the work that may still use them, so the
    allocator cannot hand their memory to the next buffer while a kernel still writes it."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
