"""W8A8 FP8 projections (``patch(..., activations="fp8")``, fusion/fp8_linear.py ``quantize_input``)
on the CPU: which path a call takes on the GPU branch (the decision faked, cuBLASLt's FP8 GEMM
replaced by a recording stand-in that computes what it computes: x quantized per token or per
1 x 128 block, both operands dequantized, in fp32): split-K at decode rows with x as it is, the
FP8 GEMM past them, the dequantized weight's GEMM without the option or where cuBLASLt refuses
(one warning); ``patch`` sets every FP8 projection, warns where there is none, refuses bad values;
torch.compile traces the option."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from helpers import w8a8_reference
from hybridgemm import decide, dispatch, fp8_linear, fp8_modules, mlp, mode_state
from hybridgemm.fp8_modules import FP8FusedLinears, FP8HybridLinear
from hybridgemm.kernels import backends, fp8
from hybridgemm.kernels import cublaslt_fp8 as lt8
from hybridgemm.kernels.cublaslt_runtime import CublasLtUnsupported
from hybridgemm.kernels.epilogue import apply_activation
from hybridgemm.kernels.problem import pointer_alignment

transformers = pytest.importorskip("transformers")


@pytest.fixture
def gpu_branch(monkeypatch):
    """The GPU branch of fp8_linear on CPU tensors: split-K decided at M <= 64 (run by a stand-in
    recording the call), the dequantized path above (F.linear); cuBLASLt's FP8 GEMM a stand-in
    (``refuse`` makes it raise CublasLtUnsupported; with ``glu`` it forms the product of x's
    halves first). Returns the calls and the switch."""
    calls, state = [], {"refuse": False}

    def decision_for(x2, w, b, out, act=None, weight_format="", fresh_x=False):
        if x2.shape[0] <= 64:
            return decide.Choice("triton_splitk", None, "rule", "k", "test")
        return decide.Choice("torch", None, "rule", "k", "test")

    def split_k(config, x, w, b, out, act, tf32=False, weight_scale=None):
        calls.append(("splitk", x.shape[0]))
        q = fp8.FP8Weight(w, weight_scale, fp8.granularity_of(w, weight_scale), x.dtype)
        z = F.linear(x.float(), q.dequantize(torch.float32), None if b is None else b.float())
        out.copy_(apply_activation(z, act))

    def w8a8(x, w, weight_scale, b, out, act, glu, what):
        calls.append((what if glu is None else f"{what} {glu}", x.shape[0]))
        if glu is not None:  # the product the quantization kernel forms (kernels/fp8_quant.py)
            gate, up = x.chunk(2, dim=1)
            x = F.silu(gate) * up
        q = fp8.FP8Weight(w, weight_scale, fp8.granularity_of(w, weight_scale), x.dtype)
        out.copy_(w8a8_reference(x, q, b, act))
        return out

    def run_and_bind(x, w, weight_scale, b=None, out=None, act=None, glu=None):
        if state["refuse"]:
            raise CublasLtUnsupported("cuBLASLt has no FP8 algorithm here (test)")
        out = w8a8(x, w, weight_scale, b, out, act, glu, "w8a8")

        def bound(x, w, weight_scale, b):  # a later call of the signature: its own operands, scales as given
            scale = fp8.scale_vector(weight_scale, fp8.granularity_of(w, weight_scale))
            return w8a8(x, w, scale, b, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype), act, glu, "bound")
        return out, bound

    real = backends.get_backend
    fakes = {"triton_splitk": split_k}

    def get_backend(name):
        be = real(name)
        return type(be)(be.name, be.available, be.candidates, be.config_from_record, fakes[name], be.describe) \
            if name in fakes else be

    def dequantized(x, w, b, act):
        calls.append(("dequantized", x.reshape(-1, x.shape[-1]).shape[0]))
        return apply_activation(F.linear(x, w, b), act)

    monkeypatch.setattr(fp8_linear, "runs_fp8_kernels", lambda x: True)
    monkeypatch.setattr(dispatch, "decision_for", decision_for)
    monkeypatch.setattr(backends, "get_backend", get_backend)
    monkeypatch.setattr(lt8, "run_and_bind", run_and_bind)
    monkeypatch.setattr(lt8, "BOUND_RUNS", type(lt8.BOUND_RUNS)(64, lru=True))
    # x's alignment, as the CUDA caching allocator's blocks have it (CPU buffers' vary from call to call)
    monkeypatch.setattr(fp8_linear, "pointer_alignment", lambda ptr: 256)
    monkeypatch.setattr(dispatch, "fused_linear", dequantized)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the one-pass dequantization kernel
    return calls, state


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_w8a8_runs_the_fp8_gemm_past_the_decode_rows(granularity, act, gpu_branch):
    calls, _ = gpu_branch
    g = torch.Generator().manual_seed(0)
    q = fp8.quantize_fp8((torch.randn(136, 300, generator=g) * 0.2).half(), granularity)
    b = torch.randn(136, generator=g).half()
    for m in (1, 17, 64, 65, 333):
        x = (torch.randn(m, 300, generator=g) * torch.rand(m, 1, generator=g) * 4).half()
        got = fp8_linear.linear_fp8(x, q.data, q.scale, b, act, quantize_input=True)
        if m <= 64:  # decode rows: x as it is
            want = apply_activation(F.linear(x.float(), q.dequantize(torch.float32), b.float()),
                                    hybridgemm.Activation.parse(act))
        else:
            want = w8a8_reference(x, q, b, act)
        assert torch.equal(got, want.half())
        plain = fp8_linear.linear_fp8(x, q.data, q.scale, b, act)
        if m > 64:  # the option changes what is computed: x's rounding to e4m3 shows
            assert not torch.equal(plain, got)
    assert calls == [("splitk", 1), ("splitk", 1), ("splitk", 17), ("splitk", 17), ("splitk", 64), ("splitk", 64),
                     ("w8a8", 65), ("dequantized", 65), ("w8a8", 333), ("dequantized", 333)]


def test_3d_inputs_the_batch_invariant_mode_and_the_backward(gpu_branch):
    """Rows of a 3-D x count as M; the batch-invariant mode keeps x as it is (cuBLASLt's
    algorithm would depend on M); the backward's recompute of the pre-activation is the W8A8
    one the forward used."""
    calls, _ = gpu_branch
    q = fp8.quantize_fp8(torch.randn(64, 128).half())
    x = torch.randn(2, 40, 128).half()
    got = fp8_linear.linear_fp8(x, q.data, q.scale, None, quantize_input=True)
    assert calls == [("w8a8", 80)] and torch.equal(got, w8a8_reference(x.reshape(80, 128), q).half().view(2, 40, 64))
    calls.clear()
    with mode_state.mode(mode_state.BATCH_INVARIANT):
        fp8_linear.linear_fp8(x, q.data, q.scale, None, quantize_input=True)
    assert calls == [("dequantized", 80)]
    calls.clear()
    xg = x.float().requires_grad_()
    y = fp8_linear.linear_fp8(xg.half(), q.data, q.scale, None, "gelu_tanh", quantize_input=True)
    y.float().sum().backward()
    assert calls == [("w8a8", 80), ("w8a8", 80)]  # the forward, then the recompute of z
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


def test_where_cublaslt_refuses_the_dequantized_path_runs_with_one_warning(gpu_branch):
    calls, state = gpu_branch
    state["refuse"] = True
    q = fp8.quantize_fp8(torch.randn(64, 128).half())
    x = torch.randn(100, 128).half()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = fp8_linear.linear_fp8(x, q.data, q.scale, None, quantize_input=True)
        again = fp8_linear.linear_fp8(x, q.data, q.scale, None, quantize_input=True)
    ours = [w for w in caught if "activations='fp8'" in str(w.message)]
    assert len(ours) == 1 and "no FP8 algorithm" in str(ours[0].message)
    assert calls == [("dequantized", 100)] * 2 and torch.equal(first, again)
    assert torch.equal(first, F.linear(x, q.dequantize(torch.float16)))


def test_later_calls_of_a_signature_take_its_bound_launch_and_only_those(gpu_branch):
    """A W8A8 call keeps the launch it made (kernels/cublaslt_fp8.BoundRun) under its signature
    (fp8_linear._bound_key): the same signature again takes it, with that call's own operands.
    Another weight, a bias copied per call, x not contiguous, a gradient wanted through the gated
    product, or the tables reloaded: the general path."""
    calls, _ = gpu_branch
    g = torch.Generator().manual_seed(7)
    q, q2 = (fp8.quantize_fp8((torch.randn(96, 160, generator=g) * 0.2).half()) for _ in range(2))
    b = torch.randn(96, generator=g).half()

    def fresh(*shape):
        return torch.randn(*shape, generator=g).half()

    def run(x, q=q, b=b, **kw):
        return fp8_linear.linear_fp8(x, q.data, q.scale, b, None, True, **kw)

    run(fresh(80, 160))
    x = fresh(80, 160)
    assert torch.equal(run(x), w8a8_reference(x, q, b).half())
    assert calls == [("w8a8", 80), ("bound", 80)]
    strided = fresh(192)[::2]  # (copied for each call: the copy's address is the call's own)
    cases = [("another weight", lambda: run(fresh(80, 160), q=q2), [("w8a8", 80), ("bound", 80)]),
             ("a strided bias", lambda: run(fresh(80, 160), b=strided), [("w8a8", 80)] * 2),
             ("x not contiguous", lambda: run(fresh(160, 80).t()), [("w8a8", 80)] * 2)]
    for what, call, want in cases:
        calls.clear()
        call(), call()
        assert calls == want, what
    calls.clear()
    decide.reload_tables()
    run(fresh(80, 160)), run(fresh(80, 160))
    assert calls == [("w8a8", 80), ("bound", 80)]
    calls.clear()
    gu = fresh(80, 320)
    gate, up = gu.chunk(2, dim=1)
    for _ in range(2):
        assert torch.equal(fp8_linear.linear_fp8_glu(gu, q.data, q.scale, None, "silu", True),
                           w8a8_reference(F.silu(gate) * up, q).half())
    assert calls == [("w8a8 silu", 80), ("bound silu", 80)]
    calls.clear()
    with torch.enable_grad():
        fp8_linear.linear_fp8_glu(gu.float().requires_grad_().half(), q.data, q.scale, None, "silu", True)
    assert calls and all(not what.endswith("silu") for what, _ in calls)  # the composition's call


def test_the_bound_key_follows_x_alignment_and_keeps_no_provisional_decision(gpu_branch, monkeypatch):
    """x's alignment is part of the signature (the decision and the quantization kernel's
    specialisation read it): x at a 2-byte offset, twice, binds and hits; at an 8-byte offset it
    is a signature of its own. A provisional decision (the dispatcher asks again next call) is
    never bound."""
    calls, _ = gpu_branch
    monkeypatch.setattr(fp8_linear, "pointer_alignment", pointer_alignment)  # the real one: CPU blocks are 64-aligned
    g = torch.Generator().manual_seed(11)
    q = fp8.quantize_fp8((torch.randn(96, 160, generator=g) * 0.2).half())

    def at(offset):  # x (80, 160) starting `offset` fp16 elements into a fresh buffer
        buf = torch.randn(80 * 160 + 8, generator=g).half()
        return buf[offset : offset + 80 * 160].view(80, 160)

    for offset in (1, 1, 4, 4):
        x = at(offset)
        assert torch.equal(fp8_linear.linear_fp8(x, q.data, q.scale, None, None, True), w8a8_reference(x, q).half())
    assert calls == [("w8a8", 80), ("bound", 80)] * 2
    calls.clear()
    faked = dispatch.decision_for
    monkeypatch.setattr(dispatch, "decision_for", lambda *a, **kw: dataclasses.replace(faked(*a, **kw),
                                                                                        provisional=True))
    decide.reload_tables()
    for _ in range(2):
        fp8_linear.linear_fp8(torch.randn(80, 160, generator=g).half(), q.data, q.scale, None, None, True)
        fp8_linear.linear_fp8_glu(torch.randn(80, 320, generator=g).half(), q.data, q.scale, None, "silu", True)
    assert calls == [("w8a8", 80), ("w8a8 silu", 80)] * 2


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=64, num_hidden_layers=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_patch_sets_every_fp8_projection_and_the_modules_pass_it_on(monkeypatch):
    model = _tiny_llama()
    plain = copy.deepcopy(model)
    hybridgemm.patch(plain, weights="fp8")
    hybridgemm.patch(model, weights="fp8", activations="fp8")
    mods = [m for m in model.modules() if isinstance(m, (FP8HybridLinear, FP8FusedLinears))]
    assert len(mods) == 8 and all(m.fp8_activations for m in mods)
    assert not any(m.fp8_activations for m in plain.modules() if isinstance(m, (FP8HybridLinear, FP8FusedLinears)))
    seen = []
    real, real_glu = fp8_modules.linear_fp8, mlp.linear_fp8_glu
    monkeypatch.setattr(fp8_modules, "linear_fp8", lambda *a: seen.append(("linear", a[-1])) or real(*a))
    # down_proj: its input is the gated product, which the call forms (fp8_linear.linear_fp8_glu)
    monkeypatch.setattr(mlp, "linear_fp8_glu", lambda *a: seen.append(("glu", a[5])) or real_glu(*a))
    ids = torch.randint(0, 64, (1, 5))
    per_layer = [("linear", True)] * 3 + [("glu", True)]  # Q/K/V, O, gate/up; then down
    with torch.no_grad():
        got = model(ids).logits
        assert seen == per_layer * 2
        want = plain(ids).logits
    assert seen[8:] == [(how, False) for how, _ in per_layer] * 2
    assert torch.equal(got, want)  # on the CPU both run the dequantized weight with x as it is


def test_every_projection_of_a_patched_prefill_runs_the_w8a8_gemm(gpu_branch):
    """Q/K/V, O, gate/up and down of both layers: 8 FP8 GEMMs over the 80 prefill rows, each
    the W8A8 one (the fused Q/K/V and gate/up hand out their parts of one call; down's input the
    gated product, formed as it is quantized); then the fp16 LM head, not FP8 (the fixture
    records the dispatcher's GEMM as "dequantized"). The logits are those of the same model
    with down called on the product as a module (the product written, then quantized)."""
    calls, _ = gpu_branch
    model = _tiny_llama().half()
    hybridgemm.patch(model, weights="fp8", activations="fp8")
    ids = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
        assert calls == [("w8a8", 80)] * 3 + [("w8a8 silu", 80)] + [("w8a8", 80)] * 3 + [("w8a8 silu", 80)] \
            + [("dequantized", 80)] and torch.isfinite(logits).all()
        calls.clear()
        for layer in model.model.layers:  # a forward hook on down: the MLP calls it as a module
            layer.mlp.down_proj.register_forward_hook(lambda *a: None)
        unfused = model(ids).logits
    # Q/K/V, O and gate/up again: their bound launches; down over the written product: a new signature
    assert calls == ([("bound", 80)] * 3 + [("w8a8", 80)]) * 2 + [("dequantized", 80)]
    assert torch.equal(logits, unfused)


def test_the_gated_product_takes_the_w8a8_gemm_only_past_the_decode_rows(gpu_branch, monkeypatch):
    """``linear_fp8_glu``: with the option and past the decode rows the product goes to the W8A8
    GEMM unwritten (one decision, for the product's shape); at decode rows, without the option,
    or where the table decides split-K for those rows, the composition runs (its own decision
    only), with the composition's result."""
    calls, _ = gpu_branch
    fresh = []
    faked = dispatch.decision_for

    def decision_for(*a, fresh_x=False, **kw):
        fresh.append(fresh_x)
        return faked(*a, fresh_x=fresh_x, **kw)

    monkeypatch.setattr(dispatch, "decision_for", decision_for)
    g = torch.Generator().manual_seed(5)
    q = fp8.quantize_fp8((torch.randn(96, 160, generator=g) * 0.2).half())
    for m, option, want in ((80, True, [("w8a8 silu", 80)]), (17, True, [("splitk", 17)]),
                            (80, False, [("dequantized", 80)])):
        calls.clear()
        fresh.clear()
        gu = torch.randn(m, 320, generator=g).half()
        got = fp8_linear.linear_fp8_glu(gu, q.data, q.scale, None, "silu", option)
        gate, up = gu.chunk(2, dim=1)
        assert calls == want and fresh == ([True] if want[0][0] == "w8a8 silu" else [False])
        calls.clear()
        assert torch.equal(got, fp8_linear.linear_fp8(F.silu(gate) * up, q.data, q.scale, None, None, option))
    monkeypatch.setattr(dispatch, "decision_for",  # a table's split-K entry past the decode rows
                        lambda *a, **kw: decide.Choice("triton_splitk", None, "table", "k", "test"))
    decide.reload_tables()  # (how a table's entry arrives: the bound launches of the old decisions go)
    calls.clear()
    fp8_linear.linear_fp8_glu(torch.randn(80, 320, generator=g).half(), q.data, q.scale, None, "silu", True)
    assert calls == [("splitk", 80)]


def test_torch_compile_passes_the_option_to_the_fp8_call(gpu_branch):
    calls, _ = gpu_branch
    q = fp8.quantize_fp8(torch.randn(64, 128).half())
    x = torch.randn(100, 128).half()
    for option in (True, False):
        fn = torch.compile(lambda x, o=option: fp8_linear.linear_fp8(x, q.data, q.scale, None, quantize_input=o),
                           fullgraph=True, backend="aot_eager")
        got = fn(x)
        torch._dynamo.reset()
        assert calls[-1] == (("w8a8", 100) if option else ("dequantized", 100))
        assert torch.equal(got, w8a8_reference(x, q).half() if option else F.linear(x, q.dequantize(torch.float16)))


def test_torch_compile_traces_the_gated_product_call_whole(gpu_branch, monkeypatch):
    """``linear_fp8_glu`` with the option, past the decode rows, under torch.compile(fullgraph):
    no data pointer is read while tracing (the bound launches' key is not built there); the
    traced call is the composition's, the product's GEMM the W8A8 op."""
    calls, _ = gpu_branch
    monkeypatch.setattr(fp8_linear, "pointer_alignment", pointer_alignment)  # the real one, as traced
    q = fp8.quantize_fp8(torch.randn(64, 128).half())
    gu = torch.randn(100, 256).half()
    fn = torch.compile(lambda gu: fp8_linear.linear_fp8_glu(gu, q.data, q.scale, None, "silu", True),
                       fullgraph=True, backend="aot_eager")
    got = fn(gu)
    torch._dynamo.reset()
    gate, up = gu.chunk(2, dim=1)
    assert calls[-1] == ("w8a8", 100) and torch.equal(got, w8a8_reference(F.silu(gate) * up, q).half())


def test_activations_fp8_without_fp8_projections_warns_and_bad_values_are_refused():
    model = _tiny_llama()
    with pytest.warns(UserWarning, match="has none"):
        hybridgemm.patch(model, activations="fp8")
    with pytest.raises(ValueError, match="activations must be 'same' or 'fp8'"):
        hybridgemm.patch(_tiny_llama(), weights="fp8", activations="e4m3")
