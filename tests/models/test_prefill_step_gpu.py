"""The prefill step on the GPU (``pytest -m gpu``): a patched bf16 model's prefill with the
rotary in one launch (fusion/models/decode_step.py ``prefill_step``) gives the same bits as the
same patched model through the layers' stock forwards (the stock rotary's element-wise kernels),
logits and the cache it fills, for bf16 and FP8 weights (W8A16 and W8A8)."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from hybridgemm.models import decode_checks as checks
from hybridgemm.models import decode_step

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

VOCAB = 512


def _model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**common, use_sliding_window=False) if kind == "qwen2" \
        else transformers.LlamaConfig(**common)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to("cuda", torch.bfloat16)


@pytest.mark.parametrize("weights", ["bf16", "fp8", "fp8-w8a8"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("batch,seq", [(1, 17), (3, 100), (1, 333)])
def test_a_prefill_gives_the_stock_forwards_bits(kind, weights, batch, seq, monkeypatch):
    model = copy.deepcopy(_model(kind))
    if weights == "bf16":
        hybridgemm.patch(model)
    else:
        hybridgemm.patch(model, weights="fp8", activations="fp8" if weights == "fp8-w8a8" else "same")
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq)).cuda()
    steps = []
    real = decode_step.prefill_step
    monkeypatch.setattr(decode_step, "prefill_step", lambda *a, **kw: steps.append(1) or real(*a, **kw))

    def run():
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            return model(ids, past_key_values=cache, use_cache=True).logits, cache

    got, got_cache = run()
    assert len(steps) == 2
    monkeypatch.setattr(checks, "takes_prefill_step", lambda *a: False)
    want, want_cache = run()
    assert len(steps) == 2  # the stock forwards this time
    assert torch.isfinite(got).all() and torch.equal(got, want)
    for layer in range(2):
        assert torch.equal(got_cache.layers[layer].keys, want_cache.layers[layer].keys)
        assert torch.equal(got_cache.layers[layer].values, want_cache.layers[layer].values)
