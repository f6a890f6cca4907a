"""``patch(model, weights="fp8")`` on the CPU (fusion/fp8_modules.py): which projections are
quantized, the patched model against the same model with the dequantized weights, the fused
decode step's acceptance of e4m3 weights, ``unpatch``'s refusal, and bad arguments."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from helpers import dequantized_copy
from hybridgemm.fp8_modules import weight_scale_of
from hybridgemm.models import decode_checks

transformers = pytest.importorskip("transformers")


def _tiny(seed=0):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_patched_fp8_model_computes_with_the_dequantized_weights(granularity):
    stock = _tiny()
    patched = copy.deepcopy(stock)
    report = hybridgemm.patch(patched, weights="fp8", granularity=granularity)
    assert sorted(report.fp8) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    assert type(patched.lm_head) is hybridgemm.HybridLinear  # the head stays bf16 unless asked
    for name in report.fp8:
        mod = patched.get_submodule(name)
        assert mod.weight.dtype == torch.float8_e4m3fn and not mod.weight.requires_grad
        assert weight_scale_of(mod).dim() == (1 if granularity == "channel" else 2)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = patched(ids).logits
        want = dequantized_copy(stock, patched)(ids).logits
        exact = stock(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - exact).abs().max() > 1e-3  # the weights really are quantized


def test_the_lm_head_is_quantized_on_request():
    model = _tiny()
    report = hybridgemm.patch(model, weights="fp8", quantize_lm_head=True)
    assert "lm_head" in report.fp8 and model.lm_head.weight.dtype == torch.float8_e4m3fn


def test_the_decode_step_takes_e4m3_weights_with_bf16_activations(monkeypatch):
    model = _tiny().to(torch.bfloat16)
    hybridgemm.patch(model, weights="fp8")
    monkeypatch.setattr(decode_checks, "on_kernel_device", lambda x: True)
    layer = model.model.layers[0]
    with torch.no_grad():
        assert decode_checks.takes_fused_path(layer, torch.randn(1, 1, 256, dtype=torch.bfloat16))
        assert not decode_checks.takes_fused_path(layer, torch.randn(1, 1, 256, dtype=torch.float16))


def test_unpatch_refuses_a_quantized_model_and_changes_nothing():
    model = _tiny()
    hybridgemm.patch(model, weights="fp8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="reload the model"):
        hybridgemm.unpatch(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("kwargs,match", [({"weights": "int8"}, "weights must be"),
                                          ({"weights": "fp8", "granularity": "tensor"}, "granularity")])
def test_bad_arguments_are_refused_before_anything_changes(kwargs, match):
    model = _tiny()
    with pytest.raises(ValueError, match=match):
        hybridgemm.patch(model, **kwargs)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_casting_a_patched_fp8_model_keeps_its_e4m3_weights_and_fp32_scales():
    model = _tiny()
    hybridgemm.patch(model, weights="fp8", granularity="block128")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    model.half()
    after = model.state_dict()
    for key, value in before.items():
        if value.dtype in (torch.float8_e4m3fn,) or key.endswith("weight_scale"):
            assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
        else:
            assert after[key].dtype == torch.float16, key
    mlp = model.model.layers[0].mlp
    assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn and mlp.gate_up_proj.weight_scale.dtype == torch.float32
    x = torch.randn(1, 3, 256).half()
    with torch.no_grad():
        assert torch.isfinite(model.model.layers[0](x, position_embeddings=(torch.ones(1, 3, 64).half(),
                                                                           torch.zeros(1, 3, 64).half()))[0]).all()
