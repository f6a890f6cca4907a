"""The fused pieces of the decode step (fusion/models/decode_step.py), each a custom op under
``torch.compile`` (:func:`_compiled`) and its eager body otherwise:

* :func:`norm_linear`: a GEMM normalising x as it loads it (Triton split-K with an RMSNorm
  prologue: ``rstd * ((x * g) @ W.T)``, the squares summed from the tiles it loads);
* :func:`norm_rope_qkv`: the same for Q/K/V over a static KV cache, also rotating q and k and
  writing k and v into the cache in its epilogue (kernels/triton_rope.py);
* :func:`rope_qkv`: the same without a norm prologue (the LayerNorm families' input norm runs
  as its module), for partial rotaries, Cohere's pairs and weights grouped per KV head too;
* :func:`qk_rope_store` and :func:`rope_store`: q/k norms, rotary and cache write in one launch
  after a Q/K/V GEMM whose epilogue cannot take them (kernels/triton_qk_rope.py);
* :func:`attend`: one token per sequence over a static cache in one launch (GQA without the
  expanded copies, the boolean mask read as it is, the cache length updated);
* :func:`linear_residual`: O and down with the residual added in the epilogue;
* :func:`pair_residual`: a parallel-residual layer's O and down in one GEMM over both K
  sources (compiled regions), the residual added in its epilogue;
* :func:`gated_norm`: gate/up normalising h on load, the GLU product in the epilogue.

Every GEMM is decided and launched by the dispatcher (``dispatch.fused_splitk`` for the
split-K fusions, ``dispatch.gated`` for gate/up). Where a decision is a kernel that cannot
carry the fusion (the table runs cuBLASLt for that shape, a launch is refused), the piece
computes the same thing unfused: the norm apart, the GEMM as the table says, the add after.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm import dispatch
from hybridgemm.diagnostics import warn_once
from hybridgemm.fp8_linear import fp8_linear
from hybridgemm.kernels.process_memory import per_call_scratch
from hybridgemm.mlp import GLU_FUNCTIONS, ActivatedGemm, gated_linear, run_activated
from hybridgemm.norm import norm_operand, prologue_norm

from . import attention_forms as forms
from . import decode_checks as checks


def _compiled(op, eager, *args):
    """Under torch.compile the custom op (opaque to Inductor, one node), else the eager body."""
    return op(*args) if torch.compiler.is_compiling() else eager(*args)


# ----------------------------------------------------------------------------- the pieces

def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor | None) -> Tensor:
    """The unfused GEMM of a piece: the dispatcher's, or the FP8 call for an e4m3 ``weight``."""
    return dispatch.fused_linear(x, weight, bias) if scale is None else fp8_linear(x, weight, scale, bias)


def normed(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None = None) -> Tensor:
    """x as a fused norm prologue leaves it (the piece's unfused form); x itself without a norm.
    ``(norm_weight, eps, norm_offset)``: a norm operand (norm.norm_operand)."""
    return x if norm_weight is None else prologue_norm(x, norm_weight, eps, norm_offset)


def _norm_fusion(norm_weight: Tensor | None, eps: float, norm_offset: float | None) -> dict:
    return {} if norm_weight is None else {"norm": (norm_weight, float(eps), norm_offset)}


def _norm_linear(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
                 bias: Tensor | None, counters: Tensor | None = None, scale: Tensor | None = None,
                 keep_prologue: bool = False) -> Tensor:
    y = dispatch.fused_splitk(x, weight, bias, counters, scale, keep_prologue,
                              **_norm_fusion(norm_weight, eps, norm_offset))
    return _linear(normed(x, norm_weight, eps, norm_offset), weight, bias, scale) if y is None else y


def _linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                     counters: Tensor | None = None, scale: Tensor | None = None,
                     residual_scale: float | None = None, residual2: Tensor | None = None) -> Tensor:
    fusion = {} if residual is None else {"residual": residual}
    if residual is not None and residual_scale is not None:
        fusion["residual_scale"] = float(residual_scale)
    if residual2 is not None:
        fusion["residual2"] = residual2
    y = dispatch.fused_splitk(x, weight, bias, counters, scale, **fusion)
    if y is not None:
        return y
    y = _linear(x, weight, bias, scale)
    if residual is None:
        return y
    y = residual + (y if residual_scale is None else y * residual_scale)
    return y if residual2 is None else y + residual2


