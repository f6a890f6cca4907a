"""hybridgemm: bias- and activation-fused GEMMs for PyTorch.

Importing the package does no GPU work and needs no CUDA driver.
"""

__version__ = "0.1.0"

from hybridgemm.kernels.epilogue import Activation, Epilogue

__all__ = ["Activation", "Epilogue", "__version__"]
