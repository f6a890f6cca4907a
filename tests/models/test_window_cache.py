"""Sliding-window cache layers that count on the device (fusion/models/window_cache.py): what
they compute against transformers' own layer, which caches they take, and the compiled step
they are for (one graph, no Python int among its inputs)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from hybridgemm.models import attention_forms, window_cache

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer  # noqa: E402

HEAD = 16


def _cache(window: int, length: int, kind: str = "gemma2") -> StaticCache:
    common = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD,
                  num_hidden_layers=2, vocab_size=32, sliding_window=window)
    config = transformers.Gemma2Config(**common) if kind == "gemma2" else transformers.MistralConfig(**common)
    return StaticCache(config=config, max_cache_len=length)


def _kv(g: torch.Generator, tokens: int):
    return torch.randn(1, 1, tokens, HEAD, generator=g), torch.randn(1, 1, tokens, HEAD, generator=g)


def test_a_window_that_never_fills_counts_on_the_device_and_computes_what_the_stock_layer_does():
    stock = _cache(window=32, length=16)
    twin = copy.deepcopy(stock)
    window_cache.adopt(twin)
    assert [type(la) for la in stock.layers] == [StaticSlidingWindowLayer, StaticLayer]
    assert [type(la) for la in twin.layers] == [window_cache.device_length_class(), StaticLayer]
    assert twin.is_sliding == stock.is_sliding == [True, False]
    g = torch.Generator().manual_seed(0)
    for step, tokens in enumerate([3] + [1] * 13):  # to the cache's last position
        k, v = _kv(g, tokens)
        want = stock.layers[0].update(k, v)
        got = twin.layers[0].update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        assert got[0] is twin.layers[0].keys  # its own (static) tensors, as stock's until full
        for q in (1, 3):  # the next call's tokens, where the cache holds them
            if stock.layers[0].get_seq_length() + q > 16:
                continue
            assert twin.layers[0].get_mask_sizes(q) == stock.layers[0].get_mask_sizes(q), (step, q)
        length = twin.layers[0].get_seq_length()
        assert isinstance(length, torch.Tensor) and int(length) == stock.layers[0].get_seq_length()
        assert twin.layers[0].cumulative_length_int == stock.layers[0].cumulative_length_int  # read by others
    if "crop" in vars(StaticLayer):  # (transformers >= 5.25)
        stock.layers[0].crop(-2)
        twin.layers[0].crop(-2)
        assert int(twin.layers[0].get_seq_length()) == stock.layers[0].get_seq_length() == 14
    twin.reset()
    stock.reset()
    assert int(twin.layers[0].get_seq_length()) == 0 and twin.layers[0].cumulative_length_int == 0
    assert not twin.layers[0].keys.any()


def test_caches_whose_window_can_fill_keep_the_stock_layers():
    # the cache longer than the window: the stock layer rolls once full
    longer = _cache(window=8, length=16)
    window_cache.adopt(longer)
    assert type(longer.layers[0]) is StaticSlidingWindowLayer
    # sliding layers only (Mistral), the cache as long as the window or shorter: the stock layer
    # is as long as the cache and rolls once full, past where a StaticLayer would stop
    for window in (16, 17, 4096):
        only_sliding = _cache(window=window, length=16, kind="mistral")
        window_cache.adopt(only_sliding)
        assert {type(la) for la in only_sliding.layers} == {StaticSlidingWindowLayer}
        g = torch.Generator().manual_seed(window)
        for tokens in [3] + [1] * 15:  # past the cache's 16 positions: the stock layer rolls
            only_sliding.layers[0].update(*_kv(g, tokens))
        assert only_sliding.layers[0].cumulative_length_int == 18
    # considered once: a cache adopted is not looked at again
    again = _cache(window=32, length=16)
    again.__dict__[window_cache.ADOPTED] = True
    window_cache.adopt(again)
    assert type(again.layers[0]) is StaticSlidingWindowLayer
    for other in (None, (1, 2), "cache"):
        window_cache.adopt(other)  # nothing, no error


def test_a_compiled_step_over_the_swapped_layer_is_one_graph_with_no_int_input():
    """transformers' layer: its int turns into a graph input after a recompile (CUDA graph trees
    then record one graph per value); the swapped layer: one graph over four steps."""
    frames = []

    def backend(gm, example_inputs):
        frames.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    def step(cache, k, v):
        keys, _ = cache.layers[0].update(k, v)
        return keys * 1, cache.layers[0].get_mask_sizes(1), cache.get_seq_length()

    stock = _cache(window=32, length=16)
    twin = copy.deepcopy(stock)
    window_cache.adopt(twin)
    seen = {}
    for name, cache in (("stock", stock), ("twin", twin)):
        torch._dynamo.reset()
        frames.clear()
        g = torch.Generator().manual_seed(1)
        cache.layers[0].update(*_kv(g, 3))
        fn = torch.compile(step, backend=backend, fullgraph=True)
        for _ in range(4):
            out = fn(cache, *_kv(g, 1))
        seen[name] = (len(frames), any("cumulative_length_int" in p for f in frames for p in f), out[0].clone())
    torch._dynamo.reset()
    assert seen["stock"][:2] == (2, True)  # the test can tell the difference
    assert seen["twin"][:2] == (1, False)
    assert torch.equal(seen["twin"][2], seen["stock"][2])


def test_a_cache_with_swapped_layers_pickles():
    cache = _cache(window=32, length=16)
    window_cache.adopt(cache)
    cache.layers[0].update(*_kv(torch.Generator().manual_seed(2), 3))
    back = pickle.loads(pickle.dumps(cache))
    assert type(back.layers[0]) is window_cache.device_length_class()
    assert torch.equal(back.layers[0].keys, cache.layers[0].keys) and int(back.layers[0].get_seq_length()) == 3


def test_a_sliding_layer_of_another_form_is_left_stock_and_reported(monkeypatch):
    """A transformers release whose sliding-window layer no longer computes the checked forms:
    no layer is swapped, and patch says why a sliding-window attention takes no static step."""
    monkeypatch.setattr(window_cache, "_loaded", [])
    monkeypatch.setattr(window_cache, "_SLIDING_UPDATE", ("self.some_other_statement()",))
    assert window_cache.device_length_class() is None
    cache = _cache(window=32, length=16)
    window_cache.adopt(cache)
    assert type(cache.layers[0]) is StaticSlidingWindowLayer
    config = transformers.Gemma2Config(hidden_size=32, intermediate_size=32, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=HEAD, num_hidden_layers=2, vocab_size=32,
                                       sliding_window=32)
    attn = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
    assert "sliding-window layer" in (attention_forms.why_not_fuse_attention(attn) or "")
