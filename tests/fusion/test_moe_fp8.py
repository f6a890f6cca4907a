"""FP8 experts in the MoE kernels on the CPU (Triton interpreter, fp16): stacked e4m3 weights per
channel and per 128 x 128 block against an fp64 reference of the dequantized weights, pair-major
and grouped, odd shapes (M = 1, 3, 17, 333; H and, per channel, I not multiples of 128); each
expert's own scales are read (a poisoned scale of an expert no pair uses changes nothing, a
doubled one doubles only its tokens' share); ``moe`` on the kernel path against the PyTorch
loop; the stacked quantization against the 2-D one; the table key; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridgemm import experts as moe_mod
from hybridgemm.autotune_cache import tune_moe
from hybridgemm.autotune_cache.keys import weight_format_of
from hybridgemm.kernels import fp8
from hybridgemm.kernels import triton_moe as tm

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DT = torch.float16


def _fp8_weights(e, i, h, granularity, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_gu = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w_d = torch.randn(e, h, i, generator=g) / i ** 0.5
    w_gu[:, :, : min(h, 7)] *= 40  # rows and blocks of very different ranges: the scales matter
    return fp8.quantize_fp8(w_gu.to(DT), granularity), fp8.quantize_fp8(w_d.to(DT), granularity)


def _routing(t, e, k, seed=1, experts=None):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed))
    if experts is not None:
        mask = torch.full((e,), -1e4)
        mask[experts] = 0
        logits = logits + mask
    return moe_mod.route(logits, k)


def _reference(x, ids, weights, w_gu, w_d):
    """fp64 over the weights dequantized in fp32 (data times scale, no rounding to x's dtype)."""
    gu, d = w_gu.dequantize(torch.float32).double(), w_d.dequantize(torch.float32).double()
    t, k = ids.shape
    i = gu.shape[1] // 2
    out = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for tok in range(t):
        for s in range(k):
            e = int(ids[tok, s])
            hidden = x[tok].double() @ gu[e].T
            out[tok] += (F.silu(hidden[:i]) * hidden[i:]) @ d[e].T * float(weights[tok, s])
    return out


def _relative(got, ref) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


CASES = [  # t, e, k, i, h, granularity, experts routed to
    (1, 8, 2, 40, 200, "channel", None),       # decode; I and H not multiples of 128
    (3, 6, 3, 48, 72, "channel", None),
    (17, 4, 2, 33, 65, "channel", [1, 3]),     # experts 0 and 2 receive nothing
    (1, 8, 2, 128, 200, "block128", None),     # H not a multiple of 128: a partial block of scales
    (3, 5, 2, 256, 136, "block128", None),
    (17, 4, 3, 128, 256, "block128", [2]),     # one expert takes every pair
]


# (gate/up, down) configs of each kernel form: pair-major on the CUDA cores, pair-major on the
# tensor cores (mma), grouped
FORMS = {"pair_major": (tm.TritonMoeConfig(1, 8, 64), tm.TritonMoeConfig(1, 16, 32)),
         "pair_major_mma": (tm.TritonMoeConfig(1, 16, 64, mma=True), tm.TritonMoeConfig(1, 32, 32, mma=True)),
         "grouped": (tm.TritonMoeConfig(16, 32, 64), tm.TritonMoeConfig(16, 64, 32))}


@pytest.mark.parametrize("t,e,k,i,h,granularity,experts", CASES)
@pytest.mark.parametrize("form", list(FORMS))
def test_fp8_experts_match_fp64_of_the_dequantized_weights(t, e, k, i, h, granularity, experts, form):
    w_gu, w_d = _fp8_weights(e, i, h, granularity)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(DT)
    ids, weights = _routing(t, e, k, experts=experts)
    up, down = FORMS[form]
    got = tm.forward(x, ids, weights, w_gu, w_d, "silu", up, down)
    ref = _reference(x, ids, weights, w_gu, w_d)
    assert got.dtype == DT and torch.isfinite(got).all()
    assert _relative(got, ref) <= 4e-3, _relative(got, ref)
    # the same kernels over the weights dequantized to fp16 agree to fp16's rounding of W
    dense = tm.forward(x, ids, weights, w_gu.dequantize(DT), w_d.dequantize(DT), "silu", up, down)
    assert _relative(got, dense.double()) <= 4e-3
    assert torch.equal(got, tm.forward(x, ids, weights, w_gu, w_d, "silu", up, down))  # a fixed order


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("form", list(FORMS))
def test_each_expert_reads_its_own_scales(granularity, form):
    t, e, k, i, h = 5, 6, 2, 128, 136
    w_gu, w_d = _fp8_weights(e, i, h, granularity)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(DT)
    ids, weights = _routing(t, e, k, experts=[0, 2, 3])
    cfg = FORMS[form]
    base = tm.forward(x, ids, weights, w_gu, w_d, "silu", *cfg)
    poisoned = [fp8.FP8Weight(w.data, w.scale.clone(), granularity, DT) for w in (w_gu, w_d)]
    for w in poisoned:
        w.scale[[1, 4, 5]] = float("nan")  # experts no pair is routed to
    assert torch.equal(tm.forward(x, ids, weights, *poisoned, "silu", *cfg), base)
    doubled = fp8.FP8Weight(w_d.data, w_d.scale.clone(), granularity, DT)
    doubled.scale[2] *= 2  # expert 2's down projection doubles: only its pairs' share changes
    got = tm.forward(x, ids, weights, w_gu, doubled, "silu", *cfg).double()
    share = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for s in range(k):
            if int(ids[tok, s]) == 2:
                share[tok] += _reference(x[tok:tok + 1], ids[tok:tok + 1, s:s + 1], weights[tok:tok + 1, s:s + 1],
                                         w_gu, w_d)[0]
    want = _reference(x, ids, weights, w_gu, w_d) + share
    assert share.abs().max() > 0.1 * want.abs().max()
    assert _relative(got, want) <= 4e-3


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_moe_runs_fp8_experts_on_the_kernel_path_as_the_loop_computes_them(granularity, monkeypatch):
    t, e, k, i, h = 17, 6, 2, 128, 96
    w_gu, w_d = _fp8_weights(e, i, h, granularity)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(DT)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(5))
    loop = moe_mod.moe(x, logits, w_gu, w_d, top_k=k)  # off the kernel path: the weights dequantized to fp16
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    for tokens in (1, t):  # pair-major (2 pairs over 6 experts) and grouped by default
        got = moe_mod.moe(x[:tokens], logits[:tokens], w_gu, w_d, top_k=k)
        assert _relative(got, loop[:tokens].double()) <= 4e-3
        ids, weights = moe_mod.route(logits[:tokens], k)
        assert _relative(got, _reference(x[:tokens], ids, weights, w_gu, w_d)) <= 4e-3
    why = moe_mod.decision_for(x, k, w_gu, "silu")
    assert why.backend == tune_moe.BACKEND and not any(tm.fp8_fits(c, w_gu.weight_format) for c in why.configs)


