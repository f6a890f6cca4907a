"""Triton RMSNorm (kernels/triton_rmsnorm.py) under the interpreter: HF LlamaRMSNorm's math
and Gemma's / OLMo 2's (``fp32_factor``) against an fp64 reference and against torch's own
ops, shapes and strides, ``out=``, mixed dtypes, bad arguments and the plan cache. bf16 is
GPU-only (the interpreter's bf16 is wrong).
"""

from __future__ import annotations

import pytest
import torch

from helpers import poisoned
from hybridgemm.kernels import triton_rmsnorm as trms
from hybridgemm.kernels.bounded_cache import BoundedCache
from hybridgemm.kernels.triton_launch import Launcher

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DTYPES = [torch.float16, torch.float32]
EPS = 1e-3  # comparable to the variance of the quieter rows, so where eps goes matters


def unit(dtype) -> float:
    """Unit roundoff: the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def operands(lead, h, dtype, device, wdtype=None):
    """x with per-row scales from 10**-2.5 to 10 (variances from ~1e-5, far below EPS, to
    ~1e2, far above), and a weight around 1 that is nowhere exactly 1."""
    scale = 10 ** (torch.rand(*lead, 1, device=device) * 3.5 - 2.5)
    x = (torch.randn(*lead, h, device=device) * scale).to(dtype)
    w = (1 + 0.5 * torch.randn(h, device=device)).to(wdtype or dtype)
    return x, w


def reference(x, w, eps=EPS):
    """The formula in float64, without the intermediate rounding (its error is in the bound)."""
    xd = x.double()
    return w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))


def hf_rms_norm(x, w, eps=EPS):
    """LlamaRMSNorm.forward, verbatim, in the operands' dtypes."""
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return w * xf.to(x.dtype)


def ratio_to_bound(out, ref, x_dtype, w):
    """max |out - ref| / bound, elementwise bound rtol * |ref| + atol. rtol: one rounding of the
    normalised row to x's dtype, one of the product to out's dtype, and 64 fp32 roundings for
    the sum of squares (tree-ordered), the mean, rsqrt (2 ulp on the GPU) and the products.
    atol: the same two roundings where the values are subnormal."""
    o_dtype = out.dtype
    rtol = unit(x_dtype) + unit(o_dtype) + 64 * unit(torch.float32)
    atol = (torch.finfo(x_dtype).smallest_normal * unit(x_dtype) * w.double().abs().max().item()
            + torch.finfo(o_dtype).smallest_normal * unit(o_dtype))
    return ((out.double() - ref).abs() / (rtol * ref.abs() + atol)).max().item()


def check(out, x, w):
    assert out.shape == x.shape and out.dtype == torch.promote_types(w.dtype, x.dtype)
    assert torch.isfinite(out).all(), "some output elements were not written"
    ratio = ratio_to_bound(out, reference(x, w), x.dtype, w)
    assert ratio <= 1, f"error {ratio:.3g} x the bound ({x.dtype}, weight {w.dtype}, shape {tuple(x.shape)})"
    # torch's own ops in the same dtypes: at most 2 ulp apart in fp16 (the rare row whose fp32
    # value sits on a rounding boundary of the intermediate), 8 ulp in fp32 (summation order).
    hf = hf_rms_norm(x, w).double()
    ulps = 2 if x.dtype == torch.float16 and out.dtype == torch.float16 else 8
    atol = torch.finfo(out.dtype).smallest_normal * unit(out.dtype) * 4
    diff = (out.double() - hf).abs()
    assert (diff <= ulps * 2 * unit(out.dtype) * hf.abs() + atol).all(), (
        f"{diff.max().item():.3g} from torch's RMSNorm ({x.dtype}, weight {w.dtype})")
    return out


def norm_checked(x, w):
    """rms_norm into a NaN-poisoned out, checked against both references."""
    out = poisoned(x.shape, torch.promote_types(w.dtype, x.dtype), x.device)
    assert trms.rms_norm(x, w, EPS, out=out) is out
    return check(out, x, w)


# ----------------------------------------------------------------------------- results


