"""fusion/models/compiled_layer_norm.py: which LayerNorms the compiled decode step computes in one
launch, and that everything else runs the module (CPU); the compiled launch against the module
and an fp64 reference (GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import rel_err
from hybridgemm.models import compiled_layer_norm as ln


def _norm(h=64, dtype=torch.float32, **kw):
    norm = nn.LayerNorm(h, dtype=dtype, **kw)
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            if norm.bias is not None:
                norm.bias.uniform_(-0.5, 0.5)
    return norm


def test_the_kernel_computes_plain_affine_layernorms_of_x_dtype_only():
    x = torch.randn(2, 64)
    assert ln._computes(_norm(), x)
    assert not ln._computes(_norm(bias=False), x)
    assert not ln._computes(_norm(elementwise_affine=False), x)
    assert not ln._computes(_norm(dtype=torch.float16), x)
    assert not ln._computes(_norm(h=32), x)
    assert not ln._computes(type("MyNorm", (nn.LayerNorm,), {})(64), x)
    hooked = _norm()
    hooked.register_forward_hook(lambda *a: None)
    assert not ln._computes(hooked, x)


def test_eager_calls_run_the_module_hooks_included():
    norm = _norm()
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    x = torch.randn(3, 64)
    assert torch.equal(ln.layer_norm(norm, x), norm(x))
    assert len(seen) == 2  # once in layer_norm, once above


@pytest.mark.gpu
def test_compiled_layer_norm_launches_the_kernel(monkeypatch):
    from hybridgemm.kernels import triton_layernorm as tln
    launches = []
    real = tln.layer_norm
    monkeypatch.setattr(tln, "layer_norm", lambda *a: launches.append(a) or real(*a))
    h = 4544
    norm = _norm(h, torch.bfloat16).cuda()
    x = (torch.randn(1, 1, h, device="cuda") * 4 + 3).bfloat16()
    with torch.no_grad():
        out = torch.compile(lambda t: ln.layer_norm(norm, t), fullgraph=True)(x)
        stock = norm(x)
    assert len(launches) == 1
    ref = torch.nn.functional.layer_norm(x.double(), (h,), norm.weight.double(), norm.bias.double(), norm.eps)
    assert rel_err(out, ref) <= 1.1 * rel_err(stock, ref) + 1e-4


@pytest.mark.gpu
def test_compiled_layer_norm_with_a_hook_runs_the_module(monkeypatch):
    from hybridgemm.kernels import triton_layernorm as tln
    launches = []
    monkeypatch.setattr(tln, "layer_norm", lambda *a: launches.append(a))
    norm = _norm(256, torch.bfloat16).cuda()
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(1))
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = torch.compile(lambda t: ln.layer_norm(norm, t), fullgraph=True)(x)
    assert not launches and seen
    torch.testing.assert_close(out, norm(x))
