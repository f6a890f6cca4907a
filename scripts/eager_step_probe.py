"""Where the host time of an eager static-cache decode step goes, stock against patched:
``python3 scripts/eager_step_probe.py MODEL [LAYERS [SORT]]`` (a GPU; SORT: a pstats key). Prints ms per step of each
(wall, 20 steps after 5 warm-up), how many layer calls took the fused step, and the patched
model's top functions by cumulative host time (cProfile)."""

from __future__ import annotations

import copy
import cProfile
import pstats
import sys
import time

import torch

import hybridgemm
from hybridgemm.models import decode_step, layernorm_layers
from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import e2e_models as hf


def main() -> None:
    name, layers = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    config = hf.hf_config(name, layers)
    torch.manual_seed(0)
    stock = hf.build_model(config, torch.bfloat16, "cuda")
    patched = copy.deepcopy(stock)
    print(hybridgemm.patch(patched).summary())
    run = E.Run(name, config, torch.device("cuda"), batches=(1,), tokens=20, prefill=8, rounds=1,
                extra={"gpu": "h200", "command": "probe"})
    calls = {"step": 0}

    def counting(real):
        def counted(*a, **kw):
            calls["step"] += 1
            return real(*a, **kw)
        return counted

    # (the decoder layers call the steps through these modules' attributes)
    decode_step.layer_step = counting(decode_step.layer_step)
    layernorm_layers.layer_step = counting(layernorm_layers.layer_step)
    with torch.no_grad():
        for label, model in (("stock", stock), ("patched", patched)):
            steps = E.decoder(run, model, 1, False)
            steps(5)
            torch.cuda.synchronize()
            calls["step"] = 0
            t = time.perf_counter()
            steps(20)
            torch.cuda.synchronize()
            print(f"{label}: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms per step, fused layer steps {calls['step']}")
        prof = cProfile.Profile()
        prof.enable()
        steps(20)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats(sys.argv[3] if len(sys.argv) > 3 else "cumulative").print_stats(30)


if __name__ == "__main__":
    main()