@pytest.mark.parametrize("h", [1, 7, 96, 4096, 5000])
@pytest.mark.parametrize("m", [1, 3, 17, 333])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_and_widths(m, h, dtype, device):
    x, w = operands((m,), h, dtype, device)
    norm_checked(x, w)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_wide_rows(m, dtype, device):
    """H > 16384: two passes over 4096-element chunks, the last one partial."""
    x, w = operands((m,), 20000, dtype, device)
    norm_checked(x, w)
    assert any(p.launch.meta["CHUNKED"] for p in trms._PLANS.values() if not p.empty)


# Wrong formulas a kernel could compute, as it would store them (fp32 math, one rounding).
def _wrong(fn):
    def wrong(x, w):
        xf = x.float()
        return fn(xf, w.float(), xf.pow(2).mean(-1, keepdim=True)).to(torch.promote_types(w.dtype, x.dtype))
    return wrong


WRONG = {
    "no-weight": _wrong(lambda xf, w, var: xf * torch.rsqrt(var + EPS)),
    "sum-not-mean": _wrong(lambda xf, w, var: w * xf * torch.rsqrt(var * xf.shape[-1] + EPS)),
    "eps-outside-sqrt": _wrong(lambda xf, w, var: w * xf / (var.sqrt() + EPS)),
    "eps-times-h": _wrong(lambda xf, w, var: w * xf * torch.rsqrt(var + EPS * xf.shape[-1])),
}


