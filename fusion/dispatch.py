"""The dispatcher: which backend and configuration runs a given linear call.

``fused_linear(x, weight, bias, activation)`` is the single entry point the user-facing
layer (linear, autograd, attention projection) calls for the forward GEMM.

Rules, in order (the tuned-table lookup arrives with the autotune work):
  1. Checks: F.linear's argument rules (clear errors naming dtype/shape/device).
  2. Not CUDA, or a dtype no kernel takes (e.g. float64): PyTorch computes it.
  3. Empty problems (M, N or K = 0): PyTorch semantics without a GEMM.
  4. cuBLASLt when it is available and has the epilogue; otherwise the Triton kernels;
     otherwise PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridgemm.kernels.checks import check_linear_args
from hybridgemm.kernels.epilogue import Activation, apply_activation
from hybridgemm.kernels.problem import DTYPE_NAMES


def torch_linear(x, weight, bias, activation: Activation) -> torch.Tensor:
    """The reference path: F.linear then the activation (CPU tensors, unsupported dtypes)."""
    return apply_activation(F.linear(x, weight, bias), activation)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation=None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` for any leading dims of ``x``, on the best backend."""
    act = Activation.parse(activation)
    if x.device.type != "cuda" or x.dtype not in DTYPE_NAMES:
        check_linear_args(x, weight, bias, "hybridgemm.linear")
        return torch_linear(x, weight, bias, act)
    from hybridgemm.kernels import cublaslt

    if act is not Activation.GELU and cublaslt.is_available():
        return cublaslt.linear(x, weight, bias, act)
    check_linear_args(x, weight, bias, "hybridgemm.linear")
    return torch_linear(x, weight, bias, act)
