"""Decoder-layer fusion (fusion/models/decoder_layer.py) on tiny random-weight transformers models:
which layers ``patch`` fuses and why not, the fused forward against the stock model (its
kernels run under the Triton interpreter here, with the device check widened to the CPU),
the fallbacks, and unpatch. The real models run on the GPU (tests/models/test_models_gpu.py and
``hybridgemm bench --e2e``).
"""

from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import hybridgemm
from hybridgemm import dispatch
from hybridgemm.kernels import triton_glu, triton_splitk
from hybridgemm.linear_layer import HybridLinear
from hybridgemm.models import attention_forms, fused_pieces
from hybridgemm.models import decode_checks as checks
from hybridgemm.models import decoder_layer as dl

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97
SPLITK = triton_splitk.TritonSplitKConfig(16, 32, 32, split_k=2, num_warps=4, num_stages=2, fused_reduce=True)


def _tiny(kind: str, layers: int = 2):
    kw = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=64)
    if kind == "qwen3":
        kw["head_dim"] = 16  # hidden / heads, as the others (its config's default, 128, makes q/k/v 8x wider)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[kind](**kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The fused path on CPU tensors (interpreter), the norm prologue fused whatever the config
    (conftest.kernels_on_cpu); counts the fused kernel calls."""
    calls = []
    monkeypatch.setattr(checks, "on_kernel_device", lambda x: True)
    monkeypatch.setattr(dispatch, "splitk_config", lambda x2, w, b, out, weight_format="": SPLITK)
    monkeypatch.setattr(triton_splitk, "prologue_fits", lambda config, itemsize: True)
    real_run, real_glu = triton_splitk.run, triton_glu.glu

    def run(cfg, *a, norm=None, residual=None, **kw):
        calls.append("norm" if norm is not None else "residual" if residual is not None else "plain")
        return real_run(cfg, *a, norm=norm, residual=residual, **kw)

    def glu(*a, norm=None, **kw):
        calls.append("glu+norm" if norm is not None else "glu")
        return real_glu(*a, norm=norm, **kw)

    monkeypatch.setattr(triton_splitk, "run", run)
    monkeypatch.setattr(triton_glu, "glu", glu)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_fused_layers_match_the_stock_model(kind, kernels_on_cpu):
    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    assert report.fused_layers == ["model.layers.0", "model.layers.1"]
    layer = model.model.layers[0]
    assert isinstance(layer, type(stock.model.layers[0])) and isinstance(layer, dl.HybridDecoderLayer)
    assert type(layer.self_attn.o_proj) is HybridLinear
    ids = torch.randint(0, VOCAB, (2, 5))  # 10 rows: the decode path (<= 16)
    state = _module_state(model)
    with torch.no_grad():
        ref, out = stock(ids).logits, model(ids).logits
    # per layer: QKV with the norm, O with the residual, gate/up with the norm, down with the residual
    assert kernels_on_cpu == ["norm", "residual", "glu+norm", "residual"] * 2
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert _module_state(model) == state  # the step passes nothing between its pieces on modules
    with torch.no_grad():
        tokens = model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref_tokens = stock.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)


def test_a_gemm_the_table_gives_another_backend_runs_the_norm_and_add_apart(kernels_on_cpu, monkeypatch):
    stock = _tiny("llama")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    monkeypatch.setattr(dispatch, "splitk_config", lambda *a: None)
    norms = []
    real = fused_pieces.prologue_norm
    monkeypatch.setattr(fused_pieces, "prologue_norm", lambda x, *operand: norms.append(x.shape) or real(x, *operand))
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)
    assert kernels_on_cpu == ["glu+norm"] * 2 and len(norms) == 2  # the QKV norm apart; gate/up keeps its own


@pytest.mark.parametrize("why", ["grad", "frozen-attention", "cpu", "fp16", "autocast", "mode", "hook"])
def test_outside_decode_inference_the_stock_forward_runs(why, kernels_on_cpu, monkeypatch):
    # (more rows than the decode step takes: tests/models/test_prefill_step.py)
    stock = _tiny("qwen2")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    ids = torch.randint(0, VOCAB, (1, 4))
    if why == "frozen-attention":  # only the MLPs train: the layer must still record their gradients
        for layer in model.model.layers:
            layer.self_attn.requires_grad_(False)
    if why == "cpu":
        monkeypatch.setattr(checks, "on_kernel_device", lambda x: x.is_cuda)
    if why == "fp16":  # fp16's range could not hold x * g (see decoder_layer's docstring)
        model.half()
        stock = copy.deepcopy(stock).half()
    if why == "hook":  # the fused path would not call it: each layer with a hooked part keeps its forward
        for i, layer in enumerate(model.model.layers):
            (layer.mlp.down_proj if i else layer.input_layernorm).register_forward_hook(lambda mod, args, out: None)
    grad = why in ("grad", "frozen-attention")
    with torch.set_grad_enabled(grad), torch.autocast("cpu", enabled=why == "autocast"), \
            hybridgemm.mode("batch_invariant" if why == "mode" else "default"):
        out = model(ids).logits
        ref = stock(ids).logits
    assert not any(c in ("norm", "residual", "glu+norm") for c in kernels_on_cpu), kernels_on_cpu
    tol = 1e-2 if why in ("fp16", "autocast") else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if grad:
        out.sum().backward()
        assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_unpatch_restores_the_stock_classes_and_state():
    model = _tiny("llama")
    classes = {n: type(m) for n, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = hybridgemm.patch(model)
    assert list(model.state_dict()) == list(before)
    restored = hybridgemm.unpatch(model)
    assert sorted(restored) == sorted(report.patched)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not any(isinstance(m, dl.HybridDecoderLayer) for m in model.modules())


def test_what_is_not_fused_and_why(monkeypatch):
    model = _tiny("llama", layers=1)
    report = hybridgemm.patch(model, layers=False)
    assert report.fused_layers == [] and not any("decoder layer" in why for _, why in report.skipped)
    hybridgemm.unpatch(model)

    report = hybridgemm.patch(model, mlp=False)
    assert report.fused_layers == []
    assert ("model.layers.0", "decoder layer not fused: its MLP's gate/up are not fused into one GEMM") \
        in report.skipped
    hybridgemm.unpatch(model)

    monkeypatch.setattr(checks, "_LAYER_BODY", checks._LAYER_BODY + ("hidden_states=self.extra(hidden_states)",))
    report = hybridgemm.patch(model)
    assert report.fused_layers == [] and any("is not a decoder layer this step computes" in why
                                             for _, why in report.skipped)
    hybridgemm.unpatch(model)

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=1, n_head=4,
                                                                n_positions=32)).eval()
    report = hybridgemm.patch(gpt2)
    # a decoder layer of a family the step does not compute: listed with its class, not fused
    assert report.fused_layers == [] and [(n, why) for n, why in report.skipped if "decoder layer" in why] == [
        ("transformer.h.0", "decoder layer not fused: its family (GPT2Block) is not supported by the fused decode "
                            "step (it supports LlamaDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer, "
                            "MistralDecoderLayer, GraniteDecoderLayer, Qwen3MoeDecoderLayer, MixtralDecoderLayer, "
                            "Qwen2MoeDecoderLayer, GemmaDecoderLayer, Phi3DecoderLayer, Gemma2DecoderLayer, "
                            "Gemma3DecoderLayer, Olmo2DecoderLayer, StableLmDecoderLayer, CohereDecoderLayer, "
                            "GPTNeoXLayer, FalconDecoderLayer, OlmoeDecoderLayer, Glm4MoeDecoderLayer, "
                            "Olmo3DecoderLayer, MinistralDecoderLayer, CwmDecoderLayer, SmolLM3DecoderLayer, "
                            "Ministral3DecoderLayer, GlmDecoderLayer, HeliumDecoderLayer, Glm4DecoderLayer, "
                            "Ernie4_5DecoderLayer, Ernie4_5_MoeDecoderLayer, HunYuanDenseV1DecoderLayer, "
                            "HunYuanMoEV1DecoderLayer, Exaone4DecoderLayer, SeedOssDecoderLayer, "
                            "Cohere2DecoderLayer)")]


def _module_state(model) -> dict:
    """Every module's instance attributes and buffers, by identity: what a forward could leave behind."""
    return {name: ({k: id(v) for k, v in vars(m).items() if not k.startswith("_") or k == "_rec"},
                   {k: id(v) for k, v in m._buffers.items()}) for name, m in model.named_modules()}