@pytest.mark.parametrize("wrong", WRONG.values(), ids=WRONG.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bound_rejects_wrong_formulas(wrong, dtype, device):
    """The bound is tight enough to fail each of these mistakes (and passes the kernel)."""
    x, w = operands((17,), 96, dtype, device)
    ref = reference(x, w)
    assert ratio_to_bound(trms.rms_norm(x, w, EPS), ref, dtype, w) <= 1
    assert ratio_to_bound(wrong(x, w), ref, dtype, w) > 1


def test_rounds_to_x_dtype_before_the_weight(device):
    """Skipping HF's rounding of the normalised row to fp16 stays inside the fp64 bound but
    changes about a quarter of the outputs by an ulp; the kernel matches torch's RMSNorm
    bit for bit except on rare rounding-boundary ties."""
    x, w = operands((17,), 4096, torch.float16, device)
    out = trms.rms_norm(x, w, EPS)
    hf = hf_rms_norm(x, w)
    no_round = _wrong(lambda xf, w, var: w * (xf * torch.rsqrt(var + EPS)))(x, w)
    assert (out != hf).float().mean().item() < 0.01
    assert (no_round != hf).float().mean().item() > 0.1


@pytest.mark.parametrize("xdt, wdt", [(torch.float16, torch.float32), (torch.float32, torch.float16)], ids=str)
def test_mixed_dtypes_follow_torch_promotion(xdt, wdt, device):
    x, w = operands((5,), 96, xdt, device, wdtype=wdt)
    out = trms.rms_norm(x, w, EPS)
    assert out.dtype == torch.float32 == hf_rms_norm(x, w).dtype
    check(out, x, w)


def test_leading_dims(device):
    x, w = operands((2, 3), 96, torch.float16, device)
    assert norm_checked(x, w).shape == (2, 3, 96)
    strided = operands((3, 2), 96, torch.float16, device)[0].transpose(0, 1)  # (2, 3, H), no flat view
    assert norm_checked(strided, w).shape == (2, 3, 96)
    assert norm_checked(x[1, 2], w).shape == (96,)  # one row, 1-D


def test_non_contiguous_x(device, monkeypatch):
    """Rows at any stride are read in place; a transposed x (column stride != 1) is copied."""
    seen = []
    real_run = trms.run
    monkeypatch.setattr(trms, "run", lambda x2d, *a: seen.append(x2d.data_ptr()) or real_run(x2d, *a))
    w = operands((1,), 40, torch.float32, device)[1]
    wide = operands((6,), 53, torch.float32, device)[0]
    sliced = wide[1:5, 7:47]  # row stride 53, a 28-byte offset
    norm_checked(sliced, w)
    assert seen[-1] == sliced.data_ptr(), "row-strided x was copied"
    every_other = wide[::2, :40]  # row stride 106
    norm_checked(every_other, w)
    assert seen[-1] == every_other.data_ptr()
    repeated = wide[0, :40].expand(3, 40)  # row stride 0: one row read three times
    out = norm_checked(repeated, w)
    assert seen[-1] == repeated.data_ptr() and torch.equal(out[0], out[2])
    transposed = operands((40,), 4, torch.float32, device)[0].T
    norm_checked(transposed, w)
    assert seen[-1] != transposed.data_ptr()


def test_non_contiguous_weight(device):
    x, _ = operands((3,), 96, torch.float16, device)
    w = operands((1,), 192, torch.float16, device)[1][::2]
    assert not w.is_contiguous()
    norm_checked(x, w)
    norm_checked(x, operands((1,), 97, torch.float16, device)[1][1:])  # contiguous, 2-byte aligned


def test_out_is_fully_overwritten(device):
    x, w = operands((17,), 96, torch.float16, device)
    out = poisoned((17, 96), torch.float16, device)
    assert trms.rms_norm(x, w, EPS, out=out) is out
    assert not out.isnan().any()
    assert torch.equal(out, trms.rms_norm(x, w, EPS))  # and deterministic


@pytest.mark.parametrize("eps", [0, 1, 0.0, 1e-6])
def test_eps_values(eps, device):
    """An int eps is taken as the float it equals; eps = 0 is plain x / rms(x)."""
    x, w = operands((3,), 96, torch.float32, device)
    out = trms.rms_norm(x, w, eps)
    assert torch.allclose(out, hf_rms_norm(x, w, eps), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- Gemma's / OLMo 2's formula


def scaled_in_fp32(x, g, eps=EPS):
    """GemmaRMSNorm's / Olmo2RMSNorm's forward in torch ops over their fp32 factor g: x
    normalised and scaled in fp32, rounded once to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * g).to(x.dtype)


def check_fp32_factor(out, x, g):
    """out against the fp64 formula (one rounding to x's dtype and the fp32 steps: no rounding
    of the normalised row to x's dtype in the bound) and against torch's ops (equal but for
    rare rounding-boundary ties in 16-bit, 8 ulp in fp32)."""
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "some output elements were not written"
    ref = reference(x, g)
    rtol = unit(x.dtype) + 64 * unit(torch.float32)
    atol = torch.finfo(x.dtype).smallest_normal * unit(x.dtype)
    ratio = ((out.double() - ref).abs() / (rtol * ref.abs() + atol)).max().item()
    assert ratio <= 1, f"error {ratio:.3g} x the bound ({x.dtype}, shape {tuple(x.shape)})"
    torch_ops = scaled_in_fp32(x, g)
    if x.dtype == torch.float32:
        assert torch.allclose(out, torch_ops, rtol=8 * 2 * unit(torch.float32), atol=0)
    else:
        assert (out != torch_ops).float().mean().item() < 0.01
        diff = (out.double() - torch_ops.double()).abs()
        assert (diff <= 2 * unit(x.dtype) * torch_ops.double().abs() + atol).all()
    return out


# every M with each width, and the chunked two-pass form (H > 16384) at a few rows
FP32_FACTOR_SHAPES = [(m, h) for m in (1, 3, 17, 333) for h in (1, 96, 3072, 5000)] + [(1, 20000), (3, 20000)]


@pytest.mark.parametrize("m, h", FP32_FACTOR_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp32_factor_rows_and_widths(m, h, dtype, device):
    x, _ = operands((m,), h, dtype, device)
    g = 1 + 0.5 * torch.randn(h, device=device)  # fp32, as Gemma's 1 + w is handed over
    out = poisoned(x.shape, dtype, x.device)
    assert trms.rms_norm(x, g, EPS, out=out, fp32_factor=True) is out
    check_fp32_factor(out, x, g)


def test_fp32_factor_rounds_once(device):
    """In fp16 the two formulas differ in about a quarter of the outputs: the kernel's
    fp32_factor form is torch's Gemma formula, and its default is Llama's."""
    x, _ = operands((17,), 4096, torch.float16, device)
    g = 1 + 0.5 * torch.randn(4096, device=device)
    gemma, llama = trms.rms_norm(x, g, EPS, fp32_factor=True), trms.rms_norm(x, g.half(), EPS)
    assert (gemma != scaled_in_fp32(x, g)).float().mean().item() < 0.01
    assert (llama != scaled_in_fp32(x, g)).float().mean().item() > 0.1
    assert (llama != hf_rms_norm(x, g.half())).float().mean().item() < 0.01


def test_fp32_factor_with_16_bit_factor_and_strided_rows(device):
    """A factor of any kernel dtype is read as fp32; rows at a stride are read in place."""
    wide, _ = operands((6,), 130, torch.float16, device)
    x = wide[1:5, 3:99]
    g = (1 + 0.5 * torch.randn(96, device=device)).half()
    check_fp32_factor(trms.rms_norm(x, g, EPS, fp32_factor=True), x, g.float())


@pytest.mark.parametrize("offset", [1.0, 0.0, -0.5])
@pytest.mark.parametrize("wdtype", DTYPES, ids=str)
def test_fp32_factor_offset_is_added_in_fp32(offset, wdtype, device):
    """The factor ``offset + weight`` formed in registers (Gemma's 1 + w from its raw weight) is
    bit for bit the kernel over the factor torch forms (``offset + weight.float()``), and
    within the bound of the fp64 formula."""
    x, _ = operands((17,), 300, torch.float16, device)
    w = (0.5 * torch.randn(300, device=device)).to(wdtype)
    factor = offset + w.float()
    out = trms.rms_norm(x, w, EPS, fp32_factor=True, offset=offset)
    assert torch.equal(out, trms.rms_norm(x, factor, EPS, fp32_factor=True))
    check_fp32_factor(out, x, factor)
    if offset:
        assert not torch.equal(out, trms.rms_norm(x, w, EPS, fp32_factor=True))  # the offset is used


def test_fp32_factor_is_part_of_the_plan(device, monkeypatch):
    monkeypatch.setattr(trms, "_PLANS", BoundedCache(trms.PLAN_CACHE_SIZE))
    x, _ = operands((3,), 96, torch.float32, device)
    g = 1 + 0.5 * torch.randn(96, device=device)
    trms.rms_norm(x, g, EPS)
    trms.rms_norm(x, g, EPS, fp32_factor=True)
    assert sorted(p.launch.meta["ROUND_FIRST"] for p in trms._PLANS.values()) == [False, True]


@pytest.mark.parametrize("kwargs, match", [
    ({"fp32_factor": "yes"}, "fp32_factor must be a bool"),
    ({"fp32_factor": 1}, "fp32_factor must be a bool"),
    ({"fp32_factor": True, "offset": "1"}, "offset must be a finite real number"),
    ({"fp32_factor": True, "offset": True}, "offset must be a finite real number"),
    ({"fp32_factor": True, "offset": float("nan")}, "offset must be a finite real number"),
    ({"fp32_factor": True, "offset": torch.tensor(1.0)}, "offset must be a finite real number"),
], ids=["str", "int", "offset-str", "offset-bool", "offset-nan", "offset-tensor"])
def test_fp32_factor_bad_input(kwargs, match, device):
    x, w = operands((3,), 96, torch.float16, device)
    with pytest.raises(TypeError, match=match):
        trms.rms_norm(x, w, EPS, **kwargs)


def test_fp32_factor_out_dtype_is_x_dtype(device):
    x, _ = operands((3,), 96, torch.float16, device)
    g = torch.ones(96, device=device)
    assert trms.out_dtype(torch.float16, torch.float32, fp32_factor=True) == torch.float16
    assert trms.out_dtype(torch.float16, torch.float32) == torch.float32
    with pytest.raises(TypeError, match="expected torch.float16 \\(x's, with fp32_factor\\)"):
        trms.rms_norm(x, g, EPS, out=torch.empty(3, 96, device=device), fp32_factor=True)


# ----------------------------------------------------------------------------- residual + norm


@pytest.mark.parametrize("m, h", [(1, 96), (3, 3072), (17, 5000), (2, 20000)], ids=str)
@pytest.mark.parametrize("fp32_factor", [True, False], ids=["fp32-factor", "llama"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_is_added_to_the_rounded_norm(m, h, fp32_factor, dtype, device):
    """``residual + norm(x)`` in one launch: bit for bit the kernel's norm, rounded, then torch's
    add of the two (the post-norm layers' ``residual + post_norm(o)``); rows at a stride, the
    chunked two-pass form at 20000."""
    x, w = operands((m,), h, dtype, device)
    g = 1 + 0.5 * torch.randn(h, device=device) if fp32_factor else w
    wide = torch.randn(m, h + 8, device=device).to(dtype) * 4
    residual = wide[:, 3:h + 3]  # a row stride of h + 8
    normed = trms.rms_norm(x, g, EPS, fp32_factor=fp32_factor)
    out = poisoned(x.shape, normed.dtype, x.device)
    assert trms.rms_norm(x, g, EPS, fp32_factor=fp32_factor, residual=residual, out=out) is out
    assert torch.equal(out, residual + normed)
    assert not torch.equal(out, normed)


def test_residual_is_part_of_the_plan(device, monkeypatch):
    monkeypatch.setattr(trms, "_PLANS", BoundedCache(trms.PLAN_CACHE_SIZE))
    x, w = operands((3,), 96, torch.float32, device)
    trms.rms_norm(x, w, EPS)
    trms.rms_norm(x, w, EPS, residual=torch.ones_like(x))
    assert sorted(p.launch.meta["ADD"] for p in trms._PLANS.values()) == [False, True]


@pytest.mark.parametrize("residual, match", [
    (lambda x: x[:, :-1], "residual must have x's shape"),
    (lambda x: x.double(), "the output dtype"),
    (lambda x: x.tolist(), "residual must be a torch.Tensor"),
], ids=["shape", "dtype", "list"])
def test_residual_bad_input(residual, match, device):
    x, w = operands((3,), 96, torch.float16, device)
    with pytest.raises((TypeError, ValueError), match=match):
        trms.rms_norm(x, w, EPS, residual=residual(x))


# ----------------------------------------------------------------------------- empty shapes


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=str)
def test_no_rows_launches_nothing(lead, device, monkeypatch):
    monkeypatch.setattr(Launcher, "__call__", lambda *a: pytest.fail("launched on an empty input"))
    x, w = operands(lead, 96, torch.float16, device)
    out = trms.rms_norm(x, w, EPS)
    assert out.shape == (*lead, 96) and out.dtype == torch.float16
    given = torch.empty(*lead, 96, dtype=torch.float16, device=device)
    assert trms.rms_norm(x, w, EPS, out=given) is given
    x, w = operands((3,), 0, torch.float16, device)  # H = 0
    assert trms.rms_norm(x, w, EPS).shape == (3, 0)


# ----------------------------------------------------------------------------- bad input

_F16 = torch.float16

# (id, call(x, w, device) with good fp16 operands x (3, 96), w (96,), error, message match)
BAD = [
    ("x-type", lambda x, w, d: trms.rms_norm(x.tolist(), w, EPS), TypeError, "x must be a torch.Tensor"),
    ("w-type", lambda x, w, d: trms.rms_norm(x, None, EPS), TypeError, "weight must be a torch.Tensor"),
    ("x-scalar", lambda x, w, d: trms.rms_norm(x[0, 0], w, EPS), ValueError, "x must have at least 1"),
    ("w-2d", lambda x, w, d: trms.rms_norm(x, w[None], EPS), ValueError, r"weight must have shape \(96,\)"),
    ("w-length", lambda x, w, d: trms.rms_norm(x, w[:-1], EPS), ValueError, r"weight must have shape \(96,\)"),
    ("x-dtype", lambda x, w, d: trms.rms_norm(x.double(), w, EPS), TypeError, "x has unsupported dtype"),
    ("w-dtype", lambda x, w, d: trms.rms_norm(x, w.to(torch.int32), EPS), TypeError, "weight has unsupported dtype"),
    ("w-device", lambda x, w, d: trms.rms_norm(x, w.to("meta"), EPS), ValueError, "weight is on meta"),
    ("eps-none", lambda x, w, d: trms.rms_norm(x, w, None), TypeError, "eps must be a real number"),
    ("eps-str", lambda x, w, d: trms.rms_norm(x, w, "1e-5"), TypeError, "eps must be a real number"),
    ("eps-bool", lambda x, w, d: trms.rms_norm(x, w, True), TypeError, "eps must be a real number"),
    ("eps-tensor", lambda x, w, d: trms.rms_norm(x, w, torch.tensor(1e-5)), TypeError, "eps must be a real"),
    ("eps-negative", lambda x, w, d: trms.rms_norm(x, w, -1e-6), ValueError, "eps must be finite and non-negative"),
    ("eps-nan", lambda x, w, d: trms.rms_norm(x, w, float("nan")), ValueError, "eps must be finite"),
    ("eps-inf", lambda x, w, d: trms.rms_norm(x, w, float("inf")), ValueError, "eps must be finite"),
    ("out-type", lambda x, w, d: trms.rms_norm(x, w, EPS, out=[0.0]), TypeError, "out must be a torch.Tensor"),
    ("out-shape", lambda x, w, d: trms.rms_norm(x, w, EPS, out=torch.empty(3, 97, dtype=_F16, device=d)),
     ValueError, r"out must be a contiguous tensor of shape \(3, 96\)"),
    ("out-dtype", lambda x, w, d: trms.rms_norm(x, w, EPS, out=torch.empty(3, 96, device=d)), TypeError,
     "out has dtype torch.float32, expected torch.float16"),
    ("out-strided", lambda x, w, d: trms.rms_norm(x, w, EPS, out=torch.empty(96, 3, dtype=_F16, device=d).T),
     ValueError, "not contiguous"),
    ("out-device", lambda x, w, d: trms.rms_norm(x, w, EPS, out=torch.empty(3, 96, dtype=_F16, device="meta")),
     ValueError, "out must be a contiguous tensor .* got \\(3, 96\\) on meta"),
]


@pytest.mark.parametrize("call, exc, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input(call, exc, match, device):
    x, w = operands((3,), 96, torch.float16, device)
    with pytest.raises(exc, match=match):
        call(x, w, device)


def test_needs_cuda_outside_the_interpreter(monkeypatch):
    x, w = operands((3,), 96, torch.float16, "cpu")
    monkeypatch.setattr(trms, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        trms.rms_norm(x, w, EPS)


def test_rejects_meta_tensors():
    x, w = operands((3,), 96, torch.float16, "meta")
    with pytest.raises(ValueError, match="x must be a CUDA tensor .* got one on meta"):
        trms.rms_norm(x, w, EPS)


# ----------------------------------------------------------------------------- plans


def test_plan_reused_per_signature(device, monkeypatch):
    monkeypatch.setattr(trms, "_PLANS", BoundedCache(trms.PLAN_CACHE_SIZE))
    x, w = operands((3,), 96, torch.float16, device)
    trms.rms_norm(x, w, EPS)
    (plan,) = trms._PLANS.values()
    trms.rms_norm(operands((3,), 96, torch.float16, device)[0], w, 1e-5)  # new data, other eps
    assert list(trms._PLANS.values()) == [plan] and next(iter(trms._PLANS.values())) is plan
    trms.rms_norm(x[:2], w, EPS)  # another M
    assert len(trms._PLANS) == 2
    norm_checked(operands((4,), 97, torch.float16, device)[0][:, 1:], w)  # x 2-byte aligned
    assert len(trms._PLANS) == 3


def test_plan_cache_is_bounded(device, monkeypatch):
    monkeypatch.setattr(trms, "_PLANS", BoundedCache(3))
    w = operands((1,), 7, torch.float32, device)[1]
    for m in range(1, 9):
        norm_checked(operands((m,), 7, torch.float32, device)[0], w)
        assert len(trms._PLANS) <= 3


@pytest.mark.parametrize("h, block, chunked, warps", [
    (1, 1, False, 4), (96, 128, False, 4), (1024, 1024, False, 4), (1025, 2048, False, 8),
    (4096, 4096, False, 8), (5000, 8192, False, 16), (16384, 16384, False, 16), (16385, 4096, True, 8),
])
def test_plan_launch_shape(h, block, chunked, warps):
    plan = trms._make_plan(5, h, h, torch.device("cpu"))
    assert plan.launch.grid == (5,) and plan.scalars == (h, h, 0, 1.0 / h)
    assert plan.launch.meta == {"BLOCK": block, "CHUNKED": chunked, "ROUND_FIRST": True, "ADD": False,
                                "num_warps": warps, "enable_fp_fusion": False}
    assert trms._make_plan(0, h, h, torch.device("cpu")).empty
