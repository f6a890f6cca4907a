"""Soak test: many calls over many shapes through every backend; memory must not grow.

    python scripts/soak.py [--calls 100000] [--shapes 50] [--out DIR] [--table PATH]

On a CUDA GPU, cycles through ``--shapes`` distinct linear problems (M from 1 to 4096; N and K
llama/qwen/gpt2-sized and odd; bf16 and fp16; with and without bias; no activation, relu,
gelu_tanh and exact gelu) and, for each, every path that takes it:

* ``cublaslt``, ``triton_gemm``, ``triton_splitk``: ``hybridgemm.kernels.backends.get_backend(name).run``
  with the backend's default for the problem (cuBLASLt: ``None``, the heuristic's first
  algorithm, as a table entry without one runs it; Triton: ``candidates(problem)[0]``; the
  split-K kernel offers candidates only for M <= 64, cuBLASLt has no exact GELU);
* ``linear``: ``hybridgemm.linear`` (the dispatcher: the table entry for its M, else F.linear),
  with 3-D input for even M.

``--calls`` calls in all, round-robin over the shapes (and over each shape's paths), after a
warm-up of ``--warmup-rounds`` rounds over every (shape, path) that fills the bounded caches
(and checks every path once against F.linear in fp32, keeping that output).
Then every ``--sample-every`` calls it records ``torch.cuda.memory_allocated()``,
``memory_reserved()`` and the host RSS (``/proc/self/status`` VmRSS) after a sync and
``gc.collect()``, with no output of the loop alive. Every ``--check-every`` calls the call's
output (NaN-poisoned first, for the backend paths) is checked against F.linear in fp32 and
compared bit for bit with the warm-up output of the same (shape, path).

Pass: (1) every sample after warm-up has allocated memory <= the post-warm-up value + 1 MiB;
(2) RSS grows by at most 64 MiB from the end of warm-up to the end; (3) the bounded caches
(listed in the summary) hold as many entries at the end as after warm-up (a fixed set of call
signatures must not keep making new keys); (4) every spot check is correct and bit-identical;
(5) no call raises; (6) all three backends ran (cuBLASLt needs nvmath-python).
Writes ``DIR/soak_h200.csv`` (the samples) and ``DIR/soak_summary.txt``; exits 0 on pass,
1 on failure, 2 when it cannot run (no CUDA GPU).

Caches it relies on being bounded (sizes in the summary):
  dispatch._MODE_CACHES (decisions and       FIFO, CACHE_SIZE = 1024 entries each
  launchers, per mode)
  cublaslt._plans                            LRU, PLAN_CACHE_SIZE = 512 plans
  cublaslt._fast                             FIFO, _FAST_CACHE_SIZE = 1024 launchers
  cublaslt_grad._plans                       LRU, GRAD_PLAN_CACHE_SIZE = 256 plans (backward; not used here)
  triton_gemm._PLANS, triton_splitk._PLANS   FIFO, triton_plan.PLAN_CACHE_SIZE = 4096 each
  Triton's JITFunction.device_caches         unbounded dict per kernel, one entry per
                                             specialisation (constexprs, dtypes, 16-byte
                                             divisibility of ints/pointers): grows only with
                                             new configs/shapes classes, never per call
  triton_scratch workspaces / counters       one per (device, stream, power-of-two size)
  cublaslt workspaces                        one 32 MiB buffer per (device, stream)
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20
ALLOC_SLACK_MIB = 1.0
# RSS bound. After warm-up every kernel is compiled and loaded, every plan, launcher and TMA
# descriptor spec is cached, and CUDA/cuBLAS(Lt) have loaded the modules these shapes use, so
# host memory should be flat. What can still move it without a leak: glibc/pymalloc arena
# growth and fragmentation from the short-lived Python objects of each call, the sample rows
# kept here (a few KiB), and lazily loaded driver/library state (a few MiB). 64 MiB covers
# that with margin, and is still small next to a real leak at soak length: over 100k calls a
# leak of ~700 bytes per call (less than one leaked tensor object or plan) exceeds it. At
# --calls 2000 the bound only catches leaks of > ~33 KiB per call: run the long soak.
RSS_SLACK_MIB = 64.0
ROOT = Path(__file__).resolve().parent.parent
DEVICE_TYPE = "cuda"  # a module constant so that the loop can be dry-run on the CPU (Triton interpreter)


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int
    dtype: str  # "bf16" or "fp16"
    bias: bool
    act: str | None

    def label(self) -> str:
        return f"M={self.m} N={self.n} K={self.k} {self.dtype} {'bias' if self.bias else 'nobias'} {self.act or 'none'}"


# Fifty distinct problems, in an order whose every prefix mixes small and large M, llama-like
# and odd sizes, both dtypes, bias or not, and the activations (so --shapes 10 is still a mix).
# fmt: off
CATALOGUE = [
    Shape(1, 4096, 4096, "bf16", True, None),          Shape(4096, 6144, 4096, "bf16", True, None),
    Shape(17, 257, 130, "fp16", False, "relu"),        Shape(300, 4608, 3584, "bf16", True, "gelu_tanh"),
    Shape(8, 1024, 4096, "bf16", True, None),          Shape(1000, 37, 45, "fp16", True, "gelu"),
    Shape(64, 14336, 4096, "bf16", False, "relu"),     Shape(3, 1001, 513, "fp16", True, None),
    Shape(2048, 1024, 4096, "bf16", True, "gelu_tanh"), Shape(33, 100, 72, "bf16", True, "gelu"),
    Shape(16, 6144, 4096, "bf16", True, None),         Shape(512, 4096, 14336, "bf16", False, None),
    Shape(1, 10240, 8192, "bf16", True, None),         Shape(777, 2050, 1030, "fp16", True, "relu"),
    Shape(5, 4608, 3584, "bf16", True, None),          Shape(128, 3584, 3584, "fp16", True, "gelu_tanh"),
    Shape(2, 512, 3584, "bf16", True, None),           Shape(4096, 1024, 4096, "fp16", False, None),
    Shape(31, 4097, 777, "bf16", True, "gelu"),        Shape(256, 2304, 768, "fp16", True, None),
    Shape(1, 8192, 8192, "bf16", False, None),         Shape(1024, 768, 768, "bf16", True, "gelu"),
    Shape(13, 3072, 768, "fp16", True, "gelu_tanh"),   Shape(100, 1000, 520, "bf16", False, "relu"),
    Shape(64, 1064, 4096, "fp16", True, None),         Shape(3000, 333, 4096, "bf16", True, None),
    Shape(1, 333, 4096, "fp16", True, "relu"),         Shape(65, 4096, 333, "bf16", True, None),
    Shape(32, 4096, 4096, "bf16", True, "gelu_tanh"),  Shape(4096, 4096, 4096, "bf16", True, None),
    Shape(7, 64, 1000, "fp16", False, None),           Shape(255, 520, 390, "bf16", True, "gelu"),
    Shape(4, 2304, 768, "bf16", True, None),           Shape(2048, 4608, 3584, "bf16", True, None),
    Shape(48, 512, 3584, "fp16", True, None),          Shape(1536, 3000, 1000, "fp16", False, "gelu_tanh"),
    Shape(1, 1024, 4096, "bf16", True, "relu"),        Shape(400, 14336, 4096, "bf16", False, None),
    Shape(9, 6144, 4096, "fp16", True, None),          Shape(200, 8192, 1024, "bf16", True, "relu"),
    Shape(24, 37, 45, "bf16", True, None),             Shape(1000, 4096, 4096, "fp16", True, None),
    Shape(1, 4096, 14336, "bf16", False, None),        Shape(3, 768, 768, "fp16", True, "gelu"),
    Shape(60, 10240, 8192, "bf16", True, None),        Shape(640, 1001, 513, "bf16", True, "gelu_tanh"),
    Shape(11, 3584, 3584, "bf16", True, None),         Shape(2500, 2048, 2048, "bf16", True, "relu"),
    Shape(40, 8192, 8192, "fp16", False, None),        Shape(128, 100, 72, "fp16", True, None),
]
# fmt: on
assert len(set(CATALOGUE)) == len(CATALOGUE) == 50


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/status (VmRSS); -1 where absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


@dataclass
class Route:
    """One way of computing a shape: a backend's run() with its default config, or linear()."""

    name: str
    config: object = None
    reference: object = None  # the warm-up output (kept for bit-for-bit spot checks)
    calls: int = 0


