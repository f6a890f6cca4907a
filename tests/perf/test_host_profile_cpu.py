"""perf/host_profile.py's hf-layer probe without a GPU: its endless one-token steps reset a
static cache that keeps its own position before it overflows."""

from __future__ import annotations

import pytest
import torch

from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf import host_profile as hp

transformers = pytest.importorskip("transformers")


def test_endless_steps_reset_the_cache_before_it_fills():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = hf.static_cache(model, 1, hp.STEP_CACHE_LEN)
    resets = []
    real = cache.reset
    cache.reset = lambda: resets.append(1) or real()
    step = hp._endless_steps(model, hf.forward_api(model), torch.zeros(1, 1, dtype=torch.long),
                             torch.zeros(1, dtype=torch.long), cache)
    calls = 3 * hp.STEP_CACHE_LEN
    with torch.no_grad():
        for _ in range(calls):
            logits = step()
    assert logits.shape == (1, 1, 97) and torch.isfinite(logits).all()
    assert len(resets) == calls // (hp.STEP_CACHE_LEN - 1)
