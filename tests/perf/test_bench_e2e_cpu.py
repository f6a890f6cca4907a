"""The end-to-end benchmark (perf/bench_e2e.py) without a GPU: argument checks and exit codes,
the wiring of ``hybridgemm bench --e2e``, the model sizes, the HBM floor counted by hand, and
a whole run of a tiny Llama on the CPU (every mode, rows, CSV, summary, figure), the compiled
mode traced with ``backend="eager"``."""

from __future__ import annotations

import io
import math

import pytest
import torch

import hybridgemm
from helpers import bench_cli
from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf.csvio import command_as_run, read_rows
from hybridgemm.perf.timing import HBM_TBPS

transformers = pytest.importorskip("transformers")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIMED = [(m, b) for m in E.DECODE_MODES for b in (1, 2)] + [("prefill", 1)]


def tiny_config(**kw):
    args = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=200, max_position_embeddings=1024, tie_word_embeddings=False)
    return transformers.LlamaConfig(**{**args, **kw})


def tiny_run(**kw) -> E.Run:
    args = dict(batches=(1, 2), tokens=3, prefill=16, rounds=2, compile_options={"backend": "eager", "fullgraph": True},
                extra={"gpu": "cpu", "command": "test"})
    return E.Run("tiny", tiny_config(), torch.device("cpu"), **{**args, **kw})


# ----------------------------------------------------------------------------- arguments


def test_parse_defaults_and_model_names():
    args = E.parse_args(["--model", "Llama3_8B"])
    assert args.model == "llama3-8b"
    assert (args.layers, args.batch, args.prefill, args.tokens, args.modes, args.out) == (None,) * 6
    args = E.parse_args(["--model", "qwen2.5-7b", "--layers", "4", "--batch", "1", "8", "--tokens", "2",
                         "--modes", "prefill", "eager_static"])
    assert (args.layers, args.batch, args.tokens, args.modes) == (4, [1, 8], 2, ["prefill", "eager_static"])


