"""The work one GPU does in a tensor-parallel decode step, measured on one GPU: rank 0's shard of
a model :func:`hybridgemm.parallelize` splits ``--tp`` ways, with its collectives left out,
beside the whole model on the same GPU.

    python -m hybridgemm.perf.tp_compute --model llama3-8b|qwen2.5-7b|llama3-70b|tiny [--layers N]
           [--tp 2] [--batch 1 8] [--tokens 64] [--rounds 3] [--out CSV] [--profile CSV]

What it answers: how much of a ``tp`` step is computation (GEMMs on the rank's weight shard,
attention over its heads, norms, the LM head's vocabulary slice, the gaps between kernels)
and so, by difference with a measured ``bench_tp`` step, how much the collectives add; and,
where no machine with ``tp`` GPUs is at hand, the least time a ``tp`` step can take.

How: this process is rank 0 of a group of ``tp`` whose collectives do nothing (torch's
``fake`` backend); the model is built and sharded exactly as ``perf/bench_tp.py``'s
``tp2_hybridgemm`` variant does (``perf/tp_models.py``: same random bf16 weights, this rank's
part only), then each row-parallel layer returns its partial product unsummed and the
vocab-parallel head its own slice of the logits (greedy decoding then picks from that slice).
The logits are therefore not the model's: nothing here checks numerics (``bench_tp``'s
``logits_error`` does, on ``tp`` GPUs). Timed as bench_e2e's ``compiled_static`` (static
cache, ``torch.compile(mode="reduce-overhead", fullgraph=True)``, ms per decode step, the
median of ``--rounds``). Variants: ``tp1_hybridgemm`` (the whole model, patched) and
``tp<N>_rank0_compute``. HBM floor: the GPU's weight bytes / its read rate (bench_e2e.hbm_floor_ms).

``--profile CSV``: after each variant's timing, :data:`PROFILE_STEPS` more decode steps under
torch.profiler (perf/e2e_profile.py's grouping of kernels: gemm, attention, norm, ...); the
per-group table is printed and every kernel's µs per token written to CSV (e2e_profile's
columns, the variant ``tp1_hybridgemm`` or ``tp<N>_rank0_compute``).

Rows (upserted on gpu, model, layers, batch, variant): ``tp``, ``status``, ``ms_per_token``,
``spread_ms``, ``hbm_floor_ms_per_gpu``, ``fraction_of_floor``, ``weight_bytes_per_gpu``,
``note`` and the environment columns. Exit code 0; 1 when a row is an error; 2 for bad
arguments or no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor

import hybridgemm
from hybridgemm.parallel import RowParallelLinear, VocabParallelLinear
from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import csvio, read_ceiling
from hybridgemm.perf import e2e_profile as P
from hybridgemm.perf.bench_msweep import git_commit, gpu_label
from hybridgemm.perf.bench_tp import TP1_MAX_FRACTION, measure, model_name
from hybridgemm.perf.tp_models import Built, build, fits, full_bytes, model_config, model_names
from hybridgemm.perf.tp_ranks import Ranks

KEY = ("gpu", "model", "layers", "batch", "variant")
PROFILE_STEPS = 16
COLUMNS = (*KEY, "tp", "status", "ms_per_token", "spread_ms", "hbm_floor_ms_per_gpu", "fraction_of_floor", "read_tbps",
           "weight_bytes_per_gpu", "tokens", "rounds", "samples", "note", "date", "commit", "torch", "triton",
           "transformers", "hybridgemm", "host", "command")


class _UnsummedRowParallel(RowParallelLinear):
    """A row-parallel layer whose partial product is returned as it is (no sum over the ranks)."""

    def sum_parts(self, y: Tensor) -> Tensor:
        return y


class _LocalVocabSlice(VocabParallelLinear):
    """A vocab-parallel head returning this rank's slice of the logits (no gather)."""

    def forward(self, x: Tensor) -> Tensor:
        return hybridgemm.linear(x, self.weight, self.bias)


def rank0_shard(run: E.Run, ranks: Ranks) -> Built:
    """Rank 0's shard of ``run``'s model over ``ranks.group``, built and patched as bench_tp's
    tp=2 variant with NCCL sums (tp_models.build), then its collectives left out."""
    built = build(run, "tp2_hybridgemm_nccl", ranks)
    for mod in built.model.modules():
        if type(mod) is RowParallelLinear:
            mod.__class__ = _UnsummedRowParallel
        elif type(mod) is VocabParallelLinear:
            mod.__class__ = _LocalVocabSlice
    return built


def row(run: E.Run, variant: str, tp: int, batch: int, built: Built, res) -> dict:
    out = {**run.extra, "model": run.name, "layers": run.config.num_hidden_layers, "batch": batch,
           "variant": variant, "tp": tp, "rounds": run.rounds, "tokens": run.tokens,
           "weight_bytes_per_gpu": built.weight_bytes, "note": "; ".join(built.notes) or None}
    if isinstance(res, BaseException) or not res:
        return {**out, "status": "error", "note": f"{type(res).__name__}: {res}".splitlines()[0][:300]}
    ms, floor = statistics.median(res), E.hbm_floor_ms(built.weight_bytes, device=run.device)
    return {**out, "status": "ok", "ms_per_token": ms, "spread_ms": max(res) - min(res), "samples": len(res),
            "hbm_floor_ms_per_gpu": floor, "fraction_of_floor": floor / ms,
            "read_tbps": read_ceiling.device_read_tbps(run.device)[0]}


