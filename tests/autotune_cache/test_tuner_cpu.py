"""The tuner's selection rule and the parallel-compile task list, without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hybridgemm.autotune_cache import measure, tune_table, tuner
from hybridgemm.autotune_cache.keys import TableKey
from hybridgemm.autotune_cache.precompile import compile_tasks, precompile
from hybridgemm.autotune_cache.presets import ProjectionShape


def test_finalists_are_the_window_clamped():
    # scores: the least ratio to F.linear over a range's points, higher is better
    assert tuner.finalist_count([]) == 0
    assert tuner.finalist_count([1.0]) == 1
    # only one within 6% of the best: still the 3 best are re-timed
    assert tuner.finalist_count([1.2, 1.0, 0.9, 0.8]) == 3
    # five within 6% of 1.0 (0.94 is at the edge and counts), 0.93 is not
    assert tuner.finalist_count([1.0, 0.99, 0.97, 0.95, 0.94, 0.93]) == 5
    # never more than MAX_FINALISTS
    assert tuner.finalist_count([1.0] * 20) == tuner.MAX_FINALISTS


def test_winner_is_the_preferred_one_among_ties():
    # (score, (backend rank, candidate rank)); F.linear is rank (-1, 0)
    rows = [(1.10, (2, 0)), (1.075, (0, 5)), (1.08, (1, 0)), (1.0, tuner.TORCH_RANK)]
    # 1.075 and 1.08 are within 3% of 1.10; cuBLASLt (rank 0) is preferred; F.linear is not a tie
    assert tuner.pick_winner(rows) == 1
    # 1.065 is more than 3% below 1.10: no longer a tie, and split-K (rank 1) at 1.08 is
    assert tuner.pick_winner([(1.10, (2, 0)), (1.065, (0, 5)), (1.08, (1, 0)), (1.0, tuner.TORCH_RANK)]) == 2
    # a kernel 2.5% faster than F.linear at its worst point is not eligible: F.linear serves
    assert tuner.pick_winner([(1.025, (1, 0)), (1.0, tuner.TORCH_RANK)]) == 1
    # 3.5% faster everywhere: it replaces F.linear
    assert tuner.pick_winner([(1.035, (1, 0)), (1.0, tuner.TORCH_RANK)]) == 0
    # within a backend, the backend's own order decides
    assert tuner.pick_winner([(1.2, (1, 4)), (1.19, (1, 2))]) == 1
    assert tuner.pick_winner([(1.2, (1, 4)), (1.16, (1, 2))]) == 0
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
    # ranges 1, 2, 3-4 (points 3, 4) and 9-16 (points 9, 12, 16)
    keys = tune_table.keys_for([ProjectionShape("t", 384, 512, True)], [1, 2, 4, 16])
    assert [(k.m_lo, k.m_hi) for k in keys] == [(1, 1), (2, 2), (3, 4), (9, 16)]
    split, tiled, lt = _FakeBackend("triton_splitk", [16, 32]), _FakeBackend("triton_gemm", [64]), \
        _FakeBackend("cublaslt", [1, 2, 3])
    tasks = compile_tasks(keys, [lt, split, tiled])
    assert lt.asked == 0  # cuBLASLt compiles nothing
    # M classes over every point of every range: 1 (M=1), not-multiple-of-16 (2, 3, 4, 9, 12),
    # multiple of 16 (16) -> 3 per config
    assert len(tasks) == 3 * (2 + 1)
    assert {b for _, b, _, _ in tasks} == {"triton_splitk", "triton_gemm"}
    for key_text, _, record, m in tasks:
        key = TableKey.from_string(key_text)
        assert key in keys and key.covers(m) and record["kind"] == "fake"
    assert sorted({m for *_, m in tasks if m == 1 or m % 16 == 0}) == [1, 16]


def test_with_exhaustive_extends_only_cublaslt():
    from hybridgemm.kernels.backends import Backend

    asked = []

    def lt_candidates(problem, heuristic_count=8, exhaustive_limit=0):
        asked.append(exhaustive_limit)
        return []

    lt = Backend("cublaslt", lambda: True, lt_candidates, None, None, str)
    split = _FakeBackend("triton_splitk", [16])
    assert tune_table.with_exhaustive([lt, split], 0) == [lt, split]
    new_lt, new_split = tune_table.with_exhaustive([lt, split], 48)
    assert new_split is split and new_lt.name == "cublaslt"
    new_lt.candidates(None)
    lt.candidates(None)
    assert asked == [48, 0]  # the original backend is not modified


def test_precompile_with_one_job_does_nothing():
    keys = tune_table.keys_for([ProjectionShape("t", 384, 512, True)], [16])
    stats = precompile(keys, [_FakeBackend("triton_gemm", [64])], jobs=1, log=pytest.fail)
    # range 9-16 is timed at 9, 12 (one specialisation class) and 16 (another): two kernels
    assert stats == {"kernels": 2, "failed": 0, "seconds": 0.0, "jobs": 1}


def test_tune_fails_before_timing_when_the_table_cannot_be_written(tmp_path):
    """An unwritable table path is reported before any candidate is compiled or timed (the
    tuner would otherwise lose up to 16 tuned keys before its first save)."""
    from tuning_tables import SIG

    from hybridgemm.autotune_cache.table import TableWriteError, TuningTable

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    path = blocker / "table.json"  # its parent is a file: no save can succeed
    keys = tune_table.keys_for([ProjectionShape("t", 384, 512, True)], [16])
    backend = _FakeBackend("triton_gemm", [64])
    with pytest.raises(TableWriteError):
        tune_table.tune(keys, TuningTable(signature=dict(SIG)), path, backends=[backend], progress=False,
                   log=lambda s: None, jobs=1)
    assert backend.asked == 0  # nothing was enumerated, compiled or timed


def test_placements_time_every_call_on_fresh_operands_and_restore_them(monkeypatch):
    import torch

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    xs, ws, outs = [x, x.clone()], [w, w.clone()], [torch.empty(2, 4)]
    first = (list(xs), list(ws), list(outs))
    seen, skews = [], []  # data pointers each placement's calls see; the skew each asks for
    medians = iter([[10.0, 5.0], [12.0, 5.5], [11.0, 7.0]])  # per placement: call 0, call 1

    def fake_rotating(calls, copies, replays=9, rounds=None, skew_bytes=0, **kw):
        assert copies == len(ws) and replays == measure.PLACEMENT_REPLAYS
        skews.append(skew_bytes)
        for c in calls:
            c(0)
        seen.append(tuple(t.data_ptr() for t in (*xs, *ws, *outs)))
        ms = next(medians)
        for _ in range(replays):  # every round the same: call 1 at ms[1] / ms[0] of the reference
            rounds.append(list(ms))
        return [measure.Timing(m, 0.1, replays) for m in ms]

    monkeypatch.setattr(measure, "gpu_time_rotating", fake_rotating)
    calls = [lambda i: outs[0].copy_(xs[i] @ ws[i].T), lambda i: None]
    got = measure.time_placements(calls, x, w, xs, ws, outs, placements=3)
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
    skews = [measure.placement_skew(p) for p in range(12)]
    assert skews[0] == 0 and len(set(skews)) == len(skews)
    assert all(s % 512 == 0 and 0 <= s < 2 << 20 for s in skews)


def test_placement_scores_cancel_drift_common_to_a_round(monkeypatch):
    """A GPU slowing down 10% per round moves every call of the round alike: the score keeps
    the true 2:1 ratio that raw medians over rounds would blur."""
    import torch

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    xs, ws, outs = [x], [w], [torch.empty(2, 4)]

    def drifting(calls, copies, replays=9, rounds=None, **kw):
        base = len(rounds)
        for r in range(replays):
            f = 1.1 ** (base + r)
            rounds.append([10.0 * f, 20.0 * f])
        return [measure.Timing(10.0, 0, replays), measure.Timing(20.0, 0, replays)]

    monkeypatch.setattr(measure, "gpu_time_rotating", drifting)
    ref, other = measure.time_placements([lambda i: None] * 2, x, w, xs, ws, outs, placements=2)
    assert other[0] == pytest.approx(2 * ref[0])


# ----------------------------------------------------------------------------- range selection

KEY = TableKey("linear", "bf16", "none", 4096, 4096, 257, 512)


def _cand(backend, rank, ratios, final=True, us=10.0):
    return tuner.Candidate(backend, {"id": rank}, (0 if backend == "cublaslt" else 1, rank), f"{backend}#{rank}",
                           list(ratios), [us] * len(ratios), [0.1] * len(ratios), final)


def _decided(cands, points=(257, 363, 512)):
    res = tuner.KeyResult(KEY, m_points=list(points), flinear_us=12.0)
    tuner.decide(res, cands)
    return res


def test_f_linear_stays_unless_a_kernel_is_faster_at_every_point():
    # 20% faster at two points, 5% slower at the low edge: its score is 0.95, so F.linear
    res = _decided([_cand("triton_gemm", 0, [0.95, 1.2, 1.2])])
    assert res.winner["backend"] == "torch" and res.ratios == [1.0, 1.0, 1.0] and res.worst_ratio == 1.0
    assert res.split_hint  # ... but it beat the winner by more than 8% somewhere: the range is halved
    # 2.5% faster everywhere: under the eligibility margin, F.linear serves, nothing to split for
    res = _decided([_cand("cublaslt", 1, [1.025, 1.025, 1.025])])
    assert res.winner["backend"] == "torch" and not res.split_hint
    # 7% faster at one point only: under SPLIT_GAIN, so the range stays whole; 9% halves it
    res = _decided([_cand("cublaslt", 1, [1.0, 1.0, 1.07])])
    assert res.winner["backend"] == "torch" and not res.split_hint
    res = _decided([_cand("cublaslt", 1, [1.0, 1.0, 1.09])])
    assert res.winner["backend"] == "torch" and res.split_hint
    # 5% faster at its worst point: it wins, and its own ratios are recorded
    res = _decided([_cand("triton_gemm", 0, [1.05, 1.1, 1.2]), _cand("cublaslt", 2, [1.0, 1.0, 1.0])])
    assert res.winner["backend"] == "triton_gemm" and res.ratios == [1.05, 1.1, 1.2] and res.worst_ratio == 1.05
    assert res.winner["worst_ratio"] == 1.05 and res.runner_up == 1.0


def test_screened_out_candidates_never_win_and_are_kept_as_runners_up():
    res = _decided([_cand("triton_gemm", 0, [1.05, 1.05, 1.05]), _cand("triton_gemm", 1, [1.5, 1.5, 1.5], final=False)])
    assert res.winner["backend"] == "triton_gemm" and res.winner["config"] == {"id": 0}
    # the rest ranked by score: the screened-out one (its screen score), then F.linear
    assert [(c["backend"], c["config"], c["worst_ratio"]) for c in res.timed] == [
        ("triton_gemm", {"id": 0}, 1.05), ("triton_gemm", {"id": 1}, 1.5), ("torch", {}, 1.0)]


def test_the_heuristic_wins_ties_over_pinned_and_triton_configs():
    heuristic = tuner.Candidate("cublaslt", {}, (0, 0), "heuristic at the exact M", [1.10, 1.10, 1.10],
                                [9.0] * 3, [0.1] * 3, True)
    res = _decided([_cand("triton_gemm", 5, [1.11, 1.12, 1.11]), heuristic, _cand("cublaslt", 3, [1.1, 1.11, 1.1])])
    assert res.winner["backend"] == "cublaslt" and res.winner["config"] == {}


def test_entry_of_records_the_range_points_and_ratios():
    res = _decided([_cand("triton_gemm", 0, [1.05, 1.1, 1.2])])
    e = tuner.entry_of(res)
    assert e["m_points"] == [257, 363, 512] and e["ratios"] == [1.05, 1.1, 1.2] and e["worst_ratio"] == 1.05
    assert e["flinear_us"] == 12.0 and e["candidates"][0]["worst_ratio"] == 1.05
    from hybridgemm.autotune_cache.table import normalize_entry

    assert normalize_entry(e, KEY) == e  # valid for its key's range


def test_a_range_one_config_cannot_serve_is_halved_and_each_half_tuned(monkeypatch):
    measured = []

    def fake_measure(key, backends, res):
        measured.append((key.m_lo, key.m_hi))
        res.m_points = tuner.sample_points(key.m_lo, key.m_hi)
        res.flinear_us = 10.0
        n = len(res.m_points)
        if (key.m_lo, key.m_hi) == (257, 512):  # fast at the top, slow at the low edge
            return [_cand("triton_gemm", 0, [0.9] + [1.2] * (n - 1))]
        if key.m_lo == 257:
            return [_cand("triton_gemm", 0, [0.95] * n)]
        return [_cand("triton_gemm", 0, [1.2] * n)]

    monkeypatch.setattr(tuner, "measure_range", fake_measure)
    monkeypatch.setattr(tuner, "validate", lambda key, res, winner, backends: True)
    out = tuner.tune_range(KEY, [], split_depth=1)
    assert measured == [(257, 512), (257, 363), (364, 512)]
    assert [(r.key.m_lo, r.key.m_hi, r.winner["backend"]) for r in out] == [(257, 363, "torch"),
                                                                          (364, 512, "triton_gemm")]
    measured.clear()
    assert len(tuner.tune_range(KEY, [], split_depth=0)) == 1 and measured == [(257, 512)]
    measured.clear()  # ranges narrower than MIN_SPLIT_WIDTH are never halved
    assert len(tuner.tune_range(KEY.with_range(5, 8), [], split_depth=3)) == 1 and measured == [(5, 8)]


def test_covered_needs_every_m_of_the_range():
    from tuning_tables import SIG

    from hybridgemm.autotune_cache.table import TuningTable, make_entry

    def entry(lo, hi):
        pts = tuner.sample_points(lo, hi)
        return make_entry("torch", {}, m_points=pts, ratios=[1.0] * len(pts), median_us=1.0, spread_us=0.0)

    t = TuningTable(dict(SIG))
    assert not tune_table.covered(t, KEY)
    t.set(KEY.with_range(257, 363), entry(257, 363))
    assert not tune_table.covered(t, KEY)
    t.set(KEY.with_range(364, 512), entry(364, 512))
    assert tune_table.covered(t, KEY)
    t.set(KEY.with_range(300, 300), entry(300, 300))  # drops 257-363: a hole at 257-299 and 301-363
    assert not tune_table.covered(t, KEY)


def test_keys_for_takes_any_m_and_tunes_the_ranges_holding_them():
    keys = tune_table.keys_for([ProjectionShape("t", 384, 512, False)], [1, 300, 333, 16384])
    assert [(k.m_lo, k.m_hi) for k in keys] == [(1, 1), (257, 512), (8193, 16384)]
    assert len(tune_table.keys_for([ProjectionShape("t", 384, 512, False)])) == 15


def test_keys_for_follows_each_shapes_bias_and_activation():
    shapes = [ProjectionShape("up", 18176, 4544, False, "gelu"), ProjectionShape("up", 3072, 768, True, "gelu_tanh"),
              ProjectionShape("o", 768, 768, True)]
    assert [k.epilogue for k in tune_table.keys_for(shapes, [1])] == ["gelu", "bias+gelu_tanh", "bias"]
    assert [k.epilogue for k in tune_table.keys_for(shapes[:1], [1], epilogues=["none"])] == ["none"]  # as asked


class _ListBackend:
    def __init__(self, name, per_m):
        self.name, self.per_m = name, per_m

    def candidates(self, problem):
        return [_Cfg(b) for b in self.per_m(problem.m)]


def test_candidates_are_the_union_over_the_points_with_the_heuristic_first():
    pts = [tuner._Point(m, tuner.problem_for(KEY, m), *([None] * 6), None, None, 0.0) for m in (257, 363, 512)]
    lt = _ListBackend("cublaslt", lambda m: [m, m + 1, m + 2])
    tiled = _ListBackend("triton_gemm", lambda m: [64, 128] if m > 300 else [32])
    rejected = []
    cands = tuner.gather_candidates([lt, tiled], pts, rejected)
    recs = [(c.backend, c.record.get("block")) for c in cands]
    # cuBLASLt: its heuristic ({}), every algorithm ranked at the top point, the first two of
    # the others' (at most MAX_PINNED_CUBLASLT = 6 pinned: 364 is cut); then Triton's at the
    # top point, then those only another point lists
    assert tuner.MAX_PINNED_CUBLASLT == 6
    assert recs == [("cublaslt", None), ("cublaslt", 512), ("cublaslt", 513), ("cublaslt", 514),
                    ("cublaslt", 257), ("cublaslt", 258), ("cublaslt", 363),
                    ("triton_gemm", 64), ("triton_gemm", 128), ("triton_gemm", 32)]
    assert cands[0].record == {} and rejected == []
    assert [c.rank for c in cands] == sorted(c.rank for c in cands)


def test_a_winner_that_fails_validation_is_replaced(monkeypatch):
    """Validation (the winner beside F.linear at many more M of the range) can reject a
    winner: without a split left, the next eligible finalist is validated, and after
    MAX_VALIDATED failures F.linear serves the range; with a split left, F.linear holds the
    whole range and the halves are tuned."""
    def fake_measure(key, backends, res):
        res.m_points = tuner.sample_points(key.m_lo, key.m_hi)
        res.flinear_us = 10.0
        n = len(res.m_points)
        return [_cand("triton_splitk", 0, [1.2] * n), _cand("triton_splitk", 1, [1.19] * n),
                _cand("cublaslt", 2, [1.1] * n)]

    tried = []

    def fake_validate(key, res, winner, backends):
        tried.append(winner.record["id"])
        return winner.record["id"] in passes

    monkeypatch.setattr(tuner, "measure_range", fake_measure)
    monkeypatch.setattr(tuner, "validate", fake_validate)
    small = KEY.with_range(5, 8)  # too narrow to halve
    passes = {2}
    # the preferred of the two tied split-K configs (rank 0), then the other, then F.linear:
    # the cuBLASLt one (1.1) is outside the tie band of the best and is never tried
    (res,) = tuner.tune_range(small, [], split_depth=1)
    assert tried == [0, 1] and res.winner["backend"] == "torch" and res.worst_ratio == 1.0
    tried.clear()
    passes = {1}
    (res,) = tuner.tune_range(small, [], split_depth=1)
    assert tried == [0, 1] and res.winner["config"] == {"id": 1}
    tried.clear()
    passes = set()  # a wide range: F.linear for the whole, then each half on its own (two tries
    # each), and the two halves that both fell back to F.linear are joined again
    out = tuner.tune_range(KEY, [], split_depth=1)
    assert tried == [0, 0, 1, 0, 1]
    assert [(r.key.m_lo, r.key.m_hi, r.winner["backend"]) for r in out] == [(257, 512, "torch")]
    assert out[0].m_points == [257, 305, 363, 364, 432, 512]  # sqrt(257 * 363) = 305.4


def test_halves_that_chose_the_same_kernel_are_joined():
    a = _decided([_cand("triton_gemm", 0, [1.05, 1.1, 1.2])], points=(257, 310, 363))
    a.key = KEY.with_range(257, 363)
    b = _decided([_cand("triton_gemm", 0, [1.07, 1.1, 1.1])], points=(364, 432, 512))
    b.key = KEY.with_range(364, 512)
    (joined,) = tuner.merge_results([a, b])
    assert (joined.key.m_lo, joined.key.m_hi) == (257, 512)
    assert joined.m_points == [257, 310, 363, 364, 432, 512] and joined.worst_ratio == 1.05
    assert tuner.entry_of(joined)["worst_ratio"] == 1.05
    c = _decided([_cand("triton_gemm", 1, [1.07, 1.1, 1.1])], points=(364, 432, 512))
    c.key = KEY.with_range(364, 512)
    assert len(tuner.merge_results([a, c])) == 2  # another config: kept apart


def test_a_range_that_runs_out_of_gpu_memory_is_reported_and_the_rest_tuned(tmp_path, monkeypatch):
    """An LM head at M = 16384 may not fit beside its rotation copies: that range gets no entry
    (F.linear serves it) and a log line saying why; the ranges after it are still tuned and the
    table is saved."""
    import torch
    from tuning_tables import SIG

    from hybridgemm.autotune_cache.table import TuningTable

    keys = tune_table.keys_for([ProjectionShape("t", 384, 512, True)], [1, 16])
    assert len(keys) == 2
    seen = []

    def fake_tune_range(key, backends, log, split_depth):
        seen.append(key)
        if key == keys[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB.\nmore text")
        winner = {"backend": "torch", "config": {}, "median_us": 9.5, "spread_us": 0.1, "describe": "F.linear",
                  "worst_ratio": 1.0}
        points = sorted({key.m_lo, key.m_hi})
        yield tuner.KeyResult(key, winner=winner, m_points=points, ratios=[1.0] * len(points), flinear_us=9.5,
                              timed=[dict(winner)])

    monkeypatch.setattr(tuner, "tune_range", fake_tune_range)
    lines = []
    path = tmp_path / "table.json"
    results = tune_table.tune(keys, TuningTable(signature=dict(SIG)), path, backends=[], progress=False,
                         log=lines.append, jobs=1)
    assert seen == keys
    saved = TuningTable.load(path, strict=True)
    assert keys[1] in saved.entries and keys[0] not in saved.entries  # the later range was saved
    oom = [r for r in results if r.key == keys[0]]
    assert len(oom) == 1 and oom[0].winner is None and "out of GPU memory" in oom[0].rejected[0][2]
    assert any("out of GPU memory" in line and "Tried to allocate 7.83 GiB." in line and "F.linear" in line
               for line in lines)
    assert not any("more text" in line for line in lines)
