"""A mixture-of-experts layer's norm and residual add inside the expert launches (CPU, Triton
interpreter): ``moe(..., norm=, residual=)`` against an fp64 reference of
``residual + experts(rmsnorm(x))`` on the pair-major kernels (both forms), the grouped ones
(norm apart) and the PyTorch loop; the residual add the layer's own add, bit for bit; bad
operands refused."""

from __future__ import annotations

import pytest
import torch

from hybridgemm import experts as moe_mod
from hybridgemm.kernels import triton_moe as tm
from hybridgemm.kernels import triton_moe_pairs as moe_pairs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
EPS = 1e-6


def _case(t, e, k, i, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w_d = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)  # rms far from 1: an unapplied norm shows
    nw = (1 + 0.5 * torch.randn(h, generator=g)).to(dtype)
    residual = torch.randn(t, h, generator=g).to(dtype)
    ids, weights = moe_mod.route(torch.randn(t, e, generator=g), k)
    return x, nw, residual, ids, weights, w_gu, w_d


def _reference(x, nw, residual, ids, weights, w_gu, w_d):
    """fp64 ``residual + experts(rmsnorm(x))``."""
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
    i = w_gu.shape[1] // 2
    out = residual.double().clone()
    for tok in range(x.shape[0]):
        for s in range(ids.shape[1]):
            ex = int(ids[tok, s])
            hid = xn[tok] @ w_gu[ex].double().T
            out[tok] += (torch.nn.functional.silu(hid[:i]) * hid[i:]) @ w_d[ex].double().T * float(weights[tok, s])
    return out


def _close(got, ref, tol):
    scale = float(ref.abs().max())
    assert torch.isfinite(got).all()
    err = float((got.double() - ref).abs().max())
    assert err <= tol * scale, err / scale


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,e,k,i,h,bn,bk", [
    (1, 8, 2, 48, 40, 32, 32),    # N and K not multiples of the blocks
    (3, 6, 3, 40, 72, 16, 64),    # K shorter than one block; 3 slots padded to 4
    (17, 4, 2, 33, 65, 16, 32),
])
@pytest.mark.parametrize("mma", [False, True], ids=["cuda_cores", "mma"])
def test_the_pair_major_kernels_normalise_x_and_add_the_residual(dtype, tol, t, e, k, i, h, bn, bk, mma):
    x, nw, residual, ids, weights, w_gu, w_d = _case(t, e, k, i, h, dtype)
    cfg = tm.TritonMoeConfig(1, max(bn, 16) if mma else bn, bk, mma=mma)
    got = torch.full((t, h), float("nan"), dtype=dtype)
    got.copy_(moe_pairs.run_pairs(cfg, x, w_gu, w_d, ids, weights, norm=(nw, EPS), residual=residual))
    _close(got, _reference(x, nw, residual, ids, weights, w_gu, w_d), tol)
    # the add is the layer's: the same kernel's sum without the residual, then torch's add
    plain = moe_pairs.run_pairs(cfg, x, w_gu, w_d, ids, weights, norm=(nw, EPS))
    assert torch.equal(got, residual + plain)
    # without the norm, the output is not the normalised one (x's rms is about 3)
    unnormed = moe_pairs.run_pairs(cfg, x, w_gu, w_d, ids, weights)
    assert (unnormed - plain).abs().max() > 0.1 * plain.abs().max()


@pytest.mark.parametrize("t,k,h", [(1, 2, 40), (3, 8, 1030)])
def test_sum_slots_adds_the_residual_to_the_rounded_sum(t, k, h):
    g = torch.Generator().manual_seed(4)
    per_pair = torch.randn(t * k, h, generator=g)
    residual = torch.randn(t, h, generator=g).half()
    got = tm.sum_slots(per_pair, k, torch.float16, residual)
    assert torch.equal(got, residual + tm.sum_slots(per_pair, k, torch.float16))


def test_every_path_of_moe_computes_the_layers_second_half(monkeypatch):
    """The PyTorch loop (no kernels), the pair-major kernels (norm in gate/up, residual in down)
    and the grouped kernels (norm apart, residual in the slot sum) agree with fp64."""
    t, e, k, i, h = 4, 16, 2, 40, 56
    x, nw, residual, ids, weights, w_gu, w_d = _case(t, e, k, i, h, torch.float32, seed=2)
    ref = _reference(x, nw, residual, ids, weights, w_gu, w_d)
    loop = moe_mod.moe(x, (ids, weights), w_gu, w_d, norm=(nw, EPS), residual=residual)
    _close(loop, ref, 1e-5)
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    calls = []
    run_pairs = moe_pairs.run_pairs
    monkeypatch.setattr(tm, "run_pairs", lambda *a, **kw: calls.append(1) or run_pairs(*a, **kw))
    pair = moe_mod.moe(x, (ids, weights), w_gu, w_d, norm=(nw, EPS), residual=residual)
    assert len(calls) == 1  # the default configs of 8 pairs over 16 experts: pair-major
    _close(pair, ref, 1e-4)
    grouped = moe_mod.moe(x, (ids, weights), w_gu, w_d, config=tm.TritonMoeConfig(16, 32, 32), norm=(nw, EPS),
                          residual=residual)
    assert len(calls) == 1
    _close(grouped, ref, 1e-4)
    assert torch.equal(pair, moe_mod.moe(x, (ids, weights), w_gu, w_d, norm=(nw, EPS), residual=residual))
    empty = moe_mod.moe(x[:0], (ids[:0], weights[:0]), w_gu, w_d, norm=(nw, EPS), residual=residual[:0])
    assert empty.shape == (0, h)


def test_bad_norm_and_residual_operands_are_clear_errors(monkeypatch):
    x, nw, residual, ids, weights, w_gu, w_d = _case(2, 4, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        moe_mod.moe(x, (ids, weights), w_gu, w_d, residual=residual[:, :8])
    with pytest.raises(ValueError, match="residual"):
        moe_mod.moe(x, (ids, weights), w_gu, w_d, residual=residual.half())
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    with pytest.raises(ValueError, match="norm weight"):
        moe_mod.moe(x, (ids, weights), w_gu, w_d, norm=(nw[:8], EPS))
    with pytest.raises(ValueError, match="norm prologue"):
        tm.forward(x, ids, weights, w_gu, w_d, "silu", tm.TritonMoeConfig(16, 32, 32), tm.TritonMoeConfig(16, 32, 32),
                   norm=(nw, EPS))
    with pytest.raises(ValueError, match="residual"):
        tm.sum_slots(torch.zeros(4, 16), 2, torch.float32, torch.zeros(2, 8))
