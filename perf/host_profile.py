"""Where host time goes (GPU machine): µs per eager call along hybridgemm's call paths, and
cProfile / torch.profiler views of them.

    HYBRIDGEMM_TABLE=autotune_cache/tables/h200.json python -m hybridgemm.perf.host_profile [PROBE ...]

calls        µs per eager call of each layer of the decode path (Qwen2.5-7B QKV shape, M=1,
             bf16): F.linear, the chosen backend's ``run``, ``call_signature``,
             ``dispatch.fused_linear``, ``hybridgemm.linear``, ``AttentionProjection.forward_qkv``
             and ``forward_out``
decode       the Qwen2.5-7B attention projection (perf/bench_attention.Layer) at B=1, no_grad:
             µs per call of each provider, then cProfile of hybridgemm's
train        one eager fwd+bwd of the same layer at 16 and 4096 tokens: µs per step, cProfile
grad         µs per call of the cuBLASLt backward GEMMs (dx; dW with and without BGRADB; torch's)
kernels      which CUDA kernels F.linear and the cuBLASLt heuristic run at M=1 (torch.profiler)
linear-step  eager fwd+bwd of ``hybridgemm.linear`` beside F.linear at ``--m --n --k``: µs per
             step, then torch.profiler tables (CPU and CUDA time)
w8a8         the W8A8 prefill path's host cost: Llama-3-8B's O (4096 x 4096) and down (4096 x
             14336, its input the gated product) as per-channel FP8 weights at ``--m`` rows
             (default 16 is raised to 64: W8A8 runs past the decode rows); at 64 rows the GPU's
             work is a few µs, so the figures are the host's. µs per call of each layer of the
             call (the checks, the dispatcher's decision, the quantize launch, cuBLASLt's
             ``run``, ``fp8_linear``, ``linear_fp8``, ``linear_fp8_glu``), then cProfile of
             ``run``, ``linear_fp8`` and ``linear_fp8_glu`` by cumulative time
hf-layer     a one-layer HF model of preset ``--model`` (default llama3-8b; perf/e2e_models.py),
             stock and patched, eager decode of one token at ``--batch`` over a static cache:
             µs per call of q/k/v, o, the MLP (where the layer has them), the LM head and
             the whole step, then cProfile of the stock and the patched step (by cumulative time; the patched
             one by own time too)

No PROBE: all of them. Every µs figure is ``perf/timing.eager_time_interleaved`` (the
callables alternate in rounds of one loop); cProfile and torch.profiler slow what they watch,
so read their tables for proportions.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm import decide, dispatch
from hybridgemm import fp8_linear as fl
from hybridgemm.kernels import cublaslt, cublaslt_fp8, fp8, fp8_quant
from hybridgemm.kernels import cublaslt_grad as grad_gemms
from hybridgemm.kernels.backends import get_backend
from hybridgemm.kernels.checks import call_signature
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import DECODE_MAX_M, Problem
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf.bench_attention import MODEL, Layer, train_step_fn
from hybridgemm.perf.timing import eager_time_interleaved

PROBES = ("calls", "decode", "train", "grad", "kernels", "linear-step", "w8a8", "hf-layer")
DTYPE = torch.bfloat16


def _print_times(fns: dict, calls: int, unit: str = "µs/call", width: int = 36) -> None:
    for name, t in eager_time_interleaved(fns, calls=calls).items():
        print(f"{name:{width}s} {t.median_us:9.2f} {unit}")


def _cprofile(label: str, fn, calls: int = 300, rows: int = 22, sort: str = "tottime") -> None:
    """cProfile of ``calls`` back-to-back calls of ``fn`` (after 20 unprofiled ones), the
    ``rows`` functions first by ``sort`` (pstats' key: own time by default)."""
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
    pstats.Stats(pr).sort_stats(sort).print_stats(rows)


def calls_probe(args) -> None:
    hidden, h, hkv, d = MODEL["hidden"], MODEL["heads"], MODEL["kv_heads"], MODEL["head_dim"]
    x = torch.randn(1, 1, hidden, device="cuda", dtype=DTYPE)
    w = torch.randn((h + 2 * hkv) * d, hidden, device="cuda", dtype=DTYPE) / 60
    b = torch.randn((h + 2 * hkv) * d, device="cuda", dtype=DTYPE)
    x2 = x.view(1, hidden)
    out = torch.empty(1, w.shape[0], device="cuda", dtype=DTYPE)
    mod = hybridgemm.AttentionProjection(hidden, h, hkv, qkv_bias=True, out_bias=False, device="cuda", dtype=DTYPE)
    attn = torch.randn(1, 1, h, d, device="cuda", dtype=DTYPE).transpose(1, 2)
    problem = Problem.from_tensors(x2, w, b, out, Epilogue(Activation.NONE, True))
    choice = decide.choose(problem, torch.cuda.current_device())
    fns = {"F.linear": lambda: F.linear(x, w, b)}
    if choice.backend != "torch":
        be = get_backend(choice.backend)
        fns[f"{choice.backend}.run direct"] = lambda: be.run(choice.config, x2, w, b, out, Activation.NONE)
    fns.update({
        "call_signature": lambda: call_signature(x, w, b, None),
        "dispatch.fused_linear": lambda: dispatch.fused_linear(x, w, b),
        "hybridgemm.linear": lambda: hybridgemm.linear(x, w, b),
        "AttentionProjection.forward_qkv": lambda: mod.forward_qkv(x),
        "AttentionProjection.forward_out": lambda: mod.forward_out(attn),
    })
    with torch.no_grad():
        _print_times(fns, calls=300)


def decode_probe(args) -> None:
    layer = Layer(MODEL, "cuda", DTYPE)
    x = torch.randn(1, 1, MODEL["hidden"], device="cuda", dtype=DTYPE)
    attn = torch.randn(1, 1, MODEL["heads"], MODEL["head_dim"], device="cuda", dtype=DTYPE).transpose(1, 2)

    def call(p):
        def fn():
            with torch.no_grad():
                layer.run(p, x, attn)
        return fn

    fns = {p: call(p) for p in ("stock", "naive_fused", "hybridgemm")}
    fns["hybridgemm.forward_qkv"] = lambda: torch.no_grad()(layer.fused.forward_qkv)(x)
    fns["hybridgemm.forward_out"] = lambda: torch.no_grad()(layer.fused.forward_out)(attn)
    _print_times(fns, calls=300, width=28)
    _cprofile("decode hybridgemm layer.run", fns["hybridgemm"])


def train_probe(args) -> None:
    layer = Layer(MODEL, "cuda", DTYPE)
    for tokens in (16, 4096):
        x = torch.randn(1, tokens, MODEL["hidden"], device="cuda", dtype=DTYPE, requires_grad=True)
        attn = torch.randn(1, tokens, MODEL["heads"], MODEL["head_dim"], device="cuda", dtype=DTYPE,
                           requires_grad=True)
        with torch.no_grad():
            outs = layer.run("stock", x, attn.transpose(1, 2))
        grads = [torch.randn_like(o) for o in outs]
        fns = {p: train_step_fn(layer, p, x, attn, grads) for p in ("stock", "naive_fused", "hybridgemm")}
        for name, t in eager_time_interleaved(fns, calls=50).items():
            print(f"train tokens={tokens} {name:14s} {t.median_us:9.2f} µs/step (wall, synced per round)")
        _cprofile(f"train step tokens={tokens} hybridgemm", fns["hybridgemm"], calls=50, rows=30)


def grad_probe(args) -> None:
    m, n, k = 16, 4096, 4096
    dz = torch.randn(m, n, device="cuda", dtype=DTYPE)
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    fns = {
        "F.linear fwd": lambda: F.linear(x, w),
        "grad_input": lambda: grad_gemms.grad_input(dz, w),
        "grad_weight bgrad": lambda: grad_gemms.grad_weight(dz, x, True),
        "grad_weight no bgrad": lambda: grad_gemms.grad_weight(dz, x, False),
        "torch dW (dz.T @ x) + sum": lambda: (dz.t() @ x, dz.sum(0)),
    }
    _print_times(fns, calls=300, width=28)
    _cprofile("grad_weight bgrad", fns["grad_weight bgrad"])


def kernels_probe(args) -> None:
    for n, k in ((4096, 4096), (1024, 4096), (8192, 28672)):
        x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        w = torch.randn(n, k, device="cuda", dtype=DTYPE)
        b = torch.randn(n, device="cuda", dtype=DTYPE)
        for label, fn in (("F.linear", lambda: F.linear(x, w, b)), ("cublaslt", lambda: cublaslt.linear(x, w, b))):
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            names = sorted({e.name[:110] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            print(f"M=1 N={n} K={k} {label}: {names}")


def linear_step_probe(args) -> None:
    m, n, k = args.m, args.n, args.k
    x = torch.randn(m, k, device="cuda", dtype=DTYPE, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=DTYPE, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=DTYPE)

    def step(fn):
        def run():
            fn(x, w, b).backward(g)
        return run

    print(f"linear-step M={m} N={n} K={k}")
    _print_times({"F.linear": step(F.linear), "hybridgemm.linear": step(hybridgemm.linear)}, calls=50,
                 unit="µs/step (eager fwd+bwd)", width=20)
    ours = step(hybridgemm.linear)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            ours()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))


def w8a8_probe(args) -> None:
    m = max(args.m, 64) if args.m <= DECODE_MAX_M else args.m
    hidden, inter = 4096, 14336
    x = torch.randn(1, m, hidden, device="cuda", dtype=DTYPE)
    x2 = x.view(m, hidden)
    gate_up = torch.randn(1, m, 2 * inter, device="cuda", dtype=DTYPE)
    w_o = fp8.quantize_fp8(torch.randn(hidden, hidden, device="cuda", dtype=DTYPE) / 64, "channel")
    w_down = fp8.quantize_fp8(torch.randn(hidden, inter, device="cuda", dtype=DTYPE) / 120, "channel")
    w_bf16 = fp8.dequantize(w_o.data, w_o.scale, DTYPE)
    out = torch.empty(m, hidden, device="cuda", dtype=DTYPE)
    o8, os_ = w_o.data, w_o.scale
    problem_args = (x2, o8, None, out, Activation.NONE, fp8.FORMAT_OF["channel"])
    print(f"w8a8 M={m}: O {tuple(o8.shape)}, down {tuple(w_down.data.shape)} (glu), per channel")
    fns = {
        "F.linear bf16 (O)": lambda: F.linear(x, w_bf16),
        "check_fp8_args (O)": lambda: fl.check_fp8_args(x, o8, os_, None),
        "cublaslt_fp8.environment": lambda: cublaslt_fp8.environment(x.device.index),
        "dispatch.decision_for (O)": lambda: dispatch.decision_for(*problem_args),
        "quantize_for_gemm (O)": lambda: fp8_quant.quantize_for_gemm(x2, "token"),
        "cublaslt_fp8.run (O)": lambda: cublaslt_fp8.run(x2, o8, os_, out=out),
        "fp8_linear W8A8 (O)": lambda: fl.fp8_linear(x, o8, os_, None, None, True),
        "linear_fp8 W8A8 (O)": lambda: fl.linear_fp8(x, o8, os_, quantize_input=True),
        "linear_fp8_glu W8A8 (down)": lambda: fl.linear_fp8_glu(gate_up, w_down.data, w_down.scale, None, "silu",
                                                                True),
    }
    with torch.no_grad():
        _print_times(fns, calls=300, width=30)
        for name in ("cublaslt_fp8.run (O)", "linear_fp8 W8A8 (O)", "linear_fp8_glu W8A8 (down)"):
            _cprofile(name, fns[name], calls=300, rows=40, sort="cumulative")


STEP_CACHE_LEN = 64


def _endless_steps(model, api, ids, pos, cache):
    """One-token decode steps at position ``pos`` over ``cache``, as many as asked: a cache
    that keeps its own position (transformers 5) is reset before it fills (one call in
    ``STEP_CACHE_LEN - 1`` then also zeroes the cache)."""
    calls = [0]

    def step():
        calls[0] += 1
        if calls[0] % (STEP_CACHE_LEN - 1) == 0:
            cache.reset()
        return hf.cached_forward(model, api, ids, cache, pos)

    return step


def _decoder_layers(model) -> torch.nn.ModuleList:
    """The model's list of decoder layers (``model.layers``, ``gpt_neox.layers``, ``transformer.h``)."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))


def hf_layer_probe(args) -> None:
    stock = hf.build_model(hf.hf_config(args.model, layers=1), DTYPE, "cuda")
    patched = copy.deepcopy(stock)
    print(hybridgemm.patch(patched).summary())
    batch, hidden = args.batch, stock.config.hidden_size
    x = torch.randn(batch, 1, hidden, device="cuda", dtype=DTYPE)
    heads = stock.config.num_attention_heads
    head_dim = getattr(stock.config, "head_dim", None) or hidden // heads
    attn = torch.randn(batch, 1, heads * head_dim, device="cuda", dtype=DTYPE)
    ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    fns = {}
    for name, model in (("stock", stock), ("patched", patched)):
        layer, api = _decoder_layers(model)[0], hf.forward_api(model)
        step = _endless_steps(model, api, ids, pos, hf.static_cache(model, batch, STEP_CACHE_LEN))
        a = next(layer._modules[n] for n in ("self_attn", "attention", "self_attention") if n in layer._modules)
        if hasattr(a, "qkv_proj"):  # the patched fused Q/K/V, or a checkpoint's own (Phi-3)
            fns[f"{name} q/k/v"] = lambda a=a: a.qkv_proj(x)
        elif all(hasattr(a, p) for p in ("q_proj", "k_proj", "v_proj")):
            fns[f"{name} q/k/v"] = lambda a=a: (a.q_proj(x), a.k_proj(x), a.v_proj(x))
        if hasattr(a, "o_proj"):
            fns[f"{name} o"] = lambda a=a: a.o_proj(attn)
        if hasattr(layer, "mlp"):
            fns[f"{name} mlp"] = lambda layer=layer: layer.mlp(x)
        fns[f"{name} lm_head"] = lambda model=model: model.get_output_embeddings()(x)
        fns[f"{name} one-token step"] = step
    with torch.no_grad():
        _print_times(fns, calls=200, width=28)
        for name in ("stock", "patched"):  # by cumulative time: where each step's host time goes, side by side
            _cprofile(f"{name} one-token step", fns[f"{name} one-token step"], calls=100, rows=45, sort="cumulative")
        _cprofile("patched one-token step", fns["patched one-token step"], calls=100, rows=30)  # by own time


RUN = {"calls": calls_probe, "decode": decode_probe, "train": train_probe, "grad": grad_probe,
       "kernels": kernels_probe, "linear-step": linear_step_probe, "w8a8": w8a8_probe,
       "hf-layer": hf_layer_probe}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.host_profile", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("probes", nargs="*", metavar="PROBE", help=f"any of {', '.join(PROBES)} (default: all)")
    ap.add_argument("--m", type=int, default=16, help="linear-step, w8a8: rows of x (default 16; w8a8 raises it to 64)")
    ap.add_argument("--n", type=int, default=4096, help="linear-step: output features (default 4096)")
    ap.add_argument("--k", type=int, default=4096, help="linear-step: input features (default 4096)")
    ap.add_argument("--batch", type=int, default=1, help="hf-layer: sequences decoded at once (default 1)")
    ap.add_argument("--model", default="llama3-8b", choices=hf.model_names(),
                    help="hf-layer: the preset whose one-layer model is profiled (default llama3-8b)")
    args = ap.parse_args(argv)
    if min(args.m, args.n, args.k, args.batch) < 1:
        ap.error(f"--m, --n, --k and --batch must be positive, got {args.m}, {args.n}, {args.k}, {args.batch}")
    unknown = [p for p in args.probes if p not in PROBES]
    if unknown:
        ap.error(f"unknown probe {', '.join(map(repr, unknown))}; probes: {', '.join(PROBES)}")
    args.probes = args.probes or list(PROBES)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("host_profile: needs a CUDA GPU (none found here); run it on the GPU machine", file=sys.stderr)
        return 2
    print(hybridgemm.explain((1, MODEL["hidden"]), ((MODEL["heads"] + 2 * MODEL["kv_heads"]) * MODEL["head_dim"],
                                                    MODEL["hidden"])))
    for name in args.probes:
        print(f"\n## {name}")
        RUN[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
