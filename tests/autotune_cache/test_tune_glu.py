"""The gated kernel's entries of the tuning table without a GPU (autotune_cache/tune_glu.py):
keys, config records, what the gated decision takes from a table holding such entries
(fusion/decide.py ``tuned_gated``: the entry's config, ``torch``, a miss, bad entries with one
warning), the shapes autotune tunes for a patched model (fusion/models/gemm_shapes.py
``gated_shapes``) and the tuner's saving order. The tuner's timing runs on the GPU
(tests/fusion/test_glu_table_gpu.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tuning_tables import SIG

from hybridgemm import decide
from hybridgemm.autotune_cache import tune_glu
from hybridgemm.autotune_cache.keys import TableKey
from hybridgemm.autotune_cache.presets import get_preset
from hybridgemm.autotune_cache.table import TuningTable
from hybridgemm.autotune_cache.table_entries import make_entry
from hybridgemm.kernels import triton_glu as tg


def _entry(backend, config, lo, hi):
    points = sorted({lo, hi})
    return make_entry(backend, config, m_points=points, ratios=[1.2, 1.1][:len(points)], median_us=10.0,
                      spread_us=0.1, flinear_us=12.0)


def test_keys_name_the_prologue_and_round_trip():
    key = tune_glu.glu_key("x", torch.bfloat16, 14336, 4096, 3, 4)
    assert key.to_string() == "glu_rms|bf16|none|N=14336|K=4096|M=3-4|c"
    assert TableKey.from_string(key.to_string()) == key
    plain = tune_glu.glu_key(None, torch.float16, 96, 64, 1, 1, bias=True)
    assert plain.to_string() == "glu|fp16|bias|N=96|K=64|M=1-1|c"
    assert tune_glu.glu_key("fp32", torch.bfloat16, 96, 64, 9, 16).op == "glu_rms32"
    assert all(tune_glu.is_glu_op(op) for op in ("glu", "glu_rms", "glu_rms32"))
    assert not tune_glu.is_glu_op("linear") and not tune_glu.is_glu_op("glu_rms16")
    ranges = [(k.m_lo, k.m_hi) for k in tune_glu.glu_keys(None, torch.bfloat16, 96, 64)]
    assert ranges == [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16)]
    assert len(tune_glu.glu_keys("x", torch.bfloat16, 96, 64, m_max=4)) == 3


def test_norm_kind_reads_the_norm_weight_dtype():
    assert tune_glu.norm_kind(None, torch.bfloat16) is None
    assert tune_glu.norm_kind(torch.ones(4, dtype=torch.bfloat16), torch.bfloat16) == "x"
    assert tune_glu.norm_kind(torch.ones(4), torch.bfloat16) == "fp32"


def test_a_config_record_round_trips_and_bad_ones_are_named():
    cfg = tg.TritonGluConfig(16, 64, 128, 4, 4)
    assert tune_glu.config_of(cfg.to_record()) == cfg
    for bad, match in [([16, 64], "dict"), ({**cfg.to_record(), "kind": "triton_splitk"}, "kind"),
                       ({**cfg.to_record(), "block_n": 48}, "block_n"), ({**cfg.to_record(), "num_warps": True},
                                                                         "num_warps"),
                       ({k: v for k, v in cfg.to_record().items() if k != "num_stages"}, "missing")]:
        with pytest.raises(ValueError, match=match):
            tune_glu.config_of(bad)


@pytest.fixture
def glu_table(monkeypatch):
    table = TuningTable(None)
    monkeypatch.setattr(decide, "table_for_device", lambda index: table)
    monkeypatch.setattr(decide.backends, "device_limits", lambda index: {"smem_limit": 232448, "capability": (9, 0)})
    decide._gated.clear()
    yield table
    decide._gated.clear()


def test_decisions_follow_the_table(glu_table):
    cfg = tg.TritonGluConfig(16, 128, 128, 4, 3)
    glu_table.set(tune_glu.glu_key("x", torch.bfloat16, 96, 64, 3, 4), _entry("triton_glu", cfg.to_record(), 3, 4))
    glu_table.set(tune_glu.glu_key("x", torch.bfloat16, 96, 64, 5, 8), _entry("torch", {}, 5, 8))
    glu_table.set(tune_glu.glu_key(None, torch.bfloat16, 96, 64, 5, 8), _entry("torch", {}, 5, 8))
    hit = decide.tuned_gated(0, torch.bfloat16, 96, 64, False, "x", 3)
    assert (hit.backend, hit.config, hit.source, hit.m_lo, hit.m_hi) == ("triton_glu", cfg, "table", 3, 4)
    assert "glu_rms|bf16|none|N=96|K=64|M=3-4|c" in hit.reason
    apart = decide.tuned_gated(0, torch.bfloat16, 96, 64, False, "x", 6)
    assert apart.backend == "torch" and "norm apart" in apart.reason
    pair = decide.tuned_gated(0, torch.bfloat16, 96, 64, False, None, 6)
    assert pair.backend == "torch" and "two GEMMs" in pair.reason
    # a miss: another M, prologue, dtype, bias or shape
    for args in [("x", 2), ("fp32", 3), (None, 3)]:
        assert decide.tuned_gated(0, torch.bfloat16, 96, 64, False, *args) is None
    assert decide.tuned_gated(0, torch.float16, 96, 64, False, "x", 3) is None
    assert decide.tuned_gated(0, torch.bfloat16, 96, 64, True, "x", 3) is None
    assert decide.tuned_gated(0, torch.bfloat16, 96, 128, False, "x", 3) is None


def test_reloading_the_tables_forgets_the_gated_decisions(glu_table):
    key = tune_glu.glu_key(None, torch.bfloat16, 96, 64, 1, 1)
    assert decide.tuned_gated(0, torch.bfloat16, 96, 64, False, None, 1) is None
    glu_table.set(key, _entry("torch", {}, 1, 1))
    assert decide.tuned_gated(0, torch.bfloat16, 96, 64, False, None, 1) is None  # remembered
    decide.reload_tables()
    assert decide.tuned_gated(0, torch.bfloat16, 96, 64, False, None, 1).backend == "torch"


@pytest.mark.parametrize("k,backend,config,said", [
    (576, "triton_glu", {"kind": "triton_glu", "block_m": 16, "block_n": 48, "block_k": 64, "num_warps": 4,
                         "num_stages": 3}, "block_n"),
    (640, "cublaslt", {}, "not one of a gated entry's"),
    # parses, but its stages need more shared memory than the device has
    (704, "triton_glu", {"kind": "triton_glu", "block_m": 16, "block_n": 256, "block_k": 512, "num_warps": 4,
                         "num_stages": 8}, "shared memory"),
])
def test_a_bad_entry_warns_once_and_the_rule_decides(glu_table, k, backend, config, said):
    # (a K of its own per case: warn_once remembers a key for the process)
    glu_table.set(tune_glu.glu_key("x", torch.bfloat16, 96, k, 5, 8), _entry(backend, config, 5, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (5, 6, 7):
            assert decide.tuned_gated(0, torch.bfloat16, 96, k, False, "x", m) is None
    assert sum(said in str(c.message) for c in caught) == 1


def test_a_trace_asks_the_rules_only(monkeypatch):
    """choose_gated(tuned=False) (what gated_linear asks under torch.compile) reads no table."""
    def no_table(index):
        raise AssertionError("the table was read")

    monkeypatch.setattr(decide, "table_for_device", no_table)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(192, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # as a CUDA tensor would be asked
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert decide.choose_gated(x, w, None, tuned=False).source == "rule"
    with pytest.raises(AssertionError, match="table was read"):
        decide.choose_gated(x, w, None)


def test_choose_gated_on_the_cpu_keeps_the_rules():
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(192, 64, dtype=torch.bfloat16)
    assert decide.choose_gated(x, w, None).backend == "torch"
    fused = decide.choose_gated(x, w, None, torch.ones(64, dtype=torch.bfloat16))
    assert (fused.backend, fused.config, fused.source) == ("triton_glu", None, "rule")


def test_tune_into_saves_each_range_plain_first_and_skips_what_the_table_holds(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    seen = []

    def fake_tune(i, k, dtype, keys, table, norm_apart, log):
        for key in keys:
            seen.append(key)
            if key.op == "glu_rms":  # a prologue range is tuned after every plain range is saved
                on_disk = TuningTable.load(where[0], signature=dict(SIG))
                assert all(plain in on_disk for plain in seen if plain.op == "glu")
            yield key, _entry("torch", {}, key.m_lo, key.m_hi)

    monkeypatch.setattr(tune_glu, "tune_glu", fake_tune)
    monkeypatch.setattr(tune_glu, "GLU_M_MAX", 4)
    table = TuningTable(dict(SIG))
    with pytest.raises(ValueError, match="norm_apart"):
        tune_glu.tune_into(table, path, 96, 64, ("x",), log=lambda s: None)
    where = [tmp_path / "m.json"]
    done = tune_glu.tune_into(TuningTable(dict(SIG)), where[0], 96, 64, ("x", None),
                              norm_apart=lambda x, g, eps: x, log=lambda s: None, m_values=[3])
    assert done == 2 and [(key.op, key.m_lo, key.m_hi) for key in seen] == [("glu", 3, 4), ("glu_rms", 3, 4)]
    seen.clear()
    where[0] = path
    done = tune_glu.tune_into(table, path, 96, 64, ("x", None), norm_apart=lambda x, g, eps: x, log=lambda s: None)
    assert done == 6 and [key.op for key in seen] == ["glu"] * 3 + ["glu_rms"] * 3
    saved = TuningTable.load(path, signature=dict(SIG))
    assert all(key in saved for key in seen)
    seen.clear()
    assert tune_glu.tune_into(saved, path, 96, 64, ("x", None), norm_apart=lambda x, g, eps: x) == 0 and not seen


def test_presets_name_the_norm_before_their_mlp():
    assert get_preset("llama3-8b").mlp_norm == "x" and get_preset("gemma-7b").mlp_norm == "fp32"
    assert get_preset("olmo2-7b").mlp_norm is None
    with pytest.raises(ValueError, match="mlp_norm"):
        type(get_preset("llama3-8b"))("x", 64, 1, 1, 64, False, False, mlp_norm="rms")


@pytest.mark.parametrize("kind,norms", [("llama", (None, "x")), ("phi3", (None, "x")), ("gemma", (None, "fp32")),
                                        ("gemma2", (None, "fp32")), ("olmo2", (None,)), ("stablelm", (None,)),
                                        ("mixtral", None)])
def test_gated_shapes_are_what_the_patched_layers_call(kind, norms):
    pytest.importorskip("transformers")
    from helpers import llama_variants
    from hybridgemm.models.gemm_shapes import gated_shapes

    _, _, patched = llama_variants(64, 96, 128, device="cpu", kind=kind)
    got = gated_shapes(patched)
    if norms is None:  # the experts run in the MoE kernels, not the gated kernel
        assert got == []
    else:
        assert [(g.intermediate, g.k, g.bias, g.norms) for g in got] == [(96, 64, False, norms)]
