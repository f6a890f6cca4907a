"""LoRA on a patched model on the GPU (``pytest -m gpu``): a small bf16 Llama with PEFT
adapters on all seven projections, attached after ``patch`` and patched after attaching,
decoding over a StaticCache (eager, and compiled with ``reduce-overhead``, fullgraph) in the
fused decode step with the adapters' terms added, as close to the fp32 PEFT model as stock bf16
PEFT is, bit-identical run to run.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from helpers import llama_variants, static_decode
from hybridgemm.fused_rows import FusedSlice

pytestmark = pytest.mark.gpu
peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

VOCAB = 512
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rel(a, ref) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


def _with_lora(model, seed: int = 1):
    """``model`` with one random adapter (r=8; B random too, so the adapter changes the logits)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(model, cfg).eval()


@pytest.fixture(scope="module")
def lora_models():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    ref, stock, patched = llama_variants(512, 1024, VOCAB)
    unpatched = copy.deepcopy(stock)
    ref, stock = _with_lora(ref), _with_lora(stock)
    after = _with_lora(patched)  # patch, then the adapters
    before = _with_lora(unpatched)  # the adapters, then patch
    report = hybridgemm.patch(before)
    assert len(report.fused_qkv) == len(report.fused_mlp) == 2
    for m in (after, before):
        assert type(m.get_base_model().model.layers[0].self_attn.q_proj.base_layer) is FusedSlice
    return ref, stock, {"patch-then-lora": after, "lora-then-patch": before}


@pytest.mark.parametrize("order", ["patch-then-lora", "lora-then-patch"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lora_decode_matches_fp32_as_stock_peft_does(lora_models, order, compiled, monkeypatch):
    from hybridgemm.models import decode_step

    ref, stock, variants = lora_models
    patched = variants[order]
    tokens = [torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(i)).cuda() for i in range(5)]
    steps, real = [], decode_step.layer_step
    if not compiled:  # (a Python side effect in the traced step would recompile it every call)
        monkeypatch.setattr(decode_step, "layer_step", lambda *a, **kw: steps.append(1) or real(*a, **kw))
    with torch.no_grad():
        want, _ = static_decode(ref, tokens, False, VOCAB)
        base, _ = static_decode(stock, tokens, False, VOCAB)
        assert not steps
        got, _ = static_decode(patched, tokens, compiled, VOCAB)
        # eager: the fused step with the adapters' terms for every layer, the 5-token prefill
        # (10 rows) and each step
        assert compiled or len(steps) == 2 * (1 + len(tokens)), len(steps)
        again, _ = static_decode(patched, tokens, compiled, VOCAB)
        with patched.disable_adapter():
            bare, _ = static_decode(patched, tokens, False, VOCAB)
    torch._dynamo.reset()
    assert torch.isfinite(got).all()
    assert _rel(got, want) <= 1.5 * _rel(base, want) + 1e-3, (_rel(got, want), _rel(base, want))
    assert torch.equal(got, again)
    assert _rel(bare, want) > 10 * _rel(base, want)  # the adapter matters: without it the logits move


def test_lora_training_step_gradients_match_stock_peft(lora_models):
    ref, stock, variants = lora_models
    patched = variants["patch-then-lora"]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7)).cuda()
    grads = []
    for m in (ref, stock, patched):
        m.train()
        m.zero_grad(set_to_none=True)
        m(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None})
        m.eval()
    want, base, got = grads
    assert set(got) == set(want) == set(base) and len(got) == 2 * 2 * len(TARGETS)
    err = sum(float((got[n] - want[n]).norm()) for n in want) / sum(float(want[n].norm()) for n in want)
    err_stock = sum(float((base[n] - want[n]).norm()) for n in want) / sum(float(want[n].norm()) for n in want)
    assert err <= 1.5 * err_stock + 1e-3, (err, err_stock)
