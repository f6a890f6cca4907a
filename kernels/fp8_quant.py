"""Activations quantized to e4m3 on the fly, in one Triton launch: the FP8 prefill path's first
step (kernels/cublaslt_fp8.py multiplies the result with an e4m3 weight).

For x (M, K) bf16/fp16 (any row stride ≥ K, unit column stride), with ``x ≈ x8.float() * scale``:

- ``token``: one scale per row, ``scale[m] = max(amax(|x[m, :]|), MIN_AMAX) / 448``;
- ``block128``: one scale per 1 x 128 block of a row, ``scale[m, b] = max(amax(|x[m, 128b :
  128b + 128]|), MIN_AMAX) / 448`` (the activation side of DeepSeek-style 128 x 128 block
  weights, as transformers' FineGrainedFP8 quantizes it);

then ``x8 = e4m3(clamp(x / scale, -448, 448))``, rounded to nearest even. With ``glu="silu"``
the row quantized is not x's but the product of a gated MLP, ``silu(gate) * up`` of x's halves
(x (M, 2K): gate then up, as a stacked gate/up GEMM writes them), each step rounded to x's dtype
as transformers' eager ``act_fn(gate) * up`` rounds it (SiLU as torch computes it: ``g / (1 +
exp(-g))`` in fp32 with IEEE division and the accurate ``expf``): the product is never written,
and its bytes equal the unfused composition's. The formula is
kernels/fp8.py's weight quantization (same MIN_AMAX, same order of operations), so a row
quantized here and the same row quantized by ``quantize_fp8(..., "channel")`` are identical.
The divisions are IEEE round-to-nearest (``div_rn``), as torch's are, and the e4m3 bytes are
rounded to nearest even (the hardware's conversion; under the interpreter encoded in code), so
the bytes and scales equal a torch reference computed in fp32. A NaN
or Inf in a row gives NaN bytes (and the GEMM a NaN output row, as F.linear would).

Scale layouts (what cuBLASLt reads, cuBLAS docs §3.1.4.5.1 "Scaling factors layouts"): per
token a contiguous (M,) vector; per block the (M, ceil(K/128)) scales are stored M-major (the
M entries of one K-block are contiguous), and :func:`quantize_activations` returns them as an
(M, L) view with strides (1, M). ``rows`` > M (see :func:`quantize_for_gemm`) appends rows
that quantize as zeros, for a GEMM whose M must be padded.

Passes: a per-token row of at most :data:`ONE_PASS_MAX` columns is read once and kept in
registers; a wider row is read twice (its amax, then its bytes). With ``glu`` the first pass
writes the product it forms to a scratch row that the second reads back instead of forming it
again (:data:`GLU_STASH`; the bytes are the same). scripts/fp8_quant_probe.py ``--stash 0 1``
times both: Llama-3-8B's down input at 2048 rows, 127.2 against 134.7 µs on an H100.

Launches: each signature (group, rows, M, K, row stride, glu, dtype, device, x's 16-byte
alignment) has a :class:`BoundQuantize`, which allocates and launches with no checks (a raw
launch of plain-int pointers once compiled); :func:`quantize_for_gemm` checks x and calls it,
and kernels/cublaslt_fp8.py's bound runs call its :meth:`BoundQuantize.pointers` directly.

Nothing touches a GPU at import time. Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .bounded_cache import BoundedCache
from .fp8 import _MIN_AMAX as MIN_AMAX  # one floor for weights and activations
from .fp8 import BLOCK, E4M3, E4M3_MAX, QUANTIZED_GLUS
from .triton_config import next_pow2
from .triton_launch import Launcher, interpreting

GROUPS = ("token", "block128")
GLUS = (None, *QUANTIZED_GLUS)  # None: x itself; else the gated product formed before quantizing
IN_DTYPES = (torch.bfloat16, torch.float16)
ONE_PASS_MAX = 8192  # widest row a per-token program keeps in registers (8 warps: 32 fp32 per thread)
# two-pass GLU rows: the first pass stashes the product it forms, the second reads it back
GLU_STASH = True
EIGHT_WARPS_MAX = 8192  # widest one-pass row on 8 warps (32 fp32 per thread)
WIDE_ROW_WARPS = 16  # warps of a one-pass program over a wider row (32 fp32 per thread at 16384)
CHUNK = 4096  # elements per step of the two-pass loop over wider rows
BLOCKS_PER_PROGRAM = 8  # 128-element blocks per program of the block kernel
PLAN_CACHE_SIZE = 1024
HARDWARE_CVT = True  # compiled kernels encode e4m3 with the hardware's cvt (_e4m3_bits; False: in code)
# the constants as the kernels see them (a @triton.jit function reads globals only as constexprs)
_FLOOR = tl.constexpr(MIN_AMAX)
_FP8_MAX = tl.constexpr(E4M3_MAX)
_MIN_NORMAL = tl.constexpr(2.0**-6)  # e4m3's smallest normal; below it the grid step is 2**-9
_SUB_MAGIC = tl.constexpr(1.5 * 2.0**14)


@triton.jit
def _scale_of(amax):
    # amax floored then divided by 448, IEEE-rounded like torch's fp32 division
    return tl.math.div_rn(tl.maximum(amax, _FLOOR), _FP8_MAX)


@triton.jit
def _e4m3_bits(xf, scale, HW_CVT: tl.constexpr):
    """The e4m3fn byte of x / scale, clamped to ±448, rounded to nearest even, as uint8.

    HW_CVT: the hardware's conversion (cvt.rn.satfinite, two values an instruction), compiled for
    the GPU. Otherwise encoded here, about fifteen integer operations a value: Triton's
    interpreter (where the CPU tests run) carries a rounded-up mantissa into the wrong binade
    (127.9 becomes 64) and turns NaN into 384. Both give the same bytes (the GPU tests compare
    them with torch's cast)."""
    q = tl.math.div_rn(xf, scale)
    # NaN stays NaN (a NaN or Inf in x makes a NaN byte, and the GEMM's row NaN, as F.linear's)
    q = tl.minimum(tl.maximum(q, -_FP8_MAX, propagate_nan=tl.PropagateNan.ALL), _FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    if HW_CVT:
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    bits = q.to(tl.int32, bitcast=True)
    a = tl.abs(q)
    # Normal range (|q| >= 2**-6): keep 3 mantissa bits, nearest even (the carry may step the
    # exponent), then (fp32 exponent << 3 | mantissa) re-biased from 127 to e4m3's 7.
    normal = (((bits & 0x7FFFFFFF) + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: a multiple of 2**-9, by adding and removing 1.5 * 2**14 (fp32 ulp 2**-9
    # there); the byte is that multiple (8 would be 2**-6, whose normal byte is also 8).
    sub = (((a + _SUB_MAGIC) - _SUB_MAGIC) * 512.0).to(tl.int32)
    code = tl.where(q != q, 0x7F, tl.where(a < _MIN_NORMAL, sub, normal))
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)  # the sign bit: -0 stays -0, as in torch


@triton.jit
def _row_values(x_row, cols, mask, K, GLU: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The fp32 values of columns ``cols`` of the row to quantize: x's own, or with GLU the
    product silu(gate) * up of x's gate (columns < K) and up (K + columns) halves, rounded to x's
    dtype after the SiLU and after the product, as torch's eager ops round them. LIBDEVICE: the
    accurate expf torch's kernel calls (Triton's own exp is an approximation); the interpreter,
    which has no libdevice, evaluates tl.exp with numpy's."""
    v = tl.load(x_row + cols, mask=mask, other=0.0)
    if GLU:
        up = tl.load(x_row + K + cols, mask=mask, other=0.0)
        g = v.to(tl.float32)
        e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
        act = tl.math.div_rn(g, 1.0 + e).to(v.dtype)  # torch: x / (1 + expf(-x)), IEEE division
        v = (act.to(tl.float32) * up.to(tl.float32)).to(v.dtype)
    return v.to(tl.float32)


@triton.jit
def _quantize_token_kernel(x_ptr, q_ptr, s_ptr, st_ptr, M, K, ldx, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
                           GLU: tl.constexpr, LIBDEVICE: tl.constexpr, HW_CVT: tl.constexpr, STASH: tl.constexpr):
    # One program per row; rows >= M (GEMM padding) read nothing and store zeros. K: the
    # quantized row's width (with GLU, x's rows hold 2K: gate, then up). STASH (two passes with
    # GLU): the first pass writes the product, in x's dtype, to st_ptr's row (K wide), and the
    # second reads it back (from L2) instead of forming it again.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * ldx
    q_row = q_ptr + row * K
    cols = tl.arange(0, BLOCK_K)
    # a boolean tensor: a scalar mask term widens the mask to int32 in some Triton versions
    live = (tl.zeros_like(cols) + row) < M
    if ONE_PASS:
        mask = cols < K
        xf = _row_values(x_row, cols, mask & live, K, GLU, LIBDEVICE)
        scale = _scale_of(tl.max(tl.abs(xf), axis=0))
        tl.store(q_row + cols, _e4m3_bits(xf, scale, HW_CVT), mask=mask)
    else:  # the row's amax first, then a second read (from L2) to quantize
        st_row = st_ptr + row * K
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            mask = start + cols < K
            xf = _row_values(x_row, start + cols, mask & live, K, GLU, LIBDEVICE)
            if STASH:
                tl.store(st_row + start + cols, xf.to(st_ptr.dtype.element_ty), mask=mask & live)
            acc = tl.maximum(acc, tl.abs(xf))
        scale = _scale_of(tl.max(acc, axis=0))
        if STASH:
            tl.debug_barrier()  # every thread's stash writes visible to the whole program
        for start in range(0, K, BLOCK_K):
            mask = start + cols < K
            if STASH:
                xf = tl.load(st_row + start + cols, mask=mask & live, other=0.0).to(tl.float32)
            else:
                xf = _row_values(x_row, start + cols, mask & live, K, GLU, LIBDEVICE)
            tl.store(q_row + start + cols, _e4m3_bits(xf, scale, HW_CVT), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _quantize_block_kernel(x_ptr, q_ptr, s_ptr, M, K, ldx, ld_s, BLOCKS: tl.constexpr, GROUP: tl.constexpr,
                           GLU: tl.constexpr, LIBDEVICE: tl.constexpr, HW_CVT: tl.constexpr):
    # Program (row, j) quantizes blocks [j * BLOCKS, (j + 1) * BLOCKS) of one row; the scale of
    # block b of row m goes to s_ptr[b * ld_s + m] (M-major, as cuBLASLt's VEC128_32F reads it).
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    cols = blocks[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    live = (tl.zeros_like(cols) + row) < M  # a boolean tensor, as in _quantize_token_kernel
    xf = _row_values(x_ptr + row * ldx, cols, mask & live, K, GLU, LIBDEVICE)
    scale = _scale_of(tl.max(tl.abs(xf), axis=1))
    tl.store(q_ptr + row * K + cols, _e4m3_bits(xf, scale[:, None], HW_CVT), mask=mask)
    tl.store(s_ptr + blocks * ld_s + row, scale, mask=blocks * GROUP < K)


def _launcher(group: str, rows: int, m: int, k: int, ldx: int, glu: str | None, device: torch.device) -> Launcher:
    compiled = not interpreting()
    glu_meta = dict(GLU=glu is not None, LIBDEVICE=compiled, HW_CVT=compiled and HARDWARE_CVT)
    if group == "token":
        one_pass = k <= ONE_PASS_MAX
        block = next_pow2(k) if one_pass else CHUNK
        warps = 4 if block <= 1024 else 8 if block <= EIGHT_WARPS_MAX else WIDE_ROW_WARPS
        return Launcher(_quantize_token_kernel, (rows,),
                        dict(BLOCK_K=block, ONE_PASS=one_pass, STASH=stashes(k, glu), num_warps=warps, **glu_meta))
    blocks = min(BLOCKS_PER_PROGRAM, next_pow2(triton.cdiv(k, BLOCK)))
    grid = (rows, triton.cdiv(triton.cdiv(k, BLOCK), blocks))
    return Launcher(_quantize_block_kernel, grid, dict(BLOCKS=blocks, GROUP=BLOCK, num_warps=4, **glu_meta))


def stashes(k: int, glu: str | None) -> bool:
    """Does a per-token quantization of a K-wide row stash the GLU product between its passes?"""
    return GLU_STASH and glu is not None and k > ONE_PASS_MAX


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


class BoundQuantize:
    """The quantization of every x of one signature (group, rows, M, K, row stride, glu, dtype,
    device, 16-byte alignment: what the compiled kernel is specialised on): allocates x8, the
    scales (and the GLU stash) and launches, with none of :func:`quantize_for_gemm`'s checks.
    Valid only for x of its signature; holds no tensor."""

    __slots__ = ("launch", "raw", "group", "rows", "m", "k", "ldx", "dtype", "device", "scale_shape", "stash",
                 "offsets")

    def __init__(self, group: str, rows: int, m: int, k: int, ldx: int, glu: str | None, dtype: torch.dtype,
                 device: torch.device):
        self.launch = _launcher(group, rows, m, k, ldx, glu, device)
        self.raw = None  # the launch with plain-int pointers (Launcher.raw), once a first call compiled it
        self.group, self.rows, self.m, self.k, self.ldx, self.dtype, self.device = group, rows, m, k, ldx, dtype, device
        self.scale_shape = (rows,) if group == "token" else (triton.cdiv(k, BLOCK), rows)
        self.stash = group == "token" and self.launch.meta["STASH"]  # (as the launcher's kernel was built)
        # :meth:`pointers`' one buffer: x8, then the scales, then the stash, each at a 256-byte boundary
        scale_at = _aligned(rows * k)
        stash_at = scale_at + _aligned(4 * rows * (1 if group == "token" else self.scale_shape[0]))
        end = stash_at + (m * k * dtype.itemsize if self.stash else 0)
        self.offsets = (scale_at, stash_at, end)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device
        x8 = torch.empty((self.rows, self.k), dtype=E4M3, device=device)  # written as bytes (_e4m3_bits)
        scale = torch.empty(self.scale_shape, dtype=torch.float32, device=device)
        stash = torch.empty((self.m, self.k), dtype=self.dtype, device=device) if self.stash else x
        if self.raw is not None:
            self._raw_launch(x.data_ptr(), x8.data_ptr(), scale.data_ptr(), stash.data_ptr())
            return x8, scale
        if self.group == "block128":
            args = (x, x8.view(torch.uint8), scale, self.m, self.k, self.ldx, self.rows)
        else:  # (the stash: x itself where the kernel reads none)
            args = (x, x8.view(torch.uint8), scale, stash, self.m, self.k, self.ldx)
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):  # the launch goes to the current device's stream
                self.launch(*args)
        else:
            self.launch(*args)
        if device.type == "cuda":
            self.raw = self.launch.raw()
        return x8, scale

    def pointers(self, x: torch.Tensor) -> tuple[object, int, int]:
        """``(keep, x8 pointer, scales pointer)``: x quantized into one allocation holding x8,
        the scales and the stash (fewer allocations than :meth:`__call__`'s tensors, for a
        caller that reads them by pointer: the GEMM); ``keep`` holds the memory until the caller
        has enqueued its reads (the caching allocator reuses it only for later work on the
        stream)."""
        if self.raw is None:  # no raw launch (not yet compiled, or the interpreter): the tensors
            x8, scale = self(x)
            return (x8, scale), x8.data_ptr(), scale.data_ptr()
        scale_at, stash_at, end = self.offsets
        buf = torch.empty(end, dtype=torch.uint8, device=self.device)
        ptr = buf.data_ptr()
        self._raw_launch(x.data_ptr(), ptr, ptr + scale_at, ptr + stash_at if self.stash else x.data_ptr())
        return buf, ptr, ptr + scale_at

    def _raw_launch(self, xp: int, x8p: int, sp: int, stash_p: int) -> None:
        if self.group == "block128":
            self.raw(self.device.index, xp, x8p, sp, self.m, self.k, self.ldx, self.rows)
        else:
            self.raw(self.device.index, xp, x8p, sp, stash_p, self.m, self.k, self.ldx)


# The bound quantizations by their signature (x8 and the scales are fresh allocations, always
# aligned).
_LAUNCHERS = BoundedCache(PLAN_CACHE_SIZE)


def check_activations(x, group: str, who: str = "quantize_activations", glu: str | None = None) -> None:
    """TypeError/ValueError naming the problem unless ``x`` is a 2-D bf16/fp16 tensor with unit
    column stride and K ≥ 1 (with ``glu``, an even number of columns ≥ 2), on CUDA (or the CPU
    under TRITON_INTERPRET=1), ``group`` one of :data:`GROUPS` and ``glu`` one of :data:`GLUS`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: x must be a torch.Tensor, got {type(x).__name__}")
    if group not in GROUPS:
        raise ValueError(f"{who}: group must be one of {GROUPS}, got {group!r}")
    if glu not in GLUS:
        raise ValueError(f"{who}: glu must be one of {GLUS}, got {glu!r}")
    if x.dtype not in IN_DTYPES:
        raise TypeError(f"{who}: x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{who}: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{who}: x has no features (K = 0): nothing to scale")
    if glu is not None and x.shape[1] % 2:
        raise ValueError(f"{who}: with glu={glu!r} x holds gate then up, an even number of columns; got {x.shape[1]}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        raise ValueError(f"{who}: x must be a CUDA tensor (or a CPU one under TRITON_INTERPRET=1), got {x.device}")


def bound_quantize(x: torch.Tensor, group: str, rows: int | None = None,
                   glu: str | None = None) -> tuple[torch.Tensor, BoundQuantize | None]:
    """``(x, bound)``: x checked (:func:`check_activations`; copied where its layout is not the
    kernel's: a column-strided or overlapping view) and the :class:`BoundQuantize` of its
    signature, for :func:`quantize_for_gemm` and callers that quantize x of one signature
    again (kernels/cublaslt_fp8.py); ``bound`` None for zero rows."""
    check_activations(x, group, glu=glu)
    m, k = x.shape[0], x.shape[1] // (1 if glu is None else 2)
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"quantize_for_gemm: rows ({rows}) must be at least x's {m} rows")
    width = x.shape[1]  # (2K with glu)
    if (width > 1 and x.stride(1) != 1) or (m > 1 and x.stride(0) < width):
        x = x.contiguous()  # a column-strided or overlapping view: one copy into the kernel's layout
    if rows == 0:
        return x, None
    ldx = x.stride(0) if m > 1 else width
    key = (group, rows, m, k, ldx, glu, x.dtype, x.get_device(), not x.data_ptr() & 15)
    bound = _LAUNCHERS.get(key)
    if bound is None:
        bound = _LAUNCHERS.put(key, BoundQuantize(group, rows, m, k, ldx, glu, x.dtype, x.device))
    return x, bound


def quantize_for_gemm(x: torch.Tensor, group: str, rows: int | None = None,
                      glu: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8 (rows, K) contiguous, scales)``: x (M, K) quantized (checked: :func:`check_activations`),
    ``rows`` ≥ M rows (default M; rows past M are zeros); with ``glu`` x is (M, 2K), gate then
    up, and the product is what is quantized (module docstring). Scales: ``token`` a (rows,)
    vector, ``block128`` an (L, rows) row-major buffer, L = ceil(K / 128) (M-major, cuBLASLt's
    layout)."""
    x, bound = bound_quantize(x, group, rows, glu)
    if bound is None:  # no rows
        k = x.shape[1] // (1 if glu is None else 2)
        scale_shape = (0,) if group == "token" else (triton.cdiv(k, BLOCK), 0)
        return (torch.empty((0, k), dtype=E4M3, device=x.device),
                torch.empty(scale_shape, dtype=torch.float32, device=x.device))
    return bound(x)


def quantize_activations(x: torch.Tensor, group: str = "token",
                         glu: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, scale)`` with ``x ≈ x8.float() * scale``: x (M, K) bf16/fp16 quantized to e4m3
    per token (scale (M,)) or per 1 x 128 block (scale (M, ceil(K/128)), M-major: strides
    (1, M)); with ``glu="silu"``, x (M, 2K) and ``silu(gate) * up ≈ x8.float() * scale``. See
    the module docstring for the formula. TypeError/ValueError for bad input."""
    x8, scale = quantize_for_gemm(x, group, glu=glu)
    return x8, scale if group == "token" else scale.t()


__all__ = ["GLUS", "GROUPS", "MIN_AMAX", "BoundQuantize", "bound_quantize", "check_activations", "quantize_activations",
           "quantize_for_gemm"]
