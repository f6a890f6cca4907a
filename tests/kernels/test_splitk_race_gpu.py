"""Split-K reductions under contention (``pytest -m gpu``): the bits never depend on which
split arrives first or last.

The one-launch split-K paths (``fused_reduce`` in triton_splitk, split-K tiles in
triton_gemm) let the last program to arrive add every split's partial, in split order. A
reduction done by the first program to arrive, or in arrival order, would still be right to
within rounding, so an error bound cannot see it; only bitwise comparison over many calls
whose arrival order varies can. The CPU interpreter runs programs one at a time and can never
show it.

Arrival order is shaken by a second stream running large GEMMs while the calls under test are
queued back to back. A positive control runs an atomic (arrival-order) sum of random fp32
partials under the same load and must see more than one bit pattern: if it did not, the
harness would not be able to show a race, and the test says so instead of passing.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_counters_zero, make_operands
from hybridgemm.kernels import triton_gemm as tg
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

pytestmark = pytest.mark.gpu

REPEATS = 200


def _under_load(calls: int, launch) -> None:
    """``launch(i)`` for i in range(calls) on the current stream while another stream keeps
    the SMs busy with 4096^3 GEMMs (they start before the first call and end after the last)."""
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(max(4, calls // 8)):
            a = (a @ a).mul_(1e-2)
    for i in range(calls):
        launch(i)
    torch.cuda.synchronize()


def _distinct(outs: torch.Tensor) -> int:
    """How many different bit patterns the rows of ``outs`` (R, ...) hold."""
    flat = outs.reshape(outs.shape[0], -1)
    return len({bytes(row.view(torch.uint8).cpu().numpy()) for row in flat})


@pytest.fixture(scope="module")
def control_varies() -> None:
    """An atomic fp32 sum of 8 partials per element under the same load gives more than one
    bit pattern over the repeats: the load does reorder arrivals."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    s, n = 8, 64 * 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    partials = torch.randn(s * n, device="cuda", generator=gen) * torch.logspace(-3, 3, s * n, device="cuda")
    index = torch.arange(n, device="cuda").repeat(s)
    outs = torch.zeros(REPEATS, n, device="cuda")
    _under_load(REPEATS, lambda i: outs[i].index_add_(0, index, partials))
    assert _distinct(outs) > 1, "an arrival-order sum gave one bit pattern: this load cannot expose a race"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("split_k", [4, 11, 16])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_fused_splitk_equals_two_pass_under_load(control_varies, dtype, split_k, m):
    """Every one of REPEATS fused calls equals the two-launch reduction bit for bit (the merge
    loads 4 (split 4) or 8 partials at a time: 11 ends on a part-filled group)."""
    n, k = 1064, 8192  # N not a multiple of the tile: a partial last tile
    x, w, b = make_operands(m, n, k, dtype, "cuda")
    bk = 256 // x.element_size() * 2
    fused = ts.TritonSplitKConfig(16, 32, bk, split_k, 4, 3, fused_reduce=True)
    two = ts.TritonSplitKConfig(16, 32, bk, split_k, 4, 3)
    ref = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    ts.run(two, x, w, b, ref, Activation.GELU_TANH)
    outs = torch.full((REPEATS, m, n), float("nan"), dtype=dtype, device="cuda")
    _under_load(REPEATS, lambda i: ts.run(fused, x, w, b, outs[i], Activation.GELU_TANH))
    assert torch.isfinite(ref).all()
    same = (outs == ref).flatten(1).all(dim=1)
    assert bool(same.all()), f"{int((~same).sum())} of {REPEATS} fused calls differ from the two-pass bits"
    assert_counters_zero()


@pytest.mark.parametrize("m", [64, 256])
def test_tiled_splitk_repeats_bitwise_under_load(control_varies, m):
    """The tiled kernel's split-K candidates (one launch, last arrival reduces) give the same
    bits on every one of REPEATS calls under load."""
    x, w, b = make_operands(m, 1024, 4096, torch.bfloat16, "cuda")
    out = torch.empty(m, 1024, dtype=x.dtype, device="cuda")
    problem = Problem.from_tensors(x, w, b, out, Epilogue(Activation.RELU, True), False)
    configs = [c for c in tg.candidates(problem) if c.split_k > 1]
    assert configs, "no split-K candidate for the few-tiles shape"
    for cfg in configs:
        outs = torch.full((REPEATS, m, 1024), float("nan"), dtype=x.dtype, device="cuda")
        _under_load(REPEATS, lambda i, cfg=cfg, outs=outs: tg.run(cfg, x, w, b, outs[i], Activation.RELU))
        assert torch.isfinite(outs).all(), cfg
        assert _distinct(outs) == 1, f"{cfg}: {_distinct(outs)} different results over {REPEATS} calls"
        assert_counters_zero()


@pytest.mark.parametrize("split_k", [9, 11])
def test_fused_splitk_with_the_norm_equals_two_pass_under_load(control_varies, split_k):
    """The RMSNorm prologue's sums of squares are merged like the partials, in groups of 8 here:
    past one group, the last part-filled, REPEATS fused calls under load give the two-launch
    bits, and those are close to the fp64 result."""
    m, n, k = 3, 1064, 512 * split_k  # two K tiles a split
    x, w, b = make_operands(m, n, k, torch.bfloat16, "cuda")
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    fused = ts.TritonSplitKConfig(16, 32, 256, split_k, 4, 3, fused_reduce=True)
    two = ts.TritonSplitKConfig(16, 32, 256, split_k, 4, 3)
    ref = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
    ts.run(two, x, w, b, ref, None, norm=(nw, 1e-6))
    outs = torch.full((REPEATS, m, n), float("nan"), dtype=x.dtype, device="cuda")
    _under_load(REPEATS, lambda i: ts.run(fused, x, w, b, outs[i], None, norm=(nw, 1e-6)))
    assert torch.isfinite(ref).all()
    same = (outs == ref).flatten(1).all(dim=1)
    assert bool(same.all()), f"{int((~same).sum())} of {REPEATS} fused calls differ from the two-pass bits"
    assert_counters_zero()
    exact = torch.nn.functional.linear(torch.nn.functional.rms_norm(x.double(), (k,), nw.double(), 1e-6),
                                       w.double(), b.double())
    assert float((ref.double() - exact).norm() / exact.norm()) < 1e-2
