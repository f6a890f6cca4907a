"""The `hybridgemm` command (also `python -m hybridgemm`).

    hybridgemm autotune --model llama3-8b|--hf-config PATH [--tp N] [--m 1 16 ...] [--dtype bf16] [--out PATH]
                        [--weights fp8 [--granularity channel|block128]] [--force|--check]
    hybridgemm autotune --moe qwen3-30b-a3b [--weights fp8 [--granularity ...]] [--dtype bf16] [--out PATH]
    hybridgemm show [PATH]
    hybridgemm explain --x 16,4096 --w 6144,4096 [--dtype bf16] [--no-bias] [--activation relu]
                       [--weights fp8 [--granularity ...] [--activations fp8]] [--table PATH | --device h200]
    hybridgemm bench --model llama3-8b [--m ...] [--providers ...] [--out results.csv] [--training] [--plot DIR]
    hybridgemm bench --m-sweep ... | --e2e --model qwen2.5-7b|llama3-8b ...   (perf/cli_commands.py)
    hybridgemm plot results.csv [more.csv ...] [--out DIR]
    hybridgemm patch --dry-run --hf-config PATH [--strict]   (fusion/cli/patch_command.py)
    hybridgemm demo [--m 16 --n 6144 --k 4096] | main [--model llama3-8b]

A bad argument is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from hybridgemm import explain
from hybridgemm.autotune_cache import signature, tune_glu, tune_moe, tune_table
from hybridgemm.autotune_cache.keys import M_MAX, ShapeKey, TableError
from hybridgemm.autotune_cache.presets import PRESETS, get_preset, parse_shape, preset_from_hf_config, show_path
from hybridgemm.autotune_cache.table import (
    TuningTable,
    shipped_devices,
    shipped_table_for_device,
    shipped_table_paths,
    user_table_path,
)
from hybridgemm.cli.patch_command import add_patch_parser, build_on_meta, dry_run
from hybridgemm.decide import fp8_decode_config, set_table_path
from hybridgemm.explain import w8a8_line
from hybridgemm.kernels import backends, fp8
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.fp8 import FORMAT_OF
from hybridgemm.kernels.problem import DECODE_MAX_M, NAME_TO_DTYPE, Problem, uses_tf32
from hybridgemm.kernels.version import __version__
from hybridgemm.models.gemm_shapes import GatedShape, gated_shapes, patched_gemms
from hybridgemm.norm import prologue_norm
from hybridgemm.parallel.sharding import rank_projections, tp_split, tp_vocab_rows
from hybridgemm.perf.cli_commands import add_bench_parser, add_plot_parser, cmd_plot
from hybridgemm.perf.demo import DEMO_MAX_ELEMENTS, run_demo
from hybridgemm.perf.plots import RESULTS_DIR, figure_sources
from hybridgemm.perf.weight_formats import add_weight_options, resolve_weight_options, weight_options_problem

_DIM_RE = re.compile(r"[0-9]{1,19}")
_DIM_MAX = 2**63 - 1  # a tensor dimension is an int64


def _ints(text: str) -> tuple[int, ...]:
    """A shape: one or more positive integers separated by commas (or ``x``): ``16,4096``,
    ``2,8,4096``, ``16x4096``. Empty parts, signs, decimals and zeros are refused."""
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    if not all(_DIM_RE.fullmatch(p) for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas (e.g. 16,4096 or 2,8,4096), got {text!r:.80}")
    dims = tuple(int(p) for p in parts)
    if not all(dims):
        raise argparse.ArgumentTypeError(f"dimensions must be positive, got {text!r:.80}")
    if max(dims) > _DIM_MAX:
        raise argparse.ArgumentTypeError(f"dimensions must be at most {_DIM_MAX} (int64), got {text!r:.80}")
    return dims


def _weight_shape(text: str) -> tuple[int, int]:
    """``N,K``: exactly two positive integers."""
    dims = _ints(text)
    if len(dims) != 2:
        raise argparse.ArgumentTypeError(f"expected N,K (two positive integers, e.g. 6144,4096), got {text!r:.80}")
    return dims


def _positive_int(text: str) -> int:
    """One positive integer (``16``); signs, decimals and zero are refused."""
    if not _DIM_RE.fullmatch(text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r:.80}")
    return int(text)


def _printable(value: object) -> str:
    """``value`` as text safe for a terminal: printable characters as they are, every other
    one (control characters, ESC of a terminal escape sequence, line breaks, lone surrogates)
    as its ``\\x1b``-style escape. Output is always one line."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # a hostile __str__: say what it is instead
        text = f"<unprintable {type(value).__name__}>"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _number(value: object, width: int, digits: int, suffix: str = "") -> str:
    """A table's timing or ratio, right-aligned; ``-`` for a missing one, the escaped text
    for anything that is not a finite number."""
    if value is None:
        return f"{'-':>{width}s}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.nan
        if math.isfinite(number):
            return f"{number:{width}.{digits}f}{suffix}"
    return f"{_printable(value):>{width}s}"


def _need_gpu(what: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"hybridgemm {what}: needs a CUDA GPU, and this machine has none. "
          "(`hybridgemm show` and `hybridgemm explain` work anywhere.)", file=sys.stderr)
    return False


def _table_path(arg: str | None) -> Path:
    return Path(arg) if arg else user_table_path()


def _preset_shapes(preset, tp: int | None, mlp: bool = False) -> list:
    """A preset's attention projection shapes; with ``mlp`` also its MLP and LM-head shapes
    (``rank_projections(preset, 1)``); one rank's under ``--tp`` (all of them)."""
    if tp is None and mlp:
        tp = 1
    return list(preset.projections if tp is None else rank_projections(preset, tp))


def fp8_gate_up_shapes(shapes: list) -> list:
    """``shapes`` as a model patched with FP8 weights runs them: its gate/up is one GEMM over the
    stacked [gate; up] e4m3 rows at every M (split-K with the product in its epilogue at decode
    rows, fusion/models/fused_pieces.py; the dequantized GEMM past them, fusion/mlp.py), so a
    ``gate_up`` shape (one half's, which the bf16 gated product runs) becomes its stacked 2I rows."""
    return [replace(s, n=2 * s.n) if s.name == "gate_up" else s for s in shapes]


