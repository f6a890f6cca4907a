"""One M range of a kernel tuned against the computation it replaces (the MoE kernels'
grouped baseline, the gated kernel's stock pair): the procedure autotune_cache/tune_moe.py and
tune_glu.py share.

Every candidate is screened at the range's top point; the best (``tuner.finalist_count``) are
timed again at each of the range's sample points beside the baseline in interleaved rounds, on
rotating copies of the weights (CUDA graphs, autotune_cache/measure.py); the winner by
``tuner.pick_winner`` on each finalist's worst ratio to the baseline: it must beat it by more
than 3%, else the entry is ``torch`` (the baseline). Needs a CUDA GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from . import tuner
from .keys import TableKey, sample_points
from .measure import gpu_time_rotating
from .table_entries import make_entry

SCREEN_REPLAYS, FINAL_REPLAYS = 3, 7


def tune_range(key: TableKey, backend: str, candidates: Sequence, baseline: Callable, ours: Callable, copies: int,
               record_of: Callable, log: Callable[[str], None], baseline_name: str = "the baseline") -> dict:
    """The entry of ``key``'s range. ``baseline(m)`` and ``ours(m, candidate)`` give a call
    ``f(i)`` on weight copy ``i`` (0 <= i < ``copies``) at M = m; ``record_of(candidate)`` the
    config record an entry stores. A candidate that fails to run (does not compile or fit) is
    left out, with a line in ``log``."""
    points = sample_points(key.m_lo, key.m_hi)
    hi = key.m_hi
    screen = []
    for cand in candidates:
        try:
            t = gpu_time_rotating([ours(hi, cand)], copies, replays=SCREEN_REPLAYS)[0]
            screen.append((t.median_us, cand))
        except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit: not a candidate)
            log(f"{key.to_string()}: {cand} left out ({type(exc).__name__}: {str(exc)[:100]})")
    screen.sort(key=lambda r: r[0])
    finalists = [c for _, c in screen[:tuner.finalist_count([screen[0][0] / r[0] for r in screen])]] if screen else []
    ratios, medians = {}, {}
    for m in points:
        rounds: list = []
        gpu_time_rotating([baseline(m)] + [ours(m, c) for c in finalists], copies, replays=FINAL_REPLAYS,
                          rounds=rounds)
        ratios[m] = [tuner.ratios_of(rounds, j + 1) for j in range(len(finalists))]
        medians[m] = [sorted(r[j] for r in rounds)[len(rounds) // 2] for j in range(len(finalists) + 1)]
    scores = [min(ratios[m][j] for m in points) for j in range(len(finalists))]
    won = tuner.pick_winner([(1.0, tuner.TORCH_RANK)] + [(s, (0, j)) for j, s in enumerate(scores)])
    base_us = medians[hi][0]
    cand_rows = [{"backend": backend, "config": record_of(c), "median_us": medians[hi][j + 1], "spread_us": 0.0,
                  "worst_ratio": s} for j, (c, s) in enumerate(zip(finalists, scores))]
    if won == 0:
        entry = make_entry("torch", {}, m_points=points, ratios=[1.0] * len(points), median_us=base_us,
                           spread_us=0.0, candidates=cand_rows, flinear_us=base_us)
    else:
        j = won - 1
        entry = make_entry(backend, record_of(finalists[j]), m_points=points, ratios=[ratios[m][j] for m in points],
                           median_us=medians[hi][won], spread_us=0.0, candidates=cand_rows, flinear_us=base_us)
    log(f"{key.to_string()}: {entry['backend']} {entry['config']} worst {entry['worst_ratio']:.3f}x {baseline_name} "
        f"({entry['median_us']:.1f} vs {base_us:.1f} µs at M={hi})")
    return entry


__all__ = ["FINAL_REPLAYS", "SCREEN_REPLAYS", "tune_range"]
