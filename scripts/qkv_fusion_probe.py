"""What the fused decode step's Q/K/V piece costs beside the bare GEMM (GPU machine): Triton
split-K at M = 1 plain, with the RMSNorm prologue, with the rotary (and KV-cache write)
epilogue, and with both, for a few configs at phi3-mini's Q/K/V (heads of 96) and
llama3-8b's (heads of 128), beside F.linear; the tuner's timing (cold weights by rotation,
CUDA graphs in interleaved rounds). Prints µs and TB/s per variant.

    python3 scripts/qkv_fusion_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache.measure import gpu_time_rotating, rotation_copies
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.triton_rope import RotaryCache

C = ts.TritonSplitKConfig
SHAPES = (
    ("phi3-mini", 32, 32, 96, 3072, [C(16, 32, 128, 1, 4, 4), C(16, 32, 256, 1, 4, 4), C(16, 32, 128, 1, 2, 4)]),
    ("llama3-8b", 32, 8, 128, 4096, [C(16, 64, 256, 1, 4, 4), C(16, 64, 128, 1, 4, 4), C(16, 32, 128, 1, 4, 4)]),
)


def probe(name: str, heads: int, kv: int, hd: int, k: int, configs: list) -> None:
    n = (heads + 2 * kv) * hd
    copies = rotation_copies(n * k * 2, "cuda")
    ws = [(torch.randn(n, k, device="cuda") / k**0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(1, k, device="cuda").bfloat16()
    nw = torch.rand(k, device="cuda").bfloat16() + 0.5
    cos, sin = (torch.rand(1, 1, hd, device="cuda").bfloat16() for _ in range(2))
    keys = torch.zeros(1, kv, 64, hd, device="cuda", dtype=torch.bfloat16)
    cached = RotaryCache(cos, sin, heads, kv, hd, keys, keys.clone(), torch.tensor(5, device="cuda"))
    rotary = RotaryCache(cos, sin, heads, kv, hd)
    counters = torch.zeros(4096, device="cuda", dtype=torch.int32)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    variants = (("plain", {}), ("norm", {"norm": (nw, 1e-5)}), ("rope+cache", {"rope": cached}),
                ("rope only", {"rope": rotary}), ("norm+rope+cache", {"norm": (nw, 1e-5), "rope": cached}))
    calls = [("F.linear", lambda j: F.linear(x, ws[j]))]
    for cfg in configs:
        for label, fusion in variants:
            calls.append((f"{label:16s} {cfg}", lambda j, cfg=cfg, fusion=fusion: ts.run(
                cfg, x, ws[j], None, out, None, counters=counters, **fusion)))
    for _, call in calls:
        call(0)
    torch.cuda.synchronize()
    timings = gpu_time_rotating([call for _, call in calls], copies, "cuda")
    print(f"== {name} Q/K/V N={n} K={k} ({n * k * 2 / 1e6:.1f} MB)")
    for (label, _), t in zip(calls, timings):
        print(f"  {t.median_us:8.2f} us  {n * k * 2 / t.median_us / 1e6:5.2f} TB/s  {label}")


def main() -> None:
    for shape in SHAPES:
        probe(*shape)


if __name__ == "__main__":
    main()
