"""Mixture-of-experts (kernels/triton_moe.py, fusion/experts.py) on the CPU: the pair layout, the
two grouped kernels under the Triton interpreter against an fp64 reference (fp32 and fp16, odd
shapes, empty experts, one expert taking every pair, M = 1, 3, 17, 333), routing against
transformers' Mixtral router (ties included), the kernel path against the expert loop and
against transformers' own experts module, and bad input."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hybridgemm import experts as moe_mod
from hybridgemm.kernels import triton_moe as tm
from hybridgemm.kernels import triton_moe_pairs as moe_pairs
from hybridgemm.kernels import triton_router as tr

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _weights(e, i, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w_d = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    return w_gu, w_d


def _routing(t, e, k, seed=1, experts=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if experts is not None:  # only these experts ever chosen
        mask = torch.full((e,), -1e4)
        mask[experts] = 0
        logits = logits + mask
    return moe_mod.route(logits, k)


def _reference(x, ids, weights, w_gu, w_d, act="silu"):
    """fp64: per pair act(x Wg^T) * (x Wu^T), then W_d, times the weight, summed over slots."""
    t, k = ids.shape
    xd, gu, d = x.double(), w_gu.double(), w_d.double()
    out = torch.zeros(t, x.shape[1], dtype=torch.float64)
    i = w_gu.shape[1] // 2
    fn = {"silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[act]
    for tok in range(t):
        for s in range(k):
            e = int(ids[tok, s])
            h = xd[tok] @ gu[e].T
            out[tok] += (fn(h[:i]) * h[i:]) @ d[e].T * float(weights[tok, s])
    return out


@pytest.mark.parametrize("t,k,e,block_m,experts", [
    (1, 2, 8, 16, None), (3, 2, 6, 4, None), (100, 3, 5, 16, [0, 4]),  # chunks of 128 pairs: 3 of them
    (333, 8, 128, 64, None), (257, 1, 3, 32, [2]),  # one expert takes every pair
])
def test_the_triton_layout_equals_the_pytorch_one(t, k, e, block_m, experts):
    ids, _ = _routing(t, e, k, experts=experts)
    got, ref = tm.align(ids, e, block_m), tm.align_torch(ids, e, block_m)
    assert torch.equal(got.rows, ref.rows) and torch.equal(got.block_expert, ref.block_expert)
    assert got.rows.dtype == got.block_expert.dtype == torch.int32


@pytest.mark.parametrize("t,k,h", [(1, 2, 40), (3, 8, 1030), (17, 3, 7)])
def test_sum_slots_adds_each_tokens_slots_in_slot_order(t, k, h):
    rows = torch.randn(t * k, h, generator=torch.Generator().manual_seed(3)) * 100
    got = torch.full((t, h), float("nan"), dtype=torch.float16)
    got.copy_(tm.sum_slots(rows, k, torch.float16))
    ref = rows.view(t, k, h)[:, 0].clone()
    for s in range(1, k):  # fp32, slot after slot
        ref += rows.view(t, k, h)[:, s]
    assert torch.equal(got, ref.half())
    with pytest.raises(ValueError, match="fp32"):
        tm.sum_slots(rows.half(), k, torch.float16)


def test_the_layout_puts_each_expert_in_whole_blocks_in_pair_order():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5 -> experts 2,0,2,3,0,2; expert 1 empty
    lay = tm.align(ids, 4, 4)
    rows, s = lay.rows.tolist(), lay.pairs
    assert s == 6 and len(rows) % 4 == 0
    blocks = [rows[b:b + 4] for b in range(0, len(rows), 4)]
    experts = lay.block_expert.tolist()
    got = {}
    for block, e in zip(blocks, experts):
        if e < 4:
            got.setdefault(e, []).extend(p for p in block if p < s)
        else:
            assert all(p == s for p in block)  # padding past the last expert
    assert got == {0: [1, 4], 2: [0, 2, 5], 3: [3]}
    assert len(rows) == -(-(s + min(4, s) * 3) // 4) * 4  # S plus at most block_m - 1 padding per expert


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,e,k,i,h,experts", [
    (1, 8, 2, 48, 40, None),      # decode: one token; N and K not multiples of the blocks
    (3, 6, 2, 40, 72, None),
    (17, 4, 3, 32, 64, [1, 3]),   # experts 0 and 2 receive nothing
    (333, 5, 1, 24, 48, [4]),     # one expert takes every pair
])
def test_the_kernels_match_fp64(dtype, tol, t, e, k, i, h, experts):
    w_gu, w_d = _weights(e, i, h, dtype)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, weights = _routing(t, e, k, experts=experts)
    cfg = tm.TritonMoeConfig(16, 32, 32)
    lay = tm.align(ids, e, cfg.block_m)
    inter = tm.run_gate_up(cfg, x, w_gu, lay, k)
    out = tm.run_down(cfg, inter, w_d, lay, weights)
    got = out.view(t, k, h).sum(1)
    ref = _reference(x, ids, weights, w_gu, w_d)
    scale = ref.abs().max()
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max() <= tol * scale, float((got.double() - ref).abs().max() / scale)


def test_moe_on_the_kernel_path_equals_the_expert_loop(monkeypatch):
    t, e, k, i, h = 17, 6, 2, 40, 56
    w_gu, w_d = _weights(e, i, h, torch.float32)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4))
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(5))
    loop = moe_mod.moe(x, logits, w_gu, w_d, top_k=k)
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    out = torch.full_like(x, float("nan"))
    out.copy_(moe_mod.moe(x, logits, w_gu, w_d, top_k=k))
    torch.testing.assert_close(out, loop, rtol=1e-5, atol=1e-5)
    again = moe_mod.moe(x, logits, w_gu, w_d, top_k=k)
    assert torch.equal(again, out)  # fixed order of every sum
    ids, weights = moe_mod.route(logits, k)
    ref = _reference(x, ids, weights, w_gu, w_d)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_route_matches_mixtrals_router_ties_included():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = transformers.MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2)
    router = MixtralTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(6))
    x[3] = 0  # every logit equal: a tie over all experts
    with torch.no_grad():
        logits, scores, idx = router(x)
        ids, weights = moe_mod.route(logits, 2)
    assert torch.equal(ids, idx) and torch.equal(weights, scores)
    assert ids[3].tolist() == idx[3].tolist()


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float16])
def test_route_runs_the_routing_kernel_where_the_kernels_run(weights_dtype, monkeypatch):
    logits = torch.randn(17, 12, generator=torch.Generator().manual_seed(2)) * 3
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    calls = []
    real = tr.launch
    monkeypatch.setattr(tr, "launch", lambda *a: calls.append(1) or real(*a))
    ids, weights = moe_mod.route(logits, 3, True, weights_dtype)
    want_ids, want = moe_mod.route_torch(logits, 3, True, weights_dtype)
    assert calls == [1] and torch.equal(ids, want_ids) and weights.dtype == weights_dtype
    torch.testing.assert_close(weights, want, rtol=4 * torch.finfo(weights_dtype).eps, atol=0)
    compiled = torch.compile(lambda z: moe_mod.route(z, 3, True, weights_dtype), fullgraph=True, backend="aot_eager")
    got_ids, got = compiled(logits)
    torch._dynamo.reset()
    assert torch.equal(got_ids, ids) and torch.equal(got, weights)  # the custom op: the same launch
    leaf = logits.clone().requires_grad_()
    ids, weights = moe_mod.route(leaf, 3)  # autograd: PyTorch's operations, not the kernel
    weights.sum().backward()
    assert len(calls) == 2 and leaf.grad is not None


def test_route_falls_back_to_pytorch_where_the_kernel_refuses(monkeypatch):
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    logits = torch.randn(3, tr.MAX_EXPERTS + 5, generator=torch.Generator().manual_seed(4))
    ids, weights = moe_mod.route(logits, 40)  # too many experts and too large a top_k for the kernel
    want_ids, want = moe_mod.route_torch(logits, 40)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want)


def test_moe_equals_transformers_mixtral_experts(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                                     num_experts_per_tok=2)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 5, 32)
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    with torch.no_grad():
        want = block(x).view(5, 32)
        logits = F.linear(x.view(5, 32), block.gate.weight)
        got = moe_mod.moe(x.view(5, 32), logits, block.experts.gate_up_proj, block.experts.down_proj, top_k=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_tokens_gives_an_empty_result():
    w_gu, w_d = _weights(3, 8, 16, torch.float32)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    out = moe_mod.moe(torch.zeros(0, 16), (ids, torch.zeros(0, 2)), w_gu, w_d)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("change,match", [
    (dict(ids=torch.tensor([[0, 3]])), "must lie in 0..2"),
    (dict(ids=torch.tensor([[0.0, 1.0]])), "must be integers"),
    (dict(weights=torch.ones(1, 3)), "must both be"),
    (dict(x=torch.zeros(1, 15)), "do not fit"),
    (dict(w_d=torch.zeros(3, 16, 7)), "do not fit"),
    (dict(activation="tanh"), "activation"),
    (dict(x=torch.zeros(1, 16, dtype=torch.float16)), "differ in dtype"),
    (dict(logits_without_k=True), "need top_k"),
])
def test_bad_arguments_are_clear_errors(change, match):
    w_gu, w_d = _weights(3, 8, 16, torch.float32)
    args = dict(x=torch.zeros(1, 16), ids=torch.tensor([[0, 1]]), weights=torch.ones(1, 2), w_gu=w_gu, w_d=w_d,
                activation="silu")
    args.update(change)
    routing = torch.zeros(1, 3) if args.pop("logits_without_k", False) else (args["ids"], args["weights"])
    with pytest.raises(ValueError, match=match):
        moe_mod.moe(args["x"], routing, args["w_gu"], args["w_d"], args["activation"])


def test_a_layout_of_another_block_size_is_refused():
    w_gu, w_d = _weights(3, 8, 16, torch.float32)
    lay = tm.align(torch.tensor([[0, 1]]), 3, 16)
    with pytest.raises(ValueError, match="block_m"):
        tm.run_gate_up(tm.TritonMoeConfig(32, 32, 32), torch.zeros(1, 16), w_gu, lay, 2)


def test_tensor_core_configs_are_pair_major_with_tiles_an_mma_takes():
    w_gu, w_d = _weights(3, 8, 16, torch.float32)
    ids, weights = torch.tensor([[0, 1]]), torch.ones(1, 2)
    lay = tm.align(ids, 3, 16)
    with pytest.raises(ValueError, match="pair-major"):
        tm.run_gate_up(tm.TritonMoeConfig(16, 32, 32, mma=True), torch.zeros(1, 16), w_gu, lay, 2)
    for small in (tm.TritonMoeConfig(1, 8, 32, mma=True), tm.TritonMoeConfig(1, 16, 8, mma=True)):
        with pytest.raises(ValueError, match="at least 16"):
            moe_pairs.run_pairs(small, torch.zeros(1, 16), w_gu, w_d, ids, weights)


def test_the_layout_has_no_value_dependent_size():
    """Dynamo traces the PyTorch form as one graph (no bincount or nonzero, whose sizes need a
    host sync: a CUDA graph could not hold it)."""
    def layout(ids):
        lay = tm.align_torch(ids, 5, 4)
        return lay.rows, lay.block_expert

    ids = torch.tensor([[4, 0], [4, 4], [1, 0]])
    traced = torch.compile(layout, fullgraph=True, backend="aot_eager")
    for a, b in zip(traced(ids), layout(ids)):
        assert torch.equal(a, b)
    torch._dynamo.reset()


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_moe as tm
from hybridgemm.kernels import triton_moe_pairs as moe_pairs
from hybridgemm.kernels import triton_router as tr
from hybridgemm.kernels.triton_glu import ACTIVATIONS

# each GEMM kernel for bf16 weights (WSCALE 0) and e4m3 ones per channel (1) and per block (2),
# the e4m3 bytes converted by integer ops (WINT) as the GPU runs them
names = ["x_ptr", "w_ptr", "sc_ptr", "out_ptr", "rows_ptr", "expert_ptr", "rw_ptr", "S", "N", "K", "top_k", "ldx",
         "lde", "ldw", "lse", "lsn", "ldo", "n_gate", "num_experts"]
for glu in (True, False):
    for wscale in (0, 1, 2):
        w = "*bf16" if wscale == 0 else "*fp8e4nv"
        types = ["*bf16", w, "*fp32", "*bf16" if glu else "*fp32", "*i32", "*i32", "*bf16" if glu else "*fp32"]
        sig = {**dict(zip(names, types + ["i32"] * 12)),
               **dict.fromkeys(["BM", "BN", "BK", "GLU", "ACT", "PREC", "ROUND_PRODUCT", "WSCALE", "WINT"],
                               "constexpr")}
        for bm in (16, 64):
            consts = {"BM": bm, "BN": 64, "BK": 64, "GLU": glu, "ACT": ACTIVATIONS["silu"], "PREC": "tf32",
                      "ROUND_PRODUCT": not glu, "WSCALE": wscale, "WINT": wscale > 0}
            try:  # the offline-compile API (not the kernel) is what raises these
                src = ASTSource(fn=tm._moe_kernel, signature=sig, constexprs=consts)
                c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
            except (TypeError, KeyError, AttributeError) as e:
                raise SystemExit(f"API: {type(e).__name__}: {e}")
            assert c.asm["cubin"]
pair_kernels = [  # the pair kernels with and without programmatic dependent launch, each weight format; the
    # norm prologue (gate/up) and the residual (down) compiled in the PDL variants
    *((moe_pairs._moe_pair_glu_kernel, ["*bf16", "*bf16" if ws == 0 else "*fp8e4nv", "*fp32", "*i64", "*bf16",
                                        "*bf16"] + ["i32"] * 10 + ["fp32"] * 2,
       {"ACT": ACTIVATIONS["silu"], "PDL": pdl, "WSCALE": ws, "WINT": ws > 0, "NORM": pdl})
      for pdl in (False, True) for ws in (0, 1, 2)),
    *((moe_pairs._moe_pair_down_kernel, ["*bf16", "*bf16" if ws == 0 else "*fp8e4nv", "*fp32", "*i64", "*fp32", "*bf16",
                                         "*bf16"] + ["i32"] * 9,
       {"TOP_K": 6, "KP": 8, "ROUND_PRODUCT": False, "PDL": pdl, "WSCALE": ws, "WINT": ws > 0, "RESIDUAL": pdl})
      for pdl in (False, True) for ws in (0, 1, 2)),
    *((moe_pairs._moe_pair_glu_mma_kernel, ["*bf16", "*bf16" if ws == 0 else "*fp8e4nv", "*fp32", "*i64", "*bf16",
                                            "*bf16"] + ["i32"] * 10 + ["fp32"] * 2,
       {"ACT": ACTIVATIONS["silu"], "PREC": "ieee", "PDL": pdl, "WSCALE": ws, "WINT": ws > 0, "NORM": pdl})
      for pdl in (False, True) for ws in (0, 1, 2)),
    *((moe_pairs._moe_pair_down_mma_kernel, ["*bf16", "*bf16" if ws == 0 else "*fp8e4nv", "*fp32", "*i64", "*fp32",
                                             "*bf16", "*bf16"] + ["i32"] * 9,
       {"TOP_K": 8, "PREC": "ieee", "ROUND_PRODUCT": False, "PDL": pdl, "WSCALE": ws, "WINT": ws > 0,
        "RESIDUAL": pdl})
      for pdl in (False, True) for ws in (0, 1, 2)),
    (tm._moe_count_kernel, ["*i64", "*i32", "i32"], {"EP": 128, "CHUNK": tm.ALIGN_CHUNK}),
    *((tm._moe_sum_slots_kernel, ["*fp32", "*bf16", "*bf16", "i32", "i32"], {"TOP_K": 8, "BH": 1024, "RESIDUAL": r})
      for r in (False, True)),
    (tm._moe_place_kernel, ["*i64", "*i32", "*i32", "*i32"] + ["i32"] * 5,
     {"EP": 128, "CHUNK": tm.ALIGN_CHUNK, "CT": 32, "BT": 64}),
]
# the default tensor-core tiles: 16 W rows on one warp, 128 and 256 deep
pair_kernels += [(fn, types, {**extra, "BN": 16, "BK": bk, "num_warps": 1}) for fn, types, extra in pair_kernels
                 if "PREC" in extra for bk in (128, 256)]
for fn, types, extra in pair_kernels:
    extra = dict(extra)
    warps = extra.pop("num_warps", 4)
    consts = {"BN": 32, "BK": 128, **extra} if "PDL" in extra else extra  # the pair kernels
    sig = {**dict(zip(fn.arg_names, types)), **dict.fromkeys(consts, "constexpr")}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 4})
    assert c.asm["cubin"]
print("compiled")
"""


