"""A @triton.jit helper in a module that names the language only as ``triton.language.core``
(tests/test_interpreter_calls.py)."""

import triton
from triton.language import core


@triton.jit
def doubled(ptr, offs, mask):
    return core.load(ptr + offs, mask=mask) * 2
