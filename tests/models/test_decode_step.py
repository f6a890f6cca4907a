"""The fused attention step (fusion/models/decode_step.py, kernels/triton_rope.py): the rotary
embedding and the static KV-cache write in the QKV split-K epilogue, against an fp64
reference (kernel) and against the stock model decoding with its own StaticCache (tiny
random-weight models; kernels under the Triton interpreter, the device check widened to the
CPU). GPU runs: tests/models/test_decode_step_gpu.py."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import shutil
import types
import warnings

import pytest
import torch
from torch import nn

import hybridgemm
from helpers import assert_static_decode_matches, greedy_static_decode
from hybridgemm import dispatch
from hybridgemm.kernels import triton_splitk
from hybridgemm.kernels.triton_rope import RotaryCache
from hybridgemm.models import attention_forms, decode_step, fused_pieces
from hybridgemm.models import decode_checks as checks
from hybridgemm.models import decoder_layer as dl
from hybridgemm.models.patching import ATTENTION_NOT_FUSED
from hybridgemm.perf import e2e_models as hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97
ONE_PASS = triton_splitk.TritonSplitKConfig(16, 16, 32, split_k=1, num_warps=4, num_stages=2)
FUSED_REDUCE = triton_splitk.TritonSplitKConfig(16, 16, 32, split_k=2, num_warps=4, num_stages=2, fused_reduce=True)
TWO_LAUNCH = triton_splitk.TritonSplitKConfig(16, 16, 32, split_k=2, num_warps=4, num_stages=2)
# block_m 2 (FP8 decode's small x tiles): M = 3 and 6 span several row tiles
SMALL_X_FUSED_REDUCE = triton_splitk.TritonSplitKConfig(2, 16, 32, split_k=2, num_warps=1, num_stages=2,
                                                        fused_reduce=True)
# The model tests' configs: tiles one head (32 columns) wide, half the interpreter's programs of
# 16-wide tiles. The kernel tests above run tiles narrower than a head too.
MODEL_ONE_PASS = triton_splitk.TritonSplitKConfig(16, 32, 32, split_k=1, num_warps=4, num_stages=2)
MODEL_FUSED_REDUCE = triton_splitk.TritonSplitKConfig(16, 32, 32, split_k=2, num_warps=4, num_stages=2,
                                                      fused_reduce=True)
MODEL_TWO_LAUNCH = triton_splitk.TritonSplitKConfig(16, 32, 32, split_k=2, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------- the kernel

def _rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def _cos_sin(positions, hd, dtype, batch=1):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = positions.to(torch.float64)[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return cos.expand(batch, *cos.shape[1:]) if batch > 1 and cos.shape[0] == 1 else cos, \
        sin.expand(batch, *sin.shape[1:]) if batch > 1 and sin.shape[0] == 1 else sin


def _rms(t, g, eps):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * g.double()


def _reference(x, w, b, g, eps, cos, sin, heads, kv_heads, hd, batch, seq, qk_norms=None, rotate=True,
               norms_after=False):
    """fp64: rmsnorm(x) @ W.T + b, q/k norms per head (``qk_norms``: (q_norm, k_norm, eps); of the
    rotated heads where ``norms_after``), rotary on q and k (not without ``rotate``), split into heads."""
    xd = x.double()
    if g is not None:
        xd = _rms(xd, g, eps)
    y = xd @ w.double().T + (0 if b is None else b.double())
    y = y.view(batch, seq, -1)
    q, k, v = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k = q.reshape(batch, seq, heads, hd), k.reshape(batch, seq, kv_heads, hd)
    if qk_norms is not None and not norms_after:
        q, k = _rms(q, qk_norms[0], qk_norms[2]), _rms(k, qk_norms[1], qk_norms[2])
    if rotate:
        c, s = cos.double()[:, :, None], sin.double()[:, :, None]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
    if qk_norms is not None and norms_after:
        q, k = _rms(q, qk_norms[0], qk_norms[2]), _rms(k, qk_norms[1], qk_norms[2])
    return q, k, v.reshape(batch, seq, kv_heads, hd)


@pytest.mark.parametrize("config", [ONE_PASS, FUSED_REDUCE, SMALL_X_FUSED_REDUCE],
                         ids=["one-pass", "fused-reduce", "small-x-fused-reduce"])
@pytest.mark.parametrize("batch,seq,heads,kv_heads,hd,k_dim,base,bias,norm", [
    (1, 1, 4, 2, 32, 80, 5, True, True),      # M = 1, K not a multiple of the block
    (3, 1, 2, 1, 16, 64, 0, False, True),     # M = 3, position 0
    (2, 3, 4, 4, 32, 96, 6, True, False),     # M = 6, S = 3: the last position falls past the cache
])
# rotate False: a layer without positional embedding (SmolLM3's NoPE layers), the cache write alone
@pytest.mark.parametrize("rotate", [True, False], ids=["rotary", "no-rotary"])
def test_rope_epilogue_matches_fp64(config, batch, seq, heads, kv_heads, hd, k_dim, base, bias, norm, rotate):
    torch.manual_seed(batch * 7 + seq)
    dt, cache_len = torch.float32, 8
    m, n = batch * seq, (heads + 2 * kv_heads) * hd
    x = torch.randn(m, k_dim, dtype=dt)
    w = torch.randn(n, k_dim, dtype=dt) / k_dim ** 0.5
    b = torch.randn(n, dtype=dt) if bias else None
    g = (torch.rand(k_dim, dtype=dt) + 0.5) if norm else None
    pos = torch.arange(seq) + base
    cos, sin = _cos_sin(pos[None], hd, dt, batch if batch == 3 else 1)  # batch 3: per-sequence rows (stride)
    keys = torch.full((batch, kv_heads, cache_len, hd), 123.0, dtype=dt)
    values = torch.full_like(keys, -321.0)
    out = torch.full((m, n), float("nan"), dtype=dt)
    rc = RotaryCache(cos, sin, heads, kv_heads, hd, keys, values, torch.tensor(base), rotate=rotate)
    triton_splitk.run(config, x, w, b, out, None, norm=None if g is None else (g, 1e-5), rope=rc)
    q, k, v = _reference(x, w, b, g, 1e-5, cos, sin, heads, kv_heads, hd, batch, seq, rotate=rotate)
    ref = torch.cat([q.reshape(m, -1), k.reshape(m, -1), v.reshape(m, -1)], dim=-1)
    outside = (pos >= cache_len).repeat(batch)  # token rows (batch-major) whose position the cache cannot hold
    assert out[outside].isnan().all()  # shown, not silently dropped
    torch.testing.assert_close(out[~outside].double(), ref[~outside], rtol=1e-4, atol=1e-4)
    for cache, new, poison in ((keys, k, 123.0), (values, v, -321.0)):
        for s in range(seq):
            p = base + s
            if p < cache_len:
                torch.testing.assert_close(cache[:, :, p].double(), new[:, s], rtol=1e-4, atol=1e-4)
        untouched = torch.ones(cache_len, dtype=torch.bool)
        untouched[base: base + seq] = False
        assert (cache[:, :, untouched] == poison).all()  # nothing else written (nor past the end)


def _grouped_to_qkv(y, kv_heads, group, hd):
    """Columns ``[q x group | k | v]`` per KV head -> all q, all k, all v."""
    g = y.reshape(y.shape[0], kv_heads, group + 2, hd)
    return torch.cat([g[:, :, :group].reshape(y.shape[0], -1), g[:, :, group].reshape(y.shape[0], -1),
                      g[:, :, group + 1].reshape(y.shape[0], -1)], dim=-1)


def _partially_rotated(t, cos, sin):
    """fp64 rotary of ``t`` [B, S, heads, hd] over the first ``cos.shape[-1]`` columns of each
    head (the rest as they are), cos/sin [B, S, R]."""
    rot = cos.shape[-1]
    c, s = cos.double()[:, :, None], sin.double()[:, :, None]
    r = t[..., :rot]
    return torch.cat((r * c + _rotate_half(r) * s, t[..., rot:]), dim=-1)


def _poisoned_cache(batch, kv_heads, cache_len, hd, dtype):
    keys = torch.full((batch, kv_heads, cache_len, hd), 123.0, dtype=dtype)
    return keys, torch.full_like(keys, -321.0)


def _epilogue_out(block_n, split, x, w, b, rope):
    """x @ w.T + b with ``rope`` in split-K's epilogue, K tiles of 16 (``split`` > 1: the fused
    reduction), into a NaN-poisoned output."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype)
    config = triton_splitk.TritonSplitKConfig(16, block_n, 16, split_k=split, num_warps=4, num_stages=2,
                                              fused_reduce=split > 1)
    triton_splitk.run(config, x, w, b, out, None, rope=rope)
    return out


def _assert_cached(keys, values, k, v, base, rtol=1e-4, atol=1e-4):
    """Tokens s of k and v ([B, S, kv_heads, hd]) at cache positions ``base + s``."""
    for i in range(k.shape[1]):
        torch.testing.assert_close(keys[:, :, base + i].double(), k[:, i], rtol=rtol, atol=atol)
        torch.testing.assert_close(values[:, :, base + i].double(), v[:, i], rtol=rtol, atol=atol)


