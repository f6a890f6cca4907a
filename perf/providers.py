"""Benchmark providers: the ways of computing ``act(x @ W.T + b)`` that the harness compares.

A provider is a registered function ``make(problem_tensors) -> callable or None``: given the
operands of one problem it returns a zero-argument callable that computes the result (and
returns it), or None where it does not apply. A provider that cannot run here at all (no GPU,
no nvmath-python, no ``hybridgemm.linear``) is skipped with a note, never an error; so is
one that does not apply to a problem (:class:`ProviderSkip` carries the note).

The "best of" providers (``cublaslt_best``, ``triton_best``) time their candidates inside
``make`` with the same method the harness uses, and keep the fastest correct one: they show
what each backend can reach with per-shape tuning, the dispatcher's table aside.

Nothing here touches the GPU at import time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm.dispatch import fused_linear
from hybridgemm.explain import explain
from hybridgemm.kernels import cublaslt
from hybridgemm.kernels import cublaslt as lt
from hybridgemm.kernels import cublaslt_search as lts
from hybridgemm.kernels.backends import get_backend
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.problem import Problem
from hybridgemm.perf.timing import eager_time_interleaved, events_time, gpu_time, reps_for

# Relative Frobenius error floors per dtype: a provider passes when its error is at most
# max(2 x F.linear's own error on the same inputs, floor) (as in the tests and the tuner).
ERR_FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


class ProviderSkip(Exception):
    """The provider cannot run this problem here; the message is the note recorded."""


@dataclass
class Timers:
    """The timing functions, injectable so the harness's bookkeeping runs in CPU tests.
    ``gpu(fn, reps=, replays=)`` -> Timing; ``eager(dict of fns, calls=)`` -> {name: Timing};
    ``events(fn)`` -> Timing; ``reps(fn)`` -> calls per captured graph."""

    gpu: Callable
    eager: Callable
    events: Callable
    reps: Callable[[Callable], int]

    @classmethod
    def default(cls) -> Timers:
        return cls(gpu_time, eager_time_interleaved, events_time, reps_for)


@dataclass
class ProblemTensors:
    """Operands, fp32 reference and error bound of one (shape, M) point."""

    shape: str
    x: torch.Tensor  # (M, K)
    w: torch.Tensor  # (N, K)
    b: torch.Tensor | None  # (N,)
    act: Activation
    ref: torch.Tensor  # fp32 act(x @ W.T + b), TF32 off
    timers: Timers | None = None
    bound: float = math.inf  # set once F.linear's own error is known (make_problem_tensors)
    flinear_err: float = math.nan
    notes: dict = field(default_factory=dict)

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def n(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1]

    @property
    def epilogue(self) -> Epilogue:
        return Epilogue(self.act, self.b is not None)

    def problem(self, out: torch.Tensor | None = None) -> Problem:
        out = torch.empty(self.m, self.n, dtype=self.x.dtype, device=self.x.device) if out is None else out
        tf32 = self.x.dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)
        return Problem.from_tensors(self.x, self.w, self.b, out, self.epilogue, tf32)

    def rel_err(self, y: torch.Tensor) -> float:
        if y.shape != self.ref.shape:
            return math.inf
        y = y.float()
        if not bool(torch.isfinite(y).all()):
            return math.inf
        denom = self.ref.norm().item()
        diff = (y - self.ref).norm().item()
        return diff / denom if denom > 0 else diff

    def passes(self, y: torch.Tensor) -> tuple[bool, float]:
        e = self.rel_err(y)
        return e <= self.bound, e


def make_problem_tensors(shape: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool,
                         activation=None, device="cuda", timers: Timers | None = None,
                         seed: int = 0) -> ProblemTensors:
    """Random operands scaled like a trained layer (W ~ 1/sqrt(K)), the fp32 reference, and the
    error bound from F.linear's own error on these inputs."""
    act = Activation.parse(activation)
    # drawn on the device: a CPU generator would spend ~1 s per large point on randn alone
    g = torch.Generator(device=device).manual_seed(seed + 7919 * m + 31 * n + k)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a reference must be true fp32
    try:
        ref = apply_activation(F.linear(x.float(), w.float(), None if b is None else b.float()), act)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    pt = ProblemTensors(shape, x, w, b, act, ref, timers)
    pt.flinear_err = pt.rel_err(apply_activation(F.linear(x, w, b), act))
    pt.bound = max(2.0 * pt.flinear_err, ERR_FLOOR.get(dtype, 1e-5))
    return pt


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Provider:
    name: str
    make: Callable[[ProblemTensors], Callable[[], torch.Tensor] | None]
    doc: str
    needs: tuple[str, ...] = ()  # "cuda", "nvmath", "hybridgemm.linear"
    opt_in: bool = False  # run only when named in --providers (slow)

    def unavailable(self) -> str | None:
        """None if this provider can run on this machine, else the note saying why not."""
        for need in self.needs:
            note = _NEED_CHECKS[need]()
            if note:
                return note
        return None


