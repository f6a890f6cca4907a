"""README.md as a user reads it: short, its quick start runs as written (here on the CPU) and
computes what it says, its `explain` example hits the shipped table, its presets are the CLI's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridgemm.autotune_cache.presets import PRESETS
from hybridgemm.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _section(title: str) -> str:
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_stays_short():
    assert len(README.read_bytes()) <= 12 * 1024


def test_the_quick_start_runs_as_written_on_a_cpu(monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = re.search(r"```python\n(.*?)```", _section("Quick start"), re.S).group(1)
    ns: dict = {}
    torch.manual_seed(0)
    exec(compile(code, "README.md (quick start)", "exec"), ns)
    x, w, b = (ns[n].double() for n in ("x", "w", "b"))
    full = F.linear(x, w, b)
    assert _rel_err(ns["y"], F.gelu(full, approximate="tanh")) < 1e-5
    q, k, v = ns["q"], ns["k"], ns["v"]
    assert q.shape == (8, 28, 1, 128) and k.shape == v.shape == (8, 4, 1, 128)
    for got, cols in ((q, slice(0, 3584)), (k, slice(3584, 4096)), (v, slice(4096, 4608))):
        assert _rel_err(got.transpose(1, 2).reshape(8, 1, -1), full[..., cols]) < 1e-5
    assert ns["logits"].shape == (1, 8, 32000) and torch.isfinite(ns["logits"]).all()
    assert ns["report"].patched
    out = capsys.readouterr().out
    assert "hybridgemm.patch: patched" in out and "linear bf16 M=8 N=4608 K=3584 epilogue=bias" in out


def test_the_explain_example_hits_the_shipped_table(capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", "/nonexistent-hybridgemm-cache")
    line = re.search(r"^hybridgemm explain (--x \S+ --w \S+)", _section("Command line"), re.M).group(1)
    assert main(["explain", *line.split(), "--device", "h200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("  runs ") and "(table: tuned for M" in out[2] and "rule:" not in out[2]


def test_the_readme_names_every_preset():
    presets = _section("Command line")
    assert all(name in presets for name in PRESETS)