def profile(run: E.Run, variant: str, batch: int, model, floor_ms: float) -> list[dict]:
    """e2e_profile's kernel rows of ``PROFILE_STEPS`` compiled decode steps of ``model``; the
    per-group table and the top kernels logged."""
    layers = run.config.num_hidden_layers
    torch._dynamo.reset()
    try:
        times = P.profile_variant(run, model, "compiled_static", batch, PROFILE_STEPS)
    finally:
        torch._dynamo.reset()
    rows = P.rows_for(SimpleNamespace(model=run.name, layers=layers), "compiled_static", batch, variant, times,
                      PROFILE_STEPS)
    run.log(f"{variant} batch {batch}, kernels per token:\n" + P.summary(rows, floor_ms, layers))
    for r in rows[:10]:
        run.log(f"  {r['us_per_token']:9.1f} µs {r['calls_per_token']:6.1f} calls  {r['group']:11s} {r['kernel'][:90]}")
    return [{**r, "date": run.extra.get("date"), "commit": run.extra.get("commit"),
             "command": run.extra.get("command")} for r in rows]


def run_variant(run: E.Run, variant: str, tp: int, ranks: Ranks, profiled: list | None = None) -> list[dict]:
    """``variant``'s rows at every batch: built (the whole model for tp 1, skipped with a note
    when it does not fit the GPU; else rank 0's shard), then timed (and profiled into
    ``profiled``, when given). A failure to build or time is an error row, not an exception."""
    base = {**run.extra, "model": run.name, "layers": run.config.num_hidden_layers, "variant": variant, "tp": tp,
            "rounds": run.rounds, "tokens": run.tokens}
    why = fits(full_bytes(run, run.dtype), run.device, TP1_MAX_FRACTION) if tp == 1 else None
    if why:
        run.log(f"{variant}: skipped: the bf16 weights do not fit one GPU: {why}")
        return [{**base, "batch": b, "status": "skipped", "note": f"the bf16 weights do not fit one GPU: {why}"}
                for b in run.batches]
    rows, built = [], None
    try:
        try:
            built = build(run, "tp1_hybridgemm", ranks) if tp == 1 else rank0_shard(run, ranks)
        except Exception as e:  # noqa: BLE001 (recorded in the rows)
            run.log(f"{variant}: could not be built: {type(e).__name__}: {e}")
            return [{**base, "batch": b, "status": "error", "note": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                    for b in run.batches]
        for batch in run.batches:
            with torch.no_grad():
                res, note = measure(run, "compiled_static", batch, built.model, ranks, lockstep=False)
            r = row(run, variant, tp, batch, built, res)
            r["note"] = "; ".join(x for x in (r["note"], note) if x) or None
            run.log(f"{variant} batch {batch}: " + (f"{r['ms_per_token']:.3f} ms ({r['fraction_of_floor']:.1%} of "
                                                    f"{r['hbm_floor_ms_per_gpu']:.3f})" if r["status"] == "ok"
                                                    else r["note"]))
            rows.append(r)
            if profiled is not None and r["status"] == "ok":
                with torch.no_grad():
                    profiled += profile(run, variant, batch, built.model, r["hbm_floor_ms_per_gpu"])
        return rows
    finally:
        built = None
        E._free(run.device)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.tp_compute", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=model_name, help=f"one of {', '.join(model_names())}")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks the shard is one of (default 2)")
    ap.add_argument("--batch", type=int, nargs="+", default=list(E.BATCHES), help="decode batch sizes (default 1 8)")
    ap.add_argument("--tokens", type=int, default=E.TOKENS, help="decode steps per round (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=E.ROUNDS, help="rounds; the median is kept (default %(default)s)")
    ap.add_argument("--out", help="CSV to upsert rows into (default: tp_compute_<gpu>.csv)")
    ap.add_argument("--profile", metavar="CSV", help="also profile each variant's kernels; their rows go here")
    args = ap.parse_args(argv)
    if args.tp < 2 or (args.layers is not None and args.layers < 1) or min(args.batch) < 1 or args.tokens < 1 \
            or args.rounds < 1:
        ap.error("--tp must be at least 2; --layers, --batch, --tokens and --rounds at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tp_compute: needs a CUDA GPU (the decode step is timed under CUDA graphs)", file=sys.stderr)
        return 2
    import transformers
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = model_config(args.model, args.layers)
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(device)
    parts = ["python", "-m", "hybridgemm.perf.tp_compute", "--model", args.model, "--layers",
             str(config.num_hidden_layers), "--tp", str(args.tp), "--batch", *map(str, args.batch), "--tokens",
             str(args.tokens), "--rounds", str(args.rounds)] + (["--profile", args.profile] if args.profile else [])
    extra = {**csvio.environment_columns(shlex.join(parts)), "gpu": gpu, "transformers": transformers.__version__,
             "date": datetime.date.today().isoformat(), "commit": git_commit()}
    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {line}", file=sys.stderr, flush=True)

    run = E.Run(args.model, config, device, tuple(args.batch), args.tokens, E.PREFILL, args.rounds,
                ("compiled_static",), extra=extra, log=log)
    out = args.out or f"tp_compute_{gpu_label(gpu)}.csv"
    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    rows, profiled = [], [] if args.profile else None
    try:
        ranks = Ranks(0, args.tp, dist.group.WORLD, None)
        for variant, tp in (("tp1_hybridgemm", 1), (f"tp{args.tp}_rank0_compute", args.tp)):
            rows += run_variant(run, variant, tp, ranks, profiled)
            E.upsert(out, rows, COLUMNS, KEY)
    finally:
        dist.destroy_process_group()
    print(f"wrote {len(rows)} rows to {out}")
    if profiled:
        csvio.write_csv(args.profile, list(P.COLUMNS), profiled)
        print(f"wrote {len(profiled)} kernel rows to {args.profile}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