@pytest.mark.parametrize("block_n,split", [(16, 1), (32, 2)], ids=["16-wide-one-pass", "32-wide-fused-reduce"])
@pytest.mark.parametrize("batch,seq,heads,kv_heads,hd,group,rot,bias", [
    (1, 1, 4, 2, 32, 0, 8, True),     # a partial rotary narrower than a tile (GPT-NeoX's rotary_pct 0.25)
    (2, 1, 4, 2, 32, 0, 16, False),   # rotary as wide as a 16-wide tile, half a 32-wide one
    (3, 1, 2, 2, 32, 1, 8, True),     # GPT-NeoX's rows, [q | k | v] per head
    (2, 1, 6, 2, 32, 3, 32, True),    # Falcon's new architecture, [q x 3 | k | v] per KV head, whole-head rotary
    (1, 1, 4, 1, 32, 0, 32, False),   # Falcon-7B's multi-query rows
    (1, 3, 2, 2, 64, 1, 32, True),    # three tokens; 16-wide tiles: two rotated, two passed per head
])
def test_partial_rotary_and_grouped_rows_in_the_rope_epilogue_match_fp64(block_n, split, batch, seq, heads, kv_heads,
                                                                         hd, group, rot, bias):
    """The rotary over the first ``rot`` columns of each head (the rest passed through), of a
    weight whose rows are grouped per KV head: the output in ``[q | k | v]`` columns, k and v
    in the cache, against fp64; poisoned outputs and cache positions."""
    torch.manual_seed(batch + 3 * group + rot + seq)
    dt, k_dim, base, cache_len = torch.float32, 72, 4, 8
    m, n = batch * seq, (heads + 2 * kv_heads) * hd
    x = torch.randn(m, k_dim, dtype=dt)
    w = torch.randn(n, k_dim, dtype=dt) / k_dim ** 0.5
    b = torch.randn(n, dtype=dt) if bias else None
    cos, sin = _cos_sin((torch.arange(seq) + base)[None], rot, dt, batch)
    keys, values = _poisoned_cache(batch, kv_heads, cache_len, hd, dt)
    out = _epilogue_out(block_n, split, x, w, b,
                        RotaryCache(cos, sin, heads, kv_heads, hd, keys, values, torch.tensor(base), group=group))
    y = x.double() @ w.double().T + (0 if b is None else b.double())
    q, k, v = (_grouped_to_qkv(y, kv_heads, group, hd) if group else y).split(
        [heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = _partially_rotated(q.reshape(batch, seq, heads, hd), cos, sin)
    k = _partially_rotated(k.reshape(batch, seq, kv_heads, hd), cos, sin)
    ref = torch.cat([q.reshape(m, -1), k.reshape(m, -1), v], dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    _assert_cached(keys, values, k, v.reshape(batch, seq, kv_heads, hd), base)
    others = (torch.arange(cache_len) < base) | (torch.arange(cache_len) >= base + seq)
    assert (keys[:, :, others] == 123.0).all() and (values[:, :, others] == -321.0).all()


@pytest.mark.parametrize("block_n,split", [(16, 1), (32, 2)], ids=["16-wide-one-pass", "32-wide-fused-reduce"])
@pytest.mark.parametrize("batch,seq,heads,kv_heads", [(1, 1, 4, 2), (2, 3, 2, 2)])
@pytest.mark.parametrize("rot", [32, 16], ids=["whole-heads", "first-half"])
@pytest.mark.parametrize("dt", [torch.float32, torch.float16], ids=["fp32", "fp16-fp32-cos"])
def test_neighbouring_pairs_in_the_rope_epilogue_match_fp64(block_n, split, batch, seq, heads, kv_heads, rot, dt):
    """Cohere's rotary: column 2i paired with 2i + 1 (``rotate_half`` interleaved), cos/sin
    holding each frequency twice, over all of each head, or over its first half (GLM's, tiles
    within the rotated columns; a 32-wide tile over 16 rotated columns is refused); against
    fp64, k and v in the cache. fp16 x with fp32 cos/sin: Ernie 4.5's (read as fp32)."""
    torch.manual_seed(batch + seq)
    hd, k_dim, base, cache_len = 32, 48, 3, 8
    tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    m, n = batch * seq, (heads + 2 * kv_heads) * hd
    x = torch.randn(m, k_dim, dtype=dt)
    w = torch.randn(n, k_dim, dtype=dt) / k_dim ** 0.5
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = (torch.arange(seq) + base).double()[:, None] * inv
    emb = torch.repeat_interleave(freqs, 2, dim=-1)[None].expand(batch, seq, rot)
    cos, sin = emb.cos().float(), emb.sin().float()
    keys, values = _poisoned_cache(batch, kv_heads, cache_len, hd, dt)
    rc = RotaryCache(cos, sin, heads, kv_heads, hd, keys, values, torch.tensor(base), pairs=True)
    if block_n > rot:
        with pytest.raises(ValueError, match="tiles within the rotated 16"):
            _epilogue_out(block_n, split, x, w, None, rc)
        return
    out = _epilogue_out(block_n, split, x, w, None, rc)
    q, k, v = (x.double() @ w.double().T).split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    c, s = cos.double()[:, :, None], sin.double()[:, :, None]

    def rotated(t, count):
        t = t.reshape(batch, seq, count, hd)
        r = t[..., :rot]
        r = r * c + torch.stack((-r[..., 1::2], r[..., ::2]), dim=-1).flatten(-2) * s
        return torch.cat([r, t[..., rot:]], dim=-1)

    q, k = rotated(q, heads), rotated(k, kv_heads)
    torch.testing.assert_close(out.double(), torch.cat([q.reshape(m, -1), k.reshape(m, -1), v], dim=-1), **tol)
    _assert_cached(keys, values, k, v.reshape(batch, seq, kv_heads, hd), base, **tol)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_grouped_rows_of_an_fp8_weight_take_their_own_scales(granularity):
    """An e4m3 Q/K/V in GPT-NeoX's per-head rows, rotated over a quarter of each head: each
    output column takes the scale of the weight row it reads (per row, or of its 128 x 128
    block), against fp64 over the dequantized weight."""
    from hybridgemm.kernels.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(11)
    heads = kv_heads = 2
    hd, rot, k_dim, base, batch = 64, 16, 256, 2, 2
    n = (heads + 2 * kv_heads) * hd
    x = torch.randn(batch, k_dim, generator=g).half()
    w = torch.randn(n, k_dim, generator=g) / 16
    w[: n // 2] *= 8  # the first KV head's q, k and v rows: 128-row blocks 0 and 2 eight times apart
    q = quantize_fp8(w.half(), granularity)
    b = torch.randn(n, generator=g).half()
    cos, sin = _cos_sin(torch.tensor([[base]]), rot, torch.float16, batch)
    keys = torch.full((batch, kv_heads, 4, hd), 7.0, dtype=torch.float16)
    values = torch.full_like(keys, -7.0)
    out = torch.full((batch, n), float("nan"), dtype=torch.float16)
    config = triton_splitk.TritonSplitKConfig(4, 32, 128, split_k=2, num_warps=4, num_stages=2, fused_reduce=True)
    triton_splitk.run(config, x, q.data, b, out, None, weight_scale=q.scale,
                      rope=RotaryCache(cos, sin, heads, kv_heads, hd, keys, values, torch.tensor(base), group=1))
    y = x.double() @ q.dequantize(torch.float64).T + b.double()
    qh, kh, v = _grouped_to_qkv(y, kv_heads, 1, hd).split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    qh = _partially_rotated(qh.reshape(batch, 1, heads, hd), cos, sin)[:, 0]
    kh = _partially_rotated(kh.reshape(batch, 1, kv_heads, hd), cos, sin)[:, 0]
    ref = torch.cat([qh.reshape(batch, -1), kh.reshape(batch, -1), v], dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-2)
    torch.testing.assert_close(keys[:, :, base].double(), kh, rtol=2e-3, atol=2e-2)
    torch.testing.assert_close(values[:, :, base].double(), v.reshape(batch, kv_heads, hd), rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("config", [MODEL_ONE_PASS, MODEL_FUSED_REDUCE, SMALL_X_FUSED_REDUCE],
                         ids=["one-pass", "fused-reduce", "small-x-fused-reduce"])
@pytest.mark.parametrize("batch,seq,heads,kv_heads,hd,bias,cache,offset,after", [
    (1, 1, 4, 2, 32, False, True, None, False),     # one token, GQA
    (3, 1, 2, 2, 16, True, True, None, False),      # three sequences, a bias before the norms
    (2, 2, 2, 1, 32, False, False, None, False),    # rotary only
    (1, 1, 4, 2, 32, False, True, 1.0, False),      # Gemma 3's: factor 1 + w
    (3, 1, 2, 2, 16, True, True, -0.25, False),     # another offset
    (1, 1, 4, 2, 32, False, True, None, True),      # Hunyuan's: the norms of the rotated heads
    (2, 2, 2, 1, 16, True, True, None, True),       # the same, two tokens of two sequences, a bias
])
def test_qk_norms_in_the_rope_epilogue_match_fp64(config, batch, seq, heads, kv_heads, hd, bias, cache, offset, after):
    """Qwen3's q/k norms: each q and k head RMS-normalised (its own weight) before the rotary,
    in tiles of one whole head (configs of 16- or 32-row tiles run with block_n = head_dim);
    Gemma 3's (``qk_offset``): the factor ``offset + weight``; Hunyuan's (``qk_after_rotary``):
    each rotated head normalised."""
    torch.manual_seed(batch + 10 * hd)
    dt, k_dim, base, cache_len = torch.float32, 72, 2, 8
    m, n = batch * seq, (heads + 2 * kv_heads) * hd
    x = torch.randn(m, k_dim, dtype=dt)
    w = torch.randn(n, k_dim, dtype=dt) / k_dim ** 0.5
    w[: heads * hd] *= 3  # q heads far from unit rms: the norm must matter
    b = torch.randn(n, dtype=dt) if bias else None
    qn, kn = torch.rand(hd, dtype=dt) + 0.5, torch.rand(hd, dtype=dt) + 0.5
    pos = torch.arange(seq) + base
    cos, sin = _cos_sin(pos[None], hd, dt, batch)
    keys = torch.full((batch, kv_heads, cache_len, hd), 123.0, dtype=dt) if cache else None
    values = torch.full_like(keys, -321.0) if cache else None
    out = torch.full((m, n), float("nan"), dtype=dt)
    rc = RotaryCache(cos, sin, heads, kv_heads, hd, keys, values, torch.tensor(base) if cache else None,
                     q_norm=qn, k_norm=kn, qk_eps=1e-6, qk_offset=offset, qk_after_rotary=after)
    triton_splitk.run(config, x, w, b, out, None, rope=rc)
    factors = (qn, kn) if offset is None else (qn + offset, kn + offset)
    q, k, v = _reference(x, w, b, None, 0.0, cos, sin, heads, kv_heads, hd, batch, seq, (*factors, 1e-6),
                         norms_after=after)
    ref = torch.cat([q.reshape(m, -1), k.reshape(m, -1), v.reshape(m, -1)], dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    if cache:
        for s in range(seq):
            torch.testing.assert_close(keys[:, :, base + s].double(), k[:, s], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(values[:, :, base + s].double(), v[:, s], rtol=1e-4, atol=1e-4)


def test_whole_head_tiles_split_k_and_match_fp64():
    """A tuned config of 16-row tiles over heads of 32: the q/k norms' whole-head tiles halve
    the tiles, so K is split twice as often, reduced in the same launch (``rope_config``); the
    result as fp64's, the cache written."""
    torch.manual_seed(5)
    dt, k_dim, heads, kv_heads, hd, base = torch.float32, 160, 4, 2, 32, 3
    n = (heads + 2 * kv_heads) * hd
    x = torch.randn(2, k_dim, dtype=dt)
    w = torch.randn(n, k_dim, dtype=dt) / k_dim ** 0.5
    qn, kn = torch.rand(hd, dtype=dt) + 0.5, torch.rand(hd, dtype=dt) + 0.5
    cos, sin = _cos_sin(torch.tensor([[base]]), hd, dt, 2)
    keys = torch.full((2, kv_heads, 8, hd), 123.0, dtype=dt)
    values = torch.full_like(keys, -321.0)
    rc = RotaryCache(cos, sin, heads, kv_heads, hd, keys, values, torch.tensor(base), q_norm=qn, k_norm=kn,
                     qk_eps=1e-6)
    launched = triton_splitk.rope_config(ONE_PASS, rc, x, w)
    assert (launched.block_n, launched.split_k, launched.fused_reduce) == (32, 2, True)
    short = triton_splitk.rope_config(ONE_PASS, rc, x[:, :64], w[:, :64])  # K of two tiles: no split
    assert (short.block_n, short.split_k, short.fused_reduce) == (32, 1, False)
    out = torch.full((2, n), float("nan"), dtype=dt)
    triton_splitk.run(ONE_PASS, x, w, None, out, None, rope=rc)
    q, k, v = _reference(x, w, None, None, 0.0, cos, sin, heads, kv_heads, hd, 2, 1, (qn, kn, 1e-6))
    ref = torch.cat([q.reshape(2, -1), k.reshape(2, -1), v.reshape(2, -1)], dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(keys[:, :, base].double(), k[:, 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values[:, :, base].double(), v[:, 0], rtol=1e-4, atol=1e-4)


def test_rope_without_a_cache_only_rotates():
    torch.manual_seed(1)
    heads, kv_heads, hd, k_dim = 2, 1, 16, 32
    x = torch.randn(2, k_dim)
    w = torch.randn((heads + 2 * kv_heads) * hd, k_dim)
    cos, sin = _cos_sin(torch.tensor([[4]]), hd, torch.float32, 2)
    out = torch.empty(2, w.shape[0])
    triton_splitk.run(ONE_PASS, x, w, None, out, rope=RotaryCache(cos, sin, heads, kv_heads, hd))
    q, k, v = _reference(x, w, None, None, 0.0, cos, sin, heads, kv_heads, hd, 2, 1)
    torch.testing.assert_close(out.double(), torch.cat([q.reshape(2, -1), k.reshape(2, -1), v.reshape(2, -1)], -1),
                               rtol=1e-4, atol=1e-4)


def _args(**over):
    heads, kv_heads, hd, k_dim, batch = 2, 1, 16, 32, 2
    cos, sin = _cos_sin(torch.tensor([[3]]), hd, torch.float32, batch)
    keys = torch.zeros(batch, kv_heads, 8, hd)
    a = dict(config=ONE_PASS, x=torch.randn(batch, k_dim), w=torch.randn((heads + 2 * kv_heads) * hd, k_dim),
             rc=RotaryCache(cos, sin, heads, kv_heads, hd, keys, keys.clone(), torch.tensor(3)), residual=None,
             activation=None)
    a.update(over)
    return a


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(config=TWO_LAUNCH), "fused reduction"),
    (lambda a: dict(config=triton_splitk.TritonSplitKConfig(16, 32, 32, 1, 4, 2)), "does not divide head_dim"),
    (lambda a: dict(w=a["w"][:-16]), "columns are not"),
    (lambda a: dict(activation="relu"), "no residual and no activation"),
    (lambda a: dict(rc=RotaryCache(a["rc"].cos[:, :, :7], a["rc"].sin[:, :, :7], 2, 1, 16)), "cos must be"),
    (lambda a: dict(rc=RotaryCache(a["rc"].cos[:, :, :6], a["rc"].sin[:, :, :6], 2, 1, 16)), "divides it or"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], group=1)), "group must be 0 or heads / kv_heads = 2"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], group=-2)), "group must be"),
    (lambda a: dict(rc=RotaryCache(a["rc"].cos[:, :, :8], a["rc"].sin[:, :, :8], 2, 1, 16, pairs=True)),
     "True only for cos/sin over all 16"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], pairs=1)), "pairs .neighbouring columns. must be a bool"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], rotate=0)), "rotate must be a bool"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], rotate=False, q_norm=torch.ones(16), k_norm=torch.ones(16))),
     "False only without q/k norms"),
    (lambda a: dict(rc=RotaryCache(a["rc"].cos.double(), a["rc"].sin.double(), 2, 1, 16)), "x's dtype"),
    (lambda a: dict(rc=RotaryCache(a["rc"].cos, a["rc"].sin, 2, 1, 16, a["rc"].keys, a["rc"].values,
                                   torch.tensor(3, dtype=torch.int32))), "base must be one int64"),
    (lambda a: dict(rc=RotaryCache(a["rc"].cos, a["rc"].sin, 2, 1, 16, a["rc"].keys[:1], a["rc"].values[:1],
                                   a["rc"].base)), "keys must be"),
    (lambda a: dict(rc=RotaryCache(a["rc"].cos, a["rc"].sin, 2, 1, 15)), "even head_dim"),
    (lambda a: dict(rc="cos"), "must be a RotaryCache"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], q_norm=torch.ones(16))), "q_norm and k_norm go together"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], q_norm=torch.ones(16), k_norm=torch.ones(8))), "k_norm must be"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], q_norm=torch.ones(16), k_norm=torch.ones(16).double())),
     "x's dtype"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], q_norm=torch.ones(16), k_norm=torch.ones(16), qk_eps=-1.0)),
     "qk_eps must be"),
    (lambda a: dict(rc=dataclasses.replace(a["rc"], qk_after_rotary=True)), "True only with q/k norms"),
])
def test_bad_rope_arguments_are_clear_errors(change, match):
    a = _args()
    a.update(change(a))
    out = torch.empty(a["x"].shape[0], a["w"].shape[0])
    with pytest.raises((ValueError, TypeError), match=match):
        triton_splitk.run(a["config"], a["x"], a["w"], None, out, a["activation"], rope=a["rc"])


# ----------------------------------------------------------------------------- the model

