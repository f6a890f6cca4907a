"""Decoder-layer fusion: a Llama-style decoder layer's two RMSNorms and two residual adds run
inside its GEMMs at decode sizes. Part of :func:`hybridgemm.patch` (``layers=True``).

A stock layer runs, per token::

    h = x + o_proj(attn(qkv(rmsnorm1(x))))        # norm kernel, QKV GEMM, ..., O GEMM, add
    y = h + down(glu(gate_up(rmsnorm2(h))))       # norm kernel, gate/up GEMM, down GEMM, add

Under torch.compile the add and the following norm become one Inductor kernel, so a decode
step runs two such kernels per layer between the GEMMs; eager runs four launches. Here:

* the QKV GEMM normalises x as it loads it (``norm_linear``: Triton split-K with an RMSNorm
  prologue, ``rstd * ((x * g) @ W.T)`` with the squares summed from the x tiles it loads; see
  ``triton_common.tl_norm_tile_mma``), and hands its output to the attention module's q/k/v
  slices (``FusedLinears.seed``);
* the O GEMM adds the residual in its epilogue (``linear_residual``: the O projection module
  becomes a :class:`ResidualLinear`, given the residual by the layer for the one call);
* the gate/up kernel normalises h on load (``gated_norm``: triton_glu with the prologue) and
  the down GEMM adds h in its epilogue.

With a static KV cache the attention part runs as decode_attention's fused step (rotary and
the cache write in the QKV epilogue); otherwise the attention module's own forward runs on the
seeded Q/K/V.

Tensor parallel (``hybridgemm.parallelize``): O and down are row-parallel
(:class:`~hybridgemm.linear_layer.PartialSumLinear`). The rank whose GEMM adds the bias adds
the residual in the same epilogue, the other ranks' GEMMs add nothing, then the parts are
summed; or, where the sum itself adds the residual (``sums_residual``: the push kernel, fp32,
one rounding), every GEMM adds nothing but the bias on that rank. Either way the residual and
the bias are each counted once and no separate add runs (:func:`_project_add`). Without the
static-cache step, O runs inside the attention module as the row-parallel layer's own forward
and the residual is added after it. Every rank must take the same path (same hooks, mode,
autocast and grad state on every rank, as the collectives already require): a rank on the
stock forward adds the residual after the sum, so mixed paths would count it on some ranks
and not others.
Numerics: the residual is added to the GEMM result after its rounding, as the stock add does;
a fused norm rounds ``x * g`` once where the stock module rounds ``x * rstd`` and then the
product with g, so results agree with the stock layer's to the inputs' rounding, not bit for
bit (fp16 is not fused: ``x * g`` could leave fp16's range where ``x * rstd * g`` does not).

Taken only where it applies: CUDA, bf16 or fp32 with every weight in x's dtype, no gradient
wanted by x or any weight the fused path reads, no autocast, the default dispatch mode, at
most :data:`DECODE_ROWS` rows, no positional arguments (the model's call), no hooks on the
norms, the MLP or down_proj (the fused path does not call them). A QKV, O or down GEMM whose
table decision is not Triton split-K runs its norm (or add) apart and the GEMM as the table
says; gate/up always runs the gated kernel. Everything else (prefill, training, fp16, CPU)
runs the stock layer forward. One forward at a time per layer, as its KV cache needs anyway:
the layer hands the O projection its residual through the module.

Recognised: transformers' ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``
and ``MistralDecoderLayer`` whose forward is the pre-norm layer above (checked in its source,
so a transformers release that changes it is left alone, with the reason in the report), with
the parts :func:`hybridgemm.patch` fused: Q/K/V, gate/up, HybridRMSNorm norms.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

from hybridgemm import dispatch
from hybridgemm.decide import get_mode
from hybridgemm.fused_rows import FusedLinears
from hybridgemm.kernels.process_memory import per_call_scratch
from hybridgemm.linear_layer import HybridLinear, PartialSumLinear, linear
from hybridgemm.mlp import FUSED_GATE_UP, HybridGatedMLP
from hybridgemm.modes import DEFAULT
from hybridgemm.norm import HybridRMSNorm, rms_norm

from . import decode_step as da

DECODE_ROWS = 16  # rows up to which the fused path runs (the gated kernel's decode configs)
# Recognised layer classes and the transformers module of each (to rebuild the fused class
# when a pickled model is loaded in a new process).
LAYER_MODULES = {"LlamaDecoderLayer": "llama", "Qwen2DecoderLayer": "qwen2", "Qwen3DecoderLayer": "qwen3",
                 "MistralDecoderLayer": "mistral"}
LAYER_CLASSES = tuple(LAYER_MODULES)
QKV_NAME = da.QKV_NAME
# Instance attribute set when the layer is patched: its attention can run as the fused step of
# decode_attention (rotary and KV-cache write in the QKV GEMM) where a call allows it.
ATTENTION_STEP = "_hybridgemm_attention_step"
# A fused layer's int32 buffer (not in the state dict) of split-K arrival counters for its
# GEMMs, which run one after another and leave it zero: a compiled decode step then needs no
# zero-filled counters per GEMM (a fill kernel each).
COUNTERS = "_hybridgemm_counters"
COUNTER_SLOTS = 4096
NOT_A_LAYER = "not a decoder layer"
_LAYER_DTYPES = (torch.bfloat16, torch.float32)
_PLAIN = (Tensor, nn.Parameter)

# The statements of the pre-norm layer forward and of the attention forward that the fused
# forward reproduces (whitespace removed); a source without all of them is not fused.
_LAYER_STATEMENTS = ("residual=hidden_states", "hidden_states=self.input_layernorm(hidden_states)",
                     "hidden_states=residual+hidden_states",
                     "hidden_states=self.post_attention_layernorm(hidden_states)",
                     "hidden_states=self.mlp(hidden_states)", "returnhidden_states")
_ATTENTION_STATEMENTS = ("attn_output=self.o_proj(attn_output)", "returnattn_output,attn_weights")


def _glu_kernel():
    # Imported on first use: importing hybridgemm needs no Triton (tests/test_layers.py).
    from hybridgemm.kernels import triton_glu

    return triton_glu


def _on_kernel_device(x: Tensor) -> bool:
    """Do the fused kernels run on x's device? (CUDA; the CPU tests widen it to the interpreter.)"""
    return x.is_cuda


