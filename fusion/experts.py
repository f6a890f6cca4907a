"""Mixture-of-experts blocks: :func:`moe`, the routed experts of a block in two grouped GEMM
launches (kernels/triton_moe.py), and :func:`route`, the softmax/top-k routing of Mixtral- and
Qwen-MoE-style routers.

``moe(x, routing, w_gate_up, w_down)`` computes what transformers' experts modules compute
(``MixtralExperts``, ``Qwen3MoeExperts``: weights stacked per expert, ``w_gate_up`` [E, 2I, H]
with the gate rows first, ``w_down`` [E, H, I]) for the routing ``(topk_ids, topk_weights)``
or for router logits: per (token, expert) pair ``act(x Wg^T) * (x Wu^T)`` then ``W_d`` times
the routing weight, summed over the token's experts in slot order in fp32 and rounded to x's
dtype once (transformers' grouped_mm form). On CUDA the two GEMMs are the Triton kernels,
bit-identical run to run; elsewhere a loop over the experts that hold pairs computes the same.

FP8 experts: ``w_gate_up`` and ``w_down`` may be stacked ``FP8Weight``s (``quantize_fp8`` of
the [E, N, K] tensors, or a checkpoint's e4m3 data and scales), both of one granularity,
computing in x's dtype. The kernels read the e4m3 bytes and apply the scales in fp32; the
PyTorch loop (and the grouped baseline) compute with the weights dequantized to x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridgemm.autotune_cache import tune_moe
from hybridgemm.autotune_cache.measure import dense_weight
from hybridgemm.diagnostics import warn_once
from hybridgemm.kernels import fp8
from hybridgemm.kernels.grouped_mm_moe import available as grouped_mm_available
from hybridgemm.kernels.grouped_mm_moe import grouped_mm_moe
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import DTYPE_NAMES
from hybridgemm.mlp import GLU_FUNCTIONS, activation_name

from . import decide
from .fp8_linear import runs_fp8_kernels
from .fused_rows import replaced_class
from .norm import prologue_norm


def route(router_logits: Tensor, top_k: int, renormalize: bool = True,
          weights_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(topk_ids [T, k] int64, topk_weights [T, k])``: softmax over the experts in fp32, the
    ``top_k`` largest, renormalised to sum to one where ``renormalize`` (Mixtral, Qwen3-MoE),
    the weights in ``weights_dtype``. Where :func:`use_kernels` holds, one Triton launch
    (kernels/triton_router.py: the experts ``torch.topk`` selects on CUDA, ties included;
    a probability may differ from PyTorch's in its last bit); elsewhere :func:`route_torch`."""
    if router_logits.dim() != 2:
        raise ValueError(f"route: router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"route: top_k {top_k} is not in 1..{router_logits.shape[1]} (the experts)")
    wants_grad = torch.is_grad_enabled() and router_logits.requires_grad
    if not wants_grad and use_kernels(router_logits):
        if torch.compiler.is_compiling():  # (Dynamo traces no first import of the kernel module)
            return torch.ops.hybridgemm.route_fwd(router_logits, top_k, renormalize, weights_dtype)
        return _route_kernel(router_logits, top_k, renormalize, weights_dtype)
    return route_torch(router_logits, top_k, renormalize, weights_dtype)


def _route_kernel(router_logits: Tensor, top_k: int, renormalize: bool,
                  weights_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The routing kernel where it takes the operands, else :func:`route_torch`."""
    kernel = triton_module("triton_router")
    if kernel.why_not(router_logits, top_k, weights_dtype) is None:
        return kernel.launch(router_logits, top_k, renormalize, weights_dtype)
    return route_torch(router_logits, top_k, renormalize, weights_dtype)


def route_torch(router_logits: Tensor, top_k: int, renormalize: bool = True,
                weights_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """:func:`route` in PyTorch, the operations of transformers' routers (``torch.topk``, so ties
    resolve as theirs do; differentiable)."""
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(weights_dtype)


@torch.library.custom_op("hybridgemm::route_fwd", mutates_args=())
def route_fwd(router_logits: Tensor, top_k: int, renormalize: bool,
              weights_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _route_kernel(router_logits, top_k, renormalize, weights_dtype)


@route_fwd.register_fake
def _route_fwd_fake(router_logits, top_k, renormalize, weights_dtype):
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.int64),
            router_logits.new_empty((t, top_k), dtype=weights_dtype))


def use_kernels(x: Tensor) -> bool:
    """Do the Triton kernels run for x (CUDA; the CPU tests widen it to the interpreter)?"""
    return x.is_cuda


def fp8_kernels_run(x: Tensor) -> bool:
    """Where the kernels run for x, do they read e4m3 weights? Not on a GPU without e4m3
    conversion (below compute capability 8.9: warned once, the experts dequantized per call)."""
    return not x.is_cuda or runs_fp8_kernels(x)


def moe(x: Tensor, routing, w_gate_up: Tensor, w_down: Tensor, activation: str = "silu", *, top_k: int | None = None,
        renormalize: bool = True, config=None, norm: tuple | None = None, residual: Tensor | None = None) -> Tensor:
    """The routed experts' output for ``x`` [T, H]: ``routing`` is ``(topk_ids, topk_weights)``
    ([T, k] each) or router logits [T, E] with ``top_k`` (and ``renormalize``, :func:`route`).
    ``config``: a kernels/triton_moe.py ``TritonMoeConfig`` for both launches, or a (gate/up,
    down) pair (default: :func:`decision_for`, the tuning table's choice); ``block_m`` 1 runs
    the pair-major kernels (no layout; decode), larger blocks the grouped ones. The weights may
    be stacked ``FP8Weight``s (module docstring).

    A mixture-of-experts decoder layer's second half, ``residual + experts(rmsnorm(x))``:
    ``norm`` = (weight [H], eps) of a Llama-style RMSNorm normalises x (in the pair-major
    gate/up launch as it loads x, as the split-K kernels' norm prologue; elsewhere the norm
    apart, :func:`hybridgemm.norm.prologue_norm`), and ``residual`` [T, H] is added to the
    output as the layer's add does (in the last launch on the kernel path)."""
    if isinstance(routing, Tensor):
        if top_k is None:
            raise ValueError("moe: router logits need top_k")
        topk_ids, topk_weights = route(routing, top_k, renormalize)
    else:
        topk_ids, topk_weights = routing
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, activation)
    if residual is not None and (not isinstance(residual, Tensor) or residual.shape != x.shape
                                 or residual.dtype != x.dtype or residual.device != x.device):
        raise ValueError(f"moe: the residual must be a tensor of x's shape {tuple(x.shape)}, dtype and device")
    if norm is not None:
        _check_norm(norm, x)
    if not x.shape[0]:
        return x.new_zeros(x.shape) if residual is None else residual.clone()
    kernels = use_kernels(x)
    if weight_format(w_gate_up) and kernels and not fp8_kernels_run(x):
        w_gate_up, w_down = (dense_weight(w, x.dtype) for w in (w_gate_up, w_down))
    decision = None
    if kernels and config is None:
        decision = decision_for(x, topk_ids.shape[1], w_gate_up, activation)
        config = decision.configs
    pair_major = kernels and config is not None and _block_m(config) == 1
    given = x, norm  # (a retry with other configs starts from these)
    if norm is not None and not pair_major:  # the norm apart where no launch takes it
        x, norm = prologue_norm(x, norm[0], norm[1]), None
    if not kernels:
        out = experts_loop(x, topk_ids, topk_weights, w_gate_up, w_down, activation)
    elif decision is not None and decision.backend == "torch":
        out = grouped_mm_moe(x, topk_ids, topk_weights, dense_weight(w_gate_up, x.dtype),
                             dense_weight(w_down, x.dtype), activation)
    else:
        from triton.errors import TritonError

        tm = triton_module("triton_moe")
        up, down = config if isinstance(config, tuple) else (config, config)
        try:
            return tm.forward(x.contiguous(), topk_ids, topk_weights, w_gate_up, w_down, activation, up, down, norm,
                              None if residual is None else residual.contiguous())
        except TritonError as e:
            # a table entry's configs that this GPU's Triton cannot compile (out of shared memory):
            # the results of any launch before the failed one are dropped, and the default
            # configs run, this call and the next ones (an explicit config, or the defaults
            # failing, raise)
            defaults = tm.default_configs(x.shape[0] * topk_ids.shape[1], w_gate_up.shape[0],
                                          weight_format(w_gate_up), top_k=topk_ids.shape[1])
            if decision is None or tuple(decision.configs) == tuple(defaults):
                raise
            warn_once(("moe-compile", decision.why), f"hybridgemm: {decision.why} could not be compiled here ({e}); "
                      "the MoE kernels' default configs run")
            _forget(given[0], topk_ids.shape[1], w_gate_up, activation, MoeDecision(
                tune_moe.BACKEND, defaults, f"{decision.why}, which did not compile here; the default configs"))
            return moe(given[0], (topk_ids, topk_weights), w_gate_up, w_down, activation, config=defaults,
                       norm=given[1], residual=residual)
    return out if residual is None else residual + out


def _check_norm(norm, x: Tensor) -> None:
    h = x.shape[1]
    ok = isinstance(norm, tuple) and len(norm) == 2 and isinstance(norm[0], Tensor) and isinstance(norm[1], float)
    if not ok or norm[0].shape != (h,) or norm[0].dtype not in (x.dtype, torch.float32) or norm[0].device != x.device:
        raise ValueError(f"moe: norm must be (weight, eps), the norm weight a [{h}] vector of x's dtype or float32 on "
                         f"x's device and eps a float")


def _block_m(config) -> int:
    return (config[0] if isinstance(config, tuple) else config).block_m


@dataclass(frozen=True)
class MoeDecision:
    backend: str  # "triton_moe" or "torch" (kernels/grouped_mm_moe.py)
    configs: tuple | None  # (gate/up, down) TritonMoeConfigs for triton_moe
    why: str


# decisions per (device, experts, top_k, activation, dtype, I, H, tokens); cleared when the
# tables are reloaded
_decisions: dict[tuple, MoeDecision] = {}
decide.on_change(lambda mode, reloaded: _decisions.clear() if reloaded else None)


def weight_format(w) -> str:
    """The stacked expert weight's format: "" for a tensor of x's dtype, else the FP8 one."""
    return w.weight_format if isinstance(w, fp8.FP8Weight) else ""


def decision_for(x: Tensor, top_k: int, w_gate_up, activation: str) -> MoeDecision:
    """What runs the routed experts of ``x`` [T, H] on CUDA: the tuning table's entry for the
    shape and weight format whose M range holds T (autotune_cache/tune_moe.py: the Triton
    kernels with its configs, or the grouped baseline where that was the faster), else the
    kernels' default configs (also once :func:`moe` found the entry's configs do not compile
    here)."""
    e, two_i, h = w_gate_up.shape
    t = x.shape[0]
    fmt = weight_format(w_gate_up)
    if not x.is_cuda:  # the interpreter (tests): no device, no table
        defaults = triton_module("triton_moe").default_configs(t * top_k, e, fmt, top_k=top_k)
        return MoeDecision(tune_moe.BACKEND, defaults,
                           f"{x.device}: no tuning table; the default configs")
    memo = _memo_key(x, top_k, w_gate_up, activation)
    index = memo[0]
    got = _decisions.get(memo)
    if got is None:
        got = _decide(index, e, top_k, activation, x.dtype, two_i // 2, h, t, fmt)
        if len(_decisions) > 4096:
            _decisions.clear()
        _decisions[memo] = got
    return got


def _memo_key(x: Tensor, top_k: int, w_gate_up, activation: str) -> tuple:
    e, two_i, h = w_gate_up.shape
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return index, e, top_k, activation, x.dtype, two_i // 2, h, x.shape[0], weight_format(w_gate_up)


def _forget(x: Tensor, top_k: int, w_gate_up, activation: str, instead: MoeDecision) -> None:
    """Replace the decision :func:`decision_for` keeps for this call's shape with ``instead``."""
    if x.is_cuda:
        _decisions[_memo_key(x, top_k, w_gate_up, activation)] = instead


def _decide(index, e, top_k, activation, dtype, i, h, t, fmt="") -> MoeDecision:
    tm = triton_module("triton_moe")
    defaults = tm.default_configs(t * top_k, e, fmt, top_k=top_k)
    if dtype not in DTYPE_NAMES:
        return MoeDecision(tune_moe.BACKEND, defaults, f"{dtype}: no table key; default configs")
    shape = tune_moe.moe_key(e, top_k, activation, dtype, i, h, 1, 1, fmt).shape
    found = decide.table_for_device(index).find(shape, t)
    if found is None:
        return MoeDecision(tune_moe.BACKEND, defaults, f"no table entry holds {shape.to_string()} at M={t}; the "
                           f"default configs {defaults}")
    key, entry = found
    tail = f"table entry {key.to_string()} (worst {entry['worst_ratio']:.3f}x the grouped baseline)"
    if entry["backend"] == "torch":
        if grouped_mm_available():
            return MoeDecision("torch", None, f"{tail}: the grouped baseline (torch._grouped_mm)")
        return MoeDecision(tune_moe.BACKEND, defaults, f"{tail} names the grouped baseline, which this torch "
                           "lacks; the default configs")
    try:
        configs = tune_moe.configs_of(entry["config"])
        why = next((w for w in (tm.fp8_fits(c, fmt) for c in configs) if w), None)
        if why:
            raise ValueError(why)
    except ValueError as exc:
        warn_once(("moe-entry", key), f"hybridgemm: {key.to_string()}: {exc}; the MoE kernels' default configs run")
        return MoeDecision(tune_moe.BACKEND, defaults, f"{tail} has a bad config ({exc}); the default configs")
    return MoeDecision(tune_moe.BACKEND, configs, f"{tail}: triton_moe {configs}")


def explain_moe(tokens: int, w_gate_up_shape, top_k: int, dtype: torch.dtype = torch.bfloat16,
                activation: str = "silu", device: int | None = None, weight_format: str = "") -> str:
    """What :func:`moe` runs for ``tokens`` tokens, experts stacked as ``w_gate_up_shape``
    ([E, 2I, H]) and ``top_k`` experts per token, their weights in ``weight_format`` ("" for
    x's dtype, ``e4m3_channel`` or ``e4m3_block128``), and why (a table entry, the defaults, or
    the PyTorch loop without a GPU)."""
    if weight_format not in ("", *fp8.FORMAT_OF.values()):
        raise ValueError(f"explain_moe: weight_format must be '' or one of {sorted(fp8.FORMAT_OF.values())}, got "
                         f"{weight_format!r:.40}")
    e, two_i, h = (int(d) for d in w_gate_up_shape)
    if tokens < 1 or not 1 <= top_k <= e or two_i % 2 or min(e, two_i, h) < 1:
        raise ValueError(f"explain_moe: {tokens} tokens, experts {tuple(w_gate_up_shape)} ([E, 2I, H]) and top_k "
                         f"{top_k} do not fit")
    if activation not in GLU_FUNCTIONS:
        raise ValueError(f"explain_moe: activation {activation!r} is not one of {sorted(GLU_FUNCTIONS)}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"explain_moe: dtype must be a torch.dtype, got {dtype!r:.40}")
    if not torch.cuda.is_available():
        return "no CUDA device: the experts run as a PyTorch loop (experts_loop)"
    index = torch.cuda.current_device() if device is None else device
    return _decide(index, e, top_k, activation, dtype, two_i // 2, h, tokens, weight_format).why


def experts_loop(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up, w_down, activation: str) -> Tensor:
    """:func:`moe`'s computation in PyTorch (differentiable in x and the routing weights, and in
    weights of x's dtype): each expert that holds pairs, in expert order (an FP8 expert's weights
    dequantized to x's dtype); the per-pair results summed over the slots in fp32."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    out = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        gate, up = F.linear(x[pairs // k], _expert(w_gate_up, e, x.dtype)).chunk(2, dim=-1)
        y = F.linear(GLU_FUNCTIONS[activation](gate) * up, _expert(w_down, e, x.dtype))
        out[pairs] = (y * topk_weights.reshape(-1)[pairs, None]).float()  # in their promoted dtype, as transformers
    return out.view(t, k, -1).sum(dim=1).to(x.dtype)


def _expert(w, e: int, dtype: torch.dtype) -> Tensor:
    if isinstance(w, fp8.FP8Weight):
        return fp8.dequantize(w.data[e], w.scale[e], dtype)
    return w[e]


def _check(x, topk_ids, topk_weights, w_gate_up, w_down, activation) -> None:
    if x.dim() != 2:
        raise ValueError(f"moe: x must be [tokens, hidden], got {tuple(x.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, (Tensor, fp8.FP8Weight)):
            raise TypeError(f"moe: {name} must be a tensor or a stacked FP8Weight, got {type(w).__name__}")
        if isinstance(w, Tensor) and w.dtype in (fp8.E4M3, torch.float8_e5m2):
            raise ValueError(f"moe: {name} is {w.dtype} without scales: pass an FP8Weight (hybridgemm.quantize_fp8, "
                             "or FP8Weight.from_tensors for a checkpoint's data and scales)")
    if weight_format(w_gate_up) != weight_format(w_down):
        raise ValueError(f"moe: w_gate_up ({weight_format(w_gate_up) or 'not FP8'}) and w_down "
                         f"({weight_format(w_down) or 'not FP8'}) differ in weight format")
    if len(w_gate_up.shape) != 3 or len(w_down.shape) != 3:
        raise ValueError(f"moe: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} must be stacked "
                         "per expert ([E, 2I, H] and [E, H, I])")
    e, two_i, h = w_gate_up.shape
    if x.shape[1] != h or w_down.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"moe: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)} and w_down "
                         f"{tuple(w_down.shape)} do not fit ([T, H], [E, 2I, H], [E, H, I])")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [{x.shape[0]}, k]")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"moe: topk_ids must be integers, got {topk_ids.dtype}")
    # (checked where it costs no device sync; on CUDA an id past the experts fails the layout's
    # indexing with a device-side assertion)
    if not topk_ids.is_cuda and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e):
        raise ValueError(f"moe: topk_ids must lie in 0..{e - 1} (the experts)")
    if activation not in GLU_FUNCTIONS:
        raise ValueError(f"moe: activation {activation!r} is not one of {sorted(GLU_FUNCTIONS)}")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise ValueError(f"moe: x ({x.dtype}) and the expert weights ({w_gate_up.dtype}, {w_down.dtype}) differ in "
                         "dtype")
    why = fp8.gate_up_blocks_problem(two_i) if weight_format(w_gate_up) == fp8.FORMAT_OF["block128"] else None
    if why:
        raise ValueError(f"moe: {why}")




# ----------------------------------------------------------------------------- patched modules

@torch.library.custom_op("hybridgemm::moe_fwd", mutates_args=())
def moe_fwd(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
            activation: str, norm_weight: Tensor | None = None, eps: float = 0.0,
            residual: Tensor | None = None) -> Tensor:
    return moe(x, (topk_ids, topk_weights), w_gate_up, w_down, activation, norm=norm_of(norm_weight, eps),
               residual=residual)


@moe_fwd.register_fake
def _moe_fwd_fake(x, topk_ids, topk_weights, w_gate_up, w_down, activation, norm_weight=None, eps=0.0,
                  residual=None):
    return x.new_empty(x.shape)


def norm_of(norm_weight: Tensor | None, eps: float) -> tuple | None:
    """:func:`moe`'s ``norm`` from a custom op's two arguments."""
    return None if norm_weight is None else (norm_weight, eps)


def why_not_experts(mod) -> tuple[str | None, str | None]:
    """(activation, None) for a transformers experts module :class:`HybridExperts` computes
    (weights stacked as ``gate_up_proj`` [E, 2I, H], gate rows first, and ``down_proj``
    [E, H, I], no biases, the default gate, a GLU activation), (None, reason) for another
    transformers experts module, (None, None) for anything else."""
    t = type(mod)
    if not t.__module__.startswith("transformers") or not hasattr(mod, "has_gate") \
            or "gate_up_proj" not in mod._parameters:
        return None, None
    gu, down = mod._parameters.get("gate_up_proj"), mod._parameters.get("down_proj")
    # (transformers 5.8 sets neither has_post_expert_norm nor _is_expert_parallel: none of either)
    if getattr(mod, "_is_expert_parallel", False):
        return None, f"{t.__name__}: experts sharded over ranks (expert parallelism)"
    if getattr(mod, "has_bias", True) or not getattr(mod, "has_gate", False) or getattr(mod, "is_transposed", True) \
            or not getattr(mod, "is_concatenated", False) or getattr(mod, "has_post_expert_norm", False):
        return None, f"{t.__name__}: experts with biases, transposed or interleaved weights or a post-norm"
    if getattr(t._apply_gate, "__name__", "") != "_default_apply_gate":
        return None, f"{t.__name__}: its own gate function"
    if gu is None or down is None or gu.dim() != 3 or down.dim() != 3 or gu.shape[1] % 2 \
            or down.shape != (gu.shape[0], gu.shape[2], gu.shape[1] // 2) or len(mod._parameters) != 2:
        return None, f"{t.__name__}: weights not stacked as [E, 2I, H] and [E, H, I]"
    act = activation_name(getattr(mod, "act_fn", None))
    if act not in GLU_FUNCTIONS:
        return None, f"{t.__name__}: activation {type(getattr(mod, 'act_fn', None)).__name__} has no GLU epilogue"
    return act, None


class HybridExperts(torch.nn.Module):
    """Stands in for a transformers experts module (its class is swapped in place; its
    parameters stay): the routed experts by :func:`moe` (one custom op under torch.compile);
    where the kernels do not run (autograd, off CUDA, weights of another dtype or layout), the
    forward of the class it replaced (:meth:`unfused`); where they cannot compile for the GPU,
    :func:`experts_loop` (:meth:`add_to`)."""

    glu_activation = "silu"

    def expert_weights(self, dtype: torch.dtype) -> tuple:
        """(w_gate_up, w_down) as :func:`moe` takes them for activations of ``dtype``."""
        return self.gate_up_proj, self.down_proj

    def compiled_moe(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, norm_weight: Tensor | None = None,
                     eps: float = 0.0, residual: Tensor | None = None) -> Tensor:
        """:func:`moe` as one custom op (what torch.compile traces)."""
        return torch.ops.hybridgemm.moe_fwd(x, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                            self.glu_activation, norm_weight, eps, residual)

    def kernel_weights(self, x: Tensor, top_k_weights: Tensor) -> tuple | None:
        """``(w_gate_up, w_down)`` (:meth:`expert_weights`) where the MoE kernels run this call
        (CUDA, x of the weights' dtype, no gradient wanted); None where :meth:`forward` runs
        :meth:`unfused`."""
        if getattr(self, "_is_expert_parallel", False):
            raise RuntimeError(f"hybridgemm: {type(self).__name__} was patched, then sharded over ranks (expert "
                               "parallelism), which its kernels do not run; unpatch it (hybridgemm.unpatch) first")
        gu, down = self.expert_weights(x.dtype)
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or top_k_weights.requires_grad
                                                  or any(isinstance(w, Tensor) and w.requires_grad for w in (gu, down)))
        runs = not wants_grad and use_kernels(x) and x.dtype == gu.dtype == down.dtype \
            and _data(gu).is_contiguous() and _data(down).is_contiguous()
        return (gu, down) if runs else None

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        weights = self.kernel_weights(hidden_states, top_k_weights)
        if weights is None:
            return self.unfused(hidden_states, top_k_index, top_k_weights)
        return self.add_to(None, hidden_states, top_k_index, top_k_weights, weights)

    def unfused(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The experts where the kernels do not run: the forward of the transformers class
        ``patch`` replaced, so the output and gradients are the unpatched module's (the same
        operations on the same tensors), and torch.compile traces it as it traces that module
        (the experts implementation its config names: ``grouped_mm``, traced in one graph,
        ``batched_mm`` or the loop); :meth:`loop` for a module that no ``patch`` swapped."""
        stock = replaced_class(self)
        if stock is None:
            return self.loop(hidden_states, top_k_index, top_k_weights)
        return stock.forward(self, hidden_states, top_k_index, top_k_weights)

    def loop(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """:func:`experts_loop` over :meth:`expert_weights`."""
        gu, down = self.expert_weights(hidden_states.dtype)
        return experts_loop(hidden_states, top_k_index, top_k_weights, gu, down, self.glu_activation)

    def _apply_gate(self, gate_up: Tensor) -> Tensor:
        # transformers' grouped_mm and batched_mm forwards call it on the module (patch takes
        # only classes whose gate is transformers' default)
        return replaced_class(self)._apply_gate(self, gate_up)

    def add_to(self, residual: Tensor | None, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, weights: tuple,
               norm: tuple | None = None) -> Tensor:
        """``residual + experts(rmsnorm(x))`` by the kernels (:func:`moe`'s ``norm`` and
        ``residual``; None: that part left out), ``weights`` what :meth:`kernel_weights` gave."""
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        if torch.compiler.is_compiling():
            return self.compiled_moe(x, top_k_index, top_k_weights, norm_weight, eps, residual)
        from triton.errors import TritonError

        gu, down = weights
        try:
            return moe(x, (top_k_index, top_k_weights), gu, down, self.glu_activation, norm=norm, residual=residual)
        except TritonError as e:  # not compiled for this GPU: nothing was launched
            warn_once(("moe", tuple(gu.shape), gu.dtype), f"hybridgemm: the grouped MoE kernels could not run for "
                      f"experts of {tuple(gu.shape)} ({e}); these experts run in PyTorch")
        out = experts_loop(x if norm is None else prologue_norm(x, *norm), top_k_index, top_k_weights, gu, down,
                           self.glu_activation)
        return out if residual is None else residual + out


def _data(w) -> Tensor:
    return w.data if isinstance(w, fp8.FP8Weight) else w


__all__ = ["HybridExperts", "MoeDecision", "decision_for", "experts_loop", "explain_moe", "moe", "route",
           "why_not_experts"]
