"""The dispatcher's decisions under upgraded libraries, on a faked H200 (nothing launched):
a cuBLASLt algorithm tuned under another cuBLASLt runs F.linear; a Triton config tuned under
another Triton runs only after its one-time correctness probe passed, and a probe that could
not run (e.g. during graph capture) leaves the decision open for the next call."""

from __future__ import annotations

import warnings

import pytest
from fake_device import FAKE_SIG, KEY, PROBLEM, SPLITK_RECORD, save_table, tuned

from hybridgemm import decide
from hybridgemm.autotune_cache import probe
from hybridgemm.autotune_cache.probe import ProbeResult

OLD_LT = FAKE_SIG["cublaslt_version"] - 100
PINNED = {"kind": "cublaslt", "cublaslt_version": OLD_LT, "algo_id": 66, "tile_name": "TILE_64x16",
          "stages_name": "STAGES_64xAUTO", "splitk": 1}


def _choose(path):
    decide.set_table_path(path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        choice = decide.choose(PROBLEM, 0)
    return choice, [str(w.message) for w in rec]


@pytest.mark.usefixtures("fake_h200_lt")
def test_a_pinned_cublaslt_algorithm_of_another_cublaslt_runs_f_linear(tmp_path):
    old = {**FAKE_SIG, "cublaslt_version": OLD_LT}
    choice, said = _choose(save_table(tmp_path / "old-lt.json", {KEY: tuned("cublaslt", PINNED)}, sig=old))
    assert (choice.backend, choice.source) == ("torch", "rule")
    assert KEY.to_string() in choice.reason and str(OLD_LT) in choice.reason
    assert not [s for s in said if "cannot be used" in s]  # no per-key rejection: the table's warning says it
    # the control: the same table's heuristic entry ({}: asked at the exact M) still runs cuBLASLt
    choice, _ = _choose(save_table(tmp_path / "old-lt-heur.json", {KEY: tuned("cublaslt", {})}, sig=old))
    assert (choice.backend, choice.source, choice.config) == ("cublaslt", "table", None)


@pytest.fixture
def old_triton_table(request, tmp_path):
    request.getfixturevalue("fake_h200")
    return save_table(tmp_path / "old-triton.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)},
                  sig={**FAKE_SIG, "triton_version": "3.5.0"})


def _probe_answers(monkeypatch, result):
    asked = []

    def fake_probe(key, entry, backend, config, problem, device=None):
        asked.append((key, backend.name, problem))
        return result

    monkeypatch.setattr(probe, "probe_entry", fake_probe)
    return asked


def test_a_triton_config_of_another_triton_runs_once_its_probe_passed(monkeypatch, old_triton_table):
    asked = _probe_answers(monkeypatch, ProbeResult(True))
    choice, _ = _choose(old_triton_table)
    assert (choice.backend, choice.source, choice.provisional) == ("triton_splitk", "table", False)
    assert "3.5.0" in choice.reason and "passed its correctness probe" in choice.reason
    assert asked == [(KEY, "triton_splitk", PROBLEM)]


def test_a_failed_probe_runs_f_linear_with_one_warning(monkeypatch, old_triton_table):
    _probe_answers(monkeypatch, ProbeResult(False, "rel err 3.1e-01 > 1.2e-02"))
    choice, said = _choose(old_triton_table)
    assert (choice.backend, choice.source, choice.provisional) == ("torch", "rule", False)
    assert "rel err" in choice.reason
    assert len([s for s in said if "failed its correctness probe" in s]) == 1
    _, said = _choose(old_triton_table)  # once per key per process
    assert not [s for s in said if "failed its correctness probe" in s]


def test_a_probe_that_could_not_run_leaves_the_decision_open(monkeypatch, old_triton_table):
    _probe_answers(monkeypatch, ProbeResult(False, "not probed: a CUDA graph is being captured", cached=False))
    choice, said = _choose(old_triton_table)
    assert (choice.backend, choice.provisional) == ("torch", True)
    assert not [s for s in said if "failed its correctness probe" in s]  # (the table warning says "probe" too)


@pytest.mark.usefixtures("fake_h200")
def test_a_table_of_this_triton_is_never_probed(monkeypatch, tmp_path):
    asked = _probe_answers(monkeypatch, ProbeResult(False, "must not be asked"))
    choice, _ = _choose(save_table(tmp_path / "same.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)}))
    assert (choice.backend, choice.source) == ("triton_splitk", "table") and asked == []


@pytest.mark.usefixtures("fake_h200")
def test_the_package_root_names_the_table_and_reloads_it(tmp_path):
    """``hybridgemm.set_table_path`` / ``reload_tables`` are the dispatcher's: a table named
    there decides the next call, and a reload after the file changed is seen."""
    import hybridgemm

    path = save_table(tmp_path / "root.json", {KEY: tuned("triton_splitk", SPLITK_RECORD)})
    hybridgemm.set_table_path(path)
    assert decide.choose(PROBLEM, 0).backend == "triton_splitk"
    save_table(path, {KEY: tuned("torch", {})})
    hybridgemm.reload_tables()
    assert (decide.choose(PROBLEM, 0).backend, decide.choose(PROBLEM, 0).source) == ("torch", "table")
    hybridgemm.set_table_path(None)
