"""The FP8 cuBLASLt path (kernels/cublaslt_fp8.py) end to end on the CPU, against an emulation of
cuBLASLt as its documentation describes it: nvmath's real enums and attribute types, and a
matmul that reads host memory by the documented layouts (column-major, "TN", the outer-vector,
VEC128 and BLK128x128 scale layouts of cuBLAS docs §3.1.4.3 and §3.1.4.5.1) and refuses what the
documentation rules out (16-byte alignment, scale mode pairs, M and N multiples of 4 for the
block modes, the bias type). What the GPU test cannot show without a GPU: that every pointer,
leading dimension, scale layout and descriptor attribute reaches cuBLASLt as documented."""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import silu_product
from hybridgemm.kernels import cublaslt_algos, cublaslt_plan
from hybridgemm.kernels import cublaslt_fp8 as cf
from hybridgemm.kernels import fp8_quant as fq
from hybridgemm.kernels.cublaslt_runtime import CublasLtUnsupported
from hybridgemm.kernels.epilogue import Activation, apply_activation
from hybridgemm.kernels.fp8 import granularity_of, quantize_fp8

real = pytest.importorskip("nvmath.bindings.cublasLt")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

E4M3, BF16, FP16, COMPUTE_32F = 28, 14, 2, 68
TORCH_OF = {BF16: torch.bfloat16, FP16: torch.float16}
D = real.MatmulDescAttribute
S = real.MatmulMatrixScale
BLOCK_MODES = {int(S.VEC128_32F), int(S.BLK128x128_32F)}
PAIRS = {(int(S.OUTER_VEC_32F), int(S.OUTER_VEC_32F)), (int(S.VEC128_32F), int(S.VEC128_32F)),
         (int(S.VEC128_32F), int(S.BLK128x128_32F)), (int(S.BLK128x128_32F), int(S.VEC128_32F))}


class FakeError(Exception):
    pass


