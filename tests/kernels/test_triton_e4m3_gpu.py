"""The e4m3 -> bf16 conversion by integer ops (kernels/triton_e4m3.py) on a GPU: every finite
e4m3 byte against Triton's cast and torch's, and the split-K kernel with an FP8 weight giving
the same bits with either conversion (x tiles of 1 to 16 rows, each reduction, both granularities)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hybridgemm.kernels import triton_e4m3 as te
from hybridgemm.kernels import triton_splitk as sk
from hybridgemm.kernels.fp8 import quantize_fp8

pytestmark = pytest.mark.gpu


@triton.jit
def _convert(w_ptr, by_int_ptr, by_cast_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(by_int_ptr + offs, te.tl_weight_values(w, tl.bfloat16, True), mask=ok)
    tl.store(by_cast_ptr + offs, te.tl_weight_values(w, tl.bfloat16, False), mask=ok)


def _finite_e4m3_codes(device) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7f / 0xff are e4m3fn's NaNs
    return codes.to(device).view(torch.float8_e4m3fn)


def test_every_finite_e4m3_value_converts_exactly():
    dev = torch.device("cuda")
    w = _finite_e4m3_codes(dev).repeat(5)[:1201]  # several programs and a ragged last one
    by_int = torch.full(w.shape, float("nan"), dtype=torch.bfloat16, device=dev)
    by_cast = torch.full_like(by_int, float("nan"))
    _convert[(triton.cdiv(w.numel(), 256),)](w, by_int, by_cast, w.numel(), BLOCK=256)
    expected = w.to(torch.bfloat16)  # exact: every e4m3 value is a bf16 value
    assert torch.equal(by_cast.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(by_int.view(torch.int16), expected.view(torch.int16))  # signed zeros and subnormals too
    negative_zero = w.view(torch.uint8) == 0x80
    assert bool(negative_zero.any()) and bool(torch.signbit(by_int[negative_zero]).all())


CONFIGS = [
    sk.TritonSplitKConfig(16, 64, 128, 1, 4, 3),
    sk.TritonSplitKConfig(16, 32, 128, 4, 4, 3, fused_reduce=True),
    sk.TritonSplitKConfig(16, 64, 128, 3, 4, 3),
    sk.TritonSplitKConfig(1, 32, 128, 2, 2, 3, fused_reduce=True),  # x tiles of 1, 4 and 8 rows
    sk.TritonSplitKConfig(4, 16, 128, 1, 1, 4),
    sk.TritonSplitKConfig(8, 64, 128, 1, 4, 4),
]


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
@pytest.mark.parametrize("m,n,k", [(1, 333, 1000), (3, 4096, 640)])
def test_split_k_gives_the_same_bits_with_either_conversion(monkeypatch, granularity, cfg, m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    w = torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g)
    w[0, :] *= 1e-4  # small values: e4m3 subnormals after scaling by the row's amax
    q = quantize_fp8(w.bfloat16(), granularity)
    assert bool(((q.data.view(torch.uint8) & 0x78) == 0).any())  # subnormal codes are present
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    outs = []
    for integer in (True, False):
        monkeypatch.setattr(te, "INTEGER_CONVERSION", integer)
        sk._PLANS.clear()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        sk.run(cfg, x, q.data, b, out, None, weight_scale=q.scale)
        outs.append(out)
    sk._PLANS.clear()
    ref = x.double() @ q.dequantize(torch.float32).double().T + b.double()
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().mean()))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
