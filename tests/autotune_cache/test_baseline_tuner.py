"""The procedure the MoE and gated kernels' tuners share (autotune_cache/baseline_tuner.py),
without a GPU: the timing is faked (a call's µs is a function of its candidate and M), so the
screen, the finalists, the 3% rule and the entry it writes are checked on their own."""

from __future__ import annotations

import pytest

from hybridgemm.autotune_cache import baseline_tuner
from hybridgemm.autotune_cache.keys import TableKey
from hybridgemm.autotune_cache.measure import Timing

KEY = TableKey("glu", "bf16", "none", 96, 64, 3, 4)
BASE_US = 100.0


def _fake_timing(monkeypatch, speed):
    """gpu_time_rotating over calls whose µs is ``speed(candidate, m)`` (the baseline: 100)."""
    def gpu_time_rotating(calls, copies, replays=9, rounds=None):
        us = [c(0) for c in calls]
        if rounds is not None:
            rounds.extend([list(us) for _ in range(replays)])
        return [Timing(u, 0.0, replays) for u in us]

    monkeypatch.setattr(baseline_tuner, "gpu_time_rotating", gpu_time_rotating)

    def ours(m, cand):
        def call(i):
            if cand == "broken":
                raise ValueError("does not fit")
            return speed(cand, m)
        return call

    return (lambda m: (lambda i: BASE_US)), ours


def _tune(monkeypatch, candidates, speed):
    baseline, ours = _fake_timing(monkeypatch, speed)
    said = []
    entry = baseline_tuner.tune_range(KEY, "triton_glu", candidates, baseline, ours, 2, lambda c: {"name": c},
                                      said.append)
    return entry, said


def test_the_fastest_candidate_at_its_worst_point_wins(monkeypatch):
    # "a" is fastest at M = 4 (the screen's point) but slow at M = 3; "b" is 20% faster at both
    times = {("a", 3): 98.0, ("a", 4): 70.0, ("b", 3): 83.0, ("b", 4): 83.0, ("c", 3): 99.0, ("c", 4): 99.0}
    entry, said = _tune(monkeypatch, ["a", "b", "c", "broken"], lambda c, m: times[(c, m)])
    assert entry["backend"] == "triton_glu" and entry["config"] == {"name": "b"}
    assert entry["m_points"] == [3, 4] and entry["ratios"] == pytest.approx([BASE_US / 83.0] * 2, abs=1e-3)
    assert entry["median_us"] == 83.0 and entry["flinear_us"] == BASE_US
    assert [c["config"]["name"] for c in entry["candidates"]] == ["a", "b", "c"]  # the finalists, screen order
    assert any("broken" in line and "left out" in line and "does not fit" in line for line in said)
    assert said[-1].startswith(f"{KEY.to_string()}: triton_glu")


def test_a_candidate_within_three_percent_keeps_the_baseline(monkeypatch):
    entry, _ = _tune(monkeypatch, ["a", "b"], lambda c, m: 98.0 if c == "a" else 99.5)
    assert entry["backend"] == "torch" and entry["config"] == {} and entry["ratios"] == [1.0, 1.0]
    assert entry["median_us"] == BASE_US and len(entry["candidates"]) == 2


def test_nothing_that_runs_keeps_the_baseline(monkeypatch):
    entry, said = _tune(monkeypatch, ["broken"], lambda c, m: 1.0)
    assert entry["backend"] == "torch" and entry["candidates"] == [] and "left out" in said[0]