def _tiny(kind: str, layers: int = 2, attention: str = "sdpa", **extra):
    kw = dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=64, **extra)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
              "granite": transformers.GraniteConfig, "gemma": transformers.GemmaConfig,
              "phi3": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
              "gemma3": transformers.Gemma3TextConfig, "olmo2": transformers.Olmo2Config,
              "stablelm": transformers.StableLmConfig, "cohere": transformers.CohereConfig,
              "olmo3": transformers.Olmo3Config, "ministral": transformers.MinistralConfig,
              "cwm": transformers.CwmConfig, "smollm3": transformers.SmolLM3Config,
              "ministral3": transformers.Ministral3Config, "glm": transformers.GlmConfig,
              "helium": transformers.HeliumConfig, "glm4": transformers.Glm4Config,
              "ernie4_5": transformers.Ernie4_5Config, "ernie4_5_moe": transformers.Ernie4_5_MoeConfig,
              "hunyuan": transformers.HunYuanDenseV1Config, "hunyuan_moe": transformers.HunYuanMoEV1Config,
              "exaone4": transformers.Exaone4Config, "seed_oss": transformers.SeedOssConfig,
              "cohere2": transformers.Cohere2Config}[kind](**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    # norms start as the identity: others, so that they show (weights U(0.5, 1.5); biases and Gemma's w U(-0.5, 0.5))
    drawn = ("olmo2", "olmo3", "stablelm", "cohere", "glm4", "hunyuan", "hunyuan_moe", "exaone4", "cohere2")
    if kind in ("gemma", "gemma2", "gemma3", *drawn):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    olmo_or_layernorm = kind in drawn
                    p.uniform_(*((0.5, 1.5) if olmo_or_layernorm and name.endswith("weight") else (-0.5, 0.5)))
    return model


def _patched(stock):
    """A patched copy of ``stock`` whose every layer is fused and takes the static-cache step:
    a transformers release (CI runs the oldest and newest supported, scripts/ci-stacks.sh) whose
    layer, attention or StaticCache is no longer a form the step computes fails here, with
    the report's reason, rather than passing on the module's own forward."""
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    layers = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    assert report.fused_layers == layers and report.fused_attention == layers, \
        f"transformers {transformers.__version__}: {report.skipped}"
    return model


def _decode(model, steps: int, batch: int = 2, prompt: int = 3, tokens=None):
    """Greedy decode over a StaticCache: (logits per step, tokens fed, cache)."""
    return greedy_static_decode(model, steps, VOCAB, tokens, batch, prompt)


def _compare(model, stock, steps=3, batch=2):
    assert_static_decode_matches(model, stock, VOCAB, steps, batch)


# Every model kind once, and each config: the config only changes the kernel, which
# test_rope_epilogue_matches_fp64 runs with both configs on every bias and norm case.
@pytest.mark.parametrize("kind,extra,config", [
    ("llama", {}, MODEL_FUSED_REDUCE), ("qwen2", {}, MODEL_ONE_PASS),
    ("mistral", {"sliding_window": None}, MODEL_FUSED_REDUCE),
    # q/k norms in the rotary epilogue; head_dim 64: the 32-row tiles run one head wide
    ("qwen3", {"head_dim": 64}, MODEL_FUSED_REDUCE),
    # residual_multiplier in the O and down epilogues (the other multipliers are outside the layers)
    ("granite", {"residual_multiplier": 0.22, "attention_multiplier": 0.05, "embedding_multiplier": 12.0,
                 "logits_scaling": 8.0}, MODEL_ONE_PASS),
    # Gemma: (1 + w) RMSNorms (an fp32 factor in the QKV and gate/up prologues), GeGLU, the
    # embedding scaled outside the layers
    ("gemma", {"head_dim": 32}, MODEL_FUSED_REDUCE),
    # Phi-3: its checkpoint's qkv_proj and gate_up_proj run as they are, residual dropouts (p > 0:
    # the identity in eval), the rotary's partial form spanning the whole head
    ("phi3", {"resid_pdrop": 0.1, "pad_token_id": 0}, MODEL_ONE_PASS),
    # a partial rotary (Phi-4-mini's form): the first half of each head rotated (16 of 32 columns)
    ("phi3", {"pad_token_id": 0, "partial_rotary_factor": 0.5}, MODEL_FUSED_REDUCE),
    # Seed-OSS: Llama's layer, q/k/v biases, its attention's and MLP's outputs through dropouts
    # (p > 0: the identity in eval)
    ("seed_oss", {"residual_dropout": 0.1, "attention_bias": True, "head_dim": 32}, MODEL_ONE_PASS),
], ids=["llama-fused-reduce", "qwen2-one-pass", "mistral-fused-reduce", "qwen3-fused-reduce", "granite-one-pass",
        "gemma-fused-reduce", "phi3-one-pass", "phi3-partial-rotary-fused-reduce", "seed-oss-one-pass"])
def test_static_cache_decode_matches_the_stock_model(kind, extra, config, kernels_on_cpu):
    kernels_on_cpu["config"] = config
    stock = _tiny(kind, **extra)
    model = _patched(stock)
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    _compare(model, stock, steps=2)  # the second step reads the cache entries the first one wrote
    assert kernels_on_cpu["rope"] == 2 * 2  # every decode step of both layers (the prefill initialises the cache)
    # QKV, O and down of every fused call (the prefill's too) used the layer's own arrival
    # counters, and left them zero
    assert kernels_on_cpu["counters"] == (2 + 1) * 2 * 3
    for layer in model.model.layers:
        counters = layer._buffers[dl.COUNTERS]
        assert counters.dtype == torch.int32 and not counters.any()
    assert not any(dl.COUNTERS in k for k in model.state_dict())


def test_a_partial_rotary_no_tile_fits_runs_its_rotary_after_the_gemm(kernels_on_cpu):
    """Phi-3 with the rotary over 24 of 32 columns: no power-of-two tile of 16 or more holds whole
    groups of them, so the Q/K/V GEMM runs without the rotary epilogue and the rotary and cache
    write follow it; the step still matches stock."""
    stock = _tiny("phi3", pad_token_id=0, partial_rotary_factor=0.75)
    model = _patched(stock)
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    _compare(model, stock, steps=2)
    assert kernels_on_cpu["rope"] == 0 and kernels_on_cpu["counters"] > 0


_WINDOWS = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("qwen3", {"head_dim": 64}), ("gemma", {"head_dim": 32})],
                         ids=["llama", "qwen3", "gemma"])
def test_a_config_the_prologue_does_not_fit_normalises_x_in_a_launch_of_its_own(kind, extra, kernels_on_cpu,
                                                                               monkeypatch):
    """Where ``triton_splitk.prologue_fits`` refuses the config (on the H200 every shape but one,
    scripts/qkv_fusion_probe.py), the custom ops (what torch.compile runs) take the norm apart:
    the Q/K/V and O/down pieces still run split-K with their rotary/cache and residual
    epilogues, the norm before them on its own (Llama's formula, which Gemma's (1 + w) is in
    fp32; Qwen3's q/k norms still in the epilogue); the decode equals stock's and no split-K
    launch carries a norm. Eager decode keeps the norm in the prologue whatever the config (it
    is host-bound: a launch apart costs more there). The gated kernel keeps its own prologue."""
    kernels_on_cpu["prologue"] = False
    stock = _tiny(kind, **extra)
    model = _patched(stock)
    _compare(model, stock, steps=2)  # eager
    assert kernels_on_cpu["norm"] == (2 + 1) * 2 and kernels_on_cpu["rope"] == 2 * 2  # Q/K/V of every call
    # the custom ops called as they are: the bodies that run under torch.compile
    monkeypatch.setattr(fused_pieces, "_compiled", lambda op, eager, *args: op(*args))
    kernels_on_cpu.update(norm=0, rope=0)
    _compare(model, stock, steps=2)
    assert kernels_on_cpu["norm"] == 0 and kernels_on_cpu["rope"] == 2 * 2
    kernels_on_cpu.update(prologue=True, rope=0)
    _compare(model, stock, steps=2)
    assert kernels_on_cpu["norm"] == (2 + 1) * 2 and kernels_on_cpu["rope"] == 2 * 2


@pytest.mark.parametrize("factor", [torch.float16, torch.float32], ids=["llama-formula", "fp32-factor"])
def test_either_norm_formula_is_taken_out_of_the_prologue(factor, kernels_on_cpu):
    """fp16 x under a config the prologue does not fit: a norm weight of x's dtype (Llama's
    formula) and an fp32 factor (Gemma's (1 + w) over half-precision x) are both computed before
    the GEMM (each one launch on CUDA: norm.prologue_norm), none in the prologue; with
    ``keep_prologue`` (eager decode) in the prologue. All as close to the fp32 computation as the
    unfused piece's rounding allows."""
    from hybridgemm.norm import prologue_norm

    kernels_on_cpu.update(prologue=False, config=triton_splitk.TritonSplitKConfig(16, 32, 64, split_k=1, num_warps=4,
                                                                                    num_stages=2))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 96, generator=g).half()
    w = (torch.randn(80, 96, generator=g) / 10).half()
    nw = (torch.rand(96, generator=g) + 0.5).to(factor)
    got = dispatch.fused_splitk(x, w, None, norm=(nw, 1e-6))
    assert kernels_on_cpu["norm"] == 0
    kept = dispatch.fused_splitk(x, w, None, keep_prologue=True, norm=(nw, 1e-6))  # eager's choice
    assert kernels_on_cpu["norm"] == 1
    ref = prologue_norm(x.float(), nw.float(), 1e-6) @ w.float().T
    unfused = prologue_norm(x, nw, 1e-6).float() @ w.float().T
    base = (unfused - ref).abs().max()
    for y in (got, kept):
        err = (y.float() - ref).abs().max()
        assert err <= 2 * base + 2e-3, (err, base)


@pytest.mark.parametrize("apart", [False, True], ids=["prologue", "apart"])
def test_an_fp8_weight_takes_the_norm_apart_only_where_asked(apart, kernels_on_cpu, monkeypatch):
    """An e4m3 Q/K/V or gate/up keeps the norm in split-K's prologue whatever the config (the
    prologue rule is for bf16 weights); with HYBRIDGEMM_FP8_NORM_APART the norm runs in a launch
    of its own first, never with ``keep_prologue`` (eager decode). Both as close to the GEMM of
    the dequantized weight over the normalised x as the piece's rounding allows."""
    from hybridgemm.kernels.fp8 import quantize_fp8
    from hybridgemm.norm import prologue_norm

    monkeypatch.setattr(dispatch, "FP8_NORM_APART", apart)
    kernels_on_cpu.update(prologue=False, config=triton_splitk.TritonSplitKConfig(4, 32, 128, split_k=1,
                                                                                    num_warps=4, num_stages=2))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 256, generator=g).half()
    q = quantize_fp8((torch.randn(80, 256, generator=g) / 12).half(), "channel")
    nw = (torch.rand(256, generator=g) + 0.5).half()
    got = dispatch.fused_splitk(x, q.data, None, weight_scale=q.scale, norm=(nw, 1e-6))
    assert kernels_on_cpu["norm"] == (0 if apart else 1)
    kept = dispatch.fused_splitk(x, q.data, None, weight_scale=q.scale, keep_prologue=True, norm=(nw, 1e-6))
    assert kernels_on_cpu["norm"] == (1 if apart else 2)
    w = q.dequantize(torch.float32)
    ref = prologue_norm(x.float(), nw.float(), 1e-6) @ w.T
    base = (prologue_norm(x, nw, 1e-6).float() @ w.T - ref).abs().max()
    for y in (got, kept):
        assert (y.float() - ref).abs().max() <= 2 * base + 2e-3


