"""Triton gated-MLP projection (SwiGLU/GeGLU, kernels/triton_glu.py) under the interpreter:
``act(x @ Wg.T + bg) * (x @ Wu.T + bu)`` against an fp64 reference, argument checks, empty
shapes, configs. bf16 and the real shapes are GPU-only (test_triton_glu_gpu.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import poisoned
from hybridgemm.kernels import triton_glu as tglu
from hybridgemm.kernels.checks import LinearArgumentError
from hybridgemm.kernels.triton_config import HOPPER_NUM_SMS
from hybridgemm.kernels.triton_launch import DeviceFacts

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

Cfg = tglu.TritonGluConfig
ACTS = ["silu", "gelu_tanh", "gelu"]
DTYPES = [torch.float16, torch.float32]
# Elementwise bound |out - ref| <= RTOL * |ref| + ATOL. fp16: the output's own rounding is
# 2**-11 relative, the fp32 sums are far tighter. fp32: the sums' rounding over K = 72. A
# swapped gate/up, a missing bias or an act on the wrong half is off by O(0.1-1); in fp32
# even exact-vs-tanh GELU (up to ~5e-4 apart) fails.
TOL = {torch.float16: (1e-3, 1e-4), torch.float32: (1e-5, 2e-5)}

SWAP16 = Cfg(16, 16, 32, 4, 2)  # swapped dots; K = 72 is three blocks, the last one partial
SWAP32 = Cfg(32, 32, 64, 4, 2)
PLAIN = Cfg(64, 16, 16, 4, 2)  # usual orientation (block_m > 32), many K blocks
CONFIGS = [SWAP16, SWAP32, PLAIN]
DIM_I, DIM_K = 40, 72  # I and K, neither a multiple of the blocks


def cfg_id(c):
    return f"m{c.block_m}n{c.block_n}k{c.block_k}"


REF_ACT = {"silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "gelu": F.gelu}


def reference(x, w, b, act):
    """act(x @ Wg.T + bg) * (x @ Wu.T + bu) in float64, from the stacked w and b."""
    i = w.shape[0] // 2
    z = x.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    return REF_ACT[act](z[..., :i]) * z[..., i:]


def operands(lead, i, k, dtype, device, bias=True):
    x = torch.randn(*lead, k, device=device).to(dtype)
    w = (torch.randn(2 * i, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(2 * i, device=device).to(dtype) if bias else None
    return x, w, b


def check(out, x, w, b, act):
    ref = reference(x, w, b, act)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "some output elements were not written"
    rtol, atol = TOL[x.dtype]
    ratio = ((out.double() - ref).abs() / (rtol * ref.abs() + atol)).max().item()
    assert ratio <= 1, f"error {ratio:.3g} x the bound ({act}, {x.dtype})"
    return out


def glu_checked(x, w, b, act, **kw):
    """glu into a NaN-poisoned out, checked against the fp64 reference."""
    out = poisoned((*x.shape[:-1], w.shape[0] // 2), x.dtype, x.device)
    assert tglu.glu(x, w, b, act, out=out, **kw) is out
    return check(out, x, w, b, act)


# ----------------------------------------------------------------------------- results


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_every_act_bias_dtype_config(cfg, dtype, act, bias, device):
    x, w, b = operands((17,), DIM_I, DIM_K, dtype, device, bias)  # two 16-row tiles, I and K tails
    glu_checked(x, w, b, act, config=cfg)


@pytest.mark.parametrize("m", [1, 3, 17, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_shapes_default_config(m, dtype, device):
    x, w, b = operands((m,), DIM_I, DIM_K, dtype, device)
    glu_checked(x, w, b, "silu")
    x, w, b = operands((m,), 24, 64, dtype, device)  # K a multiple of the block: no K masks
    glu_checked(x, w, b, "gelu", config=SWAP16)


def test_grouped_order_covers_every_tile(device):
    """10 tile-rows (more than GROUP_M) by 3 tile-columns: every tile written exactly right."""
    x, w, b = operands((145,), DIM_I, DIM_K, torch.float32, device)
    glu_checked(x, w, b, "gelu_tanh", config=SWAP16)


def test_returns_new_tensor_without_out(device):
    x, w, b = operands((3,), DIM_I, DIM_K, torch.float16, device)
    out = tglu.glu(x, w, b)
    assert out.shape == (3, DIM_I) and out.is_contiguous()
    check(out, x, w, b, "silu")


def test_deterministic(device):
    x, w, b = operands((5,), DIM_I, DIM_K, torch.float32, device)
    first = tglu.glu(x, w, b, "gelu", config=SWAP32)
    assert torch.equal(tglu.glu(x, w, b, "gelu", config=SWAP32), first)


def test_run_padded_rows(device):
    """The backend contract: x and out rows may be padded; nothing is written past I."""
    m = 5
    xbuf = torch.randn(m, DIM_K + 9, device=device).to(torch.float16)
    x = xbuf[:, 3:3 + DIM_K]  # row stride K + 9, 6-byte offset
    _, w, b = operands((m,), DIM_I, DIM_K, torch.float16, device)
    obuf = poisoned((m, DIM_I + 5), torch.float16, device)
    for cfg in (SWAP16, PLAIN):
        obuf.fill_(float("nan"))
        assert tglu.run(cfg, x, w, b, obuf[:, :DIM_I], "silu") is not None
        check(obuf[:, :DIM_I], x, w, b, "silu")
        assert torch.isnan(obuf[:, DIM_I:]).all(), "store wrote past DIM_I"


def test_non_contiguous_x(device, monkeypatch):
    """Sliced rows are read in place; a transposed view (column stride != 1) is copied."""
    seen = []
    real_run = tglu.run
    monkeypatch.setattr(tglu, "run", lambda cfg, x, *a, **kw: seen.append(x.data_ptr()) or real_run(cfg, x, *a, **kw))
    _, w, b = operands((4,), DIM_I, DIM_K, torch.float32, device)
    sliced = torch.randn(4, DIM_K + 8, device=device)[:, 5:5 + DIM_K]
    glu_checked(sliced, w, b, "silu")
    assert seen[-1] == sliced.data_ptr(), "row-strided x was copied"
    transposed = torch.randn(DIM_K, 4, device=device).T
    glu_checked(transposed, w, b, "silu")
    assert seen[-1] != transposed.data_ptr()


def test_leading_dims(device):
    x, w, b = operands((2, 3), DIM_I, DIM_K, torch.float16, device)
    assert glu_checked(x, w, b, "gelu_tanh").shape == (2, 3, DIM_I)
    strided = torch.randn(3, 2, DIM_K, device=device).to(torch.float16).transpose(0, 1)  # (2, 3, K), no flat view
    assert glu_checked(strided, w, b, "gelu_tanh").shape == (2, 3, DIM_I)
    assert glu_checked(x[0, 0], w, None, "silu").shape == (DIM_I,)  # a single row, 1-D


def test_tf32_follows_torch_flag(device):
    x, w, b = operands((3,), DIM_I, DIM_K, torch.float32, device)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for allow, prec in ((False, "ieee"), (True, "tf32")):
            torch.backends.cuda.matmul.allow_tf32 = allow
            tglu._PLANS.clear()
            tglu.glu(x, w, b, config=SWAP16)
            tglu.glu(x.half(), w.half(), b.half(), config=SWAP16)  # 16-bit dtypes ignore the flag
            assert sorted(p.launch.meta["PREC"] for p in tglu._PLANS.values()) == sorted([prec, "tf32"])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_swapped_dots_for_narrow_row_tiles(device):
    """block_m <= 32 computes acc[BN, BM] = W @ x.T (W rows on the MMA's wide side)."""
    x, w, b = operands((3,), DIM_I, DIM_K, torch.float16, device)
    tglu._PLANS.clear()
    for cfg in CONFIGS:
        tglu.glu(x, w, b, config=cfg)
    swapped = {key[0][0].block_m: plan.launch.meta["SWAP"] for key, plan in tglu._PLANS.items()}
    assert swapped == {16: True, 32: True, 64: False}


def test_default_config_fits_the_device(device, monkeypatch):
    """Without a config, glu picks one for the device's shared memory, not Hopper's."""
    small = DeviceFacts(num_sms=46, capability=(8, 6), smem_per_block=64 * 1024)
    monkeypatch.setattr(tglu, "device_facts", lambda dev: small)
    tglu._PLANS.clear()
    x, w, b = operands((2,), DIM_I, 1024, torch.float16, device)
    glu_checked(x, w, b, "silu")
    assert all(key[0][0].smem_bytes(2) <= small.smem_per_block for key in tglu._PLANS)


def test_plans_reused(device):
    x, w, b = operands((3,), DIM_I, DIM_K, torch.float16, device)
    tglu.glu(x, w, b, config=SWAP16)
    held = len(tglu._PLANS)
    for _ in range(2):
        tglu.glu(x, w, b, config=SWAP16)
    assert len(tglu._PLANS) == held


# ----------------------------------------------------------------------------- empty shapes


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=str)
def test_m_zero(lead, device):
    x, w, b = operands(lead, DIM_I, DIM_K, torch.float16, device)
    out = tglu.glu(x, w, b)
    assert out.shape == (*lead, DIM_I) and out.dtype == torch.float16
    given = torch.empty(*lead, DIM_I, dtype=torch.float16, device=device)
    assert tglu.glu(x, w, b, out=given) is given


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_k_zero(act, bias, device):
    x, w, b = operands((2, 3), DIM_I, 0, torch.float32, device, bias)
    out = glu_checked(x, w, b, act)  # act(bg) * bu in every row, zeros without a bias
    if not bias:
        assert not out.any()