def _read(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(bytearray(ctypes.string_at(ptr, count * size)), dtype=dtype)


class FakeLt:
    """cuBLASLt's calls as the FP8 path makes them, from host memory."""

    MatmulDescAttribute, MatmulMatrixScale, Epilogue = real.MatmulDescAttribute, real.MatmulMatrixScale, real.Epilogue
    MatmulPreferenceAttribute, ReductionScheme = real.MatmulPreferenceAttribute, real.ReductionScheme
    MatmulAlgoConfigAttribute, matmul_heuristic_result_dtype = real.MatmulAlgoConfigAttribute, \
        real.matmul_heuristic_result_dtype
    get_matmul_algo_config_attribute_dtype = staticmethod(real.get_matmul_algo_config_attribute_dtype)
    cuBLASLtError = FakeError

    def __init__(self):
        self.objs: dict[int, dict] = {}
        self.refuse_at_heuristic: set[str] = set()  # epilogue names the heuristic finds no algorithm for
        self.refuse_at_matmul: set[str] = set()
        self.matmuls = 0

    def _new(self, **state) -> int:
        handle = self.next_handle = getattr(self, "next_handle", 1000) + 1
        self.objs[handle] = state
        return handle

    def matmul_desc_create(self, compute, scale_type):
        return self._new(compute=compute, scale_type=scale_type, attrs={})

    def matmul_desc_set_attribute(self, desc, attr, ptr, size):
        dtype = np.dtype(real.get_matmul_desc_attribute_dtype(attr))
        assert size == dtype.itemsize, f"{D(int(attr)).name}: {size} bytes, the attribute is {dtype}"
        self.objs[desc]["attrs"][D(int(attr))] = int(np.frombuffer(ctypes.string_at(ptr, size), dtype=dtype)[0])

    def matmul_preference_create(self):
        return self._new(attrs={})

    def matmul_preference_set_attribute(self, pref, attr, ptr, size):
        assert size == np.dtype(real.get_matmul_preference_attribute_dtype(attr)).itemsize

    def matrix_layout_create(self, dtype, rows, cols, ld):
        return self._new(dtype=int(dtype), rows=int(rows), cols=int(cols), ld=int(ld))

    def matrix_layout_destroy(self, h):
        del self.objs[h]

    matmul_desc_destroy = matmul_preference_destroy = matrix_layout_destroy

    def matmul_algo_config_get_attribute(self, buf, attr, val, size, written):
        pass  # the fields read as zeros

    def _validate(self, desc, a, b, d):
        """What the documentation requires of an FP8 matmul (FakeError otherwise)."""
        st, A, B, Dl = self.objs[desc], self.objs[a], self.objs[b], self.objs[d]
        at = st["attrs"]
        epi = real.Epilogue(at.get(D.EPILOGUE, 1)).name
        modes = (at.get(D.A_SCALE_MODE, 0), at.get(D.B_SCALE_MODE, 0))
        rules = [
            (st["compute"] == COMPUTE_32F and st["scale_type"] == 0, "compute and scale type 32F"),
            (at.get(D.TRANSA) == 1 and at.get(D.TRANSB, 0) == 0, "TN form"),
            (A["dtype"] == E4M3 and B["dtype"] == E4M3 and Dl["dtype"] in TORCH_OF, "e4m3 x e4m3 -> bf16/fp16"),
            (A["rows"] == B["rows"] and Dl["rows"] == A["cols"] and Dl["cols"] == B["cols"], "shapes"),
            (A["rows"] % 16 == 0 and A["ld"] % 16 == 0 and B["ld"] % 16 == 0, "16-byte aligned K and lda/ldb"),
            ((Dl["rows"] * 2) % 16 == 0 and (Dl["ld"] * 2) % 16 == 0, "16-byte aligned rows of D"),
            (modes in PAIRS, f"scale mode pair {modes}"),
            (not (set(modes) & BLOCK_MODES) or (Dl["rows"] % 4 == 0 and Dl["cols"] % 4 == 0), "M, N multiples of 4"),
            (not (set(modes) & BLOCK_MODES) or at.get(D.FAST_ACCUM, 0) == 0, "no fast accumulation"),
            ("BIAS" not in epi or at.get(D.BIAS_DATA_TYPE) == Dl["dtype"], "bias of D's type"),
        ]
        for ok, rule in rules:
            if not ok:
                raise FakeError(f"not supported: {rule}")
        return epi

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, count, results, found):
        if self._validate(desc, a, b, d) in self.refuse_at_heuristic:
            raise FakeError("CUBLAS_STATUS_NOT_SUPPORTED")
        ctypes.c_int32.from_address(found).value = 1

    def _scales(self, mode, ptr, outer, k):
        """The (outer, K) scale of each element of op(A) (outer = M) or of B^T (outer = N)."""
        nk = -(-k // 128)
        if mode == int(S.OUTER_VEC_32F):
            return _read(ptr, outer, torch.float32).double()[:, None].expand(outer, k)
        if mode == int(S.VEC128_32F):  # outer-major: element (i, b) at i + b * outer
            s = _read(ptr, outer * nk, torch.float32).double().view(nk, outer).t()
        else:  # BLK128x128: K-major, column stride L rounded up to 4
            l4 = nk + (-nk) % 4
            nb = -(-outer // 128)
            s = _read(ptr, (nb - 1) * l4 + nk, torch.float32).double()
            s = torch.stack([s[i * l4 : i * l4 + nk] for i in range(nb)]).repeat_interleave(128, 0)[:outer]
        return s.repeat_interleave(128, 1)[:, :k]

    def matmul(self, handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, ws, ws_size, stream):
        epi = self._validate(desc, adesc, bdesc, ddesc)
        if epi in self.refuse_at_matmul:
            raise FakeError("CUBLAS_STATUS_INVALID_VALUE")
        self.matmuls += 1
        at, A, B, Dl = self.objs[desc]["attrs"], self.objs[adesc], self.objs[bdesc], self.objs[ddesc]
        assert a % 16 == 0 and b % 16 == 0 and d % 16 == 0 and at[D.A_SCALE_POINTER] % 16 == 0
        assert at[D.B_SCALE_POINTER] % 16 == 0

        def matrix(ptr, lay):  # column-major (rows, cols) with leading dimension ld
            count = lay["ld"] * (lay["cols"] - 1) + lay["rows"]
            flat = _read(ptr, count, torch.uint8).view(torch.float8_e4m3fn).double()
            flat = torch.cat([flat, flat.new_zeros(lay["ld"] - lay["rows"])])
            return flat.view(lay["cols"], lay["ld"])[:, : lay["rows"]].t()

        k, n, m = A["rows"], A["cols"], B["cols"]
        op_a = matrix(a, A).t() * self._scales(at[D.A_SCALE_MODE], at[D.A_SCALE_POINTER], n, k)
        op_b = matrix(b, B) * self._scales(at[D.B_SCALE_MODE], at[D.B_SCALE_POINTER], m, k).t()
        out = op_a @ op_b  # (N, M)
        if "BIAS" in epi:
            out = out + _read(at[D.BIAS_POINTER], n, TORCH_OF[Dl["dtype"]]).double()[:, None]
        if epi.startswith("RELU"):
            out = torch.relu(out)
        elif epi.startswith("GELU"):
            out = F.gelu(out, approximate="tanh")
        raw = out.t().contiguous().to(TORCH_OF[Dl["dtype"]])  # column j of D is row j here
        row_bytes = n * raw.element_size()
        for j in range(m):
            ctypes.memmove(d + j * Dl["ld"] * raw.element_size(), raw[j].view(torch.int16).numpy().tobytes(), row_bytes)


@pytest.fixture
def lt(monkeypatch):
    fake = FakeLt()
    for module in (cublaslt_plan, cublaslt_algos, cf):
        monkeypatch.setattr(module, "bindings", lambda: fake)
    monkeypatch.setattr(cublaslt_plan, "handle", lambda device_index: 1)
    monkeypatch.setattr(cublaslt_plan, "current_device", lambda: -1)  # a CPU tensor's get_device()
    monkeypatch.setattr(cublaslt_plan, "current_stream", lambda device: 0)
    monkeypatch.setattr(cublaslt_plan, "cublaslt_version", lambda: 130100)
    monkeypatch.setitem(cublaslt_plan.workspace_ptrs, (-1, 0), 256)
    # the operand checks want CUDA tensors: here only the weight's own checks run
    monkeypatch.setattr(cf, "_check_operands", lambda x, w8, w_scale, bias, out, glu=None: granularity_of(w8, w_scale))
    cf.clear_caches()
    yield fake
    cf.clear_caches()


def reference(x, w, b, act, dtype):
    """act(dequantized(x8) @ dequantized(W).T + b) in fp64, rounded once to ``dtype``."""
    group = cf.ACTIVATION_GROUP[w.granularity]
    x8, s = fq.quantize_activations(x, group)
    n, k = w.shape
    xs = s.double()[:, None] if group == "token" else s.double().repeat_interleave(128, 1)[:, :k]
    ws = w.scale.double()[:, None] if w.granularity == "channel" else \
        w.scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    z = (x8.double() * xs) @ (w.data.double() * ws).T + (b.double() if b is not None else 0)
    return z, apply_activation(z, Activation.parse(act)).to(dtype)


def assert_matches(out, z, want, act, dtype, fused):
    """Fused: the emulation rounds act(z) once, as the reference does (ties of the fp64 sums in
    another order aside: one ulp). After the GEMM: z is rounded first (its ulp times |act'|)."""
    u = torch.finfo(dtype).eps
    err = (out.double() - want.double()).abs()
    bound = u * want.double().abs() + (0 if fused else 1.2 * u * z.abs()) + torch.finfo(dtype).tiny
    assert torch.isfinite(out).all() and torch.all(err <= bound), f"worst {(err / bound).max().item():.3g}x"


def operands(m, n, k, dtype, granularity, bias):
    x = (torch.randn(m, k) * 10 ** (torch.rand(m, 1) * 2 - 1)).to(dtype)
    w = quantize_fp8(torch.randn(n, k) / k**0.5 * 10 ** (torch.rand(n, 1) - 0.5), granularity)
    return x, w, (torch.randn(n).to(dtype) if bias else None)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_the_reference_through_the_documented_layouts(lt, granularity, dtype, m, bias):
    n, k = 200, 400  # L = 4 blocks of K, the last partial; two 128-row blocks of N, the last partial
    x, w, b = operands(m, n, k, dtype, granularity, bias)
    for act in (None, "relu", "gelu_tanh", "gelu"):
        out = torch.full((m, n), float("nan"), dtype=dtype)
        cf.run(x, w.data, w.scale, b, out, act)
        z, want = reference(x, w, b, act, dtype)
        assert_matches(out, z, want, act, dtype, fused=act != "gelu")


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_glu_input_is_the_gemm_of_the_product(lt, granularity):
    """``glu="silu"``: x holds a gated MLP's gate then up; the GEMM's input is the product the
    quantization forms (kernels/fp8_quant.py), so the output is the bits of the GEMM of the
    product written first (fp16: the interpreter rounds it as the GPU does)."""
    m, n, k = 17, 200, 400
    gu, _, b = operands(m, n, 2 * k, torch.float16, granularity, True)
    w = quantize_fp8(torch.randn(n, k) / k**0.5, granularity)
    product = silu_product(gu)  # as the interpreter forms it
    out, want = (torch.full((m, n), float("nan"), dtype=torch.float16) for _ in range(2))
    cf.run(gu, w.data, w.scale, b, out, "relu", glu="silu")
    cf.run(product, w.data, w.scale, b, want, "relu")
    assert torch.equal(out, want)


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_weight_scales_padded_to_four_columns_and_strided_operands(lt, granularity):
    m, n, k = 6, 136, 272  # L = 3: BLK128x128's column stride 4; the token count not a multiple of 4
    x, w, b = operands(m, n, k, torch.bfloat16, granularity, True)
    wide = torch.zeros(m, k + 40, dtype=x.dtype)
    wide[:, 16 : 16 + k] = x
    out_wide = torch.full((m, n + 8), float("nan"), dtype=x.dtype)
    cf.run(wide[:, 16 : 16 + k], w.data, w.scale, b, out_wide[:, :n], "relu")
    z, want = reference(x, w, b, "relu", x.dtype)
    assert_matches(out_wide[:, :n], z, want, "relu", x.dtype, fused=True)
    assert torch.isnan(out_wide[:, n:]).all()  # nothing written past the rows


def test_each_call_reads_its_own_weights_scales(lt, monkeypatch):
    """Two weights of one shape share a plan; the scale pointers must follow the call."""
    monkeypatch.setattr(cf, "pointer_alignment", lambda ptr: 256)  # as CUDA allocations are: one plan key
    x, w1, b = operands(8, 128, 256, torch.bfloat16, "channel", True)
    w2 = quantize_fp8(torch.randn(128, 256) * 30, "channel")
    for w in (w1, w2, w1, w2):
        out = cf.run(x, w.data, w.scale, b)
        z, want = reference(x, w, b, None, x.dtype)
        assert_matches(out, z, want, None, x.dtype, fused=True)
    assert len(cf._plans) == 1


@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
def test_fast_accumulation_where_asked_and_never_with_block_scales(lt, monkeypatch, fast):
    """``FAST_ACCUM``: the descriptor of a per-channel plan asks for the tensor cores' own
    accumulation; a block-scaled plan never does (the documentation requires promotion there)."""
    monkeypatch.setattr(cf, "FAST_ACCUM", fast)
    for granularity in ("channel", "block128"):
        cf.clear_caches()
        x, w, b = operands(8, 128, 256, torch.bfloat16, granularity, False)
        out = cf.run(x, w.data, w.scale, b)
        z, want = reference(x, w, b, None, x.dtype)
        assert_matches(out, z, want, None, x.dtype, fused=True)
        (plan,) = cf._plans.values()
        assert lt.objs[plan.desc]["attrs"][D.FAST_ACCUM] == int(fast and granularity == "channel")


def test_activation_runs_after_where_cublaslt_refuses_to_fuse_it(lt):
    x, w, b = operands(8, 128, 256, torch.bfloat16, "block128", True)
    lt.refuse_at_heuristic.add("GELU_BIAS")
    out = cf.run(x, w.data, w.scale, b, None, "gelu_tanh")
    z, want = reference(x, w, b, "gelu_tanh", x.dtype)
    assert_matches(out, z, want, "gelu_tanh", x.dtype, fused=False)
    assert next(iter(cf._plans.values())).post is Activation.GELU_TANH
    lt.refuse_at_matmul.add("RELU_BIAS")  # refused only when the matmul runs: retried unfused
    out = cf.run(x, w.data, w.scale, b, None, "relu")
    z, want = reference(x, w, b, "relu", x.dtype)
    assert_matches(out, z, want, "relu", x.dtype, fused=True)
    assert {p.post for p in cf._plans.values()} == {Activation.GELU_TANH, Activation.RELU}


def test_a_refused_matmul_is_cublaslt_unsupported(lt):
    x, w, b = operands(8, 128, 256, torch.bfloat16, "channel", True)
    lt.refuse_at_matmul.add("BIAS")
    with pytest.raises(CublasLtUnsupported, match="cuBLASLt refused FP8 channel"):
        cf.run(x, w.data, w.scale, b)
    assert not cf._plans  # nothing cached that fails


def test_a_refusal_is_kept_per_signature(lt, monkeypatch):
    """A signature cuBLASLt refused raises at once on later calls (no heuristic query, no
    matmul); another signature is asked; clear_caches forgets the refusal. (Pointers count as
    256-byte aligned, as the CUDA caching allocator's are: the CPU's vary call to call.)"""
    monkeypatch.setattr(cf, "pointer_alignment", lambda ptr: 256)
    x, w, b = operands(8, 128, 256, torch.bfloat16, "channel", True)
    asked = []
    heuristic = lt.matmul_algo_get_heuristic
    monkeypatch.setattr(lt, "matmul_algo_get_heuristic", lambda *a: asked.append(1) or heuristic(*a))
    lt.refuse_at_heuristic.add("BIAS")
    for _ in range(3):
        with pytest.raises(CublasLtUnsupported, match="cannot run FP8 channel M=8 N=128 K=256"):
            cf.run(x, w.data, w.scale, b)
    assert len(asked) == 1 and not cf._plans
    out = cf.run(x, w.data, w.scale, None)  # no bias: another signature, which cuBLASLt runs
    assert_matches(out, *reference(x, w, None, None, x.dtype), None, x.dtype, fused=True)
    lt.refuse_at_heuristic.clear()
    cf.clear_caches()
    out = cf.run(x, w.data, w.scale, b)
    assert_matches(out, *reference(x, w, b, None, x.dtype), None, x.dtype, fused=True)


def test_no_algorithm_at_all_is_cublaslt_unsupported(lt):
    x, w, b = operands(8, 128, 256, torch.bfloat16, "block128", True)
    lt.refuse_at_heuristic |= {"RELU_BIAS", "BIAS"}
    with pytest.raises(CublasLtUnsupported, match="cannot run FP8 block128 M=8 N=128 K=256: RELU_BIAS: .*; BIAS"):
        cf.run(x, w.data, w.scale, b, None, "relu")
    assert not cf._plans


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("act", [None, "gelu"], ids=["fused", "after"])
@pytest.mark.parametrize("glu", [None, "silu"], ids=["x", "glu"])
def test_a_bound_run_is_the_call_again_with_its_own_operands(lt, monkeypatch, granularity, act, glu):
    """``run_and_bind``: the call's result, and a :class:`BoundRun` that computes a later call of
    the signature from that call's own tensors (other values at other addresses) bit for bit as
    ``run`` does: x quantized anew, the weight's and the bias's pointers, the padded rows of the
    block modes (17 tokens: 20 rows) dropped, the activation cuBLASLt does not fuse run after."""
    monkeypatch.setattr(cf, "pointer_alignment", lambda ptr: 256)  # as CUDA allocations are (one plan)
    m, n, k = 17, 200, 400
    width = k if glu is None else 2 * k

    def fresh():
        x, _, b = operands(m, n, width, torch.float16, granularity, True)
        return x, quantize_fp8(torch.randn(n, k) / k**0.5 * 3, granularity), b

    x, w, b = fresh()
    first, bound = cf.run_and_bind(x, w.data, w.scale, b, activation=act, glu=glu)
    assert bound is not None and torch.equal(first, cf.run(x, w.data, w.scale, b, activation=act, glu=glu))
    for _ in range(2):
        x, w, b = fresh()
        matmuls = lt.matmuls
        got = bound(x, w.data, w.scale, b)
        assert lt.matmuls == matmuls + 1 and got.shape == (m, n)
        assert torch.equal(got, cf.run(x, w.data, w.scale, b, activation=act, glu=glu))
        if glu is None:
            assert_matches(got, *reference(x, w, b, act, x.dtype), act, x.dtype, fused=act is None)


def test_no_bound_run_where_the_call_copied_an_operand_or_ran_nothing(lt, monkeypatch):
    """A later call could not pass these as they are: x in a layout the quantization copies, a
    bias off alignment (copied), block scales whose row stride is not a multiple of 4 (copied
    into a padded buffer), an ``out`` whose rows are not N wide; and no rows at all. Each such
    call still computes its result."""
    monkeypatch.setattr(cf, "pointer_alignment", lambda ptr: 256)
    x, w, b = operands(8, 128, 272, torch.bfloat16, "channel", True)
    _, wb, _ = operands(8, 256, 272, torch.bfloat16, "block128", False)  # 2 x 3 scales: a row stride of 3
    cases = {
        "x's columns strided": dict(x=torch.stack([x, x], 2).view(8, 544)[:, ::2]),
        "bias off alignment": dict(b=torch.cat([b[:1], b])[1:]),
        "block scales padded": dict(w=wb, b=None),
        "out rows wider than N": dict(out=torch.empty(8, 136, dtype=torch.bfloat16)[:, :128]),
    }
    assert cf.run_and_bind(x, w.data, w.scale, b)[1] is not None
    for what, case in cases.items():
        xx, ww, bb = case.get("x", x), case.get("w", w), case.get("b", b)
        out, bound = cf.run_and_bind(xx, ww.data, ww.scale, bb, case.get("out"))
        assert bound is None, what
        assert_matches(out, *reference(x, ww, bb, None, x.dtype), None, x.dtype, fused=True)
    assert cf.run_and_bind(x[:0], w.data, w.scale, b)[1] is None


def test_a_bound_run_keeps_no_tensor_alive(lt, monkeypatch):
    monkeypatch.setattr(cf, "pointer_alignment", lambda ptr: 256)
    x, w, b = operands(8, 128, 256, torch.bfloat16, "channel", True)
    _, bound = cf.run_and_bind(x, w.data, w.scale, b)
    refs = [weakref.ref(t) for t in (x, w.data, w.scale, b)]
    del x, w, b
    gc.collect()
    assert bound is not None and all(r() is None for r in refs)


def test_a_bound_run_whose_allocations_align_less_runs_the_checked_call(lt, monkeypatch):
    """The plan of a bound run was chosen for 256-byte aligned x8 and output (the CUDA caching
    allocator's blocks); where an allocator hands out less, the call is ``run``'s, with a plan
    of its own, and the result the same."""
    aligned = [256]
    monkeypatch.setattr(cf, "pointer_alignment", lambda ptr: aligned[0])
    x, w, b = operands(8, 128, 256, torch.bfloat16, "channel", True)
    _, bound = cf.run_and_bind(x, w.data, w.scale, b)
    assert bound is not None and len(cf._plans) == 1
    aligned[0] = 64
    got = bound(x, w.data, w.scale, b)
    assert len(cf._plans) == 2  # run's plan for the 64-byte alignment
    assert_matches(got, *reference(x, w, b, None, x.dtype), None, x.dtype, fused=True)


def test_a_bound_run_sets_the_weights_scale_pointer_only_when_the_weight_changes(lt, monkeypatch):
    """The plan's descriptor takes the activation scales' pointer at each call (a fresh
    allocation) but the weight's only when another weight comes: the results stay ``run``'s."""
    monkeypatch.setattr(cf, "pointer_alignment", lambda ptr: 256)
    sets = []
    real_set = lt.matmul_desc_set_attribute

    def counted(desc, attr, ptr, size):
        sets.append(D(int(attr)))
        return real_set(desc, attr, ptr, size)

    monkeypatch.setattr(lt, "matmul_desc_set_attribute", counted)
    x, w, b = operands(17, 200, 400, torch.float16, "channel", False)
    _, bound = cf.run_and_bind(x, w.data, w.scale, b)
    other = quantize_fp8(torch.randn(200, 400) / 20, "channel")
    for weight in (w, w, other, other):
        x = operands(17, 200, 400, torch.float16, "channel", False)[0]
        want = cf.run(x, weight.data, weight.scale, None)  # (the plan's call: its own pointers set)
        bound(x, w.data, w.scale, None)  # the plan holds w's scales again
        sets.clear()
        got = bound(x, weight.data, weight.scale, None)
        assert torch.equal(got, want)
        assert sets.count(D.A_SCALE_POINTER) == (weight is other) and sets.count(D.B_SCALE_POINTER) <= 1
