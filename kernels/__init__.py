"""The two backends (cuBLASLt through nvmath-python, Triton) and the shared epilogue vocabulary.

Importing this package touches no GPU and needs neither CUDA nor nvmath-python.
"""

from .epilogue import ALL_EPILOGUES, Activation, Epilogue, reference_linear
from .problem import Problem

__all__ = ["ALL_EPILOGUES", "Activation", "Epilogue", "Problem", "reference_linear"]
