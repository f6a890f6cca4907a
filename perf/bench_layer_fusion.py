"""What the decoder-layer fusion costs inside each GEMM (GPU machine): the kernels of
the fused decode step (fusion/models/decode_step.py) timed with and without their fused norm or residual.

    python -m hybridgemm.perf.bench_layer_fusion --model llama3-8b qwen2.5-7b --m 1 8 --out DIR

Per model, at each M: the gated kernel (gate/up) with and without its RMSNorm prologue, the
QKV GEMM with and without it, and the O and down GEMMs with and without the residual epilogue,
each in the split-K config the shipped table picks (a GEMM the table gives another backend is
listed as such, not timed). Beside them, the read ceiling at that size: the fastest of a few
grids of a kernel that only reads the same weight bytes (``read_us``; ``plain_of_read``: the
GEMM's streaming rate as a fraction of it). Every fused call is checked against an fp32
reference first; times use the tuner's method (cold weights by rotation, CUDA graphs,
interleaved rounds). Writes DIR/layer_fusion_<gpu>.csv.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridgemm import dispatch
from hybridgemm.autotune_cache.measure import gpu_time_rotating, rotation_copies
from hybridgemm.kernels import triton_glu, triton_splitk
from hybridgemm.perf.bench_msweep import git_commit
from hybridgemm.perf.csvio import environment_columns, write_csv
from hybridgemm.perf.e2e_models import hf_config

COLUMNS = ("gpu", "model", "gemm", "fused", "m", "n", "k", "config", "plain_us", "fused_us", "cost_us", "max_rel_err",
           "weight_mb", "read_us", "plain_tbps", "plain_of_read", "date", "commit", "torch", "triton", "hybridgemm",
           "command")
READ_PROGRAMS_PER_SM = (2, 4, 8, 16)  # grids of the read-only kernel; the fastest is the ceiling
MAX_REL_ERROR = 2e-2  # of the reference's largest magnitude: bf16 rounding of inputs and output is ~1e-2
EPS = 1e-5
BF16 = torch.bfloat16


def _norm_ref(x, g):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()


def _rel_err(out, ref) -> float:
    return (out.float() - ref).abs().max().item() / ref.abs().max().item()


@triton.jit
def _read_kernel(w_ptr, sink_ptr, per_prog, total, BLOCK: tl.constexpr):
    """Sum a contiguous slice of the weight: HBM read traffic and nothing else."""
    start = tl.program_id(0).to(tl.int64) * per_prog
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, per_prog, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < total, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(acc))


def _read_calls(ws, device) -> list:
    """One read-only call per grid of READ_PROGRAMS_PER_SM, each reading copy j of ``ws``."""
    total = ws[0].numel()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block = 4096
    calls = []
    for per_sm in READ_PROGRAMS_PER_SM:
        progs = sms * per_sm
        per = triton.cdiv(triton.cdiv(total, progs), block) * block
        sink = torch.empty(progs, device=device)
        calls.append(lambda j, per=per, progs=progs, sink=sink:
                     _read_kernel[(progs,)](ws[j], sink, per, total, BLOCK=block, num_warps=8))
    return calls


def _gemms(cfg) -> list[tuple[str, str, int, int, bool]]:
    """(gemm, fused part, N, K, bias) of one decoder layer."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
    return [("gate_up", "norm", inter, h, False), ("qkv", "norm", qkv, h, bias),
            ("o", "residual", h, cfg.num_attention_heads * d, False), ("down", "residual", h, inter, False)]


