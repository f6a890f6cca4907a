"""Triton tiled/persistent GEMM: correctness of every path and epilogue, configs, supports().

Runs under the Triton interpreter on a CPU machine (conftest sets TRITON_INTERPRET=1), so
shapes and blocks are small. bf16 is GPU-only (the interpreter's bf16 dot is wrong): see
test_triton_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_counters_zero, rel_err
from helpers import make_operands as operands
from hybridgemm.kernels import triton_gemm as tg
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation, reference_linear
from hybridgemm.kernels.problem import Problem
from hybridgemm.kernels.triton_config import dot_precision

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DTYPES = [torch.float16, torch.float32]
# Floor added to the error bound, per dtype: about one output rounding.
EPS = {torch.float16: 1e-4, torch.float32: 1e-6}

Cfg = tg.TritonGemmConfig
PTR_PERSISTENT = Cfg(16, 32, 16, 2, 4, 2, persistent=True, use_tma=False)
PTR_TILED = Cfg(32, 16, 32, 1, 4, 2, persistent=False, use_tma=False)
TMA_PERSISTENT = Cfg(16, 32, 16, 2, 4, 2, persistent=True, use_tma=True, epilogue_subtile=True)
TMA_TILED = Cfg(32, 16, 16, 1, 4, 3, persistent=False, use_tma=True)
# Split K (non-persistent only), reduced in one launch through arrival counters.
PTR_SPLIT = Cfg(16, 32, 16, 1, 4, 2, persistent=False, use_tma=False, split_k=3)
TMA_SPLIT = Cfg(32, 16, 16, 2, 4, 3, persistent=False, use_tma=True, epilogue_subtile=False, split_k=2)
TMA_SPLIT_SUB = Cfg(16, 32, 16, 1, 4, 2, persistent=False, use_tma=True, epilogue_subtile=True,
                    split_k=3)
ALL_PATHS = [PTR_PERSISTENT, PTR_TILED, TMA_PERSISTENT, TMA_TILED, PTR_SPLIT, TMA_SPLIT_SUB]
PTR_PATHS = [PTR_PERSISTENT, PTR_TILED, PTR_SPLIT]


def path_id(c):
    return f"tma{int(c.use_tma)}-p{int(c.persistent)}-s{c.split_k}"




def torch_err(x, w, b, act):
    """Error of PyTorch's own same-dtype result: the yardstick for ours."""
    return rel_err(apply_activation(F.linear(x, w, b), act), reference_linear(x, w, b, act))


def check(cfg, x, w, b, act, out=None, tf32=False):
    """Run into a NaN-poisoned output and compare every element with the fp64 reference."""
    m, n = x.shape[0], w.shape[0]
    if out is None:
        out = torch.full((m, n), float("nan"), dtype=x.dtype, device=x.device)
    res = tg.run(cfg, x, w, b, out, act, tf32=tf32)
    assert res is out
    assert torch.isfinite(out).all(), "some output elements were not written"
    err = rel_err(out, reference_linear(x, w, b, act))
    bound = 2 * torch_err(x, w, b, act) + EPS[x.dtype]
    assert err <= bound, f"rel err {err:.3g} > {bound:.3g} ({cfg})"
    return out


