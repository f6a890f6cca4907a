"""Gemma's RMSNorm (x normalised and scaled by its fp32 factor ``1 + w``, rounded once) as torch
ops over the factor already formed (the stock formula's ops but the factor's own two) against
one launch of kernels/triton_rmsnorm.py (``fp32_factor=True``), bf16 x, at decode rows (GPU
machine). Per (M, H): GPU µs per call (200 calls captured in one CUDA
graph, five replays) and eager host µs per call (2000 back-to-back calls, then a sync).

    python3 scripts/fp32_norm_probe.py
"""

from __future__ import annotations

import time

import torch

from hybridgemm import norm

SHAPES = ((1, 3072), (1, 3584), (1, 4096), (8, 3584), (16, 4096))


def graph_us(fn, calls: int = 200, replays: int = 5) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (plans, compiled kernels) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def main() -> None:
    with torch.no_grad():
        for m, h in SHAPES:
            x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
            g = 1 + 0.1 * torch.randn(h, device="cuda")  # a Gemma factor 1 + w, in fp32
            ops = lambda x=x, g=g: norm._scaled_in_fp32(x, g, 1e-6)  # noqa: E731
            one = lambda x=x, g=g: norm.fp32_factor_rms_norm(x, g, 1e-6)  # noqa: E731
            assert (ops() != one()).float().mean() < 0.05, "the launch does not compute the stock formula"
            print(f"M={m} H={h}: GPU torch ops {graph_us(ops):.2f} us, one launch {graph_us(one):.2f} us; "
                  f"eager host torch ops {host_us(ops):.1f} us, one launch {host_us(one):.1f} us")


if __name__ == "__main__":
    main()
