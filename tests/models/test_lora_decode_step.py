"""PEFT LoRA layers over a fused decoder layer's projections keep the fused decode step
(fusion/models/adapter_terms.py, fusion/models/decode_step.py): static-cache decode of a tiny
patched Llama with adapters equals stock PEFT's (logits and cache), the step ran for every layer
and step, and what the step does not compute (DoRA, adapters being trained, a foreign wrapper)
gives the layer's own forward. Kernels under the Triton interpreter, the device check widened
to the CPU (conftest.kernels_on_cpu); LoRA B matrices random (PEFT starts them at zero,
which would hide a term never added). GPU: tests/models/test_lora_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch
from test_decode_step import _compare, _decode, _patched, _tiny

import hybridgemm
from hybridgemm.models import adapter_terms, decode_step
from hybridgemm.models import decode_checks as checks
from hybridgemm.perf import e2e_models as hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, targets=ALL, seed: int = 1, name: str = "default", **extra):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    if isinstance(model, peft.PeftModel):
        model.add_adapter(name, cfg)
        return model
    return peft.get_peft_model(model, cfg, adapter_name=name).eval()


@pytest.fixture
def steps(monkeypatch):
    """Counts the fused decode steps run (decode_step.layer_step)."""
    count = {"n": 0}
    real = decode_step.layer_step

    def layer_step(*a, **kw):
        count["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(decode_step, "layer_step", layer_step)
    return count


def _pair(targets=ALL, order: str = "patch-then-lora", **extra):
    """(stock PEFT model, patched PEFT model) over the same tiny Llama, same adapter weights."""
    stock = _tiny("llama")
    patched = copy.deepcopy(stock)
    if order == "patch-then-lora":
        patched = _lora(_patched(patched), targets, **extra)
    else:
        patched = _lora(patched, targets, **extra)
        hybridgemm.patch(patched)
    return _lora(stock, targets, **extra).get_base_model(), patched.get_base_model()


@pytest.mark.parametrize("targets,order,batch", [
    (ALL, "patch-then-lora", 2),
    (ALL, "lora-then-patch", 1),
    (["q_proj", "v_proj", "gate_proj"], "patch-then-lora", 3),  # slices of Q/K/V and gate/up without terms
    (["o_proj", "down_proj"], "patch-then-lora", 2),  # Q/K/V and gate/up keep their one-launch kernels
], ids=["all7", "all7-lora-first", "q-v-gate", "o-down"])
def test_decode_with_adapters_runs_the_fused_step_and_matches_stock_peft(targets, order, batch, kernels_on_cpu,
                                                                       steps):
    stock, model = _pair(targets, order)
    layers = model.model.layers
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in layers)
    _compare(model, stock, steps=2, batch=batch)
    assert steps["n"] == (1 + 2) * 2  # the 3-token prefill (at most DECODE_ROWS rows) and both steps, both layers
    # the rotary kernel runs only where Q/K/V carry no terms
    assert kernels_on_cpu["rope"] == (0 if "q_proj" in targets else 2 * 2)


def test_the_adapters_change_the_step_result(kernels_on_cpu, steps):
    stock, model = _pair()
    with torch.no_grad():
        with_terms, fed, _ = _decode(model, 2)
        base_ref, _, _ = _decode(_tiny("llama"), 2, tokens=fed)
    for a, b in zip(with_terms[1:], base_ref[1:]):
        assert not torch.allclose(a, b, rtol=1e-2, atol=1e-2)
    assert steps["n"] == (1 + 2) * 2


@pytest.mark.parametrize("state", ["disabled", "merged", "other-adapter-active"])
def test_disabled_merged_and_switched_adapters_in_the_step(state, kernels_on_cpu, steps):
    stock_peft, model_peft = (_lora(m) for m in (_tiny("llama"), _patched(_tiny("llama"))))
    for m in (stock_peft, model_peft):
        _lora(m, seed=2, name="other")
    if state == "merged":
        for m in (stock_peft, model_peft):
            m.merge_adapter()
    elif state == "other-adapter-active":
        for m in (stock_peft, model_peft):
            m.set_adapter("other")
    stock, model = stock_peft.get_base_model(), model_peft.get_base_model()
    if state == "disabled":
        with stock_peft.disable_adapter(), model_peft.disable_adapter():
            _compare(model, stock, steps=2)
    else:
        _compare(model, stock, steps=2)
    assert steps["n"] == (1 + 2) * 2


def test_dora_runs_the_layer_forward(kernels_on_cpu, steps):
    stock, model = _pair(use_dora=True)
    layer = model.model.layers[0]
    assert not adapter_terms.computable(layer.self_attn.q_proj)
    assert not checks.takes_fused_path(layer, torch.randn(1, 1, 128))
    _compare(model, stock, steps=2)
    assert steps["n"] == 0


def test_adapters_being_trained_run_the_layer_forward(kernels_on_cpu):
    _, model = _pair()
    layer = model.model.layers[0]
    x = torch.randn(1, 1, 128)
    assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    assert not checks.takes_fused_path(layer, x)  # gradients wanted for the adapters
    with torch.no_grad():
        assert checks.takes_fused_path(layer, x)


def test_a_foreign_wrapper_runs_the_layer_forward(kernels_on_cpu, steps):
    _, model = _pair(["q_proj"])
    attn = model.model.layers[0].self_attn
    v = attn.v_proj

    class Wrapper(torch.nn.Module):  # an adapter of another kind: it runs its base and adds to it
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def get_base_layer(self):
            return self.base_layer

        def forward(self, x):
            return self.base_layer(x) + 1.0

    attn.v_proj = Wrapper(v)
    assert not checks._parts_in_place(model.model.layers[0])
    attn.v_proj = v
    assert checks._parts_in_place(model.model.layers[0])
    layer, x = model.model.layers[0], torch.randn(1, 1, 128)
    with torch.no_grad():
        assert checks.takes_fused_path(layer, x)
        # hooks on what the step does not call: the LoRA layer (PEFT's per-request adapter names
        # hook so), the slice it wraps, an adapter's own linear
        for mod in (attn.q_proj, attn.q_proj.base_layer, attn.q_proj.lora_A["default"]):
            handle = mod.register_forward_pre_hook(lambda mod, args: None)
            assert not checks.takes_fused_path(layer, x)
            handle.remove()
        assert checks.takes_fused_path(layer, x)


def test_dynamo_traces_a_decode_step_with_adapters_in_one_graph(kernels_on_cpu, steps):
    stock, model = _pair()
    api = hf.forward_api(model)
    with torch.no_grad():
        ref, fed, _ = _decode(stock, 2)
        cache = hf.static_cache(model, 2, 16)
        ids = torch.randint(0, 97, (2, 3), generator=torch.Generator().manual_seed(3))
        hf.cached_forward(model, api, ids, cache, torch.arange(3))
        step = torch.compile(lambda tok, pos: hf.cached_forward(model, api, tok, cache, pos)[:, -1],
                             fullgraph=True, backend="aot_eager")
        outs = [step(fed[i], torch.tensor([3 + i])) for i in range(2)]
    torch._dynamo.reset()
    for a, b in zip(outs, ref[1:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
