"""Tensor parallelism end to end: one decoder model on one rank, then sharded over two ranks by
``hybridgemm.parallelize`` and by torch's own tensor-parallel API, timed in the same run.

    torchrun --nproc-per-node 2 -m hybridgemm.perf.bench_tp --model llama3-8b|qwen2.5-7b|llama3-70b|tiny
             [--layers N] [--batch 1 8] [--prefill 2048] [--tokens 64] [--rounds 3] [--modes ...]
             [--variants ...] [--backend nccl|gloo] [--device cuda|cpu] [--out CSV] [--plot DIR]

Every rank builds the same model (a config of the real model's sizes, perf/e2e_models.py,
``--layers`` shortening it; ``tiny`` is a 2-layer Llama-layout model with attention biases, for
tests and CPU runs), bf16, with the same random weights, each rank holding only its shard
(perf/tp_models.py says how). Variants (:data:`VARIANTS`), one after another, one model in
memory at a time:

- ``tp1_hybridgemm``: rank 0 alone runs the whole model, ``hybridgemm.patch``-ed; the other
  ranks wait at a barrier of a gloo group (no GPU work, no NCCL timeout). Skipped, with a
  note, when the weights exceed :data:`TP1_MAX_FRACTION` of the GPU's memory (the 80-layer
  Llama-3-70B: ~141 GB).
- ``tp2_hybridgemm``: ``hybridgemm.parallelize(model, group)``: fusion/parallel/tensor_parallel.py's
  column/row-parallel attention and MLP and vocab-parallel LM head, then ``hybridgemm.patch``;
  row-parallel sums through the one-shot symmetric-memory all-reduce (fusion/parallel/collectives.py).
- ``tp2_hybridgemm_push``: the same with ``one_shot_kernel="push"``: hybridgemm's one-shot kernel, which
  also adds the fused layers' residuals in its fp32 sums (fusion/parallel/tensor_parallel.py).
- ``tp2_hybridgemm_nccl``: the same with ``one_shot_bytes=0``: every sum on NCCL.
- ``tp2_stock``: the unpatched model sharded with ``torch.distributed.tensor.parallel``
  (perf/tp_models.py's :func:`shard_stock`): ``ColwiseParallel`` for q/k/v/gate/up,
  ``RowwiseParallel`` for o/down, the LM head colwise with its logits gathered.

Modes (perf/bench_e2e.py's, whose round functions, decode loop and clock run here): at every
``--batch``, ``compiled_static`` (static-cache greedy decode under ``torch.compile(mode=
"reduce-overhead", fullgraph=True)``, CUDA events; for ``tp2_stock`` only, a failure with
``fullgraph=True`` is retried with ``fullgraph=False`` and the note says so), ``eager_static``
and ``eager_generate``; ``prefill`` of ``--prefill`` tokens at batch 1; and the error modes
``logits_error`` and ``decode_error`` (bench_e2e's: ``||logits - ref|| / ||ref||`` over one
forward of a fixed batch, or over the steps of a teacher-forced static-cache decode, the path
of the fused decode kernels), ``ref`` from an fp32 copy of the same full model on rank 0 (TF32
off), skipped with a note when that copy does not fit the GPU. Default: ``compiled_static
prefill logits_error``. On the CPU the compiled mode is skipped (``reduce-overhead`` is CUDA
graphs), with a note, unless ``--compile-backend`` names a backend to trace with (tests use
``eager``). ``--one-gpu`` (gloo only) puts every rank on GPU 0, for the error modes alone
where one GPU is all there is: the numbers are those of two GPUs (the same GEMM and attention
kernels; the sums over gloo with the one-shot kernels' arithmetic: fp32, rank order, one
rounding), the timings would not be, so no timed mode runs with it.

The ranks run in lockstep: both set each mode up and run each round, a gloo barrier before
every round; after each step they exchange their errors (perf/tp_ranks.py's
:meth:`Ranks.agree`), so a failure on one rank is recorded on both and the run goes on, and
never leaves the other waiting in a collective. Rank 0's timings are the ones recorded (its
clock, its CUDA events; a step's collectives make it wait for the other rank). Each mode runs
``--rounds`` rounds; reported: the median.

Rows (rank 0 writes the CSV, upserted on gpu, model, layers, mode, batch, variant, after each
variant, and the figure, :func:`hybridgemm.perf.plots_models.plot_tp`): ``tp``, ``status`` (ok |
error | skipped, ``note`` says why), ``ms_per_token`` (per decode step; prefill: per prefill),
``tokens_per_s``, ``speedup_vs_tp1`` (tp1_hybridgemm's ms / the variant's, same mode and
batch), ``hbm_floor_ms_per_gpu`` (bytes of the weights a decode step reads on one GPU, its
shard, counted as bench_e2e counts them / the GPU's read rate, bench_e2e.hbm_floor_ms), ``fraction_of_floor``
(decode only), ``logits_rel_err``, and the environment columns. Exit code 0; 1 when a row is
an error; 2 when the run cannot start (not launched by torchrun, a world size that is not
the largest tp asked, an unknown model, no GPU for ``--device cuda``, ...).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import csvio, read_ceiling
from hybridgemm.perf.bench_msweep import git_commit, gpu_label
from hybridgemm.perf.plots_models import plot_tp
from hybridgemm.perf.tp_models import (
    VARIANTS,
    Built,
    build,
    fits,
    fp32_reference,
    full_bytes,
    model_config,
    model_names,
)
from hybridgemm.perf.tp_ranks import Ranks

MODES = E.MODES
DEFAULT_MODES = ("compiled_static", "prefill", "logits_error")
KEY = E.KEY
COLUMNS = (*KEY, "tp", "status", "ms_per_token", "spread_ms", "tokens_per_s", "speedup_vs_tp1", "hbm_floor_ms_per_gpu",
           "fraction_of_floor", "read_tbps", "logits_rel_err", "weight_bytes_per_gpu", "tokens", "rounds", "samples",
           "note", "date", "commit", "torch", "triton", "transformers", "cublaslt", "nvmath", "hybridgemm", "host",
           "command")
TP1_MAX_FRACTION = 0.85  # of GPU memory the tp=1 weights may take (caches, activations, graph pools: the rest)
REF_MAX_FRACTION = 0.9  # of the free memory that the fp32 reference may take
TIMEOUT = datetime.timedelta(minutes=30)  # of a collective: the idle rank waits out the whole tp=1 variant
LAUNCH = "torchrun --nproc-per-node 2 -m hybridgemm.perf.bench_tp --model llama3-8b"


class UsageError(Exception):
    """The run cannot start as asked (exit code 2, the message on one line)."""


# ----------------------------------------------------------------------------- timing


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def measure(run: E.Run, mode: str, batch: int, model, ranks: Ranks, lockstep: bool) -> tuple[list | BaseException, str]:
    """(rank 0's ms per token of each round, or the exception; a note) for ``mode`` at
    ``batch``: bench_e2e's round function, set up then run ``run.rounds`` times. With
    ``lockstep`` every rank runs it, a barrier before each round and errors exchanged after
    each step."""
    clock, note, rnd = E.Clock(run.device), "", None
    compiled = mode == "compiled_static"
    sync = ranks.agree if lockstep else (lambda e: e)
    if compiled:
        torch._dynamo.reset()
    try:
        skips = E._cudagraph_skips()
        err = None
        try:
            rnd = E.make_round(run, mode, model, batch, clock)
        except Exception as e:  # noqa: BLE001 (recorded in the row)
            err = e.with_traceback(None)
        if (err := sync(err)) is not None:
            return err, note
        if compiled and E._cudagraph_skips() > skips:
            note = "torch.compile skipped CUDA graphs (TORCH_LOGS=perf_hints says why)"
        samples = []
        for _ in range(run.rounds):
            if lockstep:
                ranks.barrier()
            try:
                samples += rnd()
            except Exception as e:  # noqa: BLE001
                err = e.with_traceback(None)
            if (err := sync(err)) is not None:
                return err, note
        return samples, note
    finally:
        rnd = None
        if compiled:
            torch._dynamo.reset()
        E._free(run.device)


def measure_variant_mode(run: E.Run, variant: str, mode: str, batch: int, model, ranks: Ranks):
    """:func:`measure`, and for ``tp2_stock``'s compiled mode a second try with
    ``fullgraph=False`` when ``fullgraph=True`` fails (the note says so)."""
    lockstep = VARIANTS[variant] > 1
    res, note = measure(run, mode, batch, model, ranks, lockstep)
    if (isinstance(res, BaseException) and variant == "tp2_stock" and mode == "compiled_static"
            and run.compile_options.get("fullgraph")):
        relaxed = dataclasses.replace(run, compile_options={**run.compile_options, "fullgraph": False})
        first = _short(res)
        res, note = measure(relaxed, mode, batch, model, ranks, lockstep)
        note = "; ".join(x for x in (f"fullgraph=False (with fullgraph=True: {first})", note) if x)
    return res, note


# ----------------------------------------------------------------------------- rows


def _row(run: E.Run, variant: str, mode: str, batch: int, **kw) -> dict:
    return {**run.extra, "model": run.name, "layers": run.config.num_hidden_layers, "mode": mode, "batch": batch,
            "variant": variant, "tp": VARIANTS[variant], "rounds": run.rounds, **kw}


def timed_row(run: E.Run, variant: str, mode: str, batch: int, res, note: str, weight_bytes: int) -> dict:
    row = _row(run, variant, mode, batch, weight_bytes_per_gpu=weight_bytes,
               tokens=run.prefill if mode == "prefill" else run.tokens)
    if isinstance(res, BaseException) or not res:
        err = res if isinstance(res, BaseException) else RuntimeError("no samples")
        return {**row, "status": "error", "note": "; ".join(x for x in (_short(err), note) if x)}
    ms = statistics.median(res)
    per_run = run.prefill if mode == "prefill" else batch
    floor = E.hbm_floor_ms(weight_bytes, device=run.device)
    row.update(status="ok", note=note or None, ms_per_token=ms, spread_ms=max(res) - min(res), samples=len(res),
               tokens_per_s=per_run * 1e3 / ms if ms > 0 else math.nan, hbm_floor_ms_per_gpu=floor,
               read_tbps=read_ceiling.device_read_tbps(run.device)[0])
    if mode != "prefill":
        row["fraction_of_floor"] = floor / ms if ms > 0 else math.nan
    return row


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_tp1`` of every timed ok row whose (mode, batch) has an ok tp1_hybridgemm time."""
    base = {(r["mode"], r["batch"]): r["ms_per_token"] for r in rows
            if r["variant"] == "tp1_hybridgemm" and r["status"] == "ok" and r.get("ms_per_token")}
    for r in rows:
        tp1 = base.get((r["mode"], r["batch"]))
        if r["status"] == "ok" and r.get("ms_per_token") and tp1:
            r["speedup_vs_tp1"] = tp1 / r["ms_per_token"]


def tasks(run: E.Run) -> list[tuple[str, int]]:
    """(mode, batch) of every timed measurement, in run order."""
    out = [(m, b) for m in run.modes if m in E.DECODE_MODES for b in run.batches]
    return out + ([("prefill", 1)] if "prefill" in run.modes else [])


def error_modes(run: E.Run) -> list[str]:
    """The error modes of ``run``, in run order."""
    return [m for m in run.modes if m in E.ERROR_MODES]


def skipped_rows(run: E.Run, variant: str, note: str) -> list[dict]:
    """A ``skipped`` row, with ``note``, for every measurement of ``variant``."""
    batch = {"logits_error": E.LOGITS_SHAPE[0], "decode_error": E.DECODE_SHAPE[0]}
    todo = tasks(run) + [(m, batch[m]) for m in error_modes(run)]
    return [_row(run, variant, m, b, status="skipped", note=note) for m, b in todo]


@dataclass
class Result:
    rows: list[dict] = field(default_factory=list)

    @property
    def errors(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "error"]


def run_variant(run: E.Run, variant: str, ranks: Ranks, refs: dict, ids: dict, compiled_note: str | None
                ) -> list[dict]:
    """Build ``variant`` on this rank, then run every mode; the rows (rank 0's are the ones kept).
    ``refs``, per error mode: the fp32 logits (rank 0), None (the other ranks) or why there are
    none (every rank); ``ids``: each error mode's tokens."""
    lockstep = VARIANTS[variant] > 1
    rows: list[dict] = []
    try:
        built, err = Built(None, 0), None
        try:
            built = build(run, variant, ranks)
        except NotImplementedError as e:
            err = e
        except Exception as e:  # noqa: BLE001 (recorded in the rows)
            err = e.with_traceback(None)
        if lockstep:
            err = ranks.agree(err)
        if err is not None:
            status = "skipped" if isinstance(err, NotImplementedError) else "error"
            run.log(f"{variant}: {status}: {_short(err)}")
            return [{**r, "status": status} for r in skipped_rows(run, variant, _short(err))]
        notes = "; ".join(built.notes)
        if ranks.rank == 0:  # (only rank 0 logs: the others would read the rate for nothing)
            run.log(f"{variant}: {built.weight_bytes / 1e9:.2f} GB of weights per decode step on each GPU, HBM floor "
                    f"{E.hbm_floor_ms(built.weight_bytes, device=run.device):.3f} ms")
        for mode in error_modes(run):
            rows.append(logits_row(run, variant, mode, built.model, refs[mode], ids[mode], lockstep, ranks))
        for mode, batch in tasks(run):
            if mode == "compiled_static" and compiled_note:
                rows.append(_row(run, variant, mode, batch, status="skipped", note=compiled_note))
                continue
            with torch.no_grad():
                res, note = measure_variant_mode(run, variant, mode, batch, built.model, ranks)
            note = "; ".join(x for x in (note, notes) if x)
            row = timed_row(run, variant, mode, batch, res, note, built.weight_bytes)
            run.log(f"{variant} {mode} batch {batch}: " + (f"{row['ms_per_token']:.3f} ms" if row["status"] == "ok"
                                                             else f"{row['status']}: {row['note']}"))
            rows.append(row)
        return rows
    finally:
        built = None
        torch._dynamo.reset()
        E._free(run.device)


def logits_row(run: E.Run, variant: str, mode: str, model, ref, ids, lockstep: bool, ranks: Ranks) -> dict:
    """The row of error mode ``mode``: every rank runs the model on ``ids``, rank 0 compares
    with ``ref``."""
    row = _row(run, variant, mode, ids.shape[0])
    if isinstance(ref, str):
        return {**row, "status": "skipped", "note": ref}
    err = None
    try:
        with torch.no_grad():
            logits = E.error_logits(mode, model, ids)
    except Exception as e:  # noqa: BLE001
        err = e.with_traceback(None)
    if lockstep:
        err = ranks.agree(err)
    if err is not None:
        return {**row, "status": "error", "note": _short(err)}
    if ranks.rank != 0:
        return row
    rel = E.rel_error(logits, ref)
    run.log(f"{variant}: {mode} vs fp32 {rel:.3e}")
    return {**row, "status": "ok", "logits_rel_err": rel}


def run_tp(run: E.Run, ranks: Ranks, variants: tuple[str, ...], on_rows: Callable[[list[dict]], None] | None = None
           ) -> Result:
    """Every variant of ``variants`` in turn (see the module docstring); rank 0's rows, with
    ``on_rows(rows so far)`` after each variant."""
    res = Result()
    compiled_note = None
    if run.device.type != "cuda" and run.compile_options.get("mode") == "reduce-overhead":
        compiled_note = "skipped on the CPU: compile mode reduce-overhead is CUDA graphs (--compile-backend traces)"
    ids = {m: E.error_ids(m, run.config.vocab_size, run.device) for m in error_modes(run)}
    refs: dict[str, torch.Tensor | str | None] = dict.fromkeys(ids)
    if ids and ranks.rank == 0:
        why = fits(full_bytes(run, torch.float32), run.device, REF_MAX_FRACTION, free=True)
        if why:
            refs = dict.fromkeys(ids, f"no fp32 reference: the fp32 copy of the model does not fit one GPU: {why}")
        else:
            refs = {m: r if isinstance(r, torch.Tensor) else f"no fp32 reference: {_short(r)}"
                    for m, r in fp32_reference(run, ids).items()}
    if ids:  # every rank must know whether the logits are computed (they need all ranks)
        shared = [{m: r if isinstance(r, str) else None for m, r in refs.items()}]
        dist.broadcast_object_list(shared, src=0, group=ranks.control)
        refs = refs if ranks.rank == 0 else shared[0]
    ranks.barrier()
    for variant in variants:
        if VARIANTS[variant] == 1:
            if ranks.rank == 0:
                why = fits(full_bytes(run, run.dtype), run.device, TP1_MAX_FRACTION)
                if why:
                    why = f"the bf16 weights do not fit one GPU: {why}"
                    run.log(f"{variant}: skipped: {why}")
                    res.rows += skipped_rows(run, variant, why)
                else:
                    res.rows += run_variant(run, variant, ranks, refs, ids, compiled_note)
            ranks.barrier()  # the other ranks wait here while rank 0 runs the whole model
        else:
            rows = run_variant(run, variant, ranks, refs, ids, compiled_note)
            res.rows += rows if ranks.rank == 0 else []
        add_speedups(res.rows)
        if on_rows is not None and ranks.rank == 0:
            on_rows(res.rows)
    return res


# ----------------------------------------------------------------------------- summary, command line


def print_summary(res: Result, variants: tuple[str, ...], console=None) -> None:
    """Per (mode, batch): every variant's ms (speedup over tp1); then the logits errors."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    by = {(r["mode"], r["batch"], r["variant"]): r for r in res.rows}
    tab = Table(title="tensor parallel: ms per decode step (prefill: ms per prefill) and speedup over tp1_hybridgemm")
    for col in ("mode", "batch", *variants):
        tab.add_column(col, justify="left" if col == "mode" else "right")

    def cell(r):
        if r is None or r["status"] != "ok":
            return "-" if r is None else r["status"]
        if r["mode"] in E.ERROR_MODES:
            return f"{r['logits_rel_err']:.2e}"
        sp = r.get("speedup_vs_tp1")
        return f"{r['ms_per_token']:.3f}" + (f" ({sp:.2f}x)" if sp and r["variant"] != "tp1_hybridgemm" else "")

    for mode, batch in dict.fromkeys((r["mode"], r["batch"]) for r in res.rows):
        tab.add_row(mode, str(batch), *(cell(by.get((mode, batch, v))) for v in variants))
    console.print(tab)


def model_name(text: str) -> str:
    """The canonical name of ``text`` (as bench_e2e's, plus ``tiny``); an argparse error naming
    the known models otherwise."""
    key = str(text).strip().lower().replace("_", "-")
    if key not in model_names():
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; known: {', '.join(model_names())}")
    return key


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node 2 -m hybridgemm.perf.bench_tp",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=model_name, help=f"one of {', '.join(model_names())}")
    E.add_e2e_options(ap, DEFAULT_MODES)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), metavar="VARIANT",
                    help=f"variants to run (default: all): {', '.join(VARIANTS)}")
    ap.add_argument("--backend", choices=("nccl", "gloo"), help="torch.distributed backend (default: nccl with "
                    "--device cuda, else gloo)")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="where the models run (default: cuda if available)")
    ap.add_argument("--one-gpu", action="store_true", help="every rank on GPU 0 (with --backend gloo; error modes "
                    "only: timings of ranks sharing a GPU mean nothing)")
    ap.add_argument("--compile-backend", metavar="NAME", help="torch.compile backend of compiled_static instead of "
                    "mode='reduce-overhead' (e.g. eager, to trace on the CPU)")
    ap.add_argument("--out", help="CSV to upsert rows into, or a folder for tp_<gpu>x<ranks>.csv (default: "
                    "tp_<gpu>x<ranks>.csv)")
    ap.add_argument("--plot", metavar="DIR", help="draw tp.png from the CSV into DIR afterwards")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return ap.parse_args(argv)


def command_line(args, world: int) -> str:
    """The run as one canonical command line (stored in every row)."""
    parts = ["torchrun", "--nproc-per-node", str(world), "-m", "hybridgemm.perf.bench_tp", "--model", args.model,
             "--layers", str(args.layers), "--batch", *map(str, args.batch), "--prefill", str(args.prefill),
             "--tokens", str(args.tokens), "--modes", *args.modes, "--rounds", str(args.rounds),
             "--variants", *args.variants, "--backend", args.backend, "--device", args.device]
    parts += ["--one-gpu"] if args.one_gpu else []
    return shlex.join(parts + (["--compile-backend", args.compile_backend] if args.compile_backend else []))


def check_launch(args, env=os.environ) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; :class:`UsageError` when
    the run cannot start as asked. Fills in the defaults of ``args``."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise UsageError(f"no torch.distributed environment ({', '.join(missing)} not set): launch with torchrun, "
                         f"e.g. `{LAUNCH}`")
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    args.variants = tuple(dict.fromkeys(args.variants or VARIANTS))
    need = max(VARIANTS[v] for v in args.variants)
    if world != need:
        raise UsageError(f"world size {world}, but the variants asked ({', '.join(args.variants)}) need {need} "
                         f"rank{'s' if need > 1 else ''}: launch with torchrun --nproc-per-node {need}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.one_gpu:
        args.backend = args.backend or "gloo"
        if args.device != "cuda" or args.backend != "gloo":
            raise UsageError("--one-gpu needs --device cuda and --backend gloo (NCCL takes one GPU per rank)")
        timed = [m for m in (args.modes or DEFAULT_MODES) if m not in E.ERROR_MODES]
        if timed:
            raise UsageError(f"--one-gpu runs the error modes only ({', '.join(E.ERROR_MODES)}); asked: "
                             f"{', '.join(timed)}")
        local = 0
    if args.device == "cuda" and torch.cuda.device_count() <= local:
        raise UsageError(f"--device cuda: local rank {local} needs GPU {local}, and this machine has "
                         f"{torch.cuda.device_count()} (--device cpu runs on the CPU, with gloo)")
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.backend == "nccl" and args.device != "cuda":
        raise UsageError("--backend nccl needs --device cuda; use --backend gloo on the CPU")
    return rank, world, local


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        rank, world, local = check_launch(args)
        import transformers
    except UsageError as e:
        print(f"bench_tp: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("bench_tp: needs transformers (pip install transformers) to build the models", file=sys.stderr)
        return 2
    config = model_config(args.model, args.layers)
    args.layers = config.num_hidden_layers
    args.batch = tuple(args.batch or E.BATCHES)
    args.prefill, args.tokens = args.prefill or E.PREFILL, args.tokens or E.TOKENS
    args.modes, args.rounds = tuple(dict.fromkeys(args.modes or DEFAULT_MODES)), args.rounds or E.ROUNDS
    device = torch.device(args.device, local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=TIMEOUT, **({"device_id": device} if args.backend == "nccl" else {}))
    try:
        control = dist.new_group(backend="gloo", timeout=TIMEOUT) if args.backend != "gloo" else dist.group.WORLD
        ranks = Ranks(rank, world, dist.group.WORLD, control)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        out = args.out or f"tp_{gpu_label(gpu)}x{world}.csv"
        if os.path.isdir(out) or out.endswith(("/", os.sep)):
            out = os.path.join(out, f"tp_{gpu_label(gpu)}x{world}.csv")
        extra = {**csvio.environment_columns(command_line(args, world)), "gpu": gpu,
                 "transformers": transformers.__version__, "date": datetime.date.today().isoformat(),
                 "commit": git_commit()}
        start = time.perf_counter()

        def log(line: str) -> None:
            if rank == 0 and not args.no_progress:
                print(f"[{time.perf_counter() - start:7.1f}s] {line}", file=sys.stderr, flush=True)

        compile_options = dict(E.COMPILE)
        if args.compile_backend:
            compile_options = {"backend": args.compile_backend, "fullgraph": True}
        run = E.Run(args.model, config, device, args.batch, args.tokens, args.prefill, args.rounds, args.modes,
                    compile_options=compile_options, extra=extra, log=log)
        where = f"{world} ranks sharing one {gpu}" if args.one_gpu else f"{world} x {gpu}"
        log(f"{command_line(args, world)} on {where}, {args.backend}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")
        res = run_tp(run, ranks, args.variants, on_rows=lambda rows: E.upsert(out, rows, COLUMNS, KEY))
        failed = ranks.agree(RuntimeError("errors") if res.errors else None) is not None
        if rank == 0:
            report(res, args, out)
        ranks.barrier()  # every rank stays up until rank 0 is done: a rank leaving early can abort at exit
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


def report(res: Result, args, out: str) -> None:
    """Rank 0's summary table, the errors and the figure."""
    print_summary(res, args.variants)
    print(f"wrote {len(res.rows)} rows to {out}")
    if res.errors:
        print("bench_tp: errors in " + ", ".join(f"{r['mode']} B={r['batch']} {r['variant']}" for r in res.errors),
              file=sys.stderr)
    if args.plot:
        try:
            print(f"wrote {plot_tp(out, args.plot)}")
        except ImportError:
            print("bench_tp: no matplotlib: skipping tp.png (pip install 'hybridgemm[plot]')", file=sys.stderr)
        except ValueError as e:
            print(f"bench_tp: no figure: {e}", file=sys.stderr)


def exit_now(code: int) -> NoReturn:
    """End a finished rank without the interpreter's teardown: Python's exit handlers run (the
    compile workers' shutdown among them) and the streams are flushed, then ``os._exit``. In
    that teardown a C++ thread's destructor can call ``std::terminate`` ("terminate called
    without an active exception"), aborting a gloo rank whose process group is destroyed and
    whose rows are written: one loaded run in ten on 2 cores (the tiny model of
    tests/perf/test_bench_tp_cpu.py, 2026-12-06)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
