"""The attention-layer projection path of Qwen2.5-7B, bf16: stock PyTorch vs hybridgemm.

    python -m hybridgemm.perf.bench_attention --out DIR [--quick] [--scenarios decode_b1 ...]
    python -m hybridgemm.perf.bench_attention --check-only --tiny      # correctness only, any device

The path: x (B, S, 3584) -> q (B, 28, S, 128), k, v (B, 4, S, 128) (q/k/v bias), plus the
O projection (no bias) of an attention output (B, 28, S, 128) laid out as SDPA's flash
kernel leaves it ((B, S, H, D) in memory), to (B, S, 3584). Providers:
  ``stock``        separate nn.Linear q/k/v/o + view/transpose, as HF Qwen2 does (baseline)
  ``naive_fused``  one F.linear over the concatenated QKV weight + split/transpose, F.linear for O
  ``hybridgemm``   AttentionProjection.forward_qkv + forward_out
Scenarios: ``decode_b1``, ``decode_b8`` (S=1), ``prefill_2048`` (B=1): GPU time by CUDA-graph
replay, L2-clean-cold (perf/timing.gpu_time, method ``gpu``) and eager µs per call in
alternating rounds of one loop (``eager_time_interleaved``, method ``eager``), all under one
``torch.no_grad()`` as a decode loop runs; ``train_4096``,
``train_16384`` (tokens, B=1): forward + backward with given output gradients (parameter
grads set to None before each step, as zero_grad does), GPU time by CUDA events around each
step with L2 flushed before it, median (method ``fwd_bwd_events``; not graph-captured). The
providers take turns in rounds of a few steps (``events_time_interleaved``): timed one after
another, whichever ran last read slower (the GPU's clocks drop under sustained GEMM load).
Every provider is checked against an fp32 reference first (outputs, and dx/dW for training);
one that fails is recorded ``failed`` and not timed.
Writes DIR/attention_h200.csv (long form, perf/csvio.py) and prints a summary: µs per layer
and each provider's ratio to stock.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from hybridgemm import AttentionProjection
from hybridgemm.perf.csvio import environment_columns, write_rows
from hybridgemm.perf.timing import eager_time_interleaved, events_time_interleaved, gpu_time

MODEL = dict(name="qwen2.5-7b", hidden=3584, heads=28, kv_heads=4, head_dim=128)
TINY = dict(name="tiny", hidden=256, heads=8, kv_heads=2, head_dim=32)
# name: (B, S, kind)
SCENARIOS = {"decode_b1": (1, 1, "infer"), "decode_b8": (8, 1, "infer"), "prefill_2048": (1, 2048, "infer"),
             "train_4096": (1, 4096, "train"), "train_16384": (1, 16384, "train")}
PROVIDERS = ("stock", "naive_fused", "hybridgemm")
ERR_BOUND = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3, torch.float32: 2e-5}


class Layer:
    """One attention layer's projections in the three forms, sharing the same weights."""

    def __init__(self, cfg: dict, device, dtype):
        hidden, h, hkv, d = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        self.h, self.hkv, self.d = h, hkv, d
        mk = dict(device=device, dtype=dtype)
        self.q = nn.Linear(hidden, h * d, bias=True, **mk)
        self.k = nn.Linear(hidden, hkv * d, bias=True, **mk)
        self.v = nn.Linear(hidden, hkv * d, bias=True, **mk)
        self.o = nn.Linear(h * d, hidden, bias=False, **mk)
        self.fused = AttentionProjection.from_linears(self.q, self.k, self.v, self.o, h, hkv, d)
        with torch.no_grad():
            self.w_cat = nn.Parameter(torch.cat([self.q.weight, self.k.weight, self.v.weight]))
            self.b_cat = nn.Parameter(torch.cat([self.q.bias, self.k.bias, self.v.bias]))

    def params(self, provider: str) -> list[nn.Parameter]:
        if provider == "stock":
            return [p for m in (self.q, self.k, self.v, self.o) for p in m.parameters()]
        if provider == "naive_fused":
            return [self.w_cat, self.b_cat, self.o.weight]
        return list(self.fused.parameters())

    def run(self, provider: str, x: torch.Tensor, attn: torch.Tensor):
        """-> q, k, v (B, heads, S, D), y (B, S, hidden)."""
        b, s, _ = x.shape
        if provider == "stock":
            q, k, v = (lin(x).view(b, s, -1, self.d).transpose(1, 2) for lin in (self.q, self.k, self.v))
            return q, k, v, self.o(attn.transpose(1, 2).flatten(2))  # a view: attn is (B, S, H, D) in memory
        if provider == "naive_fused":
            y = F.linear(x, self.w_cat, self.b_cat).view(b, s, -1, self.d)
            q, k, v = (t.transpose(1, 2) for t in y.split([self.h, self.hkv, self.hkv], dim=2))
            return q, k, v, F.linear(attn.transpose(1, 2).flatten(2), self.o.weight)
        q, k, v = self.fused.forward_qkv(x)
        return q, k, v, self.fused.forward_out(attn)

    def reference(self, x, attn):
        """fp32 from the same (rounded) weights and inputs."""
        b, s, _ = x.shape
        f = {n: getattr(self, n).weight.float() for n in "qkvo"}
        q, k, v = (F.linear(x.float(), f[n], getattr(self, n).bias.float()).view(b, s, -1, self.d).transpose(1, 2)
                   for n in "qkv")
        return q, k, v, F.linear(attn.float().transpose(1, 2).flatten(2), f["o"])


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64, r64 = a.double(), ref.double()
    return float("inf") if not torch.isfinite(a64).all() else ((a64 - r64).norm() / r64.norm()).item()


