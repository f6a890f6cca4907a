"""tests/interpreter_calls.py: a helper call inside an interpreted launch skips only the language
patch the launch has made; results are those of the kernels as written."""

import os

import pytest
import torch
import triton
import triton.language as tl
from interpreter_core_helper import doubled

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's calls")


@triton.jit
def _squared(ptr, offs, mask):
    x = tl.load(ptr + offs, mask=mask)
    return x * x


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # a helper of this module (its language patched by the launch), then one of a module that
    # names only triton.language.core (patched at its call)
    tl.store(out_ptr + offs, _squared(x_ptr, offs, mask) + doubled(x_ptr, offs, mask), mask=mask)


def test_the_helper_skip_is_installed():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "_once", False)


def test_helpers_of_either_module_compute_as_written():
    x = torch.randn(37, dtype=torch.float64)
    out = torch.full_like(x, float("nan"))
    _kernel[(3,)](x, out, x.numel(), BLOCK=16)
    torch.testing.assert_close(out, x * x + 2 * x, rtol=0, atol=0)