def test_the_kernels_compile_for_hopper():
    """Both launches, decode and prefill block sizes, bf16 and e4m3 weights, compiled for sm_90
    by Triton's bundled ptxas (no GPU needed; in a process without the interpreter): the program
    the interpreter runs is one the GPU compiler takes."""
    from helpers import compile_offline

    compile_offline(_COMPILE_FOR_HOPPER)


_COMPILE_AS_LAUNCHED = """
import itertools, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_moe_pairs as moe_pairs
from hybridgemm.kernels.triton_glu import ACTIVATIONS

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
if not os.path.exists(cuobjdump):
    raise SystemExit("API: no cuobjdump beside this Triton")


def sass_ops(fn, types, consts, aligned, warps, stages):
    # fn compiled for sm_90 as a launch specialises it (pointers and integers divisible by 16:
    # Qwen3-30B-A3B's K, strides, N), disassembled: its SASS opcodes in order
    sig = {**dict(zip(fn.arg_names, types)), **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ops = re.findall(r"^\\s+/\\*[0-9a-f]+\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z0-9_]+)", sass, re.M)
    assert ops, fn
    return ops


def local_memory(ops):
    return [o for o in ops if o.startswith(("LDL", "STL"))]


types = ["*bf16", "*fp8e4nv", "*fp32", "*i64", "*bf16", "*bf16"] + ["i32"] * 10 + ["fp32"] * 2
aligned = {"x_ptr", "w_ptr", "sc_ptr", "ids_ptr", "out_ptr", "nw_ptr", "N", "K", "ldx", "lde", "ldw", "ldo", "n_gate"}
for bn, bk, warps, stages in ((32, 256, 2, 4), (16, 256, 1, 4)):  # the H200 table's e4m3 gate/up at M = 1 and 2
    consts = {"BN": bn, "BK": bk, "ACT": ACTIVATIONS["silu"], "PREC": "tf32", "PDL": True, "WSCALE": 1, "WINT": True,
              "NORM": False}
    ops = sass_ops(moe_pairs._moe_pair_glu_mma_kernel, types, consts, aligned, warps, stages)
    assert not local_memory(ops), (bn, bk, len(local_memory(ops)))  # nothing spilled
    assert any(o.startswith("LDGSTS") for o in ops), (bn, bk)  # the W tiles stream through the cp.async pipeline
# the CUDA-core down's one- and two-round tiles (autotune_cache/tune_moe.py's pair-major candidates),
# e4m3 and bf16 weights
aligned = {"inter_ptr", "w_ptr", "sc_ptr", "ids_ptr", "rw_ptr", "out_ptr", "res_ptr", "N", "K", "ldi", "lde", "ldw",
           "ldo", "ldr"}
for (bn, bk, warps, stages), w in itertools.product(((4, 512, 8, 1), (2, 1024, 8, 1)), ("*fp8e4nv", "*bf16")):
    types = ["*bf16", w, "*fp32", "*i64", "*fp32", "*bf16", "*bf16"] + ["i32"] * 9
    e4m3 = w == "*fp8e4nv"
    consts = {"TOP_K": 8, "KP": 8, "BN": bn, "BK": bk, "ROUND_PRODUCT": False, "PDL": True, "WSCALE": int(e4m3),
              "WINT": e4m3, "RESIDUAL": True}
    ops = sass_ops(moe_pairs._moe_pair_down_kernel, types, consts, aligned, warps, stages)
    assert not local_memory(ops), (bn, bk, w)
print("compiled")
"""


