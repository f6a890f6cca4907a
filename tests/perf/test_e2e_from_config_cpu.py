"""scripts/e2e_from_config.py without a GPU: the committed configs load as their transformers
classes with the layer count asked for; files that are no config get a clear error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
transformers = pytest.importorskip("transformers")


def _script():
    spec = importlib.util.spec_from_file_location("e2e_from_config", ROOT / "scripts" / "e2e_from_config.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_glm_config_loads_with_the_layers_asked_for():
    config = _script().load_config(str(ROOT / "perf" / "configs" / "glm4.5-air.json"), 3)
    assert type(config).__name__ == "Glm4MoeConfig" and config.num_hidden_layers == 3
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (4096, 96, 8)
    assert config.n_routed_experts == 128 and config.num_experts_per_tok == 8 and config.first_k_dense_replace == 1


def test_the_ernie_moe_config_loads_and_every_layer_is_fused():
    """ERNIE-4.5-21B-A3B's published sizes (a dense first layer, then 64 experts of 1536, 6 per token,
    two shared), built on the meta device with 3 layers and patched: every layer on the fused step,
    the experts on the grouped kernels, only the fp32 routers left as they are."""
    import torch

    import hybridgemm

    config = _script().load_config(str(ROOT / "perf" / "configs" / "ernie4.5-21b-a3b.json"), 3)
    assert type(config).__name__ == "Ernie4_5_MoeConfig" and config.num_hidden_layers == 3
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) \
        == (2560, 20, 4, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.moe_num_shared_experts) == (64, 6, 1536, 2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    report = hybridgemm.patch(model)
    assert report.fused_layers == [f"model.layers.{i}" for i in range(3)]
    assert [name for name, _ in report.skipped] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]


def test_the_exaone4_shape_config_loads_and_every_layer_is_fused():
    """EXAONE 4's layer form at Llama-3-8B's sizes, its window pattern of 4 (three sliding layers,
    then a global one without rotary), built on the meta device with 4 layers: every layer fused,
    attention and all, nothing left unfused."""
    import torch

    import hybridgemm

    config = _script().load_config(str(ROOT / "perf" / "configs" / "exaone4-8b-shape.json"), 4)
    assert type(config).__name__ == "Exaone4Config" and config.num_hidden_layers == 4
    assert config.layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"] and config.sliding_window == 4096
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    report = hybridgemm.patch(model)
    layers = [f"model.layers.{i}" for i in range(4)]
    assert report.fused_layers == layers and report.fused_attention == layers and report.skipped == []


def test_the_seed_oss_shape_config_loads_and_every_layer_is_fused():
    """Seed-OSS's layer form (q/k/v biases, dropouts of the attention's and MLP's outputs) at
    Llama-3-8B's sizes, built on the meta device with 2 layers: every layer fused, nothing left."""
    import torch

    import hybridgemm

    config = _script().load_config(str(ROOT / "perf" / "configs" / "seed-oss-8b-shape.json"), 2)
    assert type(config).__name__ == "SeedOssConfig" and config.attention_bias and config.residual_dropout == 0.1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    report = hybridgemm.patch(model)
    layers = [f"model.layers.{i}" for i in range(2)]
    assert report.fused_layers == layers and report.fused_attention == layers and report.skipped == []


@pytest.mark.parametrize("text", ["[1, 2]", '{"hidden_size": 8}', '{"model_type": "no-such-model"}'])
def test_files_that_are_no_config_are_refused(tmp_path, text, capsys, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(text)
    script = _script()
    with pytest.raises((ValueError, KeyError)):
        script.load_config(str(path), None)
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    assert script.main([str(path)]) == 2
    assert capsys.readouterr().err.startswith("e2e_from_config: ")
