"""The decision rules of fusion/decide.py on the CPU, with an H200 faked (``fake_h200``):
which device's tables a decision reads, what a rejected or unavailable entry warns and falls
back to, the batch-invariant rule (its device limits, and PyTorch when no config takes the
problem), the change hooks, and ``explain`` as it answers on a GPU machine (CUDA faked: only
the decision runs, no kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

import pytest
import test_table_faults
import torch
from test_table_faults import FAKE_SIG, GEMM_RECORD, H200_LIMITS, KEY, PROBLEM, tuned

from hybridgemm import decide, modes
from hybridgemm.autotune_cache import signature
from hybridgemm.autotune_cache.table import TableKey, TuningTable
from hybridgemm.kernels import backends
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

CALL = "linear|bf16|bias|N=384|K=512|c at M=16"  # PROBLEM's shape key and M
fake_h200 = test_table_faults.fake_h200  # the fixture: the decision path as on an H200


def _save(path, entries, sig=FAKE_SIG):
    table = TuningTable(sig)
    for k, e in entries.items():
        table.set(k, e)
    table.save(path)
    return path


def _runtime_warnings(rec):
    return [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]


@pytest.fixture
def devices_asked(fake_h200, monkeypatch):
    """The device indexes tables were loaded for (the signature is asked per device)."""
    asked = []
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: (asked.append(device_index),
                                                                                   dict(FAKE_SIG))[1])
    return asked


# ---------------------------------------------------------------- choose and the tables it reads


def test_a_miss_is_logged_with_the_call(fake_h200, caplog):
    with caplog.at_level(logging.DEBUG, logger=decide.__name__):
        choice = decide.choose(PROBLEM, 0)
    assert choice == decide.Choice("torch", None, "rule", CALL, "no table entry holds this M; F.linear")
    assert [r.getMessage() for r in caplog.records if r.name == decide.__name__] == [
        f"hybridgemm: no table entry for {CALL}"]


def test_a_decision_reads_the_tables_of_its_device(devices_asked):
    decide.choose(PROBLEM, 3)
    decide.choose(PROBLEM, 3)  # loaded once per device
    decide.choose(PROBLEM, 1)
    assert devices_asked == [3, 1]


def test_the_environment_names_the_explicit_table(fake_h200, monkeypatch):
    path = _save(fake_h200 / "env.json", {KEY: tuned("triton_gemm", GEMM_RECORD)})
    monkeypatch.setenv("HYBRIDGEMM_TABLE", str(path))
    decide.reload_tables()
    choice = decide.choose(PROBLEM, 0)
    assert (choice.backend, choice.source, choice.key) == ("triton_gemm", "table", KEY.to_string())
    assert choice.reason == "tuned for M 9-16, timed at M=9,16: worst 1.100x F.linear's speed there"
    assert (choice.m_lo, choice.m_hi, choice.worst_ratio) == (9, 16, 1.1)


def test_a_torch_entry_runs_f_linear_as_a_table_hit(fake_h200):
    decide.set_table_path(_save(fake_h200 / "torch.json", {KEY: tuned("torch", {}, ratios=[1.0, 1.2])}))
    assert decide.choose(PROBLEM, 0) == decide.Choice(
        "torch", None, "table", KEY.to_string(),
        "tuned for M 9-16, timed at M=9,16: worst 1.000x F.linear's speed there; runs F.linear", 9, 16, 1.0)


def test_tables_that_cannot_be_loaded_warn_once_per_device(fake_h200, monkeypatch):
    def no_device(device_index=None):
        raise RuntimeError(f"no device {device_index}")

    monkeypatch.setattr(signature, "current_signature", no_device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for device in (0, 0, 1):
            assert decide.choose(PROBLEM, device).reason == "no table entry holds this M; F.linear"
        decide.reload_tables()
        decide.choose(PROBLEM, 0)
    assert _runtime_warnings(rec) == [
        "hybridgemm: tuning tables not loaded for device 0 (RuntimeError: no device 0); every call runs F.linear",
        "hybridgemm: tuning tables not loaded for device 1 (RuntimeError: no device 1); every call runs F.linear"]


def test_an_unavailable_backend_warns_once_per_entry(fake_h200):
    other = TableKey.from_problem(dataclasses.replace(PROBLEM, m=300))  # 257-512
    decide.set_table_path(_save(fake_h200 / "lt.json", {
        KEY: tuned("cublaslt", {}), other: tuned("cublaslt", {}, k=other)}))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for m in (16, 9, 300):
            choice = decide.choose(dataclasses.replace(PROBLEM, m=m), 0)
            assert (choice.backend, choice.source, choice.reason) == ("torch", "rule",
                                                                      "table entry rejected; F.linear")
    assert _runtime_warnings(rec) == [
        f"hybridgemm: table entry for {k.to_string()} cannot be used (backend cublaslt is not available here); "
        "falling back to F.linear" for k in (KEY, other)]


# ---------------------------------------------------------------- the batch-invariant rule

WIDE = Problem(m=16, n=4096, k=4096, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True),
               ldx=4096, ldw=4096, ldo=4096)
TOO_BIG = dataclasses.replace(WIDE, n=65536, k=65536, ldx=65536, ldw=65536, ldo=65536)


def test_batch_invariant_rule_without_a_device_assumes_hopper():
    choice = decide.batch_invariant_choice(WIDE, None)
    assert choice == decide.Choice("triton_gemm", modes.fixed_config(WIDE)[0], modes.SOURCE,
                                   "linear|bf16|bias|N=4096|K=4096|c at M=16", modes.rule_text(WIDE))


def test_batch_invariant_rule_uses_the_devices_limits(monkeypatch):
    asked = []
    monkeypatch.setattr(backends, "device_limits", lambda index: (asked.append(index), dict(H200_LIMITS))[1])
    monkeypatch.setattr(backends, "num_sms", lambda index: (asked.append(index), 100)[1])
    few_sms = modes.fixed_config(WIDE, **H200_LIMITS, num_sms=100)[0]
    assert few_sms != modes.fixed_config(WIDE, **H200_LIMITS, num_sms=132)[0]  # the SM count matters here
    choice = decide.batch_invariant_choice(WIDE, 2)
    assert (choice.backend, choice.config, choice.source) == ("triton_gemm", few_sms, modes.SOURCE)
    assert asked == [2, 2]


def test_batch_invariant_rule_falls_back_to_pytorch_and_says_why(monkeypatch):
    assert decide.batch_invariant_choice(TOO_BIG, None) == decide.Choice(
        "torch", None, modes.SOURCE, "linear|bf16|bias|N=65536|K=65536|c at M=16",
        "no Triton config takes this problem (a tensor spans more than 2**31 elements (the kernels use 32-bit "
        "offsets)); PyTorch computes it, deterministic but NOT batch-invariant")

    def no_triton(problem, **limits):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(modes, "fixed_config", no_triton)
    choice = decide.batch_invariant_choice(WIDE, None)
    assert (choice.backend, choice.config) == ("torch", None)
    assert choice.reason == ("no Triton config takes this problem (Triton is not available (No module named "
                             "'triton')); PyTorch computes it, deterministic but NOT batch-invariant")


# ---------------------------------------------------------------- state changes


def test_change_hooks_hear_mode_switches_and_reloads(monkeypatch):
    heard = []
    monkeypatch.setattr(decide, "_hooks", list(decide._hooks))
    decide.on_change(lambda mode, reloaded: heard.append((mode, reloaded)))
    with decide.mode(modes.BATCH_INVARIANT):
        decide.reload_tables()
    assert heard == [(modes.BATCH_INVARIANT, False), (modes.BATCH_INVARIANT, True), (modes.DEFAULT, False)]
    assert all(type(r) is bool for _, r in heard)


# ---------------------------------------------------------------- explain on a GPU machine


@pytest.fixture
def fake_cuda(devices_asked, monkeypatch):
    """``torch.cuda`` as explain sees it on a one-GPU machine whose current device is 5."""
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "device", device)
    return devices_asked, entered


def test_explain_a_miss(fake_cuda):
    asked, entered = fake_cuda
    text = decide.explain((16, 512), (384, 512), "bf16", bias=True)
    assert text == (f"linear bf16 M=16 N=384 K=512 epilogue=bias\n  key {CALL}\n"
                    "  runs torch (rule: no table entry holds this M; F.linear)")
    assert asked == [5] and entered == [5]  # the current device when none is named
    decide.explain((16, 512), (384, 512), "bf16", device=2)
    assert asked == [5, 2] and entered == [5, 2]


def test_explain_a_hit_with_an_activation(fake_cuda, fake_h200):
    relu = TableKey("linear", "bf16", "bias+relu", 384, 512, 9, 16, "c")
    decide.set_table_path(_save(fake_h200 / "relu.json", {relu: tuned("triton_gemm", GEMM_RECORD, k=relu)}))
    lines = decide.explain((2, 8, 512), (384, 512), torch.bfloat16, bias=True, activation="relu").split("\n")
    assert lines[:2] == ["linear bf16 M=16 N=384 K=512 epilogue=bias+relu", f"  key {relu.to_string()}"]
    assert lines[2].startswith("  runs triton_gemm [") and lines[2].endswith(
        "(table: tuned for M 9-16, timed at M=9,16: worst 1.100x F.linear's speed there)")


@pytest.mark.parametrize("tf32, dtype, key_dtype", [(True, "fp32", "tf32"), (False, "fp32", "fp32"),
                                                    (True, "bf16", "bf16"), (True, "fp16", "fp16")])
def test_explain_keys_fp32_by_the_tf32_flag(fake_cuda, tf32, dtype, key_dtype):
    matmul = torch.backends.cuda.matmul  # its flags are properties: set and restored by hand
    old = matmul.allow_tf32
    matmul.allow_tf32 = tf32
    try:
        text = decide.explain((16, 512), (384, 512), dtype, bias=False)
    finally:
        matmul.allow_tf32 = old
    assert f"  key linear|{key_dtype}|none|N=384|K=512|c at M=16\n" in text


def test_explain_batch_invariant_on_a_gpu(fake_cuda, monkeypatch):
    asked, entered = fake_cuda
    monkeypatch.setattr(backends, "device_limits", lambda index: (asked.append(("limits", index)), H200_LIMITS)[1])
    monkeypatch.setattr(backends, "num_sms", lambda index: 132)
    with decide.mode(modes.BATCH_INVARIANT):
        lines = decide.explain((16, 4096), (4096, 4096), "bf16", device=3).split("\n")
        f64 = decide.explain((16, 512), (384, 512), torch.float64)
    assert lines[1] == "  key linear|bf16|bias|N=4096|K=4096|c at M=16"
    assert lines[2].startswith("  batch_invariant mode: triton_gemm [") and "same kernel for every M" in lines[2]
    assert asked == [("limits", 3)] and entered == [3]
    assert f64 == ("linear torch.float64 M=16 N=384 K=512 epilogue=bias: dtype not taken by any kernel, so "
                   "PyTorch computes it (not guaranteed batch-invariant)")
    assert decide.explain((16, 512), (384, 512), torch.float64) == (
        "linear torch.float64 M=16 N=384 K=512 epilogue=bias: dtype not taken by any kernel, so PyTorch computes it")


def test_explain_without_cuda_in_batch_invariant_mode(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with decide.mode(modes.BATCH_INVARIANT):
        text = decide.explain((16, 4096), (4096, 4096), "bf16")
        f64 = decide.explain((16, 512), (384, 512), "float64")
    head, tail = text.split("\n")
    assert head == ("linear bf16 M=16 N=4096 K=4096 epilogue=bias: no CUDA device here, so PyTorch (F.linear) "
                    "computes it on the CPU")
    assert tail.startswith("  batch_invariant mode: triton_gemm [") and tail.endswith(
        " on an H100/H200-class GPU; PyTorch on the CPU is not guaranteed batch-invariant")
    assert f64 == ("linear torch.float64 M=16 N=384 K=512 epilogue=bias: no CUDA device here, so PyTorch "
                   "(F.linear) computes it on the CPU")


@pytest.mark.parametrize("args, message", [
    (("16,512", (384, 512)), "x_shape must be a sequence of non-negative ints such as (16, 4096) or (2, 8, 4096), "
                             "got '16,512'"),
    (((16, 512), [-1, 512]), "w_shape must be a sequence of non-negative ints such as (6144, 4096), got [-1, 512]"),
    (((), (384, 512)), "x_shape needs at least one dimension (its last is K), got ()"),
    (((16, 512), (384, 512, 1)), "w_shape must be two ints (N, K), got (384, 512, 1)"),
    (((2, 4, 100), (8, 99)), "x_shape (2, 4, 100) has 100 features, w_shape expects 99"),
])
def test_explain_argument_messages(args, message):
    with pytest.raises(ValueError) as info:
        decide.explain(*args)
    assert str(info.value) == message


# ---------------------------------------------------------------- an entry of another Triton


def test_a_probe_is_asked_about_exactly_the_entry_and_the_calls_device(fake_h200, monkeypatch):
    from hybridgemm.autotune_cache import probe
    from hybridgemm.autotune_cache.probe import ProbeResult

    decide.set_table_path(_save(fake_h200 / "old.json", {KEY: tuned("triton_splitk", test_table_faults.SPLITK_RECORD)},
                                sig={**FAKE_SIG, "triton_version": "3.5.0"}))
    asked = []

    def fake_probe(*args):
        asked.append(args)
        return ProbeResult(True)

    monkeypatch.setattr(probe, "probe_entry", fake_probe)
    with warnings.catch_warnings(record=True):  # the table's own warning: tuned under another Triton
        warnings.simplefilter("always")
        choice = decide.choose(PROBLEM, 2)
    table = decide.table_for_device(2)
    [(key, entry, backend, config, problem, device)] = asked
    assert (key, entry, backend.name, config, problem) == (KEY, table.entries[KEY], "triton_splitk", choice.config,
                                                           PROBLEM)
    assert device == torch.device("cuda", 2)
    status, why = table.entry_status(KEY)
    assert choice.reason == ("tuned for M 9-16, timed at M=9,16: worst 1.100x F.linear's speed there; "
                             f"{why}, passed its correctness probe")


def test_each_entry_that_fails_its_probe_warns_once(fake_h200, monkeypatch):
    from hybridgemm.autotune_cache import probe
    from hybridgemm.autotune_cache.probe import ProbeResult

    other = TableKey.from_problem(dataclasses.replace(PROBLEM, m=300))
    record = test_table_faults.SPLITK_RECORD
    decide.set_table_path(_save(fake_h200 / "old.json", {KEY: tuned("triton_splitk", record),
                                                         other: tuned("triton_splitk", record, k=other)},
                                sig={**FAKE_SIG, "triton_version": "3.5.0"}))
    monkeypatch.setattr(probe, "probe_entry", lambda *args: ProbeResult(False, "wrong"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for m in (16, 300, 16):
            assert decide.choose(dataclasses.replace(PROBLEM, m=m), 0).backend == "torch"
    failed = [w for w in _runtime_warnings(rec) if "failed its correctness probe" in w]
    assert len(failed) == 2 and KEY.to_string() in failed[0] and other.to_string() in failed[1]
