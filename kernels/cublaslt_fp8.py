"""FP8 prefill GEMM through cuBLASLt on Hopper: ``out = act(x @ W.T + b)`` with W an e4m3 weight
(kernels/fp8.py) and x quantized to e4m3 on the fly (kernels/fp8_quant.py, one Triton launch),
then one cuBLASLt matmul on the FP8 tensor cores with both operands' scales applied inside it.

Layout, as in the bf16 forward (kernels/cublaslt.py): cuBLASLt is column-major, so
``D (N, M) = op(A) @ B`` with A = W8 seen as a (K, N) matrix, transposed; B = x8 seen as
(K, M); D = out seen as (N, M). FP8 kernels take exactly this "TN" form on Hopper, compute type
32F, scale type 32F, and 16-byte aligned pointers and leading dimensions (cuBLAS docs,
cublasLtMatmul(), "To use tensor- or block-scaled FP8 kernels"): hence K % 16 == 0 (rows of
W8 and x8) and N % 8 == 0 (rows of the 2-byte output).

Scales (cuBLAS docs §3.1.4.3 "Outer vector scaling" and §3.1.4.5 "128-element 1D and 128x128
2D block scaling"; attributes CUBLASLT_MATMUL_DESC_A_SCALE_MODE = 31 and B_SCALE_MODE = 32,
modes as nvmath.bindings.cublasLt.MatmulMatrixScale numbers them):

- ``channel`` weights: A and B ``OUTER_VEC_32F`` (3): one fp32 per row of op(A), i.e. per
  output feature (N of them), and one per column of B, i.e. per token (M): x is quantized per
  token.
- ``block128`` weights: A ``BLK128x128_32F`` (5), B ``VEC128_32F`` (4): x quantized per 1x128
  block. Layouts (§3.1.4.5.1): A's scales K-major, shape L4 x ceil(N/128) with the stride between
  consecutive columns a multiple of 4 (L = ceil(K/128) rounded up to L4): the weight's (nb, L)
  scales with a row stride that is a multiple of 4 (:func:`weight_scale_operand`). B's scales
  N-major, shape N x L: the (L, M) buffer fp8_quant writes. "M and N must be multiples of 4":
  the token count M is cuBLASLt's N here, so x is quantized into M rounded up to 4 rows (the
  extra rows zeros) and the GEMM writes a scratch output that is copied into ``out``.

Both modes need cuBLASLt 12.9 or later and compute capability 9.0: the cuBLAS 12.9 release
added them for Hopper; Ada (8.9) has FP8 tensor cores with tensor-wide scales only, and
Blackwell's block-scaled FP8 is the MX formats (:func:`check`). Elsewhere the caller falls back
to dequantize + the bf16 GEMM.

Epilogue: the bias (of out's dtype: CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE), relu and the tanh GELU
run in cuBLASLt's epilogue (the FP8 table of cublasLtMatmul() lists bias epilogues for D bf16 and
fp16). Where cuBLASLt has no algorithm with the activation fused for a problem, and always for the
exact (erf) GELU, which cuBLASLt does not have, the GEMM runs with the bias only and the
activation runs after it on the rounded output, with torch's ops (as ``F.gelu(F.linear(...))``
would; the pre-activation is rounded once more than in a fused epilogue).

Accumulation: per-channel plans take the tensor cores' own accumulation (the descriptor's
FAST_ACCUM on, :data:`FAST_ACCUM`); block-scaled plans have cuBLAS promote the partial sums into
fp32 as it goes, which those scale modes require. On an H100 at M = 2048 (Llama-3-8B's four
projections, scripts/fp8_accum_probe.py, perf/results/h100/README.md) the fast setting is
1.09-1.23x faster and its error against an fp64 product of the same e4m3 operands is 2.1e-3 to
3.3e-3 relative, against 1.7e-3 promoted (the bf16 rounding of the output), an order below what
quantizing the activations to e4m3 costs (2.6e-2). Set :data:`FAST_ACCUM` False before the first
call for promoted per-channel plans. Plans (kernels/cublaslt_plan.Plan with e4m3 A and B layouts
and the scale modes) live in a bounded LRU cache per operand signature; the scale pointers are
descriptor attributes, set when they change, under a lock. :func:`run_and_bind` also returns a
:class:`BoundRun`: the call's quantization launcher and plan, which later calls of the same
signature launch with their own pointers and none of the checks (its caller keys it,
:data:`BOUND_RUNS`). Nothing here touches a GPU, nor imports Triton, at import time.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .bounded_cache import BoundedCache
from .checks import contiguous_bias
from .cublaslt import _EPILOGUE_NAMES as EPILOGUE_NAMES
from .cublaslt import heuristic_workspace_bytes
from .cublaslt_plan import GemmSpec, Plan
from .cublaslt_runtime import (
    CUDA_DTYPE,
    OP_N,
    OP_T,
    CublasLtUnavailable,
    CublasLtUnsupported,
    bindings,
    cublaslt_version,
    set_attr,
)
from .epilogue import Activation, apply_activation
from .fp8 import FORMAT_OF, GRANULARITY_OF_FORMAT, OUT_DTYPES, granularity_of
from .problem import MAX_ALIGNMENT, dtype_name, pointer_alignment

CUDA_R_8F_E4M3 = 28  # cudaDataType_t of A and B (nvmath.CudaDataType.CUDA_R_8F_E4M3)
MIN_CUBLASLT = 120900  # cuBLASLt 12.9: the outer-vector and 128-block FP32 scale modes
HOPPER = 9  # compute capability major these scale modes run on
# granularity -> (A = weight, B = activations) MatmulMatrixScale names, and how x is grouped
BLOCK_SCALE_MODES = {"BLK128x128_32F", "VEC128_32F"}
FAST_ACCUM = True  # per-channel plans: the tensor cores' own accumulation (no fp32 promotion)
SCALE_MODES = {"channel": ("OUTER_VEC_32F", "OUTER_VEC_32F"), "block128": ("BLK128x128_32F", "VEC128_32F")}
ACTIVATION_GROUP = {"channel": "token", "block128": "block128"}
PLAN_CACHE_SIZE = 256


def _version_text(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def environment(device_index: int | None = None) -> tuple[bool, str]:
    """Can this machine run the FP8 scale modes at all? (ok, reason): a CUDA device of compute
    capability 9.x, nvmath-python's cuBLASLt bindings, cuBLASLt ≥ 12.9."""
    if not torch.cuda.is_available():
        return False, "the FP8 cuBLASLt path needs a CUDA device"
    cap = tuple(torch.cuda.get_device_capability(device_index))
    where = f"compute capability {cap[0]}.{cap[1]}"
    if cap < (8, 9):
        return False, f"{where} has no FP8 tensor cores (8.9 or later has them)"
    if cap[0] != HOPPER:
        return False, (f"{where}: cuBLASLt's per-channel (OUTER_VEC_32F) and 128-block (VEC128_32F, "
                       "BLK128x128_32F) FP8 scale modes run on Hopper (9.0) only")
    try:
        bindings()
    except CublasLtUnavailable as e:
        return False, str(e)
    version = cublaslt_version()
    if version is None:
        return False, "cuBLASLt could not be loaded"
    if version < MIN_CUBLASLT:
        return False, (f"cuBLASLt {_version_text(version)} lacks the outer-vector and 128-block FP8 scale "
                       f"modes (cuBLASLt {_version_text(MIN_CUBLASLT)} or later has them)")
    return True, ""


