"""One mixture-of-experts block's routed experts on one CUDA GPU: transformers' experts module
(its eager loop and its ``grouped_mm`` implementation) beside ``hybridgemm.moe``, same weights
and routing, timed two ways: ``events`` (CUDA events around each eager call, L2 flushed before
each, rounds interleaved; perf/timing.events_time_interleaved: host launch gaps included) and
``graph`` (the call captured in a CUDA graph and replayed with the L2 flushed, as a decode step
under CUDA graphs runs it; perf/timing.gpu_time_many; a provider whose call syncs with the host
cannot be captured and gets a ``skipped`` row).

    python3 -m hybridgemm.perf.bench_moe [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 8 2048]
        [--weights bf16 fp8] [--rounds 7] --out perf/results/h200/moe_h200.csv

Shapes (hidden H, experts E of intermediate size I, top-k): ``qwen3-30b-a3b`` (2048, 128 of
768, 8) and ``mixtral-8x7b`` (4096, 8 of 14336, 2); bf16 weights N(0, 0.02), the router's
logits random. Each row (``M``: the tokens): ``median_us``, ``floor_us`` (the bytes of the
experts the routing actually hits, at the GPU's read rate ``read_tbps``, perf/read_ceiling.device_read_tbps),
``fraction_of_floor`` (floor / time), ``speedup`` over transformers' default implementation
(``grouped_mm``) timed the same way, ``rel_err`` against the fp32 result of the same block.

``--weights fp8`` adds ``hybridgemm_fp8_channel`` and ``hybridgemm_fp8_block128``: the same
weights quantized (kernels/fp8.quantize_fp8, stacked per expert) in the MoE kernels, their rows'
``weights`` column the format, ``floor_us`` their own bytes (e4m3 data and fp32 scales of the
experts hit), ``rel_err`` against the same fp32 result of the bf16 weights (the quantization's
error included) and ``rel_err_dequantized`` against the fp32 result of the dequantized weights
(the kernels' own).
"""

from __future__ import annotations

import argparse
import sys

import torch

from hybridgemm import experts
from hybridgemm.kernels import fp8

from . import read_ceiling
from .csvio import environment_columns, write_rows
from .timing import events_time_interleaved, gpu_time_many

# name: (hidden, experts, intermediate, top_k), from the models' published configs
SHAPES = {"qwen3-30b-a3b": (2048, 128, 768, 8), "mixtral-8x7b": (4096, 8, 14336, 2)}


def _experts_module(h: int, e: int, i: int, k: int, implementation: str):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = transformers.MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    cfg._experts_implementation = implementation
    return MixtralExperts(cfg)