# ----------------------------------------------------------------------------- bad input


def _out(shape, dtype=torch.float16):
    return lambda dev: torch.empty(shape, dtype=dtype, device=dev)


# (id, call(x, w, b, device) with good fp16 operands x (3, K), w (2I, K), b (2I,), error, match)
BAD = [
    ("act", lambda x, w, b, d: tglu.glu(x, w, b, "relu"), ValueError, "unknown act 'relu'"),
    ("act-none", lambda x, w, b, d: tglu.glu(x, w, b, None), ValueError, "unknown act"),
    ("x-type", lambda x, w, b, d: tglu.glu(x.tolist(), w, b), TypeError, "x must be a torch.Tensor"),
    ("w-1d", lambda x, w, b, d: tglu.glu(x, w[0], b), LinearArgumentError, "weight must be 2-D"),
    ("w-odd", lambda x, w, b, d: tglu.glu(x, w[:-1], b[:-1]), ValueError, "even number of rows"),
    ("k", lambda x, w, b, d: tglu.glu(x[:, :-1], w, b), LinearArgumentError, "input features"),
    ("b-shape", lambda x, w, b, d: tglu.glu(x, w, b[:DIM_I]), LinearArgumentError, r"bias must have shape \(80,\)"),
    ("b-dtype", lambda x, w, b, d: tglu.glu(x, w, b.float()), LinearArgumentError, "share one dtype"),
    ("dtype", lambda x, w, b, d: tglu.glu(x.double(), w.double(), b.double()), TypeError, "unsupported dtype"),
    ("config-type", lambda x, w, b, d: tglu.glu(x, w, b, config=(16, 16, 32, 4, 2)), TypeError,
     "config must be a TritonGluConfig"),
    ("out-shape", lambda x, w, b, d: tglu.glu(x, w, b, out=_out((3, DIM_I + 1))(d)), ValueError,
     r"out must be a contiguous tensor of shape \(3, 40\)"),
    ("out-dtype", lambda x, w, b, d: tglu.glu(x, w, b, out=_out((3, DIM_I), torch.float32)(d)), TypeError,
     "out has dtype"),
    ("out-strided", lambda x, w, b, d: tglu.glu(x, w, b, out=_out((DIM_I, 3))(d).T), ValueError, "not contiguous"),
    ("out-type", lambda x, w, b, d: tglu.glu(x, w, b, out=[0.0]), TypeError, "out must be a torch.Tensor"),
    ("smem", lambda x, w, b, d: tglu.glu(x, w, b, config=Cfg(128, 256, 512, 4, 8)), ValueError, "shared memory"),
    ("regs", lambda x, w, b, d: tglu.glu(x, w, b, config=Cfg(128, 128, 16, 1, 1)), ValueError, "registers"),
]


