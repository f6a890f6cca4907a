"""``hybridgemm.patch(model)``: run a model's projections through hybridgemm — the attention
projections, the MLPs (fusion/mlp.py) and the LM head, each switchable;
``hybridgemm.unpatch(model)``: put the original modules back.

What is patched (found by structure, never by model name, so any architecture with the
same layout is covered; ``transformers`` is never imported here):

* a module with exact ``nn.Linear`` children ``q_proj/k_proj/v_proj`` (Llama, Qwen2,
  Mistral, ...) or ``query/key/value`` (BERT, ViT, ...): Q, K and V are *fused* into one
  GEMM (``qkv_proj``); the output projection (``o_proj``/``out_proj`` child, or BERT/ViT's
  sibling ``output.dense``) becomes a :class:`~hybridgemm.HybridLinear`.
* a module whose Q/K/V are one linear already (``qkv_proj``, ``query_key_value``, ``Wqkv``:
  Phi-3, GPT-NeoX, Falcon) with an output linear (``o_proj``, ``dense``, ``out_proj``): both
  become :class:`~hybridgemm.HybridLinear` as they are (their row layout is the model's).
* GPT-2 style ``c_attn``/``c_proj`` (transformers' ``Conv1D``, ``x @ W + b`` with W stored
  (in, out)): each becomes a :class:`HybridConv1D`. ``c_attn`` is already one fused QKV GEMM.
* ``nn.MultiheadAttention``: becomes :class:`~hybridgemm.attention.HybridMultiheadAttention`.
* gated MLPs (gate/up fused into ``gate_up_proj``, the gated product by
  :func:`hybridgemm.gated_linear`), GPT-2 and BERT MLPs (GELU in the first GEMM's epilogue):
  see fusion/mlp.py.
* an ``nn.Linear`` named ``lm_head``: becomes a :class:`~hybridgemm.HybridLinear` (the same
  object and parameters, so a head tied to the embedding stays tied).
* transformers' Llama-style RMSNorm modules: one Triton launch in eager inference
  (fusion/norm.py; recognised by class, since the formula is not visible in the structure).
* transformers' Llama, Qwen2, Qwen3, Mistral and Granite decoder layers whose parts were all
  patched: at decode sizes their RMSNorms and residual adds run inside the GEMMs
  (fusion/models/decoder_layer.py); Qwen2-MoE, Qwen3-MoE and Mixtral layers the same for their
  attention, then their sparse block as it is.
* transformers' stacked mixture-of-experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE: weights
  ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]): the routed experts in the MoE
  kernels (fusion/experts.py, the tuning table's configs; FP8 experts: fusion/fp8_experts.py);
  their softmax-top-k routers (the form checked by running each once at patch time,
  fusion/router.py): the router's GEMM by the dispatcher, the routing in one kernel launch.

How several linears are fused without re-implementing any forward (:class:`QKVSlice` modules
standing where the linears stood, backed by one :class:`FusedQKV`; one GEMM per input, each
part handed out once): fusion/fused_rows.py. Cross-attention modules are not fused (their K/V
read another input), only their linears are swapped.

Parameters. ``HybridLinear``/``HybridMultiheadAttention`` are the *same* module objects
with their class swapped: parameters, state-dict keys, optimizer state all unchanged.
Fused Q/K/V (gate/up alike): the slices keep the replaced linears' parameter objects, so
``named_parameters()``, ``get_parameter``, freezing by name and an optimizer built before
patching see the stock parameters; each became a view of its rows of one stacked tensor
that the GEMM reads (no second copy of the weights), and on unpatch it gets storage of its
own with its current (possibly trained, moved or cast) values.

Checkpoints. A patched model's ``state_dict()`` has the stock keys, in the stock order, with
the stock values, so ``save_pretrained``/``torch.save`` write a stock checkpoint and a stock
checkpoint loads into a patched model. Saving: each :class:`QKVSlice` writes copies of its
parameters (tensors of their own, as safetensors' ``save_model`` requires) and
:class:`FusedQKV` writes nothing. Loading copies each stock entry into its rows (with
``assign=True`` too: the parameter objects stay), so ``strict`` and missing/unexpected/
size-mismatch reports behave as they do for the stock module; a state dict with ``qkv_proj``
keys loads too.
:class:`HybridConv1D`'s state dict holds a contiguous copy of its weight (the
parameter is stored transposed while patched; safetensors refuses non-contiguous tensors).

Adapters and names. A linear that an adapter layer wraps (PEFT's LoRA: ``q_proj.base_layer``)
is patched under it, fused with its siblings, and the adapter runs on top; adapters attached
after patching wrap the slices the same way (fusion/fused_rows.py). A fused decoder layer
adds the terms of PEFT LoRA layers over its projections inside its decode step
(fusion/models/adapter_terms.py); with any other adapter it keeps its own forward (the report
says so). A ``resize_token_embeddings`` of transformers' models
patches the new LM head too (fusion/models/embeddings.py).

Tied weights. Fusing moves Q, K and V into the rows of one stacked tensor, which would
untie weights that are shared. So Q/K/V are not fused (each linear is swapped on its own, which keeps
every parameter object, hence every tie; the report says why) when one of the q/k/v linears,
or one of their parameters, is registered in more than one place under the patched root
(``k_proj is q_proj``, ``k_proj.weight is q_proj.weight``, a weight shared with another layer).
A tie to a module outside the patched root cannot be seen: patch the model that holds both.

Bookkeeping. Each change is recorded on the module it changed (the swapped module, or the
attention module whose children were replaced), so :func:`unpatch` of any module undoes
every patch applied anywhere under it, whichever module ``patch`` was called on, most
recent first. Patching an already patched module changes nothing (the report lists it in
``already_patched``). TorchScript modules (``torch.jit.script``/``trace``) are compiled
code that cannot be changed in place: ``patch`` refuses one, and skips one found inside an
eager model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from hybridgemm.attention import HybridMultiheadAttention
from hybridgemm.experts import HybridExperts, why_not_experts
from hybridgemm.fp8_experts import (
    HybridFP8Experts,
    adopt_checkpoint_experts,
    quantize_patched_experts,
    static_activation_scales,
    why_not_fp8_experts,
)
from hybridgemm.fp8_modules import FP8FusedLinears, FP8HybridLinear, is_fp8, quantize_patched
from hybridgemm.fused_rows import SEQ as _SEQ
from hybridgemm.fused_rows import UNDO_ATTR as _UNDO_ATTR
from hybridgemm.fused_rows import (
    FusedLinears,
    FusedSlice,
    fuse,
    qual,
    record,
    records,
    restored_class,
    stock_slot,
    unfuse,
    why_not_fuse,
)
from hybridgemm.kernels.fp8 import GRANULARITIES
from hybridgemm.linear_layer import HybridLinear, linear
from hybridgemm.mlp import (
    FUSED_GATE_UP,
    GATED_NAMES,
    OUTPUT_DROPOUT,
    HybridConvMLP,
    HybridGatedMLP,
    HybridIntermediate,
    HybridPrefusedGatedMLP,
    HybridTwoLayerMLP,
    conv_mlp_act,
    gated_parts,
    intermediate_act,
    is_lm_head,
    plain_linear,
    prefused_gated_parts,
    two_layer_act,
)
from hybridgemm.norm import (
    HybridGemmaRMSNorm,
    HybridOlmo2RMSNorm,
    HybridRMSNorm,
    is_gemma_norm,
    is_olmo2_norm,
    is_rms_norm,
)
from hybridgemm.router import HybridSigmoidRouter, HybridTopKRouter, SigmoidRouterForm, why_not_router

from . import layernorm_layers, mlp_forms
from .attention_forms import why_not_fuse_attention
from .decode_checks import (
    NORMS_AS_MODULES,
    NOT_A_LAYER,
    PARTS_SEEN,
    POST_NORMS,
    SCALED_RESIDUALS,
    STATIC_STEP,
    moe_block,
    norm_modules_form,
    normalises_outputs,
    scales_residuals,
)
from .decoder_layer import COUNTERS, HybridDecoderLayer, attention_of, fused_class, new_counters, why_not_fuse_layer
from .embeddings import RESIZE, ResizeKeepingHead, output_embeddings, resizes_embeddings
from .fp8_checkpoints import adopt as adopt_fp8_checkpoint
from .fp8_checkpoints import prepare as prepare_fp8_checkpoint
from .moe_block import FUSED_BLOCK, why_not_fuse_block
from .unpatched import unpatched

# The report's reason for a fused decoder layer whose attention runs the module's own function
# (over the fused Q/K/V) instead of the static-cache step, followed by why.
ATTENTION_NOT_FUSED = "attention step not fused"
_QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
_OUT_NAMES = ("o_proj", "out_proj")
_FUSED_NAME = "qkv_proj"
_PREFUSED_QKV = ("qkv_proj", "query_key_value", "Wqkv")

# The fused Q/K/V module and the modules standing where q_proj/k_proj/v_proj stood.
FusedQKV = FusedLinears
QKVSlice = FusedSlice


@dataclass
class PatchReport:
    """What :func:`patch` did: ``patched`` lists every module name it changed (an attention
    module whose Q/K/V were fused is listed once, also in ``fused_qkv``); ``already_patched``
    lists what an earlier :func:`patch` had changed (left as it is).

    ``skipped`` holds ``(name, reason)`` for every module left as it was, or not fused, that a
    user would expect to be sped up: the modules the patching rules found but could not patch
    or fuse (projections that are not plain ``nn.Linear``, ties, activations without an
    epilogue, TorchScript, decoder layers or attention steps of a supported family that could
    not be fused), then, in each decoder layer (a module holding a causal attention), the layer
    where it does not run the fused decode step, its attention, MLP and mixture-of-experts
    modules whose projections were not patched, its norms that are not Llama-style RMSNorms
    hybridgemm recognises, and any other linear left alone; and an ``lm_head`` left alone
    (fusion/models/unpatched.py gives the rules). Parts switched off by ``patch``'s arguments,
    and embeddings, rotary embeddings, dropout and activations, are not listed.
    ``patch(strict=True)`` raises where this list is not empty."""

    patched: list[str] = field(default_factory=list)
    fused_qkv: list[str] = field(default_factory=list)
    fused_mlp: list[str] = field(default_factory=list)
    fused_layers: list[str] = field(default_factory=list)
    fused_attention: list[str] = field(default_factory=list)  # layers whose attention runs the fused step
    # mixture-of-experts blocks whose layer adds their output in the experts' down launch
    # (fusion/models/moe_block.py; a block with more than a router and experts keeps the module call)
    fused_moe: list[str] = field(default_factory=list)
    fp8: list[str] = field(default_factory=list)  # projections whose weights were quantized (weights="fp8")
    skipped: list[tuple[str, str]] = field(default_factory=list)
    already_patched: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.patched)

    def skipped_lines(self) -> list[str]:
        """``name: reason`` for each entry of ``skipped``."""
        return [f"{n or '(root)'}: {r}" for n, r in self.skipped]

    def summary(self) -> str:
        if not self.patched:
            why = self.skipped_lines()
            if self.already_patched:
                shown = ", ".join(self.already_patched[:4]) + (", ..." if len(self.already_patched) > 4 else "")
                why.append(f"{len(self.already_patched)} modules already patched by an earlier hybridgemm.patch "
                           f"({shown}); call hybridgemm.unpatch first to patch them again")
            return f"hybridgemm.patch: nothing patched ({'; '.join(why) or 'no attention projections found'})"
        return (f"hybridgemm.patch: patched {len(self.patched)} modules ({len(self.fused_qkv)} with fused QKV, "
                f"{len(self.fused_mlp)} with fused gate/up, {len(self.fused_layers)} decoder layers with fused "
                f"norms and residuals, {len(self.fused_attention)} with rotary and KV-cache writes fused"
                + (f", {len(self.fused_moe)} MoE blocks with the residual in the experts' launch" if self.fused_moe
                   else "") + ")"
                + (f", skipped {len(self.skipped)}" if self.skipped else "")
                + (f", {len(self.already_patched)} already patched" if self.already_patched else ""))


class HybridConv1D(nn.Module):
    """Stand-in for transformers' ``Conv1D`` (``y = x @ W + b``, W stored (in, out)) with the
    same ``weight``/``bias`` parameters. While patched, W is stored transposed in memory
    (same shape and values, strides ``(1, in)``) so that ``W.T`` is a row-major (out, in)
    matrix the GEMM reads without a copy; unpatch makes it contiguous again."""

    activation: str | None = None  # fused into the epilogue (GPT-2's c_fc: its GELU)

    def __init__(self, conv: nn.Module, activation: str | None = None):
        super().__init__()
        self.activation = activation
        self.nf, self.nx = conv.weight.shape[1], conv.weight.shape[0]
        self.weight = conv.weight
        self.bias = conv.bias
        self.store_transposed()

    def store_transposed(self) -> None:
        """Give W the (in, out)-shaped, transposed-in-memory layout (a copy unless it has it)."""
        if self.weight.dim() == 2 and not self.weight.t().is_contiguous():
            self.weight.data = self.weight.data.t().contiguous().t()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:  # the stock layout: safetensors and .view() need a contiguous tensor
            destination[prefix + "weight"] = self.weight.detach().contiguous()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.store_transposed()  # assign=True puts the checkpoint's (contiguous) tensor in place

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight.t(), self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}" + (f", activation={self.activation}" if self.activation else "")


def _is_conv1d(m: nn.Module) -> bool:
    t = type(m)
    return t.__name__ == "Conv1D" and t.__module__.startswith("transformers") and \
        isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2


def _get(m: nn.Module, name: str):
    return m._modules.get(name)


def _check_module(model, who: str) -> None:
    """TypeError unless ``model`` is an initialised eager ``nn.Module``."""
    if isinstance(model, torch.jit.ScriptModule):
        if who.endswith("unpatch"):
            raise TypeError(f"{who}: got a TorchScript module ({type(model).__name__}); hybridgemm.patch never "
                            "patches one, so there is nothing to undo: unpatch the eager nn.Module it was made from")
        raise TypeError(f"{who}: got a TorchScript module ({type(model).__name__}, made by torch.jit.script or "
                        "torch.jit.trace); its forward is compiled TorchScript, which cannot be patched in place. "
                        "Patch the eager nn.Module instead (a patched model runs under torch.compile)")
    if not isinstance(model, nn.Module):
        if isinstance(model, type) and issubclass(model, nn.Module):
            got = f"the class {model.__name__} (pass an instance)"
        else:
            got = "None" if model is None else type(model).__name__
        raise TypeError(f"{who}: expected an nn.Module, got {got}")
    if not isinstance(model.__dict__.get("_modules"), dict):
        raise TypeError(f"{who}: this {type(model).__name__} is not an initialised nn.Module (its __init__ must "
                        "call super().__init__() first)")


def _record_name(name: str, rec: tuple) -> str:
    """The module name a record stands for, given the name of the module that holds it."""
    return qual(name, rec[2]) if rec[0] == "conv1d" else (name or "(root)")


def patch(model: nn.Module, fuse_qkv: bool = True, strict: bool = False, *, attention: bool = True,
          mlp: bool = True, lm_head: bool = True, norm: bool = True, layers: bool = True,
          weights: str = "same", granularity: str = "channel", quantize_lm_head: bool = False,
          activations: str = "same") -> PatchReport:
    """Patch ``model`` in place (see the module docstring); returns a :class:`PatchReport`.

    ``attention``, ``mlp``, ``lm_head``, ``norm``: which parts to patch (the attention
    projections, the MLPs of fusion/mlp.py, a ``lm_head`` nn.Linear, the RMSNorms of
    fusion/norm.py). ``layers``: fuse the norms and residual adds of decoder layers whose
    parts are all patched (fusion/models/decoder_layer.py). ``fuse_qkv=False`` swaps each q/k/v linear
    on its own (state-dict keys unchanged).
    ``weights="fp8"``: the patched projections' and experts' weights are quantized to e4m3
    (``granularity`` ``"channel"`` or ``"block128"``; the LM head too with ``quantize_lm_head``)
    and run through the FP8 kernels (fusion/fp8_modules.py, fusion/fp8_experts.py); the bf16
    weights are not kept, so such a model cannot be unpatched (reload it). ``report.fp8`` lists
    the quantized modules.
    A model loaded from an FP8 checkpoint (compressed-tensors ``float-quantized``, transformers'
    fine-grained FP8, its experts included) keeps its e4m3 weights and scales as they are,
    whatever ``weights`` says: its projections and experts become the same FP8 modules (listed
    in ``report.fp8``; fused where their scales allow) and its state dict stays in the
    checkpoint's format (fusion/models/fp8_checkpoints.py); malformed scales raise
    ``FP8FormatError``. ``activations="fp8"`` (W8A8): past the decode rows (M > 64) the FP8
    projections quantize their inputs to e4m3 dynamically (per token; per 1 x 128 block for block
    weights) and run cuBLASLt's FP8 GEMM on Hopper (fusion/fp8_linear.py); decode rows, experts
    and the batch-invariant mode keep activations as they are. A model without FP8 projections
    gets a warning.
    Nothing to patch: a warning and an empty report, or ``ValueError`` with ``strict=True``.
    ``strict=True`` also raises ``ValueError`` naming every entry of ``report.skipped`` when
    anything was left unpatched or unfused (:class:`PatchReport` says what is listed); as with
    ``load_state_dict(strict=True)``, what could be patched stays patched.
    What an earlier patch changed is left as it is (``report.already_patched``); only what
    is new gets patched. :func:`unpatch` of ``model`` or of any module above it undoes it all.
    ``TypeError`` for anything but an eager ``nn.Module`` (TorchScript modules included).
    """
    _check_module(model, "hybridgemm.patch")
    if weights not in ("same", "fp8"):
        raise ValueError(f"hybridgemm.patch: weights must be 'same' or 'fp8', got {weights!r}")
    if activations not in ("same", "fp8"):
        raise ValueError(f"hybridgemm.patch: activations must be 'same' or 'fp8', got {activations!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"hybridgemm.patch: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    report = PatchReport()
    fp8_checkpoint = prepare_fp8_checkpoint(model, report)  # an FP8 checkpoint's linears: plain while patching
    done: set[str] = set()  # module names handled as part of a parent
    modules = dict(model.named_modules())

    # Where each module and parameter object is registered (tied weights, shared modules).
    owners: dict[int, list[str]] = {}
    for mname, m in modules.items():
        if isinstance(m, torch.jit.ScriptModule):
            continue
        for slot, obj in (*m._modules.items(), *m._parameters.items()):
            if obj is not None:
                owners.setdefault(id(obj), []).append(qual(mname, slot))

    def subtree(name: str):
        prefix = qual(name, "")
        return (n for n in modules if n.startswith(prefix))

    def swap(name: str, mod: nn.Module, cls) -> None:
        if records(mod):
            return  # a module registered under several names: swapped once
        record(mod, ("class", next(_SEQ), type(mod)))
        mod.__class__ = cls
        report.patched.append(name or "(root)")
        done.add(name)

    for name, mod in modules.items():
        if name in done:
            continue
        if isinstance(mod, torch.jit.ScriptModule):
            report.skipped.append((name, f"TorchScript module ({type(mod).__name__}): compiled code, cannot be "
                                         "patched in place"))
            done.update(subtree(name))
            continue
        recs = records(mod)
        if recs:  # changed by an earlier patch
            report.already_patched.extend(dict.fromkeys(_record_name(name, rec) for rec in recs if rec[0] != "attr"))
            if isinstance(mod, nn.MultiheadAttention):
                done.update(subtree(name))
            continue
        if norm and is_rms_norm(mod):
            swap(name, mod, HybridRMSNorm)
            continue
        if norm and is_gemma_norm(mod):
            swap(name, mod, HybridGemmaRMSNorm)
            continue
        if norm and is_olmo2_norm(mod):
            swap(name, mod, HybridOlmo2RMSNorm)
            continue
        if mlp and _patch_mlp(name, mod, modules, owners, report, swap, done):
            continue
        if mlp:  # a mixture-of-experts block's stacked experts (fusion/experts.py, fusion/fp8_experts.py)
            act, why = why_not_fp8_experts(mod)
            cls = HybridFP8Experts
            if act is None and why is None:
                act, why = why_not_experts(mod)
                cls = HybridExperts
            if why is not None:
                report.skipped.append((name, why))
            if act is not None:
                swap(name, mod, cls)
                _set_attr(mod, "glu_activation", act)
                if cls is HybridFP8Experts:
                    adopt_checkpoint_experts(mod)
                    report.fp8.append(name)
                    static = static_activation_scales(mod)
                    if static:
                        report.skipped.append((name, f"static activation scale ({', '.join(static)}) kept in the "
                                                     "state dict, not applied: the MoE kernels take the activations "
                                                     "as they are (W8A16)"))
            if act is not None or why is not None:
                continue
            form, why = why_not_router(mod)
            if why is not None:
                report.skipped.append((name, why))
            if isinstance(form, SigmoidRouterForm):
                swap(name, mod, HybridSigmoidRouter)
                _set_attr(mod, "route_sigmoid_form", form)
            elif form is not None:
                swap(name, mod, HybridTopKRouter)
                _set_attr(mod, "route_renormalize", form.renormalize)
                _set_attr(mod, "route_logits_dtype_weights", form.logits_dtype_weights)
            if form is not None or why is not None:
                continue
        if lm_head and is_lm_head(name, mod):
            swap(name, mod, HybridLinear)
            continue
        if not attention:
            continue
        if type(mod) is nn.MultiheadAttention:
            swap(name, mod, HybridMultiheadAttention)
            done.update(subtree(name))
            continue
        c_attn = _get(mod, "c_attn")
        if c_attn is not None and _is_conv1d(c_attn):
            for child in ("c_attn", "c_proj"):
                conv = _get(mod, child)
                if conv is not None and _is_conv1d(conv):
                    _swap_conv1d(name, mod, child, None, report, done)
            continue
        names = next((t for t in _QKV_NAMES if all(_get(mod, n) is not None for n in t)), None)
        if names is None:
            prefused = _prefused_attention(mod)
            for child in prefused:  # Phi-3, GPT-NeoX, Falcon: Q/K/V one linear already, each swapped
                swap(qual(name, child), _get(mod, child), HybridLinear)
            done.update(qual(name, child) for child in prefused)
            continue
        paths, lins = zip(*(stock_slot(mod, n) for n in names))  # the linears, or what adapters wrap
        if all(records(lin) for lin in lins):
            continue  # swapped one by one by an earlier patch (listed in already_patched)
        if not all(type(lin) is nn.Linear for lin in lins):
            kinds = ", ".join(type(lin).__name__ for lin in lins)
            report.skipped.append((name, f"{'/'.join(names)} are {kinds}, not plain nn.Linear"))
            continue
        why_not = _why_not_fuse(name, mod, paths, list(lins), owners) if fuse_qkv else "fuse_qkv=False"
        if why_not is None:
            fused = fuse(mod, paths, list(lins), _FUSED_NAME)
            if hasattr(getattr(mod, "config", None), "clip_qkv"):  # (OLMo's, OLMoE's: FusedLinears.own_parts)
                object.__setattr__(fused, "clamps_config", mod.config)
            report.patched.append(name or "(root)")
            report.fused_qkv.append(name or "(root)")
        else:
            if fuse_qkv:
                report.skipped.append((name, f"q/k/v not fused: {why_not}; swapped one by one"))
            for n, lin in zip(paths, lins):
                swap(qual(name, n), lin, HybridLinear)
        done.update(qual(name, n) for n in (*names, *paths))
        out_name, out = _output_projection(name, mod, modules)
        if out is not None and out_name not in done:
            swap(out_name, out, HybridLinear)

    if lm_head:
        for mod in modules.values():
            if resizes_embeddings(mod) and type(output_embeddings(mod)) is HybridLinear:
                _set_attr(mod, RESIZE, ResizeKeepingHead(mod))
    report.fp8.extend(adopt_fp8_checkpoint(model, fp8_checkpoint, report))
    if weights == "fp8":
        report.fp8.extend(quantize_patched(dict(model.named_modules()), granularity, quantize_lm_head))
        report.fp8.extend(quantize_patched_experts(dict(model.named_modules()), granularity))
    if activations == "fp8":
        _quantize_activations(model, report)
    if layers:
        for name, mod in modules.items():
            why_not = why_not_fuse_layer(mod) if name not in done and not records(mod) else NOT_A_LAYER
            if why_not is None:
                why_not_attention = _fuse_layer(mod)
                report.patched.append(name or "(root)")
                report.fused_layers.append(name or "(root)")
                mlp = mod._modules.get("mlp")
                if mlp is not None and mlp.__dict__.get(FUSED_BLOCK):
                    report.fused_moe.append(f"{name}.mlp" if name else "mlp")
                if why_not_attention is None:
                    report.fused_attention.append(name or "(root)")
                else:
                    report.skipped.append((name, f"{ATTENTION_NOT_FUSED}: {why_not_attention}"))
            elif why_not != NOT_A_LAYER:
                report.skipped.append((name, f"decoder layer not fused: {why_not}"))
            elif isinstance(mod, HybridDecoderLayer) and not mod.__dict__.get(STATIC_STEP):
                # fused by an earlier patch: what its attention step still leaves out, said again
                why_not_attention = why_not_fuse_attention(attention_of(mod))
                if why_not_attention is not None:
                    report.skipped.append((name, f"{ATTENTION_NOT_FUSED}: {why_not_attention}"))
    report.skipped.extend(unpatched(model, report.skipped, attention=attention, mlp=mlp, norm=norm,
                                    lm_head=lm_head, layers=layers))
    if not report.patched:
        if strict:
            raise ValueError(report.summary())
        warnings.warn(report.summary(), stacklevel=2)
    elif strict and report.skipped:
        raise ValueError(f"{report.summary()}; strict=True: {len(report.skipped)} modules left unpatched or "
                         f"unfused: {'; '.join(report.skipped_lines())} (the rest stays patched: "
                         "hybridgemm.unpatch undoes it)")
    return report


def _fuse_layer(layer: nn.Module) -> str | None:
    """Give a recognised decoder layer its fused forward and its arrival counters (class
    swapped in place, recorded for unpatch); mark it for the static-cache step where its
    attention allows (else return why not)."""
    scaled, post_norms = scales_residuals(type(layer)), normalises_outputs(type(layer))
    family = layernorm_layers.family_of(layer)
    norm_modules = family.norms_as_modules if family is not None else norm_modules_form(type(layer))
    record(layer, ("class", next(_SEQ), type(layer)))
    layer.__class__ = fused_class(type(layer))
    layer.register_buffer(COUNTERS, new_counters(next(layer.parameters()).device), persistent=False)
    record(layer, ("buffer", next(_SEQ), COUNTERS))
    if scaled:
        _set_attr(layer, SCALED_RESIDUALS, True)
    if post_norms:
        _set_attr(layer, POST_NORMS, post_norms)
    if norm_modules:
        _set_attr(layer, NORMS_AS_MODULES, norm_modules)
    if moe_block(layer._modules.get("mlp")) and why_not_fuse_block(layer.mlp) is None:
        _set_attr(layer.mlp, FUSED_BLOCK, True)  # its norm and residual add in its launches (models/moe_block.py)
    why_not = why_not_fuse_attention(attention_of(layer))
    if why_not is None:
        _set_attr(layer, STATIC_STEP, True)
    return why_not


def _set_attr(mod: nn.Module, attr: str, value) -> None:
    """``mod.<attr> = value`` as an instance attribute, recorded for unpatch."""
    had = attr in mod.__dict__
    record(mod, ("attr", next(_SEQ), attr, had, mod.__dict__.get(attr)))
    mod.__dict__[attr] = value


def _patch_mlp(name: str, mod: nn.Module, modules: dict, owners: dict, report: PatchReport, swap, done) -> bool:
    """Patch ``mod`` if it is an MLP of fusion/mlp.py; False if it is none."""
    lins, act, why = gated_parts(mod)
    if why is not None:
        report.skipped.append((name, why))
        return True
    if lins:
        paths = tuple(stock_slot(mod, n)[0] for n in GATED_NAMES)
        down_path, down = stock_slot(mod, "down_proj")
        # (Seed-OSS's form: the same, then a dropout of its residual_dropout, which the swapped forward keeps)
        output_dropout = mlp_forms.why_not_form(mod, mlp_forms.GATED_DROPOUT_FORMS, "gated MLP") is None
        why_not = (None if output_dropout else mlp_forms.why_not_form(mod, mlp_forms.GATED_FORMS, "gated MLP")) or \
            why_not_fuse(name, mod, paths, lins, owners, FUSED_GATE_UP, "gate/up")
        if why_not is not None:  # still through hybridgemm, one GEMM each, the module's own forward
            report.skipped.append((name, f"gate/up not fused: {why_not}; swapped one by one"))
            for n, lin in zip(paths, lins):
                swap(qual(name, n), lin, HybridLinear)
        else:
            swap(name, mod, HybridGatedMLP)  # before fuse: swap() leaves modules holding records alone
            fuse(mod, paths, lins, FUSED_GATE_UP)
            _set_attr(mod, "glu_activation", act)
            if output_dropout:
                _set_attr(mod, OUTPUT_DROPOUT, True)
            report.fused_mlp.append(name or "(root)")
        if type(down) is nn.Linear:
            swap(qual(name, down_path), down, HybridLinear)
        done.update(qual(name, n) for n in (*GATED_NAMES, *paths, "down_proj", down_path))
        return True
    gate_up, act, why = prefused_gated_parts(mod)
    if why is None and gate_up is not None:
        why = mlp_forms.why_not_form(mod, mlp_forms.PREFUSED_GATED_FORMS, "gated MLP")
        if why is not None:  # its own forward, its linears dispatched one by one
            _swap_each(name, mod, (FUSED_GATE_UP, "down_proj"), swap, done)
    if why is not None:
        report.skipped.append((name, why))
        return True
    if gate_up is not None:  # Phi-3: gate and up stacked in one linear already
        swap(name, mod, HybridPrefusedGatedMLP)
        swap(qual(name, FUSED_GATE_UP), gate_up, HybridLinear)
        _set_attr(mod, "glu_activation", act)
        report.fused_mlp.append(name or "(root)")
        down_path, down = stock_slot(mod, "down_proj")
        if type(down) is nn.Linear:
            swap(qual(name, down_path), down, HybridLinear)
        done.update(qual(name, n) for n in (FUSED_GATE_UP, "down_proj", down_path))
        return True
    act, why = two_layer_act(mod)
    if why is None and act is not None:
        why = mlp_forms.why_not_form(mod, mlp_forms.TWO_LAYER_FORMS, "MLP")
        if why is not None:  # its own forward, its linears dispatched one by one
            _swap_each(name, mod, ("dense_h_to_4h", "dense_4h_to_h"), swap, done)
    if why is not None:
        report.skipped.append((name, why))
        return True
    if act is not None:  # GPT-NeoX, Falcon: the activation in the first GEMM's epilogue
        up, down = _get(mod, "dense_h_to_4h"), _get(mod, "dense_4h_to_h")
        swap(qual(name, "dense_h_to_4h"), up, HybridLinear)
        swap(qual(name, "dense_4h_to_h"), down, HybridLinear)
        swap(name, mod, HybridTwoLayerMLP)
        _set_attr(mod, "activation", act)
        return True
    act, why = conv_mlp_act(mod, _is_conv1d)
    if why is None and act is not None:
        why = mlp_forms.why_not_form(mod, mlp_forms.CONV_FORMS, "MLP")
    if why is not None:  # a GPT-2-style MLP that cannot be fused: left alone, with the reason
        report.skipped.append((name, why))
        return True
    if act is None:
        act, why = intermediate_act(mod)
        if why is None and act is not None:
            why = mlp_forms.why_not_form(mod, mlp_forms.INTERMEDIATE_FORMS, "intermediate GEMM")
            act = None if why is not None else act
        if act is None:
            if why is not None:
                report.skipped.append((name, why))
            return why is not None
        dense = _get(mod, "dense")
        swap(qual(name, "dense"), dense, HybridLinear)
        swap(name, mod, HybridIntermediate)
        _set_attr(mod, "activation", act)
        parent_name = name.rpartition(".")[0]
        output = _get(modules[parent_name], "output") if name else None
        out_dense = _get(output, "dense") if output is not None else None
        out_name = qual(parent_name, "output.dense")
        if type(out_dense) is nn.Linear and out_name not in done:
            swap(out_name, out_dense, HybridLinear)
        return True
    swap(name, mod, HybridConvMLP)
    _swap_conv1d(name, mod, "c_fc", act, report, done)
    _swap_conv1d(name, mod, "c_proj", None, report, done)
    return True


def _swap_each(name: str, mod: nn.Module, children: tuple[str, ...], swap, done: set) -> None:
    """Each plain ``nn.Linear`` of ``mod``'s ``children`` a :class:`HybridLinear` (the module's forward calls it)."""
    for child in children:
        lin = _get(mod, child)
        if type(lin) is nn.Linear:
            swap(qual(name, child), lin, HybridLinear)
        done.add(qual(name, child))


def _swap_conv1d(name: str, mod: nn.Module, child: str, act: str | None, report: PatchReport, done: set) -> None:
    """Replace ``mod``'s Conv1D ``child`` by a :class:`HybridConv1D` (``act`` in its epilogue)."""
    conv = _get(mod, child)
    new = HybridConv1D(conv, act)
    record(mod, ("conv1d", next(_SEQ), child, conv, new))
    setattr(mod, child, new)
    report.patched.append(qual(name, child))
    done.add(qual(name, child))


