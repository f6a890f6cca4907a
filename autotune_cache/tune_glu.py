"""The gated kernel (kernels/triton_glu.py) in the tuning table: its keys and entries, and the
tuner that fills them.

**Key.** ``<op>|<dtype>|<none or bias>|N=<I>|K=<K>|M=lo-hi|c`` for gate/up over a stacked (2I, K)
weight. The op names what the kernel carries before the GEMM: ``glu`` nothing (an MLP called
as a module), ``glu_rms`` the RMSNorm prologue with a norm weight of x's dtype (Llama's), and
``glu_rms32`` with an fp32 factor (a Gemma norm's ``1 + w``), both the fused decode step's.
The gate activation is not in the key: it is a few operations per output element of a
weight-streaming kernel.

**Entry.** backend ``triton_glu`` with the kernel's config record, or ``torch``: without a
prologue, the two GEMMs through the dispatcher and the product apart; with one, the norm in
launches of its own, then gate/up as the ``glu`` entry of the shape decides.

**Tuning** (:func:`tune_glu`), per decode M range (octaves up to :data:`GLU_M_MAX`): the
candidates of ``triton_glu.candidates`` against the baseline, by
autotune_cache/baseline_tuner.py (a candidate must beat the baseline by more than 3% at its
worst point, else the baseline stays). The
baseline is what a ``torch`` entry runs: without a prologue the stock pair (two F.linear over
the gate and up rows, the product in x's dtype; at run time the dispatcher's GEMMs, F.linear
where the table holds nothing faster); with one, the norm apart (``norm_apart``, the caller's
formula: the fused decode step's) and then the ``glu`` entry's decision, so the ``glu`` ranges
are tuned first. Nothing runs at import; tuning needs a CUDA GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import DTYPE_NAMES

from . import baseline_tuner
from .keys import TableKey, octave, sample_points
from .measure import rotation_copies

BACKEND = "triton_glu"
GLU_M_MAX = 16  # decode rows: the fused decode step's (fusion/models/decode_checks.DECODE_ROWS)
# the op per norm prologue: none, a norm weight of x's dtype, an fp32 factor
NORM_OPS = {None: "glu", "x": "glu_rms", "fp32": "glu_rms32"}


def norm_kind(norm_weight: torch.Tensor | None, dtype: torch.dtype) -> str | None:
    """The key's name for a prologue with ``norm_weight`` over x of ``dtype`` (None: no prologue)."""
    if norm_weight is None:
        return None
    return "x" if norm_weight.dtype == dtype else "fp32"


def glu_key(norm: str | None, dtype: torch.dtype, intermediate: int, k: int, lo: int, hi: int,
            bias: bool = False) -> TableKey:
    return TableKey(NORM_OPS[norm], DTYPE_NAMES[dtype], "bias" if bias else "none", intermediate, k, lo, hi)


def is_glu_op(op: str) -> bool:
    return op in NORM_OPS.values()


def glu_keys(norm: str | None, dtype: torch.dtype, intermediate: int, k: int, m_max: int = GLU_M_MAX) -> list[TableKey]:
    """The octave ranges up to ``m_max`` (at most :data:`GLU_M_MAX`) of one gate/up shape."""
    keys, lo = [], 1
    while lo <= min(m_max, GLU_M_MAX):
        lo, hi = octave(lo)
        keys.append(glu_key(norm, dtype, intermediate, k, lo, hi))
        lo = hi + 1
    return keys


def config_of(record):
    """The TritonGluConfig of an entry's config; ValueError naming what is wrong."""
    return triton_module("triton_glu").TritonGluConfig.from_record(record)


