"""A quick look at FP8 decode on a GPU: a preset's model (random weights), stock bf16 beside
``hybridgemm.patch(model, weights="fp8")`` in one process, greedy decode over a static cache
(compiled with CUDA graphs, and eager), then the preset's four projection GEMMs alone at
M = 1 and 8 (``hybridgemm.linear`` with an FP8 weight beside bf16 ``F.linear``, 20 calls
per CUDA graph).

    python3 scripts/fp8_decode_probe.py [MODEL] [LAYERS] [BATCHES] [GRANULARITY]
    e.g. python3 scripts/fp8_decode_probe.py llama3-8b 32 1,8 channel

``PROBE_MODES=compiled`` times the compiled rows only; ``PROBE_GEMMS=N``
the first N GEMM shapes. The full benchmark is ``hybridgemm bench --e2e --weights fp8``.
"""

from __future__ import annotations

import os
import sys

import torch

import hybridgemm
from hybridgemm.perf import bench_e2e as be
from hybridgemm.perf import e2e_models as hf

GEMMS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B: qkv, o, gate/up, down


def graph_us(fn, per_graph: int = 20, replays: int = 10) -> float:
    """µs per call of ``fn``, from replays of one CUDA graph of ``per_graph`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (per_graph * replays) * 1e3


def decode_rows(name: str, layers: int, batches: list[int], granularity: str) -> None:
    dev = torch.device("cuda")
    run = be.Run(name, hf.hf_config(name, layers), dev, tokens=32, rounds=3, log=print)
    torch.manual_seed(0)
    stock = hf.build_model(run.config, torch.bfloat16, dev)
    bf16_bytes = hf.decode_weight_bytes(stock)
    fp8_model = hf.build_model(run.config, torch.bfloat16, dev)
    fp8_model.load_state_dict(stock.state_dict())
    report = hybridgemm.patch(fp8_model, weights="fp8", granularity=granularity)
    print(report.summary(), "fp8 modules", len(report.fp8))
    # bytes a decode step reads: every parameter and buffer but the embedding table
    fp8_bytes = sum(t.numel() * t.element_size() for t in [*fp8_model.parameters(), *fp8_model.buffers()]
                    if t.dim() > 0) - fp8_model.model.embed_tokens.weight.numel() * 2
    print(f"bf16 bytes {bf16_bytes / 1e9:.2f} GB floor {be.hbm_floor_ms(bf16_bytes):.3f} ms; "
          f"fp8 bytes {fp8_bytes / 1e9:.2f} GB floor {be.hbm_floor_ms(fp8_bytes):.3f} ms")
    compiled_only = os.environ.get("PROBE_MODES") == "compiled"
    with torch.no_grad():
        ids = torch.randint(0, run.config.vocab_size, (1, 64), device=dev)
        a, b = stock(ids).logits.float(), fp8_model(ids).logits.float()
        print("prefill logits rel diff fp8 vs bf16", float((a - b).norm() / a.norm()))
        for batch in batches:
            for mode in ("compiled_static",) if compiled_only else ("compiled_static", "eager_static"):
                res, notes = be.time_mode(run, mode, batch, {"stock": stock, "fp8": fp8_model})
                s, f = (min(v) if isinstance(v, list) else v for v in (res["stock"], res["fp8"]))
                ok = isinstance(s, float) and isinstance(f, float)
                print(f"{mode} B={batch}: stock {s!r} ms, fp8 {f!r} ms, ratio {s / f if ok else '-'}, "
                      f"fp8 floor frac {be.hbm_floor_ms(fp8_bytes) / f if ok else '-'}", notes)


def gemm_rows(count: int) -> None:
    dev = torch.device("cuda")
    for n, k in GEMMS[:count]:
        w = (torch.randn(n, k, device=dev) / 64).bfloat16()
        q = hybridgemm.quantize_fp8(w)
        for m in (1, 8):
            x = torch.randn(m, k, device=dev).bfloat16()
            t8 = graph_us(lambda x=x, q=q: hybridgemm.linear(x, q))
            tb = graph_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            tc = graph_us(lambda q=q: q.data.view(torch.uint8).sum(dtype=torch.int32))
            print(f"GEMM N={n} K={k} M={m}: fp8 {t8:.1f} us ({n * k / t8 / 1e3:.0f} GB/s), F.linear bf16 {tb:.1f} us, "
                  f"e4m3 read (sum) {tc:.1f} us; fp8/read {tc / t8:.2f}")


def main(argv: list[str]) -> None:
    name = argv[0] if argv else "llama3-8b"
    layers = int(argv[1]) if len(argv) > 1 else 32
    batches = [int(b) for b in (argv[2] if len(argv) > 2 else "1,8").split(",")]
    granularity = argv[3] if len(argv) > 3 else "channel"
    decode_rows(name, layers, batches, granularity)
    gemm_rows(int(os.environ.get("PROBE_GEMMS", len(GEMMS))))


if __name__ == "__main__":
    main(sys.argv[1:])
