"""`hybridgemm show` and `hybridgemm explain` on what this machine can run (CPU): which
backends are available and why not, whether each table applies here and which of its entries
other library versions affect, and `explain --device` answering from a shipped table without
touching CUDA. Mistakes end with one line on stderr and exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from tuning_tables import SIG

import hybridgemm.autotune_cache.table as T
import hybridgemm.autotune_cache.table_document as D
import hybridgemm.autotune_cache.table_locations as L
from hybridgemm.autotune_cache import signature
from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry, shipped_table_for_device
from hybridgemm.cli import main
from hybridgemm.kernels import backends

SPLITK = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4,
          "num_stages": 4}
PINNED = {"kind": "cublaslt", "cublaslt_version": 130100, "algo_id": 66, "tile_name": "TILE_64x16",
          "stages_name": "STAGES_64xAUTO", "splitk": 1}
UPGRADED = {**SIG, "cublaslt_version": 130200, "triton_version": "3.8.0"}


def key(lo, hi, n=6144, k=4096, epi="bias"):
    return TableKey("linear", "bf16", epi, n, k, lo, hi, "c")


def tuned(k, backend, config, worst=1.25):
    pts = [k.m_lo] if k.m_lo == k.m_hi else [k.m_lo, (k.m_lo + k.m_hi) // 2, k.m_hi]
    return make_entry(backend, config, m_points=pts, ratios=[worst + 0.1] * (len(pts) - 1) + [worst], median_us=9.0,
                      spread_us=0.1, tuned_at="2026-11-29")


ENTRIES = {key(9, 16): ("triton_splitk", SPLITK), key(17, 32): ("cublaslt", PINNED),
           key(33, 64): ("cublaslt", {}), key(65, 128): ("torch", {})}


def save_table(path, sig=SIG, entries=ENTRIES):
    t = TuningTable(sig)
    for k, (backend, config) in entries.items():
        t.set(k, tuned(k, backend, config))
    t.save(path)
    return path


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No user table of the machine, no HYBRIDGEMM_TABLE, shipped tables from tmp_path/shipped
    (an H200 table like the real one), and every backend's availability as faked here."""
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HYBRIDGEMM_TABLE", raising=False)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    save_table(shipped / "h200.json")
    monkeypatch.setattr(L, "shipped_table_dir", lambda: shipped)
    monkeypatch.setattr(D, "_warned", set())
    monkeypatch.setattr(backends, "unavailable_backends", lambda: {
        "cublaslt": "nvmath-python is not installed (pip install nvmath-python)", "triton_gemm": "no CUDA device"})
    return shipped


def running(monkeypatch, sig):
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: None if sig is None else dict(sig))


def no_cuda_allowed(monkeypatch):
    """Any question to CUDA fails the test: `explain --device` must not ask."""
    def refuse(*args, **kwargs):
        raise AssertionError("CUDA was asked")

    for name in ("is_available", "current_device", "get_device_properties", "get_device_name", "device_count",
                 "init"):
        monkeypatch.setattr(torch.cuda, name, refuse)


# ----------------------------------------------------------------------------- backends


def backend_lines(out: str) -> list[str]:
    lines = out.splitlines()
    at = lines.index("backends on this machine:")
    return [line.split(None, 1) for line in lines[at + 1: at + 4]]


def test_show_lists_backends_and_why_the_unavailable_ones_are(capsys, monkeypatch):
    running(monkeypatch, None)
    assert main(["show"]) == 0
    assert backend_lines(capsys.readouterr().out) == [
        ["cublaslt", "unavailable: nvmath-python is not installed (pip install nvmath-python)"],
        ["triton_splitk", "available"],
        ["triton_gemm", "unavailable: no CUDA device"]]


def test_explain_lists_backends_too(capsys):
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096"]) == 0
    out = capsys.readouterr().out
    assert "M=16 N=6144 K=4096" in out
    assert backend_lines(out)[0] == ["cublaslt", "unavailable: nvmath-python is not installed (pip install "
                                                 "nvmath-python)"]


def test_show_of_a_table_names_the_backends_after_it(tmp_path, capsys, monkeypatch):
    running(monkeypatch, None)
    path = save_table(tmp_path / "t.json")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{path}: 4 entries; GPU NVIDIA H200")
    assert "backends on this machine:" in out


# ----------------------------------------------------------------------------- does a table apply here


