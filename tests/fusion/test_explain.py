"""``explain`` (fusion/explain.py) on the CPU: as it answers on a GPU machine (CUDA faked, an
H200's tables: only the decision runs, no kernel), on a machine without CUDA, and the errors
its arguments get.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from fake_device import CALL, GEMM_RECORD, H200_LIMITS, tuned
from fake_device import save_table as _save

from hybridgemm import decide, explain, mode_state
from hybridgemm.autotune_cache.table import TableKey
from hybridgemm.kernels import backends


@pytest.fixture
def fake_cuda(devices_asked, monkeypatch):
    """``torch.cuda`` as explain sees it on a one-GPU machine whose current device is 5."""
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "device", device)
    return devices_asked, entered


def test_explain_a_miss(fake_cuda):
    asked, entered = fake_cuda
    text = explain((16, 512), (384, 512), "bf16", bias=True)
    assert text == (f"linear bf16 M=16 N=384 K=512 epilogue=bias\n  key {CALL}\n"
                    "  runs torch (rule: no table entry holds this M; F.linear)")
    assert asked == [5] and entered == [5]  # the current device when none is named
    explain((16, 512), (384, 512), "bf16", device=2)
    assert asked == [5, 2] and entered == [5, 2]


def test_explain_a_hit_with_an_activation(fake_cuda, fake_h200):
    relu = TableKey("linear", "bf16", "bias+relu", 384, 512, 9, 16, "c")
    decide.set_table_path(_save(fake_h200 / "relu.json", {relu: tuned("triton_gemm", GEMM_RECORD, k=relu)}))
    lines = explain((2, 8, 512), (384, 512), torch.bfloat16, bias=True, activation="relu").split("\n")
    assert lines[:2] == ["linear bf16 M=16 N=384 K=512 epilogue=bias+relu", f"  key {relu.to_string()}"]
    assert lines[2].startswith("  runs triton_gemm [") and lines[2].endswith(
        "(table: tuned for M 9-16, timed at M=9,16: worst 1.100x F.linear's speed there)")


@pytest.mark.parametrize("tf32, dtype, key_dtype", [(True, "fp32", "tf32"), (False, "fp32", "fp32"),
                                                    (True, "bf16", "bf16"), (True, "fp16", "fp16")])
def test_explain_keys_fp32_by_the_tf32_flag(fake_cuda, tf32, dtype, key_dtype):
    matmul = torch.backends.cuda.matmul  # its flags are properties: set and restored by hand
    old = matmul.allow_tf32
    matmul.allow_tf32 = tf32
    try:
        text = explain((16, 512), (384, 512), dtype, bias=False)
    finally:
        matmul.allow_tf32 = old
    assert f"  key linear|{key_dtype}|none|N=384|K=512|c at M=16\n" in text


def test_explain_batch_invariant_on_a_gpu(fake_cuda, monkeypatch):
    asked, entered = fake_cuda
    monkeypatch.setattr(backends, "device_limits", lambda index: (asked.append(("limits", index)), H200_LIMITS)[1])
    monkeypatch.setattr(backends, "num_sms", lambda index: 132)
    with mode_state.mode(mode_state.BATCH_INVARIANT):
        lines = explain((16, 4096), (4096, 4096), "bf16", device=3).split("\n")
        f64 = explain((16, 512), (384, 512), torch.float64)
    assert lines[1] == "  key linear|bf16|bias|N=4096|K=4096|c at M=16"
    assert lines[2].startswith("  batch_invariant mode: triton_gemm [") and "same kernel for every M" in lines[2]
    assert asked == [("limits", 3)] and entered == [3]
    assert f64 == ("linear torch.float64 M=16 N=384 K=512 epilogue=bias: dtype not taken by any kernel, so "
                   "PyTorch computes it (not guaranteed batch-invariant)")
    assert explain((16, 512), (384, 512), torch.float64) == (
        "linear torch.float64 M=16 N=384 K=512 epilogue=bias: dtype not taken by any kernel, so PyTorch computes it")


def test_explain_without_cuda_in_batch_invariant_mode(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with mode_state.mode(mode_state.BATCH_INVARIANT):
        text = explain((16, 4096), (4096, 4096), "bf16")
        f64 = explain((16, 512), (384, 512), "float64")
    head, tail = text.split("\n")
    assert head == ("linear bf16 M=16 N=4096 K=4096 epilogue=bias: no CUDA device here, so PyTorch (F.linear) "
                    "computes it on the CPU")
    assert tail.startswith("  batch_invariant mode: triton_gemm [") and tail.endswith(
        " on an H100/H200-class GPU; PyTorch on the CPU is not guaranteed batch-invariant")
    assert f64 == ("linear torch.float64 M=16 N=384 K=512 epilogue=bias: no CUDA device here, so PyTorch "
                   "(F.linear) computes it on the CPU")


@pytest.mark.parametrize("args, message", [
    (("16,512", (384, 512)), "x_shape must be a sequence of non-negative ints such as (16, 4096) or (2, 8, 4096), "
                             "got '16,512'"),
    (((16, 512), [-1, 512]), "w_shape must be a sequence of non-negative ints such as (6144, 4096), got [-1, 512]"),
    (((), (384, 512)), "x_shape needs at least one dimension (its last is K), got ()"),
    (((16, 512), (384, 512, 1)), "w_shape must be two ints (N, K), got (384, 512, 1)"),
    (((2, 4, 100), (8, 99)), "x_shape (2, 4, 100) has 100 features, w_shape expects 99"),
])
def test_explain_argument_messages(args, message):
    with pytest.raises(ValueError) as info:
        explain(*args)
    assert str(info.value) == message
