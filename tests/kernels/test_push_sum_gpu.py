"""The push one-shot sum (kernels/triton_push_sum.py) on one GPU, its ranks simulated in one
process on concurrent streams (tests/push_loopback.py says how, and why its scenarios run in a
process of their own under a timeout). The two-GPU path through symmetric memory:
tests/parallel/test_parallel_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = Path(__file__).with_name("push_loopback.py")
sys.path.insert(0, str(SCRIPT.parent))
import push_loopback  # noqa: E402 (the scenario names)

TIMEOUT_S = 300  # every scenario, compilation included, takes well under a minute; a hang ends here


@pytest.mark.gpu_alone
def test_every_loopback_scenario():
    """Every scenario of tests/push_loopback.py, in one process, with the GPU to itself
    (``gpu_alone``: under pytest-xdist no other test runs meanwhile): its ranks' kernels wait for
    each other, and on a GPU shared with other work they only take turns with it."""
    env = {**os.environ, "CUDA_MODULE_LOADING": "EAGER", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = f"(killed after {TIMEOUT_S} s) " + (e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or "")
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            results[rec["scenario"]] = rec["result"]
    missing = [name for name in push_loopback.SCENARIOS if name not in results]
    failed = {name: res for name, res in results.items() if res != "ok"}
    assert not missing and not failed, (f"did not finish (an earlier scenario hung or the process died): {missing}; "
                                        f"failed: {failed}; stderr: {err[-3000:]}")
