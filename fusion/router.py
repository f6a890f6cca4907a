"""Mixture-of-experts routers: :class:`HybridTopKRouter` stands in for transformers' softmax-top-k
routers (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter`` and any other
that computes the same), with the router's GEMM through the dispatcher and the routing in one
kernel launch (:func:`hybridgemm.experts.route`).

Which routers: :func:`why_not_router` runs the router's own forward once, at patch time, on a
bf16 CPU copy of it with random weights and a few random tokens, and compares its outputs bit
for bit with the PyTorch forms of that routing (renormalised or not, weights in fp32 or in
the logits' dtype). The form that matches is what the patched router computes; none matching
leaves the router as it is, with the reason. So the choice follows what the installed
transformers computes, not its source text.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .experts import route, route_torch
from .linear_layer import linear

PROBE_TOKENS = 4
PROBE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class RouterForm:
    renormalize: bool  # the k weights divided by their sum
    logits_dtype_weights: bool  # the weights cast to the logits' dtype (else fp32)


# the forms a probe tries, in this order
FORMS = (RouterForm(True, False), RouterForm(True, True), RouterForm(False, False), RouterForm(False, True))


def why_not_router(mod: nn.Module) -> tuple[RouterForm | None, str | None]:
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


def _probe(mod: nn.Module, top_k: int) -> tuple[RouterForm | None, str | None]:
    # On a CPU copy in bf16 with random weights, whatever the router's device, dtype and values
    # (meta included): its form does not depend on them, the form shows in bf16 (in fp32
    # "weights in fp32" and "in the logits' dtype" look alike, and a model may be cast after
    # patching), and random weights of the right scale tell renormalised from not (zero weights
    # tie every expert; large logits make the softmax one-hot, its top k summing to 1 either way).
    name = type(mod).__name__
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            probe = copy.deepcopy(mod).to_empty(device="cpu").to(PROBE_DTYPE)
            weight = probe.weight  # logits of about unit scale
            weight.copy_(torch.randn(weight.shape, generator=g) / weight.shape[1] ** 0.5)
            x = torch.randn(PROBE_TOKENS, weight.shape[1], generator=g).to(PROBE_DTYPE)
            out = type(mod).forward(probe, x)
    except Exception as exc:  # a router that does not take [tokens, hidden]: its own business
        return None, f"{name}: its forward on [tokens, hidden] raised {type(exc).__name__}"
    if not isinstance(out, tuple) or len(out) != 3 or not all(isinstance(o, Tensor) for o in out):
        return None, f"{name}: its forward does not return (logits, weights, experts)"
    logits, weights, ids = out
    with torch.no_grad():
        if logits.shape != (PROBE_TOKENS, weight.shape[0]) or not torch.equal(logits, F.linear(x, weight)):
            return None, f"{name}: its first output is not the router GEMM's logits"
        for form in FORMS:
            want_ids, want = route_torch(logits, top_k, form.renormalize, _weights_dtype(form, logits))
            if weights.dtype == want.dtype and torch.equal(ids, want_ids) and torch.equal(weights, want):
                return form, None
    return None, f"{name}: its routing is not softmax then top-k (then renormalised), which the kernel computes"


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
        logits = linear(hidden_states.reshape(-1, weight.shape[1]), weight)
        weights_dtype = logits.dtype if self.route_logits_dtype_weights else torch.float32
        ids, weights = route(logits, self.top_k, self.route_renormalize, weights_dtype)
        return logits, weights, ids


__all__ = ["FORMS", "HybridTopKRouter", "RouterForm", "why_not_router"]
