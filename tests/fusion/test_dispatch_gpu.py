"""Dispatcher and tuner on the GPU: tune end to end, reload in a fresh process, run each backend."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import check_close_to_reference, make_operands, range_entry
from hybridgemm import decide, dispatch, explain
from hybridgemm.autotune_cache import tune_table
from hybridgemm.autotune_cache.presets import ProjectionShape
from hybridgemm.autotune_cache.signature import current_signature
from hybridgemm.autotune_cache.table import TableKey, TuningTable
from hybridgemm.autotune_cache.tune_table import keys_for, tune
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "cache"))
    decide.set_table_path(None)
    yield
    decide.set_table_path(None)


def _tiny_tune(path, ms=(1, 64, 512)):
    keys = keys_for([ProjectionShape("t", 384, 512, True)], list(ms))
    table = TuningTable.load(path, signature=current_signature())
    results = tune(keys, table, path, progress=False, log=lambda s: None, jobs=2)  # 2: the parallel compile path
    return keys, results


def _one_entry_table(tmp_path, lo, hi, backend, record):
    table = TuningTable(signature=current_signature())
    table.set(TableKey("linear", "bf16", "bias", 384, 512, lo, hi, "c"), range_entry(backend, record, lo, hi))
    path = tmp_path / "t.json"
    table.save(path)
    decide.set_table_path(path)


def test_precompile_builds_every_triton_candidate():
    from hybridgemm.autotune_cache.precompile import precompile
    from hybridgemm.kernels.backends import available_backends

    keys = keys_for([ProjectionShape("t", 320, 448, True)], [1, 64])
    lines = []
    stats = precompile(keys, available_backends(), jobs=2, log=lines.append)
    assert stats["kernels"] > 4 and stats["failed"] == 0 and stats["jobs"] == 2, (stats, lines)


def test_tune_end_to_end_and_reload(tmp_path):
    path = tmp_path / "table.json"
    keys, results = _tiny_tune(path)
    assert all(r.winner for r in results), [r.rejected for r in results]
    saved = TuningTable.load(path, signature=current_signature(), strict=True)
    for r in results:  # every decided range saved as decided, timed at both its edges
        e = saved.lookup(r.key)
        assert (e["backend"], e["config"]) == (r.winner["backend"], r.winner["config"])
        assert e["m_points"][0] == r.key.m_lo and e["m_points"][-1] == r.key.m_hi
        assert e["worst_ratio"] == min(e["ratios"]) and all(0.2 < v < 5 for v in e["ratios"])
    for key in keys:  # each asked range covered, by itself or by its halves
        assert tune_table.covered(saved, key)
    # resume: nothing left to do
    _, again = _tiny_tune(path)
    assert all(r.skipped for r in again)
    # the same choices in a fresh process reading the table
    code = ("import sys, hybridgemm as h; h.set_table_path(sys.argv[1]);"
            "print('\\n'.join(h.explain((m, 512), (384, 512)) for m in (1, 64, 300, 2000)))")
    outs = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                           env=dict(os.environ)).stdout for _ in range(2)]
    assert outs[0] == outs[1]
    # 1, 64 and 300 (range 257-512, or its half) are tuned; 2000 lies in no tuned range: the fallback rule
    assert outs[0].count("(table:") == 3 and outs[0].count("(rule:") == 1, outs[0]


def test_an_entry_is_never_run_outside_its_range(tmp_path):
    """A pinned Triton config for M 257-363 runs at 257, 300 and 363, and nowhere else: 256 and
    364 go to F.linear (the fallback rule). Checked on the calls' own decisions (the
    per-problem cache the call path fills), each result against the reference."""
    from hybridgemm.kernels.backends import get_backend

    p = Problem(m=300, n=384, k=512, dtype=torch.bfloat16, epilogue=Epilogue.from_name("bias"), ldx=512, ldw=512,
                ldo=384)
    record = get_backend("triton_gemm").candidates(p)[0].to_record()
    _one_entry_table(tmp_path, 257, 363, "triton_gemm", record)
    ran = {}
    for m in (1, 256, 257, 300, 363, 364, 2000):
        x, w, b = make_operands(m, 384, 512, torch.bfloat16, "cuda")
        y = dispatch.fused_linear(x, w, b)
        check_close_to_reference(y, x, w, b, None, f"M={m}")
        choices = dispatch._MODE_CACHES["default"][0]
        (choice,) = [c for (dev, prob), c in choices.items() if prob.m == m and prob.n == 384]
        ran[m] = (choice.backend, choice.source, choice.m_lo, choice.m_hi)
    inside = ("triton_gemm", "table", 257, 363)
    assert {m: ran[m] == inside for m in ran} == {1: False, 256: False, 257: True, 300: True, 363: True,
                                                  364: False, 2000: False}, ran
    assert all(ran[m][:2] == ("torch", "rule") for m in (1, 256, 364, 2000)), ran
    assert "tuned for M 257-363" in explain((300, 512), (384, 512))


@pytest.mark.parametrize("backend, record", [
    ("triton_gemm", {"kind": "triton_gemm", "block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8,
                     "num_warps": 4, "num_stages": 3, "persistent": True, "use_tma": True, "epilogue_subtile": False}),
    ("triton_splitk", {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4,
                       "num_warps": 4, "num_stages": 3}),
    ("cublaslt", None),
    ("cublaslt", {}),
    ("torch", {}),
])
def test_dispatch_runs_each_backend(tmp_path, backend, record):
    m, n, k = 16, 384, 512
    x, w, b = make_operands(m, n, k, torch.bfloat16, "cuda")
    key = TableKey("linear", "bf16", "bias", n, k, 9, 16, "c")
    if record is None:
        from hybridgemm.kernels import cublaslt_search as lts

        problem = Problem(m=m, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue.from_name("bias"), ldx=k, ldw=k,
                          ldo=n)
        record = lts.heuristic_algos(problem, count=2)[-1].to_record()  # not the heuristic's first
    table = TuningTable(signature=current_signature())
    table.set(key, range_entry(backend, record, 9, 16))
    path = tmp_path / "t.json"
    table.save(path)
    decide.set_table_path(path)
    assert f"runs {backend}" in explain((m, k), (n, k))
    assert "(table: tuned for M 9-16" in explain((m, k), (n, k))
    for _ in range(2):  # slow path, then the cached launcher
        y = dispatch.fused_linear(x, w, b)
        check_close_to_reference(y, x, w, b, None, backend)
    y3 = dispatch.fused_linear(x.view(2, 8, k), w, b)
    assert y3.shape == (2, 8, n) and torch.equal(y3.view(m, n), y)


def test_rejected_entry_warns_once_and_falls_back(tmp_path):
    m, n, k = 16, 384, 512
    key = TableKey("linear", "bf16", "bias", n, k, 9, 16, "c")
    table = TuningTable(signature=current_signature())
    bad = {"kind": "triton_gemm", "block_m": 256, "block_n": 256, "block_k": 256, "group_m": 8, "num_warps": 4,
           "num_stages": 8, "persistent": True, "use_tma": True, "epilogue_subtile": False}  # too much smem
    table.set(key, range_entry("triton_gemm", bad, 9, 16))
    path = tmp_path / "t.json"
    table.save(path)
    decide.set_table_path(path)
    x, w, b = make_operands(m, n, k, torch.bfloat16, "cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = dispatch.fused_linear(x, w, b)
        dispatch.fused_linear(x, w, b)
    msgs = [str(c.message) for c in caught if "cannot be used" in str(c.message)]
    assert len(msgs) == 1, msgs
    check_close_to_reference(y, x, w, b, None, "fallback")
    assert "(rule:" in explain((m, k), (n, k))


@pytest.mark.parametrize("act", [None, "relu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("mnk", [(1, 100, 72), (17, 257, 130), (1000, 37, 45)])
def test_untuned_shapes_follow_the_rule(act, mnk):
    m, n, k = mnk
    x, w, b = make_operands(m, n, k, torch.float16, "cuda")
    y = dispatch.fused_linear(x, w, b, act)
    check_close_to_reference(y, x, w, b, act, f"{mnk} {act}")


@pytest.mark.parametrize("backend", ["cublaslt", "triton_splitk", "triton_gemm"])
def test_o_projection_input_with_a_size_one_seq_dim(backend, tmp_path):
    """Attention's (B, H, 1, D) output, transposed and flattened for the O projection, is
    (B, 1, H*D) with a meaningless stride on the 1: it is read in place with the right row
    stride (before, every such call was copied on the slow path), on every backend, and
    matches the reference on the first call and on the cached launcher's."""
    from hybridgemm.kernels.backends import get_backend

    b_, h, d = 8, 6, 64
    k = n = h * d
    # what (B, H, 1, D) -> transpose -> flatten can give (torch versions differ on the stride
    # of the size-1 dim), built explicitly
    x = torch.as_strided(torch.randn(b_ * k, device="cuda").bfloat16(), (b_, 1, k), (k, d, 1))
    assert x.shape == (b_, 1, k) and x.stride(-2) != k  # the layout under test
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    p = Problem(m=b_, n=n, k=k, dtype=torch.bfloat16, epilogue=Epilogue.from_name("bias"), ldx=k, ldw=k, ldo=n)
    cands = get_backend(backend).candidates(p)
    record = cands[-1].to_record()  # not the default pick: the table's config must be the one run
    table = TuningTable(signature=current_signature())
    table.set(TableKey("linear", "bf16", "bias", n, k, 5, 8, "c"), range_entry(backend, record, 5, 8))
    path = tmp_path / "t.json"
    table.save(path)
    decide.set_table_path(path)
    assert f"runs {backend}" in explain(tuple(x.shape), (n, k))
    x2 = x.reshape(b_, k)
    for _ in range(3):  # slow path, then the cached launcher
        y = dispatch.fused_linear(x, w, bias)
        assert y.shape == (b_, 1, n)
        check_close_to_reference(y.view(b_, n), x2, w, bias, None, backend)
    from hybridgemm.kernels.checks import call_signature

    assert dispatch._launchers[0].get(call_signature(x, w, bias, None)[0]) is not None  # no copy: a cached launcher


