"""The RMSNorm part of :func:`hybridgemm.patch`: Llama-style RMSNorm modules run as one Triton
launch in eager inference (kernels/triton_rmsnorm.py).

Why: eager decode is host-bound, and Hugging Face's RMSNorm is eight torch ops (to fp32, pow,
mean, add, rsqrt, mul, to, mul), each a dispatch and a kernel launch on a few KB of data. A
Llama decoder layer runs two of them, so they are about a third of its launches
(perf/e2e_profile.py counts them). The kernel computes the same formula, the normalised row
rounded to the input dtype before the weight multiplies it.

Recognised by class (the formula is the class's, not something the structure shows): the
RMSNorm classes of transformers' Llama, Qwen2, Qwen3 and Mistral (one formula, copied per
model), with a 1-D ``weight`` and a ``variance_epsilon``; and any other transformers module
with those two whose own forward, run at patch time on a CPU copy with random weights, an
epsilon of its own and random rows in bf16, in fp16 and in fp32 under a bf16 weight, gives
Llama's formula bit for bit
(:func:`computes_rms_norm`: DeepSeek-V3's, GLM's, Ernie's and most other models' copies; a
forward that reads its epsilon from elsewhere, scales in fp32 or adds an offset gives other
bits and is left alone). Gemma's, Gemma 2's and Gemma 3's
(:data:`GEMMA_NORM_CLASSES`:
``x * rsqrt(mean(x²) + eps)`` times ``1 + weight``, all in fp32, rounded once, with ``eps``)
become :class:`HybridGemmaRMSNorm`, which computes the same formula as one launch (the
kernel's ``fp32_factor`` form) and hands the fused decode step its operand
(:func:`norm_operand`: the kept ``1 + weight`` in fp32 in eager calls, the weight and its
offset under torch.compile); OLMo 2's (:data:`OLMO2_NORM_CLASSES`: the same with ``weight``,
epsilon ``variance_epsilon``) become :class:`HybridOlmo2RMSNorm`. Other transformers modules
whose forward computes one of these two formulas bit for bit on the same probe (bf16 rows under
an fp32 weight too: :func:`computes_gemma_norm`, :func:`computes_olmo2_norm`; Qwen3-Next's,
Qwen3.5's, OLMo 3's, GPT-OSS's, Helium's copies among them) become those classes; any other
class is left alone. The module keeps its object, weight and state-dict key; only its class is swapped
(undone by :func:`hybridgemm.unpatch`).

Anything but eager inference on CUDA (a gradient wanted, ``torch.compile``, which fuses the
norm itself, autocast, the CPU, tensor subclasses, other dtypes) runs the stock formula in
torch ops, so the result there is the stock module's.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import Tensor, nn

from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES as _PLAIN
from hybridgemm.kernels.lazy import triton_module

# transformers' RMSNorm classes whose forward is Llama's formula (x in fp32, times rsqrt(mean(x^2)
# + eps), rounded to x's dtype, then times the weight); tests/fusion/test_norm.py checks each one
# against reference_rms_norm bit for bit with the installed transformers.
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "MixtralRMSNorm",
                    "Phi3RMSNorm", "GraniteRMSNorm", "GraniteMoeRMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm",
                    "OlmoeRMSNorm")
# transformers' RMSNorm classes of Gemma's formula (tests/fusion/test_norm.py checks each one
# against reference_gemma_rms_norm bit for bit with the installed transformers).
GEMMA_NORM_CLASSES = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")
# transformers' RMSNorm classes that scale by the weight in fp32 and round once (OLMo 2's; the
# same test checks them against the fp32-factor formula)
OLMO2_NORM_CLASSES = ("Olmo2RMSNorm",)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_rmsnorm():
    return triton_module("triton_rmsnorm")  # on first use: importing hybridgemm needs no Triton


def _recognised(mod: nn.Module, classes: tuple[str, ...], eps_attr: str) -> bool:
    """Is ``mod`` of one of transformers' classes ``classes``, with a 1-D ``weight`` and a number
    ``eps_attr`` (what their forward reads)?"""
    t = type(mod)
    if t.__name__ not in classes or not t.__module__.startswith("transformers"):
        return False
    w = mod._parameters.get("weight")
    eps = mod.__dict__.get(eps_attr)
    return w is not None and w.dim() == 1 and isinstance(eps, (int, float)) and not isinstance(eps, bool)


def is_rms_norm(mod: nn.Module) -> bool:
    """Is ``mod`` one of transformers' RMSNorm classes of :data:`RMS_NORM_CLASSES` (its epsilon
    ``variance_epsilon``), or another transformers module that :func:`computes_rms_norm`?"""
    return _recognised(mod, RMS_NORM_CLASSES, "variance_epsilon") or computes_rms_norm(mod)


_PROBE_EPS = 0.25  # large enough to change the bits of rows of unit scale: a forward that ignores it differs
_PROBE_ROWS = 3


def _takes_rows_only(cls: type, names: tuple[str, ...] = ("hidden_states",)) -> bool:
    """Does ``cls.forward`` take one argument, named as one of ``names``, as the patched class's
    does (a gated norm's second argument would have nowhere to go)?"""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].name in names \
        and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def computes_rms_norm(mod: nn.Module) -> bool:
    """Does transformers module ``mod`` (a 1-D ``weight``, a float ``variance_epsilon``) compute
    :func:`reference_rms_norm` with them? Its class's forward runs on a CPU copy of it (hooks
    not called) with random weights, ``variance_epsilon`` set to :data:`_PROBE_EPS` and random
    rows, in bf16 and in fp16, and fp32 rows under a bf16 weight; True where every output equals
    the reference's bit for bit (and its forward takes ``hidden_states`` alone).
    Never raises: a forward that fails on the probe is not this formula."""
    return _computes(mod, "variance_epsilon", reference_rms_norm, _PROBE_DTYPES, ("hidden_states",))


def computes_gemma_norm(mod: nn.Module) -> bool:
    """:func:`computes_rms_norm` for Gemma's formula (:func:`reference_gemma_rms_norm`, epsilon
    ``eps``; Qwen3-Next's, Qwen3.5's, VaultGemma's copies), bf16 rows under an fp32 weight too."""
    return _computes(mod, "eps", reference_gemma_rms_norm, _FP32_FACTOR_PROBE_DTYPES, _FP32_FACTOR_ARGUMENTS)


def computes_olmo2_norm(mod: nn.Module) -> bool:
    """:func:`computes_rms_norm` for OLMo 2's formula (the weight in fp32 times the normalised
    row, rounded once; epsilon ``variance_epsilon``; OLMo 3's, GPT-OSS's, Helium's copies), bf16
    rows under an fp32 weight too."""
    return _computes(mod, "variance_epsilon", lambda x, w, eps: _scaled_in_fp32(x, w.float(), eps),
                     _FP32_FACTOR_PROBE_DTYPES, _FP32_FACTOR_ARGUMENTS)


# (rows, weight) dtypes of a probe: fp32 rows under a bf16 weight tell T5's norm (it casts the
# row to a 16-bit weight's dtype) from Llama's; bf16 rows under an fp32 weight tell a factor
# applied in fp32 (rounded once) from one applied after rounding
_PROBE_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16))
_FP32_FACTOR_PROBE_DTYPES = (*_PROBE_DTYPES, (torch.bfloat16, torch.float32))
# the fp32-factor forms' forward argument may be named x, as in Gemma's classes (swapped so too)
_FP32_FACTOR_ARGUMENTS = ("hidden_states", "x")


