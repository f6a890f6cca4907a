"""The LayerNorms of a fused decode step (GPT-NeoX, Falcon: fusion/models/layernorm_layers.py)
under torch.compile: one launch of kernels/triton_layernorm.py for the one or two norms a layer
applies to the same input, where they are plain ``nn.LayerNorm`` modules it computes.

Why: Inductor compiles each such norm into a reduction kernel of about 3.3-4.5 us a layer on the
H200 for one row of 4-9 KB (perf/results/h200/e2e_profile_families_h200.csv); this launch
keeps the row in registers, as kernels/triton_rmsnorm.py's 1.7 us RMSNorm does. Under CUDA
graphs GPU time is the step's time. Eager calls run the modules (one launch each, as stock;
eager decode is host-bound), and so do norms the kernel does not compute: another class, no
affine weight or bias, parameters of another dtype than x's, another eps between the two,
forward hooks, a CPU x. The kernel's mean and variance are two fp32 passes over the row in
registers; stock's (Inductor's or torch's) differ from them in the last bits. Rows wider than
the kernel holds in registers run torch's ``layer_norm`` inside the op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES
from hybridgemm.kernels.lazy import triton_module

from .decode_checks import hooked


@torch.library.custom_op("hybridgemm::layer_norms_fwd", mutates_args=())
def layer_norms_fwd(x: Tensor, weight: Tensor, bias: Tensor, weight2: Tensor | None, bias2: Tensor | None,
                    eps: float) -> list[Tensor]:
    params = [(weight, bias)] if weight2 is None else [(weight, bias), (weight2, bias2)]
    kernel = triton_module("triton_layernorm")
    if x.shape[-1] > kernel.SINGLE_PASS_MAX:  # (wider than its registers hold: torch's)
        return [F.layer_norm(x, (x.shape[-1],), w, b, eps) for w, b in params]
    return kernel.layer_norms(x, params, eps)


@layer_norms_fwd.register_fake
def _layer_norms_fake(x, weight, bias, weight2, bias2, eps):
    return [x.new_empty(x.shape) for _ in range(1 if weight2 is None else 2)]


def _computes(norm: nn.Module, x: Tensor) -> bool:
    """Is ``norm`` a LayerNorm the kernel computes for x: plain ``nn.LayerNorm`` over x's last
    dim, with an affine weight and bias of x's dtype and device, no hooks?"""
    if type(norm) is not nn.LayerNorm or norm.normalized_shape != (x.shape[-1],) or hooked(norm):
        return False
    return all(type(t) in PLAIN_TENSOR_TYPES and t.dtype == x.dtype and t.device == x.device
               for t in (norm.weight, norm.bias))


def layer_norms(x: Tensor, norms: list[nn.Module]) -> list[Tensor]:
    """``[norm(x) for norm in norms]`` (one or two norm modules): under torch.compile one launch
    for all of them where the kernel computes each (the module docstring), else each module
    called."""
    if torch.compiler.is_compiling() and x.is_cuda and type(x) in PLAIN_TENSOR_TYPES and x.shape[-1] >= 1 \
            and len(norms) in (1, 2) \
            and all(_computes(n, x) for n in norms) and len({float(n.eps) for n in norms}) == 1:
        second = norms[1] if len(norms) == 2 else None
        return torch.ops.hybridgemm.layer_norms_fwd(
            x, norms[0].weight, norms[0].bias, None if second is None else second.weight,
            None if second is None else second.bias, float(norms[0].eps))
    return [norm(x) for norm in norms]


__all__ = ["layer_norms", "layer_norms_fwd"]
