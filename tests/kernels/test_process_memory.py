"""per_call_scratch (kernels/process_memory.py) on the CPU: nesting, per thread, and what the
split-K scratch helper hands out inside and outside it."""

from __future__ import annotations

import threading

import torch

from hybridgemm.kernels import triton_scratch
from hybridgemm.kernels.process_memory import per_call, per_call_scratch


def test_nesting_and_threads():
    assert not per_call()
    seen = []
    with per_call_scratch():
        with per_call_scratch():
            assert per_call()
        assert per_call()  # still inside the outer block
        t = threading.Thread(target=lambda: seen.append(per_call()))
        t.start()
        t.join()
    assert not per_call() and seen == [False]  # another thread is not in this thread's block


def test_exception_leaves_the_block():
    try:
        with per_call_scratch():
            raise KeyError("x")
    except KeyError:
        pass
    assert not per_call()


def test_split_scratch_cached_outside_fresh_inside():
    cpu = torch.device("cpu")
    triton_scratch.clear_workspaces()
    ws1, cnt1 = triton_scratch.split_scratch(cpu, 1000, 64)
    ws2, cnt2 = triton_scratch.split_scratch(cpu, 1000, 64)
    assert ws1 is ws2 and cnt1 is cnt2  # process buffers, reused
    held = triton_scratch.workspace_bytes()
    with per_call_scratch():
        ws3, cnt3 = triton_scratch.split_scratch(cpu, 1000, 64)
        ws4, cnt4 = triton_scratch.split_scratch(cpu, 1000, 0)
    assert ws3.numel() >= 1000 and ws3 is not ws1 and cnt3 is not cnt1 and not cnt3.any() and cnt4 is None
    assert triton_scratch.workspace_bytes() == held  # nothing new cached
    triton_scratch.clear_workspaces()