def _computes(mod: nn.Module, eps_attr: str, reference, dtypes: tuple, names: tuple[str, ...]) -> bool:
    """Does ``mod``'s forward (one argument, named as one of ``names``) give ``reference(x,
    weight, eps)`` bit for bit, its epsilon ``eps_attr``, for rows and weight of each of ``dtypes``?"""
    t = type(mod)
    w = mod._parameters.get("weight")
    eps = mod.__dict__.get(eps_attr)
    if not t.__module__.startswith("transformers") or w is None or w.dim() != 1 or not w.is_floating_point() \
            or not isinstance(eps, float) or len(mod._parameters) != 1 or mod._modules \
            or not _takes_rows_only(t, names):
        return False
    g = torch.Generator().manual_seed(0)
    try:
        with torch.device("cpu"), torch.no_grad():  # (whatever device context patch is called in)
            probe = copy.deepcopy(mod).to_empty(device="cpu")
            setattr(probe, eps_attr, _PROBE_EPS)
            for x_dtype, dtype in dtypes:
                probe = probe.to(dtype)
                probe.weight.copy_(torch.randn(w.shape, generator=g))
                x = torch.randn(_PROBE_ROWS, w.shape[0], generator=g).to(x_dtype)
                y = t.forward(probe, x)
                want = reference(x, probe.weight, _PROBE_EPS)
                if not isinstance(y, Tensor) or y.dtype != want.dtype or not torch.equal(y, want):
                    return False
    except Exception:  # its forward takes something else: not this formula
        return False
    return True


