"""Fused attention projections: one GEMM for Q, K and V, views for the heads.

Layout. The fused weight stacks the rows of W_q (H*D), W_k (Hkv*D) and W_v (Hkv*D), in that
order (what concatenating ``q_proj``/``k_proj``/``v_proj`` gives, and the order of
``nn.MultiheadAttention.in_proj_weight``). One GEMM gives ``y`` (..., S, (H + 2*Hkv)*D);
viewing it (..., S, H + 2*Hkv, D), splitting the heads [H, Hkv, Hkv] and transposing the
sequence and head dims gives ``q`` (..., H, S, D), ``k`` and ``v`` (..., Hkv, S, D) without
a copy. They are *non-contiguous views* into ``y`` (strides ``(S*(H+2Hkv)*D, D,
(H+2Hkv)*D, 1)`` for 3-D ``x``): the last dim has unit stride, which is all
``F.scaled_dot_product_attention`` needs (flash, memory-efficient and math backends
accept them; SDPA's own ``.transpose(1, 2)`` output of HF models has the same kind of
layout). Call ``.contiguous()`` only if a consumer insists. In the backward the three
gradients are joined with one ``cat`` into the fused gradient, which then goes through one
dx GEMM and one dW GEMM (bias gradient fused).

Routes (see README "The attention projection: what runs"): eager inference takes a cached
raw launch per input signature (``eager_fast.py``) that writes straight into the head-major
views; eager training records one autograd node per projection (``_QKVProjection``,
``_OutProjection``); ``torch.compile`` and everything else go through ``hybridgemm.linear``.

State dict of :class:`AttentionProjection`:
``qkv_proj.weight`` ((H+2*Hkv)*D, hidden), ``qkv_proj.bias`` ((H+2*Hkv)*D,) if any,
``o_proj.weight`` (out_features, H*D), ``o_proj.bias`` (out_features,) if any.
:func:`fuse_qkv_state_dict` / :func:`split_qkv_state_dict` convert from/to the separate
``q_proj``/``k_proj``/``v_proj``/``o_proj`` keys of Llama/Qwen2-style checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm.kernels.checks import check_linear_args

from . import eager_fast
from .eager_fast import head_views as _heads
from .linear_layer import HybridLinear, linear

WHO = "hybridgemm.attention_projection"


def _positive_int(value, name: str, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: {name} must be a positive int, got {value!r}")
    return value


def resolve_heads(hidden_size: int, num_heads, num_kv_heads, head_dim, who: str = WHO) -> tuple[int, int, int]:
    """Validate head counts; return ``(H, Hkv, D)``. ``num_kv_heads=None`` means H (no GQA);
    ``head_dim=None`` means ``hidden_size // num_heads`` (which must then divide evenly)."""
    h = _positive_int(num_heads, "num_heads", who)
    hkv = h if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads", who)
    if h % hkv:
        raise ValueError(f"{who}: num_heads ({h}) must be a multiple of num_kv_heads ({hkv}) "
                         "(each KV head serves a whole group of query heads)")
    if head_dim is None:
        if hidden_size % h:
            raise ValueError(f"{who}: hidden size {hidden_size} is not divisible by num_heads {h}; "
                             "pass head_dim explicitly if the model's head_dim is not hidden_size // num_heads")
        d = hidden_size // h
    else:
        d = _positive_int(head_dim, "head_dim", who)
    return h, hkv, d


