"""The split-K kernel with an e4m3 weight (kernels/triton_splitk.py ``weight_scale=``), under the
Triton interpreter (fp16 x): against an fp64 product with the dequantized weight, each
reduction mode, the norm and residual fusions, odd shapes, poisoned outputs and scales."""

from __future__ import annotations

import pytest
import torch

from hybridgemm.kernels import triton_splitk as sk
from hybridgemm.kernels import triton_splitk_configs
from hybridgemm.kernels.epilogue import Epilogue
from hybridgemm.kernels.fp8 import FORMAT_OF, quantize_fp8
from hybridgemm.kernels.problem import Problem

pytestmark = pytest.mark.usefixtures("interpreter")

CONFIGS = {
    "one-pass": sk.TritonSplitKConfig(16, 32, 64, 1, 4, 2),
    "two-launch": sk.TritonSplitKConfig(16, 64, 32, 3, 4, 2),
    "fused-reduce": sk.TritonSplitKConfig(16, 32, 128, 2, 4, 2, fused_reduce=True),
}


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _operands(m, n, k, granularity, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    q = quantize_fp8(w.half(), granularity)
    x = torch.randn(m, k, generator=g).half()
    b = torch.randn(n, generator=g).half()
    return q, x, b


def _run(cfg, q, x, b, **fusion):
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=torch.float16)  # poisoned
    sk.run(cfg, x, q.data, b, out, None, weight_scale=q.scale, **fusion)
    return out


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("m,n,k", [(1, 100, 300), (3, 257, 384), (17, 130, 200)])
def test_fp8_weight_matches_fp64_of_the_dequantized_weight(granularity, cfg, m, n, k):
    q, x, b = _operands(m, n, k, granularity, m + n + k)
    out = _run(CONFIGS[cfg], q, x, b)
    ref = x.double() @ q.dequantize(torch.float32).double().T + b.double()
    # fp32 accumulation, one rounding to fp16: within an ulp of the fp16 output (+ accumulation)
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_every_scale_is_read_where_it_applies(granularity):
    """Doubling one scale doubles exactly the outputs it covers (a row; a 128x128 block's rows
    over its 128 columns), and nothing else."""
    q, x, b = _operands(3, 200, 300, granularity, 11)
    cfg = CONFIGS["two-launch"]
    base = _run(cfg, q, x, None)
    scale = q.scale.clone()
    if granularity == "channel":
        scale[150] *= 2
        changed = torch.zeros(200, dtype=torch.bool)
        changed[150] = True
    else:
        scale[1, 2] *= 2  # rows 128-199, columns 256-299
        changed = torch.zeros(200, dtype=torch.bool)
        changed[128:] = True
    out = torch.empty_like(base)
    sk.run(cfg, x, q.data, None, out, None, weight_scale=scale)
    assert torch.equal(out[:, ~changed], base[:, ~changed])
    if granularity == "channel":
        torch.testing.assert_close(out[:, 150].double(), 2 * base[:, 150].double(), rtol=1e-3, atol=1e-3)
    else:
        w = q.dequantize(torch.float32).double()
        w[128:, 256:] *= 2
        torch.testing.assert_close(out.double(), x.double() @ w.T, rtol=1e-3, atol=2e-3)


def test_block_weights_keep_each_k_tile_inside_one_scale_block():
    problem = Problem(m=1, n=256, k=512, dtype=torch.float16, epilogue=Epilogue(), ldx=512, ldw=512, ldo=256,
                      weight_format=FORMAT_OF["block128"])
    ok, why = sk.TritonSplitKConfig(16, 64, 256, 1, 4, 2).supports(problem)
    assert not ok and "128-column block" in why
    assert all(c.block_k <= 128 for c in sk.candidates(problem))
    assert sk.default_config(problem).block_k <= 128
    channel = Problem(m=1, n=256, k=4096, dtype=torch.bfloat16, epilogue=Epilogue(), ldx=4096, ldw=4096, ldo=256,
                      weight_format=FORMAT_OF["channel"])
    assert max(c.block_k for c in sk.candidates(channel)) == 512  # 512 bytes of e4m3 per row per stage


