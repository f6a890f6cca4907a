"""Tensor-parallel cases on two spawned ranks (tests/parallel): the runner, and the small
seeded models both ranks build alike.

A case is a module-level function ``case(rank, group)`` of the test module (the spawned ranks
import it by name) returning None, or a reason it does not apply. Both ranks run every case in
order; the first failure ends the run on that rank, and the other rank, waiting in a
collective that will never be joined, stops at the collective timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException

SEED = 1234
# Hang guards, far above a normal run (seconds on a quiet 2-core machine, a few minutes on a busy
# one): a rank stuck in a collective stops at COLLECTIVE_TIMEOUT, a run that never ends at RUN_TIMEOUT_S.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
RUN_TIMEOUT_S = 900


def llama_config(**kw):
    import transformers

    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=False)
    config = transformers.LlamaConfig(**{**base, **kw})
    config._attn_implementation = "eager"  # eager attention reads num_key_value_groups (repeat_kv)
    return config


def randomize(module: nn.Module, seed: int = SEED) -> nn.Module:
    """Every parameter drawn from ``seed`` (biases too: transformers initialises them to
    zero, which would hide a bias added twice or not at all)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)
    return module


def token_ids(vocab: int, shape=(2, 7)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(SEED + 1))


def _worker(rank: int, port: int, out_dir: str, backend: str, cases: list) -> None:
    """Run ``cases`` in order; the first failure ends the run on this rank."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=COLLECTIVE_TIMEOUT)
    results = {}
    try:
        for case in cases:
            try:
                skip = case(rank, dist.group.WORLD)  # None, or why the case does not apply here
                dist.barrier()
                results[case.__name__] = "ok" if skip is None else f"skipped: {skip}"
            except Exception:
                results[case.__name__] = traceback.format_exc(limit=6)
                break
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_two_ranks(cases: list, backend: str, out_dir, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, list[str]]:
    """Spawn two processes that run ``cases`` on ``backend``; returns {case name: [rank 0's
    result, rank 1's]}, each "ok", "skipped: <reason>" or a traceback. Fails the test if the run
    has not ended after ``timeout_s`` (a hang)."""
    ctx = mp.start_processes(_worker, args=(_free_port(), str(out_dir), backend, cases), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"the two-rank run did not end within {timeout_s} s: a rank hangs")
    except ProcessException:
        pass  # a rank that died still wrote what it ran (or nothing): reported per case below
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    results = [json.loads(f.read_text()) if (f := out_dir / f"rank{r}.json").exists() else {} for r in range(2)]
    return {c.__name__: [r.get(c.__name__, "not run (an earlier case failed, or the rank died)") for r in results]
            for c in cases}


def assert_ranks_ok(results: list[str]) -> None:
    failed = {f"rank {r}": res for r, res in enumerate(results) if res != "ok"}
    assert not failed, "\n".join(f"{who}:\n{res}" for who, res in failed.items())
