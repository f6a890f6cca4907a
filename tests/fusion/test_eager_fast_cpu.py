"""CPU tests of the eager fast path's bookkeeping (fusion/eager_fast.py): when a call may take a
cached launch, what its key covers, and the cache's bound. The launches themselves need a GPU
(tests/fusion/test_eager_fast_gpu.py)."""

from __future__ import annotations

import torch
from torch import nn

from hybridgemm import AttentionProjection, decide, dispatch, eager_fast


def _operands(dtype=torch.float32):
    x = torch.randn(2, 3, 16, dtype=dtype)
    w = nn.Parameter(torch.randn(24, 16, dtype=dtype))
    b = nn.Parameter(torch.randn(24, dtype=dtype))
    return x, w, b


def test_eligible_only_for_plain_cuda_inference():
    x, w, b = _operands()
    assert not eager_fast.eligible(x, w, b)  # CPU: the general path (PyTorch computes it)
    xc = x.to("meta")
    wc, bc = nn.Parameter(w.detach().to("meta")), nn.Parameter(b.detach().to("meta"))
    assert not eager_fast.eligible(xc, wc, bc)  # not CUDA either
    assert not eager_fast.eligible(x.numpy(), w, b)  # not a tensor at all


def test_eager_training_routing():
    x, w, b = _operands()
    assert eager_fast.eager_training(x, w, b)  # parameters want gradients
    with torch.no_grad():
        assert not eager_fast.eager_training(x, w, b)
    w.requires_grad_(False)
    b.requires_grad_(False)
    assert not eager_fast.eager_training(x, w, b)
    assert eager_fast.eager_training(x.requires_grad_(True), w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not eager_fast.eager_training(x, w, b)  # hybridgemm.linear casts under autocast
    assert not eager_fast.eager_training(x, w.detach().double(), b)  # mixed dtypes: the general path's error


def test_signature_covers_layout_pointers_flags_and_generation():
    x, w, b = _operands()
    key, xp = eager_fast.signature(x, w, b)
    assert xp == x.data_ptr()
    assert eager_fast.signature(x, w, b)[0] == key
    assert eager_fast.signature(x.transpose(0, 1), w, b)[0] != key  # strides
    assert eager_fast.signature(x[:1], w, b)[0] != key  # shape
    assert eager_fast.signature(x, w.detach().clone(), b)[0] != key  # another weight tensor
    assert eager_fast.signature(x, w, None)[0] != key
    assert eager_fast.signature(x.double(), w, b)[0] != key
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not old  # fp32 calls depend on TF32
        assert eager_fast.signature(x, w, b)[0] != key
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    before = dispatch.generation()
    decide.reload_tables()
    assert dispatch.generation() == before + 1
    assert eager_fast.signature(x, w, b)[0] != key  # reloaded tables: every cached launch is stale


def test_launch_cache_is_bounded_oldest_first():
    cache = eager_fast.LaunchCache()
    for i in range(eager_fast.MAX_ENTRIES + 3):
        cache.put(i, i)
    assert len(cache) == eager_fast.MAX_ENTRIES
    assert min(cache) == 3 and max(cache) == eager_fast.MAX_ENTRIES + 2


def test_module_cpu_paths_keep_no_launches():
    mod = AttentionProjection(32, 4, 2, dtype=torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = mod.forward_qkv(x)
        mod.forward_out(q)
    sum(t.sum() for t in mod.forward_qkv(x)).backward()  # training: the one-node Function
    assert not mod._fast_qkv and not mod._fast_out  # nothing to launch on the CPU


def test_module_reads_parametrized_and_replaced_weights():
    """The projections read their submodules' parameters straight from ``_parameters`` (host
    time); a parametrized weight (a property) or a replaced parameter must still be honoured."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    mod = AttentionProjection(32, 4, 2, dtype=torch.float64)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    w0 = mod.qkv_proj.weight.detach().clone()
    parametrize.register_parametrization(mod.qkv_proj, "weight", Double())
    ref = torch.nn.functional.linear(x, 2 * w0, mod.qkv_proj.bias)
    with torch.no_grad():
        got = torch.cat([t.transpose(1, 2).flatten(-2) for t in mod.forward_qkv(x)], -1)
    torch.testing.assert_close(got, ref)
    mod.o_proj.weight = nn.Parameter(torch.randn_like(mod.o_proj.weight))
    attn = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(mod.forward_out(attn), torch.nn.functional.linear(
        attn.transpose(1, 2).flatten(-2), mod.o_proj.weight, mod.o_proj.bias))
