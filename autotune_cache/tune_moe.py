"""The mixture-of-experts kernels (kernels/triton_moe.py) in the tuning table: their keys and
entries, and the tuner that fills them.

**Key.** ``moe_<activation>_e<experts>_k<top_k>|<dtype>|none|N=<I>|K=<H>|M=lo-hi|c``: the
experts' GLU activation, count and top-k in the op, the expert width I as N and the hidden
size H as K, M the tokens of the call. FP8 experts append their weight format to the op
(``moe_silu_e128_k8_e4m3_channel``, keys.op_for), so their entries never serve bf16 experts.
**Entry.** backend ``triton_moe`` with ``config``
``{"up": [block_m, block_n, block_k, num_warps, num_stages], "down": [...]}`` (one block_m:
gate/up and down share the layout; a pair-major launch on the tensor cores adds a sixth value, 1:
``mma``), or backend ``torch``: the unfused grouped baseline
(kernels/grouped_mm_moe.py, transformers' ``grouped_mm`` computation) runs. ``ratios``: the
baseline's time over the winner's at each point; ``flinear_us``: the baseline's at the top.

**Tuning** (:func:`tune_moe`), per M range (octaves up to ``MOE_M_MAX``): a routing of random
logits (softmax top-k, seeded by M) at each of the range's sample points; every candidate
(:func:`candidates`) timed against the baseline on rotating copies of the expert weights by
autotune_cache/baseline_tuner.py (screened at the top point, the best ones again at every
point; a candidate must beat the baseline by more than 3% at its worst point, else the
baseline stays). FP8 experts are tuned on the random weights quantized (kernels/fp8.py), the
baseline then dequantizing them to x's dtype in each call, as ``hybridgemm.moe`` does where
that entry wins. Nothing runs at import; tuning needs a CUDA GPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from hybridgemm.kernels.fp8 import GRANULARITY_OF_FORMAT, quantize_fp8
from hybridgemm.kernels.grouped_mm_moe import grouped_mm_moe
from hybridgemm.kernels.lazy import triton_module
from hybridgemm.kernels.problem import DTYPE_NAMES

from . import baseline_tuner
from .keys import TableKey, octave, op_for, sample_points
from .measure import clone_operand, dense_weight, rotation_copies

BACKEND = "triton_moe"
MOE_M_MAX = 4096
_OP_RE = re.compile(r"^moe_([a-z_]+?)_e([1-9][0-9]{0,4})_k([1-9][0-9]{0,2})(_e4m3_channel|_e4m3_block128)?$")
_RECORD_LIMITS = {"block_m": (1, 256), "block_n": (2, 512), "block_k": (16, 1024), "num_warps": (1, 16),
                  "num_stages": (1, 8)}
# block_n below 4 and block_k above 512: the pair-major CUDA-core form's narrow, deep tiles only
# (a grouped or tensor-core launch of such tiles would not fit shared memory or an MMA)
_NARROW_N, _DEEP_K = 4, 512
MOST_WEIGHT_COPY_BYTES = 16 << 30  # rotating copies of the expert weights, at most this much


def moe_op(experts: int, top_k: int, activation: str) -> str:
    return f"moe_{activation}_e{experts}_k{top_k}"


def parse_moe_op(op: str) -> tuple[str, int, int] | None:
    """``(activation, experts, top_k)`` of a MoE op name (of any weight format: keys.weight_format_of
    reads that), ``None`` for any other op."""
    m = _OP_RE.match(op)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def moe_key(experts: int, top_k: int, activation: str, dtype: torch.dtype, intermediate: int, hidden: int,
            lo: int, hi: int, weight_format: str = "") -> TableKey:
    return TableKey(op_for(moe_op(experts, top_k, activation), weight_format), DTYPE_NAMES[dtype], "none",
                    intermediate, hidden, lo, hi)


def record_of(up, down) -> dict:
    return {name: [c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages] + [1] * c.mma
            for name, c in (("up", up), ("down", down))}


def configs_of(record) -> tuple:
    """``(up, down)`` TritonMoeConfigs of an entry's config; ValueError naming what is wrong."""
    tm = triton_module("triton_moe")
    if not isinstance(record, dict) or set(record) != {"up", "down"}:
        raise ValueError(f"a {BACKEND} config is {{'up': [...], 'down': [...]}}, got {record!r:.80}")
    out = []
    for name in ("up", "down"):
        values = record[name]
        if not isinstance(values, list) or len(values) not in (len(_RECORD_LIMITS), len(_RECORD_LIMITS) + 1):
            raise ValueError(f"{name}: expected {len(_RECORD_LIMITS)} integers {list(_RECORD_LIMITS)}, "
                             "then 1 for a pair-major launch on the tensor cores")
        for field, v in zip(_RECORD_LIMITS, values):
            lo, hi = _RECORD_LIMITS[field]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name}.{field} must be an integer in {lo}..{hi}, got {v!r}")
            if field != "num_stages" and v & (v - 1):
                raise ValueError(f"{name}.{field} must be a power of two, got {v}")
        mma = [type(v) for v in values[len(_RECORD_LIMITS):]] == [int] and values[-1] == 1  # 1, not True or 1.0
        if len(values) > len(_RECORD_LIMITS) and not (mma and values[0] == 1 and min(values[1:3]) >= 16):
            raise ValueError(f"{name}: a sixth value is 1 (mma) after block_m 1 and block_n, block_k of at least "
                             f"16, got {values!r}")
        if (values[1] < _NARROW_N or values[2] > _DEEP_K) and (values[0] != 1 or mma):
            raise ValueError(f"{name}: block_n below {_NARROW_N} or block_k above {_DEEP_K} only pair-major on the "
                             f"CUDA cores (block_m 1, no mma), got {values!r}")
        out.append(tm.TritonMoeConfig(*values[:len(_RECORD_LIMITS)], mma=mma))
    if out[0].block_m != out[1].block_m:
        raise ValueError(f"up and down differ in block_m ({out[0].block_m}, {out[1].block_m}): they share the layout")
    return tuple(out)


