"""Each eager W8A8 prefill forward's time, one by one (GPU machine): Llama-3-8B-shaped, ``--layers``
layers, ``patch(model, weights="fp8", activations="fp8")``, a 2048-token prompt, two warm-up
forwards then ``--forwards`` timed ones: CUDA events; the host's wall clock from the call to the end
of the GPU work; the host's time until the forward returns (close to the wall time: the GPU waited
for the host); and what ran during the timed forwards that a warm process should not run (Triton
compiles, cuBLASLt FP8 plans built, cudaMalloc/cudaFree by the caching allocator); with ``--profile
N``, one more forward under cProfile (the host's time by function: own, then cumulative). ``--variant``: ``tree`` (as
installed), ``stock-rotary`` (every prefill through the layers' stock forwards:
decode_checks.takes_prefill_step off), ``code-cvt`` (the activation quantization's e4m3 encoded in
code: fp8_quant.HARDWARE_CVT off), ``unpatched`` (the bf16 model as transformers runs it).
``--beside-stock``: a stock bf16 copy of the model too, whose prefill forward runs before each
forward of the variant (as ``hybridgemm bench --e2e`` alternates them), untimed; the bound
W8A8 launches kept (kernels/cublaslt_fp8.BOUND_RUNS) are counted after the timed forwards. Run each
variant in a process of its own, with TRITON_CACHE_DIR set to an empty folder to compile its kernels
there.

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/prefill_variance_probe.py --variant tree
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import time

import torch
import triton

import hybridgemm
from hybridgemm.kernels import cublaslt_fp8, fp8_quant
from hybridgemm.models import decode_checks
from hybridgemm.perf import e2e_models as hf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("tree", "stock-rotary", "code-cvt", "unpatched"), default="tree")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--forwards", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then one forward under cProfile: its N functions of most own host time, then of most "
                    "cumulative time")
    ap.add_argument("--profile-out", metavar="PATH", help="with --profile: also write that forward's pstats there")
    ap.add_argument("--beside-stock", action="store_true",
                    help="a stock bf16 copy's forward before each forward (untimed), as the e2e bench alternates them")
    args = ap.parse_args(argv)
    if args.variant == "stock-rotary":
        decode_checks.takes_prefill_step = lambda *a: False
    if args.variant == "code-cvt":
        fp8_quant.HARDWARE_CVT = False
    torch.manual_seed(0)
    model = hf.build_model(hf.hf_config("llama3-8b", args.layers), torch.bfloat16, "cuda")
    stock = copy.deepcopy(model) if args.beside_stock else None
    if args.variant != "unpatched":
        hybridgemm.patch(model, weights="fp8", activations="fp8")
    compiles, plans, build = [], [], cublaslt_fp8._build

    def count_compile(*args, **kwargs):
        compiles.append(getattr(kwargs.get("fn"), "name", "?"))
        return False  # compile as usual

    def count_plan(*args, **kwargs):
        plans.append(args[4:7])  # rows, n, k
        return build(*args, **kwargs)

    api = hf.forward_api(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device="cuda")
    times = []
    with torch.no_grad():
        for i in range(2 + args.forwards):
            if i == 2:
                triton.knobs.runtime.jit_cache_hook = count_compile
                cublaslt_fp8._build = count_plan
                allocator_before = _allocator_counts()
            if stock is not None:
                hf.prefill_forward(stock, api, ids)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            hf.prefill_forward(model, api, ids)
            end.record()
            host = (time.perf_counter() - t0) * 1e3
            end.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            if i >= 2:
                times.append((start.elapsed_time(end), wall, host))
    gpu = sorted(t[0] for t in times)
    print(f"{args.variant}, {args.layers} layers, {args.tokens} tokens: median {gpu[len(gpu) // 2]:.3f} ms, "
          f"min {gpu[0]:.3f}, max {gpu[-1]:.3f}; each (events ms / wall ms / host ms): "
          + " ".join(f"{g:.2f}/{w:.2f}/{h:.2f}" for g, w, h in times), flush=True)
    allocator = {k: v - allocator_before[k] for k, v in _allocator_counts().items()}
    print(f"  during the timed forwards: {len(compiles)} Triton compiles {sorted(set(compiles))}, "
          f"{len(plans)} cuBLASLt FP8 plans built {sorted(set(plans))}, caching allocator {allocator}; "
          f"{torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved at most; {len(cublaslt_fp8.BOUND_RUNS)} "
          "bound W8A8 launches kept", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        with torch.no_grad():
            torch.cuda.synchronize()
            profiler.enable()
            hf.prefill_forward(model, api, ids)
            profiler.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.profile)
        if args.profile_out:
            profiler.dump_stats(args.profile_out)
        print(text.getvalue(), flush=True)
    return 0


def _allocator_counts() -> dict:
    """The caching allocator's cudaMalloc/cudaFree calls and retries (a retry frees cached blocks,
    which synchronises the device)."""
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


if __name__ == "__main__":
    raise SystemExit(main())
