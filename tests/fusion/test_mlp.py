"""The MLP half of hybridgemm.patch (fusion/mlp.py) and gated_linear, on the CPU: transformers
models from tiny configs with random weights, compared with the same model unpatched and with
float64 references."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridgemm
from hybridgemm import HybridLinear
from hybridgemm.mlp import GLU_FUNCTIONS, HybridGatedMLP, activation_name, gated_linear

VOCAB = 89


def _reference(x, w, b, act: str) -> torch.Tensor:
    """act(x Wg^T + bg) * (x Wu^T + bu) in float64."""
    x64, w64 = x.double(), w.double()
    y = x64 @ w64.T + (b.double() if b is not None else 0)
    gate, up = y.chunk(2, dim=-1)
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    return fn(gate) * up


@pytest.mark.parametrize("act", sorted(GLU_FUNCTIONS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_gated_linear_matches_float64(act, bias, m):
    g = torch.Generator().manual_seed(m)
    k, i = 72, 40
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * i, k, generator=g) / k ** 0.5
    b = torch.randn(2 * i, generator=g) if bias else None
    for kernel in ("auto", "halves", "gemm"):
        out = gated_linear(x, w, b, act, kernel=kernel)
        assert out.shape == (m, i) and out.dtype == x.dtype
        torch.testing.assert_close(out.double(), _reference(x, w, b, act), rtol=1e-5, atol=1e-6, msg=kernel)
    # gate and up are not interchangeable: a swapped weight gives another answer
    swapped = torch.cat([w[i:], w[:i]])
    assert not torch.allclose(gated_linear(x, swapped, None, act), gated_linear(x, w, None, act), atol=1e-3)


def test_gated_linear_leading_dims_and_non_contiguous_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 33, generator=g).transpose(1, 2)  # (2, 33, 5): K = 5 with stride 33
    w = torch.randn(12, 5, generator=g)
    out = gated_linear(x, w, None, "silu")
    assert out.shape == (2, 33, 6)
    torch.testing.assert_close(out.double(), _reference(x, w, None, "silu"), rtol=1e-5, atol=1e-6)


def test_gated_linear_bad_input():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_linear(x, w, None, "relu6")
    with pytest.raises(ValueError, match=r"2-D \(2I, K\).*\(5, 8\)"):
        gated_linear(x, torch.randn(5, 8))
    with pytest.raises(ValueError, match="2-D"):
        gated_linear(x, torch.randn(6))
    with pytest.raises(ValueError, match="2-D"):
        gated_linear(x, "not a tensor")


def test_activation_names():
    transformers = pytest.importorskip("transformers")
    acts = transformers.activations.ACT2FN
    assert activation_name(acts["silu"]) == activation_name(nn.SiLU()) == "silu"
    assert activation_name(acts["gelu"]) == activation_name(nn.GELU()) == "gelu"
    for name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        assert activation_name(acts[name]) == "gelu_tanh", name
    assert activation_name(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert activation_name(nn.ReLU()) == "relu"
    for unknown in (acts["quick_gelu"], nn.Tanh(), None, F.silu):
        assert activation_name(unknown) is None, unknown
    # gelu_fast's factored form is the tanh GELU in fp64, to far below fp32's resolution
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    torch.testing.assert_close(acts["gelu_fast"](x), F.gelu(x, approximate="tanh"), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(acts["quick_gelu"](x), F.gelu(x, approximate="tanh"), rtol=1e-3, atol=1e-4)


def _llama(**overrides) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    cfg.update(overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("overrides,act", [
    ({}, "silu"),
    ({"mlp_bias": True}, "silu"),  # the stacked bias rides the fused GEMM's epilogue
    ({"hidden_act": "gelu_pytorch_tanh"}, "gelu_tanh"),  # GeGLU, as Gemma's MLP
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_gated_mlp_fused_matches_stock(overrides, act):
    model = _llama(**overrides)
    ids = torch.randint(0, VOCAB, (2, 7))
    ref = _logits(model, ids)
    stock_sd = {k: v.clone() for k, v in model.state_dict().items()}
    report = hybridgemm.patch(model, attention=False, lm_head=False)
    assert report.fused_mlp == ["model.layers.0.mlp", "model.layers.1.mlp"]
    mlp = model.model.layers[0].mlp
    assert type(mlp) is HybridGatedMLP and mlp.glu_activation == act
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # attention=False
    assert type(model.lm_head) is nn.Linear  # lm_head=False
    sd = model.state_dict()
    assert list(sd) == list(stock_sd) and all(torch.equal(sd[k], stock_sd[k]) for k in sd)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    # the stock forward's own gate_proj/up_proj calls still work through the slices
    x = torch.randn(3, 48)
    torch.testing.assert_close(mlp.gate_proj(x), F.linear(x, stock_sd["model.layers.0.mlp.gate_proj.weight"],
                                                         stock_sd.get("model.layers.0.mlp.gate_proj.bias")))
    hybridgemm.unpatch(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=0)


def test_unknown_activation_leaves_the_mlp_alone():
    model = _llama(hidden_act="quick_gelu")
    ids = torch.randint(0, VOCAB, (1, 5))
    ref = _logits(model, ids)
    report = hybridgemm.patch(model)
    assert report.fused_mlp == [] and type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert any("act_fn QuickGELUActivation" in why for _, why in report.skipped), report.skipped
    assert report.fused_qkv  # the attention is still patched
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)


def test_tied_gate_and_up_are_not_fused_but_still_run_through_hybridgemm():
    model = _llama(num_hidden_layers=1)
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = mlp.gate_proj.weight  # a tie fusing would silently undo
    ids = torch.randint(0, VOCAB, (1, 5))
    ref = _logits(model, ids)
    report = hybridgemm.patch(model)
    assert report.fused_mlp == []
    assert any("gate/up not fused" in why and "tied" in why for _, why in report.skipped), report.skipped
    assert type(mlp.gate_proj) is HybridLinear and mlp.up_proj.weight is mlp.gate_proj.weight
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)


def test_tied_lm_head_stays_tied():
    model = _llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hybridgemm.patch(model)
    assert type(model.lm_head) is HybridLinear and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.embed_tokens.weight[0].fill_(0.5)
    assert torch.equal(model.lm_head.weight[0], torch.full((48,), 0.5))


def test_training_gradients_of_the_fused_gate_up():
    stock = _llama().train()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = torch.randint(0, VOCAB, (2, 6))
    for m in (stock, patched):
        m(ids, labels=ids).loss.backward()
    s, p = stock.model.layers[1].mlp, patched.model.layers[1].mlp
    torch.testing.assert_close(p.gate_proj.weight.grad, s.gate_proj.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p.up_proj.weight.grad, s.up_proj.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p.down_proj.weight.grad, s.down_proj.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(patched.lm_head.weight.grad, stock.lm_head.weight.grad, rtol=1e-5, atol=1e-7)


def _needs_interpreter():
    from hybridgemm.kernels import triton_launch

    if not triton_launch.interpreting():
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")


@pytest.mark.parametrize("act", sorted(GLU_FUNCTIONS))
def test_gated_linear_triton_kernel_eager_and_compiled(act):
    """kernel="triton": eagerly and as the hybridgemm::gated_fwd op under torch.compile(fullgraph)."""
    _needs_interpreter()
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 40, generator=g), torch.randn(48, 40, generator=g) / 40 ** 0.5
    b = torch.randn(48, generator=g)
    ref = _reference(x, w, b, act)
    torch.testing.assert_close(gated_linear(x, w, b, act, kernel="triton").double(), ref, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: gated_linear(x, w, b, act, kernel="triton"), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(x).double(), ref, rtol=1e-4, atol=1e-5)


def test_gated_linear_kernel_argument():
    with pytest.raises(ValueError, match="kernel must be one of auto, halves, gemm, triton"):
        gated_linear(torch.randn(2, 8), torch.randn(6, 8), kernel="cublas")
    # "auto" on the CPU is the halves path (the Triton kernel is for CUDA inference at decode sizes)
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    assert torch.equal(gated_linear(x, w), gated_linear(x, w, kernel="halves"))
