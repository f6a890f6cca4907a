"""The M sweep (perf/bench_msweep.py) without a GPU: the M list, the shape dedupe across
presets, the summary's numbers on hand-made rows, the figure from a small CSV, and the
command lines' answer on a machine without a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import bench_cli
from hybridgemm.perf import bench_msweep as MS
from hybridgemm.perf.csvio import read_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"



# ----------------------------------------------------------------------------- M values


def test_log_spaced_m_count_range_and_spacing():
    ms = MS.m_values(points=64, random=0, m_max=16384)
    got = [m for m, s in ms if s == "log"]
    assert len(got) == len(ms)  # random=0: only log points
    assert got == sorted(set(got)) and got[0] == 1 and got[-1] == 16384
    assert all(1 <= m <= 16384 for m in got)
    # rounding merges neighbours below ~7 (1, 2, ..., 7 each once): 57 of the 64 remain
    assert len(got) == 57 and got[:7] == [1, 2, 3, 4, 5, 6, 7]
    # log spacing: above rounding noise, consecutive points are one geometric step apart
    step = math.log(16384) / 63
    big = [m for m in got if m >= 100]
    assert len(big) > 20
    for a, b in zip(big, big[1:]):
        assert abs(math.log(b / a) - step) < 0.01, (a, b)


def test_random_m_reproducible_disjoint_and_in_range():
    a = MS.m_values(points=64, random=64, seed=7, m_max=16384)
    assert a == MS.m_values(points=64, random=64, seed=7, m_max=16384)  # same seed, same M
    assert a != MS.m_values(points=64, random=64, seed=8, m_max=16384)
    log_set = {m for m, s in a if s == "log"}
    rnd = [m for m, s in a if s == "random"]
    assert not log_set & set(rnd) and len(rnd) == len(set(rnd))  # disjoint, no repeats
    assert 0 < len(rnd) <= 64 and all(1 <= m <= 16384 for m in rnd)
    assert [m for m, _ in a] == sorted(m for m, _ in a)
    assert len(log_set) == 57  # the random ones never displace log points
    # log-uniform: about as many below sqrt(m_max) = 128 as above it (64 draws; loose bounds)
    assert 10 <= sum(m < 128 for m in rnd) and 10 <= sum(m > 128 for m in rnd)
    # the draws themselves follow the seed: the same as drawing by hand with numpy
    hand = np.rint(np.exp(np.random.default_rng(7).uniform(0, math.log(16384), 64))).astype(int)
    assert set(rnd) == {int(m) for m in hand} - log_set


def test_m_values_edges_and_bad_arguments():
    assert MS.m_values(points=5, random=3, m_max=1) == [(1, "log")]
    assert MS.m_values(points=0, random=0) == []
    only_random = MS.m_values(points=0, random=16, seed=1, m_max=1000)
    assert only_random and all(s == "random" and 1 <= m <= 1000 for m, s in only_random)
    for bad in (dict(m_max=0), dict(points=-1), dict(random=-2)):
        with pytest.raises(ValueError):
            MS.m_values(**bad)


def test_quick_and_default_arguments(tmp_path):
    a = MS.parse_args(["--out", str(tmp_path)])
    assert (a.points, a.random, a.placements, a.replays, a.m_max, a.dtype, a.model) == (64, 64, 2, 3, 16384, "bf16",
                                                                                       None)
    q = MS.parse_args(["--out", str(tmp_path), "--quick", "--model", "Llama3_8B"])
    assert (q.placements, q.replays) == (1, 3) and q.points < 64 and q.random < 64 and q.model == ["llama3-8b"]
    for bad in (["--out", "d", "--model", "gpt-9"], ["--out", "d", "--m-max", "0"], ["--out", "d", "--points", "0",
                "--random", "0"], []):
        with pytest.raises(SystemExit):
            MS.parse_args(bad)


# ----------------------------------------------------------------------------- shapes


def test_shapes_shared_by_presets_are_one_row_set_with_every_name():
    shapes = MS.sweep_shapes(["llama3-8b", "mistral-7b"])
    assert [(s.n, s.k, s.bias) for s in shapes] == [(4096, 4096, False), (1024, 4096, False), (6144, 4096, False)]
    assert all(s.models == ("llama3-8b", "mistral-7b") for s in shapes)
    assert [s.projections for s in shapes] == [("q", "o"), ("kv",), ("qkv",)]
    assert shapes[0].label == "4096 x 4096 — llama3-8b, mistral-7b"


def by_key_models(shapes, key) -> tuple[str, ...]:
    return next(s.models for s in shapes if (s.n, s.k, s.bias) == key)


def test_all_presets_deduplicated_bias_kept_apart():
    shapes = MS.sweep_shapes()
    keys = [(s.n, s.k, s.bias) for s in shapes]
    assert len(keys) == len(set(keys)) == 49
    # ernie4.5-0.3b's (16 heads of 128 over 1024, 2 KV heads): q, k/v, Q/K/V and o shapes of its own
    assert [s.models for s in shapes if (s.n, s.k) in ((2048, 1024), (256, 1024), (2560, 1024), (1024, 2048))] \
        == [("ernie4.5-0.3b",)] * 4
    # falcon-7b's (71 heads of 64 over 4544, one KV head): q and o one shape, k/v and Q/K/V their own
    assert by_key_models(shapes, (4544, 4544, False)) == by_key_models(shapes, (64, 4544, False)) \
        == by_key_models(shapes, (4672, 4544, False)) == ("falcon-7b",)
    # gemma3-4b's (8 heads of 256 over 2560, 4 KV heads): q, k/v, Q/K/V and o shapes of its own
    assert [s.models for s in shapes if (s.n, s.k) in ((2048, 2560), (1024, 2560), (4096, 2560), (2560, 2048))] \
        == [("gemma3-4b",)] * 4
    # pythia-6.9b's (32 heads of 128 over 4096, no GQA, biases throughout): q, k/v and o one shape, its Q/K/V
    assert by_key_models(shapes, (12288, 4096, True)) == ("pythia-6.9b",)
    # glm4-9b's and glm4-9b-0414's (32 heads of 128 over 4096, 2 KV heads, q/k/v biases): q pythia-6.9b's biased
    # one, k/v and Q/K/V their own, o (no bias) llama3-8b's
    assert by_key_models(shapes, (4096, 4096, True)) == ("glm4-9b", "glm4-9b-0414", "pythia-6.9b")
    assert by_key_models(shapes, (256, 4096, True)) == by_key_models(shapes, (4608, 4096, True)) \
        == ("glm4-9b", "glm4-9b-0414")
    # stablelm-3b's (32 heads of 80 over 2560, no GQA): q, k/v and o one shape, its Q/K/V 7680 rows;
    # stablelm-2-1.6b's q/k/v carry biases (o none): its 2048 x 2048 twice, apart
    assert by_key_models(shapes, (7680, 2560, False)) == ("stablelm-3b",)
    assert by_key_models(shapes, (2048, 2048, True)) == ("stablelm-2-1.6b",)
    # smollm3-3b's (16 heads of 128 over 2048, 4 KV heads): q and o stablelm-2-1.6b's without its bias, k/v
    # qwen3-30b-a3b's, its Q/K/V 3072 rows of its own
    assert by_key_models(shapes, (2048, 2048, False)) == ("smollm3-3b", "stablelm-2-1.6b")
    assert by_key_models(shapes, (512, 2048, False)) == ("smollm3-3b", "qwen3-30b-a3b")
    assert by_key_models(shapes, (3072, 2048, False)) == ("smollm3-3b",)
    # olmo2-7b's and olmo3-7b's (32 heads of 128 over 4096, no GQA): their Q/K/V 12288 rows over 4096 (q, k/v and
    # o are llama's o)
    assert by_key_models(shapes, (12288, 4096, False)) == ("olmo2-7b", "olmo3-7b")
    # gemma-7b's attention (16 heads of 256 over 3072, no GQA): q, k/v and o shapes of its own
    assert by_key_models(shapes, (4096, 3072, False)) == ("gemma-7b",)
    # qwen3-30b-a3b's attention (32 heads of 128 over 2048) is a shape set of its own; mixtral's is llama3-8b's
    assert by_key_models(shapes, (5120, 2048, False)) == ("qwen3-30b-a3b",)
    assert by_key_models(shapes, (6144, 4096, False)) == ("llama3-8b", "mistral-7b", "qwen3-8b", "granite-8b",
                                                          "ministral-8b", "ministral3-8b", "aya-23-8b", "mixtral-8x7b")
    # phi3-mini's (32 heads of 96 over 3072, no GQA): q, k/v and o one 3072 x 3072 shape, its Q/K/V 9216 rows
    assert by_key_models(shapes, (3072, 3072, False)) == ("phi3-mini", "phi4-mini")
    assert by_key_models(shapes, (9216, 3072, False)) == ("phi3-mini",)
    # phi4-mini's (24 heads of 128 over 3072, 8 KV heads): its k/v and Q/K/V shapes of its own
    assert by_key_models(shapes, (1024, 3072, False)) == by_key_models(shapes, (5120, 3072, False)) == ("phi4-mini",)
    # gemma2-9b's (16 heads of 256 over 3584, 8 KV heads): four shapes of its own
    assert [s.models for s in shapes if (s.n, s.k) in ((4096, 3584), (2048, 3584), (8192, 3584), (3584, 4096))] \
        == [("gemma2-9b",)] * 4
    by_key = {(s.n, s.k, s.bias): s for s in shapes}
    assert by_key[(768, 768, True)].models == ("bert-base", "gpt2")
    assert by_key[(768, 768, True)].projections == ("q", "kv", "o")
    # qwen2.5's q (with bias) and o (without) share N x K but are different problems
    assert by_key[(3584, 3584, True)].projections == ("q",) and by_key[(3584, 3584, False)].projections == ("o",)
    assert by_key[(768, 768, True)].label == "768 x 768 (+bias) — bert-base, gpt2"


def test_gpu_label():
    assert MS.gpu_label("NVIDIA H200") == "h200" and MS.gpu_label("NVIDIA H200 NVL") == "h200"
    assert MS.gpu_label("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"
    assert MS.gpu_label("???") == "gpu"


# ----------------------------------------------------------------------------- summary


def _hand_rows():
    """Two shapes; A's rows as CSV text, B's as numbers, one row without a time."""
    a = dict(models="llama3-8b;mistral-7b", projection="kv", n="1024", k="4096", bias="False", dtype="bf16")
    b = dict(models="bert-base;gpt2", projection="q/kv/o", n=768, k=768, bias=True, dtype="bf16")
    return [
        dict(a, m="1", sample="log", speedup="2.0"),
        dict(a, m="8", sample="random", speedup="0.5"),
        dict(a, m="100", sample="log", speedup="1.0"),
        dict(a, m="20", sample="random", speedup="1.0"),
        dict(b, m=1, sample="log", speedup=4.0),
        dict(b, m=16, sample="log", speedup=0.25),
        dict(b, m=5000, sample="random", speedup=0.96),
        dict(b, m=64, sample="log", speedup=""),  # not measured: counted apart, in no mean
    ]


def test_summarize_hand_computed():
    s = MS.summarize(_hand_rows())
    assert s["rows"] == 7 and s["unmeasured"] == 1
    assert s["min"] == {"speedup": 0.25, "shape": "768 x 768 (+bias) — bert-base, gpt2", "m": 16}
    # all: 2 * 0.5 * 1 * 1 * 4 * 0.25 * 0.96 = 0.96 over 7 rows
    assert s["geomean_all"] == pytest.approx(0.96 ** (1 / 7), rel=1e-12)
    # sample=log: 2 * 1 * 4 * 0.25 = 2 over 4 rows
    assert s["n_log"] == 4 and s["geomean_log"] == pytest.approx(2 ** (1 / 4), rel=1e-12)
    # M <= 16: 2 * 0.5 * 4 * 0.25 = 1 over 4 rows (A's M=1, 8; B's M=1, 16)
    assert s["n_small_m"] == 4 and s["geomean_small_m"] == pytest.approx(1.0, rel=1e-12)
    assert s["below"] == 3  # 0.5, 0.25 and 0.96 are under 0.97
    (sa, sb) = s["shapes"]
    assert sa["shape"] == "1024 x 4096 — llama3-8b, mistral-7b" and sb["shape"].startswith("768 x 768 (+bias)")
    assert (sa["rows"], sa["min"], sa["min_m"]) == (4, 0.5, 8) and sa["geomean"] == pytest.approx(1.0, rel=1e-12)
    assert (sb["rows"], sb["min"], sb["min_m"]) == (3, 0.25, 16)
    assert sb["geomean"] == pytest.approx(0.96 ** (1 / 3), rel=1e-12)
    text = "\n".join(MS.summary_lines(s))
    assert "minimum speedup: 0.250x at M=16 (768 x 768 (+bias) — bert-base, gpt2)" in text
    assert "rows below 0.97x: 3" in text and "1024 x 4096 — llama3-8b, mistral-7b" in text


def test_summarize_without_rows():
    s = MS.summarize([])
    assert s["rows"] == 0 and s["min"] is None and math.isnan(s["geomean_all"]) and s["below"] == 0
    assert MS.summary_lines(s)[-1] == "no measured rows"


def test_csv_round_trip_keeps_the_summary(tmp_path):
    rows = [dict(r, m=int(r["m"]), speedup=float(r["speedup"] or "nan")) for r in _hand_rows()]
    path = tmp_path / "m_sweep_h200.csv"
    MS.write_csv(path, rows)
    back = read_rows(str(path))
    assert list(back[0]) == list(MS.COLUMNS) and len(back) == len(rows)
    assert MS.summarize(back) == MS.summarize(_hand_rows())


def test_run_sweep_bookkeeping_with_a_fake_measurement(monkeypatch):
    """The check runs once per shape at the swept M closest to 333; failures are collected;
    rows are handed to on_shape after each shape."""
    calls = []

    def fake(shape, m, sample, dtype, placements, replays, check=False, extra=None, fp8=None, read_us=math.nan):
        calls.append((shape.n, m, check))
        bad = check and shape.n == 512
        return {**(extra or {}), "n": shape.n, "m": m, "sample": sample, "speedup": 1.0, "flinear_us": 2.0,
                "dispatched_us": 2.0, "backend": "cublaslt", "source": "table", "range": "",
                "check": ("FAILED (rel err 1e-01 > 3e-03)" if bad else "ok (rel err 1e-03 <= 3e-03)") if check else ""}

    monkeypatch.setattr(MS, "measure_point", fake)
    shapes = [MS.SweepShape(1024, 4096, False, ("m",), ("kv",)), MS.SweepShape(512, 3584, True, ("q",), ("kv",))]
    saved = []
    res = MS.run_sweep(shapes, [(1, "log"), (300, "random"), (4000, "log")], progress=False, log=lambda s: None,
                       on_shape=lambda rows: saved.append(len(rows)))
    assert [c for c in calls if c[2]] == [(1024, 300, True), (512, 300, True)]
    assert len(res.rows) == 6 and saved == [3, 6]
    assert len(res.failed) == 1 and "512 x 3584 (+bias)" in res.failed[0] and "M=300" in res.failed[0]


# ----------------------------------------------------------------------------- figure


def _fixture_csv(path):
    rows = []
    for n, k, bias, models, base in ((1024, 4096, False, "llama3-8b;mistral-7b", 1.1),
                                      (768, 768, True, "bert-base;gpt2", 0.99)):
        for i, m in enumerate((1, 3, 17, 100, 333, 2048, 16384)):
            sp = base + 0.03 * math.sin(i)
            rows.append(dict(models=models, projection="kv", n=n, k=k, bias=bias, dtype="bf16", m=m,
                             sample="log" if i % 2 == 0 else "random", dispatched_us=10.0 / sp, flinear_us=10.0,
                             speedup=sp, backend="cublaslt", source="table", range="", validated_worst="",
                             placements=2, replays=3, date="2025-01-01", commit="abc1234"))
    MS.write_csv(path, rows)
    return path


def test_plot_m_sweep_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from hybridgemm.perf.plots_models import plot_m_sweep

    csv_path = _fixture_csv(tmp_path / "m_sweep_h200.csv")
    out = plot_m_sweep(csv_path, tmp_path / "figs")
    assert out == tmp_path / "figs" / "m_sweep.png" and out.is_file()
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000


def test_plot_m_sweep_clear_errors(tmp_path):
    pytest.importorskip("matplotlib")
    from hybridgemm.perf.plots_models import plot_m_sweep

    with pytest.raises(FileNotFoundError, match="no such CSV file"):
        plot_m_sweep(tmp_path / "nope.csv", tmp_path)
    empty = tmp_path / "m_sweep_x.csv"
    MS.write_csv(empty, [])
    with pytest.raises(ValueError, match="no rows with an M and a speedup"):
        plot_m_sweep(empty, tmp_path)


# ----------------------------------------------------------------------------- command lines without a GPU


def test_bench_m_sweep_without_gpu_says_so_and_returns_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cli("bench", "--m-sweep", "--out", str(tmp_path / "r.csv")) == 2
    err = capsys.readouterr().err
    assert "hybridgemm bench --m-sweep: needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_bench_m_sweep_rejects_bad_model_and_shape(capsys):
    assert bench_cli("bench", "--m-sweep", "--model", "gpt-9") == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert bench_cli("bench", "--m-sweep", "--shape", "64,32") == 2
    assert "--shape is not supported" in capsys.readouterr().err


def test_module_main_without_gpu_returns_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert MS.main(["--out", str(tmp_path), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_a_row_under_the_retime_bar_is_timed_again_and_pooled(monkeypatch):
    """A slow-looking row gets RETIME_PLACEMENTS more placements on fresh operands, and its
    speedup is the median over every round of both timings; a row above the bar is timed once."""
    calls = []

    def fake_pair(p, dtype, placements, replays, check):
        calls.append(placements)
        first = len(calls) == 1
        # first timing: dispatched at 1/0.96 of F.linear's time; second: at 1/1.0, five rounds
        return ([10.0] * 3, [1 / 0.96] * 3, "", 0) if first else ([10.0] * 5, [1.0] * 5, "", 0)

    monkeypatch.setattr(MS, "_time_pair", fake_pair)
    monkeypatch.setattr(MS, "_choice_columns", lambda p: {"backend": "torch", "source": "table", "range": "1-1",
                                                          "validated_worst": 1.0})
    shape = MS.sweep_shapes(["llama3-8b"])[0]
    row = MS.measure_point(shape, 300, "log", placements=2, replays=3)
    assert calls == [2, MS.RETIME_PLACEMENTS] and row["retimed"] is True
    assert row["placements"] == 2 + MS.RETIME_PLACEMENTS
    assert row["speedup"] == pytest.approx(1.0)  # median of 3 x (1/0.96) and 5 x 1.0 ratios: 1.0
    calls.clear()
    monkeypatch.setattr(MS, "_time_pair", lambda *a: (calls.append(a[2]), ([10.0] * 3, [1 / 1.1] * 3, "", 0))[1])
    row = MS.measure_point(shape, 300, "log", placements=2, replays=3)
    assert calls == [2] and row["retimed"] is False and row["speedup"] == pytest.approx(1.1)


# ----------------------------------------------------------------------------- FP8 columns


def test_fp8_options(tmp_path, capsys):
    a = MS.parse_args(["--out", str(tmp_path)])
    assert (a.weights, a.granularity) == ("bf16", None)
    a = MS.parse_args(["--out", str(tmp_path), "--weights", "fp8"])
    assert (a.weights, a.granularity) == ("fp8", "channel")
    a = MS.parse_args(["--out", str(tmp_path), "--weights", "fp8", "--granularity", "block128", "--dtype", "fp16"])
    assert (a.weights, a.granularity, a.dtype) == ("fp8", "block128", "fp16")
    for bad, words in ((["--granularity", "block128"], "--granularity: only with --weights fp8"),
                       (["--weights", "fp8", "--dtype", "fp32"], "computes in bf16 or fp16, not fp32")):
        with pytest.raises(SystemExit):
            MS.parse_args(["--out", str(tmp_path), *bad])
        assert words in capsys.readouterr().err


def test_bench_m_sweep_passes_the_fp8_options_on(monkeypatch, capsys, tmp_path):
    from hybridgemm.perf import cli_commands

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli_commands, "m_sweep_main", lambda argv: seen.append(argv) or 0)
    assert bench_cli("bench", "--m-sweep", "--model", "llama3-8b", "--out", str(tmp_path) + "/",
                     "--weights", "fp8", "--granularity", "block128") == 0
    assert seen[-1] == ["--out", str(tmp_path) + "/", "--dtype", "bf16", "--model", "llama3-8b", "--weights", "fp8",
                        "--granularity", "block128"]
    for argv, words in ((["--granularity", "channel"], "--granularity: only with --weights fp8"),
                        (["--weights", "fp8", "--dtype", "fp32"],
                         "--weights fp8: an FP8 weight computes in bf16 or fp16")):
        assert bench_cli("bench", "--m-sweep", *argv) == 2
        err = capsys.readouterr().err
        assert f"hybridgemm bench --m-sweep: {words}" in err and len(err.strip().splitlines()) == 1
    assert len(seen) == 1


def test_fp8_columns_from_the_rounds():
    # FP8 call at 0.5, 0.4, 0.6 of F.linear's time in three rounds of 10, 12, 11 µs
    cols = MS.fp8_columns([10.0, 12.0, 11.0], [0.5, 0.4, 0.6], "ok (rel err ...)", "triton_splitk", "block128", 4.4)
    assert cols["fp8_weights"] == "e4m3_block128" and cols["fp8_backend"] == "triton_splitk"
    assert cols["fp8_us"] == pytest.approx(0.5 * 11.0) and cols["fp8_speedup"] == pytest.approx(2.0)
    assert cols["fp8_read_us"] == 4.4 and cols["fp8_of_read"] == pytest.approx(4.4 / 5.5)


def test_measure_point_times_the_fp8_call_only_when_asked(monkeypatch):
    fp8_calls = []
    monkeypatch.setattr(MS, "_time_pair", lambda *a: ([10.0] * 3, [1 / 1.1] * 3, "", 0))
    monkeypatch.setattr(MS, "_choice_columns", lambda p: {"backend": "torch", "source": "rule", "range": "",
                                                          "validated_worst": ""})

    def fake_fp8(p, dtype, granularity, placements, replays, check):
        fp8_calls.append((p.m, p.n, p.k, dtype, granularity, placements, check))
        return [10.0] * 3, [0.5] * 3, "ok (rel err 1e-03 <= 3e-03)" if check else "", "triton_splitk"

    monkeypatch.setattr(MS, "_time_fp8", fake_fp8)
    shape = MS.SweepShape(1024, 4096, False, ("llama3-8b",), ("kv",))
    row = MS.measure_point(shape, 7, "log", placements=2, replays=3)
    assert not fp8_calls and "fp8_us" not in row
    row = MS.measure_point(shape, 7, "log", placements=2, replays=3, check=True, fp8="channel", read_us=4.0)
    assert fp8_calls == [(7, 1024, 4096, "bf16", "channel", 2, True)]
    assert row["speedup"] == pytest.approx(1.1) and row["fp8_speedup"] == pytest.approx(2.0)
    assert row["fp8_us"] == pytest.approx(5.0) and row["fp8_of_read"] == pytest.approx(0.8)
    assert row["fp8_check"].startswith("ok") and row["fp8_weights"] == "e4m3_channel"
    assert set(row) <= set(MS.COLUMNS)


def test_run_sweep_times_the_read_ceiling_once_per_shape_and_collects_fp8_failures(monkeypatch):
    reads, lines = [], []
    monkeypatch.setattr(MS, "fp8_read_us", lambda shape, g, dtype: reads.append((shape.n, g, dtype)) or 3.0)

    def fake(shape, m, sample, dtype, placements, replays, check=False, extra=None, fp8=None, read_us=math.nan):
        assert read_us == 3.0
        return {"n": shape.n, "m": m, "sample": sample, "speedup": 1.0, "flinear_us": 2.0, "dispatched_us": 2.0,
                "backend": "cublaslt", "source": "table", "range": "", "check": "",
                **MS.fp8_columns([2.0], [1.5], "FAILED (rel err 1e-01 > 3e-03)" if check else "", "triton_splitk",
                                 fp8, read_us)}

    monkeypatch.setattr(MS, "measure_point", fake)
    shapes = [MS.SweepShape(1024, 4096, False, ("m",), ("kv",)), MS.SweepShape(512, 3584, True, ("q",), ("kv",))]
    res = MS.run_sweep(shapes, [(1, "log"), (300, "random"), (4000, "log")], progress=False, log=lines.append,
                       fp8="channel")
    assert reads == [(1024, "channel", "bf16"), (512, "channel", "bf16")]
    assert len(res.rows) == 6 and len(res.failed) == 2 and all("M=300 fp8: FAILED" in f for f in res.failed)
    assert "e4m3_channel" in lines[0] and "of its read ceiling" in lines[0]


def test_fp8_summary_hand_computed():
    base = dict(models="llama3-8b", n=1024, k=4096, bias=False, fp8_weights="e4m3_channel")
    rows = [dict(base, m=1, fp8_speedup=2.0, fp8_of_read=0.8), dict(base, m=16, fp8_speedup=0.5, fp8_of_read=0.5),
            dict(base, m=300, fp8_speedup=4.0, fp8_of_read=0.1),
            dict(base, m=2, fp8_speedup="", fp8_of_read=""),  # not measured
            dict(base, m=1, speedup=1.2)]  # a row without FP8 columns
    text = "\n".join(MS.fp8_summary_lines(rows))
    # all three: 2 * 0.5 * 4 = 4 -> 4^(1/3); M <= 16: 2 * 0.5 = 1 -> 1.000x; of read 0.8 * 0.5 = 0.4 -> 63.2%
    assert f"geomean {4 ** (1 / 3):.3f}x over 3 rows; 1.000x over the 2 rows with M ≤ 16" in text
    assert f"geomean {0.4 ** 0.5:.1%}, lowest 50.0% at M=16 (1024 x 4096 — llama3-8b)" in text
    assert MS.fp8_summary_lines([dict(base, m=1, speedup=1.0, fp8_weights="")]) == []
