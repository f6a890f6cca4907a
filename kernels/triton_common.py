"""What the two Triton kernels share: epilogue math, operand checks, device facts, config
records, launch plans and their cache.

Nothing here touches a GPU at import time; device facts are queried on first use and cached.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import operand_key
from .epilogue import Activation, Epilogue
from .problem import DTYPE_NAMES, Problem, dtype_name
from .process_memory import per_call

# H100/H200 opt-in shared memory per block; what candidates() assume when no device is given.
HOPPER_SMEM_PER_BLOCK = 232448
HOPPER_NUM_SMS = 132  # H200 (SXM); candidates() use it to size split-K grids
INT32_LIMIT = 2**31 - 1  # the kernels compute element offsets in 32-bit integers
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned base pointers and row strides

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
def tl_add_residual(acc, res_ptrs, mask, out_dtype: tl.constexpr):
    """``residual + y`` as the decoder layer's add computes it: y rounded to the output dtype
    first, the sum in fp32, rounded by the caller's store."""
    return acc.to(out_dtype).to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)


def dot_precision(problem: Problem) -> str:
    """fp32 inputs use TF32 tensor cores only when the caller allowed it; otherwise exact fp32."""
    return "tf32" if problem.dtype != torch.float32 or problem.tf32 else "ieee"


def pdl_enabled(capability: tuple[int, int]) -> bool:
    """Launch the decode kernels (split-K GEMM, gated GEMM) with programmatic dependent launch
    (PDL) on Hopper and later.

    Why: a decode GEMV lasts ~10 µs, and a kernel boundary (the next grid's launch and start)
    costs about a microsecond of it. With PDL the next grid is launched while this one runs its
    epilogue (``gdc_launch_dependents``) and waits (``gdc_wait``) before touching memory, so
    the boundary overlaps. Correctness does not depend on the neighbours: the wait returns only
    once the previous kernel on the stream has completed and its writes are visible, whoever
    launched it; kernels launched after ours without PDL wait for our completion as usual.
    ``HYBRIDGEMM_PDL=0`` turns it off (read when a plan is built)."""
    if interpreting() or capability < (9, 0):
        return False
    return os.environ.get("HYBRIDGEMM_PDL", "1") not in ("0", "")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- device facts


@dataclass(frozen=True)
class DeviceFacts:
    num_sms: int
    capability: tuple[int, int]
    smem_per_block: int


# Under the interpreter (CPU) a persistent grid of 4 programs makes every program loop over
# several tiles in the small test shapes, and TMA descriptors work there, so say "Hopper".
_INTERPRETER_FACTS = DeviceFacts(num_sms=4, capability=(9, 0), smem_per_block=HOPPER_SMEM_PER_BLOCK)
_FACTS: dict[int, DeviceFacts] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_facts(device: torch.device) -> DeviceFacts:
    """SM count, compute capability and opt-in shared memory of ``device``; cached per index."""
    if device.type != "cuda":
        return _INTERPRETER_FACTS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    facts = _FACTS.get(idx)
    if facts is None:
        props = torch.cuda.get_device_properties(idx)
        smem = getattr(props, "shared_memory_per_block_optin", 0)
        if not smem:  # older torch: ask Triton's driver, which is what its compiler checks against
            smem = triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"]
        facts = DeviceFacts(props.multi_processor_count, (props.major, props.minor), int(smem))
        _FACTS[idx] = facts
    return facts


# ----------------------------------------------------------------------------- operands


