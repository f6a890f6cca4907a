"""The RMSNorm part of :func:`hybridgemm.patch`: Llama-style RMSNorm modules run as one Triton
launch in eager inference (kernels/triton_rmsnorm.py).

Why: eager decode is host-bound, and Hugging Face's RMSNorm is eight torch ops (to fp32, pow,
mean, add, rsqrt, mul, to, mul), each a dispatch and a kernel launch on a few KB of data. A
Llama decoder layer runs two of them, so they are about a third of its launches
(perf/e2e_profile.py counts them). The kernel computes the same formula, the normalised row
rounded to the input dtype before the weight multiplies it.

Recognised by class (the formula is the class's, not something the structure shows): the
RMSNorm classes of transformers' Llama, Qwen2, Qwen3 and Mistral (one formula, copied per
model), with a 1-D ``weight`` and a ``variance_epsilon``. Gemma's, which scales by
``1 + weight``, and any other class are left alone. The module keeps its object, weight and
state-dict key; only its class is swapped (undone by :func:`hybridgemm.unpatch`).

Anything but eager inference on CUDA (a gradient wanted, ``torch.compile``, which fuses the
norm itself, autocast, the CPU, tensor subclasses, other dtypes) runs the stock formula in
torch ops, so the result there is the stock module's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES as _PLAIN
from hybridgemm.kernels.lazy import triton_module

# transformers' RMSNorm classes whose forward is Llama's formula (x in fp32, times rsqrt(mean(x^2)
# + eps), rounded to x's dtype, then times the weight); tests/fusion/test_norm.py checks each one
# against reference_rms_norm bit for bit with the installed transformers.
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "MixtralRMSNorm",
                    "Phi3RMSNorm", "GraniteRMSNorm", "GraniteMoeRMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_rmsnorm():
    return triton_module("triton_rmsnorm")  # on first use: importing hybridgemm needs no Triton


def is_rms_norm(mod: nn.Module) -> bool:
    """Is ``mod`` one of transformers' RMSNorm classes of :data:`RMS_NORM_CLASSES`, with the
    attributes their forward reads?"""
    t = type(mod)
    if t.__name__ not in RMS_NORM_CLASSES or not t.__module__.startswith("transformers"):
        return False
    w = mod._parameters.get("weight")
    eps = mod.__dict__.get("variance_epsilon")
    return w is not None and w.dim() == 1 and isinstance(eps, (int, float)) and not isinstance(eps, bool)


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The stock formula, op for op (what the patched module runs off the fast path)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else None
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _fast_path(x, w: Tensor) -> bool:
    """May this call take the Triton launch? CUDA tensors on the current device (the launch
    goes to the current device's stream), plain tensors (not vmap's or other wrappers), no
    gradient wanted, not traced, no autocast, kernel dtypes, a unit-stride last dim, and a
    weight that fits x (anything else runs the stock formula, which raises the stock error).
    Compiling is checked first: Dynamo cannot trace the device and functorch queries below."""
    if torch.compiler.is_compiling() or type(x) not in _PLAIN or type(w) not in _PLAIN or not x.is_cuda:
        return False
    return _eligible(x, w, _current_device is not None and x.get_device() == _current_device())


def _eligible(x: Tensor, w: Tensor, on_current_device: bool) -> bool:
    """The device-independent part of :func:`_fast_path` (the CPU tests call it directly)."""
    if not on_current_device or _functorch_wrapped(x):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
        return False
    return (x.dtype in _KERNEL_DTYPES and w.dtype in _KERNEL_DTYPES and x.dim() > 0 and x.stride(-1) == 1
            and w.dim() == 1 and w.shape[0] == x.shape[-1] and w.device == x.device and w.is_contiguous())


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The stock formula (:func:`reference_rms_norm`), as one Triton launch where
    :func:`_fast_path` allows it."""
    if not _fast_path(x, w):
        return reference_rms_norm(x, w, eps)
    h = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype), device=x.device)
    if out.numel():
        # a view for the decode and prefill layouts, else a copy (reshape keeps the unit last stride)
        _triton_rmsnorm().run(x.reshape(-1, h), w, out.view(-1, h), eps)
    return out


class HybridRMSNorm(nn.Module):
    """A recognised RMSNorm with its class swapped (same ``weight`` and ``variance_epsilon``):
    one Triton launch in eager CUDA inference, the stock formula everywhere else."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: Tensor) -> Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


__all__ = ["RMS_NORM_CLASSES", "HybridRMSNorm", "is_rms_norm", "reference_rms_norm", "rms_norm"]
