"""Compiled decode with a LoRA adapter on all seven projections: stock PEFT beside the patched
model with the adapter terms written as GEMMs (``mm``) and as multiply-and-sum reductions
(``reduce``; fusion/models/adapter_terms.py ``COMPILED_FORM``), one process, CUDA GPU.

    python3 scripts/lora_form_probe.py [LAYERS] [BATCH ...]
"""

import sys

import torch

import hybridgemm
from hybridgemm.models import adapter_terms
from hybridgemm.perf import bench_e2e as be
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf.bench_lora import with_adapter

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
batches = tuple(int(b) for b in sys.argv[2:]) or (1, 8)
dev = torch.device("cuda")
config = hf.hf_config("llama3-8b", layers)
run = be.Run("llama3-8b", config, dev, batches=batches, tokens=32, rounds=3, log=print)
torch.manual_seed(0)
stock = hf.build_model(config, torch.bfloat16, dev)
patched = hf.build_model(config, torch.bfloat16, dev)
patched.load_state_dict(stock.state_dict())
hybridgemm.patch(patched)
models = {"stock_peft": with_adapter(stock, 16), "hybridgemm_peft": with_adapter(patched, 16)}
for batch in batches:
    for form in ("mm", "reduce"):
        adapter_terms.COMPILED_FORM = form
        with torch.no_grad():
            res, _ = be.time_mode(run, "compiled_static", batch, models)
        best = {v: (min(r) if isinstance(r, list) and r else r) for v, r in res.items()}
        print(f"layers {layers} B={batch} form={form}: " + ", ".join(
            f"{v} {b:.4f} ms" if isinstance(b, float) else f"{v} {b!r}" for v, b in best.items())
              + (f", speedup {best['stock_peft'] / best['hybridgemm_peft']:.3f}"
                 if all(isinstance(b, float) for b in best.values()) else ""), flush=True)
