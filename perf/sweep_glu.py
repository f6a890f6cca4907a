"""Time a grid of gated-kernel configs (kernels/triton_glu.py) beside the stock pair of GEMMs
(GPU machine): what its decode candidate list and default should be.

    python -m hybridgemm.perf.sweep_glu --shape 14336,4096 18944,3584 --m 1 8 --out DIR

Each shape is I,K (the stacked weight is 2I x K, bf16, no bias, SiLU). Every config is checked
against an fp32 reference, then timed with the tuner's method (cold weights by rotation, CUDA
graphs replayed in interleaved rounds). "stock" is ``silu(F.linear(x, Wg)) * F.linear(x, Wu)``.
Prints the four fastest per (shape, M) and writes DIR/sweep_triton_glu.csv.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache.measure import gpu_time_rotating, rotation_copies
from hybridgemm.kernels import triton_glu as tglu
from hybridgemm.kernels.triton_config import next_pow2
from hybridgemm.perf.bench_msweep import git_commit
from hybridgemm.perf.csvio import environment_columns, write_csv

# (block_n, bytes of K per row per stage, num_warps, num_stages)
GRID = ((128, 256, 4, 3), (128, 256, 8, 3), (128, 256, 4, 2), (64, 256, 4, 4), (64, 512, 4, 3), (32, 256, 4, 3),
        (32, 512, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (64, 128, 4, 6), (16, 512, 2, 4), (32, 256, 2, 3))
COLUMNS = ("gpu", "i", "k", "m", "variant", "config", "us", "weight_tbps", "speedup", "date", "commit", "torch",
           "triton", "hybridgemm", "command")
MAX_REL_ERROR = 2e-2  # of the reference's largest magnitude: bf16 output rounding is ~4e-3


def configs(m: int, i: int, k: int) -> list[tglu.TritonGluConfig]:
    bm = max(16, next_pow2(m))
    found = [tglu.TritonGluConfig(bm, bn, kb // 2, w, s) for bn, kb, w, s in GRID]
    default = tglu.default_config(m, i, k, torch.bfloat16)
    return [c for c in dict.fromkeys([*found, default]) if c.supports(m, i, k, torch.bfloat16)[0]]


def sweep_shape(i: int, k: int, ms: list[int], device: torch.device) -> list[dict]:
    wbytes = 2 * i * k * 2
    copies = rotation_copies(wbytes, device)
    ws = [(torch.randn(2 * i, k, device=device) / k**0.5).to(torch.bfloat16) for _ in range(copies)]
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device=device).to(torch.bfloat16) for _ in range(copies)]
        outs = [torch.empty(m, i, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        w32, x32 = ws[0].float(), xs[0].float()
        ref = F.silu(x32 @ w32[:i].T) * (x32 @ w32[i:].T)
        entries = [("stock", "", lambda j, xs=xs: F.silu(F.linear(xs[j], ws[j][:i])) * F.linear(xs[j], ws[j][i:]))]
        default = tglu.default_config(m, i, k, torch.bfloat16)
        for cfg in configs(m, i, k):
            tglu.run(cfg, xs[0], ws[0], None, outs[0], "silu")
            err = (outs[0].float() - ref).abs().max().item() / ref.abs().max().item()
            if not err <= MAX_REL_ERROR:
                raise AssertionError(f"{cfg} at m={m}, i={i}, k={k}: relative error {err:.3g}")
            label = f"bn={cfg.block_n} k_bytes={cfg.block_k * 2} warps={cfg.num_warps} stages={cfg.num_stages}"
            entries.append(("default" if cfg == default else "triton_glu", label,
                            lambda j, cfg=cfg, xs=xs, outs=outs: tglu.run(cfg, xs[j], ws[j], None, outs[j], "silu")))
        timings = gpu_time_rotating([e[2] for e in entries], copies, device)
        found = [dict(i=i, k=k, m=m, variant=v, config=c, us=round(t.median_us, 3),
                      weight_tbps=round(wbytes / t.median_us / 1e6, 3)) for (v, c, _), t in zip(entries, timings)]
        stock = next(r["us"] for r in found if r["variant"] == "stock")
        for r in found:
            r["speedup"] = round(stock / r["us"], 4)
        rows += found
        print(f"I={i} K={k} M={m}: stock {stock:.2f} us")
        for r in sorted(found, key=lambda r: r["us"])[:4]:
            print(f"  {r['us']:8.2f} us {r['weight_tbps']:6.3f} TB/s {r['variant']:10s} {r['config']}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hybridgemm.perf.sweep_glu", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", required=True, metavar="I,K")
    p.add_argument("--m", nargs="+", type=int, default=[1, 8])
    p.add_argument("--out", metavar="DIR")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape]
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        p.error(f"--shape takes I,K pairs of positive integers, got {' '.join(args.shape)}")
    if any(m < 1 for m in args.m):
        p.error("--m takes positive integers")
    if not torch.cuda.is_available():
        p.exit(2, "sweep_glu: needs a CUDA GPU\n")
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = list(itertools.chain.from_iterable(sweep_shape(i, k, args.m, device) for i, k in shapes))
    if args.out:
        env = environment_columns(" ".join(["python -m hybridgemm.perf.sweep_glu", *(argv or sys.argv[1:])]))
        env.update(date=datetime.date.today().isoformat(), commit=git_commit())
        path = os.path.join(args.out, "sweep_triton_glu.csv")
        write_csv(path, COLUMNS, [{**env, **r} for r in rows])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
