"""DeepSeek-V3's routing kernel (kernels/triton_router.py ``route_sigmoid``) against an fp64
reference: sigmoid scores, the selection bias, the group-limited choice (two largest per group,
the best groups kept), the k largest with the lowest expert first among equals, normalised or
not, scaled; T = 1, 3, 17, 333, expert counts that are not powers of two, no bias, ties of
groups and of experts, strided rows, the refusals; on the GPU also against transformers' own
router (the experts it selects as a set, its weights)."""

from __future__ import annotations

import pytest
import torch

from hybridgemm.kernels import triton_router as tr
from hybridgemm.kernels.triton_launch import interpreting

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICES = [pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET=1")),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _operands(t, e, device, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    b = torch.randn(e, generator=g) * 0.3 if bias else None
    return logits.to(device), None if b is None else b.to(device)


def _reference(logits, k, bias, groups, topk_groups, normalize, scale):
    """fp64, in the order the kernel documents: groups by the sum of their two largest choice
    scores (the lowest group first among equals), then the k largest (the lowest expert first)."""
    s = logits.double().cpu().sigmoid()
    c = s if bias is None else s + bias.double().cpu()
    t, e = c.shape
    if groups > 1:
        group_scores = c.view(t, groups, e // groups).topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
        allowed = torch.zeros(t, groups, dtype=torch.bool).scatter_(1, kept, True)
        c = c.masked_fill(~allowed.repeat_interleave(e // groups, dim=1), float("-inf"))
    else:
        group_scores = None
    ids = torch.sort(c, dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(1, ids)
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * scale, (c, group_scores)


def _margin_ok(c, k, group_scores, topk_groups):
    """Rows whose k-th and (k+1)-th choice scores, and whose last kept and first dropped groups'
    scores, are apart by more than rounding (where any correct fp32 routing chooses alike)."""
    ok = torch.ones(c.shape[0], dtype=torch.bool)
    if k < c.shape[1]:
        top = torch.topk(c, k + 1, dim=-1).values
        ok &= ~torch.isfinite(top[:, k]) | ((top[:, k - 1] - top[:, k]) > 1e-5)
    if group_scores is not None and topk_groups < group_scores.shape[1]:
        top = torch.topk(group_scores, topk_groups + 1, dim=-1).values
        ok &= (top[:, topk_groups - 1] - top[:, topk_groups]) > 1e-5
    return ok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,k,groups,topk_groups", [(1, 16, 4, 4, 2), (3, 60, 6, 6, 3), (17, 256, 8, 8, 4),
                                                      (333, 128, 8, 1, 1), (5, 1000, 10, 10, 5), (2, 6, 6, 3, 3)])
@pytest.mark.parametrize("normalize,scale,bias", [(True, 2.5, True), (False, 1.0, True), (True, 1.0, False)])
def test_the_kernel_matches_fp64(device, t, e, k, groups, topk_groups, normalize, scale, bias):
    logits, b = _operands(t, e, device, seed=t * 1000 + e, bias=bias)
    ids, weights = tr.route_sigmoid(logits, k, b, groups, topk_groups, normalize, scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (t, k) and ids.device == logits.device
    want_ids, want, (c, group_scores) = _reference(logits, k, b, groups, topk_groups, normalize, scale)
    ok = _margin_ok(c, k, group_scores, topk_groups)
    assert ok.float().mean() > 0.9  # the comparison covers most rows
    assert torch.equal(ids.cpu()[ok], want_ids[ok])
    torch.testing.assert_close(weights.cpu().double()[ok], want[ok], rtol=16 * torch.finfo(torch.float32).eps,
                               atol=1e-30)
    assert all(len(set(row)) == k for row in ids.tolist())  # k different experts per token


@pytest.mark.parametrize("device", DEVICES)
def test_ties_take_the_lowest_groups_and_experts_first(device):
    e, k = 12, 3
    logits = torch.zeros(3, e)
    # row 1: groups of four; groups 0 and 2 tie (their two largest sum alike), group 1 below
    logits[1] = torch.tensor([1., 0, 0, 1, -1, -1, -1, -1, 0, 1, 1, 0])
    logits[2] = -torch.arange(e, dtype=torch.float32)  # strictly ordered
    ids, weights = tr.route_sigmoid(logits.to(device), k, None, groups=3, topk_groups=1, normalize=False)
    # row 0: every group and expert ties: group 0, experts 0..2; row 1: group 0 (over 2), its 1s then a 0
    assert ids.tolist() == [[0, 1, 2], [0, 3, 1], [0, 1, 2]]
    assert torch.equal(weights[0].cpu(), torch.full((k,), 0.5))  # sigmoid(0), not normalised


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_empty_input(device):
    wide, b = _operands(7, 40, device, seed=3)
    logits = wide[:, 8:32]  # rows 40 apart, experts contiguous
    got = tr.route_sigmoid(logits, 4, b[8:32], 4, 2, True, 2.0)
    want = tr.route_sigmoid(logits.contiguous(), 4, b[8:32].contiguous(), 4, 2, True, 2.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ids, weights = tr.route_sigmoid(logits[:0], 4, b[8:32], 4, 2)
    assert ids.shape == weights.shape == (0, 4)


@pytest.mark.parametrize("args,match", [
    (dict(groups=5), "groups of 20 experts"),  # 20 experts in 5 groups of 4 fit; 16 do not divide by 5
    (dict(groups=16), "groups of two experts or more"),
    (dict(groups=4, topk_groups=5), "groups kept of 4"),
    (dict(groups=4, topk_groups=1, top_k=5), "groups kept of 4"),  # one group of 4 cannot hold 5
    (dict(bias=torch.zeros(15)), "selection bias must be a contiguous \\[16\\]"),
    (dict(bias=torch.zeros(32)[::2]), "selection bias must be a contiguous \\[16\\]"),
    (dict(top_k=17), "top_k 17 is not in 1..16"),
])
def test_bad_operands_are_refused(args, match):
    logits = torch.randn(3, 16)
    kw = dict(top_k=2, bias=None, groups=1, topk_groups=1) | args
    if match.startswith("groups of 20"):
        assert tr.why_not_sigmoid(torch.randn(3, 20), 2, None, 5, 1) is None
        match = "groups of 16 experts"
    with pytest.raises(ValueError, match=match):
        tr.route_sigmoid(logits, kw["top_k"], kw["bias"], kw["groups"], kw["topk_groups"])


@pytest.mark.gpu
@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [(256, 8, 8, 4), (128, 8, 1, 1), (160, 6, 8, 3)])
def test_the_routing_is_transformers_routers_on_cuda(experts, top_k, groups, topk_groups):
    """DeepSeek-V3's router of transformers on CUDA, fp32 logits: the same experts (as a set,
    its top-k is unsorted) and weights within fp32 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=256, n_routed_experts=experts, num_experts_per_tok=top_k,
                                        n_group=groups, topk_group=topk_groups, routed_scaling_factor=2.5,
                                        norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg).cuda()
    g = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) / 16)
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
    x = torch.randn(4000, 256, generator=g).cuda()
    with torch.no_grad():
        logits, want, want_ids = router(x)
    ids, weights = tr.route_sigmoid(logits, top_k, router.e_score_correction_bias, groups, topk_groups, True, 2.5)
    got_order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    same = (got_order.values == want_order.values).all(dim=-1)
    assert same.float().mean() > 0.999, "the selected experts differ from transformers' router's"
    torch.testing.assert_close(weights.gather(1, got_order.indices)[same], want.gather(1, want_order.indices)[same],
                               rtol=8 * torch.finfo(torch.float32).eps, atol=0)


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_router as tr

fn = tr._route_sigmoid_kernel
types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "scale": "fp32"}
for e, k, groups, kept in ((256, 8, 8, 4), (128, 8, 1, 1), (160, 6, 8, 3)):
    consts = dict(TOP_K=k, EP=triton.next_power_of_2(e), KP=triton.next_power_of_2(k), GROUPS=groups,
                  GROUP_SIZE=e // groups, TOPK_GROUPS=kept, NORMALIZE=True, HAS_BIAS=True, PDL=True, LIBDEVICE=True)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    try:
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 1})
    except (TypeError, KeyError, AttributeError) as exc:
        raise SystemExit(f"API: {type(exc).__name__}: {exc}")
    assert c.asm["cubin"], e
    assert "__nv_expf" in c.asm["ttgir"], "the sigmoid's exp must be libdevice's expf"
print("compiled")
"""


def test_the_kernel_compiles_for_hopper_with_libdevices_expf():
    """Built for sm_90 by Triton's ptxas (no GPU needed), with PDL, at DeepSeek-V3's, GLM-4.5-Air's
    and a 160-expert router's sizes; its sigmoid calls libdevice's expf, not Triton's approximate exp."""
    from helpers import compile_offline

    compile_offline(_COMPILE_FOR_HOPPER)
