"""The MLP half of :func:`hybridgemm.patch`, and :func:`gated_linear`.

Found by module structure, never by model name (``transformers`` is never imported here):

* **Gated MLPs** (Llama, Qwen2, Mistral, Gemma, ...): a module with exact ``nn.Linear``
  children ``gate_proj`` and ``up_proj`` reading the same input, a ``down_proj`` child and an
  ``act_fn`` that is SiLU (SwiGLU) or a GELU (GeGLU). gate and up are fused into one GEMM
  (``gate_up_proj``, fusion/fused_rows.py: stock state-dict keys, ties respected) and the
  module's class becomes :class:`HybridGatedMLP`, whose forward is
  ``down_proj(gated_linear(x, gate_up_proj.weight, gate_up_proj.bias, act))``;
  ``down_proj`` (if a plain ``nn.Linear``) becomes a :class:`~hybridgemm.HybridLinear`.
* **Gated MLPs whose gate and up are one linear already** (Phi-3's ``gate_up_proj``):
  :class:`HybridPrefusedGatedMLP`, the same gated product over that weight as it is.
* **Bias + GELU MLPs** through the fused bias + activation epilogues (GPT-NeoX's and Falcon's
  ``dense_h_to_4h``/``dense_4h_to_h`` too, :class:`HybridTwoLayerMLP`): GPT-2's ``c_fc``/``c_proj``
  (transformers' ``Conv1D``) with ``act``; BERT's ``intermediate.dense`` with
  ``intermediate_act_fn`` and its sibling ``output.dense``. The activation moves into the first
  GEMM's epilogue and the module's class becomes one whose forward does not apply it again (a
  LoRA layer later put over that linear gets the activation module after it, as stock).

An activation module that is not recognised (an unknown class, a custom function), or a
forward that computes more than these classes do (fusion/models/mlp_forms.py: a scale, a clamp,
a dropout, a norm), leaves the MLP's forward alone, with the reason in the report: fusing must
compute what the module computed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgemm.kernels.checks import PLAIN_TENSOR_TYPES as _PLAIN
from hybridgemm.kernels.epilogue import GLU_ACTIVATIONS
from hybridgemm.kernels.fp8 import FP8Weight
from hybridgemm.kernels.lazy import triton_module

from .decide import choose_gated
from .fp8_linear import linear_fp8, linear_fp8_glu
from .fp8_modules import FP8HybridLinear, weight_scale_of
from .fused_rows import FusedSlice, stock_slot
from .linear_layer import HybridLinear, linear

GATED_NAMES = ("gate_proj", "up_proj")
FUSED_GATE_UP = "gate_up_proj"

GLU_FUNCTIONS = GLU_ACTIVATIONS  # what each gated activation applies to the gate half


def activation_name(act) -> str | None:
    """The epilogue name of an activation module ("silu", "gelu_tanh", "gelu", "relu"), or None
    when it is not one whose math is known exactly."""
    t = type(act)
    name, from_hf = t.__name__, t.__module__.startswith("transformers")
    if t is nn.SiLU or (from_hf and name == "SiLUActivation"):
        return "silu"
    if t is nn.ReLU:
        return "relu"
    if t is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if from_hf and name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"):
        return "gelu_tanh"  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the tanh form
    if from_hf and name == "FastGELUActivation":
        # ("gelu_fast", GPT-NeoX-20B's) the same function, its argument factored as x c (1 +
        # 0.044715 x^2), c = 0.7978845608 (sqrt(2/pi) to 4e-12 relative): equal up to each op's
        # rounding, as NewGELUActivation's Python form is
        return "gelu_tanh"
    if from_hf and name == "GELUActivation":
        return "gelu"  # erf form, whether through F.gelu or transformers' Python copy of it
    return None


KERNELS = ("auto", "halves", "gemm", "triton")


def _triton_glu():
    return triton_module("triton_glu")  # on first use: importing hybridgemm needs no Triton


@torch.library.custom_op("hybridgemm::gated_fwd", mutates_args=())
def gated_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, tuned: bool = True) -> Tensor:
    """The Triton gated kernel as an opaque op (torch.compile; inference only, no autograd).
    ``tuned``: decided when it runs (the table's gated entry: its config, or the halves where
    the entry keeps the stock pair); else the kernel with its default config."""
    if not tuned:
        return _triton_glu().glu(x, weight, bias, activation)
    choice = choose_gated(x, weight, bias)
    if choice.backend != "triton_glu":
        return _halves(x, weight, bias, GLU_FUNCTIONS[activation])
    return _triton_glu().glu(x, weight, bias, activation, config=choice.config)


@gated_fwd.register_fake
def _gated_fwd_fake(x, weight, bias, activation, tuned=True):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def _halves(x: Tensor, weight: Tensor, bias: Tensor | None, fn) -> Tensor:
    """``fn(x @ Wg.T + bg) * (x @ Wu.T + bu)`` by two dispatched GEMMs over views of the stacked weight."""
    inter = weight.shape[0] // 2
    bg, bu = (None, None) if bias is None else (bias[:inter], bias[inter:])
    return fn(linear(x, weight[:inter], bg)) * linear(x, weight[inter:], bu)


def gated_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "silu", *,
                 kernel: str = "auto") -> Tensor:
    """``act(x @ Wg.T + bg) * (x @ Wu.T + bu)`` where ``weight`` = ``cat([Wg, Wu])`` (2I, K) and
    ``bias`` = ``cat([bg, bu])`` (2I,) or None; ``activation``: "silu" (SwiGLU), "gelu_tanh" or
    "gelu" (GeGLU). Returns (..., I).

    ``kernel="halves"``: the gate and the up GEMM (views of the stacked weight) through
    :func:`hybridgemm.linear` (dispatcher, autograd, torch.compile), then the activation and the
    product in x's dtype, as the stock modules compute them. ``"gemm"``: the same with one GEMM
    over the stacked weight. ``"triton"``: kernels/triton_glu.py, the product in the GEMM's
    epilogue (fp32 until the one rounding; CUDA, no autograd). ``"auto"``: the Triton kernel
    where the dispatcher's gated decision picks it (:func:`hybridgemm.decide.choose_gated`: the
    table's gated entry at decode rows, with its config; else CUDA fp16/bf16 inference at M ≤ 64
    in the default dispatch mode), else the halves. (On the H200 at
    Llama-3-8B's sizes, M = 333 and 2048, with F.linear's kernels under both, one GEMM over the
    stacked weight ran at 0.87-0.88x of the stock pair and the halves at 1.00-1.01x;
    perf/results/h200/mlp_h200.csv.)
    """
    fn = GLU_FUNCTIONS.get(activation)
    if fn is None:
        raise ValueError(f"hybridgemm.gated_linear: activation must be one of {', '.join(GLU_FUNCTIONS)}, "
                         f"got {activation!r}")
    if kernel not in KERNELS:
        raise ValueError(f"hybridgemm.gated_linear: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if isinstance(weight, FP8Weight):  # one GEMM over the stacked e4m3 rows, the product apart
        if weight.shape[0] % 2:
            raise ValueError(f"hybridgemm.gated_linear: weight must have 2I rows, got {tuple(weight.shape)}")
        gate, up = linear(x, weight, bias).chunk(2, dim=-1)
        return fn(gate) * up
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] % 2:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError("hybridgemm.gated_linear: weight must be 2-D (2I, K), the gate rows stacked over the up "
                         f"rows, got {shape}")
    # Traced by torch.compile: the rules alone; the op reads the table when it runs
    compiling = torch.compiler.is_compiling()
    choice = choose_gated(x, weight, bias, tuned=not compiling) if kernel == "auto" and isinstance(x, Tensor) \
        else None
    if kernel == "triton" or (choice is not None and choice.backend == "triton_glu"):
        if compiling or not (type(x) in _PLAIN and type(weight) in _PLAIN):
            return torch.ops.hybridgemm.gated_fwd(x, weight, bias, activation, kernel == "auto")
        return _triton_glu().glu(x, weight, bias, activation, config=None if choice is None else choice.config)
    if kernel == "gemm":
        gate, up = linear(x, weight, bias).chunk(2, dim=-1)
        return fn(gate) * up
    return _halves(x, weight, bias, fn)


# Instance attribute of a patched gated MLP whose stock forward ends in a dropout of its
# ``residual_dropout`` (Seed-OSS's; patch sets it): its forward applies that dropout too
OUTPUT_DROPOUT = "_hybridgemm_output_dropout"


class HybridGatedMLP(nn.Module):
    """Stands in for a gated MLP module (its class is swapped in place; every attribute stays):
    one GEMM for gate and up, the gated product, then ``down_proj`` (then, where patch set
    :data:`OUTPUT_DROPOUT`, the module's dropout of ``residual_dropout``, as its forward had it)."""

    glu_activation = "silu"

    def forward(self, x: Tensor) -> Tensor:
        y = self._gated_down(x)
        if self.training and OUTPUT_DROPOUT in self.__dict__:
            y = F.dropout(y, p=self.residual_dropout, training=True)
        return y

    def _gated_down(self, x: Tensor) -> Tensor:
        fused = self._modules[FUSED_GATE_UP]
        gate, up = (self._modules[n] for n in GATED_NAMES)
        if not (type(gate) is type(up) is FusedSlice):
            # gate_proj/up_proj wrapped since patching (a LoRA adapter, say): call them, so what
            # wraps them runs; their bases still share the one gate/up GEMM (fusion/fused_rows.py)
            return self.down_proj(GLU_FUNCTIONS[self.glu_activation](gate(x)) * up(x))
        if "weight_scale" in fused._buffers:  # an FP8 gate/up (fusion/fp8_modules.py): one GEMM, the product apart
            down = self._modules["down_proj"]
            if type(down) is FP8HybridLinear and not _hooked(down) and not _hooked(fused):
                # down's input quantized for the FP8 tensor cores: the product formed on the way
                return linear_fp8_glu(fused.stacked_output(x), down.weight, weight_scale_of(down), down.bias,
                                      self.glu_activation, bool(down.fp8_activations), down.activation)
            gate, up = fused(x)
            return self.down_proj(GLU_FUNCTIONS[self.glu_activation](gate) * up)
        return self.down_proj(gated_linear(x, fused.weight, fused.bias, self.glu_activation))


class HybridPrefusedGatedMLP(nn.Module):
    """Stands in for a gated MLP whose model stacks gate and up in one linear already (Phi-3's
    ``gate_up_proj``, rows ``[gate; up]``, ``activation_fn``): the gated product by
    :func:`gated_linear` over that weight as it is, then ``down_proj``. ``gate_up_proj`` is a
    :class:`~hybridgemm.HybridLinear` (what runs it when something wraps or hooks it)."""

    glu_activation = "silu"

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self._modules[FUSED_GATE_UP]
        if type(gate_up) is not HybridLinear or _hooked(gate_up):
            # wrapped, replaced or hooked since patching: the module's own computation, calling it
            gate, up = gate_up(x).chunk(2, dim=-1)
            return self.down_proj(up * self.activation_fn(gate))
        return self.down_proj(gated_linear(x, gate_up.weight, gate_up.bias, self.glu_activation))


class ActivatedGemm(NamedTuple):
    """The tensors of ``act(child(x))`` as one GEMM with the activation in its epilogue: what
    :func:`run_activated` launches (an FP8 child's e4m3 weight with its ``scale``)."""

    weight: Tensor
    bias: Tensor | None
    activation: str
    scale: Tensor | None
    fp8_activations: bool


def activated_gemm(owner: nn.Module, child: str, act: str | None) -> ActivatedGemm | None:
    """The GEMM of ``act(owner.<child>(x))`` where the child is the unhooked
    :class:`~hybridgemm.HybridLinear` patch made (or its FP8 form) and ``act`` an epilogue
    activation; None for anything else in the slot (called as a module by :func:`activated`)."""
    lin = owner._modules[child]
    if act is None or _hooked(lin):
        return None
    if type(lin) is HybridLinear:
        return ActivatedGemm(lin.weight, lin.bias, act, None, False)
    if type(lin) is FP8HybridLinear:
        return ActivatedGemm(lin.weight, lin.bias, act, weight_scale_of(lin), bool(lin.fp8_activations))
    return None


def run_activated(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, scale: Tensor | None,
                  fp8_activations: bool) -> Tensor:
    """``act(x @ weight.T + bias)`` of an :class:`ActivatedGemm`'s tensors."""
    if scale is None:
        return linear(x, weight, bias, activation)
    return linear_fp8(x, weight, scale, bias, activation, fp8_activations)


def activated(owner: nn.Module, child: str, act: str, act_module: nn.Module, x: Tensor) -> Tensor:
    """``act_module(owner.<child>(x))`` with the activation (named ``act``) in the GEMM's epilogue
    where the child is the :class:`~hybridgemm.HybridLinear` patch made (or its FP8 form),
    unhooked (:func:`activated_gemm`); anything else in the slot (a LoRA layer over it, whose
    term goes in before the activation as in the stock module; a hooked or replaced module) is
    called as a module, then the activation module."""
    gemm = activated_gemm(owner, child, act)
    if gemm is None:
        return act_module(owner._modules[child](x))
    return run_activated(x, *gemm)


class HybridTwoLayerMLP(nn.Module):
    """Stands in for GPT-NeoX's and Falcon's MLP (``dense_h_to_4h``, ``act``, ``dense_4h_to_h``):
    ``dense_h_to_4h``'s GEMM carries the activation (``activation``, set when patched) in its
    epilogue (:func:`activated`)."""

    activation: str | None = None

    def up(self, x: Tensor) -> Tensor:
        """``act(dense_h_to_4h(x))``."""
        return activated(self, "dense_h_to_4h", self.activation, self.act, x)

    def forward(self, x: Tensor) -> Tensor:
        return self.dense_4h_to_h(self.up(x))


def _hooked(mod: nn.Module) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks) or "forward" in mod.__dict__