@pytest.mark.parametrize("prologue", [False, True], ids=["apart", "prologue"])
def test_a_traced_fp32_factor_operand_computes_what_the_kept_factor_does(prologue, kernels_on_cpu):
    """Under torch.compile a Gemma norm's operand is its weight and offset 1 (norm.norm_operand),
    so that the graph forms no factor: the Q/K/V piece and the gate/up piece give the same bits
    as with the eager operand (the kept fp32 factor, offset 0), with the norm apart or in the
    prologue."""
    kernels_on_cpu.update(prologue=prologue, config=triton_splitk.TritonSplitKConfig(16, 32, 64, split_k=1,
                                                                                       num_warps=4, num_stages=2))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 96, generator=g).half()
    w = (torch.randn(80, 96, generator=g) / 10).half()
    raw = (torch.rand(96, generator=g) - 0.5).half()  # a Gemma weight: the factor is 1 + w
    kept = 1.0 + raw.float()
    traced = fused_pieces._norm_linear(x, raw, 1e-6, 1.0, w, None)
    eager = fused_pieces._norm_linear(x, kept, 1e-6, 0.0, w, None)
    assert torch.equal(traced, eager) and kernels_on_cpu["norm"] == (2 if prologue else 0)
    gate_up = (torch.randn(64, 96, generator=g) / 10).half()
    assert torch.equal(fused_pieces._gated_norm(x, raw, 1e-6, 1.0, gate_up, None, "gelu_tanh"),
                       fused_pieces._gated_norm(x, kept, 1e-6, 0.0, gate_up, None, "gelu_tanh"))


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("config", [MODEL_ONE_PASS, MODEL_TWO_LAUNCH], ids=["one-pass", "two-launch-entry"])
def test_fp8_gate_up_runs_the_glu_product_in_split_k_epilogue(granularity, config, kernels_on_cpu, monkeypatch):
    """An e4m3 gate/up: one split-K launch with the norm in its prologue and the GLU product in
    its epilogue (a table entry with the two-launch reduction runs its single-pass form, the
    same sums); the same values as the GEMM then transformers' product, and where the table
    runs another backend, that composition."""
    from hybridgemm.kernels.fp8 import quantize_fp8
    from hybridgemm.mlp import GLU_FUNCTIONS

    kernels_on_cpu.update(config=config)
    launched = []
    real_run = triton_splitk.run
    monkeypatch.setattr(triton_splitk, "run", lambda cfg, *a, **kw: launched.append((cfg, kw.get("glu")))
                        or real_run(cfg, *a, **kw))
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 256, generator=g).half()
    q = quantize_fp8((torch.randn(2 * 72, 256, generator=g) / 12).half(), granularity)
    nw = (torch.rand(256, generator=g) + 0.5).half()
    got = fused_pieces._gated_norm(x, nw, 1e-6, None, q.data, None, "silu", q.scale)
    assert [(c.split_k, c.fused_reduce or c.split_k == 1, act) for c, act in launched] == \
        [(config.split_k, True, "silu")]
    assert got.shape == (3, 72)
    y = fused_pieces._norm_linear(x, nw, 1e-6, None, q.data, None, None, q.scale)  # the GEMM alone
    composed = GLU_FUNCTIONS["silu"](y[:, :72]) * y[:, 72:]
    torch.testing.assert_close(got, composed, rtol=1e-3, atol=1e-3)  # one fp16 rounding apart at most
    monkeypatch.setattr(dispatch, "splitk_config", lambda *a, **kw: None)  # the table runs another backend
    launched.clear()
    apart = fused_pieces._gated_norm(x, nw, 1e-6, None, q.data, None, "silu", q.scale)
    assert launched == [] and apart.shape == (3, 72)
    torch.testing.assert_close(apart.float(), composed.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("offset", [None, 1.0], ids=["llama-formula", "gemma-weight"])
def test_eager_gate_up_keeps_the_norm_in_its_prologue_where_the_table_takes_it_apart(offset, kernels_on_cpu,
                                                                                   monkeypatch):
    """A gated entry of ``torch`` for a prologue (the norm apart, then gate/up): the compiled op
    follows it (no norm in the gated launch); eager decode, host-bound, runs the gated kernel
    with the norm in its prologue and the rule's config instead (one launch). Both as close to
    the fp32 computation as the unfused piece."""
    from hybridgemm import decide
    from hybridgemm.kernels import triton_glu
    from hybridgemm.norm import prologue_norm

    real_choice, real_glu, launched = decide.choose_gated, triton_glu.glu, []

    def table_says_apart(x, w, b, norm_weight=None, tuned=True, **kw):
        if tuned and norm_weight is not None:
            return decide.Choice("torch", None, "table", "glu_rms|test", "the norm apart")
        return real_choice(x, w, b, norm_weight, tuned, **kw)

    monkeypatch.setattr(decide, "choose_gated", table_says_apart)
    monkeypatch.setattr(triton_glu, "glu", lambda *a, norm=None, **kw: launched.append(norm is not None)
                        or real_glu(*a, norm=norm, **kw))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 96, generator=g).half()
    w = (torch.randn(64, 96, generator=g) / 10).half()
    nw = (torch.rand(96, generator=g) - 0.5).half() if offset else (torch.rand(96, generator=g) + 0.5).half()
    eager = fused_pieces._gated_norm_eager(x, nw, 1e-6, offset, w, None, "silu")
    assert launched == [True]
    compiled_op = fused_pieces._gated_norm(x, nw, 1e-6, offset, w, None, "silu")
    assert launched == [True]  # the op: the norm apart, then gate/up as decided without it (on the CPU: torch)
    xn = prologue_norm(x.float(), nw.float() + (offset or 0.0), 1e-6)
    ref = torch.nn.functional.silu(xn @ w[:32].float().T) * (xn @ w[32:].float().T)
    base = (compiled_op.float() - ref).abs().max()
    assert (eager.float() - ref).abs().max() <= 2 * base + 2e-3


def test_the_norm_prologue_fits_one_config_shape():
    """``prologue_fits``: 64 W rows, 512 bytes of K per row per stage, 4 warps, 4 stages."""
    cfg = triton_splitk.TritonSplitKConfig(16, 64, 256, split_k=1, num_warps=4, num_stages=4)
    assert triton_splitk.prologue_fits(cfg, 2) and not triton_splitk.prologue_fits(cfg, 4)
    assert triton_splitk.prologue_fits(dataclasses.replace(cfg, block_k=128), 4)
    assert triton_splitk.prologue_fits(dataclasses.replace(cfg, split_k=2, fused_reduce=True), 2)
    for change in (dict(block_n=32), dict(block_k=128), dict(num_warps=2), dict(num_stages=3)):
        assert not triton_splitk.prologue_fits(dataclasses.replace(cfg, **change), 2)


@pytest.mark.parametrize("kind,attention,extra", [
    ("gemma2", "eager", {"attn_logit_softcapping": None, **_WINDOWS}),
    # a cap of 0.002 bends the tiny model's logits (small weights: Gemma 2's 50 would leave them as they are)
    ("gemma2", "eager", {"attn_logit_softcapping": 0.002, **_WINDOWS}), ("gemma3", "sdpa", _WINDOWS),
    ("olmo2", "sdpa", {})], ids=["gemma2", "gemma2-softcap", "gemma3", "olmo2"])
def test_post_norm_layers_decode_as_stock_does(kind, attention, extra, kernels_on_cpu):
    """Gemma 2 (eager attention: transformers runs it no other way), Gemma 3 (its (1 + w) q/k
    norms on the head views) and OLMo 2 (no input norms; q/k norms over all heads, weight in
    fp32): each sublayer's output normalised before its residual add, the MLP's input by
    pre_feedforward_layernorm (OLMo 2: the residual stream itself), sliding-window layers beside
    full ones, Gemma 2's attention softcap or none. Sliding-window layers whose window the cache
    fills (4 of 16 positions) call the module's attention function over the fused QKV, with its
    window and softcap. Gemma 2's full layer takes the static-cache step with its eager
    function's softcap and additive mask in the decode attention kernel, Gemma 3's with its
    (1 + w) q/k norms in the rotary epilogue; OLMo 2's layers take it with their norms, the
    rotary and the cache write after the GEMM."""
    from hybridgemm.kernels import triton_decode_attention as tda
    from hybridgemm.kernels import triton_qk_rope as tqr

    stock = _tiny(kind, layers=2, attention=attention, head_dim=32, **extra)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    assert report.fused_layers == ["model.layers.0", "model.layers.1"]
    assert all(layer.__dict__.get(checks.POST_NORMS) for layer in model.model.layers)
    if kind == "olmo2":
        assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    steps, launches, qk_rows = [], [], []
    real, real_attention, real_qk = decode_step._post_norm_step, tda.decode_attention, tqr.qk_norm_rope_store
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_step, "_post_norm_step", lambda *a: steps.append(1) or real(*a))
        mp.setattr(tqr, "qk_norm_rope_store", lambda y, *a: qk_rows.append(tuple(y.shape[:2])) or real_qk(y, *a))
        mp.setattr(tda, "decode_attention", lambda q, *a, **kw: launches.append(
            (tuple(q.shape), kw["softcap"], kw["step"])) or real_attention(q, *a, **kw))
        _compare(model, stock, steps=3, batch=2)  # past the window of 4 positions: the sliding layer's mask
    assert len(steps) == 2 * (1 + 3)  # both layers: the 3-token prompt (6 rows), then each step
    # the step's layers, each new token (4 heads of 32; the prompt fills the cache through the module)
    stepped = {"gemma2": 1, "gemma3": 1, "olmo2": 2}[kind]
    assert kernels_on_cpu["rope"] == (3 * stepped if kind != "olmo2" else 0)  # OLMo 2: its rotary after its norms
    # per layer and new token: the kernel adds the step to a layer's length but to the first
    # full-attention layer's, which the model reads for the mask (Gemma 2/3's layer 1, OLMo 2's layer
    # 0); the layers on the module's path (sliding windows) run it over the keys and values their
    # cache layer returns, adding nothing
    steps_added = {"gemma2": [0, 0], "gemma3": [0, 0], "olmo2": [0, 1]}[kind]
    assert launches == [((2, 4 * 32), extra.get("attn_logit_softcapping") or 0.0, n) for n in steps_added] * 3
    # OLMo 2: its q/k norms, rotary and cache write in one launch per layer and new token
    assert qk_rows == ([(2, 1)] * 6 if kind == "olmo2" else [])


@pytest.mark.parametrize("kind,layer_types", [
    ("olmo3", ["sliding_attention", "full_attention"]), ("ministral", ["sliding_attention", "full_attention"]),
    ("cwm", ["full_attention", "sliding_attention"])])
def test_sliding_window_families_decode_as_stock_does(kind, layer_types, kernels_on_cpu):
    """OLMo 3 (OLMo 2's layer: post-norms, q/k norms over all heads), Ministral and CWM (Llama's
    layer): a sliding-window layer beside a full one, the window of 4 filled by the decode. Both
    layers fused; the full layer takes the static-cache step (Ministral's and CWM's with the rotary
    in the Q/K/V epilogue), the sliding one, whose window the cache fills, runs the module's
    attention over the fused Q/K/V."""
    stock = _tiny(kind, head_dim=32, sliding_window=4, layer_types=layer_types)
    model = _patched(stock)
    _compare(model, stock, steps=3)
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    assert all(bool(layer.__dict__.get(checks.POST_NORMS)) is (kind == "olmo3") for layer in model.model.layers)
    # Q/K/V, O and down of both layers, the prompt's call and each step's, in fused split-K
    assert kernels_on_cpu["counters"] == (1 + 3) * 2 * 3
    # the full layer's rotary in its Q/K/V epilogue at each step (OLMo 3: after its q/k norms, apart)
    assert kernels_on_cpu["rope"] == (0 if kind == "olmo3" else 3)


@pytest.mark.parametrize("training", ["model", "attention", "mlp"])
@pytest.mark.parametrize("tokens", [1, 20], ids=["decode-rows", "prefill-rows"])
def test_seed_oss_dropouts_that_drop_keep_the_layers_own_forward(tokens, training, kernels_on_cpu, monkeypatch):
    """Seed-OSS with its residual_dropout 0.5 in training mode (the whole model, or only each
    layer's attention or MLP: that module's output dropped), no gradient: each layer runs its own
    forward, its patched MLP applying the dropout as the stock one does, so the same seed drops the
    same elements as stock's; in eval the same model takes the fused decode (1 token) or prefill
    (20) step."""
    stock = _tiny("seed_oss", head_dim=32, residual_dropout=0.5, attention_bias=True)
    model = _patched(stock)
    train = {"model": lambda m: m.train(), "attention": lambda m: [layer.self_attn.train() for layer in m.model.layers],
             "mlp": lambda m: [layer.mlp.train() for layer in m.model.layers]}[training]
    steps = []
    for name in ("takes_fused_path", "takes_prefill_step"):
        real = getattr(checks, name)
        monkeypatch.setattr(checks, name,
                            lambda *a, real=real, name=name: steps.append((name, real(*a))) or steps[-1][1])
    ids = torch.randint(0, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(4))
    outs = []
    with torch.no_grad():
        for m in (model, stock):
            train(m)
            torch.manual_seed(7)
            outs.append(m(ids).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert steps and not any(took for _, took in steps)  # each layer's own forward
    steps.clear()
    with torch.no_grad():
        got, want = model.eval()(ids).logits, stock.eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs[1], want, atol=1e-3)  # (the dropouts dropped: training's logits differ)
    step = "takes_fused_path" if tokens == 1 else "takes_prefill_step"
    assert [s for s in steps if s[1]] == [(step, True)] * 2  # eval: both layers on the fused step


@pytest.mark.parametrize("window,layer_types,ropes", [
    # the window never filled (3 + 3 of 64 positions): both layers on the static-cache step
    (64, ["sliding_attention", "full_attention", "sliding_attention"], 3 * 3),
    # a window of 4 the decode fills: the sliding layers run the module's attention over the fused Q/K/V
    (4, ["sliding_attention", "full_attention", "sliding_attention"], 3),
    # no window: every layer full, every layer rotated
    (None, ["full_attention"] * 3, 3 * 3)], ids=["window-64", "window-4", "no-window"])
def test_exaone4_rotates_only_its_sliding_layers_as_stock_does(window, layer_types, ropes, kernels_on_cpu):
    """EXAONE 4: OLMo 2's post-norm layer, q/k norms on the head views (Qwen3's), and a rotary only
    where the layer slides or the model has no window (its global layers none: their q/k norms in
    the Q/K/V epilogue with a rotation by cos 1, sin 0), each sliding layer's window passed where
    it slides. Every layer fused and on the static-cache step where its cache allows; logits and
    caches as stock's."""
    stock = _tiny("exaone4", layers=3, head_dim=32, sliding_window=window, layer_types=layer_types)
    model = _patched(stock)
    assert all(checks.post_norms(layer) for layer in model.model.layers)
    _compare(model, stock, steps=3)
    assert kernels_on_cpu["rope"] == ropes  # the Q/K/V epilogues of the static-cache step, each new token
    assert kernels_on_cpu["counters"] == (1 + 3) * 3 * 3  # Q/K/V, O and down of each layer, each call