@pytest.mark.parametrize("argv, words", [
    (["--model", "llama3-8b", "--layers", "0"], "--layers: must be positive, got 0"),
    (["--model", "llama3-8b", "--layers", "-3"], "--layers: must be positive"),
    (["--model", "llama3-8b", "--layers", "two"], "--layers: expected a positive integer"),
    (["--model", "llama3-8b", "--batch", "1", "0"], "--batch: must be positive"),
    (["--model", "llama3-8b", "--tokens", "0"], "--tokens: must be positive"),
    (["--model", "llama3-8b", "--tokens", "1"], "--tokens: must be at least 2"),
    (["--model", "llama3-8b", "--prefill", "0"], "--prefill: must be positive"),
    (["--model", "llama3-8b", "--rounds", "0"], "--rounds: must be positive"),
    (["--model", "llama3-8b", "--modes", "turbo"], "--modes: invalid choice"),
    (["--model", "gpt2"], "unknown model 'gpt2'; known: qwen2.5-7b, llama3-8b"),
    ([], "--model"),
])
def test_bad_arguments_exit_2_with_the_reason(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        E.parse_args(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_main_without_gpu_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert E.main(["--model", "llama3-8b"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_bench_e2e_cli_errors(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench_cli("bench", "--e2e", "--model", "llama3-8b", "--layers", "0")
    assert exc.value.code == 2 and "--layers: must be positive" in capsys.readouterr().err
    for argv, words in ((["--model", "gpt-9"], "unknown model 'gpt-9'; known: qwen2.5-7b, llama3-8b"),
                        ([], "give one --model"),
                        (["--model", "llama3-8b", "--model", "qwen2.5-7b"], "give one --model"),
                        (["--model", "llama3-8b", "--shape", "64,32"], "--shape"),
                        (["--model", "llama3-8b"], "hybridgemm bench --e2e: needs a CUDA GPU")):
        assert bench_cli("bench", "--e2e", *argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert bench_cli("bench", "--model", "llama3-8b", "--layers", "2", "--tokens", "8") == 2
    assert "--layers, --tokens: only with --e2e" in capsys.readouterr().err


def test_bench_e2e_passes_its_options_on(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(E, "main", lambda argv: seen.append(argv) or 0)
    assert bench_cli("bench", "--e2e", "--model", "LLAMA3-8B", "--layers", "8", "--batch", "1", "4", "--tokens", "16",
                     "--modes", "prefill", "--no-progress") == 0
    assert seen[-1] == ["--model", "llama3-8b", "--layers", "8", "--batch", "1", "4", "--tokens", "16", "--modes",
                        "prefill", "--no-progress"]  # bench's default --out is not passed on
    assert bench_cli("bench", "--e2e", "--model", "qwen2.5-7b", "--out", "r/e2e.csv", "--plot", "figs") == 0
    assert seen[-1] == ["--model", "qwen2.5-7b", "--out", "r/e2e.csv", "--plot", "figs"]


# ----------------------------------------------------------------------------- sizes, HBM floor


@pytest.mark.parametrize("name, sizes", [
    ("qwen2.5-7b", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                        intermediate_size=18944, vocab_size=152064), ),
    ("llama3-8b", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256)),
])
def test_configs_have_the_published_sizes(name, sizes):
    config = hf.hf_config(name)
    assert {k: getattr(config, k) for k in sizes} == sizes
    assert config.tie_word_embeddings is False
    assert hf.rope_theta(config) == {"qwen2.5-7b": 1e6, "llama3-8b": 5e5}[name]
    assert hf.hf_config(name, layers=3).num_hidden_layers == 3


@pytest.mark.parametrize("name, sizes", [
    ("falcon-7b", dict(hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
                       parallel_attn=True, new_decoder_architecture=False, bias=False, ffn_hidden_size=18176,
                       vocab_size=65024)),
    ("pythia-6.9b", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, use_parallel_residual=True,
                         attention_bias=True, intermediate_size=16384, vocab_size=50432)),
])
def test_layernorm_family_configs_have_the_published_sizes_and_are_fused(name, sizes):
    """Falcon-7B's (multi-query: one KV head) and Pythia-6.9B's configs as published, built on the
    meta device and patched: every layer takes the fused step where this transformers' forms allow
    (Falcon's: 5.25's), else the report says why."""
    config = hf.hf_config(name, layers=2)
    assert {k: getattr(config, k) for k in sizes} == {**sizes, "num_hidden_layers": 2}
    report = hybridgemm.patch(hf.build_model(config, torch.bfloat16, "meta"))
    unfused = [(n, why) for n, why in report.skipped if why.startswith("decoder layer not fused")]
    if unfused:  # (a transformers whose Falcon layer is an older form)
        assert name == "falcon-7b" and report.fused_layers == [] and len(unfused) == 2
        assert all("is not a decoder layer this step computes" in why for _, why in unfused)
    else:
        assert len(report.fused_layers) == 2 and report.fused_attention == report.fused_layers


@pytest.mark.parametrize("name, sizes", [
    ("olmo3-7b", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                      vocab_size=100278, sliding_window=4096)),
    ("ministral-8b", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          intermediate_size=12288, vocab_size=131072, sliding_window=32768)),
    ("phi4-mini", dict(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
                       vocab_size=200064)),
    ("smollm3-3b", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, intermediate_size=11008,
                        vocab_size=128256, no_rope_layers=[1, 1, 1, 0])),
    ("ministral3-8b", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           intermediate_size=14336, vocab_size=131072)),
    ("glm4-9b", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                     intermediate_size=13696, vocab_size=151552, attention_bias=True)),
    ("glm4-9b-0414", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                          intermediate_size=13696, vocab_size=151552, attention_bias=True)),
    ("ernie4.5-0.3b", dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                           intermediate_size=3072, vocab_size=103424, use_bias=False)),
])
def test_sliding_window_and_partial_rotary_presets_are_fused(name, sizes):
    """OLMo 3's and Ministral's (sliding-window layers: OLMo 3's three to one full, Ministral's all),
    Phi-4-mini's (the rotary over 96 of each head's 128 columns), SmolLM3's (every fourth layer
    without positional embedding), Ministral 3's (YaRN, queries scaled per position), GLM-4-9B's,
    both forms (neighbouring columns paired over the first half of each head; 0414's norms around
    each sublayer) and Ernie 4.5's (the same pairs over whole heads, in fp32) configs as published,
    built on the meta device and patched: every layer fused and its attention on the static-cache step."""
    config = hf.hf_config(name, layers=4)
    assert {k: getattr(config, k) for k in sizes} == sizes and config.num_hidden_layers == 4
    layer_types = getattr(config, "layer_types", None) or []
    assert layer_types == {"olmo3-7b": ["sliding_attention"] * 3 + ["full_attention"],
                           "ministral-8b": ["sliding_attention"] * 4, "phi4-mini": [],
                           "smollm3-3b": ["full_attention"] * 4}.get(name, [])
    if name == "phi4-mini":
        assert config.rope_parameters["partial_rotary_factor"] == 0.75
    if name.startswith("glm4-9b"):
        assert config.rope_parameters["partial_rotary_factor"] == 0.5
    if name == "ministral3-8b":
        rope = config.rope_parameters
        assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"],
                rope["llama_4_scaling_beta"]) == ("yarn", 16.0, 16384, 0.1)
    report = hybridgemm.patch(hf.build_model(config, torch.bfloat16, "meta"))
    assert len(report.fused_layers) == 4 and report.fused_attention == report.fused_layers
    assert report.skipped == []


