"""What quantizing a prefill's activations to e4m3 costs (GPU machine): kernels/fp8_quant.py per
token on Llama-3-8B's shapes at 2048 rows, bf16 — x (4096 columns, the input of Q/K/V, O and
gate/up), the MLP's product (14336 columns, down's input), and that product formed from the
gate/up output inside the kernel (``glu="silu"``, what W8A8 prefill runs for down) beside torch's
eager ``silu(gate) * up`` that it replaces. CUDA events around each call with the L2 flushed
before it, median of ``--reps``; the formed product's bytes and scales are checked equal to those
of the product written first.

    python3 scripts/fp8_quant_probe.py [--rows 2048] [--reps 20] [--one-pass-max 8192 16384] [--wide-warps 8 16]
                                       [--stash 0 1] [--encode hw code]
    python3 scripts/fp8_quant_probe.py --dry-run     (each call once on small shapes, no timing;
                                                     runs under TRITON_INTERPRET=1 on a CPU)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hybridgemm.kernels import fp8_quant as fq

HIDDEN, INTERMEDIATE = 4096, 14336  # Llama-3-8B


def median_us(fn, reps: int, flush: torch.Tensor) -> float:
    times = []
    for _ in range(reps):
        flush.zero_()  # the operands come from HBM, as after the GEMM that wrote them
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--one-pass-max", type=int, nargs="+", default=[fq.ONE_PASS_MAX],
                    help="widest row kept in registers (fp8_quant.ONE_PASS_MAX), one run each")
    ap.add_argument("--wide-warps", type=int, nargs="+", default=[fq.WIDE_ROW_WARPS],
                    help="warps of a one-pass program over a row wider than fp8_quant.EIGHT_WARPS_MAX "
                         "(WIDE_ROW_WARPS), one run each")
    ap.add_argument("--stash", type=int, nargs="+", choices=(0, 1), default=[int(fq.GLU_STASH)],
                    help="two-pass GLU rows stash the product between the passes (fp8_quant.GLU_STASH), one run each")
    ap.add_argument("--encode", nargs="+", choices=("hw", "code"), default=["hw" if fq.HARDWARE_CVT else "code"],
                    help="e4m3 bytes by the hardware's cvt or encoded in code (fp8_quant.HARDWARE_CVT), one run each")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float16 if dry else torch.bfloat16  # (the interpreter rounds fp32 to bf16 by truncation)
    rows, hidden, inter = (5, 64, 160) if dry else (args.rows, HIDDEN, INTERMEDIATE)
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * inter, device=device) * 2).to(dtype)
    x = torch.randn(rows, hidden, device=device).to(dtype)
    product = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
    calls = {"x": lambda: fq.quantize_for_gemm(x, "token"),
             "product": lambda: fq.quantize_for_gemm(product, "token"),
             "product formed (glu)": lambda: fq.quantize_for_gemm(gate_up, "token", glu="silu"),
             "torch silu(gate) * up": lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:]}
    flush = None if dry else torch.empty(256 << 20, dtype=torch.uint8, device=device)
    defaults = fq.ONE_PASS_MAX, fq.HARDWARE_CVT, fq.WIDE_ROW_WARPS, fq.GLU_STASH
    first = None
    runs = [(width, encode, warps, stash) for width in args.one_pass_max for encode in args.encode
            for warps in (args.wide_warps if width > fq.EIGHT_WARPS_MAX else args.wide_warps[:1])
            for stash in (args.stash if width < INTERMEDIATE else args.stash[:1])]
    try:
        for one_pass_max, encode, warps, stash in runs:
            fq.ONE_PASS_MAX, fq.HARDWARE_CVT, fq.WIDE_ROW_WARPS = one_pass_max, encode == "hw", warps
            fq.GLU_STASH = bool(stash)
            fq._LAUNCHERS.clear()
            wide = f" wide rows on {warps} warps" if one_pass_max > fq.EIGHT_WARPS_MAX else ""
            label = f"ONE_PASS_MAX={one_pass_max} encode={encode}{wide}" + (" stash" if stash else "")
            formed, written = calls["product formed (glu)"](), calls["product"]()
            same = torch.equal(formed[0].view(torch.uint8), written[0].view(torch.uint8)) \
                and torch.equal(formed[1], written[1])
            xq = calls["x"]()
            first = first or (xq, formed)  # every run's bytes and scales must equal the first run's
            same = same and all(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
                                and torch.equal(a[1], b[1]) for a, b in zip(first, (xq, formed)))
            if dry:
                for fn in calls.values():
                    fn()
                print(f"{label}: every call ran; formed == written == the first run's: {same}")
                continue
            times = {name: median_us(fn, args.reps, flush) for name, fn in calls.items()}
            print(f"{label}, {rows} rows: "
                  + ", ".join(f"{name} {us:.1f} µs" for name, us in times.items())
                  + f"; formed == written == the first run's: {same}", flush=True)
    finally:
        fq.ONE_PASS_MAX, fq.HARDWARE_CVT, fq.WIDE_ROW_WARPS, fq.GLU_STASH = defaults
        fq._LAUNCHERS.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
