"""Sweep a grid of Triton configs for one shape beside F.linear (GPU machine): what the
candidate lists might be missing.

    python -m hybridgemm.perf.sweep_configs --backend triton_gemm   --shape 1024,4096 --m 1024
    python -m hybridgemm.perf.sweep_configs --backend triton_splitk --shape 3584,3584 4608,3584 --m 1 8
    python -m hybridgemm.perf.sweep_configs --backend triton_splitk --weights fp8 --granularity channel \
        --shape 6144,4096 4096,4096 28672,4096 4096,14336 --m 1 8

Kernels are compiled first on worker processes (autotune_cache/precompile.py), then timed
with the tuner's method (autotune_cache/measure.gpu_time_rotating: cold operands by rotation,
graphs replayed in interleaved rounds), in chunks of 8 beside F.linear. Every config is
checked against an fp32 reference before it is timed. With ``--weights fp8`` (split-K only)
the weight is e4m3 (``--granularity``), x tiles start at 1 row (M's power of two), the
reference is the fp32 product with the dequantized weight, and the baseline is what the FP8
fallback runs (dequantize, then F.linear); GB/s then count the e4m3 bytes. Prints the 15
fastest per (shape, M) with GB/s and TFLOP/s and writes DIR/sweep_<backend>.csv when --out is given.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache.keys import TableKey
from hybridgemm.autotune_cache.measure import dense_weight, gpu_time_rotating, operands_for, run_config
from hybridgemm.autotune_cache.precompile import precompile
from hybridgemm.kernels import triton_gemm as tg
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.backends import get_backend
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.fp8 import FORMAT_OF, GRANULARITIES
from hybridgemm.kernels.problem import Problem
from hybridgemm.perf.csvio import write_csv

BACKENDS = ("triton_gemm", "triton_splitk")
TILE_GRID = dict(tile=[(64, 128, 64), (64, 128, 128), (128, 64, 64), (128, 64, 128), (128, 128, 64), (64, 256, 64),
                       (128, 256, 64)],
                 stages=[3, 4, 5], warps=[4, 8], persistent=[False, True], split=[1, 2, 3, 4])
SPLITK_GRID = dict(block_n=[32, 64, 128], block_k=[128, 256, 512], split=[1, 2, 4, 7, 8, 14, 16],
                   warps=[4, 8], stages=[3, 4], fused=[False, True])
FP8_SPLITK_GRID = dict(SPLITK_GRID, block_n=[16, 32, 64, 128], block_k=[128, 256, 512], warps=[1, 2, 4, 8])
CHUNK = 8  # configs timed together beside F.linear
SHOWN = 15  # fastest configs printed per (shape, M)


def problem(m: int, n: int, k: int, weight_format: str = "") -> Problem:
    """The swept problem: bf16 with a bias, dense and aligned (W e4m3 with a ``weight_format``)."""
    return Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True), ldx=k, ldw=k,
                   ldo=n, weight_format=weight_format)


def grid(backend: str, p: Problem) -> list:
    """Every config of the backend's grid that ``supports`` the problem (on a Hopper GPU)."""
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
            if cfg.supports(p)[0]:
                out.append(cfg)
    else:
        g = FP8_SPLITK_GRID if p.weight_format else SPLITK_GRID
        pow2 = 1 << max(0, p.m - 1).bit_length()
        bm = min(64, max(1 if p.weight_format else 16, pow2))
        for bn, bk, split, w, st, fused in itertools.product(g["block_n"], g["block_k"], g["split"], g["warps"],
                                                             g["stages"], g["fused"]):
            if fused and split == 1:
                continue
            try:
                cfg = ts.TritonSplitKConfig(bm, bn, bk, split, w, st, fused)
            except ValueError:
                continue
            if cfg.supports(p)[0]:
                out.append(cfg)
    return out