def attention_projection(x: Tensor, qkv_weight: Tensor, qkv_bias: Tensor | None, num_heads: int,
                         num_kv_heads: int | None = None, head_dim: int | None = None):
    """``q, k, v`` (..., heads, S, D) from ``x`` (..., S, hidden) with ONE fused GEMM.

    ``qkv_weight`` is ((H + 2*Hkv) * D, hidden), rows ordered Q, K, V; ``qkv_bias`` matches
    or is None. The results are views (see the module docstring) ready for
    ``F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv)``.
    """
    if not isinstance(x, Tensor) or x.dim() < 2:
        what = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{WHO}: x must be a tensor (..., seq, hidden), got {what}")
    if not isinstance(qkv_weight, Tensor) or qkv_weight.dim() != 2:
        what = tuple(qkv_weight.shape) if isinstance(qkv_weight, Tensor) else type(qkv_weight).__name__
        raise ValueError(f"{WHO}: qkv_weight must be a 2-D tensor ((H + 2*Hkv) * head_dim, hidden), got {what}")
    hidden = x.shape[-1]
    h, hkv, d = resolve_heads(hidden, num_heads, num_kv_heads, head_dim)
    rows = (h + 2 * hkv) * d
    if qkv_weight.shape[0] != rows:
        raise ValueError(f"{WHO}: qkv_weight has {qkv_weight.shape[0]} rows, expected (num_heads + 2 * "
                         f"num_kv_heads) * head_dim = ({h} + 2*{hkv}) * {d} = {rows}")
    check_linear_args(x, qkv_weight, qkv_bias, WHO)  # hidden size, bias shape, dtypes, devices
    return _project(x, qkv_weight, qkv_bias, h, hkv, d)


def _project(x: Tensor, w: Tensor, b: Tensor | None, h: int, hkv: int, d: int):
    """The fused GEMM and the head views, arguments already validated."""
    if eager_fast.eager_training(x, w, b):
        return eager_fast.QKVProjection.apply(x, w, b, h, hkv, d, None)
    return _heads(linear(x, w, b), h, hkv, d)


_MISSING = object()


def _weight_and_bias(lin: nn.Module) -> tuple:
    """``(lin.weight, lin.bias)`` without ``nn.Module.__getattr__``: its lookups cost ~1.5 µs
    each, and a decode layer made eight. Falls back to attribute access when the parameters
    are not plainly registered (e.g. ``torch.nn.utils.parametrize`` turns ``weight`` into a
    property)."""
    params = lin._parameters
    w, b = params.get("weight", _MISSING), params.get("bias", _MISSING)
    if w is _MISSING or w is None or b is _MISSING:
        return lin.weight, lin.bias
    return w, b


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    if q.shape[-3] != k.shape[-3]:
        kwargs.setdefault("enable_gqa", True)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


