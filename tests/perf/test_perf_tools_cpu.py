"""The perf probes' argument parsing and pure parts, and the bookkeeping of the shared timing
loops (fake graphs and clocks), on the CPU. The timings themselves are GPU tests."""

from __future__ import annotations

import pytest
import torch

from hybridgemm.autotune_cache import measure
from hybridgemm.kernels import triton_glu
from hybridgemm.perf import host_profile, sweep_configs, sweep_glu, timing

# ----------------------------------------------------------------------------- sweep_configs


def test_sweep_configs_arguments():
    a = sweep_configs.parse_args(["--backend", "triton_splitk", "--shape", "3584,3584", "4608,3584", "--m", "1", "8"])
    assert (a.backend, a.shape, a.m, a.jobs, a.out) == ("triton_splitk", [(3584, 3584), (4608, 3584)], [1, 8], 8, None)
    a = sweep_configs.parse_args(["--backend", "triton_gemm", "--shape", "1024,4096", "--m", "1024", "--out", "d"])
    assert (a.shape, a.out) == ([(1024, 4096)], "d")


def test_sweep_configs_fp8_grid(monkeypatch):
    """FP8: the e4m3 problem, x tiles of M's power of two from 1 row (bf16: from 16), block_k <=
    128 for block scales; grid configs run correctly (interpreter, fp16 stands in for bf16)."""
    from hybridgemm.kernels import triton_splitk as ts
    from hybridgemm.kernels.backends import get_backend

    a = sweep_configs.parse_args(["--backend", "triton_splitk", "--shape", "4096,4096", "--m", "1", "--weights", "fp8",
                                  "--granularity", "block128"])
    assert a.weight_format == "e4m3_block128"
    small = sweep_configs.grid("triton_splitk", sweep_configs.problem(2, 4096, 4096, a.weight_format))
    assert small and {c.block_m for c in small} == {2} and all(c.block_k <= 128 for c in small)
    rows8 = sweep_configs.grid("triton_splitk", sweep_configs.problem(8, 4096, 4096, "e4m3_channel"))
    assert rows8 and {c.block_m for c in rows8} == {8} and max(c.block_k for c in rows8) == 512
    assert {c.block_m for c in sweep_configs.grid("triton_splitk", sweep_configs.problem(2, 4096, 4096))} == {16}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import dataclasses

    import torch

    from hybridgemm.autotune_cache.measure import random_operands

    p = dataclasses.replace(sweep_configs.problem(3, 96, 256, "e4m3_channel"), dtype=torch.float16)
    x, w, b, out = random_operands(p, "cpu")
    cfgs = [ts.TritonSplitKConfig(4, 32, 64, 2, 2, 2, True), ts.TritonSplitKConfig(16, 32, 128, 1, 4, 2)]
    assert sweep_configs.correct_configs(get_backend("triton_splitk"), cfgs, p, x, w, b, out) == cfgs


