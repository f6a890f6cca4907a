"""`hybridgemm demo`: one bias-fused GEMM on whatever device is here, checked and timed.

On a GPU: every available backend (cuBLASLt, Triton) beside F.linear on a llama3-8b QKV
projection, each checked against an fp32 reference, then timed (CUDA-graph replay,
L2-clean-cold) and its host time per eager call measured in the same loop as F.linear.
Without a GPU: the CPU path (PyTorch), checked the same way, and a note that the kernels
need a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridgemm import linear as fused_linear
from hybridgemm.kernels import cublaslt
from hybridgemm.perf.timing import eager_time_interleaved, gpu_time

# The largest operand (x, W or y, in elements) `hybridgemm demo` makes: 2^27 fp32 elements are
# 512 MiB, 1 GiB as the fp64 reference's copy on a CPU.
DEMO_MAX_ELEMENTS = 2**27


def _rel_err(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_demo(m: int = 16, n: int = 6144, k: int = 4096, print_fn=print) -> int:
    """Exit code 0 when every result matched its reference, 1 otherwise. ``m``, ``n``, ``k``:
    positive, each operand at most :data:`DEMO_MAX_ELEMENTS` (the CLI checks both)."""
    if not torch.cuda.is_available():
        print_fn("no CUDA GPU here: the GPU kernels cannot run; showing the CPU path (PyTorch).")
        x = torch.randn(m, k)
        w = torch.randn(n, k) / k**0.5
        b = torch.randn(n)
        ref = F.linear(x.double(), w.double(), b.double())
        y = fused_linear(x, w, b)
        err = _rel_err(y, ref.float())
        ok = err < 1e-5
        print_fn(f"hybridgemm.linear on CPU, fp32, M={m} N={n} K={k}: rel err vs fp64 {err:.2e} "
                 f"({'ok' if ok else 'FAIL'})")
        return 0 if ok else 1

    dtype = torch.bfloat16
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    providers = {"F.linear": lambda: F.linear(x, w, b), "hybridgemm.linear": lambda: fused_linear(x, w, b)}
    if cublaslt.is_available():
        providers["cublaslt backend"] = lambda: cublaslt.linear(x, w, b)
    else:
        print_fn("cuBLASLt backend unavailable (install nvmath-python: pip install 'hybridgemm[cu13]')")
    status = 0
    print_fn(f"bf16 GEMM + bias, M={m} N={n} K={k} on {torch.cuda.get_device_name()}")
    print_fn(f"{'provider':22s}{'rel err':>10s}{'GPU µs':>10s}{'vs F.linear':>12s}")
    base = None
    for name, fn in providers.items():
        err = _rel_err(fn(), ref)
        if not err < 1e-2:
            status = 1
        t = gpu_time(fn).median_us
        base = base or t
        print_fn(f"{name:22s}{err:10.2e}{t:10.2f}{base / t:11.3f}x")
    host = eager_time_interleaved(providers)
    print_fn("host time per eager call (same loop): " +
             ", ".join(f"{k} {v.median_us:.1f} µs" for k, v in host.items()))
    return status
