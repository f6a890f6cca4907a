"""Projection shapes from Hugging Face config.json files (``preset_from_hf_config`` and
``hybridgemm autotune --hf-config``). CPU only: the configs are written to tmp_path, and
every expected shape is worked out by hand from the config's figures."""

import json
import os
import sys
import threading

import pytest
import torch

from hybridgemm.autotune_cache.presets import get_preset, preset_from_hf_config
from hybridgemm.cli import main
from hybridgemm.parallel.sharding import rank_projections

# Trimmed from the models' published config.json files (the fields that matter, plus a few
# that must be ignored).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
    "use_cache": True, "vocab_size": 128256,
}
QWEN25_7B = {  # no bias field: Qwen2 attention hard-codes q/k/v bias and no o bias
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}
GPT2 = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
    "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "vocab_size": 50257,
}
GEMMA_7B = {  # head_dim 256 although hidden / heads = 192
    "architectures": ["GemmaForCausalLM"], "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256,
    "hidden_act": "gelu", "hidden_size": 3072, "intermediate_size": 24576, "max_position_embeddings": 8192,
    "model_type": "gemma", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000,
}
GEMMA3_4B = {  # multimodal: the language model's figures sit under text_config
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {
        "head_dim": 256, "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
    },
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
}
FALCON_7B = {  # multi_query: one K/V head shared by all 71 query heads
    "architectures": ["FalconForCausalLM"], "bias": False, "hidden_size": 4544, "model_type": "falcon",
    "multi_query": True, "n_head": 71, "n_layer": 32, "new_decoder_architecture": False, "parallel_attn": True,
    "vocab_size": 65024,
}


def write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return path


def shapes(preset):
    return {p.name: (p.n, p.k, p.bias) for p in preset.projections}


def test_llama3_8b(tmp_path):
    p = preset_from_hf_config(write(tmp_path, LLAMA3_8B))
    # 32 heads * 128 = 4096; 8 kv heads * 128 = 1024; qkv = 4096 + 2 * 1024 = 6144.
    assert shapes(p) == {
        "q": (4096, 4096, False), "kv": (1024, 4096, False),
        "qkv": (6144, 4096, False), "o": (4096, 4096, False),
    }
    assert (p.hidden, p.heads, p.kv_heads, p.head_dim) == (4096, 32, 8, 128)
    assert p.name == "llama"


def test_qwen25_7b_bias_on_qkv_only(tmp_path):
    p = preset_from_hf_config(write(tmp_path, QWEN25_7B))
    # head_dim = 3584 / 28 = 128; kv = 4 * 128 = 512; qkv = 3584 + 2 * 512 = 4608.
    assert shapes(p) == {
        "q": (3584, 3584, True), "kv": (512, 3584, True),
        "qkv": (4608, 3584, True), "o": (3584, 3584, False),
    }


def test_gpt2_old_field_names_and_bias(tmp_path):
    p = preset_from_hf_config(write(tmp_path, GPT2))
    # n_embd 768, n_head 12, no kv field -> 12 kv heads of 64: qkv = 3 * 768 = 2304.
    assert shapes(p) == {
        "q": (768, 768, True), "kv": (768, 768, True),
        "qkv": (2304, 768, True), "o": (768, 768, True),
    }


def test_explicit_head_dim_differs_from_hidden_over_heads(tmp_path):
    p = preset_from_hf_config(write(tmp_path, GEMMA_7B))
    # 16 heads * 256 = 4096 (not 3072); o maps 4096 back to 3072.
    assert shapes(p) == {
        "q": (4096, 3072, False), "kv": (4096, 3072, False),
        "qkv": (12288, 3072, False), "o": (3072, 4096, False),
    }


def test_null_head_dim_is_derived(tmp_path):
    p = preset_from_hf_config(write(tmp_path, {**LLAMA3_8B, "head_dim": None}))
    assert p.head_dim == 128 and shapes(p)["qkv"] == (6144, 4096, False)


def test_model_directory(tmp_path):
    model_dir = tmp_path / "Meta-Llama-3-8B"
    model_dir.mkdir()
    write(model_dir, {k: v for k, v in LLAMA3_8B.items() if k != "model_type"})
    (model_dir / "model.safetensors").write_bytes(b"")
    p = preset_from_hf_config(model_dir)
    assert shapes(p)["qkv"] == (6144, 4096, False)
    assert p.name == "meta-llama-3-8b"  # no _name_or_path, no model_type: the directory's name
    assert preset_from_hf_config(str(model_dir)) == p


def test_text_config_of_multimodal_model(tmp_path):
    p = preset_from_hf_config(write(tmp_path, GEMMA3_4B))
    # From text_config, not vision_config: 8 * 256 = 2048, 4 * 256 = 1024, 2048 + 2 * 1024 = 4096.
    assert shapes(p) == {
        "q": (2048, 2560, False), "kv": (1024, 2560, False),
        "qkv": (4096, 2560, False), "o": (2560, 2048, False),
    }
    assert p.name == "gemma3"


