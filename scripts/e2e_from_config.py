"""perf/bench_e2e.py's run (stock beside ``patch(model)`` in one process, random weights) for a
model described by a transformers ``config.json`` rather than a preset:

    python3 scripts/e2e_from_config.py perf/configs/glm4.5-air.json --layers 6 --batch 1 8 \\
        --modes compiled_static eager_static [--tokens 32] [--rounds 2] [--out e2e_glm4.5-air.csv]

The config's ``model_type`` picks transformers' config class; ``--layers`` replaces its layer
count (a model too large for one GPU twice over runs with fewer; the CSV's ``layers`` column
says how many). Rows as bench_e2e writes them, ``model`` the file's stem. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from hybridgemm.perf import bench_e2e as be
from hybridgemm.perf import csvio
from hybridgemm.perf.bench_msweep import git_commit


def load_config(path: str, layers: int | None):
    import transformers

    with open(path) as f:
        fields = json.load(f)
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ValueError(f"{path}: not a transformers config.json (no model_type)")
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if layers is not None:
        config.num_hidden_layers = layers
    return config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a transformers config.json")
    be.add_e2e_options(ap)
    ap.add_argument("--out", help="CSV to upsert rows into (default e2e_<config stem>.csv)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("e2e_from_config: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, args.layers)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"e2e_from_config: {exc}", file=sys.stderr)
        return 2
    import transformers

    name = os.path.splitext(os.path.basename(args.config))[0]
    modes = tuple(dict.fromkeys(args.modes or ("compiled_static",)))
    command = " ".join(["python3 scripts/e2e_from_config.py", *(argv or sys.argv[1:])])
    extra = {**csvio.environment_columns(command), "transformers": transformers.__version__,
             "date": datetime.date.today().isoformat(), "commit": git_commit()}
    start = time.perf_counter()
    run = be.Run(name, config, torch.device("cuda"), tuple(args.batch or (1,)), args.tokens or be.TOKENS,
                 args.prefill or be.PREFILL, args.rounds or be.ROUNDS, modes, extra=extra,
                 log=lambda line: print(f"[{time.perf_counter() - start:7.1f}s] {line}", file=sys.stderr, flush=True))
    out = args.out or f"e2e_{name}.csv"
    res = be.run_e2e(run, on_rows=lambda rows: be.upsert(out, rows))
    be.print_summary(res)
    print(f"wrote {len(res.rows)} rows to {out}")
    return 1 if res.errors or res.unpatch_exact is False else 0


if __name__ == "__main__":
    sys.exit(main())
