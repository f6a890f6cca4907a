"""The q/k norm, rotary and cache-write kernel (kernels/triton_qk_rope.py): against transformers'
own OLMo 2 modules (Olmo2RMSNorm, apply_rotary_pos_emb, the cache's index_copy_) in the same
dtype and against fp64; odd head counts and widths, batch and sequence layouts, strided y, a
position outside the cache, the refusals of ``check``; bf16 and the sm_90 build on the GPU side.
"""

from __future__ import annotations

import pytest
import torch

from helpers import poisoned
from hybridgemm.kernels import triton_qk_rope as tqr
from hybridgemm.kernels.triton_launch import interpreting

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")

CPU_DTYPES = [torch.float32, torch.float16]
# the CPU cases under the interpreter (the suite's CPU run), the CUDA ones with `pytest -m gpu`
DEVICES = [pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET=1")),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _unit(dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _norm_module(width, dtype, device, eps, seed):
    norm = olmo2.Olmo2RMSNorm(width, eps=eps).to(device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(width, generator=g))
    return norm.to(dtype)


def _operands(b, s, heads, kv_heads, hd, dtype, device, cos_dtype, cache_len=12, per_batch_cos=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = (heads + 2 * kv_heads) * hd
    # rows of scales from 0.05 to 20: the norm matters, eps matters for the quiet ones
    scale = 10 ** (torch.rand(b, s, 1, generator=g) * 2.6 - 1.3)
    y = (torch.randn(b, s, n, generator=g) * scale).to(dtype).to(device)
    angles = torch.rand(b if per_batch_cos else 1, s, hd // 2, generator=g) * 6.3
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(cos_dtype).to(device), emb.sin().to(cos_dtype).to(device)
    keys = poisoned((b, kv_heads, cache_len, hd), dtype, device)
    values = poisoned((b, kv_heads, cache_len, hd), dtype, device)
    q_norm = _norm_module(heads * hd, dtype, device, 1e-6, seed + 1)
    k_norm = _norm_module(kv_heads * hd, dtype, device, 1e-5, seed + 2)
    return y, cos, sin, keys, values, q_norm, k_norm


def _stock(y, cos, sin, heads, kv_heads, hd, q_norm, k_norm):
    """OLMo 2's attention between its projections and the cache, with transformers' own pieces."""
    b, s, _ = y.shape
    q, k, v = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k = q_norm(q), k_norm(k)
    q = q.view(b, s, heads, hd).transpose(1, 2)
    k = k.view(b, s, kv_heads, hd).transpose(1, 2)
    q, k = olmo2.apply_rotary_pos_emb(q, k, cos, sin)
    return q.transpose(1, 2).reshape(b, s, heads * hd), k, v.view(b, s, kv_heads, hd).transpose(1, 2)


def _fp64(y, cos, sin, heads, kv_heads, hd, q_norm, k_norm):
    """The same in float64, with no rounding in between: (q, k, and the magnitudes |t cos| +
    |rotate_half(t) sin| of q's and k's terms, which bound what a rounding of t costs)."""
    b, s, _ = y.shape
    q, k, _ = y.double().split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)

    def norm(t, mod):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon) * mod.weight.double()

    def rotate(t, n, f=lambda a: a):
        t = t.view(b, s, n, hd)
        rot = torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], dim=-1)
        return (f(t * cos.double()[:, :, None]) + f(rot * sin.double()[:, :, None])).transpose(1, 2)

    qn, kn = norm(q, q_norm), norm(k, k_norm)
    return (rotate(qn, heads).transpose(1, 2).reshape(b, s, -1), rotate(kn, kv_heads),
            rotate(qn, heads, torch.abs).transpose(1, 2).reshape(b, s, -1), rotate(kn, kv_heads, torch.abs))


def _run(y, cos, sin, keys, values, q_norm, k_norm, base, heads):
    ops = ((q_norm.weight.detach(), q_norm.variance_epsilon, 0.0), (k_norm.weight.detach(), k_norm.variance_epsilon,
                                                                     0.0))
    assert tqr.check(y, *ops, cos, sin, keys, values, base, heads) is None
    return tqr.qk_norm_rope_store(y, *ops, cos, sin, keys, values, base, heads)