def _inputs(cfg, b, s, device, dtype, grad: bool):
    x = torch.randn(b, s, cfg["hidden"], device=device, dtype=dtype, requires_grad=grad)
    attn_bshd = torch.randn(b, s, cfg["heads"], cfg["head_dim"], device=device, dtype=dtype, requires_grad=grad)
    return x, attn_bshd


def check_forward(layer: Layer, x, attn_bshd) -> dict[str, float]:
    attn = attn_bshd.transpose(1, 2)
    with torch.no_grad():
        ref = layer.reference(x, attn)
        return {p: max(_rel(o, r) for o, r in zip(layer.run(p, x, attn), ref)) for p in PROVIDERS}


def train_step_fn(layer: Layer, provider: str, x, attn_bshd, grads):
    params = layer.params(provider)

    def step():
        for t in (*params, x, attn_bshd):
            t.grad = None
        outs = layer.run(provider, x, attn_bshd.transpose(1, 2))
        torch.autograd.backward(outs, grads)
    return step


def check_training(layer: Layer, x, attn_bshd, grads) -> dict[str, float]:
    """Max rel error of (outputs' dx, d attn, dW_qkv, dW_o) against fp32 autograd."""
    xr = x.detach().float().requires_grad_(True)
    ar = attn_bshd.detach().float().requires_grad_(True)
    ws = {n: getattr(layer, n).weight.detach().float().requires_grad_(True) for n in "qkvo"}
    b, s, _ = x.shape
    outs = [F.linear(xr, ws[n], getattr(layer, n).bias.detach().float()).view(b, s, -1, layer.d).transpose(1, 2)
            for n in "qkv"] + [F.linear(ar.flatten(2), ws["o"])]  # ar is (B, S, H, D)
    torch.autograd.backward(outs, [g.float() for g in grads])
    ref_wqkv = torch.cat([ws[n].grad for n in "qkv"])
    errs = {}
    for p in PROVIDERS:
        train_step_fn(layer, p, x, attn_bshd, grads)()
        params = layer.params(p)
        if p == "stock":
            wqkv, wo = torch.cat([params[0].grad, params[2].grad, params[4].grad]), params[6].grad
        elif p == "naive_fused":
            wqkv, wo = params[0].grad, params[2].grad
        else:
            wqkv, wo = layer.fused.qkv_proj.weight.grad, layer.fused.o_proj.weight.grad
        errs[p] = max(_rel(x.grad, xr.grad), _rel(attn_bshd.grad, ar.grad), _rel(wqkv, ref_wqkv),
                      _rel(wo, ws["o"].grad))
    return errs