# ------------------------------------------------------------------- the fused computations

def _norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                 counters: Tensor | None = None) -> Tensor:
    y = da.fused_splitk(x, weight, bias, counters, norm=(norm_weight, float(eps)))
    return dispatch.fused_linear(rms_norm(x, norm_weight, eps), weight, bias) if y is None else y


def _linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                     counters: Tensor | None = None) -> Tensor:
    fusion = {} if residual is None else {"residual": residual}
    y = da.fused_splitk(x, weight, bias, counters, **fusion)
    if y is not None:
        return y
    y = dispatch.fused_linear(x, weight, bias)
    return y if residual is None else residual + y


def _gated_norm(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                activation: str) -> Tensor:
    return _glu_kernel().glu(x, weight, bias, activation, norm=(norm_weight, float(eps)))


# ``counters`` (the layer's arrival counters, see COUNTERS) are scratch the kernels leave as they
# found them (all zero), so the ops do not declare them mutated.
@torch.library.custom_op("hybridgemm::norm_linear_fwd", mutates_args=())
def norm_linear_fwd(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                    counters: Tensor | None = None) -> Tensor:
    with per_call_scratch():  # no scratch cached from inside a compiled region (CUDA graph trees)
        return _norm_linear(x, norm_weight, eps, weight, bias, counters).contiguous()


