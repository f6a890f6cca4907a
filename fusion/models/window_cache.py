"""Sliding-window static cache layers that count their tokens on the device only, for caches
whose window never fills.

transformers' ``StaticSlidingWindowLayer`` counts its tokens twice: a device tensor
(``cumulative_length``, the write position) and a Python int (``cumulative_length_int``),
which decides whether the window is full and sizes the attention mask
(``get_mask_sizes``). Under ``torch.compile`` the int is a guarded constant; after the first
recompile Dynamo makes it a symbolic input of the graph, and CUDA graph trees record one graph
per value of it: every decode step is a new length, so no step replays a CUDA graph
(perf/results/h200/README.md, gemma2-9b compiled).

A cache whose full-attention layers are no longer than its sliding ones holds no more tokens
than the window and never fills it (past its length the full layers refuse a write, as the
swapped ones then do). Until full, the stock layer writes at the device position
(``torch.arange(S) + cumulative_length``, as ``StaticLayer`` does), returns its own keys and
values, and gives the mask ``(max_cache_len, 0)``, as ``StaticLayer`` does. Such a layer's
class is swapped for :func:`device_length_class` (a subclass that computes exactly that from
the device count: no int a graph reads), so the layer also takes the fused static-cache step
(fusion/models/decode_checks.py ``kv_slot``), whose kernels read the device position and the
mask as they are. A cache whose window can fill keeps the stock layers, and so does a cache of
sliding layers only: where it is shorter than the window its layers are as long as the cache
and roll once full, past where a ``StaticLayer`` would stop.

:func:`adopt` swaps a cache's layers once, on the first eager call of a patched decoder layer
that is given the cache (never inside a compiled region, where a class swap cannot be
traced); a cache first used inside a compiled region keeps the stock layers. The swap
survives ``unpatch`` and suits the stock model too: the layers compute what they computed.
"""

from __future__ import annotations

import threading

import torch

from .source_forms import body_statements, has_statements

# Set on a cache object once its layers were considered (swapped or not): later calls skip it.
ADOPTED = "_hybridgemm_windows"
CLASS_NAME = "DeviceLengthWindowLayer"

# What the swap relies on, checked in transformers' source once: the sliding layer's update
# writes at the device position until full, its mask sizes until full are (max_cache_len, 0),
# its count is the int; StaticLayer's update, mask sizes and count are the device ones.
_SLIDING_UPDATE = (
    "is_full=current_length>=self.max_cache_len",
    "cache_position=torch.arange(kv_length,device=self.device)+self.cumulative_length",
    "self.cumulative_length.add_(kv_length)",
    "returnself.keys,self.values",
)
_SLIDING_MASK_SIZES = (
    "sliding_window=self.max_cache_len",
    "kv_offset=max(self.cumulative_length_int-sliding_window+1,0)",
    "kv_length=sliding_window",
)
_STATIC_MASK_SIZES = ("kv_offset=0", "kv_length=self.max_cache_len", "returnkv_length,kv_offset")
_STATIC_SEQ_LENGTH = ("returnself.cumulative_lengthifself.is_initializedelse0",)

_lock = threading.Lock()
_loaded: list = []  # [(StaticLayer, StaticSlidingWindowLayer, the subclass or None)], published once


def _classes():
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_build())
    return _loaded[0]


def _build():
    try:
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
    except ImportError:
        return None, None, None
    sliding, static = StaticSlidingWindowLayer, StaticLayer
    checked = has_statements(sliding.update, _SLIDING_UPDATE) \
        and has_statements(sliding.get_mask_sizes, _SLIDING_MASK_SIZES) \
        and body_statements(sliding.get_seq_length) == ["returnself.cumulative_length_int"] \
        and has_statements(static.get_mask_sizes, _STATIC_MASK_SIZES) \
        and has_statements(static.get_seq_length, _STATIC_SEQ_LENGTH) and hasattr(static, "update")
    if not checked:
        return static, sliding, None

    def _get_int(self) -> int:
        # For code that reads the stock attribute: the device count (a host sync), never a stale int.
        return int(self.cumulative_length) if self.is_initialized else 0

    def _set_int(self, value: int) -> None:
        # the stock reset() sets 0 after zeroing the device count
        if isinstance(self.cumulative_length, torch.Tensor):
            self.cumulative_length.fill_(value)
        else:
            self.cumulative_length = value

    body = {
        "__doc__": "A sliding-window static cache layer whose window never fills, counting its tokens on the device "
                   "only: StaticLayer's update, mask sizes, length and crop (hybridgemm.models.window_cache).",
        "__module__": __name__, "__qualname__": CLASS_NAME,
        "update": static.update, "get_mask_sizes": static.get_mask_sizes,
        "get_seq_length": static.get_seq_length, "cumulative_length_int": property(_get_int, _set_int),
    }
    if "crop" in vars(static):
        body["crop"] = static.crop
    return static, sliding, type(CLASS_NAME, (sliding,), body)


def device_length_class() -> type | None:
    """The swapped-in layer class (None without transformers or where its cache layers are not
    the checked ones)."""
    return _classes()[2]


def __getattr__(name: str):
    # A pickled cache names its swapped layers' class hybridgemm.models.window_cache.<CLASS_NAME>.
    if name == CLASS_NAME and device_length_class() is not None:
        return device_length_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_device_length(layer_cls: type) -> bool:
    """Is ``layer_cls`` :func:`device_length_class`? (Builds nothing for any other class: safe
    inside a compiled region's trace.)"""
    return getattr(layer_cls, "__module__", None) == __name__ and layer_cls is device_length_class()


def adopt(cache) -> None:
    """Swap the sliding-window layers of ``cache`` whose window never fills for
    :func:`device_length_class`, once per cache. Raises nothing; leaves any other cache as it is."""
    state = getattr(cache, "__dict__", None)
    if state is None or state.get(ADOPTED):
        return
    static, sliding, swapped = _classes()
    layers = getattr(cache, "layers", None)
    if swapped is not None and isinstance(layers, list) and not getattr(cache, "offloading", False):
        full = [la.max_cache_len for la in layers if type(la) is static]
        for la in layers:
            if type(la) is sliding and _never_fills(la, full):
                la.__dict__.pop("cumulative_length_int", None)  # the class's property answers now
                la.__class__ = swapped
    state[ADOPTED] = True


def _never_fills(layer, full_lengths: list[int]) -> bool:
    """Does ``layer``'s window hold every token the cache can? Its length is min(window, the
    cache's): a full-attention layer of the cache no longer than it says the cache's is no
    longer. (The count itself is not read: a device value.)"""
    length = getattr(layer, "max_cache_len", None)
    if not isinstance(length, int) or not isinstance(getattr(layer, "cumulative_length_int", None), int):
        return False
    return any(isinstance(n, int) and n <= length for n in full_lengths)


__all__ = ["ADOPTED", "adopt", "device_length_class", "is_device_length"]
