import os
import random
import zlib

import torch

# Triton decides at decoration time whether a @triton.jit function is interpreted, so the
# switch must be set before any kernel module is imported. Without a GPU, interpret.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random data per test: the seed is derived from the test id,
    and HYBRIDGEMM_TEST_SEED shifts every seed at once to draw different data."""
    base = int(os.environ.get("HYBRIDGEMM_TEST_SEED", "0"))
    seed = (base + zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())) % (2**31)
    random.seed(seed)
    torch.manual_seed(seed)
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
