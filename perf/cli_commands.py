"""The ``bench`` and ``plot`` subcommands of the ``hybridgemm`` command (wired in fusion/cli/commands.py).

    hybridgemm bench --model llama3-8b [--m 1 16 ...] [--providers ...] [--dtype bf16] [--out results.csv]
                     [--training] [--plot DIR] [--list-providers]
    hybridgemm bench --m-sweep [--model NAME ...] [--dtype bf16] [--out DIR/any.csv]
                     [--weights fp8 [--granularity channel|block128]]
    hybridgemm bench --e2e --model NAME [--layers N] [--batch 1 8] [--prefill 2048]
                     [--tokens T] [--modes ...] [--rounds R] [--out CSV] [--plot DIR]
                     [--weights fp8 [--granularity channel|block128] [--quantize-lm-head] [--no-peers]]
    hybridgemm plot results.csv [more.csv ...] [--out DIR]

Each handler returns an exit code: 0 done, 1 ran but something is missing (no figure, a
provider failed), 2 cannot run (bad arguments, no GPU, missing file).
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys

import torch

from hybridgemm.autotune_cache.presets import get_preset
from hybridgemm.perf import bench_e2e
from hybridgemm.perf import providers as P
from hybridgemm.perf.bench import DEFAULT_M, print_summary, run_bench, shapes_for
from hybridgemm.perf.bench_msweep import main as m_sweep_main
from hybridgemm.perf.e2e_models import model_names
from hybridgemm.perf.plots import make_all_plots
from hybridgemm.perf.providers import PROVIDERS
from hybridgemm.perf.weight_formats import add_weight_options, weight_options_problem

DEFAULT_OUT = "bench_results.csv"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark every provider beside F.linear on model projection shapes "
                                            "(needs a GPU); writes a long-form CSV")
    p.add_argument("--model", action="append", help="model preset (repeatable; default llama3-8b): bert-base, gpt2, "
                                                    "llama3-8b, llama3-70b, qwen2.5-7b, mistral-7b")
    p.add_argument("--shape", action="append", help="explicit N,K projection shape (repeatable)")
    p.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_M), help="M values (default: 1 16 128 1024 4096)")
    p.add_argument("--providers", nargs="+", help="providers to run (default: all but the opt-in ones; "
                                                  "F.linear always runs, it is the baseline); see --list-providers")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--activation", default="none", choices=["none", "relu", "gelu_tanh", "gelu"])
    p.add_argument("--bias", default="model", choices=["model", "on", "off"],
                   help="bias as the model has it (default), or forced on/off")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"CSV to upsert rows into (default: {DEFAULT_OUT})")
    p.add_argument("--training", action="store_true", help="also time forward+backward of hybridgemm.linear "
                                                           "vs F.linear with autograd")
    p.add_argument("--plot", metavar="DIR", help="draw the figures from --out into DIR afterwards")
    p.add_argument("--list-providers", action="store_true", help="list the providers and whether each can run here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--m-sweep", action="store_true",
                   help="instead: the M sweep (perf/bench_msweep.py): the dispatched call beside F.linear at ~100 M "
                        "from 1 to 16384 per projection shape of --model (default: every preset); writes "
                        "m_sweep_<gpu>.csv, m_sweep_summary.txt and m_sweep.png into --out's directory")
    p.add_argument("--e2e", action="store_true",
                   help="instead: the end-to-end run (perf/bench_e2e.py): one whole model (--model "
                        f"{', '.join(model_names())}; random weights), stock vs patched, in HF generate, eager and "
                        "compiled static-cache decode, prefill, and logits against fp32; upserts rows into --out "
                        "(default e2e_<gpu>.csv)")
    bench_e2e.add_e2e_options(p)
    add_weight_options(p, "with --e2e, " + bench_e2e.WEIGHTS_HELP + "; with --m-sweep, every point also times "
                       "hybridgemm.linear on the weight quantized to e4m3")
    bench_e2e.add_fp8_options(p)
    p.set_defaults(fn=cmd_bench)
    return p


def add_plot_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plot", help="draw the benchmark figures from CSVs (works anywhere, no GPU)")
    p.add_argument("csv", nargs="+", help="benchmark CSVs (bench, attention benchmark); later files win on a key")
    p.add_argument("--out", help="output directory (default: the first CSV's directory)")
    p.set_defaults(fn=cmd_plot)
    return p


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def list_providers(out=None) -> None:
    out = out or sys.stdout  # looked up per call (tests and callers redirect it)
    for p in PROVIDERS.values():
        note = p.unavailable()
        flags = " (opt-in: name it in --providers)" if p.opt_in else ""
        status = f"skipped here: {note}" if note else "available"
        print(f"{p.name:22s} {status:50s} {p.doc}{flags}", file=out)


def _command_line(args) -> str:
    """The run as a canonical command line (stored in every CSV row): rebuilt from the parsed
    arguments, so it is right however the command was invoked (script, -m, a test)."""
    parts = ["hybridgemm", "bench"]
    for m in args.model or []:
        parts += ["--model", m]
    for s in args.shape or []:
        parts += ["--shape", s]
    parts += ["--m", *map(str, args.m), "--dtype", args.dtype, "--activation", args.activation, "--bias", args.bias]
    if args.providers:
        parts += ["--providers", *args.providers]
    parts += ["--out", args.out] + (["--training"] if args.training else [])
    return shlex.join(parts)


def cmd_bench(args) -> int:
    if args.list_providers:
        list_providers()
        return 0
    if getattr(args, "e2e", False):
        return cmd_e2e(args)
    given = [f"--{name.replace('_', '-')}" for name in E2E_ONLY if getattr(args, name, None) is not None]
    if given:
        _err(f"hybridgemm bench: {', '.join(given)}: only with --e2e")
        return 2
    if getattr(args, "m_sweep", False):
        return cmd_m_sweep(args)
    given = [f"--{name}" for name in WEIGHT_OPTIONS if getattr(args, name, None) is not None]
    if given:
        _err(f"hybridgemm bench: {', '.join(given)}: only with --e2e or --m-sweep")
        return 2
    try:
        P.select(args.providers)
    except ValueError as e:
        _err(f"hybridgemm bench: {e}")
        return 2
    if any(m < 1 for m in args.m):
        _err(f"hybridgemm bench: --m values must be ≥ 1, got {args.m}")
        return 2
    # Names, shapes and paths first: a mistake in them is reported on any machine, GPU or not.
    args.model = args.model or ([] if args.shape else ["llama3-8b"])
    try:
        shapes = shapes_for(args.model, args.shape or [], args.bias)
    except ValueError as e:
        _err(f"hybridgemm bench: {e}")
        return 2
    problem = _paths_problem(args.out, args.plot)
    if problem:
        _err(f"hybridgemm bench: {problem}")
        return 2

    if not torch.cuda.is_available():
        _err("hybridgemm bench: needs a CUDA GPU, and this machine has none (it measures GPU and host time "
             "of every provider). `hybridgemm plot` works anywhere, from CSVs measured elsewhere.")
        return 2

    res = run_bench(shapes, args.m, args.providers, args.dtype, args.out, args.activation, args.training,
                    progress=not args.no_progress, command=_command_line(args))
    print_summary(res)
    print(f"wrote {len(res.rows)} rows to {args.out}")
    bad = sorted({(r["provider"], r["method"]) for r in res.rows if r.get("status") in ("failed", "error")})
    if bad:  # recorded in the CSV with the reason; the exit code says so too
        _err("hybridgemm bench: failed or errored: " + ", ".join(f"{p} ({m})" for p, m in bad))
    rc = 1 if bad else 0
    if args.plot:
        rc = max(rc, cmd_plot(argparse.Namespace(csv=[args.out], out=args.plot)))
    return rc


def _paths_problem(out: str, plot: str | None) -> str:
    """Why ``--out`` cannot be a CSV file or ``--plot`` a folder ("" when both can)."""
    if os.path.isdir(out):
        return f"--out {out}: is a directory; give the CSV's file name (e.g. {os.path.join(out, DEFAULT_OUT)})"
    if os.path.exists(out) and not os.path.isfile(out):
        return f"--out {out}: not a regular file"
    if plot and os.path.exists(plot) and not os.path.isdir(plot):
        return f"--plot {plot}: not a directory"
    return ""


def cmd_m_sweep(args) -> int:
    """``hybridgemm bench --m-sweep``: perf/bench_msweep.py's sweep over --model's shapes (all
    presets without one) in --dtype, its files in the directory of --out (or --out itself when
    it is a directory)."""

    if args.shape:
        _err("hybridgemm bench --m-sweep: sweeps the projections of model presets (--model); --shape is not "
             "supported with it")
        return 2
    try:
        models = [get_preset(m).name for m in args.model or []]
        problem = weight_options_problem(args.weights, args.granularity, args.dtype)
    except ValueError as e:
        problem = str(e)
    if problem:
        _err(f"hybridgemm bench --m-sweep: {problem}")
        return 2

    if not torch.cuda.is_available():
        _err("hybridgemm bench --m-sweep: needs a CUDA GPU, and this machine has none (it times the dispatched "
             "call beside F.linear on the GPU)")
        return 2

    out_dir = args.out if os.path.isdir(args.out) or args.out.endswith(("/", os.sep)) else os.path.dirname(args.out)
    argv = ["--out", out_dir or ".", "--dtype", args.dtype, *(a for m in models for a in ("--model", m))]
    for name in WEIGHT_OPTIONS:
        argv += [f"--{name}", getattr(args, name)] if getattr(args, name) is not None else []
    return m_sweep_main(argv + (["--no-progress"] if args.no_progress else []))


E2E_ONLY = ("layers", "batch", "prefill", "tokens", "modes", "rounds", *bench_e2e.FP8_FLAGS)
WEIGHT_OPTIONS = ("weights", "granularity")  # --e2e and --m-sweep


def cmd_e2e(args) -> int:
    """``hybridgemm bench --e2e``: perf/bench_e2e.py for the one --model, its options passed on;
    --out unless left at bench's default."""

    if args.shape or args.providers or args.training or args.m_sweep:
        _err("hybridgemm bench --e2e: runs whole models (--model); --shape, --providers, --training and --m-sweep "
             "do not apply")
        return 2
    if len(args.model or []) != 1:
        _err(f"hybridgemm bench --e2e: give one --model ({' or '.join(model_names())})")
        return 2
    try:
        model = bench_e2e.model_name(args.model[0])
        problem = bench_e2e.fp8_options_problem(args)
    except argparse.ArgumentTypeError as e:
        model, problem = "", str(e)
    if problem:
        _err(f"hybridgemm bench --e2e: {problem}")
        return 2

    if not torch.cuda.is_available():
        _err("hybridgemm bench --e2e: needs a CUDA GPU, and this machine has none (it times whole models on the GPU)")
        return 2

    argv = ["--model", model]
    for name in (*E2E_ONLY, *WEIGHT_OPTIONS):
        value = getattr(args, name, None)
        if value is True:  # a flag
            argv.append(f"--{name.replace('_', '-')}")
        elif value is not None:
            argv += [f"--{name}", *map(str, value if isinstance(value, (list, tuple)) else [value])]
    argv += ["--out", args.out] if args.out != DEFAULT_OUT else []
    argv += ["--plot", args.plot] if args.plot else []
    return bench_e2e.main(argv + (["--no-progress"] if args.no_progress else []))


def cmd_plot(args) -> int:
    missing = [p for p in args.csv if not os.path.isfile(p)]
    if missing:
        _err(f"hybridgemm plot: no such CSV file: {', '.join(missing)}")
        return 2

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _err("hybridgemm plot: needs matplotlib: pip install 'hybridgemm[plot]'")
        return 2

    out = args.out or os.path.dirname(os.path.abspath(args.csv[0]))
    try:
        written = make_all_plots(args.csv, out, log=_err)
    except (ValueError, KeyError, OSError, csv.Error) as e:  # a file that is not a benchmark CSV
        _err(f"hybridgemm plot: cannot plot {', '.join(args.csv)}: {type(e).__name__}: {e}")
        return 2
    for p in written:
        print(p)
    if not written:
        _err("hybridgemm plot: the CSVs hold no rows to plot")
        return 1
    return 0
