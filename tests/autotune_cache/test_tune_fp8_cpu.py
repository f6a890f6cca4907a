"""Tuning FP8 weights (``hybridgemm autotune --weights fp8``) without a GPU: the FP8 keys of a
preset, the problems and operands the tuner builds for them, its baseline (the weight
dequantized inside each call, then F.linear), its reference check with the split-K kernel under
the Triton interpreter, and an FP8 entry as `hybridgemm show` lists it and the FP8 decision
reads it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from fake_device import FAKE_SIG, GEMM_RECORD, SPLITK_RECORD, tuned
from fake_device import save_table as _save
from tuning_tables import SIG

from hybridgemm import decide
from hybridgemm.autotune_cache import measure, signature, tune_table, tuner
from hybridgemm.autotune_cache.keys import TableKey, op_for, weight_format_of
from hybridgemm.autotune_cache.presets import ProjectionShape, get_preset
from hybridgemm.cli import commands, main
from hybridgemm.kernels import backends, cublaslt_fp8
from hybridgemm.kernels.backends import ConfigRejected
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.fp8 import FORMAT_OF, FP8Weight
from hybridgemm.kernels.problem import Problem
from hybridgemm.kernels.triton_splitk import TritonSplitKConfig

BLOCK128 = FORMAT_OF["block128"]


def _fp8_problem(m=16, n=384, k=512, granularity="block128", dtype=torch.bfloat16):
    return Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(Activation.NONE, True), ldx=k, ldw=k, ldo=n,
                   weight_format=FORMAT_OF[granularity])


# ----------------------------------------------------------------------------- keys and problems


def test_a_presets_fp8_keys_name_the_format_and_round_trip():
    shapes = get_preset("llama3-8b").projections
    bf16 = tune_table.keys_for(shapes, [1, 300])
    keys = tune_table.keys_for(shapes, [1, 300], weight_format=BLOCK128)
    assert len(keys) == len(bf16) > 0
    assert {k.op for k in keys} == {"linear_e4m3_block128"} and {k.op for k in bf16} == {"linear"}
    assert [(k.n, k.k, k.m_lo, k.m_hi) for k in keys] == [(k.n, k.k, k.m_lo, k.m_hi) for k in bf16]
    for k in keys:
        assert TableKey.from_string(k.to_string()) == k
        p = measure.problem_for(k, k.m_lo)
        assert p.weight_format == BLOCK128 and p.m == k.m_lo and (p.n, p.k) == (k.n, k.k)
        assert TableKey.from_problem(p).with_range(k.m_lo, k.m_hi) == k  # the problem gives its key back
    assert measure.problem_for(bf16[0]).weight_format == ""
    for fmt in ("", *FORMAT_OF.values()):
        assert weight_format_of(op_for("linear", fmt)) == fmt


def test_an_fp8_keys_layout_class_counts_one_byte_per_weight_element():
    # K = 4100: a bf16 row is 8200 bytes (8-byte aligned), an e4m3 row 4100 (4-byte aligned)
    shape = [ProjectionShape("t", 256, 4100, False)]
    (bf16,) = tune_table.keys_for(shape, [16])
    (fp8,) = tune_table.keys_for(shape, [16], weight_format=FORMAT_OF["channel"])
    assert (bf16.layout, fp8.layout) == ("a8", "a4")
    assert TableKey.from_problem(measure.problem_for(fp8)).layout == "a4"


@pytest.mark.parametrize("dtypes", [("fp32",), ("bf16", "tf32")])
def test_fp8_keys_refuse_activations_no_fp8_kernel_takes(dtypes):
    with pytest.raises(ValueError, match="computes in bf16 or fp16"):
        tune_table.keys_for([ProjectionShape("t", 256, 512, True)], [16], dtypes, weight_format=BLOCK128)


# ----------------------------------------------------------------------------- operands and the baseline


@pytest.fixture
def cpu_operands(monkeypatch):
    """The tuner's operands built on the CPU: two rotation copies, made by measure.rotation_lists."""
    asked = []

    def copies(weight_bytes, device):
        asked.append(weight_bytes)
        return 2

    def operands_for(p):
        x, w, b, out = measure.random_operands(p, "cpu")
        return (x, w, b, out, *measure.rotation_lists(x, w))

    monkeypatch.setattr(measure, "rotation_copies", copies)
    monkeypatch.setattr(tuner, "operands_for", operands_for)
    return asked


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_fp8_rotation_copies_hold_their_own_e4m3_data_and_scales(granularity, cpu_operands):
    p = _fp8_problem(m=5, n=200, k=300, granularity=granularity, dtype=torch.float16)
    x, w, b, out, xs, ws = tuner.operands_for(p)
    assert isinstance(w, FP8Weight) and w.granularity == granularity and w.dtype == torch.float16
    assert w.data.dtype == torch.float8_e4m3fn and ws[0] is w and len(ws) == 2
    copy = ws[1]
    assert copy.data.data_ptr() != w.data.data_ptr() and copy.scale.data_ptr() != w.scale.data_ptr()
    assert torch.equal(copy.data.view(torch.uint8), w.data.view(torch.uint8)) and torch.equal(copy.scale, w.scale)
    # the copies are counted by the bytes a call reads: x, the e4m3 data and the fp32 scales
    assert cpu_operands == [x.nbytes + 200 * 300 + 4 * w.scale.numel()]
    assert w.nbytes == 200 * 300 + 4 * w.scale.numel()


