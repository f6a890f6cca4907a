"""The tuner's selection rule and the parallel-compile task list, without a GPU."""

from __future__ import annotations

import sys
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


def test_with_exhaustive_extends_only_cublaslt():
    from hybridgemm.backends import Backend

    asked = []

    def lt_candidates(problem, heuristic_count=8, exhaustive_limit=0):
        asked.append(exhaustive_limit)
        return []

    lt = Backend("cublaslt", lambda: True, lt_candidates, None, None, str)
    split = _FakeBackend("triton_splitk", [16])
    assert tuner.with_exhaustive([lt, split], 0) == [lt, split]
    new_lt, new_split = tuner.with_exhaustive([lt, split], 48)
    assert new_split is split and new_lt.name == "cublaslt"
    new_lt.candidates(None)
    lt.candidates(None)
    assert asked == [48, 0]  # the original backend is not modified


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
    seen, skews = [], []  # data pointers each placement's calls see; the skew each asks for
    medians = iter([[10.0, 5.0], [12.0, 5.5], [11.0, 7.0]])  # per placement: call 0, call 1

    def fake_rotating(calls, copies, replays=9, rounds=None, skew_bytes=0, **kw):
        assert copies == len(ws) and replays == tuner.PLACEMENT_REPLAYS
        skews.append(skew_bytes)
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
    # the first placement as allocated, the others with in-graph allocations moved, each
    # elsewhere and by whole allocator blocks
    assert skews[0] == 0 and len(set(skews)) == 3 and all(s % 512 == 0 for s in skews)


def test_placement_skews_are_distinct_block_multiples_within_a_segment():
    skews = [tuner.placement_skew(p) for p in range(tuner.PLACEMENTS + tuner.DUEL_PLACEMENTS)]
    assert skews[0] == 0 and len(set(skews)) == len(skews)
    assert all(s % 512 == 0 and 0 <= s < 2 << 20 for s in skews)


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


def test_close_finalists_are_those_within_the_band_plus_the_margin():
    edge = 1 + tuner.TIE_TOLERANCE + tuner.DUEL_MARGIN
    assert tuner.close_finalists([10.0, 10.0 * edge * 0.999, 10.0 * edge * 1.001]) == [0, 1]
    assert tuner.close_finalists([10.25, 10.0, 12.0]) == [0, 1]
    assert tuner.close_finalists([10.0, 11.0]) == [0]


def test_pooled_samples_decide_on_every_round_of_both_timings():
    """A duel's rounds join the first timing's: the re-timed calls' scores use all rounds,
    the reference's median too; calls not re-timed keep their ratios."""
    first = tuner.PlacementSamples(ref_us=[10.0, 10.0], ratios=[[1.0, 1.0], [0.5, 0.5], [0.9, 0.9]],
                                   per_placement=[[10.0], [5.0], [9.0]])
    more = tuner.PlacementSamples(ref_us=[20.0, 20.0, 20.0], ratios=[[1.0] * 3, [0.6] * 3],
                                  per_placement=[[20.0], [12.0]])
    first.pool(more, [1])
    (ref, ref_spread), (one, one_spread), (two, _) = first.scores()
    assert ref == 20.0 and ref_spread == 10.0  # median of 10, 10, 20, 20, 20
    assert one == pytest.approx(0.6 * 20.0) and one_spread == pytest.approx(7.0)  # median ratio of 0.5 x2, 0.6 x3
    assert two == pytest.approx(0.9 * 20.0)


def _fake_samples(log, first_ratios, duel_ratios):
    def fake(calls, x, w, xs, ws, outs, placements=tuner.PLACEMENTS, replays=4, first=0):
        log.append((len(calls), placements, first))
        ratios = first_ratios if first == 0 else duel_ratios
        return tuner.PlacementSamples([10.0] * 4, [[r] * 4 for r in ratios[:len(calls)]], [[10.0 * r] for r in ratios])
    return fake


def test_close_finalists_are_timed_again_and_the_pooled_times_decide(monkeypatch):
    """The preferred candidate (index 2) at +2.3%, outside the band: the close finalists (not
    the one 20% off) are re-timed on DUEL_PLACEMENTS more placements after the first ones, and
    the pooled rounds (2.3% x4, 0.5% x4: median 1.4%) put it inside the band."""
    log = []
    monkeypatch.setattr(tuner, "placement_samples", _fake_samples(log, [1.0, 1.0, 1.023, 1.2], [1.0, 1.0, 1.005]))
    samples, close = tuner.time_finalists([lambda i: None] * 4, None, None, [], [], [])
    assert log == [(4, tuner.PLACEMENTS, 0), (3, tuner.DUEL_PLACEMENTS, tuner.PLACEMENTS)] and close == [1, 2]
    times = samples.scores()
    assert times[2][0] == pytest.approx(10.0 * 1.014)
    assert tuner.pick_winner([(times[1][0], 1, 0), (times[2][0], 0, 0), (times[3][0], 0, 1)]) == 1


