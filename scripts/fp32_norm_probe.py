"""Gemma's RMSNorm (x normalised and scaled by its fp32 factor ``1 + w``, rounded once) as torch
ops over the factor already formed (the stock formula's ops but the factor's own two) against
one launch of kernels/triton_rmsnorm.py (``fp32_factor=True``), bf16 x, at decode rows (GPU
machine). Per (M, H): GPU µs per call (perf/timing.gpu_time_many: 200 calls captured in one
CUDA graph, five interleaved replays, the median; L2 not flushed) and eager host µs per call
(perf/timing.eager_time_interleaved: rounds of 2000 back-to-back calls, the median).

    python3 scripts/fp32_norm_probe.py
"""

from __future__ import annotations

import torch

from hybridgemm import norm
from hybridgemm.perf.timing import eager_time_interleaved, gpu_time_many

SHAPES = ((1, 3072), (1, 3584), (1, 4096), (8, 3584), (16, 4096))


def main() -> None:
    with torch.no_grad():
        for m, h in SHAPES:
            x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
            g = 1 + 0.1 * torch.randn(h, device="cuda")  # a Gemma factor 1 + w, in fp32
            ops = lambda x=x, g=g: norm._scaled_in_fp32(x, g, 1e-6)  # noqa: E731
            one = lambda x=x, g=g: norm.fp32_factor_rms_norm(x, g, 1e-6)  # noqa: E731
            assert (ops() != one()).float().mean() < 0.05, "the launch does not compute the stock formula"
            gpu = gpu_time_many([ops, one], reps=200, replays=5, flush_l2=False)
            host = eager_time_interleaved({"ops": ops, "one": one}, calls=2000)
            print(f"M={m} H={h}: GPU torch ops {gpu[0].median_us:.2f} us, one launch {gpu[1].median_us:.2f} us; "
                  f"eager host torch ops {host['ops'].median_us:.1f} us, one launch {host['one'].median_us:.1f} us")


if __name__ == "__main__":
    main()
