"""The decision rules of fusion/decide.py on the CPU, with an H200 faked (``fake_h200``):
which device's tables a decision reads, what a rejected or unavailable entry warns and falls
back to, entries of another Triton and their probe, and the change hooks (mode switches and
reloads). The batch-invariant decision: test_batch_invariant.py; ``explain``: test_explain.py.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
from fake_device import CALL, FAKE_SIG, GEMM_RECORD, KEY, PROBLEM, SPLITK_RECORD, tuned
from fake_device import save_table as _save

from hybridgemm import decide, mode_state
from hybridgemm.autotune_cache import signature
from hybridgemm.autotune_cache.table import TableKey


def _runtime_warnings(rec):
    return [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]


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


# ---------------------------------------------------------------- changes


def test_change_hooks_hear_mode_switches_and_reloads_under_the_mode_lock(monkeypatch):
    heard = []
    monkeypatch.setattr(decide, "_hooks", list(decide._hooks))
    decide.on_change(lambda mode, reloaded: heard.append((mode, reloaded, mode_state._lock.locked())))
    with mode_state.mode(mode_state.BATCH_INVARIANT):
        decide.reload_tables()
    assert heard == [(mode_state.BATCH_INVARIANT, False, True), (mode_state.BATCH_INVARIANT, True, True),
                     (mode_state.DEFAULT, False, True)]
    assert all(type(r) is bool for _, r, _ in heard)


# ---------------------------------------------------------------- an entry of another Triton


def test_a_probe_is_asked_about_exactly_the_entry_and_the_calls_device(fake_h200, monkeypatch):
    from hybridgemm.autotune_cache import probe
    from hybridgemm.autotune_cache.probe import ProbeResult

    decide.set_table_path(_save(fake_h200 / "old.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)},
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
    record = SPLITK_RECORD
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


# ------------------------------------------------------------------ a GEMM that carries fused work

def _with_candidates(backend, record, worst, candidates):
    entry = tuned(backend, record, ratios=[worst, worst + 0.05])
    entry["candidates"] = [dict(backend=b, config=c, median_us=9.5, spread_us=0.1, worst_ratio=w)
                           for b, c, w in candidates]
    return entry


def test_a_fused_piece_takes_a_split_k_candidate_tied_with_the_winner(fake_h200):
    """The table's winner is another kernel (or F.linear); its split-K candidate timed within
    the tuner's 3% tie: a GEMM that carries fused work runs that candidate, a plain one the
    winner. Outside the tie, or with no split-K candidate, both run the winner."""
    other = dict(SPLITK_RECORD, split_k=2)
    for winner, record, worst, cands, want in [
        ("triton_gemm", GEMM_RECORD, 1.19, [("triton_splitk", SPLITK_RECORD, 1.17), ("triton_splitk", other, 1.16)],
         SPLITK_RECORD),
        ("torch", {}, 1.0, [("triton_splitk", other, 0.98)], other),
        ("triton_gemm", GEMM_RECORD, 1.19, [("triton_splitk", SPLITK_RECORD, 1.10)], None),
        ("triton_gemm", GEMM_RECORD, 1.19, [("triton_gemm", dict(GEMM_RECORD, group_m=4), 1.19)], None),
    ]:
        decide.set_table_path(_save(fake_h200 / "t.json", {KEY: _with_candidates(winner, record, worst, cands)}))
        plain, fused = decide.choose(PROBLEM, 0), decide.choose_fusable(PROBLEM, 0)
        assert plain.backend == winner
        if want is None:
            assert fused == plain
        else:
            assert fused.backend == "triton_splitk" and fused.config.to_record() == {**want, "fused_reduce": False}
            assert "for a fused piece its split-K candidate, tied with the winner" in fused.reason
            assert (fused.m_lo, fused.m_hi) == (KEY.m_lo, KEY.m_hi)


def test_a_split_k_winner_is_its_own_fused_choice(fake_h200):
    decide.set_table_path(_save(fake_h200 / "s.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)}))
    assert decide.choose_fusable(PROBLEM, 0) == decide.choose(PROBLEM, 0)


def test_a_fused_piece_on_an_untuned_shape_runs_split_k_untuned_config(fake_h200):
    """No entry holds the shape: a fused piece at decode rows (fp16/bf16, M <= 16) runs split-K's
    untuned config, a plain call F.linear; past 16 rows, in fp32, or with an FP8 weight, the
    fused piece gets the plain decision too."""
    from hybridgemm.kernels import triton_splitk
    from hybridgemm.models.decode_checks import DECODE_ROWS

    assert decide.FUSED_UNTUNED_MAX_M == DECODE_ROWS
    for m, n, k, dtype in [(1, 384, 512, torch.bfloat16), (3, 4096, 14336, torch.float16),
                           (16, 12288, 3072, torch.bfloat16), (7, 160, 96, torch.bfloat16)]:
        problem = dataclasses.replace(PROBLEM, m=m, n=n, k=k, dtype=dtype, ldx=k, ldw=k, ldo=n)
        plain, fused = decide.choose(problem, 0), decide.choose_fusable(problem, 0)
        assert (plain.backend, plain.source) == ("torch", "rule")
        assert (fused.backend, fused.source, fused.key) == ("triton_splitk", "rule", plain.key)
        assert fused.config == triton_splitk.untuned_config(problem, num_sms=132)
        assert (fused.config.block_n, fused.config.num_stages) == (64, 6)
        assert fused.config.fused_reduce == (fused.config.split_k > 1)  # the rotary epilogue needs one pass
        assert fused.config.supports(problem)[0]
        assert "no table entry holds this M; a fused piece at M <= 16 runs split-K's untuned config" in fused.reason
    for problem in [dataclasses.replace(PROBLEM, m=17), dataclasses.replace(PROBLEM, m=1, dtype=torch.float32),
                    dataclasses.replace(PROBLEM, m=1, weight_format="e4m3_channel")]:
        assert decide.choose_fusable(problem, 0) == decide.choose(problem, 0)


def test_a_tuned_f_linear_winner_is_not_overridden_by_the_untuned_rule(fake_h200):
    """An entry that holds the shape decides, even where its winner is F.linear with no tied
    split-K candidate: the untuned config is only for shapes the table does not hold."""
    decide.set_table_path(_save(fake_h200 / "f.json", {KEY: tuned("torch", {}, ratios=[1.0, 1.2])}))
    assert decide.choose_fusable(PROBLEM, 0) == decide.choose(PROBLEM, 0)
    assert decide.choose_fusable(PROBLEM, 0).backend == "torch"


def test_the_fp8_decode_rule_runs_the_default_config_on_a_gpu_of_unknown_size():
    """``fp8_decode_config`` without an SM count (``explain`` on a table whose signature has none):
    the split-K default config for an H100/H200, with the one-launch reduction; None past decode."""
    from hybridgemm.kernels import triton_splitk_configs
    from hybridgemm.kernels.epilogue import Epilogue
    from hybridgemm.kernels.fp8 import FORMAT_OF
    from hybridgemm.kernels.problem import Problem

    fp8 = dict(epilogue=Epilogue(), weight_format=FORMAT_OF["channel"])
    decode = Problem(m=1, n=4096, k=14336, dtype=torch.bfloat16, ldx=14336, ldw=14336, ldo=4096, **fp8)
    cfg = decide.fp8_decode_config(decode, None)
    want = triton_splitk_configs.default_config(decode)
    assert cfg == dataclasses.replace(want, fused_reduce=want.split_k > 1) and cfg.split_k > 1
    assert decide.fp8_decode_config(decode, 66).split_k <= cfg.split_k  # fewer SMs, no more splits
    prefill = dataclasses.replace(decode, m=65)
    assert decide.fp8_decode_config(prefill, None) is None