def test_multi_query_means_one_kv_head(tmp_path):
    p = preset_from_hf_config(write(tmp_path, FALCON_7B))
    # 4544 / 71 = 64; qkv = (71 + 2) * 64 = 4672; bias field false.
    assert shapes(p) == {
        "q": (4544, 4544, False), "kv": (64, 4544, False),
        "qkv": (4672, 4544, False), "o": (4544, 4544, False),
    }


def test_bias_fields_beat_model_type(tmp_path):
    assert shapes(preset_from_hf_config(write(tmp_path, {**LLAMA3_8B, "attention_bias": True})))["o"] == \
        (4096, 4096, True)
    assert shapes(preset_from_hf_config(write(tmp_path, {**GPT2, "bias": False})))["qkv"] == (2304, 768, False)
    qkv_only = {**LLAMA3_8B, "model_type": "somenewmodel", "qkv_bias": True}
    del qkv_only["attention_bias"]
    s = shapes(preset_from_hf_config(write(tmp_path, qkv_only)))
    assert s["qkv"] == (6144, 4096, True) and s["o"] == (4096, 4096, False)


@pytest.mark.parametrize("bias", [True, False])
def test_stablelms_qkv_bias_switch_and_its_norms_as_modules(tmp_path, bias):
    """StableLM's config names its q/k/v bias use_qkv_bias (o_proj has none); its LayerNorms run
    as modules in the fused step, so its gate/up is tuned without a norm prologue."""
    transformers = pytest.importorskip("transformers")
    transformers.StableLmConfig(hidden_size=2560, intermediate_size=6912, num_attention_heads=32,
                                use_qkv_bias=bias).save_pretrained(tmp_path)
    preset = preset_from_hf_config(str(tmp_path / "config.json"))
    s = shapes(preset)
    assert s["qkv"] == (7680, 2560, bias) and s["o"] == (2560, 2560, False) and preset.mlp_norm is None


def test_name_from_name_or_path_is_made_safe(tmp_path):
    p = preset_from_hf_config(write(tmp_path, {**QWEN25_7B, "_name_or_path": "Qwen/Qwen2.5 7B:Instruct"}))
    assert p.name == "qwen2.5-7b-instruct"


# --- errors: one-line ValueErrors naming the file and the field ---------------------------

def raises(path, *needles):
    with pytest.raises(ValueError) as info:
        preset_from_hf_config(path)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_missing_file(tmp_path):
    raises(tmp_path / "nope.json", str(tmp_path / "nope.json"), "no such file")


def test_directory_without_config(tmp_path):
    raises(tmp_path, str(tmp_path / "config.json"), "no config.json")


def test_invalid_json(tmp_path):
    raises(write(tmp_path, '{"hidden_size": 4096,'), "config.json", "not valid JSON", "line 1")


def test_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "\xff"}')
    raises(path, "config.json", "UTF-8")


def test_list_at_top_level(tmp_path):
    raises(write(tmp_path, [LLAMA3_8B]), "config.json", "JSON object", "list")


def test_text_config_not_an_object(tmp_path):
    raises(write(tmp_path, {**LLAMA3_8B, "text_config": [1]}), "config.json", "text_config")


def test_missing_hidden_size(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}
    raises(write(tmp_path, cfg), "config.json", "hidden_size", "missing", "n_embd", "d_model")


def test_missing_hidden_size_in_text_config(tmp_path):
    cfg = {**GEMMA3_4B, "text_config": {"model_type": "llama", "num_attention_heads": 32}}
    raises(write(tmp_path, cfg), "text_config.hidden_size", "missing")


def test_missing_heads(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "num_attention_heads"}
    raises(write(tmp_path, cfg), "num_attention_heads", "missing")


def test_heads_not_divisible_by_kv_heads(tmp_path):
    raises(write(tmp_path, {**LLAMA3_8B, "num_key_value_heads": 5}), "config.json", "num_key_value_heads",
           "32", "5")


def test_hidden_not_divisible_by_heads_without_head_dim(tmp_path):
    raises(write(tmp_path, {**LLAMA3_8B, "num_attention_heads": 24, "num_key_value_heads": 8,
                            "hidden_size": 4100}), "num_attention_heads", "4100", "head_dim")


@pytest.mark.parametrize("field, value", [
    ("hidden_size", -4096), ("hidden_size", 0), ("num_attention_heads", -32), ("num_key_value_heads", -8),
    ("head_dim", -128), ("hidden_size", 2**40),
])
def test_non_positive_or_huge_values(tmp_path, field, value):
    raises(write(tmp_path, {**LLAMA3_8B, field: value}), "config.json", field, str(value))


@pytest.mark.parametrize("field, value", [
    ("hidden_size", True), ("num_attention_heads", False), ("num_key_value_heads", True), ("head_dim", True),
    ("hidden_size", 4096.0), ("hidden_size", "4096"), ("num_attention_heads", [32]),
])
def test_wrong_types_where_ints_are_expected(tmp_path, field, value):
    raises(write(tmp_path, {**LLAMA3_8B, field: value}), "config.json", field, "positive integer")


