"""``hybridgemm.linear``: a drop-in for ``F.linear`` with the bias and activation fused, and
:class:`HybridLinear`, an ``nn.Linear`` that calls it.

Routing (why three routes: a custom op costs ~10-25 µs of host time per call, which a
decode step cannot afford, while ``torch.compile`` and autograd need the op):

* eager, no gradient wanted (inference, ``torch.no_grad``), plain tensors:
  ``hybridgemm.dispatch.fused_linear`` directly, the cheapest call there is;
* gradient wanted, or under ``torch.compile``, or tensor subclasses (fake tensors, ...):
  the ``hybridgemm::linear_fwd`` / ``linear_act_fwd`` custom ops (fusion/ops.py), whose
  autograd runs the backward GEMMs through ``hybridgemm.dispatch.linear_backward``.

Semantics are those of ``F.linear`` followed by the activation: ``x`` (..., K), ``weight``
(N, K), ``bias`` (N,) or None, one dtype and one device; the result is (..., N) in the
input dtype. Under ``torch.autocast`` the operands are cast to the autocast dtype first,
as autocast does for ``F.linear``. CPU tensors and dtypes no kernel takes (float64, ...)
are computed by PyTorch inside the dispatcher.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridgemm import dispatch
from hybridgemm.kernels.checks import check_linear_args
from hybridgemm.kernels.epilogue import Activation, apply_activation

from . import ops  # noqa: F401  (registers the hybridgemm:: custom ops)

_PLAIN = (torch.Tensor, nn.Parameter)
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves fp64 alone


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if t is None or t.dtype == dtype or t.dtype not in _AUTOCAST_CASTS:
        return t
    return t.to(dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation=None) -> Tensor:
    """``act(x @ weight.T + bias)`` for any leading dims of ``x``.

    ``activation``: None, ``"relu"``, ``"gelu_tanh"`` (tanh approximation) or ``"gelu"``
    (exact erf form), or an :class:`~hybridgemm.Activation`. Differentiable in ``x``,
    ``weight`` and ``bias``; traceable by ``torch.compile(fullgraph=True)``.
    """
    act = Activation.parse(activation)
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or (
            bias is not None and not isinstance(bias, Tensor)):
        check_linear_args(x, weight, bias, "hybridgemm.linear")  # raises a TypeError naming the argument
    ac = _autocast_dtype(x)
    if ac is not None:
        x, weight, bias = _cast(x, ac), _cast(weight, ac), _cast(bias, ac)
    wants_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if not wants_grad:
        if (not torch.compiler.is_compiling() and type(x) in _PLAIN and type(weight) in _PLAIN
                and (bias is None or type(bias) in _PLAIN)):
            return dispatch.fused_linear(x, weight, bias, act)
        return torch.ops.hybridgemm.linear_fwd(x, weight, bias, act.value)
    if (not torch.compiler.is_compiling() and type(x) in _PLAIN and type(weight) in _PLAIN
            and (bias is None or type(bias) in _PLAIN)):
        # Eager training: the same forward and backward as the custom ops, through a plain
        # autograd.Function. torch.library's custom-op dispatch costs hundreds of µs of
        # host time per fwd+bwd on the H200 machine's CPU (measured: fwd+bwd 0.08-0.6x of
        # F.linear at M <= 1024), which no GEMM saving can repay; compile keeps the ops.
        return _EagerLinear.apply(x, weight, bias, act.value)
    if act in (Activation.GELU, Activation.GELU_TANH):
        return torch.ops.hybridgemm.linear_act_fwd(x, weight, bias, act.value)[0]
    return torch.ops.hybridgemm.linear_fwd(x, weight, bias, act.value)


class _EagerLinear(torch.autograd.Function):
    """Eager-mode autograd for :func:`linear`; saves what ``hybridgemm.ops`` saves (x only
    if dW is wanted, W only if dx is, z for gelu, y for relu)."""

    @staticmethod
    def forward(ctx, x, weight, bias, act_value: str):
        act = Activation(act_value)
        if act in (Activation.GELU, Activation.GELU_TANH):
            fused = getattr(dispatch, "fused_linear_with_preactivation", None)  # same hook as ops.py
            if fused is not None:
                y, saved = fused(x, weight, bias, act_value)
            else:
                z = dispatch.fused_linear(x, weight, bias, None)
                y, saved = apply_activation(z, act), z
        else:
            y = dispatch.fused_linear(x, weight, bias, act)
            saved = y if act is Activation.RELU else None
        ctx.act, ctx.has_bias = act_value, bias is not None
        ctx.save_for_backward(x if weight.requires_grad else None, weight if x.requires_grad else None, saved)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        from hybridgemm.ops import backward_impl

        x, weight, saved = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        dx, dw, db = backward_impl()(grad_out, x, weight, saved, ctx.act, (nx, nw, nb and ctx.has_bias))
        return dx, dw, db, None


def _activation_grad(grad_out: Tensor, saved: Tensor | None, act: Activation) -> Tensor:
    """``dL/dz`` from ``dL/dy``: the same aten kernels stock autograd uses, so the result
    matches ``F.linear`` + ``F.relu``/``F.gelu`` bit for bit."""
    if act is Activation.NONE:
        return grad_out
    if saved is None:
        raise ValueError(f"linear_backward: activation {act.value!r} needs the saved tensor, got None")
    if saved.shape != grad_out.shape:
        raise ValueError(f"linear_backward: saved tensor shape {tuple(saved.shape)} != grad_out shape "
                         f"{tuple(grad_out.shape)}")
    if act is Activation.RELU:
        # saved is y = relu(z) (or z): 1[y > 0] == 1[z > 0]
        return torch.ops.aten.threshold_backward(grad_out, saved, 0)
    approximate = "tanh" if act is Activation.GELU_TANH else "none"
    return torch.ops.aten.gelu_backward(grad_out, saved, approximate=approximate)


def _torch_grad_input(dz2: Tensor, weight: Tensor) -> Tensor:
    return dz2 @ weight


def _torch_grad_weight(dz2: Tensor, x2: Tensor, bias_grad: bool):
    return dz2.t() @ x2, (dz2.sum(0) if bias_grad else None)


def backward_gemms(grad_out: Tensor, x: Tensor | None, weight: Tensor | None, pre_activation: Tensor | None,
                   activation, needs_input_grad, grad_input=_torch_grad_input, grad_weight=_torch_grad_weight):
    """The backward of ``y = act(x @ W.T + b)`` around two GEMM functions: ``grad_input(dz2, W)
    -> dx2`` and ``grad_weight(dz2, x2, bias_grad) -> (dW, db or None)`` (torch's by default;
    ``hybridgemm.dispatch.linear_backward`` passes the cuBLASLt ones)."""
    need_x, need_w, need_b = (bool(v) for v in needs_input_grad)
    dz = _activation_grad(grad_out, pre_activation, Activation.parse(activation))
    n = dz.shape[-1]
    dz2 = dz.reshape(-1, n)
    dx = dw = db = None
    if need_x:
        if weight is None:
            raise ValueError("linear_backward: dx needs weight, got None")
        dx = grad_input(dz2, weight).reshape(*dz.shape[:-1], weight.shape[1])
    if need_w:
        if x is None:
            raise ValueError("linear_backward: dW needs x, got None")
        dw, db = grad_weight(dz2, x.reshape(-1, x.shape[-1]), need_b)
    elif need_b:
        db = dz2.sum(0)
    return dx, dw, db


def torch_linear_backward(grad_out: Tensor, x: Tensor | None, weight: Tensor | None,
                          pre_activation: Tensor | None, activation, needs_input_grad):
    """Reference backward of ``y = act(x @ W.T + b)``, in PyTorch; returns ``(dx, dW, db)``.

    ``grad_out`` (..., N) is ``dL/dy``; ``dz = grad_out * act'(z)``; then
    ``dx = dz @ W`` (..., K), ``dW = dz^T @ x`` (N, K), ``db = dz.sum over rows`` (N,).
    ``pre_activation`` is ``z`` for ``gelu``/``gelu_tanh``, the output ``y`` (or ``z``) for
    ``relu``, None without an activation. ``needs_input_grad`` = (dx?, dW?, db?); a gradient
    not asked for is returned as None, and its operand may be None (``x`` is only read for
    dW, ``weight`` only for dx). This is the contract of ``hybridgemm.dispatch.linear_backward``.
    """
    return backward_gemms(grad_out, x, weight, pre_activation, activation, needs_input_grad)


class HybridLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`hybridgemm.linear`, with an optional fused
    activation. Same parameters and state-dict keys (``weight``, ``bias``) as ``nn.Linear``.

    :func:`hybridgemm.patch` turns an existing ``nn.Linear`` into one in place (the class
    attribute ``activation = None`` covers instances that never ran ``__init__``).
    """

    activation: str | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation=None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        act = Activation.parse(activation)
        self.activation = None if act is Activation.NONE else act.value

    @classmethod
    def from_linear(cls, lin: nn.Linear, activation=None) -> HybridLinear:
        """A new module sharing ``lin``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        act = Activation.parse(activation)
        new.activation = None if act is Activation.NONE else act.value
        return new

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        return super().extra_repr() + act


__all__ = ["HybridLinear", "linear", "torch_linear_backward"]