def test_scales_that_do_not_fit_the_weight_are_refused():
    q, x, b = _operands(2, 64, 96, "channel", 5)
    out = torch.empty(2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="fits neither granularity"):
        sk.run(CONFIGS["one-pass"], x, q.data, b, out, None, weight_scale=torch.ones(63))
    with pytest.raises(TypeError, match="needs its scales"):
        sk.run(CONFIGS["one-pass"], x, q.data, b, out, None)
    with pytest.raises(TypeError, match="bf16/fp16 x"):
        sk.run(CONFIGS["one-pass"], x.float(), q.data, b.float(), out.float(), None, weight_scale=q.scale)


SMALL_X_TILES = {  # x tiles below the MMA's 16 rows (Triton pads them): FP8 decode's configs
    "x1-one-pass": sk.TritonSplitKConfig(1, 32, 64, 1, 2, 2),
    "x2-fused-reduce": sk.TritonSplitKConfig(2, 64, 32, 3, 4, 2, fused_reduce=True),
    "x8-two-launch": sk.TritonSplitKConfig(8, 16, 128, 2, 1, 3),
}


@pytest.mark.parametrize("weights", ["channel", "block128", "fp16"])
@pytest.mark.parametrize("cfg", list(SMALL_X_TILES), ids=list(SMALL_X_TILES))
@pytest.mark.parametrize("m", [1, 3, 17])
def test_x_tiles_of_fewer_than_16_rows_match_fp64(weights, cfg, m):
    """block_m from 1: every weight format, M above block_m too (several row tiles)."""
    config = SMALL_X_TILES[cfg]
    if weights == "fp16":
        g = torch.Generator().manual_seed(m)
        w = (torch.randn(130, 300, generator=g) * 0.3).half()
        x, b = torch.randn(m, 300, generator=g).half(), torch.randn(130, generator=g).half()
        out = torch.full((m, 130), float("nan"), dtype=torch.float16)
        sk.run(config, x, w, b, out, "relu")
        ref = torch.relu(x.double() @ w.double().T + b.double())
    else:
        q, x, b = _operands(m, 130, 300, weights, m)
        out = _run(config, q, x, b)
        ref = x.double() @ q.dequantize(torch.float32).double().T + b.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("cfg,m,granularity,seed", [
    (CONFIGS["fused-reduce"], 5, "channel", 3),
    (sk.TritonSplitKConfig(4, 16, 128, 2, 1, 2), 3, "block128", 4),  # a 4-row x tile, two launches
], ids=["fused-reduce", "x4-two-launch"])
def test_norm_prologue_and_residual_epilogue_with_an_fp8_weight(cfg, m, granularity, seed):
    q, x, b = _operands(m, 96, 160, granularity, seed)
    g = torch.rand(160).half() + 0.5
    res = torch.randn(m, 96).half()
    out = _run(cfg, q, x, b, norm=(g, 1e-5), residual=res)
    # the kernel's order (triton_splitk NORM): (x * g) rounded once to x's dtype, the GEMM, then
    # the rows scaled by 1/rms(x)
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = (rstd * ((x * g).double() @ q.dequantize(torch.float32).double().T) + b.double()).half().double()
    torch.testing.assert_close(out.double(), ref + res.double(), rtol=2e-3, atol=4e-3)


def test_fp8_candidates_take_x_tiles_of_m_and_bf16_ones_keep_16_rows():
    fp8 = Problem(m=2, n=4096, k=4096, dtype=torch.bfloat16, epilogue=Epilogue(), ldx=4096, ldw=4096, ldo=4096,
                  weight_format=FORMAT_OF["channel"])
    assert {c.block_m for c in sk.candidates(fp8)} == {2} and sk.default_config(fp8).block_m == 2
    assert {c.block_m for c in sk.candidates(Problem(**{**fp8.__dict__, "m": 1}))} == {1}
    assert {c.block_m for c in sk.candidates(Problem(**{**fp8.__dict__, "m": 24}))} == {32}
    bf16 = Problem(**{**fp8.__dict__, "weight_format": ""})
    assert {c.block_m for c in sk.candidates(bf16)} == {16} and sk.default_config(bf16).block_m == 16
    assert 0 < len(sk.candidates(fp8)) <= triton_splitk_configs.MAX_CANDIDATES
    cfg = sk.candidates(fp8)[0]
    assert sk.TritonSplitKConfig.from_record(cfg.to_record()) == cfg