@pytest.mark.parametrize("batch", [1, 2])
def test_glm4_norms_around_each_sublayer_decode_as_stock_does(batch, kernels_on_cpu):
    """GLM-4 (0414): each sublayer's output normalised before its residual add
    (post_self_attn_layernorm, post_mlp_layernorm), the MLP's input by post_attention_layernorm:
    Gemma 2's post-norm form under other names (each norm's weight drawn apart, so that a norm
    put in another's place shows); Phi-3's one gate/up linear, q/k/v biases, GLM's rotary of
    neighbouring pairs over the first half of each head. Both layers on the static-cache step
    (the rotary in the Q/K/V epilogue), each output norm with its add; logits and caches as
    stock's."""
    stock = _tiny("glm4", head_dim=32, pad_token_id=0, attention_bias=True)
    model = _patched(stock)
    assert all(checks.post_norms(layer) == ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                                            "post_mlp_layernorm") for layer in model.model.layers)
    steps, real = [], decode_step._post_norm_step
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_step, "_post_norm_step", lambda *a: steps.append(1) or real(*a))
        _compare(model, stock, steps=3, batch=batch)
    assert len(steps) == 2 * (1 + 3)  # both layers: the prompt, then each step
    assert kernels_on_cpu["rope"] == 2 * 3


def _compare_recording_ropes(model, stock, fused: bool, what, batch: int = 2) -> list:
    """:func:`_compare` over 3 steps, returning ``what(config, rope)`` of each split-K launch that
    carried a rotary; with ``fused`` False no split-K call takes a fusion (the GEMM, then the rest)."""
    ropes, real = [], triton_splitk.run
    with pytest.MonkeyPatch.context() as mp:
        if not fused:
            mp.setattr(dispatch, "fused_splitk", lambda *a, **kw: None)
        mp.setattr(triton_splitk, "run", lambda cfg, *a, rope=None, **kw: (
            rope is not None and ropes.append(what(cfg, rope))) or real(cfg, *a, rope=rope, **kw))
        _compare(model, stock, steps=3, batch=batch)
    return ropes


@pytest.mark.parametrize("kind,fused", [("glm", True), ("helium", True), ("ernie4_5", True), ("glm", False),
                                        ("glm-quarter", False), ("ernie4_5", False)],
                         ids=["glm", "helium", "ernie4_5", "glm-after-the-gemm", "glm-quarter-rotary-after-the-gemm",
                              "ernie4_5-after-the-gemm"])
def test_rotaries_of_neighbouring_pairs_from_halved_cos_decode_as_stock_does(kind, fused, kernels_on_cpu):
    """GLM (its rotary over the first half of each head, or a quarter), Helium and Ernie 4.5 (over
    whole heads; Ernie's in fp32 from fp32 cos/sin) pair neighbouring columns, each pair's frequency
    from the first half of cos/sin in the standard layout. Both layers take the static-cache step:
    the step interleaves cos/sin, the
    Q/K/V epilogue rotates neighbouring pairs (tiles within the rotated columns) and writes the
    cache; where the split-K epilogue does not run (``fused`` False), the GEMM, then the rotary of
    the rotated columns and the cache write as torch ops. Logits and caches as stock's."""
    kind, _, quarter = kind.partition("-")
    extra = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}} \
        if quarter else {}
    stock = _tiny(kind, head_dim=32, pad_token_id=0, **extra)
    model = _patched(stock)
    ropes = _compare_recording_ropes(model, stock, fused, lambda cfg, rope: (rope.pairs, rope.cos.shape[-1],
                                                                            cfg.block_n))
    rot = {"glm": 16, "helium": 32, "ernie4_5": 32}[kind]
    assert ropes == ([(True, rot, min(rot, kernels_on_cpu["config"].block_n))] * 2 * 3 if fused else [])


@pytest.mark.parametrize("kind", ["ernie4_5_moe", "hunyuan_moe"])
def test_moe_layers_with_shared_experts_and_routers_of_their_own_decode_as_stock_does(kind, kernels_on_cpu):
    """Ernie 4.5 MoE (a dense first layer, then a sparse block of 4 experts, 2 per token, its router
    in fp32 with a selection bias) and Hunyuan MoE (every layer sparse, its router a linear, the q/k
    norms of the rotated heads), both with a shared expert: the step calls the block after the
    post-attention norm with the patched experts inside, their routers as they are. Both layers on
    the static-cache step (the rotary in the Q/K/V epilogue); logits and caches as stock's."""
    from hybridgemm.experts import HybridExperts

    sizes = dict(moe_intermediate_size=32, num_experts_per_tok=2, moe_num_shared_experts=1, moe_layer_start_index=1) \
        if kind == "ernie4_5_moe" else dict(moe_topk=2)
    stock = _tiny(kind, head_dim=32, num_experts=4, tie_word_embeddings=False, **sizes)
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)  # (large enough to show in the logits)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.3)  # (it starts at zero: values that change choices)
    model = _patched(stock)
    assert isinstance(model.model.layers[1].mlp.experts, HybridExperts)
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    blocks, real = [], type(model.model.layers[1].mlp).forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(model.model.layers[1].mlp), "forward", lambda self, h: blocks.append(h.shape) or real(self, h))
        _compare(model, stock, steps=3)
    assert kernels_on_cpu["rope"] == 2 * 3
    # the sparse layers' blocks, stock's and the patched model's calls: the prompt, then each step
    assert len(blocks) == (1 if kind == "ernie4_5_moe" else 2) * 2 * (1 + 3)


def test_a_half_precision_ernie_takes_the_step_with_its_fp32_cos(kernels_on_cpu, monkeypatch):
    """Ernie 4.5 in 16 bits (fp16 here: the interpreter's bf16 products are wrong; the step's own
    dtypes widened to it): its rotary embedding's fp32 cos/sin pass the call's checks and reach the
    Q/K/V epilogue as fp32 (interleaved), every step of both layers; the logits as stock fp16's to
    its rounding."""
    monkeypatch.setattr(checks, "_LAYER_DTYPES", (torch.bfloat16, torch.float16, torch.float32))
    stock = _tiny("ernie4_5", head_dim=32).half()
    model = _patched(stock)
    ropes, real = [], triton_splitk.run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_splitk, "run", lambda cfg, *a, rope=None, **kw: (rope is not None and ropes.append(
            (rope.cos.dtype, rope.pairs))) or real(cfg, *a, rope=rope, **kw))
        with torch.no_grad():
            ref, fed, _ = greedy_static_decode(stock, 3, VOCAB)
            out, _, _ = greedy_static_decode(model, 3, VOCAB, fed)
    assert ropes == [(torch.float32, True)] * 2 * 3
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("kind,fp32_rotation", [("ernie4_5", True), ("glm", False), ("helium", False)])
def test_the_module_path_rotates_halved_pairs_as_each_function_rounds(kind, fp32_rotation, kernels_on_cpu):
    """On a dynamic cache each layer call rotates q and k in one launch with its function's
    rounding: Ernie 4.5's in fp32 from its fp32 cos/sin (``fp32_pairs``), GLM's and Helium's each
    product in the dtype (bit for bit each function in 16-bit dtypes:
    tests/kernels/test_triton_qk_rope.py); Ernie's cos/sin reach the launch in fp32, as its rotary
    embedding gives them; the logits as stock's."""
    from transformers import DynamicCache

    from hybridgemm.kernels import triton_qk_rope as tqr

    stock = _tiny(kind, head_dim=32, pad_token_id=0)
    model = _patched(stock)
    rotated, real_rope = [], tqr.rope_qk
    ids = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(5))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tqr, "rope_qk", lambda y, cos, sin, heads, kv_heads, pairs=False, fp32_pairs=True: rotated.append(
            (cos.dtype, pairs, fp32_pairs)) or real_rope(y, cos, sin, heads, kv_heads, pairs, fp32_pairs))
        with torch.no_grad():
            got, want = (m(ids, past_key_values=DynamicCache(config=m.config), use_cache=True).logits
                         for m in (model, stock))
    assert rotated == [(torch.float32, True, fp32_rotation)] * 2  # the prompt, both layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [True, False], ids=["epilogue", "after-the-gemm"])
@pytest.mark.parametrize("batch", [1, 2])
def test_hunyuan_normalises_its_rotated_heads_as_stock_does(fused, batch, kernels_on_cpu):
    """Hunyuan (dense): its q/k norms (query_layernorm, key_layernorm: Llama's formula over each
    head, weights drawn apart) normalise the rotated heads. Both layers take the static-cache
    step: the Q/K/V epilogue rotates each whole-head tile, then normalises it (``qk_after_rotary``);
    where the split-K epilogue does not run (``fused`` False), the GEMM, then the rotary and the
    norms as torch ops in that order. Logits and caches as stock's; a dynamic cache's calls (the
    one-launch rotary, then the norm modules) too."""
    from transformers import DynamicCache

    stock = _tiny("hunyuan", head_dim=32, pad_token_id=0)
    model = _patched(stock)
    ropes = _compare_recording_ropes(model, stock, fused, lambda cfg, rope: (rope.q_norm is not None,
                                                                            rope.qk_after_rotary, cfg.block_n), batch)
    assert ropes == ([(True, True, 32)] * 2 * 3 if fused else [])
    ids = torch.randint(0, VOCAB, (batch, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = (m(ids, past_key_values=DynamicCache(config=m.config), use_cache=True).logits
                     for m in (model, stock))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_hook_on_a_rotated_head_norm_runs_the_layers_own_forward(kernels_on_cpu):
    """A forward hook on Hunyuan's key_layernorm (a module the static-cache step computes in the
    Q/K/V epilogue, not calls): that layer runs its own forward, so the hook sees every call and
    changes what it returns (here, doubles it); the other layer keeps the step. Decode as the hooked
    stock model's."""
    stock = _tiny("hunyuan", head_dim=32, pad_token_id=0)
    model = _patched(stock)
    seen = []
    for m in (stock, model):
        m.model.layers[1].self_attn.key_layernorm.register_forward_hook(
            lambda mod, args, out: seen.append(out.shape) or out * 2)
    _compare(model, stock, steps=3)
    assert len(seen) == 2 * (1 + 3)  # stock's and the patched model's: the prompt, then each step
    assert kernels_on_cpu["rope"] == 3  # the first layer's steps only


@pytest.mark.parametrize("change", ["trains", "bf16"])
@pytest.mark.parametrize("kind,norm", [("qwen3", "k_norm"), ("hunyuan", "key_layernorm")])
def test_a_trainable_or_other_dtype_qk_norm_keeps_its_layers_own_forward(kind, norm, change, kernels_on_cpu):
    """Every weight frozen but the second layer's k norm (the step reads its weight in the Q/K/V
    epilogue), gradients enabled; or that norm's weight in bf16 in the fp32 model: the first layer
    takes the step, the second runs its own forward, so the logits are stock's and keep their graph
    back to a trainable norm, whose gradient is stock's."""
    stock = _tiny(kind, head_dim=32, pad_token_id=0)
    model = _patched(stock)
    for m in (stock, model):
        for p in m.parameters():
            p.requires_grad_(False)
        k_norm = getattr(m.model.layers[1].self_attn, norm)
        if change == "trains":
            k_norm.weight.requires_grad_(True)
        else:
            k_norm.to(torch.bfloat16)
    with torch.set_grad_enabled(change == "trains"):
        got, fed, _ = greedy_static_decode(model, 2, VOCAB, None, 1)
        want, _, _ = greedy_static_decode(stock, 2, VOCAB, fed, 1)
    assert kernels_on_cpu["rope"] == 2  # the first layer's steps only
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if change != "trains":
        return
    grads = []
    for m, logits in ((model, got), (stock, want)):
        logits[-1].sum().backward()
        grads.append(getattr(m.model.layers[1].self_attn, norm).weight.grad)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4)


def test_a_layer_whose_attention_is_wrapped_runs_its_own_forward_in_training_mode(kernels_on_cpu):
    """A patched Llama whose first layer's attention a wrapper module replaced (a checkpointing
    wrapper, say), in training mode without gradients: that layer runs its own forward (no error
    from the checks reading the attention's form), the other keeps the step; logits as stock's
    (Llama has no dropout that drops)."""

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    stock = _tiny("llama")
    model = _patched(stock)
    for m in (stock, model):
        m.model.layers[0].self_attn = Wrapped(m.model.layers[0].self_attn)
        m.train()
    ids = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)
    assert kernels_on_cpu["counters"] == 3  # the second layer's Q/K/V, O and down


# Ministral 3's query scale per position, 1 + beta * log(1 + floor(position / original)): with an
# original length of 2 every position from 2 on gets a factor above 1 (its release: 16384)
_LLAMA4_SCALED_ROPE = {"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1,
                       "original_max_position_embeddings": 2}


@pytest.mark.parametrize("batch", [1, 2])
def test_ministral3_scales_its_rotated_queries_per_position(batch, kernels_on_cpu):
    """Ministral 3: after the rotary its queries are multiplied by a factor of each token's
    position (its module's get_llama_4_attn_scale over the call's position_ids), here above 1 from
    position 2 on. Both layers take the static-cache step, the rotary in the Q/K/V epilogue and
    the factor on the rotated queries; logits and caches as stock's."""
    stock = _tiny("ministral3", head_dim=32, rope_parameters=_LLAMA4_SCALED_ROPE, pad_token_id=0)
    model = _patched(stock)
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    _compare(model, stock, steps=3, batch=batch)
    assert kernels_on_cpu["rope"] == 2 * 3  # both layers, each new token


