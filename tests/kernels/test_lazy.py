"""kernels/lazy.py: the one accessor of the Triton kernel modules (the layering test checks its
callers; tests/test_layers.py)."""

from __future__ import annotations

import importlib

import pytest

from hybridgemm.kernels import lazy


def test_returns_the_module_itself():
    for name in ("triton_splitk", "triton_config", "triton_scratch"):
        assert lazy.triton_module(name) is importlib.import_module(f"hybridgemm.kernels.{name}")


@pytest.mark.parametrize("name", ["cublaslt", "triton_common", "os", "", "triton_splitk.run"])
def test_other_names_are_refused(name):
    with pytest.raises(ValueError, match="not a Triton kernel module"):
        lazy.triton_module(name)
