"""hybridgemm.linear on the CPU: F.linear's semantics, the custom ops, autograd, compile.

On the CPU ``hybridgemm.linear`` computes with F.linear itself, so its forward values are not
compared with F.linear here: the forward cases run the dispatcher's operand handling and the
Triton kernels under the interpreter (``helpers.run_like_the_dispatcher``) against float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from helpers import check_close_to_reference, make_operands, rel_err, run_like_the_dispatcher, torch_linear
from hybridgemm import HybridLinear, backward, dispatch
from hybridgemm.backward import torch_linear_backward

ACTS = [None, "relu", "gelu_tanh", "gelu"]


def _tiled(k):
    from hybridgemm.kernels.triton_gemm import TritonGemmConfig

    return TritonGemmConfig(32, 16, 32, 8, 4, 2, persistent=False, use_tma=False)


def _split(k):
    """Split in two (single-pass reduction) where K has the two blocks that takes."""
    from hybridgemm.kernels.triton_splitk import TritonSplitKConfig

    return TritonSplitKConfig(16, 32, 16, 2 if k > 16 else 1, 4, 2, fused_reduce=k > 16)


KERNELS = [("triton_gemm", _tiled), ("triton_splitk", _split)]


# The leading dims are flattened before the kernel and the activation runs in its epilogue, apart:
# every lead once and every activation at least once, each with every kernel, bias and dtype.
LEADS_ACTS = [((), "gelu"), ((1,), None), ((3,), "relu"), ((17,), "gelu_tanh"), ((17,), None), ((2, 3, 5), "gelu")]


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # the interpreter's
@pytest.mark.parametrize("backend, config", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("lead, activation", LEADS_ACTS, ids=[f"{lead}-{act}" for lead, act in LEADS_ACTS])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_forward_matches_reference(lead, activation, bias, backend, config, dtype):
    n, k = 37, 50  # neither a multiple of the blocks
    x = torch.randn(*lead, k).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = run_like_the_dispatcher(backend, config(k), x, w, b, activation)
    assert out.shape == (*lead, n) and out.dtype == x.dtype
    check_close_to_reference(out.reshape(-1, n), x.reshape(-1, k), w, b, activation, f"{lead} {activation}")


@pytest.mark.parametrize("activation", ACTS)
def test_custom_op_path_equals_fast_path(activation):
    x, w, b = make_operands(17, 33, 70, torch.float32, "cpu")
    fast = hybridgemm.linear(x, w, b, activation)
    op = torch.ops.hybridgemm.linear_fwd(x, w, b, activation or "none")
    torch.testing.assert_close(fast, op, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # the interpreter's
@pytest.mark.parametrize("backend, config, rows", [("triton_gemm", _tiled, 20), ("triton_gemm", _tiled, 3),
                                                   ("triton_splitk", _split, 3)],  # split-K: decode, M <= 64
                         ids=["triton_gemm-m180", "triton_gemm-m27", "triton_splitk-m27"])
def test_non_contiguous_operands(backend, config, rows):
    base = torch.randn(2 * rows, 9, 5)
    x = base.transpose(0, 1)[:, ::2, :]  # (9, rows, 5), no unit stride pattern
    w = torch.randn(5, 13).t()  # (13, 5) column-major
    b = torch.randn(26)[::2]
    out = run_like_the_dispatcher(backend, config(5), x, w, b, "gelu")
    assert out.shape == (9, rows, 13)
    check_close_to_reference(out.reshape(-1, 13), x.reshape(-1, 5), w, b, "gelu", "non-contiguous")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # the interpreter's
@pytest.mark.parametrize("backend, config", KERNELS, ids=[k[0] for k in KERNELS])
def test_float64_and_empty_problems(backend, config):
    # float64: no kernel takes it (a call goes to PyTorch), and a kernel asked directly says so
    x, w, b = make_operands(3, 5, 7, torch.float64, "cpu")
    with pytest.raises(TypeError, match="float64"):
        run_like_the_dispatcher(backend, config(7), x, w, b, "relu")
    # no rows, no columns: nothing to write; K = 0: act(bias) in every row
    assert run_like_the_dispatcher(backend, config(7), torch.randn(0, 7), torch.randn(5, 7), None).shape == (0, 5)
    assert run_like_the_dispatcher(backend, config(7), torch.randn(4, 7), torch.randn(0, 7), None).shape == (4, 0)
    bias = torch.randn(5)
    kzero = run_like_the_dispatcher(backend, config(0), torch.randn(4, 0), torch.randn(5, 0), bias, "relu")
    assert torch.equal(kzero, torch.relu(bias).expand(4, 5))


def test_forward_goes_through_dispatcher(monkeypatch):
    calls = []
    real = dispatch.fused_linear

    def spy(x, w, b=None, activation=None):
        calls.append(hybridgemm.Activation.parse(activation).value)
        return real(x, w, b, activation)

    monkeypatch.setattr(dispatch, "fused_linear", spy)
    x, w, b = make_operands(3, 8, 6, torch.float32, "cpu")
    hybridgemm.linear(x, w, b, "relu")  # eager, no grad
    w.requires_grad_(True)
    hybridgemm.linear(x, w, b, "relu").sum().backward()  # op path, output kept for backward
    hybridgemm.linear(x, w, b, "gelu")  # keeps z: unfused GEMM + activation
    assert calls == ["relu", "relu", "none"]


# ------------------------------------------------------------------------------- autograd

@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_fp64(activation, bias):
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    assert torch.autograd.gradcheck(lambda *a: hybridgemm.linear(*a[:2], a[2] if bias else None, activation),
                                    inputs)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_fp32_gradients_vs_fp64_reference(activation, m):
    n, k = 45, 70
    x, w, b = make_operands(m, n, k, torch.float32, "cpu")
    gy = torch.randn(m, n)
    ours = [t.clone().requires_grad_(True) for t in (x, w, b)]
    hybridgemm.linear(*ours, activation).backward(gy)
    ref = [t.double().requires_grad_(True) for t in (x, w, b)]
    torch_linear(*ref, activation).backward(gy.double())
    stock = [t.clone().requires_grad_(True) for t in (x, w, b)]
    torch_linear(*stock, activation).backward(gy)
    for name, o, r, s in zip("xwb", ours, ref, stock):
        theirs = rel_err(s.grad, r.grad)
        assert rel_err(o.grad, r.grad) <= max(2 * theirs, 2e-6), f"d{name}"


def test_compile_bias_only_gradient():
    torch._dynamo.reset()
    x, w, b = make_operands(4, 6, 5, torch.float32, "cpu")
    b.requires_grad_(True)
    f = torch.compile(lambda x, w, b: hybridgemm.linear(x, w, b, "gelu_tanh").sum(), fullgraph=True,
                      backend="aot_eager")
    f(x, w, b).backward()
    ref = b.detach().clone().requires_grad_(True)
    F.gelu(F.linear(x, w, ref), approximate="tanh").sum().backward()
    torch.testing.assert_close(b.grad, ref.grad)


@pytest.mark.parametrize("wanted", ["x", "w", "b", "wb"])
def test_only_requested_gradients(wanted):
    x, w, b = make_operands(4, 6, 5, torch.float64, "cpu")
    for name, t in zip("xwb", (x, w, b)):
        t.requires_grad_(name in wanted)
    hybridgemm.linear(x, w, b, "gelu_tanh").sum().backward()
    for name, t in zip("xwb", (x, w, b)):
        assert (t.grad is not None) == (name in wanted)
    xr, wr, br = (t.detach().requires_grad_(n in wanted) for n, t in zip("xwb", (x, w, b)))
    F.gelu(F.linear(xr, wr, br), approximate="tanh").sum().backward()
    for name, t, r in zip("xwb", (x, w, b), (xr, wr, br)):
        if name in wanted:
            torch.testing.assert_close(t.grad, r.grad)


@pytest.mark.parametrize("activation", ACTS)
def test_backward_calls_linear_backward(monkeypatch, activation):
    seen = []

    def spy(grad_out, x, weight, pre, act, needs):
        seen.append((pre, act, tuple(needs), x is None, weight is None))
        return torch_linear_backward(grad_out, x, weight, pre, act, needs)

    monkeypatch.setattr(backward, "linear_backward", spy)
    x, w, b = make_operands(3, 4, 5, torch.float32, "cpu")
    w.requires_grad_(True)
    b.requires_grad_(True)
    y = hybridgemm.linear(x, w, b, activation)
    y.sum().backward()
    (pre, act, needs, x_none, w_none), = seen
    assert act == (activation or "none") and needs == (False, True, True)
    assert not x_none and w_none  # W is not kept when dx is not wanted
    if activation is None:
        assert pre is None
    elif activation == "relu":
        torch.testing.assert_close(pre, y.detach())  # relu keeps its output, like torch.relu
    else:
        torch.testing.assert_close(pre, F.linear(x, w, b).detach())  # the pre-activation z


@pytest.mark.parametrize("activation", ACTS)
def test_torch_linear_backward_reference(activation):
    x, w, b = (t.requires_grad_(True) for t in make_operands(6, 5, 4, torch.float64, "cpu"))
    z = F.linear(x, w, b)
    y = torch_linear(x, w, b, activation)
    g = torch.randn_like(y)
    y.backward(g)
    saved = y.detach() if activation == "relu" else z.detach()
    dx, dw, db = torch_linear_backward(g, x.detach(), w.detach(), saved, activation, (True, True, True))
    for ours, t in zip((dx, dw, db), (x, w, b)):
        torch.testing.assert_close(ours, t.grad)
    assert torch_linear_backward(g, None, w.detach(), saved, activation, (True, False, False))[1:] == (None, None)
    if activation is not None:
        with pytest.raises(ValueError, match="needs the saved tensor"):
            torch_linear_backward(g, x, w, None, activation, (True, True, True))
    with pytest.raises(ValueError, match="dW needs x"):
        torch_linear_backward(g, None, w, saved, activation, (False, True, False))


def test_opcheck_custom_ops():
    x, w, b = (t.requires_grad_(True) for t in make_operands(3, 6, 5, torch.float32, "cpu"))
    torch.library.opcheck(torch.ops.hybridgemm.linear_fwd.default, (x, w, b, "relu"))
    torch.library.opcheck(torch.ops.hybridgemm.linear_fwd.default, (x, w, None, "none"))
    torch.library.opcheck(torch.ops.hybridgemm.linear_act_fwd.default, (x, w, b, "gelu"))
    g = torch.randn(3, 6)
    torch.library.opcheck(torch.ops.hybridgemm.linear_bwd.default, (g, x.detach(), None, None, "none", False,
                                                                    True, True))
    torch.library.opcheck(torch.ops.hybridgemm.linear_bwd.default, (g, None, None, None, "none", False,
                                                                    False, True))


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_torch_compile_fullgraph(activation):
    torch._dynamo.reset()
    x, w, b = make_operands(5, 12, 10, torch.float32, "cpu")
    w2 = torch.randn(7, 12)

    def f(x, w, b, w2):
        h = hybridgemm.linear(x, w, b, activation)
        return hybridgemm.linear(h.unsqueeze(0), w2).square().sum()

    args = [t.clone().requires_grad_(True) for t in (x, w, b, w2)]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    out.backward()
    ref_args = [t.clone().requires_grad_(True) for t in (x, w, b, w2)]
    ref = f(*ref_args)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for a, r in zip(args, ref_args):
        torch.testing.assert_close(a.grad, r.grad)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b, w2),
                                   f(x, w, b, w2))


def test_autocast_cpu_casts_like_f_linear():
    x, w, b = make_operands(4, 6, 8, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = hybridgemm.linear(x, w, b)
        ref = F.linear(x, w, b)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref)


# --------------------------------------------------------------------------------- errors

def test_errors_are_clear():
    # F.linear's rules: a LinearArgumentError, the RuntimeError F.linear raises (a TypeError for
    # a non-tensor, as there), with a message that names the problem
    x, w, b = make_operands(3, 4, 5, torch.float32, "cpu")
    with pytest.raises(hybridgemm.LinearArgumentError, match="one dtype"):
        hybridgemm.linear(x, w.double(), b)
    with pytest.raises(hybridgemm.LinearArgumentError, match="one dtype"):
        hybridgemm.linear(x, w, b.half())
    with pytest.raises(hybridgemm.LinearArgumentError, match="one device"):
        hybridgemm.linear(x, w.to("meta"), b)
    with pytest.raises(hybridgemm.LinearArgumentError, match="input features"):
        hybridgemm.linear(x, torch.randn(4, 6), b)
    with pytest.raises(hybridgemm.LinearArgumentError, match="bias must have shape"):
        hybridgemm.linear(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="unknown activation"):
        hybridgemm.linear(x, w, b, "swish")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        hybridgemm.linear([[1.0]], w, b)
    for grad in ((True, False, False), (False, True, False), (False, False, True)):  # also through autograd
        xg, wg, bg = (t.clone().requires_grad_(g) for t, g in zip((x, torch.randn(5, 6), b), grad))
        with pytest.raises(hybridgemm.LinearArgumentError, match="input features"):
            hybridgemm.linear(xg, wg, bg)
    assert issubclass(hybridgemm.LinearArgumentError, RuntimeError)


# ---------------------------------------------------------------------------- HybridLinear

def test_hybrid_linear_module():
    lin = torch.nn.Linear(9, 11)
    hyb = HybridLinear.from_linear(lin, activation="relu")
    assert hyb.weight is lin.weight and hyb.bias is lin.bias
    assert set(hyb.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 3, 9)
    torch.testing.assert_close(hyb(x), torch.relu(lin(x)))
    fresh = HybridLinear(9, 11, bias=False, activation="gelu")
    fresh.load_state_dict({"weight": lin.weight.detach()})
    torch.testing.assert_close(fresh(x), F.gelu(F.linear(x, lin.weight)))
    assert "activation=gelu" in repr(fresh)
