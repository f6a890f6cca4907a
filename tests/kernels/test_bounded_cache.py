"""kernels/bounded_cache.py: the size bound, the eviction order of both policies, lookups that
are the dict's own, and inserts from several threads."""

from __future__ import annotations

import threading

import pytest

from hybridgemm.kernels.bounded_cache import BoundedCache


def test_oldest_inserted_goes_first_and_lookups_change_nothing():
    cache = BoundedCache(3)
    for k in "abc":
        assert cache.put(k, k.upper()) == k.upper()
    assert cache.get("a") == "A" and cache["b"] == "B" and "c" in cache
    cache.put("d", "D")
    assert list(cache) == ["b", "c", "d"]  # "a" went first although it was just read
    cache.put("b", "B2")  # a replaced entry becomes the newest
    cache.put("e", "E")
    assert list(cache.items()) == [("d", "D"), ("b", "B2"), ("e", "E")]
    assert cache.get("a") is None and cache.get("a", 0) == 0


def test_lru_keeps_what_is_read():
    cache = BoundedCache(3, lru=True)
    for k in "abc":
        cache.put(k, k)
    assert cache.get("a") == "a"  # now the most recent
    cache.put("d", "d")
    assert list(cache) == ["c", "a", "d"]  # "b", the least recently used, went
    assert cache.get("b") is None and cache.get("b", "miss") == "miss"
    assert list(cache) == ["c", "a", "d"]  # a miss reorders nothing


@pytest.mark.parametrize("lru", [False, True])
def test_never_holds_more_than_its_size(lru):
    cache = BoundedCache(5, lru=lru)
    for i in range(100):
        cache.put(i, i)
        cache.get(i // 2)
        assert len(cache) <= 5
    assert len(cache) == 5 and cache.max_size == 5
    cache.clear()
    assert len(cache) == 0


@pytest.mark.parametrize("size", [0, -1])
def test_size_must_be_positive(size):
    with pytest.raises(ValueError, match="max_size must be at least 1"):
        BoundedCache(size)


@pytest.mark.parametrize("lru", [False, True])
def test_inserts_from_threads_keep_the_bound(lru):
    cache = BoundedCache(64, lru=lru)
    errors = []

    def work(t):
        try:
            for i in range(2000):
                cache.put((t, i), i)
                cache.get((t, i - 1))
        except Exception as e:  # any error fails the test below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(cache) == 64
