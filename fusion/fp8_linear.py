"""FP8 weights in the linear call: :func:`fp8_linear`, its custom op, and :class:`FP8Linear`.

``y = act(x @ dequantize(W8, scale).T + b)`` with W8 e4m3 and fp32 scales (kernels/fp8.py),
x, b and y bf16/fp16. The decision is the dispatcher's (``dispatch.decision_for`` with the
weight format, so the format is part of the table key; ``decide.choose_fp8``):

* ``triton_splitk``: the split-K kernel reads the e4m3 bytes, converts them in registers and
  applies the scales in fp32 (per row after the K loop, per 128x128 block per K tile), bias
  and activation in its epilogue;
* ``cublaslt_fp8`` (a table entry only): x quantized to e4m3 per token, cuBLASLt's FP8 GEMM
  with the scales in its scale modes (kernels/cublaslt_fp8.py);
* ``torch``: the weight dequantized to x's dtype in one pass (kernels/triton_dequant.py, the
  values of ``kernels.fp8.dequantize``: one rounding), then the dispatcher's decision for that
  dtype: what any other path would compute.

``quantize_input`` (W8A8, opted into by ``patch(..., activations="fp8")``): past the decode rows
(M > ``DECODE_MAX_M``), where the decision is not one of the FP8 kernels, x is quantized to e4m3
dynamically (per token; per 1 x 128 block for block weights; a checkpoint's static input
scales are not applied) and cuBLASLt's FP8 GEMM runs (``cublaslt_fp8``, Hopper with cuBLASLt
12.9+) instead of the dequantized weight's bf16 GEMM: the FP8 tensor cores, and the rounding of
x to e4m3 added to the weight's. Where cuBLASLt cannot run that call (another GPU, an unaligned
shape), the dequantized path runs, with a warning once per device and reason. Decode rows keep
x as it is (W8A16): there the weight's bytes set the time. The batch-invariant mode never
quantizes x (cuBLASLt picks its algorithm per M, so a row's result could depend on M). The first
W8A8 call of a signature (:func:`_bound_key`) runs every check and lookup and keeps the launch
it made (kernels/cublaslt_fp8.BoundRun); later calls of that signature (a prefill's projections
at every forward of one prompt length) take it with their own pointers: an eager prefill's host
time is mostly these calls.

CPU tensors, x of another dtype, and CUDA devices without FP8 (compute capability < 8.9,
warned once) take the dequantized path. Gradients flow to x only: an FP8 weight is frozen
(``dx = grad @ dequantize(W8)``), as it is in every FP8 checkpoint runtime.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridgemm import dispatch
from hybridgemm.kernels import backends, fp8
from hybridgemm.kernels import cublaslt_fp8 as lt8
from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES, LinearArgumentError, contiguous_bias, row_major, rows_2d
from hybridgemm.kernels.cublaslt_runtime import CublasLtUnavailable, CublasLtUnsupported
from hybridgemm.kernels.epilogue import GLU_ACTIVATIONS, Activation, apply_activation
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import DECODE_MAX_M, pointer_alignment
from hybridgemm.kernels.process_memory import per_call_scratch

from .diagnostics import warn_once
from .mode_state import DEFAULT, get_mode

WHO = "hybridgemm.linear"
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 conversion in registers (Triton's fp8e4nv): Ada and Hopper on
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def check_fp8_args(x: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None) -> str:
    """F.linear's rules for an FP8 weight, with hybridgemm's messages: x (..., K) and bias (N,)
    one floating dtype, every tensor on one device. Returns the granularity."""
    if not isinstance(x, Tensor) or (bias is not None and not isinstance(bias, Tensor)):
        raise TypeError(f"{WHO}: input and bias must be tensors (bias may be None)")
    granularity = fp8.granularity_of(data, scale)
    n, k = data.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise LinearArgumentError(f"{WHO}: x has shape {tuple(x.shape)} but the FP8 weight expects {k} input "
                                  f"features (weight {tuple(data.shape)})")
    if not x.is_floating_point() or x.dtype in (fp8.E4M3, torch.float8_e5m2):
        raise LinearArgumentError(f"{WHO}: x must be a floating-point tensor of bf16/fp16/fp32, got {x.dtype}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != n:
            raise LinearArgumentError(f"{WHO}: bias must have shape ({n},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise LinearArgumentError(f"{WHO}: bias has dtype {bias.dtype} but x has {x.dtype}")
    devices = {x.device, data.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        raise LinearArgumentError(f"{WHO}: x, the FP8 weight and bias must be on one device, got "
                                  f"{', '.join(sorted(str(d) for d in devices))}")
    return granularity


def runs_fp8_kernels(x: Tensor) -> bool:
    """Do the FP8 kernels run for x: CUDA, bf16/fp16, a GPU that converts e4m3 in registers
    (compute capability 8.9 or later; below it warns once: the weights are dequantized)?"""
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES:
        return False
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    capability = backends.device_limits(dev)["capability"]
    if capability < FP8_MIN_CAPABILITY:
        warn_once(("fp8-capability", dev), f"hybridgemm: device {dev} (compute capability {capability}) has no FP8 "
                  "conversion; FP8 weights are dequantized per call and run as bf16/fp16 GEMMs")
        return False
    return True


def fp8_linear(x: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None = None, activation=None,
               quantize_input: bool = False) -> Tensor:
    """``act(x @ dequantize(data, scale).T + bias)`` for any leading dims of x (see the module
    docstring); ``scale`` in either granularity's shape (kernels/fp8.py); ``quantize_input``:
    W8A8 past the decode rows (module docstring)."""
    act = Activation.parse(activation)
    key, y = _bound_call(x, data, scale, bias, act, None) if quantize_input else (None, None)
    if y is not None:
        return y
    granularity = check_fp8_args(x, data, scale, bias)
    scale_vec = fp8.scale_vector(scale, granularity)
    n, k = data.shape
    x2 = rows_2d(x)
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0 or not runs_fp8_kernels(x):
        return dispatch.torch_linear(x, fp8.dequantize(data, scale_vec, x.dtype), bias, act)
    x2, w2, b2 = row_major(x2), row_major(data), contiguous_bias(bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    choice = dispatch.decision_for(x2, w2, b2, out, act, fp8.FORMAT_OF[granularity])
    if choice.backend in backends.FP8_BACKENDS:  # split-K, or a table's cuBLASLt FP8 entry
        backends.get_backend(choice.backend).run(choice.config, x2, w2, b2, out, act, False,
                                                 weight_scale=scale_vec)
        return out.view(*x.shape[:-1], n)
    if quantize_input and m > DECODE_MAX_M and get_mode() == DEFAULT \
            and _runs_w8a8(x2, w2, scale_vec, b2, out, act, granularity, None if choice.provisional else key,
                           (data, scale, bias)):
        return out.view(*x.shape[:-1], n)
    # past the FP8 kernels' rows: a bf16/fp16 GEMM over the weight dequantized in one pass
    return dispatch.fused_linear(x, triton_module("triton_dequant").dequantize(w2, scale_vec, granularity, x.dtype),
                                 bias, act)


def _bound_call(x: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None, act: Activation,
                glu: str | None) -> tuple[tuple | None, Tensor | None]:
    """``(key, y)``: the call's :func:`_bound_key`, and its result where a launch is kept under
    that key (this signature ran W8A8 before: its launch, with this call's pointers), else None."""
    key = _bound_key(x, data, scale, bias, act, glu)
    bound = None if key is None else lt8.BOUND_RUNS.get(key)
    if bound is None:
        return key, None
    return key, bound(x.view(-1, x.shape[-1]), data, scale, bias).view(*x.shape[:-1], data.shape[0])


def _bound_key(x: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None, act: Activation,
               glu: str | None) -> tuple | None:
    """The signature under which a W8A8 call's bound launch is kept (kernels/cublaslt_fp8.BoundRun),
    or None where the call takes the general path every time (a traced call, a tensor subclass,
    decode rows, x not contiguous): what the checks, the decision and the plan depend on. x's
    shape, dtype, device and alignment; the weight, scales and bias by data pointer, shape,
    dtype and strides (a weight replaced is a miss, never a stale read); the activation, the
    GLU, and the dispatcher's generation (tables reloaded, mode switched). A launch is kept only
    after a call of the key ran W8A8 (on a CUDA device) with none of its operands copied."""
    if torch.compiler.is_compiling() or type(x) not in PLAIN_TENSOR_TYPES or type(data) not in PLAIN_TENSOR_TYPES \
            or type(scale) not in PLAIN_TENSOR_TYPES or (bias is not None and type(bias) not in PLAIN_TENSOR_TYPES) \
            or x.dim() < 2 or x.numel() <= DECODE_MAX_M * x.shape[-1] or not x.is_contiguous():
        return None  # (decode rows never run W8A8: no key to build)
    return (x.shape, x.dtype, x.device.index, pointer_alignment(x.data_ptr()), data.data_ptr(), data.shape,
            data.dtype, data.stride(), scale.data_ptr(), scale.shape, scale.dtype, scale.stride(),
            None if bias is None else (bias.data_ptr(), bias.shape, bias.dtype, bias.stride()), act, glu,
            dispatch.generation())


def _runs_w8a8(x2: Tensor, w2: Tensor, scale: Tensor, b2: Tensor | None, out: Tensor, act: Activation,
               granularity: str, key: tuple | None, given: tuple, glu: str | None = None) -> bool:
    """Run cuBLASLt's FP8 GEMM over x quantized to e4m3 into ``out``; False (one warning per
    device and reason) where it cannot run this call. Keeps the bound launch under ``key``
    (None: keeps nothing, as for a provisional decision, which the dispatcher asks again) where
    later calls can pass the ``given`` (weight, scale, bias) as they are: none of them was
    copied for this call."""
    try:
        _, bound = lt8.run_and_bind(x2, w2, scale, b2, out, act, glu)
    except (CublasLtUnsupported, CublasLtUnavailable, ImportError) as e:
        if glu is not None:
            return False  # (the composition then runs, and fp8_linear warns as it does for any such call)
        reason = str(e)
        warn_once(("fp8-activations", x2.device.index, reason[:80]),
                  f"hybridgemm: activations='fp8': {reason}; this {granularity} FP8 GEMM runs over the weight "
                  "dequantized, with x as it is")
        return False
    data, scale_given, bias = given
    if key is not None and bound is not None and w2 is data and b2 is bias \
            and scale.data_ptr() == scale_given.data_ptr():
        lt8.BOUND_RUNS.put(key, bound)
    return True


def linear_fp8_glu(gate_up: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None, glu: str,
                   quantize_input: bool = False, activation=None) -> Tensor:
    """:func:`linear_fp8` (with ``activation`` after it) of a gated MLP's product, ``glu(gate) *
    up`` of the stacked (..., 2K) output ``gate_up`` (gate columns first; ``glu`` a key of
    ``GLU_ACTIVATIONS``), in gate_up's dtype as transformers' eager MLP rounds it. Where that
    call runs W8A8 (:func:`_glu_into_gemm`), the product is formed while x is quantized and
    never written (kernels/fp8_quant.py): the same bytes reach the same GEMM. Anywhere else,
    the composition itself."""
    if isinstance(gate_up, Tensor) and gate_up.dim() >= 1 and gate_up.shape[-1] == 2 * data.shape[-1]:
        y = _glu_into_gemm(gate_up, data, scale, bias, glu, quantize_input, Activation.parse(activation))
        if y is not None:
            return y
    gate, up = gate_up.chunk(2, dim=-1)
    return linear_fp8(GLU_ACTIVATIONS[glu](gate) * up, data, scale, bias, activation, quantize_input)


def _glu_into_gemm(gate_up: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None, glu: str,
                   quantize_input: bool, act: Activation) -> Tensor | None:
    """The product's GEMM with the product formed inside the quantization of x, or None where
    :func:`fp8_linear` of the product would not run W8A8 here: no ``quantize_input``, decode
    rows, another mode, an activation the kernel does not form, a gradient wanted, a compiled
    region, a tensor subclass, a device the FP8 kernels skip, or a table's split-K decision. (A
    table's cublaslt_fp8 entry without ``quantize_input`` also quantizes x; the composition
    serves it, so that decode rows pay for no second decision.)"""
    if not quantize_input or glu not in fp8.QUANTIZED_GLUS:
        return None
    wants_grad = torch.is_grad_enabled() and (gate_up.requires_grad or (bias is not None and bias.requires_grad))
    key, y = (None, None) if wants_grad else _bound_call(gate_up, data, scale, bias, act, glu)
    if y is not None:
        return y
    gu2 = rows_2d(gate_up)
    m = gu2.shape[0]
    if not (m > DECODE_MAX_M and get_mode() == DEFAULT):
        return None
    if wants_grad or torch.compiler.is_compiling() or type(gate_up) not in PLAIN_TENSOR_TYPES \
            or not runs_fp8_kernels(gate_up):
        return None
    k = data.shape[1]
    granularity = check_fp8_args(gu2[:, :k], data, scale, bias)
    n = data.shape[0]
    if n == 0 or k == 0:
        return None
    scale_vec = fp8.scale_vector(scale, granularity)
    w2, b2 = row_major(data), contiguous_bias(bias)
    out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    choice = dispatch.decision_for(gu2[:, :k], w2, b2, out, act, fp8.FORMAT_OF[granularity], fresh_x=True)
    if choice.backend in backends.FP8_BACKENDS and choice.backend != "cublaslt_fp8":
        return None  # (fp8_linear runs a table's split-K decision with x as it is)
    if not _runs_w8a8(row_major(gu2), w2, scale_vec, b2, out, act, granularity,
                      None if choice.provisional else key, (data, scale, bias), glu):
        return None
    return out.view(*gate_up.shape[:-1], n)


# ------------------------------------------------------------------------------ custom op

@torch.library.custom_op("hybridgemm::fp8_linear_fwd", mutates_args=())
def fp8_linear_fwd(x: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None, activation: str,
                   quantize_input: bool) -> Tensor:
    with per_call_scratch():  # no scratch cached from inside a compiled region (CUDA graph trees)
        return fp8_linear(x, data, scale, bias, activation, quantize_input).contiguous()


@fp8_linear_fwd.register_fake
def _fp8_linear_fwd_fake(x, data, scale, bias, activation, quantize_input):
    check_fp8_args(x, data, scale, bias)
    Activation.parse(activation)
    return x.new_empty((*x.shape[:-1], data.shape[0]))


def _setup(ctx, inputs, output):
    x, data, scale, bias, activation, quantize_input = inputs
    ctx.activation = activation
    ctx.quantize_input = quantize_input
    ctx.has_bias = bias is not None
    keep = activation != Activation.NONE.value  # the activation's derivative needs z = x @ W.T + b
    ctx.save_for_backward(data, scale, x if keep else None, bias if keep else None)


def _backward(ctx, grad):
    data, scale, x, bias = ctx.saved_tensors
    if ctx.activation != Activation.NONE.value:  # through the activation: its derivative at z (recomputed)
        with torch.enable_grad():
            z = fp8_linear(x.detach(), data, scale, None if bias is None else bias.detach(), None,
                           ctx.quantize_input).requires_grad_()
            (grad,) = torch.autograd.grad(apply_activation(z, Activation(ctx.activation)), z, grad)
    dx = grad @ fp8.dequantize(data, scale, grad.dtype) if ctx.needs_input_grad[0] else None
    db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[3] and ctx.has_bias else None
    return dx, None, None, db, None, None


fp8_linear_fwd.register_autograd(_backward, setup_context=_setup)


def linear_fp8(x: Tensor, data: Tensor, scale: Tensor, bias: Tensor | None = None, activation=None,
               quantize_input: bool = False) -> Tensor:
    """:func:`hybridgemm.linear` with an FP8 weight's tensors: the eager call directly where no
    gradient is wanted, else (and under torch.compile) the custom op. ``quantize_input``: W8A8
    past the decode rows (module docstring)."""
    if not isinstance(x, Tensor) or (bias is not None and not isinstance(bias, Tensor)):
        raise TypeError(f"{WHO}: input and bias must be tensors (bias may be None), got {type(x).__name__}, "
                        f"{type(bias).__name__}")
    act = Activation.parse(activation)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if not wants_grad and not torch.compiler.is_compiling() and type(x) in PLAIN_TENSOR_TYPES:
        return fp8_linear(x, data, scale, bias, act, quantize_input)
    return torch.ops.hybridgemm.fp8_linear_fwd(x, data, scale, bias, act.value, bool(quantize_input))


# ------------------------------------------------------------------------------- module

SCALE_NAMES = ("weight_scale", "weight_scale_inv")  # what FP8 checkpoints call the scales


def keep_fp8_dtypes(module: nn.Module, fn, tensors=None):
    """``fn`` of ``Module._apply`` for a module with an FP8 weight: ``model.half()``,
    ``.to(torch.bfloat16)`` and the like would cast the e4m3 weight and its fp32 scales as torch
    casts any floating tensor (turning the weight into its unscaled e4m3 values and rounding the
    scales); those only move to the device ``fn`` sends a tensor to. ``tensors``: the FP8 data
    and scales (default: ``weight`` and the scale buffers). Everything else (the bias) is
    ``fn``'s as usual."""
    if tensors is None:
        tensors = (module._parameters.get("weight"), *(module._buffers.get(n) for n in SCALE_NAMES))
    kept = {id(t) for t in tensors if t is not None and (t.dtype == fp8.E4M3 or t.dtype == torch.float32)}

    def apply(t):
        if id(t) not in kept:
            return fn(t)
        device = fn(t.new_empty(0)).device  # where fn sends a tensor (its dtype is not taken)
        if device == t.device:
            return t
        return torch.empty_like(t, device=device) if t.is_meta else t.to(device=device)

    return apply


class FP8Linear(nn.Module):
    """A linear layer with an FP8 weight: ``weight`` (e4m3, frozen) and its fp32 scales, kept
    in the shape and under the name the source format uses (``weight_scale`` (N, 1) or (N,) per
    channel as compressed-tensors writes it, ``weight_scale_inv`` (N/128, K/128) per block as
    transformers' fine-grained FP8 writes it), so ``state_dict()`` round-trips in that format.
    ``bias`` and the output are ``dtype`` (bf16/fp16). Made from an
    :class:`~hybridgemm.kernels.fp8.FP8Weight` (:meth:`from_fp8`), a bf16 ``nn.Linear``
    (:meth:`from_linear`), or a checkpoint's tensors (the constructor, which checks them)."""

    def __init__(self, data: Tensor, scale: Tensor, bias: Tensor | None = None, *, dtype=torch.bfloat16,
                 activation=None, scale_name: str = "weight_scale", check: bool = True):
        super().__init__()
        if scale_name not in SCALE_NAMES:
            raise ValueError(f"scale_name must be 'weight_scale' or 'weight_scale_inv', got {scale_name!r}")
        checked = fp8.FP8Weight.from_tensors(data, scale, dtype, check=check)  # FP8FormatError if they do not fit
        self.out_features, self.in_features = data.shape
        self.granularity = checked.granularity
        self.dtype = dtype
        self.scale_name = scale_name
        self.weight = nn.Parameter(checked.data, requires_grad=False)
        self.register_buffer(scale_name, scale if scale.is_contiguous() else scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        act = Activation.parse(activation)
        self.activation = None if act is Activation.NONE else act.value

    @classmethod
    def from_fp8(cls, weight: fp8.FP8Weight, bias: Tensor | None = None, activation=None) -> FP8Linear:
        return cls(weight.data, weight.scale, bias, dtype=weight.dtype, activation=activation, check=False)

    @classmethod
    def from_linear(cls, lin: nn.Linear, granularity: str = "channel", activation=None) -> FP8Linear:
        """``lin``'s weight quantized (:func:`kernels.fp8.quantize_fp8`), its bias kept."""
        return cls.from_fp8(fp8.quantize_fp8(lin.weight.detach(), granularity), lin.bias, activation)

    @property
    def weight_scale_tensor(self) -> Tensor:
        """The scales as the kernels read them ((N,) or (N/128, K/128); a view, no copy)."""
        scale = getattr(self, self.scale_name)
        return scale.reshape(-1) if self.granularity == "channel" else scale

    @property
    def fp8_weight(self) -> fp8.FP8Weight:
        return fp8.FP8Weight(self.weight, self.weight_scale_tensor, self.granularity, self.dtype)

    def _apply(self, fn, *args, **kwargs):
        return super()._apply(keep_fp8_dtypes(self, fn), *args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return linear_fp8(x, self.weight, self.weight_scale_tensor, self.bias, self.activation)

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8={self.granularity}{act}")


__all__ = ["FP8Linear", "check_fp8_args", "fp8_linear", "fp8_linear_fwd", "linear_fp8"]
