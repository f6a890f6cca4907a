"""Running a linear call: ``fused_linear(x, weight, bias, activation)``, the forward GEMM
behind ``hybridgemm.linear`` and the attention projection.

Rules 1-3 of fusion/decide.py are applied here (argument checks; CPU tensors and dtypes no
kernel takes, and empty problems, go to PyTorch); every other call runs the decision that
module makes (``decide.choose``, or ``modes.batch_invariant_choice`` in batch_invariant
mode). Decisions are cached per (device, problem) and, for calls that need no copy, a
launcher per call signature (shapes, strides, dtypes, devices, alignment classes, math
flags); a repeated signature goes straight to its launcher. Both caches are kept per mode, so
switching modes never reuses a decision made in the other one; reloading the tables empties
them (``decide.on_change``), and :func:`generation` counts both events for callers that keep
launches of their own (fusion/eager_fast.py).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from hybridgemm.kernels import backends, cublaslt, fp8
from hybridgemm.kernels.bounded_cache import BoundedCache
from hybridgemm.kernels.checks import (
    PLAIN_TENSOR_TYPES,
    call_signature,
    check_gpu_kernel_args,
    contiguous_bias,
    kernel_form,
    linear_operands,
    row_major,
    rows_2d,
    rows_are_flat,
)
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import DTYPE_NAMES, MAX_ALIGNMENT, Problem, uses_tf32
from hybridgemm.kernels.process_memory import per_call

from . import decide, mode_state, modes
from .decide import Choice
from .diagnostics import warn_once
from .norm import forms_factor, prologue_norm, prologue_operand

CACHE_SIZE = 1024
# An FP8 weight's fused pieces (Q/K/V, gate/up) keep the RMSNorm in split-K's prologue unless
# this is set (read at import): then the norm runs apart, one launch before the GEMM, as for a
# bf16 weight whose config the prologue does not fit. scripts/fp8_prologue_probe.py times both.
FP8_NORM_APART = os.environ.get("HYBRIDGEMM_FP8_NORM_APART", "0") == "1"
WHO = "hybridgemm.linear"  # the name errors give: hybridgemm.linear is what callers call


def torch_linear(x, weight, bias, activation: Activation) -> torch.Tensor:
    """The reference path: F.linear then the activation (CPU tensors, unsupported dtypes)."""
    return apply_activation(F.linear(x, weight, bias), activation)


def other_form(x, weight, bias, activation: Activation, run) -> torch.Tensor:
    """A call in one of F.linear's forms other than the kernels' (weight (N, K), bias (N,) or
    None): checked and brought to that form (kernels/checks.py ``linear_operands``), computed
    by ``run(x, weight, bias)``, and the result shaped as F.linear's; or, where only F.linear's
    own broadcasting says what the call means, F.linear then the activation."""
    operands = linear_operands(x, weight, bias, WHO)
    if operands is None:
        return torch_linear(x, weight, bias, activation)
    x, weight, bias, squeeze = operands
    y = run(x, weight, bias)
    return y.squeeze(-1) if squeeze else y


class _Bounded(BoundedCache):
    mode = mode_state.DEFAULT  # the dispatch mode whose decisions this cache holds

    def __init__(self):
        super().__init__(CACHE_SIZE)


def _mode_caches(mode: str) -> tuple[_Bounded, _Bounded]:
    choices, fast = _Bounded(), _Bounded()
    choices.mode = fast.mode = mode
    return choices, fast


# Module state, in decide's style (containers changed in place, scalars in one-element lists).
# Per mode: (decisions per (device, problem), launchers per call signature). ``_launchers[0]``
# is the current mode's launcher cache: the hot path reads it once and the slow path works
# with that cache's ``.mode``, so a call racing a mode switch stays within one mode's decisions.
_MODE_CACHES = {m: _mode_caches(m) for m in mode_state.MODES}
_launchers = [_MODE_CACHES[mode_state.get_mode()][1]]
_generation = [0]  # see generation()


def _decisions_changed(mode: str, tables_reloaded: bool) -> None:
    """decide's change hook (run under its lock): the new mode's caches become current; a
    reload empties every mode's."""
    if tables_reloaded:
        for caches in _MODE_CACHES.values():
            for cache in caches:
                cache.clear()
        _fusable.clear()
        _bound_splitk.clear()
    _launchers[0] = _MODE_CACHES[mode][1]
    _generation[0] += 1


