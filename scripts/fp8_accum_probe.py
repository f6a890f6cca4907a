"""cuBLASLt's FP8 GEMM with per-channel scales, with and without fast accumulation (GPU machine):
kernels/cublaslt_fp8.FAST_ACCUM off (the tensor cores' partial sums promoted to fp32) and on, on
Llama-3-8B's projection shapes at ``--m`` rows, bf16 out. Per shape: GPU time of
``cublaslt_fp8.run`` (x's quantization included; CUDA graphs, L2 flushed, perf/timing.gpu_time_many)
and the relative error of its output against an fp64 product of the same e4m3 operands and scales
(what accumulation and the bf16 rounding add), and whether two calls give the same bits.

    python3 scripts/fp8_accum_probe.py [--m 2048]
"""

from __future__ import annotations

import argparse

import torch

from hybridgemm.kernels import cublaslt_fp8
from hybridgemm.kernels.fp8 import quantize_fp8
from hybridgemm.kernels.fp8_quant import quantize_activations
from hybridgemm.perf.bench_fp8_prefill import SHAPES
from hybridgemm.perf.timing import gpu_time_many


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2048])
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    default = cublaslt_fp8.FAST_ACCUM
    for name, n, k in SHAPES:
        for m in args.m:
            x = torch.randn(m, k, device="cuda").bfloat16()
            wq = quantize_fp8((torch.randn(n, k, device="cuda") / k**0.5).bfloat16(), "channel")
            x8, xs = quantize_activations(x, "token")
            ref = (x8.double() * xs.reshape(-1, 1).double()) @ (wq.data.double() * wq.scale.double()[:, None]).T
            scale = cublaslt_fp8.weight_scale_operand(wq.scale, "channel")
            line, times = [], []
            for fast in (False, True):  # each setting's plan built fresh (plans are cached by key)
                cublaslt_fp8.FAST_ACCUM = fast
                cublaslt_fp8.clear_caches()
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

                def call(out=out, x=x, w8=wq.data, scale=scale):
                    return cublaslt_fp8.run(x, w8, scale, None, out)
                a, b = call().clone(), call().clone()
                err = ((a.double() - ref).norm() / ref.norm()).item()
                worst = ((a.double() - ref).abs().max() / ref.abs().max()).item()
                line.append(f"fast={int(fast)} rel err {err:.3e} (max {worst:.3e}) same bits twice {torch.equal(a, b)}")
                times.append(gpu_time_many([call], reps=3, replays=7)[0].median_us)
            print(f"{name} M={m}: promoted {times[0]:.1f} us, fast {times[1]:.1f} us ({times[0] / times[1]:.3f}x); "
                  + "; ".join(line), flush=True)
    cublaslt_fp8.FAST_ACCUM = default
    cublaslt_fp8.clear_caches()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
