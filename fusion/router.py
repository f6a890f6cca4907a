"""Mixture-of-experts routers: :class:`HybridTopKRouter` stands in for transformers' softmax-top-k
routers (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter`` and any other
that computes the same), with the router's GEMM through the dispatcher and the routing in one
kernel launch (:func:`hybridgemm.experts.route`). With ``HYBRIDGEMM_FUSED_ROUTER=1``, read at
import, a decode call on the GPU (up to :data:`FUSED_MAX_TOKENS` tokens) runs both in one
launch instead: split-K with the routing in its epilogue (kernels/triton_splitk.py
``route_config``, ``run(route=)``). Its GEMM runs that fixed config, not the table's, so a
logit may differ from the two-launch form's by its rounding (another summation order), and
the routing is of the logits it stores (a weight may differ from the routing kernel's in its
last bit, an expert choice only between experts that close).

:class:`HybridSigmoidRouter` stands in for DeepSeek-V3's router form (``DeepseekV3TopkRouter``,
``Glm4MoeTopkRouter`` and the others that compute the same): the logits of the router's GEMM
in fp32 as the stock forward computes them (``F.linear`` of x and the weight in fp32; under
autocast in autocast's dtype, or in fp32 where the stock forward disables autocast there), then
sigmoid scores, the selection bias, the group-limited choice, normalisation and scaling in one
launch (:func:`route_sigmoid`, kernels/triton_router.py ``route_sigmoid``), reading the
router's own attributes (its groups, kept groups, ``norm_topk_prob``, ``routed_scaling_factor``
and ``e_score_correction_bias``) at every call.

Which routers: :func:`why_not_router` runs the router's own forward once, at patch time, on a
bf16 CPU copy of it with random weights and a few random tokens, and compares its outputs bit
for bit with the PyTorch forms of that routing (softmax: renormalised or not, weights in fp32
or in the logits' dtype; sigmoid: the experts as a set, since those routers' ``torch.topk``
leaves their order unspecified). The form that matches is what the patched router computes;
none matching leaves the router as it is, with the reason. So the choice follows what the
installed transformers computes, not its source text.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm.diagnostics import warn_once
from hybridgemm.kernels.checks import row_major
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.process_memory import per_call_scratch

from . import experts
from .experts import route, route_torch
from .linear_layer import linear

PROBE_TOKENS = 4
PROBE_DTYPE = torch.bfloat16
FUSED_ROUTER = os.environ.get("HYBRIDGEMM_FUSED_ROUTER", "0") == "1"
FUSED_MAX_TOKENS = 16  # decode: one x tile of 16 rows (a router's tile of all its experts stays in registers)
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class RouterForm:
    renormalize: bool  # the k weights divided by their sum
    logits_dtype_weights: bool  # the weights cast to the logits' dtype (else fp32)


# the forms a probe tries, in this order
FORMS = (RouterForm(True, False), RouterForm(True, True), RouterForm(False, False), RouterForm(False, True))


@dataclass(frozen=True)
class SigmoidRouterForm:
    """The attributes a DeepSeek-V3-form router's forward reads (read again at every call)."""

    groups: str  # its number of expert groups
    topk_groups: str  # the groups kept
    normalize: str  # the k weights divided by their sum (plus 1e-20)
    scale: str  # the weights' factor
    bias: str | None  # its selection-bias buffer, if any
    autocast_off: bool = False  # its GEMM runs in fp32 under autocast too (autocast disabled around it)


# the attribute names transformers' routers of this form use, tried in this order
_SIGMOID_NAMES = {"groups": ("num_group", "n_group"), "topk_groups": ("topk_group",),
                  "normalize": ("norm_topk_prob",), "scale": ("routed_scaling_factor",)}
_SIGMOID_BIAS = "e_score_correction_bias"