def test_the_fp8_tensor_core_gate_up_spills_nothing_and_pipelines_its_loads():
    """The e4m3 pair-major gate/up at the configs the H200 table runs for one and two tokens,
    compiled for sm_90 as a launch specialises it (16-divisible pointers, K and strides): no
    local loads or stores in its SASS (nothing spilled) and its weight tiles loaded by
    ``cp.async`` (the pipelined loop). Compiled without those specialisations the same source
    spills (Triton 3.6: 68 local loads at 32 x 256): what the GPU runs is the specialised one.
    The CUDA-core down at the tuner's 4 x 512 and 2 x 1024 tiles (a token's slots in two K
    steps, or one, at Qwen3-30B-A3B's K = 768), e4m3 and bf16 weights, keeps no local memory
    either."""
    from helpers import compile_offline

    compile_offline(_COMPILE_AS_LAUNCHED)


@pytest.mark.parametrize("weights_dtype,rounded", [(torch.float16, True), (torch.float32, False)])
def test_the_routing_product_is_rounded_where_transformers_rounds_it(weights_dtype, rounded):
    """fp16 x: routing weights in fp16 (Qwen-MoE's routers cast them to x's dtype) give each
    pair's weighted row in fp16, as ``proj_out * weights`` does; fp32 weights (Mixtral) keep it
    in fp32."""
    e, i, h, t, k = 4, 32, 48, 9, 2
    w_gu, w_d = _weights(e, i, h, torch.float16)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(8)).half()
    ids, weights = _routing(t, e, k)
    weights = (weights * 0.7).to(weights_dtype)  # values whose products are not all fp16 numbers
    cfg = tm.TritonMoeConfig(16, 32, 32)
    lay = tm.align(ids, e, cfg.block_m)
    out = tm.run_down(cfg, tm.run_gate_up(cfg, x, w_gu, lay, k), w_d, lay, weights)
    representable = torch.equal(out, out.half().float())
    assert representable == rounded


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,e,k,i,h,bn,bk", [
    (1, 8, 2, 48, 40, 32, 32),    # N and K not multiples of the blocks
    (3, 6, 3, 40, 72, 16, 64),    # K shorter than one block; 3 slots padded to 4
    (2, 9, 5, 24, 40, 8, 32),
    (17, 4, 2, 33, 65, 16, 32),
    (2, 10, 8, 40, 72, 2, 1024),  # every slot of a token (8) in one K step (a tile deeper than K)
])
@pytest.mark.parametrize("mma", [False, True], ids=["cuda_cores", "mma"])
def test_the_pair_major_kernels_match_fp64(dtype, tol, t, e, k, i, h, bn, bk, mma):
    w_gu, w_d = _weights(e, i, h, dtype)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, weights = _routing(t, e, k)
    cfg = tm.TritonMoeConfig(1, max(bn, 16) if mma else bn, bk, mma=mma)  # (an MMA's W side is 16 rows or more)
    got = torch.full((t, h), float("nan"), dtype=dtype)
    got.copy_(moe_pairs.run_pairs(cfg, x, w_gu, w_d, ids, weights))
    ref = _reference(x, ids, weights, w_gu, w_d)
    scale = ref.abs().max()
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert (got.double() - ref).abs().max() <= tol * scale, float((got.double() - ref).abs().max() / scale)
    # the grouped kernels give the same result to the pair-major one's rounding
    lay = tm.align(ids, e, 16)
    grouped = tm.run_down(tm.TritonMoeConfig(16, 32, 32), tm.run_gate_up(tm.TritonMoeConfig(16, 32, 32), x, w_gu,
                                                                          lay, k), w_d, lay, weights)
    torch.testing.assert_close(got, grouped.view(t, k, h).sum(1).to(dtype), rtol=tol, atol=tol * float(scale))


