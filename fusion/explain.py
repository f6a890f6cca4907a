"""``explain()``: which kernel ``hybridgemm.linear`` runs for given shapes, and why, as text.

It checks the arguments (a ValueError naming the bad one), builds the Problem of a dense call
of those shapes, and asks the decision the dispatcher would ask: ``decide.choose`` (rules 4-5
of fusion/decide.py) or, in batch_invariant mode, ``modes.batch_invariant_choice``. It never
reaches fusion/dispatch.py and needs no GPU (without one it says PyTorch computes the call).
``hybridgemm.explain`` is this function.
"""

from __future__ import annotations

import operator

import torch

from hybridgemm.kernels import backends, cublaslt_fp8
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.fp8 import FORMAT_OF
from hybridgemm.kernels.problem import DECODE_MAX_M, DTYPE_NAMES, NAME_TO_DTYPE, Problem, uses_tf32

from . import decide, mode_state, modes


def _w8a8(problem: Problem, choice, granularity: str, dev: int) -> str:
    """What ``activations="fp8"`` changes for this call (fusion/fp8_linear.py ``quantize_input``)."""
    checked = problem.m > DECODE_MAX_M and choice.backend not in backends.FP8_BACKENDS
    return w8a8_line(problem.m, choice.backend, granularity,
                     cublaslt_fp8.check(problem.n, problem.k, problem.dtype, granularity, dev) if checked else None)


def w8a8_line(m: int, backend: str, granularity: str, cublaslt_check: tuple[bool, str] | None) -> str:
    """What ``activations="fp8"`` changes for a call of ``m`` rows whose decision runs
    ``backend``; ``cublaslt_check``: kernels/cublaslt_fp8.py ``check`` on the device, or None
    where no device is at hand (``hybridgemm explain --device``)."""
    if m <= DECODE_MAX_M or backend in backends.FP8_BACKENDS:
        return f"x as it is (W8A16): M={m} is a decode row count, or the decision reads e4m3 itself"
    group = "token" if granularity == "channel" else "1x128 block"
    if cublaslt_check is None:
        return (f"instead, x quantized to e4m3 per {group} and cuBLASLt's FP8 GEMM on both (W8A8) where cuBLASLt "
                "has an FP8 algorithm for the call; where not, the above, with one warning")
    ok, why = cublaslt_check
    if not ok:
        return f"cuBLASLt's FP8 GEMM cannot run it here ({why}), so the above runs, with one warning"
    return f"instead, x quantized to e4m3 per {group} and cuBLASLt's FP8 GEMM on both (W8A8)"


