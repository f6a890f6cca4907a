"""The weight prefetch before the PDL wait (kernels/triton_prefetch.py): when a plan takes it,
and, compiled offline for sm_90 (no GPU needed), that the split-K and gated kernels issue it
before ``griddepcontrol.wait`` and only when asked. GPU tests: tests/kernels/test_triton_gpu.py."""

from __future__ import annotations

import pytest

from hybridgemm.kernels import triton_prefetch as tp


@pytest.mark.parametrize("env,pdl,want", [("1", True, 2048), ("0", True, 0), ("", True, 0), (None, True, 0),
                                          ("true", True, 0), ("1", False, 0)])
def test_it_runs_only_with_pdl_and_when_asked(env, pdl, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("HYBRIDGEMM_PDL_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("HYBRIDGEMM_PDL_PREFETCH", env)
    assert tp.prefetch_elements(pdl, 256, 4096, 512, 2, 2048) == want


@pytest.mark.parametrize("w_align,ldw,k_step,itemsize,ok", [
    (16, 4096, 512, 2, True),
    (8, 4096, 512, 2, False),     # the weight's base off 16 bytes
    (256, 300, 128, 2, False),    # rows of 600 bytes: every other row starts off 16 bytes
    (256, 304, 128, 2, True),
    (256, 4104, 0, 1, False),     # e4m3 rows of 4104 bytes
    (256, 4112, 0, 1, True),
    (256, 4096, 100, 2, False),   # a split starting 200 bytes into the row
])
def test_it_runs_only_where_every_row_start_is_16_byte_aligned(w_align, ldw, k_step, itemsize, ok, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_PDL_PREFETCH", "1")
    assert tp.prefetch_elements(True, w_align, ldw, k_step, itemsize, 1024) == (1024 if ok else 0)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridgemm.kernels import triton_glu as tg
from hybridgemm.kernels import triton_splitk as ts


def ptx(fn, ptr, consts, floats=()):
    sig = {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    # the pointers, K and the row strides multiples of 16, as Triton specialises a launch of such
    # operands (the W loads then pipelined by cp.async)
    aligned = set(ptr) | {"K", "ldx", "ldw", "ldo", "k_per_split"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned and n not in consts}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    assert "cp.async.cg.shared.global" in c.asm["ptx"], fn  # the pipelined form
    return c.asm["ptx"]


def order(text):
    lines = [ln.strip() for ln in text.splitlines()]
    pre = [i for i, ln in enumerate(lines) if not ln.startswith((".", "//")) and "cp.async.bulk.prefetch.L2" in ln]
    wait = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    return pre, wait


split = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
         "cnt_ptr": "*i32", "nw_ptr": "*bf16", "res_ptr": "*bf16", "res2_ptr": "*bf16",
         "cos_ptr": "*bf16", "sin_ptr": "*bf16",
         "kc_ptr": "*bf16", "vc_ptr": "*bf16", "base_ptr": "*i64", "qn_ptr": "*bf16", "kn_ptr": "*bf16",
         "sc_ptr": "*fp32"}
consts = dict(BM=16, BN=64, BK=256, MODE=2, HAS_BIAS=False, ACT=0, PREC="tf32", EVEN_K=True, NORM=False,
              RESIDUAL=True, ROPE=False, KV=False, HD=2, PDL=True, QK_NORM=False, RES_SCALED=False, WSCALE=0,
              WINT=False, QK_FACTOR=False, QK_OFFSET=0.0, NW_OFFSET=0.0, GLU=0, PREFETCH=1024, ROUTE=0, ROUTE_KP=1,
              RENORMALIZE=False, FIXUP=ts.fixup_group(16, 64, 4, 2), ROT=2, QG=0, PAIRS=False, RES2=False, TWO=False,
              HAS_BIAS2=False)
floats = ("inv_k", "eps", "res_scale", "qk_eps")
for w, extra in (("*bf16", {}), ("*fp8e4nv", dict(BM=1, WSCALE=1, WINT=True, MODE=0, RESIDUAL=False,
                                                    GLU=tg.ACTIVATIONS["silu"]))):
    pre, wait = order(ptx(ts._splitk_kernel, dict(split, w_ptr=w), dict(consts, **extra), floats))
    assert len(wait) == 1 and pre and max(pre) < wait[0], (w, pre, wait)
    pre, wait = order(ptx(ts._splitk_kernel, dict(split, w_ptr=w), dict(consts, **extra, PREFETCH=0), floats))
    assert not pre and len(wait) == 1, (w, pre)
glu = dict(BM=16, BN=64, BK=128, GROUP_M=8, HAS_BIAS=True, ACT=tg.ACTIVATIONS["silu"], PREC="tf32", EVEN_K=True,
           SWAP=True, NORM=True, NORM_PREC="tf32", PDL=True, NW_OFFSET=0.0, PREFETCH=512)
ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "nw_ptr": "*bf16"}
pre, wait = order(ptx(tg._glu_kernel, ptrs, glu, ("inv_k", "eps")))
assert len(wait) == 1 and len(pre) >= 2 and max(pre) < wait[0], (pre, wait)  # the gate rows and the up rows
pre, wait = order(ptx(tg._glu_kernel, ptrs, dict(glu, PREFETCH=0), ("inv_k", "eps")))
assert not pre and len(wait) == 1
print("compiled")
"""


def test_the_kernels_prefetch_before_the_wait_only_when_asked():
    from helpers import compile_offline

    compile_offline(_COMPILE)
