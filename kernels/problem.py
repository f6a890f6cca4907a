"""One GEMM problem as every backend sees it: ``out[M, N] = epilogue(x[M, K] @ W[N, K].T)``.

Both backends take a :class:`Problem` in ``candidates()`` and ``Config.supports()``, so the
tuner's pruning and the dispatcher's safety check ask the same question.
The problem carries the layout facts a kernel's validity depends on: leading dimensions
(row strides, in elements) and the byte alignment of every pointer, capped at 256 bytes
(what cuBLASLt's heuristics assume by default, and more than any kernel here needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .epilogue import Epilogue

MAX_ALIGNMENT = 256

# Decode regime: up to this M the weight-streaming split-K kernel is a candidate
# (kernels/triton_splitk.py); the tuner times it there and a table entry may choose it.
DECODE_MAX_M = 64
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}


def pointer_alignment(ptr: int) -> int:
    """Largest power of two (≤ 256) that divides the address; 256 for a null pointer."""
    if ptr == 0:
        return MAX_ALIGNMENT
    return min(MAX_ALIGNMENT, ptr & -ptr)


def uses_tf32(dtype: torch.dtype) -> bool:
    """Whether a GEMM of ``dtype`` may use TF32 (:attr:`Problem.tf32`): fp32 with torch's matmul
    TF32 flag on. Decisions depend on it, so every caller that builds a Problem asks here."""
    return dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"unsupported dtype {dtype}; hybridgemm kernels take float16, bfloat16 or float32"
        ) from None


@dataclass(frozen=True)
class Problem:
    m: int
    n: int
    k: int
    dtype: torch.dtype
    epilogue: Epilogue
    ldx: int  # row stride of x, elements (≥ k)
    ldw: int  # row stride of W, elements (≥ k)
    ldo: int  # row stride of out, elements (≥ n)
    align_x: int = MAX_ALIGNMENT
    align_w: int = MAX_ALIGNMENT
    align_out: int = MAX_ALIGNMENT
    align_bias: int = MAX_ALIGNMENT
    tf32: bool = False  # fp32 inputs only: may the kernel use TF32 tensor cores?
    # "" (W has x's dtype) or an FP8 weight format (kernels/fp8.py FORMAT_OF): W is e4m3 with
    # per-channel or 128x128-block scales, x and out are ``dtype``.
    weight_format: str = ""

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def w_itemsize(self) -> int:
        """Bytes per element of W: 1 for an FP8 weight format, else x's."""
        return 1 if self.weight_format else self.itemsize

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Fewest bytes a kernel must move: read x, W and bias once, write out once."""
        e = self.itemsize
        return e * (self.m * self.k + self.m * self.n + self.n * self.epilogue.bias) + self.w_itemsize * self.n * self.k

    @classmethod
    def from_tensors(
        cls,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        epilogue: Epilogue,
        tf32: bool = False,
        weight_format: str = "",
    ) -> Problem:
        """Describe 2-D ``x`` (M, K), ``weight`` (N, K), ``out`` (M, N) with unit column stride
        (``weight_format``: see the field)."""
        m, k = x.shape
        n = weight.shape[0]
        return cls(
            m=m, n=n, k=k, dtype=x.dtype, epilogue=epilogue,
            ldx=x.stride(0) if m > 1 else k,
            ldw=weight.stride(0) if n > 1 else k,
            ldo=out.stride(0) if m > 1 else n,
            align_x=pointer_alignment(x.data_ptr()),
            align_w=pointer_alignment(weight.data_ptr()),
            align_out=pointer_alignment(out.data_ptr()),
            align_bias=pointer_alignment(bias.data_ptr()) if bias is not None else MAX_ALIGNMENT,
            tf32=tf32 and x.dtype == torch.float32,
            weight_format=weight_format,
        )
