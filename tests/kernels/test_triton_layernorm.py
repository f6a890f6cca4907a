"""kernels/triton_layernorm.py under the Triton interpreter: the LayerNorm against an fp64
reference, odd widths and row counts, strided rows, bad arguments; on the GPU in bf16. The
compiled decode step that launches it runs on the GPU (tests/models/test_decode_step_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from hybridgemm.kernels import triton_layernorm as tln

EPS = 1e-5
FLOOR = {torch.float16: 1e-3, torch.float32: 1e-6}


def _params(h, dtype):
    return (1 + 0.5 * torch.randn(h, dtype=torch.float64)).to(dtype), torch.randn(h, dtype=torch.float64).to(dtype)


def _exact(x, w, b):
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    var = (xd - mean).pow(2).mean(-1, keepdim=True)
    return (xd - mean) * torch.rsqrt(var + EPS) * w.double() + b.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("h", [1, 7, 40, 1000, 4544])
def test_layer_norm_matches_the_exact_formula(dtype, m, h):
    # a mean far from 0 and a spread far from 1: a lost centring or scaling shows
    x = (torch.randn(m, h, dtype=torch.float64) * 4 + 3).to(dtype)
    w, b = _params(h, dtype)
    out = tln.layer_norm(x, w, b, EPS)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    ref = _exact(x, w, b)
    stock = F.layer_norm(x.float(), (h,), w.float(), b.float(), EPS).to(dtype)
    assert rel_err(out, ref) <= 2 * rel_err(stock, ref) + FLOOR[dtype], (m, h)


def test_layer_norm_reads_strided_rows_and_leading_dims():
    base = torch.randn(2, 5, 96, dtype=torch.float32) * 2 + 1
    x = base[..., :40]  # rows 96 apart: read in place
    w, b = _params(40, torch.float32)
    out = tln.layer_norm(x, w, b, EPS)
    assert out.shape == (2, 5, 40)
    assert rel_err(out, _exact(x, w, b)) <= 1e-6
    xt = torch.randn(40, 6, dtype=torch.float32).t()  # unit stride on the wrong dim: copied
    assert rel_err(tln.layer_norm(xt, w, b, EPS), _exact(xt, w, b)) <= 1e-6


def test_layer_norm_is_deterministic_and_empty_inputs_are_empty():
    x = torch.randn(17, 333, dtype=torch.float16)
    w, b = _params(333, torch.float16)
    assert torch.equal(tln.layer_norm(x, w, b, EPS), tln.layer_norm(x, w, b, EPS))
    assert tln.layer_norm(torch.empty(0, 333, dtype=torch.float16), w, b, EPS).shape == (0, 333)


def test_layer_norm_refuses_bad_arguments():
    x = torch.randn(3, 40, dtype=torch.float32)
    w, b = _params(40, torch.float32)
    with pytest.raises(ValueError, match="weight must be an \\(40,\\) tensor of x's dtype"):
        tln.layer_norm(x, w.half(), b, EPS)
    with pytest.raises(ValueError, match="bias must be an \\(40,\\) tensor"):
        tln.layer_norm(x, w, b[:39], EPS)
    with pytest.raises(ValueError, match="bias must be an \\(40,\\) tensor"):
        tln.layer_norm(x, w, None, EPS)
    with pytest.raises(ValueError, match="eps must be a finite number"):
        tln.layer_norm(x, w, b, float("nan"))
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        tln.layer_norm(x.double(), w, b, EPS)
    wide = tln.SINGLE_PASS_MAX + 1
    with pytest.raises(ValueError, match="the last dim must be"):
        tln.layer_norm(torch.randn(2, wide), torch.ones(wide), torch.ones(wide), EPS)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        tln.layer_norm([1.0], w, b, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [2048, 4096, 4544, 16384])
@pytest.mark.parametrize("m", [1, 8])
def test_layer_norm_on_the_gpu_matches_the_exact_formula(h, m):
    torch.manual_seed(h + m)
    x = (torch.randn(m, h, dtype=torch.float64) * 4 + 3).to("cuda", torch.bfloat16)
    w, b = (t.cuda() for t in _params(h, torch.bfloat16))
    ref = _exact(x, w, b)
    stock = F.layer_norm(x, (h,), w, b, EPS)
    assert rel_err(tln.layer_norm(x, w, b, EPS), ref) <= 1.1 * rel_err(stock, ref) + 1e-4, h
