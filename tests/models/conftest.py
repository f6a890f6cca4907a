"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from hybridgemm import dispatch
from hybridgemm.kernels import triton_splitk
from hybridgemm.models import decode_checks as checks

# Split-K tiles one 32-wide head wide (the tiny decode models' head_dim), split in two with the
# in-kernel reduction.
HEAD_WIDE_FUSED_REDUCE = triton_splitk.TritonSplitKConfig(16, 32, 32, split_k=2, num_warps=4, num_stages=2,
                                                          fused_reduce=True)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The fused decode path on CPU tensors (Triton interpreter) with split-K config
    ``state["config"]``, its norm prologue fused where ``state["prologue"]`` (the tests' small
    configs are not the shape ``triton_splitk.prologue_fits`` takes on a GPU); counts the split-K
    calls that carry a rope (``state["rope"]``), a norm (``state["norm"]``), arrival counters
    (``state["counters"]``) and a second product (``state["second"]``)."""
    state = {"config": HEAD_WIDE_FUSED_REDUCE, "prologue": True, "rope": 0, "norm": 0, "counters": 0, "second": 0}
    monkeypatch.setattr(checks, "on_kernel_device", lambda x: True)
    monkeypatch.setattr(dispatch, "splitk_config", lambda x2, w, b, out, weight_format="": state["config"])
    monkeypatch.setattr(triton_splitk, "prologue_fits", lambda config, itemsize: state["prologue"])
    real_run = triton_splitk.run

    def run(cfg, *a, rope=None, counters=None, **kw):
        state["rope"] += rope is not None
        state["norm"] += kw.get("norm") is not None
        state["counters"] += counters is not None
        state["second"] += kw.get("second") is not None
        return real_run(cfg, *a, rope=rope, counters=counters, **kw)

    monkeypatch.setattr(triton_splitk, "run", run)
    return state
