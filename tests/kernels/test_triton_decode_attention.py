"""The one-token decode attention kernel (kernels/triton_decode_attention.py) under the Triton
interpreter, against fp64 SDPA with the GQA heads expanded: shapes, masks, spans merged by the
last program, the cache-length update, counters, bad input. GPU runs:
tests/models/test_decode_step_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridgemm.kernels import triton_decode_attention as tda
from hybridgemm.kernels.process_memory import per_call_scratch
from hybridgemm.kernels.triton_config import HOPPER_SMEM_PER_BLOCK
from hybridgemm.kernels.triton_launch import DeviceFacts
from hybridgemm.kernels.triton_scratch import counters_snapshot

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(params=[1, 64], ids=["one-span", "spans"])
def sms(request, monkeypatch):
    """The SM count the span count is sized for: 1 gives one span per (sequence, KV head),
    64 several (merged by the last program)."""
    facts = DeviceFacts(num_sms=request.param, capability=(9, 0), smem_per_block=HOPPER_SMEM_PER_BLOCK)
    monkeypatch.setattr(tda, "device_facts", lambda device: facts)
    return request.param


def _reference(q, keys, values, mask, scale):
    b, kvh, length, hd = keys.shape
    heads = q.shape[1] // hd
    rep = heads // kvh
    qd = q.double().reshape(b, heads, 1, hd)
    kd, vd = keys.double().repeat_interleave(rep, 1), values.double().repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale).reshape(b, heads * hd)


def _operands(b, heads, kvh, hd, length, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as the q columns of a fused Q/K/V output row: strided rows
    y = torch.randn(b, (heads + 2 * kvh) * hd, generator=g).to(dtype)
    keys = torch.randn(b, kvh, length, hd, generator=g).to(dtype)
    values = torch.randn(b, kvh, length, hd, generator=g).to(dtype)
    return y[:, : heads * hd], keys, values


def _tol(dtype):
    return dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=0, atol=3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,heads,kvh,hd,length", [
    (1, 8, 2, 32, 1), (1, 8, 2, 32, 17), (3, 6, 3, 16, 333), (2, 7, 1, 64, 150), (1, 4, 4, 16, 1000),
    (2, 28, 4, 16, 65), (1, 40, 2, 16, 100), (1, 64, 1, 16, 70),
    (2, 71, 1, 16, 90), (1, 71, 1, 16, 600), (1, 71, 1, 16, 300),  # Falcon-7B's 71 per KV head; 10 blocks in 4
    # spans; 5 blocks in 4 spans of 2, the last one empty
    (2, 4, 2, 256, 70),  # heads of 256 (Gemma's): blocks of 32 positions
    (2, 6, 2, 96, 90), (1, 3, 3, 48, 40)])  # heads of 96 (Phi-3's) and 48: a padded head block, masked
@pytest.mark.parametrize("mask_kind", ["none", "per-sequence", "shared", "holes"])
def test_matches_fp64_sdpa(sms, dtype, b, heads, kvh, hd, length, mask_kind):
    q, keys, values = _operands(b, heads, kvh, hd, length, dtype)
    g = torch.Generator().manual_seed(1)
    filled = torch.randint(1, length + 1, (b,), generator=g)  # positions written so far, per sequence
    mask = None
    if mask_kind == "per-sequence":
        mask = (torch.arange(length)[None] < filled[:, None]).view(b, 1, 1, length)
    elif mask_kind == "shared":
        mask = (torch.arange(length) < filled[0]).view(1, 1, 1, length)
    elif mask_kind == "holes":  # left padding and scattered masked positions, the newest one kept
        mask = torch.rand(b, 1, 1, length, generator=g) < 0.6
        mask[..., -1] = True
    out = torch.full((b, heads * hd), float("nan"), dtype=dtype)  # poisoned: every element must be written
    tda.decode_attention(q, keys, values, mask, 0.125, out)
    torch.testing.assert_close(out.double(), _reference(q, keys, values, mask, 0.125), **_tol(dtype))


def test_tiles_of_more_than_64_query_heads_merge_at_most_four_spans():
    """A pair's last program merges every span's partial of rep x head_dim fp32 values: for
    more than 64 query heads per KV head at most four spans; up to 64, two programs per SM."""
    assert tda._splits(1, 600, 64, 64, rep=71) == 4
    assert tda._splits(1, 100, 64, 64, rep=71) == 2  # (a span holds a block of positions at least)
    assert tda._splits(1, 600, 64, 64, rep=64) == 10
    assert tda._splits(8, 4096, 132, 64, rep=4) == 33


def test_a_long_cache_with_few_positions_filled(sms):
    # a static cache of 1000 positions with 5 written: the masked blocks are skipped, garbage there is never read
    q, keys, values = _operands(2, 8, 2, 32, 1000, torch.float32)
    mask = (torch.arange(1000) < 5).view(1, 1, 1, 1000)
    keys[:, :, 5:] = float("nan")
    values[:, :, 5:] = float("inf")
    out = torch.empty(2, 8 * 32)
    tda.decode_attention(q, keys, values, mask, 0.2, out)
    torch.testing.assert_close(out.double(), _reference(q, keys[:, :, :5], values[:, :, :5], None, 0.2),
                               rtol=0, atol=2e-5)


def test_the_cache_length_is_updated_once_per_call(sms):
    q, keys, values = _operands(3, 4, 2, 16, 300, torch.float32)
    base = torch.tensor(41, dtype=torch.int64)
    out = torch.empty(3, 64)
    for _ in range(3):
        tda.decode_attention(q, keys, values, None, 1.0, out, base=base, step=2)
    assert int(base) == 41 + 3 * 2
    assert all(not c.any() for c in counters_snapshot())  # every arrival counter is left zero


def test_results_do_not_depend_on_the_span_count(monkeypatch):
    q, keys, values = _operands(1, 8, 2, 32, 700, torch.float32)
    outs = []
    for n in (1, 3, 64):
        facts = DeviceFacts(num_sms=n, capability=(9, 0), smem_per_block=HOPPER_SMEM_PER_BLOCK)
        monkeypatch.setattr(tda, "device_facts", lambda device, f=facts: f)
        outs.append(tda.decode_attention(q, keys, values, None, 0.1, torch.empty(1, 256)))
    ref = _reference(q, keys, values, None, 0.1)
    for out in outs:
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


def test_a_row_with_no_position_admitted_is_zero_as_in_sdpa(sms):
    q, keys, values = _operands(2, 4, 2, 16, 100, torch.float32)
    mask = torch.ones(2, 1, 1, 100, dtype=torch.bool)
    mask[1] = False
    out = tda.decode_attention(q, keys, values, mask, 1.0, torch.full((2, 64), float("nan")))
    torch.testing.assert_close(out.double(), _reference(q, keys, values, mask, 1.0), rtol=0, atol=2e-5)
    assert torch.isfinite(out[0]).all() and (out[1] == 0).all()


def test_spans_past_the_cache_end_merge_as_empty(monkeypatch):
    # 15 SMs for one sequence and 2 KV heads: 15 spans of 128 positions over 1000, the last ones empty
    facts = DeviceFacts(num_sms=15, capability=(9, 0), smem_per_block=HOPPER_SMEM_PER_BLOCK)
    monkeypatch.setattr(tda, "device_facts", lambda device: facts)
    q, keys, values = _operands(1, 4, 2, 16, 1000, torch.float32)
    out = tda.decode_attention(q, keys, values, None, 0.5, torch.empty(1, 64))
    torch.testing.assert_close(out.double(), _reference(q, keys, values, None, 0.5), rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", ["expanded", "row-of-square", "every-other"])
def test_masks_of_other_strides(sms, layout):
    b, length = 3, 150
    q, keys, values = _operands(b, 4, 2, 16, length, torch.float32)
    g = torch.Generator().manual_seed(2)
    if layout == "expanded":  # one row for all sequences, batch stride 0
        row = torch.rand(1, 1, 1, length, generator=g) < 0.7
        row[..., 0] = True
        mask = row.expand(b, 1, 1, length)
    elif layout == "row-of-square":  # the last query row of a [B, 1, L, L] mask
        mask = (torch.rand(b, 1, length, length, generator=g) < 0.7)[:, :, -1:, :]
    else:  # positions two apart in memory
        mask = (torch.rand(b, 1, 1, 2 * length, generator=g) < 0.7)[..., ::2]
    if layout != "expanded":
        mask[..., 0] = True
    out = tda.decode_attention(q, keys, values, mask, 0.3, torch.empty(b, 64))
    torch.testing.assert_close(out.double(), _reference(q, keys, values, mask, 0.3), rtol=0, atol=2e-5)


def test_caller_counters_are_used_in_compiled_regions_and_left_zero(monkeypatch):
    facts = DeviceFacts(num_sms=64, capability=(9, 0), smem_per_block=HOPPER_SMEM_PER_BLOCK)
    monkeypatch.setattr(tda, "device_facts", lambda device: facts)
    asked, real = [], tda.split_scratch
    monkeypatch.setattr(tda, "split_scratch", lambda dev, ws, cnt: asked.append(cnt) or real(dev, ws, cnt))
    q, keys, values = _operands(2, 4, 2, 16, 300, torch.float32)
    counters = torch.zeros(8, dtype=torch.int32)
    with per_call_scratch():
        out = tda.decode_attention(q, keys, values, None, 1.0, torch.empty(2, 64), counters=counters)
    tda.decode_attention(q, keys, values, None, 1.0, torch.empty(2, 64), counters=counters)
    assert asked == [0, 4]  # compiled region: the caller's; eager: the stream's (4 pairs)
    assert not counters.any()
    torch.testing.assert_close(out.double(), _reference(q, keys, values, None, 1.0), rtol=0, atol=2e-5)


@pytest.mark.parametrize("change,match", [
    (dict(keys=torch.zeros(2, 4, 10, 12), values=torch.zeros(2, 4, 10, 12)), "head_dim 12"),
    (dict(q=torch.zeros(2, 6 * 16)), "heads a multiple of 4"),
    (dict(q=torch.zeros(3, 8 * 16)), r"q must be \[2"),
    (dict(q=torch.zeros(8 * 16, 2).T), "unit column stride"),
    (dict(mask=torch.zeros(2, 1, 1, 10, dtype=torch.float64)), "boolean or additive"),
    (dict(mask=torch.ones(2, 1, 1, 9, dtype=torch.bool)), "boolean"),
    (dict(mask=torch.ones(2, 1, 2, 10, dtype=torch.bool)), "boolean"),
    (dict(out=torch.zeros(2, 8 * 16, dtype=torch.float16)), "out must be"),
    (dict(values=torch.zeros(2, 4, 11, 16)), "one shape"),
    (dict(keys=torch.zeros(2, 4, 10, 16, dtype=torch.float64), values=torch.zeros(2, 4, 10, 16, dtype=torch.float64)),
     "share a dtype"),
    (dict(counters=torch.zeros(3, dtype=torch.int32)), "counters"),
    (dict(keys=torch.zeros(2, 4, 0, 16), values=torch.zeros(2, 4, 0, 16), mask=None), "empty"),
    (dict(keys=torch.zeros(2, 4, 10, 512), values=torch.zeros(2, 4, 10, 512), q=torch.zeros(2, 8 * 512),
          out=torch.zeros(2, 8 * 512)), "head_dim 512"),
    (dict(base=torch.zeros((), dtype=torch.int32)), "base must be"),
    (dict(base=torch.zeros(2, dtype=torch.int64)), "base must be"),
    (dict(keys=torch.zeros(2, 1, 10, 16), values=torch.zeros(2, 1, 10, 16), q=torch.zeros(2, 129 * 16),
          out=torch.zeros(2, 129 * 16)), "more than 128 query heads per KV head"),
    (dict(keys=torch.zeros(2, 1, 10, 80), values=torch.zeros(2, 1, 10, 80), q=torch.zeros(2, 65 * 80),
          out=torch.zeros(2, 65 * 80)), "more than 64 query heads per KV head .heads of 80"),
])
def test_bad_operands_are_clear_errors(change, match):
    args = dict(q=torch.zeros(2, 8 * 16), keys=torch.zeros(2, 4, 10, 16), values=torch.zeros(2, 4, 10, 16),
                mask=torch.ones(2, 1, 1, 10, dtype=torch.bool), out=torch.zeros(2, 8 * 16), counters=None, base=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        tda.decode_attention(args["q"], args["keys"], args["values"], args["mask"], 1.0, args["out"],
                             counters=args["counters"], base=args["base"])


_COMPILE_FOR_HOPPER = """
import os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_decode_attention as tda

