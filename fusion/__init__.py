"""hybridgemm: bias- and activation-fused GEMMs for PyTorch.

Importing the package does no GPU work and needs no CUDA driver (it registers the
``hybridgemm::`` custom ops with ``torch.library``, which is host-only bookkeeping).
"""

__version__ = "0.1.0"

# The submodule fusion/linear.py and the function share the name ``hybridgemm.linear``:
# ``from hybridgemm.linear import linear`` below runs after that submodule is loaded, so
# the package attribute ends up being the function (never import it lazily).
from hybridgemm.attention import AttentionProjection, HybridMultiheadAttention, attention_projection
from hybridgemm.dispatch import explain
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.linear import HybridLinear, linear
from hybridgemm.modes import get_mode, mode, set_mode
from hybridgemm.patching import PatchReport, patch, unpatch

__all__ = [
    "Activation", "AttentionProjection", "Epilogue", "HybridLinear", "HybridMultiheadAttention",
    "PatchReport", "__version__", "attention_projection", "explain", "get_mode", "linear", "mode", "patch", "set_mode",
    "unpatch",
]
