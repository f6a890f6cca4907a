"""The unfused grouped baseline of a mixture-of-experts block's routed experts: the pairs
sorted by expert in PyTorch, x's rows gathered, ``torch._grouped_mm`` for gate/up, the GLU in
PyTorch, ``torch._grouped_mm`` for down, the routing weights, the sum over each token's slots.
This is how transformers' ``grouped_mm`` experts implementation computes them (its default on
CUDA); the tuner (autotune_cache/tune_moe.py) times the Triton kernels against it, and
:func:`grouped_mm_moe` runs where the table says it is the faster.

Same roundings as kernels/triton_moe.py (each GEMM's output, the activation, the product in
x's dtype; the routing product in the weights' and x's promoted dtype; the slot sum in fp32,
rounded once). No host sync (the expert counts by ``histc``), so a CUDA graph can hold it.
"""

from __future__ import annotations

import torch

from .epilogue import GLU_ACTIVATIONS


def available() -> bool:
    """Does this torch have ``torch._grouped_mm``?"""
    return hasattr(torch, "_grouped_mm")


def grouped_mm_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[T, H] in x's dtype for ``x`` [T, H], the routing [T, k] and stacked weights ``w_gate_up``
    [E, 2I, H] (gate rows first), ``w_down`` [E, H, I]."""
    if not available():
        raise RuntimeError("grouped_mm_moe: this torch has no torch._grouped_mm")
    t, k = topk_ids.shape
    e = w_gate_up.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=e, min=0, max=e - 1)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[order // k]
    gate, up = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    inter = GLU_ACTIVATIONS[activation](gate) * up
    y = torch._grouped_mm(inter, w_down.transpose(-2, -1), offs=offs) * topk_weights.reshape(-1)[order, None]
    per_pair = torch.empty((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
    per_pair[order] = y.float()
    return per_pair.view(t, k, -1).sum(dim=1).to(x.dtype)


__all__ = ["available", "grouped_mm_moe"]