def test_moe_takes_the_pair_major_path_for_few_pairs(monkeypatch):
    """Default configs: pair-major for decode-sized routings, grouped above; the two agree."""
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    e, i, h, k = 16, 40, 56, 2
    w_gu, w_d = _weights(e, i, h, torch.float32)
    assert {c.block_m for c in tm.default_configs(8, e)} == {1}  # pairs at most half the experts
    assert len({c.block_m for c in tm.default_configs(9, e)}) == 1 and tm.default_configs(9, e)[0].block_m > 1
    assert tm.default_configs(64, 128)[0].block_m == 1 and tm.default_configs(65, 256)[0].block_m > 1
    assert {c.block_m for c in tm.default_configs(4096, 8)} == {128}
    # pair-major: gate/up on the tensor cores; down on the CUDA cores for one token's pairs, on the
    # tensor cores from two tokens on
    one, two = tm.default_configs(8, 128, top_k=8), tm.default_configs(16, 128, top_k=8)
    assert one[0] == two[0] and one[0].mma and not one[1].mma and two[1].mma
    w_128 = torch.empty(128, 2 * 40, 56)
    for tokens, down_mma in ((1, False), (2, True)):  # what moe() decides passes its top_k on
        assert moe_mod.decision_for(torch.empty(tokens, 56), 8, w_128, "silu").configs[1].mma is down_mma
    assert tm.default_configs(2, 8, top_k=2)[1] == one[1] and tm.default_configs(4, 8, top_k=2)[1] == two[1]
    # per-channel e4m3 experts: the 64 x 128 x 64 tiles past 48 rows an expert; block-scaled ones
    # as bf16 but for the pair-major tiles' depth (at most one 128-column block of scales)
    channel, block = "e4m3_channel", "e4m3_block128"
    assert {c.block_m for c in tm.default_configs(64, 128, channel, top_k=8)} == {1}
    assert tm.default_configs(65, 128, channel) == (tm.TritonMoeConfig(16, 64, 128, 4, 3),) * 2
    for top_k in (1, 8):
        pair = tm.default_configs(8, 128, block, top_k=top_k)
        assert {c.block_m for c in pair} == {1} and all(tm.fp8_fits(c, block) is None for c in pair)
    for pairs, experts in ((16384, 128), (4096, 8), (400, 8)):
        assert tm.default_configs(pairs, experts, channel) == (tm.TritonMoeConfig(64, 128, 64, 4, 4),) * 2
    assert tm.default_configs(16384, 128, block) == tm.default_configs(16384, 128)
    calls = []
    run_pairs = moe_pairs.run_pairs
    monkeypatch.setattr(tm, "run_pairs", lambda *a, **kw: calls.append(1) or run_pairs(*a, **kw))  # what forward calls
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(9))
    ids, weights = _routing(3, e, k)
    pair = moe_mod.moe(x, (ids, weights), w_gu, w_d)
    assert calls == [1]
    grouped = moe_mod.moe(x, (ids, weights), w_gu, w_d, config=tm.TritonMoeConfig(16, 32, 32))
    torch.testing.assert_close(pair, grouped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pair.double(), _reference(x, ids, weights, w_gu, w_d), rtol=1e-4, atol=1e-4)
    assert torch.equal(pair, moe_mod.moe(x, (ids, weights), w_gu, w_d))
    with pytest.raises(ValueError, match="block_m"):
        moe_mod.moe(x, (ids, weights), w_gu, w_d, config=(tm.TritonMoeConfig(1, 32, 32),
                                                          tm.TritonMoeConfig(16, 32, 32)))


