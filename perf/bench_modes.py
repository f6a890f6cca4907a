"""What batch-invariant mode costs: the same calls in batch_invariant mode, default mode and F.linear.

    python -m hybridgemm.perf.bench_modes --out DIR [--quick] [--m 1 16 ...] [--table PATH]

For llama3-8b q/o, kv, qkv and llama3-70b qkv, o (bf16, with bias) at M = 1, 16, 1024,
4096, 16384: GPU time (CUDA graph, L2-clean-cold, perf/timing.gpu_time, as every bench here)
of ``dispatch.fused_linear`` in each mode and of ``F.linear``, each result first checked
against an fp32 reference, and the batch-invariant rows checked bitwise against an M = 1 call.
Writes ``DIR/modes_<gpu>.csv`` (long form, upserted, perf/csvio.py) and prints, per shape, the
speed of batch_invariant relative to default (``default µs / batch_invariant µs``) and the
worst at M ≥ 1024. ``--quick``: M = 1, 1024, 4096, fewer replays.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm import decide, dispatch
from hybridgemm.autotune_cache.presets import get_preset
from hybridgemm.perf.csvio import environment_columns, write_rows
from hybridgemm.perf.timing import gpu_time

SHAPES = (("llama3-8b", ("q", "kv", "qkv", "o")), ("llama3-70b", ("qkv", "o")))
MS = (1, 16, 1024, 4096, 16384)
QUICK_MS = (1, 1024, 4096)
LARGE_M = 1024
PROVIDERS = ("batch_invariant", "default", "flinear")


def bench_shapes() -> list[tuple[str, int, int]]:
    """(name, N, K) of the benchmarked projections; identical (N, K) pairs merged (8b q and o)."""

    out: dict[tuple[int, int], str] = {}
    for model, names in SHAPES:
        preset = get_preset(model)
        for name in names:
            p = preset.projection(name)
            key = (p.n, p.k)
            out[key] = f"{out[key]}/{name}" if key in out else f"{model}.{name}"
    return [(name, n, k) for (n, k), name in out.items()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.bench_modes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for modes_<gpu>.csv")
    ap.add_argument("--quick", action="store_true", help=f"M = {', '.join(map(str, QUICK_MS))}, fewer replays")
    ap.add_argument("--m", type=int, nargs="+", help=f"row counts (default: {' '.join(map(str, MS))})")
    ap.add_argument("--table", help="tuning table for the default mode (default: the usual lookup)")
    args = ap.parse_args(argv)
    if args.m and min(args.m) < 1:
        ap.error("--m values must be ≥ 1")
    args.ms = tuple(args.m) if args.m else (QUICK_MS if args.quick else MS)
    return args


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200' (the CSV name, as the other benches' files are named)."""
    words = [w for w in name.lower().replace("nvidia", "").split() if w]
    return words[0] if words else "gpu"


def summarize(times: dict[tuple[str, int], dict[str, float]]) -> tuple[list[str], tuple[float, str] | None]:
    """Lines of the per-shape summary, and the worst (speed ratio, 'shape M=m') at M ≥ 1024.

    ``times[(shape, m)][provider]`` = µs. Speed ratio = default µs / batch_invariant µs.
    """
    shapes = list(dict.fromkeys(s for s, _ in times))
    ms = sorted({m for _, m in times})
    lines = [f"{'batch_invariant speed vs default':34s}" + "".join(f"{'M=' + str(m):>9s}" for m in ms)]
    worst = None
    for s in shapes:
        cells = []
        for m in ms:
            t = times.get((s, m), {})
            bi, de = t.get("batch_invariant"), t.get("default")
            if not bi or not de:
                cells.append(f"{'-':>9s}")
                continue
            r = de / bi
            cells.append(f"{r:8.3f}x")
            if m >= LARGE_M and (worst is None or r < worst[0]):
                worst = (r, f"{s} M={m}")
        lines.append(f"{s:34s}" + "".join(cells))
    return lines, worst