@pytest.mark.parametrize("cfg", ALL_PATHS, ids=path_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(Activation), ids=lambda a: a.value)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_every_path_and_epilogue(cfg, dtype, act, bias, device):
    x, w, b = operands(37, 48, 64, dtype, device, bias)  # M, N not multiples of the blocks
    check(cfg, x, w, b, act)
    assert_counters_zero()


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", PTR_PATHS, ids=path_id)
def test_odd_shapes_pointer_path(m, dtype, cfg, device):
    x, w, b = operands(m, 37, 45, dtype, device)  # K tail, N tail, unaligned row strides
    check(cfg, x, w, b, Activation.GELU_TANH)
    assert_counters_zero()


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", [TMA_PERSISTENT, TMA_TILED, TMA_SPLIT], ids=path_id)
def test_odd_shapes_tma_padded_rows(m, dtype, cfg, device):
    """Odd logical shapes inside padded (16-byte aligned) rows: TMA must zero-fill loads past
    K and clip stores past N (N x itemsize a multiple of 16 bytes, tma_reason), leaving the
    padding columns of out untouched."""
    n, k = 40, 45  # N not a multiple of the blocks
    xbuf = torch.randn(m, 48, device=device).to(dtype)
    wbuf = (torch.randn(n, 48, device=device) / k**0.5).to(dtype)
    wbuf[:, k:] = float("nan")  # must never be read
    obuf = torch.full((m, 48), float("nan"), dtype=dtype, device=device)
    x, w, out = xbuf[:, :k], wbuf[:, :k], obuf[:, :n]
    b = torch.randn(n, device=device).to(dtype)
    assert cfg.supports(Problem.from_tensors(x, w, b, out, Epilogue(Activation.RELU, True)))[0]
    check(cfg, x, w, b, Activation.RELU, out=out)
    assert torch.isnan(obuf[:, n:]).all(), "store wrote past N"


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("cfg", [TMA_PERSISTENT, TMA_TILED, TMA_SPLIT], ids=path_id)
def test_tma_refuses_an_out_whose_rows_end_inside_16_bytes(m, cfg, device):
    """A TMA store writes up to the next 16-byte boundary (tma_reason): an fp16 out of 37 columns
    in rows of 40 is no TMA problem, and the default configs for it write none of the padding."""
    n, k = 37, 48
    x, w, b = operands(m, n, k, torch.float16, device)
    obuf = torch.full((m, 40), float("nan"), dtype=torch.float16, device=device)
    out = obuf[:, :n]
    problem = Problem.from_tensors(x, w, b, out, Epilogue(Activation.RELU, True))
    ok, why = cfg.supports(problem)
    assert not ok and "16-byte units" in why, why
    chosen = tg.default_config(problem)
    assert not chosen.use_tma
    check(chosen, x, w, b, Activation.RELU, out=out)
    assert torch.isnan(obuf[:, n:]).all(), "store wrote past N"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_x(dtype, device):
    m, n, k = 17, 40, 48
    buf = torch.randn(m, k + 8, device=device).to(dtype)
    x_misaligned = buf[:, 3 : 3 + k]  # row stride 56 > K, pointer 6 or 12 bytes off
    x_aligned = buf[:, 8 : 8 + k]  # row stride > K, 16-byte aligned: TMA applies
    _, w, b = operands(m, n, k, dtype, device)
    check(PTR_PERSISTENT, x_misaligned, w, b, Activation.GELU)
    check(TMA_PERSISTENT, x_aligned, w, b, Activation.GELU)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tg.run(TMA_PERSISTENT, x_misaligned, w, b, torch.empty(m, n, dtype=dtype, device=device))


@pytest.mark.parametrize("cfg", [TMA_PERSISTENT, PTR_SPLIT, TMA_SPLIT_SUB], ids=path_id)
def test_bit_identical_repeats(cfg, device):
    x, w, b = operands(37, 48, 64, torch.float16, device)
    first = check(cfg, x, w, b, Activation.GELU)
    for _ in range(2):
        assert torch.equal(check(cfg, x, w, b, Activation.GELU), first)
        assert_counters_zero()
    # other operands through the same counters, then the first problem again
    x2, w2, b2 = operands(17, 37, 45, torch.float16, device)
    check(PTR_SPLIT, x2, w2, b2, Activation.RELU)
    assert torch.equal(check(cfg, x, w, b, Activation.GELU), first)
    assert_counters_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_matches_unsplit(dtype, device):
    """Splitting K changes only the fp32 summation order."""
    x, w, b = operands(33, 40, 96, dtype, device)
    whole = check(PTR_TILED, x, w, b, Activation.NONE)
    for split in (2, 3, 6):
        cfg = Cfg(32, 16, 16, 1, 4, 2, persistent=False, use_tma=False, split_k=split)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(check(cfg, x, w, b, Activation.NONE), whole, rtol=tol, atol=tol)


def test_tf32_flag(device):
    p32 = Problem(4, 4, 4, torch.float32, Epilogue(), 4, 4, 4)
    assert dot_precision(p32) == "ieee"
    assert dot_precision(Problem(4, 4, 4, torch.float32, Epilogue(), 4, 4, 4, tf32=True)) == "tf32"
    assert dot_precision(Problem(4, 4, 4, torch.float16, Epilogue(), 4, 4, 4)) == "tf32"
    x, w, b = operands(17, 40, 48, torch.float32, device)
    out = torch.empty(17, 40, device=device)
    tg.run(PTR_TILED, x, w, b, out, tf32=True)  # the interpreter's dot is exact either way
    assert rel_err(out, reference_linear(x, w, b)) < 1e-2


