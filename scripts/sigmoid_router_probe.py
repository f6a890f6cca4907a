"""Where a patched DeepSeek-V3-form MoE model's logits error comes from (tests/helpers.tiny_moe_lm):
per patch flag, the per-token logits error against the fp32 copy beside stock bf16's, and per
layer, the tokens whose chosen experts differ from stock's with the gap between the k-th and
(k+1)-th choice score there. Needs a CUDA GPU.

    python3 scripts/sigmoid_router_probe.py [--kind deepseek_v3] [--tokens 4 32]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def choices(model, tokens):
    """Each MoE layer's router output (weights, ids) and its choice scores, for ``tokens``."""
    seen = {}

    def hook(name):
        def keep(module, args, out):
            x = args[0].reshape(-1, args[0].shape[-1])
            logits = torch.nn.functional.linear(x.float(), module.weight.float())
            scores = logits.sigmoid() + module.e_score_correction_bias.float()
            seen[name] = (out[2], scores)
        return keep

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        logits = model(tokens).logits.float()
    for h in handles:
        h.remove()
    return logits, seen


def main() -> None:
    import hybridgemm
    from helpers import tiny_moe_lm

    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="deepseek_v3")
    ap.add_argument("--tokens", type=int, nargs=2, default=[4, 32])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cuda = torch.device(args.device)
    fp32 = tiny_moe_lm(args.kind, 97, 256, 16, 4, head_dim=64).to(cuda)
    stock = copy.deepcopy(fp32).to(torch.bfloat16)
    seeded = torch.Generator(device=cuda).manual_seed(1)
    tokens = torch.randint(0, 97, tuple(args.tokens), device=cuda, generator=seeded)
    with torch.no_grad():
        ref = fp32(tokens).logits.float()
    stock_logits, stock_seen = choices(stock, tokens)
    stock_err = (stock_logits - ref).norm(dim=-1) / ref.norm(dim=-1)
    print(f"stock bf16: median {stock_err.median():.5f} max {stock_err.max():.5f}")
    flags = {"all": {}, "no norm": {"norm": False}, "no layers": {"layers": False}, "no mlp": {"mlp": False},
             "no attention": {"attention": False}, "mlp only": {"attention": False, "norm": False, "layers": False,
                                                               "lm_head": False}}
    for label, kw in flags.items():
        model = copy.deepcopy(stock)
        hybridgemm.patch(model, **kw)
        logits, seen = choices(model, tokens)
        err = (logits - ref).norm(dim=-1) / ref.norm(dim=-1)
        ratio = err / stock_err.clamp_min(1e-6)
        print(f"{label:>13}: median {err.median():.5f} max {err.max():.5f}; tokens within 1.1x stock "
              f"{(err <= 1.1 * stock_err + 1e-3).float().mean():.3f}; worst ratio {ratio.max():.1f}")
        for name, (ids, scores) in seen.items():
            want_ids, want_scores = stock_seen[name]
            differ = (ids.sort(-1).values != want_ids.sort(-1).values).any(-1)
            top = want_scores.sort(-1, descending=True).values
            k = ids.shape[-1]
            gap = top[:, k - 1] - top[:, k]
            input_gap = (scores - want_scores).abs().max(-1).values
            print(f"    {name}: {int(differ.sum())} of {differ.numel()} tokens route elsewhere; their k-th gaps "
                  f"{gap[differ].tolist()[:8]}; score moves by the input there {input_gap[differ].tolist()[:8]}; "
                  f"smallest gap overall {gap.min():.2e}")


if __name__ == "__main__":
    main()