@pytest.mark.parametrize("part", ["q_proj", "o_proj", "self_attn", "q_norm"])
def test_a_hook_on_a_part_the_step_skips_keeps_that_layer_stock(part, kernels_on_cpu):
    kind = "qwen3" if part == "q_norm" else "llama"
    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    seen = []
    for m in (stock, model):  # the same hook on both: it doubles its module's output
        attn = m.model.layers[0].self_attn
        mod = attn if part == "self_attn" else getattr(attn, part)
        if part == "self_attn":
            mod.register_forward_hook(lambda mod, args, out: (out[0] * 2, *out[1:]))
        else:
            mod.register_forward_hook(lambda mod, args, out: seen.append(part) or out * 2)
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)
    # layer 0 ran its stock forward (its hook ran in both models), layer 1 the fused step
    assert kernels_on_cpu == ["norm", "residual", "glu+norm", "residual"]
    assert part == "self_attn" or seen == [part, part]


def test_an_attention_forward_with_a_statement_more_is_not_fused(kernels_on_cpu):
    """The step computes the forwards it knows statement by statement: a subclass whose forward
    does one thing more keeps its layer on the stock forward (the extra line is honoured)."""
    import types

    cls = transformers.models.llama.modeling_llama.LlamaAttention
    src = inspect.getsource(cls.forward).replace("        cos, sin = position_embeddings\n",
                                                  "        cos, sin = position_embeddings\n"
                                                  "        query_states = query_states * 3.0\n")
    assert "* 3.0" in src
    names = dict(vars(transformers.models.llama.modeling_llama))
    exec(compile(textwrap.dedent(src).replace("@deprecate_kwarg", "# "), "<variant>", "exec"), names)
    variant = types.new_class("ScaledLlamaAttention", (cls,), exec_body=lambda ns: ns.update(forward=names["forward"]))
    stock = _tiny("llama")
    for layer in stock.model.layers:
        layer.self_attn.__class__ = variant
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    assert report.fused_layers == []
    assert any("not an attention this step computes" in why for _, why in report.skipped), report.skipped
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    assert kernels_on_cpu == []