def test_empty_and_k_zero(device):
    x, w, b = operands(0, 40, 48, torch.float32, device)
    out = torch.empty(0, 40, device=device)
    assert tg.run(TMA_PERSISTENT, x, w, b, out) is out
    x, w, b = operands(5, 40, 0, torch.float32, device)
    out = torch.full((5, 40), float("nan"), device=device)
    tg.run(PTR_TILED, x, w, b, out, "relu")
    assert torch.equal(out, torch.relu(b).expand(5, 40))


def test_run_rejects_bad_operands(device):
    x, w, b = operands(4, 40, 48, torch.float16, device)
    out = torch.empty(4, 40, dtype=torch.float16, device=device)
    with pytest.raises(TypeError, match="dtype"):
        tg.run(PTR_TILED, x, w.float(), b, out)
    with pytest.raises(TypeError, match="float64"):
        tg.run(PTR_TILED, x.double(), w.double(), b.double(), out.double())
    with pytest.raises(ValueError, match="shape mismatch"):
        tg.run(PTR_TILED, x, w[:, :40], b, out)
    with pytest.raises(ValueError, match="bias"):
        tg.run(PTR_TILED, x, w, b[:39], out)
    with pytest.raises(ValueError, match="unit column stride"):
        tg.run(PTR_TILED, x, w.t().contiguous().t(), b, out)
    with pytest.raises(ValueError, match="activation"):
        tg.run(PTR_TILED, x, w, b, out, "swish")


def test_plan_cache_reused(device):
    x, w, b = operands(5, 40, 48, torch.float16, device)
    out = torch.empty(5, 40, dtype=torch.float16, device=device)
    tg.run(PTR_TILED, x, w, b, out)
    size = len(tg._PLANS)
    tg.run(PTR_TILED, x.clone(), w, b, out)
    assert len(tg._PLANS) == size


# ----------------------------------------------------------------------------- configs

def _config(persistent, split_k, **kw):
    return Cfg(persistent=persistent, split_k=1 if persistent else split_k, **kw)


configs = st.builds(
    _config,
    block_m=st.sampled_from([16, 32, 64, 128, 256]),
    block_n=st.sampled_from([32, 64, 128, 256]),
    block_k=st.sampled_from([16, 32, 64, 128]),
    group_m=st.integers(1, 64),
    num_warps=st.sampled_from([1, 2, 4, 8, 16]),
    num_stages=st.integers(1, 8),
    persistent=st.booleans(),
    use_tma=st.booleans(),
    epilogue_subtile=st.booleans(),
    split_k=st.integers(1, 16),
)


@settings(max_examples=200, deadline=None)
@given(configs)
def test_record_round_trip(cfg):
    record = json.loads(json.dumps(cfg.to_record()))
    assert record["kind"] == "triton_gemm"
    assert Cfg.from_record(record) == cfg


@pytest.mark.parametrize(
    "change, match",
    [
        ({"kind": "triton_splitk"}, "kind"),
        ({"block_m": 48}, "power of two"),
        ({"block_n": 8}, "power of two"),
        ({"num_warps": 3}, "power of two"),
        ({"num_stages": 0}, "num_stages"),
        ({"block_k": "64"}, "must be int"),
        ({"block_k": 64.0}, "must be int"),
        ({"persistent": 1}, "must be bool"),
        ({"group_m": True}, "must be int"),
        ({"extra": 1}, "unexpected keys"),
    ],
)
def test_bad_records_rejected(change, match):
    record = {**PTR_PERSISTENT.to_record(), **change}
    with pytest.raises(ValueError, match=match):
        Cfg.from_record(record)


def test_split_k_config_checks():
    with pytest.raises(ValueError, match="persistent=False"):
        Cfg(64, 64, 64, 8, 4, 3, persistent=True, use_tma=True, split_k=2)
    with pytest.raises(ValueError, match="split_k"):
        Cfg(64, 64, 64, 8, 4, 3, persistent=False, use_tma=True, split_k=0)
    record = PTR_PERSISTENT.to_record()
    del record["split_k"]  # a record written before split_k existed
    assert Cfg.from_record(record) == PTR_PERSISTENT
    assert Cfg.from_record(PTR_SPLIT.to_record()) == PTR_SPLIT