@pytest.mark.parametrize("name, floor_ms", [("qwen2.5-7b", 3.34), ("llama3-8b", 3.55)])
def test_full_size_floor_on_the_meta_device(name, floor_ms):
    """The whole models, built without memory: the bytes a decode step reads give the floors
    quoted in issue 16 (3.34 and 3.55 ms at 4.23 TB/s); Qwen's q/k/v carry biases, Llama's not."""
    model = hf.build_model(hf.hf_config(name), torch.bfloat16, "meta")
    assert E.hbm_floor_ms(hf.decode_weight_bytes(model)) == pytest.approx(floor_ms, abs=0.005)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == (name == "qwen2.5-7b", False)


def _hand_count(h=64, kv=32, inter=96, vocab=200, layers=2) -> int:
    per_layer = h * h + 2 * (kv * h) + h * h + 3 * inter * h + 2 * h  # q, k+v, o, gate+up+down, two norms
    return layers * per_layer + h + vocab * h  # final norm, LM head; never the input embedding


def test_weight_bytes_and_floor_counted_by_hand():
    model = hf.build_model(tiny_config(), torch.bfloat16, "cpu")
    assert hf.decode_weight_bytes(model) == 2 * _hand_count() == 149120
    assert E.hbm_floor_ms(149120) == pytest.approx(149120 / (HBM_TBPS * 1e12) * 1e3)
    fp32 = hf.build_model(tiny_config(), torch.float32, "cpu")
    assert hf.decode_weight_bytes(fp32) == 4 * _hand_count()
    assert fp32.model.rotary_emb.inv_freq.dtype == model.model.rotary_emb.inv_freq.dtype == torch.float32
    tied = hf.build_model(tiny_config(tie_word_embeddings=True), torch.bfloat16, "cpu")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert hf.decode_weight_bytes(tied) == 2 * _hand_count()  # the head streams the shared table: counted once