def plain_linear(mod) -> bool:
    """An ``nn.Linear``, or a subclass of transformers' that computes what it computes (Falcon's
    ``FalconLinear``: ``x @ W.T + b``)."""
    t = type(mod)
    return t is nn.Linear or (t.__name__ == "FalconLinear" and t.__module__.startswith("transformers")
                              and t.__bases__ == (nn.Linear,))


def prefused_gated_parts(mod: nn.Module) -> tuple[nn.Module | None, str | None, str | None]:
    """(``gate_up_proj``, activation, reason not to patch) for an MLP whose gate and up are one
    linear already (Phi-3); ``(None, None, None)`` when ``mod`` is not one."""
    gate_up, down = mod._modules.get(FUSED_GATE_UP), mod._modules.get("down_proj")
    act_fn = getattr(mod, "activation_fn", None)
    if gate_up is None or down is None or not isinstance(act_fn, nn.Module) or "gate_proj" in mod._modules:
        return None, None, None
    if type(gate_up) is not nn.Linear:
        return None, None, f"gate_up_proj is {type(gate_up).__name__}, not a plain nn.Linear"
    act = activation_name(act_fn)
    if act not in GLU_FUNCTIONS:
        return None, None, f"gated MLP with activation_fn {type(act_fn).__name__}: only SiLU and GELU are fused"
    if gate_up.out_features % 2:
        return None, None, f"gate_up_proj has an odd number of rows ({gate_up.out_features})"
    return gate_up, act, None


