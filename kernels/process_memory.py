"""Where scratch memory comes from: buffers kept for the process, or per call.

Eager calls reuse cuBLASLt workspaces and split-K scratch kept per (device, stream) for the
whole process: no allocation per call, and a CUDA graph captured by hand bakes in their
addresses (they are never freed).

Calls from inside a compiled region (the ``hybridgemm::`` custom ops) must not do that.
torch.compile's CUDA graph trees allocate everything a region creates, during its eager warm-up
and during its capture, from a private pool, and refuse a recording that leaves a pool tensor
alive that is not one of the graph's outputs ("Detected N tensor(s) in the cudagraph pool not
tracked as outputs"): a buffer cached on first use there would be exactly that. So inside
:func:`per_call_scratch` the backends allocate their scratch per call through the caching
allocator and drop it when the call returns (stream-ordered, so the memory is reused only by
later work on that stream; inside a graph it is pool memory the graph owns). Cost: an
allocation per split-K or cuBLASLt call (a cached block, a few µs of host time; the split-K
counters add a memset), paid only under torch.compile, where a CUDA graph replays without it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_STATE = threading.local()


def per_call() -> bool:
    """True while this thread runs inside :func:`per_call_scratch`."""
    return getattr(_STATE, "depth", 0) > 0


@contextmanager
def per_call_scratch():
    """Backends called in this block (this thread) allocate their scratch per call."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1