def applicability(out: str, path) -> list[str]:
    """The lines between a table's header and its column titles."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{path}:"))
    end = next(i for i in range(at + 1, len(lines)) if lines[i].lstrip().startswith("key "))
    return [line.strip() for line in lines[at + 1: end]]


@pytest.mark.parametrize("sig, expected", [
    (None, ["does not apply here: no CUDA GPU on this machine"]),
    (SIG, ["applies here"]),
    ({**SIG, "gpu_name": "NVIDIA H100 80GB HBM3"}, ["does not apply here: other GPU (gpu_name differs: table has "
                                                   "'NVIDIA H200', this device has 'NVIDIA H100 80GB HBM3')"]),
    ({**SIG, "sm_count": 114}, ["does not apply here: other SM count (sm_count differs: table has 132, this device "
                                "has 114)"]),
    (UPGRADED, ["applies here, in part:",
                "Triton configs tuned under Triton 3.6.0 (here 3.8.0): 1 entry checked once against an fp32 "
                "reference before first use",
                "cuBLASLt records tuned under cuBLASLt 130100 (here 130200): 1 entry run F.linear"]),
    ({**SIG, "cublaslt_version": None}, ["applies here, in part:",
                                         "cuBLASLt is not available here: its 2 entries run F.linear"]),
])
def test_show_says_per_table_whether_it_applies_here(tmp_path, capsys, monkeypatch, _isolated, sig, expected):
    running(monkeypatch, sig)
    user = save_table(T.user_table_path())
    assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert applicability(out, user) == expected
    assert applicability(out, _isolated / "h200.json") == expected


def test_show_when_the_device_cannot_be_read(capsys, monkeypatch, _isolated):
    def broken(device_index=None):
        raise RuntimeError("driver gone")

    monkeypatch.setattr(signature, "current_signature", broken)
    assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert applicability(out, _isolated / "h200.json") == [
        "does not apply here: the GPU's facts could not be read (RuntimeError: driver gone)"]


def test_show_rows_keep_their_columns_with_the_notes(tmp_path, capsys, monkeypatch):
    running(monkeypatch, UPGRADED)
    path = save_table(tmp_path / "t.json")
    assert main(["show", str(path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("linear|")]
    assert [r[:2] for r in rows] == [[key(9, 16).to_string(), "triton_splitk"], [key(17, 32).to_string(), "cublaslt"],
                                     [key(33, 64).to_string(), "cublaslt"], [key(65, 128).to_string(), "torch"]]


# ----------------------------------------------------------------------------- explain --device


def device_explain(capsys, *argv) -> list[str]:
    assert main(["explain", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out.splitlines()


@pytest.mark.parametrize("name", ["h200", "H200", "NVIDIA H200", "nvidia-h200", " H200 "])
def test_device_names_match_the_shipped_table(name, _isolated):
    assert shipped_table_for_device(name) == _isolated / "h200.json"


@pytest.mark.parametrize("name", ["h20", "h100", "", "nvidia", "h200.json", "/tmp/h200"])
def test_other_names_match_nothing(name):
    assert shipped_table_for_device(name) is None


def test_explain_device_a_triton_entry(capsys, monkeypatch):
    no_cuda_allowed(monkeypatch)
    out = device_explain(capsys, "--x", "2,6,4096", "--w", "6144,4096", "--device", "h200")
    assert out[0] == ("linear bf16 M=12 N=6144 K=4096 epilogue=bias, on an NVIDIA H200 (132 SMs) with cuBLASLt "
                      "130100 and Triton 3.6.0 (shipped table h200.json)")
    assert out[1] == "  key linear|bf16|bias|N=6144|K=4096|M=9-16|c"
    assert out[2] == ("  runs triton_splitk [block_k=128 block_m=16 block_n=64 num_stages=4 num_warps=4 split_k=4] "
                      "(table: tuned for M 9-16, timed at M=9,12,16: worst 1.250x F.linear's speed there)")
    assert "under another Triton than 3.6.0" in out[3]
    assert not any("backends on this machine" in line for line in out)  # about another machine, not this one


def test_explain_device_a_pinned_cublaslt_entry(capsys, monkeypatch):
    no_cuda_allowed(monkeypatch)
    out = device_explain(capsys, "--x", "20,4096", "--w", "6144,4096", "--device", "H200")
    assert out[2].startswith("  runs cublaslt [algo 66 TILE_64x16 STAGES_64xAUTO splitk=1] (table: tuned for M 17-32")
    assert out[3] == "  under another cuBLASLt than 130100 this entry runs F.linear"


def test_explain_device_the_heuristic_flinear_and_a_miss(capsys, monkeypatch):
    no_cuda_allowed(monkeypatch)
    assert device_explain(capsys, "--x", "40,4096", "--w", "6144,4096", "--device", "h200")[2].startswith(
        "  runs cublaslt [heuristic at the exact M] (table: tuned for M 33-64")
    out = device_explain(capsys, "--x", "100,4096", "--w", "6144,4096", "--device", "h200")
    assert out[2].startswith("  runs torch (table: tuned for M 65-128") and out[2].endswith("; runs F.linear)")
    misses = {  # what the table lacks, and what it holds instead
        ("--x", "200,4096"): "no entry of this shape holds M=200 (its ranges: 9-16, 17-32, 33-64, 65-128)",
        ("--x", "20000,4096"): "M=20000 is past the table's ranges (M 1-16384)",
        ("--x", "16,4096", "--no-bias"): "the table has no entry for N=6144 K=4096 with bf16 and epilogue none; "
                                         "it holds bf16 epilogue bias",
        ("--x", "16,4096", "--dtype", "fp16"): "the table has no entry for N=6144 K=4096 with fp16 and epilogue "
                                               "bias; it holds bf16 epilogue bias",
        ("--x", "16,4096", "--activation", "relu"): "the table has no entry for N=6144 K=4096 with bf16 and "
                                                    "epilogue bias+relu; it holds bf16 epilogue bias",
    }
    for argv, why in misses.items():
        out = device_explain(capsys, *argv, "--w", "6144,4096", "--device", "h200")
        assert out[2] == f"  runs torch (rule: {why}; F.linear)", argv
    out = device_explain(capsys, "--x", "16,1024", "--w", "512,1024", "--device", "h200")
    assert out[2] == ("  runs torch (rule: the table has no entry for N=512 K=1024 with bf16 and epilogue bias, nor "
                      "any for this N, K (`hybridgemm autotune --shape 512,1024` on that GPU tunes it); F.linear)")


def test_explain_device_says_what_an_fp8_weight_without_an_entry_runs(capsys):
    """No entry for an FP8 weight: the split-K kernel streaming e4m3 at decode rows (the rule
    decide.choose_fp8 takes) where split-K can run the shape, the dequantized weight's path past
    them; never plain F.linear. With --activations fp8 past the decode rows: W8A8 on cuBLASLt."""
    head = ("  runs triton_splitk (rule: the table has no entry for N=512 K=1024 with bf16 and epilogue none, "
            "nor any for this N, K")
    for m in (1, 64):
        out = device_explain(capsys, "--x", f"{m},1024", "--w", "512,1024", "--no-bias", "--weights", "fp8",
                             "--activations", "fp8", "--device", "h200")
        assert out[1] == f"  key linear_e4m3_channel|bf16|none|N=512|K=1024|c at M={m}"
        assert out[2].startswith(head) and out[2].endswith(f"M={m} <= 64: the split-K kernel streaming e4m3, "
                                                           "its default config)"), out
        assert out[3].startswith("  activations='fp8': x as it is (W8A16)"), out
    dequantized = ("the weight dequantized to fp16 in one pass, then fp16's decision for this N, K: the same "
                   "`hybridgemm explain --device` without --weights)")
    argv = ("--x", "65,1024", "--w", "512,1024", "--no-bias", "--weights", "fp8", "--granularity", "block128",
            "--dtype", "fp16", "--device", "h200")
    out = device_explain(capsys, *argv)
    assert out[1] == "  key linear_e4m3_block128|fp16|none|N=512|K=1024|c at M=65"
    assert out[2].startswith("  runs torch (rule: the table has no entry") and out[2].endswith(dequantized), out
    assert len(out) == 3
    out = device_explain(capsys, *argv, "--activations", "fp8")
    assert out[3] == ("  activations='fp8': instead, x quantized to e4m3 per 1x128 block and cuBLASLt's FP8 GEMM on "
                      "both (W8A8) where cuBLASLt has an FP8 algorithm for the call; where not, the above, with one "
                      "warning"), out
    # a shape split-K cannot take (2^31 weight elements and more): the dequantized path at M = 1 too
    out = device_explain(capsys, "--x", "1,8192", "--w", "262144,8192", "--no-bias", "--weights", "fp8",
                         "--device", "h200")
    assert out[2].startswith("  runs torch (rule: the table has no entry") and "dequantized to bf16" in out[2], out


def test_explain_device_names_the_epilogue_the_shipped_table_holds(capsys, monkeypatch):
    """The README's example (6144 x 4096 with the default bias) on the real shipped table:
    llama3-8b's QKV has no bias, and the answer says so and names the flag that asks for it."""
    monkeypatch.undo()
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", "/nonexistent-hybridgemm-cache")
    no_cuda_allowed(monkeypatch)
    out = device_explain(capsys, "--x", "16,4096", "--w", "6144,4096", "--device", "h200")
    assert out[2] == ("  runs torch (rule: the table has no entry for N=6144 K=4096 with bf16 and epilogue bias; it "
                      "holds bf16 epilogue none (--no-bias); F.linear)")
    out = device_explain(capsys, "--x", "16,4096", "--w", "6144,4096", "--no-bias", "--device", "h200")
    assert out[1] == "  key linear|bf16|none|N=6144|K=4096|M=9-16|c" and out[2].startswith("  runs triton_splitk")