def _output_projection(name: str, mod: nn.Module, modules: dict):
    for n in _OUT_NAMES:
        path, out = stock_slot(mod, n)
        if type(out) is nn.Linear:
            return qual(name, path), out
    # BERT/ViT: q/k/v live in `<attn>.self` (or `.attention`), the output in `<attn>.output.dense`
    if name:
        parent_name = name.rpartition(".")[0]
        output = _get(modules[parent_name], "output")
        dense = _get(output, "dense") if output is not None else None
        if type(dense) is nn.Linear:
            return (f"{parent_name}.output.dense" if parent_name else "output.dense"), dense
    return None, None


def _prefused_attention(mod: nn.Module) -> tuple[str, ...]:
    """The children of an attention module whose Q/K/V are one linear already (``qkv_proj``,
    ``query_key_value``, ``Wqkv``) with its output linear (``o_proj``, ``dense``, ``out_proj``):
    their names, or () for any other module."""
    qkv = next((n for n in _PREFUSED_QKV if plain_linear(_get(mod, n))), None)
    out = next((n for n in _OUT_NAMES + ("dense",) if plain_linear(_get(mod, n))), None)
    return (qkv, out) if qkv is not None and out is not None else ()


def _why_not_fuse(name: str, mod: nn.Module, names, lins: list[nn.Linear], owners: dict) -> str | None:
    if getattr(mod, "is_cross_attention", False) or "Cross" in type(mod).__name__:
        return "cross-attention (K/V read another input)"
    return why_not_fuse(name, mod, names, lins, owners, _FUSED_NAME, "q/k/v")