def bench_gemm(model: str, gemm: str, fused: str, n: int, k: int, bias: bool, m: int, device) -> dict:
    row = dict(model=model, gemm=gemm, fused=fused, m=m, n=n, k=k)
    wrows = 2 * n if gemm == "gate_up" else n
    copies = rotation_copies(wrows * k * 2, device)
    ws = [(torch.randn(wrows, k, device=device) / k**0.5).to(BF16) for _ in range(copies)]
    b = torch.randn(wrows, device=device).to(BF16) if bias else None
    xs = [(3 * torch.randn(m, k, device=device)).to(BF16) for _ in range(copies)]  # rms 3: a lost 1/rms shows
    g = (1 + 0.1 * torch.randn(k, device=device)).to(BF16)
    res = torch.randn(m, n, device=device).to(BF16)
    outs = [torch.empty(m, n, device=device, dtype=BF16) for _ in range(copies)]
    if gemm == "gate_up":
        cfg = triton_glu.default_config(m, n, k, BF16)
        triton_glu.run(cfg, xs[0], ws[0], b, outs[0], "silu", norm=(g, EPS))
        z = _norm_ref(xs[0], g) @ ws[0].float().T
        ref = F.silu(z[:, :n]) * z[:, n:]
        plain = lambda j: triton_glu.run(cfg, xs[j], ws[j], b, outs[j], "silu")  # noqa: E731
        fused_call = lambda j: triton_glu.run(cfg, xs[j], ws[j], b, outs[j], "silu", norm=(g, EPS))  # noqa: E731
    else:
        choice = dispatch.decision_for(xs[0], ws[0], b, outs[0])
        if choice.backend != "triton_splitk":
            return {**row, "config": f"table: {choice.backend}"}
        cfg = choice.config
        extra = dict(norm=(g, EPS)) if fused == "norm" else dict(residual=res)
        triton_splitk.run(cfg, xs[0], ws[0], b, outs[0], **extra)
        xin = _norm_ref(xs[0], g) if fused == "norm" else xs[0].float()
        ref = xin @ ws[0].float().T + (b.float() if b is not None else 0)
        ref = ref + res.float() if fused == "residual" else ref
        plain = lambda j: triton_splitk.run(cfg, xs[j], ws[j], b, outs[j])  # noqa: E731
        fused_call = lambda j: triton_splitk.run(cfg, xs[j], ws[j], b, outs[j], **extra)  # noqa: E731
    err = _rel_err(outs[0], ref)
    if not err <= MAX_REL_ERROR:
        raise AssertionError(f"{model} {gemm} m={m}: fused result off by {err:.3g} of its largest magnitude")
    t_plain, t_fused, *t_read = gpu_time_rotating([plain, fused_call, *_read_calls(ws, device)], copies, device)
    wbytes = wrows * k * 2
    read_us = min(t.median_us for t in t_read)
    return {**row, "config": str(cfg), "plain_us": round(t_plain.median_us, 3),
            "fused_us": round(t_fused.median_us, 3), "cost_us": round(t_fused.median_us - t_plain.median_us, 3),
            "max_rel_err": f"{err:.3g}", "weight_mb": round(wbytes / 1e6, 1), "read_us": round(read_us, 3),
            "plain_tbps": round(wbytes / t_plain.median_us / 1e6, 3),
            "plain_of_read": round(read_us / t_plain.median_us, 3)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hybridgemm.perf.bench_layer_fusion",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["llama3-8b", "qwen2.5-7b"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 8])
    p.add_argument("--out", metavar="DIR")
    args = p.parse_args(argv)
    if any(not 1 <= m <= 16 for m in args.m):
        p.error("--m takes decode sizes, 1..16 rows (the fused path's range)")
    try:
        configs = {name: hf_config(name) for name in args.model}
    except (KeyError, ValueError) as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        p.exit(2, "bench_layer_fusion: needs a CUDA GPU\n")
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, cfg in configs.items():
        for gemm, fused, n, k, bias in _gemms(cfg):
            for m in args.m:
                r = bench_gemm(name, gemm, fused, n, k, bias, m, device)
                rows.append(r)
                print(f"{name:12s} {gemm:8s} +{fused:8s} M={m:2d}: " + (
                    f"{r['plain_us']:7.2f} -> {r['fused_us']:7.2f} us ({r['cost_us']:+.2f}); {r['weight_mb']} MB "
                    f"at {r['plain_tbps']:.2f} TB/s, read alone {r['read_us']:.2f} us ({r['plain_of_read']:.1%})"
                    if "plain_us" in r else r["config"]), flush=True)
    if args.out:
        env = environment_columns(" ".join(["python -m hybridgemm.perf.bench_layer_fusion", *(argv or sys.argv[1:])]))
        env.update(date=datetime.date.today().isoformat(), commit=git_commit())
        gpu = env.get("gpu", "gpu").split()[-1].lower()
        path = os.path.join(args.out, f"layer_fusion_{gpu}.csv")
        write_csv(path, COLUMNS, [{**env, **r} for r in rows])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