def test_a_changed_query_scale_function_is_not_fused(monkeypatch):
    """A get_llama_4_attn_scale of any other statements leaves the attention to the module, with the reason."""
    from transformers.models.ministral3 import modeling_ministral3 as m3

    def other_scale(positions_ids, beta, max_position_embeddings):
        scaling = 1 + beta * torch.log1p(torch.floor(positions_ids / max_position_embeddings))
        return scaling[:, None, :, None]

    monkeypatch.setattr(m3, "get_llama_4_attn_scale", other_scale)
    monkeypatch.setattr(attention_forms, "_FORMS", {})
    assert "get_llama_4_attn_scale of another form" in attention_forms.why_not_attention_form(m3.Ministral3Attention)


@pytest.mark.parametrize("no_rope_layers", [[1, 0], [0, 1]], ids=["second-nope", "first-nope"])
@pytest.mark.parametrize("fused", [True, False], ids=["epilogue", "after-the-gemm"])
def test_a_layer_without_positional_embedding_writes_its_cache_unrotated(no_rope_layers, fused, kernels_on_cpu):
    """SmolLM3: a layer whose ``use_rope`` is off (its NoPE layers, every fourth in the release)
    beside one that rotates; both fused, both on the static-cache step. The NoPE layer's Q/K/V
    epilogue writes the cache without rotating (``RotaryCache.rotate`` False), the other's rotates;
    where the split-K epilogue does not run (``fused`` False) the GEMM, then the stock ops without
    the rotary. Logits and caches as stock's."""
    stock = _tiny("smollm3", head_dim=32, no_rope_layers=no_rope_layers, pad_token_id=0)
    model = _patched(stock)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == no_rope_layers
    rotates, real = [], triton_splitk.run
    with pytest.MonkeyPatch.context() as mp:
        if not fused:
            mp.setattr(dispatch, "fused_splitk", lambda *a, **kw: None)
        mp.setattr(triton_splitk, "run", lambda cfg, *a, rope=None, **kw: (
            rope is not None and rotates.append(rope.rotate)) or real(cfg, *a, rope=rope, **kw))
        _compare(model, stock, steps=3)
    assert rotates == ([bool(r) for r in no_rope_layers] * 3 if fused else [])


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("rotary,bias", [(0.25, True), (1.0, False)], ids=["quarter-rotary-qkv-bias", "whole-rotary"])
def test_stablelm_layers_decode_as_stock_does(parallel, rotary, bias, kernels_on_cpu):
    """StableLM: its LayerNorms (weight and bias) called as modules, the residual parallel (the
    attention and the MLP of one normalised input) or sequential, the rotary over the first
    quarter of each head's columns (the rest passed) or all of them, Q/K/V with or without a
    bias. Each layer takes the static-cache step: the Q/K/V GEMM without a prologue, the rotary
    and the cache write in its epilogue, the attention kernel, O and down with their residuals
    in the epilogue."""
    from hybridgemm.kernels import triton_qk_rope as tqr

    stock = _tiny("stablelm", head_dim=32, partial_rotary_factor=rotary, use_qkv_bias=bias,
                  use_parallel_residual=parallel)
    model = _patched(stock)
    assert all(layer.__dict__.get(checks.NORMS_AS_MODULES) == "chosen" for layer in model.model.layers)
    assert (model.model.layers[0].post_attention_layernorm is None) == parallel
    stores, real = [], tqr.qk_norm_rope_store
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tqr, "qk_norm_rope_store", lambda y, qn, kn, cos, *a, **kw: stores.append(
            (tuple(y.shape), qn, cos.shape[-1])) or real(y, qn, kn, cos, *a, **kw))
        _compare(model, stock, steps=3, batch=2)
    assert kernels_on_cpu["rope"] == 2 * 3 and kernels_on_cpu["norm"] == 0  # each layer, each new token
    assert stores == []  # (the norms ran as modules; no rotary launch of its own)


def test_a_rotary_no_tile_fits_runs_after_the_gemm_without_a_warning(kernels_on_cpu):
    """StableLM rotating 12 of each head's 32 columns: no power-of-two tile of 16 or more holds
    whole pairs of them (``dispatch._tiles_within_heads``), so the Q/K/V GEMM runs without the
    epilogue and the rotary and cache write follow in one launch, silently; logits and caches as
    the unpatched model's."""
    from hybridgemm.kernels import triton_qk_rope as tqr

    stock = _tiny("stablelm", partial_rotary_factor=0.375)
    model = _patched(stock)
    stores, real = [], tqr.qk_norm_rope_store
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.filterwarnings("error", message="hybridgemm")
        mp.setattr(tqr, "qk_norm_rope_store", lambda y, qn, kn, cos, *a, **kw: stores.append(
            (tuple(y.shape), cos.shape[-1])) or real(y, qn, kn, cos, *a, **kw))
        _compare(model, stock, steps=2, batch=2)
    assert kernels_on_cpu["rope"] == 0
    assert stores == [((2, 1, (4 + 2 * 2) * 32), 12)] * 2 * 2  # each layer, each new token


@pytest.mark.parametrize("block_n,head_dim,rotated,launched", [
    (64, 128, 32, 64),    # Pythia's: a 64-wide tile holds two groups of 32, the first rotated
    (64, 96, 96, 32),     # Phi-3's heads of 96: tiles of 32
    (64, 64, 16, 64),     # StableLM-2's quarter rotary of heads of 64
    (32, 128, 64, 32),
    (64, 80, 20, None),   # StableLM-3B's heads of 80 rotated over 20: no tile fits
    (64, 32, 12, None),
])
def test_rotary_tiles_fit_the_heads_and_the_rotated_columns(block_n, head_dim, rotated, launched):
    config = triton_splitk.TritonSplitKConfig(16, block_n, 128, split_k=2, num_warps=4, num_stages=3,
                                              fused_reduce=True)
    got = dispatch._tiles_within_heads(config, head_dim, rotated)
    assert (got if got is None else got.block_n) == launched
    if got is not None:
        assert dataclasses.replace(got, block_n=block_n) == config  # the other fields as tuned


@pytest.mark.parametrize("batch", [1, 2])
def test_cohere_layers_decode_as_stock_does(batch, kernels_on_cpu):
    """Cohere (Aya 23, Command R): its mean-centred LayerNorm (weight only, fp32) called as a
    module, the attention and the MLP of one normalised input added in parallel, its rotary of
    neighbouring columns in fp32 with the cache write in the Q/K/V GEMM's epilogue (or, where the
    table's GEMM is not split-K, in one launch after it); the logit scale outside the layers.
    Static cache, then generate's dynamic one."""
    from hybridgemm.kernels import triton_qk_rope as tqr

    stock = _tiny("cohere", logit_scale=0.25)
    model = _patched(stock)
    assert all(layer.__dict__.get(checks.NORMS_AS_MODULES) == "parallel" for layer in model.model.layers)
    stores, real = [], tqr.qk_norm_rope_store
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tqr, "qk_norm_rope_store", lambda y, qn, kn, cos, *a, pairs=False, **kw: stores.append(
            (tuple(y.shape), qn, pairs)) or real(y, qn, kn, cos, *a, pairs=pairs, **kw))
        _compare(model, stock, steps=3, batch=batch)
        assert kernels_on_cpu["rope"] == 2 * 3 and kernels_on_cpu["norm"] == 0 and stores == []
        tuned, kernels_on_cpu["config"] = kernels_on_cpu["config"], None  # no split-K decision: the separate launch
        _compare(model, stock, steps=2, batch=batch)
        kernels_on_cpu["config"] = tuned
    assert kernels_on_cpu["rope"] == 2 * 3
    assert stores == [((batch, 1, (4 + 2 * 2) * 32), None, True)] * 2 * 2
    ids = torch.randint(3, VOCAB, (2, 4))
    rotated, real_rope = [], tqr.rope_qk
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(tqr, "rope_qk", lambda y, cos, sin, heads, kv_heads, pairs=False, fp32_pairs=True: rotated.append(
            pairs and fp32_pairs) or real_rope(y, cos, sin, heads, kv_heads, pairs, fp32_pairs))
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref = stock.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref)
    assert rotated and all(rotated)  # each fused layer call on the dynamic cache: Cohere's pairs in one launch


@pytest.mark.parametrize("window,ropes", [(64, 4 * 3), (4, 3)], ids=["window-64", "window-4"])
def test_cohere2_rotates_only_its_sliding_layers_as_stock_does(window, ropes, kernels_on_cpu):
    """Cohere 2 (Command R7B): Cohere's parallel layer and LayerNorm, its rotary of neighbouring
    columns only on its sliding layers (its global one none: that layer's Q/K/V epilogue rotates
    by cos 1, sin 0), the window passed where the layer has one. Three sliding layers beside one
    global; every layer fused and on the static-cache step where its cache allows (a window of 64
    the decode never fills; of 4, filled: the sliding layers run the module's attention over the
    fused Q/K/V). Logits and caches as stock's."""
    stock = _tiny("cohere2", layers=4, head_dim=32, sliding_window=window, logit_scale=0.25, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    model = _patched(stock)
    assert all(layer.__dict__.get(checks.NORMS_AS_MODULES) == "parallel" for layer in model.model.layers)
    _compare(model, stock, steps=3)
    assert kernels_on_cpu["rope"] == ropes  # the static-cache steps' Q/K/V epilogues, each new token
    ids = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():  # (a dynamic cache: the module path's rotary, skipped on the global layer)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0),
                           stock.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("module,cls,why", [
    ("llama", "LlamaAttention", None),
    ("qwen3", "Qwen3Attention", "q/k norms with Cohere's rotary of neighbouring pairs are not a form")])
def test_an_attention_of_cohere_pairs_is_read_as_such_and_with_qk_norms_refused(module, cls, why):
    """Llama's and Qwen3's attention forwards, each with Cohere's rotary function in its module's
    place: Llama's is read as a rotary of neighbouring pairs (the pair epilogue's form); Qwen3's,
    whose per-head q/k norms the pair epilogue would not apply, is refused with its reason."""
    import inspect

    from transformers.models.cohere import modeling_cohere

    base = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    stock = inspect.unwrap(base.forward)
    names = {**stock.__globals__, "apply_rotary_pos_emb": modeling_cohere.apply_rotary_pos_emb}
    forward = types.FunctionType(stock.__code__, names, stock.__name__, stock.__defaults__, stock.__closure__)
    variant = type(f"Paired{cls}", (base,), {"forward": forward})
    got = attention_forms.why_not_attention_form(variant)
    if why is None:
        assert got is None and attention_forms.attention_form(variant).pair_rotary
    else:
        assert why in got


@pytest.mark.parametrize("kind,extra", [("cohere", {}), ("stablelm", {"head_dim": 32, "use_parallel_residual": True}),
                                         ("stablelm", {"head_dim": 32, "use_parallel_residual": False})],
                         ids=["cohere", "stablelm-parallel", "stablelm-sequential"])
def test_parallel_norm_module_layers_compiled_take_o_and_down_in_one_launch(kind, extra, kernels_on_cpu, monkeypatch):
    """Cohere's and a parallel StableLM's layers as torch.compile calls the pieces (each custom
    op, no Dynamo): O and down in one split-K launch with the attention's output as its second
    product, logits and caches as the unpatched model's; eager calls (the pieces' bodies) and a
    sequential StableLM take none."""
    stock = _tiny(kind, **extra)
    model = _patched(stock)
    _compare(model, stock, steps=2, batch=2)
    assert kernels_on_cpu["second"] == 0
    monkeypatch.setattr(fused_pieces, "_compiled", lambda op, eager, *args: op(*args))
    _compare(model, stock, steps=2, batch=2)
    # each layer: the prompt (the fused layer over the module's attention) and each new token
    assert kernels_on_cpu["second"] == (2 * 3 if extra.get("use_parallel_residual", True) else 0)


@pytest.mark.parametrize("kind,flag,norms,extra", [
    ("cohere", "use_qk_norm", ("q_norm", "k_norm"), {}),
    ("stablelm", "qk_layernorm", ("layernorm.norms",), {"head_dim": 32, "use_parallel_residual": True})])
def test_per_head_qk_norms_keep_the_fused_layer_on_the_modules_attention(kind, flag, norms, extra, kernels_on_cpu):
    """Command R+'s use_qk_norm, StableLM 2 12B's qk_layernorm (per-head LayerNorms over q and k):
    the layer is fused, its attention runs the module's computation over the fused Q/K/V (the
    norms as modules on the head views, before the rotary), with a static cache and with
    generate's dynamic one, and the report says why the attention step is not taken."""
    stock = _tiny(kind, **{flag: True, **extra})
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if any(n in name for n in norms):
                p.uniform_(0.5, 1.5)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    assert report.fused_layers == ["model.layers.0", "model.layers.1"] and report.fused_attention == []
    attention = {n: why for n, why in report.skipped if why.startswith(ATTENTION_NOT_FUSED)}
    assert list(attention) == report.fused_layers and all(flag in why for why in attention.values())
    _compare(model, stock, steps=2, batch=2)
    ids = torch.randint(3, VOCAB, (1, 4))
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref = stock.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref)


def test_stablelm_over_generates_dynamic_cache_matches_stock(kernels_on_cpu):
    """generate() with its default dynamic cache: the fused layer's attention through the module's
    computation, the partial rotary in one launch (``rope_qk``) for each new token."""
    from hybridgemm.kernels import triton_qk_rope as tqr

    stock = _tiny("stablelm", head_dim=32, partial_rotary_factor=0.25)
    model = _patched(stock)
    widths, real = [], tqr.rope_qk
    ids = torch.randint(3, VOCAB, (2, 4))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(tqr, "rope_qk", lambda y, cos, *a: widths.append(cos.shape[-1]) or real(y, cos, *a))
        out = model(ids).logits
        ref = stock(ids).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref_tokens = stock.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, ref_tokens)
    assert widths and set(widths) == {8}


