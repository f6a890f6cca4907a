"""`hybridgemm show` and `hybridgemm explain` on bad input (CPU): every mistake is one line on
stderr and an exit code, never a traceback; strings from a table reach the terminal escaped."""

from __future__ import annotations

import json

import pytest
import torch
from tuning_tables import SIG

from hybridgemm import decide, explain
from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry
from hybridgemm.cli import main

KEY = TableKey("linear", "bf16", "bias", 6144, 4096, 9, 16, "c")
KEY_1 = TableKey("linear", "bf16", "bias", 6144, 4096, 1, 1, "c")
ESC = "\x1b[31m"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No user table of the machine, no HYBRIDGEMM_TABLE, and no explicit table left behind."""
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HYBRIDGEMM_TABLE", raising=False)
    yield
    decide.set_table_path(None)


def _save(path, signature=None, entries=None):
    t = TuningTable(signature or SIG)
    for key, entry in (entries or {}).items():
        t.set(key, entry)
    t.save(path)
    return path


def _entry(median_us=12.5, flinear_us=16.9, config=None):
    return make_entry("triton_splitk", config or {"kind": "x"}, m_points=[9, 12, 16], ratios=[1.41, 1.352, 1.5],
                      median_us=median_us, spread_us=0.2, flinear_us=flinear_us)


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _argparse_error(err: str, argument: str) -> None:
    """argparse's own error: its usage block, then one line naming the argument."""
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"hybridgemm explain: error: argument {argument}: ")
    assert sum("error:" in line for line in err.splitlines()) == 1


# ----------------------------------------------------------------------------- explain: arguments


@pytest.mark.parametrize("x", ["", ",", "16,,4096", "-16,4096", "0,4096", "16.5,4096", "x", "16,4096,", "1e3,4096"])
def test_explain_rejects_a_bad_x(x, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", f"--x={x}", "--w", "6144,4096"])
    assert exc.value.code == 2
    _argparse_error(capsys.readouterr().err, "--x")


@pytest.mark.parametrize("w", ["6144", "6144,4096,1", "6144,0", "-6144,4096", "6144,,4096", ""])
def test_explain_rejects_a_bad_w(w, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "--x", "16,4096", f"--w={w}"])
    assert exc.value.code == 2
    _argparse_error(capsys.readouterr().err, "--w")


