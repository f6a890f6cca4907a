"""The benchmark sweep behind ``hybridgemm bench``: providers x projection shapes x M.

Per (shape, M) point, in one process and one loop (perf/timing.py):
  1. every provider's output is checked against an fp32 reference (error at most
     max(2 x F.linear's own error, dtype floor)); a provider that fails is recorded as
     ``failed`` and not timed, one that cannot run here as ``skipped`` with a note;
  2. GPU time of each passing provider: CUDA-graph replay, L2-clean-cold, median (method ``gpu``);
  3. host time per eager call of all passing providers in alternating rounds of one loop,
     F.linear among them (method ``eager``).
With ``training``: forward + backward of one linear through ``hybridgemm.linear`` beside
F.linear with autograd, GPU time by CUDA events around each step, L2 flushed before each,
median (method ``fwd_bwd_events``).
Rows are upserted into a long-form CSV (perf/csvio.py) after every point, so an interrupted
sweep keeps what it measured and other GPUs' rows in the same file are never clobbered.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache.presets import ProjectionShape, get_preset, parse_shape
from hybridgemm.kernels import cublaslt
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.problem import DTYPE_NAMES, NAME_TO_DTYPE
from hybridgemm.perf import providers as P
from hybridgemm.perf.csvio import environment_columns, write_rows

DEFAULT_M = (1, 16, 128, 1024, 4096)
TRAIN_BASELINE, TRAIN_OURS = "flinear", "hybridgemm_linear"


# ----------------------------------------------------------------------------- timing helpers


# ----------------------------------------------------------------------------- workloads


def shapes_for(models=(), explicit=(), bias: str = "model") -> list[ProjectionShape]:
    """Projection shapes of the model presets (q, kv, fused qkv, o) plus explicit ``"N,K"``
    shapes. Identical problems of one model are measured once (llama3-8b's q and o are both
    4096x4096: "llama3-8b.q/o"). ``bias``: "model" (as the model has it), "on" or "off"."""
    out: list[ProjectionShape] = []
    for model in models:
        preset = get_preset(model)
        merged: dict[tuple, list[str]] = {}
        for p in preset.projections:
            merged.setdefault((p.n, p.k, p.bias), []).append(p.name)
        out += [ProjectionShape(f"{preset.name}.{'/'.join(names)}", n, k, b) for (n, k, b), names in merged.items()]
    out += [parse_shape(s) for s in explicit]
    if bias != "model":
        out = [ProjectionShape(s.name, s.n, s.k, bias == "on") for s in out]
    return out


@dataclass
class BenchResult:
    rows: list[dict] = field(default_factory=list)
    summary: list[dict] = field(default_factory=list)  # one per (shape, M): see bench_point
    training: list[dict] = field(default_factory=list)


def _us(t) -> float:
    return round(float(t.median_us), 3)


def bench_point(pt: P.ProblemTensors, providers: list[P.Provider], skipped: dict[str, str],
                base: dict, log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """Check, GPU-time and eager-time every provider on one problem; rows + a summary dict."""
    timers = pt.timers
    flops = 2 * pt.m * pt.n * pt.k
    nbytes = pt.problem().min_bytes
    rows, fns, gpu_us, configs = [], {}, {}, {}
    common = dict(base, err_bound=f"{pt.bound:.2e}")
    for name, note in skipped.items():
        rows.append(dict(common, provider=name, method="gpu", status="skipped", note=note))
    for prov in providers:
        row = dict(common, provider=prov.name, method="gpu")
        try:
            fn = P.build(prov, pt)
            ok, err = pt.passes(fn())
            row.update(config=P.config_of(fn), rel_err=f"{err:.2e}")
            if not ok:
                rows.append(dict(row, status="failed", note=f"rel err {err:.2e} > bound {pt.bound:.2e}"))
                log(f"  {prov.name}: FAILED the check: rel err {err:.2e} > {pt.bound:.2e}")
                continue
            reps = timers.reps(fn)
            t = timers.gpu(fn, reps=reps)
        except P.ProviderSkip as e:
            rows.append(dict(row, status="skipped", note=str(e)))
            continue
        except Exception as e:  # a provider that crashes is recorded with its error; the sweep goes on
            rows.append(dict(row, status="error", note=f"{type(e).__name__}: {str(e)[:300]}"))
            log(f"  {prov.name}: error {type(e).__name__}: {str(e)[:200]}")
            continue
        fns[prov.name], gpu_us[prov.name], configs[prov.name] = fn, t.median_us, row["config"]
        rows.append(dict(row, status="ok", median_us=_us(t), spread_us=round(t.spread_us, 3), reps=reps,
                         replays=t.replays, tflops=round(flops / max(t.median_us, 1e-9) / 1e6, 3),
                         gbps=round(nbytes / max(t.median_us, 1e-9) / 1e3, 1)))
    fl = gpu_us.get(P.BASELINE)
    for r in rows:
        if r["status"] == "ok" and fl:
            r["speedup_vs_flinear"] = round(fl / max(r["median_us"], 1e-9), 4)
    eager = {}
    if fns:
        # Fewer calls per round for long GEMMs: there eager time is GPU time and the loop would
        # otherwise take seconds per point.
        calls = int(max(20, min(200, 20000 / max(fl or 1.0, 1.0))))
        eager = timers.eager(fns, calls=calls)
        for name, t in eager.items():
            r = dict(common, provider=name, method="eager", status="ok", median_us=_us(t),
                     spread_us=round(t.spread_us, 3), calls=calls, config=configs[name])
            if P.BASELINE in eager:
                r["speedup_vs_flinear"] = round(eager[P.BASELINE].median_us / max(t.median_us, 1e-9), 4)
            rows.append(r)
    winner = min(gpu_us, key=gpu_us.get) if gpu_us else None
    summary = dict(shape=pt.shape, M=pt.m, N=pt.n, K=pt.k, flinear_us=fl, gpu_us=gpu_us, winner=winner,
                   winner_us=gpu_us.get(winner), eager_us={k: v.median_us for k, v in eager.items()},
                   failed=[r["provider"] for r in rows if r["status"] in ("failed", "error")])
    return rows, summary


def bench_training(shape: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool, act: Activation,
                   base: dict, timers: P.Timers, device="cuda", log=print) -> tuple[list[dict], dict]:
    """Forward + backward of one linear: ``hybridgemm.linear`` vs F.linear with autograd."""
    g = torch.Generator(device=device).manual_seed(17 * m + n + 3 * k)
    x0 = torch.randn(m, k, generator=g, device=device).to(dtype)
    w0 = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    b0 = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    gy = torch.randn(m, n, generator=g, device=device).to(dtype)
    ours = P.hybridgemm_linear()
    lins = {TRAIN_BASELINE: lambda x, w, b: apply_activation(F.linear(x, w, b), act)}
    if ours is not None:
        lins[TRAIN_OURS] = lambda x, w, b: ours(x, w, b, act)

    def grads(lin, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (x0, w0, b0) if t is not None]
        y = lin(*leaves, *([None] if b0 is None else []))
        y.backward(gy.to(cast))
        return [y.detach()] + [t.grad for t in leaves]

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = grads(lins[TRAIN_BASELINE], torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old

    def errs(outs):
        return [(o.float() - r).norm().item() / max(r.norm().item(), 1e-30) for o, r in zip(outs, ref)]

    fl_errs = errs(grads(lins[TRAIN_BASELINE], dtype))
    bounds = [max(2 * e, P.ERR_FLOOR.get(dtype, 1e-5)) for e in fl_errs]
    rows, us = [], {}
    common = dict(base, method="fwd_bwd_events", flops=6 * m * n * k)
    if ours is None:
        rows.append(dict(common, provider=TRAIN_OURS, status="skipped", note="hybridgemm.linear is not available"))
    for name, lin in lins.items():
        row = dict(common, provider=name)
        try:
            e = errs(grads(lin, dtype))
            row["rel_err"] = f"{max(e):.2e}"
            if not all(a <= bnd for a, bnd in zip(e, bounds)):
                rows.append(dict(row, status="failed", note="y/dx/dW/db rel errs " + " ".join(f"{v:.1e}" for v in e)))
                continue
            leaves = [t.detach().clone().requires_grad_() for t in (x0, w0, b0) if t is not None]
            args = leaves + ([None] if b0 is None else [])

            def step(lin=lin, leaves=leaves, args=args):
                for t in leaves:  # fresh grads each step: accumulation would add a kernel
                    t.grad = None
                lin(*args).backward(gy)

            t = timers.events(step)
        except Exception as ex:  # recorded, not fatal: the other provider still gets measured
            rows.append(dict(row, status="error", note=f"{type(ex).__name__}: {str(ex)[:300]}"))
            log(f"  training {name}: error {type(ex).__name__}: {str(ex)[:200]}")
            continue
        us[name] = t.median_us
        rows.append(dict(row, status="ok", median_us=_us(t), spread_us=round(t.spread_us, 3),
                         tflops=round(6 * m * n * k / max(t.median_us, 1e-9) / 1e6, 3)))
    fl = us.get(TRAIN_BASELINE)
    for r in rows:
        if r["status"] == "ok" and fl:
            r["speedup_vs_flinear"] = round(fl / max(r["median_us"], 1e-9), 4)
    return rows, dict(shape=shape, M=m, flinear_us=fl, ours_us=us.get(TRAIN_OURS))


def run_bench(shapes: list[ProjectionShape], ms=DEFAULT_M, provider_names=None, dtype: str = "bf16",
              out: str | None = None, activation=None, training: bool = False, progress: bool = True,
              device: str = "cuda", timers: P.Timers | None = None, command: str = "",
              log: Callable[[str], None] | None = None) -> BenchResult:
    """The sweep. Raises ValueError for unknown providers or dtypes (before any GPU work)."""
    if dtype not in NAME_TO_DTYPE:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(NAME_TO_DTYPE)}")
    tdtype, act = NAME_TO_DTYPE[dtype], Activation.parse(activation)
    providers, skipped = P.split_available(P.select(provider_names))
    timers = timers or P.Timers.default()
    env = environment_columns(command)
    if device != "cpu":

        env["cublaslt"] = cublaslt.cublaslt_version() or ""
    res = BenchResult()
    steps = len(shapes) * len(ms) * (2 if training else 1)
    with _Progress(progress, steps) as bar:
        say = log or bar.log
        for name, note in skipped.items():
            say(f"skipping provider {name}: {note}")
        for s in shapes:
            for m in ms:
                base = dict(env, shape=s.name, N=s.n, K=s.k, M=m, dtype=DTYPE_NAMES[tdtype],
                            epilogue=Epilogue(act, s.bias).name)
                bar.describe(f"{s.name} M={m}")
                pt = P.make_problem_tensors(s.name, m, s.n, s.k, tdtype, s.bias, act, device, timers)
                rows, summ = bench_point(pt, providers, skipped, base, say)
                del pt
                res.rows += rows
                res.summary.append(summ)
                if out:
                    write_rows(out, rows)
                bar.advance()
                if training:
                    bar.describe(f"{s.name} M={m} fwd+bwd")
                    rows, summ = bench_training(s.name, m, s.n, s.k, tdtype, s.bias, act, base, timers, device, say)
                    res.rows += rows
                    res.training.append(summ)
                    if out:
                        write_rows(out, rows)
                    bar.advance()
    return res


class _Progress:
    """A rich progress bar (or nothing), and a log that prints above it."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.p = enabled, total, None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.p = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              TextColumn("{task.description}"))
            self.p.start()
            self.task = self.p.add_task("", total=self.total)
        return self

    def describe(self, what: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=what)

    def advance(self) -> None:
        if self.p is not None:
            self.p.update(self.task, advance=1)

    def log(self, line: str) -> None:
        if self.p is not None:
            self.p.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.stop()