def two_layer_act(mod: nn.Module) -> tuple[str | None, str | None]:
    """(activation, reason not to) for a GPT-NeoX/Falcon-style MLP (``dense_h_to_4h``, ``act``,
    ``dense_4h_to_h``); (None, None) for anything else."""
    up, down, act = (mod._modules.get("dense_h_to_4h"), mod._modules.get("dense_4h_to_h"),
                     getattr(mod, "act", None))
    if up is None or down is None or not isinstance(act, nn.Module):
        return None, None
    if not (plain_linear(up) and plain_linear(down)):
        return None, f"dense_h_to_4h/dense_4h_to_h are {type(up).__name__}, {type(down).__name__}, not plain linears"
    name = activation_name(act)
    if name not in ("gelu", "gelu_tanh", "relu"):
        return None, f"act {type(act).__name__} has no fused epilogue"
    return name, None


class HybridIntermediate(nn.Module):
    """Stands in for BERT's intermediate module: ``dense``'s GEMM carries the activation
    (``activation``, set when patched) in its epilogue (:func:`activated`)."""

    activation: str | None = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        return activated(self, "dense", self.activation, self.intermediate_act_fn, hidden_states)


class HybridConvMLP(nn.Module):
    """Stands in for GPT-2's MLP: ``c_fc`` carries the activation in its epilogue."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.c_fc(hidden_states)))


def gated_parts(mod: nn.Module) -> tuple[list, str | None, str | None]:
    """(``[gate_proj, up_proj]``, activation, reason not to patch) for a gated MLP; ``([], None,
    None)`` when ``mod`` is not one. Of a linear an adapter wraps, the wrapped one
    (fusion/fused_rows.py, ``stock_slot``)."""
    lins = [stock_slot(mod, n)[1] for n in GATED_NAMES]
    if any(lin is None for lin in lins) or mod._modules.get("down_proj") is None:
        return [], None, None
    if not all(type(lin) is nn.Linear for lin in lins):
        return [], None, "gate_proj/up_proj are " + ", ".join(type(lin).__name__ for lin in lins) + \
            ", not plain nn.Linear"
    act_fn = getattr(mod, "act_fn", None)
    act = activation_name(act_fn) if isinstance(act_fn, nn.Module) else None
    if act not in GLU_FUNCTIONS:
        return [], None, f"gated MLP with act_fn {type(act_fn).__name__}: only SiLU and GELU are fused"
    if lins[0].out_features != lins[1].out_features:
        return [], None, "gate_proj and up_proj have different out_features"
    return lins, act, None


def intermediate_act(mod: nn.Module) -> tuple[str | None, str | None]:
    """(activation, reason not to) for a BERT-style intermediate module (``dense`` +
    ``intermediate_act_fn``); (None, None) for anything else."""
    dense, act_fn = mod._modules.get("dense"), getattr(mod, "intermediate_act_fn", None)
    if dense is None or act_fn is None:
        return None, None
    if type(dense) is not nn.Linear:
        return None, f"dense is {type(dense).__name__}, not a plain nn.Linear"
    act = activation_name(act_fn) if isinstance(act_fn, nn.Module) else None
    if act not in ("gelu", "gelu_tanh", "relu"):
        return None, f"intermediate_act_fn {type(act_fn).__name__} has no fused epilogue"
    return act, None


def conv_mlp_act(mod: nn.Module, is_conv1d) -> tuple[str | None, str | None]:
    """(activation, reason not to) for a GPT-2-style MLP (``c_fc``/``c_proj`` Conv1D, ``act``,
    ``dropout``); (None, None) for anything else."""
    c_fc, c_proj = mod._modules.get("c_fc"), mod._modules.get("c_proj")
    if c_fc is None or c_proj is None or not (is_conv1d(c_fc) and is_conv1d(c_proj)):
        return None, None
    if mod._modules.get("dropout") is None:
        return None, "GPT-2-style MLP without a dropout module"
    act = activation_name(getattr(mod, "act", None))
    if act not in ("gelu", "gelu_tanh", "relu"):
        return None, f"act {type(getattr(mod, 'act', None)).__name__} has no fused epilogue"
    return act, None


LM_HEAD_NAMES = ("lm_head", "embed_out")  # embed_out: GPT-NeoX's


def is_lm_head(name: str, mod: nn.Module) -> bool:
    return name.rpartition(".")[2] in LM_HEAD_NAMES and type(mod) is nn.Linear


__all__ = ["GLU_FUNCTIONS", "HybridConvMLP", "HybridGatedMLP", "HybridIntermediate", "HybridPrefusedGatedMLP",
           "HybridTwoLayerMLP", "activation_name", "gated_linear", "plain_linear", "prefused_gated_parts",
           "two_layer_act"]
