"""hybridgemm: bias- and activation-fused GEMMs for PyTorch.

Importing the package does no GPU work and needs no CUDA driver (it registers the
``hybridgemm::`` custom ops with ``torch.library``, which is host-only bookkeeping).
Tensor parallelism (``hybridgemm.parallel``: ``parallelize``, ``load_full_state_dict``,
``ParallelReport``) is imported on first use, so that ``import hybridgemm`` does not load
torch's functional collectives.
"""

import importlib

from hybridgemm.attention import AttentionProjection, HybridMultiheadAttention, attention_projection
from hybridgemm.decide import reload_tables, set_table_path
from hybridgemm.experts import explain_moe, moe, route
from hybridgemm.explain import explain  # the function; the module is sys.modules['hybridgemm.explain']
from hybridgemm.fp8_linear import FP8Linear
from hybridgemm.kernels.checks import LinearArgumentError
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.fp8 import FP8FormatError, FP8Weight, quantize_fp8
from hybridgemm.kernels.version import __version__
from hybridgemm.linear_layer import HybridLinear, linear
from hybridgemm.mlp import gated_linear
from hybridgemm.mode_state import get_mode, mode, set_mode
from hybridgemm.models.patching import PatchReport, patch, unpatch

_PARALLEL = ("ParallelReport", "load_full_state_dict", "parallelize")


def __getattr__(name: str):
    if name == "parallel" or name in _PARALLEL:
        module = importlib.import_module("hybridgemm.parallel")
        return module if name == "parallel" else getattr(module, name)
    raise AttributeError(f"module 'hybridgemm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "parallel", *_PARALLEL})


__all__ = [
    "Activation", "AttentionProjection", "Epilogue", "FP8FormatError", "FP8Linear", "FP8Weight", "HybridLinear",
    "HybridMultiheadAttention", "LinearArgumentError", "ParallelReport", "PatchReport", "__version__",
    "attention_projection", "explain", "explain_moe", "gated_linear", "get_mode", "linear", "load_full_state_dict",
    "mode", "moe", "parallelize", "patch", "quantize_fp8", "reload_tables", "route", "set_mode", "set_table_path",
    "unpatch",
]
