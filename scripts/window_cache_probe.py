"""Where a sliding-window model's compiled decode speed comes from: the stock model over
transformers' own StaticCache layers, the stock model over a cache whose sliding layers count
on the device (``hybridgemm.models.window_cache.adopt``, what a patched model's first call
does), and the patched model; one process, random weights, greedy decode of B = 1 under
``torch.compile(mode="reduce-overhead", fullgraph=True)``, CUDA events over 32 steps.

    python3 scripts/window_cache_probe.py [MODEL] [LAYERS] [ROUNDS]
    e.g. python3 scripts/window_cache_probe.py gemma2-9b 42 2

Prints ms per token of each, the median of the rounds. ``hybridgemm bench --e2e`` times
stock and patched alone.
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

import hybridgemm
from hybridgemm.models import window_cache
from hybridgemm.perf import bench_e2e as be
from hybridgemm.perf import e2e_models as hf


def ms_per_token(run: be.Run, model, adopt: bool) -> float:
    real = hf.static_cache

    def cache(*args):
        made = real(*args)
        if adopt:
            window_cache.adopt(made)
        return made

    hf.static_cache = cache
    try:
        steps = be.decoder(run, model, 1, compiled=True)
    finally:
        hf.static_cache = real
    steps(be.WARMUP)
    clock = be.Clock("cuda")
    times = [clock.event_ms(lambda: steps(run.tokens)) / run.tokens for _ in range(run.rounds)]
    torch._dynamo.reset()
    return statistics.median(times)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma2-9b"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else None
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    config = hf.hf_config(name, layers)
    run = be.Run(name, config, torch.device("cuda"), rounds=rounds)
    stock = hf.build_model(config, torch.bfloat16, "cuda")
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=256):
        rows = [("stock, transformers' cache layers", ms_per_token(run, stock, adopt=False)),
                ("stock, sliding layers counting on the device", ms_per_token(run, stock, adopt=True))]
        patched = copy.deepcopy(stock)
        del stock
        hybridgemm.patch(patched)
        rows.append(("hybridgemm.patch", ms_per_token(run, patched, adopt=False)))
    print(f"{name}, {config.num_hidden_layers} layers, B = 1, compiled (reduce-overhead), ms per token:")
    for label, ms in rows:
        print(f"  {label:48s} {ms:8.3f}  ({rows[0][1] / ms:.2f}x)")


if __name__ == "__main__":
    main()