def _no_cuda() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU (none here)"


def _no_nvmath() -> str | None:
    if _no_cuda():
        return _no_cuda()
    return None if cublaslt.is_available() else "needs nvmath-python's cuBLASLt bindings (not installed)"


def hybridgemm_linear():
    """``hybridgemm.linear`` (fusion/linear_layer.py)."""
    return hybridgemm.linear


_NEED_CHECKS = {
    "cuda": _no_cuda,
    "nvmath": _no_nvmath,
    "hybridgemm.linear": lambda: None,
}

PROVIDERS: dict[str, Provider] = {}
BASELINE = "flinear"


def register(name: str, doc: str, needs: tuple[str, ...] = (), opt_in: bool = False):
    def deco(make):
        PROVIDERS[name] = Provider(name, make, doc, needs, opt_in)
        return make

    return deco


def provider_names(include_opt_in: bool = True) -> list[str]:
    return [p.name for p in PROVIDERS.values() if include_opt_in or not p.opt_in]


def select(names: list[str] | None = None) -> list[Provider]:
    """The providers to run, baseline first. ``None``: every provider that is not opt-in."""
    names = provider_names(include_opt_in=False) if not names else list(names)
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(PROVIDERS)}")
    ordered = [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]  # every ratio needs it
    return [PROVIDERS[n] for n in ordered]


def split_available(providers: list[Provider]) -> tuple[list[Provider], dict[str, str]]:
    """(those that can run here, {name: note} for those that cannot)."""
    ok, skipped = [], {}
    for p in providers:
        note = p.unavailable()
        if note:
            skipped[p.name] = note
        else:
            ok.append(p)
    return ok, skipped


def build(provider: Provider, pt: ProblemTensors) -> Callable[[], torch.Tensor]:
    """The provider's callable for ``pt``; raises :class:`ProviderSkip` with the note if none."""
    note = provider.unavailable()
    if note:
        raise ProviderSkip(note)
    fn = provider.make(pt)
    if fn is None:
        raise ProviderSkip(f"{provider.name} does not apply to {pt.shape} M={pt.m} ({pt.epilogue.name})")
    return fn


def config_of(fn) -> str:
    return getattr(fn, "config", "")


def _tag(fn, config: str):
    fn.config = config
    return fn


# ----------------------------------------------------------------------------- providers


@register("flinear", "torch.nn.functional.linear + activation (the baseline)")
def _flinear(pt: ProblemTensors):
    x, w, b, act = pt.x, pt.w, pt.b, pt.act
    if act is Activation.NONE:  # no wrapper call: its host time is part of what we measure
        return lambda: F.linear(x, w, b)
    return lambda: apply_activation(F.linear(x, w, b), act)


@register("matmul_add", "unfused x @ W.T, then + b, then the activation")
def _matmul_add(pt: ProblemTensors):
    x, w, b, act = pt.x, pt.w, pt.b, pt.act
    if b is None:
        return lambda: apply_activation(x @ w.T, act)
    return lambda: apply_activation(x @ w.T + b, act)


@register("cublaslt_heuristic", "hybridgemm.kernels.cublaslt.linear, heuristic's first algorithm",
          needs=("cuda", "nvmath"))
def _cublaslt_heuristic(pt: ProblemTensors):
    if not lt.epilogue_supported(pt.epilogue):
        raise ProviderSkip(f"cuBLASLt has no epilogue {pt.epilogue.name!r}")
    x, w, b, act = pt.x, pt.w, pt.b, pt.act
    return _tag(lambda: lt.linear(x, w, b, act), "heuristic #0")


@register("cublaslt_best", "fastest of cuBLASLt's heuristic top 16 + 16 exhaustive algorithms",
          needs=("cuda", "nvmath"))
def _cublaslt_best(pt: ProblemTensors):
    problem = pt.problem()
    ok, why = lt.supports(problem)
    if not ok:
        raise ProviderSkip(why)
    dev = pt.x.device.index if pt.x.device.index is not None else torch.cuda.current_device()
    algos = lts.candidates(problem, dev, heuristic_count=16, exhaustive_limit=16)
    x, w, b, act = pt.x, pt.w, pt.b, pt.act
    cands = [(f"{a.source}: {a.describe()}", lambda a=a: lt.linear(x, w, b, act, algo=a)) for a in algos]
    return fastest(pt, cands, "cuBLASLt")