def why_not_router(mod: nn.Module) -> tuple[RouterForm | SigmoidRouterForm | None, str | None]:
    """``(form, None)`` for a transformers router :class:`HybridTopKRouter` computes, ``(None,
    reason)`` for another transformers router, ``(None, None)`` for anything else."""
    t = type(mod)
    if not t.__module__.startswith("transformers") or not t.__name__.endswith("Router"):
        return None, None
    weight = mod._parameters.get("weight")
    if weight is None or weight.dim() != 2 or len(mod._parameters) != 1 or mod._modules:
        return None, f"{t.__name__}: not a router of one [experts, hidden] weight without bias"
    top_k = getattr(mod, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= weight.shape[0]:
        return None, f"{t.__name__}: no top_k in 1..{weight.shape[0]} (its experts)"
    if not weight.is_floating_point():
        return None, f"{t.__name__}: weight of {weight.dtype}, not a floating-point router"
    return _probe(mod, top_k)


def _probe(mod: nn.Module, top_k: int) -> tuple[RouterForm | SigmoidRouterForm | None, str | None]:
    # On a CPU copy in bf16 with random weights, whatever the router's device, dtype and values
    # (meta included) and whatever device context patch runs in: its form does not depend on
    # them, the form shows in bf16 (in fp32 "weights in fp32" and "in the logits' dtype" look
    # alike, and a model may be cast after patching), and random weights of the right scale tell
    # renormalised from not (zero weights tie every expert; large logits make the softmax
    # one-hot, its top k summing to 1 either way).
    with torch.device("cpu"):
        return _probe_on_cpu(mod, top_k)


def _probe_on_cpu(mod: nn.Module, top_k: int) -> tuple[RouterForm | SigmoidRouterForm | None, str | None]:
    name = type(mod).__name__
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            probe = copy.deepcopy(mod).to_empty(device="cpu").to(PROBE_DTYPE)
            weight = probe.weight  # logits of about unit scale
            weight.copy_(torch.randn(weight.shape, generator=g) / weight.shape[1] ** 0.5)
            for b in probe.buffers():  # (a selection bias: values that change choices; to_empty left none)
                if b.is_floating_point():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            x = torch.randn(PROBE_TOKENS, weight.shape[1], generator=g).to(PROBE_DTYPE)
            out = type(mod).forward(probe, x)
    except Exception as exc:  # a router that does not take [tokens, hidden]: its own business
        return None, f"{name}: its forward on [tokens, hidden] raised {type(exc).__name__}"
    if not isinstance(out, tuple) or len(out) != 3 or not all(isinstance(o, Tensor) for o in out):
        return None, f"{name}: its forward does not return (logits, weights, experts)"
    logits, weights, ids = out
    with torch.no_grad():
        if logits.shape == (PROBE_TOKENS, weight.shape[0]) and logits.dtype == torch.float32 \
                and torch.equal(logits, F.linear(x.float(), weight.float())):
            return _sigmoid_form(mod, probe, top_k, logits, weights, ids)
        if logits.shape != (PROBE_TOKENS, weight.shape[0]) or not torch.equal(logits, F.linear(x, weight)):
            return None, f"{name}: its first output is not the router GEMM's logits"
        for form in FORMS:
            want_ids, want = route_torch(logits, top_k, form.renormalize, _weights_dtype(form, logits))
            if weights.dtype == want.dtype and torch.equal(ids, want_ids) and torch.equal(weights, want):
                return form, None
    return None, f"{name}: its routing is not softmax then top-k (then renormalised), which the kernel computes"


def _sigmoid_form(mod: nn.Module, probe: nn.Module, top_k: int, logits: Tensor, weights: Tensor,
                  ids: Tensor) -> tuple[SigmoidRouterForm | None, str | None]:
    """The :class:`SigmoidRouterForm` whose routing of the probe's fp32 ``logits`` gives the
    probe's ``(weights, ids)``, the experts compared as sets; else (None, the reason)."""
    name = type(mod).__name__
    found = {k: next((n for n in names if n in mod.__dict__), None) for k, names in _SIGMOID_NAMES.items()}
    bias = _SIGMOID_BIAS if isinstance(mod._buffers.get(_SIGMOID_BIAS), Tensor) else None
    if None in found.values():
        return None, f"{name}: fp32 logits, but not the sigmoid routing's attributes ({', '.join(_SIGMOID_NAMES)})"
    form = SigmoidRouterForm(bias=bias, autocast_off=_fp32_under_autocast(mod, probe), **found)
    try:
        want_ids, want = route_sigmoid_torch(logits, top_k, *_sigmoid_args(probe, form))
    except (RuntimeError, ValueError, TypeError) as exc:
        return None, f"{name}: its sigmoid routing's attributes do not fit its experts ({exc})"
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    if weights.dtype == want.dtype and torch.equal(order.values, want_order.values) \
            and torch.equal(weights.gather(1, order.indices), want.gather(1, want_order.indices)):
        return form, None
    return None, f"{name}: its routing of fp32 logits is not DeepSeek-V3's sigmoid routing, which the kernel computes"


def _fp32_under_autocast(mod: nn.Module, probe: nn.Module) -> bool:
    """Does the router's forward keep its logits fp32 under bf16 autocast (some disable autocast
    around their GEMM; most let autocast run it in bf16)?"""
    x = torch.randn(PROBE_TOKENS, probe.weight.shape[1], generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = type(mod).forward(probe, x)
    except Exception:  # (its forward ran without autocast: the routing decides)
        return False
    return isinstance(out, tuple) and isinstance(out[0], Tensor) and out[0].dtype == torch.float32


def _sigmoid_args(router: nn.Module, form: SigmoidRouterForm) -> tuple:
    """(bias, groups, topk_groups, normalize, scale) of ``router`` now, for :func:`route_sigmoid`."""
    bias = router._buffers.get(form.bias) if form.bias is not None else None
    return (bias, int(getattr(router, form.groups)), int(getattr(router, form.topk_groups)),
            bool(getattr(router, form.normalize)), float(getattr(router, form.scale)))


def route_sigmoid_torch(logits: Tensor, top_k: int, bias: Tensor | None, groups: int, topk_groups: int,
                        normalize: bool, scale: float) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's routing of fp32 ``logits`` [T, E] in PyTorch, the operations of
    transformers' router op for op (differentiable): ``(ids [T, k], weights [T, k] fp32)``."""
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    # the group step for one group too: it keeps every expert, and raises where stock's raises
    # (more groups kept than there are)
    group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, topk_groups, dim=-1, sorted=False)[1], 1)
    allowed = kept.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
    choice = choice.masked_fill(~allowed.bool(), float("-inf"))
    # unsorted, as transformers' router takes them: the weights' sum then adds them in its order
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale


