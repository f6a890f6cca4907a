"""Every bad argument of the `hybridgemm` command ends with one line on stderr naming the bad
value and exit code 2, never a traceback, and before any GPU is asked for; `explain` reports
a bad table as `show` does; the main job on a CPU summarises the shipped table and redraws
the README's figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridgemm import decide
from hybridgemm.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXPLAIN = ["explain", "--x", "16,4096", "--w", "6144,4096"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No user table of the machine, no HYBRIDGEMM_TABLE, no GPU (a check that waited for
    the GPU would say "needs a CUDA GPU" instead of naming the bad value)."""
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HYBRIDGEMM_TABLE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
    decide.set_table_path(None)


def _run(argv, capsys) -> tuple[int, str, str]:
    """``hybridgemm ARGV`` in this process: (exit code, stdout, stderr); argparse's exit too."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _bad_files(tmp_path) -> dict[str, tuple[Path, str]]:
    """A table path of each bad kind, and what the error line says about it."""
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"schema": 2, "signature": ')
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    return {"corrupt": (corrupt, "not valid JSON"), "missing": (tmp_path / "nope.json", "no such file"),
            "directory": (tmp_path, "not a regular file"), "fifo": (fifo, "not a regular file")}


# ----------------------------------------------------------------------------- one line, exit 2


CASES = [  # (argv, text the line must hold: the bad value)
    (["demo", "--m", "-1"], "'-1'"),
    (["demo", "--m", "0"], "'0'"),
    (["demo", "--k", "4096.5"], "'4096.5'"),
    (["demo", "--n", "1000000000000"], "1000000000000"),
    (["demo", "--m", "100000", "--n", "100000"], "M x N = 10000000000"),
    (["main", "--model", "bogus"], "'bogus'"),
    (["bench", "--model", "nope"], "'nope'"),
    (["bench", "--m-sweep", "--model", "nope"], "'nope'"),
    (["autotune", "--model", "llama3-8b", "--jobs", "0"], "--jobs"),
    (["autotune", "--model", "llama3-8b", "--jobs", "-2"], "got -2"),
    (["autotune", "--model", "llama3-8b", "--exhaustive", "-3"], "got -3"),
    (["autotune", "--model", "llama3-8b", "--epilogue", "bogus"], "'bogus'"),
    (["autotune", "--model", "llama3-8b", "--epilogue", "bias", "bias+bias"], "'bias+bias'"),
    (["autotune", "--model", "llama3-8b", "--split-depth", "-1"], "got -1"),
    (["autotune", "--model", "llama3-8b", "--dtype", "int8"], "'int8'"),
    (["autotune", "--model", "bogus"], "'bogus'"),
    (["autotune", "--model", "llama3-8b", "--weights", "fp4"], "'fp4'"),
    (["autotune", "--model", "llama3-8b", "--weights", "fp8", "--granularity", "block64"], "'block64'"),
    (["autotune", "--model", "llama3-8b", "--granularity", "block128"], "--granularity: only with --weights fp8"),
    (["autotune", "--model", "llama3-8b", "--quantize-lm-head"], "--quantize-lm-head: only with --weights fp8"),
    (["autotune", "--model", "llama3-8b", "--weights", "fp8", "--dtype", "bf16", "fp32"], "not fp32"),
    (["autotune", "--moe", "llama3-8b"], "llama3-8b has no experts"),
    (["autotune", "--moe", "qwen3-30b-a3b", "--m", "4"], "--moe tunes every M range"),
    (["autotune", "--moe", "qwen3-30b-a3b", "--dtype", "fp32"], "--moe tunes bf16 or fp16 experts"),
    (["autotune", "--moe", "bogus"], "'bogus'"),
    (["explain", "--x", "16,4096", "--w", "6144"], "'6144'"),
    ([*EXPLAIN, "--activations", "fp8"], "--activations fp8: only with --weights fp8"),
    ([*EXPLAIN, "--weights", "fp8", "--activations", "e4m3"], "--activations"),
    (["explain", "--x", "16,4000", "--w", "6144,4096"], "4000"),
    (["explain", *EXPLAIN[1:], "--dtype", "fp8"], "'fp8'"),
    (["frobnicate"], "'frobnicate'"),
]


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_argument_is_one_line_and_exit_2(argv, needle, capsys):
    rc, _, err = _run(argv, capsys)
    assert rc == 2
    line = _one_line(err)
    assert line.startswith(f"hybridgemm {argv[0] if argv[0] != 'frobnicate' else ''}".rstrip()), line
    assert needle in line and "needs a CUDA GPU" not in line, line


@pytest.mark.parametrize("command", ["autotune", "bench"])
def test_out_that_is_a_directory_is_one_line_and_exit_2(command, tmp_path, capsys):
    argv = [command, "--model", "llama3-8b", "--out", str(tmp_path)]
    rc, _, err = _run(argv, capsys)
    assert rc == 2
    line = _one_line(err)
    assert f"--out {tmp_path}: is a directory" in line and "needs a CUDA GPU" not in line


def test_autotune_out_below_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    rc, _, err = _run(["autotune", "--model", "llama3-8b", "--out", str(tmp_path / "file" / "t.json")], capsys)
    assert rc == 2 and f"{tmp_path / 'file'} is not a directory" in _one_line(err)


def test_good_options_still_reach_the_gpu_check(tmp_path, capsys):
    """The checks refuse only what is wrong: valid values go on to "needs a CUDA GPU"."""
    argv = ["autotune", "--model", "llama3-8b", "--jobs", "1", "--exhaustive", "0", "--epilogue", "none",
            "bias+gelu_tanh", "--out", str(tmp_path / "new" / "t.json")]
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and "needs a CUDA GPU" in _one_line(err)
    rc, _, err = _run(["autotune", "--model", "llama3-8b", "--weights", "fp8", "--granularity", "block128"], capsys)
    assert rc == 2 and "needs a CUDA GPU" in _one_line(err)
    rc, _, err = _run(["bench", "--model", "qwen2.5-7b", "--out", str(tmp_path / "b.csv")], capsys)
    assert rc == 2 and "needs a CUDA GPU" in _one_line(err)
    rc, _, err = _run(["autotune", "--moe", "qwen3-30b-a3b", "--moe", "mixtral-8x7b"], capsys)
    assert rc == 2 and "needs a CUDA GPU" in _one_line(err)
    rc, _, err = _run(["autotune", "--moe", "qwen3-30b-a3b", "--weights", "fp8", "--granularity", "block128"], capsys)
    assert rc == 2 and "needs a CUDA GPU" in _one_line(err)


def test_a_bad_demo_size_exits_2_in_a_fresh_process():
    """End to end, as a user runs it: no traceback from the allocator, one line."""
    proc = subprocess.run([sys.executable, "-m", "hybridgemm", "demo", "--n", "1000000000000"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert "1000000000000" in _one_line(proc.stderr) and proc.stdout == ""


# ----------------------------------------------------------------------------- explain's table, as show reports it


@pytest.mark.parametrize("kind", ["corrupt", "missing", "directory", "fifo"])
@pytest.mark.parametrize("source", ["argument", "HYBRIDGEMM_TABLE"])
def test_explain_reports_a_bad_table_as_show_does(kind, source, tmp_path, capsys, monkeypatch):
    path, reason = _bad_files(tmp_path)[kind]
    if source == "argument":
        show, explain = ["show", str(path)], [*EXPLAIN, "--table", str(path)]
    else:
        monkeypatch.setenv("HYBRIDGEMM_TABLE", str(path))
        show, explain = ["show"], EXPLAIN
    rc_show, _, err_show = _run(show, capsys)
    rc_explain, out, err_explain = _run(explain, capsys)
    assert rc_show == 1 and rc_explain == 2 and out == ""
    said_show = _one_line(err_show).removeprefix("hybridgemm show: error: ")
    said_explain = _one_line(err_explain).removeprefix("hybridgemm explain: error: ")
    assert said_explain == said_show
    assert str(path) in said_explain and reason in said_explain
    assert ("HYBRIDGEMM_TABLE" in said_explain) == (source == "HYBRIDGEMM_TABLE")


def test_explain_with_a_good_hybridgemm_table_runs(tmp_path, capsys, monkeypatch):
    from hybridgemm.autotune_cache.table import TuningTable

    path = tmp_path / "t.json"
    TuningTable({"schema": 2, "kernel_abi": 1, "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
                 "sm_count": 132, "cublaslt_version": 130100, "triton_version": "3.6.0", "torch_version": "2.11.0",
                 "package_version": "0.1.0"}).save(path)
    monkeypatch.setenv("HYBRIDGEMM_TABLE", str(path))
    rc, out, err = _run(EXPLAIN, capsys)
    assert rc == 0 and "M=16 N=6144 K=4096" in out and err == ""


# ----------------------------------------------------------------------------- the main job on a CPU


def _embedded_figures() -> set[str]:
    text = (ROOT / "README.md").read_text() + (ROOT / "perf/results/h200/README.md").read_text()
    return set(re.findall(r"!\[[^\]]*\]\((?:[^)]*/)?plots/([^)/]+\.png)\)", text))


def test_the_main_job_summarises_the_table_and_draws_the_readme_figures(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(["main"], capsys)
    assert rc == 0, err
    assert "rel err vs fp64" in out and "(ok)" in out
    assert not re.search(r"^\s+linear\|", out, re.M)  # counts, not the entries (`show` lists them)
    from hybridgemm.autotune_cache.table import TuningTable, shipped_table_paths

    for path in shipped_table_paths():
        table = TuningTable.load(path)
        head = next(line for line in out.splitlines() if line.startswith(f"{path}: "))
        assert head.startswith(f"{path}: {len(table)} entries;")
        by_backend = re.search(rf"{re.escape(head)}\n(?:.*\n)*?  by backend: (.*)", out).group(1)
        counts = dict(re.findall(r"(\w+) (\d+)", by_backend))
        backends = {}
        for entry in table.entries.values():
            backends[entry["backend"]] = backends.get(entry["backend"], 0) + 1
        assert {k: int(v) for k, v in counts.items()} == backends
    assert re.search(r"^  llama3-8b\s+\d+\s+\d+\s+\d+$", out, re.M)  # attention, MLP+LM head, tp=2
    drawn = {p.name for p in (tmp_path / "out" / "plots").iterdir()}
    assert _embedded_figures() <= drawn
    assert "hybridgemm plot " in out and "--out out/plots" in out


def test_show_still_lists_every_entry(capsys):
    from hybridgemm.autotune_cache.table import TuningTable, shipped_table_paths

    rc, out, _ = _run(["show"], capsys)
    assert rc == 0
    fp8 = "(_e4m3_channel|_e4m3_block128)?"
    ops = rf"linear{fp8}|moe_silu_e[0-9]+_k[0-9]+{fp8}|glu(_rms|_rms32)?"
    listed = len(re.findall(rf"^\s+({ops})\|", out, re.M))
    assert listed == sum(len(TuningTable.load(p)) for p in shipped_table_paths())


def test_block_scaled_fp8_experts_need_whole_blocks_in_each_half(capsys, monkeypatch):
    from dataclasses import replace

    from hybridgemm.autotune_cache import presets

    monkeypatch.setitem(presets.PRESETS, "odd-moe", replace(presets.PRESETS["qwen3-30b-a3b"], name="odd-moe",
                                                            expert_intermediate=1408 + 64))
    rc, _, err = _run(["autotune", "--moe", "odd-moe", "--weights", "fp8", "--granularity", "block128"], capsys)
    assert rc == 2 and "odd-moe: block-scaled FP8 gate/up weights need I a multiple of 128" in _one_line(err)
    rc, _, err = _run(["autotune", "--moe", "odd-moe", "--weights", "fp8"], capsys)  # per channel: any I
    assert rc == 2 and "needs a CUDA GPU" in _one_line(err)