def test_the_fp8_baseline_dequantizes_its_copy_inside_each_call(cpu_operands):
    key = tune_table.keys_for([ProjectionShape("t", 192, 320, True)], [4], ("fp16",), weight_format=BLOCK128)[0]
    pt = tuner.setup_point(key, 3)
    assert pt.problem.weight_format == BLOCK128 and pt.problem.m == 3
    x, w, b = pt.x, pt.w, pt.b
    want = F.linear(x, w.dequantize(torch.float16), b)  # what the FP8 call's fallback computes
    assert torch.equal(pt.baseline(0), want)
    # the reference: the fp32 product with the weight dequantized in fp32
    ref64 = x.double() @ w.dequantize(torch.float32).double().T + b.double()
    assert pt.err(ref64) < 1e-6
    assert pt.err(pt.baseline(0)) <= pt.bound and pt.bound == tuner.ERR_FLOOR[torch.float16]
    # the e4m3 bytes read as if their scales were 1: far outside the bound
    assert pt.err(F.linear(x, w.data.to(torch.float16), b)) > 10 * pt.bound
    # doubling copy 1's scales doubles what call 1 computes (its own scales, read in the call);
    # call 0 is unchanged
    pt.ws[1].scale.mul_(2)
    doubled = pt.baseline(1).double() - b.double()
    torch.testing.assert_close(doubled, 2 * (want.double() - b.double()), rtol=2e-3, atol=2e-3)
    assert torch.equal(pt.baseline(0), want)