def main(argv=None) -> int:
    args = parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_modes: needs a CUDA GPU (none found here); run it on the GPU machine "
              "(scripts/gpu-check.sh)", file=sys.stderr)
        return 2


    if args.table:
        decide.set_table_path(args.table)
    env = environment_columns(" ".join(["python -m hybridgemm.perf.bench_modes", *(argv or sys.argv[1:])]))
    replays = 5 if args.quick else 9
    rows, times = [], {}
    print(f"{'shape':30s}{'M':>7s}{'batch_inv':>11s}{'default':>11s}{'F.linear':>11s}{'bi/def':>8s}  "
          "rows==M1  batch_invariant config")
    for name, n, k in bench_shapes():
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        b = torch.randn(n, device="cuda").bfloat16()
        for m in args.ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = F.linear(x.float(), w.float(), b.float())
            fns = {"batch_invariant": lambda: dispatch.fused_linear(x, w, b),
                   "default": lambda: dispatch.fused_linear(x, w, b),
                   "flinear": lambda: F.linear(x, w, b)}
            mode_of = {"batch_invariant": "batch_invariant", "default": "default", "flinear": "default"}
            errs, status = {}, {}
            for p in PROVIDERS:
                with hybridgemm.mode(mode_of[p]):
                    y = fns[p]()
                errs[p] = ((y.float() - ref).norm() / ref.norm()).item()
                status[p] = "ok" if errs[p] < 2e-2 else "failed"
            with hybridgemm.mode("batch_invariant"):
                y_all = dispatch.fused_linear(x, w, b)
                same_rows = all(torch.equal(dispatch.fused_linear(x[i:i + 1], w, b)[0], y_all[i])
                                for i in sorted({0, m // 2, m - 1}))
                config = hybridgemm.explain((m, k), (n, k), torch.bfloat16).splitlines()[-1].split("[")[-1]
                config = config.split("]")[0]
            # Two rounds in alternating order, the lower median of each (both orders).
            reps = 10 if m <= 1024 else 2
            t = {p: float("inf") for p in PROVIDERS}
            for order in (PROVIDERS, PROVIDERS[::-1]):
                for p in order:
                    if status[p] != "ok":
                        continue
                    with hybridgemm.mode(mode_of[p]):  # the graph captures this mode's kernels
                        t[p] = min(t[p], gpu_time(fns[p], reps=reps, replays=replays).median_us)
            times[(name, m)] = {p: v for p, v in t.items() if math.isfinite(v)}
            both = math.isfinite(t["default"] + t["batch_invariant"])
            ratio = t["default"] / t["batch_invariant"] if both else math.nan
            print(f"{name:30s}{m:7d}{t['batch_invariant']:11.2f}{t['default']:11.2f}{t['flinear']:11.2f}"
                  f"{ratio:8.3f}  {'yes' if same_rows else 'NO':8s}  {config}", flush=True)
            flops = 2 * m * n * k
            base = dict(env, shape=name, N=n, K=k, M=m, dtype="bfloat16", epilogue="bias", method="gpu")
            for p in PROVIDERS:
                us = t[p]
                row = dict(base, provider=p, status=status[p], rel_err=f"{errs[p]:.2e}", err_bound="2e-2")
                if math.isfinite(us):
                    row.update(median_us=round(us, 3), speedup_vs_flinear=round(t["flinear"] / us, 4),
                               tflops=round(flops / us / 1e6, 2))
                if p == "batch_invariant":
                    row.update(config=config, speed_vs_default=round(ratio, 4),
                               rows_bitwise_vs_m1="yes" if same_rows else "no")
                rows.append(row)
    lines, worst = summarize(times)
    print()
    print("\n".join(lines))
    if worst is not None:
        print(f"worst at M >= {LARGE_M}: {worst[0]:.3f}x of default speed ({worst[1]})")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"modes_{gpu_slug(torch.cuda.get_device_name())}.csv")
    write_rows(path, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
