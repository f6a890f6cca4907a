"""cuBLASLt backend beside F.linear on the projection shapes of llama3-8b and llama3-70b.

    python -m hybridgemm.perf.bench_cublaslt --out DIR [--m 1 16 256 4096] [--quick]

Providers (bias epilogue, bf16): ``flinear`` (baseline), ``lt_heuristic`` (our backend's
default: the heuristic's first algorithm), ``lt_best`` (fastest of the heuristic's top 16 and
up to ``--exhaustive`` algorithms from the exhaustive AlgoGetIds/AlgoInit/AlgoCheck loop).
Every provider is checked against an fp32 reference before it is timed.
GPU time: the tuner's method (rotating cold copies of x and W, interleaved CUDA-graph
replays, finalists re-timed on the tuner's placements; see bench_shape). Host time: eager back-to-back
calls of F.linear and lt_heuristic in alternating rounds of one loop.
Writes DIR/cublaslt_h200.csv (long form) and prints a summary table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache.measure import time_placements
from hybridgemm.kernels import cublaslt as lt
from hybridgemm.kernels import cublaslt_runtime
from hybridgemm.kernels import cublaslt_search as lts
from hybridgemm.kernels.checks import call_signature
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem
from hybridgemm.perf.csvio import environment_columns, write_rows
from hybridgemm.perf.timing import Timing, eager_time_interleaved, gpu_time_rotating, rotation_lists

# (name, N, K): the attention projections of llama3-8b and llama3-70b (autotune_cache/presets.py)
SHAPES = [
    ("llama3-8b.q", 4096, 4096),
    ("llama3-8b.kv", 1024, 4096),
    ("llama3-8b.qkv", 6144, 4096),
    ("llama3-8b.o", 4096, 4096),
    ("llama3-70b.qkv", 10240, 8192),
    ("llama3-70b.o", 8192, 8192),
]


def _rel_err(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_shape(name, n, k, m, dtype, exhaustive, rows, env, log):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    base = dict(env, shape=name, N=n, K=k, M=m, dtype=str(dtype).removeprefix("torch."), epilogue="bias")
    flops = 2 * m * n * k
    nbytes = x.element_size() * (m * k + n * k + m * n + n)

    def row(provider, t, config="", err=None, method="gpu"):
        r = dict(base, provider=provider, method=method, median_us=round(t.median_us, 3),
                 spread_us=round(t.spread_us, 3), tflops=round(flops / t.median_us / 1e6, 2),
                 gbps=round(nbytes / t.median_us / 1e3, 1), config=config,
                 rel_err=f"{err:.2e}" if err is not None else "")
        rows.append(r)
        return r

    problem = Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(Activation.NONE, True), ldx=k, ldw=k, ldo=n)
    heur = lts.heuristic_algos(problem, count=16)
    err = _rel_err(lt.linear(x, w, b, out=out), ref)

    # The tuner's method: every call reads its own cold copy of x and W (rotating copies),
    # CUDA graphs replayed in interleaved rounds. A screen of all enumerated algorithms, then
    # F.linear, the heuristic pick, the 3 fastest of the screen and F.linear again re-timed
    # together on the tuner's placements (autotune_cache.measure.time_placements), which
    # decides; the two F.linear rows show the noise left. "Best" is the fastest of those
    # finalists, the heuristic pick included (so it can never read slower than it).
    xs, ws = rotation_lists(x, w)
    copies = len(ws)

    def flinear(i):
        return F.linear(xs[i], ws[i], b)

    def heuristic(i):
        return lt.run(None, xs[i], ws[i], b, out, Activation.NONE)

    cands = lts.candidates(problem, heuristic_count=16, exhaustive_limit=exhaustive)
    ok = []
    for algo in cands:
        try:
            e = _rel_err(lt.linear(x, w, b, algo=algo, out=out), ref)
            if not e < 2e-2:
                log(f"  skip {algo.describe()}: rel err {e:.2e}")
                continue
            ok.append((algo, e))
        except Exception as ex:  # an algorithm that fails to run is reported, not fatal
            log(f"  {algo.describe()} failed: {ex}")
    run_algo = [lambda i, a=algo: lt.run(a, xs[i], ws[i], b, out, Activation.NONE) for algo, _ in ok]
    screen = gpu_time_rotating(run_algo, copies, replays=3) if ok else []
    top = sorted(range(len(ok)), key=lambda j: screen[j].median_us)[:3]
    final = time_placements([flinear, heuristic] + [run_algo[j] for j in top] + [flinear], x, w, xs, ws, [out])
    t_fl, t_h, t_fl2 = (Timing(us, sp, 3) for us, sp in (final[0], final[1], final[-1]))
    row("flinear", t_fl, err=_rel_err(F.linear(x, w, b), ref))
    row("lt_heuristic", t_h, heur[0].describe() if heur else "", err)
    row("flinear_repeat", t_fl2)
    best = (t_h, heur[0], err) if heur else None
    for j, (us, sp) in zip(top, final[2:-1]):
        if best is None or us < best[0].median_us:
            best = (Timing(us, sp, 3), ok[j][0], ok[j][1])
    if best is not None:
        r = row("lt_best", best[0], f"{best[1].source}: {best[1].describe()}", best[2])
        r["candidates"] = len(ok)
    fl = min(t_fl.median_us, t_fl2.median_us)
    return {"shape": name, "M": m, "flinear": t_fl.median_us, "flinear2": t_fl2.median_us,
            "heur": t_h.median_us, "best": best[0].median_us if best else float("nan"),
            "fl_best": fl, "best_cfg": best[1].describe() if best else "-", "ncand": len(ok), "fl": fl}


def bench_host(name, n, k, dtype, rows, env):
    x = torch.randn(1, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    res = eager_time_interleaved({"flinear": lambda: F.linear(x, w, b),
                                  "lt_heuristic": lambda: lt.linear(x, w, b)})
    for prov, t in res.items():
        rows.append(dict(env, shape=name, N=n, K=k, M=1, dtype=str(dtype).removeprefix("torch."),
                         epilogue="bias", provider=prov, method="eager", median_us=round(t.median_us, 3),
                         spread_us=round(t.spread_us, 3)))
    return res["flinear"].median_us, res["lt_heuristic"].median_us


def host_breakdown(n=256, k=256, dtype=torch.bfloat16, calls=2000) -> dict[str, float]:
    """Where the host time of one call goes (µs per call, eager, GPU work negligible)."""
    import numpy as np

    x = torch.randn(1, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    out = torch.empty(1, n, device="cuda", dtype=dtype)
    lt.clear_caches()
    lt.linear(x, w, b)
    plan = next(iter(lt._plans.values()))
    L = cublaslt_runtime.bindings()
    h, d, a, bd, dd = plan.handle, plan.desc, plan.adesc, plan.bdesc, plan.ddesc
    alpha, beta, algo = plan.alpha_ptr, plan.beta_ptr, plan.algo_ptr
    xp, wp, op = x.data_ptr(), w.data_ptr(), out.data_ptr()
    stream = torch.cuda.current_stream().cuda_stream
    ws = cublaslt_runtime.workspace_ptr(0, stream)
    holder = np.array([b.data_ptr()], dtype=np.int64)
    dev_obj = x.device
    fns = {
        "F.linear": lambda: F.linear(x, w, b),
        "raw cublasLtMatmul binding": lambda: L.matmul(h, d, alpha, wp, a, xp, bd, beta, op, dd, op, dd, algo, ws,
                                                      lt.WORKSPACE_BYTES, stream),
        "set bias attr + binding": lambda: (L.matmul_desc_set_attribute(d, 8, holder.ctypes.data, 8),
                                            L.matmul(h, d, alpha, wp, a, xp, bd, beta, op, dd, op, dd, algo, ws,
                                                     lt.WORKSPACE_BYTES, stream)),
        "lt.run (no checks)": lambda: lt.run(None, x, w, b, out, Activation.NONE),
        "lt.linear (fast path)": lambda: lt.linear(x, w, b),
        "torch.empty (device str)": lambda: torch.empty((1, n), dtype=dtype, device="cuda"),
        "torch.empty (device obj)": lambda: torch.empty((1, n), dtype=dtype, device=dev_obj),
        "x.new_empty": lambda: x.new_empty((1, n)),
        "call signature (fast key)": lambda: call_signature(x, w, b, None),
    }
    res = eager_time_interleaved(fns, calls=calls)
    return {name: t.median_us for name, t in res.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="perf/results/h200")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 4096])
    ap.add_argument("--exhaustive", type=int, default=24, help="exhaustive algorithms timed per shape")
    ap.add_argument("--quick", action="store_true", help="two shapes, M=1 and 4096, few candidates")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not lt.is_available():
        print("bench_cublaslt: needs a CUDA GPU and nvmath-python", file=sys.stderr)
        return 2
    shapes = SHAPES[2:4] if args.quick else SHAPES
    ms = [1, 4096] if args.quick else args.m
    exhaustive = 4 if args.quick else args.exhaustive
    dtype = torch.bfloat16
    env = environment_columns(" ".join(["python -m hybridgemm.perf.bench_cublaslt", *(argv or sys.argv[1:])]))
    env["cublaslt"] = lt.cublaslt_version()
    rows, summary = [], []
    t0 = time.time()
    for name, n, k in shapes:
        for m in ms:
            s = bench_shape(name, n, k, m, dtype, exhaustive, rows, env, print)
            summary.append(s)
            print(f"[{time.time() - t0:6.1f}s] {name:15s} M={m:5d}  F.linear {s['flinear']:8.2f} "
                  f"(again {s['flinear2']:8.2f})  lt_heur {s['heur']:8.2f} ({s['heur'] / s['fl']:.3f}x)  "
                  f"lt_best {s['best']:8.2f} ({s['best'] / s['fl']:.3f}x) of {s['ncand']}  {s['best_cfg']}",
                  flush=True)
    host = [(name, *bench_host(name, n, k, dtype, rows, env)) for name, n, k in
            [*shapes, ("tiny", 256, 256)]]
    breakdown = host_breakdown()
    for name, us in breakdown.items():
        rows.append(dict(env, shape="tiny", N=256, K=256, M=1, dtype="bfloat16", epilogue="bias",
                         provider=f"host:{name}", method="eager", median_us=round(us, 3)))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cublaslt_h200.csv")
    write_rows(path, rows)
    print(f"\nwrote {len(rows)} rows to {path}")
    print("\nGPU time, µs (cold operands; ratio = time / the better of two F.linear copies timed in the same\n"
          "interleaved rounds on the same 3 sets of operand copies; < 1 is faster)")
    print(f"{'shape':16s}{'M':>6s}{'F.linear':>10s}{'lt_heur':>10s}{'ratio':>7s}{'lt_best':>10s}{'ratio':>7s}")
    for s in summary:
        print(f"{s['shape']:16s}{s['M']:6d}{s['fl']:10.2f}{s['heur']:10.2f}{s['heur'] / s['fl']:7.3f}"
              f"{s['best']:10.2f}{s['best'] / s['fl_best']:7.3f}")
    print("\nhost time per eager call at M=1, µs (F.linear vs lt.linear, same loop)")
    for name, a, b in host:
        print(f"{name:16s} F.linear {a:7.2f}  hybridgemm.cublaslt {b:7.2f}  ratio {b / a:.3f}")
    print("\nhost time breakdown, µs per call (tiny shape):")
    for name, us in breakdown.items():
        print(f"  {name:28s}{us:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
