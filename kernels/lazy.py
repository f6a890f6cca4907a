"""The one way to reach a Triton kernel module from code that ``import hybridgemm`` loads:
:func:`triton_module`, which imports it (and Triton with it) on first use.

Why: ``import hybridgemm`` must work where Triton is absent (the CPU path and ``hybridgemm
show`` need none), so the dispatcher, the fused modules and the backends registry load the
Triton kernels only when a call needs one. The layering test (tests/test_layers.py) reads
every ``triton_module("...")`` call as an import of that module and checks the set of them;
hence the argument is always a string literal.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# kernels/ modules that import Triton at module level
TRITON_MODULES = frozenset({
    "triton_config", "triton_decode_attention", "triton_dequant", "triton_e4m3", "triton_epilogue", "triton_gemm",
    "triton_glu", "triton_launch", "triton_layernorm", "triton_moe", "triton_moe_configs", "triton_moe_pairs",
    "triton_plan", "triton_prefetch", "triton_push_sum", "triton_qk_rope", "triton_rmsnorm", "triton_rope",
    "triton_router", "triton_scratch", "triton_splitk", "triton_splitk_configs",
})

_loaded: dict[str, ModuleType] = {}


def triton_module(name: str) -> ModuleType:
    """``hybridgemm.kernels.<name>``, imported on the first call (ImportError without Triton, or
    where this Triton lacks what the module needs). ValueError for a name not in
    :data:`TRITON_MODULES`."""
    module = _loaded.get(name)
    if module is None:
        if name not in TRITON_MODULES:
            raise ValueError(f"triton_module: {name!r} is not a Triton kernel module; known: "
                             f"{', '.join(sorted(TRITON_MODULES))}")
        module = _loaded[name] = importlib.import_module(f"{__package__}.{name}")
    return module


__all__ = ["TRITON_MODULES", "triton_module"]
