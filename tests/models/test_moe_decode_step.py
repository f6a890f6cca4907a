"""The fused decode step of mixture-of-experts decoder layers (CPU, Triton interpreter): tiny
Qwen3-MoE, Mixtral, Qwen2-MoE (with its shared expert) and OLMoE models, patched, take the step
in every layer (QKV with norm, rotary and cache write in one GEMM, or for OLMoE's q/k norms over
all heads the GEMM with its norm, then those norms, the rotary and the cache write; the
attention, O with the residual; then the post-attention norm, the router and the experts in the grouped kernels,
the residual added in their down launch where the block is a router and experts alone, else
the block called as a module), and their static-cache decode gives stock's logits and cache;
the block step equals the module call bit for bit; a hook on the MoE block still runs;
experts that are not the patched kernels keep the layer's own forward, with the reason in the
report; the patch-time probe refuses blocks that compute something else."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from helpers import assert_trains_as_stock, greedy_static_decode, tiny_moe_lm
from hybridgemm import experts
from hybridgemm.experts import HybridExperts
from hybridgemm.kernels import triton_moe_pairs as moe_pairs
from hybridgemm.models import attention_forms, moe_block
from hybridgemm.models import decode_checks as checks
from hybridgemm.router import HybridTopKRouter

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97


def _tiny(kind: str):  # (Qwen2-MoE's with a gated shared expert beside the routed ones)
    return tiny_moe_lm(kind, VOCAB, 128, 8, 2, head_dim=32, attn_implementation="sdpa")


def _decodes_as_stock(model, stock) -> None:
    """Two greedy static-cache steps of ``model`` fed stock's tokens: stock's logits and cache."""
    with torch.no_grad():
        ref, fed, ref_cache = greedy_static_decode(stock, 2, VOCAB)
        out, _, cache = greedy_static_decode(model, 2, VOCAB, tokens=fed)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for got, want in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_moe_layers_take_the_step_and_decode_as_stock(kind, kernels_on_cpu, monkeypatch):
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    if attention_forms.why_not_fuse_attention(model.model.layers[0].self_attn) is not None:
        pytest.skip(f"no fused attention step with transformers {transformers.__version__}")
    assert report.fused_layers == ["model.layers.0", "model.layers.1"] == report.fused_attention
    # the blocks of a router and experts alone add their output in the experts' launch
    assert report.fused_moe == ([] if kind == "qwen2_moe" else [f"model.layers.{i}.mlp" for i in range(2)])
    assert ("MoE blocks with the residual in the experts' launch" in report.summary()) is (kind != "qwen2_moe")
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers)
    # the routers patched; Qwen2-MoE's one-output shared-expert gates run as the model computes them
    assert all(type(layer.mlp.gate) is HybridTopKRouter for layer in model.model.layers)
    left = ["mlp.shared_expert_gate"] if kind == "qwen2_moe" else []
    assert [n for n, _ in report.skipped] == [f"model.layers.{i}.{m}" for i in range(2) for m in left]
    calls = []
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    _decodes_as_stock(model, stock)
    # both decode steps of both layers ran the fused QKV, with the rotary in its epilogue but for
    # OLMoE's q/k norms over all heads (the norms, rotary and cache write after the GEMM)
    assert kernels_on_cpu["rope"] == (0 if kind == "olmoe" else 2 * 2)
    assert len(calls) == 3  # the block's forward (and its hooks) ran in the prefill and both steps


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_glm4_moe_layers_take_the_step_and_decode_as_stock(qk_norm, kernels_on_cpu, monkeypatch):
    """GLM-4-MoE: q/k/v biases, the rotary over the first half of each head, a dense first layer,
    then a block of shared experts beside the routed ones (called as a module) with DeepSeek-V3's
    router. With per-head q/k norms (use_qk_norm) the attention is the module's computation."""
    from hybridgemm.router import HybridSigmoidRouter

    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    stock = tiny_moe_lm("glm4_moe", VOCAB, 128, 8, 2, head_dim=32, attn_implementation="sdpa")
    # (transformers 5.8: the router returns its logits, the block routes; the router stays stock's)
    routes = isinstance(stock.model.layers[1].mlp.gate(torch.zeros(1, 128)), tuple)
    for layer in stock.model.layers:
        attn = layer.self_attn
        attn.use_qk_norm = qk_norm
        if qk_norm:  # (the modules exist where the config says so: made here, weights not ones)
            attn.q_norm = type(layer.input_layernorm)(32, eps=1e-6)
            attn.k_norm = type(layer.input_layernorm)(32, eps=1e-6)
            with torch.no_grad():
                attn.q_norm.weight.uniform_(0.5, 1.5)
                attn.k_norm.weight.uniform_(0.5, 1.5)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    if attention_forms.why_not_attention_form(type(model.model.layers[0].self_attn)) is not None:
        pytest.skip(f"no fused attention step for GLM-4-MoE with transformers {transformers.__version__}")
    assert report.fused_layers == ["model.layers.0", "model.layers.1"]
    assert report.fused_attention == ([] if qk_norm else ["model.layers.0", "model.layers.1"])
    assert (type(model.model.layers[1].mlp.gate) is HybridSigmoidRouter) is routes
    assert all(layer.__dict__.get(checks.STATIC_STEP) for layer in model.model.layers) is not qk_norm
    skipped = [why for name, why in report.skipped if routes or name != "model.layers.1.mlp.gate"]
    if qk_norm:
        assert skipped and all("use_qk_norm" in why for why in skipped), report.skipped
    else:
        assert skipped == []
    _decodes_as_stock(model, stock)
    # both decode steps of both layers ran the fused QKV with the (partial) rotary in its epilogue
    assert kernels_on_cpu["rope"] == (0 if qk_norm else 2 * 2)