def check(n: int, k: int, dtype: torch.dtype, granularity: str, device_index: int | None = None) -> tuple[bool, str]:
    """Can this path run W (N, K) of ``granularity`` with activations and output of ``dtype``?
    (ok, reason): the shape and dtype rules first, then :func:`environment`."""
    if granularity not in SCALE_MODES:
        return False, f"granularity must be one of {tuple(SCALE_MODES)}, got {granularity!r}"
    if dtype not in OUT_DTYPES:
        return False, f"the FP8 path computes in bfloat16 or float16, got {dtype}"
    if n < 1 or k < 1:
        return False, "empty problem (handled without a GEMM)"
    if k % 16:
        return False, f"K={k} is not a multiple of 16: cuBLASLt's FP8 kernels need 16-byte aligned rows of W and x"
    if n % 8:
        return False, f"N={n} is not a multiple of 8: cuBLASLt's FP8 kernels need 16-byte aligned output rows"
    return environment(device_index)


def supports(problem) -> tuple[bool, str]:
    """(ok, reason) for a kernels.problem.Problem whose ``weight_format`` names an FP8 format
    (kernels/fp8.py FORMAT_OF): :func:`check` plus the leading dimensions and alignments."""
    fmt = getattr(problem, "weight_format", "")
    granularity = GRANULARITY_OF_FORMAT.get(fmt)
    if granularity is None:
        return False, f"weight format {fmt!r} is not one this path runs ({', '.join(FORMAT_OF.values())})"
    if problem.m < 1:
        return False, "empty problem (handled without a GEMM)"
    if problem.ldw % 16 or problem.align_w < 16:
        return False, f"W's rows must be 16-byte aligned for FP8 (ld {problem.ldw}, alignment {problem.align_w})"
    if (problem.m > 1 and problem.ldo % 8) or problem.align_out < 16:
        return False, f"out's rows must be 16-byte aligned (ld {problem.ldo}, alignment {problem.align_out})"
    return check(problem.n, problem.k, problem.dtype, granularity)