def bench_shape(name: str, tokens: int, env: dict, rounds: int, weights_kinds=("bf16",),
                device: str = "cuda") -> list[dict]:
    h, e, i, k = SHAPES[name]
    dev = torch.device(device)
    torch.manual_seed(0)
    mod = _experts_module(h, e, i, k, "eager").to(dev, torch.bfloat16)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    ids, weights = experts.route(torch.randn(tokens, e, device=dev), k)
    grouped = _experts_module(h, e, i, k, "grouped_mm").to(dev, torch.bfloat16)
    grouped.load_state_dict(mod.state_dict())
    providers = {
        "transformers_eager": lambda: mod(x, ids, weights),
        "transformers_grouped_mm": lambda: grouped(x, ids, weights),
        "hybridgemm": lambda: experts.moe(x, (ids, weights), mod.gate_up_proj, mod.down_proj),
    }
    quantized = {}  # provider: (w_gate_up, w_down) FP8Weights
    if "fp8" in weights_kinds:
        for granularity in fp8.GRANULARITIES:
            qw = tuple(fp8.quantize_fp8(w.detach(), granularity) for w in (mod.gate_up_proj, mod.down_proj))
            quantized[f"hybridgemm_fp8_{granularity}"] = qw
            providers[f"hybridgemm_fp8_{granularity}"] = (lambda qw: lambda: experts.moe(x, (ids, weights), *qw))(qw)
    with torch.no_grad():
        ref = experts.experts_loop(x.float(), ids, weights, mod.gate_up_proj.float(), mod.down_proj.float(), "silu")
        errs, own_errs = {}, {}
        for prov, fn in providers.items():
            try:
                out = fn()
                errs[prov] = float((out.float() - ref).norm() / ref.norm())
                if prov in quantized:
                    qref = experts.experts_loop(x.float(), ids, weights,
                                                *(w.dequantize(torch.float32) for w in quantized[prov]), "silu")
                    own_errs[prov] = float((out.float() - qref).norm() / qref.norm())
            except Exception as exc:  # noqa: BLE001 (recorded in the row; the run goes on)
                errs[prov] = exc
        timed = {p: fn for p, fn in providers.items() if not isinstance(errs[p], BaseException)}
        by_method = {"events": events_time_interleaved(timed, rounds=rounds) if timed else {}, "graph": {}}
        # transformers' eager loop reads the routing on the host (it syncs), so it cannot be
        # captured; it is not tried either: a failed capture leaves the CUDA generator in its
        # capture state, and the next shape's weights could not be drawn
        by_method["graph"]["transformers_eager"] = RuntimeError("its forward syncs with the host (the eager loop "
                                                                "reads which experts are hit on the CPU)")
        for prov, fn in timed.items():
            if prov == "transformers_eager":
                continue
            try:
                by_method["graph"][prov] = gpu_time_many([fn], replays=rounds)[0]
            except Exception as exc:  # noqa: BLE001 (recorded in the row; the run goes on)
                by_method["graph"][prov] = exc
    hit = int(torch.unique(ids).numel())
    floors = {p: floor_us(hit, e, (mod.gate_up_proj, mod.down_proj), dev) for p in providers}
    floors.update((p, floor_us(hit, e, qw, dev)) for p, qw in quantized.items())
    base = dict(env, shape=name, hidden=h, experts=e, intermediate=i, top_k=k, M=tokens, experts_hit=hit,
                dtype="bf16", read_tbps=read_ceiling.device_read_tbps(dev)[0])
    rows = []
    for method, times in by_method.items():
        stock = times.get("transformers_grouped_mm")  # transformers' default experts implementation
        stock = None if isinstance(stock, BaseException) else stock
        for prov in providers:
            floor = floors[prov]
            row = dict(base, provider=prov, method=method, floor_us=round(floor, 2),
                       weights=quantized[prov][0].weight_format if prov in quantized else "bf16")
            if prov in own_errs:
                row["rel_err_dequantized"] = f"{own_errs[prov]:.2e}"
            t = times.get(prov)
            if isinstance(errs[prov], BaseException):
                row.update(status="error", note=f"{type(errs[prov]).__name__}: {errs[prov]}"[:300])
            elif isinstance(t, BaseException):
                row.update(status="skipped", note=f"not capturable in a CUDA graph: {type(t).__name__}: {t}"[:300])
            else:
                row.update(status="ok", rel_err=f"{errs[prov]:.2e}", median_us=round(t.median_us, 2),
                           spread_us=round(t.spread_us, 2), fraction_of_floor=round(floor / t.median_us, 3))
                if stock is not None:
                    row["speedup"] = round(stock.median_us / t.median_us, 3)
            rows.append(row)
    return rows


def floor_us(hit: int, experts_count: int, weights, device=None) -> float:
    """The time the bytes of ``hit`` of the experts' weights (tensors or stacked FP8Weights: data
    and scales) take at ``device``'s read rate (perf/read_ceiling.device_read_tbps)."""
    nbytes = sum(w.nbytes if isinstance(w, fp8.FP8Weight) else w.numel() * w.element_size() for w in weights)
    return read_ceiling.hbm_floor_ms(hit / experts_count * nbytes, device=device) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m hybridgemm.perf.bench_moe", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--weights", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
                    help="fp8: also the FP8 experts, per channel and per 128x128 block")
    ap.add_argument("--out", required=True, help="CSV to upsert the rows into")
    args = ap.parse_args(argv)
    if min(args.tokens) < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds take positive integers")
    if not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_moe: needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    env = environment_columns("python3 -m hybridgemm.perf.bench_moe " + " ".join(argv or sys.argv[1:]))
    rows = []
    for name in args.shapes:
        for tokens in args.tokens:
            got = bench_shape(name, tokens, env, args.rounds, tuple(args.weights))
            rows += got
            for r in got:
                print(f"{r['shape']:>14} T={tokens:>5} {r['method']:>6} {r['provider']:>24} {r['status']:>7} "
                      f"{r.get('median_us', '-'):>10} us  floor {r['floor_us']} us  "
                      f"{r.get('speedup', '')}x grouped_mm  rel err {r.get('rel_err', r.get('note', ''))}", flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