def _preset_gated(preset, tp: int | None = None) -> list:
    """The preset's gate/up for the gated kernel's entries, one rank's under ``tp`` (the width
    of ``rank_projections``' gate/up; patch fuses each rank's gate and up): none without a
    dense MLP width or with MLP biases (the tuner times no bias)."""
    if not preset.intermediate or preset.mlp_bias:
        return []
    width = next(s.n for s in rank_projections(preset, tp or 1) if s.name == "gate_up")
    return [GatedShape(width, preset.hidden, False, tuple(dict.fromkeys((None, preset.mlp_norm))))]


def _hf_config_shapes(path: str, tp: int | None, mlp: bool, gated: list | None = None) -> list:
    """``--hf-config PATH``'s shapes: under ``--tp``, one rank's (:func:`_tp_shapes`); else
    the GEMMs :func:`hybridgemm.patch` runs on the model the config builds (transformers, on
    the meta device; fusion/models/gemm_shapes.py): attention's, and with ``mlp`` the MLP's
    and the LM head's, and its gate/up shapes for the gated kernel appended to ``gated``. Where
    transformers cannot build it, the shapes the config's fields give (said on stderr).
    ``ValueError`` when the patched model runs none of the asked GEMMs."""
    if tp is not None:
        return _tp_shapes(path, tp, mlp, gated)
    try:
        _, model, _ = dry_run(path)
    except ValueError as e:
        preset = preset_from_hf_config(path)  # its own error where the fields do not do either
        print(f"hybridgemm autotune: {e}; tuning the shapes the config's fields give", file=sys.stderr)
        if mlp and gated is not None:
            gated += _preset_gated(preset)
        return _preset_shapes(preset, None, mlp)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        # transformers builds such a model; it fails on its first forward
        raise ValueError(f"{show_path(path)}: num_key_value_heads: {heads} attention heads are not a multiple of "
                         f"{kv_heads} key/value heads")
    attention, rest = patched_gemms(model)
    shapes = attention + (rest if mlp else [])
    if mlp and gated is not None:
        gated += [g for g in gated_shapes(model) if not g.bias]
    if not shapes:
        raise ValueError(f"{show_path(path)}: hybridgemm.patch runs no dispatched GEMM "
                         f"{'' if mlp else 'in the attention '}of the {type(model).__name__} it configures "
                         f"(`hybridgemm patch --dry-run --hf-config {path}` says why"
                         f"{'' if mlp else '; --mlp adds the MLP and LM head'})")
    return shapes


