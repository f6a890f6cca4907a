"""The read ceiling of a weight: how fast a kernel that only reads the weight's bytes streams
them from HBM at that size, the reference a decode GEMM (a GEMV in all but name) is measured
against (perf/bench_layer_fusion.py, perf/bench_msweep.py).

The reading kernel sums a contiguous buffer in fp32 and stores one number per program; it is
launched on a few grids (:data:`READ_PROGRAMS_PER_SM` programs per SM) and the fastest is the
ceiling. An FP8 weight is read as the bytes it is: e4m3 data and fp32 scales, which
:func:`fp8_in_one_buffer` lays out back to back in one allocation so that the reading kernel
and the FP8 GEMM read the very same N*K + 4 * (number of scales) bytes.

:func:`device_read_tbps` is the GPU's whole-HBM read rate that the benches divide a step's
bytes by (their HBM floor): the H200's measured figure, or on another GPU the reading kernel's
rate over 1 GiB, measured once per device and process (``$HYBRIDGEMM_READ_TBPS`` sets it by hand).

Triton is imported on first use: perf/bench_msweep.py imports this module, and
``import hybridgemm.perf.bench_msweep`` must work where Triton is absent (tests/test_layers.py).
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from hybridgemm.autotune_cache.table_locations import device_slug
from hybridgemm.kernels.fp8 import BLOCK, FP8Weight, quantize_fp8
from hybridgemm.perf.timing import HBM_TBPS

READ_PROGRAMS_PER_SM = (2, 4, 8, 16)  # grids of the read-only kernel; the fastest is the ceiling
READ_BLOCK = 4096  # elements per program per loop step
_ALIGN = 16  # bytes: the scales start right after the e4m3 data, at a 16-byte boundary
# GPUs whose whole-HBM read rate is a figure measured and published with their results (by
# device_slug): the rate their reports divide by, so that a rerun's floors are comparable
MEASURED_READ_TBPS = {"h200": HBM_TBPS}  # perf/results/h200/README.md
MEASURE_BYTES = 1 << 30  # the buffer device_read_tbps reads on other GPUs: 20x an H100's L2
READ_TBPS_ENV = "HYBRIDGEMM_READ_TBPS"
# Seconds of reads before any call is timed, so that the clocks have left idle (one 1 GiB read
# gives them little time: an H100's figure, measured once per process, ranged over 2.67-3.05 TB/s
# in perf/results/h100's CSVs, column read_tbps).
WARM_SECONDS = 0.25


@functools.cache
def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(w_ptr, sink_ptr, per_prog, total, BLOCK: tl.constexpr):
        """Sum a contiguous slice of the buffer: HBM read traffic and nothing else."""
        start = tl.program_id(0).to(tl.int64) * per_prog
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(0, per_prog, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            acc += tl.load(w_ptr + offs, mask=offs < total, other=0, eviction_policy="evict_first").to(tl.float32)
        tl.store(sink_ptr + tl.program_id(0), tl.sum(acc))

    return read_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def read_view(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` as the kernel reads it: a float or int tensor as it is (flattened); a byte buffer
    as int32 where its length allows (4 bytes a load, as wide as a bf16 pair), else as bytes."""
    flat = buf.reshape(-1)
    if flat.element_size() == 1:
        flat = flat.view(torch.uint8)
        if flat.numel() % 4 == 0:
            flat = flat.view(torch.int32)
    return flat


def read_calls(buffers: list[torch.Tensor], device) -> list[Callable[[int], torch.Tensor]]:
    """One read-only call per grid of :data:`READ_PROGRAMS_PER_SM`, each ``call(j)`` reading
    every byte of ``buffers[j]`` (the rotating copies of gpu_time_rotating) and returning its
    programs' sums (their total is the buffer's sum: every element was read once)."""
    views = [read_view(b) for b in buffers]
    total = views[0].numel()
    if any(v.numel() != total or v.dtype != views[0].dtype for v in views):
        raise ValueError("read_calls: every buffer must hold the same number of elements of one dtype")
    kernel = _read_kernel()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    calls = []
    for per_sm in READ_PROGRAMS_PER_SM:
        progs = sms * per_sm
        per = _cdiv(_cdiv(total, progs), READ_BLOCK) * READ_BLOCK  # elements per program, whole blocks
        sink = torch.empty(progs, device=views[0].device)

        def call(j: int, per=per, progs=progs, sink=sink) -> torch.Tensor:
            kernel[(progs,)](views[j], sink, per, total, BLOCK=READ_BLOCK, num_warps=8)
            return sink

        calls.append(call)
    return calls


def fp8_bytes(n: int, k: int, granularity: str) -> int:
    """Bytes of an (N, K) FP8 weight: N*K e4m3 bytes and 4 bytes per fp32 scale (one per row,
    or one per 128 x 128 block)."""
    scales = n if granularity == "channel" else _cdiv(n, BLOCK) * _cdiv(k, BLOCK)
    return n * k + 4 * scales


