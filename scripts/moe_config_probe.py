"""Times the MoE kernels' launches one by one, per config, cold (L2 flushed, CUDA-graph replay,
perf/timing.gpu_time), for the shapes of perf/bench_moe.py: the pair-major gate/up and down
(kernels/triton_moe_pairs.py ``pairs_gate_up``/``pairs_down``, on the CUDA cores and on the tensor
cores: configs with ``mma``), the layout (``align``) and the grouped
gate/up and down, each against the read floor of the expert weights it streams.

    python3 scripts/moe_config_probe.py [--shapes ...] [--tokens 1 8 64 2048]
        [--weights bf16 | fp8_channel | fp8_block128] [--grouped-only] --out DIR

Writes DIR/moe_config_probe.csv (one row per launch and config) and prints the fastest config of
each launch per shape and token count. FP8 weights: the experts quantized per expert
(kernels/fp8.py), their e4m3 bytes and scales counted in the floor; configs that cannot read
block scales (``fp8_fits``) are left out.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys

import torch

from hybridgemm import experts
from hybridgemm.kernels import fp8
from hybridgemm.kernels import triton_moe as tm
from hybridgemm.kernels import triton_moe_pairs as moe_pairs
from hybridgemm.perf.bench_moe import SHAPES, floor_us
from hybridgemm.perf.timing import gpu_time

PAIR_UP_GRID = [tm.TritonMoeConfig(1, bn, bk, w, s) for bn, bk, w, s in [
    (8, 128, 8, 2), (8, 128, 8, 4), (16, 128, 8, 4), (32, 128, 8, 4), (32, 128, 8, 2), (16, 256, 8, 4),
    (64, 128, 8, 4), (8, 256, 4, 4)]]
PAIR_DOWN_GRID = [tm.TritonMoeConfig(1, bn, bk, w, s) for bn, bk, w, s in
                  itertools.product((4, 8, 16, 32), (64, 128, 256), (4, 8), (2, 4))]
# tiles as deep as a small K (Qwen3-30B-A3B's 768): a token's slots in two K steps, or one
PAIR_DOWN_GRID += [tm.TritonMoeConfig(1, bn, bk, w, 1) for bn, bk, w in [(4, 512, 8), (2, 1024, 8), (4, 1024, 16)]]
# the tensor-core forms (mma): W tiles of 16-64 rows, a warp per 16 rows or fewer warps
PAIR_UP_GRID += [tm.TritonMoeConfig(1, bn, bk, w, s, mma=True) for bn, bk, w, s in [
    (16, 128, 1, 4), (16, 256, 1, 4), (16, 512, 1, 3), (32, 128, 2, 4), (32, 256, 2, 4), (32, 256, 4, 4),
    (32, 512, 2, 3), (64, 128, 4, 4), (64, 256, 4, 4)]]
PAIR_DOWN_GRID += [tm.TritonMoeConfig(1, bn, bk, w, s, mma=True) for bn, bk, w, s in [
    (16, 128, 1, 4), (16, 256, 1, 4), (16, 512, 1, 3), (32, 128, 2, 4), (32, 256, 2, 4), (32, 256, 4, 3),
    (64, 256, 4, 4)]]
# (block_m, block_n, block_k, warps, stages); the large tiles for prefill only
SMALL_GROUPED = [(16, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (32, 64, 128, 4, 3),
                 (64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3)]
LARGE_GROUPED = [(64, 128, 64, 8, 3), (64, 256, 64, 8, 3), (64, 128, 128, 8, 3), (64, 128, 64, 4, 4),
                 (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2),
                 (128, 64, 64, 4, 4), (128, 64, 128, 8, 3), (256, 128, 64, 8, 3), (128, 256, 32, 8, 4),
                 (64, 256, 32, 8, 4)]


def _time(fn, *args) -> float:
    try:
        return gpu_time(lambda: fn(*args), reps=5, replays=5, warmup=2).median_us
    except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit: recorded, the probe goes on)
        print(f"    {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return float("nan")


def probe(name: str, tokens: int, writer, weights_form: str = "bf16", pairs: bool = True) -> None:
    h, e, i, k = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w_gu = (torch.randn(e, 2 * i, h, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    w_d = (torch.randn(e, h, i, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    fmt = ""
    if weights_form != "bf16":
        granularity = weights_form.removeprefix("fp8_")
        w_gu, w_d = fp8.quantize_fp8(w_gu, granularity), fp8.quantize_fp8(w_d, granularity)
        fmt = fp8.FORMAT_OF[granularity]
    x = torch.randn(tokens, h, device=dev, generator=g).to(torch.bfloat16)
    ids, weights = experts.route(torch.randn(tokens, e, device=dev, generator=g), k)
    hit = int(torch.unique(ids).numel())
    floor_up, floor_down = floor_us(hit, e, [w_gu]), floor_us(hit, e, [w_d])
    best = {}

    def row(launch, cfg, us, floor):
        writer.writerow([name, tokens, hit, launch, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps,
                         cfg.num_stages, int(cfg.mma), f"{us:.2f}", f"{floor:.2f}",
                         f"{floor / us:.3f}" if us == us else ""])
        if us == us and (launch not in best or us < best[launch][1]):
            best[launch] = (cfg, us, floor)

    def fits(grid):
        return [c for c in grid if tm.fp8_fits(c, fmt) is None]

    if pairs and tokens * k <= 128:
        for cfg in fits(PAIR_UP_GRID):
            row("pairs_gate_up" + "_mma" * cfg.mma, cfg, _time(moe_pairs.pairs_gate_up, cfg, x, w_gu, ids), floor_up)
        inter = moe_pairs.pairs_gate_up(fits(PAIR_UP_GRID)[0], x, w_gu, ids)
        for cfg in fits(PAIR_DOWN_GRID):
            us = _time(moe_pairs.pairs_down, cfg, inter, w_d, ids, weights)
            row("pairs_down" + "_mma" * cfg.mma, cfg, us, floor_down)
    grid = fits([tm.TritonMoeConfig(*c) for c in (SMALL_GROUPED if tokens <= 64 else LARGE_GROUPED)])
    for bm in sorted({c.block_m for c in grid}):
        lay = tm.align(ids, e, bm)
        row("align", tm.TritonMoeConfig(bm, 0, 0), _time(tm.align, ids, e, bm), 0.0)
        row("align_torch", tm.TritonMoeConfig(bm, 0, 0), _time(tm.align_torch, ids, e, bm), 0.0)
        inter = tm.run_gate_up(tm.TritonMoeConfig(bm, 64, 64), x, w_gu, lay, k)
        for cfg in (c for c in grid if c.block_m == bm):
            row("grouped_gate_up", cfg, _time(tm.run_gate_up, cfg, x, w_gu, lay, k), floor_up)
            row("grouped_down", cfg, _time(tm.run_down, cfg, inter, w_d, lay, weights), floor_down)
    row("moe_default", tm.TritonMoeConfig(0, 0, 0), _time(experts.moe, x, (ids, weights), w_gu, w_d),
        floor_up + floor_down)
    for launch, (cfg, us, floor) in sorted(best.items()):
        print(f"{name:>14} T={tokens:>5} hit={hit:>3} {launch:>16} {us:9.2f} us  floor {floor:8.2f}  "
              f"({floor / us if floor else 0:.2f})  {cfg}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 2048])
    ap.add_argument("--weights", choices=["bf16", *(f"fp8_{g}" for g in fp8.GRANULARITIES)], default="bf16")
    ap.add_argument("--grouped-only", action="store_true", help="time the grouped launches only, not the pair-major")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    name = "moe_config_probe.csv" if args.weights == "bf16" else f"moe_config_probe_{args.weights}.csv"
    with open(os.path.join(args.out, name), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "tokens", "experts_hit", "launch", "block_m", "block_n", "block_k", "num_warps",
                    "num_stages", "mma", "median_us", "floor_us", "fraction_of_floor"])
        for shape in args.shapes:
            for tokens in args.tokens:
                probe(shape, tokens, w, args.weights, pairs=not args.grouped_only)
                f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
