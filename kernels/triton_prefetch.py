"""Weight prefetch into L2 before a PDL wait, for the decode GEMM kernels (split-K, gated).

Under programmatic dependent launch (``triton_launch.pdl_enabled``) a decode GEMM's programs
start while the previous kernel finishes, then wait (``gdc_wait``) before reading anything that
kernel writes. The weight is not among those: it can be fetched before the wait. With
``PREFETCH`` on, each program first asks L2 for the first bytes of each of its W rows' K range
(one ``cp.async.bulk.prefetch.L2`` per row, Hopper's bulk prefetch, which takes a 16-byte
aligned address and a multiple of 16 bytes), so that its pipeline's first loads after the wait
find them in L2, and HBM has work while the previous kernel drains. The prefetch only warms L2:
what the kernel computes is the same, bits included.

``HYBRIDGEMM_PDL_PREFETCH=1`` turns it on where PDL is on (read when a plan is built, so plans
and bound launches built before a change keep what they were built with; off by default).
Nothing touches a GPU at import time.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

ALIGN = 16  # the bulk prefetch's address and size granularity, bytes


def prefetch_enabled(pdl: bool) -> bool:
    """Prefetch the weight before the PDL wait? Only with PDL (Hopper, whose bulk prefetch it
    uses) and ``HYBRIDGEMM_PDL_PREFETCH=1``."""
    return pdl and os.environ.get("HYBRIDGEMM_PDL_PREFETCH", "0") == "1"


def prefetch_elements(pdl: bool, w_align: int, ldw: int, k_step: int, w_itemsize: int, elements: int) -> int:
    """The ``PREFETCH`` constexpr of a plan: W elements per row to prefetch (``elements``, the
    pipeline's stages of K), or 0 for none: off (:func:`prefetch_enabled`), or where a row's
    start could be off 16 bytes (W's base ``w_align``, its row stride ``ldw`` and the K offset
    a program starts at, a multiple of ``k_step``, all in elements of ``w_itemsize`` bytes)."""
    if not prefetch_enabled(pdl) or w_align % ALIGN or (ldw * w_itemsize) % ALIGN or (k_step * w_itemsize) % ALIGN:
        return 0
    return elements


@triton.jit
def tl_prefetch_rows(row_ptrs, elements):
    """Ask L2 for ``elements`` of W from each of ``row_ptrs`` (16-byte aligned: see
    :func:`prefetch_elements`), rounded down to whole 16-byte units; nothing where that is 0."""
    nbytes = (elements * row_ptrs.dtype.element_ty.primitive_bitwidth // 8) // 16 * 16 + tl.zeros(row_ptrs.shape,
                                                                                                  tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [row_ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
