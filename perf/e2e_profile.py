"""Where a decode step's GPU time goes (GPU machine): CUDA kernel time per token of a
random-weight HF model, stock beside patched, grouped by what the kernel does.

    python -m hybridgemm.perf.e2e_profile --model llama3-8b --layers 8 --batch 1 8 \
        [--modes compiled_static eager_static prefill] [--steps 16] [--prefill 2048] [--out CSV] \
        [--by-grid] [--weights fp8 [--granularity channel|block128] [--quantize-lm-head] [--fp8-activations]]

Each variant decodes greedily over a static cache exactly as ``hybridgemm bench --e2e`` does
(perf/bench_e2e.py's decoder, compiled with "reduce-overhead" and fullgraph for
``compiled_static``); ``--steps`` steps run under torch.profiler (CUDA activity only, which
records each kernel of a CUDA-graph replay too) after the warm-up. ``prefill`` profiles ``--steps``
eager forwards of a ``--prefill``-token prompt at batch 1, as ``bench --e2e``'s prefill mode
runs them (logits of the last position only); its rows are per prefill, not per token. Every kernel is put in a
group by its name (:func:`group_of`): ``gemm`` (cuBLAS/cuBLASLt, and hybridgemm's Triton GEMM,
gated and MoE kernels), ``attention`` (SDPA's kernels), ``norm``, ``activation``, ``rotary``,
``kv_cache``, ``routing`` (``torch.topk``'s kernels, hybridgemm's routing kernel), ``quantize``
(hybridgemm's kernels that round x to e4m3 or expand an FP8 weight), ``copy``,
``elementwise`` and ``other``. Inductor's kernels are grouped by the
ops their names list (a kernel fusing rotary with the KV-cache write counts as rotary); an
eager RMSNorm's casts, multiplies and add count as copy and elementwise. The table printed per
(mode, batch) gives µs per token and per layer of each group for both variants, the step's
kernel time against its HBM floor (weight bytes / the GPU's read rate, bench_e2e.hbm_floor_ms) and, for the GEMMs, the
fraction of the floor their bytes alone would allow. ``--by-grid`` keys each kernel by its
launch grid too, so the shapes one Triton kernel runs (Q/K/V, O, down) get a row each. Kernel
time excludes the gaps between kernels: the wall time per token of ``bench --e2e`` minus this
sum is launch and host time. With ``--weights fp8`` the patched variant is ``patch(model,
weights="fp8", granularity=...)`` (named ``hybridgemm_e4m3_<granularity>`` in the CSV; with
``--quantize-lm-head`` its LM head too, ``_head`` added to the name; with ``--fp8-activations``
also ``activations="fp8"``, W8A8 past the decode rows, ``_w8a8`` added), and the decode tables add
its own floor (the bytes it reads: e4m3 projections, their scales, the bf16 rest).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

import hybridgemm
from hybridgemm.perf import csvio
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf.bench_e2e import PREFILL, WARMUP, Run, decoder, positive_int, step_bytes, tokens
from hybridgemm.perf.bench_msweep import git_commit
from hybridgemm.perf.read_ceiling import hbm_floor_ms, read_rate_note
from hybridgemm.perf.weight_formats import add_weight_options, resolve_weight_options, weight_options_problem

DECODE_MODES = ("compiled_static", "eager_static")
MODES = (*DECODE_MODES, "prefill")
GEMM = re.compile(r"nvjet|gemm|gemv|xmma|cutlass|_glu_kernel|_splitk_kernel|_reduce_kernel|splitKreduce|_moe_pair_|"
                  r"_moe_kernel", re.I)
ATTENTION = re.compile(r"flash|fmha|cudnn.*sdpa|attention_kernel", re.I)  # SDPA's own kernels
# Inductor names a fused kernel after the ops it fuses (triton_poi_fused_<ops>_<n>): the most
# telling op decides, in this order.
INDUCTOR = re.compile(r"^triton_(?:poi|red|per)_fused_(.*)$")
FUSED_OPS = (
    ("norm", re.compile(r"(^|_)(rsqrt|mean|var_mean)(_|$)")),
    ("activation", re.compile(r"(^|_)(silu|gelu|sigmoid)(_|$)")),
    ("rotary", re.compile(r"(^|_)(cos|sin|neg)(_|$)")),
    ("kv_cache", re.compile(r"index_copy|index_put|scatter")),
    ("other", re.compile(r"(^|_)(argmax|max|topk)(_|$)")),
)
# Eager ATen kernels, by functor or kernel name. An eager RMSNorm is also two casts and two
# multiplies and an add, which land in copy and elementwise: only its pow, mean and rsqrt
# kernels are told apart here.
ATEN = (
    ("norm", re.compile(r"_rms_norm_kernel|layer_norm|MeanOps|rsqrt|pow_tensor_scalar")),  # ours, then the stock ops
    ("quantize", re.compile(r"_quantize_(token|block)_kernel|_dequant")),  # x to e4m3 (W8A8); weights to bf16
    ("activation", re.compile(r"silu|gelu|sigmoid", re.I)),
    # (ours: the rotary alone, or with the q/k norms and the cache write)
    ("rotary", re.compile(r"neg_kernel|CatArray|_qk_norm_rope_store_kernel|_qk_rope_kernel")),
    ("kv_cache", re.compile(r"index_copy|index_put|scatter")),
    ("routing", re.compile(r"sbtopk|bitonicSort|_route_kernel")),  # torch.topk's select and sort; ours
    ("copy", re.compile(r"copy_kernel|direct_copy")),
    ("other", re.compile(r"ArgMax|Memset|FillFunctor|indexSelect|reduce_kernel")),
)
COLUMNS = ("model", "layers", "mode", "batch", "variant", "group", "kernel", "calls_per_token", "us_per_token",
           "us_per_layer", "date", "commit", "command")


def group_of(kernel: str) -> str:
    """What a kernel does, from its name: gemm, attention, norm, activation, rotary, kv_cache,
    routing, quantize, copy, elementwise or other (see the module docstring)."""
    if GEMM.search(kernel):
        return "gemm"
    fused = INDUCTOR.match(kernel)
    if fused:
        return next((g for g, p in FUSED_OPS if p.search(fused.group(1))), "elementwise")
    if ATTENTION.search(kernel):
        return "attention"
    return next((g for g, p in ATEN if p.search(kernel)), "elementwise")


def kernel_times(steps, n: int, by_grid: bool = False) -> dict[str, tuple[int, float]]:
    """``{kernel name: (calls, total µs)}`` of the CUDA kernels ``steps(n)`` runs; ``by_grid``:
    keyed by name and launch grid (``name grid=x,y,z``), which tells apart the shapes one
    kernel (a Triton GEMM) runs."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        steps(n)
        torch.cuda.synchronize()
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    if by_grid:
        for name, grid, us in _trace_kernels(prof):
            slot = out[f"{name} grid={','.join(map(str, grid))}"]
            slot[0] += 1
            slot[1] += us
        return {k: (c, us) for k, (c, us) in out.items()}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            slot = out[ev.name]
            slot[0] += 1
            slot[1] += ev.device_time
    return {k: (c, us) for k, (c, us) in out.items()}


