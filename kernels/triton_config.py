"""What a Triton GEMM config may be and which problems it can take: the Hopper limits that
``candidates()`` assume without a device, the 32-bit offset and TMA alignment rules, the
precision rule for fp32 inputs, the range checks of config fields and the records configs are
saved as in tuning tables.

Serves the configs of triton_gemm, triton_splitk and triton_glu, and the sizes that
triton_rmsnorm and the split scratch round with :func:`next_pow2`; hybridgemm.modes asks
:func:`problem_limits`. Nothing here touches a GPU.
"""

from __future__ import annotations

import dataclasses

import torch

from .problem import DTYPE_NAMES, Problem
from .triton_epilogue import ACT_CODE

# H100/H200 opt-in shared memory per block; what candidates() assume when no device is given.
HOPPER_SMEM_PER_BLOCK = 232448
HOPPER_NUM_SMS = 132  # H200 (SXM); candidates() use it to size split-K grids
INT32_LIMIT = 2**31 - 1  # the kernels compute element offsets in 32-bit integers
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned base pointers and row strides


def dot_precision(problem: Problem) -> str:
    """fp32 inputs use TF32 tensor cores only when the caller allowed it; otherwise exact fp32."""
    return "tf32" if problem.dtype != torch.float32 or problem.tf32 else "ieee"


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for ``n`` ≤ 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def problem_limits(problem: Problem) -> str | None:
    """Why a problem cannot run at all (dtype, 32-bit offsets), or None."""
    if problem.dtype not in DTYPE_NAMES:
        return f"dtype {problem.dtype} not supported (fp16, bf16, fp32 only)"
    if problem.epilogue.activation not in ACT_CODE:
        return f"activation {problem.epilogue.activation!r} not supported"
    extents = (problem.m * problem.ldx, problem.n * problem.ldw, problem.m * problem.ldo)
    if max(extents) > INT32_LIMIT:
        return "a tensor spans more than 2**31 elements (the kernels use 32-bit offsets)"
    return None


def tma_reason(problem: Problem) -> str | None:
    """Why TMA tensor descriptors cannot describe x, W and out of this problem, or None."""
    e = problem.itemsize
    if min(problem.m, problem.n, problem.k) < 1:
        return "TMA needs non-empty M, N and K"
    for name, align in (("x", problem.align_x), ("weight", problem.align_w), ("out", problem.align_out)):
        if align < TMA_ALIGN:
            return f"TMA needs 16-byte aligned pointers ({name} is {align}-byte aligned)"
    for name, rows, ld, width in (("x", problem.m, problem.ldx, problem.k),
                                  ("weight", problem.n, problem.ldw, problem.k),
                                  ("out", problem.m, problem.ldo, problem.n)):
        ld = tma_row_stride(rows, ld, width, e)
        if (ld * e) % TMA_ALIGN or ld < width:
            return f"TMA needs 16-byte aligned row strides ({name} row stride is {ld * e} bytes)"
    # A TMA store writes a row up to its next 16-byte boundary (on an H100, Triton 3.6: columns
    # 37-39 of an fp16 out of 37 columns in rows of 40), which may be another tensor's bytes.
    if (problem.n * e) % TMA_ALIGN:
        return f"TMA stores whole 16-byte units: out's rows of {problem.n * e} bytes would be written past their end"
    return None


def tma_row_stride(rows: int, ld: int, width: int, itemsize: int) -> int:
    """The row stride to describe an operand with: a single row's stride is never used, so
    round its width up to 16 bytes (a 1 x 45 fp16 x still qualifies for TMA)."""
    if rows != 1:
        return ld
    per = TMA_ALIGN // itemsize
    return -(-width // per) * per


# ----------------------------------------------------------------------------- config records


def check_pow2(name: str, value: int, lo: int, hi: int) -> None:
    if value < lo or value > hi or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two in [{lo}, {hi}]")


def check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} must be in [{lo}, {hi}]")


def config_to_record(config, kind: str) -> dict:
    return {"kind": kind, **dataclasses.asdict(config)}


def config_from_record(cls, kind: str, record):
    """Rebuild ``cls`` from a record: exact key set, exact JSON types, then the value checks of
    ``cls.__post_init__``. Every failure is a ValueError that names the problem. A field added
    later with a default (e.g. ``split_k``) may be absent: records written before it still load."""
    if not isinstance(record, dict):
        raise ValueError(f"{cls.__name__} record must be a dict, got {type(record).__name__}")
    if record.get("kind") != kind:
        raise ValueError(f"record kind {record.get('kind')!r} is not {kind!r}")
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    keys = set(record) - {"kind"}
    if not set(fields) - optional <= keys <= set(fields):
        missing, extra = sorted(set(fields) - optional - keys), sorted(keys - set(fields))
        raise ValueError(f"{kind} record: missing keys {missing}, unexpected keys {extra}")
    for name, type_name in fields.items():
        if name not in record:
            continue
        value = record[name]
        want_bool = type_name == "bool"
        if want_bool != isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{kind} record: {name}={value!r} must be {type_name}")
    return cls(**{name: record[name] for name in fields if name in record})


__all__ = [
    "HOPPER_NUM_SMS", "HOPPER_SMEM_PER_BLOCK", "INT32_LIMIT", "TMA_ALIGN", "check_pow2", "check_range",
    "config_from_record", "config_to_record", "dot_precision", "next_pow2", "problem_limits", "tma_reason",
    "tma_row_stride",
]
