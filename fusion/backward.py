"""The backward of ``y = act(x @ W.T + b)``, in one place: the cuBLASLt GEMMs on the GPU
(:func:`linear_backward`), the torch reference elsewhere (:func:`torch_linear_backward`),
both around :func:`backward_gemms`. Used by the custom ops (fusion/ops.py), eager training
(fusion/linear_layer.py) and the attention projection's Functions (fusion/eager_fast.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from hybridgemm.kernels import cublaslt, cublaslt_grad
from hybridgemm.kernels.checks import rows_2d
from hybridgemm.kernels.epilogue import Activation
from hybridgemm.kernels.problem import DTYPE_NAMES


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
    ``linear_backward`` passes the cuBLASLt ones)."""
    need_x, need_w, need_b = (bool(v) for v in needs_input_grad)
    dz = _activation_grad(grad_out, pre_activation, Activation.parse(activation))
    dz2 = rows_2d(dz)  # (M, N), also where N or K is 0 (reshape(-1, N) cannot infer M there)
    dx = dw = db = None
    if need_x:
        if weight is None:
            raise ValueError("linear_backward: dx needs weight, got None")
        dx = grad_input(dz2, weight).reshape(*dz.shape[:-1], weight.shape[1])
    if need_w:
        if x is None:
            raise ValueError("linear_backward: dW needs x, got None")
        dw, db = grad_weight(dz2, rows_2d(x), need_b)
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
    dW, ``weight`` only for dx). This is the contract of :func:`linear_backward`.
    """
    return backward_gemms(grad_out, x, weight, pre_activation, activation, needs_input_grad)


def linear_backward(grad_out: Tensor, x: Tensor | None, weight: Tensor | None,
                    pre_activation: Tensor | None, activation, needs_input_grad):
    """Backward of ``y = act(x @ W.T + b)``: ``(dx, dW, db)``, None where not asked.

    On CUDA with cuBLASLt: ``dz = grad_out * act'(z)`` (elementwise, torch), then
    ``dx = dz @ W`` and ``dW = dz^T @ x`` as cuBLASLt GEMMs, the bias gradient fused into the
    dW GEMM (``BGRADB`` epilogue, kernels/cublaslt_grad.py). Elsewhere (CPU, float64, no
    nvmath) :func:`torch_linear_backward`. Contract: ``pre_activation`` is z for
    gelu/gelu_tanh and y for relu.
    """
    if (grad_out.device.type != "cuda" or grad_out.dtype not in DTYPE_NAMES or not _cublaslt_available()
            or (x is not None and x.dtype != grad_out.dtype)
            or (weight is not None and weight.dtype != grad_out.dtype)):
        return torch_linear_backward(grad_out, x, weight, pre_activation, activation, needs_input_grad)
    # grad_input/grad_weight make the tensors' device current themselves (only when needed).
    return backward_gemms(grad_out, x, weight, pre_activation, activation, needs_input_grad,
                          cublaslt_grad.grad_input, cublaslt_grad.grad_weight)


@functools.cache
def _cublaslt_available() -> bool:
    # Asked once per process: is_available() probes the driver and nvmath, host time a
    # per-call backward cannot spend.
    return cublaslt.is_available()
