"""The mixture-of-experts models of the end-to-end benchmark (perf/bench_e2e.py) without a GPU:
the qwen3-30b-a3b and mixtral-8x7b configs against their published config.json, the HBM floor
of a decode step (only the experts uniform routing reaches, E * (1 - (1 - k/E)^B)) counted by
hand, the command line taking the names, and the same families at tiny sizes built through
the same ``hf_config``: what ``patch`` does to them, stock logits, and a whole run of every
mode on the CPU (the compiled step with the experts' Triton kernels under the interpreter)."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch

import hybridgemm
from helpers import bench_cli
from hybridgemm import experts as hexperts
from hybridgemm.autotune_cache.presets import PRESETS
from hybridgemm.experts import HybridExperts
from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import e2e_models as hf
from hybridgemm.router import HybridTopKRouter

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

MOE = ("qwen3-30b-a3b", "mixtral-8x7b")
VOCAB = 200


# ----------------------------------------------------------------------------- the full-size figures


PUBLISHED = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", 1e6, dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=48,
        vocab_size=151936, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960, attention_bias=False,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, tie_word_embeddings=False)),
    "mixtral-8x7b": ("MixtralConfig", 1e6, dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=32,
        vocab_size=32000, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", MOE)
def test_configs_have_the_published_figures(name):
    cls, theta, fields = PUBLISHED[name]
    config = hf.hf_config(name)
    assert type(config).__name__ == cls
    assert {k: getattr(config, k) for k in fields} == fields
    assert hf.rope_theta(config) == theta
    assert hf.hf_config(name, layers=3).num_hidden_layers == 3
    preset = PRESETS[name]
    assert preset.moe and preset.intermediate is None and hf.is_moe(name)
    assert (preset.experts, preset.experts_per_token, preset.expert_intermediate) == (
        (128, 8, 768) if name == "qwen3-30b-a3b" else (8, 2, 14336))
    assert hf.experts_per_token(config) == preset.experts_per_token
    assert name in hf.model_names() and name not in hf.dense_model_names()


def test_hf_config_takes_head_dim_only_where_the_family_reads_it(monkeypatch):
    """Qwen3-30B-A3B's 32 heads of 128 are wider than its hidden size (2048): its family's config
    carries head_dim; Qwen2's does not, so such a preset of that family is refused."""
    assert PRESETS["qwen3-30b-a3b"].hidden != 32 * 128
    wide = replace(PRESETS["qwen2.5-7b"], name="wide-qwen2", head_dim=256)
    monkeypatch.setitem(PRESETS, "wide-qwen2", wide)
    monkeypatch.setitem(hf.SIZES, "wide-qwen2", hf.SIZES["qwen2.5-7b"])
    with pytest.raises(ValueError, match="Qwen2Config has no head_dim"):
        hf.hf_config("wide-qwen2")


def _moe_hand_count(h, q, kv, head_dim, qk_norm, experts, expert_params, layers, vocab, read) -> Fraction:
    """Parameters a decode step reads: per layer q, k, v, o, the q/k norms, two norms, the
    router (one row per expert) and ``read`` of the ``experts`` experts; then the final norm and
    the LM head (never the input embedding)."""
    per_layer = q * h + 2 * kv * h + h * q + (2 * head_dim if qk_norm else 0) + 2 * h + experts * h
    return layers * (per_layer + Fraction(read) * expert_params) + h + vocab * h


def _full_size(name, read):
    if name == "qwen3-30b-a3b":
        return _moe_hand_count(2048, 4096, 512, 128, True, 128, 3 * 768 * 2048, 48, 151936, read)
    return _moe_hand_count(4096, 4096, 1024, 128, False, 8, 3 * 14336 * 4096, 32, 32000, read)


@pytest.mark.parametrize("name, b8", [("qwen3-30b-a3b", Fraction(1732076671, 33554432)),
                                      ("mixtral-8x7b", Fraction(58975, 8192))])
