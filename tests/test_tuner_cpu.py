"""The tuner's selection rule and the parallel-compile task list, without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hybridgemm.autotune_cache import tuner
from hybridgemm.autotune_cache.keys import TableKey
from hybridgemm.autotune_cache.precompile import compile_tasks, precompile
from hybridgemm.autotune_cache.presets import ProjectionShape


def test_finalists_are_the_window_clamped():
    assert tuner.finalist_count([]) == 0
    assert tuner.finalist_count([10.0]) == 1
    # only one within 6%: still the 3 fastest are re-timed
    assert tuner.finalist_count([10.0, 20.0, 30.0, 40.0]) == 3
    # five within 6% (10.6 is at the edge and counts), the 11.0 does not
    assert tuner.finalist_count([10.0, 10.1, 10.3, 10.5, 10.6, 11.0]) == 5
    # never more than MAX_FINALISTS
    assert tuner.finalist_count([10.0] * 20) == tuner.MAX_FINALISTS


def test_winner_is_the_preferred_one_among_ties():
    # (median µs, backend rank, candidate rank)
    rows = [(10.0, 2, 0), (10.1, 0, 5), (10.2, 1, 0), (11.0, 0, 0)]
    # 10.1 and 10.2 are within 2% of 10.0; cuBLASLt (rank 0) is preferred; 11.0 is not a tie
    assert tuner.pick_winner(rows) == 1
    # outside the band the fastest wins whatever the preference
    assert tuner.pick_winner([(10.0, 2, 3), (10.25, 0, 0)]) == 0
    # the band is 2%: 10.19 is a tie, and the preferred one wins it
    assert tuner.pick_winner([(10.0, 2, 3), (10.19, 0, 0)]) == 1
    # within a backend, the backend's own order decides
    assert tuner.pick_winner([(10.0, 1, 4), (10.05, 1, 2)]) == 1
    # the same rows in another order pick the same candidate (the rule is order-free)
    rows2 = [rows[3], rows[2], rows[1], rows[0]]
    assert rows2[tuner.pick_winner(rows2)] == rows[1]


@dataclass(frozen=True)
class _Cfg:
    block: int

    def to_record(self):
        return {"kind": "fake", "block": self.block}


class _FakeBackend:
    def __init__(self, name, blocks):
        self.name, self.blocks, self.asked = name, blocks, 0

    def candidates(self, problem):
        self.asked += 1
        return [_Cfg(b) for b in self.blocks]


def test_compile_tasks_one_per_distinct_kernel():
    keys = tuner.keys_for([ProjectionShape("t", 384, 512, True)], [1, 2, 4, 16, 32, 64])
    split, tiled, lt = _FakeBackend("triton_splitk", [16, 32]), _FakeBackend("triton_gemm", [64]), \
        _FakeBackend("cublaslt", [1, 2, 3])
    tasks = compile_tasks(keys, [lt, split, tiled])
    assert lt.asked == 0  # cuBLASLt compiles nothing
    # M classes: 1 (M=1), not-multiple-of-16 (2, 4), multiple of 16 (16, 32, 64) -> 3 per config
    assert len(tasks) == 3 * (2 + 1)
    backends = {b for _, b, _ in tasks}
    assert backends == {"triton_splitk", "triton_gemm"}
    for key_text, _, record in tasks:
        assert TableKey.from_string(key_text) in keys and record["kind"] == "fake"


def test_precompile_with_one_job_does_nothing():
    keys = tuner.keys_for([ProjectionShape("t", 384, 512, True)], [16])
    stats = precompile(keys, [_FakeBackend("triton_gemm", [64])], jobs=1, log=pytest.fail)
    assert stats == {"kernels": 1, "failed": 0, "seconds": 0.0, "jobs": 1}


def test_tune_fails_before_timing_when_the_table_cannot_be_written(tmp_path):
    """An unwritable table path is reported before any candidate is compiled or timed (the
    tuner would otherwise lose up to 16 tuned keys before its first save)."""
    from test_table import SIG

    from hybridgemm.autotune_cache.table import TableWriteError, TuningTable

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    path = blocker / "table.json"  # its parent is a file: no save can succeed
    keys = tuner.keys_for([ProjectionShape("t", 384, 512, True)], [16])
    backend = _FakeBackend("triton_gemm", [64])
    with pytest.raises(TableWriteError):
        tuner.tune(keys, TuningTable(signature=dict(SIG)), path, backends=[backend], progress=False,
                   log=lambda s: None, jobs=1)
    assert backend.asked == 0  # nothing was enumerated, compiled or timed


def test_placements_time_every_call_on_fresh_operands_and_restore_them(monkeypatch):
    import torch

    from hybridgemm.perf import timing

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    xs, ws, outs = [x, x.clone()], [w, w.clone()], [torch.empty(2, 4)]
    first = (list(xs), list(ws), list(outs))
    seen = []  # data pointers each placement's calls see
    medians = iter([[10.0, 5.0], [12.0, 5.5], [11.0, 7.0]])  # per placement: call 0, call 1

    def fake_rotating(calls, copies, replays=9, rounds=None, **kw):
        assert copies == len(ws) and replays == 5
        for c in calls:
            c(0)
        seen.append(tuple(t.data_ptr() for t in (*xs, *ws, *outs)))
        ms = next(medians)
        for _ in range(replays):  # every round the same: call 1 at ms[1] / ms[0] of the reference
            rounds.append(list(ms))
        return [timing.Timing(m, 0.1, replays) for m in ms]

    monkeypatch.setattr(timing, "gpu_time_rotating", fake_rotating)
    calls = [lambda i: outs[0].copy_(xs[i] @ ws[i].T), lambda i: None]
    got = tuner.time_placements(calls, x, w, xs, ws, outs, placements=3)
    # the reference: its median over all rounds (11.0); call 1: its median per-round ratio to
    # the reference (ratios 5/10, 5.5/12, 7/11: median 0.5) times that; spreads are max - min
    # of the per-placement medians
    assert got[0] == (11.0, 2.0)
    assert got[1][0] == pytest.approx(11.0 * 0.5) and got[1][1] == pytest.approx(2.0)
    assert len(seen) == 3 and len(set(seen)) == 3  # each placement on other tensors
    assert all(not set(a) & set(b) for a in seen for b in seen if a is not b)
    assert (xs, ws, outs) == first  # the caller's lists come back as they were


def test_placement_scores_cancel_drift_common_to_a_round(monkeypatch):
    """A GPU slowing down 10% per round moves every call of the round alike: the score keeps
    the true 2:1 ratio that raw medians over rounds would blur."""
    import torch

    from hybridgemm.perf import timing

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    xs, ws, outs = [x], [w], [torch.empty(2, 4)]

    def drifting(calls, copies, replays=9, rounds=None, **kw):
        base = len(rounds)
        for r in range(replays):
            f = 1.1 ** (base + r)
            rounds.append([10.0 * f, 20.0 * f])
        return [timing.Timing(10.0, 0, replays), timing.Timing(20.0, 0, replays)]

    monkeypatch.setattr(timing, "gpu_time_rotating", drifting)
    ref, other = tuner.time_placements([lambda i: None] * 2, x, w, xs, ws, outs, placements=2)
    assert other[0] == pytest.approx(2 * ref[0])