def _trace_kernels(prof) -> list[tuple[str, list, float]]:
    """``(name, grid, µs)`` of each kernel in the profiler's trace (its launch grid is recorded
    only there)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return [(e["name"], list(e.get("args", {}).get("grid", ())), float(e["dur"])) for e in events
            if e.get("cat") == "kernel" and e.get("dur", 0) > 0]


def profile_variant(run: Run, model, mode: str, batch: int, steps: int,
                    by_grid: bool = False) -> dict[str, tuple[int, float]]:
    if mode == "prefill":
        api = hf.forward_api(model)
        ids = tokens(1, run.prefill, model.config.vocab_size, run.device)

        def forwards(n: int) -> None:
            for _ in range(n):
                hf.prefill_forward(model, api, ids)

        forwards(2)  # warm-up: Triton compiles, cuBLASLt plans
        torch.cuda.synchronize()
        return kernel_times(forwards, steps, by_grid)
    step = decoder(run, model, batch, compiled=mode == "compiled_static")
    step(WARMUP)  # compilation, CUDA-graph warm-up and recording
    torch.cuda.synchronize()
    return kernel_times(step, steps, by_grid)


def rows_for(args, mode, batch, variant, times, steps) -> list[dict]:
    rows = []
    for kernel, (calls, us) in sorted(times.items(), key=lambda kv: -kv[1][1]):
        rows.append({"model": args.model, "layers": args.layers, "mode": mode, "batch": batch, "variant": variant,
                     "group": group_of(kernel), "kernel": kernel[:200], "calls_per_token": calls / steps,
                     "us_per_token": us / steps, "us_per_layer": us / steps / args.layers})
    return rows


def summary(rows: list[dict], floor_ms: float | None, layers: int) -> str:
    """The per-group table of one (mode, batch): µs per token and per layer for each variant;
    ``floor_ms`` None (prefill): no HBM floor line."""
    by = defaultdict(float)
    variants = sorted({r["variant"] for r in rows}, key=lambda v: v != "stock")
    for r in rows:
        by[(r["variant"], r["group"])] += r["us_per_token"]
    groups = sorted({g for _, g in by}, key=lambda g: -max(by[(v, g)] for v in variants))
    head = f"{'group':12s}" + "".join(f"{v + ' µs/tok':>22s}{'µs/layer':>10s}" for v in variants)
    lines = [head]
    for g in groups:
        lines.append(f"{g:12s}" + "".join(f"{by[(v, g)]:22.1f}{by[(v, g)] / layers:10.1f}" for v in variants))
    totals = {v: sum(by[(v, g)] for g in groups) for v in variants}
    lines.append(f"{'total':12s}" + "".join(f"{totals[v]:22.1f}{totals[v] / layers:10.1f}" for v in variants))
    gemms = "GEMM kernels alone: " + ", ".join(f"{v} {by[(v, 'gemm')]:.1f} µs" for v in variants)
    if floor_ms is None:
        lines.append(gemms)
    else:
        lines.append(f"HBM floor {floor_ms * 1e3:.1f} µs/token; kernel time as a fraction of it: "
                     + ", ".join(f"{v} {floor_ms * 1e3 / totals[v]:.1%}" for v in variants if totals[v])
                     + "; " + gemms)
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.e2e_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=hf.model_names())
    ap.add_argument("--layers", type=positive_int, help="decoder layers (default: the model's own)")
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(DECODE_MODES),
                    help=f"default: the decode modes, {' '.join(DECODE_MODES)}")
    ap.add_argument("--steps", type=positive_int, default=16,
                    help="decode steps (prefill mode: forwards) profiled (default 16)")
    ap.add_argument("--prefill", type=positive_int, default=PREFILL,
                    help=f"prompt length of the prefill mode (default {PREFILL})")
    ap.add_argument("--out", help="CSV of every kernel's time per token (default: none)")
    ap.add_argument("--by-grid", action="store_true",
                    help="one row per kernel and launch grid (tells apart the shapes of one Triton kernel)")
    add_weight_options(ap, "the patched model's projections quantized to e4m3 (patch(weights='fp8'))")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="with --weights fp8: the LM head in e4m3 too (patch(quantize_lm_head=True))")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="with --weights fp8: patch(activations='fp8'), W8A8 past the decode rows")
    args = ap.parse_args(argv)
    problem = weight_options_problem(args.weights, args.granularity)
    for flag in ("quantize_lm_head", "fp8_activations"):
        if not problem and getattr(args, flag) and args.weights != "fp8":
            problem = f"--{flag.replace('_', '-')}: only with --weights fp8"
    if problem:
        ap.error(problem)
    resolve_weight_options(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("e2e_profile: needs a CUDA GPU (none found here); run it on the GPU machine", file=sys.stderr)
        return 2
    config = hf.hf_config(args.model, layers=args.layers)
    args.layers = config.num_hidden_layers
    torch.manual_seed(0)
    stock = hf.build_model(config, torch.bfloat16, "cuda")
    patched = copy.deepcopy(stock)
    fp8 = {} if args.granularity is None else {"weights": "fp8", "granularity": args.granularity,
                                               "quantize_lm_head": args.quantize_lm_head}
    if args.fp8_activations:
        fp8["activations"] = "fp8"
    print(hybridgemm.patch(patched, **fp8).summary())
    head = "_head" if args.quantize_lm_head else ""
    w8a8 = "_w8a8" if args.fp8_activations else ""
    name = "hybridgemm" if not fp8 else f"hybridgemm_e4m3_{args.granularity}{head}{w8a8}"
    run = Run(args.model, config, torch.device("cuda"), tokens=args.steps, prefill=args.prefill, rounds=1)
    command = "python -m hybridgemm.perf.e2e_profile " + " ".join(sys.argv[1:] if argv is None else argv)
    extra = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
             "command": csvio.command_as_run(command)}
    all_rows = []
    with torch.no_grad():
        for mode in args.modes:
            for batch in [1] if mode == "prefill" else args.batch:
                rows = []
                for variant, model in (("stock", stock), (name, patched)):
                    torch._dynamo.reset()
                    times = profile_variant(run, model, mode, batch, args.steps, args.by_grid)
                    rows += rows_for(args, mode, batch, variant, times, args.steps)
                what = f"prefill of {args.prefill} tokens, µs per prefill" if mode == "prefill" else f"batch {batch}"
                print(f"\n## {args.model}, {args.layers} layers, {mode}, {what}")
                floor = None if mode == "prefill" else hbm_floor_ms(step_bytes(run, stock, batch))
                print(summary(rows, floor, args.layers))
                if fp8 and floor is not None:
                    own = hbm_floor_ms(step_bytes(run, patched, batch)) * 1e3
                    total = sum(r["us_per_token"] for r in rows if r["variant"] == name)
                    print(f"{name}'s own floor (its bytes at {read_rate_note()}) {own:.1f} µs/token: its kernel time "
                          f"{total:.1f} µs is {own / total:.1%} of it")
                for v in ("stock", name):
                    top = [r for r in rows if r["variant"] == v][:12]
                    print(f"-- {v}: top kernels (µs/token, calls/token, group)")
                    for r in top:
                        kernel, grid = r["kernel"].rpartition(" ")[::2] if args.by_grid else (r["kernel"], "")
                        print(f"  {r['us_per_token']:9.1f} {r['calls_per_token']:6.1f}  {r['group']:11s} "
                              f"{kernel[:110]} {grid}")
                all_rows += [{**r, **extra} for r in rows]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        csvio.write_csv(args.out, list(COLUMNS), all_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