def test_bad_records_missing_key_and_not_dict():
    record = PTR_PERSISTENT.to_record()
    del record["use_tma"]
    with pytest.raises(ValueError, match="missing keys"):
        Cfg.from_record(record)
    with pytest.raises(ValueError, match="dict"):
        Cfg.from_record([1, 2])


def problem(m=4096, n=4096, k=4096, dtype=torch.bfloat16, **kw):
    layout = dict(ldx=k, ldw=k, ldo=n) | kw
    return Problem(m, n, k, dtype, Epilogue(Activation.NONE, True), **layout)


def test_supports_reasons():
    big = Cfg(128, 256, 64, 8, 8, 4, True, True)  # 4 stages + a full output tile
    ok, why = big.supports(problem())
    assert not ok and "shared memory" in why
    assert Cfg(128, 256, 64, 8, 8, 4, True, True, epilogue_subtile=True).supports(problem())[0]
    tma = Cfg(128, 128, 64, 8, 8, 3, True, True)
    assert tma.supports(problem())[0]
    ok, why = Cfg(128, 128, 64, 8, 8, 3, False, True, split_k=16).supports(problem(k=512, ldx=512, ldw=512))
    assert not ok and "exceeds the 8 blocks of K" in why
    ok, why = tma.supports(problem(align_x=8))
    assert not ok and "16-byte aligned pointers" in why
    ok, why = tma.supports(problem(k=4100, ldx=4100, ldw=4100))
    assert not ok and "row strides" in why
    ok, why = tma.supports(problem(), capability=(8, 0))
    assert not ok and "compute capability" in why
    assert Cfg(128, 128, 64, 8, 8, 3, True, False).supports(problem(align_x=2))[0]
    ok, why = tma.supports(problem(dtype=torch.float64))
    assert not ok and "dtype" in why
    ok, why = Cfg(256, 256, 32, 8, 4, 2, True, False).supports(problem())
    assert not ok and "registers" in why
    ok, why = tma.supports(problem(m=600_000))
    assert not ok and "2**31" in why


@pytest.mark.parametrize(
    "prob",
    [
        problem(),
        problem(m=1024, n=1024, k=8192),
        problem(m=128),
        problem(dtype=torch.float32),
        problem(dtype=torch.float16, align_x=2, k=4099, ldx=4099, ldw=4099),
        problem(m=1024, n=1024, k=4096),
        problem(m=256, n=1024, k=4096),
    ],
    ids=["4k", "tall-k", "medium-m", "fp32", "misaligned", "8b-kv-1024", "8b-kv-256"],
)
def test_candidates(prob):
    found = tg.candidates(prob)
    assert 1 <= len(found) <= 12
    assert len(set(found)) == len(found)
    assert all(c.supports(prob)[0] for c in found)
    assert tg.default_config(prob) == found[0]
    if prob.align_x < 16:
        assert not any(c.use_tma for c in found)
    else:
        assert found[0].use_tma and any(c.persistent for c in found)
    if prob.m <= 256:
        assert any(c.block_m == 64 for c in found)


@pytest.mark.parametrize("m", [1024, 2048])
def test_candidates_fill_the_sms_when_tiles_are_few(m):
    """8b kv (N = 1024) at large M: 128 x 128 tiles leave SMs idle, so smaller tiles and
    split-K configs must be on the list, each making at least ~one wave of programs."""
    prob = problem(m=m, n=1024, k=4096)
    found = tg.candidates(prob)
    assert len(found) <= 12
    programs = {c: -(-m // c.block_m) * (-(-1024 // c.block_n)) * c.split_k for c in found}
    assert any(c.split_k > 1 for c in found)
    assert any(c.block_m == 64 and c.num_warps == 4 for c in found)
    assert any(c.block_n == 64 and c.num_warps == 4 for c in found)
    assert sum(p >= 128 for c, p in programs.items() if not c.persistent) >= 6, programs
    assert all(not (c.persistent and c.split_k > 1) for c in found)
