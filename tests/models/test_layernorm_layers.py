"""GPT-NeoX's and Falcon's decoder layers on the fused decode step
(fusion/models/layernorm_layers.py): tiny random models decoding over a StaticCache against the
same model unpatched (kernels under the Triton interpreter, the device check widened to the CPU),
the calls that keep the layer's own forward, the reasons a layer is not fused, and the grouped
rotary/cache write's torch path against its kernel. GPU runs: tests/models/test_decode_step_gpu.py
(``gpt_neox``)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

import hybridgemm
from helpers import assert_static_decode_matches, greedy_static_decode
from hybridgemm.kernels import triton_qk_rope as tqr
from hybridgemm.models import attention_forms, fused_pieces, layernorm_layers, legacy_falcon
from hybridgemm.models import decode_checks as checks
from hybridgemm.perf import e2e_models as hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97
LAYERS = ["gpt_neox.layers.0", "gpt_neox.layers.1"]


def _tiny(attention: str = "sdpa", **extra):
    config = transformers.GPTNeoXConfig(hidden_size=128, intermediate_size=96, num_attention_heads=4,
                                        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    with torch.no_grad():  # its LayerNorms start as the identity: others, so that they show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(*((0.5, 1.5) if name.endswith("weight") else (-0.5, 0.5)))
    return model


def _patched(stock):
    """A patched copy of ``stock`` whose every layer is fused and takes the static-cache step (a
    transformers release whose GPT-NeoX layer or attention is no longer a form the step computes
    fails here, with the report's reason)."""
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    assert report.fused_layers == LAYERS and report.fused_attention == LAYERS, \
        f"transformers {transformers.__version__}: {report.skipped}"
    # what stays unfused: the LayerNorms, which the step calls as the modules they are
    assert [n for n, _ in report.skipped] == [f"{layer}.{n}" for layer in LAYERS for n in checks.LAYER_NORM_NAMES]
    mark = layernorm_layers.FAMILIES["GPTNeoXLayer"].norms_as_modules
    assert all(layer.__dict__.get(checks.NORMS_AS_MODULES) == mark for layer in model.gpt_neox.layers)
    return model


def _compare(model, stock, steps, batch):
    assert_static_decode_matches(model, stock, VOCAB, steps, batch)


def _count_stores(mp, stores):
    real = tqr.qk_norm_rope_store
    mp.setattr(tqr, "qk_norm_rope_store", lambda y, qn, kn, cos, *a, group=0, **kw: stores.append(
        (tuple(y.shape), cos.shape[-1], group)) or real(y, qn, kn, cos, *a, group=group, **kw))


@pytest.mark.parametrize("parallel,rotary,bias,batch,attention,act", [
    (True, 0.25, True, 2, "sdpa", "gelu"),        # Pythia's form
    (True, 0.25, True, 2, "sdpa", "gelu_fast"),   # GPT-NeoX-20B's MLP: the tanh GELU factored
    (False, 1.0, False, 1, "sdpa", "gelu"),       # sequential residual, whole-head rotary, no biases
    (True, 0.5, False, 3, "eager", "gelu"),       # the eager attention function (the decode kernel computes it)
])
def test_gpt_neox_layers_decode_as_stock_does(parallel, rotary, bias, batch, attention, act, kernels_on_cpu):
    """Each layer takes the static-cache step: its LayerNorms as modules, the Q/K/V GEMM with
    the rotary over the first ``rotary_pct`` of each head and the cache write of its per-head
    [q | k | v] weight rows in its epilogue, the attention kernel, dense and dense_4h_to_h with
    their residuals in the epilogue (dense_h_to_4h's GELU in its own); logits and caches as the
    unpatched model's."""
    stock = _tiny(attention, use_parallel_residual=parallel, rotary_pct=rotary, attention_bias=bias, hidden_act=act)
    model = _patched(stock)
    stores = []
    with pytest.MonkeyPatch.context() as mp:
        _count_stores(mp, stores)
        _compare(model, stock, steps=3, batch=batch)
    assert kernels_on_cpu["rope"] == 2 * 3 and kernels_on_cpu["norm"] == 0  # each layer, each new token
    assert stores == []  # (no launch of its own)


def test_gpt_neox_parallel_layers_add_the_attention_then_x_in_dense_4h_to_h(kernels_on_cpu, monkeypatch):
    """Eager, ``(mlp + a) + x`` as stock rounds it: dense_4h_to_h's GEMM gets the attention's
    output (dense's GEMM) as its first residual and the layer's input as its second (tiny fp32
    models cannot show the order in their logits; tests/kernels/test_layer_fusion_kernels.py pins
    the roundings)."""
    stock = _tiny(use_parallel_residual=True)
    model = _patched(stock)
    seen, adds = {}, []
    real_step, real_gemm = layernorm_layers.layer_step, fused_pieces._linear_residual

    def step(layer, x, *args):
        seen["x"] = x
        return real_step(layer, x, *args)

    def gemm(x, weight, bias, residual, *args, residual2=None):
        y = real_gemm(x, weight, bias, residual, *args, residual2=residual2)
        adds.append((weight, residual is not None and residual is seen.get("a"),
                     residual2 is not None and residual2 is seen.get("x")))
        seen["a"] = y
        return y

    monkeypatch.setattr(layernorm_layers, "layer_step", step)
    monkeypatch.setattr(fused_pieces, "_linear_residual", gemm)
    _compare(model, stock, steps=2, batch=1)
    dense = {id(layer.attention.dense.weight) for layer in model.gpt_neox.layers}
    down = {id(layer.mlp.dense_4h_to_h.weight) for layer in model.gpt_neox.layers}
    assert len(adds) == 2 * 2 * 2  # dense then dense_4h_to_h, each layer, each new token
    assert all(id(w) in dense and not first and not second for w, first, second in adds[0::2]), adds
    assert all(id(w) in down and first and second for w, first, second in adds[1::2]), adds
    assert kernels_on_cpu["second"] == 0


@pytest.mark.parametrize("family", ["gpt_neox", "falcon"])
def test_parallel_layers_compiled_take_dense_and_dense_4h_to_h_in_one_launch(family, kernels_on_cpu, monkeypatch):
    """The pieces as torch.compile calls them (each custom op, no Dynamo): a parallel layer's
    dense and dense_4h_to_h are one split-K launch with the attention's output as its second
    product (GPT-NeoX with biases, Falcon's multi-query layer without), logits and caches as the
    unpatched model's; the pieces' eager bodies, as eager calls run them, take none."""
    if family == "falcon":
        if not _falcon_form_taken():
            pytest.skip(f"transformers {transformers.__version__}: its Falcon attention is another form")
        stock = _falcon(multi_query=True, parallel_attn=True, bias=False)
        model = copy.deepcopy(stock)
        assert hybridgemm.patch(model).fused_layers == FALCON_LAYERS
    else:
        stock = _tiny(use_parallel_residual=True, attention_bias=True)
        model = _patched(stock)
    _compare(model, stock, steps=2, batch=2)
    assert kernels_on_cpu["second"] == 0
    monkeypatch.setattr(fused_pieces, "_compiled", lambda op, eager, *args: op(*args))
    _compare(model, stock, steps=2, batch=2)
    assert kernels_on_cpu["second"] == 2 * 2  # each layer, each new token


@pytest.mark.parametrize("rotary", [0.25, 1.0])
def test_gpt_neox_qkv_the_table_runs_apart_rotates_in_one_launch_after_it(rotary, kernels_on_cpu):
    """Where the table's Q/K/V GEMM is not split-K, the GEMM runs as the table says and the
    rotary and cache write of its per-head layout follow in one launch; logits and caches as
    the unpatched model's."""
    stock = _tiny(rotary_pct=rotary)
    model = _patched(stock)
    kernels_on_cpu["config"] = None  # no split-K decision: nothing carries the epilogue
    stores = []
    with pytest.MonkeyPatch.context() as mp:
        _count_stores(mp, stores)
        _compare(model, stock, steps=3, batch=2)
    assert kernels_on_cpu["rope"] == 0
    assert stores == [((2, 1, 3 * 128), int(32 * rotary), 1)] * 2 * 3  # each layer, each new token


def test_other_calls_run_the_layers_own_forward(kernels_on_cpu):
    """generate() over its dynamic cache, and a static-cache call with a hook on the attention
    module (which the step does not call): the layer's own forward over its patched linears,
    tokens and logits as stock's, the hook run."""
    stock = _tiny()
    model = _patched(stock)
    stores = []
    ids = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        _count_stores(mp, stores)
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, stock.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
        assert stores == []
        seen = []
        model.gpt_neox.layers[1].attention.register_forward_hook(lambda mod, args, out: seen.append(1))
        _compare(model, stock, steps=2, batch=2)
    assert len(seen) == 1 + 2  # the prompt and each new token
    assert kernels_on_cpu["rope"] == 2 and stores == []  # layer 0 only, each new token


def test_trainable_layernorms_keep_the_layers_own_forward(kernels_on_cpu):
    """Frozen linears, a trainable LayerNorm (LN tuning) in the second layer and gradients
    enabled: the first layer (nothing to train, no gradient wanted of its input) takes the step,
    the second, whose GEMMs would record no gradient, does not; the logits keep their graph back
    to the norm."""
    model = _patched(_tiny())
    for p in model.parameters():
        p.requires_grad_(False)
    norm = model.gpt_neox.layers[1].post_attention_layernorm
    norm.weight.requires_grad_(True)
    stores = []
    with pytest.MonkeyPatch.context() as mp:
        _count_stores(mp, stores)
        logits, _, _ = greedy_static_decode(model, 1, VOCAB, None, 1)
    assert kernels_on_cpu["rope"] == 1 and stores == [] and logits[-1].requires_grad  # the new token's, layer 0
    logits[-1].sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


def test_a_layer_the_step_cannot_compute_is_reported_and_left_alone():
    """rotary_ndims of an odd count of columns (a rotary_pct the kernel cannot pair), and a
    use_parallel_residual that is no bool: the layer stays unfused, the report says why, the
    model's output is the unpatched one's."""
    stock = _tiny(rotary_pct=0.1)  # 3 columns of 32
    model = copy.deepcopy(stock)
    model.gpt_neox.layers[1].use_parallel_residual = 1
    report = hybridgemm.patch(model)
    assert report.fused_layers == []
    reasons = dict(report.skipped)
    assert "rotary_ndims (3) is not an even count of columns within a head of 32" in reasons[LAYERS[0]]
    assert "use_parallel_residual is 1, not a bool" in reasons[LAYERS[1]]
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch,seq,heads,kv_heads,group,hd,rot,base", [
    (1, 1, 4, 4, 1, 32, 8, 5), (3, 2, 3, 3, 1, 20, 20, 0), (2, 1, 6, 2, 3, 16, 16, 4)])
