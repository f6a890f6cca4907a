"""FP8 weights in the linear call on the CPU (fusion/fp8_linear.py, fusion/fp8_modules.py,
``decide.choose_fp8``, ``explain(weights="fp8")``): the dequantized path against F.linear of
the dequantized weight, the kernel path through the Triton interpreter (fp16), autograd and
torch.compile of the custom op, the module and ``patch(weights="fp8")``, the decision per M
on a faked H200 with and without a table entry, and bad input."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from fake_device import save_table, tuned

import hybridgemm
from hybridgemm import decide, dispatch, fp8_linear
from hybridgemm.autotune_cache.keys import TableKey
from hybridgemm.kernels import fp8, triton_splitk
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem


def _weight(n, k, granularity="channel", dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return hybridgemm.quantize_fp8((torch.randn(n, k, generator=g) * 0.2).to(dtype), granularity)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("x_shape", [(1, 300), (3, 300), (2, 17, 300), (333, 300)])
@pytest.mark.parametrize("act", [None, "gelu_tanh", "relu"])
def test_cpu_path_is_f_linear_of_the_dequantized_weight(granularity, x_shape, act):
    q = _weight(130, 300, granularity, torch.float32)
    x = torch.randn(*x_shape)
    b = torch.randn(130)
    got = hybridgemm.linear(x, q, b, act)
    want = hybridgemm.Activation.parse(act)
    ref = F.linear(x, q.dequantize(torch.float32), b)
    ref = {Activation.NONE: ref, Activation.RELU: F.relu(ref), Activation.GELU_TANH: F.gelu(ref, approximate="tanh")}
    assert torch.equal(got, ref[want])
    assert got.shape == (*x_shape[:-1], 130)


def test_kernel_path_through_the_interpreter(monkeypatch):
    """fp8_linear's GPU branch on CPU tensors: the split-K decision runs the kernel with the
    weight's scales (TRITON_INTERPRET=1, fp16), against fp64 of the dequantized weight."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = triton_splitk.TritonSplitKConfig(16, 32, 64, 2, 4, 2, fused_reduce=True)
    seen = []

    def decision_for(x2, w, b, out, act=None, weight_format=""):
        seen.append(weight_format)
        return decide.Choice("triton_splitk", cfg, "rule", "k", "test")

    monkeypatch.setattr(fp8_linear, "runs_fp8_kernels", lambda x: True)
    monkeypatch.setattr(dispatch, "decision_for", decision_for)
    for granularity in ("channel", "block128"):
        q = _weight(200, 260, granularity)
        x = torch.randn(3, 260).half()
        b = torch.randn(200).half()
        got = hybridgemm.linear(x, q, b)
        ref = x.double() @ q.dequantize(torch.float32).double().T + b.double()
        torch.testing.assert_close(got.double(), ref, rtol=1e-3, atol=2e-3)
    assert seen == ["e4m3_channel", "e4m3_block128"]


@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_gradients_reach_x_and_bias_only(act):
    q = _weight(40, 64, "channel", torch.float32)
    x = torch.randn(5, 64, dtype=torch.float32, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    hybridgemm.linear(x, q, b, act).square().sum().backward()
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = F.linear(x2, q.dequantize(torch.float32), b2)
    ref = F.gelu(ref, approximate="tanh") if act else ref
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-5)


def test_torch_compile_traces_the_fp8_op_in_one_graph():
    q = _weight(48, 64, "block128", torch.float32)
    layer = hybridgemm.FP8Linear.from_fp8(q, torch.randn(48))
    x = torch.randn(4, 64).to(torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))