@pytest.mark.parametrize("kind,attention,extra", [
    ("gemma2", "eager", {"attn_logit_softcapping": 0.002, "layer_types": ["sliding_attention", "full_attention"]}),
    ("gemma3", "sdpa", {"layer_types": ["sliding_attention", "full_attention"]})], ids=["gemma2", "gemma3"])
def test_sliding_layers_whose_window_never_fills_take_the_static_step(kind, attention, extra, kernels_on_cpu):
    """A window of 32 over the cache of 16 positions never fills (a sliding layer beside a full one
    of 16; Gemma 3's (1 + w) q/k norms in the rotary epilogue): the first call swaps the sliding
    layers for ones
    that count on the device (window_cache), and every layer takes the static-cache step: its
    rotary and cache write in the Q/K/V epilogue, its new token in the decode attention kernel.
    Logits, cache entries and lengths as stock's (whose layers stay stock)."""
    from hybridgemm.kernels import triton_decode_attention as tda
    from hybridgemm.models import window_cache

    stock = _tiny(kind, layers=2, attention=attention, head_dim=32, sliding_window=32, **extra)
    model = _patched(stock)
    launches = []
    real = tda.decode_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tda, "decode_attention", lambda q, *a, **kw: launches.append(kw["step"]) or real(q, *a, **kw))
        _compare(model, stock, steps=3, batch=2)
        with torch.no_grad():
            _, _, cache = _decode(model, 2)  # a fresh cache: the prompt, then two steps
    sliding = [type(la) for la in cache.layers if la.is_sliding]
    assert sliding and sliding == [window_cache.device_length_class()] * len(sliding)
    # every decode step of both layers (3, then the last call's 2)
    assert kernels_on_cpu["rope"] == (3 + 2) * 2 and len(launches) == (3 + 2) * 2


def test_a_first_call_compiled_over_a_dynamic_cache_traces_in_one_graph(kernels_on_cpu, monkeypatch):
    """Nothing in a fused layer's per-call checks builds window_cache's classes inside a trace (a
    lock Dynamo cannot trace): a patched Llama compiled with fullgraph over a DynamicCache, its
    first call the compiled one, in a process where those classes were never built."""
    from hybridgemm.models import window_cache

    monkeypatch.setattr(window_cache, "_loaded", [])
    stock = _tiny("llama")
    model = _patched(stock)
    config = model.config
    ids = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = stock(ids, past_key_values=transformers.DynamicCache(config=config), use_cache=True).logits
        step = torch.compile(model, fullgraph=True, backend="eager")
        got = step(ids, past_key_values=transformers.DynamicCache(config=config), use_cache=True).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert window_cache._loaded == []  # still never built


