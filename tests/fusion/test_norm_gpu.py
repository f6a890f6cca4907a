"""The patched RMSNorm on a real GPU (``pytest -m gpu``): the Triton launch against the stock
module in bf16/fp16/fp32 at decode and prefill shapes (Llama's formula, and Gemma's / OLMo 2's
fp32 factor), the launch really taken, CUDA-graph
replay equal to eager, and torch.compile running the stock formula."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridgemm
from hybridgemm import norm as hnorm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


def _norm_class(name):
    """transformers' ``name`` class: LlamaRMSNorm, or one recognised by running it (not in the list)."""
    if name == "LlamaRMSNorm":
        return LlamaRMSNorm
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    return DeepseekV3RMSNorm


def pair(h, dtype, name="LlamaRMSNorm"):
    stock = _norm_class(name)(h, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        stock.weight.copy_(1 + 0.5 * torch.randn(h, device="cuda"))
    patched = copy.deepcopy(stock)
    hybridgemm.patch(nn.Sequential(patched), strict=True)
    return stock, patched


@pytest.mark.parametrize("name", ["LlamaRMSNorm", "DeepseekV3RMSNorm"])  # listed; recognised by running it
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 4096), (8, 1, 3584), (1, 333, 4096), (3, 17, 5000)])
def test_kernel_matches_the_stock_module(name, dtype, shape, monkeypatch):
    stock, patched = pair(shape[-1], dtype, name)
    launched = []
    kernel = hnorm._triton_rmsnorm()
    real = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a: launched.append(1) or real(*a))
    x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
    with torch.no_grad():
        out, ref = patched(x), stock(x)
    assert launched == [1]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp = torch.finfo(dtype).eps
    diff = (out.float() - ref.float()).abs()
    assert diff.max() <= 2 * ulp * ref.float().abs().max()  # a sum order apart
    if dtype is torch.float32:  # the sum order moves rstd by an ulp or two, and with it every element
        assert (diff <= 4 * ulp * ref.abs()).all()
    else:  # the rounding to 16 bits hides that: mostly bit-identical (the same formula and roundings)
        assert (diff == 0).float().mean() > 0.95


def fp32_factor_pair(family, h, dtype):
    """A stock Gemma (1 + w) or OLMo 2 (w) norm on the GPU and its patched copy; "qwen3_next" and
    "gpt_oss": those models' norms, of Gemma's and OLMo 2's formula, recognised by running them."""
    import importlib

    name = {"gemma": "GemmaRMSNorm", "olmo2": "Olmo2RMSNorm", "qwen3_next": "Qwen3NextRMSNorm",
            "gpt_oss": "GptOssRMSNorm"}[family]
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {name}")
    stock = cls(h, eps=1e-6)
    with torch.no_grad():
        stock.weight.copy_(0.5 * torch.randn(h) + (0.0 if family in ("gemma", "qwen3_next") else 1.0))
    stock = stock.to("cuda", dtype)
    patched = copy.deepcopy(stock)
    hybridgemm.patch(nn.Sequential(patched), strict=True)
    assert isinstance(patched, hnorm.Fp32FactorRMSNorm)
    return stock, patched


@pytest.mark.parametrize("family", ["gemma", "olmo2", "qwen3_next", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 3072), (8, 1, 3584), (1, 333, 4096), (3, 17, 5000)])
def test_fp32_factor_kernel_matches_the_stock_module(family, dtype, shape, monkeypatch):
    """Gemma's / OLMo 2's formula (scaled by the fp32 factor, rounded once) as one launch:
    the stock module's output but for the sum order, and unlike Llama's formula in 16 bits."""
    stock, patched = fp32_factor_pair(family, shape[-1], dtype)
    launched = []
    kernel = hnorm._triton_rmsnorm()
    real = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a: launched.append(a[4]) or real(*a))  # run's fp32_factor
    x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
    with torch.no_grad():
        out, ref = patched(x), stock(x)
        g, eps, _ = hnorm.norm_operand(patched)  # the kept factor (eager: offset 0)
        llama = hnorm.reference_rms_norm(x, g.to(dtype), eps)
    assert launched == [True]  # one launch, the fp32_factor form
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    ulp = torch.finfo(dtype).eps
    diff = (out.float() - ref.float()).abs()
    if dtype is torch.float32:
        assert (diff <= 4 * ulp * ref.abs()).all()
    else:
        assert (diff <= ulp * ref.float().abs()).all() and (diff == 0).float().mean() > 0.95
        assert (llama != ref).float().mean() > 0.05


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 3584), (3, 17, 5000)])
def test_add_norm_is_one_launch_of_the_module_output_plus_the_residual(family, dtype, shape, monkeypatch):
    """``add_norm(residual, norm, x)``, the post-norm layers' add: one launch, bit for bit the norm
    of the same operand (``apply_norm``: a Gemma / OLMo 2 norm's kept fp32 factor) added to the
    residual by torch, and the module's own output (its weight and offset) plus the residual but
    for the rare value where the two compiled norms round apart; a residual of another dtype
    takes the two steps."""
    stock, patched = pair(shape[-1], dtype) if family == "llama" else fp32_factor_pair(family, shape[-1], dtype)
    launched = []
    kernel = hnorm._triton_rmsnorm()
    real = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a: launched.append(a[6] is not None) or real(*a))  # run's residual
    x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
    residual = (torch.randn(*shape, device="cuda") * 5).to(dtype)
    with torch.no_grad():
        out = hnorm.add_norm(residual, patched, x)
        assert launched == [True]
        assert torch.equal(out, residual + hnorm.apply_norm(patched, x))
        normed = patched(x)
        module = residual + normed
        ulp = torch.finfo(dtype).eps  # an ulp of the norm apart, rounded into the sum
        assert ((out.float() - module.float()).abs() <= 2 * ulp * (module.float().abs() + normed.float().abs())).all()
        assert (out == module).float().mean() > 0.99
        wider = residual.double()
        assert torch.equal(hnorm.add_norm(wider, patched, x), wider + hnorm.apply_norm(patched, x))
    assert launched == [True, False, False, False, False]  # its launch, the norm's, the module's, the two steps'


def test_cuda_graph_replay_equals_eager():
    _, patched = pair(4096, torch.bfloat16)
    x = torch.randn(2, 1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        patched(x)  # the plan and the compiled kernel, outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            patched(x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = patched(x)
        x.copy_(torch.randn_like(x))
        expected = patched(x)
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_compiled_runs_the_stock_formula():
    stock, patched = pair(4096, torch.bfloat16)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(patched, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), torch.compile(stock, fullgraph=True)(x), rtol=0, atol=0)