# ----------------------------------------------------------------------------- candidates and their check


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _scale_ignoring_run(config, x, w, b, out, act, tf32=False, weight_scale=None):
    """A wrong FP8 kernel: the e4m3 values as if every scale were 1."""
    return out.copy_(F.linear(x, w.to(x.dtype), b))


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_fp8_candidates_are_checked_against_the_dequantized_reference(granularity, cpu_operands, interpreter,
                                                                     fake_h200, monkeypatch):
    """The split-K kernel (run with the weight's scales) passes the tuner's check against the
    fp32 product with the dequantized weight at every point and copy; a kernel that drops the
    scales is rejected; the backends that take no FP8 weight offer no candidates."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    key = tune_table.keys_for([ProjectionShape("t", 96, 256, True)], [4], ("fp16",),
                              weight_format=FORMAT_OF[granularity])[0]
    assert (key.m_lo, key.m_hi) == (3, 4)
    points = [tuner.setup_point(key, m) for m in tuner.sample_points(key.m_lo, key.m_hi)]
    splitk = backends.get_backend("triton_splitk")
    configs = [TritonSplitKConfig(16, 32, 64, 1, 4, 2), TritonSplitKConfig(16, 32, 128, 2, 4, 2, fused_reduce=True)]
    split = dataclasses.replace(splitk, candidates=lambda p: list(configs))
    wrong = backends.Backend("cublaslt_fp8", lambda: True, lambda p: [backends._Heuristic()],
                             lambda record, p: None, _scale_ignoring_run, str)
    gemm = backends.get_backend("triton_gemm")
    rejected: list = []
    cands = tuner.gather_candidates([gemm, split, wrong], points, rejected)
    assert [c.backend for c in cands] == ["triton_splitk", "triton_splitk", "cublaslt_fp8"] and rejected == []
    assert cands[2].record == {}
    valid = tuner._bind_candidates([gemm, split, wrong], cands, points, rejected)
    assert [c.record for c in valid] == [c.to_record() for c in configs]
    assert [(r[0], "rel err" in r[2]) for r in rejected] == [("cublaslt_fp8", True)]
    for pt in points:  # each point's calls write its output from the e4m3 weight and its scales
        for j in range(len(valid)):
            for i in range(len(pt.ws)):
                pt.outs[0].fill_(float("nan"))
                pt.fns[j](i)
                assert pt.err(pt.outs[0]) <= pt.bound


# ----------------------------------------------------------------------------- backends and FP8 problems


def test_only_the_fp8_backends_take_an_fp8_problem(fake_h200):
    p = _fp8_problem()
    for name in ("cublaslt", "triton_gemm"):
        be = backends.get_backend(name)
        assert be.candidates(p) == []
        with pytest.raises(ConfigRejected, match=f"{name} takes a weight of x's dtype, not e4m3_block128"):
            be.config_from_record({}, p)
    splitk = backends.get_backend("triton_splitk")
    assert splitk.candidates(p) and all(c.block_k <= 128 for c in splitk.candidates(p))
    assert splitk.config_from_record(SPLITK_RECORD, p) == TritonSplitKConfig.from_record(SPLITK_RECORD)
    lt8 = backends.get_backend("cublaslt_fp8")
    assert lt8.candidates(dataclasses.replace(p, weight_format="")) == []  # never a bf16 weight
    with pytest.raises(ConfigRejected):  # no CUDA device here: cuBLASLt's FP8 path says why
        lt8.config_from_record({}, p)
    with pytest.raises(ValueError, match="weight_scale"):
        lt8.run(None, None, None, None, None, Activation.NONE)


def test_the_fp8_only_backend_is_tuned_but_not_listed_for_every_call(monkeypatch):
    monkeypatch.setattr(backends, "get_backend",
                        lambda name: dataclasses.replace(backends._FACTORIES[name](), available=lambda: True))
    assert [b.name for b in backends.available_backends()] == list(backends.PREFERENCE)
    assert [b.name for b in backends.available_backends(fp8=True)] == [*backends.PREFERENCE, "cublaslt_fp8"]
    assert "cublaslt_fp8" not in backends.PREFERENCE  # `show` and the unavailable warning stay as they were


def test_tune_adds_the_fp8_only_backends_for_fp8_keys(tmp_path, monkeypatch):
    from hybridgemm.autotune_cache.table import TuningTable

    asked = []
    monkeypatch.setattr(tune_table, "available_backends", lambda fp8=False: asked.append(fp8) or [])
    monkeypatch.setattr(tuner, "tune_range", lambda key, backends, log, split_depth: [])
    shape = [ProjectionShape("t", 256, 512, True)]
    for fmt in ("", BLOCK128):
        tune_table.tune(tune_table.keys_for(shape, [16], weight_format=fmt), TuningTable(dict(SIG)),
                        tmp_path / "t.json", progress=False, log=lambda s: None, jobs=1)
    assert asked == [False, True]


# ----------------------------------------------------------------------------- an FP8 entry in a table


def _fp8_key(problem):
    return TableKey.from_problem(problem)


def test_choose_fp8_returns_the_fp8_entry_and_bf16_calls_never_see_it(fake_h200):
    p = _fp8_problem()
    key = _fp8_key(p)
    assert key.to_string() == "linear_e4m3_block128|bf16|bias|N=384|K=512|M=9-16|c"
    decide.set_table_path(_save(fake_h200 / "fp8.json", {key: tuned("triton_splitk", SPLITK_RECORD, k=key)}))
    choice = decide.choose_fp8(p, 0)
    assert (choice.backend, choice.source, choice.key) == ("triton_splitk", "table", key.to_string())
    assert choice.config == TritonSplitKConfig.from_record(SPLITK_RECORD)
    assert (choice.m_lo, choice.m_hi, choice.worst_ratio) == (9, 16, 1.1)
    # the same shape with a bf16 weight has no entry; nor has the other granularity
    assert decide.choose(dataclasses.replace(p, weight_format=""), 0).source == "rule"
    assert decide.choose(dataclasses.replace(p, weight_format=FORMAT_OF["channel"]), 0).source == "rule"


def test_choose_fp8_runs_a_cublaslt_fp8_entry_and_rejects_a_bf16_backends(fake_h200, monkeypatch):
    p = _fp8_problem(m=300)
    key = _fp8_key(p)
    monkeypatch.setattr(cublaslt_fp8, "supports", lambda problem: (True, ""))
    decide.set_table_path(_save(fake_h200 / "lt8.json", {key: tuned("cublaslt_fp8", {}, k=key)}))
    choice = decide.choose_fp8(p, 0)
    assert (choice.backend, choice.config, choice.source) == ("cublaslt_fp8", None, "table")
    # a record of a backend that reads no FP8 weight cannot serve: a warning, then rule 5
    decide.set_table_path(_save(fake_h200 / "gemm.json", {key: tuned("triton_gemm", GEMM_RECORD, k=key)}))
    with pytest.warns(RuntimeWarning, match="takes a weight of x's dtype"):
        choice = decide.choose_fp8(p, 0)
    assert (choice.backend, choice.source) == ("torch", "rule")


def test_show_lists_fp8_entries(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HYBRIDGEMM_TABLE", raising=False)
    keys = [_fp8_key(_fp8_problem()), _fp8_key(_fp8_problem(m=300, granularity="channel"))]
    path = _save(tmp_path / "fp8.json", {keys[0]: tuned("triton_splitk", SPLITK_RECORD, k=keys[0], us=7.5),
                                          keys[1]: tuned("torch", {}, k=keys[1], ratios=[1.0, 1.0])}, sig=FAKE_SIG)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fp8.json: 2 entries" in out
    rows = [line.split() for line in out.splitlines() if "linear_e4m3" in line]
    assert [(r[0], r[1]) for r in rows] == [(keys[0].to_string(), "triton_splitk"), (keys[1].to_string(), "torch")]
    assert rows[0][2] == "7.50"


# ----------------------------------------------------------------------------- the command line


def test_autotune_weights_fp8_tunes_the_presets_fp8_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: dict(SIG))
    tuned_keys = []

    def fake_tune(keys, table, path, **kw):
        tuned_keys.extend(keys)
        return []

    monkeypatch.setattr(tune_table, "tune", fake_tune)
    out = tmp_path / "t.json"
    argv = ["autotune", "--model", "llama3-8b", "--m", "1", "300", "--out", str(out)]
    assert main([*argv, "--weights", "fp8", "--granularity", "block128"]) == 0
    want = tune_table.keys_for(get_preset("llama3-8b").projections, [1, 300], weight_format=BLOCK128)
    assert len(tuned_keys) == len(set(tuned_keys)) and set(tuned_keys) == set(want)
    assert "with e4m3_block128 weights" in capsys.readouterr().out
    tuned_keys.clear()
    assert main([*argv, "--weights", "fp8", "--dtype", "fp16"]) == 0  # channel by default
    assert {(k.op, k.dtype) for k in tuned_keys} == {("linear_e4m3_channel", "fp16")}
    tuned_keys.clear()
    assert main(argv) == 0  # without --weights: the bf16 keys, as before
    assert {k.op for k in tuned_keys} == {"linear"}


@pytest.mark.parametrize("source", ["preset", "hf_config"])
def test_autotune_mlp_weights_fp8_tunes_the_stacked_gate_up_an_fp8_model_runs(source, tmp_path, monkeypatch):
    # An FP8 gate/up is one GEMM over the stacked [gate; up] rows (2I) at every M; the gated
    # product's one-half shape (I) is a GEMM an FP8 model never runs.
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: dict(SIG))
    tuned_keys = []
    monkeypatch.setattr(tune_table, "tune", lambda keys, table, path, **kw: tuned_keys.extend(keys) or [])
    gated = []
    monkeypatch.setattr(commands, "_tune_gated", lambda shapes, args: gated.extend(shapes))
    preset = get_preset("llama3-8b")
    if source == "preset":
        model = ["--model", "llama3-8b"]
    else:
        config = tmp_path / "config.json"
        config.write_text(json.dumps({
            "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 1000,
            "architectures": ["LlamaForCausalLM"]}))
        model = ["--hf-config", str(config)]
    assert main(["autotune", *model, "--mlp", "--m", "1", "--out", str(tmp_path / "t.json"), "--weights", "fp8"]) == 0
    hidden, inter = (preset.hidden, preset.intermediate) if source == "preset" else (256, 688)
    shapes = {(k.n, k.k) for k in tuned_keys}
    assert (2 * inter, hidden) in shapes and (inter, hidden) not in shapes
    assert (hidden, inter) in shapes  # down, as it is
    vocab = preset.vocab if source == "preset" else 1000
    # the LM head in the model's dtype, as patch(weights="fp8") leaves it; FP8 with --quantize-lm-head
    assert {k.op for k in tuned_keys if k.n != vocab} == {"linear_e4m3_channel"}
    assert {k.op for k in tuned_keys if k.n == vocab} == {"linear"}
    tuned_keys.clear()
    assert main(["autotune", *model, "--mlp", "--m", "1", "--out", str(tmp_path / "q.json"), "--weights", "fp8",
                 "--quantize-lm-head"]) == 0
    assert {k.op for k in tuned_keys} == {"linear_e4m3_channel"}
    tuned_keys.clear()
    assert main(["autotune", *model, "--mlp", "--m", "1", "--out", str(tmp_path / "b.json")]) == 0
    assert (inter, hidden) in {(k.n, k.k) for k in tuned_keys}  # bf16: the one-half GEMMs, as before
    assert [(g.intermediate, g.k) for g in gated] == [(inter, hidden)]  # and the gated kernel's entries


def test_autotune_mlp_weights_fp8_tp_tunes_a_ranks_stacked_gate_up(tmp_path, monkeypatch):
    # a rank of tp=2 runs gate and up of I/2 rows each, stacked: I rows; down takes K = I/2
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: dict(SIG))
    tuned_keys = []
    monkeypatch.setattr(tune_table, "tune", lambda keys, table, path, **kw: tuned_keys.extend(keys) or [])
    p = get_preset("llama3-8b")
    argv = ["autotune", "--model", "llama3-8b", "--tp", "2", "--mlp", "--m", "1", "--out", str(tmp_path / "t.json")]
    assert main([*argv, "--weights", "fp8"]) == 0
    shapes = {(k.n, k.k) for k in tuned_keys}
    assert (p.intermediate, p.hidden) in shapes and (p.intermediate // 2, p.hidden) not in shapes
    assert (p.hidden, p.intermediate // 2) in shapes