def _gated_norm(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
                bias: Tensor | None, activation: str, scale: Tensor | None = None, counters: Tensor | None = None,
                keep_prologue: bool = False) -> Tensor:
    if scale is not None:
        # FP8: the gated kernel reads no e4m3 weight; split-K runs gate/up with the product in
        # its epilogue, or where the table runs another backend, the GEMM then the product
        y = dispatch.fused_splitk(x, weight, bias, counters, scale, keep_prologue, glu=activation,
                                  **_norm_fusion(norm_weight, eps, norm_offset))
        if y is not None:
            return y
        gate, up = _norm_linear(x, norm_weight, eps, norm_offset, weight, bias, counters, scale).chunk(2, dim=-1)
        return GLU_FUNCTIONS[activation](gate) * up
    y = dispatch.gated(x, weight, bias, activation, keep_prologue=keep_prologue,
                       **_norm_fusion(norm_weight, eps, norm_offset))
    return gated_linear(normed(x, norm_weight, eps, norm_offset), weight, bias, activation) if y is None else y


# ``counters`` (the layer's arrival counters, decoder_layer.COUNTERS) are scratch the kernels
# leave as they found them (all zero), so the ops do not declare them mutated.
@torch.library.custom_op("hybridgemm::norm_linear_fwd", mutates_args=())
def norm_linear_fwd(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
                    bias: Tensor | None, counters: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    with per_call_scratch():  # no scratch cached from inside a compiled region (CUDA graph trees)
        return _norm_linear(x, norm_weight, eps, norm_offset, weight, bias, counters, scale).contiguous()


@norm_linear_fwd.register_fake
def _norm_linear_fake(x, norm_weight, eps, norm_offset, weight, bias, counters=None, scale=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hybridgemm::linear_residual_fwd", mutates_args=())
def linear_residual_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                        counters: Tensor | None = None, scale: Tensor | None = None,
                        residual_scale: float | None = None, residual2: Tensor | None = None) -> Tensor:
    with per_call_scratch():
        return _linear_residual(x, weight, bias, residual, counters, scale, residual_scale, residual2).contiguous()


@linear_residual_fwd.register_fake
def _linear_residual_fake(x, weight, bias, residual, counters=None, scale=None, residual_scale=None, residual2=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hybridgemm::gated_norm_fwd", mutates_args=())
def gated_norm_fwd(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
                   bias: Tensor | None, activation: str, scale: Tensor | None = None,
                   counters: Tensor | None = None) -> Tensor:
    with per_call_scratch():
        return _gated_norm(x, norm_weight, eps, norm_offset, weight, bias, activation, scale, counters)


@gated_norm_fwd.register_fake
def _gated_norm_fake(x, norm_weight, eps, norm_offset, weight, bias, activation, scale=None, counters=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


# Eager decode is host-bound: a norm apart from split-K's prologue is a launch of host time,
# and the prologue's extra GPU time hides behind the host's. Under torch.compile (CUDA graphs:
# GPU time is the step's time) the ops take the norm apart where the prologue costs GPU time.
# The choice is by mode, never by capture state, so that a graph's warm-up and replays compute
# the same bits.
_norm_linear_eager = functools.partial(_norm_linear, keep_prologue=True)


def norm_linear(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
                bias: Tensor | None, counters: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """``linear(rmsnorm(x), weight, bias)`` with the RMSNorm of operand ``(norm_weight, eps,
    norm_offset)`` (norm.norm_operand: Llama's formula, or Gemma's / OLMo 2's fp32 factor;
    ``linear(x, weight, bias)`` for a None ``norm_weight``), one launch where the table runs Triton split-K.
    ``counters``: zeroed int32 arrival counters for split-K's fused reduction, used by one launch
    at a time. ``scale``: ``weight`` is e4m3 with
    these scales (fusion/fp8_modules.py ``weight_scale_of``), as in every piece here."""
    return _compiled(torch.ops.hybridgemm.norm_linear_fwd, _norm_linear_eager, x, norm_weight, float(eps),
                     norm_offset, weight, bias, counters, scale)


def linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                    counters: Tensor | None = None, scale: Tensor | None = None,
                    residual_scale: float | None = None, residual2: Tensor | None = None) -> Tensor:
    """``residual + linear(x, weight, bias)`` (times ``residual_scale`` before the add, as
    Granite's layers scale it; ``linear(x, weight, bias)`` for a None residual), then
    ``+ residual2`` where given (with a residual and no scale: a parallel-residual layer's
    ``(mlp + a) + x``, each sum rounded as stock's), one launch where the table runs Triton
    split-K."""
    if residual2 is not None and (residual is None or residual_scale is not None):
        raise ValueError("linear_residual: residual2 comes with a residual and no residual_scale")
    return _compiled(torch.ops.hybridgemm.linear_residual_fwd, _linear_residual, x, weight, bias, residual, counters,
                     scale, None if residual_scale is None else float(residual_scale), residual2)


def _pair_apart(x: Tensor, weight: Tensor, bias: Tensor | None, x2: Tensor, weight2: Tensor, bias2: Tensor | None,
                residual: Tensor, counters: Tensor | None = None, residual_first: bool = False) -> Tensor:
    """``((x2 W2^T + b2) + (x W^T + b)) + residual`` in two launches, each sum rounded as stock's
    GPT-NeoX and Falcon layers round ``(mlp + a) + x``; ``residual_first``: ``(residual + (x2 W2^T
    + b2)) + (x W^T + b)``, as Cohere's and StableLM's add ``x + a + mlp`` left to right."""
    if residual_first:
        return _linear_residual(x, weight, bias, _linear_residual(x2, weight2, bias2, residual, counters), counters)
    a = _linear_residual(x2, weight2, bias2, None, counters)
    return _linear_residual(x, weight, bias, a, counters, residual2=residual)


def _pair_residual(x: Tensor, weight: Tensor, bias: Tensor | None, x2: Tensor, weight2: Tensor, bias2: Tensor | None,
                   residual: Tensor, counters: Tensor | None = None, residual_first: bool = False) -> Tensor:
    y = None
    if weight.dtype == x.dtype and weight2.dtype == x.dtype == x2.dtype:  # (an FP8 weight: the two apart)
        y = dispatch.fused_splitk(x, weight, bias, counters, residual=residual, second=(x2, weight2, bias2))
    return _pair_apart(x, weight, bias, x2, weight2, bias2, residual, counters, residual_first) if y is None else y


@torch.library.custom_op("hybridgemm::pair_residual_fwd", mutates_args=())
def pair_residual_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, x2: Tensor, weight2: Tensor,
                      bias2: Tensor | None, residual: Tensor, counters: Tensor | None = None,
                      residual_first: bool = False) -> Tensor:
    with per_call_scratch():
        return _pair_residual(x, weight, bias, x2, weight2, bias2, residual, counters, residual_first).contiguous()


@pair_residual_fwd.register_fake
def _pair_residual_fake(x, weight, bias, x2, weight2, bias2, residual, counters=None, residual_first=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def pair_residual(x: Tensor, weight: Tensor, bias: Tensor | None, x2: Tensor, weight2: Tensor, bias2: Tensor | None,
                  residual: Tensor, counters: Tensor | None = None, residual_first: bool = False) -> Tensor:
    """``(linear(x, weight, bias) + linear(x2, weight2, bias2)) + residual`` (weights of x's
    dtype): a parallel-residual layer's down and O projections and its residual. Under
    torch.compile one split-K launch (and its reduce kernel where the config reduces in a second
    launch) where the table runs split-K for the first GEMM (its config,
    the second product's K split in the same extent after it: ``triton_splitk.run(second=)``),
    both products and biases summed in fp32 and rounded once before the residual; a CUDA graph
    replays the step, so one launch fewer is GPU time saved. Eager calls (host-bound: each of the
    two GEMMs takes a bound launch from the second call on, which the one launch has not) and any
    call the launch does not take run the two GEMMs apart with stock's roundings:
    ``(x W^T + b) + (x2 W2^T + b2)`` rounded, plus the residual, rounded (GPT-NeoX's and Falcon's
    ``(mlp + a) + x``), or with ``residual_first`` the residual plus ``x2 W2^T + b2``, rounded,
    plus ``x W^T + b``, rounded (Cohere's and StableLM's ``x + a + mlp``)."""
    return _compiled(torch.ops.hybridgemm.pair_residual_fwd, _pair_apart, x, weight, bias, x2, weight2, bias2,
                     residual, counters, bool(residual_first))


_gated_norm_eager = functools.partial(_gated_norm, keep_prologue=True)  # (as _norm_linear_eager)


def gated_norm(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
               bias: Tensor | None, activation: str, scale: Tensor | None = None,
               counters: Tensor | None = None) -> Tensor:
    """``gated_linear(rmsnorm(x), weight, bias, activation)`` (the norm of operand
    ``(norm_weight, eps, norm_offset)``; x itself for a None ``norm_weight``), one launch of the gated kernel
    where the dispatcher's gated rule picks it (an FP8 weight: the split-K launch with the norm
    prologue and the product in its epilogue, where the table runs split-K; ``counters``: the
    layer's zeroed arrival counters for its single-pass reduction, as :func:`norm_linear`'s)."""
    return _compiled(torch.ops.hybridgemm.gated_norm_fwd, _gated_norm_eager, x, norm_weight, float(eps),
                     norm_offset, weight, bias, activation, scale, counters)


# ------------------------------------------------------------------ Q/K/V with rotary + cache

def _rotate(t: Tensor, cos: Tensor, sin: Tensor, pairs: bool = False) -> Tensor:
    """Hugging Face's rotary embedding of ``t`` [B, S, heads, hd], cos/sin [B or 1, S, R], in t's
    dtype; fp32 cos/sin (OLMo 2's) rotate in fp32, then round to t's dtype, as its rotary does.
    R < hd (StableLM's, GLM's partial rotary): the first R columns of each head, the rest as they
    are. ``pairs``: Cohere's (neighbouring columns paired, rotated as fp32 copies, rounded once;
    GLM's and Helium's in the static step too, as the pair epilogue rotates; Ernie 4.5's, from its
    fp32 cos/sin)."""
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    width = cos.shape[-1]
    r = t[..., :width]
    if pairs:
        f = r.float()
        out = (f * c + torch.stack((-f[..., 1::2], f[..., ::2]), dim=-1).flatten(-2) * s).to(t.dtype)
    else:
        half = width // 2
        out = (r * c + torch.cat((-r[..., half:], r[..., :half]), dim=-1) * s).to(t.dtype)
    return out if width == t.shape[-1] else torch.cat((out, t[..., width:]), dim=-1)


def _rope_qkv_unfused(x, norm_weight, eps, norm_offset, weight, bias, cos, sin, keys, values, base, heads, kv_heads,
                      scale=None, q_norm=None, k_norm=None, qk_eps=0.0, qk_offset=None, rotate=True,
                      pairs=False, qk_after_rotary=False) -> Tensor:
    """The stock computation: norm, GEMM, then :func:`rotate_store`."""
    y = _linear(normed(x, norm_weight, eps, norm_offset), weight, bias, scale)
    return rotate_store(y, cos, sin, keys, values, base, heads, kv_heads, q_norm, k_norm, qk_eps, qk_offset=qk_offset,
                        pairs=pairs, rotate=rotate, qk_after_rotary=qk_after_rotary)


def rotate_store(y, cos, sin, keys, values, base, heads, kv_heads, q_norm=None, k_norm=None, qk_eps=0.0,
                  full_norms: tuple[Callable, Callable] | None = None, qk_offset: float | None = None,
                  pairs: bool = False, rotate: bool = True, qk_after_rotary: bool = False) -> Tensor:
    """From the Q/K/V projection ``y`` [B, S, N], as the stock attention computes it: the q/k
    norms (``full_norms``: the norms over all the q (k) columns, before the head views, as OLMo 2's;
    else per head, of operand ``(q_norm / k_norm, qk_eps, qk_offset)``, norm.prologue_norm; with
    ``qk_after_rotary`` of the rotated heads, as Hunyuan's), rotary in y's dtype (``pairs``:
    Cohere's; none without ``rotate``), ``index_copy_`` of k and v into the cache."""
    b, s = y.shape[:2]
    hd = keys.shape[-1]
    q, k, v = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    if full_norms is not None:
        q, k = full_norms[0](q), full_norms[1](k)
    q, k = q.reshape(b, s, heads, hd), k.reshape(b, s, kv_heads, hd)
    if q_norm is not None and not qk_after_rotary:
        q, k = prologue_norm(q, q_norm, qk_eps, qk_offset), prologue_norm(k, k_norm, qk_eps, qk_offset)
    if rotate:
        q, k = _rotate(q, cos, sin, pairs), _rotate(k, cos, sin, pairs)
    if q_norm is not None and qk_after_rotary:
        q, k = prologue_norm(q, q_norm, qk_eps, qk_offset), prologue_norm(k, k_norm, qk_eps, qk_offset)
    pos = torch.arange(s, device=y.device) + base.view(())
    keys.index_copy_(2, pos, k.transpose(1, 2))
    values.index_copy_(2, pos, v.reshape(b, s, kv_heads, hd).transpose(1, 2))
    return torch.cat([q.reshape(b, s, -1), k.reshape(b, s, -1), v], dim=-1)


def _rope_qkv(x, norm_weight, eps, norm_offset, weight, bias, cos, sin, keys, values, base, heads, kv_heads,
              counters=None, scale=None, q_norm=None, k_norm=None, qk_eps=0.0, qk_offset=None, rotate=True,
              pairs=False, qk_after_rotary=False, keep_prologue=False) -> Tensor:
    rc = checks.rotary_cache(cos, sin, heads, kv_heads, keys, values, base, q_norm, k_norm, float(qk_eps), qk_offset,
                             pairs=pairs, rotate=rotate, qk_after_rotary=qk_after_rotary)
    y = dispatch.fused_splitk(x, weight, bias, counters, scale, keep_prologue,
                              **_norm_fusion(norm_weight, eps, norm_offset), rope=rc)
    if y is None:
        return _rope_qkv_unfused(x, norm_weight, eps, norm_offset, weight, bias, cos, sin, keys, values, base, heads,
                                 kv_heads, scale, q_norm, k_norm, qk_eps, qk_offset, rotate, pairs, qk_after_rotary)
    return y


@torch.library.custom_op("hybridgemm::norm_rope_qkv_fwd", mutates_args=("keys", "values"))
def norm_rope_qkv_fwd(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
                      bias: Tensor | None, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, base: Tensor,
                      heads: int, kv_heads: int, counters: Tensor | None = None, scale: Tensor | None = None,
                      q_norm: Tensor | None = None, k_norm: Tensor | None = None, qk_eps: float = 0.0,
                      qk_offset: float | None = None, rotate: bool = True, pairs: bool = False,
                      qk_after_rotary: bool = False) -> Tensor:
    with per_call_scratch():
        return _rope_qkv(x, norm_weight, eps, norm_offset, weight, bias, cos, sin, keys, values, base, heads,
                         kv_heads, counters, scale, q_norm, k_norm, qk_eps, qk_offset, rotate, pairs,
                         qk_after_rotary).contiguous()


@norm_rope_qkv_fwd.register_fake
def _norm_rope_qkv_fake(x, norm_weight, eps, norm_offset, weight, bias, cos, sin, keys, values, base, heads, kv_heads,
                        counters=None, scale=None, q_norm=None, k_norm=None, qk_eps=0.0, qk_offset=None, rotate=True,
                        pairs=False, qk_after_rotary=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_rope_qkv_eager = functools.partial(_rope_qkv, keep_prologue=True)  # (as _norm_linear_eager)


def norm_rope_qkv(x: Tensor, norm_weight: Tensor | None, eps: float, norm_offset: float | None, weight: Tensor,
                  bias: Tensor | None, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, base: Tensor, heads: int,
                  kv_heads: int, counters: Tensor | None = None, scale: Tensor | None = None,
                  q_norm: Tensor | None = None, k_norm: Tensor | None = None, qk_eps: float = 0.0,
                  qk_offset: float | None = None, rotate: bool = True, pairs: bool = False,
                  qk_after_rotary: bool = False) -> Tensor:
    """Q/K/V of ``rmsnorm(x)`` (x [B, S, D]; the norm of operand ``(norm_weight, eps,
    norm_offset)``, norm.norm_operand; of x itself without ``norm_weight``) with q and k
    normalised per head (``q_norm`` and ``k_norm``: their norms' operands [hd], eps ``qk_eps``,
    offset ``qk_offset``; none without them; ``qk_after_rotary``: the rotated heads normalised) and
    rotated (not without ``rotate``: a layer without positional embedding; ``pairs``: neighbouring
    columns paired, cos/sin holding each frequency twice, in fp32), k and v written into
    ``keys``/``values`` [B, kv_heads, L, hd] at positions ``base + s``; returns [B, S, N]. One
    split-K launch where the table runs split-K with a config that fits (tiles within a head, of
    one whole head with q/k norms; no two-launch reduction), the stock sequence of operations
    otherwise."""
    return _compiled(torch.ops.hybridgemm.norm_rope_qkv_fwd, _rope_qkv_eager, x, norm_weight, float(eps),
                     norm_offset, weight, bias, cos, sin, keys, values, base, heads, kv_heads, counters, scale, q_norm,
                     k_norm, float(qk_eps), None if qk_offset is None else float(qk_offset), bool(rotate), bool(pairs),
                     bool(qk_after_rotary))


def _rope_qkv_q(x: Tensor, weight: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                base: Tensor, heads: int, kv_heads: int, group: int = 0, pairs: bool = False,
                counters: Tensor | None = None, scale: Tensor | None = None, keep_prologue: bool = False) -> Tensor:
    rc = checks.rotary_cache(cos, sin, heads, kv_heads, keys, values, base, group=group, pairs=pairs)
    y = dispatch.fused_splitk(x, weight, bias, counters, scale, keep_prologue, rope=rc)
    if y is None:  # the GEMM as the table says, then the rotary and the cache write in one launch
        y = _norm_linear(x, None, 0.0, None, weight, bias, counters, scale, keep_prologue)
        return _rope_store(y, cos, sin, keys, values, base, heads, pairs, group)
    return y[..., : heads * keys.shape[-1]]


@torch.library.custom_op("hybridgemm::rope_qkv_fwd", mutates_args=("keys", "values"))
def rope_qkv_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, keys: Tensor,
                 values: Tensor, base: Tensor, heads: int, kv_heads: int, group: int = 0, pairs: bool = False,
                 counters: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    with per_call_scratch():
        return _rope_qkv_q(x, weight, bias, cos, sin, keys, values, base, heads, kv_heads, group, pairs, counters,
                           scale).contiguous()


@rope_qkv_fwd.register_fake
def _rope_qkv_fake(x, weight, bias, cos, sin, keys, values, base, heads, kv_heads, group=0, pairs=False, counters=None,
                   scale=None):
    return x.new_empty((*x.shape[:-1], heads * keys.shape[-1]))


_rope_qkv_q_eager = functools.partial(_rope_qkv_q, keep_prologue=True)


def rope_qkv(x: Tensor, weight: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
             base: Tensor, heads: int, kv_heads: int, group: int = 0, pairs: bool = False,
             counters: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """The Q/K/V projection of x (normalised already: the LayerNorm families' input norm runs as
    its module), q and k rotated over the first ``cos.shape[-1]`` columns of each head (a partial
    rotary: GPT-NeoX's, StableLM's; ``pairs``: Cohere's rotary of neighbouring columns), k and v
    written into ``keys``/``values`` at ``base + s``; returns the rotated q [B, S, heads * hd].
    ``group``: the weight's rows grouped per KV head, ``[q x group | k | v]`` (GPT-NeoX's
    ``[q | k | v]`` per head: 1; Falcon's new architecture: heads / kv_heads; 0: all q, all k,
    all v). One split-K launch where the table runs split-K with tiles that fit the heads and
    the rotary (kernels/triton_rope.py); else the GEMM, then :func:`rope_store`'s one launch."""
    return _compiled(torch.ops.hybridgemm.rope_qkv_fwd, _rope_qkv_q_eager, x, weight, bias, cos, sin, keys, values,
                     base, heads, kv_heads, int(group), bool(pairs), counters, scale)


def _qk_rope_store(y: Tensor, q_g: Tensor, q_eps: float, q_offset: float, k_g: Tensor, k_eps: float, k_offset: float,
                   cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, base: Tensor, heads: int) -> Tensor:
    kernel = forms.qk_rope_kernel()
    q_op, k_op = (q_g, q_eps, q_offset), (k_g, k_eps, k_offset)
    if checks.on_kernel_device(y) and kernel.check(y, q_op, k_op, cos, sin, keys, values, base, heads) is None:
        return kernel.qk_norm_rope_store(y, q_op, k_op, cos, sin, keys, values, base, heads)
    norms = (functools.partial(prologue_norm, g=q_g, eps=q_eps, offset=q_offset),
             functools.partial(prologue_norm, g=k_g, eps=k_eps, offset=k_offset))
    y = rotate_store(y, cos, sin, keys, values, base, heads, keys.shape[1], full_norms=norms)
    return y[..., : heads * keys.shape[-1]].contiguous()


@torch.library.custom_op("hybridgemm::qk_rope_store_fwd", mutates_args=("keys", "values"))
def qk_rope_store_fwd(y: Tensor, q_g: Tensor, q_eps: float, q_offset: float, k_g: Tensor, k_eps: float,
                      k_offset: float, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, base: Tensor,
                      heads: int) -> Tensor:
    return _qk_rope_store(y, q_g, q_eps, q_offset, k_g, k_eps, k_offset, cos, sin, keys, values, base, heads)


@qk_rope_store_fwd.register_fake
def _qk_rope_store_fake(y, q_g, q_eps, q_offset, k_g, k_eps, k_offset, cos, sin, keys, values, base, heads):
    return y.new_empty((*y.shape[:-1], heads * keys.shape[-1]))


def qk_rope_store(y: Tensor, q_norm: nn.Module, k_norm: nn.Module, cos: Tensor, sin: Tensor, keys: Tensor,
                  values: Tensor, base: Tensor, heads: int) -> Tensor:
    """From the Q/K/V projection ``y`` [B, S, N], OLMo 2's attention up to the cache: q and k
    normalised over all their columns by the patched fp32-factor norms ``q_norm``/``k_norm``
    (norm.Fp32FactorRMSNorm), rotated (``cos``/``sin`` of y's dtype or fp32), k and v written
    into ``keys``/``values`` at ``base + s``; returns the rotated q [B, S, heads * hd]. One launch
    (kernels/triton_qk_rope.py) where its operand checks pass, the stock sequence of torch ops
    otherwise."""
    return _compiled(torch.ops.hybridgemm.qk_rope_store_fwd, _qk_rope_store, y, *norm_operand(q_norm),
                     *norm_operand(k_norm), cos, sin, keys, values, base, heads)


def _rope_store(y: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, base: Tensor, heads: int,
                pairs: bool = False, group: int = 0) -> Tensor:
    kernel = forms.qk_rope_kernel()
    if checks.on_kernel_device(y) and kernel.check(y, None, None, cos, sin, keys, values, base, heads,
                                                   group) is None:
        return kernel.qk_norm_rope_store(y, None, None, cos, sin, keys, values, base, heads, pairs=pairs,
                                         group=group)
    if group:  # [q x group | k | v] per KV head -> all q, all k, all v
        b, s = y.shape[:2]
        g = y.reshape(b, s, keys.shape[1], group + 2, keys.shape[-1])
        y = torch.cat([g[..., :group, :].reshape(b, s, -1), g[..., group, :].reshape(b, s, -1),
                       g[..., group + 1, :].reshape(b, s, -1)], dim=-1)
    y = rotate_store(y, cos, sin, keys, values, base, heads, keys.shape[1], pairs=pairs)
    return y[..., : heads * keys.shape[-1]].contiguous()


@torch.library.custom_op("hybridgemm::rope_store_fwd", mutates_args=("keys", "values"))
def rope_store_fwd(y: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, base: Tensor, heads: int,
                   pairs: bool = False, group: int = 0) -> Tensor:
    return _rope_store(y, cos, sin, keys, values, base, heads, pairs, group)


@rope_store_fwd.register_fake
def _rope_store_fake(y, cos, sin, keys, values, base, heads, pairs=False, group=0):
    return y.new_empty((*y.shape[:-1], heads * keys.shape[-1]))


def rope_store(y: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, base: Tensor, heads: int,
               pairs: bool = False, group: int = 0) -> Tensor:
    """From the Q/K/V projection ``y`` [B, S, N]: q and k rotated over the first ``cos.shape[-1]``
    columns of each head (StableLM's and GPT-NeoX's partial rotary; cos/sin of y's dtype;
    ``pairs``: Cohere's rotary of neighbouring columns in fp32), k and v written into
    ``keys``/``values`` at ``base + s``; returns the rotated q [B, S, heads * hd]. ``group``:
    y's columns grouped per KV head, ``[q x group | k | v]`` (GPT-NeoX's ``[q | k | v]`` per
    head: 1; Falcon's new architecture: heads / kv_heads); 0: all q, all k, all v. One launch
    (kernels/triton_qk_rope.py) where its operand checks pass, the stock sequence of torch ops
    otherwise."""
    return _compiled(torch.ops.hybridgemm.rope_store_fwd, _rope_store, y, cos, sin, keys, values, base, heads,
                     bool(pairs), int(group))


# ------------------------------------------------------------------------- decode attention

def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor, step: int,
            counters: Tensor | None, softcap: float = 0.0, into: Tensor | None = None) -> Tensor:
    # into: the output tensor to fill (the PyTorch form's result is copied into it), else a new one
    from triton.errors import TritonError

    out = q.new_empty(q.shape) if into is None else into
    try:
        return forms.attention_kernel().decode_attention(q, keys, values, mask, scale, out, base=base, step=step,
                                                          counters=counters, softcap=softcap)
    except (ValueError, TritonError) as e:  # refused or not compiled: nothing was launched
        warn_once(("decode_attention", tuple(keys.shape), q.shape[1], q.dtype),
                  f"hybridgemm: the decode attention kernel could not run for a cache of {tuple(keys.shape)} ({e}); "
                  "that layer's attention runs on PyTorch")
    b, kv_heads, _, hd = keys.shape
    rep = q.shape[1] // hd // kv_heads
    qh = q.reshape(b, kv_heads * rep, 1, hd)
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    if softcap:  # SDPA takes no cap: the capped logits, then the mask, softmax (fp32 here)
        scores = softcap * torch.tanh(qh.float() @ keys.float().transpose(2, 3) * (scale / softcap))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        out = (torch.softmax(scores, dim=-1).to(q.dtype) @ values).reshape(b, -1)
    else:
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale).reshape(b, -1)
    if step:
        base.add_(step)
    return out if into is None else into.copy_(out)


# counters: scratch left as found (all zero), not declared mutated (decoder_layer.COUNTERS)
@torch.library.custom_op("hybridgemm::decode_attention_fwd", mutates_args=("base",))
def decode_attention_fwd(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor,
                         step: int, counters: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    with per_call_scratch():
        return _attend(q, keys, values, mask, scale, base, step, counters, softcap)


@decode_attention_fwd.register_fake
def _decode_attention_fake(q, keys, values, mask, scale, base, step, counters=None, softcap=0.0):
    return q.new_empty(q.shape)


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor, step: int,
           counters: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    """One query token per sequence (q [B, heads * hd]) over the static cache ``keys``/``values``
    [B, kv_heads, L, hd] in one launch, adding ``step`` to the cache length ``base``; the logits
    soft-capped where ``softcap > 0``; the mask boolean or additive. PyTorch (one warning) where
    the kernel refuses the operands."""
    return _compiled(torch.ops.hybridgemm.decode_attention_fwd, _attend, q, keys, values, mask, float(scale), base,
                     step, counters, float(softcap))


# ---------------------------------------------------------- attention beside the MLP's first GEMM

@functools.cache
def _side_stream(device_index: int, main_stream: int) -> torch.cuda.Stream:
    # one per stream that captures (two captures at once never share one); high priority: the
    # attention is the short branch, and its grid should not queue behind the GEMM's programs
    return torch.cuda.Stream(device_index, priority=-1)


def _capturing(q: Tensor) -> bool:
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _attend_beside(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor,
                   step: int, counters: Tensor | None, softcap: float, x: Tensor, weight: Tensor,
                   bias: Tensor | None, activation: str, weight_scale: Tensor | None,
                   fp8_activations: bool) -> tuple[Tensor, Tensor]:
    if not _capturing(q):  # one after the other
        return (_attend(q, keys, values, mask, scale, base, step, counters, softcap),
                run_activated(x, weight, bias, activation, weight_scale, fp8_activations))
    main = torch.cuda.current_stream(q.device)
    side = _side_stream(main.device_index, main.cuda_stream)
    out = q.new_empty(q.shape)  # on the main stream, which reads it after the join
    side.wait_stream(main)  # q, the cache and base are written
    try:
        # per-call scratch: the graph's own workspace, and the caller's counters or zeroed ones,
        # never the side stream's cached buffers (which every graph captured here would share)
        with torch.cuda.stream(side), per_call_scratch():
            _attend(q, keys, values, mask, scale, base, step, counters, softcap, out)
        up = run_activated(x, weight, bias, activation, weight_scale, fp8_activations)
    finally:
        main.wait_stream(side)  # joined whatever happened, so that the capture can end
    return out, up


@torch.library.custom_op("hybridgemm::attend_beside_fwd", mutates_args=("base",))
def attend_beside_fwd(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor,
                      step: int, counters: Tensor | None, softcap: float, x: Tensor, weight: Tensor,
                      bias: Tensor | None, activation: str, weight_scale: Tensor | None,
                      fp8_activations: bool) -> tuple[Tensor, Tensor]:
    with per_call_scratch():
        out, up = _attend_beside(q, keys, values, mask, scale, base, step, counters, softcap, x, weight, bias,
                                 activation, weight_scale, fp8_activations)
    return out, up.contiguous()  # (Inductor relies on contiguous outputs, as linear_fwd's)


@attend_beside_fwd.register_fake
def _attend_beside_fake(q, keys, values, mask, scale, base, step, counters, softcap, x, weight, bias, activation,
                        weight_scale, fp8_activations):
    return q.new_empty(q.shape), x.new_empty(*x.shape[:-1], weight.shape[0])


def attend_beside(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor,
                  step: int, counters: Tensor | None, softcap: float, x: Tensor, up: ActivatedGemm
                  ) -> tuple[Tensor, Tensor]:
    """:func:`attend`, and the GEMM ``up`` of x (a parallel layer's MLP input, which the attention
    does not feed). While a CUDA graph is captured (torch.compile's reduce-overhead mode, or the
    caller's own graph), the attention is captured on a second stream beside the GEMM on the
    current one, joined before they return: the attention is one short grid (a program per KV
    head and span of the cache), and beside the GEMM its time is hidden instead of added.
    Otherwise (eager calls, which the host's time per launch bounds, and CPU tensors) one after
    the other: switching streams costs host time there and gains nothing. Both compute what
    they compute alone, bits included (the attention takes the caller's ``counters``, or zeroed
    ones of its own, and a workspace of its own; the GEMM takes none of them)."""
    return _compiled(torch.ops.hybridgemm.attend_beside_fwd, _attend_beside, q, keys, values, mask, float(scale),
                     base, step, counters, float(softcap), x, up.weight, up.bias, up.activation, up.scale,
                     bool(up.fp8_activations))


__all__ = ["attend", "attend_beside", "gated_norm", "linear_residual", "norm_linear", "norm_rope_qkv", "normed",
           "pair_residual", "qk_rope_store", "rope_qkv", "rope_store", "rotate_store"]