def test_expected_experts_by_hand(name, b8):
    """B = 1 reads k experts; B = 8: E * (1 - (1 - k/E)^8), worked out as fractions: Qwen3-30B-A3B
    128 * (1 - (15/16)^8) = 51.62 of 128, Mixtral 8 * (1 - (3/4)^8) = 7.20 of 8."""
    p = PRESETS[name]
    assert hf.expected_experts(p.experts, p.experts_per_token, 1) == pytest.approx(p.experts_per_token, abs=1e-12)
    assert hf.expected_experts(p.experts, p.experts_per_token, 8) == pytest.approx(float(b8), rel=1e-12)
    assert hf.expected_experts(p.experts, p.experts_per_token, 0) == 0
    assert hf.expected_experts(p.experts, p.experts_per_token, 10**6) == pytest.approx(p.experts)
    for bad in ((8, 0, 1), (8, 9, 1), (8, 2, -1)):
        with pytest.raises(ValueError, match="expected_experts"):
            hf.expected_experts(*bad)


@pytest.mark.parametrize("name, gb", [("qwen3-30b-a3b", (60.44, 6.08, 25.84)), ("mixtral-8x7b", (93.14, 25.50, 84.11))])
def test_full_size_floor_on_the_meta_device(name, gb):
    """The whole models, built without memory: every expert's bytes, and a decode step's at
    batch 1 and 8 under uniform routing, equal the hand count (bf16: 2 bytes a parameter)."""
    config = hf.hf_config(name)
    model = hf.build_model(config, torch.bfloat16, "meta")
    p = PRESETS[name]
    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (p.heads * p.head_dim, p.hidden)
    assert tuple(attn.o_proj.weight.shape) == (p.hidden, p.heads * p.head_dim)
    up, down = model.model.layers[0].mlp.experts.gate_up_proj, model.model.layers[0].mlp.experts.down_proj
    assert (tuple(up.shape), tuple(down.shape)) == ((p.experts, 2 * p.expert_intermediate, p.hidden),
                                                    (p.experts, p.hidden, p.expert_intermediate))
    assert hf.decode_weight_bytes(model) == 2 * _full_size(name, p.experts)
    run = E.Run(name, config, torch.device("meta"))
    for batch, want_gb in zip((1, 8), gb[1:]):
        read = Fraction(hf.expected_experts(p.experts, p.experts_per_token, batch))
        assert E.step_bytes(run, model, batch) == pytest.approx(float(2 * _full_size(name, read)), abs=1)
        assert E.step_bytes(run, model, batch) / 1e9 == pytest.approx(want_gb, abs=0.005)
    assert hf.decode_weight_bytes(model) / 1e9 == pytest.approx(gb[0], abs=0.005)
    assert "uniform routing" in hf.floor_assumption(config, 8)
    assert hf.floor_assumption(hf.hf_config("qwen3-8b"), 8) == ""  # dense: every weight once


# ----------------------------------------------------------------------------- the command line


def test_the_command_line_takes_the_moe_names(monkeypatch, capsys):
    assert E.parse_args(["--model", "Qwen3_30B_A3B", "--layers", "2"]).model == "qwen3-30b-a3b"
    assert E.parse_args(["--model", "MIXTRAL-8x7B"]).model == "mixtral-8x7b"
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(E, "main", lambda argv: seen.append(argv) or 0)
    assert bench_cli("bench", "--e2e", "--model", "qwen3-30b-a3b", "--layers", "4", "--batch", "1", "8") == 0
    assert seen[-1] == ["--model", "qwen3-30b-a3b", "--layers", "4", "--batch", "1", "8"]
    assert bench_cli("bench", "--e2e", "--model", "mixtral_8x7b", "--layers", "2") == 0
    assert seen[-1] == ["--model", "mixtral-8x7b", "--layers", "2"]
    assert bench_cli("bench", "--e2e", "--model", "mixtral-8x22b") == 2
    err = capsys.readouterr().err
    assert "unknown model 'mixtral-8x22b'" in err and "qwen3-30b-a3b, mixtral-8x7b" in err