def test_fp8_linear_module_keeps_the_checkpoint_names():
    lin = torch.nn.Linear(256, 130).to(torch.bfloat16)
    mod = hybridgemm.FP8Linear.from_linear(lin, "channel")
    assert list(mod.state_dict()) == ["weight", "bias", "weight_scale"]
    data, scale = mod.weight.detach(), mod.weight_scale.reshape(-1, 1)
    inv = hybridgemm.FP8Linear(data, scale, None, scale_name="weight_scale_inv")
    assert list(inv.state_dict()) == ["weight", "weight_scale_inv"] and inv.weight_scale_inv.shape == (130, 1)
    x = torch.randn(2, 256).to(torch.bfloat16)
    torch.testing.assert_close(inv(x), mod(x) - lin.bias.detach(), rtol=0.02, atol=0.02)
    with pytest.raises(fp8.FP8FormatError, match="finite and > 0"):
        hybridgemm.FP8Linear(data, torch.full((130, 1), float("nan")))
    with pytest.raises(fp8.FP8FormatError, match="fits neither"):
        hybridgemm.FP8Linear(data, torch.ones(3, 3))
    with pytest.raises(ValueError, match="scale_name"):
        hybridgemm.FP8Linear(data, scale, scale_name="scale")


@pytest.mark.parametrize("bad,error,match", [
    (lambda q: hybridgemm.linear(torch.randn(2, 63), q), hybridgemm.LinearArgumentError, "expects 64 input features"),
    (lambda q: hybridgemm.linear(torch.randn(2, 64), q, torch.randn(7)), hybridgemm.LinearArgumentError,
     r"bias must have shape \(40,\)"),
    (lambda q: hybridgemm.linear(torch.randn(2, 64), q, torch.randn(40).half()), hybridgemm.LinearArgumentError,
     "bias has dtype"),
    (lambda q: hybridgemm.linear(torch.ones(2, 64, dtype=torch.int32), q), hybridgemm.LinearArgumentError,
     "floating-point"),
    (lambda q: hybridgemm.linear(torch.randn(2, 64).to(torch.float8_e4m3fn), q), hybridgemm.LinearArgumentError,
     "floating-point"),
    (lambda q: hybridgemm.linear(torch.randn(2, 64), q, "relu"), TypeError, "tensors"),
])
def test_bad_calls_raise_clear_errors(bad, error, match):
    with pytest.raises(error, match=match):
        bad(_weight(40, 64, "channel", torch.float32))


def test_gated_linear_with_an_fp8_weight():
    q = _weight(2 * 48, 64, "channel", torch.float32)
    x = torch.randn(3, 64)
    w = q.dequantize(torch.float32)
    ref = F.silu(F.linear(x, w[:48])) * F.linear(x, w[48:])
    torch.testing.assert_close(hybridgemm.gated_linear(x, q), ref)


# ------------------------------------------------------------------------------- decisions

def _problem(m, fmt="e4m3_channel", n=6144, k=4096):
    return Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, False), ldx=k, ldw=k,
                   ldo=n, weight_format=fmt)


@pytest.mark.parametrize("fmt", ["e4m3_channel", "e4m3_block128"])
def test_rule_5_streams_fp8_at_decode_rows_and_dequantizes_past_them(fake_h200, fmt):
    for m in (1, 17, 64):
        choice = decide.choose_fp8(_problem(m, fmt), 0)
        assert choice.backend == "triton_splitk" and choice.source == "rule"
        assert choice.config.split_k == 1 or choice.config.fused_reduce  # the rotary epilogue needs either
        assert choice.key.startswith(f"linear_{fmt}|bf16|none|N=6144|K=4096|c at M={m}")
        if fmt == "e4m3_block128":
            assert choice.config.block_k <= 128
    past = decide.choose_fp8(_problem(65, fmt), 0)
    assert past.backend == "torch" and "dequantize" in past.reason


def test_an_fp8_table_entry_is_found_under_its_own_key_only(fake_h200):
    problem = _problem(1)
    key = TableKey.from_problem(problem)
    assert key.to_string() == "linear_e4m3_channel|bf16|none|N=6144|K=4096|M=1-1|c"
    assert TableKey.from_string(key.to_string()) == key
    record = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 512, "split_k": 1, "num_warps": 4,
              "num_stages": 4}
    save_table(fake_h200 / "t.json", {key: tuned("triton_splitk", record, key)})
    decide.set_table_path(fake_h200 / "t.json")
    choice = decide.choose_fp8(problem, 0)
    assert choice.source == "table" and choice.config.block_k == 512 and choice.key == key.to_string()
    bf16 = dataclasses.replace(problem, weight_format="")
    assert decide.choose(bf16, 0).source == "rule"  # the FP8 entry never serves a bf16 weight


