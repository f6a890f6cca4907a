"""The gated kernel's table entries on the GPU (``pytest -m gpu``): the tuner fills one entry per
decode octave for each prologue, timed against its baseline; the gated decision then runs what
the entry says (its config, or the composition apart for ``torch``), and the results are as
close to the fp32 computation as the stock modules'."""

from __future__ import annotations

import pytest
import torch

from hybridgemm import decide, dispatch
from hybridgemm.autotune_cache import tune_glu
from hybridgemm.autotune_cache.table import TuningTable
from hybridgemm.kernels import triton_glu
from hybridgemm.norm import prologue_norm

pytestmark = pytest.mark.gpu

WIDTH, K = 320, 576  # gate/up: I (WIDTH) and K, neither a multiple of 128


def _rel(a, ref) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(scope="module")
def tuned():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    table = TuningTable(None)
    keys = tune_glu.glu_keys(None, torch.bfloat16, WIDTH, K, m_max=8) + tune_glu.glu_keys("x", torch.bfloat16, WIDTH, K,
                                                                                     m_max=8)
    for key, entry in tune_glu.tune_glu(WIDTH, K, torch.bfloat16, keys, table, prologue_norm):
        table.set(key, entry)
    return table, keys


def test_the_tuner_fills_each_range_of_each_prologue(tuned):
    table, keys = tuned
    assert [(k.op, k.m_lo, k.m_hi) for k in keys] == [(op, lo, hi) for op in ("glu", "glu_rms")
                                                     for lo, hi in ((1, 1), (2, 2), (3, 4), (5, 8))]
    for key in keys:
        entry = table.lookup(key)
        assert entry["m_points"][0] == key.m_lo and entry["m_points"][-1] == key.m_hi
        assert entry["backend"] in ("torch", "triton_glu") and entry["worst_ratio"] > 0 and entry["candidates"]
        if entry["backend"] == "triton_glu":
            assert entry["worst_ratio"] > 1.03  # beat its baseline by the tuner's margin at every point
            tune_glu.config_of(entry["config"])


@pytest.mark.parametrize("m", [1, 3, 7])
@pytest.mark.parametrize("norm", [False, True])
def test_the_gated_decision_runs_the_entry(tuned, monkeypatch, m, norm):
    table, _ = tuned
    monkeypatch.setattr(decide, "table_for_device", lambda index: table)
    decide._gated.clear()
    ran = []
    real = triton_glu.run

    def spy(config, *a, **kw):
        ran.append(config)
        return real(config, *a, **kw)

    monkeypatch.setattr(triton_glu, "run", spy)
    try:
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(2 * WIDTH, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        nw = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16() if norm else None
        entry = table.find(tune_glu.glu_key("x" if norm else None, torch.bfloat16, WIDTH, K, 1, 1).shape, m)[1]
        got = dispatch.gated(x, w, None, "silu", norm=None if nw is None else (nw, 1e-6))
        xn = x if nw is None else prologue_norm(x, nw, 1e-6)
        if entry["backend"] == "torch":
            assert got is None and not ran  # the caller composes it: the norm apart, then gate/up
            if nw is not None:  # the decode step's piece: the norm apart, then gate/up as the glu entry says
                from hybridgemm.mlp import gated_linear
                from hybridgemm.models import fused_pieces

                piece = fused_pieces._gated_norm(x, nw, 1e-6, None, w, None, "silu")
                assert torch.equal(piece, gated_linear(xn, w, None, "silu"))
            return
        assert ran == [tune_glu.config_of(entry["config"])]
        xf = x.float() if nw is None else x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) \
            * nw.float()
        ref = torch.nn.functional.silu(xf @ w[:WIDTH].float().T) * (xf @ w[WIDTH:].float().T)
        stock = torch.nn.functional.silu(xn @ w[:WIDTH].T) * (xn @ w[WIDTH:].T)
        assert _rel(got, ref) <= 1.5 * _rel(stock, ref) + 1e-3, (_rel(got, ref), _rel(stock, ref))
    finally:
        decide._gated.clear()


def test_compiled_gated_linear_reads_the_table_when_it_runs(tuned, monkeypatch):
    """gated_linear under torch.compile (fullgraph) at decode rows: the trace asks the rules, the
    op decides from the table when it runs, so a compiled call equals the eager one bit for bit
    and follows a table loaded after compiling."""
    from hybridgemm.mlp import gated_linear

    table, _ = tuned
    empty = TuningTable(None)
    current = [empty]
    monkeypatch.setattr(decide, "table_for_device", lambda index: current[0])
    decide._gated.clear()
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        x = torch.randn(3, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(2 * WIDTH, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        fn = torch.compile(lambda a: gated_linear(a, w, None, "silu"), fullgraph=True)
        with torch.no_grad():
            first = fn(x)
            assert torch.equal(first, gated_linear(x, w, None, "silu"))
            current[0] = table
            decide.reload_tables()  # (empties the decisions; the monkeypatched lookup stays)
            again = fn(x)
            assert torch.equal(again, gated_linear(x, w, None, "silu"))
    finally:
        decide._gated.clear()
        torch._dynamo.reset()