def test_the_dense_mlp_benchmarks_refuse_the_moe_models(capsys):
    from hybridgemm.perf import bench_layer_fusion, bench_lora, tp_models

    assert not set(MOE) & set(tp_models.model_names())
    with pytest.raises(SystemExit):
        bench_lora.parse_args(["--model", "mixtral-8x7b"])
    with pytest.raises(SystemExit):
        bench_layer_fusion.parse_args(["--model", "qwen3-30b-a3b"])
    assert "a mixture of experts has no dense gate/up and down GEMMs" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tiny models of the same families


TINY = {  # hidden 64 < 4 heads x 32: head_dim set in both, as Qwen3-30B-A3B needs it
    "qwen3-30b-a3b": dict(hidden=64, heads=4, kv_heads=2, head_dim=32, experts=8, experts_per_token=3,
                          expert_intermediate=40),
    "mixtral-8x7b": dict(hidden=64, heads=4, kv_heads=2, head_dim=32, experts=4, experts_per_token=2,
                         expert_intermediate=48),
}


@pytest.fixture
def tiny(monkeypatch):
    """``tiny(name)``: registers ``tiny-<name>``, the preset and sizes of ``name`` at test sizes
    (its family and fixed fields kept), and returns its config from :func:`hf.hf_config`."""

    def make(name: str):
        key = f"tiny-{name}"
        monkeypatch.setitem(PRESETS, key, replace(PRESETS[name], name=key, vocab=VOCAB, layers=2, **TINY[name]))
        sizes = hf.SIZES[name]
        monkeypatch.setitem(hf.SIZES, key, replace(sizes, layers=2, vocab=VOCAB, max_positions=1024,
                                                   intermediate=sizes.intermediate and 80))
        return hf.hf_config(key)

    return make


def _tiny_bytes(name: str, read) -> float:
    """Bytes of a tiny model in a 16-bit dtype (see :func:`_moe_hand_count`)."""
    t = TINY[name]
    q, kv = t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    params = _moe_hand_count(t["hidden"], q, kv, t["head_dim"], name == "qwen3-30b-a3b", t["experts"],
                             3 * t["expert_intermediate"] * t["hidden"], 2, VOCAB, Fraction(read))
    return float(2 * params)


def _patched_copy(config, stock, dtype):
    model = hf.build_model(config, dtype, "cpu")
    model.load_state_dict(stock.state_dict())
    return model, hybridgemm.patch(model)