def is_available() -> bool:
    return environment()[0]


def weight_scale_operand(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """The weight's scales as cuBLASLt reads them: ``channel`` a contiguous (N,) vector;
    ``block128`` the (nb, L) scales with a row stride that is a multiple of 4 (BLK128x128_32F),
    as they are where they already are, else copied into an (nb, L4) buffer and returned as its
    (nb, L) view. Both 16-byte aligned. Call it once per weight to spare :func:`run` the copy."""
    if granularity == "channel":
        scale = scale.reshape(-1).contiguous()
    else:
        nb, nk = scale.shape
        if scale.stride(1) != 1 or (nb > 1 and scale.stride(0) % 4):
            padded = torch.zeros((nb, nk + (-nk) % 4), dtype=scale.dtype, device=scale.device)  # padding: never read
            padded[:, :nk] = scale
            scale = padded[:, :nk]
    return scale if scale.data_ptr() % 16 == 0 else weight_scale_operand(scale.clone(), granularity)


class ScaledPlan(Plan):
    """A :class:`Plan` whose A and B are e4m3 with per-row/per-block fp32 scales (``modes``: the
    MatmulMatrixScale names of A and B); ``bias_dtype`` the epilogue's bias type, None without."""

    def __init__(self, spec: GemmSpec, device_index: int, what: str, modes: tuple[str, str],
                 bias_dtype: torch.dtype | None):
        super().__init__(spec, device_index, what)
        lt = self._lt
        # The base made every layout in the output's type; A and B are e4m3.
        for name, dims in (("adesc", spec.a), ("bdesc", spec.b)):
            lt.matrix_layout_destroy(getattr(self, name))
            setattr(self, name, lt.matrix_layout_create(CUDA_R_8F_E4M3, *dims))
        D, S, set_desc = lt.MatmulDescAttribute, lt.MatmulMatrixScale, lt.matmul_desc_set_attribute
        set_attr(set_desc, self.desc, D.A_SCALE_MODE, int(S[modes[0]]), np.int32)
        set_attr(set_desc, self.desc, D.B_SCALE_MODE, int(S[modes[1]]), np.int32)
        fast = FAST_ACCUM and not (set(modes) & BLOCK_SCALE_MODES)  # the block modes require promotion
        set_attr(set_desc, self.desc, D.FAST_ACCUM, int(fast), np.int8)
        if bias_dtype is not None:
            set_attr(set_desc, self.desc, D.BIAS_DATA_TYPE, CUDA_DTYPE[bias_dtype], np.int32)
        self._scale_attrs = (int(D.A_SCALE_POINTER), int(D.B_SCALE_POINTER))
        self._scale_ptrs = np.zeros(2, dtype=np.int64)
        self._scale_addr = self._scale_ptrs.ctypes.data  # (the set_attribute calls copy the value there)
        self._scales_set: tuple[int, int] | None = None
        self._scale_lock = threading.Lock()
        self.post = Activation.NONE  # the activation run after the GEMM (not fused)

    def _set_scales(self, a_scale: int, b_scale: int) -> None:
        # each pointer set only when it changed: the weight's scales (A) stay, while a W8A8
        # call's activation scales (B) are a fresh allocation of each call
        held = self._scales_set
        if held is None or a_scale != held[0]:
            self._scale_ptrs[0] = a_scale
            self._set_desc_attr(self.desc, self._scale_attrs[0], self._scale_addr, 8)
        if held is None or b_scale != held[1]:
            self._scale_ptrs[1] = b_scale
            self._set_desc_attr(self.desc, self._scale_attrs[1], self._scale_addr + 8, 8)
        self._scales_set = (a_scale, b_scale)

    def launch(self, a_ptr: int, b_ptr: int, d_ptr: int, bias_ptr: int, a_scale: int, b_scale: int) -> None:
        """:meth:`Plan.call` with the two scale vectors; the lock keeps another thread's scale
        pointers out of the descriptor until this matmul is enqueued."""
        with self._scale_lock:
            self._set_scales(a_scale, b_scale)
            self.call(a_ptr, b_ptr, d_ptr, bias_ptr)


def _build(granularity, act, dtype, bias, rows, n, k, ldw, ldo, aligns, device_index, scale_ptrs,
           fuse: bool = True) -> ScaledPlan:
    """The plan with the activation fused in cuBLASLt's epilogue where cuBLASLt has an algorithm
    for it (and ``fuse``), else with the bias only (``plan.post``: the activation to run after)."""
    attempts = [(EPILOGUE_NAMES[(act, bias)], Activation.NONE)] if fuse and act is not Activation.NONE and (
        act, bias) in EPILOGUE_NAMES else []
    attempts.append((EPILOGUE_NAMES[(Activation.NONE, bias)], act))
    refusals = []
    for epilogue, post in attempts:
        spec = GemmSpec(dtype, False, OP_T, OP_N, epilogue, (k, n, ldw), (k, rows, k), (n, rows, ldo), aligns,
                        heuristic_workspace_bytes())
        what = f"FP8 {granularity} {dtype_name(dtype)} M={rows} N={n} K={k} epilogue={epilogue}"
        plan = None
        try:
            plan = ScaledPlan(spec, device_index, what, SCALE_MODES[granularity], dtype if bias else None)
            plan.post = post
            plan._set_scales(*scale_ptrs)  # the heuristic sees a descriptor as complete as the matmul's
            return plan.use(None)
        except (CublasLtUnsupported, bindings().cuBLASLtError) as e:  # a descriptor cuBLASLt refuses, or no algorithm
            if plan is not None:
                plan.destroy()
            refusals.append(f"{epilogue}: {e}")
    raise CublasLtUnsupported(f"cuBLASLt cannot run FP8 {granularity} M={rows} N={n} K={k}: {'; '.join(refusals)}")


_plans = BoundedCache(PLAN_CACHE_SIZE, lru=True)
# What cuBLASLt refused, per plan key: a call of that signature raises at once, without another
# heuristic query and failing matmul (cuBLASLt's answer for a descriptor does not change).
_refused = BoundedCache(PLAN_CACHE_SIZE, lru=True)


# Bound runs (BoundRun) under their callers' keys (fusion/fp8_linear.py): emptied with the plans.
BOUND_RUNS = BoundedCache(4 * PLAN_CACHE_SIZE, lru=True)


def clear_caches() -> None:
    _plans.clear()
    _refused.clear()
    BOUND_RUNS.clear()


def _check_operands(x, w8, w_scale, bias, out, glu=None) -> str:
    """The granularity of (w8, w_scale); TypeError/ValueError naming the argument otherwise."""
    who = "cublaslt_fp8.run"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: x must be a torch.Tensor, got {type(x).__name__}")
    granularity = granularity_of(w8, w_scale)  # TypeError/FP8FormatError (a ValueError) for bad weights
    if x.dtype not in OUT_DTYPES:
        raise TypeError(f"{who}: x must be bfloat16 or float16, got {x.dtype}")
    n, k = w8.shape
    width = k if glu is None else 2 * k  # with glu: gate then up
    if x.dim() != 2 or x.shape[1] != width:
        what = "" if glu is None else f" (gate then up, glu={glu!r})"
        raise ValueError(f"{who}: x must be (M, {width}){what} to match the weight ({n}, {k}), got {tuple(x.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,) or bias.dtype != x.dtype
                             or bias.device != x.device):
        got = f"{tuple(bias.shape)} {bias.dtype} on {bias.device}" if isinstance(bias, torch.Tensor) else type(bias)
        raise ValueError(f"{who}: bias must be a ({n},) {x.dtype} tensor on {x.device}, got {got}")
    m = x.shape[0]
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != (m, n) or out.dtype != x.dtype
                            or out.device != x.device):
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"{who}: out must be a ({m}, {n}) {x.dtype} tensor on {x.device}, got {got}")
    if x.device.type != "cuda" or w8.device != x.device:
        raise ValueError(f"{who}: x and the weight must be CUDA tensors on one device, got {x.device} and {w8.device}")
    if granularity == "block128" and w_scale.stride(-1) != 1:
        raise ValueError(f"{who}: block scales must have unit column stride, got strides {w_scale.stride()}")
    # What this path cannot run (the caller falls back): CublasLtUnsupported
    ok, why = check(n, k, x.dtype, granularity, x.device.index)
    if not ok:
        raise CublasLtUnsupported(f"{who}: {why}")
    if w8.stride(1) != 1 or w8.stride(0) % 16 or w8.data_ptr() % 16:
        raise CublasLtUnsupported(f"{who}: the e4m3 weight's rows must be 16-byte aligned (strides {w8.stride()})")
    if out is not None and (out.stride(1) != 1 or out.data_ptr() % 16
                            or (m > 1 and (out.stride(0) < n or out.stride(0) % 8))):
        raise CublasLtUnsupported(f"{who}: out's rows must be 16-byte aligned, got strides {out.stride()}")
    return granularity


