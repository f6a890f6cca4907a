"""What the RMSNorm prologue costs the FP8 decode pieces (GPU machine): Llama-3-8B's Q/K/V and
gate/up with e4m3 weights per channel, Triton split-K at M = 1 and 8, for each config of the
FP8 plan (kernels/triton_splitk_configs.py ``_FP8_PLAN``) that takes the shape: the bare GEMM,
the GEMM with the norm in its prologue (what the fused decode step runs for an FP8 weight), and
the norm apart (``norm.prologue_norm``, one launch) then the GEMM; the Q/K/V with the rotary and
KV-cache epilogue too, the gate/up with the GLU product in its epilogue. The tuner's timing
(cold weights by rotation, CUDA graphs in interleaved rounds). For bf16 weights the prologue
more than doubles the Q/K/V GEMM in most configs (scripts/qkv_fusion_probe.py), and the fused
step takes the norm apart there (``triton_splitk.prologue_fits``); an FP8 weight's path keeps it.

    python3 scripts/fp8_prologue_probe.py [--m 1 8]
    python3 scripts/fp8_prologue_probe.py --dry-run     (each call once on small shapes, no timing;
                                                         runs under TRITON_INTERPRET=1 on a CPU)
"""

from __future__ import annotations

import argparse

import torch

from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels import triton_splitk_configs as ts_configs
from hybridgemm.kernels.fp8 import quantize_fp8, scale_vector
from hybridgemm.kernels.triton_rope import RotaryCache
from hybridgemm.norm import prologue_norm
from hybridgemm.perf.sweep_configs import problem

# (name, heads, kv heads, head_dim, hidden, intermediate): Llama-3-8B; small ones for --dry-run
LLAMA = ("llama3-8b", 32, 8, 128, 4096, 14336)
SMALL = ("small", 2, 1, 128, 256, 160)


def configs_for(n: int, k: int, m: int) -> list:
    """The FP8 plan's configs for (M, N, K) with the one-launch reduction (which the rotary and
    GLU epilogues need), those the kernel takes."""
    p = problem(m, n, k, "e4m3_channel")
    out = []
    for bn, k_bytes, warps, stages, waves, _ in ts_configs._FP8_PLAN:
        bk = k_bytes  # e4m3: a byte an element
        split = ts_configs._split_for(waves, -(-n // bn), -(-k // bk), ts_configs.HOPPER_NUM_SMS)
        c = ts.TritonSplitKConfig(ts_configs._block_m(p), bn, bk, split, warps, stages, split > 1)
        if c.supports(p)[0] and c not in out:
            out.append(c)
    return out


def piece_calls(shape, m: int, device, copies: int) -> list[tuple[str, object]]:
    """(label, call(j)) of every variant of both pieces at ``m`` rows; ``j`` picks a weight copy."""
    _, heads, kv, hd, hidden, inter = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, hidden, generator=g).bfloat16().to(device)
    nw = (torch.rand(hidden, generator=g) + 0.5).bfloat16().to(device)
    counters = torch.zeros(4096, device=device, dtype=torch.int32)
    calls = []
    n_qkv = (heads + 2 * kv) * hd
    for piece, n, extra in (("qkv", n_qkv, "rope"), ("gate_up", 2 * inter, "glu")):
        ws = []
        for _ in range(copies):
            q = quantize_fp8(torch.randn(n, hidden, generator=g).div(hidden ** 0.5).to(device), "channel")
            ws.append((q.data, scale_vector(q.scale, "channel")))
        n_out = n // 2 if extra == "glu" else n
        out = torch.empty(m, n_out, device=device, dtype=torch.bfloat16)
        if extra == "rope":
            cos, sin = (torch.rand(m, 1, hd, generator=g).bfloat16().to(device) for _ in range(2))
            keys = torch.zeros(m, kv, 64, hd, device=device, dtype=torch.bfloat16)
            fused = {"rope": RotaryCache(cos, sin, heads, kv, hd, keys, keys.clone(),
                                         torch.tensor(5, device=device))}
        else:
            fused = {"glu": "silu"}
        for cfg in configs_for(n, hidden, m):
            def run(j, xin, norm, fused_args, cfg=cfg, ws=ws, out=out):
                data, scale = ws[j]
                return ts.run(cfg, xin, data, None, out, None, counters=counters, weight_scale=scale, norm=norm,
                              **fused_args)

            def apart(j, fused_args, run=run):
                return run(j, prologue_norm(x, nw, 1e-5), None, fused_args)

            tag = f"{piece:8s} M={m} {cfg}"
            for label, fargs in (("", {}), (f" +{extra}", fused)):
                if extra == "glu" and not fargs:
                    # the bare GEMM over the stacked rows writes N, not N/2
                    full = torch.empty(m, n, device=device, dtype=torch.bfloat16)
                    calls.append((f"plain{label:6s} {tag}", lambda j, cfg=cfg, ws=ws, full=full: ts.run(
                        cfg, x, ws[j][0], None, full, None, counters=counters, weight_scale=ws[j][1])))
                    continue
                calls.append((f"plain{label:6s} {tag}", lambda j, run=run, fargs=fargs: run(j, x, None, fargs)))
                calls.append((f"prologue{label:6s} {tag}",
                              lambda j, run=run, fargs=fargs: run(j, x, (nw, 1e-5), fargs)))
                calls.append((f"apart{label:6s} {tag}", lambda j, apart=apart, fargs=fargs: apart(j, fargs)))
    return calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dry-run", action="store_true", help="each call once on small shapes, no timing")
    args = ap.parse_args(argv)
    if args.dry_run:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for m in args.m:
            calls = piece_calls(SMALL, m, device, copies=1)
            for _, call in calls:
                call(0)
            print(f"M={m}: {len(calls)} calls ran")
        return
    from hybridgemm.autotune_cache.measure import gpu_time_rotating, rotation_copies

    _, heads, kv, hd, hidden, inter = LLAMA
    copies = rotation_copies(2 * inter * hidden, "cuda")
    for m in args.m:
        calls = piece_calls(LLAMA, m, "cuda", copies)
        for _, call in calls:
            call(0)
        torch.cuda.synchronize()
        timings = gpu_time_rotating([call for _, call in calls], copies, "cuda")
        for (label, _), t in zip(calls, timings):
            print(f"  {t.median_us:8.2f} us  {label}")


if __name__ == "__main__":
    main()