def _dims(shape, what: str, example: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or ValueError naming ``what``."""

    def bad() -> ValueError:
        return ValueError(f"{what} must be a sequence of non-negative ints such as {example}, got {shape!r:.80}")

    if isinstance(shape, (str, bytes)):
        raise bad()
    try:
        items = tuple(shape)
    except TypeError:
        raise bad() from None
    out = []
    for d in items:
        try:
            v = None if isinstance(d, bool) else operator.index(d)
        except TypeError:
            v = None
        if v is None or v < 0:
            raise bad()
        out.append(v)
    return tuple(out)


_ACCEPTED_DTYPES = ("a torch.dtype, or one of bf16, fp16, fp32, bfloat16, float16, float32, float64 "
                    "(or another torch dtype's name)")


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        name = dtype.strip().removeprefix("torch.")
        found = NAME_TO_DTYPE.get(name)
        if found is None:
            found = vars(torch).get(name)  # a lookup, not getattr: never imports or runs anything
        if not isinstance(found, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r:.40}; expected {_ACCEPTED_DTYPES}")
        return found
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be {_ACCEPTED_DTYPES}; got {dtype!r:.60}")
    return dtype


def explain(x_shape, w_shape, dtype: torch.dtype | str = torch.bfloat16, bias: bool = True,
            activation=None, device: int | None = None, weights: str = "same", granularity: str = "channel",
            activations: str = "same") -> str:
    """Which kernel ``hybridgemm.linear`` runs for these shapes, and why (a table hit with the
    M range it was validated on and its worst measured ratio to F.linear, or the fallback
    rule). Works without a GPU (it then says PyTorch runs).

    ``x_shape`` is one or more non-negative ints (``(..., K)``), ``w_shape`` two (``(N, K)``),
    with the same K; ``dtype`` a ``torch.dtype``, one of ``bf16``/``fp16``/``fp32``, or the name
    of a torch dtype (``bfloat16``, ``float16``, ``float32``, ``float64``, ...; a ``torch.``
    prefix is allowed). ``weights="fp8"``: the weight is FP8 of ``granularity`` (``channel`` or
    ``block128``; ``hybridgemm.quantize_fp8``), x and the output ``dtype`` (bf16/fp16), and the
    decision is the FP8 one (its own table key); with ``activations="fp8"`` (the module option
    of ``patch(..., activations="fp8")``) it also says whether x is quantized to e4m3 for
    cuBLASLt's FP8 GEMM at this M (W8A8) or taken as it is. Anything else raises ValueError
    naming the argument and what it takes."""
    dtype = _parse_dtype(dtype)
    if weights not in ("same", "fp8"):
        raise ValueError(f"weights must be 'same' or 'fp8', got {weights!r:.40}")
    if weights == "fp8" and granularity not in FORMAT_OF:
        raise ValueError(f"granularity must be one of {', '.join(FORMAT_OF)}, got {granularity!r:.40}")
    if weights == "fp8" and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"an FP8 weight computes in bf16 or fp16, got dtype {dtype}")
    if activations not in ("same", "fp8") or (activations == "fp8" and weights != "fp8"):
        raise ValueError(f"activations must be 'same', or 'fp8' with weights='fp8', got {activations!r:.40}")
    weight_format = FORMAT_OF[granularity] if weights == "fp8" else ""
    x_dims = _dims(x_shape, "x_shape", "(16, 4096) or (2, 8, 4096)")
    w_dims = _dims(w_shape, "w_shape", "(6144, 4096)")
    if not x_dims:
        raise ValueError("x_shape needs at least one dimension (its last is K), got ()")
    if len(w_dims) != 2:
        raise ValueError(f"w_shape must be two ints (N, K), got {w_dims}")
    act = Activation.parse(activation)
    bias = bool(bias)
    m = 1
    for d in x_dims[:-1]:
        m *= d
    n, k = w_dims
    if x_dims[-1] != k:
        raise ValueError(f"x_shape {x_dims} has {x_dims[-1]} features, w_shape expects {k}")
    problem = Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(act, bias), ldx=k, ldw=k, ldo=n,
                      tf32=uses_tf32(dtype), weight_format=weight_format)
    head = f"linear {DTYPE_NAMES.get(dtype, dtype)} M={m} N={n} K={k} epilogue={problem.epilogue.name}"
    if weight_format:
        head += f" weight={weight_format}"
    if m == 0 or n == 0 or k == 0:
        return f"{head}: empty problem (M, N or K = 0), so PyTorch computes it (no GEMM)"
    invariant = mode_state.get_mode() == mode_state.BATCH_INVARIANT
    if not torch.cuda.is_available():
        if weight_format:
            return f"{head}: no CUDA device here, so the weight is dequantized and PyTorch (F.linear) computes it"
        line = f"{head}: no CUDA device here, so PyTorch (F.linear) computes it on the CPU"
        if invariant and dtype in DTYPE_NAMES:
            line += (f"\n  batch_invariant mode: {modes.batch_invariant_choice(problem, None).describe()} on an "
                     "H100/H200-class GPU; PyTorch on the CPU is not guaranteed batch-invariant")
        return line
    if dtype not in DTYPE_NAMES:
        tail = " (not guaranteed batch-invariant)" if invariant else ""
        return f"{head}: dtype not taken by any kernel, so PyTorch computes it{tail}"
    dev = torch.cuda.current_device() if device is None else device
    if weight_format:
        if torch.cuda.get_device_capability(dev) < (8, 9):
            return f"{head}\n  device {dev} has no FP8 conversion: the weight is dequantized per call, then {dtype}"
        if invariant:
            return f"{head}\n  batch_invariant mode: the weight is dequantized, then the batch-invariant {dtype} path"
        with torch.cuda.device(dev):
            choice = decide.choose_fp8(problem, dev)
        line = f"{head}\n  key {choice.key}\n  runs {choice.describe()}"
        return line + (f"\n  activations='fp8': {_w8a8(problem, choice, granularity, dev)}" if activations == "fp8"
                       else "")
    with torch.cuda.device(dev):
        if invariant:
            choice = modes.batch_invariant_choice(problem, dev)
            return f"{head}\n  key {choice.key}\n  batch_invariant mode: {choice.describe()}"
        choice = decide.choose(problem, dev)
    return f"{head}\n  key {choice.key}\n  runs {choice.describe()}"
