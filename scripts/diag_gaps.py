# ruff: noqa: B023  (the lambdas are timed inside the iteration that made them)
"""Probes behind two open measurement gaps (GPU machine). Prints; changes nothing.

    python scripts/diag_gaps.py dispatch [--table PATH]   dispatched call vs its table winner
    python scripts/diag_gaps.py lt [--n 10240 --k 8192 --m 16]   cuBLASLt heuristic vs F.linear
    python scripts/diag_gaps.py repro [--table PATH] [--repeats 3]   candidate ratios, re-timed

``dispatch``: bench_dispatch found decode split-K keys ~2% slower through the dispatcher than
the table's winner launched directly. The two differ in where the output lives: the direct
launch reuses one preallocated ``out``, the dispatcher allocates one per call. Times, with the
tuner's method, the winner into one shared out, into a distinct out per weight copy, into a
fresh ``torch.empty`` per call, and the dispatched call; then lists the kernels each one's
graph launches (torch.profiler), so a launch difference would show.

``lt``: the heuristic's first algorithm at 70b qkv M=16 was 1.10x F.linear. Asks the heuristic
with several workspace limits and alignment preferences, times each first pick beside
F.linear, and names the kernels F.linear and each pick run.

``repro``: two tuning runs chose differently at a few M >= 512 keys, with the two winners 2-7%
apart as one run timed them. Re-times each such key's recorded candidates (the table's top 5,
which hold both runs' winners) beside F.linear ``--repeats`` times in this process, each time on
freshly allocated operands, and prints every candidate's ratio to F.linear. Run it in several
processes: a spread across processes larger than within one says the effect is per process.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F


def _kernels(fn, reps: int = 3) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    names = []
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.name not in names:
            names.append(ev.name)
    return names


def dispatch_gap(table: str | None) -> None:
    from hybridgemm import dispatch
    from hybridgemm.autotune_cache.table import TableKey
    from hybridgemm.autotune_cache.tuner import operands_for
    from hybridgemm.backends import get_backend
    from hybridgemm.kernels.epilogue import Activation, Epilogue
    from hybridgemm.kernels.problem import Problem
    from hybridgemm.perf.timing import gpu_time_rotating

    if table:
        dispatch.set_table_path(table)
    tab = dispatch.table_for_device(torch.cuda.current_device())
    for n, k, m, bias in ((1024, 4096, 16, False), (1024, 4096, 1, False), (4096, 4096, 1, False)):
        p = Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, bias),
                    ldx=k, ldw=k, ldo=n)
        x, w, b, out, xs, ws = operands_for(p)
        entry = tab.lookup(TableKey.from_problem(p))
        if not entry:
            print(f"N={n} K={k} M={m}: no table entry")
            continue
        be = get_backend(entry["backend"])
        cfg = be.config_from_record(entry["config"], p)
        outs = [torch.empty_like(out) for _ in ws]
        fns = {
            "winner_shared_out": lambda i: be.run(cfg, xs[i], ws[i], b, out, Activation.NONE),
            "winner_out_per_copy": lambda i: be.run(cfg, xs[i], ws[i], b, outs[i], Activation.NONE),
            "winner_fresh_empty": lambda i: be.run(cfg, xs[i], ws[i], b, torch.empty_like(out), Activation.NONE),
            "winner_new_empty": lambda i: be.run(cfg, xs[i], ws[i], b, xs[i].new_empty(out.shape), Activation.NONE),
            "dispatch": lambda i: dispatch.fused_linear(xs[i], ws[i], b),
            "flinear": lambda i: F.linear(xs[i], ws[i], b),
        }
        dispatch.fused_linear(x, w, b)
        chosen = dispatch.choose(Problem.from_tensors(x, w, b, out, p.epilogue), torch.cuda.current_device())
        print(f"   dispatcher's choice: {chosen.backend} {chosen.config} (same as the entry: "
              f"{chosen.backend == entry['backend'] and chosen.config == cfg})")
        best = {name: float("inf") for name in fns}
        for order in (list(fns), list(fns)[::-1], list(fns)):
            for name, t in zip(order, gpu_time_rotating([fns[o] for o in order], len(ws), replays=11)):
                best[name] = min(best[name], t.median_us)
        print(f"N={n} K={k} M={m} bias={bias} {entry['backend']} {be.describe(cfg)} (copies {len(ws)})")
        for name, t in best.items():
            print(f"   {name:22s} {t:8.2f} µs  {t / best['winner_shared_out']:.3f}x")
        for name in ("winner_shared_out", "dispatch"):
            print(f"   kernels of {name}: {_kernels(lambda: fns[name](0))}")


def repro(table: str | None, repeats: int) -> None:
    import os

    from hybridgemm import dispatch
    from hybridgemm.autotune_cache.table import TableKey
    from hybridgemm.autotune_cache.tuner import record_calls, time_placements
    from hybridgemm.backends import get_backend
    from hybridgemm.kernels.epilogue import Activation, Epilogue
    from hybridgemm.kernels.problem import Problem

    if table:
        dispatch.set_table_path(table)
    tab = dispatch.table_for_device(torch.cuda.current_device())
    print(f"pid {os.getpid()}")
    for n, k, m, bias in ((512, 3584, 2048, True), (1024, 4096, 1024, False), (1024, 4096, 512, False),
                          (6144, 4096, 2048, False), (4096, 4096, 1, False)):
        p = Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, bias),
                    ldx=k, ldw=k, ldo=n)
        entry = tab.lookup(TableKey.from_problem(p))
        if not entry:
            print(f"N={n} K={k} M={m}: no table entry")
            continue
        cands = []
        for c in entry["candidates"]:
            be = get_backend(c["backend"])
            cands.append((be, be.config_from_record(c["config"], p)))
        print(f"N={n} K={k} M={m} bias={bias}: ratio to F.linear per candidate, one row per repeat")
        for be, cfg in cands:
            print(f"   c{cands.index((be, cfg))}: {be.name} {be.describe(cfg)}")
        records = [(c["backend"], c["config"]) for c in entry["candidates"]]
        for r in range(repeats):
            x, w, xs, ws, outs, calls = record_calls(p, records)  # fresh operands each repeat
            res = time_placements(calls, x, w, xs, ws, outs)
            ref = res[0][0]
            print(f"   repeat {r}: F.linear {ref:8.2f} µs | " + " ".join(
                f"c{j}={t / ref:.3f}(±{s / ref:.3f})" for j, (t, s) in enumerate(res[1:])), flush=True)


def lt_heuristic(n: int, k: int, ms: list[int]) -> None:
    from hybridgemm.kernels import cublaslt as lt
    from hybridgemm.kernels.epilogue import Activation, Epilogue
    from hybridgemm.kernels.problem import Problem
    from hybridgemm.perf.timing import gpu_time_many

    for m in ms:
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        b = torch.randn(n, device="cuda").bfloat16()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        print(f"N={n} K={k} M={m}: F.linear kernels {_kernels(lambda: F.linear(x, w, b))}")
        picks = []
        for ws_mib in (0, 1, 4, 32):
            for align in (None, 16):
                p = Problem.from_tensors(x, w, b, out, Epilogue(Activation.NONE, True))
                if align:
                    p = replace(p, align_x=align, align_w=align, align_out=align)
                plan = lt.Plan(p, torch.cuda.current_device())
                algos = plan.heuristics(4, ws_mib * 2**20)
                plan.destroy()
                if algos:
                    picks.append((f"ws={ws_mib}MiB align={align or 'ptr'}", algos[0]))
        uniq = []
        for label, a in picks:
            if all(a.data != u[1].data for u in uniq):
                uniq.append((label, a))
            print(f"   {label:24s} first pick {a.describe()}")
        fns = [lambda: F.linear(x, w, b)] + [lambda a=a: lt.run(a, x, w, b, out) for _, a in uniq]
        times = gpu_time_many(fns, replays=15)
        print(f"   F.linear {times[0].median_us:8.2f} µs")
        for (label, a), t in zip(uniq, times[1:]):
            print(f"   {label:24s} {t.median_us:8.2f} µs  {t.median_us / times[0].median_us:.3f}x  "
                  f"kernels {_kernels(lambda a=a: lt.run(a, x, w, b, out))}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["dispatch", "lt", "repro"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--table")
    ap.add_argument("--n", type=int, default=10240)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--m", type=int, nargs="+", default=[16, 1, 256])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_gaps: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.what == "dispatch":
        dispatch_gap(args.table)
    elif args.what == "repro":
        repro(args.table, args.repeats)
    else:
        lt_heuristic(args.n, args.k, args.m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