@pytest.mark.parametrize("x", ["16,4096", "2,8,4096", "16x4096", "4096"])
def test_explain_takes_one_or_more_positive_ints(x, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU explanation")
    assert main(["explain", "--x", x, "--w", "6144,4096"]) == 0
    assert "N=6144 K=4096" in capsys.readouterr().out


def test_explain_k_mismatch_is_one_line(capsys):
    assert main(["explain", "--x", "16,4000", "--w", "6144,4096"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("hybridgemm explain: error: ") and "4000 features" in line


def test_explain_table_must_exist(tmp_path, capsys):
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--table", str(tmp_path / "nope.json")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == f"hybridgemm explain: error: {tmp_path / 'nope.json'}: no such file"


def test_explain_table_must_be_a_regular_file(tmp_path, capsys):
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--table", str(tmp_path)]) == 2
    assert "not a regular file" in _one_line(capsys.readouterr().err)


def test_explain_with_a_table_file(tmp_path, capsys):
    path = _save(tmp_path / "t.json", entries={KEY: _entry()})
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--table", str(path)]) == 0
    assert "M=16 N=6144 K=4096" in capsys.readouterr().out


# ----------------------------------------------------------------------------- explain(): the function


@pytest.mark.parametrize("dtype", ["os", "Tensor", "nn", "__name__", "tf32", "", 3, None, torch.Tensor])
def test_explain_function_rejects_a_dtype_that_is_not_one(dtype):
    with pytest.raises(ValueError, match="bf16, fp16, fp32, bfloat16, float16, float32, float64"):
        explain((16, 4096), (6144, 4096), dtype=dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "bfloat16", "float16", "float32", "float64",
                                   "torch.bfloat16", torch.float16])
def test_explain_function_takes_dtypes_and_their_names(dtype):
    assert "M=16 N=6144 K=4096" in explain((16, 4096), (6144, 4096), dtype=dtype)


def test_explain_function_on_cpu_says_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU explanation")
    text = explain((16, 4096), (6144, 4096), dtype="bf16")
    assert text.startswith("linear bf16 M=16 N=6144 K=4096 epilogue=bias") and "no CUDA device" in text


@pytest.mark.parametrize("x_shape, w_shape, match", [
    ((), (6144, 4096), "at least one dimension"),
    ("16,4096", (6144, 4096), "x_shape must be"),
    ((16, 4096.0), (6144, 4096), "x_shape must be"),
    ((16, -4096), (6144, -4096), "x_shape must be"),
    ((True, 4096), (6144, 4096), "x_shape must be"),
    (None, (6144, 4096), "x_shape must be"),
    ((16, 4096), (6144,), "two ints"),
    ((16, 4096), (1, 6144, 4096), "two ints"),
    ((16, 4096), "6144,4096", "w_shape must be"),
    ((16, 4000), (6144, 4096), "features"),
])
def test_explain_function_rejects_bad_shapes(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        explain(x_shape, w_shape)


# ----------------------------------------------------------------------------- show


def test_show_escapes_strings_from_the_table(tmp_path, capsys):
    sig = {**SIG, "gpu_name": f"NVIDIA {ESC}H200", "triton_version": "3.6\x1b]0;title\x07\n"}
    path = _save(tmp_path / "esc.json", sig, {KEY: _entry(config={"note": ESC})})
    assert main(["show", str(path)]) == 0
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out and "\x07" not in captured.out and "\x1b" not in captured.err
    assert "GPU NVIDIA \\x1b[31mH200" in captured.out and "Triton 3.6\\x1b]0;title\\x07\\n" in captured.out
    assert "linear|bf16|bias|N=6144|K=4096|M=9-16|c" in captured.out  # ordinary text stays readable


def test_show_escapes_a_hostile_key_in_its_error(tmp_path, capsys):
    path = _save(tmp_path / "t.json", entries={KEY: _entry()})
    doc = json.loads(path.read_text())
    doc["entries"][f"linear|bf16|{ESC}|N=1|K=1|M=1-1|c"] = doc["entries"].pop(KEY.to_string())
    path.write_text(json.dumps(doc))
    assert main(["show", str(path)]) == 1
    captured = capsys.readouterr()
    assert "\x1b" not in captured.err and "\x1b" not in captured.out
    assert _one_line(captured.err).startswith("hybridgemm show: error: ")


def test_show_median_us_zero_prints_a_row(tmp_path, capsys):
    path = _save(tmp_path / "zero.json", entries={KEY: _entry(median_us=0.0, flinear_us=0.0),
                                                   KEY_1: make_entry("cublaslt", {}, m_points=[1], ratios=[1.2],
                                                                     median_us=0.0, spread_us=0.0)})
    assert main(["show", str(path)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    rows = [line.split() for line in captured.out.splitlines() if line.strip().startswith("linear|")]
    assert rows == [["linear|bf16|bias|N=6144|K=4096|M=1-1|c", "cublaslt", "0.00", "-", "1.200x", "1"],
                    ["linear|bf16|bias|N=6144|K=4096|M=9-16|c", "triton_splitk", "0.00", "0.00", "1.352x", "9,12,16"]]


@pytest.mark.parametrize("content", [b'{"schema": 2, "signature": ', b"\x00\xff not json", b"[]",
                                     b'{"schema": 99, "signature": {}, "entries": {}}'])
def test_show_a_corrupt_explicit_table_is_one_line_and_exit_1(tmp_path, capsys, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    assert main(["show", str(path)]) == 1
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert line.startswith(f"hybridgemm show: error: {path}: ") and "linear|" not in captured.out


def test_show_an_explicit_directory_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 1
    assert "not a regular file" in _one_line(capsys.readouterr().err)


def test_show_a_missing_explicit_table_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(["show", str(tmp_path / "nope.json")]) == 1
    assert "no such file" in _one_line(capsys.readouterr().err)


def test_show_a_loader_failure_is_one_line(tmp_path, capsys, monkeypatch):
    path = _save(tmp_path / "t.json", entries={KEY: _entry()})

    def boom(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(TuningTable, "load", boom)
    assert main(["show", str(path)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("hybridgemm show: error: ") and "RecursionError" in line


def test_show_honours_hybridgemm_table_first(tmp_path, capsys, monkeypatch):
    path = _save(tmp_path / "env.json", entries={KEY: _entry()})
    monkeypatch.setenv("HYBRIDGEMM_TABLE", str(path))
    assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{path}: 1 entries; GPU NVIDIA H200")
    assert "linear|bf16|bias|N=6144|K=4096|M=9-16|c" in out


def test_show_a_corrupt_hybridgemm_table_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    path = tmp_path / "env.json"
    path.write_text("{not json")
    monkeypatch.setenv("HYBRIDGEMM_TABLE", str(path))
    assert main(["show"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert str(path) in line and "HYBRIDGEMM_TABLE" in line


def test_show_a_missing_hybridgemm_table_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_TABLE", str(tmp_path / "nope.json"))
    assert main(["show"]) == 1
    assert "no such file" in _one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- main: the last resort


@pytest.mark.parametrize("command", [["show"], ["explain", "--x", "16,4096", "--w", "6144,4096"]])
def test_an_unexpected_failure_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, command):
    path = _save(tmp_path / "t.json", entries={KEY: _entry()})
    monkeypatch.setenv("HYBRIDGEMM_TABLE", str(path))

    def boom(*args, **kwargs):
        raise KeyError("boom\nsecond line")

    monkeypatch.setattr("hybridgemm.cli.commands._print_table", boom)
    monkeypatch.setattr("hybridgemm.cli.commands.explain", boom)
    assert main(command) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"hybridgemm {command[0]}: error: KeyError: ")


def test_an_interrupt_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("hybridgemm.cli.commands.explain", interrupted)
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096"]) == 130
    assert _one_line(capsys.readouterr().err) == "hybridgemm explain: interrupted"


def test_version(capsys):
    import hybridgemm

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"hybridgemm {hybridgemm.__version__}"


# ----------------------------------------------------------------------------- autotune --tp: arguments


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama3-8b", "--tp", "0"], "--tp takes the number of tensor-parallel ranks (1 or more), got 0"),
    (["--model", "llama3-8b", "--tp", "3"], "llama3-8b: tp=3 does not divide the 32 attention heads"),
    (["--model", "qwen2.5-7b", "--tp", "8"], "qwen2.5-7b: tp=8 does not divide the 28 attention heads"),
    (["--shape", "6144,4096", "--tp", "2"], "--tp applies to --model and --hf-config"),
])
def test_autotune_tp_that_cannot_apply_is_one_line(argv, needle, capsys):
    assert main(["autotune", *argv]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("hybridgemm autotune: ") and needle in line and "needs a CUDA GPU" not in line


@pytest.mark.parametrize("tp", ["two", "1.5", ""])
def test_autotune_tp_must_be_an_integer(tp, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["autotune", "--model", "llama3-8b", f"--tp={tp}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --tp: invalid int value" in err.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_autotune_tp_that_splits_then_needs_a_gpu(capsys):
    assert main(["autotune", "--model", "llama3-70b", "--tp", "8"]) == 2
    assert "needs a CUDA GPU" in _one_line(capsys.readouterr().err)
