"""``fused_pieces.pair_residual``: a parallel-residual layer's dense_4h_to_h and dense GEMMs and
its residual, one split-K launch as torch.compile calls the piece (its custom op), the two GEMMs
apart otherwise. CPU (kernels under the Triton interpreter, the device check widened); the
layers that use it: tests/models/test_layernorm_layers.py (GPT-NeoX, Falcon),
tests/models/test_decode_step.py (Cohere, StableLM); bf16 on the GPU:
tests/models/test_decode_step_gpu.py (``gpt_neox``, ``falcon``)."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from hybridgemm.models import fused_pieces

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _operands(dtype, batch=3, n=48, k=96, k2=40, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    x, x2 = rand(batch, 1, k), rand(batch, 1, k2)
    w, w2 = rand(n, k, scale=k ** -0.5), rand(n, k2, scale=k2 ** -0.5)
    b, b2 = (rand(n), rand(n)) if bias else (None, None)
    residual = rand(batch, 1, n, scale=30.0)
    return x, w, b, x2, w2, b2, residual


def _reference(x, w, b, x2, w2, b2, residual):
    y = x.double() @ w.double().T + x2.double() @ w2.double().T + residual.double()
    return y + sum(t.double() for t in (b, b2) if t is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_the_op_sums_both_products_in_one_launch(dtype, bias, kernels_on_cpu):
    """The custom op: one split-K launch with the second product, as close to fp64 as the two
    GEMMs apart (each rounded, as stock's parallel layer computes it)."""
    ops = _operands(dtype, bias=bias)
    got = torch.ops.hybridgemm.pair_residual_fwd(*ops, None)
    assert kernels_on_cpu["second"] == 1
    apart = fused_pieces.pair_residual(*ops)  # (eager: the two apart)
    assert kernels_on_cpu["second"] == 1
    want = _reference(*ops)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(got, want) <= rel_err(apart, want) + {torch.float32: 1e-6, torch.float16: 1e-4}[dtype]
    assert torch.equal(got, torch.ops.hybridgemm.pair_residual_fwd(*ops, None))  # the same bits again


def test_without_a_split_k_decision_the_two_run_apart(kernels_on_cpu):
    """Where the table's decision for dense_4h_to_h is not split-K, the op computes the GEMMs
    apart: the eager body's bits."""
    ops = _operands(torch.float32)
    kernels_on_cpu["config"] = None
    got = torch.ops.hybridgemm.pair_residual_fwd(*ops, None)
    assert kernels_on_cpu["second"] == 0
    assert torch.equal(got, fused_pieces._pair_apart(*ops))
    assert rel_err(got, _reference(*ops)) < 1e-6


def test_the_custom_op_passes_opcheck():
    """``hybridgemm::pair_residual_fwd``: schema, fake tensors and autograd registration checked
    by torch.library.opcheck (the CPU form)."""
    torch.library.opcheck(torch.ops.hybridgemm.pair_residual_fwd, (*_operands(torch.float32), None))


@pytest.mark.parametrize("seed", range(3))
def test_residual_first_rounds_as_cohere_adds(seed, kernels_on_cpu):
    """``residual_first`` (Cohere's and StableLM's ``x + a + mlp``, left to right): the residual
    plus the second product, rounded, plus the first product, rounded; without it GPT-NeoX's
    ``(mlp + a) + x``. fp16, the residual 30x the products: the two orders round apart. The
    eager piece (the two GEMMs apart)."""
    x, w, b, x2, w2, b2, residual = ops = _operands(torch.float16, batch=5, n=200, seed=seed)

    def product(a, weight, bias):  # (one GEMM, fp32 accumulation, rounded to fp16)
        return (a.float() @ weight.float().T + bias.float()).half()

    def add(u, v):  # (as stock adds two fp16 tensors)
        return (u.float() + v.float()).half()

    first = add(add(residual, product(x2, w2, b2)), product(x, w, b))
    mlp_first = add(add(product(x, w, b), product(x2, w2, b2)), residual)
    got, other = fused_pieces.pair_residual(*ops, residual_first=True), fused_pieces.pair_residual(*ops)
    assert not torch.equal(first, mlp_first)  # (the orders tell apart on these operands)
    assert torch.equal(got, first) and torch.equal(other, mlp_first)
