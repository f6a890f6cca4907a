"""``patch`` of mixture-of-experts models (CPU): the stacked experts of tiny Mixtral, Qwen2-MoE
and Qwen3-MoE become :class:`~hybridgemm.experts.HybridExperts` and their routers
:class:`~hybridgemm.router.HybridTopKRouter` (the form found by running each), whose logits equal
stock's on the grouped and routing kernels (Triton interpreter, the device check widened to the
CPU) and in PyTorch (autograd, CPU); the state dict stays stock's, ``unpatch`` restores the
classes, gradients of a training step equal stock's, Dynamo traces the kernel path as one graph,
and routers of another form are reported."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from helpers import tiny_moe_lm
from hybridgemm import experts
from hybridgemm.experts import HybridExperts
from hybridgemm.kernels import triton_router
from hybridgemm.router import HybridTopKRouter, RouterForm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97


def _tiny(kind: str):
    experts, top_k = {"mixtral": (4, 2), "qwen3_moe": (6, 3), "qwen2_moe": (6, 2), "olmoe": (6, 2)}[kind]
    return tiny_moe_lm(kind, VOCAB, 64, experts, top_k, head_dim=16)


def _experts_modules(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def _routers(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate")]


def _ids():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("kernels", [False, True], ids=["unfused", "kernels"])
def test_patched_moe_models_give_stock_logits(kind, kernels, monkeypatch):
    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    mods = _experts_modules(model)
    assert len(mods) == 2 and all(type(m) is HybridExperts for m in mods)
    assert all(type(m) is HybridTopKRouter for m in _routers(model))
    assert not any("experts" in name or name.endswith("mlp.gate") for name, _ in report.skipped), report.skipped
    calls, routed = [], []
    if kernels:
        monkeypatch.setattr(experts, "use_kernels", lambda x: True)
        real, real_route = experts.moe, triton_router.launch
        monkeypatch.setattr(experts, "moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        monkeypatch.setattr(triton_router, "launch", lambda *a, **kw: routed.append(1) or real_route(*a, **kw))
    with torch.no_grad():
        want, got = stock(_ids()).logits, model(_ids()).logits
    assert len(calls) == len(routed) == (2 if kernels else 0)  # both layers' experts and routers in kernels
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    sd, ref = model.state_dict(), stock.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    hybridgemm.unpatch(model)
    assert all(type(m) is type(r) for m, r in zip(_experts_modules(model), _experts_modules(stock)))
    assert all(type(m) is type(r) and not m.__dict__.keys() - r.__dict__.keys()
               for m, r in zip(_routers(model), _routers(stock)))


@pytest.mark.parametrize("kind", ["mixtral", "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_experts_that_need_gradients_run_the_replaced_forward(kind, dtype, implementation):
    """With autograd (or anywhere the kernels do not run) a patched experts module runs the
    forward of the transformers class it replaced, in the experts implementation its config
    names: the output and every gradient equal stock's bit for bit (in fp32 the PyTorch loop
    over experts, :func:`~hybridgemm.experts.experts_loop`, gives other bits); the loop stays
    within rounding. Stock's ``batched_mm`` in fp32 on the CPU gives other bits from one call to
    the next (half of 20 repeated calls, 2026-12-06): there, within fp32 rounding."""
    stock = _tiny(kind).to(dtype)
    stock.set_experts_implementation(implementation)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    assert model.config._experts_implementation == implementation
    (ref,), (mod,) = _experts_modules(stock)[:1], _experts_modules(model)[:1]
    assert type(mod) is HybridExperts
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(11, 64, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(mod.gate_up_proj.shape[0], generator=gen)[:2] for _ in range(11)])
    routing = torch.rand(11, 2, generator=gen).to(dtype)
    outs, grads = [], []
    for m in (ref, mod):
        xi, wi = x.clone().requires_grad_(), routing.clone().requires_grad_()
        out = m(xi, ids, wi)
        out.float().square().sum().backward()
        outs.append(out)
        grads.append([xi.grad, wi.grad, m.gate_up_proj.grad, m.down_proj.grad])
    if implementation == "batched_mm" and dtype == torch.float32:
        for got, want in zip([outs[1], *grads[1]], [outs[0], *grads[0]]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(outs[1], outs[0])
        assert all(torch.equal(g, r) for g, r in zip(grads[1], grads[0]))
    with torch.no_grad():
        loop = experts.experts_loop(x, ids, routing, mod.gate_up_proj, mod.down_proj, mod.glu_activation)
    torch.testing.assert_close(loop, outs[0].detach(), **({} if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)))


@pytest.mark.parametrize(("kind", "dtype"), [("mixtral", torch.float32), ("olmoe", torch.float32),
                                             ("qwen2_moe", torch.float32), ("mixtral", torch.bfloat16)],
                         ids=["mixtral", "olmoe", "qwen2_moe", "mixtral-bf16"])
def test_a_training_step_traces_in_one_graph_where_stock_does(kind, dtype):
    """torch.compile(fullgraph=True) of a patched model's forward and backward (transformers'
    grouped_mm experts: its fallback op in fp32, ``grouped_mm`` itself in bf16): its gradients
    equal the stock model's eager ones (no graph break from the experts or the router)."""
    stock = _tiny(kind).to(dtype)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    grads = []
    for m, compiled in ((stock, False), (stock, True), (model, True)):
        m.train()
        m.zero_grad()
        fn = lambda ids, m=m: m(ids).logits  # noqa: E731
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        try:
            fn(_ids()).square().mean().backward()
        except Exception as e:  # (Dynamo's Unsupported, or BackendCompilerFailed from AOTAutograd)
            if m is stock and compiled:
                pytest.skip(f"stock {kind} does not trace in one graph with transformers "
                            f"{transformers.__version__}, torch {torch.__version__}: {str(e)[:80]}")
            raise
        finally:
            torch._dynamo.reset()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert set(grads[2]) == set(grads[0]) and any("experts" in n for n in grads[0])
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.05, atol=2e-4)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[2][n], g, **tol)