def check_operands(x, weight, bias, out) -> None:
    """Clear TypeError/ValueError for anything the kernels cannot take. Run once per plan."""
    named = {"x": x, "weight": weight, "out": out} | ({} if bias is None else {"bias": bias})
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or weight.dim() != 2 or out.dim() != 2:
        raise ValueError(
            f"x, weight and out must be 2-D, got x{tuple(x.shape)}, weight{tuple(weight.shape)}, "
            f"out{tuple(out.shape)}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or tuple(out.shape) != (m, n):
        raise ValueError(
            f"shape mismatch: x{tuple(x.shape)} @ weight{tuple(weight.shape)}.T -> out{tuple(out.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or (n > 1 and bias.stride(0) != 1)):
        raise ValueError(f"bias must be a contiguous vector of {n} elements, got {tuple(bias.shape)}")
    dtype_name(x.dtype)  # TypeError for anything but fp16/bf16/fp32
    for name, t in named.items():
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; all must match")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if (k > 1 and (x.stride(1) != 1 or weight.stride(1) != 1)) or (n > 1 and out.stride(1) != 1):
        raise ValueError("x, weight and out need unit column stride (rows may be padded)")
    if m > 1 and out.stride(0) < n:
        raise ValueError(f"out rows overlap (row stride {out.stride(0)} < N={n})")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (got {x.device}) or TRITON_INTERPRET=1")


# Activation is a str enum, so this dict answers Activation members and their string values
# alike with one hash lookup (Activation.parse costs ~0.5 µs per call).
_ACTIVATIONS = {None: Activation.NONE, **{a.value: a for a in Activation}}


def parse_activation(activation) -> Activation:
    try:
        return _ACTIVATIONS[activation]
    except (KeyError, TypeError):
        return Activation.parse(activation)


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


# ----------------------------------------------------------------------------- split-K scratch
#
# Both kernels can split K and reduce the fp32 partials in fixed split order. Scratch memory:
#   - a workspace [SPLIT_K, M, N] fp32 for the partials;
#   - for the single-pass reduction, an int32 arrival counter per output tile. A counter only
#     signals "every split of this tile has written its partial"; it never carries values. The
#     program that arrives last sums the partials in split order 0..S-1 and resets the counter
#     to 0, so the buffer is all zeros between calls (what the next call and graph replays need).
#
# Both are kept per (device, stream) from torch's caching allocator and never freed: a CUDA
# graph captured with a split-K call bakes in their addresses. Calls from compiled regions take
# fresh ones per call instead (kernels/process_memory.py). Graphs captured on one stream
# share them: do not replay such graphs concurrently with each other or with eager calls on
# that stream.
#
# Counters must be zero before the first use. A buffer created eagerly is zeroed eagerly. One
# created while the stream is being captured is zeroed by a memset *inside that graph*; it is
# reused by later captures on that stream (which then rely on that graph, or any eager/replayed
# call using the buffer, having run first) but never by eager calls, which get a fresh buffer.
# Warm up eagerly before capturing (torch's advice anyway) and none of this matters.

_WORKSPACES: dict[tuple, torch.Tensor] = {}
_COUNTERS: dict[tuple, tuple[torch.Tensor, bool]] = {}
_RETIRED: list[torch.Tensor] = []  # replaced counter buffers a captured graph may still use


def _stream_key(device: torch.device) -> tuple:
    if device.type != "cuda":
        return (device.type, device.index, 0)
    # torch.cuda.current_stream() builds a Stream object (~10 µs on a slow host, once per
    # split-K call); the raw getter returns the same cudaStream_t as an int.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _get_raw_stream is not None:
        return (device.type, index, _get_raw_stream(index))
    return (device.type, index, torch.cuda.current_stream(index).cuda_stream)


def workspace(device: torch.device, numel: int, stream_key: tuple | None = None) -> torch.Tensor:
    """An fp32 buffer of ≥ ``numel`` elements for the current stream; sizes are bucketed to
    powers of two (≥ 1 MiB) so varying M reuses a few buffers. Never freed (see above)."""
    nbytes = max(1 << 20, next_pow2(numel * 4))
    key = (stream_key or _stream_key(device)) + (nbytes,)
    buf = _WORKSPACES.get(key)
    if buf is None:
        buf = _WORKSPACES[key] = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    return buf


def split_counters(device: torch.device, numel: int, stream_key: tuple | None = None) -> torch.Tensor:
    """A zero-filled int32 buffer of ≥ ``numel`` arrival counters for the current stream."""
    key = stream_key or _stream_key(device)
    entry = _COUNTERS.get(key)
    if entry is not None and entry[0].numel() >= numel and not entry[1]:
        return entry[0]  # the common case: an eagerly zeroed buffer, no capture query needed
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if entry is not None and entry[0].numel() >= numel and capturing:
        return entry[0]
    if entry is not None:
        _RETIRED.append(entry[0])
    buf = torch.zeros(max(1024, next_pow2(numel)), dtype=torch.int32, device=device)
    _COUNTERS[key] = (buf, capturing)
    return buf


def split_scratch(device: torch.device, ws_numel: int, counters: int) -> tuple:
    """(workspace, counters or None) for a split-K launch on the current stream; fresh ones,
    dropped after the call, inside ``process_memory.per_call_scratch`` (compiled regions)."""
    if per_call():
        ws = torch.empty(ws_numel, dtype=torch.float32, device=device)
        return ws, (torch.zeros(counters, dtype=torch.int32, device=device) if counters else None)
    key = _stream_key(device)
    ws = workspace(device, ws_numel, key)
    return ws, (split_counters(device, counters, key) if counters else None)


def workspace_bytes() -> int:
    """Bytes held by cached split-K workspaces (for tests and memory accounting)."""
    return sum(b.numel() * 4 for b in _WORKSPACES.values())


def counters_snapshot() -> list[torch.Tensor]:
    """The live counter buffers (tests check that every call leaves them all zero)."""
    return [buf for buf, _ in _COUNTERS.values()]


def clear_workspaces() -> None:
    """Drop cached workspaces and counters. Unsafe while a captured CUDA graph still uses one."""
    _WORKSPACES.clear()
    _COUNTERS.clear()
    _RETIRED.clear()


@triton.jit
def tl_split_fixup(acc, ws_ptr, offs, mask, split_stride, cnt_ptr, pid_s, split_k):
    """Single-pass deterministic split-K reduction of one output tile.

    Every split program stores its fp32 partial ``acc`` at ``ws_ptr + pid_s * split_stride +
    offs`` and then bumps the tile's counter. The program that sees ``split_k - 1`` arrived
    before it returns ``(sum of the partials in split order 0..split_k-1, True)`` and resets
    the counter; the others return ``(acc, False)`` and must not store. Which program finishes
    the tile varies from run to run, the sum and its order do not: bit-identical results.

    Ordering: the barrier makes the whole CTA's partial stores happen before thread 0's
    release (acq_rel, GPU scope) increment; the last program's acquire makes the other
    programs' partials visible to it, and its loads bypass L1 (``.cg``).
    """
    tl.store(ws_ptr + pid_s * split_stride + offs, acc, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == split_k - 1
    total = acc
    if last:
        # where(c, mask, False), not mask & c: same PTX; Triton 3.9's interpreter rejects mask & c as an int32 mask
        first = tl.load(ws_ptr + offs, mask=tl.where(pid_s != 0, mask, False), other=0.0, cache_modifier=".cg")
        total = tl.where(pid_s == 0, acc, first)
        for s in range(1, split_k):  # fixed order; this program's own partial from registers
            # where(), not &, for the same reason as above (scalar comparison in the load mask)
            part = tl.load(ws_ptr + s * split_stride + offs, mask=tl.where(s != pid_s, mask, False),
                           other=0.0, cache_modifier=".cg")
            total += tl.where(s == pid_s, acc, part)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call
    return total, last


# ----------------------------------------------------------------------------- launches


class Launcher:
    """Launch one @triton.jit kernel on a fixed grid with fixed constexprs, cheaply.

    The first call goes through ``JITFunction.__getitem__`` (binds, specialises, compiles) and
    returns the ``CompiledKernel``; later calls use ``CompiledKernel[grid]`` (Triton's public
    launcher of an already compiled kernel), skipping the per-call argument binding and cache
    key. That is valid because a Launcher belongs to one plan, whose key fixes everything
    Triton specialises on: every integer argument's value, each pointer's 16-byte alignment,
    the dtypes, the device. Without a CompiledKernel (the interpreter, another Triton version)
    or with HYBRIDGEMM_TRITON_SLOW_LAUNCH=1 every call takes the normal path.
    """

    __slots__ = ("fn", "grid", "meta", "tail", "runner", "compiled")

    def __init__(self, fn, grid: tuple, meta: dict):
        self.fn, self.grid, self.meta = fn, grid, meta
        self.tail: tuple | None = None  # constexpr values, in signature order after the args
        self.runner = None
        self.compiled = None  # the CompiledKernel, once the fast path is set up

    def raw(self):
        """A launch with no Python of Triton's in between: ``fn(device, *args)`` where pointer
        arguments are plain ints (Triton's C launcher then skips its per-pointer
        ``data_ptr()`` call and driver query: about half of a decode call's host time on the
        H200 machine). It launches on ``device``'s current stream, entering the device first
        only when it is not current, and defers to Triton's runner while a launch hook is
        installed. None until a first call has set up the fast path, or where this Triton's
        launcher is not the one this was written against (3.x CUDA launcher, no scratch).
        Like the fast runner, valid only for arguments of this plan's signature."""
        compiled = self.compiled
        if compiled is None:
            return None
        launcher = compiled.run
        c_launch = getattr(launcher, "launch", None)
        # Triton >= 3.8's launcher (it has kernel_signature) parses another C argument layout: no raw launch
        if (c_launch is None or hasattr(launcher, "kernel_signature") or getattr(launcher, "global_scratch_size", 1)
                or getattr(launcher, "profile_scratch_size", 1) or _get_raw_stream is None):
            return None
        coop = int(bool(launcher.launch_cooperative_grid))
        pdl = int(bool(launcher.launch_pdl))
        function, packed, tail = compiled.function, compiled.packed_metadata, self.tail
        gx, gy, gz = tuple(self.grid) + (1,) * (3 - len(self.grid))
        hooks = triton.knobs.runtime
        slow = self.runner

        def launch(device: int, *args):
            if _get_device() != device:
                with torch.cuda.device(device):  # then the call below takes the current-device path
                    launch(device, *args)
                return
            if _hooks_installed(hooks):
                slow(*args, *tail)
                return
            c_launch(gx, gy, gz, _get_raw_stream(device), function, coop, pdl, None, None, packed, None, None,
                     None, *args, *tail)

        return launch

    def __call__(self, *args) -> None:
        runner = self.runner
        if runner is not None:
            runner(*args, *self.tail)
            return
        compiled = self.fn[self.grid](*args, **self.meta)
        if self.tail is None:  # only the first call tries to set up the fast path
            self.tail = ()
            self.runner = self._fast_runner(compiled, len(args))

    def _fast_runner(self, compiled, nargs: int):
        if interpreting() or os.environ.get("HYBRIDGEMM_TRITON_SLOW_LAUNCH", "0") not in ("", "0"):
            return None
        compiled_cls = getattr(getattr(triton, "compiler", None), "CompiledKernel", None)
        names = getattr(self.fn, "arg_names", None)
        if compiled_cls is None or not isinstance(compiled, compiled_cls) or names is None:
            return None
        try:
            tail = tuple(self.meta[name] for name in names[nargs:])
            grid = tuple(self.grid) + (1,) * (3 - len(self.grid))  # it reads 3 dims
            runner = _direct_runner(compiled, grid) or compiled[grid]
        except (KeyError, TypeError, AttributeError):
            return None
        self.tail = tail
        self.compiled = compiled
        return runner


_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _hooks_installed(hooks) -> bool:
    """Is a Triton launch hook installed (profilers, proton)? Triton 3.6 keeps them in
    HookChain objects (never None); an empty chain is no hook."""
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


def _direct_runner(compiled, grid: tuple):
    """``CompiledKernel[grid]`` minus its per-call Python: Triton's runner asks the driver
    for the device and stream and builds launch metadata for hooks on every call (about a
    third of a split-K decode call's host time on the H200 machine). This calls the
    compiled launcher itself, with torch's current raw stream, and defers to Triton's
    runner whenever a launch hook is installed (profilers, proton). None when this Triton's
    CompiledKernel does not look like the one this was written against (3.x)."""
    knobs = getattr(triton, "knobs", None)
    needed = ("run", "function", "packed_metadata", "_init_handles")
    if knobs is None or _get_device is None or _get_raw_stream is None or not all(
            hasattr(compiled, a) for a in needed):
        return None
    compiled._init_handles()
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    gx, gy, gz = grid
    hooks = knobs.runtime
    slow = compiled[grid]

    def runner(*args):
        if _hooks_installed(hooks):
            slow(*args)
            return
        run(gx, gy, gz, _get_raw_stream(_get_device()), function, packed, None, None, None, *args)

    return runner


# ----------------------------------------------------------------------------- plans

PLAN_CACHE_SIZE = 4096  # plans per kernel: varying M in a server makes new keys; rebuilding is cheap


@dataclass(frozen=True)
class TritonPlan:
    """Everything about a launch that depends only on (config, operand layout, activation,
    tf32), computed once, so that a repeated call does no Problem construction, no
    ``supports`` check, no device query and no grid arithmetic."""

    device: torch.device
    launch: Launcher | None = None
    scalars: tuple = ()  # the kernel's integer arguments
    ws_numel: int = 0  # split-K workspace elements (0 without a split)
    counters: int = 0  # split-K arrival counters (output tiles of a one-launch reduction, else 0)
    descs: tuple | None = None  # TMA: per operand (shape, strides, block_shape)
    reduce: Launcher | None = None  # the second launch of a two-launch split-K reduction
    reduce_scalars: tuple = ()
    empty: bool = False  # M or N is 0: nothing to launch


class PlanCache(dict):
    """One kernel's plans by (config, activation, tf32, operand layout): ``operand_key`` with
    16-byte pointer classes (what Triton specialises pointer arguments on and TMA needs).

    Bounded: cleared when full. Thread-safe through the dict's own atomic operations: two
    threads missing the same key both build a plan, and either is valid."""

    def __init__(self, build, capacity: int = PLAN_CACHE_SIZE):
        super().__init__()
        self.build = build  # (config, x, weight, bias, out, act, tf32) -> TritonPlan
        self.capacity = capacity

    def plan(self, config, x, weight, bias, out, activation, tf32, build: bool = True) -> TritonPlan | None:
        """The plan for these operands, built on a miss (None on a miss when not ``build``)."""
        act = parse_activation(activation)
        tf32 = bool(tf32)
        key = (config, act, tf32, operand_key(x, x.data_ptr(), weight, weight.data_ptr(), bias, out, 15))
        plan = self.get(key)
        if plan is None and build:
            if len(self) >= self.capacity:
                self.clear()
            plan = self[key] = self.build(config, x, weight, bias, out, act, tf32)
        return plan


def plan_problem(config, x, weight, bias, out, act: Activation, tf32: bool):
    """What building any plan starts with: the operand checks (clear errors), the Problem, and
    ``config.supports`` on x's device. ``(problem, device facts)``, or None for an empty output
    (M or N is 0). Raises ValueError when the config cannot run the problem there."""
    check_operands(x, weight, bias, out)
    problem = Problem.from_tensors(x, weight, bias, out, Epilogue(act, bias is not None), tf32)
    if problem.m == 0 or problem.n == 0:
        return None
    facts = device_facts(x.device)
    ok, reason = config.supports(problem, smem_limit=facts.smem_per_block, capability=facts.capability)
    if not ok:
        raise ValueError(f"{config} does not support {problem}: {reason}")
    return problem, facts


def plan_meta(config, problem: Problem, act: Activation, has_bias: bool) -> dict:
    """The constexprs and launch options both kernels take, from a config with block_m/n/k,
    num_warps and num_stages."""
    return dict(BM=config.block_m, BN=config.block_n, BK=config.block_k, HAS_BIAS=has_bias, ACT=ACT_CODE[act],
                PREC=dot_precision(problem), EVEN_K=problem.k % config.block_k == 0,
                num_warps=config.num_warps, num_stages=config.num_stages)


def split_extent(k: int, block_k: int, split: int) -> int:
    """Elements of K per split: whole blocks, spread evenly over ``split`` programs."""
    return triton.cdiv(triton.cdiv(k, block_k), split) * block_k


def check_fusion(x: torch.Tensor, out: torch.Tensor, norm: tuple | None, residual: torch.Tensor | None,
                 who: str) -> None:
    """ValueError/TypeError unless ``norm`` is None or (a contiguous K-vector of x's dtype on x's
    device, a finite eps ≥ 0) and ``residual`` is None or an (M, N) tensor like ``out`` with unit
    column stride."""
    if norm is not None:
        if not (isinstance(norm, tuple) and len(norm) == 2):
            raise TypeError(f"{who}: norm must be a (weight, eps) pair, got {type(norm).__name__}")
        nw, eps = norm
        if not isinstance(nw, torch.Tensor) or nw.dim() != 1 or nw.shape[0] != x.shape[1] or nw.stride(0) != 1:
            raise ValueError(f"{who}: the norm weight must be a contiguous vector of {x.shape[1]} elements (x's K)")
        if nw.dtype != x.dtype or nw.device != x.device:
            raise TypeError(f"{who}: the norm weight must have x's dtype and device ({x.dtype}, {x.device}), got "
                            f"{nw.dtype} on {nw.device}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
            raise ValueError(f"{who}: norm eps must be a finite number ≥ 0, got {eps!r}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{who}: residual must be a tensor, got {type(residual).__name__}")
        if residual.shape != out.shape or residual.dtype != out.dtype or residual.device != out.device:
            raise ValueError(f"{who}: residual must match the output ({tuple(out.shape)}, {out.dtype}, {out.device}), "
                             f"got {tuple(residual.shape)}, {residual.dtype}, {residual.device}")
        if residual.stride(1) != 1 or (residual.shape[0] > 1 and residual.stride(0) < residual.shape[1]):
            raise ValueError(f"{who}: residual rows must be row-major with unit column stride")


def plan_scratch(plan: TritonPlan, placeholder: torch.Tensor, counters: torch.Tensor | None = None) -> tuple:
    """(workspace, counters) for a launch of ``plan`` on the current stream; ``placeholder``
    for each that the plan does not use (never dereferenced). ``counters``: the caller's own
    zeroed int32 arrival counters, used in compiled regions (``per_call_scratch``) when the plan
    needs no more than they hold (the kernels leave them zero again), in place of a zero-filled
    buffer per call; eager calls use their stream's (a caller's buffer is not per stream)."""
    if not plan.ws_numel:
        return placeholder, placeholder
    if counters is not None and plan.counters and counters.numel() >= plan.counters and per_call():
        ws, _ = split_scratch(plan.device, plan.ws_numel, 0)
        return ws, counters
    ws, cnt = split_scratch(plan.device, plan.ws_numel, plan.counters)
    return ws, (ws if cnt is None else cnt)