# pair-major (block_n, block_k, warps, stages, mma): CUDA-core and tensor-core forms (the
# fastest of each in scripts/moe_config_probe.py at the Qwen3-30B-A3B and Mixtral-8x7B experts).
# Down's CUDA-core form compiles its K-tile loads without a cp.async pipeline (sm_90 SASS, Triton
# 3.6 and 3.9), so each K step waits for the last: 4 x 512 and 2 x 1024 read a token's slots over
# Qwen3-30B-A3B's K = 768 in two rounds and in one (compiled for sm_90 with e4m3 or bf16 weights
# they keep no local memory: tests/fusion/test_moe.py)
_PAIR_UP = [(8, 128, 8, 4, False), (8, 256, 8, 4, False), (16, 256, 1, 4, True), (32, 256, 2, 4, True),
            (16, 128, 1, 4, True)]
_PAIR_DOWN = [(8, 256, 4, 4, False), (4, 256, 4, 2, False), (4, 256, 8, 2, False), (8, 256, 8, 4, False),
              (16, 128, 4, 2, False), (4, 512, 8, 1, False), (2, 1024, 8, 1, False), (16, 128, 1, 4, True),
              (32, 256, 2, 4, True)]
# (block_n, block_k, warps, stages) per block_m; the gate/up launch holds two weight tiles, so its
# widest tiles are left out where shared memory would not hold them
_GROUPED = {16: [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3)],
            32: [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3)],
            64: [(128, 64, 4, 4), (64, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3)],
            128: [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 4), (256, 64, 8, 3)]}