@norm_linear_fwd.register_fake
def _norm_linear_fake(x, norm_weight, eps, weight, bias, counters=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hybridgemm::linear_residual_fwd", mutates_args=())
def linear_residual_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                        counters: Tensor | None = None) -> Tensor:
    with per_call_scratch():
        return _linear_residual(x, weight, bias, residual, counters).contiguous()


@linear_residual_fwd.register_fake
def _linear_residual_fake(x, weight, bias, residual, counters=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hybridgemm::gated_norm_fwd", mutates_args=())
def gated_norm_fwd(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                   activation: str) -> Tensor:
    return _gated_norm(x, norm_weight, eps, weight, bias, activation)


@gated_norm_fwd.register_fake
def _gated_norm_fake(x, norm_weight, eps, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                counters: Tensor | None = None) -> Tensor:
    """``linear(rmsnorm(x), weight, bias)`` with Llama's RMSNorm (weight ``norm_weight``), one
    GEMM launch where the table runs Triton split-K. Inference only (no autograd).
    ``counters``: zeroed int32 arrival counters for split-K's fused reduction (see
    ``triton_splitk.run``), used by one launch at a time."""
    if torch.compiler.is_compiling():
        return torch.ops.hybridgemm.norm_linear_fwd(x, norm_weight, float(eps), weight, bias, counters)
    return _norm_linear(x, norm_weight, eps, weight, bias, counters)


def linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                    counters: Tensor | None = None) -> Tensor:
    """``residual + linear(x, weight, bias)`` (``linear(x, weight, bias)`` for a None
    residual), one launch where the table runs Triton split-K. Inference only (no autograd).
    ``counters`` as for :func:`norm_linear`."""
    if torch.compiler.is_compiling():
        return torch.ops.hybridgemm.linear_residual_fwd(x, weight, bias, residual, counters)
    return _linear_residual(x, weight, bias, residual, counters)


def gated_norm(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
               activation: str) -> Tensor:
    """``gated_linear(rmsnorm(x), weight, bias, activation)`` in one launch of the gated kernel.
    Inference only (no autograd)."""
    if torch.compiler.is_compiling():
        return torch.ops.hybridgemm.gated_norm_fwd(x, norm_weight, float(eps), weight, bias, activation)
    return _gated_norm(x, norm_weight, eps, weight, bias, activation)


# ------------------------------------------------------------------------------- modules

class ResidualLinear(HybridLinear):
    """The O projection of a fused decoder layer: a :class:`HybridLinear` that adds
    ``residual`` in its epilogue when the layer has set it, for the one next call (taken and
    cleared by it), else plain. A residual of another shape than the output is an error."""

    residual: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        r = self.residual
        if r is None:
            return linear(x, self.weight, self.bias, self.activation)
        self.residual = None
        if r.shape != (*x.shape[:-1], self.out_features):
            raise RuntimeError(f"hybridgemm: the fused decoder layer's residual {tuple(r.shape)} does not fit "
                               f"o_proj's output {(*x.shape[:-1], self.out_features)}")
        return linear_residual(x, self.weight, self.bias, r)


