"""The FP8 split-K kernel's configs on a GPU, against the read ceiling of the weight's bytes.

For each (N, K) and M: the split-K candidates, the default config and a grid of configs with
x tiles of M's power of two, each run with the e4m3 conversion by integer ops
(kernels/triton_e4m3.py) and checked against the fp32 product of the dequantized weight, then
timed with the tuner's method beside bf16 F.linear and the read-only kernel over the same
bytes (perf/read_ceiling.py). The fastest configs are timed again with Triton's cast. For the
fastest config of each conversion, the PTX and SASS instruction counts that tell where the
time goes (conversions, byte permutes, MMAs, FMAs, shared-memory traffic).

    python3 scripts/fp8_kernel_probe.py [--shape N,K ...] [--m M ...] [--granularity channel|block128]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re

import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache.keys import TableKey
from hybridgemm.autotune_cache.measure import dense_weight, gpu_time_rotating, operands_for, rotation_copies, run_config
from hybridgemm.autotune_cache.precompile import precompile
from hybridgemm.kernels import triton_e4m3 as te
from hybridgemm.kernels import triton_splitk as ts
from hybridgemm.kernels import triton_splitk_configs as ts_configs
from hybridgemm.kernels.backends import get_backend
from hybridgemm.kernels.fp8 import FORMAT_OF
from hybridgemm.perf.read_ceiling import fp8_bytes, fp8_in_one_buffer, read_calls
from hybridgemm.perf.sweep_configs import correct_configs, problem

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B: qkv, o, gate/up, down
CAST_TOP = 2  # the fastest integer-conversion configs timed again with Triton's cast
PTX_OPS = ("cvt.rn.f16x2.e4m3x2", "cvt.bf16.f16", "cvt.f32.bf16", "prmt", "lop3", "fma.rn.bf16x2", "mma.sync",
           "wgmma", "fma.rn.f32", "ld.shared", "st.shared", "cp.async", "ldmatrix", "ld.global")
SASS_OPS = ("F2FP", "F2F", "HADD2", "HFMA2", "HMUL2", "PRMT", "LOP3", "SHF", "IMAD", "FFMA", "FMUL", "HMMA", "HGMMA",
            "LDS", "STS", "LDSM", "LDG", "LDGSTS", "SHFL", "BAR")


def small_m_grid(p) -> list:
    """Configs with x tiles of M's power of two (from 1) and warps along W's rows only."""
    out = []
    bm = 1 << max(0, p.m - 1).bit_length()
    pairs = ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8))
    for (bn, warps), bk, stages, waves in itertools.product(pairs, (256, 512), (3, 4), (1, 2)):
        split = ts_configs._split_for(waves, -(-p.n // bn), -(-p.k // bk), ts_configs.HOPPER_NUM_SMS)
        out.append(ts.TritonSplitKConfig(bm, bn, bk, split, warps, stages, split > 1))
    return [c for c in out if c.supports(p)[0]]


def read_us(n: int, k: int, granularity: str) -> float:
    device = torch.device("cuda")
    copies = rotation_copies(fp8_bytes(n, k, granularity), device)
    bufs = [fp8_in_one_buffer(torch.randn(n, k, device=device).bfloat16(), granularity)[1] for _ in range(copies)]
    return min(t.median_us for t in gpu_time_rotating(read_calls(bufs, device), copies, device))


def compiled_kernels() -> set:
    found = set()
    for cache in ts._splitk_kernel.device_caches.values():
        found.update(cache[0].values())
    return found


def timed(be, p, cfgs, ops, kernels: dict) -> list[tuple[float, float, object]]:
    """(µs, F.linear µs, config) for each config that runs correctly, fastest first; the
    kernel each config compiled to goes into ``kernels``."""
    x, w, b, out, xs, ws = ops
    for c in cfgs:  # first runs in this process: each compiles (or loads) its kernel
        before = compiled_kernels()
        try:
            run_config(be, c, p, x, w, b, out)
        except Exception as e:  # reported again by correct_configs
            print(f"  {be.describe(c)}: {type(e).__name__}: {str(e)[:120]}")
            continue
        new = compiled_kernels() - before
        kernels[c] = next(iter(new)) if new else None
    ok = correct_configs(be, [c for c in cfgs if c in kernels], p, x, w, b, out)
    res = []
    for i in range(0, len(ok), 8):
        chunk = ok[i:i + 8]
        fns = [lambda j: F.linear(xs[j], dense_weight(ws[j], p.dtype), b)]
        fns += [lambda j, c=c: run_config(be, c, p, xs[j], ws[j], b, out) for c in chunk]
        times = gpu_time_rotating(fns, len(ws), replays=7)
        res += [(t.median_us, times[0].median_us, c) for c, t in zip(chunk, times[1:])]
    return sorted(res, key=lambda r: r[0])


def instruction_counts(kernel, dump: str | None = None) -> str:
    """PTX / SASS instruction counts of a compiled kernel, and the layout conversions and
    shared-memory ops of its TTGIR (written to ``dump`` with the SASS)."""
    if kernel is None:
        return "  (compiled earlier in this process: counts shown there)"
    ptx = kernel.asm.get("ptx", "")
    ttgir = kernel.asm.get("ttgir", "")
    line = "  ptx: " + " ".join(f"{op}={ptx.count(op)}" for op in PTX_OPS)
    line += "\n  ttgir: " + " ".join(f"{op}={ttgir.count(op)}" for op in (
        "ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.local_store", "ttg.async_copy", "tt.reshape",
        "scf.for", "warp_group_dot", "tt.dot"))
    sass = ""
    try:
        sass = kernel.asm["sass"]
        ops = []
        for raw in sass.splitlines():  # "control codes<TAB>[@P0 ]OPCODE operands;"
            text = re.sub(r"^@!?U?P\w+\s+", "", raw.split("\t", 1)[-1].strip())
            word = text.split(" ", 1)[0].rstrip(";") if text else ""
            if "\t" in raw and re.fullmatch(r"[A-Z][A-Z0-9_.]*", word):
                ops.append(word.split(".")[0])
        counts = collections.Counter(ops)
        line += "\n  sass: " + " ".join(f"{op}={counts.get(op, 0)}" for op in SASS_OPS) + f" total={len(ops)}"
    except Exception as e:  # cuobjdump missing: PTX only
        line += f"\n  sass: unavailable ({type(e).__name__}: {str(e)[:80]})"
    if dump:
        with open(dump, "w") as f:
            f.write(ttgir + "\n\n// ---- SASS\n" + sass)
    return line


def probe(n: int, k: int, m: int, granularity: str, jobs: int) -> None:
    be = get_backend("triton_splitk")
    p = problem(m, n, k, FORMAT_OF[granularity])
    cfgs = list(dict.fromkeys(ts.candidates(p) + [ts.default_config(p)] + small_m_grid(p)))
    key = TableKey.from_problem(p).to_string()
    te.INTEGER_CONVERSION = True
    precompile([], [], jobs, tasks=[(key, "triton_splitk", c.to_record(), m) for c in cfgs])
    ops = operands_for(p)
    ceiling = read_us(n, k, granularity)
    nbytes = fp8_bytes(n, k, granularity)
    print(f"N={n} K={k} M={m} {granularity}: read ceiling {ceiling:.2f} us ({nbytes / ceiling / 1e3:.0f} GB/s), "
          f"{len(cfgs)} configs", flush=True)
    ts._PLANS.clear()
    int_kernels, cast_kernels = {}, {}
    integer = timed(be, p, cfgs, ops, int_kernels)
    te.INTEGER_CONVERSION = False
    ts._PLANS.clear()
    cast = timed(be, p, list(dict.fromkeys([c for _, _, c in integer[:CAST_TOP]] + [ts.default_config(p)])), ops,
                 cast_kernels)
    te.INTEGER_CONVERSION = True
    ts._PLANS.clear()
    for label, res in (("integer", integer), ("cast", cast)):
        for us, fl, c in res[:8 if label == "integer" else 5]:
            print(f"  {label:7s} {us:8.2f} us {ceiling / us:6.1%} of read  F.linear {fl:7.2f}  {be.describe(c)}")
    out_dir = os.environ.get("OUT", ".")
    for label, res, kernels in (("integer", integer, int_kernels), ("cast", cast, cast_kernels)):
        if res:
            us, _, c = res[0]
            print(f"  {label} fastest ({us:.2f} us): {be.describe(c)}")
            dump = f"{out_dir}/ir_{n}x{k}_m{m}_{label}.txt" if label == "integer" else None
            print(instruction_counts(kernels.get(c), dump), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=[f"{n},{k}" for n, k in SHAPES])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--granularity", default="channel", choices=("channel", "block128"))
    ap.add_argument("--jobs", type=int, default=12)
    args = ap.parse_args()
    for text in args.shape:
        n, k = (int(v) for v in text.split(","))
        for m in args.m:
            probe(n, k, m, args.granularity, args.jobs)


if __name__ == "__main__":
    main()
