"""``patch`` of DeepSeek-V3-form routers (CPU): the routers of tiny GLM-4.5-MoE and DeepSeek-V3
models (sigmoid scores, the selection bias, group-limited choice, normalised and scaled) become
:class:`~hybridgemm.router.HybridSigmoidRouter`, found by running each; their outputs equal the
stock router's (the experts as a set) in PyTorch and on the routing kernel (Triton interpreter,
the device check widened to the CPU); the model's logits equal stock's; the router reads its
attributes at every call; gradients equal stock's; ``unpatch`` restores the class; routers of
another form are reported and left alone. Under transformers releases whose router returns its
logits only (5.8: the MoE block routes), the tests skip and
``test_a_router_that_only_computes_logits_is_reported`` checks what ``patch`` does there."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridgemm
from helpers import tiny_moe_lm
from hybridgemm import experts
from hybridgemm.kernels import triton_router
from hybridgemm.router import HybridSigmoidRouter, SigmoidRouterForm, why_not_router

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

VOCAB = 97
KINDS = ["glm4_moe", "deepseek_v3"]


def _tiny(kind: str):
    model = tiny_moe_lm(kind, VOCAB, 64, 8, 3, head_dim=16)
    with torch.no_grad():
        out = _routers(model)[0](torch.zeros(1, 64))
    if not isinstance(out, tuple):  # transformers 5.8: the block routes (route_tokens_to_experts), not its router
        pytest.skip(f"this transformers' {kind} router returns its logits only; its MoE block routes")
    return model


def _routers(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate")]


def _ids():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))


def _as_sets(out):
    """(logits, weights, ids) with each row's experts in ascending order, weights alike."""
    logits, weights, ids = out
    order = ids.sort(dim=-1)
    return logits, weights.gather(1, order.indices), order.values


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernel"])
def test_patched_models_route_as_stock_and_give_its_logits(kind, kernels, monkeypatch):
    stock = _tiny(kind)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    routers = _routers(model)
    assert len(routers) == 1 and type(routers[0]) is HybridSigmoidRouter  # (layer 0 is dense)
    assert routers[0].route_sigmoid_form == SigmoidRouterForm("num_group", "topk_group", "norm_topk_prob",
                                                              "routed_scaling_factor", "e_score_correction_bias")
    assert not any(name.endswith("mlp.gate") for name, _ in report.skipped), report.skipped
    launches = []
    if kernels:
        monkeypatch.setattr(experts, "use_kernels", lambda x: True)
        real = triton_router.launch_sigmoid
        monkeypatch.setattr(triton_router, "launch_sigmoid", lambda *a: launches.append(a) or real(*a))
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = _as_sets(routers[0](x)), _as_sets(_routers(stock)[0](x))
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        if kernels:  # the kernel's sums in its own order: the last bit may differ
            torch.testing.assert_close(got[1], want[1], rtol=4 * torch.finfo(torch.float32).eps, atol=0)
        else:
            assert torch.equal(got[1], want[1])
        logits, want_logits = model(_ids()).logits, stock(_ids()).logits
    assert len(launches) == (2 if kernels else 0)
    if kernels:  # (groups, kept groups, normalize, scale) as the router's attributes say
        assert launches[-1][3:] == (stock.config.n_group, stock.config.topk_group, True, 2.5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    sd, ref = model.state_dict(), stock.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    hybridgemm.unpatch(model)
    router, stock_router = _routers(model)[0], _routers(stock)[0]
    assert type(router) is type(stock_router) and not router.__dict__.keys() - stock_router.__dict__.keys()


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernel"])
def test_the_router_reads_its_attributes_and_bias_at_every_call(kernels, monkeypatch):
    stock = _tiny("glm4_moe")
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    if kernels:
        monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    router, stock_router = _routers(model)[0], _routers(stock)[0]
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(6))
    before = router(x)
    for r in (router, stock_router):
        r.routed_scaling_factor, r.norm_topk_prob, r.topk_group = 1.5, False, 3
        with torch.no_grad():
            r.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
    with torch.no_grad():
        got, want = _as_sets(router(x)), _as_sets(stock_router(x))
    assert torch.equal(got[2], want[2]) and not torch.equal(got[2], _as_sets(before)[2])
    torch.testing.assert_close(got[1], want[1], rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def test_a_training_step_gives_stock_gradients():
    stock = _tiny("glm4_moe").train()
    model = copy.deepcopy(stock)
    hybridgemm.patch(model)
    for m in (stock, model):
        m(_ids(), labels=_ids()).loss.backward()
    got, want = _routers(model)[0].weight.grad, _routers(stock)[0].weight.grad
    assert got is not None and got.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_dynamo_traces_the_kernel_path_in_one_graph(monkeypatch):
    monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    model = _tiny("glm4_moe")
    hybridgemm.patch(model)
    router = _routers(model)[0]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # (with a gradient wanted, the PyTorch form runs)
        explained = torch._dynamo.explain(router)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert "route_sigmoid_fwd" in str(explained.graphs[0].graph)


def test_the_form_is_found_for_routers_built_on_meta_at_full_width():
    """GLM-4.5-Air's router width (128 experts of hidden 4096, one group): routers made on the
    meta device, as ``hybridgemm patch --dry-run`` builds models (to_empty leaves their bias
    buffers arbitrary), all take the form: the probe sets its own bias."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = transformers.Glm4MoeConfig(hidden_size=4096, n_routed_experts=128, num_experts_per_tok=8, n_group=1,
                                     topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    with torch.device("meta"):
        routers = [Glm4MoeTopkRouter(cfg) for _ in range(6)]
    if not isinstance(Glm4MoeTopkRouter(transformers.Glm4MoeConfig(hidden_size=8, n_routed_experts=4,
                                                                   num_experts_per_tok=2, n_group=1, topk_group=1))(
            torch.zeros(1, 8)), tuple):
        pytest.skip("this transformers' GLM-4-MoE router returns its logits only")
    forms = [why_not_router(r) for r in routers]
    assert all(isinstance(form, SigmoidRouterForm) and why is None for form, why in forms), forms


def test_routers_of_other_forms_are_reported_and_left_alone():
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    model = _tiny("glm4_moe")
    router = _routers(model)[0]

    class FakeSoftmaxTopkRouter(Glm4MoeTopkRouter):  # fp32 logits, but softmax scores
        __module__ = "transformers.models.fake.modeling_fake"

        def forward(self, hidden_states):
            logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
            weights, ids = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
            return logits, weights, ids

    router.__class__ = FakeSoftmaxTopkRouter
    form, why = why_not_router(router)
    assert form is None and "not DeepSeek-V3's sigmoid routing" in why
    report = hybridgemm.patch(model)
    assert type(router) is FakeSoftmaxTopkRouter
    assert any(name.endswith("mlp.gate") and "not DeepSeek-V3's sigmoid routing" in w for name, w in report.skipped)

    good = _routers(_tiny("glm4_moe"))[0]
    with torch.device("meta"):  # patch called in a device context: the probe still runs on the CPU
        assert isinstance(why_not_router(good)[0], SigmoidRouterForm)
    bad = copy.deepcopy(good)
    bad.topk_group = 5  # more groups kept than its 4
    form, why = why_not_router(bad)
    assert form is None and why.startswith("Glm4MoeTopkRouter:")


@pytest.mark.parametrize("kind", KINDS)
def test_a_router_that_only_computes_logits_is_reported(kind):
    """Whichever transformers: a router returning its logits only (the block routes) is left
    alone with the reason, and the patched model gives stock's logits."""
    stock = tiny_moe_lm(kind, VOCAB, 64, 8, 3, head_dim=16)
    router = _routers(stock)[0]
    if isinstance(router(torch.zeros(1, 64)), tuple):
        router.__class__ = type("LogitsOnlyRouter", (type(router),), {
            "__module__": type(router).__module__,
            "forward": lambda self, h: torch.nn.functional.linear(h.view(-1, 64).float(), self.weight.float())})
        stock.model.layers[1].mlp.__class__ = type("BlockRouting", (type(stock.model.layers[1].mlp),), {
            "__module__": type(stock.model.layers[1].mlp).__module__,
            "forward": lambda self, h: self.experts(h.view(-1, 64), *_route_in_block(self, self.gate(h))).view(
                h.shape) + self.shared_experts(h)})
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    assert type(_routers(model)[0]) is type(router)
    assert any(name.endswith("mlp.gate") and why.startswith(f"{type(router).__name__}: ")
               and ("does not return (logits, weights, experts)" in why or "no top_k" in why)  # (5.8's: no top_k)
               for name, why in report.skipped)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, stock(_ids()).logits, rtol=1e-4, atol=1e-4)


