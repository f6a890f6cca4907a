"""Triton split-K with a second product summed into the same launch (``run(second=)``): a
parallel-residual layer's ``dense(o) + dense_4h_to_h(g)`` in one GEMM over two K sources.

Runs under the Triton interpreter on a CPU machine (fp16/fp32); bf16 on the GPU (the ``gpu``
test at the end).
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_counters_zero, poisoned, rel_err
from helpers import make_operands as operands
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.epilogue import Activation, apply_activation
from hybridgemm.kernels.fp8 import quantize_fp8

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

Cfg = ts.TritonSplitKConfig
TWO_LAUNCH = Cfg(16, 16, 16, split_k=3, num_warps=4, num_stages=2)  # partials, then the reduce kernel
ONE_SPLIT = Cfg(16, 32, 32, split_k=1, num_warps=4, num_stages=2)  # its own split, the second's: one launch
FUSED = Cfg(16, 32, 16, split_k=2, num_warps=4, num_stages=3, fused_reduce=True)
CONFIGS = [TWO_LAUNCH, ONE_SPLIT, FUSED]
EPS = {torch.float16: 1e-4, torch.float32: 1e-6}


def _ids(c):
    return f"split{c.split_k}{'-fused' if c.fused_reduce else ''}"


def _reference(x, w, b, x2, w2, b2, act=Activation.NONE, residual=None, residual2=None):
    """In fp64: act(x W^T + x2 W2^T + b + b2) (+ residual) (+ residual2)."""
    y = x.double() @ w.double().T + x2.double() @ w2.double().T
    for t in (b, b2):
        if t is not None:
            y = y + t.double()
    y = apply_activation(y, act)
    for r in (residual, residual2):
        if r is not None:
            y = y + r.double()
    return y


def _same_dtype(x, w, b, x2, w2, b2, act=Activation.NONE):
    """PyTorch in the operands' dtype, the two products apart: the rounding a bound is made of."""
    y = torch.nn.functional.linear(x, w, b) + torch.nn.functional.linear(x2, w2, b2)
    return apply_activation(y, act)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("biases", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["both", "second", "first", "none"])
def test_both_products_and_both_biases_are_summed(cfg, dtype, m, biases, device):
    """Against fp64 on fresh data, into a poisoned output: K = 45 and K2 = 29 (neither a multiple of
    the K block: the masked loads), N = 37 (a partial N tile), M over one and two row blocks."""
    torch.manual_seed(m)
    x, w, b = operands(m, 37, 45, dtype, device, biases[0])
    x2, w2, b2 = operands(m, 37, 29, dtype, device, biases[1])
    out = poisoned((m, 37), dtype, device)
    assert ts.run(cfg, x, w, b, out, None, second=(x2, w2, b2)) is out
    ref = _reference(x, w, b, x2, w2, b2)
    bound = 2 * rel_err(_same_dtype(x, w, b, x2, w2, b2), ref) + EPS[dtype]
    assert rel_err(out, ref) <= bound
    assert_counters_zero()


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
@pytest.mark.parametrize("act", [Activation.GELU, Activation.RELU], ids=lambda a: a.value)
def test_the_activation_and_residuals_apply_to_the_sum(cfg, act, device):
    """act(x W^T + x2 W2^T + b + b2), rounded, + r, rounded, + r2, rounded: the residuals of other
    row strides than the output's, r2 at a residual stream's magnitude."""
    torch.manual_seed(7)
    m, n, dtype = 5, 48, torch.float16
    x, w, b = operands(m, n, 64, dtype, device)
    x2, w2, b2 = operands(m, n, 96, dtype, device)
    r = torch.randn(m, n + 16, dtype=torch.float64).to(dtype).to(device)[:, 3:3 + n]
    r2 = (torch.randn(m, n + 48, dtype=torch.float64) * 300).to(dtype).to(device)[:, 8:8 + n]
    out = ts.run(cfg, x, w, b, poisoned((m, n), dtype, device), act, second=(x2, w2, b2), residual=r, residual2=r2)
    bare = ts.run(cfg, x, w, b, poisoned((m, n), dtype, device), act, second=(x2, w2, b2))
    assert torch.equal(out, ((bare.float() + r.float()).to(dtype).float() + r2.float()).to(dtype))
    ref = _reference(x, w, b, x2, w2, b2, act)
    assert rel_err(bare, ref) <= 2 * rel_err(_same_dtype(x, w, b, x2, w2, b2, act), ref) + EPS[dtype]
    assert_counters_zero()


