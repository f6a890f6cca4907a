"""What the decoder-layer fusion costs inside each GEMM (GPU machine): the kernels of
the fused decode step (fusion/models/fused_pieces.py) timed with and without their fused norm or residual.

    python -m hybridgemm.perf.bench_layer_fusion --model llama3-8b qwen2.5-7b --m 1 8 --out DIR

Per model, at each M: the gated kernel (gate/up) with and without its RMSNorm prologue, the
QKV GEMM with and without it, and the O and down GEMMs with and without the residual epilogue,
each in the split-K config the shipped table picks (a GEMM the table gives another backend is
listed as such, not timed). Beside them, the read ceiling at that size: the fastest of a few
grids of a kernel that only reads the same weight bytes (``read_us``; ``plain_of_read``: the
GEMM's streaming rate as a fraction of it). Every fused call is checked against an fp32
reference first; times use the tuner's method (cold weights by rotation, CUDA graphs,
interleaved rounds). Writes DIR/layer_fusion_<gpu>.csv.

FP8 rows (``weights`` e4m3_channel, e4m3_block128; ``--granularity`` picks them, ``--no-fp8``
leaves them out): each GEMM's weight quantized (kernels/fp8.quantize_fp8) and called as
``hybridgemm.linear(x, fp8_weight, b)`` (gate/up: the stacked weight's GEMM, without the
gating), checked against x @ the dequantized weight in fp32, timed beside the read ceiling of
the FP8 bytes (N*K e4m3 + the fp32 scales, in one buffer that the GEMM reads too:
perf/read_ceiling.py). ``weight_mb`` is then those bytes, ``config`` the dispatcher's choice.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm import dispatch
from hybridgemm.autotune_cache.measure import gpu_time_rotating, rotation_copies
from hybridgemm.kernels import fp8, triton_glu, triton_splitk
from hybridgemm.perf.bench_msweep import git_commit
from hybridgemm.perf.csvio import environment_columns, write_csv
from hybridgemm.perf.e2e_models import hf_config, is_moe
from hybridgemm.perf.read_ceiling import fp8_bytes, fp8_in_one_buffer, read_calls

COLUMNS = ("gpu", "model", "gemm", "fused", "weights", "m", "n", "k", "config", "plain_us", "fused_us", "cost_us",
           "max_rel_err", "weight_mb", "read_us", "plain_tbps", "plain_of_read", "date", "commit", "torch", "triton",
           "hybridgemm", "command")
MAX_REL_ERROR = 2e-2  # of the reference's largest magnitude: bf16 rounding of inputs and output is ~1e-2
EPS = 1e-5
BF16 = torch.bfloat16


def _norm_ref(x, g):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()


def _rel_err(out, ref) -> float:
    return (out.float() - ref).abs().max().item() / ref.abs().max().item()


def _gemms(cfg) -> list[tuple[str, str, int, int, bool]]:
    """(gemm, fused part, N, K, bias) of one decoder layer."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
    return [("gate_up", "norm", inter, h, False), ("qkv", "norm", qkv, h, bias),
            ("o", "residual", h, cfg.num_attention_heads * d, False), ("down", "residual", h, inter, False)]


def bench_gemm(model: str, gemm: str, fused: str, n: int, k: int, bias: bool, m: int, device) -> dict:
    row = dict(model=model, gemm=gemm, fused=fused, weights="bf16", m=m, n=n, k=k)
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
    t_plain, t_fused, *t_read = gpu_time_rotating([plain, fused_call, *read_calls(ws, device)], copies, device)
    wbytes = wrows * k * 2
    read_us = min(t.median_us for t in t_read)
    return {**row, "config": str(cfg), "plain_us": round(t_plain.median_us, 3),
            "fused_us": round(t_fused.median_us, 3), "cost_us": round(t_fused.median_us - t_plain.median_us, 3),
            "max_rel_err": f"{err:.3g}", "weight_mb": round(wbytes / 1e6, 1), "read_us": round(read_us, 3),
            "plain_tbps": round(wbytes / t_plain.median_us / 1e6, 3),
            "plain_of_read": round(read_us / t_plain.median_us, 3)}


