"""Triton split-K (decode) GEMM: correctness, determinism, workspace reuse, configs, supports().

Runs under the Triton interpreter on a CPU machine; bf16 is GPU-only (test_triton_gpu.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_counters_zero, rel_err
from helpers import make_operands as operands
from hybridgemm.kernels import triton_launch
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation, reference_linear
from hybridgemm.kernels.problem import Problem
from hybridgemm.kernels.triton_config import HOPPER_NUM_SMS
from hybridgemm.kernels.triton_scratch import counters_snapshot, tl_sum_parts

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DTYPES = [torch.float16, torch.float32]
EPS = {torch.float16: 1e-4, torch.float32: 1e-6}

Cfg = ts.TritonSplitKConfig
SPLIT3 = Cfg(block_m=16, block_n=16, block_k=16, split_k=3, num_warps=4, num_stages=2)
DIRECT = Cfg(block_m=16, block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2)
SPLIT2 = Cfg(block_m=16, block_n=32, block_k=16, split_k=2, num_warps=4, num_stages=3)
FUSED3 = Cfg(16, 16, 16, split_k=3, num_warps=4, num_stages=2, fused_reduce=True)
FUSED2 = Cfg(16, 32, 16, split_k=2, num_warps=4, num_stages=3, fused_reduce=True)
CONFIGS = [SPLIT3, DIRECT, SPLIT2, FUSED3, FUSED2]


def cfg_id(c):
    return f"split{c.split_k}{'-fused' if c.fused_reduce else ''}"




def check(cfg, x, w, b, act, out=None):
    """Run into a NaN-poisoned output; error bounded relative to PyTorch's own same-dtype one."""
    if out is None:
        out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    assert ts.run(cfg, x, w, b, out, act) is out
    assert torch.isfinite(out).all(), "some output elements were not written"
    ref = reference_linear(x, w, b, act)
    bound = 2 * rel_err(apply_activation(F.linear(x, w, b), act), ref) + EPS[x.dtype]
    err = rel_err(out, ref)
    assert err <= bound, f"rel err {err:.3g} > {bound:.3g} ({cfg})"
    return out


@pytest.mark.parametrize("cfg", [SPLIT3, DIRECT, FUSED3], ids=cfg_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(Activation), ids=lambda a: a.value)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_every_epilogue(cfg, dtype, act, bias, device):
    x, w, b = operands(3, 40, 64, dtype, device, bias)
    check(cfg, x, w, b, act)
    assert_counters_zero()


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
def test_odd_shapes(m, dtype, cfg, device):
    x, w, b = operands(m, 37, 45, dtype, device)  # K tail, N tail, M=17 spans two m-blocks
    check(cfg, x, w, b, Activation.GELU)
    assert_counters_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_x_and_padded_out(dtype, device):
    m, n, k = 5, 37, 45
    buf = torch.randn(m, k + 8, device=device).to(dtype)
    x = buf[:, 3 : 3 + k]  # row stride > K, misaligned pointer
    _, w, b = operands(m, n, k, dtype, device)
    obuf = torch.full((m, n + 3), float("nan"), dtype=dtype, device=device)
    check(SPLIT3, x, w, b, Activation.RELU, out=obuf[:, :n])
    assert torch.isnan(obuf[:, n:]).all(), "store wrote past N"
    obuf.fill_(float("nan"))
    check(FUSED3, x, w, b, Activation.RELU, out=obuf[:, :n])
    assert torch.isnan(obuf[:, n:]).all(), "store wrote past N"


def test_deterministic_and_workspace_reused(device):
    x, w, b = operands(3, 40, 64, torch.float16, device)
    first = check(SPLIT3, x, w, b, Activation.GELU_TANH)
    held = ts.workspace_bytes()
    assert held > 0
    for _ in range(3):
        assert torch.equal(check(SPLIT3, x, w, b, Activation.GELU_TANH), first)
    assert ts.workspace_bytes() == held, "workspace reallocated per call"
    # A different M in the same size bucket reuses the same buffer too.
    x2, _, _ = operands(5, 40, 64, torch.float16, device)
    check(SPLIT3, x2, w, b, Activation.NONE)
    assert ts.workspace_bytes() == held


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_reduce_bit_identical_to_two_launches(dtype, device):
    """Same partials, same order: the single-pass reduction gives the two-launch bits."""
    x, w, b = operands(17, 37, 45, dtype, device)
    for split in (2, 3):
        two = check(Cfg(16, 16, 16, split, 4, 2), x, w, b, Activation.GELU_TANH)
        one = check(Cfg(16, 16, 16, split, 4, 2, fused_reduce=True), x, w, b, Activation.GELU_TANH)
        assert torch.equal(one, two)
        assert_counters_zero()


