"""The tensor-parallel split rules and one rank's GEMM shapes (fusion/parallel/sharding.py)."""

from dataclasses import replace

import pytest

from hybridgemm.autotune_cache.presets import (
    get_preset,
)
from hybridgemm.parallel.sharding import rank_projections, tp_local_heads, tp_split, tp_vocab_rows


def tp_shapes(name, tp):
    return {p.name: (p.n, p.k, p.bias) for p in rank_projections(get_preset(name), tp)}


def test_llama3_8b_over_two_ranks():
    # 16 query heads and 4 KV heads of 128 per rank; o reads the rank's 2048 columns;
    # MLP 14336 / 2 = 7168 rows for gate and for up; LM head 128256 / 2 rows.
    assert tp_shapes("llama3-8b", 2) == {
        "q": (2048, 4096, False), "kv": (512, 4096, False), "qkv": (3072, 4096, False),
        "o": (4096, 2048, False), "gate_up": (7168, 4096, False), "down": (4096, 7168, False),
        "lm_head": (64128, 4096, False),
    }


def test_llama3_70b_over_eight_and_sixteen_ranks():
    # tp=8: 8 query heads and 1 KV head per rank (8 KV heads: one group each).
    s8 = tp_shapes("llama3-70b", 8)
    assert s8["qkv"] == ((8 + 2) * 128, 8192, False) and s8["o"] == (8192, 1024, False)
    assert s8["gate_up"] == (3584, 8192, False) and s8["down"] == (8192, 3584, False)
    assert s8["lm_head"] == (16032, 8192, False)
    # tp=16: 4 query heads per rank, and a copy of their group's one KV head (16 = 2 x 8 KV heads).
    s16 = tp_shapes("llama3-70b", 16)
    assert s16["q"] == (512, 8192, False) and s16["kv"] == (128, 8192, False) and s16["qkv"] == (768, 8192, False)


def test_tp_one_is_the_whole_model_and_attention_matches_projections():
    s = tp_shapes("llama3-8b", 1)
    whole = {p.name: (p.n, p.k, p.bias) for p in get_preset("llama3-8b").projections}
    assert {k: s[k] for k in ("q", "kv", "qkv", "o")} == whole
    assert s["gate_up"] == (14336, 4096, False) and s["down"] == (4096, 14336, False)
    assert s["lm_head"] == (128256, 4096, False)


def test_qwen_biases_per_rank():
    # q/k/v keep their bias rows; o has none. 28 heads / 4 = 7, 4 KV heads / 4 = 1.
    s = tp_shapes("qwen2.5-7b", 4)
    assert s["qkv"] == ((7 + 2) * 128, 3584, True) and s["o"] == (3584, 896, False)
    assert "o_nobias" not in s and s["down"] == (3584, 4736, False)


def test_a_row_parallel_bias_is_on_rank_zero_only_so_both_gemms_are_listed():
    biased = replace(get_preset("llama3-8b"), qkv_bias=True, o_bias=True)
    s = {p.name: (p.n, p.k, p.bias) for p in rank_projections(biased, 2)}  # rank 0's o adds the bias, the others' not
    assert s["o"] == (4096, 2048, True) and s["o_nobias"] == (4096, 2048, False)
    assert "o_nobias" not in {p.name for p in rank_projections(biased, 1)}
    bert = tp_shapes("bert-base", 2)  # parallelize splits none of BERT's layers: whole on every rank
    assert bert["o"] == (768, 768, True) and "o_nobias" not in bert
    assert "gate_up" not in bert and "lm_head" not in bert
    mlp_bias = replace(get_preset("llama3-8b"), mlp_bias=True)
    m = {p.name: (p.n, p.k, p.bias) for p in rank_projections(mlp_bias, 2)}
    assert m["down"] == (4096, 7168, True) and m["down_nobias"] == (4096, 7168, False)
    assert m["gate_up"] == (7168, 4096, True)


def test_tied_lm_head_stays_whole():
    tied = replace(get_preset("llama3-8b"), tied_lm_head=True)
    assert {p.name: p.n for p in rank_projections(tied, 4)}["lm_head"] == 128256


@pytest.mark.parametrize("tp, needle", [
    (3, "llama3-8b: tp=3 does not divide the 32 attention heads"),
    (64, "llama3-8b: tp=64 does not divide the 32 attention heads"),
    (0, "positive integer, got 0"),
    (-2, "positive integer, got -2"),
    (True, "positive integer, got True"),
])
def test_tp_that_does_not_split_the_model(tp, needle):
    with pytest.raises(ValueError, match=needle):
        rank_projections(get_preset("llama3-8b"), tp)


def test_split_rules():
    assert tp_local_heads(32, 8, 2) == (16, 4) and tp_local_heads(32, 8, 8) == (4, 1)
    assert tp_local_heads(32, 8, 16) == (2, 1) and tp_local_heads(32, 1, 4) == (8, 1)
    with pytest.raises(ValueError, match="does not fit the 4 key/value heads"):
        tp_local_heads(12, 4, 6)  # 2 query heads per rank would straddle two GQA groups
    with pytest.raises(ValueError, match="does not divide the intermediate size 14337"):
        tp_split(14337, 2, "intermediate size")
    # A vocabulary tp does not divide: ceil rows each, the last rank fewer.
    assert tp_vocab_rows(128256, 8) == 16032 and tp_vocab_rows(32001, 2) == 16001 and tp_vocab_rows(10, 4) == 3
    with pytest.raises(ValueError, match="too small to split over tp=4"):
        tp_vocab_rows(3, 4)
    with pytest.raises(ValueError, match="intermediate size"):
        rank_projections(replace(get_preset("mistral-7b"), intermediate=1000), 16)
