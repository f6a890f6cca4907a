"""What the per-call checks of a fused layer keep between calls (fusion/models/decode_checks.py
``layer_parts``): the lists of its parts, read once while its module structure holds and read
anew once a child of the layer, its attention or its MLP is replaced; hooks, dtypes, gradients
and LoRA layers are read at every call. Tiny random-weight Llama models, the kernels under the
Triton interpreter (fp32), against the stock model."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from hybridgemm.models import decode_checks as checks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97
HIDDEN = 64


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    return stock, model


@pytest.fixture
def reads(monkeypatch):
    """Counts the reads of a layer's parts (``decode_checks._read_parts``)."""
    count = {"n": 0}
    real = checks._read_parts

    def counted(layer):
        count["n"] += 1
        return real(layer)

    monkeypatch.setattr(checks, "_read_parts", counted)
    return count


def _linear_like(mod: torch.nn.Module) -> torch.nn.Linear:
    """A plain nn.Linear computing what the patched projection ``mod`` computes."""
    w = mod.weight.detach()
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=mod.bias is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if mod.bias is not None:
            lin.bias.copy_(mod.bias)
    return lin


def _checked_first_layer() -> tuple[torch.nn.Module, torch.Tensor]:
    """The first layer of a patched tiny model after one decode check it passed, and that x."""
    _, model = _pair()
    layer, x = model.model.layers[0], torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        assert checks.takes_fused_path(layer, x)
    return layer, x


def test_a_layer_reads_its_parts_once_while_its_structure_holds(kernels_on_cpu, reads):
    stock, model = _pair()
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
        layer = model.model.layers[0]
        assert checks.takes_prefill_step(layer, torch.randn(1, 30, HIDDEN)) and checks.takes_fused_path(layer, x)
    assert reads["n"] == 2  # one read per layer, at its first call
    kept = checks.layer_parts(layer)
    assert kept.in_place and not kept.adapters
    assert kept.fused == tuple(checks._fused_parts(layer)) and kept.skipped == tuple(checks._skipped_modules(layer))


@pytest.mark.parametrize("replaced", ["o_proj", "down_proj", "mlp", "self_attn", "q_slice"])
def test_a_child_replaced_after_a_check_is_seen_at_the_next_call(replaced, kernels_on_cpu, reads):
    stock, model = _pair()
    layer, stock_layer = model.model.layers[1], stock.model.layers[1]
    x, rows = torch.randn(1, 1, HIDDEN), torch.randn(1, 30, HIDDEN)
    with torch.no_grad():
        assert checks.takes_fused_path(layer, x) and checks.takes_prefill_step(layer, rows)
        if replaced == "o_proj":
            layer.self_attn.o_proj = _linear_like(layer.self_attn.o_proj)
        elif replaced == "down_proj":
            layer.mlp.down_proj = _linear_like(layer.mlp.down_proj)
        elif replaced == "mlp":  # the stock MLP: no fused gate/up
            layer.mlp = copy.deepcopy(stock_layer.mlp)
        elif replaced == "self_attn":  # the stock attention: no fused Q/K/V at all
            layer.self_attn = copy.deepcopy(stock_layer.self_attn)
        else:  # a slice of the fused Q/K/V, as a foreign wrapper would take its place
            layer.self_attn.q_proj = _linear_like(layer.self_attn.q_proj)
        assert not checks.takes_fused_path(layer, x) and not checks.takes_prefill_step(layer, rows)
        ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    assert reads["n"] == 3  # layer 1 before and after the replacement, layer 0 in the forward


def test_hooks_dtypes_and_gradients_are_read_at_every_call(kernels_on_cpu, reads):
    layer, x = _checked_first_layer()
    with torch.no_grad():
        handle = layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args: None)
        assert not checks.takes_fused_path(layer, x)
        handle.remove()
        assert checks.takes_fused_path(layer, x)
        down = layer.mlp.down_proj.weight
        down.data = down.data.to(torch.float64)  # a part's dtype changed in place (the module object is the same)
        assert not checks.takes_fused_path(layer, x)
        down.data = down.data.to(torch.float32)
        assert checks.takes_fused_path(layer, x)
    assert not checks.takes_fused_path(layer, x)  # gradients wanted for the parameters
    assert reads["n"] == 1