def test_stacked_quantization_is_the_2d_one_per_expert():
    w = torch.randn(3, 300, 200, generator=torch.Generator().manual_seed(0)).to(DT)
    for granularity in fp8.GRANULARITIES:
        q = fp8.quantize_fp8(w, granularity)
        assert q.experts == 3 and q.shape == (3, 300, 200)
        assert q.scale.shape == ((3, 300) if granularity == "channel" else (3, 3, 2))
        for e in range(3):
            one = fp8.quantize_fp8(w[e], granularity)
            assert torch.equal(one.data.view(torch.uint8), q.data[e].view(torch.uint8))
            assert torch.equal(one.scale, q.scale[e])
            assert torch.equal(one.dequantize(torch.float32), q.dequantize(torch.float32)[e])
    assert fp8.quantize_fp8(w[0]).experts is None


def test_the_table_key_names_the_weight_format(monkeypatch):
    key = tune_moe.moe_key(128, 8, "silu", torch.bfloat16, 768, 2048, 1, 1, "e4m3_block128")
    assert key.op == "moe_silu_e128_k8_e4m3_block128" and weight_format_of(key.op) == "e4m3_block128"
    assert tune_moe.parse_moe_op(key.op) == ("silu", 128, 8)
    assert tune_moe.moe_key(128, 8, "silu", torch.bfloat16, 768, 2048, 1, 1).op == "moe_silu_e128_k8"
    assert tune_moe.parse_moe_op("moe_silu_e128_k8_e4m3_other") is None
    block = tune_moe.candidates(64, 128, "e4m3_block128")
    assert block and all(tm.fp8_fits(c, "e4m3_block128") is None for pair in block for c in pair)
    assert len(block) < len(tune_moe.candidates(64, 128))  # the 256-deep pair-major tiles are left out
    with pytest.raises(ValueError, match="weight_format"):
        moe_mod.explain_moe(1, (8, 256, 64), 2, weight_format="int4")
    looked_up = []

    class NoEntries:
        def find(self, shape, m):
            looked_up.append(shape.op)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(moe_mod.decide, "table_for_device", lambda index: NoEntries())
    why = moe_mod.explain_moe(1, (8, 256, 64), 2, weight_format="e4m3_block128", device=0)
    assert looked_up == ["moe_silu_e8_k2_e4m3_block128"] and "moe_silu_e8_k2_e4m3_block128" in why
    assert "TritonMoeConfig(block_m=1, block_n=8, block_k=128" in why  # block-scaled: 128-deep down tiles


