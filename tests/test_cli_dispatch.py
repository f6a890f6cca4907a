"""The CLI and the dispatcher's decisions, on the CPU (no GPU work needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hybridgemm import dispatch
from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry
from hybridgemm.cli import main
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

SIG = {"schema": 1, "kernel_abi": 1, "gpu_name": "NVIDIA H200", "compute_capability": "9.0", "sm_count": 132,
       "cublaslt_version": 130100, "triton_version": "3.6.0", "torch_version": "2.11.0", "package_version": "0.1.0"}


def _problem(m, n=6144, k=4096):
    return Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True), ldx=k, ldw=k, ldo=n)


@pytest.fixture
def table_file(tmp_path):
    t = TuningTable(signature=SIG)
    rec = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 8, "num_warps": 4,
           "num_stages": 4}
    for m in (1, 16):
        t.set(TableKey.from_problem(_problem(m)), make_entry("triton_splitk", rec, median_us=12.5, spread_us=0.2,
                                                             flinear_us=16.9))
    path = tmp_path / "t.json"
    t.save(path)
    return path


def test_autotune_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    assert main(["autotune", "--model", "llama3-8b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_show_prints_entries(table_file, capsys):
    assert main(["show", str(table_file)]) == 0
    out = capsys.readouterr().out
    assert "linear|bf16|bias|N=6144|K=4096|M=16|c" in out and "triton_splitk" in out and "1.352x" in out


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

    assert hybridgemm.explain is dispatch.explain and "explain" in hybridgemm.__all__
    assert "M=3 N=48 K=40" in hybridgemm.explain((3, 40), (48, 40), torch.float16)


def test_explain_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="features"):
        dispatch.explain((4, 100), (8, 99))


def test_cli_bad_arguments():
    with pytest.raises(SystemExit):
        main(["explain", "--x", "a,b", "--w", "1,2"])
    with pytest.raises(SystemExit):
        main(["autotune", "--dtype", "int8"])


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "hybridgemm", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "autotune" in res.stdout


def test_cpu_linear_falls_back_to_torch():
    x, w, b = torch.randn(3, 5, 7), torch.randn(4, 7), torch.randn(4)
    for act in (None, "relu", "gelu", "gelu_tanh"):
        y = dispatch.fused_linear(x, w, b, act)
        ref = dispatch.torch_linear(x, w, b, Activation.parse(act))
        assert torch.equal(y, ref)
    with pytest.raises(TypeError, match="one dtype"):
        dispatch.fused_linear(x, w.double(), b)
    with pytest.raises(ValueError, match="unknown activation"):
        dispatch.fused_linear(x, w, b, "swish")


def test_table_document_is_json_only(table_file):
    doc = json.loads(table_file.read_text())
    assert set(doc) == {"schema", "signature", "entries"}