def test_fused_reduce_repeats_and_counters_reset(device):
    """Counters go back to 0 after every call, so repeated calls, new data and a different
    problem on the same (device, stream) buffer all come out right and bit-identical."""
    x, w, b = operands(5, 40, 64, torch.float16, device)
    first = check(FUSED3, x, w, b, Activation.GELU)
    assert_counters_zero()
    held = ts.workspace_bytes()
    for _ in range(3):
        assert torch.equal(check(FUSED3, x, w, b, Activation.GELU), first)
        assert_counters_zero()
    assert ts.workspace_bytes() == held, "workspace reallocated per call"
    x2, w2, b2 = operands(3, 37, 45, torch.float16, device)
    check(FUSED2, x2, w2, b2, Activation.RELU)  # different tile count, same counters
    check(FUSED3, x2, w2, None, Activation.NONE)
    assert_counters_zero()
    assert torch.equal(check(FUSED3, x, w, b, Activation.GELU), first)


def test_counters_survive_clear(device):
    x, w, b = operands(2, 40, 64, torch.float32, device)
    check(FUSED2, x, w, b, Activation.NONE)
    ts.clear_workspaces()
    assert counters_snapshot() == [] and ts.workspace_bytes() == 0
    check(FUSED2, x, w, b, Activation.NONE)  # fresh zeroed counters
    assert_counters_zero()


