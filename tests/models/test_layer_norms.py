"""fusion/models/layer_norms.py: which LayerNorms the compiled decode step computes in one
launch, and that everything else runs the modules (CPU); the compiled launch against the
modules and an fp64 reference (GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import rel_err
from hybridgemm.models import layer_norms as ln


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


def test_eager_calls_run_the_modules_hooks_included():
    norms = [_norm(), _norm()]
    seen = []
    norms[1].register_forward_hook(lambda mod, args, out: seen.append(out))
    x = torch.randn(3, 64)
    outs = ln.layer_norms(x, norms)
    assert [torch.equal(o, n(x)) for o, n in zip(outs, norms)] == [True, True]
    assert len(seen) == 2  # once in layer_norms, once above


@pytest.mark.gpu
@pytest.mark.parametrize("two", [False, True], ids=["one", "two"])
def test_compiled_layer_norms_launch_the_kernel_once(two, monkeypatch):
    from hybridgemm.kernels import triton_layernorm as tln
    launches = []
    real = tln.layer_norms
    monkeypatch.setattr(tln, "layer_norms", lambda *a: launches.append(a) or real(*a))
    h = 4544
    norms = [_norm(h, torch.bfloat16).cuda() for _ in range(2 if two else 1)]
    x = (torch.randn(1, 1, h, device="cuda") * 4 + 3).bfloat16()
    fn = torch.compile(lambda t: ln.layer_norms(t, norms), fullgraph=True)
    with torch.no_grad():
        outs = fn(x)
        stock = [n(x) for n in norms]
    assert len(launches) == 1 and len(outs) == len(norms)
    for out, ref_mod, s in zip(outs, norms, stock):
        ref = torch.nn.functional.layer_norm(x.double(), (h,), ref_mod.weight.double(), ref_mod.bias.double(),
                                             ref_mod.eps)
        assert rel_err(out, ref) <= 1.1 * rel_err(s, ref) + 1e-4


@pytest.mark.gpu
def test_compiled_layer_norms_of_other_eps_or_hooks_run_the_modules(monkeypatch):
    from hybridgemm.kernels import triton_layernorm as tln
    launches = []
    monkeypatch.setattr(tln, "layer_norms", lambda *a: launches.append(a))
    norms = [_norm(256, torch.bfloat16).cuda(), _norm(256, torch.bfloat16, eps=1e-3).cuda()]
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        outs = torch.compile(lambda t: ln.layer_norms(t, norms), fullgraph=True)(x)
    assert not launches
    for out, n in zip(outs, norms):
        torch.testing.assert_close(out, n(x))