def test_a_traced_call_keeps_nothing(kernels_on_cpu, reads, monkeypatch):
    _, model = _pair()
    layer = model.model.layers[0]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        assert checks.takes_fused_path(layer, torch.randn(1, 1, HIDDEN))
        assert checks.takes_fused_path(layer, torch.randn(1, 1, HIDDEN))
    assert checks.PARTS_SEEN not in layer.__dict__ and reads["n"] == 2


def test_a_layer_with_lora_layers_is_read_at_every_call(kernels_on_cpu, reads):
    peft = pytest.importorskip("peft")
    stock, _ = _pair()
    model = peft.get_peft_model(copy.deepcopy(stock), peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    hybridgemm.patch(model.get_base_model())
    layer = model.get_base_model().model.layers[0]
    x = torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        assert checks.takes_fused_path(layer, x)
        assert checks.takes_fused_path(layer, x)
        assert not checks.takes_prefill_step(layer, torch.randn(1, 30, HIDDEN))  # (no LoRA terms in a prefill)
        with model.disable_adapter():  # read anew: the LoRA layers' state is read per call
            assert checks.takes_fused_path(layer, x)
    assert checks.PARTS_SEEN not in layer.__dict__ and reads["n"] == 4


def test_a_deep_copy_keeps_its_parts_and_checks_its_own_children(kernels_on_cpu, reads):
    layer, x = _checked_first_layer()
    with torch.no_grad():
        twin = copy.deepcopy(layer)
        assert checks.takes_fused_path(twin, x)
        assert reads["n"] == 1  # the copy's kept parts are its own children
        assert all(a is not b for a, b in zip(checks.layer_parts(twin).fused, checks.layer_parts(layer).fused))
        twin.self_attn.o_proj = _linear_like(twin.self_attn.o_proj)
        assert not checks.takes_fused_path(twin, x)
        assert checks.takes_fused_path(layer, x)


@pytest.mark.parametrize("change", ["parametrize-q", "parametrize-o", "unpatch-o", "renamed-qkv"])
def test_a_child_changed_in_place_after_a_check_is_seen_at_the_next_call(change, kernels_on_cpu):
    """A child whose class changes in place (torch's parametrizations, ``hybridgemm.unpatch`` of
    one module) or that is registered under another name is a structure of its own."""
    parametrize = torch.nn.utils.parametrize
    stock, model = _pair()
    layer = model.model.layers[1]
    attn = layer.self_attn
    x, rows = torch.randn(1, 1, HIDDEN), torch.randn(1, 30, HIDDEN)
    with torch.no_grad():
        assert checks.takes_fused_path(layer, x) and checks.takes_prefill_step(layer, rows)
        if change.startswith("parametrize"):
            mod = attn.q_proj if change.endswith("q") else attn.o_proj
            parametrize.register_parametrization(mod, "weight", torch.nn.Identity())
        elif change == "unpatch-o":
            assert hybridgemm.unpatch(attn.o_proj)
        else:
            attn._modules["renamed"] = attn._modules.pop(checks.QKV_NAME)
        assert not checks.takes_fused_path(layer, x) and not checks.takes_prefill_step(layer, rows)
        if change in ("parametrize-q", "parametrize-o", "unpatch-o"):  # (the stock forward, modules as they are now)
            ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
            torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)


def test_unpatched_experts_are_seen_at_the_next_call(kernels_on_cpu):
    from helpers import tiny_moe_lm

    model = tiny_moe_lm("qwen3_moe", VOCAB, 64, 8, 2, head_dim=16, attn_implementation="sdpa")
    hybridgemm.patch(model)
    layer = model.model.layers[0]
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        assert checks.takes_fused_path(layer, x)
        assert hybridgemm.unpatch(layer.mlp.experts)
        assert not checks.takes_fused_path(layer, x)


def test_unpatch_drops_the_kept_parts(kernels_on_cpu):
    stock, model = _pair()
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids)
    assert all(checks.PARTS_SEEN in layer.__dict__ for layer in model.model.layers)
    hybridgemm.unpatch(model)
    assert not any(checks.PARTS_SEEN in mod.__dict__ for mod in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