class HybridDecoderLayer(nn.Module):
    """Mixed in before a recognised decoder-layer class (:func:`fused_class`): the fused
    forward where it applies, the class's own forward everywhere else."""

    def _apply(self, fn, *args, **kwargs):
        # The counters must be zero before a kernel uses them: a move keeps them so, but
        # to_empty() (a model built on the meta device) leaves them uninitialised, and
        # load_state_dict does not touch a non-persistent buffer.
        out = super()._apply(fn, *args, **kwargs)
        counters = self._buffers.get(COUNTERS)
        if counters is not None and not counters.is_meta:
            with torch.no_grad():
                counters.zero_()
        return out

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        if args or not _takes_fused_path(self, hidden_states):
            return super().forward(hidden_states, *args, **kwargs)
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv = attn._modules[QKV_NAME]
        counters = self._buffers.get(COUNTERS)
        slot = da.kv_slot(attn, hidden_states, kwargs) if self.__dict__.get(ATTENTION_STEP) else None
        if slot is not None:
            a = da.attention_step(attn, slot, hidden_states, ln1, qkv, kwargs, counters)
            h = _project_add(attn.o_proj, a, hidden_states, counters)
        else:
            h = self._attention(attn, ln1, qkv, hidden_states, kwargs, counters)
        gate_up = mlp._modules[FUSED_GATE_UP]
        inter = gated_norm(h, ln2.weight, ln2.variance_epsilon, gate_up.weight, gate_up.bias, mlp.glu_activation)
        return _project_add(mlp.down_proj, inter, h, counters)

    @staticmethod
    def _attention(attn, ln1, qkv, hidden_states, kwargs, counters):
        """``hidden_states + attention(norm(hidden_states))`` through the attention module's own
        forward, given the normalised Q/K/V and O's residual."""
        qkv.seed(hidden_states, norm_linear(hidden_states, ln1.weight, ln1.variance_epsilon, qkv.weight, qkv.bias,
                                            counters))
        o_proj = attn.o_proj
        takes_residual = isinstance(o_proj, ResidualLinear)
        if takes_residual:
            o_proj.residual = hidden_states
        try:
            h = attn(hidden_states=hidden_states, **kwargs)[0]
            if not takes_residual:  # a row-parallel O (the layer sets no residual on it): add here
                h = hidden_states + h
            # The slices must have handed out the seeded output (a hook that replaced their
            # input would have made them project it without the norm).
            unused = qkv._rec is not None
        finally:
            if takes_residual:
                o_proj.residual = None
            qkv._rec = None
        if unused:
            raise RuntimeError("hybridgemm: the fused decoder layer's attention did not take the normalised Q/K/V "
                               "it was given (a hook or another attention forward?); patch with layers=False")
        return h


def _project_add(proj: nn.Module, x: Tensor, residual: Tensor, counters: Tensor | None) -> Tensor:
    """``residual + proj(x)`` for the layer's O or down projection. A row-parallel projection
    (:class:`PartialSumLinear`) whose sum adds the residual (``sums_residual``) gets it there:
    every rank's GEMM adds nothing but the one rank's bias. Otherwise the residual goes into
    the epilogue of the one rank's GEMM that adds the bias and the other ranks' GEMMs add
    nothing. Either way the sum over the ranks holds the residual and the bias once each, and
    no separate add runs."""
    if isinstance(proj, PartialSumLinear):
        if proj.sums_residual:
            part = linear_residual(x, proj.weight, proj.bias if proj.adds_bias else None, None, counters)
            return proj.sum_parts_residual(part, residual)
        if proj.adds_bias:
            return proj.sum_parts(linear_residual(x, proj.weight, proj.bias, residual, counters))
        return proj.sum_parts(linear_residual(x, proj.weight, None, None, counters))
    return linear_residual(x, proj.weight, proj.bias, residual, counters)


def _tensors(layer: nn.Module) -> list:
    """Every parameter the fused forward reads (its norms, QKV, O, gate/up, down)."""
    attn, mlp = layer.self_attn, layer.mlp
    mods = (layer.input_layernorm, layer.post_attention_layernorm, attn._modules[QKV_NAME], attn.o_proj,
            mlp._modules[FUSED_GATE_UP], mlp.down_proj)
    return [t for m in mods for t in (m.weight, getattr(m, "bias", None)) if t is not None]


