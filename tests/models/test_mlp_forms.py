"""patch() swaps an MLP module's forward for its own only where that forward computes what the
swap computes (fusion/models/mlp_forms.py): an MLP with the right children whose forward does
more keeps its forward, its linears dispatched one by one, the reason in the report; outputs as
the unpatched module's."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

import hybridgemm
from hybridgemm import HybridLinear
from hybridgemm.mlp import HybridGatedMLP


class _Gated(nn.Module):
    def __init__(self, scale: float | None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(24, 40), nn.Linear(24, 40), nn.Linear(40, 24)
        self.act_fn, self.scale = nn.SiLU(), scale


class _Llama(_Gated):  # Llama's statements over an input named otherwise
    def forward(self, hidden):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(hidden)) * self.up_proj(hidden))
        return down_proj


class _Scaled(_Gated):  # one factor more on the output (InklingMLP's global_scale, say)
    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj * self.scale


class _Clamped(_Gated):  # the gate clamped first (DeepSeek-V4's, GLM-5's swiglu_limit)
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=self.scale)) * self.up_proj(x))


class _Prefused(nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(24, 80), nn.Linear(40, 24)
        self.activation_fn, self.extra = nn.SiLU(), extra

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        up_states = up_states * self.activation_fn(gate)
        return self.down_proj(up_states if not self.extra else up_states.tanh())


class _TwoLayer(nn.Module):  # GPT-NeoX's statements, then one more
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h, self.dense_4h_to_h, self.act = nn.Linear(24, 96), nn.Linear(96, 24), nn.GELU()

    def forward(self, hidden_states):
        hidden_states = self.dense_h_to_4h(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dense_4h_to_h(hidden_states)
        return hidden_states * 0.5


class _Holder(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


def _patched_pair(mlp: nn.Module):
    torch.manual_seed(0)
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.3)
    stock = _Holder(mlp).eval()
    model = copy.deepcopy(stock)
    return stock, model, hybridgemm.patch(model)


def test_a_gated_mlp_of_llamas_statements_is_fused_whatever_its_input_is_called():
    stock, model, report = _patched_pair(_Llama(None))
    assert type(model.mlp) is HybridGatedMLP and report.fused_mlp == ["mlp"]
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mlp", [lambda: _Scaled(0.37), lambda: _Clamped(0.1), lambda: _Prefused(True),
                                 _TwoLayer], ids=["scaled", "clamped", "prefused-tanh", "two-layer-halved"])
def test_an_mlp_whose_forward_computes_more_keeps_its_forward(mlp):
    """Each has the children and activation a fused MLP has; its forward does one thing more.
    Left with its class and forward, its linears dispatched one by one; outputs as stock's (a
    fused forward would drop that one thing: the scale, the clamp, the tanh, the halving)."""
    stock, model, report = _patched_pair(mlp())
    assert type(model.mlp) is type(stock.mlp) and report.fused_mlp == []
    assert any(n == "mlp" and f"{type(stock.mlp).__name__}.forward computes more" in why for n, why in report.skipped)
    assert all(type(m) is HybridLinear for m in model.mlp.children() if isinstance(m, nn.Linear))
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module,cls,config", [
    ("falcon_h1", "FalconH1MLP", dict(hidden_size=64, intermediate_size=96, mlp_multipliers=[2.0, 0.5])),
    ("gemma3n", "Gemma3nTextMLP", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      activation_sparsity_pattern=[0.95, 0.95])),
])
def test_transformers_gated_mlps_that_compute_more_keep_their_forward(module, cls, config):
    """Falcon-H1's (multipliers on the gate and the output) and Gemma 3n's (activation sparsity: a
    top-k of the gate) gated MLPs."""
    transformers = pytest.importorskip("transformers")
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config_cls = {"falcon_h1": "FalconH1Config", "gemma3n": "Gemma3nTextConfig"}[module]
    cfg = getattr(transformers, config_cls)(**config)
    mlp = getattr(mod, cls)(cfg, layer_idx=0) if module == "gemma3n" else getattr(mod, cls)(cfg)
    stock, model, report = _patched_pair(mlp)
    assert type(model.mlp) is type(stock.mlp) and report.fused_mlp == []
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)


def test_seed_oss_gated_mlp_is_fused_with_its_output_dropout():
    """Seed-OSS's gated MLP ends in a dropout of its residual_dropout: fused, the swapped forward
    applies the dropout in training (the same mask as stock's with the same seed) and not in
    eval; unpatch restores its class and leaves no mark."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.seed_oss.modeling_seed_oss import SeedOssMLP

    from hybridgemm.mlp import OUTPUT_DROPOUT

    stock, model, report = _patched_pair(SeedOssMLP(transformers.SeedOssConfig(
        hidden_size=64, intermediate_size=96, residual_dropout=0.3)))
    assert type(model.mlp) is HybridGatedMLP and report.fused_mlp == ["mlp"] and OUTPUT_DROPOUT in model.mlp.__dict__
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)
    stock.train(), model.train()
    outs = []
    for m in (stock, model):
        torch.manual_seed(5)
        outs.append(m(x))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert (outs[0] == 0).any()  # (the dropout ran)
    hybridgemm.unpatch(model)
    assert type(model.mlp) is SeedOssMLP and OUTPUT_DROPOUT not in model.mlp.__dict__


def test_an_intermediate_with_a_layernorm_inside_keeps_its_forward():
    """RoBERTa-PreLayerNorm's intermediate normalises before its dense GEMM: not BERT's."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.roberta_prelayernorm import modeling_roberta_prelayernorm as rp

    cfg = transformers.RobertaPreLayerNormConfig(hidden_size=32, intermediate_size=64)
    stock, model, report = _patched_pair(rp.RobertaPreLayerNormIntermediate(cfg))
    assert type(model.mlp) is rp.RobertaPreLayerNormIntermediate
    assert any("forward computes more" in why for _, why in report.skipped)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)
