"""perf/bench_router.py without a GPU: its refusals, and its figure from rows."""

from __future__ import annotations

import pytest

from hybridgemm.perf import bench_router


def test_it_needs_a_gpu_and_positive_token_counts(monkeypatch, capsys):
    monkeypatch.setattr(bench_router.torch.cuda, "is_available", lambda: False)
    assert bench_router.main(["--tokens", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_router.main(["--tokens", "0"])
    with pytest.raises(SystemExit):
        bench_router.main(["--shapes", "no-such-model"])


def test_the_figure_draws_every_shape_and_mode(tmp_path):
    rows = [{"shape": s, "tokens": t, "mode": m, "speedup": 1.0 + t / 1000}
            for s in bench_router.SHAPES for t in (1, 8, 2048) for m in bench_router.MODES]
    path = tmp_path / "router.png"
    bench_router.plot(rows, str(path))
    assert path.stat().st_size > 1000


def test_the_stock_router_has_the_shapes_sizes():
    pytest.importorskip("transformers")
    router = bench_router.stock_router("deepseek-v3", "cpu")
    hidden, experts = bench_router.SHAPES["deepseek-v3"][:2]
    assert router.weight.shape == (experts, hidden)
    assert router.e_score_correction_bias.dtype.is_floating_point and router.e_score_correction_bias.std() > 0.1
