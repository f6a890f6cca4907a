"""Triton tiled configs for a few-tile shape (8b kv at M=1024: N=1024, K=4096), beside F.linear.

    python scripts/sweep_few_tiles.py [M N K]
"""

import itertools
import sys

import torch
import torch.nn.functional as F

from hybridgemm.kernels import triton_gemm as tg
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem
from hybridgemm.perf.timing import gpu_time_many

m, n, k = (int(v) for v in (sys.argv[1:4] if len(sys.argv) >= 4 else (1024, 1024, 4096)))
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
ref = F.linear(x.float(), w.float(), b.float())
cfgs = []
for (bm, bn, bk), stages, warps, persistent, split in itertools.product(
        [(64, 128, 64), (64, 128, 128), (128, 64, 64), (128, 128, 64), (64, 256, 64)],
        [3, 5], [4, 8], [False, True], [1, 2]):
    if (persistent and split > 1) or (bm == 64 and warps == 8 and bn < 256):
        continue
    cfg = tg.TritonGemmConfig(bm, bn, bk, 8, warps, stages, persistent, True, False, split)
    p = Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True), ldx=k, ldw=k, ldo=n)
    if cfg.supports(p)[0]:
        cfgs.append(cfg)
ok = []
for cfg in cfgs:
    try:
        out.fill_(float("nan"))
        tg.run(cfg, x, w, b, out, Activation.NONE)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if err < 1e-2:
            ok.append(cfg)
    except Exception as e:  # report and go on
        print("fail", cfg, type(e).__name__, str(e)[:100])
print(f"{len(ok)} configs run correctly of {len(cfgs)}")
res = []
for i in range(0, len(ok), 8):
    chunk = ok[i:i + 8]
    fns = [lambda: F.linear(x, w, b)] + [lambda c=c: tg.run(c, x, w, b, out, Activation.NONE) for c in chunk]
    ts = gpu_time_many(fns, reps=10, replays=7)
    for c, t in zip(chunk, ts[1:]):
        res.append((t.median_us / ts[0].median_us, t.median_us, ts[0].median_us, c))
res.sort(key=lambda r: r[0])
for r in res[:15]:
    c = r[3]
    print(f"{r[1]:8.2f} µs  F.linear {r[2]:8.2f}  speed {1 / r[0]:.3f}x  bm={c.block_m} bn={c.block_n} bk={c.block_k} "
          f"st={c.num_stages} w={c.num_warps} pers={c.persistent} split={c.split_k}")
