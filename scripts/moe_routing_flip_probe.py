"""Where a patched mixture-of-experts model's static cache departs from stock's: each router's
chosen experts per call, stock beside patched (tests/helpers.llama_variants, bf16, eager, B = 2,
the GPU decode test's tokens), the logits' distance to the fp32 model, and each layer's key
distance per (sequence, position). Needs a CUDA GPU.

    python3 scripts/moe_routing_flip_probe.py [KIND]      (default hunyuan_moe)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import llama_variants, static_decode  # noqa: E402

VOCAB = 512


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(kind: str) -> None:
    ref, stock, patched = llama_variants(512, 1024, VOCAB, kind=kind)
    tokens = [torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(i)).cuda() for i in range(6)]
    seen: dict[tuple[str, int], list] = {}
    for tag, model in (("stock", stock), ("patched", patched)):
        for i, layer in enumerate(model.model.layers):
            def hook(mod, args, out, key=(tag, i)):
                seen.setdefault(key, []).append((out[2].cpu(), out[1].float().cpu()))
            layer.mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        want, _ = static_decode(ref, tokens, False, VOCAB)
        base, stock_cache = static_decode(stock, tokens, False, VOCAB)
        got, cache = static_decode(patched, tokens, False, VOCAB)
    print(f"logits rel vs fp32: stock {_rel(base, want):.4g} patched {_rel(got, want):.4g}")
    for i in range(len(stock.model.layers)):
        for call, ((si, sw), (pi, pw)) in enumerate(zip(seen[("stock", i)], seen[("patched", i)])):
            same = torch.equal(si.sort(-1).values, pi.sort(-1).values)
            print(f"layer {i} call {call}: " + ("same experts" if same else
                  f"DIFFER stock {si.tolist()} patched {pi.tolist()} weights {sw.tolist()} {pw.tolist()}"))
    for i, (a, b) in enumerate(zip(cache.layers, stock_cache.layers)):
        d = (a.keys.float() - b.keys.float()).norm(dim=-1) / b.keys.float().norm(dim=-1).clamp_min(1e-6)
        print(f"layer {i} key rel per (sequence, position), max over heads: {d.amax(1)[:, :11].tolist()}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hunyuan_moe")
