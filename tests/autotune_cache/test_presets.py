
import pytest

from hybridgemm.autotune_cache.presets import (
    PRESETS,
    ProjectionShape,
    get_preset,
    parse_shape,
    preset_names,
)


def shapes(name):
    return {p.name: (p.n, p.k, p.bias) for p in get_preset(name).projections}


def test_llama3_8b_matches_design_figures():
    # Llama-3-8B config: 8b qkv K=4096 -> N=6144, o 4096x4096, kv N=1024.
    assert shapes("llama3-8b") == {
        "q": (4096, 4096, False), "kv": (1024, 4096, False),
        "qkv": (6144, 4096, False), "o": (4096, 4096, False),
    }


def test_llama3_70b_matches_design_figures():
    # Llama-3-70B config: 70b qkv 8192 -> 10240, o 8192 -> 8192.
    s = shapes("llama3-70b")
    assert s["qkv"] == (10240, 8192, False)
    assert s["o"] == (8192, 8192, False)
    assert s["kv"] == (1024, 8192, False)


def test_qwen_has_qkv_bias_but_no_o_bias():
    assert shapes("qwen2.5-7b") == {
        "q": (3584, 3584, True), "kv": (512, 3584, True),
        "qkv": (4608, 3584, True), "o": (3584, 3584, False),
    }


@pytest.mark.parametrize("name", ["bert-base", "gpt2"])
def test_mha_models_have_bias_everywhere(name):
    assert shapes(name) == {
        "q": (768, 768, True), "kv": (768, 768, True),
        "qkv": (2304, 768, True), "o": (768, 768, True),
    }


def test_mistral_is_llama3_8b_shaped():
    assert shapes("mistral-7b") == shapes("llama3-8b")


def test_every_preset_is_consistent():
    assert preset_names() == list(PRESETS)
    for preset in PRESETS.values():
        s = {p.name: p for p in preset.projections}
        assert s["qkv"].n == s["q"].n + 2 * s["kv"].n
        assert s["o"].k == s["q"].n and s["o"].n == preset.hidden
        assert preset.heads % preset.kv_heads == 0
        assert preset.projection("o") == s["o"]


def test_get_preset_is_forgiving_about_spelling_and_lists_names():
    assert get_preset("Llama3_8B") is PRESETS["llama3-8b"]
    with pytest.raises(ValueError, match="valid names: .*llama3-70b"):
        get_preset("llama2")
    with pytest.raises(ValueError, match="has no projection 'v'"):
        get_preset("gpt2").projection("v")


def test_parse_shape():
    assert parse_shape("6144,4096") == ProjectionShape("6144,4096", 6144, 4096, True)
    assert parse_shape(" 10 , 20 ", bias=False) == ProjectionShape("10,20", 10, 20, False)
    for bad in ["6144", "6144x4096", "a,b", "0,4096", "1,2,3", "", "-1,4"]:
        with pytest.raises(ValueError, match="bad shape"):
            parse_shape(bad)


# --- tensor parallelism: one rank's shapes -------------------------------------------------

def test_llama3_70b_has_its_whole_model_figures():
    p = get_preset("llama3-70b")
    assert (p.hidden, p.heads, p.kv_heads, p.head_dim) == (8192, 64, 8, 128)
    assert (p.intermediate, p.vocab, p.layers, p.tied_lm_head) == (28672, 128256, 80, False)


# --- mixtures of experts ---------------------------------------------------------------------

def test_qwen3_30b_a3b_attention_is_wider_than_its_hidden_size():
    # Qwen3-30B-A3B config: hidden 2048, 32 heads and 4 KV heads of 128 -> q 4096, kv 512, qkv 5120
    assert shapes("qwen3-30b-a3b") == {
        "q": (4096, 2048, False), "kv": (512, 2048, False),
        "qkv": (5120, 2048, False), "o": (2048, 4096, False),
    }
    assert shapes("mixtral-8x7b") == shapes("llama3-8b")  # Mixtral's attention is Mistral's


@pytest.mark.parametrize("name, figures", [
    ("qwen3-30b-a3b", (128, 8, 768, 151936, 48)),
    ("mixtral-8x7b", (8, 2, 14336, 32000, 32)),
])
def test_moe_presets_have_experts_and_no_dense_mlp(name, figures):
    from hybridgemm.parallel.sharding import rank_projections

    p = get_preset(name)
    assert p.moe and (p.experts, p.experts_per_token, p.expert_intermediate, p.vocab, p.layers) == figures
    assert p.intermediate is None and not p.tied_lm_head
    # the experts are no dispatched GEMM: past attention, only the router and the LM head are
    # tuned (the router whole on every rank)
    assert [s.name for s in rank_projections(p, 1)] == ["q", "kv", "qkv", "o", "router", "lm_head"]
    assert [s.name for s in rank_projections(p, 2)] == ["q", "kv", "qkv", "o", "router", "lm_head"]
    router = next(s for s in rank_projections(p, 2) if s.name == "router")
    assert (router.n, router.k, router.bias) == (p.experts, p.hidden, False)
    assert not get_preset("llama3-8b").moe


def test_a_moe_preset_needs_consistent_expert_fields():
    from hybridgemm.autotune_cache.presets import ModelPreset

    base = dict(name="m", hidden=64, heads=4, kv_heads=2, head_dim=16, qkv_bias=False, o_bias=False)
    for bad in (dict(experts=8, experts_per_token=9, expert_intermediate=32),
                dict(experts=8, experts_per_token=2),
                dict(experts=8, experts_per_token=2, expert_intermediate=32, intermediate=128)):
        with pytest.raises(ValueError, match="mixture-of-experts preset"):
            ModelPreset(**base, **bad)
    assert ModelPreset(**base, experts=8, experts_per_token=2, expert_intermediate=32).moe
