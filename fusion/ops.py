"""``torch.library`` custom ops behind :func:`hybridgemm.linear`, with fake kernels and autograd.

Why custom ops: the backends launch kernels from raw pointers (cuBLASLt) or Triton
launchers, which ``torch.compile`` cannot trace. An opaque op with a fake (meta) kernel
lets Dynamo/AOTAutograd/Inductor trace a model that uses it with ``fullgraph=True``, and
the registered autograd formula gives it a backward that is itself an opaque op.

Ops (namespace ``hybridgemm``):

``linear_fwd(x, weight, bias?, activation) -> y``
    ``y = act(x @ weight.T + bias)`` through ``hybridgemm.dispatch.fused_linear`` (one
    fused GEMM). Used for inference, for training without an activation, and for
    training with ``relu``: relu's derivative ``1[z > 0]`` equals ``1[y > 0]``, so the
    output itself is what the backward keeps (as stock ``torch.relu`` does), no extra memory.
``linear_act_fwd(x, weight, bias?, activation) -> (y, z)``
    Training with ``gelu``/``gelu_tanh``: the backward needs the pre-activation ``z``.
    We *save* ``z`` rather than recompute it in the backward: keeping it costs ``M x N``
    elements, exactly what stock ``F.linear`` + ``F.gelu`` keep (gelu saves its input),
    while recomputing would cost a whole extra forward GEMM (+50% of the backward's
    FLOPs). ``z`` is the GEMM with the bias only, ``y`` the activation applied to it.
``linear_bwd(grad_out, x?, weight?, saved?, activation, needs_x, needs_w, needs_b) -> (dx, dw, db)``
    Calls ``hybridgemm.backward.linear_backward``. A custom op
    cannot return ``None``, so a gradient that is not needed comes back as an empty tensor
    and the autograd formula turns it into ``None``.

No double backward: ``linear_bwd`` has no autograd formula (``create_graph=True`` through
these ops raises).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridgemm import dispatch
from hybridgemm.kernels.checks import check_linear_args
from hybridgemm.kernels.epilogue import Activation, apply_activation
from hybridgemm.kernels.process_memory import per_call_scratch

from . import backward

WHO = "hybridgemm.linear"
_SAVES_PREACT = (Activation.GELU.value, Activation.GELU_TANH.value)


def _out_shape(x: Tensor, weight: Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------- forward, fused epilogue

@torch.library.custom_op("hybridgemm::linear_fwd", mutates_args=())
def linear_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    # .contiguous(): the fake kernel promises a contiguous result (Inductor relies on it).
    with per_call_scratch():  # no scratch cached from inside a compiled region (CUDA graph trees)
        return dispatch.fused_linear(x, weight, bias, activation).contiguous()


@linear_fwd.register_fake
def _linear_fwd_fake(x, weight, bias, activation):
    check_linear_args(x, weight, bias, WHO)
    Activation.parse(activation)
    return x.new_empty(_out_shape(x, weight))


def _needs(ctx, has_bias: bool) -> tuple[bool, bool, bool]:
    nx, nw, nb = ctx.needs_input_grad[:3]
    return bool(nx), bool(nw), bool(nb) and has_bias


def _setup_linear_fwd(ctx, inputs, output):
    x, weight, bias, activation = inputs
    nx, nw, nb = _needs(ctx, bias is not None)
    ctx.activation = activation
    ctx.needs = (nx, nw, nb)
    # Keep only what the wanted gradients read: dx needs W, dW needs x (a frozen weight,
    # as with LoRA, then keeps no activation memory).
    ctx.save_for_backward(x if nw else None, weight if nx else None,
                          output if activation == Activation.RELU.value else None)


def _linear_fwd_backward(ctx, grad):
    x, weight, saved = ctx.saved_tensors
    dx, dw, db = _run_backward(ctx, grad, x, weight, saved)
    return dx, dw, db, None


linear_fwd.register_autograd(_linear_fwd_backward, setup_context=_setup_linear_fwd)


# ---------------------------------------------------- forward that keeps the pre-activation

@torch.library.custom_op("hybridgemm::linear_act_fwd", mutates_args=())
def linear_act_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> tuple[Tensor, Tensor]:
    if activation not in _SAVES_PREACT:
        raise ValueError(f"{WHO}: linear_act_fwd is for {_SAVES_PREACT}, got {activation!r}")
    with per_call_scratch():
        z = dispatch.fused_linear(x, weight, bias, None).contiguous()
    return apply_activation(z, Activation.parse(activation)), z


@linear_act_fwd.register_fake
def _linear_act_fwd_fake(x, weight, bias, activation):
    check_linear_args(x, weight, bias, WHO)
    shape = _out_shape(x, weight)
    return x.new_empty(shape), x.new_empty(shape)


def _setup_linear_act_fwd(ctx, inputs, output):
    x, weight, bias, activation = inputs
    nx, nw, nb = _needs(ctx, bias is not None)
    ctx.activation = activation
    ctx.needs = (nx, nw, nb)
    ctx.mark_non_differentiable(output[1])  # z is internal: callers only ever see y
    ctx.save_for_backward(x if nw else None, weight if nx else None, output[1])


def _linear_act_fwd_backward(ctx, grad_y, grad_z):
    x, weight, z = ctx.saved_tensors
    dx, dw, db = _run_backward(ctx, grad_y, x, weight, z)
    return dx, dw, db, None


linear_act_fwd.register_autograd(_linear_act_fwd_backward, setup_context=_setup_linear_act_fwd)


# ------------------------------------------------------------------------------- backward

def _run_backward(ctx, grad, x, weight, saved):
    nx, nw, nb = ctx.needs
    if not (nx or nw or nb):
        return None, None, None
    dx, dw, db = torch.ops.hybridgemm.linear_bwd(grad, x, weight, saved, ctx.activation, nx, nw, nb)
    return (dx if nx else None), (dw if nw else None), (db if nb else None)


@torch.library.custom_op("hybridgemm::linear_bwd", mutates_args=())
def linear_bwd(grad_out: Tensor, x: Tensor | None, weight: Tensor | None, saved: Tensor | None,
               activation: str, needs_x: bool, needs_w: bool, needs_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    with per_call_scratch():
        grads = backward.linear_backward(grad_out, x, weight, saved, activation, (needs_x, needs_w, needs_b))
    out = []
    for g, want in zip(grads, (needs_x, needs_w, needs_b)):
        if want and g is None:
            raise RuntimeError(f"{WHO}: linear_backward returned no gradient it was asked for")
        # Contiguous, as the fake kernel promises; an unwanted gradient is an empty tensor.
        out.append(g.contiguous() if want else grad_out.new_empty(0))
    return tuple(out)


@linear_bwd.register_fake
def _linear_bwd_fake(grad_out, x, weight, saved, activation, needs_x, needs_w, needs_b):
    n = grad_out.shape[-1]
    # dx reads W, dW reads x; with only db wanted neither is kept (and K is not needed)
    k = weight.shape[1] if weight is not None else (x.shape[-1] if x is not None else 0)
    dx = grad_out.new_empty((*grad_out.shape[:-1], k)) if needs_x else grad_out.new_empty(0)
    dw = grad_out.new_empty((n, k)) if needs_w else grad_out.new_empty(0)
    db = grad_out.new_empty((n,)) if needs_b else grad_out.new_empty(0)
    return dx, dw, db


__all__ = ["linear_act_fwd", "linear_bwd", "linear_fwd"]
