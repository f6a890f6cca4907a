"""The bad-input catalogue: every case either raises the named error with a message naming
the problem, or returns what F.linear (+ the activation) returns. Each case runs on the CPU,
and on the GPU (marker ``gpu``) where there is one; none may crash or hang.

On the CPU ``hybridgemm.linear`` is F.linear itself, so the result cases are not compared with
F.linear there: each goes through what a call does on a GPU instead (the operand
normalisation, the decision with an H200 faked, the chosen Triton kernel under the
interpreter), against a float64 reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fake_device import FAKE_SIG

import hybridgemm
from hybridgemm import AttentionProjection, attention_projection, decide, explain
from hybridgemm.autotune_cache.keys import M_MAX
from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry
from hybridgemm.cli import main as cli_main
from hybridgemm.kernels import backends, checks
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.problem import DTYPE_NAMES, Problem
from hybridgemm.kernels.triton_gemm import TritonGemmConfig
from hybridgemm.kernels.triton_splitk import MAX_M as SPLITK_MAX_M
from hybridgemm.kernels.triton_splitk import TritonSplitKConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LinearArgumentError = hybridgemm.LinearArgumentError  # F.linear's rules broken: a RuntimeError, as F.linear's


def _t(*shape, dev, dtype=torch.float32):
    return torch.randn(*shape, device=dev, dtype=dtype)


def _lin(x, w, b=None, act=None):
    return lambda: hybridgemm.linear(x, w, b, act)


# (id, builder(dev) -> (callable, reference or None), expected exception or None, message regex)
ERRORS = [
    # F.linear's argument rules (tests/fusion/test_dropin.py holds the forms it accepts): a
    # LinearArgumentError is the RuntimeError F.linear raises
    ("dtype_mix", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d, dtype=torch.float16)), LinearArgumentError,
     "one dtype"),
    ("bias_dtype", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d), _t(4, dev=d, dtype=torch.float64)),
     LinearArgumentError, "bias=torch.float64"),
    ("weight_3d", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, 1, dev=d)), LinearArgumentError, "weight must be 2-D"),
    ("x_scalar", lambda d: _lin(torch.tensor(1.0, device=d), _t(4, 1, dev=d)), LinearArgumentError, "scalar"),
    ("k_mismatch", lambda d: _lin(_t(2, 5, dev=d), _t(4, 3, dev=d)), LinearArgumentError, "input features"),
    ("bias_len", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d), _t(5, dev=d)), LinearArgumentError,
     r"bias must have shape \(4,\)"),
    # (N, 1) with M != N: F.linear refuses it (it would broadcast per row, not per column)
    ("bias_column", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d), _t(4, 1, dev=d)), LinearArgumentError,
     r"bias of shape \(4, 1\) does not broadcast to the output's shape \(2, 4\)"),
    ("x_list", lambda d: _lin([[1.0, 2.0]], _t(4, 2, dev=d)), TypeError, "x must be a torch.Tensor"),
    ("w_list", lambda d: _lin(_t(2, 2, dev=d), [[1.0, 2.0]]), TypeError, "weight must be a torch.Tensor"),
    ("bias_float", lambda d: _lin(_t(2, 2, dev=d), _t(3, 2, dev=d), 1.5), TypeError, "bias must be"),
    ("act_unknown", lambda d: _lin(_t(2, 2, dev=d), _t(3, 2, dev=d), None, "swish"), ValueError, "unknown activation"),
    ("act_int", lambda d: _lin(_t(2, 2, dev=d), _t(3, 2, dev=d), None, 3), ValueError, "unknown activation"),
    ("attn_heads_zero", lambda d: lambda: attention_projection(_t(1, 2, 8, dev=d), _t(24, 8, dev=d), None, 0, 0),
     ValueError, "num_heads must be a positive int"),
    ("attn_hidden_not_divisible", lambda d: lambda: attention_projection(_t(1, 2, 10, dev=d), _t(30, 10, dev=d),
                                                                         None, 3, 3), ValueError, "not divisible"),
    ("attn_gqa_groups", lambda d: lambda: attention_projection(_t(1, 2, 12, dev=d), _t(36, 12, dev=d), None, 3, 2),
     ValueError, "multiple of num_kv_heads"),
    ("attn_rows", lambda d: lambda: attention_projection(_t(1, 2, 8, dev=d), _t(20, 8, dev=d), None, 2, 1),
     ValueError, "has 20 rows"),
    ("attn_x_1d", lambda d: lambda: attention_projection(_t(8, dev=d), _t(24, 8, dev=d), None, 2, 2),
     ValueError, "seq, hidden"),
    ("attn_dtype", lambda d: lambda: attention_projection(_t(1, 2, 8, dev=d), _t(24, 8, dev=d, dtype=torch.float64),
                                                          None, 2, 2), LinearArgumentError, "one dtype"),
    ("module_heads", lambda d: lambda: AttentionProjection(10, 3, 3, device=d), ValueError, "not divisible"),
    ("module_out_shape", lambda d: lambda: AttentionProjection(8, 2, 2, device=d).forward_out(_t(1, 3, 2, 4, dev=d)),
     ValueError, "expected"),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_name_the_problem(case, dev):
    _, build, exc, match = case
    with pytest.raises(exc, match=match):
        build(dev)()


def _results(dev):
    """(id, x, w, b, activation): each must equal F.linear + activation in value and shape."""
    buf = _t(40, 70, dev=dev)
    return [
        ("m0", _t(0, 8, dev=dev), _t(5, 8, dev=dev), _t(5, dev=dev), None),
        ("k0", _t(3, 0, dev=dev), _t(5, 0, dev=dev), _t(5, dev=dev), "relu"),
        ("n0", _t(3, 8, dev=dev), _t(0, 8, dev=dev), _t(0, dev=dev), None),
        ("x_1d", _t(8, dev=dev), _t(5, 8, dev=dev), _t(5, dev=dev), None),
        ("x_transposed", _t(8, 6, dev=dev).T, _t(5, 8, dev=dev), _t(5, dev=dev), "gelu_tanh"),
        ("x_expanded_stride0", _t(1, 8, dev=dev).expand(4, 8), _t(5, 8, dev=dev), None, None),
        ("x_misaligned", buf[:, 1:65], _t(33, 64, dev=dev), _t(33, dev=dev), "relu"),
        ("w_misaligned", _t(7, 64, dev=dev), buf.reshape(-1)[1:1 + 33 * 64].view(33, 64), None, None),
        ("bias_strided", _t(7, 64, dev=dev), _t(33, 64, dev=dev), _t(66, dev=dev)[::2], "gelu"),
        ("nan_inf", torch.tensor([[float("nan"), 1.0], [float("inf"), 2.0], [1.0, 2.0]], device=dev),
         _t(3, 2, dev=dev), _t(3, dev=dev), None),
        ("leading_dims", _t(2, 3, 4, 16, dev=dev), _t(9, 16, dev=dev), _t(9, dev=dev), "relu"),
        ("float64", _t(3, 8, dev=dev, dtype=torch.float64), _t(5, 8, dev=dev, dtype=torch.float64), None, "gelu"),
        ("huge_k", _t(1, 1 << 17, dev=dev), _t(2, 1 << 17, dev=dev) / 300, _t(2, dev=dev), None),
        ("m_top_of_last_range", _t(16384, 8, dev=dev), _t(4, 8, dev=dev), _t(4, dev=dev), None),
        ("m_past_last_range", _t(16385, 8, dev=dev), _t(4, 8, dev=dev), _t(4, dev=dev), None),
    ]


RESULT_IDS = [r[0] for r in _results("cpu")]


def _reference(x, w, b, act):
    return apply_activation(F.linear(x.double(), w.double(), b.double() if b is not None else None),
                            Activation.parse(act))


def _check_result(got, ref, x, what):
    assert got.shape == ref.shape and got.dtype == x.dtype and got.device == x.device, what
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN positions differ from F.linear's"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: Inf positions differ from F.linear's"
    if finite.any():
        tol = 1e-2 if x.device.type == "cuda" and x.dtype == torch.float32 else 1e-4  # cuda fp32 may be TF32
        torch.testing.assert_close(got[finite].double(), ref[finite], rtol=tol, atol=tol, msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(RESULT_IDS)), ids=RESULT_IDS)
def test_results_match_f_linear(idx):
    _, x, w, b, act = _results("cuda")[idx]
    _check_result(hybridgemm.linear(x, w, b, act), _reference(x, w, b, act), x, "hybridgemm.linear")


def _kernel_config(backend: str, m: int, k: int):
    """A small config of ``backend`` that the interpreter runs quickly for these shapes: wide
    row blocks for many rows, long K blocks split 16 or 64 ways for a long K (and split-K
    split in two where K has two blocks, so its reduction runs too)."""
    long_k = k > 4096
    if backend == "triton_gemm":
        return TritonGemmConfig(block_m=256 if m > 4096 else 32, block_n=16, block_k=256 if long_k else 32,
                                group_m=8, num_warps=4, num_stages=2, persistent=False, use_tma=False,
                                split_k=16 if long_k else 1)
    block_k = 256 if long_k else 32
    split = 64 if long_k else max(1, min(2, -(-k // block_k)))  # a split needs a block of K each
    return TritonSplitKConfig(block_m=16, block_n=16, block_k=block_k, split_k=split, num_warps=4, num_stages=2,
                              fused_reduce=long_k)


def _cpu_result_params():
    out = []
    for idx, (name, x, *_rest) in enumerate(_results("cpu")):
        m = x.numel() // x.shape[-1] if x.shape[-1] else x.shape[0]
        for backend in ("triton_gemm", "triton_splitk"):
            if backend == "triton_splitk" and m > SPLITK_MAX_M:
                continue  # split-K is a decode kernel: never offered past M = 64
            out.append(pytest.param(idx, backend, id=f"{name}-{backend}"))
    return out


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # the interpreter's
@pytest.mark.parametrize("idx, backend", _cpu_result_params())
def test_results_through_the_decision_and_the_interpreter_kernels(idx, backend, fake_h200):
    """The CPU variant of the result cases (module docstring): the operands normalised as the
    dispatcher does (kernels/checks.py), the decision for the case's problem with a table whose
    entry for the case's key names ``backend``, and that entry's kernel under the interpreter."""
    name, x, w, b, act_name = _results("cpu")[idx]
    act = Activation.parse(act_name)
    ref = _reference(x, w, b, act_name)
    if x.dtype not in DTYPE_NAMES:  # float64: no kernel takes it, so a call goes to PyTorch
        with pytest.raises(TypeError, match="float64"):
            backends.get_backend(backend).run(_kernel_config(backend, 3, 8), x, w, b, torch.empty_like(ref), act)
        return
    x2, w2, b2 = checks.row_major(checks.rows_2d(x)), checks.row_major(w), checks.contiguous_bias(b)
    n = w.shape[0]
    out = torch.full((x2.shape[0], n), float("nan"), dtype=x.dtype)
    problem = Problem.from_tensors(x2, w2, b2, out, Epilogue(act, b is not None))
    cfg = _kernel_config(backend, problem.m, problem.k)
    if problem.m == 0 or problem.n == 0 or problem.k == 0:
        # rule 3: no decision, no GEMM (PyTorch's semantics); the kernels still take them
        assert "empty problem" in explain(tuple(x.shape), tuple(w.shape), x.dtype, b is not None, act_name)
        choice = None
    elif problem.m > M_MAX:  # past the last tuned range: no entry can hold it, F.linear runs
        with pytest.raises(ValueError, match="past the last tuned range"):
            TableKey.from_problem(problem)
        choice = decide.choose(problem, 0)
        assert (choice.backend, choice.source) == ("torch", "rule") and "no table entry" in choice.reason
        return
    else:
        key = TableKey.from_problem(problem)
        pts = [key.m_lo] if key.m_lo == key.m_hi else [key.m_lo, key.m_hi]
        table = TuningTable(FAKE_SIG)
        table.set(key, make_entry(backend, cfg.to_record(), m_points=pts, ratios=[1.1] * len(pts),
                                  median_us=5.0, spread_us=0.1))
        table.save(fake_h200 / f"{name}.json")
        decide.set_table_path(fake_h200 / f"{name}.json")
        choice = decide.choose(problem, 0)
        assert (choice.backend, choice.config, choice.source, choice.key) == (backend, cfg, "table", key.to_string())
    runner = backends.get_backend(backend if choice is None else choice.backend)
    assert runner.run(cfg if choice is None else choice.config, x2, w2, b2, out, act) is out
    _check_result(out.reshape(*x.shape[:-1], n), ref, x, f"{name} on {backend}")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True),
                                   (True, True, True)], ids=["x", "w", "b", "all"])
def test_requires_grad_combinations(needs, dev):
    x, w, b = _t(5, 7, dev=dev, dtype=torch.float64), _t(3, 7, dev=dev, dtype=torch.float64), \
        _t(3, dev=dev, dtype=torch.float64)
    for t, need in zip((x, w, b), needs):
        t.requires_grad_(need)
    hybridgemm.linear(x, w, b, "gelu").sum().backward()
    xr, wr, br = (t.detach().clone().requires_grad_(n) for t, n in zip((x, w, b), needs))
    F.gelu(F.linear(xr, wr, br)).sum().backward()
    for t, r, need in zip((x, w, b), (xr, wr, br), needs):
        assert (t.grad is None) == (not need)
        if need:
            torch.testing.assert_close(t.grad, r.grad)


def test_cli_errors_are_messages_not_tracebacks(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    assert cli_main(["explain", "--x", "4,100", "--w", "8,99"]) == 2
    assert "features" in capsys.readouterr().err
    assert cli_main(["show", str(tmp_path / "missing.json")]) == 1
    assert cli_main(["plot", str(tmp_path / "missing.csv"), "--out", str(tmp_path)]) != 0
    with pytest.raises(SystemExit):
        cli_main(["autotune", "--dtype", "int8"])
    with pytest.raises(SystemExit):  # removed option
        cli_main(["autotune", "--shape", "384,512", "--one-process"])
    capsys.readouterr()
    # M outside 1..16384: a message (on a machine without a GPU, that one is needed), no tuning
    for bad_m in ("0", "16385"):
        assert cli_main(["autotune", "--shape", "384,512", "--m", bad_m, "--out", str(tmp_path / "t.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridgemm autotune: ") and "Traceback" not in err
        assert not (tmp_path / "t.json").exists()
    # a table that is not a table: one error line, not a traceback
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\x00\xff not json")
    assert cli_main(["show", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hybridgemm show: error: {bad}: ") and "Traceback" not in err


@pytest.mark.gpu
def test_mixed_devices_are_refused():
    x, w = torch.randn(2, 3, device="cuda"), torch.randn(4, 3)
    for args in ((x, w), (x, w.cuda(), torch.randn(4)), (x, w.cuda(), torch.randn(1, 4))):
        with pytest.raises(RuntimeError):  # F.linear's error type for mixed devices
            F.linear(*args)
        with pytest.raises(LinearArgumentError, match="one device"):
            hybridgemm.linear(*args)
