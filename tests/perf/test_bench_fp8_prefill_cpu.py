"""perf/bench_fp8_prefill.py without a GPU: its command line's answers and its summary lines."""

from __future__ import annotations

import pytest

from hybridgemm.perf import bench_fp8_prefill as B


def test_cli_without_a_gpu_and_bad_arguments(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "fp8.csv")
    monkeypatch.setattr(B.torch.cuda, "is_available", lambda: False)
    assert B.main(["--out", out]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    for argv, words in [(["--m", "0"], "at least 1"), (["--shapes", "4096"], "N,K"),
                        (["--shapes", "4096,0"], "N,K"), (["--dtype", "fp32"], "invalid choice")]:
        with pytest.raises(SystemExit) as e:
            B.main([*argv, "--out", out])
        assert e.value.code == 2 and words in capsys.readouterr().err, argv
    assert not (tmp_path / "fp8.csv").exists()


def test_summary_lines():
    row = dict(shape="llama3-8b.o", M=2048, provider="fp8_cublaslt_channel", status="ok", median_us=100.0,
               tflops=687.2, speedup_vs_flinear=1.5, rel_err="3.1e-02")
    assert "1.500x F.linear" in B._summary(row) and "687.2 TFLOP/s" in B._summary(row)
    skipped = dict(row, status="skipped", note="compute capability 8.9: ... Hopper (9.0) only")
    del skipped["median_us"]
    assert "Hopper" in B._summary(skipped)
    assert B.shape_arg("6144,4096") == (6144, 4096)
