"""The CLI and the dispatcher's decisions, on the CPU (no GPU work needed)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest
import torch

from hybridgemm import dispatch, explain
from hybridgemm.autotune_cache import signature, tune_table
from hybridgemm.autotune_cache.table import HybridGemmTableWarning, TableKey, TuningTable, make_entry
from hybridgemm.cli import main
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

SIG = {"schema": 2, "kernel_abi": 1, "gpu_name": "NVIDIA H200", "compute_capability": "9.0", "sm_count": 132,
       "cublaslt_version": 130100, "triton_version": "3.6.0", "torch_version": "2.11.0", "package_version": "0.1.0"}
REC = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 8, "num_warps": 4,
       "num_stages": 4}


def _problem(m, n=6144, k=4096):
    return Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True), ldx=k, ldw=k, ldo=n)


@pytest.fixture
def table_file(tmp_path):
    t = TuningTable(signature=SIG)
    t.set(TableKey.from_problem(_problem(1)), make_entry("triton_splitk", REC, m_points=[1], ratios=[1.5],
                                                         median_us=10.0, spread_us=0.2, flinear_us=15.0))
    t.set(TableKey.from_problem(_problem(16)), make_entry("triton_splitk", REC, m_points=[9, 12, 16],
                                                          ratios=[1.41, 1.352, 1.5], median_us=12.5, spread_us=0.2,
                                                          flinear_us=16.9))
    path = tmp_path / "t.json"
    t.save(path)
    return path


def test_autotune_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    assert main(["autotune", "--model", "llama3-8b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_show_prints_ranges_worst_ratios_and_points(table_file, capsys):
    assert main(["show", str(table_file)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{table_file}: 2 entries; GPU NVIDIA H200, cuBLASLt 130100, Triton 3.6.0")
    assert "worst" in out and "timed at M" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("linear|")]
    assert rows == [  # key, backend, µs at the top point, F.linear µs, worst ratio, the points timed; lowest M first
        ["linear|bf16|bias|N=6144|K=4096|M=1-1|c", "triton_splitk", "10.00", "15.00", "1.500x", "1"],
        ["linear|bf16|bias|N=6144|K=4096|M=9-16|c", "triton_splitk", "12.50", "16.90", "1.352x", "9,12,16"],
    ]


def test_show_reads_a_schema_1_table_as_one_m_ranges(tmp_path, capsys):
    path = tmp_path / "v1.json"
    v1 = {"backend": "cublaslt", "config": {}, "candidates": [], "median_us": 10.0, "spread_us": 0.1,
          "tuned_at": "2025-06-01"}
    path.write_text(json.dumps({"schema": 1, "signature": {**SIG, "schema": 1}, "entries": {
        "linear|bf16|bias|N=6144|K=4096|M=16|c": {**v1, "flinear_us": 12.0},
        "linear|bf16|bias|N=6144|K=4096|M=64|c": v1}}))  # no ratio recorded: dropped
    with pytest.warns(HybridGemmTableWarning, match="schema-1"):
        assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: 1 entries;" in out
    assert [line.split() for line in out.splitlines() if line.strip().startswith("linear|")] == [
        ["linear|bf16|bias|N=6144|K=4096|M=16-16|c", "cublaslt", "10.00", "12.00", "1.200x", "16"]]


def test_show_of_a_corrupt_table_named_explicitly_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{"schema": 2, "signature": ')
    assert main(["show", str(path)]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridgemm show: error: {path}: ") and "not valid JSON" in err[0]
    assert "linear|" not in captured.out and "Traceback" not in captured.err


def test_show_missing_file(tmp_path, capsys):
    assert main(["show", str(tmp_path / "nope.json")]) == 1


def test_explain_on_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU explanation")
    assert main(["explain", "--x", "2,8,4096", "--w", "6144,4096"]) == 0
    out = capsys.readouterr().out
    assert "M=16 N=6144 K=4096" in out and "PyTorch" in out


def test_explain_is_exported_at_top_level():
    import hybridgemm

    # the function of fusion/explain.py, whose module the package attribute shadows
    assert hybridgemm.explain is importlib.import_module("hybridgemm.explain").explain
    assert "explain" in hybridgemm.__all__
    assert "M=3 N=48 K=40" in hybridgemm.explain((3, 40), (48, 40), torch.float16)


def test_explain_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="features"):
        explain((4, 100), (8, 99))


def test_cli_bad_arguments():
    with pytest.raises(SystemExit):
        main(["explain", "--x", "a,b", "--w", "1,2"])
    with pytest.raises(SystemExit):
        main(["autotune", "--dtype", "int8"])
    with pytest.raises(SystemExit):  # gone: every candidate is timed in one process now
        main(["autotune", "--shape", "384,512", "--one-process"])
    with pytest.raises(SystemExit):
        main(["autotune", "--shape", "384,512", "--m", "1.5"])
    with pytest.raises(SystemExit):
        main(["autotune", "--shape", "384,512", "--split-depth", "one"])


@pytest.fixture
def fake_gpu_autotune(monkeypatch, tmp_path):
    """`hybridgemm autotune` as on a GPU machine, with the tuner and the checker replaced by
    recorders: ``calls`` receives (what, keys, keywords)."""
    calls = []

    def fake_tune(keys, table, path, **kw):
        calls.append(("tune", list(keys), kw))
        return []

    def fake_check(table, keys=None, log=print):
        keys = list(keys)
        calls.append(("check", keys, {}))
        return [{"status": "ok"}] + [{"status": "slower"}] * (len(keys) - 1)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: dict(SIG))
    monkeypatch.setattr(tune_table, "tune", fake_tune)
    monkeypatch.setattr(tune_table, "check_table", fake_check)
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    return calls


def test_autotune_m_selects_the_ranges_holding_each_m(fake_gpu_autotune, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["autotune", "--shape", "384,512", "--m", "300", "1", "16384", "257", "512", "3",
                 "--out", str(out), "--split-depth", "2", "--no-progress"]) == 0
    [(what, keys, kw)] = fake_gpu_autotune
    assert what == "tune" and kw["split_depth"] == 2 and kw["force"] is False
    assert [k.to_string() for k in keys] == [
        "linear|bf16|bias|N=384|K=512|M=1-1|c", "linear|bf16|bias|N=384|K=512|M=3-4|c",
        "linear|bf16|bias|N=384|K=512|M=257-512|c", "linear|bf16|bias|N=384|K=512|M=8193-16384|c"]
    assert f"tuning 4 M ranges (1 shapes x 4 ranges x 1 dtypes; 0 already covered) into {out}" in (
        capsys.readouterr().out)


def test_autotune_counts_ranges_already_covered(fake_gpu_autotune, tmp_path, capsys):
    out = tmp_path / "t.json"
    t = TuningTable(SIG)
    base = TableKey("linear", "bf16", "bias", 384, 512, 257, 363)
    t.set(base, make_entry("torch", {}, m_points=[257, 363], ratios=[1, 1], median_us=5, spread_us=0))
    t.set(base.with_range(364, 512), make_entry("torch", {}, m_points=[364, 512], ratios=[1, 1], median_us=5,
                                                spread_us=0))
    t.set(base.with_range(513, 700), make_entry("torch", {}, m_points=[513, 700], ratios=[1, 1], median_us=5,
                                                spread_us=0))
    t.save(out)
    assert main(["autotune", "--shape", "384,512", "--m", "300", "600", "--out", str(out), "--no-progress"]) == 0
    # 257-512 is covered by its two halves; 513-1024 only up to 700
    assert "tuning 2 M ranges (1 shapes x 2 ranges x 1 dtypes; 1 already covered)" in capsys.readouterr().out
    # --check re-times the entries overlapping the asked ranges, whatever their own ranges
    assert main(["autotune", "--shape", "384,512", "--m", "300", "600", "--out", str(out), "--check"]) == 1
    what, keys, _ = fake_gpu_autotune[-1]
    assert what == "check" and [(k.m_lo, k.m_hi) for k in keys] == [(257, 363), (364, 512), (513, 700)]
    assert f"checked 3 entries of {out}: 2 slower by more than 5% or rejected" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--m", "0"], "--m takes values of M in 1..16384, got [0]"),
    (["--m", "16", "16385", "-4"], "--m takes values of M in 1..16384, got [16385, -4]"),
    (["--split-depth", "-1"], "--split-depth must be 0 or more"),
])
def test_autotune_rejects_bad_m_and_split_depth(fake_gpu_autotune, tmp_path, capsys, argv, message):
    assert main(["autotune", "--shape", "384,512", "--out", str(tmp_path / "t.json"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert fake_gpu_autotune == [] and not (tmp_path / "t.json").exists()


def test_autotune_reports_a_bad_m_before_asking_for_a_gpu(capsys):
    """On a machine without a GPU, a bad --m is still named (not hidden behind 'needs a GPU')."""
    assert main(["autotune", "--shape", "384,512", "--m", "0"]) == 2
    err = capsys.readouterr().err
    assert "--m takes values of M in 1..16384, got [0]" in err and "GPU" not in err


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "hybridgemm", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "autotune" in res.stdout


def test_cpu_linear_falls_back_to_torch():
    x, w, b = torch.randn(3, 5, 7), torch.randn(4, 7), torch.randn(4)
    for act in (None, "relu", "gelu", "gelu_tanh"):
        y = dispatch.fused_linear(x, w, b, act)
        ref = dispatch.torch_linear(x, w, b, Activation.parse(act))
        assert torch.equal(y, ref)
    with pytest.raises(RuntimeError, match="one dtype"):  # F.linear's error type (hybridgemm.LinearArgumentError)
        dispatch.fused_linear(x, w.double(), b)
    with pytest.raises(ValueError, match="unknown activation"):
        dispatch.fused_linear(x, w, b, "swish")


def test_table_document_is_json_only(table_file):
    doc = json.loads(table_file.read_text())
    assert set(doc) == {"schema", "signature", "entries"} and doc["schema"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(TuningTable.load(table_file, SIG, strict=True)) == 2
