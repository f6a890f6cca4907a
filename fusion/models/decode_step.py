"""The attention half of a fused decoder layer at decode sizes with a static KV cache: one
GEMM launch computes Q/K/V from the un-normalised hidden state, rotates q and k, and writes k
and v into the cache (``triton_splitk.run(norm=, rope=)``, see kernels/triton_rope.py); for one
token per sequence, one more launch computes the attention over the cache and updates its
length (kernels/triton_decode_attention.py); then O with the residual in its epilogue.

A stock Llama attention runs, per layer and token: the QKV GEMM, the rotary embedding, two
``index_copy_`` into the cache, the cache's length update, GQA's expanded copies of the cached
keys and values, the mask conversion, the attention and O; under torch.compile that is six
to nine kernels between the two GEMMs. Here it is one. Where the attention kernel does not
apply (several tokens per sequence, a mask that is not boolean, another registered SDPA
function, a device without the kernels) the model's attention function runs on the cache as
before, or SDPA on packed GQA rows (:func:`attention_step`).

Taken (:func:`kv_slot`) only where the result is the stock one: transformers'
``StaticLayer`` (exact class, initialised, whose ``update`` is the one checked below) in a
cache whose ``update`` is the base class's and that does not offload; the attention's source
is the checked Llama/Qwen2/Mistral forward (:func:`why_not_fuse_attention`: no q/k norm, the
standard ``apply_rotary_pos_emb``), ``sdpa`` attention, no sliding window, no dropout, no
hooks on the modules it skips, a ``[B, S, D]`` hidden state and ``position_embeddings``.
Elsewhere the layer runs its attention module as before (fusion/models/decoder_layer.py).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm import dispatch
from hybridgemm.decide import uses_tf32, warn_once
from hybridgemm.kernels.checks import contiguous_bias, row_major, rows_2d
from hybridgemm.kernels.process_memory import per_call_scratch
from hybridgemm.norm import rms_norm

# The statements of the attention forward that the fused step reproduces (whitespace removed).
_ATTENTION_STATEMENTS = (
    "query_states=self.q_proj(hidden_states).view(hidden_shape).transpose(1,2)",
    "key_states=self.k_proj(hidden_states).view(hidden_shape).transpose(1,2)",
    "value_states=self.v_proj(hidden_states).view(hidden_shape).transpose(1,2)",
    "cos,sin=position_embeddings",
    "query_states,key_states=apply_rotary_pos_emb(query_states,key_states,cos,sin)",
    ".update(key_states,value_states,self.layer_idx",
    "attn_output=attn_output.reshape(*input_shape,-1).contiguous()",
    "attn_output=self.o_proj(attn_output)",
)
_ROTARY_STATEMENTS = ("q_embed=(q*cos)+(rotate_half(q)*sin)", "k_embed=(k*cos)+(rotate_half(k)*sin)")
_ROTATE_HALF_STATEMENTS = ("x1=x[...,:x.shape[-1]//2]", "x2=x[...,x.shape[-1]//2:]", "returntorch.cat((-x2,x1),dim=-1)")
_STATIC_UPDATE_STATEMENTS = (
    "kv_length=key_states.shape[-2]",
    "cache_position=torch.arange(kv_length,device=self.device)+self.cumulative_length",
    "self.cumulative_length.add_(kv_length)",
    "self.keys.index_copy_(2,cache_position,key_states)",
    "self.values.index_copy_(2,cache_position,value_states)",
    "returnself.keys,self.values",
)
_CACHE_UPDATE_STATEMENTS = ("self.layers[layer_idx].update(key_states,value_states",)
QKV_NAME = "qkv_proj"  # the fused Q/K/V module of a patched attention
# Keyword arguments of the attention forward that the stock one does not pass on to the
# attention function.
_CONSUMED = ("hidden_states", "position_embeddings", "attention_mask", "cache", "past_key_values", "cache_position")


def source_text(fn) -> str | None:
    """``fn``'s source with all whitespace removed (None where it has none): what the
    statement checks of the layer and attention forwards compare against."""
    try:
        return "".join(inspect.getsource(fn).split())
    except (OSError, TypeError):
        return None


def _has_all(fn, statements) -> bool:
    src = source_text(fn)
    return src is not None and all(s in src for s in statements)


# transformers' Cache.update and StaticLayer.update are the checked ones (None: not checked
# yet), and the transformers objects a call reads, looked up once when a layer is patched
# (never per call).
_STATIC_CACHE_OK: bool | None = None
_CACHE_CLS = _STATIC_LAYER_CLS = _ATTENTION_FUNCTIONS = _STOCK_SDPA = None


def _check_static_cache() -> bool:
    global _STATIC_CACHE_OK, _CACHE_CLS, _STATIC_LAYER_CLS, _ATTENTION_FUNCTIONS, _STOCK_SDPA
    if _STATIC_CACHE_OK is None:
        try:
            from transformers.cache_utils import Cache, StaticLayer
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError:
            _STATIC_CACHE_OK = False
            return False
        _CACHE_CLS, _STATIC_LAYER_CLS = Cache, StaticLayer
        _ATTENTION_FUNCTIONS, _STOCK_SDPA = ALL_ATTENTION_FUNCTIONS, sdpa_attention_forward
        _STATIC_CACHE_OK = _has_all(Cache.update, _CACHE_UPDATE_STATEMENTS) \
            and _has_all(StaticLayer.update, _STATIC_UPDATE_STATEMENTS)
    return _STATIC_CACHE_OK


def why_not_fuse_attention(attn: nn.Module) -> str | None:
    """Why the attention module ``attn`` cannot run as the fused step (None: it can); raises
    nothing. Read once when a layer is patched (source inspection), not per call."""
    cls = type(attn)
    if not _check_static_cache():
        return "this transformers version's StaticCache update is not the one checked"
    if not _has_all(cls.forward, _ATTENTION_STATEMENTS):
        return f"{cls.__name__}.forward is not the attention this transformers version was checked against"
    module = inspect.getmodule(cls)
    rope, rotate = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    if rope is None or rotate is None or not _has_all(rope, _ROTARY_STATEMENTS) \
            or not _has_all(rotate, _ROTATE_HALF_STATEMENTS):
        return "its rotary embedding is not the standard rotate_half one"
    if not all(isinstance(getattr(attn, a, None), int) for a in ("head_dim", "layer_idx")):
        return "it has no integer head_dim and layer_idx"
    return None


def kv_slot(attn: nn.Module, x: Tensor, kwargs: dict):
    """``(cache layer, cos, sin, first)`` when this call can take the fused attention step, else
    None; ``first``: the layer is the cache's first.
    Only for an attention :func:`why_not_fuse_attention` accepted when it was patched."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    pe = kwargs.get("position_embeddings")
    if cache is None or pe is None or x.dim() != 3 or attn.training or attn.config._attn_implementation != "sdpa" \
            or getattr(attn, "sliding_window", None) is not None:
        return None
    layers = getattr(cache, "layers", None)
    if not _STATIC_CACHE_OK or not isinstance(layers, list) or attn.layer_idx >= len(layers):
        return None
    layer = layers[attn.layer_idx]
    if type(layer) is not _STATIC_LAYER_CLS or not layer.is_initialized or getattr(cache, "offloading", False) \
            or type(cache).update is not _CACHE_CLS.update:
        return None
    keys, values, base = layer.keys, layer.values, layer.cumulative_length
    b, hd = x.shape[0], attn.head_dim
    # Head counts from the fused weight and the cache, which hold this process's heads (all of
    # them, or a tensor-parallel rank's share, where the config still gives the whole model's).
    rows, kv_heads = attn._modules[QKV_NAME].weight.shape[0], keys.shape[1]
    groups = getattr(attn, "num_key_value_groups", None)
    if not isinstance(groups, int) or groups < 1 or rows != (groups + 2) * kv_heads * hd:
        return None  # a cache (or fused weight) of other head counts: the attention module says what is wrong
    if keys.dtype != x.dtype or values.dtype != x.dtype or keys.shape[0] != b or keys.shape[-1] != hd \
            or values.shape != keys.shape or not keys.is_contiguous() or not values.is_contiguous():
        return None
    if not isinstance(base, Tensor) or base.dtype != torch.int64 or base.numel() != 1 or base.device != x.device:
        return None
    cos, sin = pe
    if cos.dim() != 3 or cos.shape[-1] != hd or cos.shape[1] != x.shape[1] or cos.dtype != x.dtype \
            or cos.shape != sin.shape:
        return None
    if any(hooked(attn._modules.get(n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or hooked(attn):
        return None
    return layer, cos, sin, layer is layers[0]


def hooked(mod: nn.Module | None) -> bool:
    """Has ``mod`` forward hooks or a replaced forward (a fused path that skips it must not run)?"""
    return mod is not None and bool(mod._forward_hooks or mod._forward_pre_hooks or "forward" in mod.__dict__)


# ------------------------------------------------------------------- the fused Q/K/V + cache

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def splitk_config(x2: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor):
    """The split-K config the table runs for this GEMM, or None when it runs another backend
    (or PyTorch computes it: CPU tensors, other dtypes)."""
    if not x2.is_cuda or x2.dtype not in _KERNEL_DTYPES or weight.dtype != x2.dtype:
        return None
    choice = dispatch.decision_for(x2, weight, bias, out)
    return choice.config if choice.backend == "triton_splitk" and choice.config is not None else None


_FUSION_NAMES = {"norm": "norm", "residual": "residual", "rope": "rotary/KV-cache"}


def fused_splitk(x: Tensor, weight: Tensor, bias: Tensor | None, counters: Tensor | None = None,
                 **fusion) -> Tensor | None:
    """The GEMM with ``fusion`` (``triton_splitk.run``'s ``norm=``, ``residual=``, ``rope=``) in
    one split-K launch, where the table runs split-K for it; None where it does not, or where
    the launch is refused (a ValueError, warned once per shape, as the dispatcher warns and
    falls back): the caller then computes it unfused."""
    from hybridgemm.kernels import triton_splitk

    n = weight.shape[0]
    x2, w2, b2 = row_major(rows_2d(x)), row_major(weight), contiguous_bias(bias)
    out = x.new_empty((x2.shape[0], n))
    config = splitk_config(x2, w2, b2, out)
    if config is None:
        return None
    if "residual" in fusion:
        fusion["residual"] = row_major(rows_2d(fusion["residual"]))
    try:
        triton_splitk.run(config, x2, w2, b2, out, None, tf32=uses_tf32(x.dtype), counters=counters, **fusion)
    except ValueError as e:
        warn_once(("decoder_layer", tuple(weight.shape), x.dtype, tuple(fusion)),
                  f"hybridgemm: split-K could not run the {'/'.join(_FUSION_NAMES[f] for f in fusion)} fusion for a "
                  f"{tuple(weight.shape)} weight ({e}); that layer part runs unfused")
        return None
    return out.view(*x.shape[:-1], n)


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Hugging Face's rotary embedding of ``t`` [B, S, heads, hd], cos/sin [B or 1, S, hd]."""
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    half = t.shape[-1] // 2
    return t * c + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * s


def _unfused(x, norm_weight, eps, weight, bias, cos, sin, keys, values, base, heads, kv_heads) -> Tensor:
    """The stock computation: norm, GEMM, rotary in x's dtype, ``index_copy_`` into the cache."""
    b, s = x.shape[:2]
    hd = keys.shape[-1]
    y = dispatch.fused_linear(rms_norm(x, norm_weight, eps), weight, bias)
    q, k, v = y.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = _rotate(q.reshape(b, s, heads, hd), cos, sin)
    k = _rotate(k.reshape(b, s, kv_heads, hd), cos, sin)
    pos = torch.arange(s, device=x.device) + base.view(())
    keys.index_copy_(2, pos, k.transpose(1, 2))
    values.index_copy_(2, pos, v.reshape(b, s, kv_heads, hd).transpose(1, 2))
    return torch.cat([q.reshape(b, s, -1), k.reshape(b, s, -1), v], dim=-1)


def _rope_qkv(x, norm_weight, eps, weight, bias, cos, sin, keys, values, base, heads, kv_heads,
              counters=None) -> Tensor:
    from hybridgemm.kernels.triton_rope import RotaryCache

    rc = RotaryCache(cos.contiguous() if cos.stride(-1) != 1 else cos, sin.contiguous() if sin.stride(-1) != 1
                     else sin, heads, kv_heads, keys.shape[-1], keys, values, base)
    y = fused_splitk(x, weight, bias, counters, norm=(norm_weight, float(eps)), rope=rc)
    if y is None:
        return _unfused(x, norm_weight, eps, weight, bias, cos, sin, keys, values, base, heads, kv_heads)
    return y


# counters: scratch left as found (all zero), not declared mutated (decoder_layer.COUNTERS)
@torch.library.custom_op("hybridgemm::norm_rope_qkv_fwd", mutates_args=("keys", "values"))
def norm_rope_qkv_fwd(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None, cos: Tensor,
                      sin: Tensor, keys: Tensor, values: Tensor, base: Tensor, heads: int, kv_heads: int,
                      counters: Tensor | None = None) -> Tensor:
    with per_call_scratch():  # no scratch cached from inside a compiled region (CUDA graph trees)
        return _rope_qkv(x, norm_weight, eps, weight, bias, cos, sin, keys, values, base, heads, kv_heads,
                         counters).contiguous()


@norm_rope_qkv_fwd.register_fake
def _norm_rope_qkv_fake(x, norm_weight, eps, weight, bias, cos, sin, keys, values, base, heads, kv_heads,
                        counters=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def norm_rope_qkv(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None, cos: Tensor,
                  sin: Tensor, keys: Tensor, values: Tensor, base: Tensor, heads: int, kv_heads: int,
                  counters: Tensor | None = None) -> Tensor:
    """Q/K/V of ``rmsnorm(x)`` (x [B, S, D]) with q and k rotated, k and v written into
    ``keys``/``values`` [B, kv_heads, L, hd] at positions ``base + s``; returns [B, S, N].
    One split-K launch where the table runs split-K with a config that fits (tiles within a
    head, no two-launch reduction), the stock sequence of operations otherwise. Inference only.
    ``counters``: zeroed int32 arrival counters for split-K's fused reduction (``triton_splitk.run``)."""
    if torch.compiler.is_compiling():
        return torch.ops.hybridgemm.norm_rope_qkv_fwd(x, norm_weight, float(eps), weight, bias, cos, sin, keys, values,
                                                      base, heads, kv_heads, counters)
    return _rope_qkv(x, norm_weight, eps, weight, bias, cos, sin, keys, values, base, heads, kv_heads, counters)


def _kernel_device(x: Tensor) -> bool:
    """Does the decode-attention kernel run on x's device? (CUDA; the CPU tests widen it to the
    interpreter.)"""
    return x.is_cuda


def _attention_kernel():
    # Imported on first use: importing hybridgemm needs no Triton (tests/test_layers.py).
    from hybridgemm.kernels import triton_decode_attention

    return triton_decode_attention


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor, step: int,
            counters: Tensor | None) -> Tensor:
    from triton.errors import TritonError

    out = q.new_empty(q.shape)
    try:
        return _attention_kernel().decode_attention(q, keys, values, mask, scale, out, base=base, step=step,
                                                    counters=counters)
    except (ValueError, TritonError) as e:  # refused or not compiled: nothing was launched
        warn_once(("decode_attention", tuple(keys.shape), q.shape[1], q.dtype),
                  f"hybridgemm: the decode attention kernel could not run for a cache of {tuple(keys.shape)} ({e}); "
                  "that layer's attention runs on PyTorch's SDPA")
    b, kv_heads, _, hd = keys.shape
    rep = q.shape[1] // hd // kv_heads
    qh = q.reshape(b, kv_heads * rep, 1, hd)
    out = F.scaled_dot_product_attention(qh, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                         attn_mask=mask, scale=scale).reshape(b, -1)
    if step:
        base.add_(step)
    return out


# counters: scratch left as found (all zero), not declared mutated (decoder_layer.COUNTERS)
@torch.library.custom_op("hybridgemm::decode_attention_fwd", mutates_args=("base",))
def decode_attention_fwd(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, base: Tensor,
                         step: int, counters: Tensor | None = None) -> Tensor:
    with per_call_scratch():
        return _attend(q, keys, values, mask, scale, base, step, counters)


@decode_attention_fwd.register_fake
def _decode_attention_fake(q, keys, values, mask, scale, base, step, counters=None):
    return q.new_empty(q.shape)


def _kernel_takes(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, counters: Tensor | None) -> bool:
    return _kernel_device(q) and _attention_kernel().why_not(q, keys, values, mask) is None \
        and (counters is None or counters.numel() >= keys.shape[0] * keys.shape[1])


def attention_step(attn: nn.Module, slot, x: Tensor, norm: nn.Module, qkv: nn.Module, kwargs: dict,
                   counters: Tensor | None = None) -> Tensor:
    """The attention sublayer's output before O, for a call :func:`kv_slot` accepted (``slot``):
    ``[B, S, heads * hd]``."""
    layer, cos, sin, first = slot
    b, s = x.shape[:2]
    hd = attn.head_dim
    keys, values = layer.keys, layer.values
    kv_heads = keys.shape[1]
    heads = qkv.weight.shape[0] // hd - 2 * kv_heads
    base = layer.cumulative_length
    y = norm_rope_qkv(x, norm.weight, norm.variance_epsilon, qkv.weight, qkv.bias, cos, sin, keys, values,
                      base, heads, kv_heads, counters)
    mask = kwargs.get("attention_mask")
    sdpa = _ATTENTION_FUNCTIONS["sdpa"]  # a user may have registered another one
    if s == 1 and sdpa is _STOCK_SDPA:
        q = y.view(b, -1)[:, : heads * hd]
        if _kernel_takes(q, keys, values, mask, counters):
            # One launch: GQA without the expanded copy, the boolean mask read as it is, and the
            # cache-length update (what StaticLayer.update does after computing the positions),
            # except the first layer's: the model derives the step's positions and mask from
            # that one (Cache.get_seq_length), and Inductor may recompute a mask after this
            # kernel, so it stays a separate in-graph add whose ordering the compiler tracks.
            inc = 0 if first else s
            if torch.compiler.is_compiling():
                out = torch.ops.hybridgemm.decode_attention_fwd(q, keys, values, mask, float(attn.scaling), base, inc,
                                                                counters)
            else:
                out = _attend(q, keys, values, mask, float(attn.scaling), base, inc, counters)
            if first:
                base.add_(s)
            return out.view(b, 1, heads * hd)
    base.add_(s)  # what StaticLayer.update does after computing the positions
    rep = heads // kv_heads
    shared_mask = mask is None or (mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
                                   and mask.shape[-1] == keys.shape[2])
    if s == 1 and b > 1 and rep > 1 and heads == rep * kv_heads and shared_mask and sdpa is _STOCK_SDPA:
        # One query per sequence: the rep query heads that share a KV head become rep query rows
        # of that head (one row of the mask serves them all), so SDPA reads the cache as it is
        # instead of the rep-fold expanded copy that GQA otherwise makes of it. At batch 1 the
        # expanded copy is small and cuDNN's kernel for the one-row queries measured faster
        # (H200: docs/DESIGN.md, "The attention step"), so batch 1 keeps the model's own SDPA call.
        q = y[..., : heads * hd].reshape(b, kv_heads, rep, hd)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
        return out.reshape(b, 1, heads * hd)
    q = y[..., : heads * hd].view(b, s, heads, hd).transpose(1, 2)
    rest = {k: v for k, v in kwargs.items() if k not in _CONSUMED}
    out, _ = sdpa(attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling, **rest)
    return out.reshape(b, s, -1).contiguous()


__all__ = ["QKV_NAME", "attention_step", "fused_splitk", "hooked", "kv_slot", "norm_rope_qkv", "source_text",
           "splitk_config", "why_not_fuse_attention"]