def route_sigmoid(logits: Tensor, top_k: int, bias: Tensor | None = None, groups: int = 1, topk_groups: int = 1,
                  normalize: bool = True, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's routing of fp32 router logits [T, E]: one Triton launch where the kernels
    run and take the operands and no gradient is wanted (kernels/triton_router.py; a weight may
    differ from PyTorch's in its last bit, an expert choice only between experts that close),
    else :func:`route_sigmoid_torch`."""
    wants_grad = torch.is_grad_enabled() and (logits.requires_grad or bias is not None and bias.requires_grad)
    if not wants_grad and experts.use_kernels(logits) and logits.dtype == torch.float32:
        if torch.compiler.is_compiling():  # (Dynamo traces no first import of the kernel module)
            return torch.ops.hybridgemm.route_sigmoid_fwd(logits, top_k, bias, groups, topk_groups, normalize, scale)
        return _route_sigmoid_kernel(logits, top_k, bias, groups, topk_groups, normalize, scale)
    return route_sigmoid_torch(logits, top_k, bias, groups, topk_groups, normalize, scale)


def _route_sigmoid_kernel(logits: Tensor, top_k: int, bias: Tensor | None, groups: int, topk_groups: int,
                          normalize: bool, scale: float) -> tuple[Tensor, Tensor]:
    kernel = triton_module("triton_router")
    if kernel.why_not_sigmoid(logits, top_k, bias, groups, topk_groups) is None:
        return kernel.launch_sigmoid(logits, top_k, bias, groups, topk_groups, normalize, scale)
    return route_sigmoid_torch(logits, top_k, bias, groups, topk_groups, normalize, scale)


@torch.library.custom_op("hybridgemm::route_sigmoid_fwd", mutates_args=())
def route_sigmoid_fwd(logits: Tensor, top_k: int, bias: Tensor | None, groups: int, topk_groups: int, normalize: bool,
                      scale: float) -> tuple[Tensor, Tensor]:
    return _route_sigmoid_kernel(logits, top_k, bias, groups, topk_groups, normalize, scale)


@route_sigmoid_fwd.register_fake
def _route_sigmoid_fwd_fake(logits, top_k, bias, groups, topk_groups, normalize, scale):
    t = logits.shape[0]
    return logits.new_empty((t, top_k), dtype=torch.int64), logits.new_empty((t, top_k), dtype=torch.float32)


class HybridSigmoidRouter(nn.Module):
    """Stands in for a transformers router of DeepSeek-V3's form (its class is swapped in place;
    its weight, bias buffer, attributes and hooks stay): ``(logits, weights, experts)`` of
    ``hidden_states`` [..., H], the fp32 logits as the stock forward computes them, the routing
    by :func:`route_sigmoid` with the attributes :attr:`route_sigmoid_form` names."""

    route_sigmoid_form: SigmoidRouterForm

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        weight = self.weight
        x = hidden_states.reshape(-1, weight.shape[1]).float()
        device = x.device.type
        # autocast switched off only where it is on (as transformers' maybe_autocast: no region in
        # a graph that needs none; the meta device has no autocast); else under autocast in
        # autocast's dtype, as the stock forward
        off = self.route_sigmoid_form.autocast_off and device != "meta" and torch.is_autocast_enabled(device)
        with torch.autocast(device, enabled=False) if off else contextlib.nullcontext():
            logits = F.linear(x, weight.float())
        ids, weights = route_sigmoid(logits, self.top_k, *_sigmoid_args(self, self.route_sigmoid_form))
        return logits, weights, ids


def _weights_dtype(form: RouterForm, logits: Tensor) -> torch.dtype:
    return logits.dtype if form.logits_dtype_weights else torch.float32


class HybridTopKRouter(nn.Module):
    """Stands in for a transformers softmax-top-k router (its class is swapped in place; its
    weight, ``top_k`` and hooks stay): ``(logits, weights, experts)`` of
    ``hidden_states`` [..., H], the logits by :func:`hybridgemm.linear`, the routing by
    :func:`hybridgemm.experts.route` in the form :func:`why_not_router` found."""

    route_renormalize = True
    route_logits_dtype_weights = False

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        weight = self.weight
        x = hidden_states.reshape(-1, weight.shape[1])
        if _fused_runs(x, weight):  # (the logits then have x's dtype)
            fused = torch.ops.hybridgemm.router_fwd if torch.compiler.is_compiling() else _router
            weights_dtype = x.dtype if self.route_logits_dtype_weights else torch.float32
            return fused(x, weight, self.top_k, self.route_renormalize, weights_dtype)
        return _two_launches(x, weight, self.top_k, self.route_renormalize, self.route_logits_dtype_weights)


def _two_launches(x: Tensor, weight: Tensor, top_k: int, renormalize: bool,
                  logits_dtype_weights: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The router's GEMM by the dispatcher, then the routing (:func:`hybridgemm.experts.route`)."""
    logits = linear(x, weight)
    ids, weights = route(logits, top_k, renormalize, logits.dtype if logits_dtype_weights else torch.float32)
    return logits, weights, ids


def _fused_runs(x: Tensor, weight: Tensor) -> bool:
    """Does a router call take the one-launch form (module docstring)? Asked for, on the
    kernels' device, decode rows, one floating dtype, no autograd wanted."""
    return FUSED_ROUTER and experts.use_kernels(x) and 1 <= x.shape[0] <= FUSED_MAX_TOKENS \
        and x.dtype in _FUSED_DTYPES and weight.dtype == x.dtype \
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def _router(x: Tensor, weight: Tensor, top_k: int, renormalize: bool,
            weights_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(logits, weights, ids)`` of a router in one split-K launch with the routing in its
    epilogue, or where that does not take the router (more experts than one tile holds, a
    refused launch: warned once) its GEMM and then the routing kernel."""
    splitk = triton_module("triton_splitk")
    (m, k), e = x.shape, weight.shape[0]
    config = splitk.route_config(m, e, k, x.element_size()) if top_k <= splitk.MAX_TOP_K else None
    if config is not None:
        logits = x.new_empty((m, e))
        ids = torch.empty((m, top_k), dtype=torch.int64, device=x.device)
        weights = torch.empty((m, top_k), dtype=weights_dtype, device=x.device)
        try:
            splitk.run(config, row_major(x), row_major(weight), None, logits, None, route=(ids, weights, renormalize))
            return logits, weights, ids
        except (ValueError, TypeError) as exc:
            warn_once(("fused_router", tuple(weight.shape), x.dtype),
                      f"hybridgemm: the router's GEMM could not route in its epilogue ({exc}); it runs apart")
    return _two_launches(x, weight, top_k, renormalize, weights_dtype != torch.float32)


@torch.library.custom_op("hybridgemm::router_fwd", mutates_args=())
def router_fwd(x: Tensor, weight: Tensor, top_k: int, renormalize: bool,
               weights_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_router` as one opaque op under torch.compile. Its arrival counters are allocated
    (zero-filled) per call, as every compiled op's without a layer's counters."""
    with per_call_scratch():  # no scratch cached from inside a compiled region (CUDA graph trees)
        return _router(x, weight, top_k, renormalize, weights_dtype)


@router_fwd.register_fake
def _router_fwd_fake(x, weight, top_k, renormalize, weights_dtype):
    m = x.shape[0]
    return (x.new_empty((m, weight.shape[0])), x.new_empty((m, top_k), dtype=weights_dtype),
            x.new_empty((m, top_k), dtype=torch.int64))


__all__ = ["FORMS", "HybridSigmoidRouter", "HybridTopKRouter", "RouterForm", "SigmoidRouterForm", "route_sigmoid",
           "route_sigmoid_torch", "why_not_router"]