@pytest.mark.parametrize("argv", [
    ["--backend", "cublaslt", "--shape", "1024,4096", "--m", "1"],  # not a Triton backend
    ["--backend", "triton_gemm", "--shape", "1024", "--m", "1"],  # one number, not N,K
    ["--backend", "triton_gemm", "--shape", "0,4096", "--m", "1"],
    ["--backend", "triton_gemm", "--shape", "a,b", "--m", "1"],
    ["--backend", "triton_gemm", "--shape", "1024,4096", "--m", "0"],
    ["--backend", "triton_gemm", "--shape", "1024,4096"],  # --m is required
    ["--backend", "triton_gemm", "--shape", "1024,4096", "--m", "1", "--weights", "fp8"],  # split-K only
    ["--backend", "triton_splitk", "--shape", "1024,4096", "--m", "1", "--weights", "fp4"],
    ["--backend", "triton_splitk", "--shape", "1024,4096", "--m", "1", "--weights", "fp8", "--granularity", "b64"],
])
def test_sweep_configs_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        sweep_configs.parse_args(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--shape", "14336"], ["--shape", "0,4096"], ["--shape", "a,b"], ["--shape", "1,2,3"],
    ["--shape", "14336,4096", "--m", "0"], [],
])
def test_sweep_glu_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        sweep_glu.main(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


@pytest.mark.parametrize("m", [1, 8, 33])
def test_sweep_glu_times_its_grid_and_the_default(m):
    """The sweep times every grid row that fits (at decode M all of them) with the M's row tile,
    plus the default config."""
    found = sweep_glu.configs(m, 14336, 4096)
    shapes = {(c.block_n, c.block_k * 2, c.num_warps, c.num_stages) for c in found}
    fitting = [g for g in sweep_glu.GRID
               if triton_glu.TritonGluConfig(max(16, 1 << (m - 1).bit_length()), g[0], g[1] // 2, g[2], g[3])
               .supports(m, 14336, 4096, torch.bfloat16)[0]]
    assert set(fitting) <= shapes and len(fitting) >= 4
    if m <= 16:
        assert len(fitting) == len(sweep_glu.GRID)
    assert triton_glu.default_config(m, 14336, 4096, torch.bfloat16) in found
    assert all(c.block_m == max(16, 1 << (m - 1).bit_length()) for c in found)


def test_sweep_grid_is_the_one_the_committed_sweeps_timed():
    """perf/results/h200/logs/sweep_triton_*.txt: 105 tiled configs at 8b kv M = 1024, 294
    split-K configs per shape at M = 1."""
    tiled = sweep_configs.grid("triton_gemm", sweep_configs.problem(1024, 1024, 4096))
    assert len(tiled) == 105 and len(set(tiled)) == 105
    assert not any(c.persistent and c.split_k > 1 for c in tiled)
    for n, k in ((3584, 3584), (4608, 3584)):
        p = sweep_configs.problem(1, n, k)
        splitk = sweep_configs.grid("triton_splitk", p)
        assert len(splitk) == 294 and all(c.supports(p)[0] and c.block_m == 16 for c in splitk)
        assert not any(c.fused_reduce and c.split_k == 1 for c in splitk)


def test_sweep_configs_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sweep_configs.main(["--backend", "triton_gemm", "--shape", "64,64", "--m", "16"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ----------------------------------------------------------------------------- host_profile


def test_host_profile_arguments():
    a = host_profile.parse_args([])
    assert a.probes == list(host_profile.PROBES) and (a.m, a.n, a.k) == (16, 4096, 4096)
    a = host_profile.parse_args(["linear-step", "calls", "--m", "1", "--n", "256", "--k", "512"])
    assert a.probes == ["linear-step", "calls"] and (a.m, a.n, a.k) == (1, 256, 512)
    assert host_profile.parse_args(["hf-layer", "--batch", "8"]).batch == 8
    assert set(host_profile.RUN) == set(host_profile.PROBES)


@pytest.mark.parametrize("argv", [["nope"], ["calls", "--m", "0"], ["--k", "x"], ["hf-layer", "--batch", "0"]])
def test_host_profile_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        host_profile.parse_args(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_host_profile_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host_profile.main(["calls"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the timing loops


class _Graph:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)


def test_replay_interleaved_uploads_then_alternates(monkeypatch):
    log: list[str] = []
    clock = iter(range(100))
    monkeypatch.setattr(measure, "elapsed_ms", lambda fn: (fn(), float(next(clock)))[1])
    out = measure.replay_interleaved([_Graph("a", log), _Graph("b", log)], 3)
    assert log == ["a", "b"] + ["a", "b"] * 3  # one uncounted replay each, then rounds in order
    assert out == [[2.0, 4.0, 6.0], [3.0, 5.0, 7.0]]


def test_eager_rounds_warm_up_then_alternate(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    log: list[str] = []
    fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    res = timing.eager_time_interleaved(fns, calls=2, rounds=3, warmup=1)
    assert log == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert set(res) == {"a", "b"} and all(t.replays == 3 and t.median_us >= 0 for t in res.values())


def test_bench_moe_refuses_bad_arguments_and_needs_a_gpu(capsys):
    from hybridgemm.perf import bench_moe

    with pytest.raises(SystemExit):
        bench_moe.main(["--tokens", "0", "--out", "x.csv"])
    with pytest.raises(SystemExit):
        bench_moe.main(["--shapes", "gpt2", "--out", "x.csv"])
    if not torch.cuda.is_available():
        assert bench_moe.main(["--out", "x.csv"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
