# ruff: noqa: B023  (the lambdas are timed inside the iteration that made them)
"""Sweep a grid of Triton configs for one shape beside F.linear (GPU machine): what the
candidate lists might be missing.

    python scripts/sweep_configs.py --backend triton_gemm   --shape 1024,4096 --m 1024
    python scripts/sweep_configs.py --backend triton_splitk --shape 3584,3584 4608,3584 --m 1 8

Kernels are compiled first on worker processes (autotune_cache/precompile.py), then timed
with the tuner's method (autotune_cache/measure.gpu_time_rotating: cold operands by rotation, graphs
replayed in interleaved rounds), in chunks of 8 beside F.linear. Every config is checked
against an fp32 reference before it is timed. Prints the 15 fastest per (shape, M) with GB/s
and TFLOP/s and writes DIR/sweep_<backend>.csv when --out is given.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys

TILE_GRID = dict(tile=[(64, 128, 64), (64, 128, 128), (128, 64, 64), (128, 64, 128), (128, 128, 64), (64, 256, 64),
                       (128, 256, 64)],
                 stages=[3, 4, 5], warps=[4, 8], persistent=[False, True], split=[1, 2, 3, 4])
SPLITK_GRID = dict(block_n=[32, 64, 128], block_k=[128, 256, 512], split=[1, 2, 4, 7, 8, 14, 16],
                   warps=[4, 8], stages=[3, 4], fused=[False, True])


def grid(backend: str, problem) -> list:
    """Every config of the backend's grid that ``supports`` the problem (on a Hopper GPU)."""
    from hybridgemm.kernels import triton_gemm as tg
    from hybridgemm.kernels import triton_splitk as ts

    out = []
    if backend == "triton_gemm":
        g = TILE_GRID
        for (bm, bn, bk), st, w, pers, split in itertools.product(g["tile"], g["stages"], g["warps"],
                                                                   g["persistent"], g["split"]):
            if (pers and split > 1) or (w == 8 and bm * bn < 128 * 128):
                continue
            try:
                cfg = tg.TritonGemmConfig(bm, bn, bk, 8, w, st, pers, True, False, split)
            except ValueError:
                continue
            if cfg.supports(problem)[0]:
                out.append(cfg)
    else:
        g = SPLITK_GRID
        bm = min(64, max(16, 1 << max(0, problem.m - 1).bit_length()))
        for bn, bk, split, w, st, fused in itertools.product(g["block_n"], g["block_k"], g["split"], g["warps"],
                                                             g["stages"], g["fused"]):
            if fused and split == 1:
                continue
            try:
                cfg = ts.TritonSplitKConfig(bm, bn, bk, split, w, st, fused)
            except ValueError:
                continue
            if cfg.supports(problem)[0]:
                out.append(cfg)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["triton_gemm", "triton_splitk"], required=True)
    ap.add_argument("--shape", nargs="+", required=True, help="N,K (bf16, with bias)")
    ap.add_argument("--m", type=int, nargs="+", required=True)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("sweep_configs: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.nn.functional as F

    from hybridgemm.autotune_cache.keys import TableKey
    from hybridgemm.autotune_cache.measure import operands_for
    from hybridgemm.autotune_cache.precompile import precompile
    from hybridgemm.kernels.backends import get_backend
    from hybridgemm.kernels.epilogue import Activation, Epilogue
    from hybridgemm.kernels.problem import Problem
    from hybridgemm.perf.timing import gpu_time_rotating

    be = get_backend(args.backend)
    rows = []
    for shape in args.shape:
        n, k = (int(v) for v in shape.split(","))
        for m in args.m:
            p = Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True), ldx=k,
                        ldw=k, ldo=n)
            cfgs = grid(args.backend, p)
            key = TableKey.from_problem(p).to_string()
            precompile([], [], args.jobs, tasks=[(key, args.backend, c.to_record()) for c in cfgs])
            x, w, b, out, xs, ws = operands_for(p)
            ref = F.linear(x.float(), w.float(), b.float())
            ok = []
            for c in cfgs:
                try:
                    out.fill_(float("nan"))
                    be.run(c, x, w, b, out, Activation.NONE)
                    if ((out.float() - ref).norm() / ref.norm()).item() < 1e-2:
                        ok.append(c)
                except Exception as e:  # report and go on: a sweep explores configs that may not run
                    print(f"  {be.describe(c)}: {type(e).__name__}: {str(e)[:120]}")
            print(f"N={n} K={k} M={m}: {len(ok)} of {len(cfgs)} configs run correctly", flush=True)
            res = []
            for i in range(0, len(ok), 8):
                chunk = ok[i:i + 8]
                fns = [lambda j: F.linear(xs[j], ws[j], b)]
                fns += [lambda j, c=c: be.run(c, xs[j], ws[j], b, out, Activation.NONE) for c in chunk]
                ts = gpu_time_rotating(fns, len(ws), replays=7)
                res += [(t.median_us, ts[0].median_us, c) for c, t in zip(chunk, ts[1:])]
            res.sort(key=lambda r: r[0])
            nbytes, flops = 2 * (n * k + m * k + m * n), 2 * m * n * k
            for us, fl, c in res[:15]:
                print(f"  {us:8.2f} µs ({nbytes / us / 1e3:6.0f} GB/s, {flops / us / 1e6:6.1f} TFLOP/s)  "
                      f"F.linear {fl:8.2f}  speedup {fl / us:.3f}x  {be.describe(c)}")
            rows += [dict(N=n, K=k, M=m, backend=args.backend, median_us=round(us, 3), flinear_us=round(fl, 3),
                          speedup=round(fl / us, 4), config=be.describe(c)) for us, fl, c in res]
    if args.out and rows:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"sweep_{args.backend}.csv")
        with open(path, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