decide.on_change(_decisions_changed)


def generation() -> int:
    """Bumped whenever cached decisions become invalid (tables reloaded, mode switched)."""
    return _generation[0]


def _runner(choice: Choice):
    if choice.source == modes.SOURCE:
        return modes.run  # the tiled kernel, in row chunks past 32-bit offsets
    return backends.get_backend(choice.backend).run


def _run_choice(choice: Choice, x2, w2, b2, out, act, tf32) -> None:
    if choice.backend == "torch":
        out.copy_(torch_linear(x2, w2, b2, act))
        return
    _runner(choice)(choice.config, x2, w2, b2, out, act, tf32)


def _bindable(choice: Choice, x, w, b) -> bool:
    """Can calls of this signature skip every copy (x's rows flat, W row-major, the bias
    unit-stride and 16-byte aligned) and run the chosen kernel as it is?"""
    if choice.backend == "torch" or not rows_are_flat(x) or w.stride(1) != 1:
        return False
    n, k = w.shape
    return not ((n > 1 and w.stride(0) < k) or (b is not None and (b.stride(0) != 1 or b.data_ptr() % 16)))


def _raw_launch(choice: Choice, x2, w2, b2, out, act, tf32):
    """The backend's ``fn(xp, wp, bp, op)`` for this signature (see Backend.bind), or None."""
    if choice.source == modes.SOURCE:
        return None  # batch-invariant runs go through modes.run (row chunks)
    bind = backends.get_backend(choice.backend).bind
    return None if bind is None else bind(choice.config, x2, w2, b2, out, act, tf32)


def _torch_launcher(act: Activation):
    def launch_torch(x, w, b, xp, wp):
        return torch_linear(x, w, b, act)

    return launch_torch