def fp8_in_one_buffer(weight: torch.Tensor, granularity: str) -> tuple[FP8Weight, torch.Tensor]:
    """``quantize_fp8(weight, granularity)`` with its e4m3 data and its scales back to back in
    one byte buffer: ``(the FP8Weight, the buffer)``, the second what :func:`read_calls` reads
    (exactly :func:`fp8_bytes` bytes). N*K must be a multiple of 16 (the scales' alignment;
    every model projection's is); ValueError otherwise."""
    n, k = weight.shape
    if (n * k) % _ALIGN:
        raise ValueError(f"fp8_in_one_buffer: N*K = {n * k} is not a multiple of {_ALIGN}")
    q = quantize_fp8(weight, granularity)
    buf = torch.empty(fp8_bytes(n, k, granularity), dtype=torch.uint8, device=weight.device)
    data = buf[:n * k].view(q.data.dtype).view(n, k)
    scale = buf[n * k:].view(torch.float32).view(q.scale.shape)
    data.copy_(q.data)
    scale.copy_(q.scale)
    return FP8Weight(data, scale, granularity, q.dtype), buf


def device_read_tbps(device: torch.device | str | int | None = None) -> tuple[float, str]:
    """(TB/s, what the figure is) for HBM floors on ``device`` (default: the current CUDA
    device): ``$HYBRIDGEMM_READ_TBPS`` where set (a rate given by hand; the tests pin the
    H200's); the published rate of a GPU in :data:`MEASURED_READ_TBPS`; on any other GPU the
    fastest grid of the reading kernel over :data:`MEASURE_BYTES` (or a quarter of the free
    memory, if less), median of 5 calls, measured once per device and process; the H200's
    figure for a run without a CUDA device (a CPU run's floors)."""
    pinned = os.environ.get(READ_TBPS_ENV, "").strip()
    if pinned:
        try:
            tbps = float(pinned)
        except ValueError:
            tbps = math.nan
        if not math.isfinite(tbps) or tbps <= 0:
            raise ValueError(f"{READ_TBPS_ENV}={pinned!r}: give the HBM read rate in TB/s, a positive number")
        return tbps, READ_TBPS_ENV
    if device is not None:  # (an int names a CUDA device, as torch.cuda's functions take it)
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return HBM_TBPS, "the H200's measured read rate (not a CUDA device)"
    index = device.index if device is not None else None
    return _cuda_read_tbps(torch.cuda.current_device() if index is None else index)


@functools.cache
def _cuda_read_tbps(index: int) -> tuple[float, str]:
    name = torch.cuda.get_device_name(index)
    known = MEASURED_READ_TBPS.get(device_slug(name))
    if known is not None:
        return known, f"the {name}'s measured read rate"
    return _measure_read_tbps(torch.device("cuda", index)), f"read rate measured on this {name}"


def _measure_read_tbps(device: torch.device) -> float:
    free = torch.cuda.mem_get_info(device)[0]
    nbytes = min(MEASURE_BYTES, free // 4) // (4 * READ_BLOCK) * (4 * READ_BLOCK)
    if nbytes == 0:
        raise RuntimeError(f"{device}: too little free memory to measure the HBM read rate (set {READ_TBPS_ENV})")
    buf = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best_ms = float("inf")
    with torch.cuda.device(device):
        calls = read_calls([buf], device)
        del buf  # (the calls hold it until they go)
        for call in calls:
            call(0)  # compiles
        warm_until = time.perf_counter() + WARM_SECONDS
        while time.perf_counter() < warm_until:  # the clocks up before any call is timed
            calls[0](0)
            torch.cuda.synchronize(device)
        for call in calls:
            times = []
            for _ in range(5):
                start.record()
                call(0)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            best_ms = min(best_ms, statistics.median(times))
        call = None  # (the loop's last call holds the buffer too)
        del calls
        torch.cuda.empty_cache()  # the buffer's memory back to the device, not kept by the allocator
    return nbytes / (best_ms * 1e-3) / 1e12


def hbm_floor_ms(nbytes: int, tbps: float | None = None, device=None) -> float:
    """Milliseconds to read ``nbytes`` once at ``tbps`` TB/s (default: ``device``'s read rate,
    :func:`device_read_tbps`; the current CUDA device's without one): the benches' HBM floor."""
    return nbytes / ((device_read_tbps(device)[0] if tbps is None else tbps) * 1e12) * 1e3


def read_rate_note(device=None) -> str:
    """The rate the HBM floors on ``device`` divide by, and what it is, for a log line."""
    tbps, what = device_read_tbps(device)
    return f"{tbps:.2f} TB/s ({what})"