def _close(out, ref, dtype, ulps, terms):
    """Within ``ulps`` roundings of ``dtype`` of the magnitude of the rotary's terms (``terms``:
    |t cos| + |rotate_half(t) sin|; a value where they cancel keeps their rounding errors)."""
    err = (out.double() - ref.double()).abs()
    bound = ulps * 2 * _unit(dtype) * terms
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, {(err > bound).sum().item()} elements out"


CASES = [  # b, s, heads, kv_heads, hd, base
    (1, 1, 4, 2, 32, 5),
    (3, 1, 3, 1, 16, 0),
    (2, 2, 5, 5, 6, 9),
    (1, 3, 2, 1, 64, 4),
    (3, 1, 6, 2, 10, 11),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cos_fp32", [True, False], ids=["fp32-cos", "same-cos"])
@pytest.mark.parametrize("b,s,heads,kv_heads,hd,base", CASES)
def test_matches_transformers_olmo2_and_fp64(device, cos_fp32, b, s, heads, kv_heads, hd, base):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    for dtype in ([torch.bfloat16, torch.float16] if device == "cuda" else CPU_DTYPES):
        y, cos, sin, keys, values, q_norm, k_norm = _operands(b, s, heads, kv_heads, hd, dtype, device,
                                                              torch.float32 if cos_fp32 else dtype,
                                                              per_batch_cos=b % 2 == 1, seed=b * 7 + hd)
        base_t = torch.tensor([base], dtype=torch.int64, device=device)
        with torch.no_grad():
            q = _run(y, cos, sin, keys, values, q_norm, k_norm, base_t, heads)
            ref_q, ref_k, ref_v = _stock(y, cos, sin, heads, kv_heads, hd, q_norm, k_norm)
            d_q, d_k, q_terms, k_terms = _fp64(y, cos, sin, heads, kv_heads, hd, q_norm, k_norm)
        assert q.shape == (b, s, heads * hd) and q.dtype == dtype and q.is_contiguous()
        written = slice(base, base + s)
        assert torch.equal(values[:, :, written], ref_v), "v must be copied bit for bit"
        assert torch.isnan(keys[:, :, :base]).all() and torch.isnan(keys[:, :, base + s:]).all(), \
            "positions other than base + s must be untouched"
        assert torch.isnan(values[:, :, :base]).all() and torch.isnan(values[:, :, base + s:]).all()
        # against the stock modules in the same dtype: the sum's order and rsqrt differ in fp32's
        # last bits, which a rounding to 16 bits shows as one ulp where a value sits on a boundary
        _close(q, ref_q, dtype, 2 if dtype != torch.float32 else 64, q_terms)
        _close(keys[:, :, written], ref_k, dtype, 2 if dtype != torch.float32 else 64, k_terms)
        if dtype != torch.float32:  # the stock roundings, each one: nearly every value the same bits
            same = torch.cat([(q == ref_q).flatten(), (keys[:, :, written] == ref_k).flatten()]).double().mean()
            assert same >= 0.97, f"only {same:.1%} of the values equal stock's"
        # against fp64: the norm's rounding, the two products' and the sum's (16-bit cos/sin),
        # the last one, and fp32's few roundings
        ulps = 4 if not cos_fp32 else 2
        _close(q, d_q, dtype, ulps + (64 if dtype == torch.float32 else 1), q_terms)
        _close(keys[:, :, written], d_k, dtype, ulps + (64 if dtype == torch.float32 else 1), k_terms)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_a_shared_cos(device):
    """y as a column slice of a wider [B, S, N'] tensor (the row stride is N'), cos [1, S, hd]."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dtype = torch.float16 if device == "cuda" else torch.float32
    b, s, heads, kv_heads, hd = 3, 2, 3, 1, 8
    y, cos, sin, keys, values, q_norm, k_norm = _operands(b, s, heads, kv_heads, hd, dtype, device, torch.float32,
                                                          per_batch_cos=False, seed=3)
    wide = torch.randn(b, s, y.shape[-1] + 24, dtype=dtype, device=device)
    wide[..., : y.shape[-1]] = y
    strided = wide[..., : y.shape[-1]]
    assert not strided.is_contiguous()
    base = torch.tensor([2], dtype=torch.int64, device=device)
    with torch.no_grad():
        q = _run(strided, cos, sin, keys, values, q_norm, k_norm, base, heads)
        ref_q, ref_k, ref_v = _stock(y, cos, sin, heads, kv_heads, hd, q_norm, k_norm)
        _, _, q_terms, k_terms = _fp64(y, cos, sin, heads, kv_heads, hd, q_norm, k_norm)
    _close(q, ref_q, dtype, 64, q_terms)
    _close(keys[:, :, 2:4], ref_k, dtype, 64, k_terms)
    assert torch.equal(values[:, :, 2:4], ref_v)


@pytest.mark.parametrize("device", DEVICES)
def test_a_position_outside_the_cache_writes_nothing_and_gives_nan(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dtype = torch.float32
    b, s, heads, kv_heads, hd = 2, 3, 2, 1, 8
    y, cos, sin, keys, values, q_norm, k_norm = _operands(b, s, heads, kv_heads, hd, dtype, device, dtype,
                                                          cache_len=6)
    base = torch.tensor([4], dtype=torch.int64, device=device)  # positions 4, 5 fit; 6 does not
    with torch.no_grad():
        q = _run(y, cos, sin, keys, values, q_norm, k_norm, base, heads)
    assert torch.isfinite(q[:, :2]).all() and torch.isnan(q[:, 2]).all()
    assert torch.isfinite(keys[:, :, 4:]).all() and torch.isnan(keys[:, :, :4]).all()
    assert torch.isfinite(values[:, :, 4:]).all() and torch.isnan(values[:, :, :4]).all()


def test_an_empty_batch_launches_nothing():
    y, cos, sin, keys, values, q_norm, k_norm = _operands(1, 1, 2, 1, 8, torch.float32, "cpu", torch.float32)
    empty = y[:0]
    q = tqr.qk_norm_rope_store(empty, (q_norm.weight, 1e-6, 0.0), (k_norm.weight, 1e-6, 0.0), cos, sin,
                               keys[:0], values[:0], torch.zeros(1, dtype=torch.int64), 2)
    assert q.shape == (0, 1, 16)


@pytest.mark.parametrize("name,change,why", [
    ("y", lambda y: y[..., :-2], "columns"),
    ("y", lambda y: y.transpose(0, 1).contiguous().transpose(0, 1), "flatten"),
    ("y", lambda y: y.to(torch.int32), "fp16/bf16/fp32"),
    ("keys", lambda k: k.transpose(2, 3), "contiguous"),
    ("values", lambda v: v.to(torch.float16), "y's dtype"),
    ("cos", lambda c: c[..., :-2], "cos/sin"),
    ("cos", lambda c: c.to(torch.float16), "cos/sin"),
    ("base", lambda t: t.to(torch.int32), "int64"),
    ("q_norm", lambda op: (op[0][:-1], *op[1:]), "q_norm"),
    ("k_norm", lambda op: (op[0].repeat(2), *op[1:]), "k_norm"),
    ("q_norm", lambda op: (op[0], float("nan"), op[2]), "finite"),
    ("k_norm", lambda op: (op[0], 1e-6, float("inf")), "finite"),
])
def test_check_names_what_does_not_fit(name, change, why):
    y, cos, sin, keys, values, q_norm, k_norm = _operands(3, 2, 4, 2, 8, torch.float32, "cpu", torch.float32)
    args = dict(y=y, q_norm=(q_norm.weight.detach(), 1e-6, 0.0), k_norm=(k_norm.weight.detach(), 1e-6, 0.0),
                cos=cos, sin=sin, keys=keys, values=values, base=torch.zeros(1, dtype=torch.int64), heads=4)
    assert tqr.check(**args) is None
    args[name] = change(args[name])
    why_not = tqr.check(**args)
    assert why_not is not None and why in why_not, why_not


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,s,heads,kv_heads,hd,strided", [(1, 1, 4, 2, 32, False), (3, 1, 3, 1, 16, True),
                                                            (2, 3, 5, 5, 6, False), (3, 2, 6, 2, 256, True)])
def test_rope_alone_is_transformers_rotary_bit_for_bit(device, b, s, heads, kv_heads, hd, strided):
    """``rope_qk``: Llama's ``apply_rotary_pos_emb`` (the standard form) over the q and k columns
    of y, cos/sin of y's dtype: in 16 bits the same bits (each product and the sum rounded as
    torch rounds them), in fp32 too (no FMA); y's row stride past its columns; cos per batch or shared."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for dtype in ([torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else CPU_DTYPES):
        y, cos, sin, *_ = _operands(b, s, heads, kv_heads, hd, dtype, device, dtype, per_batch_cos=b % 2 == 0,
                                    seed=hd + s)
        if strided:
            wide = torch.zeros(b, s, y.shape[-1] + 40, dtype=dtype, device=device)
            wide[..., : y.shape[-1]] = y
            y = wide[..., : y.shape[-1]]
        assert tqr.check_rope(y, cos, sin, heads, kv_heads) is None
        q, k = tqr.rope_qk(y, cos, sin, heads, kv_heads)
        yq, yk, _ = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        ref_q, ref_k = apply_rotary_pos_emb(yq.reshape(b, s, heads, hd).transpose(1, 2),
                                            yk.reshape(b, s, kv_heads, hd).transpose(1, 2), cos, sin)
        assert q.shape == (b, s, heads * hd) and k.shape == (b, s, kv_heads * hd)
        assert torch.equal(q, ref_q.transpose(1, 2).reshape(b, s, -1)), dtype
        assert torch.equal(k, ref_k.transpose(1, 2).reshape(b, s, -1)), dtype


