"""The bad-input catalogue: every case either raises the named error with a message naming
the problem, or returns what F.linear (+ the activation) returns. Each case runs on the CPU,
and on the GPU (marker ``gpu``) where there is one; none may crash or hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from hybridgemm import AttentionProjection, attention_projection
from hybridgemm.cli import main as cli_main
from hybridgemm.kernels.epilogue import Activation, apply_activation

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _t(*shape, dev, dtype=torch.float32):
    return torch.randn(*shape, device=dev, dtype=dtype)


def _lin(x, w, b=None, act=None):
    return lambda: hybridgemm.linear(x, w, b, act)


# (id, builder(dev) -> (callable, reference or None), expected exception or None, message regex)
ERRORS = [
    ("dtype_mix", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d, dtype=torch.float16)), TypeError, "one dtype"),
    ("bias_dtype", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d), _t(4, dev=d, dtype=torch.float64)),
     TypeError, "bias=torch.float64"),
    ("weight_1d", lambda d: _lin(_t(2, 3, dev=d), _t(3, dev=d)), ValueError, "weight must be 2-D"),
    ("weight_3d", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, 1, dev=d)), ValueError, "weight must be 2-D"),
    ("x_scalar", lambda d: _lin(torch.tensor(1.0, device=d), _t(4, 1, dev=d)), ValueError, "scalar"),
    ("k_mismatch", lambda d: _lin(_t(2, 5, dev=d), _t(4, 3, dev=d)), ValueError, "input features"),
    ("bias_len", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d), _t(5, dev=d)), ValueError,
     r"bias must have shape \(4,\)"),
    ("bias_2d", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d), _t(1, 4, dev=d)), ValueError, "bias must have shape"),
    # (N, 1): its first dim matches N, so only the dimension check refuses it (else it would
    # broadcast per row, not per column, without a word)
    ("bias_column", lambda d: _lin(_t(2, 3, dev=d), _t(4, 3, dev=d), _t(4, 1, dev=d)), ValueError,
     r"bias must have shape \(4,\)"),
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
                                                          None, 2, 2), TypeError, "one dtype"),
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


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("idx", range(len(RESULT_IDS)), ids=RESULT_IDS)
def test_results_match_f_linear(idx, dev):
    _, x, w, b, act = _results(dev)[idx]
    got = hybridgemm.linear(x, w, b, act)
    ref = apply_activation(F.linear(x.double(), w.double(), b.double() if b is not None else None),
                           Activation.parse(act))
    assert got.shape == ref.shape and got.dtype == x.dtype and got.device == x.device
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN positions differ from F.linear's"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite), "Inf positions differ from F.linear's"
    if finite.any():
        tol = 1e-2 if x.device.type == "cuda" and x.dtype == torch.float32 else 1e-4  # cuda fp32 may be TF32
        torch.testing.assert_close(got[finite].double(), ref[finite], rtol=tol, atol=tol)


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
    with pytest.raises(ValueError, match="one device"):
        hybridgemm.linear(x, w)
    with pytest.raises(ValueError, match="one device"):
        hybridgemm.linear(x, w.cuda(), torch.randn(4))