@pytest.mark.parametrize("tokens,bm", [(3, 1), (40, 16), (3, 16)],
                         ids=["pair-major-entry", "grouped-entry", "grouped-entry-pair-major-defaults"])
def test_a_table_entry_this_triton_cannot_compile_runs_the_default_configs(tokens, bm, monkeypatch):
    """A table entry whose configs fail to compile here (out of shared memory: a hand-edited
    record, another GPU's table) is dropped for the default configs, with one warning naming
    it and the decision for that shape replaced; with the norm and the residual the result is
    the defaults' bit for bit (a grouped entry whose defaults are pair-major too: the norm in
    the pair-major launch, as the next calls run it). A config passed explicitly that fails
    raises."""
    from triton.runtime.errors import OutOfResources

    e, i, h, k = 16, 32, 48, 2
    w_gu, w_d = _weights(e, i, h, torch.float32)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(3))
    res = torch.randn(tokens, h, generator=torch.Generator().manual_seed(4))
    norm = (torch.rand(h, generator=torch.Generator().manual_seed(5)) + 0.5, 1e-6)
    ids, weights = _routing(tokens, e, k)
    defaults = tm.default_configs(tokens * k, e, "", top_k=k)
    assert defaults[0].block_m == (1 if tokens == 3 else 16)
    bad = (tm.TritonMoeConfig(bm, 64, 1024 if bm == 1 else 512, 4, 8), tm.TritonMoeConfig(bm, 64, 512, 4, 8))
    entry = moe_mod.MoeDecision("triton_moe", bad, f"table entry moe_silu_e16_k2|fp32|none|N=32|K=48|M={tokens} "
                                f"block_m {bm} (a test's)")
    monkeypatch.setattr(moe_mod, "use_kernels", lambda x: True)
    monkeypatch.setattr(moe_mod, "decision_for", lambda *a: entry)
    forgotten = []
    monkeypatch.setattr(moe_mod, "_forget", lambda *a: forgotten.append((a[0] is x, a[1:4], a[4])))
    real, launched = tm.forward, []

    def forward(x, ids, weights, w_gu, w_d, activation, up, down, *rest):
        launched.append((up, down))
        if (up, down) == bad:
            raise OutOfResources(300 * 1024, 227 * 1024, "shared memory")
        return real(x, ids, weights, w_gu, w_d, activation, up, down, *rest)

    monkeypatch.setattr(tm, "forward", forward)
    with pytest.warns(RuntimeWarning, match=r"a test's\) could not be compiled here .*default configs run"):
        got = moe_mod.moe(x, (ids, weights), w_gu, w_d, norm=norm, residual=res)
    want = moe_mod.moe(x, (ids, weights), w_gu, w_d, config=defaults, norm=norm, residual=res)
    assert torch.equal(got, want) and launched == [bad, defaults, defaults]
    (same_x, (top_k, gate_up, activation), instead), = forgotten
    assert same_x and (top_k, activation) == (k, "silu") and gate_up is w_gu and instead.configs == defaults
    with pytest.raises(OutOfResources):
        moe_mod.moe(x, (ids, weights), w_gu, w_d, config=bad)


def test_a_replaced_decision_is_the_one_the_next_call_finds(monkeypatch):
    """``_forget`` keys the replacement as :func:`decision_for` looks it up (device, shape,
    tokens, weight format), so the next call of that shape runs it without asking the table."""
    w_gu, _ = _weights(4, 32, 48, torch.bfloat16)
    x = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.bfloat16, shape=(5, 48))
    instead = moe_mod.MoeDecision("triton_moe", tm.default_configs(10, 4, top_k=2), "the defaults (a test's)")
    monkeypatch.setattr(moe_mod, "_decisions", {})
    monkeypatch.setattr(moe_mod, "_decide", lambda *a: pytest.fail("the table was asked"))
    moe_mod._forget(x, 2, w_gu, "silu", instead)
    assert moe_mod.decision_for(x, 2, w_gu, "silu") is instead
    other = types.SimpleNamespace(**{**vars(x), "shape": (6, 48)})
    with pytest.raises(pytest.fail.Exception, match="the table was asked"):
        moe_mod.decision_for(other, 2, w_gu, "silu")  # another token count: its own decision