def test_a_training_step_gives_stock_gradients():
    stock = _tiny("mixtral")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    grads = []
    for m in (stock, model):
        m.train()
        m(_ids(), labels=_ids()).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if "experts" in n or "mlp.gate" in n})
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) == 6
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-6)


def test_dynamo_traces_the_kernel_path_in_one_graph(monkeypatch):
    stock = _tiny("mixtral")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    fn = torch.compile(lambda ids: model(ids).logits, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got, want = fn(_ids()), stock(_ids()).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "traced"])
def test_a_fused_router_routes_in_its_gemm_and_gives_stock_logits(kind, compiled, monkeypatch):
    """``HYBRIDGEMM_FUSED_ROUTER`` (router.FUSED_ROUTER): decode-sized calls (here 10 tokens) run
    the router's GEMM with the routing in its epilogue, no routing kernel apart; the logits
    equal stock's; Dynamo traces it as one graph (the router as one op)."""
    from hybridgemm import router
    from hybridgemm.kernels import triton_splitk

    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    monkeypatch.setattr(router, "FUSED_ROUTER", True)
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    fused, routed = [], []
    real_run, real_route = triton_splitk.run, triton_router.launch
    monkeypatch.setattr(triton_splitk, "run", lambda *a, route=None, **kw: fused.append(route is not None)
                        or real_run(*a, route=route, **kw))
    monkeypatch.setattr(triton_router, "launch", lambda *a, **kw: routed.append(1) or real_route(*a, **kw))
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    fn = torch.compile(lambda t: model(t).logits, fullgraph=True, backend="aot_eager") if compiled \
        else (lambda t: model(t).logits)
    with torch.no_grad():
        got, want = fn(ids), stock(ids).logits
    torch._dynamo.reset()
    assert fused.count(True) == 2 and routed == []  # both layers' routers in one launch each
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_experts_of_another_form_are_reported():
    model = _tiny("mixtral")
    mod = _experts_modules(model)[0]
    mod.has_bias = True
    report = hybridgemm.patch(model)
    assert type(mod) is not HybridExperts
    assert any(name.endswith("layers.0.mlp.experts") and "biases" in why for name, why in report.skipped)