@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_the_splits_are_one_gemm_over_the_concatenated_k(fused, device):
    """Where K is whole splits of the config's extent, the second product's splits are the ones a
    GEMM over [x | x2] @ [W | W2]^T would take with as many splits, summed in the same order: the
    same bits, in both reductions, call after call."""
    torch.manual_seed(3)
    m, n, k, k2 = 3, 40, 64, 48  # extent 32 (split 2 of 64): 2 + 2 splits (the second's last one short)
    x, w, b = operands(m, n, k, torch.float32, device)
    x2, w2, _ = operands(m, n, k2, torch.float32, device, bias=False)
    cfg = Cfg(16, 16, 16, split_k=2, num_warps=4, num_stages=2, fused_reduce=fused)
    pair = ts.run(cfg, x, w, b, poisoned((m, n), torch.float32, device), None, second=(x2, w2, None))
    cat = Cfg(16, 16, 16, split_k=4, num_warps=4, num_stages=2, fused_reduce=fused)  # K 112: extent 32, 4 splits
    one = ts.run(cat, torch.cat([x, x2], 1), torch.cat([w, w2], 1), b, poisoned((m, n), torch.float32, device), None)
    assert torch.equal(pair, one)
    again = ts.run(cfg, x, w, b, poisoned((m, n), torch.float32, device), None, second=(x2, w2, None))
    assert torch.equal(pair, again)
    assert_counters_zero()


def test_padded_rows_and_a_second_of_another_k_take_their_own_plans(device):
    """x2 and W2 with padded rows (row strides past K2), then the same first operands with a
    second product of another K2: each call's plan is its own (the second's layout is in the key)."""
    torch.manual_seed(5)
    m, n, dtype = 4, 33, torch.float32
    x, w, b = operands(m, n, 40, dtype, device)
    for k2 in (24, 56):
        x2 = torch.randn(m, k2 + 8, dtype=dtype, device=device)[:, 4:4 + k2]
        w2 = (torch.randn(n, k2 + 16, dtype=dtype, device=device) / k2 ** 0.5)[:, :k2]
        b2 = torch.randn(n, dtype=dtype, device=device)
        out = ts.run(FUSED, x, w, b, poisoned((m, n), dtype, device), None, second=(x2, w2, b2))
        ref = _reference(x, w, b, x2, w2, b2)
        assert rel_err(out, ref) <= 2 * rel_err(_same_dtype(x, w, b, x2, w2, b2), ref) + EPS[dtype]


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_many_more_splits_of_the_second_product_and_an_empty_one(cfg, device):
    """A second product of 13x the first's K (more splits than one fixup group gathers at a time:
    triton_scratch.TL_MAX_FIXUP_GROUP), and one of no columns at all, whose bias still adds."""
    torch.manual_seed(11)
    m, n, dtype = 3, 40, torch.float32
    x, w, b = operands(m, n, 48, dtype, device)
    for k2 in (13 * 48, 0):
        x2, w2, b2 = operands(m, n, k2, dtype, device)
        out = ts.run(cfg, x, w, b, poisoned((m, n), dtype, device), None, second=(x2, w2, b2))
        ref = _reference(x, w, b, x2, w2, b2)
        assert rel_err(out, ref) <= 2 * rel_err(_same_dtype(x, w, b, x2, w2, b2), ref) + EPS[dtype], k2
    assert_counters_zero()


def test_bad_second_operands_are_refused_by_name():
    m, n, k, dtype = 3, 32, 64, torch.float16
    x, w, b = operands(m, n, k, dtype, "cpu")
    x2, w2, b2 = operands(m, n, 32, dtype, "cpu")
    out = torch.empty(m, n, dtype=dtype)
    with pytest.raises(TypeError, match=r"second must be \(x2, weight2, bias2\)"):
        ts.run(FUSED, x, w, b, out, None, second=(x2, w2))
    with pytest.raises(ValueError, match="shape mismatch"):
        ts.run(FUSED, x, w, b, out, None, second=(x2, w2[:, :16], b2))
    with pytest.raises(ValueError, match="shape mismatch"):
        ts.run(FUSED, x, w, b, out, None, second=(x2[:2], w2, b2))
    with pytest.raises(TypeError, match="dtype"):
        ts.run(FUSED, x, w, b, out, None, second=(x2.float(), w2.float(), None))
    with pytest.raises(ValueError, match="bias must be a contiguous vector"):
        ts.run(FUSED, x, w, b, out, None, second=(x2, w2, b2[:5]))
    with pytest.raises(ValueError, match="second takes no norm"):
        ts.run(FUSED, x, w, b, out, None, norm=(torch.ones(k, dtype=dtype), 1e-5), second=(x2, w2, b2))
    q = quantize_fp8(w.float(), "channel")
    with pytest.raises(ValueError, match="second takes no norm, rope, glu, route or FP8 weight"):
        ts.run(FUSED, x, q.data, b, out, None, weight_scale=q.scale, second=(x2, w2, b2))


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_splitk as ts

fn = ts._splitk_kernel
ptr = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
       "cnt_ptr": "*i32", "res_ptr": "*bf16", "res2_ptr": "*bf16", "x2_ptr": "*bf16", "w2_ptr": "*bf16",
       "bias2_ptr": "*bf16"}