def test_decode_logits_are_the_forwards_logits_step_by_step():
    """Teacher-forced static-cache decode computes, step by step, the logits one forward of
    the whole sequence computes at the same positions (fp32, so only summation order differs)."""
    torch.manual_seed(3)
    model = hf.build_model(tiny_config(), torch.float32, "cpu")
    ids = E.tokens(2, 19, 200, "cpu")
    with torch.no_grad():
        steps = hf.decode_logits(model, ids, 7)
        whole = hf.full_logits(model, ids).float()
    assert steps.shape == (2, 12, 200) and steps.dtype == torch.float32
    torch.testing.assert_close(steps, whole[:, 6:18], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(steps[:, 1:], whole[:, 6:17], rtol=1e-2, atol=1e-2), "the positions are shifted"
    for bad in (0, 19):
        with pytest.raises(ValueError, match="prompt_len"):
            hf.decode_logits(model, ids, bad)


# ----------------------------------------------------------------------------- a whole run on the CPU


@pytest.fixture(scope="module")
def smoke():
    torch.manual_seed(0)
    lines = []
    res = E.run_e2e(tiny_run(log=lines.append))
    return res, lines


def test_run_times_every_mode_for_both_variants(smoke):
    res, lines = smoke
    assert not res.errors, res.errors
    got = {(r["mode"], r["batch"], r["variant"]) for r in res.rows}
    errors = {("logits_error", 2, v) for v in E.VARIANTS} | {("decode_error", 2, v) for v in E.VARIANTS}
    assert got == {(m, b, v) for m, b in TIMED for v in E.VARIANTS} | errors
    floor = E.hbm_floor_ms(2 * _hand_count())
    for r in res.rows:
        assert set(r) <= set(E.COLUMNS), set(r) - set(E.COLUMNS)
        assert (r["gpu"], r["model"], r["layers"], r["status"]) == ("cpu", "tiny", 2, "ok")
        if r["mode"] == "logits_error":
            assert 0 < r["logits_rel_err"] < 0.05 and r["prompt_len"] == E.LOGITS_SHAPE[1]
            continue
        if r["mode"] == "decode_error":
            assert 0 < r["logits_rel_err"] < 0.05 and r["prompt_len"] == E.DECODE_PROMPT
            assert r["tokens"] == E.DECODE_SHAPE[1] - E.DECODE_PROMPT
            continue
        ms = r["ms_per_token"]
        assert math.isfinite(ms) and ms > 0 and r["samples"] >= r["rounds"] == 2
        per_run = 16 if r["mode"] == "prefill" else r["batch"]
        assert r["tokens_per_s"] == pytest.approx(per_run * 1e3 / ms)
        stock = next(s for s in res.rows if (s["mode"], s["batch"], s["variant"]) == (r["mode"], r["batch"], "stock"))
        assert r["speedup"] == pytest.approx(stock["ms_per_token"] / ms)
        if r["mode"] == "prefill":
            assert "hbm_floor_ms" not in r and r["tokens"] == 16
        else:
            assert r["hbm_floor_ms"] == pytest.approx(floor) and r["fraction_of_floor"] == pytest.approx(floor / ms)
            assert (r["tokens"], r["prompt_len"]) == (3, E.PROMPT_LEN)
    assert res.unpatch_exact is True
    assert any("patched" in line for line in lines) and any(line.startswith("[7/7] prefill") for line in lines)


def test_csv_upsert_summary_and_figure(smoke, tmp_path):
    res, _ = smoke
    path = tmp_path / "e2e.csv"
    other = [{**r, "model": "other"} for r in res.rows[:2]]
    E.upsert(path, other)
    E.upsert(path, res.rows)
    E.upsert(path, res.rows)  # measured again: replaces, never duplicates
    rows = read_rows(str(path))
    assert list(rows[0]) == list(E.COLUMNS)
    assert len(rows) == len(res.rows) + 2 and sum(r["model"] == "other" for r in rows) == 2
    out = io.StringIO()
    from rich.console import Console

    E.print_summary(res, Console(file=out, width=160))
    text = out.getvalue()
    assert all(m in text for m in ("eager_generate", "eager_static", "compiled_static", "prefill"))
    assert "logits error vs fp32, hybridgemm" in text

    from hybridgemm.perf.plots import make_all_plots
    from hybridgemm.perf.plots_models import plot_e2e

    png = plot_e2e(path, tmp_path / "figs")
    assert png.name == "e2e.png" and png.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in make_all_plots([str(path)], tmp_path / "again", log=lambda s: None)] == ["e2e.png"]