def test_explain_names_the_format_and_refuses_bad_values():
    text = hybridgemm.explain((1, 4096), (6144, 4096), weights="fp8", granularity="block128")
    assert "weight=e4m3_block128" in text
    with pytest.raises(ValueError, match="weights must be"):
        hybridgemm.explain((1, 4096), (6144, 4096), weights="int4")
    with pytest.raises(ValueError, match="granularity"):
        hybridgemm.explain((1, 4096), (6144, 4096), weights="fp8", granularity="tensor")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        hybridgemm.explain((1, 4096), (6144, 4096), dtype="fp32", weights="fp8")
    with pytest.raises(ValueError, match="activations must be"):
        hybridgemm.explain((1, 4096), (6144, 4096), activations="fp8")  # an FP8 weight's option


def test_explain_says_what_fp8_activations_change(fake_h200, monkeypatch):
    from hybridgemm.kernels import cublaslt_fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    verdict = {"ok": (True, "")}
    monkeypatch.setattr(cublaslt_fp8, "check", lambda *a: verdict["ok"])

    def line(m, granularity="channel", activations="fp8"):
        text = hybridgemm.explain((m, 4096), (6144, 4096), weights="fp8", granularity=granularity,
                                  activations=activations)
        return text.splitlines()[-1]

    assert "x as it is (W8A16)" in line(64) and "triton_splitk" in hybridgemm.explain((64, 4096), (6144, 4096),
                                                                                      weights="fp8")
    assert line(65) == ("  activations='fp8': instead, x quantized to e4m3 per token and cuBLASLt's FP8 GEMM on both "
                        "(W8A8)")
    assert "per 1x128 block" in line(2048, "block128")
    assert "activations" not in line(2048, activations="same")
    verdict["ok"] = (False, "compute capability 8.0 has no FP8 tensor cores")
    assert "cannot run it here (compute capability 8.0" in line(2048)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("shape", [(1, 16), (3, 130), (200, 260), (257, 384)])
def test_one_pass_dequantize_equals_the_reference_bit_for_bit(monkeypatch, granularity, shape):
    """kernels/triton_dequant.py in the interpreter (fp16: the interpreter's bf16 is not
    trusted) against kernels/fp8.py ``dequantize``, every value, odd shapes, poisoned output."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hybridgemm.kernels import fp8
    from hybridgemm.kernels.lazy import triton_module

    q = _weight(*shape, granularity)
    scale = fp8.scale_vector(q.scale, granularity)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    got = triton_module("triton_dequant").dequantize(q.data, scale, granularity, torch.float16)
    monkeypatch.setattr(torch, "empty", real_empty)
    want = fp8.dequantize(q.data, q.scale, torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, want)


def test_past_the_fp8_kernels_rows_the_gemm_reads_the_one_pass_dequantized_weight(monkeypatch):
    """The fallback decision on the GPU branch: a bf16/fp16 GEMM over the weight the one-pass
    kernel made (counted), the result as F.linear over the reference dequantization."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hybridgemm.kernels.lazy import triton_module

    module = triton_module("triton_dequant")
    calls = []
    real = module.dequantize
    monkeypatch.setattr(module, "dequantize", lambda *a: calls.append(a[2]) or real(*a))
    monkeypatch.setattr(fp8_linear, "runs_fp8_kernels", lambda x: True)
    monkeypatch.setattr(dispatch, "decision_for",
                        lambda *a, **k: decide.Choice("torch", None, "rule", "k", "test"))
    monkeypatch.setattr(dispatch, "fused_linear", lambda x, w, b, act: F.linear(x, w, b))
    for granularity in ("channel", "block128"):
        q = _weight(70, 200, granularity)
        x = torch.randn(2, 5, 200).half()
        got = hybridgemm.linear(x, q)
        assert torch.equal(got, F.linear(x, q.dequantize(torch.float16)))
    assert calls == ["channel", "block128"]