def test_heads_no_tuned_tile_divides_take_narrower_tiles_in_the_rotary_epilogue(kernels_on_cpu, monkeypatch):
    """Phi-3-mini's heads of 96 under a tuned tile 64 columns wide (which would span two heads):
    the rotary epilogue runs tiles of 32, the tuned config's other fields kept, and the model
    decodes as stock does; the decode attention kernel takes the padded head."""
    widths = []
    real = triton_splitk.run

    def run(cfg, *a, **kw):
        if kw.get("rope") is not None:
            widths.append(cfg.block_n)
        return real(cfg, *a, **kw)

    monkeypatch.setattr(triton_splitk, "run", run)
    attention = attention_forms.attention_kernel()
    heads = []
    real_attention = attention.decode_attention

    def decode_attention(q, keys, *a, **kw):
        heads.append(keys.shape[-1])
        return real_attention(q, keys, *a, **kw)

    monkeypatch.setattr(attention, "decode_attention", decode_attention)
    kernels_on_cpu["config"] = triton_splitk.TritonSplitKConfig(16, 64, 32, split_k=1, num_warps=4, num_stages=2)
    config = transformers.Phi3Config(hidden_size=192, intermediate_size=96, num_attention_heads=2,
                                     num_key_value_heads=1, num_hidden_layers=2, vocab_size=VOCAB,
                                     max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert stock.model.layers[0].self_attn.head_dim == 96
    model = _patched(stock)
    _compare(model, stock, steps=2)
    assert widths == [32] * 4  # both layers, both decode steps
    assert heads == [96] * 4


def test_residual_dropout_that_drops_keeps_the_layers_own_forward(kernels_on_cpu, monkeypatch):
    """Phi-3 training with resid_pdrop > 0 (no gradient wanted): its dropouts drop, so the layers
    run their own forward (the stock model's masks from the same seed); in eval the step runs."""
    stock = _tiny("phi3", resid_pdrop=0.5, pad_token_id=0)
    model = _patched(stock)
    steps = []
    real = decode_step.layer_step
    monkeypatch.setattr(decode_step, "layer_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    ids = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for m in (stock, model):
            m.train()
        torch.manual_seed(7)
        want = stock(ids).logits
        torch.manual_seed(7)
        got = model(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert steps == []
        model.eval()
        model(ids)
    assert steps == [1, 1]


@pytest.mark.parametrize("why", ["two-launch", "not-split-k", "hook", "sliding-window", "qwen3"])
def test_where_the_step_cannot_fuse_the_results_are_still_stock(why, kernels_on_cpu, monkeypatch):
    # qwen3 with the others' head_dim (its config's default, 128, makes every projection 4x wider),
    # its q_norm replaced
    # sliding-window: Mistral's window of 4 positions, which the cache of 16 fills: its cache layers
    # roll (window_cache leaves them stock), so the step does not write them
    kind, extra = (("qwen3", {"head_dim": 32}) if why == "qwen3"
                   else ("mistral", {"sliding_window": 4}) if why == "sliding-window" else ("llama", {}))
    stock = _tiny(kind, **extra)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    if why == "two-launch":
        kernels_on_cpu["config"] = MODEL_TWO_LAUNCH
    if why == "not-split-k":
        kernels_on_cpu["config"] = None
    if why == "hook":
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda mod, args, kwargs: None, with_kwargs=True)
    if why == "qwen3":  # q/k norms the rotary epilogue cannot compute: modules patch does not know
        for layer in stock.model.layers:
            layer.self_attn.q_norm = nn.Identity()
        model = copy.deepcopy(stock)
        hybridgemm.patch(model)
        assert "q_norm is not an RMSNorm" in attention_forms.why_not_fuse_attention(model.model.layers[0].self_attn)
        assert not any(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compare(model, stock, steps=2)
    # two-launch: tried, refused, unfused; hook: the hooked layer 0 runs its stock forward
    assert kernels_on_cpu["rope"] == {"two-launch": 4, "hook": 2}.get(why, 0)
    if why == "two-launch":
        assert sum("rotary/KV-cache fusion" in str(w.message) for w in seen) == 1


def test_a_hub_kernel_bound_as_the_rotary_runs_where_the_step_would_not(kernels_on_cpu):
    """With Hugging Face's kernels installed, each attention routes apply_rotary_pos_emb through a wrapper of its
    own, whose forward kernels.kernelize replaces with a Hub kernel's. Such an attention is not fused: its layer
    runs the module's attention over the fused Q/K/V, calling that kernel, as the stock model does."""
    stock = _tiny("llama")
    form = attention_forms.attention_form(type(stock.model.layers[0].self_attn))
    wrappers = [attention_forms.module_rotary(layer.self_attn, form) for layer in stock.model.layers]
    if wrappers[0] is form.rotary:
        pytest.skip("this transformers release calls apply_rotary_pos_emb as a plain function (no kernels wrappers)")
    calls = []

    def hub_rotary(self, q, k, cos, sin, unsqueeze_dim=1):  # the stock rotary with q scaled: a kernel of its own
        calls.append(1)
        q, k = attention_forms.plain_function(form.rotary)(q, k, cos, sin, unsqueeze_dim)
        return q * 1.5, k

    for wrapper in wrappers:  # as kernels.kernelize binds a layer's forward
        wrapper.forward = types.MethodType(hub_rotary, wrapper)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    attn = model.model.layers[0].self_attn
    assert "Hugging Face Hub" in attention_forms.why_not_fuse_attention(attn)
    assert not any(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    _compare(model, stock, steps=2)
    assert calls and kernels_on_cpu["rope"] == 0
    del attention_forms.module_rotary(attn, form).forward  # the wrapper back to the stock function
    assert attention_forms.why_not_fuse_attention(attn) is None


@pytest.mark.parametrize("batch", [1, 3])
def test_one_token_attention_is_one_kernel_launch(batch, kernels_on_cpu, monkeypatch):
    from hybridgemm.kernels import triton_decode_attention as tda

    stock = _tiny("llama")
    model = _patched(stock)
    launches, real = [], tda.decode_attention
    monkeypatch.setattr(tda, "decode_attention", lambda q, k, *a, **kw: launches.append(
        (tuple(q.shape), kw["step"], kw["counters"] is not None)) or real(q, k, *a, **kw))
    monkeypatch.setattr(decode_step, "F", None)  # no SDPA call at all
    monkeypatch.setattr(fused_pieces, "F", None)  # (nor the attention piece's fallback)
    _compare(model, stock, steps=2, batch=batch)
    assert kernels_on_cpu["rope"] == 2 * 2
    # 4 query heads of 32 over 2 KV heads; each layer's call adds 1 to its cache length but the
    # first layer's (an add after it: the model's positions come from that one)
    assert launches == [((batch, 4 * 32), 0, True), ((batch, 4 * 32), 1, True)] * 2


@pytest.mark.parametrize("batch", [1, 3])
def test_without_the_kernel_gqa_query_rows_are_packed_from_batch_2(batch, kernels_on_cpu, monkeypatch):
    stock = _tiny("llama")
    model = _patched(stock)
    monkeypatch.setattr(checks, "kernel_takes", lambda *a: False)
    shapes, real = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(decode_step, "F", types.SimpleNamespace(
        scaled_dot_product_attention=lambda q, *a, **kw: shapes.append(tuple(q.shape)) or real(q, *a, **kw)))
    _compare(model, stock, steps=2, batch=batch)
    assert kernels_on_cpu["rope"] == 2 * 2
    # 4 query heads on 2 KV heads: each KV head's 2 query heads as 2 rows (batch 1: the model's SDPA call)
    assert shapes == ([] if batch == 1 else [(batch, 2, 2, 32)] * 4)


def test_unpatch_removes_the_attention_step():
    model = _tiny("llama", layers=1)
    hybridgemm.patch(model)
    assert model.model.layers[0].__dict__.get(checks.STATIC_STEP)
    assert dl.COUNTERS in model.model.layers[0]._buffers
    hybridgemm.unpatch(model)
    assert checks.STATIC_STEP not in model.model.layers[0].__dict__
    assert dl.COUNTERS not in model.model.layers[0]._buffers


def test_a_left_padded_batch_with_its_attention_mask_matches_stock(kernels_on_cpu, monkeypatch):
    # Per-sequence positions (so per-sequence cos/sin rows) and a mask hiding the padding,
    # which the attention kernel reads per sequence.
    from hybridgemm.kernels import triton_decode_attention as tda

    masks, real = [], tda.decode_attention
    monkeypatch.setattr(tda, "decode_attention", lambda q, k, v, mask, *a, **kw: masks.append(
        None if mask is None else tuple(mask.shape)) or real(q, k, v, mask, *a, **kw))
    stock = _tiny("qwen2")
    model = _patched(stock)
    api = hf.forward_api(model)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0  # sequence 0 is left-padded by two tokens

    def run(m):
        cache = hf.static_cache(m, 2, 16)
        am = mask.clone()
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        out = [m(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True,
                 **{api.cache_kw: cache}).logits[:, -1]]
        for step in range(3):
            am = torch.cat([am, torch.ones(2, 1, dtype=torch.long)], dim=1)
            tok = torch.full((2, 1), 3 + step)
            out.append(m(input_ids=tok, attention_mask=am, position_ids=pos[:, -1:] + 1 + step, use_cache=True,
                         **{api.cache_kw: cache}).logits[:, -1])
        return torch.stack(out)

    with torch.no_grad():
        torch.testing.assert_close(run(model), run(stock), rtol=1e-4, atol=1e-4)
    assert kernels_on_cpu["rope"] == 3 * 2
    assert masks == [(2, 1, 1, 16)] * 3 * 2


def test_a_cache_overflow_shows_as_nan_logits(kernels_on_cpu):
    stock = _tiny("llama")
    model = _patched(stock)
    api = hf.forward_api(model)
    with torch.no_grad():
        cache = hf.static_cache(model, 2, 4)
        hf.cached_forward(model, api, torch.randint(0, VOCAB, (2, 3)), cache, torch.arange(3))
        last = hf.cached_forward(model, api, torch.randint(0, VOCAB, (2, 1)), cache, torch.tensor([3]))
        assert torch.isfinite(last).all()  # position 3 is the cache's last
        past = hf.cached_forward(model, api, torch.randint(0, VOCAB, (2, 1)), cache, torch.tensor([4]))
    assert past.isnan().all()  # stock raises (index_copy_ out of range); never a silent wrong answer


def test_a_cache_of_other_head_counts_runs_the_attention_module(kernels_on_cpu):
    model = _patched(_tiny("llama", layers=1))
    api = hf.forward_api(model)
    with torch.no_grad():
        cache = hf.static_cache(model, 2, 8)
        hf.cached_forward(model, api, torch.randint(0, VOCAB, (2, 3)), cache, torch.arange(3))
        layer = cache.layers[0]
        x = torch.randn(2, 1, 128)
        cos = torch.ones(2, 1, 32)
        kw = {"cache": cache, "position_embeddings": (cos, cos)}
        attn = model.model.layers[0].self_attn
        assert checks.kv_slot(attn, x, kw) is not None
        layer.keys, layer.values = layer.keys[:, :1].clone(), layer.values[:, :1].clone()
        assert checks.kv_slot(attn, x, kw) is None


def test_counters_are_zeroed_when_the_layer_is_materialised():
    with torch.device("meta"):
        model = _tiny("llama", layers=1)
    hybridgemm.patch(model)
    model.to_empty(device="cpu")
    assert not model.model.layers[0]._buffers[dl.COUNTERS].any()
    model.model.layers[0]._buffers[dl.COUNTERS].fill_(3)
    model.to(torch.float32)
    assert not model.model.layers[0]._buffers[dl.COUNTERS].any()


def test_a_layer_built_on_meta_and_loaded_with_assign_moves_as_the_stock_layer_does():
    stock = _tiny("llama", layers=1)
    built = []
    for patch in (False, True):
        with torch.device("meta"):
            model = _tiny("llama", layers=1)
        if patch:
            hybridgemm.patch(model)
        model.load_state_dict(stock.state_dict(), assign=True)  # leaves non-persistent buffers on meta
        built.append(model.model.layers[0])
    built[0].to("cpu")
    layer = built[1]
    assert layer._buffers[dl.COUNTERS].is_meta
    layer.to("cpu")  # the counters are made anew beside the parameters: a meta tensor has no values
    counters = layer._buffers[dl.COUNTERS]
    assert counters.device.type == "cpu" and counters.dtype == torch.int32
    assert counters.numel() == dl.COUNTER_SLOTS and not counters.any()
    x = torch.randn(1, 3, stock.config.hidden_size)
    pe = stock.model.rotary_emb(x, torch.arange(3)[None])
    with torch.no_grad():
        torch.testing.assert_close(layer(x, position_embeddings=pe), built[0](x, position_embeddings=pe))


# (the eager backend runs the graph Dynamo captured as captured; aot_eager runs the same capture
# functionalised)
# OLMo 2: its all-head q/k norms, rotary and cache write in their own custom op, no rotary epilogue
@pytest.mark.parametrize("backend,kind", [("aot_eager", "llama"), ("inductor", "llama"), ("aot_eager", "granite"),
                                          ("aot_eager", "olmo2")])
def test_dynamo_traces_a_decode_step_in_one_graph(backend, kind, kernels_on_cpu, monkeypatch):
    # inductor: the cache-length updates of the attention kernels are ordered against the
    # positions and mask the model derives from the first layer's length, which Inductor
    # may recompute per layer
    if backend == "inductor" and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("Inductor's CPU backend needs a C++ compiler")
    from hybridgemm.kernels import triton_decode_attention as tda
    from hybridgemm.kernels import triton_qk_rope as tqr

    launches, real = [], tda.decode_attention
    monkeypatch.setattr(tda, "decode_attention", lambda *a, **kw: launches.append(kw["step"]) or real(*a, **kw))
    qk_launches, real_qk = [], tqr.qk_norm_rope_store
    monkeypatch.setattr(tqr, "qk_norm_rope_store", lambda *a: qk_launches.append(1) or real_qk(*a))
    # a process where the attention kernel's module was never loaded: patch loads it (the trace cannot)
    from hybridgemm.kernels import lazy

    monkeypatch.delitem(lazy._loaded, "triton_decode_attention", raising=False)
    stock = _tiny(kind, **({"residual_multiplier": 0.22} if kind == "granite" else {}))
    model = _patched(stock)
    api = hf.forward_api(model)
    with torch.no_grad():
        ref, fed, ref_cache = _decode(stock, 2)
        cache = hf.static_cache(model, 2, 16)
        ids = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(3))
        hf.cached_forward(model, api, ids, cache, torch.arange(3))
        step = torch.compile(lambda tok, pos: hf.cached_forward(model, api, tok, cache, pos)[:, -1],
                             fullgraph=True, backend=backend)  # aot_eager: functionalised (the cache mutation)
        outs = [step(fed[i], torch.tensor([3 + i])) for i in range(2)]
    torch._dynamo.reset()
    for a, b in zip(outs, ref[1:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert kernels_on_cpu["rope"] == (0 if kind == "olmo2" else 2 * 2)
    assert len(qk_launches) == (2 * 2 if kind == "olmo2" else 0)
    assert launches == [0, 1] * 2  # both layers' attention in the kernel, both steps
    assert [int(la.cumulative_length) for la in cache.layers] == [int(la.cumulative_length)
                                                                  for la in ref_cache.layers] == [5, 5]


def test_an_attention_kernel_that_cannot_run_falls_back_to_sdpa_once_warned(kernels_on_cpu, monkeypatch):
    from hybridgemm.kernels import triton_decode_attention as tda

    def refuse(*a, **kw):
        raise ValueError("refused for the test")

    monkeypatch.setattr(tda, "decode_attention", refuse)
    stock = _tiny("llama")
    model = _patched(stock)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compare(model, stock, steps=2)  # logits, caches and lengths as stock's
    assert sum("decode attention kernel could not run" in str(w.message) for w in seen) == 1


@pytest.mark.parametrize("batch", [1, 3])
def test_a_model_on_transformers_eager_attention_takes_the_step_with_its_additive_mask(batch, kernels_on_cpu,
                                                                                     monkeypatch):
    """attn_implementation="eager": its function is a form the kernel computes; transformers gives it an
    additive floating mask, which the kernel reads as it is."""
    from hybridgemm.kernels import triton_decode_attention as tda

    masks, real = [], tda.decode_attention
    monkeypatch.setattr(tda, "decode_attention", lambda q, k, v, mask, *a, **kw: masks.append(mask.dtype)
                        or real(q, k, v, mask, *a, **kw))
    stock = _tiny("llama", attention="eager")
    model = _patched(stock)
    _compare(model, stock, steps=2, batch=batch)
    assert masks == [torch.float32] * 2 * 2  # both layers, both steps


def test_olmo2s_fp32_rotary_in_bfloat16_takes_the_step_with_its_roundings():
    """OLMo 2's rotary embedding gives fp32 cos/sin; its apply_rotary_pos_emb rotates in fp32 and rounds
    to q's dtype. A bf16 layer takes the step with them (kv_slot), and the step's rotary and cache
    write (``rotate_store``) give the stock function's bits."""
    from transformers.models.olmo2 import modeling_olmo2 as o2

    stock = _tiny("olmo2", head_dim=32).to(torch.bfloat16)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    with torch.no_grad():
        cache = hf.static_cache(model, 2, 16)
        hf.cached_forward(model, hf.forward_api(model), torch.randint(0, VOCAB, (2, 3)), cache, torch.arange(3))
        x = torch.randn(2, 1, 128, dtype=torch.bfloat16)
        cos, sin = model.model.rotary_emb(x, torch.tensor([[3], [3]]))
    assert cos.dtype == torch.float32
    attn = model.model.layers[1].self_attn
    slot = checks.kv_slot(attn, x, {"past_key_values": cache, "position_embeddings": (cos, sin)})
    assert slot is not None and slot[1] is cos and not slot[3]  # layer 1: not a layer the model reads
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 1, (4 + 2 * 2) * 32, generator=g).to(torch.bfloat16)
    keys, values = torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16), torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16)
    got = fused_pieces.rotate_store(y, cos, sin, keys, values, torch.tensor(3), 4, 2)
    q, k, v = y.split([128, 64, 64], dim=-1)
    rotary = attention_forms.plain_function(attention_forms.attention_form(o2.Olmo2Attention).rotary)
    want_q, want_k = rotary(q.view(2, 1, 4, 32).transpose(1, 2), k.view(2, 1, 2, 32).transpose(1, 2), cos, sin)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[..., :128], want_q.transpose(1, 2).reshape(2, 1, 128))
    assert torch.equal(keys[:, :, 3], want_k[:, :, 0]) and torch.equal(values[:, :, 3], v.view(2, 2, 32))


def test_a_soft_capped_gemma2_layer_falls_back_to_its_eager_form_when_the_kernel_cannot_run(kernels_on_cpu,
                                                                                             monkeypatch):
    """The fallback of a refused kernel computes the cap and the additive mask too (SDPA takes no cap);
    one warning for the full layer's static-cache step, one for the sliding layer's module path."""
    from hybridgemm import diagnostics
    from hybridgemm.kernels import triton_decode_attention as tda

    def refuse(*a, **kw):
        raise ValueError("refused for the test")

    monkeypatch.setattr(tda, "decode_attention", refuse)
    monkeypatch.setattr(diagnostics, "_warned", set())  # (another test may have warned for this cache shape)
    stock = _tiny("gemma2", layers=2, attention="eager", head_dim=32, attn_logit_softcapping=0.002, **_WINDOWS)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compare(model, stock, steps=2)
    assert sum("decode attention kernel could not run" in str(w.message) for w in seen) == 2


@pytest.mark.parametrize("kind,attention,batch,extra", [
    ("llama", "sdpa", 1, {}), ("llama", "sdpa", 3, {}), ("qwen3", "sdpa", 2, {"head_dim": 32}),
    ("gemma2", "eager", 2, {"attn_logit_softcapping": 0.002, "head_dim": 32, **_WINDOWS}),
    ("smollm3", "sdpa", 2, {"no_rope_layers": [1, 0], "pad_token_id": 0}),
    ("ministral3", "sdpa", 2, {"rope_parameters": _LLAMA4_SCALED_ROPE, "pad_token_id": 0, "head_dim": 32}),
    ("glm", "sdpa", 2, {"pad_token_id": 0, "head_dim": 32}),
    ("ernie4_5", "sdpa", 2, {"head_dim": 32}),
], ids=["llama-b1", "llama-b3", "qwen3", "gemma2-softcap", "smollm3-nope", "ministral3-position-scale",
        "glm-halved-pairs", "ernie4_5-fp32-halved-pairs"])
def test_dynamic_cache_decode_runs_the_attention_kernel_over_what_the_cache_returns(kind, attention, batch, extra,
                                                                                    kernels_on_cpu):
    """A dynamic cache (``generate``'s default): each new token's attention is one launch of the
    decode attention kernel over the keys and values the cache layer returns (GQA without SDPA's
    expanded copies; Gemma 2's softcap and additive mask), adding nothing to any length, and each
    call's rotary one launch; logits and caches as stock's."""
    from transformers import DynamicCache

    from hybridgemm.kernels import triton_decode_attention as tda

    stock = _tiny(kind, attention=attention, **extra)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    from hybridgemm.kernels import triton_qk_rope as tqr

    launches, real = [], tda.decode_attention
    rotated, real_rope = [], tqr.rope_qk
    ids = torch.randint(0, VOCAB, (batch, 3), generator=torch.Generator().manual_seed(3))

    def decode(m):
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            logits = [m(ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            for _ in range(3):
                logits.append(m(logits[-1].argmax(-1, keepdim=True), past_key_values=cache,
                                use_cache=True).logits[:, -1])
        return logits, cache

    ref, ref_cache = decode(stock)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tda, "decode_attention", lambda q, *a, **kw: launches.append((tuple(q.shape), kw["step"],
                                                                                 kw.get("base"))) or real(q, *a, **kw))
        mp.setattr(tqr, "rope_qk", lambda y, *a: rotated.append(y.shape[1]) or real_rope(y, *a))
        out, cache = decode(model)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for got, want in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-4)
    assert launches == [((batch, 4 * model.model.layers[0].self_attn.head_dim), 0, None)] * (2 * 3)
    # the rotary in one launch per layer and call, the prompt's too; Qwen3's q/k norms come before
    # it (the module's ops then); SmolLM3's second layer rotates nothing
    assert rotated == {"qwen3": [], "smollm3": [3] + [1] * 3}.get(kind, [3] * 2 + [1] * 6)


def test_the_eager_forms_the_kernel_computes_are_read_exactly(monkeypatch):
    """Llama's and Gemma 2's eager attention functions are forms the decode kernel computes; one
    statement more (attention sinks, say) is not."""
    from transformers.models.gemma2 import modeling_gemma2 as g2
    from transformers.models.llama import modeling_llama as ll

    assert attention_forms._read_form(ll.LlamaAttention).kernel_eager
    assert attention_forms._read_form(g2.Gemma2Attention).kernel_eager
    real = attention_forms.body_statements

    def with_one_more(fn):
        statements = real(fn)
        if fn is ll.eager_attention_forward:
            statements = [*statements[:-1], "attn_output=attn_output*2", statements[-1]]
        return statements

    monkeypatch.setattr(attention_forms, "body_statements", with_one_more)
    assert not attention_forms._read_form(ll.LlamaAttention).kernel_eager


def test_gemma3s_late_qk_norm_form_is_read_only_with_every_other_statement_as_checked(monkeypatch):
    """Gemma 3's attention (q/k norms on the head views) is read as the q/k-normed form; the same
    statements with one more anywhere are no form the step computes."""
    from transformers.models.gemma3 import modeling_gemma3 as g

    statements = attention_forms.body_statements(g.Gemma3Attention.forward)
    form = attention_forms._read_form(g.Gemma3Attention)
    assert form.qk_norm and not form.prefused and not form.softcap and form.window_from == "module"
    for at in (3, 8, len(statements) - 1):
        extra = [*statements[:at], "attn_output=attn_output*2", *statements[at:]]
        monkeypatch.setattr(attention_forms, "body_statements", lambda fn, extra=extra: extra)
        assert isinstance(attention_forms._read_form(g.Gemma3Attention), str), at