def _tp_shapes(path: str, tp: int, mlp: bool, gated: list | None = None) -> list:
    """``--hf-config PATH --tp N``: the GEMM shapes one of N ranks runs after
    :func:`hybridgemm.parallelize`, all of them (attention, MLP, LM head): the GEMMs ``patch``
    runs on the model the config builds, each part ``parallelize`` splits cut as it cuts it
    (the attention's heads, from the config's fields: ``rank_projections``; the MLP's columns:
    gate/up and up N / tp, down K / tp; the LM head's rows), a part it leaves whole (the layers
    of a family it does not split: GPT-NeoX, Falcon, Phi-3) whole, and with ``mlp`` the rank's
    gate/up shapes for the gated kernel appended to ``gated``. The config's fields alone (said
    on stderr) where transformers cannot build the model."""
    try:
        model = build_on_meta(path)[1]
    except ValueError as e:
        print(f"hybridgemm autotune: {e}; tuning the shapes the config's fields give", file=sys.stderr)
        return _preset_shapes(preset_from_hf_config(path), tp, mlp)
    # (tensor_parallel loads torch's functional collectives: only under --tp)
    from hybridgemm.parallel.tensor_parallel import split_parts

    try:
        split = split_parts(model, tp)
    except ValueError as e:  # a part that cannot be split tp ways
        raise ValueError(f"{show_path(path)}: {e}") from None
    patched = dry_run(path)[1]
    attention, rest = patched_gemms(patched)
    if mlp and gated is not None:  # a rank's gate/up: I / tp where the MLP is split
        for g in gated_shapes(patched):
            if not g.bias:
                gated.append(g if "mlp" not in split else
                             g._replace(intermediate=tp_split(g.intermediate, tp, "intermediate size")))
    if "attention" in split:  # the rank's heads, as the fields give them (no MLP, no head)
        preset = preset_from_hf_config(path)
        attention = list(rank_projections(replace(preset, intermediate=None, vocab=None, experts=0), tp))
    shapes = list(attention)
    for s in rest:
        if s.name == "lm_head" and "lm_head" in split:
            s = replace(s, n=tp_vocab_rows(s.n, tp))
        elif s.name in ("gate_up", "up") and "mlp" in split:
            s = replace(s, n=s.n // tp)
        elif s.name == "down" and "mlp" in split:
            s = replace(s, k=s.k // tp)
            if s.bias and tp > 1:  # only rank 0 adds a row-parallel layer's bias
                shapes.append(replace(s, name="down_nobias", bias=False))
        shapes.append(s)
    whole = {"attention", "mlp"} - split
    if whole and tp > 1:
        print(f"hybridgemm autotune: hybridgemm.parallelize leaves {' and '.join(f'the {p}' for p in sorted(whole))} "
              f"of the model {show_path(path)} configures whole on each rank: those GEMMs are tuned whole",
              file=sys.stderr)
    return shapes


def _cmd_autotune(args) -> int:
    # Shapes first: a bad --model, --hf-config, --shape or --tp is reported on any machine, GPU or not.
    if args.tp is not None and args.tp < 1:
        print(f"hybridgemm autotune: --tp takes the number of tensor-parallel ranks (1 or more), got {args.tp}",
              file=sys.stderr)
        return 2
    for flag, given in (("--tp", args.tp is not None), ("--mlp", args.mlp)):
        if given and not (args.model or args.hf_config):
            print(f"hybridgemm autotune: {flag} applies to --model and --hf-config (a --shape is tuned as given)",
                  file=sys.stderr)
            return 2
    shapes, gated = [], []
    for name in args.model or []:
        preset = get_preset(name)
        if preset.moe and (args.mlp or args.tp is not None):
            print(f"hybridgemm autotune: {preset.name} is a mixture of experts ({preset.experts} experts, "
                  f"{preset.experts_per_token} per token) whose experts run in the grouped MoE kernels, not as "
                  "dispatched GEMMs: no MLP shapes are tuned for it, only its router's and LM head's", file=sys.stderr)
        whole = [p for p in sorted(preset.tp_whole) if p == "attention" or preset.intermediate]  # (parts with shapes)
        if args.tp is not None and args.tp > 1 and whole:
            print(f"hybridgemm autotune: hybridgemm.parallelize leaves {' and '.join(f'the {p}' for p in whole)} "
                  f"of {preset.name} whole on each rank: those GEMMs are tuned whole", file=sys.stderr)
        shapes += _preset_shapes(preset, args.tp, args.mlp)  # (a --tp that does not split it: its error first)
        if args.mlp:
            gated += _preset_gated(preset, args.tp)
    for path in args.hf_config or []:
        try:
            shapes += _hf_config_shapes(path, args.tp, args.mlp, gated)
        except ValueError as e:
            print(f"hybridgemm autotune: {e}", file=sys.stderr)
            return 2
    if args.no_bias and not args.shape:
        print("hybridgemm autotune: --no-bias applies to --shape", file=sys.stderr)
        return 2
    shapes += [parse_shape(s, bias=not args.no_bias) for s in args.shape or []]
    moe_presets = [get_preset(name) for name in args.moe or []]
    dense = [p.name for p in moe_presets if not p.moe]
    if dense:
        print(f"hybridgemm autotune: --moe takes mixture-of-experts presets "
              f"({', '.join(n for n, p in PRESETS.items() if p.moe)}); "
              f"{', '.join(dense)} has no experts", file=sys.stderr)
        return 2
    if not shapes and not moe_presets:
        print("hybridgemm autotune: give --model NAME, --hf-config PATH, --shape N,K or --moe NAME", file=sys.stderr)
        return 2
    if moe_presets and (args.check or args.m):
        print("hybridgemm autotune: --moe tunes every M range of the experts (no --check or --m)", file=sys.stderr)
        return 2
    blocks = [f"{p.name}: {why}" for p in moe_presets if args.granularity == "block128"
              for why in [fp8.gate_up_blocks_problem(2 * p.expert_intermediate)] if why]
    if blocks:
        print(f"hybridgemm autotune: --granularity block128: {'; '.join(blocks)}", file=sys.stderr)
        return 2
    if moe_presets and not set(args.dtype) & {"bf16", "fp16"}:
        print(f"hybridgemm autotune: --moe tunes bf16 or fp16 experts, not {' '.join(args.dtype)}", file=sys.stderr)
        return 2

    bad = [m for m in args.m or [] if not 1 <= m <= M_MAX]
    if bad:
        print(f"hybridgemm autotune: --m takes values of M in 1..{M_MAX}, got {bad}", file=sys.stderr)
        return 2
    problem = _autotune_option_problem(args)
    if problem:
        print(f"hybridgemm autotune: {_printable(problem)}", file=sys.stderr)
        return 2
    if not _need_gpu("autotune"):
        return 2

    resolve_weight_options(args)
    if moe_presets:
        rc = _tune_moe_presets(moe_presets, args)
        if rc or not shapes:
            return rc
    if gated and not args.check and not args.granularity:
        _tune_gated(gated, args)
    if args.granularity:
        shapes = fp8_gate_up_shapes(shapes)
    seen, unique = set(), []
    for s in shapes:  # presets share shapes (e.g. q and o): tune each (N, K, bias, activation) once
        if (s.n, s.k, s.bias, s.activation) not in seen:
            seen.add((s.n, s.k, s.bias, s.activation))
            unique.append(s)
    weight_format = FORMAT_OF[args.granularity] if args.granularity else ""
    # patch(weights="fp8") quantizes projections, not a mixture-of-experts router, and the LM head
    # only with quantize_lm_head: those GEMMs keep the model's dtype, so their keys do too
    kept_names = {"router"} if args.quantize_lm_head else {"router", "lm_head"}
    kept = [s for s in unique if weight_format and s.name in kept_names]
    keys = tune_table.keys_for([s for s in unique if s not in kept], args.m, args.dtype, args.epilogue,
                               weight_format=weight_format) + tune_table.keys_for(kept, args.m, args.dtype,
                                                                                  args.epilogue)
    path = _table_path(args.out)
    table = TuningTable.load(path, signature=signature.current_signature())
    if args.check:
        entries = sorted({k for key in keys for k in table.covering(key)}, key=lambda k: k.to_string())
        rows = tune_table.check_table(table, entries)
        drifted = [r for r in rows if r.get("status") != "ok"]
        print(f"checked {len(rows)} entries of {path}: {len(drifted)} slower by more than 5% or rejected")
        return 1 if drifted else 0
    ranges = len({(k.m_lo, k.m_hi) for k in keys})
    todo = sum(1 for k in keys if args.force or not tune_table.covered(table, k))
    weights = f" with {weight_format} weights" if weight_format else ""
    print(f"tuning {len(keys)} M ranges{weights} ({len(unique)} shapes x {ranges} ranges x {len(args.dtype)} dtypes; "
          f"{len(keys) - todo} already covered) into {path}")
    results = tune_table.tune(keys, table, path, force=args.force, progress=not args.no_progress, jobs=args.jobs,
                              exhaustive=args.exhaustive, split_depth=args.split_depth)
    _print_summary(results)
    return 0 if all(r.skipped or r.winner for r in results) else 1


def _tune_moe_presets(presets, args) -> int:
    """The grouped MoE kernels' entries of each preset's experts (autotune_cache/tune_moe.py), in
    each of --dtype's 16-bit dtypes, with FP8 experts of --granularity under --weights fp8."""
    path = _table_path(args.out)
    table = TuningTable.load(path, signature=signature.current_signature())
    weight_format = FORMAT_OF[args.granularity] if args.granularity else ""
    for p in presets:
        for name in (d for d in args.dtype if d in ("bf16", "fp16")):
            weights = f", {weight_format} weights" if weight_format else ""
            print(f"tuning the {p.name} experts ({p.experts} of {p.expert_intermediate} x {p.hidden}, top-"
                  f"{p.experts_per_token}, {name}{weights}) at M 1..{tune_moe.MOE_M_MAX} into {path}")
            t0 = time.time()
            done = tune_moe.tune_into(table, path, p.experts, p.experts_per_token, p.expert_intermediate, p.hidden,
                                      dtype=NAME_TO_DTYPE[name], force=args.force, log=print,
                                      weight_format=weight_format)
            print(f"tuned {done} ranges of {p.name}'s experts in {time.time() - t0:.1f} s")
    return 0


def _tune_gated(gated, args) -> None:
    """The gated kernel's entries (autotune_cache/tune_glu.py) of each gate/up shape, at decode
    rows (those holding --m's values where given), for every norm prologue the patched model
    calls it with, in bf16 and fp16 of --dtype."""
    path = _table_path(args.out)
    table = TuningTable.load(path, signature=signature.current_signature())
    merged: dict[tuple, set] = {}
    for g in gated:
        merged.setdefault((g.intermediate, g.k), set()).update(g.norms)
    for dtype in [NAME_TO_DTYPE[d] for d in args.dtype if d in ("bf16", "fp16")]:
        for (i, k), norms in merged.items():
            shown = ", ".join(tune_glu.NORM_OPS[n] for n in sorted(norms, key=lambda n: (n is not None, n or "")))
            print(f"tuning gate/up {2 * i} x {k} ({shown}) at M 1..{tune_glu.GLU_M_MAX} into {path}")
            t0 = time.time()
            done = tune_glu.tune_into(table, path, i, k, norms, dtype, norm_apart=prologue_norm, force=args.force,
                                      m_values=args.m)
            print(f"tuned {done} gated ranges in {time.time() - t0:.1f} s")


EPILOGUE_EXAMPLES = "none, bias, relu, bias+relu, gelu_tanh, bias+gelu_tanh, gelu, bias+gelu"


def _autotune_option_problem(args) -> str:
    """What is wrong with autotune's numeric options, --epilogue or --out ("" if nothing), so
    that a mistake is reported at once, on any machine, not after a tuning run."""
    if args.split_depth < 0:
        return f"--split-depth must be 0 or more, got {args.split_depth}"
    if args.jobs is not None and args.jobs < 1:
        return f"--jobs takes the number of compiling processes (1 or more), got {args.jobs}"
    if args.exhaustive < 0:
        return f"--exhaustive takes how many extra cuBLASLt algorithms to time (0 or more), got {args.exhaustive}"
    for dtype in args.dtype:
        problem = weight_options_problem(args.weights, args.granularity, dtype)
        if problem:
            return problem
    if args.quantize_lm_head and args.weights != "fp8":
        return "--quantize-lm-head: only with --weights fp8"
    for name in args.epilogue or []:
        try:
            Epilogue.from_name(name)
        except ValueError:
            return f"--epilogue {name!r}: not an epilogue; expected one of {EPILOGUE_EXAMPLES}"
    return _table_out_problem(args.out) if args.out else ""


def _table_out_problem(out: str) -> str:
    """Why ``--out`` cannot be a table file ("" when it can): it must be a regular file or not
    exist yet, below a folder (or where one can be made)."""
    path = Path(out)
    if path.is_dir():
        return f"--out {out}: is a directory; give the table's file name (e.g. {path / 'table.json'})"
    if path.exists() and not path.is_file():
        return f"--out {out}: not a regular file"
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"--out {out}: {parent} is not a directory"
    return ""


def _print_summary(results) -> None:
    rows = [r for r in results if not r.skipped and r.winner]
    if not rows:
        return
    print(f"\n{'key':50s} {'winner':14s} {'µs at top':>9s} {'worst vs F.linear':>17s} {'next':>7s}  config")
    for r in rows:
        w = r.winner
        nxt = f"{r.runner_up:6.3f}x" if r.runner_up else "      -"
        print(f"{r.key.to_string():50s} {w['backend']:14s} {w['median_us']:9.2f} {r.worst_ratio:16.3f}x {nxt}  "
              f"{w['describe'][:60]}")


def _show_error(message: object) -> None:
    print(f"hybridgemm show: error: {_printable(message)}", file=sys.stderr)


def _explicit_table(path: Path, where: str) -> tuple[TuningTable | None, str]:
    """A table named explicitly (a path argument, ``--table`` or ``$HYBRIDGEMM_TABLE``, the
    last marked by ``where``), read strictly: ``(table, "")``, or ``(None, why)`` with why in
    one line, the same for ``show`` and ``explain``. A FIFO or device is refused unopened."""
    if not os.path.exists(path):
        return None, f"{path}{where}: no such file"
    if not os.path.isfile(path):
        return None, f"{path}{where}: not a regular file"
    try:
        return TuningTable.load(path, strict=True), ""
    except (TableError, OSError) as e:
        return None, f"{e}{where}" if str(path) in str(e) else f"{path}{where}: {e}"
    except Exception as e:  # the loader's own failure on hostile input: still one line
        return None, f"{path}{where}: cannot load it ({type(e).__name__}: {e})"


def _env_table() -> tuple[Path | None, str]:
    """``$HYBRIDGEMM_TABLE`` as a path (None when unset or empty), and the note that marks it."""
    env = os.environ.get("HYBRIDGEMM_TABLE") or None
    return (Path(env) if env else None), " (HYBRIDGEMM_TABLE)"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def _running_signature() -> tuple[dict | None, str]:
    """This machine's device signature (None without a CUDA GPU), and why it is missing
    when asking for it failed."""
    try:
        return signature.current_signature(), ""
    except Exception as e:  # a broken driver: the tables then apply nowhere here
        return None, f"the GPU's facts could not be read ({type(e).__name__}: {e})"


def _applicability(table: TuningTable, running: dict | None, failure: str = "") -> list[str]:
    """Whether ``table`` applies on this machine and, if only in part, which entries not."""
    why = failure or signature.why_not_applicable(table.signature, running)
    if why:
        return [f"  does not apply here: {_printable(why)}"]
    effects = table.version_effects(running)
    if not effects:
        return ["  applies here"]
    return ["  applies here, in part:"] + [f"    {_printable(effect.describe())}" for effect in effects]


def _print_backends() -> None:
    """Which backends can run on this machine and, for the others, why not."""
    missing = backends.unavailable_backends()
    print("backends on this machine:")
    for name in backends.PREFERENCE:
        state = f"unavailable: {missing[name]}" if name in missing else "available"
        print(f"  {name:14s} {_printable(state)}")


def _print_table(path: Path, table: TuningTable, notes: list[str] = ()) -> None:
    """The table's header line, then ``notes`` (whether it applies here), then its entries."""
    sig = table.signature if isinstance(table.signature, dict) else {}
    gpu, lt, tr = (_printable(sig.get(f, "?")) for f in ("gpu_name", "cublaslt_version", "triton_version"))
    print(f"{_printable(path)}: {len(table)} entries; GPU {gpu}, cuBLASLt {lt}, Triton {tr}")
    for line in notes:
        print(line)
    print(f"  {'key':52s} {'backend':14s} {'µs at top':>9s} {'F.linear µs':>11s} {'worst':>7s}  timed at M")
    for key in sorted(table.entries, key=lambda k: (k.dtype, k.epilogue, k.n, k.k, k.layout, k.m_lo)):
        e = table.entries[key]
        points = ",".join(_printable(m) for m in e.get("m_points") or ())
        print(f"  {_printable(key.to_string()):52s} {_printable(e.get('backend', '?')):14s} "
              f"{_number(e.get('median_us'), 9, 2)} {_number(e.get('flinear_us'), 11, 2)} "
              f"{_number(e.get('worst_ratio'), 6, 3, 'x')}  {points}")


def _cmd_show(args) -> int:
    """Print tables. An explicit one (PATH, else ``$HYBRIDGEMM_TABLE``) is read strictly: if it
    is missing, unreadable or corrupt, one line says why and the exit code is 1. Without
    PATH, the user table and the shipped tables follow (a bad one there warns and shows empty)."""
    env, env_where = _env_table()
    explicit = Path(args.path) if args.path else env
    where = "" if args.path or explicit is None else env_where
    others = [] if args.path else [p for p in [_table_path(None)] if p.exists()] + shipped_table_paths()
    if explicit is not None:
        others = [p for p in others if not _same_file(p, explicit)]
    if explicit is None and not others:
        print("no tables: run `hybridgemm autotune` on a GPU machine", file=sys.stderr)
        return 1
    rc = 0
    running, failure = _running_signature()
    if explicit is not None:
        table, problem = _explicit_table(explicit, where)
        if table is None:
            _show_error(problem)
            return 1
        _print_table(explicit, table, _applicability(table, running, failure))
    for path in others:
        if not os.path.isfile(path):
            _show_error(f"{path}: not a regular file; skipped")
            rc = 1
            continue
        try:
            table = TuningTable.load(path, strict=False)
        except Exception as e:  # a bad table here warns and loads empty; anything else: one line
            _show_error(f"{path}: cannot load it ({type(e).__name__}: {e})")
            rc = 1
            continue
        # a bad table loads empty (no source), with a warning saying why
        _print_table(path, table, _applicability(table, running, failure) if table.sources else [])
    _print_backends()
    return rc


def _record_text(backend: str, record: dict) -> str:
    """A table entry's config in words, from its record alone (no GPU, no library needed)."""
    if backend == "cublaslt":
        if not record:
            return " [heuristic at the exact M]"
        names = " ".join(str(record[f]) for f in ("tile_name", "stages_name") if f in record)
        return f" [algo {record.get('algo_id', '?')} {names} splitk={record.get('splitk', '?')}]"
    if not record:
        return ""
    return " [" + " ".join(f"{k}={v}" for k, v in record.items() if k != "kind") + "]"


def _explain_for_device(args) -> int:
    """``explain --device NAME``: what a GPU of that model runs for the call, from its shipped
    table alone (with the table's own cuBLASLt and Triton versions), on any machine, touching
    no GPU."""
    path = shipped_table_for_device(args.device)
    if path is None:
        known = ", ".join(f"{stem} ({gpu})" if gpu else stem
                          for stem, (_, gpu) in sorted(shipped_devices().items())) or "none"
        print(f"hybridgemm explain: error: --device {_printable(args.device)}: no shipped table for this GPU; "
              f"known devices: {_printable(known)}", file=sys.stderr)
        return 2
    table = TuningTable.load(path, strict=True)  # a TableError (ValueError) ends as one line, rc 2
    dtype = NAME_TO_DTYPE[args.dtype]
    *lead, k = args.x
    n, wk = args.w
    if k != wk:
        raise ValueError(f"x_shape {tuple(args.x)} has {k} features, w_shape expects {wk}")
    m = math.prod(lead)
    epilogue = Epilogue(Activation.parse(args.activation), not args.no_bias)
    fmt_granularity = args.granularity or "channel"
    fmt = FORMAT_OF[fmt_granularity] if args.weights == "fp8" else ""
    problem = Problem(m=m, n=n, k=k, dtype=dtype, epilogue=epilogue, ldx=k, ldw=k, ldo=n, tf32=uses_tf32(dtype),
                      weight_format=fmt)
    sig = table.signature
    weight = f" {fmt} weight" if fmt else ""
    print(f"linear {args.dtype}{weight} M={m} N={n} K={k} epilogue={epilogue.name}, on an "
          f"{_printable(sig.get('gpu_name'))} ({_printable(sig.get('sm_count'))} SMs) with cuBLASLt "
          f"{_printable(sig.get('cublaslt_version'))} and Triton {_printable(sig.get('triton_version'))} "
          f"(shipped table {path.name})")
    shape = ShapeKey.from_problem(problem)
    hit = table.find(shape, m) if m <= M_MAX else None
    w8a8 = fmt and args.activations == "fp8"
    dequantized = (f"the weight dequantized to {args.dtype} in one pass, then {args.dtype}'s decision for this "
                   "N, K: the same `hybridgemm explain --device` without --weights")
    if hit is None:
        print(f"  key {shape.to_string()} at M={m}")
        why = _printable(_why_no_entry(table, shape, m))
        sms = sig.get("sm_count")
        splitk = fmt and fp8_decode_config(problem, sms if isinstance(sms, int) else None)
        if splitk:  # decide.choose_fp8's rule 5
            print(f"  runs triton_splitk (rule: {why}; M={m} <= {DECODE_MAX_M}: the split-K kernel streaming "
                  "e4m3, its default config)")
        else:
            print(f"  runs torch (rule: {why}; {dequantized if fmt else 'F.linear'})")
        if w8a8:
            print(f"  activations='fp8': {w8a8_line(m, 'triton_splitk' if splitk else 'torch', fmt_granularity, None)}")
        return 0
    key, entry = hit
    points = ",".join(str(p) for p in entry["m_points"])
    baseline = "the dequantize-then-F.linear fallback's" if fmt else "F.linear's"
    reason = (f"tuned for M {key.m_lo}-{key.m_hi}, timed at M={points}: worst {entry['worst_ratio']:.3f}x "
              f"{baseline} speed there")
    backend = entry["backend"]
    print(f"  key {key.to_string()}")
    if backend == "torch":
        print(f"  runs torch (table: {reason}; runs {dequantized if fmt else 'F.linear'})")
    else:
        print(f"  runs {_printable(backend)}{_printable(_record_text(backend, entry['config']))} (table: {reason})")
    if w8a8:
        print(f"  activations='fp8': {w8a8_line(m, backend, fmt_granularity, None)}")
    if backend == "cublaslt" and entry["config"]:
        print(f"  under another cuBLASLt than {_printable(sig.get('cublaslt_version'))} this entry runs F.linear")
    elif signature.is_triton_backend(backend):
        print(f"  under another Triton than {_printable(table.tuned_triton(key))} this config is first "
              "checked once against an fp32 reference")
    return 0


def _explain_flags(dtype: str, epilogue: str) -> str:
    """The ``explain`` flags that ask for ``dtype`` and ``epilogue`` beyond the defaults
    (bf16, bias): ``fp16``, ``relu`` -> ``--dtype fp16 --no-bias --activation relu``."""
    epi = Epilogue.from_name(epilogue)
    flags = ([] if dtype == "bf16" else [f"--dtype {dtype}"]) + ([] if epi.bias else ["--no-bias"])
    flags += [f"--activation {epi.activation.value}"] if epi.activation is not Activation.NONE else []
    return " ".join(flags)


def _why_no_entry(table: TuningTable, shape: ShapeKey, m: int) -> str:
    """Why ``table`` has no entry for ``shape`` at ``m``, naming what it holds instead: M past
    the ranges, no range of this shape holding M, or this N, K only with other epilogues or
    dtypes (and the flags that ask for them)."""
    if m > M_MAX:
        return f"M={m} is past the table's ranges (M 1-{M_MAX})"
    ranges = sorted((k.m_lo, k.m_hi) for k in table.entries if k.shape == shape)
    if ranges:
        return (f"no entry of this shape holds M={m} (its ranges: "
                + ", ".join(f"{lo}-{hi}" for lo, hi in ranges[:6]) + (", ..." if len(ranges) > 6 else "") + ")")
    same_nk = {(k.dtype, k.epilogue) for k in table.entries
               if (k.op, k.n, k.k, k.layout) == (shape.op, shape.n, shape.k, shape.layout)}
    head = f"the table has no entry for N={shape.n} K={shape.k} with {shape.dtype} and epilogue {shape.epilogue}"
    if not same_nk:
        return f"{head}, nor any for this N, K (`hybridgemm autotune --shape {shape.n},{shape.k}` on that GPU tunes it)"
    held = [f"{dt} epilogue {epi}" + (f" ({flags})" if (flags := _explain_flags(dt, epi)) else "")
            for dt, epi in sorted(same_nk)]
    return f"{head}; it holds {', '.join(held)}"


def _cmd_explain(args) -> int:
    """Shapes are checked by the parser (:func:`_ints`, :func:`_weight_shape`) and by
    :func:`explain` (K must match); ``--device`` must be a GPU model a shipped table is for.
    The explicit table (``--table``, else ``$HYBRIDGEMM_TABLE``) must load as ``show`` loads
    it: if not, the line ``show`` prints for it, and exit code 2."""
    problem = weight_options_problem(args.weights, args.granularity, args.dtype)
    if not problem and args.activations == "fp8" and args.weights != "fp8":
        problem = "--activations fp8: only with --weights fp8 (an FP8 projection's option)"
    if problem:
        print(f"hybridgemm explain: error: {problem}", file=sys.stderr)
        return 2
    if args.device is not None:
        return _explain_for_device(args)
    env, env_where = _env_table()
    explicit, where = (Path(args.table), "") if args.table is not None else (env, env_where)
    if explicit is not None:
        table, problem = _explicit_table(explicit, where)
        if table is None:
            print(f"hybridgemm explain: error: {_printable(problem)}", file=sys.stderr)
            return 2
    if args.table is not None:
        set_table_path(args.table)
    weights = "fp8" if args.weights == "fp8" else "same"
    print(explain(args.x, args.w, args.dtype, bias=not args.no_bias, activation=args.activation, weights=weights,
                  granularity=args.granularity or "channel", activations=args.activations))
    _print_backends()
    return 0


def _cmd_demo(args) -> int:
    sizes = {"M x K": args.m * args.k, "N x K": args.n * args.k, "M x N": args.m * args.n}
    over = {name: size for name, size in sizes.items() if size > DEMO_MAX_ELEMENTS}
    if over:
        print(f"hybridgemm demo: error: --m {args.m} --n {args.n} --k {args.k}: "
              + ", ".join(f"{name} = {size}" for name, size in over.items())
              + f" elements, over the demo's {DEMO_MAX_ELEMENTS} (2^{DEMO_MAX_ELEMENTS.bit_length() - 1}) per operand",
              file=sys.stderr)
        return 2
    return run_demo(m=args.m, n=args.n, k=args.k)


def _preset_shape_sets() -> dict[str, dict[str, set[tuple[int, int]]]]:
    """Per preset, the (N, K) of its GEMMs by kind: ``attention`` (q, k/v, qkv, o), ``mlp``
    (gate/up, down, LM head, where the preset knows them) and ``tp2`` (one rank's, tp=2)."""
    sets = {}
    for name, preset in PRESETS.items():
        attention = {(p.n, p.k) for p in preset.projections}
        mlp = {(p.n, p.k) for p in rank_projections(preset, 1)} - attention
        try:
            tp2 = {(p.n, p.k) for p in rank_projections(preset, 2)}
        except ValueError:  # a model that does not split two ways
            tp2 = set()
        sets[name] = {"attention": attention, "mlp": mlp, "tp2": tp2}
    return sets


def _print_table_summary(path: Path, table: TuningTable, notes: list[str]) -> None:
    """A table in counts: its header line, ``notes``, entries per backend, and per preset the
    entries of its attention, MLP/LM-head and tp=2 shapes (``show`` lists every entry)."""
    sig = table.signature if isinstance(table.signature, dict) else {}
    gpu, lt, tr = (_printable(sig.get(f, "?")) for f in ("gpu_name", "cublaslt_version", "triton_version"))
    print(f"{_printable(path)}: {len(table)} entries; GPU {gpu}, cuBLASLt {lt}, Triton {tr}")
    for line in notes:
        print(line)
    backends_count: dict[str, int] = {}
    for entry in table.entries.values():
        name = _printable(entry.get("backend", "?"))
        backends_count[name] = backends_count.get(name, 0) + 1
    print("  by backend: " + ", ".join(f"{name} {n}" for name, n in
                                       sorted(backends_count.items(), key=lambda item: (-item[1], item[0]))))
    shapes = [(k.n, k.k) for k in table.entries]
    print(f"  {'by preset':14s} {'attention':>9s} {'MLP+LM head':>11s} {'tp=2 shards':>11s}")
    claimed: set[tuple[int, int]] = set()
    for name, kinds in _preset_shape_sets().items():
        counts = [sum(1 for nk in shapes if nk in kinds[kind]) for kind in ("attention", "mlp", "tp2")]
        claimed |= set().union(*kinds.values())
        if any(counts):
            print(f"  {name:14s} " + " ".join(f"{c or '-':>{w}}" for c, w in zip(counts, (9, 11, 11))))
    other = sum(1 for nk in shapes if nk not in claimed)
    if other:
        print(f"  {'other shapes':14s} {other:>9d}")
    print("  (presets that share a shape each count its entries; `hybridgemm show` lists every entry)")


def _redraw_committed_figures(out: Path) -> int:
    """The README's figures redrawn from the committed H200 CSVs into ``out`` through
    ``hybridgemm plot`` (the command is printed); 0 when there are none to redraw (an
    installed wheel has no perf/results/)."""
    sources = figure_sources(RESULTS_DIR / "h200")
    if not sources:
        print("no committed H200 results here (perf/results/h200/ is in the source tree): no figures redrawn")
        return 0

    def shown(p: Path) -> str:
        try:
            return str(p.relative_to(Path.cwd()))
        except ValueError:
            return str(p)

    print(f"redrawing the README's figures from the committed H200 results:\n  hybridgemm plot "
          f"{' '.join(shown(p) for p in sources)} --out {out}")
    return cmd_plot(argparse.Namespace(csv=[str(p) for p in sources], out=str(out)))


def _cmd_main(args) -> int:
    """The README's main job. GPU: tune the preset into the user table, then benchmark every
    provider beside F.linear and draw its figures (perf/results/<gpu>/). CPU: the CPU path
    checked against fp64 and the shipped tables in counts. Both: the README's figures redrawn
    from the committed H200 results into out/plots/. Exit code: the worst of the steps'."""
    preset = get_preset(args.model).name  # an unknown name: one line and exit 2, before anything runs
    out = Path("out/plots")
    if torch.cuda.is_available():
        rc = _cmd_autotune(build_parser().parse_args(["autotune", "--model", preset]))
        if rc:
            return rc
        gpu = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "-")
        results = Path("perf/results") / gpu
        results.mkdir(parents=True, exist_ok=True)
        bench = build_parser().parse_args(["bench", "--model", preset, "--out", str(results / "bench.csv"),
                                           "--plot", str(results / "plots")])
        return max(bench.fn(bench), _redraw_committed_figures(out))
    rc = run_demo()
    running, failure = _running_signature()
    for path in shipped_table_paths():
        table = TuningTable.load(path, strict=False)  # a bad one warns and counts as empty
        _print_table_summary(path, table, _applicability(table, running, failure) if table.sources else [])
    return max(rc, _redraw_committed_figures(out))


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``hybridgemm CMD: error: ...``, and exit code 2
    (``--help`` shows the usage); subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {_printable(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="hybridgemm", description="Bias-fused GEMMs for PyTorch: tools.")
    ap.add_argument("--version", action="version", version=f"hybridgemm {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("autotune", help="time every backend's candidates per shape and M range; fill the table")
    p.add_argument("--model", action="append", help="model preset (repeatable): bert-base, gpt2, llama3-8b, ...")
    p.add_argument("--shape", action="append", help="explicit N,K projection shape (repeatable)")
    p.add_argument("--no-bias", action="store_true",
                   help="the --shape projections have no bias (as a mixture-of-experts router's GEMM)")
    p.add_argument("--moe", action="append", metavar="NAME",
                   help="a mixture-of-experts preset (repeatable): tune the grouped MoE kernels' configs for its "
                   "experts at every M range against the grouped torch._grouped_mm baseline (with --weights fp8: "
                   "FP8 experts of --granularity, the baseline dequantizing them)")
    p.add_argument("--hf-config", action="append", metavar="PATH",
                   help="a Hugging Face config.json, or a local model directory holding one: tune the "
                   "attention GEMMs hybridgemm.patch runs on the model it configures (built by transformers "
                   "on the meta device, nothing fetched; without transformers, or under --tp, the q, k/v, qkv "
                   "and o shapes its fields give); repeatable")
    p.add_argument("--mlp", action="store_true",
                   help="also tune the MLP's gate/up and down and the LM head of --model / --hf-config, the "
                   "GEMMs hybridgemm.patch runs through the dispatcher (where the model's sizes are known; a "
                   "mixture-of-experts model's experts are not such GEMMs: its router and LM head only), and the gated "
                   "kernel's configs for gate/up at decode rows, with and without the norm before it (under --tp "
                   "one rank's gate/up; with --weights fp8 the GEMM over the stacked gate and up rows instead, "
                   "which an FP8 gate/up runs at every M)")
    p.add_argument("--tp", type=int, metavar="N",
                   help="tensor-parallel degree: tune the shapes each of N ranks runs after "
                   "hybridgemm.parallel.parallelize (q/kv/qkv/o with the rank's heads; the MLP's gate/up and "
                   "down and the LM head where the model's sizes are known; the layers of a family parallelize "
                   "leaves whole (Phi-3, GPT-NeoX, Falcon) at full size); for --model and --hf-config")
    p.add_argument("--m", type=int, nargs="+", help="tune the M ranges holding these M (default: every range, "
                   "1 to 16384: 1, 2, 3-4, 5-8, ..., 8193-16384)")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32", "tf32"])
    p.add_argument("--epilogue", nargs="+",
                   help="epilogue names (default: each shape's own: bias if it has one, and with --hf-config the "
                        "MLP's activation of a linear whose GEMM carries it, e.g. bias+gelu)")
    add_weight_options(p, "tune the shapes with an FP8 weight, its own table keys (op linear_e4m3_<granularity>), "
                          "against the weight dequantized per call, then F.linear; as patch(weights='fp8') runs them: "
                          "an LM head and a mixture-of-experts router keep the model's dtype")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --weights fp8: the LM head's keys in the FP8 format too, as patch(..., weights='fp8', "
                        "quantize_lm_head=True) runs it")
    p.add_argument("--out", help="table path (default: the user table; see README)")
    p.add_argument("--force", action="store_true", help="re-tune keys already in the table")
    p.add_argument("--check", action="store_true", help="re-time the table's winners and report drift")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--exhaustive", type=int, default=0, metavar="N",
                   help="also time up to N cuBLASLt algorithms from its exhaustive enumeration (slower)")
    p.add_argument("--split-depth", type=int, default=1, metavar="D",
                   help="halve a range one config cannot serve whole, up to D times (default 1; 0: never)")
    p.add_argument("--jobs", type=int, help="processes compiling Triton candidates before timing "
                   "(default: half the CPUs, at most 8; 1: compile lazily while tuning)")
    p.set_defaults(fn=_cmd_autotune)

    p = sub.add_parser("show", help="print a tuning table (default: the user table and the shipped ones)")
    p.add_argument("path", nargs="?")
    p.set_defaults(fn=_cmd_show)

    p = sub.add_parser("explain", help="which kernel runs for these shapes, and why")
    p.add_argument("--x", type=_ints, required=True, help="input shape, e.g. 16,4096 or 2,8,4096")
    p.add_argument("--w", type=_weight_shape, required=True, help="weight shape N,K, e.g. 6144,4096")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--activation", choices=["relu", "gelu_tanh", "gelu"])
    add_weight_options(p, "the weight is FP8 (hybridgemm.quantize_fp8), its own table key")
    p.add_argument("--activations", choices=["same", "fp8"], default="same",
                   help="fp8: also say whether x is quantized to e4m3 for cuBLASLt's FP8 GEMM at this M "
                        "(patch(..., activations='fp8'); with --weights fp8)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--table", help="explicit table path (over the user and shipped tables)")
    where.add_argument("--device", metavar="GPU", help="answer for a GPU of this model from its shipped table "
                       "(e.g. h200), on any machine")
    p.set_defaults(fn=_cmd_explain)

    p = sub.add_parser("demo", help="one bias-fused GEMM per backend, checked and timed beside F.linear")
    p.add_argument("--m", type=_positive_int, default=16, help="rows of x (default 16)")
    p.add_argument("--n", type=_positive_int, default=6144, help="output features (default 6144)")
    p.add_argument("--k", type=_positive_int, default=4096, help="input features (default 4096)")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("main", help="the main job (README): on a GPU tune + bench the preset; on a CPU the "
                                    "CPU path and the shipped table; both redraw the README's figures")
    p.add_argument("--model", default="llama3-8b", help=f"model preset: {', '.join(PRESETS)}")
    p.set_defaults(fn=_cmd_main)

    add_bench_parser(sub)
    add_plot_parser(sub)
    add_patch_parser(sub)
    return ap


# Commands that never show a traceback: any failure is one line on stderr.
_ONE_LINE_COMMANDS = frozenset({"show", "explain", "demo", "main"})


def _quiet_stdout() -> None:
    """After a broken pipe (``hybridgemm show | head``): send what is left of stdout to
    /dev/null, so that the interpreter's final flush does not report it again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a descriptor (captured)
        pass


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command
    guarded = command in _ONE_LINE_COMMANDS
    try:
        return int(args.fn(args) or 0)
    except BrokenPipeError:
        if not guarded:
            raise
        _quiet_stdout()
        return 1
    except (ValueError, OSError) as e:  # bad shapes, names, files: a message, not a traceback
        print(f"hybridgemm {command}: error: {_printable(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not guarded:
            raise
        print(f"hybridgemm {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # last resort: an unexpected failure is still one line, not a traceback
        if not guarded:
            raise
        print(f"hybridgemm {command}: error: {type(e).__name__}: {_printable(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