def _stablelm_rotary(y, cos, sin, heads, kv_heads, hd):
    """StableLM's attention from its projection to the cache, with transformers' own pieces: the
    first ``cos.shape[-1]`` columns of each head rotated, the rest passed, ``torch.cat``."""
    from transformers.models.stablelm.modeling_stablelm import apply_rotary_pos_emb

    b, s, _ = y.shape
    rot = cos.shape[-1]
    q, k, v = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = q.view(b, s, heads, hd).transpose(1, 2)
    k = k.view(b, s, kv_heads, hd).transpose(1, 2)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
    q, k = torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)
    return q.transpose(1, 2).reshape(b, s, heads * hd), k, v.view(b, s, kv_heads, hd).transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,s,heads,kv_heads,hd,rot,base", [(1, 1, 4, 2, 32, 8, 5), (3, 1, 3, 1, 20, 4, 0),
                                                            (2, 3, 5, 5, 80, 20, 7), (1, 2, 2, 2, 16, 16, 3),
                                                            (3, 2, 6, 2, 10, 2, 1)])
def test_partial_rotary_without_norms_is_stablelm_bit_for_bit(device, b, s, heads, kv_heads, hd, rot, base):
    """No q/k norms and cos/sin of ``rot`` columns (StableLM's, GPT-NeoX's ``rotary_ndims``): q and
    the cached k are transformers' partial rotary bit for bit (16-bit: each product and sum
    rounded as torch rounds them; fp32: no FMA), v cached as it is, nothing else written; the
    rotary alone (``rope_qk``) the same. A whole-head ``rot`` is the standard rotary."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    for dtype in ([torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else CPU_DTYPES):
        y, _, _, keys, values, *_ = _operands(b, s, heads, kv_heads, hd, dtype, device, dtype, seed=hd + rot)
        g = torch.Generator().manual_seed(rot)
        angles = torch.rand(b, s, rot // 2, generator=g) * 6.3
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
        pos = torch.tensor([base], dtype=torch.int64, device=device)
        assert tqr.check(y, None, None, cos, sin, keys, values, pos, heads) is None
        q = tqr.qk_norm_rope_store(y, None, None, cos, sin, keys, values, pos, heads)
        ref_q, ref_k, ref_v = _stablelm_rotary(y, cos, sin, heads, kv_heads, hd)
        assert torch.equal(q, ref_q), dtype
        assert torch.equal(keys[:, :, base:base + s], ref_k) and torch.equal(values[:, :, base:base + s], ref_v)
        others = torch.ones(keys.shape[2], dtype=torch.bool)
        others[base:base + s] = False
        assert torch.isnan(keys[:, :, others]).all() and torch.isnan(values[:, :, others]).all()
        assert tqr.check_rope(y, cos, sin, heads, kv_heads) is None
        q2, k2 = tqr.rope_qk(y, cos, sin, heads, kv_heads)
        assert torch.equal(q2, ref_q) and torch.equal(k2, ref_k.transpose(1, 2).reshape(b, s, -1)), dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,s,heads,kv_heads,hd,base", [(1, 1, 4, 2, 32, 5), (3, 1, 3, 1, 16, 0), (2, 2, 5, 5, 6, 9)])
def test_neighbour_pairs_are_coheres_rotary_bit_for_bit(device, b, s, heads, kv_heads, hd, base):
    """``pairs``: Cohere's rotary (columns 2i and 2i + 1 paired, cos/sin interleaved, q and k
    rotated as fp32 copies and rounded once) with its own functions: q and the cached k bit for
    bit, with the cache write and alone (``rope_qk``)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    cohere = pytest.importorskip("transformers.models.cohere.modeling_cohere")
    for dtype in ([torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else CPU_DTYPES):
        y, _, _, keys, values, *_ = _operands(b, s, heads, kv_heads, hd, dtype, device, dtype, seed=hd + 1)
        g = torch.Generator().manual_seed(hd)
        emb = torch.repeat_interleave(torch.rand(b, s, hd // 2, generator=g) * 6.3, 2, dim=-1)
        cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
        q, k, v = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        ref_q, ref_k = cohere.apply_rotary_pos_emb(q.view(b, s, heads, hd).transpose(1, 2),
                                                   k.view(b, s, kv_heads, hd).transpose(1, 2), cos, sin)
        ref_q = ref_q.transpose(1, 2).reshape(b, s, -1)
        pos = torch.tensor([base], dtype=torch.int64, device=device)
        got = tqr.qk_norm_rope_store(y, None, None, cos, sin, keys, values, pos, heads, pairs=True)
        assert torch.equal(got, ref_q), dtype
        assert torch.equal(keys[:, :, base:base + s], ref_k)
        assert torch.equal(values[:, :, base:base + s], v.view(b, s, kv_heads, hd).transpose(1, 2))
        q2, k2 = tqr.rope_qk(y, cos, sin, heads, kv_heads, pairs=True)
        assert torch.equal(q2, ref_q) and torch.equal(k2, ref_k.transpose(1, 2).reshape(b, s, -1)), dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("module,b,s,heads,kv_heads,hd,rot", [("glm", 1, 1, 4, 2, 32, 16), ("glm", 2, 3, 3, 1, 16, 8),
                                                             ("helium", 3, 2, 2, 2, 32, 32)])
def test_halved_neighbour_pairs_are_glms_and_heliums_rotary_bit_for_bit(device, module, b, s, heads, kv_heads, hd,
                                                                        rot):
    """``pairs`` with ``fp32_pairs`` off over cos/sin the step interleaves (attention_forms.interleaved_cos):
    GLM's rotary (the first ``rot`` columns of each head) and Helium's (all of them) with their own
    functions, each product and the sum rounded to the dtype as theirs: q and k bit for bit."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    mod = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    from hybridgemm.models.attention_forms import interleaved_cos

    for dtype in ([torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else CPU_DTYPES):
        y, *_ = _operands(b, s, heads, kv_heads, hd, dtype, device, dtype, seed=hd + rot)
        g = torch.Generator().manual_seed(rot)
        angles = torch.rand(b, s, rot // 2, generator=g) * 6.3
        emb = torch.cat([angles, angles], dim=-1)  # the standard layout, as their rotary embeddings give it
        cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
        q, k, _ = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        ref_q, ref_k = mod.apply_rotary_pos_emb(q.view(b, s, heads, hd).transpose(1, 2),
                                                k.view(b, s, kv_heads, hd).transpose(1, 2), cos, sin)
        q2, k2 = tqr.rope_qk(y, interleaved_cos(cos), interleaved_cos(sin), heads, kv_heads, pairs=True,
                             fp32_pairs=False)
        assert torch.equal(q2, ref_q.transpose(1, 2).reshape(b, s, -1)), dtype
        assert torch.equal(k2, ref_k.transpose(1, 2).reshape(b, s, -1)), dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,s,heads,kv_heads,hd", [(1, 1, 4, 2, 32), (2, 3, 3, 1, 16), (3, 2, 2, 2, 6)])
def test_halved_neighbour_pairs_in_fp32_are_ernies_rotary_bit_for_bit(device, b, s, heads, kv_heads, hd):
    """``pairs`` over fp32 cos/sin the step interleaves: Ernie 4.5's rotary (neighbouring pairs from
    the first half of its fp32 cos/sin, q and k rotated as fp32 copies, rounded once) with its own
    function, q and k bit for bit; fp32 cos/sin beside a 16-bit y only where ``fp32_cos`` says so."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    ernie = pytest.importorskip("transformers.models.ernie4_5.modeling_ernie4_5")
    from hybridgemm.models.attention_forms import interleaved_cos

    for dtype in ([torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else CPU_DTYPES):
        y, _, _, _, _, *_ = _operands(b, s, heads, kv_heads, hd, dtype, device, dtype, seed=hd + 3)
        g = torch.Generator().manual_seed(hd + 1)
        angles = torch.rand(b, s, hd // 2, generator=g) * 6.3
        emb = torch.cat([angles, angles], dim=-1)  # fp32 in the standard layout, as its rotary embedding gives it
        cos, sin = emb.cos().to(device), emb.sin().to(device)
        q, k, _ = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        ref_q, ref_k = ernie.apply_rotary_pos_emb(q.view(b, s, heads, hd).transpose(1, 2),
                                                  k.view(b, s, kv_heads, hd).transpose(1, 2), cos, sin)
        icos, isin = interleaved_cos(cos), interleaved_cos(sin)
        if dtype != torch.float32:
            assert "of y's dtype" in tqr.check_rope(y, icos, isin, heads, kv_heads)
        assert tqr.check_rope(y, icos, isin, heads, kv_heads, fp32_cos=True) is None
        q2, k2 = tqr.rope_qk(y, icos, isin, heads, kv_heads, pairs=True)
        assert torch.equal(q2, ref_q.transpose(1, 2).reshape(b, s, -1)), dtype
        assert torch.equal(k2, ref_k.transpose(1, 2).reshape(b, s, -1)), dtype
        # the same shapes with cos/sin of y's dtype: another plan (the pointer type), the dtype's values
        q3, _ = tqr.rope_qk(y, icos.to(dtype), isin.to(dtype), heads, kv_heads, pairs=True)
        ref_q3, _ = ernie.apply_rotary_pos_emb(q.view(b, s, heads, hd).transpose(1, 2),
                                               k.view(b, s, kv_heads, hd).transpose(1, 2), cos.to(dtype),
                                               sin.to(dtype))
        assert torch.equal(q3, ref_q3.transpose(1, 2).reshape(b, s, -1)), dtype


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_cos_rotates_in_fp32_as_olmo2s_rotary(device):
    """The standard rotary (no pairs) over fp32 cos/sin beside a 16-bit y: rotated in fp32 and
    rounded once, bit for bit OLMo 2's function (which promotes q and k to cos's fp32), not each
    product rounded to the dtype as for cos/sin of y's dtype."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    b, s, heads, kv_heads, hd = 2, 3, 3, 1, 32
    for dtype in ([torch.bfloat16, torch.float16] if device == "cuda" else [torch.float16]):
        y, cos, sin, *_ = _operands(b, s, heads, kv_heads, hd, dtype, device, torch.float32, seed=13)
        q, k, _ = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        ref_q, ref_k = olmo2.apply_rotary_pos_emb(q.view(b, s, heads, hd).transpose(1, 2),
                                                  k.view(b, s, kv_heads, hd).transpose(1, 2), cos, sin)
        assert tqr.check_rope(y, cos, sin, heads, kv_heads, fp32_cos=True) is None
        q2, k2 = tqr.rope_qk(y, cos, sin, heads, kv_heads)
        assert torch.equal(q2, ref_q.transpose(1, 2).reshape(b, s, -1)), dtype
        assert torch.equal(k2, ref_k.transpose(1, 2).reshape(b, s, -1)), dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,s,heads,hd,rot,base", [(1, 1, 4, 32, 8, 5), (3, 1, 3, 20, 20, 0), (2, 3, 5, 80, 20, 7),
                                                   (1, 2, 7, 6, 2, 3)])
def test_per_head_layout_is_gpt_neoxs_attention_bit_for_bit(device, b, s, heads, hd, rot, base):
    """``group=1``: y in GPT-NeoX's ``query_key_value`` layout (``[q | k | v]`` per head), rotated
    over the first ``rot`` columns of each head: q and the cached k and v are what GPT-NeoX's
    attention computes with its own functions (its head view, chunk and partial rotary), bit
    for bit; the rest of the cache untouched."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    for dtype in ([torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else CPU_DTYPES):
        y, _, _, keys, values, *_ = _operands(b, s, heads, heads, hd, dtype, device, dtype, seed=hd + rot + 3)
        g = torch.Generator().manual_seed(rot + 1)
        angles = torch.rand(b, s, rot // 2, generator=g) * 6.3
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
        qkv = y.view(b, s, heads, 3 * hd).transpose(1, 2)
        ref_q, ref_k, ref_v = qkv.chunk(3, dim=-1)
        ref_q, ref_k = neox.apply_rotary_pos_emb(ref_q, ref_k, cos, sin)
        pos = torch.tensor([base], dtype=torch.int64, device=device)
        assert tqr.check(y, None, None, cos, sin, keys, values, pos, heads, group=1) is None
        q = tqr.qk_norm_rope_store(y, None, None, cos, sin, keys, values, pos, heads, group=1)
        assert torch.equal(q, ref_q.transpose(1, 2).reshape(b, s, -1)), dtype
        assert torch.equal(keys[:, :, base:base + s], ref_k) and torch.equal(values[:, :, base:base + s], ref_v)
        others = torch.ones(keys.shape[2], dtype=torch.bool)
        others[base:base + s] = False
        assert torch.isnan(keys[:, :, others]).all() and torch.isnan(values[:, :, others]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,s,heads,kv_heads,hd,base", [(1, 1, 4, 2, 32, 5), (3, 1, 6, 3, 16, 0), (2, 3, 8, 1, 8, 7)])
def test_grouped_layout_is_falcons_new_architecture_bit_for_bit(device, b, s, heads, kv_heads, hd, base):
    """``group=heads/kv_heads``: y in Falcon's new-architecture layout (per KV head, its q heads,
    then its k and v) viewed, split and rotated as its attention does: q and the cached k and v
    bit for bit, with Falcon's own rotary function."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    falcon = pytest.importorskip("transformers.models.falcon.modeling_falcon")
    group = heads // kv_heads
    for dtype in ([torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else CPU_DTYPES):
        y, cos, sin, keys, values, *_ = _operands(b, s, heads, kv_heads, hd, dtype, device, dtype, seed=heads + hd)
        grouped = y.view(b, s, kv_heads, group + 2, hd)
        ref_q, ref_k = falcon.apply_rotary_pos_emb(grouped[..., :-2, :].flatten(-3, -2).transpose(1, 2),
                                                   grouped[..., -2, :].transpose(1, 2), cos, sin)
        pos = torch.tensor([base], dtype=torch.int64, device=device)
        assert tqr.check(y, None, None, cos, sin, keys, values, pos, heads, group=group) is None
        q = tqr.qk_norm_rope_store(y, None, None, cos, sin, keys, values, pos, heads, group=group)
        assert torch.equal(q, ref_q.transpose(1, 2).reshape(b, s, -1)), dtype
        in_cache = slice(base, min(base + s, keys.shape[2]))
        n = in_cache.stop - in_cache.start
        assert torch.equal(keys[:, :, in_cache], ref_k[:, :, :n])
        assert torch.equal(values[:, :, in_cache], grouped[..., -1, :].transpose(1, 2)[:, :, :n])


def test_check_refuses_a_grouped_layout_the_heads_do_not_fill():
    y, cos, sin, keys, values, *_ = _operands(2, 1, 4, 2, 8, torch.float32, "cpu", torch.float32)
    base = torch.zeros(1, dtype=torch.int64)
    assert tqr.check(y, None, None, cos, sin, keys, values, base, 4) is None
    assert tqr.check(y, None, None, cos, sin, keys, values, base, 4, group=2) is None
    for group in (1, 3):  # per head needs 4 KV heads; 3 x 2 is not 4
        why = tqr.check(y, None, None, cos, sin, keys, values, base, 4, group=group)
        assert why is not None and f"need {group} x 2 heads (got 4)" in why


def test_check_refuses_one_norm_without_the_other_and_an_odd_or_too_wide_rotary():
    y, cos, sin, keys, values, q_norm, _ = _operands(2, 1, 4, 2, 8, torch.float32, "cpu", torch.float32)
    base = torch.zeros(1, dtype=torch.int64)
    why = tqr.check(y, (q_norm.weight.detach(), 1e-6, 0.0), None, cos, sin, keys, values, base, 4)
    assert why is not None and "together" in why
    for width in (3, 10):  # odd; wider than the head
        c = torch.ones(2, 1, width)
        why = tqr.check(y, None, None, c, c, keys, values, base, 4)
        assert why is not None and "R even, at most 8" in why, why
        assert "R even" in tqr.check_rope(y, c, c, 4, 2)


@pytest.mark.parametrize("name,change,why", [
    ("y", lambda y: y[..., :-2], "columns"),
    ("y", lambda y: y.transpose(0, 1).contiguous().transpose(0, 1), "flatten"),
    ("cos", lambda c: c.float(), "y's dtype"),
    ("cos", lambda c: torch.cat([c, c[..., :2]], dim=-1), "at most 8"),  # wider than a head
    ("heads", lambda h: 0, "columns"),
])
def test_check_rope_names_what_does_not_fit(name, change, why):
    y, cos, sin, *_ = _operands(3, 2, 4, 2, 8, torch.float16, "cpu", torch.float16)
    args = dict(y=y, cos=cos, sin=sin, heads=4, kv_heads=2)
    assert tqr.check_rope(**args) is None
    args[name] = change(args[name])
    if name == "cos":
        args["sin"] = change(sin)
    why_not = tqr.check_rope(**args)
    assert why_not is not None and why in why_not, why_not


_COMPILE_FOR_HOPPER = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_qk_rope as tqr
from hybridgemm.kernels.triton_launch import interpreting

fn = tqr._qk_norm_rope_store_kernel
ptrs = ["*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*bf16", "*bf16", "*i64", "*bf16"]
scalars = ["i32"] * 15 + ["fp32"] * 6
sig = dict(zip(fn.arg_names, ptrs + scalars))
for q_cols, kv_cols, hd, qg, group in ((4096, 4096, 128, 1, 128), (5120, 1024, 128, 1, 128),
                                       (2048, 512, 64, 1, 64),
                                       (2560, 2560, 80, 1, 240),  # GPT-NeoX's per-head layout
                                       (8192, 512, 64, 16, 1152)):  # Falcon-40B's groups
    consts = dict(QB=tqr.next_pow2(q_cols), KB=tqr.next_pow2(kv_cols), HD=hd, ROUND_EACH=False, NORM=True,
                  ROT=hd, PAIRS=False, QG=qg, GROUP=group)
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    try:
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16 if q_cols > 4096 else 8,
                                                                      "enable_fp_fusion": False})
    except (TypeError, KeyError, AttributeError) as e:
        raise SystemExit(f"API: {type(e).__name__}: {e}")
    assert c.asm["cubin"], q_cols
rope = tqr._qk_rope_kernel  # the rotary alone: 16 + 8 heads of 256, bf16 cos/sin
sig = dict(zip(rope.arg_names, ["*bf16"] * 5 + ["i32"] * 6))
consts = dict(QB=4096, KB=2048, HD=256, ROUND_EACH=True, ROT=64, PAIRS=False)  # (and a partial rotary)
src = ASTSource(fn=rope, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": False})
print("compiled")
"""


def test_the_kernel_compiles_for_hopper_at_olmo2_widths():
    """Built for sm_90 by Triton's ptxas (no GPU needed): OLMo 2 7B's (32 + 32 heads of 128),
    13B-like (40 + 8), a small one, Pythia-2.8B's per-head layout (32 heads of 80) and Falcon-40B's
    groups (128 heads of 64 over 8 KV heads), bf16 with
    fp32 cos/sin and factors."""
    from helpers import compile_offline

    compile_offline("import triton\n" + _COMPILE_FOR_HOPPER)
