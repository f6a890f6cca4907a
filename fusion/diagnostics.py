"""Warnings the linear call gives once per process: tables not loaded for a device, a table
entry that cannot be used, a backend that failed to run a shape, a shape the batch-invariant
mode cannot take, a fused decode step that fell back.

A bad table file warns through autotune_cache/table_document.py instead (its own warning
class, once per file and kind).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable

_warned: set = set()  # the keys warned about so far


def warn_once(key: Hashable, message: str) -> None:
    """One RuntimeWarning per ``key`` per process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
