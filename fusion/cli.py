"""The `hybridgemm` command (also `python -m hybridgemm`)."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args) -> int:
    from hybridgemm.demo import run_demo

    return run_demo(m=args.m, n=args.n, k=args.k)


def _cmd_main(args) -> int:
    """The README's main job. GPU: demo of every backend beside F.linear. CPU: the CPU path."""
    from hybridgemm.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridgemm", description="Bias-fused GEMMs for PyTorch: tools.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("main", help="the main job (README): on a GPU tune + benchmark; on a CPU the CPU path")
    p.set_defaults(fn=_cmd_main)
    p = sub.add_parser("demo", help="one bias-fused GEMM per backend, checked and timed beside F.linear")
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--n", type=int, default=6144)
    p.add_argument("--k", type=int, default=4096)
    p.set_defaults(fn=_cmd_demo)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
