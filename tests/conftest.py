import os
import random
import tempfile
import zlib
from pathlib import Path

import torch

# Triton decides at decoration time whether a @triton.jit function is interpreted, so the
# switch must be set before any kernel module is imported. Without a GPU, interpret.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_calls import install as _install_interpreter_calls  # noqa: E402

    _install_interpreter_calls()

# The benches' HBM floors divide by the GPU's read rate, which is measured on GPUs other than
# the H200 (perf/read_ceiling.device_read_tbps): pinned to the H200's figure, a test's floors are
# the same numbers on every machine. Tests of the rate itself unset it.
os.environ["HYBRIDGEMM_READ_TBPS"] = "4.23"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    # A test taking the `device` fixture runs on the GPU where there is one: `pytest -m gpu`
    # leaves it out, so it carries a marker of its own for the GPU machine's run of them.
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.anydevice)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Where there is a GPU, each test holds it (setup, call and teardown) through a lock that
    every pytest process of this user on the machine shares (tests/device_lock.py): a
    ``gpu_alone`` test exclusively, so that no other test's kernels run beside it (under
    pytest-xdist's ``-n`` too), every other test shared."""
    if not cuda_available():
        return (yield)
    from device_lock import DeviceLock, private_directory

    lock = DeviceLock(private_directory(Path(tempfile.gettempdir()) / f"hybridgemm-gpu-tests-{os.getuid()}"))
    with lock.hold(exclusive=item.get_closest_marker("gpu_alone") is not None):
        return (yield)


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random data per test: the seed is derived from the test id,
    and HYBRIDGEMM_TEST_SEED shifts every seed at once to draw different data."""
    base = int(os.environ.get("HYBRIDGEMM_TEST_SEED", "0"))
    seed = (base + zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())) % (2**31)
    random.seed(seed)
    torch.manual_seed(seed)
    yield


@pytest.fixture(autouse=True)
def _unbound_splitk():
    """No eager split-K launch bound by an earlier test (fusion/dispatch.py ``_bound_key``): a
    test that pins a config (monkeypatching ``dispatch.splitk_config``) gets it from its first
    call, whatever another test bound for a weight at the same address."""
    if cuda_available():
        from hybridgemm import dispatch

        dispatch._bound_splitk.clear()
    yield


@pytest.fixture
def device() -> str:
    """Where kernel tests run: the GPU if there is one, else the CPU (Triton interpreter)."""
    return "cuda" if cuda_available() else "cpu"


@pytest.fixture
def no_tf32():
    """fp32 GEMMs (references included) in true fp32, not TF32, for the test's duration."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def fake_h200(monkeypatch, tmp_path):
    """The dispatcher's decision path as on an H200 with Triton (and without cuBLASLt, which
    needs a real device), reading tables from ``tmp_path`` only (tests/fake_device.py)."""
    import dataclasses

    from fake_device import FAKE_SIG, H200_LIMITS

    from hybridgemm import decide, diagnostics
    from hybridgemm.autotune_cache import signature
    from hybridgemm.kernels import backends, cublaslt

    monkeypatch.setenv("HYBRIDGEMM_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HYBRIDGEMM_TABLE", raising=False)
    monkeypatch.setattr(signature, "current_signature", lambda device_index=None: dict(FAKE_SIG))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(backends, "device_limits", lambda index: dict(H200_LIMITS))
    monkeypatch.setattr(backends, "num_sms", lambda index: 132)
    monkeypatch.setattr(cublaslt, "is_available", lambda: False)  # also on a GPU machine (alltests)
    real = backends.get_backend

    def get_backend(name):
        be = real(name)
        return dataclasses.replace(be, available=lambda: name != "cublaslt")

    monkeypatch.setattr(backends, "get_backend", get_backend)
    monkeypatch.setattr(diagnostics, "_warned", set())  # the dispatcher warns once per key per process
    decide.set_table_path(None)
    yield tmp_path
    decide.set_table_path(None)


@pytest.fixture
def fake_h200_lt(fake_h200, monkeypatch):
    """``fake_h200`` with cuBLASLt available and taking every problem (nothing is launched:
    its heuristic is only named in the decision)."""
    import dataclasses

    from hybridgemm.kernels import backends, cublaslt

    monkeypatch.setattr(cublaslt, "is_available", lambda: True)
    monkeypatch.setattr(cublaslt, "supports", lambda problem: (True, ""))
    faked = backends.get_backend
    monkeypatch.setattr(backends, "get_backend", lambda name: dataclasses.replace(faked(name), available=lambda: True))
    return fake_h200