def test_grouped_rope_store_on_torch_is_its_kernel(batch, seq, heads, kv_heads, group, hd, rot, base, monkeypatch):
    """``rope_store(group=...)``: the torch path (a device the kernel does not run on) and the
    kernel (under the interpreter) give the same q and cache bit for bit, fp32 and fp16, per
    head (GPT-NeoX's) and in groups per KV head (Falcon's new architecture)."""
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(hd + rot)
        y = torch.randn(batch, seq, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
        angles = torch.rand(batch, seq, rot // 2, generator=g) * 6.3
        cos, sin = (torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype))
        results = []
        for on_kernel in (False, True):
            monkeypatch.setattr(checks, "on_kernel_device", lambda x, on=on_kernel: on)
            keys = torch.full((batch, kv_heads, 8, hd), float("nan"), dtype=dtype)
            values = keys.clone()
            q = fused_pieces.rope_store(y, cos, sin, keys, values, torch.tensor([base]), heads, group=group)
            results.append((q, keys, values))
        (q0, k0, v0), (q1, k1, v1) = results
        assert torch.equal(q0, q1) and torch.equal(k0.nan_to_num(7.0), k1.nan_to_num(7.0)) \
            and torch.equal(v0.nan_to_num(7.0), v1.nan_to_num(7.0)), dtype
        assert not k0[:, :, base:base + seq].isnan().any()  # (the new positions written)


# ------------------------------------------------------------------------------------- Falcon

FALCON_LAYERS = ["transformer.h.0", "transformer.h.1"]


def _falcon(attention: str = "sdpa", **extra):
    config = transformers.FalconConfig(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB,
                                       max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _falcon_form_taken() -> bool:
    """Is the installed transformers' Falcon attention a form the step computes (5.8-5.25's)?"""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    return attention_forms.why_not_attention_form(FalconAttention) is None


def _falcon_caches_copies(model) -> bool:
    """Does the installed transformers' Falcon attention (5.8-5.24's) cache K and V copied to
    every query head for this model, a new architecture with fewer KV heads than heads?"""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    config = model.config
    return attention_forms.attention_form(FalconAttention).split_heads_falcon and config.new_decoder_architecture \
        and config.num_kv_heads < config.num_attention_heads


@pytest.mark.parametrize("extra,norms,group", [
    (dict(multi_query=True, parallel_attn=True, bias=False), ("input_layernorm",), 0),      # Falcon-7B's form
    # 40B's, 180B's: two norms (num_ln_in_parallel_attn unset: the layer makes it 2), eager attention
    (dict(new_decoder_architecture=True, num_kv_heads=2, bias=False, attention="eager"), ("ln_attn", "ln_mlp"), 2),
    (dict(new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=1, bias=True),  # one norm
     ("input_layernorm",), 4),
    (dict(multi_query=False, parallel_attn=False, num_kv_heads=4, bias=True),               # sequential, per head
     ("input_layernorm", "post_attention_layernorm"), 1),
    (dict(multi_query=True, parallel_attn=False, bias=False, attention="eager"),             # sequential, one KV head
     ("input_layernorm", "post_attention_layernorm"), 0),
    # the new architecture with a KV head per query head (its groups of one)
    (dict(new_decoder_architecture=True, num_kv_heads=4, bias=True), ("ln_attn", "ln_mlp"), 1),
])
@pytest.mark.parametrize("attention_kernel", [True, False])
def test_falcon_layers_decode_as_stock_does(extra, norms, group, attention_kernel, kernels_on_cpu):
    """Falcon's layer forms: its norms as modules (one shared by the attention and the MLP, two
    of their own, or sequential), its Q/K/V layout (multi-query's one KV head, the new
    architecture's groups per KV head, per head) rotated and cached in one launch, the parallel
    residual as stock's (mlp + a) + x. Logits and caches as the unpatched model's, with the
    decode attention kernel and without it (batch 3: the attention function over the cache, or
    SDPA over the query heads of a KV head as rows). Under a transformers whose Falcon attention
    is another form, or whose cache the step does not write (5.8-5.24's new architecture with
    fewer KV heads), the report says so and the model is left computing what it did."""
    stock = _falcon(**extra)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    if not _falcon_form_taken() or _falcon_caches_copies(stock):
        reasons = ("copied to each of its query heads",) if _falcon_form_taken() else \
            ("is not an attention this step computes", "is not a decoder layer this step computes")
        unfused = [why for name, why in report.skipped if name in FALCON_LAYERS]
        assert report.fused_layers == [] and len(unfused) == 2 and all(
            any(r in why for r in reasons) for why in unfused), report.skipped
        assert_static_decode_matches(model, stock, VOCAB, 2, 2)
        return
    assert report.fused_layers == FALCON_LAYERS and report.fused_attention == FALCON_LAYERS, report.skipped
    assert sorted(n for n, _ in report.skipped) == [f"{layer}.{n}" for layer in FALCON_LAYERS for n in sorted(norms)]
    stores, attended = [], []
    with pytest.MonkeyPatch.context() as mp:
        _count_stores(mp, stores)
        real_takes = checks.kernel_takes
        mp.setattr(checks, "kernel_takes", lambda *a: attended.append(1) or attention_kernel and real_takes(*a))
        assert_static_decode_matches(model, stock, VOCAB, 3, 2 if attention_kernel else 3)
    assert kernels_on_cpu["rope"] == 2 * 3 and stores == []  # rotated and cached in the Q/K/V epilogue
    # each layer's decode steps asked the kernel, but for the eager scores of 5.8-5.24's Falcon
    # attention (legacy_falcon.eager_attention: softmax in the activations' dtype, not the kernel's)
    eager_apart = attention_forms.attention_form(type(model.transformer.h[0].self_attention)).split_heads_falcon \
        and stock.config._attn_implementation == "eager"
    assert len(attended) == (0 if eager_apart else 2 * 3)
    assert [layer.self_attention.query_key_value.weight.shape[0] for layer in model.transformer.h] == \
        [(4 + 2 * _falcon_kv_heads(stock.config)) * 32] * 2
    if group:  # the rows grouped per KV head, as the kernel reads them
        assert forms_group(model.transformer.h[0].self_attention) == group


def _falcon_kv_heads(config) -> int:
    return config.num_kv_heads if config.new_decoder_architecture or not config.multi_query else 1


def forms_group(attn) -> int:
    return attention_forms.qkv_group(attn, attention_forms.attention_form(type(attn)))


def _attention_fp64(q, k, v, mask):
    """softmax(q k^T / sqrt(hd) + mask) v in fp64, K and V broadcast over the query heads; [B, S, heads, hd]."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [1, 5])
def test_legacy_falcon_functions_compute_its_sdpa_and_eager_branches(kv_heads):
    """The functions standing in for transformers 5.8-5.24's Falcon attention branches
    (legacy_falcon), over a cache of one KV head (multi-query, broadcast) or one per query head:
    SDPA with a boolean mask, with none (causal), eager with an additive mask, against fp64, out
    as [B, S, heads, hd]; eager's scores in the queries' dtype (that branch's softmax dtype)."""
    torch.manual_seed(1)
    b, heads, s, length, hd = 2, 5, 3, 7, 24  # (sqrt(hd) not a power of two: the division rounds)
    module = SimpleNamespace(head_dim=hd, is_causal=True)
    q = torch.randn(b, heads, s, hd)
    k, v = torch.randn(b, kv_heads, length, hd), torch.randn(b, kv_heads, length, hd)
    allowed = torch.rand(b, 1, s, length) > 0.3
    allowed[..., 0] = True  # (every row attends somewhere)
    additive = torch.zeros(b, 1, s, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    sdpa = legacy_falcon.FUNCTIONS.get_interface("sdpa", None)
    eager = legacy_falcon.FUNCTIONS.get_interface("eager", None)
    assert sdpa is legacy_falcon.sdpa_attention and eager is legacy_falcon.eager_attention
    assert attention_forms.computes_sdpa(sdpa) and not attention_forms.computes_sdpa(eager)
    out, none = sdpa(module, q, k, v, allowed, scaling=0.5)  # (SDPA's own scale, as that branch)
    assert none is None and out.shape == (b, s, heads, hd) and out.is_contiguous()
    torch.testing.assert_close(out.double(), _attention_fp64(q, k, v, allowed), rtol=1e-5, atol=1e-5)
    causal = torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s)
    out, _ = sdpa(module, q, k[:, :, :s], v[:, :, :s], None)
    torch.testing.assert_close(out.double(), _attention_fp64(q, k[:, :, :s], v[:, :, :s], causal), rtol=1e-5,
                               atol=1e-5)
    out, scores = eager(module, q, k, v, additive)
    assert out.shape == (b, s, heads, hd) and scores.shape == (b, heads, s, length)
    torch.testing.assert_close(out.double(), _attention_fp64(q, k, v, additive), rtol=1e-5, atol=1e-5)
    # in bf16, bit for bit the branch's own ops: the scores divided in place, softmax in bf16
    q, k, v, additive = q.bfloat16(), k.bfloat16(), v.bfloat16(), additive.bfloat16()
    out, scores = eager(module, q, k, v, additive)
    want = q @ k.transpose(-1, -2)
    want /= math.sqrt(hd)
    want = torch.nn.functional.softmax(want + additive, dim=-1, dtype=torch.bfloat16)
    assert scores.dtype == torch.bfloat16 and torch.equal(scores, want)
    assert torch.equal(out, (want @ v).transpose(1, 2))


def test_falcon_with_alibi_or_attention_weights_keeps_its_own_forward(kernels_on_cpu):
    """ALiBi (no rotary): the layer is not fused, the report says why. A decode call over a
    static cache asking for the attention weights: the fused layer's own forward, which returns
    them (eager attention), as stock's."""
    stock = _falcon(alibi=True, multi_query=True, parallel_attn=True)
    report = hybridgemm.patch(copy.deepcopy(stock))
    reasons = dict(report.skipped)
    assert report.fused_layers == [] and all(n in reasons for n in FALCON_LAYERS)
    assert all(("ALiBi" if _falcon_form_taken() else "this step computes") in reasons[n] for n in FALCON_LAYERS)
    if not _falcon_form_taken():
        return
    stock = _falcon("eager", multi_query=True, parallel_attn=True)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    outputs = []
    stores = []
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        _count_stores(mp, stores)
        for m in (model, stock):
            api, cache = hf.forward_api(m), hf.static_cache(m, 1, 16)
            hf.cached_forward(m, api, torch.arange(3, 7).view(1, 4), cache, torch.arange(4))
            kw = {api.cache_kw: cache, "use_cache": True, "position_ids": torch.tensor([[4]])}
            if api.cache_position:
                kw["cache_position"] = torch.tensor([4])
            outputs.append(m(input_ids=torch.tensor([[9]]), output_attentions=True, **kw))
    got, want = outputs
    assert stores == [] and all(a is not None and a.shape == (1, 4, 1, 16) for a in got.attentions)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
