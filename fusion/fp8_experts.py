"""FP8 experts in a patched model: :class:`HybridFP8Experts`, the routed experts of a
mixture-of-experts block with e4m3 weights, run by the MoE kernels (fusion/experts.py ``moe``
with stacked ``FP8Weight``s, kernels/triton_moe.py).

Two ways in, as for the linears (fusion/fp8_modules.py):

* ``patch(model, weights="fp8")`` quantizes each patched experts module's ``gate_up_proj``
  [E, 2I, H] and ``down_proj`` [E, H, I] per expert (``granularity``; block-scaled gate/up
  weights need I a multiple of 128, else that module is quantized per channel): the e4m3 data
  replace the parameters under their names (frozen) and the fp32 scales are the buffers
  ``gate_up_proj_scale_inv`` and ``down_proj_scale_inv`` ((E, N) per channel, (E, N/128,
  K/128) per block; the suffix is transformers' name for scales that multiply).
* ``patch`` of a model loaded from a fine-grained FP8 checkpoint (transformers'
  ``FineGrainedFP8Config``, whose quantizer makes each experts module an ``FP8Experts`` with
  e4m3 ``gate_up_proj`` / ``down_proj`` and their 128 x 128 block ``*_scale_inv``) keeps its
  tensors as they are: the module's class is swapped (:func:`adopt_checkpoint_experts`), its
  state dict does not change. :func:`why_not_fp8_experts` recognises such a module by what it
  holds, never by its name.

Gradients reach the activations and routing weights only: FP8 weights and scales are frozen
(the loop that autograd runs dequantizes them). ``model.to(dtype)`` moves them without casting.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridgemm.kernels import fp8
from hybridgemm.mlp import GLU_FUNCTIONS, activation_name

from .experts import HybridExperts, moe, norm_of
from .fp8_linear import keep_fp8_dtypes
from .fp8_modules import data_error, refuse_bad_fp8, scales_error

PROJECTIONS = ("gate_up_proj", "down_proj")
SCALE_SUFFIX = "_scale_inv"
# what transformers' FP8Experts holds beside the weights and their scales: biases (None here)
# and the static activation scales of a W8A8 checkpoint (kept, not applied)
_BIASES = tuple(p + "_bias" for p in PROJECTIONS)
_ACTIVATION_SCALES = tuple(p + "_activation_scale" for p in PROJECTIONS)


def _scale(mod: nn.Module, proj: str) -> Tensor | None:
    name = proj + SCALE_SUFFIX
    t = mod._parameters.get(name)
    return mod._buffers.get(name) if t is None else t


class HybridFP8Experts(HybridExperts):
    """A patched experts module whose weights are FP8 (see the module docstring)."""

    def expert_weights(self, dtype: torch.dtype) -> tuple[fp8.FP8Weight, fp8.FP8Weight]:
        """The stacked ``FP8Weight``s over the module's tensors as they are now (views: no copy;
        shape and dtype checks only, a few µs of host time), computing in ``dtype`` (bf16 where
        that is not a 16-bit dtype: the PyTorch loop then dequantizes to ``dtype`` itself)."""
        compute = dtype if dtype in fp8.OUT_DTYPES else torch.bfloat16
        return tuple(fp8.FP8Weight.from_tensors(self._parameters[p].detach(), _scale(self, p).detach(), compute,
                                                check=False) for p in PROJECTIONS)

    def compiled_moe(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, norm_weight: Tensor | None = None,
                     eps: float = 0.0, residual: Tensor | None = None) -> Tensor:
        return torch.ops.hybridgemm.moe_fp8_fwd(x, top_k_index, top_k_weights, self.gate_up_proj.detach(),
                                                _scale(self, "gate_up_proj").detach(), self.down_proj.detach(),
                                                _scale(self, "down_proj").detach(), self.glu_activation, norm_weight,
                                                eps, residual)

    def unfused(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """:meth:`loop`, over the weights dequantized to the activations' dtype (the class
        ``patch`` replaced may hold these weights in another precision, or not read FP8 at all)."""
        return self.loop(hidden_states, top_k_index, top_k_weights)

    def _apply(self, fn, *args, **kwargs):
        # e4m3 data and fp32 scales follow fn's device, never its dtype (module docstring)
        tensors = [t for p in PROJECTIONS for t in (self._parameters.get(p), _scale(self, p))]
        return super()._apply(keep_fp8_dtypes(self, fn, tensors), *args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        refuse_bad_fp8(state_dict, prefix, PROJECTIONS, [p + SCALE_SUFFIX for p in PROJECTIONS], error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        data, scale = self._parameters["gate_up_proj"], _scale(self, "gate_up_proj")
        return f"experts={data.shape[0]}, fp8={fp8.stacked_granularity_of(data, scale)}"


@torch.library.custom_op("hybridgemm::moe_fp8_fwd", mutates_args=())
def moe_fp8_fwd(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor, gate_up_scale: Tensor,
                down: Tensor, down_scale: Tensor, activation: str, norm_weight: Tensor | None = None,
                eps: float = 0.0, residual: Tensor | None = None) -> Tensor:
    weights = [fp8.FP8Weight.from_tensors(d, s, x.dtype, check=False)
               for d, s in ((gate_up, gate_up_scale), (down, down_scale))]
    return moe(x, (topk_ids, topk_weights), *weights, activation, norm=norm_of(norm_weight, eps), residual=residual)


@moe_fp8_fwd.register_fake
def _moe_fp8_fwd_fake(x, topk_ids, topk_weights, gate_up, gate_up_scale, down, down_scale, activation,
                      norm_weight=None, eps=0.0, residual=None):
    return x.new_empty(x.shape)


def why_not_fp8_experts(mod: nn.Module) -> tuple[str | None, str | None]:
    """(activation, None) for a transformers experts module holding FP8 weights that
    :class:`HybridFP8Experts` runs (e4m3 ``gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I], gate rows first, fp32 ``*_scale_inv`` per 128 x 128 block, no biases, a plain
    GLU gate), (None, reason) for another experts module with FP8 weights, (None, None) for
    anything else. Shapes and dtypes only: :func:`check_fp8_experts` reads the values."""
    t = type(mod)
    if not t.__module__.startswith("transformers"):  # (a TorchScript module's _parameters is no dict)
        return None, None
    gu, down = mod._parameters.get("gate_up_proj"), mod._parameters.get("down_proj")
    name = t.__name__
    up = mod._parameters.get("up_proj")
    if gu is None and up is not None and up.dtype in fp8.FP8_DTYPES:
        return None, f"{name}: FP8 experts without a gate"
    if gu is None or gu.dtype not in fp8.FP8_DTYPES:
        return None, None
    if gu.dtype != fp8.E4M3 or down is None or down.dtype != fp8.E4M3:
        return None, f"{name}: FP8 experts of {gu.dtype}; the MoE kernels read {fp8.E4M3} weights"
    if getattr(mod, "_is_expert_parallel", False):
        return None, f"{name}: experts sharded over ranks (expert parallelism)"
    if getattr(mod, "has_bias", False) or any(mod._parameters.get(b) is not None for b in _BIASES):
        return None, f"{name}: FP8 experts with biases"
    if any(getattr(mod, a, None) is not None for a in ("gate_softcap", "swiglu_alpha", "limit")):
        return None, f"{name}: a clamped or soft-capped gate"
    block = getattr(mod, "block_size", None)
    if block is None or tuple(block) != (fp8.BLOCK, fp8.BLOCK):
        return None, f"{name}: scales per {'tensor' if block is None else tuple(block)}; the MoE kernels read " \
                     f"per-channel and 128x128-block scales"
    scales = [_scale(mod, p) for p in PROJECTIONS]
    if any(s is None or s.dtype != torch.float32 for s in scales):
        return None, f"{name}: scales that are not float32 (e.g. ue8m0)"
    known = {*PROJECTIONS, *(p + SCALE_SUFFIX for p in PROJECTIONS), *_BIASES, *_ACTIVATION_SCALES}
    unknown = [n for n, p in mod._parameters.items() if p is not None and n not in known]
    if unknown:
        return None, f"{name}: it holds {', '.join(unknown)}, which the MoE kernels do not apply"
    e, two_i, h = gu.shape if gu.dim() == 3 else (0, 1, 0)
    if gu.dim() != 3 or two_i % 2 or down.shape != (e, h, two_i // 2):
        return None, f"{name}: weights not stacked as [E, 2I, H] and [E, H, I]"
    try:
        if any(fp8.stacked_granularity_of(w, s) != "block128" for w, s in zip((gu, down), scales)):
            return None, f"{name}: scales of a shape other than 128x128 blocks"
    except fp8.FP8FormatError as e:
        return None, f"{name}: {e}"
    why = fp8.gate_up_blocks_problem(two_i)
    if why:
        return None, f"{name}: {why}"
    act = activation_name(getattr(mod, "act_fn", None))
    if act not in GLU_FUNCTIONS:
        return None, f"{name}: activation {type(getattr(mod, 'act_fn', None)).__name__} has no GLU epilogue"
    return act, None


def static_activation_scales(mod: nn.Module) -> list[str]:
    """The static activation scales an FP8 experts module holds (a W8A8 checkpoint's)."""
    return [n for n in _ACTIVATION_SCALES if mod._parameters.get(n) is not None or mod._buffers.get(n) is not None]


def check_fp8_experts(name: str, mod: nn.Module) -> None:
    """FP8FormatError naming the tensor if an FP8 experts module's scales are not all finite and
    > 0 or its data holds NaN codes (reads them: one pass each, at patch time)."""
    for proj in PROJECTIONS:
        why = (scales_error(f"hybridgemm.patch: {name}.{proj}{SCALE_SUFFIX}", _scale(mod, proj).detach())
               or data_error(f"hybridgemm.patch: {name}.{proj}", mod._parameters[proj].detach()))
        if why is not None:
            raise fp8.FP8FormatError(why)


def adopt_checkpoint_experts(mod: nn.Module) -> None:
    """Freeze a checkpoint's FP8 experts module that :func:`why_not_fp8_experts` accepted (its
    e4m3 weights, their scales, static activation scales), as ``patch`` swaps its class to
    :class:`HybridFP8Experts`. The state dict is unchanged."""
    for name in (*PROJECTIONS, *(p + SCALE_SUFFIX for p in PROJECTIONS), *_ACTIVATION_SCALES):
        t = mod._parameters.get(name)
        if t is not None:
            t.requires_grad_(False)


def quantize_experts(mod: HybridExperts, granularity: str) -> None:
    """Quantize a patched experts module's weights per expert (module docstring) and make it a
    :class:`HybridFP8Experts`."""
    two_i = mod.gate_up_proj.shape[1]
    gran = "channel" if fp8.gate_up_blocks_problem(two_i) else granularity
    for proj in PROJECTIONS:
        q = fp8.quantize_fp8(mod._parameters[proj].detach(), gran)
        mod._parameters[proj] = nn.Parameter(q.data, requires_grad=False)
        mod.register_buffer(proj + SCALE_SUFFIX, q.scale)
    mod.__class__ = HybridFP8Experts


def quantize_patched_experts(modules: dict[str, nn.Module], granularity: str) -> list[str]:
    """Quantize every patched experts module among ``modules`` (name -> module); returns their
    names."""
    done = []
    for name, mod in modules.items():
        if type(mod) is HybridExperts:
            quantize_experts(mod, granularity)
            done.append(name)
    return done


__all__ = ["HybridFP8Experts", "PROJECTIONS", "SCALE_SUFFIX", "adopt_checkpoint_experts", "check_fp8_experts",
           "quantize_experts", "quantize_patched_experts", "static_activation_scales", "why_not_fp8_experts"]
