"""How the Triton kernels are launched: :class:`Launcher` (one @triton.jit kernel on a fixed grid
with fixed constexprs, with a fast path past Triton's per-call Python and a raw launch taking
data pointers as ints), the device facts the launch plans size their grids and stages with,
and whether a kernel uses programmatic dependent launch.

Serves every Triton kernel here: triton_gemm, triton_splitk, triton_glu, triton_rmsnorm,
triton_decode_attention and triton_push_sum (their launches), triton_moe_pairs and triton_router
(:func:`pdl_options`), and the launch plans of
triton_plan; kernels/backends.py reads :func:`device_facts` for the tuner's limits. Nothing
here touches a GPU at import time: device facts are queried on first use and cached.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from .triton_config import HOPPER_SMEM_PER_BLOCK

# The current device index and its current cudaStream_t as ints, through torch's raw getters
# (no Stream object built per call); None on a torch without them (no raw launch then).
get_device = getattr(torch._C, "_cuda_getDevice", None)
get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def interpreting() -> bool:
    """Are the kernels run by Triton's CPU interpreter (``TRITON_INTERPRET=1``)?"""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


def pdl_options(x: torch.Tensor) -> dict:
    """The ``PDL`` constexpr and the ``launch_pdl`` option of a plain ``kernel[grid](...)``
    launch on x's device (:func:`pdl_enabled`), read once per device, not per launch."""
    return _pdl_options(x.device) if x.is_cuda else _NO_PDL


_NO_PDL = {"PDL": False}


@functools.cache
def _pdl_options(device: torch.device) -> dict:
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device_facts(device).capability) else _NO_PDL


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
                or getattr(launcher, "profile_scratch_size", 1) or get_raw_stream is None):
            return None
        coop = int(bool(launcher.launch_cooperative_grid))
        pdl = int(bool(launcher.launch_pdl))
        function, packed, tail = compiled.function, compiled.packed_metadata, self.tail
        gx, gy, gz = tuple(self.grid) + (1,) * (3 - len(self.grid))
        hooks = triton.knobs.runtime
        slow = self.runner

        def launch(device: int, *args):
            if get_device() != device:
                with torch.cuda.device(device):  # then the call below takes the current-device path
                    launch(device, *args)
                return
            if _hooks_installed(hooks):
                slow(*args, *tail)
                return
            c_launch(gx, gy, gz, get_raw_stream(device), function, coop, pdl, None, None, packed, None, None,
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
    if knobs is None or get_device is None or get_raw_stream is None or not all(
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
        run(gx, gy, gz, get_raw_stream(get_device()), function, packed, None, None, None, *args)

    return runner


__all__ = ["DeviceFacts", "Launcher", "device_facts", "get_device", "get_raw_stream", "interpreting", "pdl_enabled"]
