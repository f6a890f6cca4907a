"""Top-k routing of a mixture-of-experts router in one launch: :func:`route`.

For each token's router logits (a row of E), what transformers' softmax-top-k routers compute
(Mixtral, Qwen2-MoE, Qwen3-MoE):

* ``p = softmax(logits)`` in fp32 (the logits converted from their dtype, their max
  subtracted, ``exp``, divided by the sum with IEEE rounding);
* the ``k`` largest ``p`` in descending order. Among equal values the lowest expert comes first,
  which selects the experts ``torch.topk`` selects on CUDA (its radix select takes the values
  above the k-th, then the k-th value's ties in index order). NaN ranks above every number, as
  in ``torch.topk``;
* with ``renormalize``, the k values divided by their sum;
* stored as int64 expert ids (``torch.topk``'s) and weights in ``weights_dtype``.

One program per token, the whole row in registers (E up to :data:`MAX_EXPERTS`). It replaces
the three to five launches of the PyTorch form (softmax, ``torch.topk``'s select and sort, the
division, the cast). Sums run in the kernel's order, not PyTorch's: a probability may differ
from PyTorch's in its last bit, and an expert choice only where two probabilities are that
close. Nothing touches a GPU at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .triton_launch import pdl_options

MAX_EXPERTS = 1024  # one row of logits in one program's registers
MAX_TOP_K = 32  # the selection loop is unrolled
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def tl_route_tile(logits, ok, TOP_K: tl.constexpr, KP: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The routing of a tile of router logits ``[EP, BM]`` (experts down, one token a column;
    fp32; rows where ``ok`` [EP] is False are padding): ``(ids [KP, BM] int32, weights [KP, BM]
    fp32)``, slots from ``TOP_K`` on unused (module docstring: softmax, the k largest, lowest
    expert first among equals, NaN above every number, renormalised)."""
    EP: tl.constexpr = logits.shape[0]
    BM: tl.constexpr = logits.shape[1]
    offs = tl.arange(0, EP)[:, None]
    logits = tl.where(ok[:, None], logits, float("-inf"))
    shifted = tl.exp(logits - tl.max(logits, axis=0)[None, :])
    probs = tl.math.div_rn(shifted, tl.sum(tl.where(ok[:, None], shifted, 0.0), axis=0)[None, :])
    # selection keys: NaN above every probability (torch.topk's order), -1 for padding and for
    # experts already taken (every probability is >= 0)
    keys = tl.where(probs != probs, float("inf"), probs)
    keys = tl.where(ok[:, None], keys, -1.0)
    slots = tl.arange(0, KP)[:, None]
    ids = tl.zeros((KP, BM), dtype=tl.int32)
    values = tl.zeros((KP, BM), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)[None, :]
        expert = tl.min(tl.where(keys == best, offs, EP), axis=0)[None, :]  # the lowest of equal keys
        value = tl.sum(tl.where(offs == expert, probs, 0.0), axis=0)[None, :]
        ids = tl.where(slots == s, expert, ids)
        values = tl.where(slots == s, value, values)
        keys = tl.where(offs == expert, -1.0, keys)
    if RENORMALIZE:
        values = tl.math.div_rn(values, tl.sum(tl.where(slots < TOP_K, values, 0.0), axis=0)[None, :])
    return ids, values


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, E, ld, TOP_K: tl.constexpr, EP: tl.constexpr,
                  KP: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    # PDL: the logits are the previous kernel's output; nothing is read before the wait.
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, EP)
    ok = offs < E
    logits = tl.load(logits_ptr + t * ld + offs, mask=ok, other=float("-inf")).to(tl.float32)
    ids, values = tl_route_tile(logits[:, None], ok, TOP_K, KP, RENORMALIZE)
    if PDL:
        gdc_launch_dependents()
    slots = tl.arange(0, KP)[:, None]
    taken = slots < TOP_K
    tl.store(ids_ptr + t * TOP_K + slots, ids.to(tl.int64), mask=taken)
    tl.store(weights_ptr + t * TOP_K + slots, values.to(weights_ptr.dtype.element_ty), mask=taken)


def why_not(logits: torch.Tensor, top_k: int, weights_dtype: torch.dtype) -> str | None:
    """Why :func:`route` cannot take these operands (None: it can)."""
    if logits.dim() != 2:
        return f"router logits must be [tokens, experts], got {tuple(logits.shape)}"
    e = logits.shape[1]
    if not 1 <= e <= MAX_EXPERTS:
        return f"{e} experts: the routing kernel holds 1..{MAX_EXPERTS}"
    if not 1 <= top_k <= min(e, MAX_TOP_K):
        return f"top_k {top_k} is not in 1..{min(e, MAX_TOP_K)} (the experts, at most {MAX_TOP_K})"
    if logits.dtype not in _LOGIT_DTYPES:
        return f"router logits of {logits.dtype}: the kernel reads fp32, bf16 or fp16"
    if weights_dtype not in _WEIGHT_DTYPES:
        return f"routing weights of {weights_dtype}: the kernel writes fp32, bf16 or fp16"
    if logits.stride(1) != 1:
        return "router logits must be contiguous along the experts"
    return None


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True,
          weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int64, weights [T, k] weights_dtype)`` for router logits [T, E] (see the
    module docstring). ValueError where :func:`why_not` refuses the operands."""
    why = why_not(logits, top_k, weights_dtype)
    if why is not None:
        raise ValueError(f"triton_router.route: {why}")
    return launch(logits, top_k, renormalize, weights_dtype)


def launch(logits: torch.Tensor, top_k: int, renormalize: bool,
           weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` for operands :func:`why_not` has taken (the caller asked it)."""
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=weights_dtype, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, weights, e, logits.stride(0), TOP_K=top_k, EP=triton.next_power_of_2(e),
                            KP=triton.next_power_of_2(top_k), RENORMALIZE=bool(renormalize),
                            num_warps=4 if e > 256 else 1, **pdl_options(logits))
    return ids, weights


__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "launch", "route", "why_not"]