class AttentionProjection(nn.Module):
    """Fused QKV projection + output projection of one attention layer.

    ``forward_qkv(x)`` -> ``q, k, v`` (B, H|Hkv, S, D); ``forward_out(attn)`` takes the
    attention result (..., H, S, D) and returns (..., S, out_features); ``forward(x,
    attn_fn=None, **kw)`` runs both around ``attn_fn(q, k, v, **kw)`` (default:
    ``F.scaled_dot_product_attention``, with ``enable_gqa`` when H != Hkv). Biases are
    optional for each projection (Qwen2: QKV bias, no O bias; GPT-2/BERT/ViT: both).

    Layout: with ``batch_first=True`` (default) inputs are (..., S, hidden) and outputs
    (..., S, out_features); with ``batch_first=False`` they are (S, B, hidden) -> (S, B,
    out_features), as ``nn.MultiheadAttention(batch_first=False)`` takes them (2-D inputs are
    unbatched (S, hidden) either way). ``q, k, v`` and ``forward_out``'s input are head-major
    (B, H, S, D) in both layouts.

    ``dropout``: probability of dropping attention weights in training mode, applied by the
    default attention (``F.scaled_dot_product_attention``'s ``dropout_p``, where
    ``nn.MultiheadAttention`` applies its ``dropout``); nothing is dropped in eval mode. An
    ``attn_fn`` passed to ``forward`` does its own attention, dropout included, and a
    ``dropout_p`` passed to ``forward`` overrides it.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, qkv_bias: bool = True, out_bias: bool = True,
                 out_features: int | None = None, device=None, dtype=None, *, batch_first: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        who = "AttentionProjection"
        _positive_int(hidden_size, "hidden_size", who)
        if not isinstance(batch_first, bool):
            raise TypeError(f"{who}: batch_first must be a bool, got {batch_first!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"{who}: dropout must be a probability between 0 and 1, got {dropout!r}")
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.num_heads, self.num_kv_heads, self.head_dim = resolve_heads(
            hidden_size, num_heads, num_kv_heads, head_dim, who)
        self.hidden_size = hidden_size
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        out = hidden_size if out_features is None else _positive_int(out_features, "out_features", who)
        # nn.Linear's init with fan_in = hidden for the fused weight: what three separate
        # q/k/v linears would get.
        self.qkv_proj = HybridLinear(hidden_size, (h + 2 * hkv) * d, bias=qkv_bias, device=device, dtype=dtype)
        self.o_proj = HybridLinear(h * d, out, bias=out_bias, device=device, dtype=dtype)

    # Class-level defaults: read by an instance whose state lacks them (unpickled without these keys).
    batch_first: bool = True
    dropout: float = 0.0

    # Cached raw launches of eager inference calls (fusion/eager_fast.py), made on first use;
    # not state: never saved, pickled or copied.
    _fast_qkv: eager_fast.LaunchCache | None = None
    _fast_out: eager_fast.LaunchCache | None = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_fast_qkv", None)
        state.pop("_fast_out", None)
        return state

    @property
    def split_sizes(self) -> tuple[int, int, int]:
        """Rows of W_q, W_k, W_v in the fused weight."""
        return (self.num_heads * self.head_dim,) + (self.num_kv_heads * self.head_dim,) * 2

    def _cache(self, name: str) -> eager_fast.LaunchCache:
        cache = self.__dict__.get(name)
        if cache is None:
            cache = self.__dict__[name] = eager_fast.LaunchCache()
        return cache

    def forward_qkv(self, x: Tensor):
        # Head counts were validated at construction; hidden size, dtypes and devices are
        # checked by the GEMM call. (The submodules hold the parameters; their forward, and
        # any hook on them, is not called.)
        if not self.batch_first:
            x = self._seq_first_input(x)
        w, b = _weight_and_bias(self._modules["qkv_proj"])
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if eager_fast.eligible(x, w, b) and x.dim() >= 2:
            # Eager inference: the cached raw launch (fusion/eager_fast.py)
            return eager_fast.qkv_launch(self._cache("_fast_qkv"), x, w, b, h, hkv, d)
        if eager_fast.eager_training(x, w, b) and x.dim() >= 2:
            return eager_fast.QKVProjection.apply(x, w, b, h, hkv, d, self._cache("_fast_qkv"))
        return _project(x, w, b, h, hkv, d)

    def _seq_first_input(self, x) -> Tensor:
        """(S, B, hidden) -> a (B, S, hidden) view; (S, hidden) as it is."""
        if not isinstance(x, Tensor) or x.dim() not in (2, 3):
            what = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"AttentionProjection (batch_first=False): expected x of shape (seq, batch, hidden) "
                             f"or (seq, hidden), got {what}")
        return x.transpose(0, 1) if x.dim() == 3 else x

    def forward_out(self, attn: Tensor) -> Tensor:
        if self.batch_first:
            return self._out(attn)
        if not isinstance(attn, Tensor) or attn.dim() not in (3, 4):
            what = tuple(attn.shape) if isinstance(attn, Tensor) else type(attn).__name__
            raise ValueError(f"AttentionProjection.forward_out (batch_first=False): expected attn of shape "
                             f"(batch, {self.num_heads} heads, seq, {self.head_dim}) or ({self.num_heads} heads, "
                             f"seq, {self.head_dim}), got {what}")
        y = self._out(attn)  # (B, S, out) or (S, out)
        return y.transpose(0, 1) if y.dim() == 3 else y

    def _out(self, attn: Tensor) -> Tensor:
        """(..., H, S, D) -> (..., S, out_features)."""
        w, b = _weight_and_bias(self._modules["o_proj"])
        if eager_fast.eligible(attn, w, b):
            cache = self._cache("_fast_out")
            y = eager_fast.out_cached(cache, attn, w, b)
            if y is not None:
                return y
            self._check_attn(attn)
            return eager_fast.out_bind(cache, attn, w, b)
        self._check_attn(attn)
        if eager_fast.eager_training(attn, w, b):
            return eager_fast.OutProjection.apply(attn, w, b, self._cache("_fast_out"))
        # (..., H, S, D) -> (..., S, H*D): a view when attn is laid out (..., S, H, D) in
        # memory (SDPA's flash/cuDNN outputs are), else one copy inside the flatten.
        return linear(attn.transpose(-3, -2).flatten(-2), w, b)

    def _check_attn(self, attn: Tensor) -> None:
        h, d = self.num_heads, self.head_dim
        if attn.dim() < 3 or attn.shape[-3] != h or attn.shape[-1] != d:
            raise ValueError(f"AttentionProjection.forward_out: expected (..., {h} heads, seq, {d}), "
                             f"got {tuple(attn.shape)}")

    def forward(self, x: Tensor, attn_fn=None, **attn_kwargs) -> Tensor:
        q, k, v = self.forward_qkv(x)
        if attn_fn is None:
            if self.dropout and self.training:
                attn_kwargs.setdefault("dropout_p", self.dropout)
            o = _sdpa(q, k, v, **attn_kwargs)
        else:
            o = attn_fn(q, k, v, **attn_kwargs)
        return self.forward_out(o)

    def extra_repr(self) -> str:
        extra = "" if self.batch_first else ", batch_first=False"
        if self.dropout:
            extra += f", dropout={self.dropout}"
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{extra}")

    # ------------------------------------------------------------------ conversions

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, num_heads: int,
                     num_kv_heads: int | None = None, head_dim: int | None = None) -> AttentionProjection:
        """Fuse separate projections (copies the weights; the result shares no storage)."""
        who = "AttentionProjection.from_linears"
        lins = {"q": q, "k": k, "v": v, "o": o}
        for name, lin in lins.items():
            if not isinstance(getattr(lin, "weight", None), Tensor) or lin.weight.dim() != 2:
                raise TypeError(f"{who}: {name} must be an nn.Linear-like module with a 2-D weight")
        hidden = q.weight.shape[1]
        if head_dim is None and q.weight.shape[0] % _positive_int(num_heads, "num_heads", who) == 0:
            head_dim = q.weight.shape[0] // num_heads
        h, hkv, d = resolve_heads(hidden, num_heads, num_kv_heads, head_dim, who)
        want = {"q": (h * d, hidden), "k": (hkv * d, hidden), "v": (hkv * d, hidden)}
        for name, shape in want.items():
            if tuple(lins[name].weight.shape) != shape:
                raise ValueError(f"{who}: {name}.weight has shape {tuple(lins[name].weight.shape)}, expected "
                                 f"{shape} for {h} heads, {hkv} KV heads, head_dim {d}, hidden {hidden}")
        if o.weight.shape[1] != h * d:
            raise ValueError(f"{who}: o.weight has {o.weight.shape[1]} input features, expected H*D = {h * d}")
        params = [t for lin in lins.values() for t in (lin.weight, lin.bias) if t is not None]
        if len({t.dtype for t in params}) > 1 or len({t.device for t in params}) > 1:
            raise TypeError(f"{who}: q, k, v, o must share one dtype and device, got "
                            f"{sorted({str(t.dtype) for t in params})} on {sorted({str(t.device) for t in params})}")
        has_b = [lin.bias is not None for lin in (q, k, v)]
        if any(has_b) and not all(has_b):
            raise ValueError(f"{who}: q, k and v must all have a bias or none (got q={has_b[0]}, "
                             f"k={has_b[1]}, v={has_b[2]}); a fused bias cannot leave one out")
        mod = cls(hidden, h, hkv, d, qkv_bias=all(has_b), out_bias=o.bias is not None,
                  out_features=o.weight.shape[0], device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            mod.qkv_proj.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            if all(has_b):
                mod.qkv_proj.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
            mod.o_proj.weight.copy_(o.weight)
            if o.bias is not None:
                mod.o_proj.bias.copy_(o.bias)
        return mod

    @classmethod
    def from_multihead_attention(cls, mha: nn.MultiheadAttention) -> AttentionProjection:
        """From ``nn.MultiheadAttention``'s packed ``in_proj_weight``/``in_proj_bias`` and
        ``out_proj`` (copied). The result takes the same input layout (``batch_first``),
        applies the same attention dropout in training mode and starts in the same
        training/eval mode as ``mha``; ``forward(x)`` gives what ``mha(x, x, x,
        need_weights=False)[0]`` gives."""
        who = "AttentionProjection.from_multihead_attention"
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"{who}: expected nn.MultiheadAttention, got {type(mha).__name__}")
        if not mha._qkv_same_embed_dim or mha.in_proj_weight is None:
            raise ValueError(f"{who}: kdim/vdim differ from embed_dim ({mha.kdim}, {mha.vdim} vs "
                             f"{mha.embed_dim}): K and V do not come from the same input, nothing to fuse")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(f"{who}: add_bias_kv / add_zero_attn append extra keys; not representable")
        e, h = mha.embed_dim, mha.num_heads
        mod = cls(e, h, h, e // h, qkv_bias=mha.in_proj_bias is not None,
                  out_bias=mha.out_proj.bias is not None, device=mha.in_proj_weight.device,
                  dtype=mha.in_proj_weight.dtype, batch_first=bool(mha.batch_first), dropout=mha.dropout)
        mod.train(mha.training)
        with torch.no_grad():
            mod.qkv_proj.weight.copy_(mha.in_proj_weight)
            if mha.in_proj_bias is not None:
                mod.qkv_proj.bias.copy_(mha.in_proj_bias)
            mod.o_proj.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                mod.o_proj.bias.copy_(mha.out_proj.bias)
        return mod

    def to_linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        """Separate ``nn.Linear`` q, k, v, o with copies of the weights (inverse of from_linears)."""
        w, b = self.qkv_proj.weight.detach(), self.qkv_proj.bias
        out = []
        for wi, bi in zip(w.split(self.split_sizes), b.detach().split(self.split_sizes) if b is not None
                          else (None,) * 3):
            lin = nn.Linear(wi.shape[1], wi.shape[0], bias=bi is not None, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(wi)
                if bi is not None:
                    lin.bias.copy_(bi)
            out.append(lin)
        o = nn.Linear(self.o_proj.in_features, self.o_proj.out_features, bias=self.o_proj.bias is not None,
                      device=w.device, dtype=w.dtype)
        o.load_state_dict(self.o_proj.state_dict())
        return (*out, o)


def fuse_qkv_state_dict(sd: dict, prefix: str = "") -> dict:
    """``{prefix}q_proj.*, k_proj.*, v_proj.*, o_proj.*`` -> AttentionProjection keys
    (``qkv_proj.*``, ``o_proj.*``). Other keys are left out."""
    out = {"qkv_proj.weight": torch.cat([sd[f"{prefix}{p}_proj.weight"] for p in "qkv"])}
    has_b = [f"{prefix}{p}_proj.bias" in sd for p in "qkv"]
    if any(has_b) and not all(has_b):
        raise ValueError("fuse_qkv_state_dict: q, k and v must all have a bias or none")
    if all(has_b):
        out["qkv_proj.bias"] = torch.cat([sd[f"{prefix}{p}_proj.bias"] for p in "qkv"])
    for name in ("weight", "bias"):
        if f"{prefix}o_proj.{name}" in sd:
            out[f"o_proj.{name}"] = sd[f"{prefix}o_proj.{name}"]
    return out


def split_qkv_state_dict(sd: dict, num_heads: int, num_kv_heads: int | None, head_dim: int,
                         prefix: str = "") -> dict:
    """Inverse of :func:`fuse_qkv_state_dict`: AttentionProjection keys -> ``q_proj.*`` ...
    (the split tensors are views of the fused ones)."""
    hkv = num_heads if num_kv_heads is None else num_kv_heads
    sizes = [num_heads * head_dim, hkv * head_dim, hkv * head_dim]
    w = sd["qkv_proj.weight"]
    if w.shape[0] != sum(sizes):
        raise ValueError(f"split_qkv_state_dict: qkv_proj.weight has {w.shape[0]} rows, expected {sum(sizes)}")
    out = {f"{prefix}{p}_proj.weight": t for p, t in zip("qkv", w.split(sizes))}
    if "qkv_proj.bias" in sd:
        out.update({f"{prefix}{p}_proj.bias": t for p, t in zip("qkv", sd["qkv_proj.bias"].split(sizes))})
    for name in ("weight", "bias"):
        if f"o_proj.{name}" in sd:
            out[f"{prefix}o_proj.{name}"] = sd[f"o_proj.{name}"]
    return out


class HybridMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose self-attention path is :func:`attention_projection` +
    ``F.scaled_dot_product_attention`` + :func:`hybridgemm.linear` for the output.

    :func:`hybridgemm.patch` turns an ``nn.MultiheadAttention`` into one in place (same
    object, same parameters and state-dict keys); ``unpatch`` turns it back. The fused path
    runs when ``query is key is value`` (self-attention), the projection is packed
    (no kdim/vdim), there is no ``add_bias_kv``/``add_zero_attn``, the input is a dense
    2-D/3-D tensor and the masks have the documented shapes; every other call goes to the
    stock ``forward`` unchanged (including its error messages). Mask semantics follow the
    stock module: boolean ``True`` = not allowed, float masks are added to the scores.
    Note: ``nn.TransformerEncoderLayer``'s inference fast path (eval mode, no autograd)
    calls a native kernel with the parameters and never calls this forward; it stays
    correct, it just does not run through hybridgemm.
    """

    def _fusable(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> bool:
        if not (query is key and key is value and isinstance(query, Tensor)) or query.is_nested:
            return False
        if not self._qkv_same_embed_dim or self.bias_k is not None or self.add_zero_attn:
            return False
        if query.dim() not in (2, 3) or query.shape[-1] != self.embed_dim:
            return False
        if is_causal and attn_mask is None:
            return False  # the stock forward raises its own error for this
        batched = query.dim() == 3
        seq = query.shape[1 if batched and self.batch_first else 0]
        bsz = query.shape[0 if self.batch_first else 1] if batched else 1
        for m in (attn_mask, key_padding_mask):
            if m is not None and (m.dtype != torch.bool and not m.is_floating_point()):
                return False
        if attn_mask is not None and tuple(attn_mask.shape) not in ((seq, seq), (bsz * self.num_heads, seq, seq)):
            return False
        want_kpm = (bsz, seq) if batched else (seq,)
        return key_padding_mask is None or tuple(key_padding_mask.shape) == want_kpm

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not self._fusable(query, key, value, key_padding_mask, attn_mask, is_causal):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        batched = query.dim() == 3
        x = query if not batched or self.batch_first else query.transpose(0, 1)
        x = x if batched else x.unsqueeze(0)  # (B, L, E)
        bsz, seq = x.shape[0], x.shape[1]
        h = self.num_heads
        q, k, v = attention_projection(x, self.in_proj_weight, self.in_proj_bias, h, h)
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, q.dtype)
            mask = mask.view(bsz, h, seq, seq) if mask.dim() == 3 else mask
        if key_padding_mask is not None:
            kpm = _additive(key_padding_mask, q.dtype).view(bsz, 1, 1, seq)
            mask = kpm if mask is None else mask + kpm
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * (1.0 / self.head_dim) ** 0.5) @ k.transpose(-2, -1)
            probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            if dropout_p > 0.0:
                probs = F.dropout(probs, p=dropout_p)
            o = probs @ v
            weights = probs.mean(dim=1) if average_attn_weights else probs
        elif is_causal and key_padding_mask is None:
            # As the stock module: the causal hint replaces the (causal) attn_mask.
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        out = linear(o.transpose(1, 2).flatten(-2), self.out_proj.weight, self.out_proj.bias)
        if not batched:
            return out.squeeze(0), (weights.squeeze(0) if weights is not None else None)
        return (out if self.batch_first else out.transpose(0, 1)), weights


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean (True = masked out) -> float with -inf there; a float mask as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


__all__ = ["AttentionProjection", "HybridMultiheadAttention", "attention_projection", "fuse_qkv_state_dict",
           "resolve_heads", "split_qkv_state_dict"]
