"""Tables across library upgrades, on the CPU: which signature fields make a table apply at
all (GPU model, SM count, ...) and which are judged entry by entry (cuBLASLt and Triton
versions); the one-time correctness probe of a Triton config tuned under another Triton; and
why a backend is unavailable (said once).

The running device is a signature handed to the loaders (or a faked ``current_signature``);
the probe runs on the CPU (fake backends, and one Triton config under the interpreter)."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
from tuning_tables import SIG

import hybridgemm.autotune_cache.table as T
import hybridgemm.autotune_cache.table_document as D
from hybridgemm.autotune_cache import probe, signature, tune_table
from hybridgemm.autotune_cache.signature import FLINEAR, PROBE, USE, entry_verdict, why_not_applicable
from hybridgemm.autotune_cache.table import (
    HybridGemmTableWarning,
    TableKey,
    TuningTable,
    load_tables,
    make_entry,
    parse_document,
)
from hybridgemm.kernels import backends
from hybridgemm.kernels.backends import Backend
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.problem import Problem

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

UPGRADED = {**SIG, "cublaslt_version": 130200, "triton_version": "3.8.0", "torch_version": "2.14.1"}
SPLITK = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4,
          "num_stages": 4}
PINNED = {"kind": "cublaslt", "cublaslt_version": 130100, "algo_id": 66, "tile_name": "TILE_64x16",
          "stages_name": "STAGES_64xAUTO", "splitk": 1}


def key(lo, hi, n=6144, k=4096):
    return TableKey("linear", "bf16", "bias", n, k, lo, hi, "c")


def tuned(k, backend, config):
    pts = [k.m_lo] if k.m_lo == k.m_hi else [k.m_lo, k.m_hi]
    return make_entry(backend, config, m_points=pts, ratios=[1.2] * len(pts), median_us=9.0, spread_us=0.1,
                      tuned_at="2026-11-29")


# One entry of each kind: Triton, pinned cuBLASLt, cuBLASLt's heuristic, F.linear.
K_TRITON, K_PINNED, K_HEUR, K_TORCH = key(1, 1), key(2, 2), key(3, 4), key(5, 8)
ENTRIES = {K_TRITON: ("triton_splitk", SPLITK), K_PINNED: ("cublaslt", PINNED), K_HEUR: ("cublaslt", {}),
           K_TORCH: ("torch", {})}


def save_table(path, sig=SIG, entries=ENTRIES):
    t = TuningTable(sig)
    for k, (backend, config) in entries.items():
        t.set(k, tuned(k, backend, config))
    t.save(path)
    return path


def statuses(table, running=None):
    return {k: table.entry_status(k, running)[0] for k in table.entries}


def version_warnings(records):
    return [str(w.message) for w in records
            if issubclass(w.category, HybridGemmTableWarning) and "tuned under" in str(w.message)]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HYBRIDGEMM_TABLE", raising=False)
    monkeypatch.setattr(D, "_warned", set())  # warn-once memory, per test


# ----------------------------------------------------------------------------- the signature split


def test_library_versions_do_not_reject_a_table():
    assert signature.signature_matches(SIG, UPGRADED) == (True, "")
    assert signature.signature_matches(SIG, {**UPGRADED, "cublaslt_version": None, "triton_version": None})[0]


@pytest.mark.parametrize("field, value, words", [
    ("gpu_name", "NVIDIA H100 80GB HBM3", "other GPU"),
    ("sm_count", 114, "other SM count"),
    ("compute_capability", "9.1", "other compute capability"),
    ("kernel_abi", signature.KERNEL_ABI + 1, "other kernel ABI"),
])
def test_device_fields_must_match(field, value, words):
    ok, reason = signature.signature_matches(SIG, {**UPGRADED, field: value})
    assert not ok and reason.startswith(field)
    assert why_not_applicable(SIG, {**UPGRADED, field: value}).startswith(words)
    assert why_not_applicable(SIG, UPGRADED) == ""
    assert why_not_applicable(SIG, None) == "no CUDA GPU on this machine"


@pytest.mark.parametrize("backend, config, tuned, running, expected", [
    ("triton_splitk", SPLITK, "3.6.0", SIG, USE),
    ("triton_splitk", SPLITK, "3.6.0", UPGRADED, PROBE),
    ("triton_gemm", {"kind": "x"}, "3.6.0", UPGRADED, PROBE),
    ("triton_splitk", SPLITK, "3.6.0", {**SIG, "triton_version": None}, FLINEAR),
    ("cublaslt", PINNED, None, SIG, USE),
    ("cublaslt", PINNED, None, UPGRADED, FLINEAR),  # the tuner validated that algorithm, not another
    ("cublaslt", {**PINNED, "cublaslt_version": None}, None, SIG, FLINEAR),
    ("cublaslt", {}, None, UPGRADED, USE),  # the heuristic is asked of the running cuBLASLt
    ("cublaslt", {}, None, {**SIG, "cublaslt_version": None}, FLINEAR),
    ("torch", {}, None, {**SIG, "cublaslt_version": None, "triton_version": None}, USE),
])
def test_entry_verdict(backend, config, tuned, running, expected):
    status, reason = entry_verdict(backend, config, tuned, running)
    assert status == expected and (reason == "") == (status == USE)


def test_a_table_of_older_libraries_applies_entry_by_entry(tmp_path):
    path = save_table(tmp_path / "t.json")
    t = TuningTable.load(path, UPGRADED)
    assert len(t) == 4 and t.signature == UPGRADED
    assert statuses(t) == {K_TRITON: PROBE, K_PINNED: FLINEAR, K_HEUR: USE, K_TORCH: USE}
    assert t.foreign_triton and t.tuned_triton(K_TRITON) == "3.6.0" and t.tuned_triton(K_TORCH) is None
    assert "tuned under cuBLASLt 130100, this process runs 130200" in t.entry_status(K_PINNED)[1]
    assert "Triton 3.6.0" in t.entry_status(K_TRITON)[1]
    native = TuningTable.load(path, SIG)
    assert set(statuses(native).values()) == {USE} and not native.foreign_triton
    effects = [e.describe() for e in t.version_effects()]
    assert effects == ["Triton configs tuned under Triton 3.6.0 (here 3.8.0): 1 entry checked once against an "
                       "fp32 reference before first use",
                       "cuBLASLt records tuned under cuBLASLt 130100 (here 130200): 1 entry run F.linear"]
    assert native.version_effects() == []


def test_a_table_for_another_gpu_or_sm_count_does_not_apply(tmp_path):
    path = save_table(tmp_path / "t.json")
    for field, value in (("gpu_name", "NVIDIA H100"), ("sm_count", 114)):
        with pytest.warns(HybridGemmTableWarning, match=field):
            assert len(TuningTable.load(path, {**UPGRADED, field: value})) == 0
        D._warned.clear()


def test_load_tables_warns_once_per_table_with_counts(tmp_path):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    save_table(shipped / "h200.json")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        merged = load_tables(UPGRADED, shipped_dir=shipped)
        load_tables(UPGRADED, shipped_dir=shipped)  # the same table again: no second warning
    messages = version_warnings(rec)
    assert len(messages) == 1, messages
    assert "h200.json" in messages[0] and "1 entry checked once" in messages[0]
    assert "cuBLASLt 130100 (here 130200): 1 entry run F.linear" in messages[0]
    assert "hybridgemm autotune" in messages[0]
    assert statuses(merged) == {K_TRITON: PROBE, K_PINNED: FLINEAR, K_HEUR: USE, K_TORCH: USE}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        load_tables(SIG, shipped_dir=shipped)  # the versions it was tuned under: nothing to say
    assert version_warnings(rec) == []


def test_without_cublaslt_its_entries_run_flinear_and_the_table_warning_leaves_it_to_the_backend_warning(tmp_path):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    save_table(shipped / "h200.json")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        merged = load_tables({**SIG, "cublaslt_version": None}, shipped_dir=shipped)
    assert version_warnings(rec) == []
    assert statuses(merged) == {K_TRITON: USE, K_PINNED: FLINEAR, K_HEUR: FLINEAR, K_TORCH: USE}
    assert [e.describe() for e in merged.version_effects()] == [
        "cuBLASLt is not available here: its 2 entries run F.linear"]


def test_a_merged_view_keeps_what_each_entry_was_tuned_under(tmp_path):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    save_table(shipped / "h200.json")  # tuned under Triton 3.6.0
    save_table(T.user_table_path(), UPGRADED, {key(1, 1): ("triton_splitk", SPLITK),
                                               key(9, 16): ("triton_splitk", SPLITK)})  # re-tuned under 3.8.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = load_tables(UPGRADED, shipped_dir=shipped)
    assert merged.entry_status(key(1, 1))[0] == USE  # the user's, tuned under the running Triton
    assert merged.entry_status(key(9, 16))[0] == USE
    assert merged.entry_status(K_PINNED)[0] == FLINEAR
    assert merged.tuned_triton(key(1, 1)) == "3.8.0"


def test_saving_after_an_upgrade_keeps_each_entrys_triton(tmp_path):
    path = save_table(tmp_path / "t.json")
    t = TuningTable.load(path, UPGRADED)
    t.set(key(9, 16), tuned(key(9, 16), "triton_splitk", SPLITK))  # re-tuned under 3.8.0
    t.save(path)
    doc = json.loads(path.read_text())
    assert doc["signature"]["triton_version"] == "3.8.0"
    assert doc["entries"][K_TRITON.to_string()]["triton_version"] == "3.6.0"
    assert "triton_version" not in doc["entries"][key(9, 16).to_string()]
    assert doc["entries"][K_PINNED.to_string()]["config"]["cublaslt_version"] == 130100  # the record says
    again = TuningTable.load(path, UPGRADED)
    assert again.entry_status(K_TRITON)[0] == PROBE and again.entry_status(key(9, 16))[0] == USE
    back = TuningTable.load(path, SIG)  # under Triton 3.6.0 again: the re-tuned entry is the foreign one
    assert back.entry_status(K_TRITON)[0] == USE and back.entry_status(key(9, 16))[0] == PROBE
    assert TuningTable.load(path).dumps() == path.read_text()  # canonical: save -> load -> save is identical
    first = path.read_text()
    again.save(path)
    assert path.read_text() == first


def test_save_merges_a_disk_table_of_older_libraries(tmp_path):
    path = save_table(tmp_path / "t.json")
    t = TuningTable(UPGRADED)
    t.set(key(9, 16), tuned(key(9, 16), "triton_splitk", SPLITK))
    t.save(path)  # same GPU: merged, not replaced
    doc = json.loads(path.read_text())
    assert len(doc["entries"]) == 5
    assert doc["entries"][K_TRITON.to_string()]["triton_version"] == "3.6.0"


@pytest.mark.parametrize("backend, value", [("torch", "3.6.0"), ("cublaslt", "3.6.0"), ("triton_splitk", 36),
                                            ("triton_splitk", ""), ("triton_splitk", "3" * 41),
                                            ("triton_splitk", ["3.6.0"])])
def test_a_bad_triton_version_field_drops_its_entry(backend, value):
    text = TuningTable(SIG, {K_TRITON: tuned(K_TRITON, backend, SPLITK if backend != "torch" else {})}).dumps()
    doc = json.loads(text)
    doc["entries"][K_TRITON.to_string()]["triton_version"] = value
    parsed = parse_document(json.dumps(doc).encode())
    assert parsed.entries == {} and "triton_version" in parsed.dropped[0]


def test_autotune_re_tunes_entries_the_running_libraries_do_not_trust(tmp_path):
    path = save_table(tmp_path / "t.json")
    upgraded, native = TuningTable.load(path, UPGRADED), TuningTable.load(path, SIG)
    for k in ENTRIES:
        assert tune_table.covered(native, k)
    assert not tune_table.covered(upgraded, K_TRITON) and not tune_table.covered(upgraded, K_PINNED)
    assert tune_table.covered(upgraded, K_HEUR) and tune_table.covered(upgraded, K_TORCH)


# ----------------------------------------------------------------------------- the probe

PROBLEM = Problem(m=5, n=24, k=40, dtype=torch.float32, epilogue=Epilogue(Activation.RELU, True), ldx=40, ldw=40,
                  ldo=24)


def fake_backend(run):
    return Backend("triton_splitk", lambda: True, lambda p: [], lambda r, p: None, run, str)


def correct(config, x, w, b, out, act, tf32=False):
    out.copy_(apply_activation(torch.nn.functional.linear(x, w, b), act))
    return out


def test_probe_passes_a_correct_kernel():
    result = probe.probe_config(fake_backend(correct), None, PROBLEM, "cpu")
    assert result and result.ok and "relative error" in result.reason


@pytest.mark.parametrize("run, words", [
    (lambda c, x, w, b, out, act, tf32=False: out.copy_(correct(c, x, w, b, out.clone(), act) * 1.01),
     "relative error"),
    (lambda c, x, w, b, out, act, tf32=False: out, "relative error"),  # never wrote: the NaN poison stays
    (lambda c, x, w, b, out, act, tf32=False: 1 / 0, "ZeroDivisionError"),
])
def test_probe_fails_a_wrong_or_failing_kernel(run, words):
    result = probe.probe_config(fake_backend(run), None, PROBLEM, "cpu")
    assert not result and words in result.reason and result.cached


def test_probe_operands_have_the_problems_layout():
    p = Problem(m=6, n=10, k=12, dtype=torch.float16, epilogue=Epilogue(Activation.NONE, True), ldx=20, ldw=16,
                ldo=14, align_x=2, align_w=4, align_out=8, align_bias=2)
    x, w, b, out = probe.operands(p, "cpu")
    assert x.shape == (6, 12) and x.stride() == (20, 1) and w.stride() == (16, 1) and out.stride() == (14, 1)
    for t, align in ((x, 2), (w, 4), (out, 8), (b, 2)):
        ptr = t.data_ptr()
        assert ptr % align == 0 and ptr % (2 * align) != 0
    assert torch.isnan(out).all() and torch.isfinite(x).all()


def test_probe_leaves_the_callers_random_state_alone():
    before = torch.get_rng_state()
    probe.probe_config(fake_backend(correct), None, PROBLEM, "cpu")
    assert torch.equal(before, torch.get_rng_state())


def test_probe_entry_runs_once_per_entry():
    probe.clear_cache()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return correct(*args, **kwargs)

    entry = tuned(K_TRITON, "triton_splitk", SPLITK)
    for _ in range(3):
        assert probe.probe_entry(K_TRITON, entry, fake_backend(counted), None, PROBLEM, "cpu")
    assert len(calls) == 1
    probe.clear_cache()


def test_probe_does_not_run_while_a_cuda_graph_is_captured(monkeypatch):
    probe.clear_cache()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    entry = tuned(K_TRITON, "triton_splitk", SPLITK)
    result = probe.probe_entry(K_TRITON, entry, fake_backend(correct), None, PROBLEM, "cuda:0")
    assert not result and not result.cached and "captured" in result.reason
    assert probe._cache == {}  # asked again later, it probes then


def test_probe_runs_a_real_triton_config():
    from hybridgemm.kernels import triton_splitk as ts

    cfg = ts.TritonSplitKConfig(block_m=16, block_n=16, block_k=16, split_k=2, num_warps=4, num_stages=2)
    p = Problem(m=3, n=32, k=64, dtype=torch.float16, epilogue=Epilogue(Activation.GELU_TANH, True), ldx=64,
                ldw=64, ldo=32)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert probe.probe_config(backends.get_backend("triton_splitk"), cfg, p, device)


@pytest.mark.parametrize("weight_format", ["e4m3_channel", "e4m3_block128"])
def test_probe_of_an_fp8_entry_runs_the_fp8_kernel_against_the_dequantized_weight(weight_format):
    """An FP8 entry tuned under another Triton is probed on e4m3 data with its scales: the real
    kernel passes; a kernel that ignores the scales (the bf16 path's arguments) fails."""
    from hybridgemm.kernels import triton_splitk as ts

    cfg = ts.TritonSplitKConfig(block_m=16, block_n=16, block_k=64, split_k=2, num_warps=4, num_stages=2)
    p = Problem(m=3, n=160, k=200, dtype=torch.float16, epilogue=Epilogue(Activation.NONE, True), ldx=200,
                ldw=200, ldo=160, weight_format=weight_format)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    real = backends.get_backend("triton_splitk")
    assert probe.probe_config(real, cfg, p, device)
    seen = []

    def unscaled(config, x, w, b, out, act, tf32=False, weight_scale=None):
        seen.append(weight_scale is not None)
        return real.run(config, x, w, b, out, act, tf32, weight_scale=torch.ones_like(weight_scale))

    result = probe.probe_config(fake_backend(unscaled), cfg, p, device)
    assert seen == [True] and not result and "relative error" in result.reason


# ----------------------------------------------------------------------------- unavailable backends


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(backends, "_warned_unavailable", type(backends._warned_unavailable)())


def test_on_a_cpu_every_backend_says_no_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU answer")
    missing = backends.unavailable_backends()
    assert list(missing) == list(backends.PREFERENCE)
    assert all("no CUDA device" in reason for reason in missing.values())


def test_nvmath_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvmath", None)
    monkeypatch.setattr(backends.lt, "is_available", lambda: False)
    reason = backends.unavailable_backends()["cublaslt"]
    assert reason.startswith("nvmath-python is not installed (pip install nvmath-python")


def test_nvmath_that_fails_to_import(monkeypatch):
    pytest.importorskip("nvmath")
    monkeypatch.setitem(sys.modules, "nvmath.bindings", None)
    monkeypatch.setattr(backends.lt, "is_available", lambda: False)
    reason = backends.unavailable_backends()["cublaslt"]
    assert reason.startswith("nvmath-python failed to import (") and "halted" in reason and "reinstall" in reason


def test_a_cublaslt_library_that_does_not_load(monkeypatch):
    cublas_lt = pytest.importorskip("nvmath.bindings.cublasLt")

    def broken():
        raise OSError("libcublasLt.so.13: cannot open shared object file")

    monkeypatch.setattr(cublas_lt, "get_version", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends.lt, "is_available", lambda: False)
    reason = backends.unavailable_backends()["cublaslt"]
    assert reason.startswith("libcublasLt could not be loaded (OSError: libcublasLt.so.13") and "cu13" in reason


@pytest.mark.parametrize("error, words", [
    (ModuleNotFoundError("No module named 'triton'", name="triton"), "Triton is not installed (pip install"),
    (ImportError("cannot import name 'TensorDescriptor' from 'triton.tools.tensor_descriptor'"),
     "lacks triton.tools.tensor_descriptor"),
    (RuntimeError("Triton cache directory is not writable"), "its module failed to import (RuntimeError: Triton"),
])
def test_triton_that_is_missing_too_old_or_broken(monkeypatch, error, words):
    real = backends.get_backend

    def get_backend(name):
        if name.startswith("triton"):
            raise error
        return real(name)

    monkeypatch.setattr(backends, "get_backend", get_backend)
    if "not installed" in words:
        monkeypatch.setattr(backends, "_module_missing", lambda name: name == "triton")
    missing = backends.unavailable_backends()
    assert words in missing["triton_gemm"] and words in missing["triton_splitk"]


def test_warn_unavailable_once_warns_once_naming_backend_reason_and_fix(monkeypatch, fresh_warning):
    monkeypatch.setattr(backends, "unavailable_backends",
                        lambda: {"cublaslt": "nvmath-python is not installed (pip install nvmath-python)"})
    with pytest.warns(backends.BackendUnavailableWarning) as rec:
        assert backends.warn_unavailable_once() == {"cublaslt": "nvmath-python is not installed (pip install "
                                                                "nvmath-python)"}
    assert len(rec) == 1
    message = str(rec[0].message)
    assert "cuBLASLt (cublaslt) unavailable: nvmath-python is not installed (pip install nvmath-python)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.warn_unavailable_once() == {}  # said once per process


def test_warn_unavailable_once_is_silent_when_every_backend_runs(monkeypatch, fresh_warning):
    monkeypatch.setattr(backends, "unavailable_backends", lambda: {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.warn_unavailable_once() == {}
        assert backends.warn_unavailable_once() == {}


def test_describe_unavailable_groups_a_shared_reason():
    text = backends.describe_unavailable({"cublaslt": "no CUDA device", "triton_splitk": "no CUDA device",
                                          "triton_gemm": "Triton is not installed"})
    assert text == ("cuBLASLt (cublaslt) and Triton split-K (triton_splitk) unavailable: no CUDA device; "
                    "Triton tiled (triton_gemm) unavailable: Triton is not installed")
