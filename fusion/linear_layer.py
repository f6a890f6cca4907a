"""``hybridgemm.linear`` (defined in this module, ``hybridgemm.linear_layer``): a drop-in for
``F.linear`` with the bias and activation fused, and
:class:`HybridLinear`, an ``nn.Linear`` that calls it.

Routing (a custom op costs ~10-25 µs of host time per call, which a decode step cannot
afford, while ``torch.compile`` needs the op):

* eager, no gradient wanted (inference, ``torch.no_grad``), plain tensors:
  ``hybridgemm.dispatch.fused_linear`` directly, the cheapest call there is;
* eager with a gradient wanted, plain tensors: :class:`_EagerLinear`, a plain
  ``autograd.Function`` with the same forward and the backward GEMMs of fusion/backward.py;
* under ``torch.compile``, or tensor subclasses (fake tensors, ...): the
  ``hybridgemm::linear_fwd`` / ``linear_act_fwd`` custom ops (fusion/ops.py), whose autograd
  runs the same backward.

Semantics are those of ``F.linear`` followed by the activation: the arguments ``input``,
``weight``, ``bias`` (positional or by keyword), ``input`` (..., K), ``weight`` (N, K),
``bias`` (N,) or None, one dtype and one device; the result is (..., N) in the input dtype.
F.linear's other forms are taken as it takes them: a 1-D weight (K,) gives (...); a bias of
one value ((), (1,), (1, 1)) or of shape (1, N) is that (N,) vector; any other bias shape, or
a bias with a 1-D weight, is F.linear's own broadcasting, which F.linear then computes. What
F.linear refuses raises :class:`~hybridgemm.LinearArgumentError`, a RuntimeError as
F.linear's errors are (a TypeError for a non-tensor argument, as there), naming the argument.
Under ``torch.autocast`` the operands are cast to the autocast dtype first, as autocast does
for ``F.linear``. CPU tensors and dtypes no kernel takes (float64, ...) are computed by
PyTorch inside the dispatcher.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridgemm import dispatch
from hybridgemm.dispatch import WHO
from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES as _PLAIN
from hybridgemm.kernels.checks import kernel_form, linear_operands
from hybridgemm.kernels.epilogue import Activation, apply_activation
from hybridgemm.kernels.fp8 import FP8Weight

from . import (
    backward,
    fp8_linear,
    ops,  # noqa: F401  (registers the hybridgemm:: custom ops)
)

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


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None, activation=None) -> Tensor:
    """``act(input @ weight.T + bias)`` for any leading dims of ``input``: ``F.linear``'s
    arguments, forms and errors (see the module docstring), then the activation.

    ``activation``: None, ``"relu"``, ``"gelu_tanh"`` (tanh approximation) or ``"gelu"``
    (exact erf form), or an :class:`~hybridgemm.Activation`. Differentiable in ``input``,
    ``weight`` and ``bias``; traceable by ``torch.compile(fullgraph=True)``.

    ``weight`` may be an :class:`~hybridgemm.kernels.fp8.FP8Weight` (``hybridgemm.quantize_fp8``):
    x and bias then have its dtype (bf16/fp16), and gradients reach x and bias only
    (fusion/fp8_linear.py).
    """
    x = input
    if isinstance(weight, FP8Weight):
        return fp8_linear.linear_fp8(x, weight.data, weight.scale, bias, activation)
    try:
        act = Activation.parse(activation)
    except ValueError:
        if isinstance(activation, Tensor):  # F.linear takes three arguments; a fourth tensor is a slip
            raise TypeError(f"{WHO}: activation must be None, a str or an Activation, got a Tensor "
                            "(the arguments are input, weight, bias, activation)") from None
        raise
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or (
            bias is not None and not isinstance(bias, Tensor)):
        linear_operands(x, weight, bias, WHO)  # raises a TypeError naming the argument
    ac = _autocast_dtype(x)
    if ac is not None:
        x, weight, bias = _cast(x, ac), _cast(weight, ac), _cast(bias, ac)
    wants_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if not wants_grad and (not torch.compiler.is_compiling() and type(x) in _PLAIN and type(weight) in _PLAIN
                           and (bias is None or type(bias) in _PLAIN)):
        return dispatch.fused_linear(x, weight, bias, act)  # takes F.linear's every form itself
    if not kernel_form(weight, bias):
        # The ops and the autograd below take weight (N, K) and bias (N,): other forms become
        # views of that form here, so that autograd's gradients keep the caller's shapes.
        return dispatch.other_form(x, weight, bias, act, lambda x, weight, bias: linear(x, weight, bias, act))
    if not wants_grad:
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
        x, weight, saved = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        dx, dw, db = backward.linear_backward(grad_out, x, weight, saved, ctx.act, (nx, nw, nb and ctx.has_bias))
        return dx, dw, db, None


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


class PartialSumLinear(nn.Module):
    """A linear layer whose local product is one part of a sum over processes: tensor
    parallelism's row-parallel layer (:class:`hybridgemm.parallel.RowParallelLinear`), whose
    input features are split over the ranks. ``forward(x)`` is
    ``sum_parts(linear(x, weight, bias if adds_bias else None))``: exactly one part adds the
    bias. The fused decode step (fusion/models/decode_step.py) computes the local part itself, with
    the residual added where the bias is, and calls :meth:`sum_parts`; or, with
    ``sums_residual``, without the residual, and calls :meth:`sum_parts_residual`."""

    weight: Tensor
    bias: Tensor | None
    adds_bias: bool = False
    sums_residual: bool = False  # a fused layer hands the residual to sum_parts_residual

    def sum_parts(self, y: Tensor) -> Tensor:
        """The sum of every part's ``y`` (the same on every part)."""
        raise NotImplementedError

    def sum_parts_residual(self, y: Tensor, residual: Tensor) -> Tensor:
        """``residual`` + the sum of every part's ``y``, for a layer with ``sums_residual``."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.sum_parts(linear(x, self.weight, self.bias if self.adds_bias else None))


__all__ = ["HybridLinear", "PartialSumLinear", "linear"]
