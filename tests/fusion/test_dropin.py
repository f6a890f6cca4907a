"""``hybridgemm.linear`` as a drop-in for ``F.linear``: a table of F.linear's argument forms,
those it accepts and those it refuses, run through both. Either both refuse, hybridgemm's
exception an instance of F.linear's (a RuntimeError subclass, ``LinearArgumentError``, with
hybridgemm's message where it names the problem; a TypeError where F.linear's is one), or both
return the same shape and dtype with the same values.

On the CPU a call without gradients is F.linear's own computation, so the results are also
taken through the paths that reshape the operands: with gradients wanted (the views that bring
a form to the kernels' (N, K) weight and (N,) bias, then hybridgemm's backward), and through
the dispatcher's GPU slow path run on CPU tensors, its kernel a Triton GEMM under the
interpreter, each against a float64 reference.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm import LinearArgumentError, dispatch
from hybridgemm.decide import Choice
from hybridgemm.kernels import backends, checks
from hybridgemm.kernels.epilogue import Activation, apply_activation
from hybridgemm.kernels.triton_gemm import TritonGemmConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
KERNEL, FLINEAR = "kernel", "F.linear"  # how an accepted form is computed: as the kernels' form, or by F.linear
OURS = r"^hybridgemm\.linear: .*"  # hybridgemm's own message


def _t(*shape, dev, dtype=torch.float32):
    return torch.randn(*shape, device=dev, dtype=dtype)


def _cols(rows, cols, dev):
    """A (rows, cols) tensor whose rows are not contiguous (a transposed view)."""
    return _t(cols, rows, dev=dev).T


# (id, build(dev) -> (args, kwargs), expected): expected is KERNEL or FLINEAR for a form F.linear
# accepts, else (F.linear's exception type, a regex of hybridgemm's message or None where the
# message is F.linear's own).
FORMS = [
    # the arguments: positional, by keyword, F.linear's names
    ("positional", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(5, dev=d)), {}), KERNEL),
    ("positional_no_bias", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d)), {}), KERNEL),
    ("input_keyword", lambda d: ((), {"input": _t(3, 8, dev=d), "weight": _t(5, 8, dev=d), "bias": _t(5, dev=d)}),
     KERNEL),
    ("weight_bias_keywords", lambda d: ((_t(3, 8, dev=d),), {"weight": _t(5, 8, dev=d), "bias": _t(5, dev=d)}),
     KERNEL),
    ("bias_none_keyword", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d)), {"bias": None}), KERNEL),
    ("unknown_keyword", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d)), {"foo": 1}), (TypeError, None)),
    ("input_twice", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d)), {"input": _t(3, 8, dev=d)}), (TypeError, None)),
    ("weight_missing", lambda d: ((_t(3, 8, dev=d),), {}), (TypeError, None)),
    ("fourth_positional_tensor", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(5, dev=d), _t(5, dev=d)), {}),
     (TypeError, OURS + "activation must be")),
    # arguments that are not tensors
    ("input_list", lambda d: (([[1.0, 2.0]], _t(5, 2, dev=d)), {}), (TypeError, OURS + "x must be a torch.Tensor")),
    ("input_none", lambda d: ((None, _t(5, 2, dev=d)), {}), (TypeError, OURS + "x must be a torch.Tensor")),
    ("weight_list", lambda d: ((_t(3, 2, dev=d), [[1.0, 2.0]]), {}), (TypeError, OURS + "weight must be a torch")),
    ("bias_float", lambda d: ((_t(3, 2, dev=d), _t(5, 2, dev=d), 1.5), {}), (TypeError, OURS + "bias must be")),
    ("bias_list", lambda d: ((_t(3, 2, dev=d), _t(5, 2, dev=d), [1.0] * 5), {}), (TypeError, OURS + "bias must be")),
    # the input's dims and layout
    ("x_1d", lambda d: ((_t(8, dev=d), _t(5, 8, dev=d), _t(5, dev=d)), {}), KERNEL),
    ("x_4d", lambda d: ((_t(2, 3, 2, 8, dev=d), _t(5, 8, dev=d), _t(5, dev=d)), {}), KERNEL),
    ("x_transposed", lambda d: ((_cols(3, 8, d), _t(5, 8, dev=d), _t(5, dev=d)), {}), KERNEL),
    ("x_0d", lambda d: ((torch.tensor(1.0, device=d), _t(5, 1, dev=d)), {}), (RuntimeError, OURS + ".*scalar")),
    ("m0", lambda d: ((_t(0, 8, dev=d), _t(5, 8, dev=d), _t(5, dev=d)), {}), KERNEL),
    ("k0", lambda d: ((_t(3, 0, dev=d), _t(5, 0, dev=d), _t(5, dev=d)), {}), KERNEL),
    ("k_mismatch", lambda d: ((_t(3, 8, dev=d), _t(5, 7, dev=d)), {}), (RuntimeError, OURS + "x has 8 input features")),
    # the weight's dims: a 1-D weight (K,) gives (...) (its last dim dropped)
    ("weight_1d", lambda d: ((_t(3, 8, dev=d), _t(8, dev=d)), {}), KERNEL),
    ("weight_1d_x_1d", lambda d: ((_t(8, dev=d), _t(8, dev=d)), {}), KERNEL),
    ("weight_1d_x_3d", lambda d: ((_t(2, 3, 8, dev=d), _t(8, dev=d)), {}), KERNEL),
    ("weight_1d_k_mismatch", lambda d: ((_t(3, 8, dev=d), _t(7, dev=d)), {}), (RuntimeError, OURS + "input features")),
    ("weight_1d_x_1d_scalar_bias", lambda d: ((_t(8, dev=d), _t(8, dev=d), torch.tensor(0.5, device=d)), {}),
     FLINEAR),
    ("weight_1d_x_2d_bias", lambda d: ((_t(3, 8, dev=d), _t(8, dev=d), _t(3, dev=d)), {}), (RuntimeError, None)),
    ("weight_3d", lambda d: ((_t(3, 8, dev=d), _t(2, 5, 8, dev=d)), {}), (RuntimeError, OURS + "weight must be 2-D")),
    ("weight_0d", lambda d: ((_t(3, 8, dev=d), torch.tensor(1.0, device=d)), {}),
     (RuntimeError, OURS + "weight must be 2-D")),
    # the bias's shape
    ("bias_1_n", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(1, 5, dev=d)), {}), KERNEL),
    ("bias_1_n_x_3d", lambda d: ((_t(2, 3, 8, dev=d), _t(5, 8, dev=d), _t(1, 5, dev=d)), {}), KERNEL),
    ("bias_1_n_x_1d", lambda d: ((_t(8, dev=d), _t(5, 8, dev=d), _t(1, 5, dev=d)), {}), FLINEAR),
    ("bias_scalar", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), torch.tensor(0.5, device=d)), {}), KERNEL),
    ("bias_one", lambda d: ((_t(2, 3, 8, dev=d), _t(5, 8, dev=d), _t(1, dev=d)), {}), KERNEL),
    ("bias_1_1", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(1, 1, dev=d)), {}), KERNEL),
    ("bias_1_1_x_1d", lambda d: ((_t(8, dev=d), _t(5, 8, dev=d), _t(1, 1, dev=d)), {}), (RuntimeError, None)),
    ("bias_n0", lambda d: ((_t(3, 8, dev=d), _t(0, 8, dev=d), _t(0, dev=d)), {}), KERNEL),
    ("bias_one_n0", lambda d: ((_t(3, 8, dev=d), _t(0, 8, dev=d), _t(1, dev=d)), {}), KERNEL),
    # shapes F.linear broadcasts over the result: F.linear computes them
    ("bias_m_n", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(3, 5, dev=d)), {}), FLINEAR),
    ("bias_n_1_square", lambda d: ((_t(5, 8, dev=d), _t(5, 8, dev=d), _t(5, 1, dev=d)), {}), FLINEAR),
    ("bias_seq_n_x_3d", lambda d: ((_t(2, 3, 8, dev=d), _t(5, 8, dev=d), _t(3, 5, dev=d)), {}), FLINEAR),
    ("bias_full_x_3d", lambda d: ((_t(2, 3, 8, dev=d), _t(5, 8, dev=d), _t(2, 3, 5, dev=d)), {}), FLINEAR),
    # shapes that do not broadcast to the result
    ("bias_n_1", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(5, 1, dev=d)), {}),
     (RuntimeError, OURS + r"bias of shape \(5, 1\) does not broadcast to the output's shape \(3, 5\)")),
    ("bias_1_1_n_x_2d", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(1, 1, 5, dev=d)), {}),
     (RuntimeError, OURS + "bias of shape")),
    ("bias_wrong_length", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(6, dev=d)), {}),
     (RuntimeError, OURS + r"bias must have shape \(5,\)")),
    ("bias_wrong_length_x_1d", lambda d: ((_t(8, dev=d), _t(5, 8, dev=d), _t(4, dev=d)), {}),
     (RuntimeError, OURS + r"bias must have shape \(5,\)")),
    # dtypes and devices
    ("dtype_weight", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d, dtype=torch.float64)), {}),
     (RuntimeError, OURS + "one dtype")),
    ("dtype_bias", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(5, dev=d, dtype=torch.float16)), {}),
     (RuntimeError, OURS + "bias=torch.float16")),
    ("dtype_bias_1_n", lambda d: ((_t(3, 8, dev=d), _t(5, 8, dev=d), _t(1, 5, dev=d, dtype=torch.float64)), {}),
     (RuntimeError, OURS + "one dtype")),
    ("float64", lambda d: ((_t(3, 8, dev=d, dtype=torch.float64), _t(5, 8, dev=d, dtype=torch.float64)), {}), KERNEL),
]
IDS = [f[0] for f in FORMS]
ACCEPTED = [f for f in FORMS if f[2] in (KERNEL, FLINEAR)]
ACCEPTED_IDS = [f[0] for f in ACCEPTED]


def _outcome(fn, args, kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # the exception is the outcome compared
        return None, e


def _operands(args, kwargs):
    """(input, weight, bias) of an F.linear call given by position or keyword."""
    given = dict(zip(("input", "weight", "bias"), args)) | kwargs
    return given["input"], given["weight"], given.get("bias")


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _reference(args, kwargs, act=None):
    """F.linear (+ the activation) in float64 on the CPU, for the same arguments."""
    up = lambda a: a.detach().cpu().double() if isinstance(a, torch.Tensor) else a
    y = F.linear(*map(up, args), **{k: up(v) for k, v in kwargs.items()})
    return apply_activation(y, Activation.parse(act))


def _assert_same_result(ours, theirs, ref, what):
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours.device == theirs.device, what
    tol = 1e-2 if ours.device.type == "cuda" and ours.dtype == torch.float32 else 1e-6  # cuda fp32 may be TF32
    torch.testing.assert_close(ours.detach().cpu().double(), ref, rtol=tol, atol=tol, msg=what)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", FORMS, ids=IDS)
def test_each_form_has_f_linears_outcome(case, dev):
    name, build, expected = case
    args, kwargs = build(dev)
    theirs, their_error = _outcome(F.linear, args, kwargs)
    ours, our_error = _outcome(hybridgemm.linear, args, kwargs)
    if expected in (KERNEL, FLINEAR):
        assert their_error is None, f"{name}: the table says F.linear accepts it, F.linear raised {their_error!r}"
        assert our_error is None, f"{name}: F.linear accepts it, hybridgemm.linear raised {our_error!r}"
        _assert_same_result(ours, theirs, _reference(args, kwargs), name)
        return
    exc, message = expected
    assert type(their_error) is exc, f"{name}: the table says F.linear raises {exc.__name__}, got {their_error!r}"
    assert isinstance(our_error, exc), f"{name}: F.linear raises {exc.__name__}, hybridgemm.linear {our_error!r}"
    if message is not None:
        assert isinstance(our_error, LinearArgumentError) or exc is TypeError, name
        assert re.search(message, str(our_error)), str(our_error)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", ACCEPTED, ids=ACCEPTED_IDS)
def test_each_accepted_form_differentiates_as_f_linear_does(case, dev):
    """With gradients wanted, the forms go through hybridgemm's own autograd: the gradients must
    have the caller's shapes (a (1, N) bias gets a (1, N) gradient) and F.linear's values."""
    name, build, _ = case
    args, kwargs = build(dev)
    if not all(t.is_floating_point() for t in _tensors(args, kwargs)):
        pytest.skip("no gradients for integer tensors")
    grad = lambda a: a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a
    ours_args, ours_kwargs = [grad(a) for a in args], {k: grad(v) for k, v in kwargs.items()}
    ref_args = [a.detach().cpu().double().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    ref_kwargs = {k: v.detach().cpu().double().requires_grad_() if isinstance(v, torch.Tensor) else v
                  for k, v in kwargs.items()}
    ours = hybridgemm.linear(*ours_args, activation="gelu_tanh", **ours_kwargs)
    ref = F.gelu(F.linear(*ref_args, **ref_kwargs), approximate="tanh")
    _assert_same_result(ours, F.linear(*args, **kwargs), ref.detach(), name)
    seed = torch.randn(ref.shape, dtype=torch.float64)
    ours.backward(seed.to(ours.dtype).to(ours.device))
    ref.backward(seed)
    tol = 1e-2 if dev == "cuda" else 1e-5
    for mine, theirs in zip(_tensors(ours_args, ours_kwargs), _tensors(ref_args, ref_kwargs)):
        assert mine.grad is not None and mine.grad.shape == mine.shape, name
        torch.testing.assert_close(mine.grad.cpu().double(), theirs.grad, rtol=tol, atol=tol, msg=name)


def test_forms_under_torch_compile():
    """The views that bring a form to the ops' (N, K) / (N,) are traced with the op."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: hybridgemm.linear(x, w, b, "relu"), fullgraph=True, backend="aot_eager")
    builders = {f[0]: f[1] for f in FORMS}
    for name in ("weight_1d", "bias_1_n", "bias_scalar", "bias_m_n"):
        x, w, b = _operands(*builders[name]("cpu"))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xg, wg, b)
        ref = torch.relu(F.linear(x.double(), w.double(), None if b is None else b.double()))
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5, msg=name)
        y.sum().backward()
        assert xg.grad.shape == x.shape and wg.grad.shape == w.shape, name


