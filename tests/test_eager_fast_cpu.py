"""CPU tests of the eager fast path's bookkeeping (fusion/eager_fast.py): when a call may take a
cached launch, what its key covers, and the cache's bound. The launches themselves need a GPU
(tests/test_eager_fast_gpu.py)."""

from __future__ import annotations

import torch
from torch import nn

from hybridgemm import AttentionProjection, dispatch, eager_fast


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
    dispatch.reload_tables()
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