def test_experts_left_unpatched_keep_the_layers_own_forward():
    model = _tiny("qwen3_moe")
    report = hybridgemm.patch(model, mlp=False)
    assert not report.fused_layers
    assert any("experts are not the patched grouped kernels" in why for _, why in report.skipped), report.skipped
    assert not any(type(m) is HybridExperts for m in model.modules())


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe"])
def test_routed_blocks_take_their_norm_and_residual_add_into_the_expert_launches(kind, kernels_on_cpu, monkeypatch):
    """Blocks of router and experts alone: the residual add in the experts' down launch (the
    norm once, apart, for the router and the experts), logits as stock's."""
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    if attention_forms.why_not_fuse_attention(model.model.layers[0].self_attn) is not None:
        pytest.skip(f"no fused attention step with transformers {transformers.__version__}")
    assert all(layer.mlp.__dict__.get(moe_block.FUSED_BLOCK) for layer in model.model.layers)
    downs = []
    pairs_down = moe_pairs.pairs_down
    monkeypatch.setattr(moe_pairs, "pairs_down", lambda *a, **kw: downs.append(kw.get("residual", a[5:6])) or
                        pairs_down(*a, **kw))
    with torch.no_grad():
        ref, fed, _ = greedy_static_decode(stock, 2, VOCAB)
        out, _, _ = greedy_static_decode(model, 2, VOCAB, tokens=fed)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # both decode steps of both layers: the residual into the pair-major down (the prefill's 12
    # pairs take the grouped kernels, the residual in their slot sum)
    assert sum(1 for r in downs if isinstance(r, torch.Tensor) or (isinstance(r, tuple) and r and r[0] is not None)) \
        == 2 * 2
    # the prefill and both steps, both layers: QKV's norm in its GEMM (the router's GEMM takes none)
    assert kernels_on_cpu["norm"] == 3 * 2


def test_olmoe_with_its_qkv_clamped_keeps_its_own_forward(kernels_on_cpu, monkeypatch):
    """OLMoE's clamp of Q/K/V (config.clip_qkv), which the step does not compute and which its
    forward applies in place to each of Q, K and V: set when patched, its Q/K/V are fused but
    its layers are not, the report says why; set after patching, each call runs the layer's own
    forward (none takes the fused QKV with its norm). Logits as stock's, which the clamp changes."""
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    clamp = 0.05  # (about a twentieth of q's and k's magnitude, a quarter of v's: the clamp shows)
    stock = _tiny("olmoe")
    stock.config.clip_qkv = clamp
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    reasons = dict(report.skipped)
    assert report.fused_layers == [] and report.fused_qkv == [f"model.layers.{i}.self_attn" for i in range(2)]
    for i in range(2):
        assert f"clamped to config.clip_qkv ({clamp})" in reasons[f"model.layers.{i}"]
    later = copy.deepcopy(stock)
    later.config.clip_qkv = None
    assert hybridgemm.patch(later).fused_layers == ["model.layers.0", "model.layers.1"]
    later.config.clip_qkv = clamp
    unclamped = copy.deepcopy(stock)
    unclamped.config.clip_qkv = None
    with torch.no_grad():
        ref, fed, _ = greedy_static_decode(stock, 2, VOCAB)
        off, _, _ = greedy_static_decode(unclamped, 2, VOCAB, tokens=fed)
        for m in (model, later):
            kernels_on_cpu["norm"] = 0
            out, _, _ = greedy_static_decode(m, 2, VOCAB, tokens=fed)
            for a, b in zip(out, ref):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            assert kernels_on_cpu["norm"] == 0  # (the step's QKV takes its norm; the layer's own forward none)
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(off, ref))


