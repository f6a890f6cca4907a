# ruff: noqa: B023  (the lambdas are called inside the loop iteration that made them)
"""Where does host time go?  cProfile of the eager paths the targets measure (GPU machine).

    HYBRIDGEMM_TABLE=autotune_cache/tables/h200.json python scripts/profile_host.py [decode|train|grad|kernels]...

decode   the Qwen2.5-7B attention projection (perf/bench_attention.Layer) at B=1, no_grad
train    one eager fwd+bwd of the same layer at 4096 tokens, and of hybridgemm.linear at M=16
grad     host µs per call of the cuBLASLt backward GEMMs (dx; dW with/without BGRADB; fresh db vs reused)
kernels  which kernels F.linear and the cuBLASLt heuristic run at M=1 (torch.profiler)
"""

import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F

from hybridgemm import dispatch
from hybridgemm.perf.bench_attention import Layer
from hybridgemm.perf.timing import eager_time_interleaved

dt = torch.bfloat16
dev = torch.device("cuda")


def profile(label: str, fn, calls: int = 300, rows: int = 22) -> None:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"\n### {label}: {(time.perf_counter() - t0) / calls * 1e6:.1f} µs/call under cProfile")
    pstats.Stats(pr).sort_stats("tottime").print_stats(rows)


def decode() -> None:
    from hybridgemm.perf.bench_attention import MODEL

    layer = Layer(MODEL, dev, dt)
    x = torch.randn(1, 1, MODEL["hidden"], device=dev, dtype=dt)
    attn = torch.randn(1, 1, MODEL["heads"], MODEL["head_dim"], device=dev, dtype=dt).transpose(1, 2)

    def call(p):
        def fn():
            with torch.no_grad():
                layer.run(p, x, attn)
        return fn

    fns = {p: call(p) for p in ("stock", "naive_fused", "hybridgemm")}
    fns["hybridgemm.forward_qkv"] = lambda: torch.no_grad()(layer.fused.forward_qkv)(x)
    fns["hybridgemm.forward_out"] = lambda: torch.no_grad()(layer.fused.forward_out)(attn)
    for name, t in eager_time_interleaved(fns, calls=300).items():
        print(f"{name:28s} {t.median_us:8.2f} µs/call")
    profile("decode hybridgemm layer.run", fns["hybridgemm"])


def train() -> None:
    from hybridgemm.perf.bench_attention import MODEL, train_step_fn

    layer = Layer(MODEL, dev, dt)
    for tokens in (16, 4096):
        x = torch.randn(1, tokens, MODEL["hidden"], device=dev, dtype=dt, requires_grad=True)
        attn = torch.randn(1, tokens, MODEL["heads"], MODEL["head_dim"], device=dev, dtype=dt, requires_grad=True)
        with torch.no_grad():
            outs = layer.run("stock", x, attn.transpose(1, 2))
        grads = [torch.randn_like(o) for o in outs]
        fns = {p: train_step_fn(layer, p, x, attn, grads) for p in ("stock", "naive_fused", "hybridgemm")}
        for name, t in eager_time_interleaved(fns, calls=50).items():
            print(f"train tokens={tokens} {name:14s} {t.median_us:9.2f} µs/step (wall, synced per round)")
        profile(f"train step tokens={tokens} hybridgemm", fns["hybridgemm"], calls=50, rows=30)


def grad() -> None:
    from hybridgemm.kernels import cublaslt_grad as g

    m, n, k = 16, 4096, 4096
    dz = torch.randn(m, n, device=dev, dtype=dt)
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt)
    fns = {
        "F.linear fwd": lambda: F.linear(x, w),
        "grad_input": lambda: g.grad_input(dz, w),
        "grad_weight bgrad": lambda: g.grad_weight(dz, x, True),
        "grad_weight no bgrad": lambda: g.grad_weight(dz, x, False),
        "torch dW (dz.T @ x) + sum": lambda: (dz.t() @ x, dz.sum(0)),
    }
    for name, t in eager_time_interleaved(fns, calls=300).items():
        print(f"{name:28s} {t.median_us:8.2f} µs/call")
    profile("grad_weight bgrad", fns["grad_weight bgrad"])


def kernels() -> None:
    from hybridgemm.kernels import cublaslt

    for n, k in ((4096, 4096), (1024, 4096), (8192, 28672)):
        x = torch.randn(1, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt)
        b = torch.randn(n, device=dev, dtype=dt)
        for label, fn in (("F.linear", lambda: F.linear(x, w, b)), ("cublaslt", lambda: cublaslt.linear(x, w, b))):
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            names = sorted({e.name[:110] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            print(f"M=1 N={n} K={k} {label}: {names}")


if __name__ == "__main__":
    what = sys.argv[1:] or ["decode", "train", "grad", "kernels"]
    print(dispatch.explain((1, 3584), (4608, 3584)))
    for w in what:
        globals()[w]()
