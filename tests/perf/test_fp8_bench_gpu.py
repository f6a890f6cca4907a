"""The FP8 rows of the GEMV benchmarks on the GPU: the M sweep's FP8 columns
(perf/bench_msweep.py) and the layer-fusion bench's FP8 rows (perf/bench_layer_fusion.py),
each checked and set beside the read ceiling of the FP8 bytes (perf/read_ceiling.py)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridgemm.perf import bench_layer_fusion as LF
from hybridgemm.perf import bench_msweep as MS
from hybridgemm.perf import read_ceiling as R

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_m_sweep_fp8_columns_for_one_shape(granularity):
    shape = MS.SweepShape(1024, 4096, False, ("test",), ("kv",))
    res = MS.run_sweep([shape], [(1, "log"), (16, "log"), (333, "log")], "bf16", placements=1, replays=3,
                       progress=False, log=lambda s: None, fp8=granularity)
    assert not res.failed, res.failed
    read = {r["fp8_read_us"] for r in res.rows}
    assert len(read) == 1 and 0 < read.pop() < 50  # 4.2 MB: a few µs at HBM rates, timed once per shape
    for r in res.rows:
        assert r["fp8_weights"] == f"e4m3_{granularity}" and r["fp8_backend"]
        for col in ("fp8_us", "fp8_speedup", "fp8_of_read"):
            assert math.isfinite(r[col]) and r[col] > 0, (r["m"], col, r[col])
        assert r["fp8_of_read"] == pytest.approx(r["fp8_read_us"] / r["fp8_us"])
        assert r["fp8_of_read"] < 1.3, r  # nothing reads its bytes much faster than the read-only kernel
    assert [r["m"] for r in res.rows if r["fp8_check"]] == [333] and res.rows[-1]["fp8_check"].startswith("ok")


def test_read_ceiling_of_fp8_bytes_reads_them_all():
    device = torch.device("cuda")
    w = torch.randn(2048, 4096, device=device, dtype=torch.bfloat16)
    copies = [R.fp8_in_one_buffer(w, "channel")[1] for _ in range(2)]
    expected = R.read_view(copies[0]).double().sum().item()
    for call in R.read_calls(copies, device):
        assert call(0).double().sum().item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("gemm, n, k", [("o", 4096, 4096), ("gate_up", 14336, 4096)])
def test_layer_fusion_fp8_row(gemm, n, k, granularity):
    row = LF.bench_fp8_gemm("llama3-8b", gemm, n, k, False, 1, granularity, torch.device("cuda"))
    rows = 2 * n if gemm == "gate_up" else n
    assert row["weights"] == f"e4m3_{granularity}"
    assert row["weight_mb"] == round(R.fp8_bytes(rows, k, granularity) / 1e6, 1)
    assert float(row["max_rel_err"]) <= LF.MAX_REL_ERROR
    assert 0 < row["plain_of_read"] < 1.3 and row["read_us"] > 0 and row["plain_tbps"] > 0
