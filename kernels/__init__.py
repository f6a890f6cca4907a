"""The two backends (cuBLASLt through nvmath-python, Triton) and the shared epilogue vocabulary.

Importing this package touches no GPU and needs neither CUDA nor nvmath-python.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _is_checkout(path: str) -> bool:
    # a hybridgemm source tree (this one or another): its kernels/ is never the package to load
    return all(os.path.isdir(os.path.join(path, d, "")) for d in ("kernels", "fusion", "autotune_cache"))


def _stand_aside_for_the_installed_kernels() -> bool:
    """Put the installed top-level ``kernels`` package in this module's place; False where there is none.

    This directory is the package ``hybridgemm.kernels``. Where a checkout's root is on ``sys.path``
    (``python -m``/``-c`` run from it, ``python -m pytest``), it is also found under the bare name
    ``kernels``: the name of Hugging Face's kernels distribution, which transformers (>= 5.25 depends
    on it) imports. The import system returns whatever ``sys.modules`` holds once this body has run.
    """
    elsewhere = [p for p in sys.path if isinstance(p, str) and not _is_checkout(p or os.curdir)]
    spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
    if spec is None or spec.origin is None or spec.loader is None:  # none, or a namespace package: a bare folder
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _stand_aside_for_the_installed_kernels():
    from .epilogue import ALL_EPILOGUES, Activation, Epilogue, reference_linear
    from .problem import Problem

    __all__ = ["ALL_EPILOGUES", "Activation", "Epilogue", "Problem", "reference_linear"]