def _shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,K (two positive ints), got {text!r}") from None
    if n < 1 or k < 1:
        raise argparse.ArgumentTypeError(f"expected N,K (two positive ints), got {text!r}")
    return n, k


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.sweep_configs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=BACKENDS, required=True)
    ap.add_argument("--shape", type=_shape, nargs="+", required=True, help="N,K (bf16, with bias)")
    ap.add_argument("--m", type=int, nargs="+", required=True)
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: an e4m3 weight (split-K only; see the module docstring)")
    ap.add_argument("--granularity", choices=GRANULARITIES, default="channel", help="FP8 scales (default channel)")
    ap.add_argument("--jobs", type=int, default=8, help="compile workers (default 8)")
    ap.add_argument("--out", help="folder for sweep_<backend>.csv")
    args = ap.parse_args(argv)
    if min(args.m) < 1:
        ap.error(f"--m values must be positive, got {args.m}")
    if args.weights == "fp8" and args.backend != "triton_splitk":
        ap.error("--weights fp8 sweeps the split-K kernel only (--backend triton_splitk)")
    args.weight_format = FORMAT_OF[args.granularity] if args.weights == "fp8" else ""
    return args


def correct_configs(be, cfgs: list, p: Problem, x, w, b, out) -> list:
    """The configs whose result is within 1e-2 (relative Frobenius) of an fp32 reference (of the
    dequantized weight for an FP8 one); the others are reported and dropped."""
    ref = F.linear(x.float(), dense_weight(w, torch.float32), b.float())
    ok = []
    for c in cfgs:
        try:
            out.fill_(float("nan"))
            run_config(be, c, p, x, w, b, out)
            if ((out.float() - ref).norm() / ref.norm()).item() < 1e-2:
                ok.append(c)
        except Exception as e:  # report and go on: a sweep explores configs that may not run
            print(f"  {be.describe(c)}: {type(e).__name__}: {str(e)[:120]}")
    return ok


def sweep_point(be, backend: str, m: int, n: int, k: int, jobs: int, weight_format: str = "") -> list[dict]:
    """Every grid config that runs correctly at (M, N, K), timed beside F.linear (the FP8
    fallback for an FP8 weight): one row each."""
    p = problem(m, n, k, weight_format)
    cfgs = grid(backend, p)
    key = TableKey.from_problem(p).to_string()
    precompile([], [], jobs, tasks=[(key, backend, c.to_record(), m) for c in cfgs])
    x, w, b, out, xs, ws = operands_for(p)
    ok = correct_configs(be, cfgs, p, x, w, b, out)
    print(f"N={n} K={k} M={m}: {len(ok)} of {len(cfgs)} configs run correctly", flush=True)
    res = []
    for i in range(0, len(ok), CHUNK):
        chunk = ok[i:i + CHUNK]
        fns = [lambda j: F.linear(xs[j], dense_weight(ws[j], p.dtype), b)]
        fns += [lambda j, c=c: run_config(be, c, p, xs[j], ws[j], b, out) for c in chunk]
        times = gpu_time_rotating(fns, len(ws), replays=7)
        res += [(t.median_us, times[0].median_us, c) for c, t in zip(chunk, times[1:])]
    res.sort(key=lambda r: r[0])
    nbytes, flops = 2 * (m * k + m * n) + p.w_itemsize * n * k, 2 * m * n * k
    for us, fl, c in res[:SHOWN]:
        print(f"  {us:8.2f} µs ({nbytes / us / 1e3:6.0f} GB/s, {flops / us / 1e6:6.1f} TFLOP/s)  "
              f"F.linear {fl:8.2f}  speedup {fl / us:.3f}x  {be.describe(c)}")
    return [dict(N=n, K=k, M=m, backend=backend, weights=weight_format or "bf16", median_us=round(us, 3),
                 flinear_us=round(fl, 3),
                 speedup=round(fl / us, 4), config=be.describe(c)) for us, fl, c in res]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_configs: needs a CUDA GPU", file=sys.stderr)
        return 2
    be = get_backend(args.backend)
    rows = []
    for n, k in args.shape:
        for m in args.m:
            rows += sweep_point(be, args.backend, m, n, k, args.jobs, args.weight_format)
    if args.out and rows:
        suffix = f"_{args.weight_format}" if args.weight_format else ""
        path = os.path.join(args.out, f"sweep_{args.backend}{suffix}.csv")
        write_csv(path, list(rows[0]), rows)
        print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
