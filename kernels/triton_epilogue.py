"""The fused epilogue math of the Triton GEMMs, as @triton.jit helpers on the fp32 accumulator:
the activation (triton_gemm, triton_splitk, and the GELUs of triton_glu's gate), the RMSNorm
prologue's pieces (triton_splitk, triton_glu: its factor, the scaled x, the sums of squares) and
the residual add (triton_splitk).

``ACT_CODE`` maps an :class:`~.epilogue.Activation` to the constexpr :func:`tl_activation`
branches on. Nothing here touches a GPU at import time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .epilogue import Activation

# Activation -> the constexpr code the kernels branch on.
ACT_CODE = {Activation.NONE: 0, Activation.RELU: 1, Activation.GELU_TANH: 2, Activation.GELU: 3}


@triton.jit
def tl_activation(z, ACT: tl.constexpr):
    """The activation of the fused epilogue, on the fp32 accumulator (codes: ACT_CODE)."""
    if ACT == 1:
        z = tl.maximum(z, 0.0)
    elif ACT == 2:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no tanh intrinsic needed, and for large |u| the
        # exp saturates to the right limits (z or -0) instead of producing inf/inf.
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        z = z / (1.0 + tl.exp(-2.0 * u))
    elif ACT == 3:
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    return z


@triton.jit
def tl_norm_factor(g, OFFSET: tl.constexpr):
    """The factor a norm prologue multiplies x by, from the loaded norm weight ``g``: ``g``
    itself, or with an ``OFFSET`` ``OFFSET + g`` in fp32 (Gemma's ``1 + w``), formed in registers:
    no launch before the GEMM forms it."""
    if OFFSET != 0.0:
        g = g.to(tl.float32) + OFFSET
    return g


@triton.jit
def tl_norm_tile_mma(xt, g, sq, PREC: tl.constexpr):
    """One K-chunk of an RMSNorm fused into the GEMM that reads its output (a norm prologue).

    ``rmsnorm(x) @ W.T == rstd * ((x * g) @ W.T)`` per row, ``rstd = rsqrt(mean(x²) + eps)``:
    the GEMM multiplies ``x * g`` (the norm weight ``g`` [BK], rounded once to x's dtype) and
    the caller scales each row of the fp32 result by ``rstd`` (:func:`tl_rstd`) before the
    bias. The squares accumulate from the tiles the GEMM loads anyway (no extra pass over x),
    here as one more small MMA, ``sq [BM, BM] += x @ x.T``, whose diagonal holds the rows'
    sums of squares (:func:`tl_diagonal`). Returns ``(x * g, sq)``.
    Hugging Face's module rounds ``x * rstd`` and then ``* g``: the results agree to the
    rounding of the inputs, not bit for bit. In fp16, ``x * g`` can overflow where the stock
    order stays in range (activations of thousands times weights of tens): the decoder-layer
    fusion takes bf16 and fp32 only.

    Each kernel uses the accumulation that measured faster in it on the H200: the gated
    kernel this MMA, triton_splitk (whose main dot runs on wgmma there) the fp32 tile of
    squares of :func:`tl_norm_tile_sq`; the other one cost each of them several times more.
    What the fused norm costs a call: perf/results/h200/layer_fusion_h200.csv."""
    xg = (xt.to(tl.float32) * g[None, :].to(tl.float32)).to(xt.dtype)
    return xg, tl.dot(xt, tl.trans(xt), sq, input_precision=PREC)


@triton.jit
def tl_norm_tile_sq(xt, g, sq):
    """:func:`tl_norm_tile_mma` with the squares summed elementwise into an fp32 [BM, BK] tile
    ``sq`` (rows summed by the caller after the loop). Returns ``(x * g, sq)``."""
    xf = xt.to(tl.float32)
    return (xf * g[None, :].to(tl.float32)).to(xt.dtype), sq + xf * xf


@triton.jit
def tl_diagonal(sq, BM: tl.constexpr):
    """The diagonal of a [BM, BM] tile, as a [BM] vector."""
    idx = tl.arange(0, BM)
    return tl.sum(tl.where(idx[:, None] == idx[None, :], sq, 0.0), axis=1)


@triton.jit
def tl_rstd(ss, inv_k, eps):
    """``1 / rms`` of rows from their sums of squares (``inv_k`` = fp32(1/K), ``tl.math.rsqrt``:
    triton_rmsnorm's formula)."""
    return tl.math.rsqrt(ss * inv_k + eps)


@triton.jit
def tl_add_residual(acc, res_ptrs, mask, out_dtype: tl.constexpr, res_scale, SCALED: tl.constexpr):
    """``residual + y`` as the decoder layer's add computes it: y rounded to the output dtype
    first (with ``SCALED``: then times ``res_scale``, rounded again, as Granite's
    ``hidden_states * residual_multiplier``), the sum in fp32, rounded by the caller's store."""
    y = acc.to(out_dtype).to(tl.float32)
    if SCALED:
        y = (y * res_scale).to(out_dtype).to(tl.float32)
    return y + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