def test_an_unavailable_backend_is_said_once_on_the_first_gpu_call(monkeypatch):
    """One BackendUnavailableWarning on the first GPU call (naming the backend and why), none
    on later calls of this or other shapes; the calls still give right results."""
    from hybridgemm.kernels import backends

    why = "nvmath-python is not installed (pip install nvmath-python)"
    monkeypatch.setattr(backends, "unavailable_backends", lambda: {"cublaslt": why})
    monkeypatch.setattr(backends, "_warned_unavailable", type(backends._warned_unavailable)())
    decide.reload_tables()  # no cached decision: the next calls take the slow path
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for m, n in ((3, 520), (3, 520), (17, 776)):
            x, w, b = make_operands(m, n, 320, torch.bfloat16, "cuda")
            check_close_to_reference(dispatch.fused_linear(x, w, b), x, w, b, Activation.NONE)
    said = [str(r.message) for r in rec if issubclass(r.category, backends.BackendUnavailableWarning)]
    assert len(said) == 1 and "cublaslt" in said[0] and why in said[0]


def test_a_triton_config_tuned_under_another_triton_is_probed_then_run(tmp_path, monkeypatch):
    """A table whose signature names another Triton: its Triton entry runs after the one-time
    correctness probe (on this GPU, against an fp32 reference), with one table warning; a
    config the probe rejects (a wrong kernel, faked) runs F.linear with one warning."""
    from hybridgemm.autotune_cache import probe
    from hybridgemm.kernels import backends

    m, n, k = 16, 384, 512
    key = TableKey("linear", "bf16", "bias", n, k, 9, 16, "c")
    record = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4,
              "num_stages": 3}
    table = TuningTable(signature={**current_signature(), "triton_version": "0.0.1"})
    table.set(key, range_entry("triton_splitk", record, 9, 16))
    path = tmp_path / "old-triton.json"
    table.save(path)
    probe.clear_cache()
    decide.set_table_path(path)
    x, w, b = make_operands(m, n, k, torch.bfloat16, "cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = dispatch.fused_linear(x, w, b)
    said = [str(c.message) for c in caught]
    assert len([s for s in said if "0.0.1" in s]) == 1, said
    check_close_to_reference(y, x, w, b, None, "probed")
    text = explain((m, k), (n, k))
    assert "runs triton_splitk" in text and "passed its correctness probe" in text

    # the same entry when the kernel computes something else: the probe fails, F.linear runs
    real = backends.get_backend("triton_splitk")

    def wrong(config, x2, w2, b2, out, act, tf32=False):
        real.run(config, x2, w2, b2, out, act, tf32)
        out.mul_(1.5)

    wrong_backend = dataclasses.replace(real, run=wrong)
    orig = backends.get_backend
    monkeypatch.setattr(backends, "get_backend", lambda name: wrong_backend if name == "triton_splitk" else orig(name))
    probe.clear_cache()
    decide.reload_tables()
    problem = Problem.from_tensors(x, w, b, torch.empty(m, n, dtype=x.dtype, device="cuda"),
                                   Epilogue.from_name("bias"), False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decision = decide.choose(problem, torch.cuda.current_device())
    probe.clear_cache()
    assert decision.backend == "torch" and "probe" in decision.reason
    assert len([c for c in caught if "failed its correctness probe" in str(c.message)]) == 1


def test_a_fused_piece_runs_the_split_k_candidate_tied_with_a_torch_winner(tmp_path):
    """A table whose winner at M = 1 is F.linear, with a split-K candidate tied with it: a plain
    call runs F.linear; a split-K call carrying the norm prologue and the residual runs that
    candidate (decide.choose_fusable), against an fp32 reference."""
    m, n, k = 1, 384, 512
    x, w, _ = make_operands(m, n, k, torch.bfloat16, "cuda")
    key = TableKey("linear", "bf16", "none", n, k, 1, 1, "c")
    record = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4,
              "num_stages": 3}
    entry = range_entry("torch", {}, 1, 1, ratio=1.0)
    entry["candidates"] = [dict(backend="triton_splitk", config=record, median_us=10.1, spread_us=0.1,
                                worst_ratio=0.99)]
    table = TuningTable(signature=current_signature())
    table.set(key, entry)
    table.save(tmp_path / "t.json")
    decide.set_table_path(tmp_path / "t.json")
    assert "(table: tuned for M 1-1" in explain((m, k), (n, k), bias=False)
    assert "runs F.linear" in explain((m, k), (n, k), bias=False)
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = dispatch.fused_splitk(x, w, None, norm=(g, 1e-6), residual=r)
    assert y is not None  # split-K ran the fusion (None: the caller would compose it)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()) @ w.float().T + r.float()
    assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert dispatch.fused_splitk(x, w, None) is None  # nothing fused: the table's winner, F.linear