@register("triton_best", "fastest of the Triton split-K and tiled kernels' candidates for this M",
          needs=("cuda",))
def _triton_best(pt: ProblemTensors):
    problem = pt.problem()
    x, w, b, act = pt.x, pt.w, pt.b, pt.act
    shape, dtype, device = (pt.m, pt.n), x.dtype, x.device
    cands = []
    for name in ("triton_splitk", "triton_gemm"):
        be = get_backend(name)  # its candidates() carry this device's SM count and smem limit
        for cfg in be.candidates(problem):
            # allocate the output like F.linear does, so host times compare like for like
            fn = (lambda be=be, cfg=cfg: be.run(cfg, x, w, b, torch.empty(shape, dtype=dtype, device=device),
                                                act, problem.tf32))
            cands.append((f"{name} {be.describe(cfg)}", fn))
    return fastest(pt, cands, "Triton")


@register("dispatch", "hybridgemm.dispatch.fused_linear: the tuned table's pick (what users get)",
          needs=("cuda",))
def _dispatch(pt: ProblemTensors):
    x, w, b, act = pt.x, pt.w, pt.b, pt.act
    why = explain(tuple(x.shape), tuple(w.shape), x.dtype, bias=b is not None, activation=act)
    runs = [ln.strip().removeprefix("runs ") for ln in why.splitlines() if ln.strip().startswith("runs ")]
    return _tag(lambda: fused_linear(x, w, b, act), runs[0] if runs else "")


@register("compile_max_autotune", "torch.compile(F.linear + activation), max-autotune GEMM search "
          "(no inductor CUDA graphs: the timer captures its own)", needs=("cuda",), opt_in=True)
def _compile_max_autotune(pt: ProblemTensors):
    import torch._dynamo

    # A fresh compile per problem: every (shape, M) would otherwise recompile the same code
    # object and hit dynamo's recompile limit, falling back to eager silently.
    torch._dynamo.reset()
    act = pt.act

    def f(x, w, b):
        return apply_activation(F.linear(x, w, b), act)

    # "max-autotune" would also wrap the graph in inductor's CUDA graphs, which cannot be
    # captured inside gpu_time's own graph; the GEMM autotuning is the same without them.
    cf = torch.compile(f, mode="max-autotune-no-cudagraphs", dynamic=False)
    x, w, b = pt.x, pt.w, pt.b
    cf(x, w, b)  # compile and autotune now, outside any timed region
    return _tag(lambda: cf(x, w, b), "mode=max-autotune-no-cudagraphs")


# ----------------------------------------------------------------------------- best-of


def fastest(pt: ProblemTensors, cands: list[tuple[str, Callable]], what: str, finalists: int = 3):
    """The fastest correct candidate, by the harness's timer: all timed with 5 replays, the
    ``finalists`` fastest re-timed with 9 (the tuner's rule). Candidates that fail the error
    bound or raise are dropped; if none is left, :class:`ProviderSkip` says why."""
    if pt.timers is None:
        raise ProviderSkip(f"{what} best-of needs timers")
    timed, rejected = [], []
    reps = None
    for label, fn in cands:
        try:
            ok, e = pt.passes(fn())
            if not ok:
                rejected.append(f"{label}: rel err {e:.2e} > {pt.bound:.2e}")
                continue
            reps = reps or pt.timers.reps(fn)
            timed.append([pt.timers.gpu(fn, reps=reps, replays=5).median_us, label, fn])
        except Exception as ex:  # compile or launch failure: that candidate is out, reported below
            rejected.append(f"{label}: {type(ex).__name__}: {str(ex)[:120]}")
    if not timed:
        first = "; ".join(rejected[:2]) or "no candidates for this problem"
        raise ProviderSkip(f"no {what} candidate ran ({len(cands)} offered): {first}")
    timed.sort(key=lambda r: r[0])
    for r in timed[:finalists]:
        r[0] = pt.timers.gpu(r[2], reps=reps, replays=9).median_us
    best = min(timed[:finalists], key=lambda r: r[0])
    pt.notes[what] = rejected
    dropped = f", {len(rejected)} rejected" if rejected else ""
    return _tag(best[2], f"{best[1]} (best of {len(timed)}{dropped})")