@pytest.mark.parametrize("call, exc, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input(call, exc, match, device):
    x, w, b = operands((3,), DIM_I, DIM_K, torch.float16, device)
    with pytest.raises(exc, match=match):
        call(x, w, b, device)


def test_needs_cuda_outside_the_interpreter(monkeypatch):
    x, w, b = operands((3,), DIM_I, DIM_K, torch.float16, "cpu")
    monkeypatch.setattr(tglu, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        tglu.glu(x, w, b)


# ----------------------------------------------------------------------------- configs


def test_record_round_trip():
    for m in (1, 16, 64, 4096):
        for cfg in tglu.candidates(m, 14336, 4096, torch.bfloat16):
            record = json.loads(json.dumps(cfg.to_record()))
            assert record["kind"] == "triton_glu"
            assert Cfg.from_record(record) == cfg


@pytest.mark.parametrize("change, match", [
    ({"kind": "triton_splitk"}, "kind"),
    ({"block_n": 24}, "power of two"),
    ({"block_k": 1024}, "power of two"),
    ({"num_stages": 0}, "num_stages"),
    ({"num_warps": 4.0}, "must be int"),
    ({"split_k": 1}, "unexpected keys"),
])
def test_bad_records_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        Cfg.from_record({**SWAP16.to_record(), **change})


LLAMA3_8B = (14336, 4096)  # I, K


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 8, 16, 33, 64, 333, 4096])
def test_candidates(m, dtype):
    i, k = LLAMA3_8B
    found = tglu.candidates(m, i, k, dtype)
    assert 4 <= len(found) <= 12 and len(set(found)) == len(found)
    assert all(c.supports(m, i, k, dtype)[0] for c in found)
    if m <= 16:  # decode: 16-row tiles, many programs over N, deep K per stage
        assert all(c.block_m == 16 and 16 <= c.block_n <= 128 and c.num_warps <= 4 for c in found)
        assert all(c.block_k * dtype.itemsize >= 256 and 3 <= c.num_stages <= 5 for c in found)
    elif m > 64:
        assert all(c.block_m in (64, 128) for c in found)
    default = tglu.default_config(m, i, k, dtype)
    assert default in found
    assert -(-m // default.block_m) * -(-i // default.block_n) >= HOPPER_NUM_SMS


def test_default_config_for_small_i_and_limits():
    small = tglu.default_config(1, 40, 72, torch.float16)  # few columns: the most programs
    assert small.block_n == 16
    tight = tglu.default_config(1, 14336, 4096, torch.bfloat16, smem_limit=100 * 1024)
    assert tight.smem_bytes(2) <= 100 * 1024
    assert tglu.candidates(1, 40, 72, torch.float64) == []
    with pytest.raises(ValueError, match="no Triton GLU config"):
        tglu.default_config(1, 40, 72, torch.int8)