def test_bias_field_not_a_bool(tmp_path):
    raises(write(tmp_path, {**LLAMA3_8B, "attention_bias": "yes"}), "attention_bias", "true or false")


def test_unknown_model_without_bias_field(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "attention_bias"}
    raises(write(tmp_path, {**cfg, "model_type": "brandnew"}), "config.json", "attention_bias", "brandnew")


def test_too_large_file(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(16 * 1024 * 1024 + 1)  # sparse: costs no disk
    raises(path, "config.json", "too large")


def test_wrong_path_types(tmp_path):
    raises(None, "str or path")
    raises("", "empty")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("as_dir", [False, True])
def test_fifo_is_refused_without_blocking(tmp_path, as_dir):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    result = {}

    def load():
        try:
            preset_from_hf_config(tmp_path if as_dir else fifo)
        except ValueError as e:
            result["msg"] = str(e)

    # In a thread, so a regression shows as a failure rather than a hung test run.
    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(timeout=120)  # a hang guard: the refusal takes milliseconds
    if t.is_alive():  # unblock the stuck open() by opening the write end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("preset_from_hf_config blocked on a FIFO")
    assert "not a regular file" in result["msg"] and "config.json" in result["msg"]


# --- the command line -------------------------------------------------------------------

def test_cli_help_lists_hf_config(capsys):
    with pytest.raises(SystemExit):
        main(["autotune", "--help"])
    assert "--hf-config PATH" in capsys.readouterr().out


@pytest.mark.parametrize("content", ['{"hidden_size": 4096', '[]', json.dumps({**LLAMA3_8B,
                                                                             "num_key_value_heads": 5})])
def test_cli_bad_config_is_a_message_not_a_traceback(tmp_path, capsys, content):
    bad = write(tmp_path, content)
    assert main(["autotune", "--hf-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridgemm autotune: ") and str(bad) in err
    assert "Traceback" not in err and "needs a CUDA GPU" not in err
    assert len(err.strip().splitlines()) == 1


def test_cli_missing_config(tmp_path, capsys):
    assert main(["autotune", "--model", "llama3-8b", "--hf-config", str(tmp_path / "gone")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "needs a CUDA GPU" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_good_config_then_needs_gpu(tmp_path, capsys):
    good = write(tmp_path, QWEN25_7B)
    assert main(["autotune", "--hf-config", str(good), "--hf-config", str(good)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "Traceback" not in err


def test_cli_without_any_shape_mentions_hf_config(capsys):
    assert main(["autotune"]) == 2
    assert "--hf-config PATH" in capsys.readouterr().err


def test_no_transformers_import(tmp_path):
    """The reader works without transformers: it must not import it."""
    had = "transformers" in sys.modules
    preset_from_hf_config(write(tmp_path, LLAMA3_8B))
    assert had or "transformers" not in sys.modules


# --- tensor parallelism: the MLP and LM head figures, and --tp -----------------------------

def test_whole_model_figures_are_read(tmp_path):
    p = preset_from_hf_config(write(tmp_path, LLAMA3_8B))
    assert (p.intermediate, p.vocab, p.layers, p.mlp_bias, p.tied_lm_head) == (14336, 128256, 32, False, False)
    g = preset_from_hf_config(write(tmp_path, GPT2))  # n_layer; no intermediate_size
    assert (g.intermediate, g.vocab, g.layers) == (None, 50257, 12)
    m = preset_from_hf_config(write(tmp_path, {**GEMMA3_4B, "tie_word_embeddings": True}))  # top-level flag
    assert (m.intermediate, m.layers, m.tied_lm_head) == (10240, 34, True)
    b = preset_from_hf_config(write(tmp_path, {**LLAMA3_8B, "mlp_bias": True, "tie_word_embeddings": True}))
    assert b.mlp_bias and b.tied_lm_head


@pytest.mark.parametrize("field, value, needle", [
    ("intermediate_size", 0, "positive integer"), ("vocab_size", "big", "positive integer"),
    ("num_hidden_layers", True, "positive integer"), ("mlp_bias", "no", "true or false"),
    ("tie_word_embeddings", 1, "true or false"),
])
def test_bad_whole_model_figures(tmp_path, field, value, needle):
    raises(write(tmp_path, {**LLAMA3_8B, field: value}), "config.json", field, needle)


def test_qwen25_7b_over_two_ranks(tmp_path):
    p = preset_from_hf_config(write(tmp_path, QWEN25_7B))
    # 14 query heads and 2 KV heads of 128 per rank, q/k/v biased; MLP 18944 / 2 = 9472.
    assert {s.name: (s.n, s.k, s.bias) for s in rank_projections(p, 2)} == {
        "q": (1792, 3584, True), "kv": (256, 3584, True), "qkv": (2304, 3584, True),
        "o": (3584, 1792, False), "gate_up": (9472, 3584, False), "down": (3584, 9472, False),
        "lm_head": (76032, 3584, False),
    }


def _tuned_shapes(monkeypatch, argv, gated=None):
    """The shapes ``hybridgemm autotune ARGV`` hands the tuner (stopped right there: tuning
    needs a GPU); the gate/up shapes it hands the gated kernel's tuner go into ``gated``."""
    import hybridgemm.cli.commands as cli

    class Stop(Exception):
        pass

    def keys_for(shapes, *args, **kwargs):  # (an epilogue activation, where a shape has one, last)
        raise Stop([(s.name, s.n, s.k, s.bias) + ((s.activation,) if s.activation != "none" else ())
                    for s in shapes])

    monkeypatch.setattr(cli, "_need_gpu", lambda what: True)
    monkeypatch.setattr(cli.tune_table, "keys_for", keys_for)
    monkeypatch.setattr(cli, "_tune_gated", lambda shapes, args: (gated if gated is not None else []).extend(shapes))
    with pytest.raises(Stop) as info:
        main(["autotune", *argv])
    return info.value.args[0]


@pytest.mark.parametrize("name,norms", [("llama3-8b", (None, "x")), ("gemma-7b", (None, "fp32")),
                                        ("olmo2-7b", (None,))])
def test_cli_mlp_tunes_the_gated_kernel_with_the_presets_prologue(monkeypatch, name, norms):
    gated = []
    _tuned_shapes(monkeypatch, ["--model", name, "--mlp"], gated)
    preset = get_preset(name)
    assert [(g.intermediate, g.k, g.bias, g.norms) for g in gated] == [(preset.intermediate, preset.hidden, False,
                                                                       norms)]
    gated.clear()
    _tuned_shapes(monkeypatch, ["--model", name, "--mlp", "--tp", "2"], gated)  # a rank's gate/up: I / 2
    assert [(g.intermediate, g.k, g.norms) for g in gated] == [(preset.intermediate // 2, preset.hidden, norms)]
    gated.clear()
    _tuned_shapes(monkeypatch, ["--model", name, "--mlp", "--tp", "1"], gated)  # one rank: the whole MLP
    assert [g.intermediate for g in gated] == [preset.intermediate]
    gated.clear()
    _tuned_shapes(monkeypatch, ["--model", name], gated)
    assert gated == []  # no --mlp: no gated entries


def test_cli_hf_config_tunes_the_gated_shapes_the_patched_model_calls(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    gated = []
    _tuned_shapes(monkeypatch, ["--hf-config", str(write(tmp_path, LLAMA3_8B)), "--mlp"], gated)
    assert [(g.intermediate, g.k, g.bias, g.norms) for g in gated] == [(14336, 4096, False, (None, "x"))]


def test_cli_tp_tunes_one_ranks_shapes(tmp_path, monkeypatch):
    shapes = _tuned_shapes(monkeypatch, ["--hf-config", str(write(tmp_path, LLAMA3_8B)), "--tp", "2"])
    assert shapes == [("q", 2048, 4096, False), ("kv", 512, 4096, False), ("qkv", 3072, 4096, False),
                      ("o", 4096, 2048, False), ("gate_up", 7168, 4096, False), ("down", 4096, 7168, False),
                      ("lm_head", 64128, 4096, False)]
    # the same model as a preset gives the same shapes; without --tp only attention's, unsplit
    assert _tuned_shapes(monkeypatch, ["--model", "llama3-8b", "--tp", "2"]) == shapes
    assert [s[0] for s in _tuned_shapes(monkeypatch, ["--model", "llama3-8b"])] == ["q", "kv", "qkv"]  # o == q


def test_cli_tp_tunes_a_family_parallelize_leaves_whole_at_its_full_size(monkeypatch, capsys):
    """--model of a family whose layers parallelize does not split (GPT-NeoX, Falcon, Phi-3):
    under --tp its attention and MLP GEMMs are the whole model's, only the LM head a rank's
    rows, and stderr says so."""
    shapes = _tuned_shapes(monkeypatch, ["--model", "pythia-6.9b", "--tp", "2"])
    # (kv and o are q's shape: tuned once)
    assert shapes == [("q", 4096, 4096, True), ("qkv", 12288, 4096, True), ("lm_head", 25216, 4096, False)]
    assert "leaves the attention of pythia-6.9b whole on each rank" in capsys.readouterr().err  # (no gated MLP)
    phi3 = {s[0]: s[1:] for s in _tuned_shapes(monkeypatch, ["--model", "phi3-mini", "--tp", "4"])}
    assert phi3["qkv"] == (9216, 3072, False) and phi3["gate_up"] == (8192, 3072, False)
    assert phi3["down"] == (3072, 8192, False) and phi3["lm_head"] == (8016, 3072, False)
    assert _tuned_shapes(monkeypatch, ["--model", "falcon-7b", "--tp", "2"])[2] == ("qkv", 4672, 4544, False)
    capsys.readouterr()
    _tuned_shapes(monkeypatch, ["--model", "pythia-6.9b", "--tp", "1"])
    assert "whole" not in capsys.readouterr().err  # one rank: nothing to say


def test_cli_mlp_tp_tunes_the_gated_kernel_of_an_mlp_parallelize_leaves_whole(tmp_path, monkeypatch):
    """Phi-3's MLP runs whole on every rank, so --mlp --tp tunes its gated kernel at full width,
    from the preset and from the config (the patched model's gate/up); a split MLP, one rank's
    I / tp."""
    pytest.importorskip("transformers")
    from hybridgemm.perf import e2e_models as hf

    gated = []
    _tuned_shapes(monkeypatch, ["--model", "phi3-mini", "--mlp", "--tp", "2"], gated)
    assert [(g.intermediate, g.k, g.bias) for g in gated] == [(8192, 3072, False)]
    path = tmp_path / "phi3.json"
    hf.hf_config("phi3-mini", layers=2).to_json_file(str(path))
    gated.clear()
    _tuned_shapes(monkeypatch, ["--hf-config", str(path), "--mlp", "--tp", "2"], gated)
    assert [(g.intermediate, g.k, g.bias) for g in gated] == [(8192, 3072, False)]
    gated.clear()
    _tuned_shapes(monkeypatch, ["--hf-config", str(path), "--tp", "2"], gated)  # no --mlp: no gated entries
    assert gated == []
    _tuned_shapes(monkeypatch, ["--hf-config", str(write(tmp_path, LLAMA3_8B)), "--mlp", "--tp", "2"], gated)
    assert [(g.intermediate, g.k, g.bias, g.norms) for g in gated] == [(7168, 4096, False, (None, "x"))]


def test_a_family_without_a_gated_mlp_has_no_mlp_width(tmp_path):
    """GPT-NeoX's intermediate_size is its dense_h_to_4h's width, not a gate/up width: the
    fields give no MLP shape (patch's activated linears come from the built model)."""
    neox = {"model_type": "gpt_neox", "hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 16384,
            "num_hidden_layers": 32, "vocab_size": 50432}
    p = preset_from_hf_config(write(tmp_path, neox))
    assert p.intermediate is None and p.qkv_bias and p.o_bias
    assert [s.name for s in rank_projections(p, 1)] == ["q", "kv", "qkv", "o", "lm_head"]
    assert preset_from_hf_config(write(tmp_path, {**neox, "model_type": "llama"})).intermediate == 16384


def test_cli_mlp_adds_the_mlp_and_lm_head_shapes(tmp_path, monkeypatch, capsys):
    shapes = _tuned_shapes(monkeypatch, ["--model", "llama3-8b", "--mlp"])
    assert shapes == [("q", 4096, 4096, False), ("kv", 1024, 4096, False), ("qkv", 6144, 4096, False),
                      ("gate_up", 14336, 4096, False), ("down", 4096, 14336, False),
                      ("lm_head", 128256, 4096, False)]  # o is q's shape: tuned once
    assert _tuned_shapes(monkeypatch, ["--model", "llama3-8b", "--mlp", "--tp", "2"]) == _tuned_shapes(
        monkeypatch, ["--model", "llama3-8b", "--tp", "2"])
    # a preset without the MLP's sizes (BERT's MLP is not gate/up/down): attention only
    assert [s[0] for s in _tuned_shapes(monkeypatch, ["--model", "bert-base", "--mlp"])] == ["q", "qkv"]  # kv, o: q's
    assert main(["autotune", "--shape", "6144,4096", "--mlp"]) == 2
    assert "--mlp applies to --model and --hf-config" in capsys.readouterr().err


@pytest.mark.parametrize("tp, needle", [("3", "tp=3 does not divide the 32 attention heads"),
                                        ("0", "--tp takes the number of tensor-parallel ranks"),
                                        ("-1", "(1 or more), got -1")])
def test_cli_hf_config_tp_that_does_not_split(tmp_path, capsys, tp, needle):
    path = write(tmp_path, LLAMA3_8B)
    assert main(["autotune", "--hf-config", str(path), "--tp", tp]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridgemm autotune: ") and needle in err
    assert len(err.strip().splitlines()) == 1 and "needs a CUDA GPU" not in err


# --- --hf-config without --tp: the GEMMs hybridgemm.patch runs on the model the config builds ------

pytest_transformers = pytest.importorskip  # (transformers is a test dependency; the reader above needs none)


@pytest.mark.parametrize("cfg, attention, rest", [
    (LLAMA3_8B, [("qkv", 6144, 4096, False), ("o", 4096, 4096, False)],
     [("gate_up", 14336, 4096, False), ("down", 4096, 14336, False), ("lm_head", 128256, 4096, False)]),
    (QWEN25_7B, [("qkv", 4608, 3584, True), ("o", 3584, 3584, False)],
     [("gate_up", 18944, 3584, False), ("down", 3584, 18944, False), ("lm_head", 152064, 3584, False)]),
    (GPT2, [("qkv", 2304, 768, True), ("o", 768, 768, True)],
     [("up", 3072, 768, True, "gelu_tanh"), ("down", 768, 3072, True), ("lm_head", 50257, 768, False)]),
], ids=["llama3-8b", "qwen2.5-7b", "gpt2"])
def test_cli_hf_config_tunes_the_gemms_the_patched_model_runs(tmp_path, monkeypatch, cfg, attention, rest):
    pytest_transformers("transformers")
    path = str(write(tmp_path, cfg))
    assert _tuned_shapes(monkeypatch, ["--hf-config", path]) == attention  # the fused QKV, not q and k/v apart
    assert _tuned_shapes(monkeypatch, ["--hf-config", path, "--mlp"]) == attention + rest


@pytest.mark.parametrize("name, want", [
    ("pythia-6.9b", [("qkv", 12288, 4096, True), ("o", 4096, 4096, True), ("up", 16384, 4096, True, "gelu"),
                     ("down", 4096, 16384, True), ("lm_head", 50432, 4096, False)]),
    ("falcon-7b", [("qkv", 4672, 4544, False), ("o", 4544, 4544, False), ("up", 18176, 4544, False, "gelu"),
                   ("down", 4544, 18176, False), ("lm_head", 65024, 4544, False)]),
])
def test_cli_hf_config_tunes_an_activated_linear_with_its_activation(tmp_path, monkeypatch, name, want):
    """GPT-NeoX's and Falcon's dense_h_to_4h runs with the MLP's GELU in its epilogue: that is
    the table key tuned (its multi-query Q/K/V: 71 heads of 64 and one K/V head)."""
    pytest_transformers("transformers")
    from hybridgemm.perf import e2e_models as hf

    path = tmp_path / "config.json"
    hf.hf_config(name, layers=2).to_json_file(path)
    assert _tuned_shapes(monkeypatch, ["--hf-config", str(path), "--mlp"]) == want


@pytest.mark.parametrize("name, attention_mlp, lm_head", [
    ("pythia-6.9b", [("qkv", 12288, 4096, True), ("o", 4096, 4096, True), ("up", 16384, 4096, True, "gelu"),
                     ("down", 4096, 16384, True)], ("lm_head", 25216, 4096, False)),
    # 71 heads that 2 ranks do not split: parallelize leaves Falcon's attention whole, so no error
    ("falcon-7b", [("qkv", 4672, 4544, False), ("o", 4544, 4544, False), ("up", 18176, 4544, False, "gelu"),
                   ("down", 4544, 18176, False)], ("lm_head", 32512, 4544, False)),
])
def test_cli_hf_config_tp_of_a_family_parallelize_leaves_whole(tmp_path, monkeypatch, capsys, name, attention_mlp,
                                                                  lm_head):
    """GPT-NeoX's and Falcon's layers are not split by hybridgemm.parallelize (only the LM
    head's rows are): under --tp each rank runs their GEMMs whole, and that is what is tuned."""
    pytest_transformers("transformers")
    from hybridgemm.perf import e2e_models as hf

    path = tmp_path / "config.json"
    config = hf.hf_config(name, layers=2)
    config.to_json_file(path)
    with torch.device("meta"):
        model = pytest_transformers("transformers").AutoModelForCausalLM.from_config(config)
    if "lm_head" not in model._modules:  # GPT-NeoX's head is embed_out in older transformers (5.8.1): left whole
        lm_head = (lm_head[0], config.vocab_size, *lm_head[2:])
    assert _tuned_shapes(monkeypatch, ["--hf-config", str(path), "--tp", "2"]) == attention_mlp + [lm_head]
    assert "leaves the attention and the mlp of the model" in capsys.readouterr().err
    assert _tuned_shapes(monkeypatch, ["--hf-config", str(path), "--mlp"])[:-1] == attention_mlp  # as without --tp


def _mixed_split_configs():
    transformers = pytest_transformers("transformers")
    starcoder2 = transformers.Starcoder2Config(hidden_size=256, intermediate_size=1024, num_attention_heads=8,
                                               num_key_value_heads=2, num_hidden_layers=2, vocab_size=1000,
                                               tie_word_embeddings=False)
    deepseek_v3 = transformers.DeepseekV3Config(
        hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=2,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, vocab_size=1000, tie_word_embeddings=False)
    return {"starcoder2": starcoder2.to_dict(), "deepseek_v3": deepseek_v3.to_dict()}


@pytest.mark.parametrize("name, want, whole", [
    # its attention split (4 of 8 heads, 1 of 2 KV heads; only rank 0 adds o's bias), its MLP
    # whole (c_fc / c_proj: not dispatched), the LM head's rows split
    ("starcoder2", [("q", 128, 256, True), ("kv", 32, 256, True), ("qkv", 192, 256, True), ("o", 256, 128, True),
                    ("o_nobias", 256, 128, False), ("lm_head", 500, 256, False)], "the mlp"),
    # its attention whole (not dispatched), its dense MLP's columns split: gate/up N / 2, down K / 2
    ("deepseek_v3", [("gate_up", 384, 256, False), ("down", 256, 384, False), ("lm_head", 500, 256, False)],
     "the attention"),
])
def test_cli_hf_config_tp_cuts_each_part_as_parallelize_does(tmp_path, monkeypatch, capsys, name, want, whole):
    path = write(tmp_path, _mixed_split_configs()[name])
    assert _tuned_shapes(monkeypatch, ["--hf-config", str(path), "--tp", "2"]) == want
    assert f"leaves {whole} of the model" in capsys.readouterr().err


def test_cli_hf_config_follows_what_patch_fuses(tmp_path, monkeypatch):
    """A config whose model patch fuses differently gives other shapes: Qwen3 (a head_dim of its
    own), and a model whose MLP gate/up patch cannot fuse (a shared weight is not in a config, so
    an activation patch does not fuse: its gate and up run as two dispatched GEMMs of one shape)."""
    pytest_transformers("transformers")
    qwen3 = {**LLAMA3_8B, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 64,
             "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 6144}
    got = _tuned_shapes(monkeypatch, ["--hf-config", str(write(tmp_path, qwen3)), "--mlp"])
    assert got == [("qkv", 1536, 4096, False), ("o", 4096, 1024, False), ("gate_up", 6144, 4096, False),
                   ("down", 4096, 6144, False), ("lm_head", 128256, 4096, False)]
    relu = {**LLAMA3_8B, "hidden_act": "relu"}  # patch fuses only SiLU/GELU gated MLPs: this one is left alone
    got = _tuned_shapes(monkeypatch, ["--hf-config", str(write(tmp_path, relu)), "--mlp"])
    assert got == [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("lm_head", 128256, 4096, False)]


def test_cli_hf_config_of_a_model_patch_leaves_alone(tmp_path, monkeypatch, capsys):
    """Mamba: no attention, its mixer's linears left alone; only the LM head is dispatched."""
    transformers = pytest_transformers("transformers")
    cfg = transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=1000, state_size=16).to_dict()
    path = str(write(tmp_path, cfg))
    monkeypatch.setattr("hybridgemm.cli.commands._need_gpu", lambda what: True)
    assert main(["autotune", "--hf-config", path]) == 2
    err = capsys.readouterr().err
    assert "runs no dispatched GEMM in the attention of the MambaForCausalLM" in err and "--mlp adds" in err
    assert len(err.strip().splitlines()) == 1
    assert _tuned_shapes(monkeypatch, ["--hf-config", path, "--mlp"]) == [("lm_head", 1000, 64, False)]


def test_cli_hf_config_transformers_cannot_build_falls_back_to_the_fields(tmp_path, monkeypatch, capsys):
    """A model_type transformers does not know: the shapes the config's fields give, said on stderr."""
    cfg = {**LLAMA3_8B, "model_type": "not-a-transformers-model"}
    got = _tuned_shapes(monkeypatch, ["--hf-config", str(write(tmp_path, cfg))])
    assert got == [("q", 4096, 4096, False), ("kv", 1024, 4096, False), ("qkv", 6144, 4096, False)]
    err = capsys.readouterr().err
    assert "is not one transformers" in err and "tuning the shapes the config's fields give" in err


# --- mixtures of experts -------------------------------------------------------------------------

QWEN3_30B_A3B = {  # trimmed from the published config.json; 2 layers instead of 48 (shapes do not depend on it)
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 2,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 151936,
}
MIXTRAL_8X7B = {  # v0.1, 2 layers instead of 32
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
}


@pytest.mark.parametrize("name, cfg", [("qwen3-30b-a3b", QWEN3_30B_A3B), ("mixtral-8x7b", MIXTRAL_8X7B)])
def test_cli_moe_preset_tunes_what_the_patched_model_runs(tmp_path, monkeypatch, capsys, name, cfg):
    """A mixture-of-experts preset: its attention shapes; with --mlp (or --tp) only the router
    and the LM head beyond them, with a note on stderr (the experts run in the grouped kernels,
    not the table's GEMMs). The model its published config builds, patched, runs those very
    GEMMs."""
    attention = _tuned_shapes(monkeypatch, ["--model", name])
    assert capsys.readouterr().err == ""
    mlp = _tuned_shapes(monkeypatch, ["--model", name, "--mlp"])
    err = capsys.readouterr().err
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert mlp == attention + [("router", experts, cfg["hidden_size"], False),
                               ("lm_head", cfg["vocab_size"], cfg["hidden_size"], False)]
    assert err.startswith(f"hybridgemm autotune: {name} is a mixture of experts") and "only its router's and LM" in err
    assert len(err.strip().splitlines()) == 1
    _tuned_shapes(monkeypatch, ["--model", name, "--tp", "2"])
    assert f"{name} is a mixture of experts" in capsys.readouterr().err
    pytest_transformers("transformers")
    built = _tuned_shapes(monkeypatch, ["--hf-config", str(write(tmp_path, cfg)), "--mlp"])
    assert [role for role, *_ in built] == ["qkv", "o", "router", "lm_head"]  # the experts run no table GEMM
    assert {tuple(s[1:]) for s in built} <= {tuple(s[1:]) for s in mlp}  # the preset's (o may be q's shape)


QWEN3_30B_A3B = {  # published config.json fields that matter here
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "attention_bias": False, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "vocab_size": 151936,
    "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "vocab_size": 32000, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("cfg,want", [(QWEN3_30B_A3B, (128, 8, 768)), (MIXTRAL_8X7B, (8, 2, 14336))],
                         ids=["qwen3-moe", "mixtral"])
def test_a_mixture_of_experts_has_experts_and_no_dense_mlp(tmp_path, cfg, want):
    """Its experts (width moe_intermediate_size, else Mixtral's intermediate_size) run in the
    MoE kernels: the tensor-parallel shapes hold no dense gate/up or down."""
    from hybridgemm.parallel.sharding import rank_projections

    p = preset_from_hf_config(write(tmp_path, cfg))
    assert p.moe and (p.experts, p.experts_per_token, p.expert_intermediate) == want and p.intermediate is None
    names = {s.name for s in rank_projections(p, 2)}
    assert not {"gate_up", "down", "down_nobias"} & names and "lm_head" in names


def test_bad_expert_fields_are_named(tmp_path):
    with pytest.raises(ValueError, match="num_experts_per_tok: missing"):
        preset_from_hf_config(write(tmp_path, {**QWEN3_30B_A3B, "num_experts_per_tok": None}))
    with pytest.raises(ValueError, match="num_experts_per_tok: 200 is more than the 128 experts"):
        preset_from_hf_config(write(tmp_path, {**QWEN3_30B_A3B, "num_experts_per_tok": 200}))
    with pytest.raises(ValueError, match="moe_intermediate_size: missing"):
        preset_from_hf_config(write(tmp_path, {k: v for k, v in QWEN3_30B_A3B.items()
                                               if k not in ("moe_intermediate_size", "intermediate_size")}))


def test_cli_shape_without_bias(monkeypatch, capsys):
    """``--shape N,K --no-bias`` tunes the bias-less GEMM (a router's); ``--no-bias`` alone is a
    usage error."""
    assert _tuned_shapes(monkeypatch, ["--shape", "128,2048", "--no-bias"]) == [("128,2048", 128, 2048, False)]
    assert _tuned_shapes(monkeypatch, ["--shape", "128,2048"]) == [("128,2048", 128, 2048, True)]
    assert main(["autotune", "--model", "llama3-8b", "--no-bias"]) == 2
    assert "--no-bias applies to --shape" in capsys.readouterr().err


def test_cli_fp8_tunes_the_router_in_the_models_dtype(monkeypatch):
    """``--weights fp8``: the projections' keys are the FP8 format's; a router's and the LM
    head's, which ``patch(weights="fp8")`` leaves in the model's dtype, the plain linear's (the
    LM head FP8 with ``--quantize-lm-head``, as ``quantize_lm_head=True`` quantizes it)."""
    import hybridgemm.cli.commands as cli

    class Stop(Exception):
        pass

    real, calls = cli.tune_table.keys_for, []

    def keys_for(shapes, *args, **kwargs):
        calls.append(([s.name for s in shapes], kwargs.get("weight_format", "")))
        return real(shapes, *args, **kwargs)

    def load(path, **kw):  # the keys are made: stop before any table is read
        raise Stop()

    monkeypatch.setattr(cli, "_need_gpu", lambda what: True)
    monkeypatch.setattr(cli.tune_table, "keys_for", keys_for)
    monkeypatch.setattr(cli.TuningTable, "load", load)
    with pytest.raises(Stop):
        main(["autotune", "--model", "qwen3-30b-a3b", "--mlp", "--weights", "fp8", "--m", "1"])
    formats = {name: fmt for names, fmt in calls for name in names}
    assert formats["router"] == formats["lm_head"] == "" and formats["qkv"] == "e4m3_channel", calls
    calls.clear()
    with pytest.raises(Stop):
        main(["autotune", "--model", "qwen3-30b-a3b", "--mlp", "--weights", "fp8", "--quantize-lm-head", "--m", "1"])
    formats = {name: fmt for names, fmt in calls for name in names}
    assert formats["router"] == "" and formats["lm_head"] == formats["qkv"] == "e4m3_channel", calls
    calls.clear()
    with pytest.raises(Stop):
        main(["autotune", "--model", "qwen3-30b-a3b", "--mlp", "--m", "1"])
    assert {fmt for _, fmt in calls} == {""}