fn = tda._decode_attention_kernel
scalars = ["i32"] * 3 + ["fp32"] * 3 + ["i32"] * 11  # L, span, step; qk_scale, softcap, hide_at; heads, strides
for mask, capped in (("*i1", False), ("*bf16", True)):  # a boolean mask; Gemma 2's additive mask and softcap
    ptrs = ["*bf16", "*bf16", "*bf16", mask, "*bf16", "*fp32", "*i32", "*i64"]
    sig = dict(zip(fn.arg_names, ptrs + scalars))
    for hd in (96, 128, 256):
        consts = dict(REP=1, RP=16, HD=hd, HDP=triton.next_power_of_2(hd), BT=tda._block_t(hd), HAS_MASK=True,
                      ADD_MASK=capped, SOFTCAP=capped, SPLITS=4, INC=True, PREC="tf32", PDL=True)
        src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
        try:
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
        except (TypeError, KeyError, AttributeError) as e:
            raise SystemExit(f"API: {type(e).__name__}: {e}")
        assert c.asm["cubin"] and c.metadata.shared <= 227 * 1024, (hd, c.metadata.shared)
        print(mask, hd, c.metadata.shared)
# Falcon-7B's 71 query heads of 64 per KV head: tiles of 128 rows on 8 warps, one span or four,
# compiled as a launch specialises it (16-divisible pointers and strides), nothing spilled
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
if not os.path.exists(cuobjdump):
    raise SystemExit("API: no cuobjdump beside this Triton")
