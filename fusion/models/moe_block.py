"""A mixture-of-experts decoder layer's second half in the fused decode step,
``h + block(post_attention_layernorm(h))``: the norm (one launch, as the module computes it),
the router (its GEMM and the routing kernel, :class:`HybridTopKRouter`), then the experts' two
launches with the residual added to down's rounded sum (:meth:`HybridExperts.add_to`), the
layer's add bit for bit. Called as a module, the block's output is added in a launch of its
own. Measured on the H100 (FP8 Qwen3-30B-A3B, 12 layers, ``scripts/ab_base.sh`` against the
block called as a module; ``perf/results/h100/README.md``): 0.843 → 0.840 ms a step at B = 1
(within the spread), 1.786 → 1.769 ms at B = 8.

The experts' gate/up launch can take the norm too (``moe(..., norm=)``, the pair-major
kernels' ``NORM``); the step does not use it: with the norm there and in the router's split-K
prologue, the same step took 1.100 ms at B = 1 against 0.904 ms with the block called as a
module (1.770 against 1.810 ms at B = 8).

Which blocks: :func:`why_not_fuse_block` runs the block class's own forward at patch time, on
the CPU in the router's dtype for one token and for six, with stand-ins for its router and
experts that record what they are given, and checks that it calls each once, hands the
router the tokens as rows and the experts those rows with the router's experts and weights,
and returns the experts' output in h's shape and dtype, nothing else (Mixtral's, Qwen3-MoE's and
OLMoE's blocks outside training). A block with more modules (Qwen2-MoE's shared expert) is
called as a module. The probe runs on a shallow copy: the block's parameters and buffers are
the real ones (none of the recognised blocks' forwards touches them).
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
_PROBE_SHAPES = ((1, 1), (2, 3))  # (batch, sequence) of the probe's tokens


class _RouterStandIn(nn.Module):
    """Returns (logits, weights, ids) of its own; records the x it was given."""

    def __init__(self, experts: int, top_k: int):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.seen, self.out = [], None

    def forward(self, x: Tensor):
        g = torch.Generator().manual_seed(7)
        t = x.shape[0]
        self.seen.append(x)
        self.out = (torch.randn(t, self.experts, generator=g).to(x.dtype), torch.rand(t, self.top_k, generator=g),
                    torch.randint(0, self.experts, (t, self.top_k), generator=g))
        return self.out


class _ExpertsStandIn(nn.Module):
    """Returns a function of x; records the (x, ids, weights) it was given."""

    def __init__(self):
        super().__init__()
        self.seen, self.out = [], None

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        self.seen.append((x, ids, weights))
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
    dtype = router.weight.dtype if router.weight.is_floating_point() else torch.float32
    try:
        with torch.device("cpu"), torch.no_grad():
            for shape in _PROBE_SHAPES:
                why = _probe(block, e, router.top_k, hidden, dtype, shape)
                if why is not None:
                    return f"{name}: {why}"
    except Exception as exc:  # its forward takes another form: the module call runs it
        return f"{name}: its forward with stand-in router and experts raised {type(exc).__name__}"
    return None


def _probe(block: nn.Module, e: int, top_k: int, hidden: int, dtype: torch.dtype, shape: tuple) -> str | None:
    probe = copy.copy(block)
    gate, stand_in = _RouterStandIn(e, top_k), _ExpertsStandIn()
    probe.__dict__["_modules"] = {"gate": gate, "experts": stand_in}
    probe.__dict__["training"] = False
    x = torch.randn(*shape, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = type(block).forward(probe, x)
    rows = x.reshape(-1, hidden)
    if len(gate.seen) != 1 or len(stand_in.seen) != 1:
        return "its forward does not call its router and its experts once each"
    seen = gate.seen[0]
    if seen.dtype != dtype or not torch.equal(seen, rows):
        return "its forward does not route the tokens as rows, as they are"
    seen_x, ids, weights = stand_in.seen[0]
    if not (seen_x.dtype == dtype and torch.equal(seen_x, rows) and ids is gate.out[2] and weights is gate.out[1]):
        return "its experts do not take the tokens with its router's experts and weights"
    if not isinstance(y, Tensor) or y.dtype != dtype or not torch.equal(y, stand_in.out.reshape(x.shape)):
        return "it returns more than its experts' output"
    return None


def block_step(layer: nn.Module, h: Tensor) -> Tensor | None:
    """``h + layer.mlp(layer.post_attention_layernorm(h))`` as the module docstring says, or None
    where this call cannot take it (a block not accepted at patch time, training, hooks on the
    block or its experts, whose forwards it does not call). Where the kernels do not run the
    experts (gradients wanted, say) or the norm's output is not of h's dtype, the experts'
    module after the norm and the router, then torch's add."""
    block = layer.mlp
    if not block.__dict__.get(FUSED_BLOCK) or block.training:
        return None
    router, experts = block._modules.get("gate"), block._modules.get("experts")
    if not isinstance(router, HybridTopKRouter) or not isinstance(experts, HybridExperts) \
            or hooked(block) or hooked(experts):
        return None
    x = layer.post_attention_layernorm(h).reshape(-1, h.shape[-1])
    _, weights, ids = router(x)
    expert_weights = experts.kernel_weights(x, weights) if x.dtype == h.dtype else None
    if expert_weights is None:
        return h + experts(x, ids, weights).view(h.shape)
    return experts.add_to(h.reshape(x.shape), x, ids, weights, expert_weights).view(h.shape)


__all__ = ["FUSED_BLOCK", "block_step", "why_not_fuse_block"]
