"""The end-to-end benchmark's FP8 runs (perf/bench_e2e.py ``--weights fp8``, perf/e2e_weights.py)
without a GPU: the options and their checks, the bytes of an FP8-patched model counted by hand,
the dequantized reference models, a whole FP8 run of a tiny Llama on the CPU (rows, floors,
errors, CSV), and the torchao peers: absent (one log line, no rows), faked (what they are
given), and real where torchao is installed."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from torch import nn

import hybridgemm
from helpers import bench_cli
from hybridgemm.fp8_modules import weight_scale_of
from hybridgemm.kernels import fp8
from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf import e2e_weights as ew
from hybridgemm.perf.csvio import read_rows
from hybridgemm.perf.timing import HBM_TBPS

transformers = pytest.importorskip("transformers")

H, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 384, 4, 2, 200, 2  # every K > 128: block scales are 2-D
KV = H // HEADS * KV_HEADS


def tiny_config():
    return transformers.LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                    max_position_embeddings=1024, tie_word_embeddings=False)


def tiny_run(**kw) -> E.Run:
    args = dict(batches=(1,), tokens=2, prefill=8, rounds=1, compile_options={"backend": "eager", "fullgraph": True},
                extra={"gpu": "cpu", "command": "test"}, granularity="channel")
    return E.Run("tiny", tiny_config(), torch.device("cpu"), **{**args, **kw})


def _scales(n: int, k: int, granularity: str) -> int:
    return n if granularity == "channel" else -(-n // 128) * -(-k // 128)


def fp8_hand_count(granularity: str, lm_head: bool = False) -> int:
    """Bytes a decode step of the FP8-patched tiny model reads: per layer the fused QKV, O, fused
    gate/up and down weights in e4m3 (one byte each) with 4-byte scales, two bf16 norms; the
    final norm; the LM head (bf16, or e4m3 with its scales); never the input embedding."""
    projections = [(H + 2 * KV, H), (H, H), (2 * INTER, H), (H, INTER)]
    per_layer = sum(n * k + 4 * _scales(n, k, granularity) for n, k in projections) + 2 * 2 * H
    head = VOCAB * H + 4 * _scales(VOCAB, H, granularity) if lm_head else 2 * VOCAB * H
    return LAYERS * per_layer + 2 * H + head


def bf16_hand_count() -> int:
    per_layer = 2 * (H * H + 2 * KV * H + H * H + 3 * INTER * H + 2 * H)
    return LAYERS * per_layer + 2 * H + 2 * VOCAB * H


def patched_fp8(granularity: str, lm_head: bool = False):
    torch.manual_seed(1)
    stock = hf.build_model(tiny_config(), torch.bfloat16, "cpu")
    model = hf.build_model(tiny_config(), torch.bfloat16, "cpu")
    model.load_state_dict(stock.state_dict())
    report = hybridgemm.patch(model, weights="fp8", granularity=granularity, quantize_lm_head=lm_head)
    return stock, model, report


# ----------------------------------------------------------------------------- options


def test_fp8_options_parse_and_default():
    args = E.parse_args(["--model", "llama3-8b"])
    assert (args.weights, args.granularity, args.quantize_lm_head, args.no_peers) == ("bf16", None, False, False)
    args = E.parse_args(["--model", "llama3-8b", "--weights", "fp8"])
    assert (args.weights, args.granularity) == ("fp8", "channel")
    args = E.parse_args(["--model", "llama3-8b", "--weights", "fp8", "--granularity", "block128", "--quantize-lm-head",
                         "--no-peers"])
    assert (args.weights, args.granularity, args.quantize_lm_head, args.no_peers) == ("fp8", "block128", True, True)
    args.layers, args.batch, args.prefill, args.tokens, args.modes, args.rounds = 2, (1,), 16, 4, ("prefill",), 1
    assert E.command_line(args).endswith("--rounds 1 --weights fp8 --granularity block128 --quantize-lm-head "
                                         "--no-peers")
    args = E.parse_args(["--model", "llama3-8b", "--weights", "fp8", "--fp8-activations"])
    assert args.fp8_activations is True and E.parse_args(["--model", "llama3-8b"]).fp8_activations is False
    args.layers, args.batch, args.prefill, args.tokens, args.modes, args.rounds = 2, (1,), 16, 4, ("prefill",), 1
    assert E.command_line(args).endswith("--weights fp8 --granularity channel --fp8-activations")


def test_the_command_line_names_the_prompt_length_only_where_the_prefill_mode_ran():
    args = E.parse_args(["--model", "llama3-8b"])
    args.layers, args.batch, args.prefill, args.tokens, args.rounds = 2, (1,), 512, 4, 1
    args.modes = ("compiled_static", "prefill")
    assert " --prefill 512 " in E.command_line(args)
    args.modes = ("compiled_static", "logits_error")
    line = E.command_line(args)
    assert "--prefill" not in line and line.endswith("--tokens 4 --modes compiled_static logits_error --rounds 1")


@pytest.mark.parametrize("argv, words", [
    (["--granularity", "block128"], "--granularity: only with --weights fp8"),
    (["--weights", "bf16", "--granularity", "channel"], "--granularity: only with --weights fp8"),
    (["--no-peers"], "--no-peers: only with --weights fp8"),
    (["--quantize-lm-head", "--no-peers"], "--quantize-lm-head, --no-peers: only with --weights fp8"),
    (["--fp8-activations"], "--fp8-activations: only with --weights fp8"),
    (["--weights", "int4"], "--weights: invalid choice"),
    (["--weights", "fp8", "--granularity", "tensor"], "--granularity: invalid choice"),
])
def test_bad_fp8_options_exit_2_with_the_reason(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        E.parse_args(["--model", "llama3-8b", *argv])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_bench_e2e_passes_the_fp8_options_on(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(E, "main", lambda argv: seen.append(argv) or 0)
    assert bench_cli("bench", "--e2e", "--model", "llama3-8b", "--weights", "fp8", "--granularity", "block128",
                     "--quantize-lm-head", "--no-peers", "--tokens", "8") == 0
    assert seen[-1] == ["--model", "llama3-8b", "--tokens", "8", "--quantize-lm-head", "--no-peers", "--weights", "fp8",
                        "--granularity", "block128"]
    assert bench_cli("bench", "--e2e", "--model", "llama3-8b", "--weights", "fp8") == 0
    assert seen[-1] == ["--model", "llama3-8b", "--weights", "fp8"]
    for argv, words in ((["--e2e", "--model", "llama3-8b", "--granularity", "channel"],
                         "hybridgemm bench --e2e: --granularity: only with --weights fp8"),
                        (["--e2e", "--model", "llama3-8b", "--no-peers"],
                         "hybridgemm bench --e2e: --no-peers: only with --weights fp8"),
                        (["--model", "llama3-8b", "--weights", "fp8"], "--weights: only with --e2e or --m-sweep"),
                        (["--m-sweep", "--no-peers"], "--no-peers: only with --e2e")):
        assert bench_cli("bench", *argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert len(seen) == 2


# ----------------------------------------------------------------------------- bytes and floors


@pytest.mark.parametrize("granularity, lm_head", [("channel", False), ("block128", False), ("block128", True),
                                                  ("channel", True)])
def test_fp8_model_bytes_counted_by_hand(granularity, lm_head):
    stock, model, report = patched_fp8(granularity, lm_head)
    assert hf.decode_weight_bytes(stock) == bf16_hand_count()
    assert len(report.fp8) == 4 * LAYERS + lm_head
    got = hf.decode_weight_bytes(model)
    assert got == fp8_hand_count(granularity, lm_head)
    assert E.hbm_floor_ms(got) == pytest.approx(got / (HBM_TBPS * 1e12) * 1e3)
    # the scales are counted: without them the count would be short by 4 bytes per scale
    scales = sum(b.numel() for n, b in model.named_buffers() if n.endswith("weight_scale"))
    assert scales > 0 and got - sum(p.numel() * p.element_size() for p in model.parameters()
                                    if p is not model.model.embed_tokens.weight) == 4 * scales


def test_tensor_bytes_counts_a_flattening_subclass_by_its_parts():
    class Quantized:  # what a traceable tensor subclass answers: its inner tensors' names
        qdata = torch.zeros(64, 32, dtype=torch.int8)
        scale = torch.zeros(64, 1)
        dtype = torch.bfloat16  # the logical dtype, which says nothing about the storage

        def __tensor_flatten__(self):
            return ["qdata", "scale"], None

    assert hf.tensor_bytes(Quantized()) == 64 * 32 + 64 * 4
    assert hf.tensor_bytes(torch.zeros(5, 3, dtype=torch.bfloat16)) == 30
    assert hf.tensor_bytes(nn.Parameter(torch.zeros(4))) == 16


# ----------------------------------------------------------------------------- dequantized models


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_dequantized_model_holds_each_part_at_its_stock_name(granularity):
    stock, model, report = patched_fp8(granularity)
    deq = ew.dequantized_model(tiny_config(), stock, model, report.fp8, torch.float32, "cpu")
    assert all(p.dtype == torch.float32 for p in deq.parameters())
    stock_params, deq_params = dict(stock.named_parameters()), dict(deq.named_parameters())
    assert list(stock_params) == list(deq_params)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, w in stock_params.items():
        got = deq_params[name]
        if name.rpartition(".")[0].rpartition(".")[2] not in projections:
            assert torch.equal(got, w.float()), name  # embeddings, norms, the LM head: as they were
            continue
        # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself, relative to its scale
        err = ((got - w.float()).norm() / w.float().norm()).item()
        assert 0 < err < 2**-4, (name, err)
        for other in projections:  # and it is this part's weight, not another's rows
            twin = name.replace(name.rpartition(".")[0].rpartition(".")[2], other)
            if twin != name and stock_params.get(twin) is not None and stock_params[twin].shape == w.shape:
                assert ((got - stock_params[twin].float()).norm() / w.float().norm()).item() > 0.5
    q = model.model.layers[0].self_attn.qkv_proj
    assert torch.equal(deq.model.layers[0].self_attn.k_proj.weight,
                       fp8.dequantize(q.weight, weight_scale_of(q), torch.float32)[H:H + KV])


def test_dequantized_model_refuses_a_name_it_cannot_place():
    stock, model, report = patched_fp8("channel")
    other = transformers.LlamaConfig(**{**tiny_config().to_dict(), "intermediate_size": 512})
    with pytest.raises(ValueError, match="no parameter of that shape"):
        ew.dequantized_model(other, hf.build_model(other, torch.bfloat16, "cpu"), model, report.fp8, torch.float32,
                             "cpu")


# ----------------------------------------------------------------------------- a whole FP8 run


@pytest.fixture(scope="module")
def fp8_run():
    mp = pytest.MonkeyPatch()
    mp.setattr(ew, "torchao_version", lambda: None)
    lines = []
    try:
        torch.manual_seed(0)
        res = E.run_e2e(tiny_run(log=lines.append))
    finally:
        mp.undo()
    return res, lines


def test_fp8_run_rows_floors_and_errors(fp8_run):
    res, lines = fp8_run
    hyb = "hybridgemm_e4m3_channel"
    assert not res.errors, res.errors
    by = {(r["mode"], r["variant"]): r for r in res.rows}
    timed = [m for m in E.MODES if m not in E.ERROR_MODES]
    assert set(by) == {(m, v) for m in timed for v in ("stock", hyb)} | {
        (m, v) for m in E.ERROR_MODES for v in ("stock", hyb, E.DEQUANT)}
    assert res.unpatch_exact is None  # an FP8 model cannot be unpatched: no check
    bf16_bytes, fp8_bytes = bf16_hand_count(), fp8_hand_count("channel")
    for r in res.rows:
        assert set(r) <= set(E.COLUMNS), set(r) - set(E.COLUMNS)
        assert r["weights"] == {"stock": "bf16", hyb: "e4m3_channel", E.DEQUANT: "bf16"}[r["variant"]]
        if r["mode"] in E.ERROR_MODES:
            continue
        assert r["weight_bytes"] == bf16_bytes
        assert r["variant_bytes"] == (fp8_bytes if r["variant"] == hyb else bf16_bytes)
        if r["mode"] in E.DECODE_MODES:
            ms = r["ms_per_token"]
            assert r["hbm_floor_ms"] == pytest.approx(E.hbm_floor_ms(bf16_bytes))
            assert r["fraction_of_floor"] == pytest.approx(E.hbm_floor_ms(bf16_bytes) / ms)
            assert r["variant_floor_ms"] == pytest.approx(E.hbm_floor_ms(r["variant_bytes"]))
            assert r["fraction_of_variant_floor"] == pytest.approx(E.hbm_floor_ms(r["variant_bytes"]) / ms)
    for mode in E.ERROR_MODES:
        stock, patched, deq = (by[(mode, v)] for v in ("stock", hyb, E.DEQUANT))
        assert stock["logits_rel_err"] == stock["logits_rel_err_vs_bf16"] and 0 < stock["logits_rel_err"] < 0.05
        # against the bf16 model, quantizing shows; against the dequantized weights' fp32 model, it does not
        assert patched["logits_rel_err_vs_bf16"] > 3 * patched["logits_rel_err"] > 0
        assert deq["logits_rel_err_vs_bf16"] > 3 * deq["logits_rel_err"] > 0
        # on the CPU the FP8 modules compute dequantize -> bf16 F.linear: the same error
        assert patched["error_ratio"] == pytest.approx(patched["logits_rel_err"] / deq["logits_rel_err"])
        assert patched["error_ratio"] == pytest.approx(1.0, abs=0.05)
        assert "dequant_bf16's error" in patched["note"]
    assert sum("torchao is not installed" in line for line in lines) == 1
    assert not any(r["variant"].startswith("torchao") for r in res.rows)


def test_fp8_run_csv_and_summary(fp8_run, tmp_path):
    res, _ = fp8_run
    path = tmp_path / "e2e.csv"
    E.upsert(path, res.rows)
    rows = read_rows(str(path))
    assert list(rows[0]) == list(E.COLUMNS) and len(rows) == len(res.rows)
    assert {r["weights"] for r in rows} == {"bf16", "e4m3_channel"}
    assert {r["run_weights"] for r in rows} == {"e4m3_channel"}
    # a bf16 run's rows of the same keys (its stock rows too) sit beside the FP8 run's, not in their place
    bf16_rows = [{**r, "run_weights": ""} for r in res.rows if r["variant"] == "stock"]
    E.upsert(path, bf16_rows)
    E.upsert(path, bf16_rows)
    rows = read_rows(str(path))
    assert len(rows) == len(res.rows) + len(bf16_rows)
    assert sum(r["variant"] == "stock" and r["run_weights"] == "" for r in rows) == len(bf16_rows)
    import io

    from rich.console import Console

    out = io.StringIO()
    E.print_summary(res, Console(file=out, width=200))
    text = out.getvalue()
    assert "hybridgemm_e4m3_channel" in text and "of own floor" in text
    assert "logits error vs fp32, dequant_bf16:" in text and "vs the bf16 model's fp32:" in text


def test_main_runs_fp8_into_its_own_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(ew, "torchao_version", lambda: "0.18.0")
    seen = {}

    def fake_run(run, on_rows=None):
        seen["run"] = run
        rows = E.mode_rows(run, "prefill", 1, {"stock": [2.0], run.patched_variant: [1.0]}, 1000)
        on_rows(rows)
        return E.Result(rows)

    monkeypatch.setattr(E, "run_e2e", fake_run)
    assert E.main(["--model", "llama3-8b", "--layers", "2", "--weights", "fp8", "--granularity", "block128",
                   "--quantize-lm-head", "--out", str(tmp_path), "--no-progress"]) == 0
    run = seen["run"]
    assert (run.granularity, run.quantize_lm_head, run.peers) == ("block128", True, True)
    rows = read_rows(str(tmp_path / "e2e_fp8_h200.csv"))
    # the LM head quantized too: the run's rows apart from a run without (run_weights, variant)
    assert [(r["variant"], r["run_weights"]) for r in rows] == [("stock", "e4m3_block128_head"),
                                                                ("hybridgemm_e4m3_block128_head", "e4m3_block128_head")]
    assert rows[0]["torchao"] == "0.18.0" and "--weights fp8 --granularity block128" in rows[0]["command"]
    assert not (tmp_path / "e2e_h200.csv").exists()
    capsys.readouterr()


# ----------------------------------------------------------------------------- torchao peers


@dataclasses.dataclass
class FakeConfig:
    set_inductor_config: bool = True


class FakeFloat8(FakeConfig):
    pass


class FakeInt8(FakeConfig):
    pass


def fake_torchao(monkeypatch, fail: str | None = None) -> list:
    """A ``torchao`` whose ``quantize_`` records what it was given and rounds the chosen
    weights through e4m3 (so the peer computes, and differs from stock)."""
    calls = []

    def quantize_(model, config, filter_fn=None):
        if type(config).__name__ == fail:
            raise RuntimeError("this GPU has no kernel for it")
        chosen = [name for name, mod in model.named_modules() if filter_fn(mod, name)]
        calls.append((config, chosen, {n: p.detach().clone() for n, p in model.named_parameters()}))
        with torch.no_grad():
            for name in chosen:
                w = model.get_submodule(name).weight
                w.copy_(w.to(torch.float8_e4m3fn).to(w.dtype))

    package = types.ModuleType("torchao")
    package.__version__ = "0.0.fake"
    quantization = types.ModuleType("torchao.quantization")
    quantization.quantize_ = quantize_
    quantization.Float8WeightOnlyConfig, quantization.Int8WeightOnlyConfig = FakeFloat8, FakeInt8
    package.quantization = quantization
    monkeypatch.setitem(sys.modules, "torchao", package)
    monkeypatch.setitem(sys.modules, "torchao.quantization", quantization)
    return calls


def test_peers_get_a_fresh_stock_copy_every_projection_but_the_head_and_no_inductor_settings(monkeypatch):
    calls = fake_torchao(monkeypatch)
    lines = []
    torch.manual_seed(0)
    res = E.run_e2e(tiny_run(log=lines.append, modes=("logits_error", "eager_static")))
    assert not res.errors, res.errors
    assert [type(c).__name__ for c, _, _ in calls] == ["FakeFloat8", "FakeInt8"]
    assert all(c.set_inductor_config is False for c, _, _ in calls)
    torch.manual_seed(E.SEED)  # run_e2e's stock model, rebuilt from its seed
    stock = hf.build_model(tiny_config(), torch.bfloat16, "cpu")
    for _, chosen, params in calls:
        assert len(chosen) == 7 * LAYERS and "lm_head" not in chosen
        assert all(torch.equal(params[n], p) for n, p in stock.named_parameters())  # the stock weights, unquantized
    by = {(r["mode"], r["variant"]): r for r in res.rows}
    for v, weights in (("torchao_float8_weight_only", "e4m3_channel"), ("torchao_int8_weight_only", "int8_channel")):
        row = by[("eager_static", v)]
        assert row["status"] == "ok" and row["weights"] == weights and row["speedup"] > 0
        err = by[("logits_error", v)]
        assert err["status"] == "ok" and "logits_rel_err" not in err  # no reference of its own weights
        assert err["logits_rel_err_vs_bf16"] > 3 * by[("logits_error", "stock")]["logits_rel_err"]
    assert any("torchao_float8_weight_only: torchao 0.0.fake Float8WeightOnlyConfig" in line for line in lines)


def test_peers_with_the_lm_head_and_a_failing_peer(monkeypatch):
    calls = fake_torchao(monkeypatch, fail="FakeInt8")
    torch.manual_seed(0)
    res = E.run_e2e(tiny_run(modes=("eager_static",), quantize_lm_head=True))
    assert len(calls) == 1 and "lm_head" in calls[0][1]
    status = {r["variant"]: (r["status"], r.get("note", "")) for r in res.rows}
    assert status["torchao_int8_weight_only"] == ("error", "RuntimeError: this GPU has no kernel for it")
    assert {v for v, (s, _) in status.items() if s == "ok"} == {"stock", "hybridgemm_e4m3_channel_head",
                                                                 "torchao_float8_weight_only"}


def test_no_peers_without_fp8_or_when_left_out(monkeypatch):
    calls = fake_torchao(monkeypatch)
    torch.manual_seed(0)
    bf16 = E.run_e2e(tiny_run(modes=("eager_static",), granularity=None))
    left_out = E.run_e2e(tiny_run(modes=("eager_static",), peers=False))
    assert not calls
    assert {r["variant"] for r in bf16.rows} == {"stock", "hybridgemm"} and bf16.unpatch_exact is True
    assert {r["variant"] for r in left_out.rows} == {"stock", "hybridgemm_e4m3_channel"}


def test_real_torchao_peers_on_the_cpu():
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    res = E.run_e2e(tiny_run(modes=("logits_error", "eager_static")))
    by = {(r["mode"], r["variant"]): r for r in res.rows}
    assert by[("eager_static", "torchao_float8_weight_only")]["status"] == "ok"
    # torchao's e4m3 per-row weights hold exactly the bytes of hybridgemm's channel-scaled ones
    assert by[("eager_static", "torchao_float8_weight_only")]["variant_bytes"] == fp8_hand_count("channel")
    assert by[("eager_static", "torchao_int8_weight_only")]["variant_bytes"] >= fp8_hand_count("channel")


def test_a_w8a8_run_patches_with_fp8_activations_under_its_own_names():
    run = tiny_run(fp8_activations=True)
    assert run.run_weights == "e4m3_channel_w8a8" and run.patched_variant == "hybridgemm_e4m3_channel_w8a8"
    assert tiny_run().run_weights == "e4m3_channel" and tiny_run(granularity=None).run_weights == ""
    torch.manual_seed(1)
    stock = hf.build_model(tiny_config(), torch.bfloat16, "cpu")
    patched, names = E._patched(run, stock)
    mods = [patched.get_submodule(n) for n in names]
    assert len(mods) == 4 * LAYERS and all(m.fp8_activations for m in mods)
    plain, _ = E._patched(tiny_run(), stock)
    assert not any(plain.get_submodule(n).fp8_activations for n in names)