def test_finalists_not_close_are_timed_once_and_deferred_ones_are_not_retimed_here(monkeypatch):
    log = []
    monkeypatch.setattr(tuner, "placement_samples", _fake_samples(log, [1.0, 1.0, 1.05, 1.1], []))
    samples, close = tuner.time_finalists([lambda i: None] * 4, None, None, [], [], [])
    assert log == [(4, tuner.PLACEMENTS, 0)] and close == []
    assert [t for t, _ in samples.scores()] == pytest.approx([10.0, 10.0, 10.5, 11.0])
    log.clear()
    monkeypatch.setattr(tuner, "placement_samples", _fake_samples(log, [1.0, 1.0, 1.01, 1.1], []))
    samples, close = tuner.time_finalists([lambda i: None] * 4, None, None, [], [], [], duel=False)
    assert log == [(4, tuner.PLACEMENTS, 0)] and close == [1, 2]  # left for the second process


class _NamedBackend:
    def __init__(self, name):
        self.name = name

    def describe(self, cfg):
        return f"{self.name}:{cfg.n}"


class _RecordConfig:
    def __init__(self, n):
        self.n = n

    def to_record(self):
        return {"n": self.n}


def _pending_result(first_ratios):
    """A KeyResult whose finalists are cuBLASLt (preferred) and Triton, timed by one process."""
    from hybridgemm.autotune_cache.table import TableKey

    key = TableKey.from_string("linear|bf16|none|N=4096|K=4096|M=256|c")
    rows = [[0.0, 0.0, 1, 0, _NamedBackend("triton_gemm"), _RecordConfig(1), None],
            [0.0, 0.0, 0, 0, _NamedBackend("cublaslt"), _RecordConfig(2), None]]
    samples = tuner.PlacementSamples([10.0] * 4, [[1.0] * 4] + [[r] * 4 for r in first_ratios], [[10.0]] * 3)
    res = tuner.KeyResult(key, pending=(samples, rows, [], [1, 2]))
    tuner.decide(res, samples, rows, [])
    return res


def test_a_second_process_overturns_a_choice_one_process_made_on_its_own_luck():
    """This process saw cuBLASLt 3% slower than Triton (outside the band: Triton won); the
    second process sees them equal; pooled (3% x4, 0% x4: 1.5%) they tie and the preferred
    cuBLASLt wins. The job names exactly the close finalists."""
    res = _pending_result([1.0, 1.03])
    assert res.winner["backend"] == "triton_gemm"
    job = tuner.pending_job(res)
    assert job == {"key": res.key.to_string(), "calls": [{"backend": "triton_gemm", "config": {"n": 1}},
                                                          {"backend": "cublaslt", "config": {"n": 2}}]}
    more = tuner.PlacementSamples([10.0] * 4, [[1.0] * 4, [1.0] * 4, [1.0] * 4], [[10.0]] * 3)
    tuner.finish_pending(res, more)
    assert res.winner["backend"] == "cublaslt" and res.second_process and res.pending is None
    assert res.winner["median_us"] == pytest.approx(10.15)


def test_without_the_second_process_the_first_decision_stands():
    res = _pending_result([1.0, 1.03])
    tuner.finish_pending(res, None)
    assert res.winner["backend"] == "triton_gemm" and not res.second_process and res.pending is None


def test_second_process_failures_leave_the_decision_to_this_process(monkeypatch, tmp_path):
    """A child that cannot time (here: no GPU, exit 2) gives None per job and one log line;
    a child that times some jobs gives their samples and None, with the reason, for the rest."""
    from hybridgemm.autotune_cache import second_process

    lines = []
    jobs = [{"key": "linear|bf16|none|N=64|K=64|M=1|c", "calls": []}] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert second_process.retime(jobs, 0, log=lines.append) == [None, None]
    assert len(lines) == 1 and "second process failed (exit 2" in lines[0] and "needs a CUDA GPU" in lines[0]

    script = (
        "import json, sys; json.dump({'results': [{'ref_us': [5.0], 'ratios': [[1.0], [0.9]],"
        " 'per_placement': [[5.0], [4.5]]}, {'error': 'ValueError: no'}]}, open(sys.argv[2], 'w'));"
        " print('done 0'); print('done 1')")
    monkeypatch.setattr(second_process, "_child_command",
                        lambda jobs_path, out_path, device: [sys.executable, "-c", script, jobs_path, out_path])
    lines.clear()
    seen = []
    got = second_process.retime(jobs, 0, advance=seen.append, log=lines.append)
    assert got[0].ratios == [[1.0], [0.9]] and got[1] is None and len(seen) == 2
    assert lines == [f"second process could not time {jobs[1]['key']}: ValueError: no"]


def test_a_hung_second_process_is_killed_at_its_time_limit(monkeypatch):
    from hybridgemm.autotune_cache import second_process

    monkeypatch.setattr(second_process, "_child_command",
                        lambda jobs_path, out_path, device: [sys.executable, "-c", "import time; time.sleep(60)"])
    lines = []
    jobs = [{"key": "linear|bf16|none|N=64|K=64|M=1|c", "calls": []}]
    assert second_process.retime(jobs, 0, log=lines.append, timeout_s=1.0) == [None]
    assert len(lines) == 1 and "killed" in lines[0] and "limit is 1 s" in lines[0], lines
