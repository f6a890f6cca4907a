"""A LayerNorm of the fused decode step (GPT-NeoX, Falcon: fusion/models/layernorm_layers.py)
under torch.compile: one launch of kernels/triton_layernorm.py where the norm is a plain
``nn.LayerNorm`` it computes.

Why: Inductor compiles such a norm into a reduction kernel of about 3.3-4.5 us on the H200 for
one row of 9 KB, the kernel takes 2.7 us (falcon-7b,
perf/results/h200/e2e_profile_families_h200.csv). Under CUDA graphs GPU time is the step's
time. Eager calls run the module (one launch, as stock; eager decode is host-bound), and so do
norms the kernel does not compute: another class, no affine weight or bias, parameters of
another dtype than x's, forward hooks, a CPU x. The kernel's mean and variance are two fp32
passes over the row in registers; stock's (Inductor's or torch's) differ from them in the last
bits. Rows wider than the kernel holds in registers run torch's ``layer_norm`` inside the op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES
from hybridgemm.kernels.lazy import triton_module

from .decode_checks import hooked


@torch.library.custom_op("hybridgemm::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    kernel = triton_module("triton_layernorm")
    if x.shape[-1] > kernel.SINGLE_PASS_MAX:  # (wider than its registers hold: torch's)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return kernel.layer_norm(x, weight, bias, eps)


@layer_norm_fwd.register_fake
def _layer_norm_fake(x, weight, bias, eps):
    return x.new_empty(x.shape)


def _computes(norm: nn.Module, x: Tensor) -> bool:
    """Is ``norm`` a LayerNorm the kernel computes for x: plain ``nn.LayerNorm`` over x's last
    dim, with an affine weight and bias of x's dtype and device, no hooks?"""
    if type(norm) is not nn.LayerNorm or norm.normalized_shape != (x.shape[-1],) or hooked(norm):
        return False
    return all(type(t) in PLAIN_TENSOR_TYPES and t.dtype == x.dtype and t.device == x.device
               for t in (norm.weight, norm.bias))


def layer_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """``norm(x)``: under torch.compile one launch where the kernel computes it (the module
    docstring), else the module called."""
    if torch.compiler.is_compiling() and x.is_cuda and type(x) in PLAIN_TENSOR_TYPES and x.shape[-1] >= 1 \
            and _computes(norm, x):
        return torch.ops.hybridgemm.layer_norm_fwd(x, norm.weight, norm.bias, float(norm.eps))
    return norm(x)


__all__ = ["layer_norm", "layer_norm_fwd"]