def test_explain_device_from_the_real_shipped_table(capsys, monkeypatch):
    """The answer for every entry of the real shipped H200 table is the entry itself."""
    monkeypatch.undo()  # the real shipped tables, and nothing faked
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", "/nonexistent-hybridgemm-cache")
    no_cuda_allowed(monkeypatch)
    path = T.shipped_table_for_device("h200")
    assert path is not None and path.parent == L.shipped_table_dir()
    table = TuningTable.load(path, strict=True)
    # (the MoE and gated kernels' entries are not linear calls: explain_moe and choose_gated answer for them)
    entries = sorted(((k, e) for k, e in table.entries.items() if k.op.startswith("linear")),
                     key=lambda item: item[0].to_string())
    assert any(k.op == "linear_e4m3_channel" for k, _ in entries[::17])
    fp8_seen = set()
    for k, e in entries[::17]:
        parts = k.epilogue.split("+")  # none, bias, an activation, or bias+activation
        acts = [p for p in parts if p not in ("none", "bias")]
        argv = ["--x", f"{k.m_hi},{k.k}", "--w", f"{k.n},{k.k}"] + ([] if "bias" in parts else ["--no-bias"])
        argv += ["--activation", *acts] if acts else []
        if k.op != "linear":  # an FP8 weight's key (op linear_e4m3_<granularity>), W8A8 asked for
            argv += ["--weights", "fp8", "--granularity", k.op.rpartition("_")[2], "--activations", "fp8"]
        out = device_explain(capsys, *argv, "--device", "h200")
        assert out[1] == f"  key {k.to_string()}"
        assert out[2].startswith(f"  runs {e['backend']}") and f"worst {e['worst_ratio']:.3f}x" in out[2]
        if k.op != "linear":
            w8a8 = k.m_hi > 64 and e["backend"] not in backends.FP8_BACKENDS
            assert out[3].startswith("  activations='fp8': " + ("instead, x quantized" if w8a8 else "x as it is"))
            fp8_seen.add(w8a8)
    assert fp8_seen == {True, False}  # FP8 entries at decode rows and past them


