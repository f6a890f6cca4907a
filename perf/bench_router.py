"""DeepSeek-V3-form routers (sigmoid scores, selection bias, group-limited top-k), transformers'
router beside the patched one (:class:`hybridgemm.router.HybridSigmoidRouter`) in one process
on one CUDA GPU, at the router shapes of two released models:

* ``glm4.5-air``: hidden 4096, 128 experts, 8 a token, one group (GLM-4.5-Air's config);
* ``deepseek-v3``: hidden 7168, 256 experts, 8 a token, 8 groups of which 4 are kept, the
  weights scaled by 2.5 (DeepSeek-V3's config).

    python3 -m hybridgemm.perf.bench_router [--shapes glm4.5-air deepseek-v3] [--tokens 1 8 2048]
        [--out perf/results/h200/router_h200.csv]

The router's weight in bf16, its selection bias in fp32 (N(0, 0.3)), bf16 tokens. Modes:
``gpu`` (CUDA-graph replay, L2 flushed before each call: kernel time), ``compiled`` (the same
over ``torch.compile(fullgraph=True)`` of each router: Inductor fuses stock's element-wise
routing) and ``eager`` (wall clock per call, a host sync per round of 200 calls: the launches'
host cost too). ``same_experts`` is the share of tokens whose experts (as a set) the patched
router chooses as stock's does. Rows (CSV, upserted on gpu, shape, tokens, mode): ``stock_us``,
``hybridgemm_us``, ``speedup``, ``same_experts``, environment columns; a plot of the speedups
beside the CSV (``router.png``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch

import hybridgemm
from hybridgemm.perf import csvio
from hybridgemm.perf.bench_msweep import git_commit
from hybridgemm.perf.timing import eager_time_interleaved, gpu_time_many

# hidden, experts, top-k, groups, groups kept, scale
SHAPES = {"glm4.5-air": (4096, 128, 8, 1, 1, 1.0), "deepseek-v3": (7168, 256, 8, 8, 4, 2.5)}
MODES = ("gpu", "compiled", "eager")
COLUMNS = ("gpu", "shape", "tokens", "mode", "stock_us", "hybridgemm_us", "speedup", "same_experts", "torch",
           "triton", "transformers", "hybridgemm", "host", "date", "commit", "command")


def stock_router(shape: str, device) -> torch.nn.Module:
    """transformers' DeepSeek-V3 router of ``shape``'s sizes, random weight and bias."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hidden, experts, top_k, groups, kept, scale = SHAPES[shape]
    cfg = transformers.DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k,
                                        n_group=groups, topk_group=kept, routed_scaling_factor=scale,
                                        norm_topk_prob=True)
    g = torch.Generator().manual_seed(experts)
    router = DeepseekV3TopkRouter(cfg).eval()
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) / hidden ** 0.5)
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
    router = router.to(device, torch.bfloat16)
    router.e_score_correction_bias.data = router.e_score_correction_bias.data.float()  # (fp32 in checkpoints)
    return router


def same_experts(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.sort(-1).values == b.sort(-1).values).all(-1).float().mean())


def measure(shape: str, tokens: int, modes, device) -> list[dict]:
    stock = stock_router(shape, device)
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    if type(patched).__name__ != "HybridSigmoidRouter":
        raise RuntimeError(f"{shape}: patch left the router as {type(patched).__name__} (this transformers' router "
                           "returns its logits only?)")
    x = torch.randn(tokens, SHAPES[shape][0], device=device, dtype=torch.bfloat16)
    rows = []
    with torch.no_grad():
        same = same_experts(patched(x)[2], stock(x)[2])
        for mode in modes:
            fns = {"stock": lambda: stock(x), "hybridgemm": lambda: patched(x)}
            if mode == "compiled":
                compiled = {n: torch.compile(r, fullgraph=True) for n, r in (("stock", stock), ("hybridgemm", patched))}
                fns = {n: (lambda c=c: c(x)) for n, c in compiled.items()}
            if mode == "eager":
                t = eager_time_interleaved(fns)
                us = {n: t[n].median_us for n in fns}
            else:
                t = gpu_time_many(list(fns.values()), device)
                us = dict(zip(fns, (v.median_us for v in t)))
            rows.append({"shape": shape, "tokens": tokens, "mode": mode, "stock_us": round(us["stock"], 2),
                         "hybridgemm_us": round(us["hybridgemm"], 2),
                         "speedup": round(us["stock"] / us["hybridgemm"], 3), "same_experts": round(same, 5)})
            print(f"{shape} T={tokens} {mode}: stock {us['stock']:.2f} us, hybridgemm {us['hybridgemm']:.2f} us "
                  f"({us['stock'] / us['hybridgemm']:.2f}x); same experts {same:.4f}", flush=True)
        torch._dynamo.reset()
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODES), figsize=(4 * len(MODES), 3.2), sharey=True)
    for ax, mode in zip(axes, MODES):
        for shape in SHAPES:
            pts = sorted((int(r["tokens"]), float(r["speedup"])) for r in rows if r["mode"] == mode
                         and r["shape"] == shape)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=shape)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(mode)
        ax.set_xlabel("tokens")
    axes[0].set_ylabel("speedup over transformers' router")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hybridgemm.perf.bench_router", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 2048])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--out", default="router.csv")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error("--tokens: give positive token counts")
    if not torch.cuda.is_available():
        print("bench_router: needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers

    device = torch.device("cuda")
    env = {**csvio.environment_columns(" ".join(["python3 -m hybridgemm.perf.bench_router", *(argv or sys.argv[1:])])),
           "transformers": transformers.__version__, "date": datetime.date.today().isoformat(),
           "commit": git_commit()}
    rows = [{**env, **r} for shape in args.shapes for t in args.tokens for r in measure(shape, t, args.modes, device)]
    csvio.write_csv(args.out, COLUMNS, rows)
    plot(rows, os.path.join(os.path.dirname(os.path.abspath(args.out)), "router.png"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