def test_bad_fp8_experts_are_clear_errors():
    e, i, h = 4, 128, 64
    w_gu, w_d = _fp8_weights(e, i, h, "block128")
    x, routing = torch.zeros(1, h, dtype=DT), (torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=DT))
    chan_gu, chan_d = _fp8_weights(e, i, h, "channel")
    with pytest.raises(ValueError, match="differ in weight format"):
        moe_mod.moe(x, routing, w_gu, chan_d)
    with pytest.raises(ValueError, match="without scales"):
        moe_mod.moe(x, routing, w_gu.data, w_d)
    odd = _fp8_weights(e, 40, h, "block128")
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_mod.moe(x, routing, *odd)
    with pytest.raises(ValueError, match="multiple of 128"):  # the kernels' own check
        tm.forward(x, *routing, *odd, "silu", *tm.default_configs(2, e, "e4m3_block128"))
    with pytest.raises(ValueError, match="differ in dtype"):
        moe_mod.moe(x.float(), routing, chan_gu, chan_d)
    with pytest.raises(ValueError, match="stacked"):
        tm.forward(x, *routing, fp8.quantize_fp8(torch.randn(2 * i, h)), w_d, "silu", *tm.default_configs(2, e))
    with pytest.raises(ValueError, match="crosses"):
        tm.forward(x, *routing, w_gu, w_d, "silu", tm.TritonMoeConfig(1, 8, 128), tm.TritonMoeConfig(1, 8, 256))
    with pytest.raises(fp8.FP8FormatError, match="fits neither"):
        fp8.FP8Weight(w_gu.data, w_gu.scale[:, :1], "block128")
    bad = w_gu.scale.clone()
    bad[1, 0, 0] = float("inf")
    with pytest.raises(fp8.FP8FormatError, match="finite"):
        fp8.FP8Weight.from_tensors(w_gu.data, bad, DT)


def test_where_the_gpu_has_no_e4m3_conversion_the_kernels_get_dequantized_experts(monkeypatch):
    w_gu, w_d = _fp8_weights(4, 128, 64, "channel")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(DT)
    routing = _routing(3, 4, 2)
    seen = []
    real = tm.forward
    monkeypatch.setattr(tm, "forward", lambda x, ids, rw, gu, d, *a: seen.append((gu, d)) or real(x, ids, rw, gu, d,
                                                                                                  *a))
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    fp8_run = moe_mod.moe(x, routing, w_gu, w_d)
    monkeypatch.setattr(moe_mod, "fp8_kernels_run", lambda x: False)
    dense_run = moe_mod.moe(x, routing, w_gu, w_d)
    assert [type(w) for w in seen[0]] == [fp8.FP8Weight] * 2
    assert torch.equal(seen[1][0], w_gu.dequantize(DT)) and torch.equal(seen[1][1], w_d.dequantize(DT))
    assert _relative(dense_run, fp8_run.double()) <= 4e-3