floats = ("inv_k", "eps", "res_scale", "qk_eps")
# the pointers, both K and the row strides multiples of 16, as Triton specialises pythia-6.9b's and
# falcon-7b's operands: the W loads of either product then pipelined by cp.async
aligned = set(ptr) | {"K", "ldx", "ldw", "ldo", "k_per_split", "K2", "ldx2", "ldw2"}
consts = dict(BM=16, BN=64, BK=256, HAS_BIAS=True, ACT=0, PREC="tf32", EVEN_K=True, NORM=False, RESIDUAL=True,
              ROPE=False, KV=False, HD=2, PDL=True, QK_NORM=False, RES_SCALED=False, WSCALE=0, WINT=False,
              QK_FACTOR=False, QK_OFFSET=0.0, NW_OFFSET=0.0, GLU=0, PREFETCH=0, ROUTE=0, ROUTE_KP=1,
              RENORMALIZE=False, ROT=2, QG=0, PAIRS=False, RES2=False, TWO=True, HAS_BIAS2=True)
for mode, even, splits in ((2, True, 3), (2, False, 2), (1, True, 5)):
    meta = dict(consts, MODE=mode, EVEN_K=even, FIXUP=ts.fixup_group(16, 64, 4, splits))
    sig = {n: "constexpr" if n in meta else ptr.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=meta, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    assert "cp.async.cg.shared.global" in c.asm["ptx"], (mode, even)
fn = ts._reduce_kernel
meta = dict(BLOCK=1024, HAS_BIAS=True, ACT=0, NORM=False, RESIDUAL=True, RES_SCALED=False, PDL=True, RES2=True,
            HAS_BIAS2=True)
sig = {n: "constexpr" if n in meta else ptr.get(n, "*fp32" if n == "ws_ptr" else "fp32" if n in floats else "i32")
       for n in fn.arg_names}
assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=meta), target=GPUTarget("cuda", 90, 32),
                      options={"num_warps": 4}).asm["cubin"]
print("compiled")
"""


def test_the_kernels_compile_for_hopper_with_the_loads_pipelined():
    """Built for sm_90 by Triton's ptxas (no GPU needed): both reductions, whole and partial K
    blocks, the W loads through cp.async's pipeline with the product's operands selected per split."""
    from helpers import compile_offline

    compile_offline(_COMPILE_FOR_HOPPER)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,k2,cfg", [
    (4096, 16384, 4096, Cfg(16, 64, 256, split_k=2, num_warps=4, num_stages=3, fused_reduce=True)),
    (4544, 18176, 4544, Cfg(16, 64, 256, split_k=1, num_warps=4, num_stages=4)),
    (4096, 16384, 4096, Cfg(16, 64, 128, split_k=8, num_warps=4, num_stages=4)),
], ids=["pythia-6.9b", "falcon-7b", "two-launch"])
@pytest.mark.parametrize("m", [1, 8])
def test_bf16_sums_as_close_as_two_gemms_and_the_same_bits_in_every_replay(n, k, k2, cfg, m):
    """bf16 at pythia-6.9b's and falcon-7b's dense_4h_to_h + dense shapes (the H200 table's
    configs for dense_4h_to_h; falcon's K2 not whole K blocks; a two-launch reduction): the sum,
    rounded once, at least as close to fp64 as the two GEMMs apart with stock's roundings, and
    with the residual added within 1e-3 of them; the same bits over 50 calls and 20 replays of a
    captured CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(m)
    dt = torch.bfloat16
    x, w, b = operands(m, n, k, dt, "cuda")
    x2, w2, b2 = operands(m, n, k2, dt, "cuda")
    r = (torch.randn(m, n, device="cuda") * 30).to(dt)
    bare = ts.run(cfg, x, w, b, poisoned((m, n), dt, "cuda"), None, second=(x2, w2, b2))
    apart = torch.nn.functional.linear(x, w, b) + torch.nn.functional.linear(x2, w2, b2)
    want = _reference(x, w, b, x2, w2, b2)
    assert rel_err(bare, want) <= rel_err(apart, want), (rel_err(bare, want), rel_err(apart, want))  # one rounding
    out = poisoned((m, n), dt, "cuda")
    ts.run(cfg, x, w, b, out, None, second=(x2, w2, b2), residual=r)
    first = out.clone()
    stock = apart + r
    ref = _reference(x, w, b, x2, w2, b2, residual=r)
    assert rel_err(first, ref) <= rel_err(stock, ref) + 1e-3, (rel_err(first, ref), rel_err(stock, ref))
    for _ in range(50):
        ts.run(cfg, x, w, b, out, None, second=(x2, w2, b2), residual=r)
        assert torch.equal(out, first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ts.run(cfg, x, w, b, out, None, second=(x2, w2, b2), residual=r)
    out.fill_(float("nan"))
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    assert_counters_zero()