def is_gemma_norm(mod: nn.Module) -> bool:
    """Is ``mod`` one of transformers' RMSNorm classes of :data:`GEMMA_NORM_CLASSES` (its epsilon
    ``eps``), or another transformers module that :func:`computes_gemma_norm`?"""
    return _recognised(mod, GEMMA_NORM_CLASSES, "eps") or computes_gemma_norm(mod)


def is_olmo2_norm(mod: nn.Module) -> bool:
    """Is ``mod`` one of transformers' RMSNorm classes of :data:`OLMO2_NORM_CLASSES` (its epsilon
    ``variance_epsilon``), or another transformers module that :func:`computes_olmo2_norm`?"""
    return _recognised(mod, OLMO2_NORM_CLASSES, "variance_epsilon") or computes_olmo2_norm(mod)


def _scaled_in_fp32(x: Tensor, g: Tensor, eps: float) -> Tensor:
    """``x`` normalised and scaled by the fp32 factor ``g`` in fp32, rounded once to x's dtype
    (the stock formula op for op)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * g).to(x.dtype)


def reference_gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's formula, op for op: normalised and scaled by ``1 + weight`` in fp32, rounded once."""
    return _scaled_in_fp32(x, 1.0 + weight.float(), eps)


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


def _launch(x: Tensor, w: Tensor, eps: float, fp32_factor: bool, offset: float = 0.0,
            residual: Tensor | None = None) -> Tensor:
    """The Triton launch of a call :func:`_fast_path` accepted (plus ``residual``: x's shape,
    the output's dtype, a unit last stride)."""
    h = x.shape[-1]
    dtype = x.dtype if fp32_factor else torch.promote_types(w.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if out.numel():
        # a view for the decode and prefill layouts, else a copy (reshape keeps the unit last stride)
        _triton_rmsnorm().run(x.reshape(-1, h), w, out.view(-1, h), eps, fp32_factor, offset,
                              None if residual is None else residual.reshape(-1, h))
    return out


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The stock formula (:func:`reference_rms_norm`), as one Triton launch where
    :func:`_fast_path` allows it."""
    return _launch(x, w, eps, False) if _fast_path(x, w) else reference_rms_norm(x, w, eps)


def fp32_factor_rms_norm(x: Tensor, w: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """Gemma's / OLMo 2's formula with the factor ``offset + w`` in fp32 (Gemma: its weight and
    1, OLMo 2: its weight and 0; or a factor already formed and 0): x normalised and scaled by
    the factor in fp32, rounded once to x's dtype; one Triton launch, which forms the factor
    in registers, where :func:`_fast_path` allows it, else the stock ops."""
    if _fast_path(x, w):
        return _launch(x, w, eps, True, offset)
    return _scaled_in_fp32(x, offset + w.float(), eps)


class HybridRMSNorm(nn.Module):
    """A recognised RMSNorm with its class swapped (same ``weight`` and ``variance_epsilon``):
    one Triton launch in eager CUDA inference, the stock formula everywhere else."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: Tensor) -> Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class Fp32FactorRMSNorm(nn.Module):
    """A recognised RMSNorm that scales the normalised x by an fp32 factor, ``OFFSET + weight``,
    and rounds once (Gemma's ``1 + w``, OLMo 2's ``w``), with its class swapped (same ``weight``
    and epsilon attribute): one Triton launch in eager CUDA inference (the factor formed in
    registers), the stock formula in torch ops elsewhere; the fused decode step takes its
    operand from :func:`norm_operand`."""

    OFFSET: float
    weight: nn.Parameter

    def norm_eps(self) -> float:
        raise NotImplementedError

    def forward(self, hidden_states: Tensor) -> Tensor:
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            # in the graph: differentiable, and never a kept tensor (which inference mode may have
            # made) saved for backward
            return _scaled_in_fp32(hidden_states, self.OFFSET + self.weight.float(), self.norm_eps())
        # eager inference: one launch on CUDA, which adds OFFSET to the weight in registers
        return fp32_factor_rms_norm(hidden_states, self.weight, self.norm_eps(), self.OFFSET)

    def kernel_weight(self) -> Tensor:
        """``OFFSET + weight`` in fp32, the factor a fused norm prologue multiplies x by (it
        computes ``rstd * ((x * g) @ W.T)``), for eager calls (:func:`norm_operand`). Kept
        between calls while the weight is unchanged (the same parameter, storage and version);
        formed afresh if called while compiling (no kept tensor enters a graph)."""
        w = self.weight
        if torch.compiler.is_compiling():
            return self.OFFSET + w.detach().float()
        key = (id(w), w.data_ptr(), w._version, w.device, w.dtype)
        kept = self.__dict__.get("_kernel_weight")
        if kept is None or kept[0] != key:
            with torch.no_grad():
                kept = (key, (self.OFFSET + w.detach().float()).contiguous())
            self.__dict__["_kernel_weight"] = kept
        return kept[1]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.norm_eps()}, {self.OFFSET:g} + weight in fp32"


