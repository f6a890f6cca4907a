"""The weight formats a benchmark runs (``--weights bf16|fp8``, ``--granularity
channel|block128``): the options of perf/bench_e2e.py and perf/bench_msweep.py (and of
``hybridgemm bench --e2e / --m-sweep``, which pass them on), and the format's name in a CSV's
``weights`` column: ``bf16`` (the model's own dtype), or kernels/fp8.py's ``e4m3_channel`` /
``e4m3_block128``.
"""

from __future__ import annotations

import argparse

from hybridgemm.kernels.fp8 import FORMAT_OF, GRANULARITIES

WEIGHTS = ("bf16", "fp8")
DEFAULT_GRANULARITY = "channel"


def add_weight_options(ap: argparse.ArgumentParser, fp8_does: str) -> None:
    """``--weights`` and ``--granularity`` (both default None, so that
    :func:`weight_options_problem` tells a given option from a default). ``fp8_does``: what
    ``--weights fp8`` does, for the help."""
    ap.add_argument("--weights", choices=WEIGHTS, help=f"bf16 (default) or fp8: {fp8_does}")
    ap.add_argument("--granularity", choices=GRANULARITIES,
                    help="the FP8 scales: one per output row (channel, default) or per 128 x 128 block (block128); "
                         "only with --weights fp8")


def weight_options_problem(weights: str | None, granularity: str | None, dtype: str = "bf16") -> str:
    """Why the two options cannot go together, or with activations of ``dtype`` ("" when they can)."""
    if granularity is not None and weights != "fp8":
        return "--granularity: only with --weights fp8"
    if weights == "fp8" and dtype not in ("bf16", "fp16"):
        return f"--weights fp8: an FP8 weight computes in bf16 or fp16, not {dtype}"
    return ""


def resolve_weight_options(args: argparse.Namespace) -> None:
    """Fill the defaults in: ``args.weights`` bf16, ``args.granularity`` channel (FP8 only,
    else None). Call after :func:`weight_options_problem` found none."""
    args.weights = args.weights or "bf16"
    args.granularity = (args.granularity or DEFAULT_GRANULARITY) if args.weights == "fp8" else None


def weight_format(granularity: str | None) -> str:
    """The ``weights`` column of a variant: ``bf16`` without a granularity, else the FP8 format."""
    return FORMAT_OF[granularity] if granularity else "bf16"