def test_experts_sharded_over_ranks_are_reported_not_patched():
    model = _tiny("mixtral")
    mod = _experts_modules(model)[0]
    mod._is_expert_parallel = True  # transformers' expert parallelism: ids of other ranks' experts
    report = hybridgemm.patch(model)
    assert type(mod) is not HybridExperts
    assert any(name.endswith("layers.0.mlp.experts") and "expert parallelism" in why for name, why in report.skipped)


@pytest.mark.parametrize("kind,norm_topk,form", [
    ("mixtral", None, RouterForm(True, False)),  # renormalised, fp32 weights
    ("qwen3_moe", True, RouterForm(True, True)),  # weights in the logits' dtype
    ("qwen3_moe", False, RouterForm(False, True)),
    ("qwen2_moe", True, RouterForm(True, True)),
])
def test_the_router_form_is_what_the_router_computes(kind, norm_topk, form):
    model = _tiny(kind)
    for router in _routers(model):
        if norm_topk is not None:
            router.norm_topk_prob = norm_topk
    hybridgemm.patch(model)
    got = {RouterForm(r.route_renormalize, r.route_logits_dtype_weights) for r in _routers(model)}
    assert got == {form}
    model = model.to(torch.bfloat16)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    router = _routers(model)[0]
    with torch.no_grad():
        logits, weights, ids = router(x)
        stock = type(_routers(_tiny(kind))[0])
        router.__class__ = stock  # the stock forward over the same weight
        want = router(x)
    assert weights.dtype == want[1].dtype and torch.equal(ids, want[2]) and torch.equal(weights, want[1])
    assert torch.equal(logits, want[0])


@pytest.mark.parametrize("hidden", [64, 512, 4096])
@pytest.mark.parametrize("norm_topk", [False, True])
def test_the_form_does_not_depend_on_the_routers_width_or_weights(hidden, norm_topk):
    """Wide routers and zero weights alike (wide ones once made the probe's softmax one-hot, where
    renormalised and not look the same)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from hybridgemm.router import why_not_router

    cfg = transformers.Qwen3MoeConfig(hidden_size=hidden, num_experts=128, num_experts_per_tok=8,
                                      norm_topk_prob=norm_topk)
    router = Qwen3MoeTopKRouter(cfg)  # (its weight starts at zero)
    assert why_not_router(router) == (RouterForm(norm_topk, True), None)
    torch.nn.init.normal_(router.weight, std=1.0)  # huge logits: the probe uses its own weights
    assert why_not_router(router) == (RouterForm(norm_topk, True), None)
    with torch.device("meta"):  # patch called in a device context: the probe still runs on the CPU
        assert why_not_router(router) == (RouterForm(norm_topk, True), None)


def test_a_router_of_another_form_is_reported_and_left_alone():
    model = _tiny("mixtral")
    router = _routers(model)[0]

    class SigmoidTopKRouter(torch.nn.Module):  # DeepSeek-V3-like: sigmoid scores, not softmax
        __module__ = "transformers.models.fake.modeling_fake"

        def forward(self, hidden_states):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.weight.shape[1]), self.weight)
            scores, ids = torch.topk(logits.sigmoid(), self.top_k, dim=-1)
            return logits, scores, ids

    router.__class__ = SigmoidTopKRouter
    report = hybridgemm.patch(model)
    assert type(router) is SigmoidTopKRouter
    assert any(name.endswith("layers.0.mlp.gate") and "not softmax then top-k" in why for name, why in report.skipped)
    assert type(_routers(model)[1]) is HybridTopKRouter
