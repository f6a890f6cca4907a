"""The FP8 prefill path beside bf16, GPU time at prefill M, on the projection shapes of llama3-8b.

    python -m hybridgemm.perf.bench_fp8_prefill [--shapes N,K ...] [--m 2048] [--dtype bf16] --out CSV

Providers, per shape (N, K) and M, for a weight quantized to e4m3 per channel and per 128 x 128
block (kernels/fp8.py):

- ``flinear``: ``F.linear`` with the dequantized weight in bf16/fp16 (what an unquantized model
  runs; the baseline of ``speedup_vs_flinear``);
- ``dequant_flinear_<granularity>``: dequantize the e4m3 weight, then ``F.linear`` (the fallback
  where the FP8 path cannot run), per call;
- ``hybridgemm_<granularity>``: ``hybridgemm.linear(x, w8)``, the path a patched model takes (the
  table's decision at this M; without an FP8 entry, the weight dequantized in one pass,
  kernels/triton_dequant.py, then the bf16/fp16 GEMM);
- ``fp8_cublaslt_<granularity>``: kernels/cublaslt_fp8.run, quantizing x included.

Each provider's result is checked against an fp32 reference (x times the dequantized weight)
before it is timed (``rel_err``; the FP8 path's includes quantizing x). GPU time: CUDA graphs of
the calls, L2 flushed (read) before each, replayed in interleaved rounds (perf/timing.gpu_time_many).
Rows are upserted into the CSV (perf/csvio.py); a summary is printed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm.kernels import cublaslt_fp8
from hybridgemm.kernels.fp8 import dequantize, quantize_fp8
from hybridgemm.kernels.problem import NAME_TO_DTYPE

from .csvio import environment_columns, write_rows
from .sweep_configs import _shape as shape_arg  # "N,K" -> (N, K), argparse's error otherwise
from .timing import gpu_time_many

# (name, N, K): llama3-8b's projections (autotune_cache/presets.py): fused qkv, o, fused gate_up, down
SHAPES = [("llama3-8b.qkv", 6144, 4096), ("llama3-8b.o", 4096, 4096), ("llama3-8b.gate_up", 28672, 4096),
          ("llama3-8b.down", 4096, 14336)]
GRANULARITIES = ("channel", "block128")
# rel err against the fp32 reference above which a provider's rows say "failed" (not timed):
# the bf16 GEMM's rounding; for the FP8 path, quantizing x to e4m3 costs a few percent
MAX_ERR = {"flinear": 2e-2, "dequant": 2e-2, "fp8": 1e-1}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_shape(name: str, n: int, k: int, m: int, dtype: torch.dtype, env: dict) -> list[dict]:
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = torch.randn(n, k, device="cuda") / k**0.5
    base = dict(env, shape=name, N=n, K=k, M=m, dtype=str(dtype).removeprefix("torch."), epilogue="none",
                method="gpu")
    providers: dict[str, tuple] = {}  # name -> (call or None, kind, fp32 reference, note)
    for g in GRANULARITIES:
        wq = quantize_fp8(w, g)
        ref = F.linear(x.float(), dequantize(wq.data, wq.scale, torch.float32))
        if not providers:  # the baseline: the (channel) dequantized weight, stored in dtype
            w16 = wq.dequantize(dtype)
            providers["flinear"] = (lambda w16=w16: F.linear(x, w16), "flinear", F.linear(x.float(), w16.float()), "")
        providers[f"dequant_flinear_{g}"] = (
            lambda wq=wq: F.linear(x, dequantize(wq.data, wq.scale, dtype)), "dequant", ref, "")
        wq16 = quantize_fp8(w.to(dtype), g)  # computing in dtype, as a model's weight would
        providers[f"hybridgemm_{g}"] = (lambda wq16=wq16: hybridgemm.linear(x, wq16), "dequant",
                                        F.linear(x.float(), dequantize(wq16.data, wq16.scale, torch.float32)), "")
        ok, why = cublaslt_fp8.check(n, k, dtype, g)
        call = None
        if ok:
            scale = cublaslt_fp8.weight_scale_operand(wq.scale, g)  # once per weight, as a model would
            out = torch.empty(m, n, dtype=dtype, device="cuda")

            def call(wq=wq, scale=scale, out=out):
                return cublaslt_fp8.run(x, wq.data, scale, None, out)
        providers[f"fp8_cublaslt_{g}"] = (call, "fp8", ref, why)
    rows, timed = [], {}
    for prov, (call, kind, ref, note) in providers.items():
        row = dict(base, provider=prov, note=note)
        rows.append(row)
        if call is None:
            row["status"] = "skipped"
            continue
        err = _rel_err(call(), ref)
        row["rel_err"], row["err_bound"] = f"{err:.2e}", MAX_ERR[kind]
        row["status"] = "ok" if err <= MAX_ERR[kind] else "failed"
        if row["status"] == "ok":
            timed[prov] = (call, row)
    del providers
    times = gpu_time_many([c for c, _ in timed.values()], reps=3, replays=7) if timed else []
    flops = 2 * m * n * k
    baseline = next((t.median_us for p, t in zip(timed, times) if p == "flinear"), None)
    for (_, row), t in zip(timed.values(), times):
        row.update(median_us=round(t.median_us, 2), spread_us=round(t.spread_us, 2),
                   tflops=round(flops / t.median_us / 1e6, 1))
        if baseline:
            row["speedup_vs_flinear"] = round(baseline / t.median_us, 3)
    return rows


def _summary(r: dict) -> str:
    head = f"{r['shape']:>18} M={r['M']:>5} {r['provider']:>24} {r['status']:>7}"
    if "median_us" not in r:
        return f"{head}  {r.get('note') or 'rel err ' + r.get('rel_err', '')}"
    speedup = f"{r['speedup_vs_flinear']:6.3f}x F.linear" if "speedup_vs_flinear" in r else ""
    return f"{head} {r['median_us']:10.1f} us {r['tflops']:7.1f} TFLOP/s {speedup}  rel err {r['rel_err']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.bench_fp8_prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", type=shape_arg, help="N,K pairs (default: llama3-8b's projections)")
    ap.add_argument("--m", nargs="+", type=int, default=[2048], help="token counts (default 2048)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--out", required=True, help="CSV to upsert the rows into")
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.m):
        ap.error("--m values must be at least 1")
    if not torch.cuda.is_available():
        print("bench_fp8_prefill: needs a CUDA GPU", file=sys.stderr)
        return 2
    ok, why = cublaslt_fp8.environment()
    if not ok:
        print(f"bench_fp8_prefill: the FP8 cuBLASLt path cannot run here ({why}); its rows say skipped",
              file=sys.stderr)
    shapes = [(f"{n}x{k}", n, k) for n, k in args.shapes] if args.shapes else SHAPES
    env = environment_columns("python -m hybridgemm.perf.bench_fp8_prefill " + " ".join(argv or sys.argv[1:]))
    rows = []
    for name, n, k in shapes:
        for m in args.m:
            got = bench_shape(name, n, k, m, NAME_TO_DTYPE[args.dtype], env)
            rows += got
            for r in got:
                print(_summary(r), flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
