"""The MoE entries of the tuning table without a GPU (autotune_cache/tune_moe.py): keys, config
records and their validation, the candidates, and what ``moe`` decides from a table holding
such entries (fusion/experts.py ``decision_for``): the entry's configs, the grouped baseline,
the defaults on a miss or a bad config (one warning). The tuner itself runs on the GPU
(tests/fusion/test_moe_gpu.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hybridgemm import experts
from hybridgemm.autotune_cache import tune_moe
from hybridgemm.autotune_cache.keys import TableKey, weight_format_of
from hybridgemm.autotune_cache.table import TuningTable
from hybridgemm.autotune_cache.table_entries import make_entry
from hybridgemm.kernels import triton_moe as tm


def test_the_key_names_activation_experts_and_top_k():
    key = tune_moe.moe_key(128, 8, "silu", torch.bfloat16, 768, 2048, 3, 4)
    assert key.to_string() == "moe_silu_e128_k8|bf16|none|N=768|K=2048|M=3-4|c"
    assert TableKey.from_string(key.to_string()) == key
    assert tune_moe.parse_moe_op(key.op) == ("silu", 128, 8)
    assert tune_moe.parse_moe_op("moe_gelu_tanh_e8_k2") == ("gelu_tanh", 8, 2)
    assert tune_moe.parse_moe_op("linear") is None and tune_moe.parse_moe_op("moe_silu_e0_k2") is None


def test_a_record_round_trips_and_bad_ones_are_named():
    up, down = tm.TritonMoeConfig(64, 128, 64, 4, 4), tm.TritonMoeConfig(64, 256, 64, 8, 3)
    assert tune_moe.configs_of(tune_moe.record_of(up, down)) == (up, down)
    good = tune_moe.record_of(up, down)
    for bad, match in [({"up": good["up"]}, "'up'"), ({**good, "down": [64, 128, 64, 4]}, "5 integers"),
                       ({**good, "down": [64, 96, 64, 4, 3]}, "power of two"),
                       ({**good, "down": [32, 128, 64, 4, 3]}, "share the layout"),
                       ({**good, "up": [64, 128, 64, True, 3]}, "integer"), ([1, 2], "config is"),
                       ({**good, "up": [64, 128, 64, 4, 99]}, "num_stages"),
                       ({**good, "down": [64, 256, 2048, 8, 3]}, "block_k"),
                       ({**good, "down": [1, 1, 1024, 8, 1]}, "block_n"),
                       # narrow or deep tiles: the pair-major CUDA-core form's alone
                       ({**good, "down": [64, 2, 64, 4, 3]}, "pair-major on the CUDA cores"),
                       ({**good, "down": [64, 64, 1024, 4, 3]}, "pair-major on the CUDA cores"),
                       ({**good, "up": [64, 128, 64, 4, 3, 1]}, "sixth value")]:
        with pytest.raises(ValueError, match=match):
            tune_moe.configs_of(bad)
    # pair-major on the tensor cores: a sixth value 1, only after block_m 1 and tiles of 16 or more
    mma_up, mma_down = tm.TritonMoeConfig(1, 32, 256, 2, 4, mma=True), tm.TritonMoeConfig(1, 8, 256, 4, 4)
    record = tune_moe.record_of(mma_up, mma_down)
    assert record == {"up": [1, 32, 256, 2, 4, 1], "down": [1, 8, 256, 4, 4]}
    assert tune_moe.configs_of(record) == (mma_up, mma_down)
    one_step = tm.TritonMoeConfig(1, 2, 1024, 8, 1)  # the narrowest N tile and widest K tile a record holds
    assert tune_moe.configs_of(tune_moe.record_of(mma_up, one_step)) == (mma_up, one_step)
    for bad, match in [([1, 16, 1024, 4, 4, 1], "pair-major on the CUDA cores"),
                       ([1, 8, 256, 4, 4, 1], "sixth value"), ([1, 32, 256, 2, 4, 0], "sixth value"),
                       ([1, 32, 256, 2, 4, True], "sixth value"), ([1, 32, 256, 2, 4, 1.0], "sixth value"),
                       ([1, 32, 256, 2, 4, 1, 1], "5 integers")]:
        with pytest.raises(ValueError, match=match):
            tune_moe.configs_of({"up": bad, "down": record["down"]})


def test_candidates_share_a_block_size_and_fit_the_routing():
    decode = tune_moe.candidates(8, 128)
    assert any(u.block_m == 1 for u, _ in decode) and {u.block_m for u, _ in decode} <= {1, 16}
    # the CUDA-core down whose K tile covers Qwen3-30B-A3B's K = 768 in one step, and in two
    downs = {d for _, d in decode}
    assert {tm.TritonMoeConfig(1, 2, 1024, 8, 1), tm.TritonMoeConfig(1, 4, 512, 8, 1)} <= downs
    prefill = tune_moe.candidates(16384, 128)
    assert all(u.block_m == d.block_m > 1 for u, d in prefill) and {u.block_m for u, _ in prefill} == {16, 32, 64, 128}
    assert not any(u.block_m == 128 and u.block_n == 256 for u, _ in prefill)  # two 128x256 tiles: no smem


@pytest.fixture
def moe_table(monkeypatch):
    table = TuningTable(None)
    monkeypatch.setattr(experts.decide, "table_for_device", lambda index: table)
    experts._decisions.clear()
    yield table
    experts._decisions.clear()


class _FakeCudaX:
    """Stands in for a CUDA tensor in decision_for (no GPU here): shape, dtype, device."""

    def __init__(self, t, h, dtype=torch.bfloat16):
        self.shape, self.dtype, self.is_cuda, self.device = (t, h), dtype, True, torch.device("cuda", 0)


def _entry(backend, config, lo=5, hi=8):
    points = sorted({lo, hi})
    return make_entry(backend, config, m_points=points, ratios=[3.0, 2.5][:len(points)], median_us=10.0,
                      spread_us=0.1, flinear_us=28.0)


def test_explain_moe_names_the_entry_it_would_run(moe_table, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    up = tm.TritonMoeConfig(1, 8, 128, 8, 4)
    moe_table.set(tune_moe.moe_key(16, 2, "silu", torch.bfloat16, 96, 64, 1, 1),
                  _entry("triton_moe", tune_moe.record_of(up, up), 1, 1))
    said = experts.explain_moe(1, (16, 192, 64), 2)
    assert "M=1-1" in said and "triton_moe" in said
    assert "no table entry" in experts.explain_moe(3, (16, 192, 64), 2)


def test_decisions_follow_the_table(moe_table, monkeypatch):
    w = torch.empty(16, 2 * 96, 64)
    up, down = tm.TritonMoeConfig(16, 64, 128, 4, 3), tm.TritonMoeConfig(16, 128, 64, 4, 3)
    moe_table.set(tune_moe.moe_key(16, 2, "silu", torch.bfloat16, 96, 64, 5, 8), _entry("triton_moe",
                                                                                         tune_moe.record_of(up, down)))
    moe_table.set(tune_moe.moe_key(16, 2, "silu", torch.bfloat16, 96, 64, 9, 16), _entry("torch", {}, 9, 16))
    hit = experts.decision_for(_FakeCudaX(6, 64), 2, w, "silu")
    assert hit.configs == (up, down) and "M=5-8" in hit.why
    monkeypatch.setattr(experts, "grouped_mm_available", lambda: True)
    assert experts.decision_for(_FakeCudaX(12, 64), 2, w, "silu").backend == "torch"
    miss = experts.decision_for(_FakeCudaX(40, 64), 2, w, "silu")
    assert miss.configs == tm.default_configs(80, 16) and "no table entry" in miss.why
    other_act = experts.decision_for(_FakeCudaX(6, 64), 2, w, "gelu_tanh")
    assert other_act.configs == tm.default_configs(12, 16)


def test_a_bad_config_in_the_table_warns_once_and_runs_the_defaults(moe_table):
    w = torch.empty(16, 2 * 96, 64)
    moe_table.set(tune_moe.moe_key(16, 2, "silu", torch.bfloat16, 96, 64, 5, 8),
                  _entry("triton_moe", {"up": [16, 64, 128, 4, 3], "down": [32, 64, 128, 4, 3]}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = experts.decision_for(_FakeCudaX(7, 64), 2, w, "silu")
    assert got.configs == tm.default_configs(14, 16) and "bad config" in got.why
    assert sum("share the layout" in str(c.message) for c in caught) == 1


def test_the_grouped_baseline_computes_the_experts():
    """kernels/grouped_mm_moe.py against the fp64 loop (bf16 where this torch's CPU
    torch._grouped_mm runs)."""
    from hybridgemm.kernels.grouped_mm_moe import grouped_mm_moe

    g = torch.Generator().manual_seed(0)
    e, i, h, t, k = 6, 32, 48, 9, 2
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).bfloat16()
    w_d = (torch.randn(e, h, i, generator=g) / i ** 0.5).bfloat16()
    x = torch.randn(t, h, generator=g).bfloat16()
    ids, weights = experts.route(torch.randn(t, e, generator=g), k)
    try:
        got = grouped_mm_moe(x, ids, weights, w_gu, w_d)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch's torch._grouped_mm does not run on the CPU: {exc}")
    ref = experts.experts_loop(x.double(), ids, weights.double(), w_gu.double(), w_d.double(), "silu")
    assert got.dtype == torch.bfloat16 and got.shape == (t, h)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


def test_explain_moe_without_a_gpu_and_bad_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "PyTorch loop" in experts.explain_moe(1, (128, 1536, 2048), 8)
    with pytest.raises(ValueError, match="do not fit"):
        experts.explain_moe(1, (8, 1535, 2048), 2)
    with pytest.raises(ValueError, match="activation"):
        experts.explain_moe(1, (8, 1536, 2048), 2, activation="tanh")
    with pytest.raises(ValueError, match="do not fit"):
        experts.explain_moe(0, (8, 1536, 2048), 2)
    with pytest.raises(ValueError, match="torch.dtype"):
        experts.explain_moe(1, (8, 1536, 2048), 2, dtype="bf16")


def test_tune_into_saves_each_range_and_skips_what_the_table_holds(tmp_path, monkeypatch):
    """Each tuned range is in the file as soon as it is tuned; a second run without --force
    tunes nothing; a range out of GPU memory keeps no entry."""
    path = tmp_path / "t.json"
    seen = []

    def fake_tune(experts_, top_k, i, h, activation, dtype, keys, log, weight_format=""):
        assert all(weight_format_of(k.op) == weight_format for k in keys)
        for key in keys:
            seen.append(key)
            if key.m_lo == 3:
                yield key, None  # out of memory
                continue
            on_disk = TuningTable.load(path, signature=dict(SIG)) if path.exists() else None
            assert on_disk is not None and all(k in on_disk for k in seen[:-1] if k.m_lo != 3)
            yield key, _entry("triton_moe", tune_moe.record_of(*tm.default_configs(key.m_hi * top_k, experts_)),
                              key.m_lo, key.m_hi)

    from tuning_tables import SIG

    monkeypatch.setattr(tune_moe, "tune_moe", fake_tune)
    table = TuningTable(dict(SIG))
    done = tune_moe.tune_into(table, path, 8, 2, 64, 32, m_max=8, log=lambda s: None)
    keys = tune_moe.moe_keys(8, 2, 64, 32, m_max=8)
    assert done == 3 and [(k.m_lo, k.m_hi) for k in keys] == [(1, 1), (2, 2), (3, 4), (5, 8)]
    saved = TuningTable.load(path, signature=dict(SIG))
    assert [k for k in keys if k in saved] == [keys[0], keys[1], keys[3]]
    seen.clear()
    assert tune_moe.tune_into(saved, path, 8, 2, 64, 32, m_max=8, log=lambda s: None) == 0
    assert seen == [keys[2]]  # only the range without an entry
    seen.clear()  # FP8 experts: their own keys, none of which the bf16 entries hold
    assert tune_moe.tune_into(saved, path, 8, 2, 64, 32, m_max=8, log=lambda s: None,
                              weight_format="e4m3_channel") == 3
    assert [k.op for k in seen] == ["moe_silu_e8_k2_e4m3_channel"] * 4
