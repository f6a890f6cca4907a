"""The ``hybridgemm`` command line (``commands``: autotune, show, explain, bench, plot, demo, main)."""

from .commands import main

__all__ = ["main"]
