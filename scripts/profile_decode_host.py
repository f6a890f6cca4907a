"""Host time per eager call along the decode path (Qwen2.5-7B shapes, M=1, bf16), layer by layer.

    HYBRIDGEMM_TABLE=autotune_cache/tables/h200.json python scripts/profile_decode_host.py
"""

import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm import dispatch
from hybridgemm.kernels.backends import get_backend
from hybridgemm.kernels.checks import call_signature
from hybridgemm.perf.timing import eager_time_interleaved

hidden, h, hkv, d = 3584, 28, 4, 128
dt = torch.bfloat16
x = torch.randn(1, 1, hidden, device="cuda", dtype=dt)
w = torch.randn((h + 2 * hkv) * d, hidden, device="cuda", dtype=dt) / 60
b = torch.randn((h + 2 * hkv) * d, device="cuda", dtype=dt)
x2 = x.view(1, hidden)
out = torch.empty(1, w.shape[0], device="cuda", dtype=dt)
mod = hybridgemm.AttentionProjection(hidden, h, hkv, qkv_bias=True, out_bias=False, device="cuda", dtype=dt)
attn = torch.randn(1, 1, h, d, device="cuda", dtype=dt).transpose(1, 2)
print(dispatch.explain((1, hidden), tuple(w.shape)))
hybridgemm.linear(x, w, b)
prob_choice = next(iter(dispatch._choices.values()))
be = get_backend(prob_choice.backend)
fns = {
    "F.linear": lambda: F.linear(x, w, b),
    f"{prob_choice.backend}.run direct": lambda: be.run(prob_choice.config, x2, w, b, out, hybridgemm.Activation.NONE),
    "call_signature": lambda: call_signature(x, w, b, None),
    "dispatch.fused_linear": lambda: dispatch.fused_linear(x, w, b),
    "hybridgemm.linear": lambda: hybridgemm.linear(x, w, b),
    "AttentionProjection.forward_qkv": lambda: mod.forward_qkv(x),
    "AttentionProjection.forward_out": lambda: mod.forward_out(attn),
}
with torch.no_grad():
    for name, t in eager_time_interleaved(fns, calls=300).items():
        print(f"{name:36s} {t.median_us:8.2f} µs/call")
    print("fast-path entries:", len(dispatch._fast), "choices:", len(dispatch._choices))