def test_transformers_idle_capture_hooks_keep_the_step(kernels_on_cpu):
    """A call asking for hidden states installs transformers' output-capturing hooks on the
    attention modules for good: idle, they keep the fused step; capturing attentions, the
    layers run their stock forward and return the attention weights."""
    stock = _tiny("llama")
    stock.config._attn_implementation = "eager"
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        ref = stock(ids, output_hidden_states=True)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
        kernels_on_cpu.clear()
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)
        assert kernels_on_cpu == ["norm", "residual", "glu+norm", "residual"] * 2
        kernels_on_cpu.clear()
        out, ref = model(ids, output_attentions=True), stock(ids, output_attentions=True)
    assert kernels_on_cpu == [] and len(out.attentions) == 2
    for a, b in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_an_unpickled_layer_reads_its_attention_form_when_loaded(tmp_path):
    model = _tiny("qwen3", layers=1)
    hybridgemm.patch(model)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    attention = type(model.model.layers[0].self_attn)
    attention_forms._FORMS.pop(attention)
    torch.load(path, weights_only=False)
    assert isinstance(attention_forms._FORMS.get(attention), attention_forms.AttentionForm)


def test_an_exception_inside_the_step_leaves_no_state(kernels_on_cpu, monkeypatch):
    model = _tiny("llama", layers=1)
    hybridgemm.patch(model)
    state = _module_state(model)

    def boom(*a, **kw):
        raise ValueError("attention failed")

    monkeypatch.setattr(attention_forms.AttentionForm, "attention_function", lambda self, impl: boom)
    with torch.no_grad(), pytest.raises(ValueError, match="attention failed"):
        model(torch.randint(0, VOCAB, (1, 3)))
    assert _module_state(model) == state


def test_torch_compile_traces_the_fused_layer(kernels_on_cpu):
    stock = _tiny("llama")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    ids = torch.randint(0, VOCAB, (1, 5))
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # Dynamo; the custom ops run eagerly
    with torch.no_grad():
        out, ref = compiled(ids).logits, stock(ids).logits
    torch._dynamo.reset()
    assert kernels_on_cpu == ["norm", "residual", "glu+norm", "residual"] * 2
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_a_patched_model_pickles(tmp_path):
    model = _tiny("qwen2", layers=1)
    hybridgemm.patch(model)
    layer_class = type(model.model.layers[0])
    assert layer_class.__name__ == "Qwen2DecoderLayer"  # name-based checks (no-split module lists) still match
    path = tmp_path / "model.pt"
    torch.save(model, path)
    ids = torch.randint(0, VOCAB, (1, 4))
    loaded = torch.load(path, weights_only=False)
    assert type(loaded.model.layers[0]) is layer_class
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    # a new process: the class is rebuilt from transformers' by name
    code = ("import torch, hybridgemm, sys; m = torch.load(sys.argv[1], weights_only=False); "
            "print(type(m.model.layers[0]).__mro__[1].__name__)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout.strip() == "HybridDecoderLayer", done.stderr[-2000:]


def test_a_refused_split_k_launch_falls_back_with_one_warning(kernels_on_cpu, monkeypatch):
    stock = _tiny("llama")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)

    def refuse(*a, **kw):
        raise ValueError("no config fits this device")

    monkeypatch.setattr(triton_splitk, "run", refuse)
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model(ids).logits
        model(ids)  # once per fusion and weight shape: nothing new
    unfused = [str(w.message) for w in seen if "runs unfused" in str(w.message)]
    assert len(unfused) == 3 and all("no config fits this device" in m for m in unfused), unfused  # QKV, O, down
    torch.testing.assert_close(out, stock(ids).logits, rtol=1e-4, atol=1e-4)