def tune_into(table, path, intermediate: int, k: int, norms=(None, "x"), dtype: torch.dtype = torch.bfloat16,
              norm_apart: Callable | None = None, force: bool = False, log: Callable[[str], None] = print,
              m_values=None) -> int:
    """Tune the ranges of one gate/up shape that ``table`` does not hold (all with ``force``;
    only those holding one of ``m_values`` where given),
    for each prologue in ``norms`` (None, "x", "fp32"; a prologue needs ``norm_apart(x, g, eps)``,
    the norm computed apart), into it, saving it to ``path`` after each range (an interrupted run
    keeps what it tuned). The ``glu`` ranges go first: the prologue ranges' baseline reads them.
    Returns the ranges tuned."""
    norms = sorted(set(norms), key=lambda n: n is not None)
    if any(n is not None for n in norms) and norm_apart is None:
        raise ValueError("tune_into: a norm prologue's baseline needs norm_apart (the norm computed apart)")
    keys = [key for n in norms for key in glu_keys(n, dtype, intermediate, k)
            if (force or table.lookup(key) is None) and (not m_values or any(key.covers(m) for m in m_values))]
    if not keys:
        return 0
    table.save(path)  # an unwritable path fails now, not after the first range
    done = 0
    for key, entry in tune_glu(intermediate, k, dtype, keys, table, norm_apart, log):
        table.set(key, entry)
        table.save(path)
        done += 1
    return done


def _stock_pair(x, w, i, act):
    return act(F.linear(x, w[:i])) * F.linear(x, w[i:])


def tune_glu(intermediate: int, k: int, dtype: torch.dtype, keys: list[TableKey], table,
             norm_apart: Callable | None = None, log: Callable[[str], None] = lambda s: None):
    """``(key, entry)`` for each of ``keys`` of one gate/up shape, as each range is tuned
    (module docstring); ``table`` holds the ``glu`` entries a prologue range's baseline runs."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(2 * intermediate, k, device=dev, generator=g) * k ** -0.5).to(dtype)
    copies = rotation_copies(w.numel() * w.element_size(), dev)
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    norm_weights = {"x": (torch.rand(k, device=dev, generator=g) + 0.5).to(dtype),
                    "fp32": torch.rand(k, device=dev, generator=g) + 0.5}
    for key in keys:
        yield key, _tune_range(key, intermediate, k, dtype, weights, copies, norm_weights, table, norm_apart, g, log)


def _plain_config(table, dtype: torch.dtype, i: int, k: int, m: int):
    """The config the ``glu`` entry of the shape runs at ``m`` (None: the stock pair)."""
    found = table.find(glu_key(None, dtype, i, k, 1, 1).shape, m)
    if found is None or found[1]["backend"] != BACKEND:
        return None
    try:
        return config_of(found[1]["config"])
    except ValueError:
        return None


def _tune_range(key, i, k, dtype, weights, copies, norm_weights, table, norm_apart, g, log) -> dict:
    tg = triton_module("triton_glu")
    act = torch.nn.functional.silu
    norm = next(n for n, op in NORM_OPS.items() if op == key.op)
    nw = None if norm is None else norm_weights[norm]
    eps = 1e-6
    xs = {m: torch.randn(m, k, device=weights[0].device, generator=g).to(dtype)
          for m in sample_points(key.m_lo, key.m_hi)}

    def baseline(m):
        x = xs[m]
        if nw is None:
            return lambda c: _stock_pair(x, weights[c], i, act)
        plain = _plain_config(table, dtype, i, k, m)
        if plain is None:
            return lambda c: _stock_pair(norm_apart(x, nw, eps), weights[c], i, act)
        return lambda c: tg.glu(norm_apart(x, nw, eps), weights[c], None, "silu", config=plain)

    def ours(m, cfg):
        x = xs[m]
        fused = None if nw is None else (nw, eps)
        return lambda c: tg.glu(x, weights[c], None, "silu", config=cfg, norm=fused)

    return baseline_tuner.tune_range(key, BACKEND, tg.candidates(key.m_hi, i, k, dtype), baseline, ours, copies,
                                     lambda cfg: cfg.to_record(), log)


__all__ = ["BACKEND", "GLU_M_MAX", "NORM_OPS", "config_of", "glu_key", "glu_keys", "is_glu_op", "norm_kind",
           "tune_glu", "tune_into"]