def test_explain_device_unknown_is_one_line_and_exit_2(capsys):
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--device", "a100"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == ("hybridgemm explain: error: --device a100: no shipped table for this GPU; known devices: "
                    "h200 (NVIDIA H200)")


def test_explain_device_escapes_the_name(capsys):
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--device", "\x1b[31mx"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[31mx" in one_line(err)


def test_explain_device_k_mismatch_is_one_line_and_exit_2(capsys):
    assert main(["explain", "--x", "16,4000", "--w", "6144,4096", "--device", "h200"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("hybridgemm explain: error: ") and "4000 features" in line


def test_explain_device_with_a_corrupt_shipped_table_is_one_line_and_exit_2(capsys, _isolated):
    (_isolated / "h200.json").write_text(json.dumps({"schema": 2, "signature": SIG, "entries": []}))
    (_isolated / "h100.json").write_text("{not json")
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--device", "h200"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("hybridgemm explain: error: ") and "h200.json" in line and "entries" in line
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--device", "h100"]) == 2
    assert "h100.json" in one_line(capsys.readouterr().err)
    assert main(["explain", "--x", "16,4096", "--w", "6144,4096", "--device", "a100"]) == 2
    assert one_line(capsys.readouterr().err).endswith("known devices: h100, h200")


def test_explain_device_and_table_do_not_combine(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "--x", "16,4096", "--w", "6144,4096", "--device", "h200", "--table", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not allowed with argument" in err.splitlines()[-1]