class HybridGemmaRMSNorm(Fp32FactorRMSNorm):
    """A Gemma RMSNorm (:data:`GEMMA_NORM_CLASSES`): factor ``1 + weight``, epsilon ``eps``."""

    OFFSET = 1.0
    eps: float

    def norm_eps(self) -> float:
        return self.eps


class HybridOlmo2RMSNorm(Fp32FactorRMSNorm):
    """An OLMo 2 RMSNorm (:data:`OLMO2_NORM_CLASSES`): factor ``weight`` (in fp32, where
    Llama's formula rounds before it), epsilon ``variance_epsilon``."""

    OFFSET = 0.0
    variance_epsilon: float

    def norm_eps(self) -> float:
        return self.variance_epsilon


def prologue_norm(x: Tensor, g: Tensor, eps: float, offset: float | None = None) -> Tensor:
    """The norm of operand ``(g, eps, offset)`` (:func:`norm_operand`) apart, as a fused norm
    prologue computes it (the fused GEMMs' fallback; one launch on CUDA): with an ``offset``,
    Gemma's / OLMo 2's formula with factor ``offset + g`` in fp32; without one, Llama's formula
    for a ``g`` of x's dtype and for an fp32 ``g`` (a factor already formed) Gemma's."""
    if offset is not None:
        return fp32_factor_rms_norm(x, g, eps, offset)
    return rms_norm(x, g, eps) if g.dtype == x.dtype else fp32_factor_rms_norm(x, g, eps)


def forms_factor(g: Tensor, offset: float | None, dtype: torch.dtype) -> bool:
    """Does :func:`prologue_operand` form the factor for x of ``dtype`` (a 16-bit weight of the
    other 16-bit dtype, with an offset), rather than hand the kernels the weight?"""
    return offset is not None and g.dtype not in (dtype, torch.float32)


