"""Run-to-run equality of compiled static-cache decode (GPU): for tiny Gemma 2, Gemma 3 and
Llama models (tests/helpers.py ``llama_variants``, batch 2, six steps), the stock and the patched
model each decoded three times under ``torch.compile(mode="reduce-overhead", fullgraph=True)``
(the recompile limit raised: Gemma's sliding-window cache layers recompile as their Python-int
length turns symbolic and as the window fills; graph trees record one graph per length), the
stock model twice eagerly; prints which runs are bit-identical.

    python3 scripts/compiled_determinism_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import llama_variants, static_decode  # noqa: E402

VOCAB = 512


def main() -> int:
    if not torch.cuda.is_available():
        print("compiled_determinism_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    for kind in ("gemma2", "gemma3", "llama"):
        _, stock, patched = llama_variants(512, 1024, VOCAB, kind=kind)
        tokens = [torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(i)).cuda() for i in range(6)]
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
            s = [static_decode(stock, tokens, True, VOCAB)[0] for _ in range(3)]
            torch._dynamo.reset()
            p = [static_decode(patched, tokens, True, VOCAB)[0] for _ in range(3)]
            e = [static_decode(stock, tokens, False, VOCAB)[0] for _ in range(2)]
        torch._dynamo.reset()
        print(kind, "stock compiled 1==2", torch.equal(s[0], s[1]), "2==3", torch.equal(s[1], s[2]),
              "| patched compiled 1==2", torch.equal(p[0], p[1]), "2==3", torch.equal(p[1], p[2]),
              "| stock eager 1==2", torch.equal(e[0], e[1]), "| stock c vs e", torch.equal(s[0], e[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