@pytest.mark.parametrize("clamped", ["before", "after"])
def test_olmoe_with_its_qkv_clamped_trains_as_stock(clamped):
    """Its forward clamps the fused Q/K/V's parts in place, the clamp set before or after
    patching: with gradients wanted, logits and the gradients of its stock parameters (the Q/K/V
    rows among them) as the unpatched model's (the parts handed out as copies then)."""
    stock = _tiny("olmoe")
    stock.config.clip_qkv = 0.05 if clamped == "before" else None
    model = copy.deepcopy(stock)
    assert hybridgemm.patch(model).fused_qkv == [f"model.layers.{i}.self_attn" for i in range(2)]
    stock.config.clip_qkv = model.config.clip_qkv = 0.05
    assert sum(n.endswith(("q_proj.weight", "v_proj.weight")) for n, _ in model.named_parameters()) == 4
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    assert_trains_as_stock(model, stock, ids, logits_atol=1e-5, grad_atol=1e-6)


def test_blocks_that_compute_more_are_called_as_modules(kernels_on_cpu, monkeypatch):
    """Qwen2-MoE's shared expert, a subclass whose forward scales the experts' output, and a
    hook on the experts (whose forward the fused block skips): the block's own forward runs
    (and the decode still equals stock's)."""
    shared = _tiny("qwen2_moe")
    hybridgemm.patch(shared)
    why = moe_block.why_not_fuse_block(shared.model.layers[0].mlp)
    assert "shared_expert" in why and not shared.model.layers[0].mlp.__dict__.get(moe_block.FUSED_BLOCK)
    block = _tiny("qwen3_moe")
    hybridgemm.patch(block)
    mlp = block.model.layers[0].mlp
    assert moe_block.why_not_fuse_block(mlp) is None
    cls = type(mlp)
    mlp.__class__ = type("Scaled", (cls,), {"forward": lambda self, h: 2 * cls.forward(self, h)})
    assert "returns more" in moe_block.why_not_fuse_block(mlp)
    mlp.__class__ = cls
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    stock = _tiny("qwen3_moe")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    calls = []
    model.model.layers[1].mlp.experts.register_forward_hook(lambda m, a, out: calls.append(1))
    with torch.no_grad():
        ref, fed, _ = greedy_static_decode(stock, 2, VOCAB)
        out, _, _ = greedy_static_decode(model, 2, VOCAB, tokens=fed)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert len(calls) == 3  # the experts (and their hook) ran in the prefill and both steps


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_block_step_equals_the_module_call_bit_for_bit(kind, monkeypatch):
    """``block_step`` against ``h + block(norm(h))`` called as modules, on the kernel path: one
    token and three, a non-contiguous h; and with the norm's output of another dtype than h
    (an fp32 norm and block in an fp16 layer), where the residual cannot go into the kernel."""
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    model = _tiny(kind)
    hybridgemm.patch(model)
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tokens in (1, 3):
            h = torch.randn(1, tokens, 256, generator=g)[..., ::2]  # hidden 128, every other column
            got = moe_block.block_step(layer, h)
            assert got is not None and torch.equal(got, h + layer.mlp(layer.post_attention_layernorm(h)))
        h = torch.randn(1, 1, 128, generator=g).half()
        got = moe_block.block_step(layer, h)  # (the norm's fp32 weight gives fp32 rows)
        assert got.dtype == torch.float32 and torch.equal(got, h + layer.mlp(layer.post_attention_layernorm(h)))


def test_the_probe_refuses_blocks_that_compute_something_else():
    """A block that routes fp32 copies of the tokens, one that returns zeros for one token: both
    refused; the probe runs on the CPU whatever the default device (a model built on meta)."""
    model = _tiny("qwen3_moe")
    hybridgemm.patch(model)
    mlp = model.model.layers[0].mlp
    cls = type(mlp)

    def casts(self, h):
        b, s, d = h.shape
        r = h.reshape(-1, d)
        _, w, ids = self.gate(r.float())
        return self.experts(r, ids, w).reshape(b, s, d)

    def one_token_zeros(self, h):
        return torch.zeros_like(h) if h.shape[0] * h.shape[1] == 1 else cls.forward(self, h)

    try:
        mlp.__class__ = type("Casts", (cls,), {"forward": casts})
        with torch.no_grad():
            mlp.gate.weight.data = mlp.gate.weight.data.bfloat16()  # a bf16 router: the probe's tokens are bf16
            assert "route the tokens" in moe_block.why_not_fuse_block(mlp)
            mlp.gate.weight.data = mlp.gate.weight.data.float()
        mlp.__class__ = type("OneTokenZeros", (cls,), {"forward": one_token_zeros})
        assert "once each" in moe_block.why_not_fuse_block(mlp)
    finally:
        mlp.__class__ = cls
    with torch.device("meta"):
        assert moe_block.why_not_fuse_block(mlp) is None
