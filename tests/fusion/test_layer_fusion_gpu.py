"""The decoder-layer fusions of the Triton kernels on the GPU (``pytest -m gpu``), in bf16 at
Llama-3-8B's sizes: the split-K norm prologue and residual epilogue in each reduction mode
(one launch, two launches, the last program reducing), the gated kernel's norm prologue,
against fp32 with a bound from stock bf16's own error; the fused-reduce mode bit-identical
over repeated calls (its reducing program varies from call to call).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridgemm.kernels import triton_glu, triton_splitk
from hybridgemm.norm import reference_rms_norm

pytestmark = pytest.mark.gpu

Cfg = triton_splitk.TritonSplitKConfig
MODES = {"one-launch": Cfg(16, 64, 256, 1, 4, 4), "two-launch": Cfg(16, 64, 256, 4, 4, 3),
         "fused-reduce": Cfg(16, 64, 256, 4, 4, 3, fused_reduce=True)}
EPS = 1e-5
BF16 = torch.bfloat16


def _rel(a, ref) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def _operands(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = (3 * torch.randn(m, k, device="cuda", generator=g)).to(BF16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(BF16)
    nw = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).to(BF16)
    r = torch.randn(m, n, device="cuda", generator=g).to(BF16)
    return x, w, nw, r


def _exact_norm(x, nw):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("m", [1, 8])
def test_splitk_norm_and_residual_bf16(mode, m):
    n, k = 4096, 4096
    x, w, nw, r = _operands(m, n, k)
    cfg = MODES[mode]
    out = torch.full((m, n), float("nan"), device="cuda", dtype=BF16)
    triton_splitk.run(cfg, x, w, None, out, None, norm=(nw, EPS))
    ref = _exact_norm(x, nw) @ w.float().T
    stock = F.linear(reference_rms_norm(x, nw, EPS), w)
    assert torch.isfinite(out).all() and _rel(out, ref) <= 2 * _rel(stock, ref) + 1e-3
    triton_splitk.run(cfg, x, w, None, out, None, residual=r)
    ref = x.float() @ w.float().T + r.float()
    assert _rel(out, ref) <= 2 * _rel(r + F.linear(x, w), ref) + 1e-3


def test_fused_reduce_norm_is_bit_identical_across_calls():
    x, w, nw, r = _operands(8, 4096, 4096)
    cfg = MODES["fused-reduce"]
    first = triton_splitk.run(cfg, x, w, None, torch.empty(8, 4096, device="cuda", dtype=BF16), None,
                              norm=(nw, EPS), residual=r)
    for _ in range(20):
        again = triton_splitk.run(cfg, x, w, None, torch.empty_like(first), None, norm=(nw, EPS), residual=r)
        assert torch.equal(again, first)


@pytest.mark.parametrize("m", [1, 8])
def test_gated_norm_bf16(m):
    i, k = 14336, 4096
    x, _, nw, _ = _operands(m, 1, k)
    w = (torch.randn(2 * i, k, device="cuda") / k**0.5).to(BF16)
    out = triton_glu.glu(x, w, None, "silu", norm=(nw, EPS))
    z = _exact_norm(x, nw) @ w.float().T
    ref = F.silu(z[:, :i]) * z[:, i:]
    zs = F.linear(reference_rms_norm(x, nw, EPS), w)
    stock = F.silu(zs[:, :i]) * zs[:, i:]
    assert _rel(out, ref) <= 2 * _rel(stock, ref) + 1e-3