def _quantize_activations(model: nn.Module, report: PatchReport) -> None:
    """``activations="fp8"``: every FP8 projection module quantizes its inputs past the decode
    rows; a warning where there is none."""
    mods = [m for m in model.modules() if isinstance(m, (FP8HybridLinear, FP8FusedLinears))]
    for mod in mods:
        mod.fp8_activations = True
    if not mods:
        warnings.warn("hybridgemm.patch: activations='fp8' applies to FP8 projections (weights='fp8', or a model "
                      "loaded from an FP8 checkpoint); this model has none, so nothing quantizes its activations",
                      stacklevel=3)


def unpatch(model: nn.Module) -> list[str]:
    """Undo every :func:`patch` applied to ``model`` or to any module under it (whichever
    module ``patch`` was called on); returns the names (relative to ``model``) of the
    restored modules, most recently patched first, empty if nothing was patched. Restored
    modules are the original objects; their parameters hold the current (possibly trained,
    moved or cast) values. ``TypeError`` for anything but an eager ``nn.Module``; ``ValueError``
    (nothing changed) for a model whose weights ``patch(weights="fp8")`` quantized or that
    ``patch`` took from an FP8 checkpoint."""
    _check_module(model, "hybridgemm.unpatch")
    quantized = [name for name, mod in model.named_modules() if is_fp8(mod) or isinstance(mod, HybridFP8Experts)]
    if quantized:
        raise ValueError(f"hybridgemm.unpatch: {len(quantized)} modules hold FP8 weights, quantized by "
                         f"patch(weights='fp8') or taken from an FP8 checkpoint (e.g. {quantized[0] or '(root)'}); "
                         "they cannot be unpatched: reload the model instead")
    found = []
    for name, mod in model.named_modules():
        for rec in mod.__dict__.pop(_UNDO_ATTR, None) or ():
            found.append((rec[1], name, mod, rec))
    found.sort(key=lambda item: item[0], reverse=True)
    restored = []
    for _, name, mod, rec in found:
        kind = rec[0]
        if kind == "attr":
            _, _, attr, had, old = rec
            if had:
                mod.__dict__[attr] = old
            else:
                mod.__dict__.pop(attr, None)
            continue
        if kind == "buffer":
            mod._buffers.pop(rec[2], None)
            continue
        if _record_name(name, rec) not in restored:
            restored.append(_record_name(name, rec))
        if kind == "class":
            mod.__class__ = restored_class(mod, rec[2])
        elif kind == "conv1d":
            _, _, child, conv, new = rec
            with torch.no_grad():
                conv.weight = new.weight
                conv.bias = new.bias
                conv.weight.data = conv.weight.data.contiguous()
            setattr(mod, child, conv)
        elif kind == "fused":
            unfuse(mod, rec)
    for mod in model.modules():  # the checks' kept part lists (decode_checks.layer_parts) name patched modules
        mod.__dict__.pop(PARTS_SEEN, None)
    return restored


__all__ = ["ATTENTION_NOT_FUSED", "FusedQKV", "HybridConv1D", "PatchReport", "QKVSlice", "patch", "unpatch"]
