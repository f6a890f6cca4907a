"""Decode with a PEFT LoRA adapter: stock PEFT beside ``patch(model)`` then the same adapter, in
one process, on one CUDA GPU; a preset's model (perf/e2e_models.py) with random weights.

    python3 -m hybridgemm.perf.bench_lora [--model llama3-8b] [--layers N] [--batch 1 8]
        [--rank 16] [--modes compiled_static eager_static] [--tokens 32] [--rounds 3]
        [--out perf/results/h200/lora_h200.csv]

Both models get one adapter of rank ``--rank`` on all seven projections (q, k, v, o, gate,
up, down), the same random values in both (B random too, scaled so the adapter moves the
logits without swamping them). Decode is the harness's (perf/bench_e2e.py ``time_mode``, under ``torch.no_grad()``):
greedy over a static cache, ``compiled_static`` (``torch.compile`` reduce-overhead, CUDA
events over ``--tokens`` steps, pipelined) and ``eager_static`` (wall clock, a host sync at
the end of each round). Error: the logits of a 64-token prefill and of 8 eager static-cache
decode steps against the same model and adapter in fp32, for both variants
(``error_ratio`` = the patched model's error / stock PEFT's).

Rows (CSV, upserted on gpu, model, layers, rank, mode, batch, variant): ``ms_per_token``
(best round), ``speedup`` (stock_peft's ms / this row's), ``prefill_err``/``decode_err``
and ``error_ratio`` on the patched rows, environment columns.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

import hybridgemm
from hybridgemm.perf import bench_e2e as be
from hybridgemm.perf import csvio
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf.bench_msweep import git_commit, gpu_label

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEY = ("gpu", "model", "layers", "rank", "mode", "batch", "variant")
COLUMNS = (*KEY, "status", "ms_per_token", "speedup", "prefill_err", "decode_err", "error_ratio", "note", "peft",
           "torch", "triton", "cublaslt", "nvmath", "hybridgemm", "host", "date", "commit", "command")
B_SCALE = 0.02  # LoRA B's random values times this: the adapter's term a few percent of the output


def with_adapter(model, rank: int, seed: int = 1):
    """``model`` with one LoRA adapter (PEFT) on all seven projections, random A and B."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.mul_(B_SCALE)
    return wrapped.get_base_model().eval()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


def errors(models: dict, ref, vocab: int, device) -> dict:
    """``{variant: (prefill error, decode error)}`` against the fp32 model ``ref``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 64), generator=g).to(device)
    steps = [torch.randint(0, vocab, (1, 1), generator=g).to(device) for _ in range(8)]

    def decode(model):
        api, cache = hf.forward_api(model), hf.static_cache(model, 1, 96)
        hf.cached_forward(model, api, ids, cache, torch.arange(64, device=device))
        out, pos = [], torch.tensor([64], device=device)
        for tok in steps:
            out.append(hf.cached_forward(model, api, tok, cache, pos)[:, -1].float())
            pos.add_(1)
        return torch.stack(out)

    with torch.no_grad():
        want = (hf.full_logits(ref, ids).float(), decode(ref))
        return {v: (_rel(hf.full_logits(m, ids), want[0]), _rel(decode(m), want[1])) for v, m in models.items()}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m hybridgemm.perf.bench_lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=hf.dense_model_names())  # adapters on gate/up/down
    ap.add_argument("--layers", type=int, default=None, help="the preset's depth unless given")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["compiled_static", "eager_static"],
                    choices=["compiled_static", "eager_static"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-errors", action="store_true", help="skip the fp32 reference (it needs 4 bytes a weight)")
    ap.add_argument("--out", default=None, help="CSV (default lora_<gpu>.csv)")
    args = ap.parse_args(argv)
    if args.rank < 1 or args.tokens < 1 or args.rounds < 1 or min(args.batch) < 1:
        ap.error("--rank, --tokens, --rounds and --batch take positive integers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_lora: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import peft
    except ImportError:
        print("bench_lora: needs peft (pip install peft)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    config = hf.hf_config(args.model, args.layers)
    layers = config.num_hidden_layers
    run = be.Run(args.model, config, dev, batches=tuple(args.batch), tokens=args.tokens, rounds=args.rounds,
                 log=print)
    torch.manual_seed(0)
    stock = hf.build_model(config, torch.bfloat16, dev)
    patched = hf.build_model(config, torch.bfloat16, dev)
    patched.load_state_dict(stock.state_dict())
    print(hybridgemm.patch(patched).summary())
    ref = None
    if not args.no_errors:
        ref = hf.build_model(config, torch.float32, dev)
        ref.load_state_dict(stock.state_dict())
        ref = with_adapter(ref, args.rank)
    models = {"stock_peft": with_adapter(stock, args.rank), "hybridgemm_peft": with_adapter(patched, args.rank)}
    errs = {}
    if ref is not None:
        errs = errors(models, ref, config.vocab_size, dev)
        del ref
        torch.cuda.empty_cache()
        for v, (p, d) in errs.items():
            print(f"{v}: logits error vs fp32, prefill {p:.3e}, decode {d:.3e}")
    gpu = torch.cuda.get_device_name()
    env = {**csvio.environment_columns(" ".join(["python3 -m hybridgemm.perf.bench_lora", *(argv or sys.argv[1:])])),
           "peft": peft.__version__, "date": datetime.date.today().isoformat(), "commit": git_commit()}
    rows = []
    for mode in args.modes:
        for batch in args.batch:
            with torch.no_grad():  # inference, as generate() runs it (no autograd graph for the adapters)
                res, notes = be.time_mode(run, mode, batch, models)
            best = {v: min(r) if isinstance(r, list) and r else None for v, r in res.items()}
            for v, ms in best.items():
                row = {"model": args.model, "layers": layers, "rank": args.rank, "mode": mode, "batch": batch,
                       "variant": v, "ms_per_token": f"{ms:.4f}" if ms else "",
                       "speedup": f"{best['stock_peft'] / ms:.3f}" if ms and best.get("stock_peft") else "",
                       "status": "ok" if ms else f"error: {res[v]!r}"[:200], "note": notes.get(v, ""), **env}
                if v in errs:
                    row["prefill_err"], row["decode_err"] = (f"{e:.4e}" for e in errs[v])
                    if v != "stock_peft" and "stock_peft" in errs:
                        row["error_ratio"] = f"{errs[v][1] / errs['stock_peft'][1]:.3f}"
                rows.append(row)
                print(f"{mode} B={batch} {v}: {row['ms_per_token'] or row['status']} ms/token, "
                      f"speedup {row['speedup'] or '-'}")
    out = args.out or f"lora_{gpu_label(gpu)}.csv"
    be.upsert(out, rows, COLUMNS, KEY)
    print(f"wrote {len(rows)} rows to {os.path.abspath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
