"""The M sweep's machinery on the GPU (perf/bench_msweep.py): one small shape at a few M,
every row timed, consistent and checked."""

from __future__ import annotations

import math

import pytest

from hybridgemm.perf import bench_msweep as MS
from hybridgemm.perf.csvio import read_rows

pytestmark = pytest.mark.gpu

MS_UNDER_TEST = [(1, "log"), (3, "random"), (17, "random"), (333, "log")]


def test_sweep_rows_for_one_small_shape(tmp_path):
    shape = MS.SweepShape(1024, 4096, False, ("test",), ("kv",))
    res = MS.run_sweep([shape], MS_UNDER_TEST, "bf16", placements=1, replays=3, progress=False, log=lambda s: None)
    assert not res.failed, res.failed
    assert [(r["m"], r["sample"]) for r in res.rows] == MS_UNDER_TEST
    for r in res.rows:
        for col in ("dispatched_us", "flinear_us", "speedup"):
            assert math.isfinite(r[col]) and r[col] > 0, (r["m"], col, r[col])
        assert r["speedup"] == pytest.approx(r["flinear_us"] / r["dispatched_us"], rel=1e-6)
        assert r["backend"] and r["source"], r
        if r["range"]:
            lo, hi = (int(v) for v in r["range"].split("-"))
            assert lo <= r["m"] <= hi, (r["m"], r["range"])
        assert (r["n"], r["k"], r["bias"], r["replays"]) == (1024, 4096, False, 3)
        assert r["placements"] == 1 + (MS.RETIME_PLACEMENTS if r["retimed"] else 0)  # a slow row is timed again
    checked = [r for r in res.rows if r["check"]]
    assert [r["m"] for r in checked] == [333] and checked[0]["check"].startswith("ok")
    path = tmp_path / "m_sweep_h200.csv"
    MS.write_csv(path, res.rows)
    s = MS.summarize(read_rows(str(path)))
    assert s["rows"] == len(MS_UNDER_TEST) and s["min"]["speedup"] > 0


def test_check_catches_a_wrong_result(monkeypatch):
    """A dispatcher that returns a wrong result fails the check (the bound is not vacuous)."""
    import torch

    import hybridgemm.dispatch as D

    x = torch.randn(64, 512, device="cuda").bfloat16()
    w = (torch.randn(256, 512, device="cuda") / 512**0.5).bfloat16()
    ok, err, bound = MS.check_dispatched(x, w, None, "bf16")
    assert ok and err <= bound
    real = D.fused_linear
    monkeypatch.setattr(D, "fused_linear", lambda x, w, b=None, activation=None: real(x, w, b) * 1.01)
    ok, err, bound = MS.check_dispatched(x, w, None, "bf16")
    assert not ok and err > bound
