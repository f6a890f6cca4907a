"""The prefill step of a fused layer (fusion/models/decode_step.py ``prefill_step``): an eager
call of more rows than the decode step takes runs the layer's modules with the standard rotary
in one launch (kernels/triton_qk_rope.py ``rope_qk``). On tiny random-weight models under the
Triton interpreter (fp32), against the stock model; which calls take it and which keep the
stock forward. Its bits against the stock forward's on the GPU: tests/models/test_prefill_step_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from hybridgemm.models import attention_forms, decode_step
from hybridgemm.models import decode_checks as checks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97


def _tiny(kind: str) -> torch.nn.Module:
    kw = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=400)
    if kind == "qwen3":
        kw["head_dim"] = 16
    if kind == "phi3":
        kw["pad_token_id"] = 0  # (its config's default is past this vocabulary)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "phi3": transformers.Phi3Config,
              "qwen3": transformers.Qwen3Config, "granite": transformers.GraniteConfig}[kind](**kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def counted(monkeypatch):
    """Counts the prefill steps, the decode steps and the one-launch rotaries."""
    state = {"prefill": 0, "decode": 0, "rope": []}
    real_prefill, real_step = decode_step.prefill_step, decode_step.layer_step
    kernel = attention_forms.qk_rope_kernel()
    real_rope = kernel.rope_qk

    def prefill(*a, **kw):
        state["prefill"] += 1
        return real_prefill(*a, **kw)

    def step(*a, **kw):
        state["decode"] += 1
        return real_step(*a, **kw)

    monkeypatch.setattr(decode_step, "prefill_step", prefill)
    monkeypatch.setattr(decode_step, "layer_step", step)
    monkeypatch.setattr(kernel, "rope_qk", lambda y, *a, **kw: state["rope"].append(tuple(y.shape))
                        or real_rope(y, *a, **kw))
    return state


@pytest.mark.parametrize("kind,rotary_launches", [("llama", True), ("qwen2", True), ("phi3", True),
                                                  ("qwen3", False)])
@pytest.mark.parametrize("batch,seq", [(1, 17), (2, 9), (1, 333)])
def test_a_prefill_runs_the_layer_modules_and_matches_stock(kind, rotary_launches, batch, seq, kernels_on_cpu,
                                                           counted):
    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        out = model(ids).logits
        ref = stock(ids).logits
    assert counted["prefill"] == 2 and counted["decode"] == 0
    # Qwen3's q/k norms come before the rotary: its function runs as the module calls it
    qkv_columns = model.model.layers[0].self_attn._modules[checks.QKV_NAME].weight.shape[0]
    assert counted["rope"] == ([(batch, seq, qkv_columns)] * 2 if rotary_launches else [])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_generate_prefills_then_decodes_as_stock(kernels_on_cpu, counted):
    stock = _tiny("llama")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        want = stock.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert counted["prefill"] == 2 and counted["decode"] == 2 * 4  # the prompt, then one step a new token


@pytest.mark.parametrize("why", ["decode-rows", "grad", "hook", "mode", "cpu", "scaled-residuals", "compiling"])
def test_what_keeps_the_stock_forward_for_many_rows(why, kernels_on_cpu, counted, monkeypatch):
    stock = _tiny("granite" if why == "scaled-residuals" else "llama")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    ids = torch.randint(0, VOCAB, (1, 4 if why == "decode-rows" else 30))
    if why == "hook":
        model.model.layers[1].self_attn.register_forward_hook(lambda mod, args, out: None)
    if why == "cpu":
        monkeypatch.setattr(checks, "on_kernel_device", lambda x: x.is_cuda)
    if why == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(1, ids.shape[1], 64)
    layer = model.model.layers[1]
    with torch.set_grad_enabled(why == "grad"), hybridgemm.mode("batch_invariant" if why == "mode" else "default"):
        if why == "grad":
            x.requires_grad_(True)
        takes = checks.takes_prefill_step(layer, x)
        if why != "compiling":
            out, ref = model(ids).logits, stock(ids).logits
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not takes
    expected = {"decode-rows": 0, "hook": 1}.get(why, 0)  # the unhooked layer still takes it
    assert counted["prefill"] == expected


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_prefill_calls_its_block_as_a_module(kind, kernels_on_cpu, counted, monkeypatch):
    from helpers import tiny_moe_lm
    from hybridgemm import experts

    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    stock = tiny_moe_lm(kind, VOCAB, 128, 8, 2, head_dim=32, attn_implementation="sdpa")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    blocks = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda mod, args, out: blocks.append(mod))  # (hooks of the MLP run)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, ref = model(ids).logits, stock(ids).logits
    assert counted["prefill"] == 2 and len(counted["rope"]) == 2 and len(blocks) == 2
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_the_residual_is_added_into_the_sublayer_output_with_the_sums_bits():
    """``decode_step._add_into``: ``residual + out`` in ``out``'s memory where it may be written
    (the bits of the stock add, which is the same sum either way round), else a new tensor with
    ``out`` left as it was."""
    g = torch.Generator().manual_seed(4)
    residual = torch.randn(3, 17, 96, generator=g).to(torch.bfloat16)
    out = (torch.randn(3, 17, 96, generator=g) * 1e-2).to(torch.bfloat16)
    want = residual + out
    got = decode_step._add_into(out, residual)
    assert got is out and torch.equal(got, want)
    base = (torch.randn(3, 96, 17, generator=g) * 1e-2).to(torch.bfloat16)
    cases = {"strided": base.transpose(1, 2), "expanded": base[:1, :1, :].transpose(1, 2).expand(3, 17, 96),
             "fp32": base.transpose(1, 2).float(), "broadcast": base[0, :, 0].clone()}
    for name, other in cases.items():
        keep = other.clone()
        got = decode_step._add_into(other, residual)
        assert got is not other and torch.equal(other, keep), name
        assert torch.equal(got, residual + keep), name
    keep = residual.clone()  # out in the residual's memory: a new tensor, the residual kept
    got = decode_step._add_into(residual, residual)
    assert got is not residual and torch.equal(residual, keep) and torch.equal(got, keep + keep)