def _route_in_block(block, logits):
    """transformers 5.8's block routing, for a router made to return its logits only."""
    from hybridgemm.router import route_sigmoid_torch

    gate = block.gate
    ids, weights = route_sigmoid_torch(logits, gate.top_k, gate.e_score_correction_bias, gate.num_group,
                                       gate.topk_group, gate.norm_topk_prob, gate.routed_scaling_factor)
    return ids, weights


def _minicpm5_router():
    """MiniCPM5-MoE's router (it disables autocast around its GEMM), 8 experts in 2 groups."""
    module = pytest.importorskip("transformers.models.minicpm5_moe.modeling_minicpm5_moe")
    cfg = transformers.MiniCPM5MoeConfig(hidden_size=64, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
                                         topk_group=1)
    router = module.MiniCPM5MoeTopkRouter(cfg)
    torch.manual_seed(2)
    with torch.no_grad():
        router.weight.normal_(0, 0.2)
        router.e_score_correction_bias.normal_(0, 0.3)
    if not isinstance(router(torch.zeros(1, 64)), tuple):
        pytest.skip("this transformers' MiniCPM5-MoE router returns its logits only")
    return router


@pytest.mark.parametrize("which", ["glm4_moe", "minicpm5_moe"])
def test_under_autocast_the_router_computes_its_logits_in_stock_dtype(which):
    """Under bf16 autocast, a router whose forward lets autocast run its GEMM (GLM's) gives bf16
    logits and one that disables autocast there (MiniCPM5-MoE's) fp32 logits: the patched router
    the same, with stock's experts and weights."""
    stock = _minicpm5_router() if which == "minicpm5_moe" else _routers(_tiny("glm4_moe"))[0]
    router = copy.deepcopy(stock)
    hybridgemm.patch(router)
    assert type(router) is HybridSigmoidRouter
    assert router.route_sigmoid_form.autocast_off is (which == "minicpm5_moe")
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = _as_sets(router(x)), _as_sets(stock(x))
    assert got[0].dtype == want[0].dtype == (torch.float32 if which == "minicpm5_moe" else torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():  # without autocast, and on the meta device (shapes only), as stock
        assert all(torch.equal(a, b) for a, b in zip(_as_sets(router(x)), _as_sets(stock(x))))
        meta_got, meta_want = copy.deepcopy(router).to("meta"), copy.deepcopy(stock).to("meta")
        x = torch.empty(5, 64, device="meta")
        assert [t.shape for t in meta_got(x)] == [t.shape for t in meta_want(x)]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernel"])
def test_more_groups_kept_than_there_are_raises_as_stock_after_patch(kernels, monkeypatch):
    """One group (GLM-4.5-Air's form): a router whose kept groups are then set above its one group
    raises as the stock forward does, on the PyTorch form and where the kernel refuses it."""
    stock = _routers(_tiny("glm4_moe"))[0]
    stock.num_group, stock.topk_group = 1, 1
    router = copy.deepcopy(stock)
    hybridgemm.patch(router)
    if kernels:
        monkeypatch.setattr(experts, "use_kernels", lambda x: True)
    assert type(router) is HybridSigmoidRouter
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got, want = _as_sets(router(x)), _as_sets(stock(x))
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        torch.testing.assert_close(got[1], want[1], rtol=4 * torch.finfo(torch.float32).eps, atol=0)
        for r in (stock, router):
            r.topk_group = 2
        with pytest.raises(RuntimeError):
            stock(x)
        with pytest.raises(RuntimeError):
            router(x)