# ------------------------------------------------- the GPU slow path's operand handling, on the CPU

SMALL_GEMM = TritonGemmConfig(block_m=32, block_n=16, block_k=32, group_m=8, num_warps=4, num_stages=2,
                              persistent=False, use_tma=False, split_k=1)


@pytest.fixture
def gpu_slow_path(monkeypatch):
    """``dispatch._fused_linear_slow`` (what a CUDA call with no cached launcher runs) on CPU
    tensors: its check without the CUDA-only part (``check_linear_args``), every decision a
    small Triton GEMM run under the interpreter, no raw launch bound. Yields the list of the
    operands each kernel run received."""
    runs = []
    real = backends.get_backend

    def get_backend(name):
        be = real(name)

        def run(cfg, x2, w2, b2, out, *rest, **kw):
            runs.append((x2, w2, b2))
            return be.run(cfg, x2, w2, b2, out, *rest, **kw)

        return dataclasses.replace(be, run=run, bind=None)

    monkeypatch.setattr(backends, "get_backend", get_backend)
    monkeypatch.setattr(dispatch, "check_gpu_kernel_args", checks.check_linear_args)
    monkeypatch.setattr(dispatch, "_decision",
                        lambda problem, dev, mode: Choice("triton_gemm", SMALL_GEMM, "table", "test", "test"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return runs


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # the interpreter's
@pytest.mark.parametrize("case", ACCEPTED, ids=ACCEPTED_IDS)
def test_each_accepted_form_through_the_gpu_slow_path(case, gpu_slow_path):
    name, build, expected = case
    x, w, b = _operands(*build("cpu"))
    if x.dtype == torch.float64:
        pytest.skip("no kernel takes float64: dispatch.fused_linear sends it to PyTorch before this path")
    y, raw = dispatch._fused_linear_slow(x, w, b, "relu", None, dispatch._launchers[0].mode)
    ref = _reference((x, w, b), {}, "relu")
    _assert_same_result(y, F.linear(x, w, b), ref, name)
    empty = y.numel() == 0 or x.shape[-1] == 0
    assert len(gpu_slow_path) == (1 if expected == KERNEL and not empty else 0), name
    for x2, w2, b2 in gpu_slow_path:  # the kernels' form: (M, K), (N, K) row-major, a contiguous (N,) bias
        assert x2.dim() == 2 and w2.dim() == 2 and w2.stride(1) == 1 and w2.shape[1] == x2.shape[1], name
        assert b2 is None or (b2.shape == (w2.shape[0],) and b2.stride(0) == 1 and b2.data_ptr() % 16 == 0), name
    if expected == FLINEAR:
        assert raw is None
