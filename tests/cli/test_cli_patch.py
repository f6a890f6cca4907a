"""`hybridgemm patch --dry-run --hf-config PATH`: the report of hybridgemm.patch on the model a
config.json describes, built on the meta device (no weights); a bad path or config is one line
on stderr and exit code 2."""

from __future__ import annotations

import pytest

from hybridgemm.cli import main

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _config(tmp_path, config, name: str = "config.json"):
    path = tmp_path / name
    config.to_json_file(str(path))
    return path


def test_dry_run_of_a_supported_family_reports_no_skips(tmp_path, capsys):
    path = _config(tmp_path, transformers.LlamaConfig(**TINY))
    rc, out, err = _run(["patch", "--dry-run", "--hf-config", str(tmp_path), "--strict"], capsys)  # the directory
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{path}: LlamaForCausalLM, built on the meta device (no weights)"
    # per layer its attention, o_proj, MLP, down_proj and two norms, then the final norm, lm_head and the layers
    assert lines[1] == ("hybridgemm.patch: patched 16 modules (2 with fused QKV, 2 with fused gate/up, 2 decoder "
                        "layers with fused norms and residuals, 2 with rotary and KV-cache writes fused)")
    assert len(lines) == 2 and "skipped" not in out


def test_dry_run_lists_every_skipped_module(tmp_path, capsys):
    config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    path = _config(tmp_path, config, "gpt2.json")
    rc, out, err = _run(["patch", "--dry-run", "--hf-config", str(path)], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    # per layer: c_attn, c_proj, c_fc (its GELU in the epilogue), the MLP's c_proj and the MLP;
    # and the LM head
    assert lines[1] == ("hybridgemm.patch: patched 11 modules (0 with fused QKV, 0 with fused gate/up, 0 decoder "
                        "layers with fused norms and residuals, 0 with rotary and KV-cache writes fused), "
                        "skipped 6")
    assert lines[2] == "skipped (6):"
    listed = [line.strip().split(": ", 1) for line in lines[3:]]
    assert [name for name, _ in listed] == [f"transformer.h.{i}{part}" for i in range(2) for part in (
        "", ".ln_1", ".ln_2")]
    assert "GPT2Block" in listed[0][1]
    assert "LayerNorm is not one of the" in listed[1][1] and "RMS_NORM_CLASSES" in listed[1][1]
    rc, strict_out, _ = _run(["patch", "--dry-run", "--hf-config", str(path), "--strict"], capsys)
    assert rc == 1 and strict_out == out  # the same report; --strict makes the skips the exit code


def test_dry_run_of_a_mixture_of_experts_model(tmp_path, capsys):
    config = transformers.MixtralConfig(**{**TINY, "num_hidden_layers": 1}, num_local_experts=4, num_experts_per_tok=2)
    path = _config(tmp_path, config)
    rc, out, err = _run(["patch", "--dry-run", "--hf-config", str(path)], capsys)
    assert rc == 0, err
    # the stacked experts (fusion/experts.py) and the router (fusion/router.py) are patched
    assert "mlp.gate" not in out and "mlp.experts" not in out and "skipped" not in out
    assert "1 MoE blocks with the residual in the experts' launch" in out  # the probe runs on a meta-built model


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object at the top level, got list"),
    ('{"hidden_size": 64}', "no model_type field"),
    ('{"model_type": "no-such-model"}', "model_type 'no-such-model' is not one transformers"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}',
     "transformers refuses this llama config: StrictDataclassClassValidationError"),
])
def test_a_bad_path_or_config_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    rc, out, err = _run(["patch", "--dry-run", "--hf-config", str(path)], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("hybridgemm patch: error: ") and message in err, err


def test_a_directory_without_config_and_missing_options(tmp_path, capsys):
    rc, _, err = _run(["patch", "--dry-run", "--hf-config", str(tmp_path)], capsys)
    assert rc == 2 and "no config.json in this directory" in err and err.count("\n") == 1
    rc, _, err = _run(["patch", "--hf-config", str(tmp_path)], capsys)
    assert rc == 2 and "--dry-run" in err and "Traceback" not in err
