"""hybridgemm: bias- and activation-fused GEMMs for PyTorch.

Importing the package does no GPU work and needs no CUDA driver (it registers the
``hybridgemm::`` custom ops with ``torch.library``, which is host-only bookkeeping).
"""

from hybridgemm.attention import AttentionProjection, HybridMultiheadAttention, attention_projection
from hybridgemm.decide import explain, get_mode, mode, reload_tables, set_mode, set_table_path
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.version import __version__
from hybridgemm.linear_layer import HybridLinear, linear
from hybridgemm.mlp import gated_linear
from hybridgemm.patching import PatchReport, patch, unpatch

__all__ = [
    "Activation", "AttentionProjection", "Epilogue", "HybridLinear", "HybridMultiheadAttention",
    "PatchReport", "__version__", "attention_projection", "explain", "gated_linear", "get_mode", "linear", "mode",
    "patch",
    "reload_tables", "set_mode", "set_table_path", "unpatch",
]
