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

:func:`route_sigmoid` computes the other routing transformers ships widely, DeepSeek-V3's
(GLM-4.5 MoE, Kimi K2, dots.llm1 and others carry the same router): per token

* ``s = sigmoid(logits)`` in fp32 as torch's CUDA kernel computes it (``1 / (1 + expf(-x))``,
  the same bits: the choices below then break near-ties as torch's do) and the selection scores
  ``c = s + bias`` (the router's ``e_score_correction_bias``);
* with ``groups`` > 1, the experts in ``groups`` equal groups: each group scored by the sum of
  its two largest ``c``, the ``topk_groups`` best groups kept (the lowest group first among
  equal scores), the other groups' experts out of the choice (their ``c`` set to -inf);
* the ``k`` largest ``c`` (the lowest expert first among equals), whose ``s`` are the weights:
  with ``normalize`` divided by their sum plus 1e-20, then times ``scale`` (the router's
  ``routed_scaling_factor``); fp32.

One program per token, the whole row in registers (E up to :data:`MAX_EXPERTS`). It replaces
the three to five launches of the PyTorch form (softmax, ``torch.topk``'s select and sort, the
division, the cast; for the sigmoid form about a dozen). Sums run in the kernel's order, not
PyTorch's: a probability may differ from PyTorch's in its last bit, and an expert choice only
where two probabilities are that close. Nothing touches a GPU at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .triton_launch import interpreting, pdl_options

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


@triton.jit
def _route_sigmoid_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, ld, scale, TOP_K: tl.constexpr,
                          EP: tl.constexpr, KP: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                          TOPK_GROUPS: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          PDL: tl.constexpr, LIBDEVICE: tl.constexpr):
    # PDL: the logits are the previous kernel's output; nothing is read before the wait.
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, EP)
    ok = offs < E
    logits = tl.load(logits_ptr + t * ld + offs, mask=ok, other=0.0).to(tl.float32)
    # torch's CUDA sigmoid, 1 / (1 + expf(-x)) with IEEE division: libdevice's expf (Triton's own exp
    # is an approximation, whose last bits would break near-ties otherwise than torch's); the
    # interpreter, which has no libdevice, evaluates tl.exp with numpy's
    e = libdevice.exp(-logits) if LIBDEVICE else tl.exp(-logits)
    s = tl.math.div_rn(1.0, 1.0 + e)
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    # selection keys: NaN above every number (torch.topk's order)
    keys = tl.where(c != c, float("inf"), c)
    if GROUPS > 1:
        group = offs // GROUP_SIZE
        scores = tl.zeros((EP,), dtype=tl.float32)  # each expert's group's score
        for g in tl.static_range(GROUPS):
            inside = ok & (group == g)
            first = tl.max(tl.where(inside, keys, float("-inf")))
            at = tl.min(tl.where(inside & (keys == first), offs, EP))
            second = tl.max(tl.where(inside & (offs != at), keys, float("-inf")))
            scores = tl.where(inside, first + second, scores)
        kept = offs < 0
        for _ in tl.static_range(TOPK_GROUPS):
            free = ok & ~kept
            best = tl.max(tl.where(free, scores, float("-inf")))
            pick = tl.min(tl.where(free & (scores == best), group, GROUPS))  # the lowest of equal groups
            kept = kept | (group == pick)
        keys = tl.where(kept, keys, float("-inf"))
    taken = offs >= E
    slots = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int32)
    values = tl.zeros((KP,), dtype=tl.float32)
    total = 0.0
    for slot in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), keys))
        expert = tl.min(tl.where(~taken & (keys == best), offs, EP))  # the lowest of equal keys
        value = tl.sum(tl.where(offs == expert, s, 0.0))
        ids = tl.where(slots == slot, expert, ids)
        values = tl.where(slots == slot, value, values)
        total += value  # in slot order
        taken = taken | (offs == expert)
    if NORMALIZE:
        values = tl.math.div_rn(values, total + 1e-20)
    if PDL:
        gdc_launch_dependents()
    stored = slots < TOP_K
    tl.store(ids_ptr + t * TOP_K + slots, ids.to(tl.int64), mask=stored)
    tl.store(weights_ptr + t * TOP_K + slots, values * scale, mask=stored)


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


MAX_GROUPS = 64  # the group loops are unrolled


def why_not_sigmoid(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None, groups: int,
                    topk_groups: int) -> str | None:
    """Why :func:`route_sigmoid` cannot take these operands (None: it can)."""
    why = why_not(logits, top_k, torch.float32)
    if why is not None:
        return why
    e = logits.shape[1]
    if not 1 <= groups <= MAX_GROUPS or e % groups or groups > 1 and e // groups < 2:
        return f"{groups} groups of {e} experts: the kernel takes 1..{MAX_GROUPS} groups of two experts or more " \
               "that divide the experts"
    if not 1 <= topk_groups <= groups or top_k > topk_groups * (e // groups):
        return f"{topk_groups} groups kept of {groups}: at least one, at most all, holding the top_k {top_k}"
    if bias is not None and (bias.shape != (e,) or bias.dtype not in _LOGIT_DTYPES or bias.device != logits.device
                             or bias.stride(0) != 1):
        return f"the selection bias must be a contiguous [{e}] float tensor on the logits' device"
    return None


def route_sigmoid(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None, groups: int = 1,
                  topk_groups: int = 1, normalize: bool = True,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int64, weights [T, k] fp32)``: DeepSeek-V3's routing of router logits [T, E]
    (the module docstring). ValueError where :func:`why_not_sigmoid` refuses the operands."""
    why = why_not_sigmoid(logits, top_k, bias, groups, topk_groups)
    if why is not None:
        raise ValueError(f"triton_router.route_sigmoid: {why}")
    return launch_sigmoid(logits, top_k, bias, groups, topk_groups, normalize, scale)


def launch_sigmoid(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None, groups: int, topk_groups: int,
                   normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_sigmoid` for operands :func:`why_not_sigmoid` has taken."""
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        _route_sigmoid_kernel[(t,)](logits, logits if bias is None else bias, ids, weights, e, logits.stride(0),
                                    float(scale), TOP_K=top_k, EP=triton.next_power_of_2(e),
                                    KP=triton.next_power_of_2(top_k), GROUPS=groups, GROUP_SIZE=e // groups,
                                    TOPK_GROUPS=topk_groups, NORMALIZE=bool(normalize), HAS_BIAS=bias is not None,
                                    LIBDEVICE=not interpreting(), num_warps=4 if e > 256 else 1,
                                    **pdl_options(logits))
    return ids, weights


__all__ = ["MAX_EXPERTS", "MAX_GROUPS", "MAX_TOP_K", "launch", "launch_sigmoid", "route", "route_sigmoid", "why_not",
           "why_not_sigmoid"]