@dataclass
class Case:
    shape: Shape
    x: object
    w: object
    b: object
    x_linear: object  # x as passed to hybridgemm.linear (3-D for even M)
    paths: list[Route] = field(default_factory=list)  # the routes this shape takes
    dispatch: str = ""


def build_problems(shapes, torch, dev):
    from hybridgemm import explain
    from hybridgemm.kernels import cublaslt
    from hybridgemm.kernels.backends import get_backend
    from hybridgemm.kernels.epilogue import Activation, Epilogue
    from hybridgemm.kernels.problem import NAME_TO_DTYPE, Problem

    gen = torch.Generator(device=dev).manual_seed(0)
    probs = []
    for s in shapes:
        dt = NAME_TO_DTYPE[s.dtype]
        x = torch.randn(s.m, s.k, device=dev, generator=gen).to(dt)
        w = (torch.randn(s.n, s.k, device=dev, generator=gen) / math.sqrt(s.k)).to(dt)
        b = torch.randn(s.n, device=dev, generator=gen).to(dt) if s.bias else None
        xl = x.view(2, s.m // 2, s.k) if s.m % 2 == 0 else x
        p = Case(s, x, w, b, xl)
        out = torch.empty(s.m, s.n, dtype=dt, device=dev)
        problem = Problem.from_tensors(x, w, b, out, Epilogue(Activation.parse(s.act), s.bias))
        if cublaslt.is_available() and cublaslt.supports(problem)[0]:
            p.paths.append(Route("cublaslt", None))
        for name in ("triton_gemm", "triton_splitk"):
            cands = get_backend(name).candidates(problem)
            if cands:
                p.paths.append(Route(name, cands[0]))
        p.paths.append(Route("linear"))
        p.dispatch = explain(tuple(xl.shape), (s.n, s.k), dt, s.bias, s.act).splitlines()[-1].strip()
        probs.append(p)
    return probs


def run_path(p: Case, path: Route, torch, poison: bool = False):
    """One call; returns the output (the caller drops it)."""
    s = p.shape
    if path.name == "linear":
        import hybridgemm

        return hybridgemm.linear(p.x_linear, p.w, p.b, s.act).view(s.m, s.n)
    from hybridgemm.kernels.backends import get_backend

    out = torch.empty(s.m, s.n, dtype=p.x.dtype, device=p.x.device)
    if poison:
        out.fill_(float("nan"))
    get_backend(path.name).run(path.config, p.x, p.w, p.b, out, s.act)
    return out


def check_output(p: Case, path: Route, out, torch) -> str | None:
    """None if ``out`` is right: finite where F.linear is, within max(2 x torch's own error,
    the dtype's floor) of F.linear in fp32 (tests/helpers.py's bound), and bit-identical to the
    warm-up output of this (shape, path) when there is one. Else what is wrong."""
    from helpers import FLOORS, rel_err, torch_linear

    s = p.shape
    fp32 = torch_linear(p.x.float(), p.w.float(), None if p.b is None else p.b.float(), s.act)
    ours = rel_err(out, fp32)
    theirs = rel_err(torch_linear(p.x, p.w, p.b, s.act), fp32)
    bound = max(2.0 * theirs, FLOORS[p.x.dtype])
    if not ours <= bound:
        return f"{s.label()} via {path.name}: rel err {ours:.3g} > bound {bound:.3g} (torch's own {theirs:.3g})"
    if path.reference is not None and not torch.equal(out, path.reference):
        diff = int((out != path.reference).sum())
        return f"{s.label()} via {path.name}: {diff} of {out.numel()} elements differ from the warm-up output"
    return None


def cache_sizes() -> dict[str, int]:
    """Entries in every bounded cache the call path uses (and Triton's compiled-kernel caches)."""
    from hybridgemm import dispatch, get_mode
    from hybridgemm.kernels import cublaslt, cublaslt_grad, cublaslt_runtime, triton_gemm, triton_scratch, triton_splitk

    decisions, launchers = dispatch._MODE_CACHES[get_mode()]
    sizes = {
        "dispatch decisions": len(decisions), "dispatch launchers": len(launchers),
        "cublaslt._plans": len(cublaslt._plans), "cublaslt._fast": len(cublaslt._fast),
        "cublaslt_runtime.workspaces": len(cublaslt_runtime.workspaces),
        "cublaslt_grad._plans": len(cublaslt_grad._plans),
        "triton_gemm._PLANS": len(triton_gemm._PLANS), "triton_splitk._PLANS": len(triton_splitk._PLANS),
        "triton_scratch._WORKSPACES": len(triton_scratch._WORKSPACES),
        "triton_scratch._COUNTERS": len(triton_scratch._COUNTERS),
        "triton_scratch._RETIRED": len(triton_scratch._RETIRED),
    }
    for name, fn in (("triton_gemm._gemm_kernel", triton_gemm._gemm_kernel),
                     ("triton_splitk._splitk_kernel", triton_splitk._splitk_kernel),
                     ("triton_splitk._reduce_kernel", triton_splitk._reduce_kernel)):
        try:  # Triton 3.x: device_caches[device] = (kernel_cache, key_cache, target, backend, binder)
            sizes[f"compiled {name}"] = sum(len(c[0]) for c in fn.device_caches.values())
        except (AttributeError, TypeError, IndexError):
            pass
    return sizes


CACHE_BOUNDS = {
    "dispatch decisions": "FIFO, dispatch.CACHE_SIZE", "dispatch launchers": "FIFO, dispatch.CACHE_SIZE",
    "cublaslt._plans": "LRU, cublaslt.PLAN_CACHE_SIZE", "cublaslt._fast": "FIFO, cublaslt._FAST_CACHE_SIZE",
    "cublaslt_grad._plans": "LRU, cublaslt_grad.GRAD_PLAN_CACHE_SIZE",
    "triton_gemm._PLANS": "FIFO, triton_plan.PLAN_CACHE_SIZE",
    "triton_splitk._PLANS": "FIFO, triton_plan.PLAN_CACHE_SIZE",
}


def bound_values() -> dict[str, int]:
    from hybridgemm import dispatch
    from hybridgemm.kernels import cublaslt, cublaslt_grad, triton_gemm, triton_splitk

    return {"dispatch decisions": dispatch.CACHE_SIZE, "dispatch launchers": dispatch.CACHE_SIZE,
            "cublaslt._plans": cublaslt._plans.max_size, "cublaslt._fast": cublaslt._fast.max_size,
            "cublaslt_grad._plans": cublaslt_grad._plans.max_size, "triton_gemm._PLANS": triton_gemm._PLANS.max_size,
            "triton_splitk._PLANS": triton_splitk._PLANS.max_size}


def fmt_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100_000, help="calls after warm-up (default 100000)")
    ap.add_argument("--shapes", type=int, default=50, help=f"distinct shapes, 1..{len(CATALOGUE)} (default 50)")
    ap.add_argument("--out", default="out", help="folder for soak_h200.csv and soak_summary.txt")
    ap.add_argument("--table", default=None, help="tuning table for the dispatcher (default: user + shipped)")
    ap.add_argument("--warmup-rounds", type=int, default=2, help="rounds over every (shape, path) first (>= 1)")
    ap.add_argument("--sample-every", type=int, default=0, help="calls between memory samples (0: calls/200)")
    ap.add_argument("--check-every", type=int, default=0, help="calls between spot checks (0: calls/400)")
    ap.add_argument("--alloc-slack-mib", type=float, default=ALLOC_SLACK_MIB)
    ap.add_argument("--rss-slack-mib", type=float, default=RSS_SLACK_MIB)
    args = ap.parse_args(argv)
    if args.calls < 1 or not 1 <= args.shapes <= len(CATALOGUE) or args.warmup_rounds < 1:
        ap.error(f"need --calls >= 1, 1 <= --shapes <= {len(CATALOGUE)}, --warmup-rounds >= 1")

    import torch

    if not torch.cuda.is_available():
        print("soak: needs a CUDA GPU and torch.cuda.is_available() is False here; nothing was run "
              "(run it on the GPU machine: bash scripts/gpu-check.sh soak)", file=sys.stderr)
        return 2

    sys.path.insert(0, str(ROOT / "tests"))  # helpers.py: the tests' error bound and reference
    import hybridgemm
    from hybridgemm import decide

    if args.table:
        decide.set_table_path(args.table)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device()) if DEVICE_TYPE == "cuda" else torch.device(DEVICE_TYPE)
    sample_every = args.sample_every or max(1, args.calls // 200)
    check_every = args.check_every or max(1, args.calls // 400)
    failures: list[str] = []
    rows: list[dict] = []
    t_start = time.time()

    def sample(calls: int, phase: str) -> dict:
        torch.cuda.synchronize()
        gc.collect()
        row = {"calls": calls, "phase": phase, "elapsed_s": round(time.time() - t_start, 3),
               "allocated_bytes": torch.cuda.memory_allocated(dev), "reserved_bytes": torch.cuda.memory_reserved(dev),
               "rss_bytes": rss_bytes()}
        rows.append(row)
        return row

    def log(msg: str) -> None:
        print(f"[soak {time.time() - t_start:7.1f}s] {msg}", flush=True)

    shapes = CATALOGUE[: args.shapes]
    log(f"{torch.cuda.get_device_name(dev)}; {len(shapes)} shapes, {args.calls} calls after "
        f"{args.warmup_rounds} warm-up round(s); hybridgemm {hybridgemm.__version__}, torch {torch.__version__}")
    sample(0, "start")
    try:
        probs = build_problems(shapes, torch, dev)
    except Exception:
        failures.append("setting up the shapes raised:\n" + traceback.format_exc())
        return finish(args, out_dir, rows, failures, [], None, None, None, log)
    pairs = [(p, path) for p in probs for path in p.paths]
    if not args.check_every:
        # Call i runs shape i % S by route (i // S) % R (R <= 4 routes): a check period sharing
        # no factor with S, 2 and 3 makes the spot checks visit every shape and every route.
        while math.gcd(check_every, 6 * len(probs)) != 1:
            check_every += 1
    from hybridgemm.kernels import cublaslt

    if not cublaslt.is_available():
        failures.append("the cuBLASLt backend is not available here (nvmath-python missing?): "
                        "only the Triton backends and the dispatcher were soaked")
    log(f"{len(pairs)} (shape, path) pairs: " + ", ".join(
        f"{name} {sum(path.name == name for _, path in pairs)}"
        for name in ("cublaslt", "triton_gemm", "triton_splitk", "linear")))

    # ---- warm-up: every pair runs (Triton compiles here), is checked, and keeps its output
    try:
        for r in range(args.warmup_rounds):
            for i, (p, path) in enumerate(pairs):
                out = run_path(p, path, torch, poison=True)
                if r == 0:
                    bad = check_output(p, path, out, torch)
                    if bad:
                        failures.append(f"warm-up: {bad}")
                    path.reference = out.clone()
                del out
                if r == 0 and (i + 1) % 20 == 0:
                    log(f"warm-up {i + 1}/{len(pairs)} pairs")
    except Exception:
        failures.append("warm-up raised:\n" + traceback.format_exc())
        return finish(args, out_dir, rows, failures, probs, None, None, None, log)
    base = sample(0, "warmed")
    base_caches = cache_sizes()
    log(f"warm-up done: allocated {fmt_mib(base['allocated_bytes'])}, reserved {fmt_mib(base['reserved_bytes'])}, "
        f"RSS {fmt_mib(base['rss_bytes'])}")

    # ---- the soak: round-robin over shapes; within a shape, over its paths
    checks = done = 0
    t0 = time.time()
    progress_every = max(1, args.calls // 50)
    try:
        for i in range(args.calls):
            p = probs[i % len(probs)]
            path = p.paths[(i // len(probs)) % len(p.paths)]
            path.calls += 1
            spot = (i + 1) % check_every == 0
            out = run_path(p, path, torch, poison=spot)
            if spot:
                checks += 1
                bad = check_output(p, path, out, torch)
                if bad:
                    failures.append(f"call {i + 1}: {bad}")
            del out
            done = i + 1
            if done % sample_every == 0 or done == args.calls:
                sample(done, "soak")
            if done % progress_every == 0 or done == args.calls:
                rate = done / max(1e-9, time.time() - t0)
                last = rows[-1]
                log(f"{done}/{args.calls} calls ({100 * done / args.calls:.0f}%), {rate:.0f} calls/s, "
                    f"ETA {(args.calls - done) / rate:.0f} s, allocated "
                    f"{(last['allocated_bytes'] - base['allocated_bytes']) / MIB:+.2f} MiB, RSS "
                    f"{(last['rss_bytes'] - base['rss_bytes']) / MIB:+.1f} MiB, {checks} checks, "
                    f"{len(failures)} failures")
    except Exception:
        failures.append(f"call {i + 1} ({p.shape.label()} via {path.name}) raised:\n" + traceback.format_exc())
    final = sample(done, "final")
    return finish(args, out_dir, rows, failures, probs, base, final, (base_caches, cache_sizes(), checks), log)


def finish(args, out_dir: Path, rows, failures, probs, base, final, caches, log) -> int:
    lines = [f"soak: {args.calls} calls over {len(probs)} shapes, warm-up {args.warmup_rounds} round(s)"]
    if base is not None and final is not None:
        base_caches, end_caches, checks = caches
        d_alloc = final["allocated_bytes"] - base["allocated_bytes"]
        d_res = final["reserved_bytes"] - base["reserved_bytes"]
        d_rss = final["rss_bytes"] - base["rss_bytes"]
        steady = [r for r in rows if r["phase"] in ("soak", "final")]
        peak = max(r["allocated_bytes"] for r in steady) - base["allocated_bytes"]
        over = [r for r in steady if r["allocated_bytes"] > base["allocated_bytes"] + args.alloc_slack_mib * MIB]
        if over:
            failures.insert(0, f"allocated memory above post-warm-up + {args.alloc_slack_mib} MiB in {len(over)} of "
                            f"{len(steady)} samples (first at call {over[0]['calls']}, peak {peak:+d} B, "
                            f"final {d_alloc:+d} B)")
        if base["rss_bytes"] < 0:
            failures.append("no /proc/self/status VmRSS here: the RSS criterion could not be checked")
        elif d_rss > args.rss_slack_mib * MIB:
            failures.append(f"RSS grew {fmt_mib(d_rss)} after warm-up (> {args.rss_slack_mib} MiB)")
        for name, n in end_caches.items():
            if n != base_caches.get(name):
                failures.append(f"cache {name} went from {base_caches.get(name)} entries after warm-up to {n}: "
                                "a fixed set of calls keeps making new keys")
        lines += [
            f"allocated: post-warm-up {base['allocated_bytes']} B, final {final['allocated_bytes']} B "
            f"(delta {d_alloc:+d} B, peak over post-warm-up {peak:+d} B, slack {args.alloc_slack_mib} MiB)",
            f"reserved:  post-warm-up {fmt_mib(base['reserved_bytes'])}, final {fmt_mib(final['reserved_bytes'])} "
            f"(delta {d_res / MIB:+.1f} MiB; reported, not a criterion: the caching allocator may keep blocks)",
            f"host RSS:  post-warm-up {fmt_mib(base['rss_bytes'])}, final {fmt_mib(final['rss_bytes'])} "
            f"(delta {d_rss / MIB:+.1f} MiB = {d_rss / max(1, args.calls):+.1f} B/call, "
            f"bound {args.rss_slack_mib} MiB)",
            f"spot checks: {checks} (F.linear fp32 bound + bit-identical to the warm-up output)",
            f"wall time: {final['elapsed_s']:.0f} s",
            "",
            "bounded caches (entries after warm-up -> at the end; bound):",
        ]
        bounds = bound_values()
        for name, n in end_caches.items():
            bound = f"{CACHE_BOUNDS[name].split(', ')[0]} {bounds[name]}" if name in bounds else "see scripts/soak.py"
            lines.append(f"  {name:34s} {base_caches.get(name)!s:>5} -> {n!s:<5} ({bound})")
    lines += ["", "shapes (calls per path; what hybridgemm.linear runs):"]
    for p in probs:
        calls = ", ".join(f"{path.name} {path.calls}" for path in p.paths)
        lines.append(f"  {p.shape.label():42s} {calls}")
        lines.append(f"      linear -> {p.dispatch}")
    verdict = "PASS" if not failures else f"FAIL ({len(failures)} problem(s))"
    lines += ["", f"result: {verdict}"] + [f"  - {f}" for f in failures[:50]]
    if len(failures) > 50:
        lines.append(f"  ... and {len(failures) - 50} more")
    text = "\n".join(lines) + "\n"
    (out_dir / "soak_summary.txt").write_text(text)
    with open(out_dir / "soak_h200.csv", "w", newline="") as f:
        fields = ["calls", "phase", "elapsed_s", "allocated_bytes", "reserved_bytes", "rss_bytes"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    print(text, end="", flush=True)
    log(f"wrote {out_dir / 'soak_h200.csv'} and {out_dir / 'soak_summary.txt'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
