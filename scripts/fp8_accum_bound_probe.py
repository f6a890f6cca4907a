"""How far cuBLASLt's per-channel FP8 GEMM strays beyond its output's rounding, with and without
fast accumulation (GPU machine): on the operands of tests/kernels/test_cublaslt_fp8_gpu.py (its
shapes, M values and dtypes, per-channel weights, a bias), the largest element of
``(|out - z| - ULPS ulp |z|) / sum_l |x_l w_l|`` against the fp64 product ``z`` of the same e4m3
operands: what that test's accumulation slack (ACC_SLACK) has to cover.

    python3 scripts/fp8_accum_bound_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("kernels", ".")]
import test_cublaslt_fp8_gpu as t  # noqa: E402 (the test's operands and reference)

from hybridgemm.kernels import cublaslt_fp8 as cf  # noqa: E402
from hybridgemm.kernels.cublaslt_runtime import CublasLtUnsupported  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    default = cf.FAST_ACCUM
    try:
        for fast in (False, True):
            cf.FAST_ACCUM = fast
            cf.clear_caches()
            for n, k in t.SHAPES_NK:
                for m in t.MS:
                    for dtype in t.DTYPES:
                        x, w, b = t.operands(m, n, k, dtype, "channel", True)
                        z = t.Preactivation(t.dequantized_activations(x, "channel"), t.dequantized_weight(w), b)
                        what = f"fast={int(fast)} {dtype} M={m} N={n} K={k}"
                        try:
                            out = cf.run(x, w.data, w.scale, b, None, None)
                        except CublasLtUnsupported as e:
                            print(f"{what}: not run ({e})", flush=True)
                            continue
                        err = (out.double() - z.value).abs()
                        excess = ((err - t.ULPS * t.unit(dtype) * z.value.abs()).clamp_min(0) / z.abs_sum).max()
                        print(f"{what}: max excess/abs_sum {excess.item():.3e} = 2^{torch.log2(excess).item():.2f}",
                              flush=True)
    finally:
        cf.FAST_ACCUM = default
        cf.clear_caches()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
