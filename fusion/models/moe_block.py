"""A mixture-of-experts decoder layer's second half in the fused decode step,
``h + block(post_attention_layernorm(h))``: the norm (one launch, as the module computes it),
the router (its GEMM and the routing kernel, :class:`HybridTopKRouter`), then the experts' two
launches with the residual added to down's rounded sum (:meth:`HybridExperts.add_to`), the
layer's add bit for bit. Called as a module, the block's output is added in a launch of its
own.

The experts' gate/up launch could take the norm too (``moe(..., norm=)``, the pair-major
kernels' ``NORM``), but not at one token: on the H100 the FP8 Qwen3-30B-A3B step took 1.100 ms
with the norm there and in the router's split-K prologue, against 0.904 ms with the norm apart
(12 layers, B = 1, ``scripts/ab_base.sh``; ``perf/results/h100/README.md``), while B = 8 went
from 1.810 to 1.770 ms. So the norm runs apart, once, for both the router and the experts.

Which blocks: :func:`why_not_fuse_block` runs the block class's own forward once, at patch time,
with stand-ins for its router and experts that record what they are given, and checks that it
computes ``experts(x, ids, weights)`` of its router's outputs on the tokens as rows and returns
that in h's shape, nothing else (Mixtral's and Qwen3-MoE's blocks outside training). A block
with more modules (Qwen2-MoE's shared expert) is called as a module.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from hybridgemm.experts import HybridExperts
from hybridgemm.router import HybridTopKRouter

from .decode_checks import hooked

# Instance attribute set on a block :func:`why_not_fuse_block` accepted at patch time
FUSED_BLOCK = "_hybridgemm_fused_block"
_PROBE_SHAPE = (2, 3)  # (batch, sequence) of the probe's tokens


class _RouterStandIn(nn.Module):
    """Returns (logits, weights, ids) of its own; records the x it was given."""

    def __init__(self, experts: int, top_k: int):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.seen = self.out = None

    def forward(self, x: Tensor):
        g = torch.Generator().manual_seed(7)
        t = x.shape[0]
        self.seen = x
        self.out = (torch.randn(t, self.experts, generator=g), torch.rand(t, self.top_k, generator=g),
                    torch.randint(0, self.experts, (t, self.top_k), generator=g))
        return self.out


class _ExpertsStandIn(nn.Module):
    """Returns a function of x; records the (x, ids, weights) it was given."""

    def __init__(self):
        super().__init__()
        self.seen = self.out = None

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        self.seen = (x, ids, weights)
        self.out = x * 3.0 + 1.0
        return self.out


def why_not_fuse_block(block: nn.Module) -> str | None:
    """Why the step cannot compute a patched MoE block itself (None: it can); see the module
    docstring. Runs on the CPU with a few random tokens; touches none of the block's weights."""
    name = type(block).__name__
    if set(block._modules) != {"gate", "experts"}:
        return f"{name}: modules beside its router and experts ({', '.join(sorted(block._modules))})"
    router, experts = block._modules["gate"], block._modules["experts"]
    if not isinstance(router, HybridTopKRouter) or not isinstance(experts, HybridExperts):
        return f"{name}: its router or experts are not the patched ones"
    e, hidden = router.weight.shape
    probe = copy.copy(block)
    gate, stand_in = _RouterStandIn(e, router.top_k), _ExpertsStandIn()
    probe.__dict__["_modules"] = {"gate": gate, "experts": stand_in}
    probe.__dict__["training"] = False
    x = torch.randn(*_PROBE_SHAPE, hidden, generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            y = type(block).forward(probe, x)
    except Exception as exc:  # its forward takes another form: the module call runs it
        return f"{name}: its forward with stand-in router and experts raised {type(exc).__name__}"
    rows = x.reshape(-1, hidden)
    if gate.seen is None or stand_in.seen is None or not torch.equal(gate.seen, rows):
        return f"{name}: its forward does not route the tokens as rows"
    seen_x, ids, weights = stand_in.seen
    if not (torch.equal(seen_x, rows) and ids is gate.out[2] and weights is gate.out[1]):
        return f"{name}: its experts do not take the tokens with its router's experts and weights"
    if not isinstance(y, Tensor) or not torch.equal(y, stand_in.out.reshape(x.shape)):
        return f"{name}: it returns more than its experts' output"
    return None


def block_step(layer: nn.Module, h: Tensor) -> Tensor | None:
    """``h + layer.mlp(layer.post_attention_layernorm(h))`` as the module docstring says, or None
    where this call cannot take it (a block not accepted at patch time, training, hooks on the
    block or its experts, whose forwards it does not call, experts the kernels do not run)."""
    block = layer.mlp
    if not block.__dict__.get(FUSED_BLOCK) or block.training:
        return None
    router, experts = block._modules.get("gate"), block._modules.get("experts")
    if not isinstance(router, HybridTopKRouter) or not isinstance(experts, HybridExperts) \
            or hooked(block) or hooked(experts):
        return None
    x = layer.post_attention_layernorm(h).reshape(-1, h.shape[-1])
    _, weights, ids = router(x)
    if not experts.kernels_run(x, weights):  # (the PyTorch loop: gradients wanted, say)
        return h + experts(x, ids, weights).view(h.shape)
    return experts.add_to(h.reshape(x.shape), x, ids, weights).view(h.shape)


__all__ = ["FUSED_BLOCK", "block_step", "why_not_fuse_block"]