def test_split_counts_agree(device):
    x, w, b = operands(2, 40, 96, torch.float32, device)
    outs = [check(Cfg(16, 16, 16, s, 4, 2), x, w, b, Activation.NONE) for s in (1, 2, 3, 6)]
    outs += [check(Cfg(16, 16, 16, s, 4, 2, True), x, w, b, Activation.NONE) for s in (2, 6)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


def test_empty(device):
    x, w, b = operands(0, 40, 48, torch.float16, device)
    out = torch.empty(0, 40, dtype=torch.float16, device=device)
    assert ts.run(SPLIT3, x, w, b, out) is out


def test_run_rejects(device):
    x, w, b = operands(2, 40, 32, torch.float16, device)
    out = torch.empty(2, 40, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="exceeds the 2 blocks of K"):
        ts.run(SPLIT3, x, w, b, out)
    with pytest.raises(ValueError, match="exceeds the 2 blocks of K"):
        ts.run(FUSED3, x, w, b, out)
    with pytest.raises(TypeError, match="dtype"):
        ts.run(DIRECT, x, w, b.float(), out)
    with pytest.raises(ValueError, match="shape mismatch"):
        ts.run(DIRECT, x, w, b, out[:, :39])


# ----------------------------------------------------------------------------- configs

def _config(split_k, fused, **kw):
    return Cfg(split_k=split_k, fused_reduce=fused and split_k > 1, **kw)


configs = st.builds(
    _config,
    block_m=st.sampled_from([16, 32, 64, 128]),
    block_n=st.sampled_from([16, 32, 64, 128, 256]),
    block_k=st.sampled_from([16, 32, 64, 128, 256, 512]),
    split_k=st.integers(1, 64),
    num_warps=st.sampled_from([1, 2, 4, 8, 16]),
    num_stages=st.integers(1, 8),
    fused=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(configs)
def test_record_round_trip(cfg):
    record = json.loads(json.dumps(cfg.to_record()))
    assert record["kind"] == "triton_splitk"
    assert Cfg.from_record(record) == cfg


@pytest.mark.parametrize(
    "change, match",
    [
        ({"kind": "triton_gemm"}, "kind"),
        ({"split_k": 0}, "split_k"),
        ({"split_k": 2.0}, "must be int"),
        ({"block_n": 24}, "power of two"),
        ({"block_m": 12}, "power of two"),
        ({"num_stages": True}, "must be int"),
        ({"persistent": False}, "unexpected keys"),
    ],
)
def test_bad_records_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        Cfg.from_record({**SPLIT3.to_record(), **change})


def test_record_without_fused_reduce_loads():
    """Records written before ``fused_reduce`` existed (shipped tables) still load."""
    record = SPLIT3.to_record()
    del record["fused_reduce"]
    assert Cfg.from_record(record) == SPLIT3
    assert FUSED3.to_record()["fused_reduce"] is True


def test_fused_reduce_needs_a_split():
    with pytest.raises(ValueError, match="fused_reduce needs split_k > 1"):
        Cfg(16, 16, 16, 1, 4, 2, fused_reduce=True)
    with pytest.raises(ValueError, match="must be bool"):
        Cfg.from_record({**FUSED3.to_record(), "fused_reduce": 1})


def test_missing_key_rejected():
    record = SPLIT3.to_record()
    del record["split_k"]
    with pytest.raises(ValueError, match="missing keys"):
        Cfg.from_record(record)


def problem(m=1, n=10240, k=8192, dtype=torch.bfloat16, **kw):
    layout = dict(ldx=k, ldw=k, ldo=n) | kw
    return Problem(m, n, k, dtype, Epilogue(Activation.NONE, True), **layout)


def test_supports_reasons():
    assert Cfg(16, 64, 128, 4, 4, 4).supports(problem(align_x=2, align_w=2))[0]  # any alignment
    ok, why = Cfg(16, 64, 128, 4, 4, 4).supports(problem(k=256, ldx=256, ldw=256))
    assert not ok and "exceeds the 2 blocks of K" in why
    ok, why = Cfg(16, 256, 512, 2, 4, 4).supports(problem())
    assert not ok and "shared memory" in why
    ok, why = Cfg(128, 256, 64, 2, 4, 2).supports(problem(m=64))
    assert not ok and "registers" in why
    ok, why = Cfg(16, 64, 128, 2, 4, 4).supports(problem(dtype=torch.int8))
    assert not ok and "dtype" in why


SHAPES = {  # name: (N, K), the shapes the split-K kernel is tuned for
    "8b-q": (4096, 4096), "8b-kv": (1024, 4096), "8b-qkv": (6144, 4096), "8b-o": (4096, 4096),
    "70b-qkv": (10240, 8192), "70b-o": (8192, 8192),
}


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("name", list(SHAPES))
def test_candidates_cover_the_gpu(name, m):
    n, k = SHAPES[name]
    prob = problem(m=m, n=n, k=k)
    found = ts.candidates(prob)
    assert 1 <= len(found) <= 16 and len(set(found)) == len(found)
    assert all(c.supports(prob)[0] for c in found)
    assert ts.default_config(prob).supports(prob)[0]
    programs = [(-(-n // c.block_n)) * c.split_k * (-(-m // c.block_m)) for c in found]
    # Each candidate fills the SMs at least half-way and at most ~5 waves; some give ~2+ waves.
    # Exception: a no-split config with deep stages may use as few as a quarter of the SMs
    # (measured best at qwen2.5-7b o: 56 programs of 64 rows, sweep_triton_splitk.csv).
    assert all(HOPPER_NUM_SMS // 2 <= p <= 5 * HOPPER_NUM_SMS or (c.split_k == 1 and HOPPER_NUM_SMS // 4 <= p)
               for c, p in zip(found, programs)), programs
    assert any(1.9 * HOPPER_NUM_SMS <= p for p in programs), programs
    assert all(c.split_k > 1 or not c.fused_reduce for c in found)
    if m <= 16:  # the single-pass reduction, the two-launch one and no split are all timed
        assert any(c.fused_reduce for c in found)
        assert any(c.split_k > 1 and not c.fused_reduce for c in found)
        assert any(c.split_k == 1 for c in found) or n <= 1024


def test_candidates_only_for_decode():
    assert ts.candidates(problem(m=65)) == []
    assert ts.candidates(problem(m=64))
    small = problem(m=1, n=37, k=45, ldx=45, ldw=45, ldo=37, dtype=torch.float16)
    assert ts.default_config(small).supports(small)[0]


# ----------------------------------------------------------------------------- launcher


def test_launcher_fast_path(monkeypatch):
    """After the first (JIT) launch, a Launcher calls CompiledKernel[grid] with the args and
    then the constexprs in signature order; the interpreter always takes the JIT path."""
    from triton.compiler import CompiledKernel

    calls = []

    class FakeCompiled(CompiledKernel):
        def __init__(self):
            pass

        def __getitem__(self, grid):
            return lambda *args: calls.append(("fast", grid, args))

    class FakeFn:
        arg_names = ["a", "b", "C", "D"]

        def __getitem__(self, grid):
            def launch(*args, **meta):
                calls.append(("jit", grid, args, meta))
                return FakeCompiled()
            return launch

    meta = dict(D=2, C=1, num_warps=4)
    slow = triton_launch.Launcher(FakeFn(), (3, 2), meta)
    slow(10, 20)
    slow(11, 21)
    assert [c[0] for c in calls] == ["jit", "jit"]  # interpreting: never the fast path
    calls.clear()
    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    fast = triton_launch.Launcher(FakeFn(), (3, 2), meta)
    fast(10, 20)
    fast(11, 21)
    assert calls == [("jit", (3, 2), (10, 20), meta), ("fast", (3, 2, 1), (11, 21, 1, 2))]
    calls.clear()
    one_dim = triton_launch.Launcher(FakeFn(), (5,), meta)  # CompiledKernel's runner indexes 3 grid dims
    one_dim(1, 2)
    one_dim(1, 2)
    assert calls[1] == ("fast", (5, 1, 1), (1, 2, 1, 2))
    calls.clear()
    monkeypatch.setenv("HYBRIDGEMM_TRITON_SLOW_LAUNCH", "1")
    opted_out = triton_launch.Launcher(FakeFn(), (3, 2), meta)
    opted_out(1, 2)
    opted_out(1, 2)
    assert [c[0] for c in calls] == ["jit", "jit"]


@pytest.mark.parametrize("head_dim,k,tuned,want_split", [
    (128, 2048, ts.TritonSplitKConfig(16, 64, 256, 1, 4, 4), 2),     # Qwen3-30B-A3B's Q/K/V entry at M = 1
    (128, 4096, ts.TritonSplitKConfig(16, 64, 256, 1, 4, 4), 2),     # Qwen3-8B's
    (256, 2560, ts.TritonSplitKConfig(16, 64, 256, 1, 4, 4), 4),     # Gemma 3 4B's
    (256, 512, ts.TritonSplitKConfig(16, 64, 256, 1, 4, 4), 2),      # K of four 128-wide tiles: two a split
    (128, 4096, ts.TritonSplitKConfig(16, 64, 256, 3, 4, 3, fused_reduce=True), 6),
    (128, 4096, ts.TritonSplitKConfig(16, 128, 256, 2, 4, 3, fused_reduce=True), 2),  # already whole heads
    (32, 128, ts.TritonSplitKConfig(16, 16, 32, 2, 4, 2), 2),        # a two-launch entry at the cap: single-pass
    (128, 4096, ts.TritonSplitKConfig(16, 32, 128, 3, 4, 3, fused_reduce=True), 11),  # 12 would leave one idle
])
def test_whole_head_tiles_keep_the_tuned_programs(head_dim, k, tuned, want_split):
    """The q/k norms' whole-head tiles (``rope_config``): as many programs over the weight as
    the tuned config ran (K split as often more as the tiles are wider, two K tiles a split at
    least, every split given K tiles, always the one-launch reduction the rotary epilogue
    needs), in shared memory and registers."""
    cfg = ts._whole_head_config(tuned, head_dim, k, 2, 2)
    assert cfg.block_n == head_dim and cfg.split_k == want_split
    assert cfg.fused_reduce == (cfg.split_k > 1)
    prob = problem(m=1, n=40 * head_dim, k=k)
    assert cfg.supports(prob)[0], cfg.supports(prob)
    k_tiles = -(-k // cfg.block_k)
    assert (cfg.split_k - 1) * -(-k_tiles // cfg.split_k) < k_tiles  # the last split has K tiles too


# ----------------------------------------------------------------------------- merging the splits


@pytest.mark.parametrize("block_m, block_n, num_warps, split, group", [
    (16, 16, 4, 16, 8),    # 2 fp32 registers a thread a part: capped at MAX_FIXUP_GROUP
    (16, 64, 4, 16, 8),    # 8
    (16, 128, 4, 16, 4),   # 16 (Qwen3-30B-A3B's one-tile router)
    (64, 64, 4, 16, 2),    # 32
    (64, 128, 4, 16, 1),   # 64: one part at a time
    (128, 256, 8, 4, 1),   # 128 (a large GEMM tile)
    (16, 64, 4, 3, 3),     # no more than there are parts
    (16, 64, 4, 1, 1),
])
def test_the_merge_group_keeps_loads_in_flight_within_the_register_budget(block_m, block_n, num_warps, split,
                                                                          group):
    from hybridgemm.kernels import triton_scratch as scratch

    assert scratch.fixup_group(block_m, block_n, num_warps, split) == group


@triton.jit
def _sum_parts_kernel(parts_ptr, out_ptr, count, n, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    total = tl_sum_parts(tl.zeros([BLOCK], dtype=tl.float32), parts_ptr + offs, n, ok, count, GROUP)
    tl.store(out_ptr + offs, total, mask=ok)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_the_parts_are_summed_in_index_order_whatever_the_group(group, device):
    """tl_sum_parts against the same fp32 additions one by one in PyTorch (part 0, + part 1, ...),
    bit for bit, signs of zero included, for counts below, at and past the group and not a
    multiple of it. The data make the order show: 1e8-scale terms beside small ones (another
    order rounds differently), and a column of -0.0 parts (a sum started from +0.0 would end
    +0.0)."""
    g = torch.Generator().manual_seed(group)
    n, block = 37, 64
    for count in (1, 2, group, group + 1, 2 * group + 3, 11):
        parts = torch.randn(count, n, generator=g) * torch.where(torch.rand(count, n, generator=g) < 0.3, 1e8, 1.0)
        parts[:, 5] = -0.0
        parts = parts.to(device)
        want = parts[0].clone()
        for s in range(1, count):
            want = want + parts[s]
        out = torch.full((block,), float("nan"), device=device)
        _sum_parts_kernel[(1,)](parts, out, count, n, GROUP=group, BLOCK=block)
        assert torch.equal(out[:n].view(torch.int32), want.view(torch.int32)), (group, count)
        assert torch.signbit(out[5])  # -0.0 kept


@pytest.mark.parametrize("block_n, split", [(128, 5), (128, 7), (64, 9), (32, 11)])
def test_fused_reduce_bit_identical_to_two_launches_at_many_splits(block_n, split, device):
    """Splits past one merge group (4 or 8 parts here) and not a multiple of it: the single-pass
    merge gives the two-launch bits, the norm's summed squares included, and both are close to
    fp64 (their common order is checked by test_the_parts_are_summed_in_index_order_...)."""
    from hybridgemm.kernels.triton_scratch import fixup_group

    assert fixup_group(16, block_n, 4, split) < split
    x, w, b = operands(3, 70, 16 * split * 2, torch.float32, device)
    two = check(Cfg(16, block_n, 16, split, 4, 2), x, w, b, Activation.GELU_TANH)
    one = check(Cfg(16, block_n, 16, split, 4, 2, fused_reduce=True), x, w, b, Activation.GELU_TANH)
    assert torch.equal(one, two)
    assert_counters_zero()
    nw = torch.rand(x.shape[1], device=device) + 0.5
    outs = []
    for fused in (False, True):
        out = torch.full((3, 70), float("nan"), device=device)
        ts.run(Cfg(16, block_n, 16, split, 4, 2, fused_reduce=fused), x, w, b, out, None, norm=(nw, 1e-6))
        outs.append(out)
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    ref = F.linear(F.rms_norm(x.double(), (x.shape[1],), nw.double(), 1e-6), w.double(), b.double())
    assert rel_err(outs[1], ref) < 1e-5
