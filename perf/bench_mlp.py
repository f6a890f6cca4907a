"""The MLP's GEMMs and the LM head of a preset model, hybridgemm beside stock PyTorch, GPU time.

    python -m hybridgemm.perf.bench_mlp [--models llama3-8b qwen2.5-7b] [--m 1 8 64 ...] --out CSV

Per model (bf16, its hidden size H, MLP width I, vocabulary V) and per M:

- ``gate_up``: ``silu(x Wg^T) * (x Wu^T)``. ``stock`` is what the stock module runs (two
  F.linear, F.silu, a multiply); ``gemm_act`` one GEMM over the stacked (2I, H) weight through
  the dispatcher, then F.silu and the multiply (``gated_linear(kernel="gemm")``); ``triton_glu``
  the Triton kernel with the product in its epilogue (kernels/triton_glu.py, its default config;
  ``kernel="triton"``); ``halves`` the stock module's two GEMMs through the dispatcher
  (``kernel="halves"``);
  ``hybridgemm`` what ``gated_linear``'s "auto" picks.
- ``down`` (H, I) and ``lm_head`` (V, H): ``stock`` F.linear, ``hybridgemm`` the dispatcher.

Each call is timed as the tuner times (autotune_cache/measure.py): CUDA graphs over rotating
copies of the weights (every call reads them cold from HBM), replayed in interleaved rounds,
median. Columns: ``us``, ``weight_gbps`` (weight bytes / time: what a decode GEMV can at most
stream), ``fraction_of_hbm`` (of the GPU's read rate ``read_tbps``, perf/read_ceiling.device_read_tbps),
``speedup`` (stock / variant).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F

from hybridgemm import dispatch
from hybridgemm.autotune_cache.measure import gpu_time_rotating, rotation_copies
from hybridgemm.autotune_cache.presets import get_preset
from hybridgemm.mlp import gated_linear

from . import read_ceiling
from .bench_msweep import git_commit
from .csvio import environment_columns, write_csv

DEFAULT_M = (1, 2, 4, 8, 16, 33, 64, 128, 333, 1024, 2048)
COLUMNS = ("gpu", "model", "op", "m", "n", "k", "variant", "us", "spread_us", "weight_gbps", "fraction_of_hbm",
           "read_tbps", "speedup", "date", "commit", "torch", "triton", "cublaslt", "hybridgemm", "command")


def _variants(op: str, inter: int):
    """name -> call(x, w) for ``op``; ``w`` is the stacked (2I, H) weight for gate_up."""
    if op != "gate_up":
        return {"stock": lambda x, w: F.linear(x, w), "hybridgemm": lambda x, w: dispatch.fused_linear(x, w)}
    return {
        "stock": lambda x, w: F.silu(F.linear(x, w[:inter])) * F.linear(x, w[inter:]),
        "gemm_act": lambda x, w: gated_linear(x, w, None, "silu", kernel="gemm"),
        "halves": lambda x, w: gated_linear(x, w, None, "silu", kernel="halves"),
        "triton_glu": lambda x, w: gated_linear(x, w, None, "silu", kernel="triton"),
        "hybridgemm": lambda x, w: gated_linear(x, w, None, "silu"),
    }


def measure(model: str, ms, replays: int = 7) -> list[dict]:
    p = get_preset(model)
    ops = {"gate_up": (2 * p.intermediate, p.hidden), "down": (p.hidden, p.intermediate),
           "lm_head": (p.vocab, p.hidden)}
    rows = []
    tbps = read_ceiling.device_read_tbps()[0]
    for op, (n, k) in ops.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        copies = rotation_copies(w.numel() * w.element_size())
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        variants = _variants(op, p.intermediate)
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            names = list(variants)
            calls = [lambda i, fn=variants[v], xs=xs, ws=ws: fn(xs[i], ws[i]) for v in names]
            times = gpu_time_rotating(calls, copies, replays=replays)
            stock_us = times[names.index("stock")].median_us
            for v, t in zip(names, times):
                gbps = w.numel() * w.element_size() / (t.median_us * 1e3)
                rows.append(dict(model=model, op=op, m=m, n=n, k=k, variant=v, us=t.median_us, spread_us=t.spread_us,
                                 weight_gbps=gbps, fraction_of_hbm=gbps / (tbps * 1e3), read_tbps=tbps,
                                 speedup=stock_us / t.median_us))
            del xs
        del ws, w
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.bench_mlp", description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama3-8b", "qwen2.5-7b"])
    ap.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_M))
    ap.add_argument("--out", required=True, help="CSV to write")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mlp: needs a CUDA GPU", file=sys.stderr)
        return 2
    if any(m < 1 for m in args.m):
        ap.error("--m values must be at least 1")
    moe = [m for m in args.models if get_preset(m).moe]
    if moe:
        ap.error(f"{', '.join(moe)}: a mixture of experts has no dense MLP shapes to time")
    env = environment_columns("python -m hybridgemm.perf.bench_mlp " + " ".join(argv or sys.argv[1:]))
    env["date"] = datetime.date.today().isoformat()
    env["commit"] = git_commit()
    rows = [{**env, **r} for model in args.models for r in measure(model, args.m)]
    write_csv(args.out, list(COLUMNS), rows)
    for r in rows:
        print(f"{r['model']:>11} {r['op']:>8} M={r['m']:>5} {r['variant']:>11} {r['us']:9.1f} us "
              f"{r['fraction_of_hbm']:6.1%} of HBM  {r['speedup']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