sig = dict(zip(fn.arg_names, ["*bf16", "*bf16", "*bf16", "*i1", "*bf16", "*fp32", "*i32", "*i64"] + scalars))
aligned = {"q_ptr", "k_ptr", "v_ptr", "m_ptr", "o_ptr", "ws_ptr", "cnt_ptr", "base_ptr", "q_sb", "k_sb", "k_sh", "k_st",
           "v_sb", "v_sh", "v_st", "o_sb"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
for splits in (1, 4):
    consts = dict(REP=71, RP=128, HD=64, HDP=64, BT=tda._block_t(64), HAS_MASK=True, ADD_MASK=False, SOFTCAP=False,
                  SPLITS=splits, INC=True, PREC="tf32", PDL=True)
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    assert "LDL" not in sass and "STL" not in sass, splits
print("compiled")
"""


def test_the_kernel_compiles_for_hopper_with_heads_of_96_128_and_256():
    """Compiled for sm_90 by Triton's bundled ptxas (no GPU needed; in a process without the
    interpreter), its shared memory within the H100/H200 limit, for heads of 96, 128 and 256,
    with a boolean mask and with an additive mask and a softcap; Falcon-7B's 71 query heads per
    KV head (tiles of 128 rows, 8 warps) with no local memory in its SASS."""
    from helpers import compile_offline

    compile_offline(_COMPILE_FOR_HOPPER)


def _capped_reference(q, keys, values, mask, scale, softcap):
    """fp64: softcap * tanh(q k^T * scale / softcap) + mask (additive), softmax, times v."""
    b, kvh, length, hd = keys.shape
    heads = q.shape[1] // hd
    rep = heads // kvh
    qd = q.double().reshape(b, heads, 1, hd)
    kd, vd = keys.double().repeat_interleave(rep, 1), values.double().repeat_interleave(rep, 1)
    s = qd @ kd.transpose(2, 3) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask.double()
    return (torch.softmax(s, dim=-1) @ vd).reshape(b, heads * hd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,heads,kvh,hd,length", [(1, 8, 2, 32, 17), (3, 6, 3, 16, 333), (2, 4, 2, 256, 70),
                                                   (2, 6, 2, 96, 90)])
@pytest.mark.parametrize("softcap,mask_kind", [(50.0, "none"), (50.0, "additive"), (0.0, "additive"),
                                               (2.0, "additive-bias"), (30.0, "boolean")])
def test_soft_capped_logits_and_additive_masks_match_fp64(sms, dtype, b, heads, kvh, hd, length, softcap, mask_kind):
    """Gemma 2's attention (transformers' eager form): logits soft-capped, then an additive mask
    (the dtype's minimum where masked; "additive-bias": finite values too); scores scaled so the
    cap bends them (2.0: most of them)."""
    q, keys, values = _operands(b, heads, kvh, hd, length, dtype, seed=4)
    q = q * 4  # scores of several units: the cap matters
    g = torch.Generator().manual_seed(5)
    hidden = torch.rand(b, 1, 1, length, generator=g) < 0.4
    hidden[..., -1] = False  # the newest position is always attended
    mask = None
    if mask_kind == "boolean":
        mask = ~hidden
    elif mask_kind.startswith("additive"):
        mask = torch.zeros(b, 1, 1, length, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)
        if mask_kind == "additive-bias":
            mask = mask + (torch.rand(b, 1, 1, length, generator=g) * -3).to(dtype).masked_fill(hidden, 0)
    out = torch.full((b, heads * hd), float("nan"), dtype=dtype)  # poisoned
    tda.decode_attention(q, keys, values, mask, 0.125, out, softcap=softcap)
    ref = _capped_reference(q, keys, values, None if mask is None or mask.dtype == torch.bool else mask, 0.125,
                            softcap)
    if mask is not None and mask.dtype == torch.bool:
        ref = _capped_reference(q, keys, values, torch.zeros(mask.shape, dtype=torch.float64).masked_fill(
            ~mask, float("-inf")), 0.125, softcap)
    torch.testing.assert_close(out.double(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_additive_mask_skips_hidden_blocks_it_never_reads(sms, dtype):
    # a static cache of 1000 positions with 5 written, hidden by the dtype's minimum: garbage past them is never read
    q, keys, values = _operands(2, 8, 2, 32, 1000, dtype)
    mask = torch.zeros(1, 1, 1, 1000, dtype=dtype).masked_fill(torch.arange(1000) >= 5, torch.finfo(dtype).min)
    keys[:, :, 5:] = float("nan")
    values[:, :, 5:] = float("inf")
    out = tda.decode_attention(q, keys, values, mask, 0.2, torch.empty(2, 8 * 32, dtype=dtype), softcap=20.0)
    torch.testing.assert_close(out.double(), _capped_reference(q, keys[:, :, :5], values[:, :, :5], None, 0.2, 20.0),
                               **_tol(dtype))


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan"), "50"])
def test_a_bad_softcap_is_refused(softcap):
    q, keys, values = _operands(1, 4, 2, 16, 10, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        tda.decode_attention(q, keys, values, None, 1.0, torch.empty(1, 64), softcap=softcap)


def test_a_mask_of_another_float_dtype_is_refused():
    q, keys, values = _operands(1, 4, 2, 16, 10, torch.float16)
    assert "additive" in tda.why_not(q, keys, values, torch.zeros(1, 1, 1, 10, dtype=torch.bfloat16))
    assert tda.why_not(q, keys, values, torch.zeros(1, 1, 1, 10, dtype=torch.float32)) is None