def _bound_quantize(x: torch.Tensor, group: str, rows: int, glu: str | None):
    from .fp8_quant import bound_quantize  # Triton, loaded on first use: import and supports() need none

    return bound_quantize(x, group, rows, glu)


def _launch(key: tuple, build_args: tuple, args: tuple) -> ScaledPlan:
    """Launch the plan of ``key`` (built from ``build_args`` on a miss) with ``args``; returns it.
    cuBLASLt may refuse a descriptor only when the matmul runs (its header says so of the scale
    pointers: an unsupported combination makes cublasLtMatmul() return an invalid-value status):
    a fused activation refused so is tried once more, after the GEMM; any other refusal is
    :class:`CublasLtUnsupported`, no refused plan stays cached, and the refusal is kept
    (:data:`_refused`)."""
    refused = _refused.get(key)
    if refused is not None:
        raise CublasLtUnsupported(refused)
    try:
        return _launch_or_refuse(key, build_args, args)
    except CublasLtUnsupported as e:
        _refused.put(key, str(e))
        raise


def _launch_or_refuse(key: tuple, build_args: tuple, args: tuple) -> ScaledPlan:
    plan = _plans.get(key)
    for fuse in (True, False):
        if plan is None:
            plan = _plans.put(key, _build(*build_args, fuse=fuse))
        try:
            plan.launch(*args)
            return plan
        except bindings().cuBLASLtError as e:
            _plans.pop(key, None)
            refusal = e
        if build_args[1] is Activation.NONE or plan.post is not Activation.NONE:
            break  # no fused activation to take out
        plan = None
    raise CublasLtUnsupported(f"cuBLASLt refused {plan.what}: {refusal}") from None


