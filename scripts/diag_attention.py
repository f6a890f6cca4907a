# ruff: noqa: B023  (the lambdas are timed inside the iteration that made them)
"""Probes behind the attention projection's open targets (GPU machine). Prints; changes nothing.

    python scripts/diag_attention.py train [--tokens 4096 16384]   kernels of one fwd+bwd step
    python scripts/diag_attention.py host [--tokens 4096]           host µs per step, per provider
    python scripts/diag_attention.py pieces [--tokens 4096]         host µs of the fast path's pieces
    [HYBRIDGEMM_PDL=0] python scripts/diag_attention.py decode_seq --tokens 1024   decode GPU time, PDL on/off

``train``: per provider of perf/bench_attention.py (stock, naive_fused, hybridgemm), the GPU
kernels one training step launches and their summed time (torch.profiler, 5 steps), so the
gap between providers can be put on named kernels.

``host``: host µs per decode call and per training step of each provider (issued back to
back without waiting), beside the wall time once the GPU has caught up: where host > GPU,
the step is host-bound and the GPU idles.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch


def _kernel_table(fn, steps: int = 5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / steps
    return per


def train(tokens: list[int]) -> None:
    from hybridgemm.perf import bench_attention as ba

    dev, dtype = torch.device("cuda"), torch.bfloat16
    for s in tokens:
        layer = ba.Layer(ba.MODEL, dev, dtype)
        x, attn = ba._inputs(ba.MODEL, 1, s, dev, dtype, grad=True)
        grads = [torch.randn_like(o) for o in layer.run("stock", x, attn.transpose(1, 2))]
        for p in ba.PROVIDERS:
            per = _kernel_table(ba.train_step_fn(layer, p, x, attn, grads))
            print(f"\n## tokens={s} {p}: {sum(per.values()):9.1f} µs of kernels per step")
            for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"  {us:9.1f}  {name[:150]}")


def host(tokens: list[int]) -> None:
    """Host time per step: 30 steps issued back to back, timed without waiting for the GPU
    (the launch queue holds them all), then the GPU time of the same 30 for comparison."""
    import time

    from hybridgemm.perf import bench_attention as ba

    dev, dtype = torch.device("cuda"), torch.bfloat16
    cases = [("decode_b1", 1, 1, False), ("decode_b8", 8, 1, False)] + [(f"train_{s}", 1, s, True) for s in tokens]
    for name, b, s, train in cases:
        layer = ba.Layer(ba.MODEL, dev, dtype)
        x, attn = ba._inputs(ba.MODEL, b, s, dev, dtype, grad=train)
        grads = [torch.randn_like(o) for o in layer.run("stock", x, attn.transpose(1, 2))] if train else None
        for p in ba.PROVIDERS:
            if train:
                fn = ba.train_step_fn(layer, p, x, attn, grads)
            else:
                def fn():
                    with torch.no_grad():
                        layer.run(p, x, attn.transpose(1, 2))
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(30):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"{name:12s} {p:12s} host {(t1 - t0) / 30 * 1e6:8.1f} µs/step   wall {(t2 - t0) / 30 * 1e6:8.1f}")


def _per_call_us(fn, calls: int = 2000) -> float:
    import time

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def pieces(tokens: list[int]) -> None:
    """Host µs of each piece of the decode fast path (B=1), and of the Python pieces of one
    hybridgemm training step (timers wrapped around the Functions and backward GEMMs)."""
    import time

    import torch.nn.functional as F

    from hybridgemm import attention, dispatch, eager_fast
    from hybridgemm.kernels import cublaslt_grad
    from hybridgemm.perf import bench_attention as ba

    dev, dtype = torch.device("cuda"), torch.bfloat16
    layer = ba.Layer(ba.MODEL, dev, dtype)
    mod = layer.fused
    x, attn_bshd = ba._inputs(ba.MODEL, 1, 1, dev, dtype, grad=False)
    attn = attn_bshd.transpose(1, 2)
    w, b = mod.qkv_proj.weight, mod.qkv_proj.bias
    with torch.no_grad():
        mod.forward_qkv(x)
        mod.forward_out(attn)
        key, xp = eager_fast.signature(x, w, b)
        raw, wp, bp, shape, stride = mod._fast_qkv[key]
        y = x.new_empty_strided(shape, stride)
        rows = {
            "F.linear qkv": lambda: F.linear(x, layer.w_cat, layer.b_cat),
            "eligible": lambda: eager_fast.eligible(x, w, b),
            "signature": lambda: eager_fast.signature(x, w, b),
            "new_empty_strided": lambda: x.new_empty_strided(shape, stride),
            "raw launch": lambda: raw(xp, wp, bp, y.data_ptr()),
            "split_with_sizes": lambda: y.split_with_sizes((28, 4, 4), dim=-3),
            "forward_qkv": lambda: mod.forward_qkv(x),
            "forward_out": lambda: mod.forward_out(attn),
            "hybridgemm.linear qkv": lambda: __import__("hybridgemm").linear(x, w, b),
            "layer.run hybridgemm": lambda: layer.run("hybridgemm", x, attn),
            "layer.run naive_fused": lambda: layer.run("naive_fused", x, attn),
        }
        for name, fn in rows.items():
            print(f"decode_b1 {name:24s} {_per_call_us(fn):8.2f} µs/call")

    totals: dict[str, float] = defaultdict(float)

    def timed(owner, attr, label):
        real = getattr(owner, attr)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                totals[label] += time.perf_counter() - t0
        setattr(owner, attr, wrapper)

    timed(attention._QKVProjection, "forward", "qkv forward (incl. GEMM call)")
    timed(attention._QKVProjection, "backward", "qkv backward (incl. below)")
    timed(attention._OutProjection, "forward", "o forward (incl. GEMM call)")
    timed(attention._OutProjection, "backward", "o backward (incl. below)")
    timed(dispatch, "linear_backward", "dispatch.linear_backward")
    timed(dispatch, "fused_linear", "dispatch.fused_linear")
    for fn_name in ("grad_input", "grad_weight"):
        timed(cublaslt_grad, fn_name, f"cublaslt_grad.{fn_name}")
    dispatch._backward_gemms[0] = None  # re-resolve to the wrapped cublaslt_grad functions
    for s in tokens:
        x, attn_bshd = ba._inputs(ba.MODEL, 1, s, dev, dtype, grad=True)
        grads = [torch.randn_like(o) for o in layer.run("stock", x, attn_bshd.transpose(1, 2))]
        step = ba.train_step_fn(layer, "hybridgemm", x, attn_bshd, grads)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        totals.clear()
        fwd = bwd = 0.0
        n = 20
        for _ in range(n):
            params = layer.params("hybridgemm")
            t0 = time.perf_counter()
            for t in (*params, x, attn_bshd):
                t.grad = None
            outs = layer.run("hybridgemm", x, attn_bshd.transpose(1, 2))
            t1 = time.perf_counter()
            torch.autograd.backward(outs, grads)
            t2 = time.perf_counter()
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
        torch.cuda.synchronize()
        print(f"\ntrain_{s}: host forward {fwd / n * 1e6:.1f} µs, backward call {bwd / n * 1e6:.1f} µs per step")
        for label, sec in totals.items():
            print(f"  {label:34s} {sec / n * 1e6:8.1f} µs/step")


def decode_seq(tokens: list[int]) -> None:
    """GPU time (graph replay, L2 flushed) of the decode projections alone (QKV then O, as
    bench_attention times them) and of a realistic decode step in between: QKV, SDPA of the new
    token over a KV cache of ``tokens[0]`` positions, O. Run once with HYBRIDGEMM_PDL=0 and once
    without to see what programmatic dependent launch gives each."""
    import os

    import torch.nn.functional as F

    from hybridgemm.perf import bench_attention as ba
    from hybridgemm.perf.timing import gpu_time

    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = ba.MODEL
    for b in (1, 8):
        layer = ba.Layer(cfg, dev, dtype)
        mod = layer.fused
        x, attn_bshd = ba._inputs(cfg, b, 1, dev, dtype, grad=False)
        attn = attn_bshd.transpose(1, 2)
        kc = torch.randn(b, cfg["kv_heads"], tokens[0], cfg["head_dim"], device=dev, dtype=dtype)
        vc = torch.randn_like(kc)

        def proj():
            mod.forward_qkv(x)
            mod.forward_out(attn)

        def step():
            q, k, v = mod.forward_qkv(x)
            o = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            mod.forward_out(o)

        def sdpa_only():
            F.scaled_dot_product_attention(attn, kc, vc, enable_gqa=True)

        with torch.no_grad():
            t = {name: gpu_time(fn, reps=10, replays=9).median_us
                 for name, fn in (("proj", proj), ("step", step), ("sdpa", sdpa_only))}
        print(f"B={b} PDL={os.environ.get('HYBRIDGEMM_PDL', '1')}: QKV+O {t['proj']:.2f} µs; "
              f"QKV+SDPA({tokens[0]})+O {t['step']:.2f} µs; SDPA alone {t['sdpa']:.2f} µs; "
              f"step - SDPA {t['step'] - t['sdpa']:.2f} µs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", choices=("train", "host", "pieces", "decode_seq"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    {"train": train, "host": host, "pieces": pieces, "decode_seq": decode_seq}[args.probe](args.tokens)


if __name__ == "__main__":
    main()