def _launcher(choice: Choice, x, w, b, act, tf32, raw=None):
    """A no-checks callable for calls with this exact signature (the caller has checked
    :func:`_bindable`): ``raw`` wrapped with the output allocation when there is one."""
    n, k = w.shape
    m = x.numel() // k
    out_shape = (*x.shape[:-1], n)
    if raw is not None:
        def launch_raw(x, w, b, xp, wp):
            out = x.new_empty(out_shape)
            raw(xp, wp, 0 if b is None else b.data_ptr(), out.data_ptr())
            return out

        return launch_raw
    if choice.backend == "cublaslt":
        return cublaslt.launcher_for(x, w, b, act, choice.config)
    run, cfg = _runner(choice), choice.config

    def launch(x, w, b, xp, wp):
        out = x.new_empty((m, n))  # x's dtype and device; cheaper than torch.empty(dtype=, device=)
        run(cfg, x.reshape(m, k), w, b, out, act, tf32)
        return out.view(out_shape)

    return launch


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation=None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` for any leading dims of ``x``, on the chosen backend, with
    F.linear's argument forms and errors (see ``hybridgemm.linear``)."""
    if x.device.type != "cuda" or x.dtype not in DTYPE_NAMES:
        linear_operands(x, weight, bias, WHO)  # F.linear's rules, hybridgemm's messages; F.linear takes the rest
        return torch_linear(x, weight, bias, Activation.parse(activation))
    key, xp, wp = call_signature(x, weight, bias, activation)
    fast = _launchers[0]
    fn = fast.get(key)
    if fn is not None:
        return fn(x, weight, bias, xp, wp)
    return _fused_linear_slow(x, weight, bias, activation, key, fast.mode)[0]


def fused_linear_and_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            activation=None):
    """``(y, raw)``: ``y = fused_linear(x, weight, bias, activation)`` and the kernel that
    computed it as ``raw(xp, wp, bp, op)`` (raw data pointers, ``bp`` 0 without a bias; the
    output (M, N) row-major at ``op``), valid for later calls with operands of exactly this
    signature (shapes, strides, dtypes, devices, alignment classes) while :func:`generation`
    is unchanged; ``raw`` is None where no such launch exists (PyTorch computes it, a copy
    is needed, a backend without raw launches). For callers that keep their own per-signature
    cache and allocate the output in their own layout (the attention projection)."""
    if x.device.type != "cuda" or x.dtype not in DTYPE_NAMES:
        return fused_linear(x, weight, bias, activation), None
    return _fused_linear_slow(x, weight, bias, activation, None, _launchers[0].mode)


def _decision(problem: Problem, dev: int, mode: str) -> Choice:
    """The mode's decision for ``problem`` on device ``dev``, cached per (device, problem)."""
    choices = _MODE_CACHES[mode][0]
    choice = choices.get((dev, problem))
    if choice is None:
        invariant = mode == modes.BATCH_INVARIANT
        backends.warn_unavailable_once(stacklevel=5)
        with torch.cuda.device(dev):
            if problem.weight_format:  # FP8: the batch-invariant mode runs the dequantized weight's path
                choice = decide.fallback_rule(problem, "batch_invariant mode: dequantize, then the invariant "
                                              "path") if invariant else decide.choose_fp8(problem, dev)
            else:
                choice = modes.batch_invariant_choice(problem, dev) if invariant else decide.choose(problem, dev)
        if invariant and choice.backend == "torch":
            warn_once(("invariant", problem.n, problem.k, problem.dtype),
                      f"hybridgemm: batch_invariant mode cannot run {choice.key} on Triton; {choice.reason}")
        if not choice.provisional:
            choices.put((dev, problem), choice)
    return choice


def decision_for(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                 activation=None, weight_format: str = "", *, fresh_x: bool = False) -> Choice:
    """What the current mode runs for ``out = act(x2 @ weight.T + bias)`` (x2 (M, K) and
    ``weight`` row-major, ``out`` (M, N) contiguous, CUDA, a kernel dtype): the decision
    :func:`fused_linear` takes for these operands, for callers that fuse more around the same
    GEMM (:func:`fused_splitk`) and for FP8 weights (``weight_format``, fusion/fp8_linear.py).
    ``fresh_x``: x2 stands for a tensor of its shape not yet formed, which would be a fresh
    contiguous allocation (its row stride K, its start aligned as the allocator aligns it)."""
    problem = Problem.from_tensors(x2, weight, bias, out, Epilogue(Activation.parse(activation), bias is not None),
                                   uses_tf32(x2.dtype), weight_format)
    if fresh_x:
        problem = dataclasses.replace(problem, ldx=problem.k, align_x=MAX_ALIGNMENT)
    dev = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    return _decision(problem, dev, _launchers[0].mode)


def _fused_linear_slow(x, weight, bias, activation, fast_key, mode: str):
    """A call whose signature has no cached launcher: checks, the (cached) decision, the run.
    Returns ``(y, raw)`` as :func:`fused_linear_and_launch` does; caches a launcher under
    ``fast_key`` (None: none) where the call needed no copy."""
    act = Activation.parse(activation)
    if not kernel_form(weight, bias):  # never cached under fast_key: its views are made per call
        return other_form(x, weight, bias, act, lambda x, w, b: _fused_linear_slow(x, w, b, act, None, mode)[0]), None
    choices, fast = _MODE_CACHES[mode]
    invariant = mode == modes.BATCH_INVARIANT
    check_gpu_kernel_args(x, weight, bias, WHO)
    lead = x.shape[:-1]
    n, k = weight.shape
    x2 = row_major(rows_2d(x))
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch_linear(x, weight, bias, act), None
    w2, b2 = row_major(weight), contiguous_bias(bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tf32 = uses_tf32(x.dtype)
    problem = Problem.from_tensors(x2, w2, b2, out, Epilogue(act, bias is not None), tf32)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    choice = _decision(problem, dev, mode)
    if choice.backend == "torch":  # F.linear itself: no output of ours to fill, no copy
        if fast_key is not None and not choice.provisional:
            fast.put(fast_key, _torch_launcher(act))
        return torch_linear(x, weight, bias, act), None
    copied = invariant and choice.backend == "triton_gemm" and modes.needs_dense_x(choice.config, x2)
    if copied:  # one load path for every call: copy an x that TMA cannot describe
        x2 = x2.clone(memory_format=torch.contiguous_format)
    try:
        _run_choice(choice, x2, w2, b2, out, act, tf32)
    except ValueError as e:  # e.g. cuBLASLt has no algorithm for these alignments
        warn_once(("run", problem), f"hybridgemm: {choice.backend} could not run {choice.key} ({e}); "
                  "computing this shape with PyTorch" + (" (NOT batch-invariant)" if invariant else ""))
        choice = Choice("torch", None, "rule", choice.key, f"{choice.backend} failed: {e}")
        choices.put((dev, problem), choice)
        out = torch_linear(x2, w2, b2, act)
    raw = None
    if not copied and _bindable(choice, x, weight, bias):
        raw = _raw_launch(choice, x2, w2, b2, out, act, tf32)
        launcher = _launcher(choice, x, weight, bias, act, tf32, raw)
        if launcher is not None and fast_key is not None:
            fast.put(fast_key, launcher)
    return out.reshape(*lead, n), raw


# ------------------------------------------------------------- GEMMs with fusions around them
# The decode step's GEMMs (fusion/models/fused_pieces.py) carry work around the GEMM: an RMSNorm
# prologue, a residual add, the rotary embedding and the KV-cache write. They are decided here
# like any other call (the table's decision for the bare GEMM; the gated rule for gate/up) and
# launched here; where the decision is a kernel that cannot carry the fusion, these return None
# and the caller computes the same thing unfused.

_SPLITK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FUSION_NAMES = {"norm": "norm", "residual": "residual", "rope": "rotary/KV-cache", "weight_scale": "FP8 weight",
                 "glu": "GLU product", "residual_scale": "residual scale", "residual2": "second residual",
                 "second": "second product"}


def splitk_config(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  weight_format: str = ""):
    """The Triton split-K config the current mode runs for ``out = x2 @ weight.T + bias``, or
    None where it runs another backend (or PyTorch computes it: CPU tensors, other dtypes).
    ``weight_format``: ``weight`` is FP8 in that format (kernels/fp8.py)."""
    if not x2.is_cuda or x2.dtype not in _SPLITK_DTYPES or (weight.dtype != x2.dtype and not weight_format):
        return None
    choice = decision_for(x2, weight, bias, out, weight_format=weight_format)
    return choice.config if choice.backend == "triton_splitk" and choice.config is not None else None


_fusable: BoundedCache = BoundedCache(4096)  # (device, problem) -> the fused piece's Choice


def fusable_splitk_config(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor):
    """For a GEMM that carries fused work, where :func:`splitk_config` gives none: the split-K
    candidate the tuner timed tied with the table's winner (``decide.choose_fusable``; default
    mode, CUDA, weights of x's dtype), or None. Cached per device and problem, and dropped with
    the plain decisions when the tables are reloaded."""
    if not x2.is_cuda or x2.dtype not in _SPLITK_DTYPES or weight.dtype != x2.dtype \
            or _launchers[0].mode != mode_state.DEFAULT:
        return None
    problem = Problem.from_tensors(x2, weight, bias, out, Epilogue(Activation.parse(None), bias is not None),
                                   uses_tf32(x2.dtype))
    dev = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    found = _fusable.get((dev, problem))
    if found is None:
        with torch.cuda.device(dev):
            found = decide.choose_fusable(problem, dev)
        if not found.provisional:
            _fusable.put((dev, problem), found)
    return found.config if found.backend == "triton_splitk" and found.config is not None else None


def _tiles_within_heads(config, head_dim: int, rotated: int, pairs: bool = False):
    """``config`` with tiles narrow enough for the rotary epilogue's heads: the rotary pairs
    columns within one head, so a tile must not span two (a head of 96, Phi-3's, under a tuned
    tile of 64 columns: tiles of 32), and the ``rotated`` columns of a head (a partial rotary)
    must fill whole tiles or a tile whole groups of them (``pairs``, neighbouring columns paired:
    whole tiles only). The other fields are the tuned ones. None where no power-of-two tile of
    16 or more fits (StableLM-3B's heads of 80 rotated over 20 columns): the caller computes it
    unfused."""
    def fits(block_n):
        return head_dim % block_n == 0 and rotated > 0 and \
            (rotated % block_n if block_n <= rotated else pairs or block_n % rotated) == 0

    block_n = config.block_n
    while block_n > 16 and not fits(block_n):
        block_n //= 2
    if not fits(block_n):
        return None
    return config if block_n == config.block_n else dataclasses.replace(config, block_n=block_n)


# An eager decode step calls the same few fused GEMMs at every token (O and down with their
# residual, the LayerNorm families' Q/K/V, a norm prologue): the decision, the plan and the
# checks of a call signature do not change from one token to the next, only the pointers. The
# first call of a signature runs the general path below and binds the launch it made
# (triton_splitk.bind); later calls of exactly that signature launch it with their pointers.
_bound_splitk: BoundedCache = BoundedCache(4096, lru=True)  # (layers x row counts: the ones in use stay)


def _bound_key(x, weight, bias, keep_prologue: bool, fusion: dict):
    """The signature a bound eager fused split-K launch is valid for, or None where the call
    takes the general path every time: not CUDA, tensor subclasses, autograd wanted, autocast,
    a non-contiguous operand, a bias off 16-byte alignment (the general path aligns a copy), a
    residual on another device, the rotary epilogue. The weight, bias and norm weight are keyed
    by data pointer (a weight replaced is a miss, never a stale read); x and the residual by
    layout and alignment class; the tables' generation and the mode, as every cached decision
    is."""
    if not fusion.keys() <= {"residual", "norm", "residual_scale", "residual2"} or type(x) not in PLAIN_TENSOR_TYPES \
            or type(weight) not in PLAIN_TENSOR_TYPES or not x.is_cuda:
        return None
    residual, norm, residual2 = fusion.get("residual"), fusion.get("norm"), fusion.get("residual2")
    tensors = (x, weight, bias, residual, None if norm is None else norm[0], residual2)
    if any(t is not None and (type(t) not in PLAIN_TENSOR_TYPES or not t.is_contiguous()) for t in tensors):
        return None
    if (bias is not None and bias.data_ptr() % 16) or any(r is not None and r.device != x.device
                                                           for r in (residual, residual2)):
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    if torch.compiler.is_compiling() or torch.is_autocast_enabled("cuda"):
        return None
    g, eps, offset = (*norm, None)[:3] if norm is not None else (None, None, None)
    if g is not None and forms_factor(g, offset, x.dtype):
        return None  # (a factor formed per call: a bound launch would read the weight instead)
    return (x.shape, x.dtype, x.device.index, x.data_ptr() % 16, weight.data_ptr(), weight.shape, weight.dtype,
            None if bias is None else (bias.data_ptr(), bias.dtype, bias.shape),
            None if residual is None else (residual.shape, residual.dtype, residual.data_ptr() % 16),
            None if residual2 is None else (residual2.shape, residual2.dtype, residual2.data_ptr() % 16),
            None if g is None else (g.data_ptr(), g.dtype, g.shape, eps, offset),
            fusion.get("residual_scale"), keep_prologue, uses_tf32(x.dtype), _generation[0], _launchers[0].mode)


def _bound_call(launch, n: int):
    """``fn(x, weight, bias, fusion)``: the output allocated, ``launch`` with the call's pointers."""
    def call(x, weight, bias, fusion):
        out = x.new_empty((*x.shape[:-1], n))
        residual, norm, residual2 = fusion.get("residual"), fusion.get("norm"), fusion.get("residual2")
        launch(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
               0 if norm is None else norm[0].data_ptr(), 0 if residual is None else residual.data_ptr(),
               0 if residual2 is None else residual2.data_ptr())
        return out

    return call


def fused_splitk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 counters: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                 keep_prologue: bool = False, **fusion) -> torch.Tensor | None:
    """``linear(x, weight, bias)`` with ``fusion`` (split-K's ``norm=(g, eps[, offset])``: a norm
    operand, norm.norm_operand; ``residual=``, ``rope=``; ``glu=`` an activation name: ``weight``
    is a stacked [gate; up] and the result ``glu(gate) * up``, N / 2 wide; ``second=(x2, weight2, bias2)``:
    ``x2 @ weight2.T + bias2`` summed in, its K split in the same extent as the bare GEMM's
    config splits K, weights of x's dtype) in one launch, where the decision for
    the bare GEMM is Triton split-K (or, with a
    fusion, the table holds a split-K candidate tied with its winner: :func:`fusable_splitk_config`);
    the norm in a launch of its own before it (``norm.prologue_norm``: one Triton launch, Llama's
    formula or Gemma's / OLMo 2's fp32 factor) where its config is not one the prologue fits
    (``triton_splitk.prologue_fits``); for an FP8 weight only with ``HYBRIDGEMM_FP8_NORM_APART=1``
    (:data:`FP8_NORM_APART`), else its path keeps the prologue; never with ``keep_prologue``
    (eager decode: host-bound, where the launch apart costs host time and the prologue's GPU time
    hides behind it);
    None where it is not, where no tile fits a ``rope``'s heads and rotated columns
    (:func:`_tiles_within_heads`), or where the kernel refuses the fusion (warned once per shape,
    as a refused table entry is): the caller then computes it unfused. ``counters``: zeroed int32 arrival
    counters for the fused reduction, used by one launch at a time. ``weight_scale``: ``weight``
    is e4m3 with these scales (kernels/fp8.py scale_vector's layout). Calls without rotary, GLU or
    FP8 weight, outside compiled regions or there without ``counters``, launch their
    signature's bound launch from the second call on (:func:`_bound_key`)."""
    # (eager calls ignore the layer's counters: triton_scratch.plan_scratch)
    bound_key = None if (counters is not None and per_call()) or weight_scale is not None else \
        _bound_key(x, weight, bias, keep_prologue, fusion)
    if bound_key is not None:
        call = _bound_splitk.get(bound_key)
        if call is not None:
            return call(x, weight, bias, fusion)
    norm_asked = "norm" in fusion
    n = weight.shape[0]
    x2, w2, b2 = row_major(rows_2d(x)), row_major(weight), contiguous_bias(bias)
    out = x.new_empty((x2.shape[0], n))  # the bare GEMM's output, which its decision is for
    weight_format = "" if weight_scale is None else fp8.FORMAT_OF[fp8.granularity_of(weight, weight_scale)]
    config = splitk_config(x2, w2, b2, out, weight_format)
    if config is None and fusion and weight_scale is None:
        config = fusable_splitk_config(x2, w2, b2, out)
    if config is None:
        return None
    if fusion.get("glu") is not None:
        n //= 2
        out = x.new_empty((x2.shape[0], n))
        if config.split_k > 1 and not config.fused_reduce:
            # the epilogue needs a tile's sums in one program: the single-pass reduction adds
            # the same partials in the same order, so the bits are the two-launch path's
            config = dataclasses.replace(config, fused_reduce=True)
    rope = fusion.get("rope")
    if rope is not None:
        config = _tiles_within_heads(config, rope.head_dim, rope.cos.shape[-1], rope.pairs)
        if config is None:
            return None
    norm = fusion.get("norm")
    if norm is not None:
        g, eps, offset = (*norm, None)[:3]
        apart = False
        if weight_scale is not None and not keep_prologue:
            apart = FP8_NORM_APART
        elif not keep_prologue:
            splitk = triton_module("triton_splitk")
            try:
                launched = config if rope is None else splitk.rope_config(config, rope, x2, w2)
            except ValueError:  # no whole-head config: the launch below refuses it, warned
                launched = config
            apart = not splitk.prologue_fits(launched, x2.element_size())
        if apart:
            # the prologue would cost about a second GEMM with this config: normalise first, as
            # the unfused piece does, in a launch of its own
            x2 = row_major(rows_2d(prologue_norm(x, g, eps, offset)))
            del fusion["norm"]
        else:
            fusion["norm"] = prologue_operand(g, eps, offset, x.dtype)
    if weight_scale is not None:
        fusion["weight_scale"] = weight_scale
    for name in ("residual", "residual2"):
        if name in fusion:
            fusion[name] = row_major(rows_2d(fusion[name]))
    if "second" in fusion:
        sx, sw, sb = fusion["second"]
        fusion["second"] = (row_major(rows_2d(sx)), row_major(sw), contiguous_bias(sb))
    splitk = backends.get_backend("triton_splitk")
    try:
        splitk.run(config, x2, w2, b2, out, None, uses_tf32(x.dtype), counters=counters, **fusion)
    except ValueError as e:
        warn_once(("fused_splitk", tuple(weight.shape), x.dtype, tuple(fusion)),
                  f"hybridgemm: split-K could not run the {'/'.join(_FUSION_NAMES[f] for f in fusion)} fusion "
                  f"for a {tuple(weight.shape)} weight ({e}); that part runs unfused")
        return None
    if bound_key is not None and ("norm" in fusion) == norm_asked:  # (not with the norm taken apart)
        launch = splitk.bind(config, x2, w2, b2, out, None, uses_tf32(x.dtype), **fusion)
        if launch is not None:
            _bound_splitk.put(bound_key, _bound_call(launch, n))
    return out.view(*x.shape[:-1], n)


def gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
          norm: tuple | None = None, keep_prologue: bool = False) -> torch.Tensor | None:
    """``act(x' @ Wg.T + bg) * (x' @ Wu.T + bu)`` over the stacked ``weight`` = cat([Wg, Wu]),
    x' = ``rmsnorm(x)`` with ``norm=(g, eps[, offset])`` (a norm operand, norm.norm_operand)
    else x, in one launch of the gated kernel where :func:`decide.choose_gated` picks it, with
    its config; None where it does not (the caller composes it: the norm apart, then
    :func:`hybridgemm.gated_linear`). With a norm and ``keep_prologue`` (eager decode, as
    :func:`fused_splitk`'s), where the table's entry takes the norm apart the kernel runs with
    the norm in its prologue and its rule's config instead: one launch where the entry's
    choice is two."""
    g, eps, offset = (*norm, None)[:3] if norm is not None else (None, 0.0, None)
    choice = decide.choose_gated(x, weight, bias, g, fp32_factor=offset is not None)
    if keep_prologue and g is not None and choice.backend != "triton_glu":
        choice = decide.choose_gated(x, weight, bias, g, tuned=False, fp32_factor=offset is not None)
    if choice.backend != "triton_glu":
        return None
    kernel_norm = None if g is None else prologue_operand(g, eps, offset, x.dtype)
    return triton_module("triton_glu").glu(x, weight, bias, activation, norm=kernel_norm, config=choice.config)