class BoundRun:
    """:func:`run` for every later call of one signature, bound after a first call of it: x of
    the same shape, dtype, device, row stride and 16-byte alignment; a weight of the same
    shape, row stride and alignment, its scales in the same layout and not copied by
    :func:`weight_scale_operand`, a bias of the same dtype (or none) and 16-byte aligned; the
    output allocated fresh (where an allocator hands out blocks less aligned than the plan's
    call had, that call runs :func:`run`). ``bound(x, w8, w_scale, bias)`` quantizes x and
    launches the plan with those tensors' pointers: none of :func:`run`'s checks, lookups or
    copies. It holds no tensor (a model's weights are not kept alive by it); the caller keys it
    by everything above (fusion/fp8_linear.py)."""

    __slots__ = ("quantize", "plan", "m", "n", "rows", "dtype", "device", "act", "glu")

    def __init__(self, quantize, plan: ScaledPlan, m: int, n: int, rows: int, dtype: torch.dtype,
                 device: torch.device, act: Activation, glu: str | None):
        self.quantize, self.plan, self.m, self.n, self.rows, self.dtype, self.device = \
            quantize, plan, m, n, rows, dtype, device
        self.act, self.glu = act, glu

    def __call__(self, x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        keep, x8_ptr, x_scale_ptr = self.quantize.pointers(x)  # (keep: x8 and its scales, until enqueued)
        out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        d = out if self.rows == self.m else torch.empty((self.rows, self.n), dtype=self.dtype, device=self.device)
        dp = d.data_ptr()
        if pointer_alignment(x8_ptr | dp) < MAX_ALIGNMENT:  # (either's alignment) not as the plan's call was
            del keep  # (the quantization enqueued above is unused; run quantizes again)
            return run(x, w8, w_scale, bias, out, self.act, self.glu)
        self.plan.launch(w8.data_ptr(), x8_ptr, dp, 0 if bias is None else bias.data_ptr(),
                         w_scale.data_ptr(), x_scale_ptr)
        del keep
        return _finish(self.plan, d, out)


def _finish(plan: ScaledPlan, d: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The activation cuBLASLt did not fuse, and the padded rows dropped: ``out``."""
    if plan.post is not Activation.NONE:
        d.copy_(apply_activation(d, plan.post))
    if d is not out:
        out.copy_(d[:out.shape[0]])
    return out


def run(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None, activation=None, glu: str | None = None) -> torch.Tensor:
    """``out[:] = act(x @ dequantize(w8, w_scale).T + bias)`` on the FP8 tensor cores; returns
    ``out`` (allocated when None). x (M, K) bf16/fp16 CUDA with unit column stride; w8 (N, K)
    e4m3 with ``w_scale`` per kernels/fp8.py (``channel`` (N,) or ``block128`` (nb, L)); bias
    (N,) of x's dtype or None; out (M, N) of x's dtype; activation None, "relu", "gelu_tanh" or
    "gelu" (exact: after the GEMM). ``glu="silu"``: x is (M, 2K), a gated MLP's gate then up, and
    the GEMM's input is ``silu(gate) * up`` in x's dtype, formed while x is quantized
    (kernels/fp8_quant.py) and never written. TypeError/ValueError for bad arguments,
    :class:`CublasLtUnsupported` where this path cannot run (the caller falls back)."""
    return run_and_bind(x, w8, w_scale, bias, out, activation, glu)[0]


def run_and_bind(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, activation=None,
                 glu: str | None = None) -> tuple[torch.Tensor, BoundRun | None]:
    """:func:`run`, and the :class:`BoundRun` for later calls of this signature: None where
    they could not reuse this call's launch as it is (no rows; an ``out`` that is not what a
    fresh allocation would be: rows N wide, 256-byte aligned; an operand copied: x's layout, a
    bias off alignment, block scales whose row stride is not a multiple of 4)."""
    act = Activation.parse(activation)
    granularity = _check_operands(x, w8, w_scale, bias, out, glu)
    m, (n, k) = x.shape[0], w8.shape
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, None
    rows = m if granularity == "channel" else m + (-m) % 4  # VEC128_32F: cuBLASLt's N a multiple of 4
    x_in = x
    x, quantize = _bound_quantize(x, ACTIVATION_GROUP[granularity], rows, glu)
    x8, x_scale = quantize(x)
    w_operand = weight_scale_operand(w_scale, granularity)
    b = contiguous_bias(bias)
    d = out if rows == m else torch.empty((rows, n), dtype=x.dtype, device=x.device)
    ldo = d.stride(0) if rows > 1 else n
    wp, xp, dp = w8.data_ptr(), x8.data_ptr(), d.data_ptr()
    aligns = (pointer_alignment(wp), pointer_alignment(xp), pointer_alignment(dp), pointer_alignment(dp))
    key = (granularity, act, x.dtype, b is not None, rows, n, k, w8.stride(0), ldo, aligns, x.get_device())
    args = (wp, xp, dp, b.data_ptr() if b is not None else 0, w_operand.data_ptr(), x_scale.data_ptr())
    plan = _launch(key, (granularity, act, x.dtype, b is not None, rows, n, k, w8.stride(0), ldo, aligns,
                         x.get_device(), args[4:]), args)
    _finish(plan, d, out)
    # A bound call allocates out and x8 fresh: the caching allocator's blocks are 512-byte
    # aligned and out's rows N wide, so this call's plan fits it where this call's were so too.
    reusable = ldo == n and pointer_alignment(dp) == pointer_alignment(xp) == MAX_ALIGNMENT \
        and x is x_in and b is bias and w_operand.data_ptr() == w_scale.data_ptr()
    return out, (BoundRun(quantize, plan, m, n, rows, x.dtype, x.device, act, glu) if reusable else None)


__all__ = [
    "ACTIVATION_GROUP", "BOUND_RUNS", "MIN_CUBLASLT", "SCALE_MODES", "BoundRun", "ScaledPlan", "check", "clear_caches",
    "environment", "is_available", "run", "run_and_bind", "supports", "weight_scale_operand",
]
