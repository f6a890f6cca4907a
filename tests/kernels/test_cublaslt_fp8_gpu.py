"""The FP8 prefill GEMM through cuBLASLt (kernels/cublaslt_fp8.py) on a Hopper GPU: against an
fp64 reference built from the dequantized weight and the dequantized quantized activations, for
both weight granularities, bf16 and fp16, odd M, every activation, with and without bias;
against the bf16 reference (unquantized x) to show what quantizing the activations costs;
poisoned outputs, strided operands, determinism, CUDA graphs, the plan cache."""

from __future__ import annotations

import pytest
import torch

from helpers import poisoned, rel_err
from hybridgemm.kernels import cublaslt_fp8 as cf
from hybridgemm.kernels import fp8_quant as fq
from hybridgemm.kernels.cublaslt_runtime import CublasLtUnsupported
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.fp8 import quantize_fp8
from hybridgemm.kernels.problem import Problem

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

if torch.cuda.is_available() and not cf.is_available():
    pytest.skip(f"the FP8 cuBLASLt path cannot run here: {cf.environment()[1]}", allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16]
ACTS = [None, "relu", "gelu_tanh", "gelu"]
SHAPES_NK = [(4096, 4096), (1000, 1152), (6144, 4096)]
MS = [1, 17, 333, 2048]
# What each output element may be off by, beyond rounding, as a fraction of sum_l |x_l w_l|:
# Hopper's FP8 tensor cores keep about 14 bits while they accumulate (DeepSeek-V3 report, §3.3.2).
# Where cuBLAS promotes the partial sums to fp32 every few MMAs (block scales) that stays small;
# where the tensor cores accumulate on their own (per-channel plans, cf.FAST_ACCUM) it grows: on
# an H100 these operands reached 2^-10.5 (scripts/fp8_accum_bound_probe.py,
# perf/results/h100/logs/fp8_accum_bound_probe_fast.txt).
ACC_SLACK = {"promoted": 2.0**-13, "fast": 2.0**-9}
ULPS = 2  # rounding of the output (and of the pre-activation where the activation runs after)
SLOPE = {None: 1.0, "relu": 1.0, "gelu_tanh": 1.2, "gelu": 1.2}  # bound on |act'|


def unit(dtype) -> float:
    return torch.finfo(dtype).eps / 2


