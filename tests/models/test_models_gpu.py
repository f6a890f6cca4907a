"""Every way people run a patched Hugging Face model, on the GPU (``pytest -m gpu``): a small
Llama (GQA, SwiGLU MLP, untied LM head) and a Qwen2 (q/k/v biases) in bf16, stock and
``hybridgemm.patch``-ed (attention, MLP and LM head) from the same weights, in one process.

Paths: HF ``generate`` with the dynamic cache and with a static cache (which HF runs through its
own compiled forward), and ``torch.compile(fullgraph=True)`` of the forward in the default and
"reduce-overhead" (CUDA graph trees) modes. Each must run and give logits as close to the fp32
model's as stock bf16's are (a bound from stock's own error, not a fixed tolerance).
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

VOCAB = 512


def _model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    base = _model(request.param).eval()
    ref = copy.deepcopy(base).cuda()  # fp32
    stock = copy.deepcopy(base).to("cuda", torch.bfloat16)
    patched = copy.deepcopy(stock)
    report = hybridgemm.patch(patched)
    assert len(report.fused_qkv) == 2 and len(report.fused_mlp) == 2, report
    assert type(patched.lm_head) is hybridgemm.HybridLinear
    return ref, stock, patched


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(batch + length)).cuda()


@pytest.mark.parametrize("batch,length", [(1, 1), (1, 17), (3, 33)])
def test_eager_forward_logits(models, batch, length):
    ref, stock, patched = models
    ids = _ids(batch, length)
    with torch.no_grad():
        want = ref(ids).logits
        err_stock, err = _rel(stock(ids).logits, want), _rel(patched(ids).logits, want)
    assert err <= 1.1 * err_stock + 1e-3, (err, err_stock)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate(models, cache):
    """HF generate, greedy; the static cache runs HF's compiled forward. The first new token's
    logits are checked; the run must produce every token."""
    _, stock, patched = models
    ids = _ids(2, 9)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    if cache == "static":
        kw["cache_implementation"] = "static"
    torch._dynamo.reset()
    with torch.no_grad():
        got = patched.generate(ids, **kw)
        want = stock.generate(ids, **kw)
    assert got.sequences.shape == (2, 15)
    first_got, first_want = got.logits[0].float(), want.logits[0].float()
    assert _rel(first_got, first_want) < 0.05, _rel(first_got, first_want)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_forward(models, mode):
    ref, stock, patched = models
    torch._dynamo.reset()
    step = torch.compile(patched, mode=None if mode == "default" else mode, fullgraph=True)
    with torch.no_grad():
        for batch, length in [(1, 1), (1, 1), (1, 1), (2, 5)]:  # repeats: CUDA graph trees record, then replay
            ids = _ids(batch, length)
            want = ref(ids).logits
            err_stock = _rel(stock(ids).logits, want)
            got = step(ids).logits.clone()
            assert _rel(got, want) <= 1.1 * err_stock + 1e-3, (batch, length, _rel(got, want), err_stock)
    torch._dynamo.reset()
