"""Where does eager fwd+bwd time of hybridgemm.linear go? (torch.profiler, one shape)

    python scripts/profile_train_step.py [M] [N] [K]
"""

import sys
import time

import torch
import torch.nn.functional as F

import hybridgemm

m, n, k = (int(v) for v in (sys.argv[1:] + ["16", "4096", "4096"][len(sys.argv) - 1:])[:3])
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)


def step(fn):
    y = fn(x, w, b)
    y.backward(g)


for name, fn in (("F.linear", F.linear), ("hybridgemm.linear", hybridgemm.linear)):
    for _ in range(20):
        step(fn)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        step(fn)
    torch.cuda.synchronize()
    print(f"{name:20s} eager fwd+bwd {(time.perf_counter() - t0) / 50 * 1e6:8.1f} µs/step")

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        step(hybridgemm.linear)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))