@pytest.mark.parametrize("name", MOE)
def test_tiny_moe_patch_report_and_stock_logits(name, tiny):
    """``patch`` fuses Q/K/V (and the q/k norms, norms, LM head), swaps the stacked experts for
    :class:`HybridExperts`, fuses the decoder layers (the decode step calls the sparse block),
    and swaps the routers for :class:`HybridTopKRouter`, leaving nothing unpatched; the patched
    model's logits, of a whole forward and of a static-cache decode, are the stock model's."""
    config = tiny(name)
    torch.manual_seed(0)
    stock = hf.build_model(config, torch.float32, "cpu")
    with torch.no_grad():
        for pname, p in stock.named_parameters():
            if "experts" in pname:
                p.normal_(0, 0.1)  # large enough for the experts to matter in the logits
    model, report = _patched_copy(config, stock, torch.float32)
    layers = [f"model.layers.{i}" for i in range(2)]
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if name == "qwen3-30b-a3b" else "MixtralForCausalLM")
    assert report.fused_qkv == [f"{n}.self_attn" for n in layers]
    assert all(type(model.get_submodule(f"{n}.mlp.experts")) is HybridExperts for n in layers)
    assert all(f"{n}.mlp.experts" in report.patched for n in layers)
    assert "lm_head" in report.patched and "model.norm" in report.patched
    assert (name == "qwen3-30b-a3b") == all(f"{n}.self_attn.q_norm" in report.patched for n in layers)
    assert report.fused_mlp == report.fp8 == [] and report.fused_layers == report.fused_attention == layers
    assert report.skipped == []
    assert all(type(model.get_submodule(f"{n}.mlp.gate")) is HybridTopKRouter for n in layers)
    ids = E.tokens(2, 12, VOCAB, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(hf.full_logits(model, ids), hf.full_logits(stock, ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hf.decode_logits(model, ids, 5), hf.decode_logits(stock, ids, 5),
                                   rtol=1e-5, atol=1e-5)
    hybridgemm.unpatch(model)
    sd, ref = model.state_dict(), stock.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


def test_experts_of_another_form_fail_the_patched_variant(tiny):
    """Experts that patch could not take (a form it reports) make their layer (not fused) count
    as left unpatched: the bench then fails the patched variant as strict=True would."""
    config = tiny("mixtral-8x7b")
    model = hf.build_model(config, torch.float32, "cpu")
    model.model.layers[0].mlp.experts.has_bias = True
    report = hybridgemm.patch(model)
    names = [n for n, _ in report.skipped]
    assert "model.layers.0.mlp.experts" in names
    assert "model.layers.0" in names and "model.layers.1" not in names
    assert not E.attention_skips(report)


def test_decode_weight_bytes_counts_the_experts_it_is_told(tiny):
    config = tiny("qwen3-30b-a3b")
    model = hf.build_model(config, torch.bfloat16, "cpu")
    assert hf.decode_weight_bytes(model) == _tiny_bytes("qwen3-30b-a3b", 8)
    assert hf.decode_weight_bytes(model, 3) == _tiny_bytes("qwen3-30b-a3b", 3)
    assert hf.decode_weight_bytes(model, 20) == hf.decode_weight_bytes(model)  # at most every expert
    assert hf.decode_weight_bytes(model, 2.5) == round(_tiny_bytes("qwen3-30b-a3b", 2.5))
    seen = []
    per_layer = hf.decode_weight_bytes(model, lambda name, e: seen.append((name, e)) or (1 if "0" in name else 5))
    assert seen == [("model.layers.0.mlp.experts", 8), ("model.layers.1.mlp.experts", 8)]
    assert per_layer == (_tiny_bytes("qwen3-30b-a3b", 1) + _tiny_bytes("qwen3-30b-a3b", 5)) / 2
    with pytest.raises(ValueError, match="experts read"):
        hf.decode_weight_bytes(model, -1)


@pytest.mark.parametrize("name", MOE)
def test_tiny_moe_runs_every_mode_end_to_end(name, tiny, monkeypatch):
    """A whole run (every mode, both variants) of a tiny model of the family: no errors, the
    floor of each decode row the hand count at its batch's expected experts, stated in
    ``floor_assumes``. The experts run their CPU loop, but under torch.compile (which does not
    trace the loop as one graph) their grouped kernels as on CUDA (Triton interpreter). In fp16:
    the interpreter's bf16 results of these kernels are not usable (the bf16 kernels are checked
    on the GPU, tests/fusion/test_moe_gpu.py)."""
    config = tiny(name)
    monkeypatch.setattr(hexperts, "use_kernels", lambda x: torch.compiler.is_compiling())
    lines = []
    run = E.Run(f"tiny-{name}", config, torch.device("cpu"), batches=(1, 2), tokens=2, prefill=8, rounds=1,
                dtype=torch.float16, compile_options={"backend": "eager", "fullgraph": True},
                extra={"gpu": "cpu", "command": "test"}, log=lines.append)
    torch.manual_seed(0)
    res = E.run_e2e(run)
    assert not res.errors, [(r["mode"], r["batch"], r["variant"], r.get("note")) for r in res.errors]
    assert res.unpatch_exact is True
    t = TINY[name]
    for r in res.rows:
        assert set(r) <= set(E.COLUMNS), set(r) - set(E.COLUMNS)
        if r["mode"] in E.ERROR_MODES:
            assert 0 < r["logits_rel_err"] < 0.05
            if r["variant"] != "stock":
                assert r["error_ratio"] < 1.5
            continue
        tokens = 8 if r["mode"] == "prefill" else r["batch"]
        read = hf.expected_experts(t["experts"], t["experts_per_token"], tokens)
        assert r["weight_bytes"] == r["variant_bytes"] == round(_tiny_bytes(name, read))
        assert r["floor_assumes"] == (f"uniform routing: {read:.2f} of {t['experts']} experts per layer read for "
                                      f"{tokens} tokens, E*(1-(1-k/E)^B) with k={t['experts_per_token']}")
        if r["mode"] == "prefill":
            assert "hbm_floor_ms" not in r
        else:
            assert r["hbm_floor_ms"] == pytest.approx(E.hbm_floor_ms(round(_tiny_bytes(name, read))))
            assert math.isfinite(r["fraction_of_floor"])
    assert not any("left unpatched" in line or "patch failed" in line for line in lines)
    assert any(line.startswith("batch 2:") and "uniform routing" in line for line in lines)


@pytest.mark.parametrize("name", MOE)
def test_tiny_moe_runs_with_fp8_experts(name, tiny, monkeypatch):
    """An FP8 run (``--weights fp8``) of a tiny model of the family: ``patch`` quantizes the
    experts too (listed in ``report.fp8``), a step's bytes count the e4m3 experts it reaches with
    their fp32 scales (by hand), and the logits err against the fp32 model of the dequantized
    weights (its experts included) no more than the dequantized fp16 model does."""
    from hybridgemm.fp8_experts import HybridFP8Experts
    from hybridgemm.perf import e2e_weights

    config = tiny(name)
    monkeypatch.setattr(e2e_weights, "torchao_version", lambda: None)
    monkeypatch.setattr(hexperts, "use_kernels", lambda x: torch.compiler.is_compiling())
    run = E.Run(f"tiny-{name}", config, torch.device("cpu"), batches=(1,), tokens=2, prefill=8, rounds=1,
                modes=("eager_static", "compiled_static", *E.ERROR_MODES), dtype=torch.float16,
                compile_options={"backend": "eager", "fullgraph": True}, extra={"gpu": "cpu", "command": "test"},
                granularity="channel")
    torch.manual_seed(0)
    res = E.run_e2e(run)
    assert not res.errors, [(r["mode"], r["batch"], r["variant"], r.get("note")) for r in res.errors]
    t = TINY[name]
    e, i, h = t["experts"], t["expert_intermediate"], t["hidden"]
    model = hf.build_model(config, torch.float16, "cpu")
    report = hybridgemm.patch(model, weights="fp8", granularity="channel")
    mods = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert len(mods) == 2 and all(type(m) is HybridFP8Experts for m in mods)
    assert {n for n in report.fp8 if n.endswith("experts")} == {f"model.layers.{j}.mlp.experts" for j in (0, 1)}
    per_expert = 3 * i * h + 4 * (2 * i + h)  # e4m3 data, fp32 scales per row
    read = hf.expected_experts(e, t["experts_per_token"], 1)
    assert hf.decode_weight_bytes(model, read) - hf.decode_weight_bytes(model, 0) == round(2 * read * per_expert)
    dequantized = dict(e2e_weights.dequantized_weights(model, report.fp8, torch.float32))
    for j in (0, 1):  # the reference's experts are the e4m3 ones times their row scales, at the stock names
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{j}.mlp.experts.{proj}"
            state = model.state_dict()
            by_hand = state[key].float() * state[key + "_scale_inv"][..., None]
            assert torch.equal(dequantized[key], by_hand)
    rows = {(r["mode"], r["variant"]): r for r in res.rows}
    for mode in E.ERROR_MODES:
        patched = rows[(mode, run.patched_variant)]
        assert 0 < patched["logits_rel_err"] < 0.05 and patched["error_ratio"] < 1.5
        assert patched["logits_rel_err_vs_bf16"] > 3 * patched["logits_rel_err"]  # the quantization shows there
    step = rows[("compiled_static", run.patched_variant)]
    assert step["variant_bytes"] < step["weight_bytes"]
