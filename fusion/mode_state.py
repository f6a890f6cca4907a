"""Which dispatch mode is on: the mode names, ``get_mode``/``set_mode``/``mode``, and who hears
of a switch. What each mode runs and guarantees: fusion/modes.py.

A module of its own because of where it sits: below fusion/decide.py, whose change hooks hear
of every switch and which reads the mode when it reloads the tables, while the batch-invariant
decision (fusion/modes.py) returns decide's ``Choice`` and so sits above it.

The mode is process-global (one setting shared by every thread). A switch and a table reload
(decide) tell their listeners under one lock, so those that keep decisions per mode
(fusion/dispatch.py) see one change at a time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

DEFAULT = "default"
BATCH_INVARIANT = "batch_invariant"
MODES = (DEFAULT, BATCH_INVARIANT)

# Module state: scalars live in one-element lists, so no name is ever rebound and every reader
# holds the same object.
_lock = threading.Lock()
_mode: list[str] = [DEFAULT]
_listeners: list[Callable[[str], None]] = []


def get_mode() -> str:
    """The current dispatch mode, ``"default"`` or ``"batch_invariant"`` (process-global)."""
    return _mode[0]


def set_mode(name: str) -> str:
    """Switch the dispatch mode for the whole process; returns the previous mode.

    ``"batch_invariant"``: rows of ``hybridgemm.linear`` are bit-identical for every M (the
    policy and its limits: fusion/modes.py). ``"default"``: the tuned kernels. Each mode keeps
    its own cached decisions, so a switch never reuses the other mode's. An unknown name is a
    ValueError that changes nothing.
    """
    if name not in MODES:
        raise ValueError(f"unknown hybridgemm mode {name!r}; valid modes: {', '.join(map(repr, MODES))}")
    with _lock:
        previous = _mode[0]
        _mode[0] = name
        for listener in _listeners:
            listener(name)
    return previous


@contextlib.contextmanager
def mode(name: str) -> Iterator[str]:
    """``with hybridgemm.mode("batch_invariant"): ...``: the mode inside the block, the
    previous one restored on exit (exceptions included). Process-global, like set_mode."""
    previous = set_mode(name)
    try:
        yield name
    finally:
        set_mode(previous)


def on_switch(listener: Callable[[str], None]) -> None:
    """Call ``listener(new_mode)`` under the mode lock after every switch (how fusion/decide.py's
    change hooks hear of switches without this module importing decide)."""
    _listeners.append(listener)


@contextlib.contextmanager
def held() -> Iterator[str]:
    """The mode lock for the block: no switch until it ends; yields the current mode (decide
    reloads the tables under it, so a reload and a switch never interleave)."""
    with _lock:
        yield _mode[0]
