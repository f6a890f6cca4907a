"""GPT-NeoX's decoder layer on the fused decode step (fusion/models/neox_layer.py): tiny random
GPT-NeoX models decoding over a StaticCache against the same model unpatched (kernels under the
Triton interpreter, the device check widened to the CPU), the calls that keep the layer's own
forward, the reasons a layer is not fused, and the per-head rotary/cache write's torch path
against its kernel. GPU runs: tests/models/test_decode_step_gpu.py (``gpt_neox``)."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from helpers import assert_static_decode_matches, greedy_static_decode
from hybridgemm.kernels import triton_qk_rope as tqr
from hybridgemm.models import decode_checks as checks
from hybridgemm.models import decode_step, neox_layer

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
    assert [n for n, _ in report.skipped] == [f"{layer}.{n}" for layer in LAYERS for n in neox_layer.LAYER_NORM_NAMES]
    assert all(layer.__dict__.get(checks.NORMS_AS_MODULES) == neox_layer.NORMS_AS_MODULES
               for layer in model.gpt_neox.layers)
    return model


def _compare(model, stock, steps, batch):
    assert_static_decode_matches(model, stock, VOCAB, steps, batch)


def _count_stores(mp, stores):
    real = tqr.qk_norm_rope_store
    mp.setattr(tqr, "qk_norm_rope_store", lambda y, qn, kn, cos, *a, per_head=False, **kw: stores.append(
        (tuple(y.shape), cos.shape[-1], per_head)) or real(y, qn, kn, cos, *a, per_head=per_head, **kw))


@pytest.mark.parametrize("parallel,rotary,bias,batch,attention", [
    (True, 0.25, True, 2, "sdpa"),     # Pythia's and GPT-NeoX-20B's form
    (False, 1.0, False, 1, "sdpa"),    # sequential residual, whole-head rotary, no biases
    (True, 0.5, False, 3, "eager"),    # the eager attention function (the decode kernel computes it)
])
def test_gpt_neox_layers_decode_as_stock_does(parallel, rotary, bias, batch, attention, kernels_on_cpu):
    """Each layer takes the static-cache step: its LayerNorms as modules, the Q/K/V GEMM, the
    rotary over the first ``rotary_pct`` of each head and the cache write of its per-head
    [q | k | v] layout in one launch, the attention kernel, dense and dense_4h_to_h with their
    residuals in the epilogue; logits and caches as the unpatched model's."""
    stock = _tiny(attention, use_parallel_residual=parallel, rotary_pct=rotary, attention_bias=bias)
    model = _patched(stock)
    stores = []
    with pytest.MonkeyPatch.context() as mp:
        _count_stores(mp, stores)
        _compare(model, stock, steps=3, batch=batch)
    assert kernels_on_cpu["rope"] == 0 and kernels_on_cpu["norm"] == 0  # (no GEMM prologue or epilogue rotary)
    assert stores == [((batch, 1, 3 * 128), int(32 * rotary), True)] * 2 * 3  # each layer, each new token


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
    assert stores == [((2, 1, 3 * 128), 8, True)] * 2  # layer 0 only, each new token


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
    assert stores == [((1, 1, 3 * 128), 8, True)] and logits[-1].requires_grad  # the new token's, layer 0
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


@pytest.mark.parametrize("batch,seq,heads,hd,rot,base", [(1, 1, 4, 32, 8, 5), (3, 2, 3, 20, 20, 0)])
def test_per_head_rope_store_on_torch_is_its_kernel(batch, seq, heads, hd, rot, base, monkeypatch):
    """``rope_store(per_head=True)``: the torch path (a device the kernel does not run on) and the
    kernel (under the interpreter) give the same q and cache bit for bit, fp32 and fp16."""
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(hd + rot)
        y = torch.randn(batch, seq, 3 * heads * hd, generator=g).to(dtype)
        angles = torch.rand(batch, seq, rot // 2, generator=g) * 6.3
        cos, sin = (torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype))
        results = []
        for on_kernel in (False, True):
            monkeypatch.setattr(checks, "on_kernel_device", lambda x, on=on_kernel: on)
            keys = torch.full((batch, heads, 8, hd), float("nan"), dtype=dtype)
            values = keys.clone()
            q = decode_step.rope_store(y, cos, sin, keys, values, torch.tensor([base]), heads, per_head=True)
            results.append((q, keys, values))
        (q0, k0, v0), (q1, k1, v1) = results
        assert torch.equal(q0, q1) and torch.equal(k0.nan_to_num(7.0), k1.nan_to_num(7.0)) \
            and torch.equal(v0.nan_to_num(7.0), v1.nan_to_num(7.0)), dtype
        assert not k0[:, :, base:base + seq].isnan().any()  # (the new positions written)