def prologue_operand(g: Tensor, eps: float, offset: float | None, dtype: torch.dtype) -> tuple:
    """The ``norm=`` argument a fused norm prologue's kernel takes for operand ``(g, eps,
    offset)`` (:func:`norm_operand`) with x of ``dtype``: ``(g, eps)`` where the factor is ``g``
    as it is (Llama's weight, a kept fp32 factor, or OLMo 2's weight: the kernels multiply in
    fp32, and ``0 + g`` in fp32 is ``g``), else ``(g, eps, offset)``, whose factor ``offset + g``
    in fp32 the kernels form in registers (Gemma's ``1 + w``: no launches before the GEMM). A
    16-bit weight of the other 16-bit dtype than x's, which the kernels do not read, with an
    offset: the factor formed here in fp32."""
    if forms_factor(g, offset, dtype):
        return (offset + g.float(), eps)
    return (g, eps) if not offset else (g, eps, float(offset))


def norm_operand(norm: nn.Module) -> tuple[Tensor, float, float | None]:
    """``(g, eps, offset)`` of a patched norm for the fused decode step: a Llama-style norm's
    weight, eps and None. A Gemma or OLMo 2 norm's eager operand is its kept factor
    (:meth:`Fp32FactorRMSNorm.kernel_weight`) and offset 0; under ``torch.compile`` its weight
    and ``OFFSET``, so that no graph computes the factor: a norm apart and a norm prologue form
    it in registers (:func:`prologue_operand`)."""
    if isinstance(norm, Fp32FactorRMSNorm):
        if torch.compiler.is_compiling():
            return norm.weight, norm.norm_eps(), norm.OFFSET
        return norm.kernel_weight(), norm.norm_eps(), 0.0
    return norm.weight, norm.variance_epsilon, None


def apply_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """A patched norm's output for ``x`` (the module's formula), without its forward hooks."""
    return prologue_norm(x, *norm_operand(norm))


def add_norm(residual: Tensor, norm: nn.Module, x: Tensor) -> Tensor:
    """``residual + norm(x)`` for a patched norm (:func:`apply_norm`'s output, then torch's add):
    one Triton launch, the norm rounded and then added, where the norm's own launch would run
    and ``residual`` is a plain tensor of x's shape and the norm's output dtype, else the two
    steps. (The post-norm layers' residual adds: Gemma 2/3, OLMo 2.)"""
    g, eps, offset = norm_operand(norm)
    fp32_factor = offset is not None or g.dtype != x.dtype  # (prologue_norm's choice of formula)
    if _fast_path(x, g) and type(residual) in _PLAIN and residual.shape == x.shape \
            and residual.dtype == x.dtype and residual.device == x.device and residual.stride(-1) == 1 \
            and not (torch.is_grad_enabled() and residual.requires_grad):
        return _launch(x, g, eps, fp32_factor, offset or 0.0, residual)
    return residual + prologue_norm(x, g, eps, offset)


PATCHED_NORMS = (HybridRMSNorm, HybridGemmaRMSNorm, HybridOlmo2RMSNorm)

__all__ = ["GEMMA_NORM_CLASSES", "OLMO2_NORM_CLASSES", "PATCHED_NORMS", "RMS_NORM_CLASSES", "Fp32FactorRMSNorm",
           "HybridGemmaRMSNorm", "HybridOlmo2RMSNorm", "HybridRMSNorm", "add_norm", "apply_norm", "computes_gemma_norm",
           "computes_olmo2_norm", "computes_rms_norm",
           "forms_factor", "fp32_factor_rms_norm", "is_gemma_norm", "is_olmo2_norm", "is_rms_norm", "norm_operand",
           "prologue_operand", "prologue_norm", "reference_gemma_rms_norm", "reference_rms_norm", "rms_norm"]