def operands(m, n, k, dtype, granularity, bias):
    """x with rows and 128-column blocks of different magnitudes (so per-token and per-block
    scales differ), an FP8 weight whose rows and 128-column blocks differ too, a bias."""
    def blocks(cols):
        return (10 ** (torch.rand(1, -(-cols // 128), device="cuda") - 0.5)).repeat_interleave(128, dim=1)[:, :cols]

    x = torch.randn(m, k, device="cuda") * 10 ** (torch.rand(m, 1, device="cuda") * 2 - 1) * blocks(k)
    w = torch.randn(n, k, device="cuda") / k**0.5 * 10 ** (torch.rand(n, 1, device="cuda") - 0.5) * blocks(k)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    return x.to(dtype), quantize_fp8(w, granularity), b


def dequantized_weight(w) -> torch.Tensor:
    n, k = w.shape
    s = w.scale.double()
    if w.granularity == "channel":
        return w.data.double() * s[:, None]
    return w.data.double() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def dequantized_activations(x, granularity) -> torch.Tensor:
    """What the GEMM multiplies: x quantized as the path quantizes it, dequantized in fp64."""
    x8, s = fq.quantize_activations(x, cf.ACTIVATION_GROUP[granularity])
    k = x.shape[1]
    per = s.double()[:, None] if granularity == "channel" else s.double().repeat_interleave(128, 1)[:, :k]
    return x8.double() * per


def accumulation(granularity) -> str:
    return "fast" if cf.FAST_ACCUM and granularity == "channel" else "promoted"


def check_against(out, z, act, dtype, what, slack):
    """|out - act(z)| <= ULPS ulp(|act(z)| + slope |z|) + slack * sum|x w| elementwise;
    returns the worst ratio of error to bound and the worst error in output ulps."""
    ref = apply_activation(z.value, Activation.parse(act))
    err = (out.double() - ref).abs()
    bound = ULPS * unit(dtype) * (ref.abs() + SLOPE[act] * z.value.abs()) + slack * z.abs_sum
    ratio = (err / bound).max().item()
    ulps = (err / (unit(dtype) * ref.abs().clamp_min(torch.finfo(dtype).tiny))).max().item()
    worst = (err / bound).argmax().item()
    assert ratio <= 1.0, (f"{what}: error {err.flatten()[worst].item():.3g} over its bound "
                          f"{bound.flatten()[worst].item():.3g} (x{ratio:.2f}) at flat index {worst}")
    return ratio, ulps


class Preactivation:
    """The fp64 reference's x @ W.T + b and sum_l |x_l w_l| (the accumulation bound's scale)."""

    def __init__(self, xq, w64, b):
        self.value = xq @ w64.T + (b.double() if b is not None else 0)
        self.abs_sum = xq.abs() @ w64.abs().T


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("nk", SHAPES_NK, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("m", MS)
def test_matches_the_dequantized_reference(dtype, granularity, bias, nk, m, record_property):
    n, k = nk
    x, w, b = operands(m, n, k, dtype, granularity, bias)
    w64 = dequantized_weight(w)
    xq = dequantized_activations(x, granularity)
    z = Preactivation(xq, w64, b)
    z_bf = x.double() @ w64.T + (b.double() if b is not None else 0)  # x unquantized
    for act in ACTS:
        out = poisoned((m, n), dtype, "cuda")
        cf.run(x, w.data, w.scale, b, out, act)
        assert torch.isfinite(out).all(), f"{act}: some outputs were never written"
        what = f"{granularity} {dtype} M={m} N={n} K={k} bias={bias} act={act} ({accumulation(granularity)})"
        ratio, ulps = check_against(out, z, act, dtype, what, ACC_SLACK[accumulation(granularity)])
        ref_bf = apply_activation(z_bf, Activation.parse(act))
        ours_vs_bf = rel_err(out, ref_bf)
        quantizing = rel_err(apply_activation(z.value, Activation.parse(act)), ref_bf)
        record_property(f"{act}", f"bound ratio {ratio:.3f}, worst {ulps:.1f} ulps, vs bf16 ref {ours_vs_bf:.3e} "
                                  f"(activation quantization alone {quantizing:.3e})")
        print(f"{what}: bound ratio {ratio:.3f}, worst {ulps:.1f} ulps; rel err vs unquantized-x reference "
              f"{ours_vs_bf:.3e}, of which activation quantization {quantizing:.3e}")
        # quantizing x to e4m3 costs a few percent, not more (a wrong scale layout costs O(1))
        assert ours_vs_bf < 0.08, f"{what}: rel err {ours_vs_bf:.3e} against the unquantized-x reference"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_deterministic(dtype, granularity):
    for m in (333, 2048):
        x, w, b = operands(m, 4096, 4096, dtype, granularity, True)
        first = cf.run(x, w.data, w.scale, b, None, "gelu_tanh")
        second = poisoned(first.shape, dtype, "cuda")
        cf.run(x, w.data, w.scale, b, second, "gelu_tanh")
        assert torch.equal(first, second)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_strided_operands_and_a_prepared_scale(granularity):
    m, n, k = 37, 1000, 1152
    x, w, b = operands(m, n, k, torch.bfloat16, granularity, True)
    want = cf.run(x, w.data, w.scale, b, None, "relu")
    wide_x = torch.zeros(m, k + 64, dtype=x.dtype, device="cuda")
    wide_x[:, 8 : 8 + k] = x
    wide_out = poisoned((m, n + 24), x.dtype, "cuda")
    out = wide_out[:, :n]  # row stride n + 24: a multiple of 8
    cf.run(wide_x[:, 8 : 8 + k], w.data, w.scale, b, out, "relu")
    assert torch.equal(out, want) and torch.isnan(wide_out[:, n:]).all()
    prepared = cf.weight_scale_operand(w.scale, granularity)  # once per weight: no copy per call
    assert torch.equal(cf.run(x, w.data, prepared, b, None, "relu"), want)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_cuda_graph_replays_on_new_inputs(granularity):
    m, n, k = 333, 4096, 4096
    x, w, b = operands(m, n, k, torch.bfloat16, granularity, True)
    out = torch.empty(m, n, dtype=x.dtype, device="cuda")
    cf.run(x, w.data, w.scale, b, out, "gelu_tanh")  # plan and Triton launcher built outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cf.run(x, w.data, w.scale, b, out, "gelu_tanh")
    for _ in range(3):
        x.copy_(operands(m, n, k, torch.bfloat16, granularity, False)[0])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, cf.run(x, w.data, w.scale, b, None, "gelu_tanh"))


def test_plans_are_cached_and_say_where_the_activation_runs():
    cf.clear_caches()
    x, w, b = operands(64, 4096, 4096, torch.bfloat16, "block128", True)
    for act in ACTS:
        for _ in range(3):
            cf.run(x, w.data, w.scale, b, None, act)
    assert len(cf._plans) == len(ACTS)
    where = {key[1].value: ("after the GEMM" if plan.post is not Activation.NONE else "in cuBLASLt's epilogue")
             for key, plan in cf._plans.items()}
    print(f"block128 bf16 with bias, activation: {where}")
    assert where["gelu"] == "after the GEMM"  # cuBLASLt has no exact GELU


def test_supports_on_this_machine():
    x, w, b = operands(16, 4096, 4096, torch.bfloat16, "channel", True)
    out = torch.empty(16, 4096, dtype=x.dtype, device="cuda")
    problem = Problem.from_tensors(x, w.data, b, out, Epilogue(Activation.RELU, True), weight_format=w.weight_format)
    assert cf.supports(problem) == (True, "")
    # what it cannot run it refuses with CublasLtUnsupported, for the caller to fall back
    odd = quantize_fp8(torch.randn(64, 4104, device="cuda"), "channel")
    with pytest.raises(CublasLtUnsupported, match="K=4104"):
        cf.run(torch.randn(4, 4104, device="cuda").to(torch.bfloat16), odd.data, odd.scale)
    with pytest.raises(CublasLtUnsupported, match="out's rows"):
        cf.run(x, w.data, w.scale, b, torch.empty(16, 4100, dtype=x.dtype, device="cuda")[:, 2:4098])