def candidates(pairs: int, experts: int, weight_format: str = "") -> list[tuple]:
    """(up, down) config pairs for ``pairs`` pairs over ``experts`` experts: pair-major ones up to
    128 pairs; grouped ones of every block size up to twice the rows an expert gets on average;
    for block-scaled FP8 experts those whose tiles fit the scale blocks (triton_moe.fp8_fits)."""
    tm = triton_module("triton_moe")
    out = []
    if pairs <= 128:
        out += [(tm.TritonMoeConfig(1, *u), tm.TritonMoeConfig(1, *d)) for u in _PAIR_UP for d in _PAIR_DOWN]
    per_expert = -(-pairs // max(experts, 1))
    for bm, tiles in _GROUPED.items():
        if bm > max(16, 2 * per_expert):
            continue
        ups = [t for t in tiles if t[0] < 256 or bm < 128]
        out += [(tm.TritonMoeConfig(bm, *u), tm.TritonMoeConfig(bm, *d)) for u in ups for d in tiles]
    return [c for c in out if not (tm.fp8_fits(c[0], weight_format) or tm.fp8_fits(c[1], weight_format))]


def _routing(m: int, experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(m)
    probs = torch.softmax(torch.randn(m, experts, device=device, generator=g), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def moe_keys(experts: int, top_k: int, intermediate: int, hidden: int, activation: str = "silu",
             dtype: torch.dtype = torch.bfloat16, m_max: int = MOE_M_MAX, weight_format: str = "") -> list[TableKey]:
    """The octave ranges up to ``m_max`` (at most ``MOE_M_MAX``) of one MoE shape and weight format."""
    keys, lo = [], 1
    while lo <= min(m_max, MOE_M_MAX):
        lo, hi = octave(lo)
        keys.append(moe_key(experts, top_k, activation, dtype, intermediate, hidden, lo, hi, weight_format))
        lo = hi + 1
    return keys


def tune_into(table, path, experts: int, top_k: int, intermediate: int, hidden: int, activation: str = "silu",
              dtype: torch.dtype = torch.bfloat16, m_max: int = MOE_M_MAX, force: bool = False,
              log: Callable[[str], None] = print, weight_format: str = "") -> int:
    """Tune the ranges of one MoE shape that ``table`` does not hold (all with ``force``) into
    it, saving it to ``path`` after each range (an interrupted run keeps what it tuned); a range
    that runs out of GPU memory keeps no entry (the default configs serve it). Returns the
    ranges tuned."""
    keys = [k for k in moe_keys(experts, top_k, intermediate, hidden, activation, dtype, m_max, weight_format)
            if force or table.lookup(k) is None]
    if keys:
        table.save(path)  # an unwritable path fails now, not after the first range
    done = 0
    for key, entry in tune_moe(experts, top_k, intermediate, hidden, activation, dtype, keys, log,
                               weight_format=weight_format):
        if entry is not None:
            table.set(key, entry)
            table.save(path)
            done += 1
    return done


def tune_moe(experts: int, top_k: int, intermediate: int, hidden: int, activation: str = "silu",
             dtype: torch.dtype = torch.bfloat16, keys: list[TableKey] | None = None,
             log: Callable[[str], None] = lambda s: None, weight_format: str = ""):
    """``(key, entry)`` for each of ``keys`` (default: :func:`moe_keys`) of one MoE shape and
    weight format, as each range is tuned (module docstring); ``entry`` None where the GPU ran
    out of memory."""
    if keys is None:
        keys = moe_keys(experts, top_k, intermediate, hidden, activation, dtype, weight_format=weight_format)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w_gu = (torch.randn(experts, 2 * intermediate, hidden, device=dev, generator=g) * 0.02).to(dtype)
    w_d = (torch.randn(experts, hidden, intermediate, device=dev, generator=g) * 0.02).to(dtype)
    if weight_format:
        granularity = GRANULARITY_OF_FORMAT[weight_format]
        w_gu, w_d = quantize_fp8(w_gu, granularity), quantize_fp8(w_d, granularity)
    per_expert_bytes = 3 * intermediate * hidden * (1 if weight_format else w_gu.element_size())
    copies = max(2, min(rotation_copies(min(experts, top_k) * per_expert_bytes, dev),
                        MOST_WEIGHT_COPY_BYTES // (experts * per_expert_bytes)))
    weights = [(w_gu, w_d)] + [(clone_operand(w_gu), clone_operand(w_d)) for _ in range(copies - 1)]
    for key in keys:
        try:
            entry = _tune_range(key, experts, top_k, hidden, activation, dtype, weights, copies, g, log,
                                weight_format)
        except torch.OutOfMemoryError as exc:
            log(f"{key.to_string()}: out of GPU memory ({str(exc).splitlines()[0] if str(exc) else ''}); no entry")
            entry = None
        yield key, entry


def _tune_range(key, experts, top_k, hidden, activation, dtype, weights, copies, g, log, weight_format="") -> dict:
    tm = triton_module("triton_moe")
    dev = weights[0][0].device
    hi = key.m_hi
    inputs = {}
    for m in sample_points(key.m_lo, hi):
        x = torch.randn(m, hidden, device=dev, generator=g).to(dtype)
        inputs[m] = (x, *_routing(m, experts, top_k, dev))

    def baseline(m):
        x, ids, rw = inputs[m]
        return lambda i: grouped_mm_moe(x, ids, rw, *(dense_weight(w, dtype) for w in weights[i]), activation)

    def ours(m, up, down):
        x, ids, rw = inputs[m]
        return lambda i: tm.forward(x, ids, rw, *weights[i], activation, up, down)

    return baseline_tuner.tune_range(key, BACKEND, candidates(hi * top_k, experts, weight_format), baseline,
                                     lambda m, cand: ours(m, *cand), copies, lambda cand: record_of(*cand), log,
                                     "the grouped baseline")


__all__ = ["BACKEND", "MOE_M_MAX", "candidates", "configs_of", "moe_key", "moe_keys", "moe_op", "parse_moe_op",
           "record_of", "tune_into", "tune_moe"]