def _takes_fused_path(layer: nn.Module, x) -> bool:
    compiling = torch.compiler.is_compiling()
    if not compiling and type(x) not in _PLAIN:
        return False
    if x.dtype not in _LAYER_DTYPES or x.dim() < 2 or not _on_kernel_device(x):
        return False
    k = x.shape[-1]
    if not k or x.numel() // k > DECODE_ROWS:
        return False
    if torch.is_autocast_enabled(x.device.type) or get_mode() != DEFAULT:
        return False
    params = _tensors(layer)
    if any(t.dtype != x.dtype for t in params):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in params)):
        return False
    mlp = layer.mlp
    return not (da.hooked(layer.input_layernorm) or da.hooked(layer.post_attention_layernorm) or da.hooked(mlp)
                or da.hooked(mlp.down_proj) or _global_hooks())


def _global_hooks() -> bool:
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


_FUSED_CLASSES: dict[type, type] = {}


def fused_class(cls: type) -> type:
    """The class a recognised layer of class ``cls`` gets: :class:`HybridDecoderLayer` mixed in,
    still an instance of ``cls`` and named like it (what name-based checks such as a model's
    ``_no_split_modules`` read). Pickled as ``hybridgemm.models.decoder_layer.<name>``, which this
    module resolves (:func:`__getattr__`)."""
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        fused = _FUSED_CLASSES[cls] = type(cls.__name__, (HybridDecoderLayer, cls),
                                           {"__module__": __name__, "__qualname__": cls.__name__})
        globals()[cls.__name__] = fused
    return fused


def __getattr__(name: str):
    # A pickled patched model names its layers' class hybridgemm.models.decoder_layer.<name>: rebuild it
    # from transformers' class of that name.
    family = LAYER_MODULES.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    stock = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    return fused_class(stock)


def _fusable_projection(proj) -> bool:
    """An O or down projection the fused forward computes: patched, or row-parallel."""
    return type(proj) is HybridLinear or isinstance(proj, PartialSumLinear)


def why_not_fuse_layer(mod: nn.Module) -> str | None:
    """Why the decoder layer ``mod`` cannot be fused (None: it can); raises nothing. A module
    that is no recognised decoder layer gives :data:`NOT_A_LAYER`."""
    t = type(mod)
    if t.__name__ not in LAYER_CLASSES or not t.__module__.startswith("transformers"):
        return NOT_A_LAYER
    attn, mlp = mod._modules.get("self_attn"), mod._modules.get("mlp")
    norms = [mod._modules.get(n) for n in ("input_layernorm", "post_attention_layernorm")]
    if attn is None or not isinstance(attn._modules.get(QKV_NAME), FusedLinears):
        return "its Q/K/V are not fused into one GEMM"
    if not _fusable_projection(attn._modules.get("o_proj")):
        return f"its o_proj is a {type(attn._modules.get('o_proj')).__name__}, not a patched or row-parallel nn.Linear"
    if type(mlp) is not HybridGatedMLP or not isinstance(mlp._modules.get(FUSED_GATE_UP), FusedLinears):
        return "its MLP's gate/up are not fused into one GEMM"
    if not _fusable_projection(mlp._modules.get("down_proj")):
        return (f"its down_proj is a {type(mlp._modules.get('down_proj')).__name__}, not a patched or row-parallel "
                "nn.Linear")
    if not all(type(n) is HybridRMSNorm for n in norms):
        return "its norms are not Llama-style RMSNorms"
    layer_src, attn_src = da.source_text(t.forward), da.source_text(type(attn).forward)
    if layer_src is None or not all(s in layer_src for s in _LAYER_STATEMENTS) \
            or layer_src.count("hidden_states=residual+hidden_states") != 2:
        return f"{t.__name__}.forward is not the pre-norm layer this transformers version was checked against"
    if attn_src is None or not all(s in attn_src for s in _ATTENTION_STATEMENTS):
        return f"{type(attn).__name__}.forward does not end with o_proj as expected"
    return None


__all__ = ["DECODE_ROWS", "LAYER_CLASSES", "NOT_A_LAYER", "HybridDecoderLayer", "ResidualLinear", "fused_class",
           "gated_norm", "linear_residual", "norm_linear", "why_not_fuse_layer"]