def run_scenario(name, cfg, device, dtype, quick, rows, env, log, scenarios=SCENARIOS):
    b, s, kind = scenarios[name]
    layer = Layer(cfg, device, dtype)
    x, attn_bshd = _inputs(cfg, b, s, device, dtype, grad=kind == "train")
    n_qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * cfg["head_dim"]
    base = dict(env, shape=name, N=n_qkv, K=cfg["hidden"], M=b * s, B=b, S=s, model=cfg["name"],
                dtype=str(dtype).removeprefix("torch."), epilogue="bias")
    if kind == "train":
        outs = layer.run("stock", x, attn_bshd.transpose(1, 2))
        grads = [torch.randn_like(o) for o in outs]
        errs = check_training(layer, x, attn_bshd, grads)
    else:
        errs = check_forward(layer, x, attn_bshd)
    ok = [p for p in PROVIDERS if errs[p] <= max(2 * errs["stock"], ERR_BOUND[dtype])]
    for p in PROVIDERS:
        if p not in ok:
            rows.append(dict(base, provider=p, method="check", status="failed", rel_err=f"{errs[p]:.2e}"))
            log(f"  {name}: {p} FAILED the correctness check: rel err {errs[p]:.2e} (stock {errs['stock']:.2e})")
    result = {"errs": errs}
    if device.type != "cuda":
        return result
    attn = attn_bshd.transpose(1, 2)
    if kind == "train":
        steps = {p: train_step_fn(layer, p, x, attn_bshd, grads) for p in ok}
        timed = events_time_interleaved(steps, rounds=3 if quick else 7, iters=4 if quick else 5)
        for p, t in timed.items():
            rows.append(dict(base, provider=p, method="fwd_bwd_events", status="ok", median_us=round(t.median_us, 3),
                             spread_us=round(t.spread_us, 3), rel_err=f"{errs[p]:.2e}"))
            result[(p, "fwd_bwd_events")] = t.median_us
        return result

    def call(p):
        def fn():
            layer.run(p, x, attn)
        return fn

    # Inference runs under one no_grad for the whole loop, as a decode loop does (entering it
    # per call would add the same few µs of host time to every provider).
    with torch.no_grad():
        for p in ok:
            t = gpu_time(call(p), reps=5 if quick else 10, replays=5 if quick else 9)
            rows.append(dict(base, provider=p, method="gpu", status="ok", median_us=round(t.median_us, 3),
                             spread_us=round(t.spread_us, 3), rel_err=f"{errs[p]:.2e}"))
            result[(p, "gpu")] = t.median_us
        eager = eager_time_interleaved({p: call(p) for p in ok}, calls=100 if quick else 200)
    for p, t in eager.items():
        rows.append(dict(base, provider=p, method="eager", status="ok", median_us=round(t.median_us, 3),
                         spread_us=round(t.spread_us, 3)))
        result[(p, "eager")] = t.median_us
    return result


def _summary(results: dict) -> list[str]:
    lines = ["", "µs per layer (ratio = stock / provider; > 1 is faster than stock)"]
    lines.append(f"{'scenario':14s}{'method':16s}" + "".join(f"{p:>20s}" for p in PROVIDERS))
    for name, res in results.items():
        methods = sorted({k[1] for k in res if isinstance(k, tuple)})
        for m in methods:
            stock = res.get(("stock", m))
            cells = []
            for p in PROVIDERS:
                t = res.get((p, m))
                cells.append(f"{'-':>20s}" if t is None else
                             f"{t:11.2f}" + (f" ({stock / t:5.2f}x)" if stock and t else " " * 9))
            lines.append(f"{name:14s}{m:16s}" + "".join(cells))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="perf/results/h200")
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--quick", action="store_true", help="fewer replays and steps")
    ap.add_argument("--check-only", action="store_true", help="correctness checks only, no timing, no CSV")
    ap.add_argument("--tiny", action="store_true", help="a small layer (hidden 256) and short sequences")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.check_only:
        print("bench_attention: timing needs a CUDA GPU (use --check-only without one)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TINY if args.tiny else MODEL
    scenarios = {k: (b, min(s, 64), kind) for k, (b, s, kind) in SCENARIOS.items()} if args.tiny else SCENARIOS
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references must be fp32
    torch.manual_seed(0)

    env = environment_columns(" ".join(["python -m hybridgemm.perf.bench_attention", *(argv or sys.argv[1:])]))
    rows, results, failed = [], {}, 0
    t0 = time.time()
    for name in args.scenarios:
        res = run_scenario(name, cfg, device, dtype, args.quick, rows, env, print, scenarios)
        results[name] = res
        failed += sum(1 for r in rows if r["shape"] == name and r.get("status") == "failed")
        errs = " ".join(f"{p} {e:.1e}" for p, e in res["errs"].items())
        print(f"[{time.time() - t0:6.1f}s] {name}: rel err vs fp32 reference: {errs}", flush=True)
        if not args.check_only and rows:
            os.makedirs(args.out, exist_ok=True)
            write_rows(os.path.join(args.out, "attention_h200.csv"), rows)  # upsert after every scenario
    if not args.check_only:
        print(f"\nwrote {len(rows)} rows to {os.path.join(args.out, 'attention_h200.csv')}")
        print("\n".join(_summary(results)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