def test_a_failing_mode_is_recorded_and_the_run_goes_on(monkeypatch):
    real = E.make_round

    def flaky(run, mode, model, batch, clock):
        patched = any(n.endswith("qkv_proj") for n, _ in model.named_modules())
        if patched and mode == "eager_static":
            raise RuntimeError("boom in setup")
        rnd = real(run, mode, model, batch, clock)
        if patched and mode == "prefill":
            def broken():
                raise RuntimeError("boom in a round")
            return broken
        return rnd

    monkeypatch.setattr(E, "make_round", flaky)
    res = E.run_e2e(tiny_run(batches=(1,), tokens=2, rounds=1, modes=("eager_static", "prefill", "eager_generate")))
    status = {(r["mode"], r["variant"]): (r["status"], r.get("note", "")) for r in res.rows}
    assert status[("eager_static", "hybridgemm")] == ("error", "RuntimeError: boom in setup")
    assert status[("prefill", "hybridgemm")] == ("error", "RuntimeError: boom in a round")
    assert {k for k, (s, _) in status.items() if s == "ok"} == {
        ("eager_static", "stock"), ("prefill", "stock"), ("eager_generate", "stock"), ("eager_generate", "hybridgemm")}
    assert len(res.errors) == 2


def test_main_writes_the_csv_and_exits_1_on_an_error(monkeypatch, tmp_path, capsys):
    """main() around run_e2e: the --out folder gets e2e_<gpu>.csv, the summary is printed and
    an errored row makes the exit code 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    seen = {}

    def fake_run(run, on_rows=None):
        seen["run"] = run
        rows = E.mode_rows(run, "prefill", 1, {"stock": [2.0, 3.0, 4.0], "hybridgemm": ValueError("bad")}, 1000)
        on_rows(rows)
        return E.Result(rows, unpatch_exact=True)

    monkeypatch.setattr(E, "run_e2e", fake_run)
    assert E.main(["--model", "llama3-8b", "--layers", "2", "--out", str(tmp_path), "--no-progress"]) == 1
    run = seen["run"]
    assert (run.config.num_hidden_layers, run.batches, run.tokens, run.prefill, run.modes) == (
        2, E.BATCHES, E.TOKENS, E.PREFILL, E.MODES)
    rows = read_rows(str(tmp_path / "e2e_h200.csv"))
    assert [(r["variant"], r["status"]) for r in rows] == [("stock", "ok"), ("hybridgemm", "error")]
    assert rows[0]["ms_per_token"] == "3.0" and rows[1]["note"] == "ValueError: bad"
    assert rows[0]["command"].startswith(
        command_as_run("hybridgemm bench --e2e --model llama3-8b --layers 2 --batch 1 8"))
    assert rows[0]["gpu"] == "NVIDIA H200" and rows[0]["transformers"] == transformers.__version__ and rows[0]["date"]
    out = capsys.readouterr()
    assert "prefill" in out.out and "errors in prefill B=1 hybridgemm" in out.err


def test_token_clock_times_the_gaps_between_new_tokens_only(monkeypatch):
    from hybridgemm.perf import e2e_models

    ticks = iter([10.0, 10.5, 10.75, 11.5])
    monkeypatch.setattr(e2e_models.time, "perf_counter", lambda: next(ticks))
    clock = e2e_models.TokenClock()
    clock.put("prompt")  # not stamped: the prompt is streamed before any forward
    with pytest.raises(ValueError, match="at least 2"):
        clock.ms_per_step()
    for _ in range(4):
        clock.put("token")
    clock.end()
    assert clock.ms_per_step() == pytest.approx(1500.0 / 3)


def test_a_layer_whose_attention_runs_the_module_function_is_measured_as_patched(monkeypatch):
    """Gemma 3's two sliding-window layers under a transformers whose sliding cache layer is not
    the checked one (window_cache's source forms made to differ): every layer is fused and
    reports that its attention runs the module's function (report.skipped); the bench measures
    that model and logs them. Only entries of fused layers count so (anything else still fails
    the patched variant)."""
    from hybridgemm.models import window_cache

    monkeypatch.setattr(window_cache, "_loaded", [])
    monkeypatch.setattr(window_cache, "_SLIDING_UPDATE", ("self.some_other_statement()",))
    config = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=200,
                                           sliding_window=8, max_position_embeddings=1024)
    patched, logged, _ = _patched_variant(config)
    assert isinstance(patched, torch.nn.Module)
    line = next(s for s in logged if "fused decoder layers run their attention module's function" in s)
    assert line.startswith("2 fused decoder layers") and "sliding-window layer" in line
    report = type("Report", (), {"fused_layers": ["model.layers.0"], "skipped": [
        ("model.layers.0", "attention step not fused: why"), ("model.layers.1", "attention step not fused: why"),
        ("model.layers.0.mlp", "linear not patched: why")]})()
    assert E.attention_skips(report) == [("model.layers.0", "attention step not fused: why")]


@pytest.mark.parametrize("kind", ["StableLmConfig", "CohereConfig"])
def test_norms_a_fused_layer_calls_as_modules_keep_the_patched_variant(kind):
    """StableLM's and Cohere's LayerNorms are listed in report.skipped (no GEMM prologue takes
    them) but their fused layers call them: the patched variant is built and the log says so;
    any other skipped module still fails it."""
    config = getattr(transformers, kind)(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=200,
                                         max_position_embeddings=64)
    patched, logged, stock = _patched_variant(config)
    assert isinstance(patched, torch.nn.Module), logged
    norms = 2 if kind == "CohereConfig" else 4  # Cohere's layer has one norm, StableLM's sequential one two
    assert f"{norms} norms of fused decoder layers run as their modules" in "\n".join(logged)
    model = hf.build_model(config, torch.float32, "cpu")
    report = hybridgemm.patch(model)
    exempt = E.norm_module_skips(report, model)
    assert len(exempt) == norms and all(n.endswith("layernorm") for n, _ in exempt)
    report.skipped.append(("model.layers.0.extra_norm", "something else"))  # not one of those norms: not exempt
    assert E.norm_module_skips(report, model) == exempt
    unfused = hybridgemm.patch(hf.build_model(config, torch.float32, "cpu"), layers=False)
    assert unfused.skipped and not E.norm_module_skips(unfused, stock)  # no fused layers: nothing exempt


def _patched_variant(config):
    """The bench's patched variant of a tiny CPU model of ``config``: (the model or the exception,
    the lines logged, the stock model)."""
    logged = []
    run = E.Run("tiny", config, torch.device("cpu"), batches=(1,), tokens=2, prefill=8, rounds=1,
                extra={"gpu": "cpu", "command": "test"})
    run.log = logged.append
    stock = hf.build_model(config, torch.float32, "cpu")
    return E._patched(run, stock)[0], logged, stock


def test_decode_rows_carry_the_read_rate_their_floors_divide_by(monkeypatch):
    # the floor is the step's bytes over the read rate the row names (read_ceiling.device_read_tbps)
    for tbps in ("4.23", "2.5"):
        monkeypatch.setenv("HYBRIDGEMM_READ_TBPS", tbps)
        rows = E.mode_rows(tiny_run(), "eager_static", 1, {"stock": [2.0], "hybridgemm": [1.0]}, 10**9)
        for r in rows:
            assert r["read_tbps"] == float(tbps)
            assert r["hbm_floor_ms"] == pytest.approx(1e9 / (float(tbps) * 1e12) * 1e3)
        assert rows[1]["fraction_of_floor"] == pytest.approx(rows[1]["hbm_floor_ms"] / 1.0)


def test_the_floor_line_is_labelled_with_its_rows_rate(tmp_path, monkeypatch):
    # a panel whose rows divided by two rates: the line at the lower floor, labelled with that row's rate
    import matplotlib.axes

    from hybridgemm.perf import csvio, plots_models

    rows = []
    for variant, ms, floor, rate in (("stock", 3.0, 2.0, "3.30"), ("hybridgemm", 2.5, 1.5, "4.40")):
        rows.append({"gpu": "NVIDIA H100", "model": "m", "layers": "2", "mode": "compiled_static", "batch": "1",
                     "variant": variant, "status": "ok", "ms_per_token": ms, "hbm_floor_ms": floor,
                     "read_tbps": rate, "run_weights": ""})
    path = tmp_path / "e2e.csv"
    csvio.write_csv(path, list(rows[0]), rows)
    labels = []
    orig = matplotlib.axes.Axes.axhline

    def spy(self, y=0, *a, **kw):
        labels.append((y, kw.get("label")))
        return orig(self, y, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", spy)
    plots_models.plot_e2e(str(path), str(tmp_path / "fig"), "e2e.png")
    assert (1.5, "HBM floor: weights / 4.40 TB/s") in labels
