"""The bounded cache every per-signature cache of plans and launchers uses: cuBLASLt plans and
fast launchers (cublaslt, cublaslt_grad), Triton launch plans and launchers (triton_plan,
triton_rmsnorm, triton_decode_attention, triton_push_sum), the dispatcher's decisions and
launchers (hybridgemm.dispatch) and the attention projection's raw launches
(hybridgemm.eager_fast).

Why bounded: a server whose M varies makes a new key per new shape, and a cache must not grow
for the life of the process. Why not ``functools.lru_cache``: the callers build their own
keys (cheaper than hashing a call's arguments) and insert what they built on a miss.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class BoundedCache(OrderedDict):
    """A dict of at most ``max_size`` entries: :meth:`put` inserts and evicts the oldest entries
    past the size. Past ``max_size`` an evicted value is only dropped (a launcher still holding
    it keeps it alive).

    Lookups are the dict's own (``get``, ``in``, ``[]``): no lock and no bookkeeping, because
    they sit on the per-call host path; eviction is then oldest-inserted first. With
    ``lru=True``, ``get`` also marks a hit as the most recent entry (about 70 ns more per
    lookup), so that entries in use outlive those that are not: least-recently-used eviction.

    Thread-safe: insertions take a lock; a lookup racing an eviction sees the entry or a miss.
    """

    def __init__(self, max_size: int, *, lru: bool = False):
        if max_size < 1:
            raise ValueError(f"BoundedCache: max_size must be at least 1, got {max_size}")
        super().__init__()
        self.max_size = max_size
        self.lru = lru
        self._lock = threading.Lock()
        if lru:
            self.get = self._get_recent  # the instance's lookup: the class's stays the C one

    def _get_recent(self, key, default=None):
        try:
            self.move_to_end(key)
        except KeyError:  # a miss, or another thread's put() evicted it in between
            return default
        return OrderedDict.get(self, key, default)

    def put(self, key, value):
        """Insert (or replace) ``key`` as the newest entry, evict past ``max_size``; returns ``value``."""
        with self._lock:
            self[key] = value
            self.move_to_end(key)
            while len(self) > self.max_size:
                self.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            super().clear()


__all__ = ["BoundedCache"]