def bench_fp8_gemm(model: str, gemm: str, n: int, k: int, bias: bool, m: int, granularity: str, device) -> dict:
    """The FP8 row of one GEMM (see the module docstring): ``hybridgemm.linear`` on the e4m3
    weight, and the read ceiling of the same bytes."""
    wrows = 2 * n if gemm == "gate_up" else n
    copies = rotation_copies(fp8_bytes(wrows, k, granularity), device)
    made = [fp8_in_one_buffer((torch.randn(wrows, k, device=device) / k**0.5).to(BF16), granularity)
            for _ in range(copies)]
    ws, bufs = [w for w, _ in made], [buf for _, buf in made]
    b = torch.randn(wrows, device=device).to(BF16) if bias else None
    xs = [(3 * torch.randn(m, k, device=device)).to(BF16) for _ in range(copies)]
    out = hybridgemm.linear(xs[0], ws[0], b)
    ref = xs[0].float() @ ws[0].dequantize(torch.float32).T + (b.float() if b is not None else 0)
    err = _rel_err(out, ref)
    if not err <= MAX_REL_ERROR:
        raise AssertionError(f"{model} {gemm} m={m} fp8 {granularity}: off by {err:.3g} of its largest magnitude")
    choice = dispatch.decision_for(xs[0], ws[0].data, b, out, None, ws[0].weight_format)
    call = lambda j: hybridgemm.linear(xs[j], ws[j], b)  # noqa: E731
    t_fp8, *t_read = gpu_time_rotating([call, *read_calls(bufs, device)], copies, device)
    nbytes, read_us = bufs[0].numel(), min(t.median_us for t in t_read)
    return dict(model=model, gemm=gemm, fused="", weights=ws[0].weight_format, m=m, n=n, k=k,
                config=str(choice.config) if choice.backend == "triton_splitk" else f"{choice.backend} (dequantized)",
                plain_us=round(t_fp8.median_us, 3), max_rel_err=f"{err:.3g}", weight_mb=round(nbytes / 1e6, 1),
                read_us=round(read_us, 3), plain_tbps=round(nbytes / t_fp8.median_us / 1e6, 3),
                plain_of_read=round(read_us / t_fp8.median_us, 3))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybridgemm.perf.bench_layer_fusion",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["llama3-8b", "qwen2.5-7b"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 8])
    p.add_argument("--granularity", nargs="+", choices=fp8.GRANULARITIES, default=list(fp8.GRANULARITIES),
                   help="FP8 rows of these scale granularities (default: both)")
    p.add_argument("--no-fp8", action="store_true", help="no FP8 rows")
    p.add_argument("--out", metavar="DIR")
    args = p.parse_args(argv)
    if any(not 1 <= m <= 16 for m in args.m):
        p.error("--m takes decode sizes, 1..16 rows (the fused path's range)")
    try:
        args.configs = {name: hf_config(name) for name in args.model}
        moe = [name for name in args.model if is_moe(name)]
    except (KeyError, ValueError) as e:
        p.error(str(e))
    if moe:
        p.error(f"{', '.join(moe)}: a mixture of experts has no dense gate/up and down GEMMs to time")
    args.granularity = [] if args.no_fp8 else list(dict.fromkeys(args.granularity))
    return args


def _line(r: dict) -> str:
    head = f"{r['model']:12s} {r['gemm']:8s} " + (f"+{r['fused']:8s}" if r["weights"] == "bf16" else
                                                   f"{r['weights']:13s}") + f" M={r['m']:2d}: "
    if "plain_us" not in r:
        return head + r["config"]
    fused = f" -> {r['fused_us']:7.2f} us ({r['cost_us']:+.2f})" if r.get("fused_us") is not None else " us"
    return head + (f"{r['plain_us']:7.2f}{fused}; {r['weight_mb']} MB at {r['plain_tbps']:.2f} TB/s, read alone "
                   f"{r['read_us']:.2f} us ({r['plain_of_read']:.1%})")


def main(argv=None) -> None:
    args = parse_args(argv)
    configs = args.configs
    if not torch.cuda.is_available():
        print("bench_layer_fusion: needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, cfg in configs.items():
        for gemm, fused, n, k, bias in _gemms(cfg):
            for m in args.m:
                rows.append(bench_gemm(name, gemm, fused, n, k, bias, m, device))
                print(_line(rows[-1]), flush=True)
                for granularity in args.granularity:
                    rows.append(bench_fp8_gemm(name, gemm, n, k, bias, m, granularity, device))
                    print(_line(rows[-1]), flush=True)
    if args.out:
        env = environment_columns(" ".join(["python -m hybridgemm.perf.bench_layer_fusion", *(argv or sys.argv[1:])]))
        env.update(date=datetime.date.today().isoformat(), commit=git_commit())
        gpu = env.get("gpu", "gpu").split()[-1].lower()
        path = os.path.join(args.out, f"layer_fusion_{gpu}.csv")
        write_csv(path, COLUMNS, [{**env, **r} for r in rows])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
