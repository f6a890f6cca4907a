"""The FP8 cuBLASLt path (kernels/cublaslt_fp8.py) without a GPU: what it refuses and why (no
CUDA, below sm89, not Hopper, no bindings, an old cuBLASLt, unaligned shapes), the weight scales'
cuBLASLt layout, and argument errors."""

from __future__ import annotations

import pytest
import torch

from hybridgemm.kernels import cublaslt_fp8 as cf
from hybridgemm.kernels.cublaslt_runtime import CublasLtUnavailable, CublasLtUnsupported
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.fp8 import FP8FormatError, quantize_fp8
from hybridgemm.kernels.problem import Problem


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: ``machine(capability, version=130100, bindings=True)`` (capability None:
    no CUDA)."""

    def make(capability, version=130100, bindings=True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(cf, "cublaslt_version", lambda: version)

        def no_bindings():
            raise CublasLtUnavailable("the cuBLASLt backend needs nvmath-python")

        monkeypatch.setattr(cf, "bindings", (lambda: object()) if bindings else no_bindings)

    return make


@pytest.mark.parametrize("capability,version,bindings,words", [
    (None, 130100, True, "needs a CUDA device"),
    ((8, 0), 130100, True, "8.0 has no FP8 tensor cores"),
    ((7, 5), 130100, True, "no FP8 tensor cores"),
    ((8, 9), 130100, True, "Hopper (9.0) only"),
    ((10, 0), 130100, True, "Hopper (9.0) only"),
    ((12, 0), 130100, True, "Hopper (9.0) only"),
    ((9, 0), 130100, False, "needs nvmath-python"),
    ((9, 0), None, True, "could not be loaded"),
    ((9, 0), 120800, True, "cuBLASLt 12.8.0 lacks"),
])
def test_environment_refusals_say_why(machine, capability, version, bindings, words):
    machine(capability, version, bindings)
    for granularity in ("channel", "block128"):
        ok, why = cf.check(4096, 4096, torch.bfloat16, granularity)
        assert not ok and words in why
    assert not cf.is_available()


def test_hopper_with_a_new_cublaslt_is_accepted(machine):
    for version in (120900, 130100):
        machine((9, 0), version)
        assert cf.check(4096, 4096, torch.float16, "block128") == (True, "")
        assert cf.is_available()


@pytest.mark.parametrize("n,k,dtype,granularity,words", [
    (4096, 4100, torch.bfloat16, "channel", "K=4100 is not a multiple of 16"),
    (1004, 4096, torch.bfloat16, "block128", "N=1004 is not a multiple of 8"),
    (4096, 4096, torch.float32, "channel", "bfloat16 or float16"),
    (4096, 4096, torch.bfloat16, "tensor", "granularity must be one of"),
    (0, 4096, torch.bfloat16, "channel", "empty problem"),
])
def test_shape_and_dtype_refusals(machine, n, k, dtype, granularity, words):
    machine((9, 0))  # the rules hold on the one machine that could run it
    ok, why = cf.check(n, k, dtype, granularity)
    assert not ok and words in why


def _problem(weight_format="e4m3_block128", **kw):
    base = dict(m=2048, n=6144, k=4096, dtype=torch.bfloat16, epilogue=Epilogue(Activation.GELU, True), ldx=4096,
                ldw=4096, ldo=6144, weight_format=weight_format)
    return Problem(**{**base, **kw})


def test_supports_reads_the_problem(machine):
    machine((9, 0))
    assert cf.supports(_problem()) == (True, "")
    assert cf.supports(_problem("e4m3_channel")) == (True, "")
    for problem, words in [(_problem(""), "not one this path runs"), (_problem(m=0), "empty"),
                           (_problem(ldw=4104), "W's rows"), (_problem(align_w=8), "W's rows"),
                           (_problem(ldo=6148), "out's rows"), (_problem(k=4008, ldx=4016, ldw=4016), "K=4008")]:
        ok, why = cf.supports(problem)
        assert not ok and words in why, (problem, why)
    machine((8, 9))
    ok, why = cf.supports(_problem())
    assert not ok and "Hopper" in why


def test_supports_refuses_without_cuda_here():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ok, why = cf.supports(_problem())
    assert not ok and "CUDA device" in why


def test_weight_scale_operand_layouts():
    w = quantize_fp8(torch.randn(300, 1152), "block128")  # scales (3, 9): rows padded to 12
    s = cf.weight_scale_operand(w.scale, "block128")
    assert s.shape == (3, 9) and s.stride() == (12, 1) and torch.equal(s, w.scale)
    assert s.data_ptr() % 16 == 0
    assert cf.weight_scale_operand(s, "block128") is s  # already in cuBLASLt's layout: no copy
    w = quantize_fp8(torch.randn(300, 1024), "block128")  # (3, 8): as it is
    assert cf.weight_scale_operand(w.scale, "block128").data_ptr() == w.scale.data_ptr()
    c = quantize_fp8(torch.randn(40, 64), "channel")
    v = cf.weight_scale_operand(c.scale.reshape(40, 1), "channel")
    assert v.shape == (40,) and torch.equal(v, c.scale)
    shifted = torch.empty(41)[1:]  # 4 bytes past an aligned address
    shifted.copy_(c.scale)
    moved = cf.weight_scale_operand(shifted, "channel")
    assert moved.data_ptr() % 16 == 0 and torch.equal(moved, c.scale)


def test_run_argument_errors():
    w = quantize_fp8(torch.randn(64, 128), "channel")
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="torch.Tensor"):
        cf.run(x.tolist(), w.data, w.scale)
    with pytest.raises(FP8FormatError, match="e4m3fn"):
        cf.run(x, w.data.view(torch.uint8), w.scale)
    with pytest.raises(FP8FormatError, match="fits neither"):
        cf.run(x, w.data, w.scale[:10])
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        cf.run(x.float(), w.data, w.scale)
    with pytest.raises(ValueError, match=r"x must be \(M, 128\)"):
        cf.run(x[:, :64], w.data, w.scale)
    with pytest.raises(ValueError, match=r"bias must be a \(64,\) torch.bfloat16"):
        cf.run(x, w.data, w.scale, bias=torch.zeros(63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias must be"):
        cf.run(x, w.data, w.scale, bias=torch.zeros(64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out must be a \(4, 64\)"):
        cf.run(x, w.data, w.scale, out=torch.empty(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="CUDA tensors"):
        cf.run(x, w.data, w.scale)
    assert issubclass(CublasLtUnsupported, ValueError)  # the dispatcher's fallback catches one kind
