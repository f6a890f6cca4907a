"""GPU tests of the raw launches behind the eager fast paths: ``Backend.bind`` (cuBLASLt and
Triton split-K, every reduction mode), the dispatcher's raw launcher, and the attention
projection's cached launches (fusion/eager_fast.py): same bits as the general path, correct
against an fp64 reference, invalidated by table reloads, weight swaps and layout changes,
never taken when autograd wants the graph, and capturable in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from helpers import FLOORS, check_close_to_reference, make_operands, rel_err
from hybridgemm import AttentionProjection, decide, dispatch
from hybridgemm.decide import Choice
from hybridgemm.kernels import triton_splitk
from hybridgemm.kernels.epilogue import Activation

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]
DEV = "cuda"


def _poison_pool() -> None:
    """Fill free caching-allocator blocks with NaN, so memory a kernel forgets to write shows."""
    small = [torch.full((1 << 17,), float("nan"), device=DEV) for _ in range(16)]  # 512 KiB: small pool
    large = torch.full((1 << 24,), float("nan"), device=DEV)  # 64 MiB: large pool
    del small, large


SPLITK = {
    "split1": triton_splitk.TritonSplitKConfig(16, 64, 128, 1, 4, 3, False),
    "split3_fused": triton_splitk.TritonSplitKConfig(16, 64, 64, 3, 4, 3, True),
    "split3_two_launch": triton_splitk.TritonSplitKConfig(16, 64, 64, 3, 4, 3, False),
}


@pytest.mark.parametrize("name", list(SPLITK))
@pytest.mark.parametrize("m,n,k,bias,act", [(1, 200, 328, True, None), (3, 96, 520, False, "relu"),
                                            (17, 130, 264, True, "gelu_tanh")])
def test_splitk_bind_matches_run(name, m, n, k, bias, act):
    cfg = SPLITK[name]
    x, w, b = make_operands(m, n, k, torch.bfloat16, DEV, bias=bias)
    ref_out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    triton_splitk.run(cfg, x, w, b, ref_out, act)
    raw = triton_splitk.bind(cfg, x, w, b, ref_out, act)
    assert raw is not None
    for _ in range(3):  # fresh operands of the same signature, through the raw launch
        x2, w2, b2 = make_operands(m, n, k, torch.bfloat16, DEV, bias=bias)
        out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
        raw(x2.data_ptr(), w2.data_ptr(), 0 if b2 is None else b2.data_ptr(), out.data_ptr())
        again = torch.full_like(out, float("nan"))
        triton_splitk.run(cfg, x2, w2, b2, again, act)
        assert torch.equal(out, again), name
        check_close_to_reference(out, x2, w2, b2, act, f"raw {name} {m}x{n}x{k}")


def test_splitk_bind_before_any_run_is_none():
    cfg = SPLITK["split1"]
    x, w, b = make_operands(5, 72, 136, torch.float16, DEV)
    out = torch.empty(5, 72, device=DEV, dtype=torch.float16)
    assert triton_splitk.bind(cfg, x, w, b, out) is None  # no plan yet: the caller takes the general path


@pytest.mark.nvmath
@pytest.mark.parametrize("m,n,k,bias,act", [(1, 200, 328, True, None), (17, 96, 520, False, "relu"),
                                            (300, 130, 264, True, "gelu_tanh")])
def test_cublaslt_bind_matches_run(m, n, k, bias, act):
    from hybridgemm.kernels import cublaslt

    if not cublaslt.is_available():
        pytest.skip("nvmath-python not installed")
    x, w, b = make_operands(m, n, k, torch.bfloat16, DEV, bias=bias)
    out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    a = Activation.parse(act)
    cublaslt.run(None, x, w, b, out, a)
    raw = cublaslt.bind(None, x, w, b, out, a)
    assert raw is not None
    x2, w2, b2 = make_operands(m, n, k, torch.bfloat16, DEV, bias=bias)
    got = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    raw(x2.data_ptr(), w2.data_ptr(), 0 if b2 is None else b2.data_ptr(), got.data_ptr())
    want = torch.empty_like(got)
    cublaslt.run(None, x2, w2, b2, want, a)
    assert torch.equal(got, want)


# ------------------------------------------------------------------ the attention projection

@pytest.fixture(params=["own", "heuristic", "split1", "split3_fused", "split3_two_launch", "triton_gemm"])
def forced_backend(request, monkeypatch):
    """Make the dispatcher choose a given kernel for every problem ("own": its own choice, which
    for these untuned shapes is F.linear; "heuristic": cuBLASLt's heuristic at the exact M)."""
    decide.reload_tables()
    if request.param != "own":
        real_choose = decide.choose

        def choose(problem, device_index):
            if request.param == "heuristic":
                return Choice("cublaslt", None, "table", "forced", "test")
            if request.param == "triton_gemm":
                from hybridgemm.kernels.backends import get_backend

                cfg = get_backend("triton_gemm").candidates(problem)[0]
                return Choice("triton_gemm", cfg, "table", "forced", "test")
            cfg = SPLITK[request.param]
            ok, _ = cfg.supports(problem)
            return Choice("triton_splitk", cfg, "table", "forced", "test") if ok else real_choose(problem, device_index)

        monkeypatch.setattr(decide, "choose", choose)
    yield request.param
    decide.reload_tables()


def _module(hidden=256, h=8, hkv=2, qkv_bias=True, out_bias=False, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return AttentionProjection(hidden, h, hkv, qkv_bias=qkv_bias, out_bias=out_bias, device=DEV, dtype=dtype)


def _general(mod, x, attn):
    """The same module's answer through the general path (autograd-style routing off)."""
    from hybridgemm.attention import _project

    q, k, v = _project(x, mod.qkv_proj.weight, mod.qkv_proj.bias, mod.num_heads, mod.num_kv_heads, mod.head_dim)
    y = hybridgemm.linear(attn.transpose(-3, -2).flatten(-2), mod.o_proj.weight, mod.o_proj.bias)
    return q, k, v, y


@pytest.mark.parametrize("shape", [(1, 1), (8, 1), (1, 3), (2, 17), (17,), (3, 2, 5)])
def test_attention_fast_path_equals_general_path(forced_backend, shape):
    mod = _module()
    with torch.no_grad():
        for call in range(3):  # call 0 binds, calls 1-2 take the cached launch
            x = torch.randn(*shape, 256, device=DEV, dtype=torch.bfloat16)
            # SDPA's flash output layout: (..., S, H, D) in memory, viewed (..., H, S, D)
            attn = torch.randn(*shape, 8, 32, device=DEV, dtype=torch.bfloat16).transpose(-3, -2)
            _poison_pool()
            q, k, v = mod.forward_qkv(x)
            y = mod.forward_out(attn)
            gq, gk, gv, gy = _general(mod, x, attn)
            for ours, ref in ((q, gq), (k, gk), (v, gv), (y, gy)):
                assert ours.shape == ref.shape and ours.stride() == ref.stride()
                assert torch.equal(ours, ref), f"{forced_backend} {shape} call {call}"
            w = mod.qkv_proj.weight
            ref_qkv = F.linear(x.double(), w.double(), mod.qkv_proj.bias.double())
            got = torch.cat([t.transpose(-3, -2).flatten(-2) for t in (q, k, v)], -1)
            assert rel_err(got, ref_qkv) <= FLOORS[torch.bfloat16]
    cached = len(mod._fast_qkv or {}) + len(mod._fast_out or {})
    # no raw launch: triton_gemm's, and F.linear's (the fallback for a shape no table covers)
    assert cached == (0 if forced_backend in ("triton_gemm", "own") else 2)


def test_attention_fast_path_invalidated(forced_backend):
    mod = _module()
    x = torch.randn(2, 1, 256, device=DEV, dtype=torch.bfloat16)
    attn = torch.randn(2, 1, 8, 32, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    with torch.no_grad():
        mod.forward_qkv(x)
        mod.forward_out(attn)
        # in place: same pointers, new values
        mod.qkv_proj.weight.mul_(-0.5)
        mod.o_proj.weight.add_(1.0)
        for ours, ref in zip((*mod.forward_qkv(x), mod.forward_out(attn)), _general(mod, x, attn)):
            assert torch.equal(ours, ref)
        # swapped for new tensors: new pointers
        mod.qkv_proj.weight = torch.nn.Parameter(torch.randn_like(mod.qkv_proj.weight) / 16)
        mod.qkv_proj.bias = torch.nn.Parameter(torch.randn_like(mod.qkv_proj.bias))
        mod.o_proj.weight = torch.nn.Parameter(torch.randn_like(mod.o_proj.weight) / 16)
        for ours, ref in zip((*mod.forward_qkv(x), mod.forward_out(attn)), _general(mod, x, attn)):
            assert torch.equal(ours, ref)
        before = dispatch.generation()
        decide.reload_tables()
        assert dispatch.generation() != before
        for ours, ref in zip((*mod.forward_qkv(x), mod.forward_out(attn)), _general(mod, x, attn)):
            assert torch.equal(ours, ref)
        # a contiguous (B, H, S, D) attn needs a copy to flatten: correct, never cached
        n_out = len(mod._fast_out or {})
        attn_c = attn.contiguous()
        assert torch.equal(mod.forward_out(attn_c), _general(mod, x, attn_c)[3])
        assert len(mod._fast_out or {}) == n_out


def test_attention_fast_path_not_taken_with_autograd():
    mod = _module()
    x = torch.randn(1, 4, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mod.forward_qkv(x)
    assert q.requires_grad and "QKVProjection" in type(q.grad_fn).__name__  # the autograd Function
    (q.sum() + k.sum() + v.sum()).backward()
    assert x.grad is not None and mod.qkv_proj.weight.grad is not None
    with torch.no_grad():
        q2, _, _ = mod.forward_qkv(x)
    assert not q2.requires_grad and torch.equal(q2, q.detach())


def test_attention_fast_path_bad_input_still_raises():
    mod = _module()
    with torch.no_grad():
        mod.forward_out(torch.randn(1, 1, 8, 32, device=DEV, dtype=torch.bfloat16).transpose(1, 2))
        with pytest.raises(ValueError, match="heads"):
            mod.forward_out(torch.randn(1, 7, 1, 32, device=DEV, dtype=torch.bfloat16))
        mod.forward_qkv(torch.randn(1, 1, 256, device=DEV, dtype=torch.bfloat16))
        with pytest.raises((ValueError, RuntimeError)):
            mod.forward_qkv(torch.randn(1, 1, 200, device=DEV, dtype=torch.bfloat16))
        with pytest.raises(hybridgemm.LinearArgumentError, match="dtype"):  # a RuntimeError, as F.linear's
            mod.forward_qkv(torch.randn(1, 1, 256, device=DEV, dtype=torch.float16))


def test_attention_fast_path_in_cuda_graph(forced_backend):
    mod = _module()
    x = torch.randn(4, 1, 256, device=DEV, dtype=torch.bfloat16)
    attn = torch.randn(4, 1, 8, 32, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    with torch.no_grad():
        for _ in range(2):  # bind, then warm the cached launch
            mod.forward_qkv(x)
            mod.forward_out(attn)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            q, k, v = mod.forward_qkv(x)
            y = mod.forward_out(attn)
        x.copy_(torch.randn_like(x))
        attn.copy_(torch.randn_like(attn))
        g.replay()
        torch.cuda.synchronize()
        for ours, ref in zip((q, k, v, y), _general(mod, x, attn)):
            assert torch.equal(ours, ref)


@pytest.mark.parametrize("forced_backend", ["heuristic"], indirect=True)
def test_module_pickles_without_cached_launches(forced_backend):
    import copy
    import io

    mod = _module()
    with torch.no_grad():
        mod.forward_qkv(torch.randn(1, 1, 256, device=DEV, dtype=torch.bfloat16))
    assert mod._fast_qkv
    buf = io.BytesIO()
    torch.save(mod, buf)
    clone = copy.deepcopy(mod)
    assert not clone._fast_qkv
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(1, 1, 256, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(loaded.forward_qkv(x), mod.forward_qkv(x)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(1, 5), (2, 17), (33,)])
def test_training_functions_match_general_path(forced_backend, shape):
    """The one-node QKV / O Functions (forward through the cached launch) give the same bits
    as the general path (linear + views, split backward), and gradients within the bound of
    an fp64 reference."""
    mod = _module()
    hidden, h, hkv, d = 256, 8, 2, 32
    for step in range(2):  # step 0 binds the launch, step 1 uses it
        x = torch.randn(*shape, hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        attn_bshd = torch.randn(*shape, h, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        outs = (*mod.forward_qkv(x), mod.forward_out(attn_bshd.transpose(-3, -2)))
        assert "QKVProjection" in type(outs[0].grad_fn).__name__
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
        ours = [t.grad.clone() for t in (x, attn_bshd, *mod.parameters())]
        for t in (x, attn_bshd, *mod.parameters()):
            t.grad = None
        w, b, wo = mod.qkv_proj.weight, mod.qkv_proj.bias, mod.o_proj.weight
        ref_outs = (*_project_general(x, w, b, h, hkv, d),
                    hybridgemm.linear(attn_bshd.flatten(-2), wo))  # (..., S, H*D)
        for a, r in zip(outs, ref_outs):
            assert torch.equal(a, r), f"forward {forced_backend} {shape} step {step}"
        torch.autograd.backward(ref_outs, grads)
        general = [t.grad for t in (x, attn_bshd, *mod.parameters())]
        for name, a, r in zip(("dx", "dattn", "dWqkv", "dbqkv", "dWo"), ours, general):
            assert torch.equal(a, r), f"{name} {forced_backend} {shape} step {step}"
        for t in (x, attn_bshd, *mod.parameters()):
            t.grad = None
        # fp64 reference of dW_qkv
        dy = torch.cat([g.transpose(-3, -2) for g in grads[:3]], -2).flatten(-2).double()
        ref_dw = dy.reshape(-1, dy.shape[-1]).T @ x.detach().double().reshape(-1, hidden)
        assert rel_err(ours[2], ref_dw) <= FLOORS[torch.bfloat16]


def _project_general(x, w, b, h, hkv, d):
    """linear + views: the pre-Function route, autograd through split/transpose."""
    from hybridgemm.attention import _heads

    return _heads(hybridgemm.linear(x, w, b), h, hkv, d)