def print_summary(res: BenchResult, console=None) -> None:
    """Per (shape, M): F.linear's GPU time, the fastest provider and its speedup, the
    dispatcher's speedup, and host-time ratios (eager). Speedup = F.linear time / time."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)  # logs: no 80-column truncation

    def x(fl, t):
        return f"{fl / t:.3f}x" if fl and t else "-"

    tab = Table(title="GPU time, L2-clean-cold (speedup = F.linear / provider; > 1 is faster)")
    for col in ("shape", "M", "F.linear µs", "winner", "winner µs", "winner vs F.linear", "dispatch vs F.linear",
                "host: dispatch vs F.linear", "failed"):
        tab.add_column(col, justify="left" if col in ("shape", "winner", "failed") else "right")
    for s in res.summary:
        fl, ea = s["flinear_us"], s["eager_us"]
        tab.add_row(s["shape"], str(s["M"]), f"{fl:.2f}" if fl else "-", s["winner"] or "-",
                    f"{s['winner_us']:.2f}" if s["winner_us"] else "-", x(fl, s["winner_us"]),
                    x(fl, s["gpu_us"].get("dispatch")), x(ea.get(P.BASELINE), ea.get("dispatch")),
                    ", ".join(s["failed"]))
    console.print(tab)
    if res.training:
        tab = Table(title="training fwd+bwd, CUDA events median (speedup = F.linear / hybridgemm.linear)")
        for col in ("shape", "M", "F.linear µs", "hybridgemm.linear µs", "speedup"):
            tab.add_column(col, justify="left" if col == "shape" else "right")
        for s in res.training:
            fl, ours = s["flinear_us"], s["ours_us"]
            tab.add_row(s["shape"], str(s["M"]), f"{fl:.2f}" if fl else "-", f"{ours:.2f}" if ours else "-",
                        x(fl, ours))
        console.print(tab)
