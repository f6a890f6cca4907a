"""The push one-shot sum (kernels/triton_push_sum.py) on one GPU, its ranks simulated in one
process: every rank's buffer is a tensor on the same GPU and each rank's kernels run on a
stream of their own, concurrently with the others', so the waits, the release/acquire
ordering and the reuse of slots under skew are real; only the link between GPUs is not.

Run by tests/kernels/test_push_sum_gpu.py, every scenario in one process (``python push_loopback.py``,
one JSON line per scenario as it ends), with ``CUDA_MODULE_LOADING=EAGER`` and under a
timeout: one rank's kernel spins until the other rank's kernel of the same call runs, on the
same GPU, so every kernel the scenario launches is compiled and loaded before any two run
together (:meth:`Loopback.prime`), and every output is allocated before too: with CUDA's lazy
loading, loading a kernel while another spins can wait for the spinning kernel to finish, and
a device memory allocation between two launches on different streams keeps them from running
concurrently, either of which here would never end (a hang the timeout turns into a
failure). Two processes on two GPUs do not have that dependency: each GPU's kernels wait only
for the other GPU's.

Every result is compared with the fp32 rank-order sum of fresh random data (plus the
residual), rounded once, and must hold the same bits on every rank.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import rank_order_sum  # noqa: E402
from hybridgemm.kernels import triton_push_sum as ps


class Loopback:
    """``world`` ranks of one group on this GPU: buffers, address table, counters, streams."""

    def __init__(self, world: int, capacity: int):
        self.world, self.capacity = world, capacity
        self.bufs = [torch.zeros(ps.buffer_bytes(world, capacity), dtype=torch.uint8, device="cuda")
                     for _ in range(world)]
        self.table = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device="cuda")
        self.epochs = [torch.zeros(ps.MAX_PROGRAMS, dtype=torch.int32, device="cuda") for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        torch.cuda.synchronize()

    def flags(self, rank: int) -> torch.Tensor:
        return ps.flag_view(self.bufs[rank], self.world)

    def prime(self, calls) -> None:
        """Compile and load the kernel of every (rank, operands) that ``calls`` (lists of
        ``(y, residual or None)`` per rank) will launch, each rank alone, its peers' flags of
        its first call raised by hand so that it does not wait; then every buffer and counter
        back to zero."""
        for r in range(self.world):
            seen = set()
            for per_rank in calls:
                y, res = per_rank[r]
                key = (y.dtype, y.numel(), res is not None)
                if key in seen:
                    continue
                seen.add(key)
                self.flags(r)[1].fill_(1)  # call 1 of every program: parity 1, flag 1
                self.epochs[r].zero_()
                self.sum_into(r, y, torch.empty_like(y), res)
                torch.cuda.synchronize()
        for b, e in zip(self.bufs, self.epochs):
            b.zero_()
            e.zero_()
        torch.cuda.synchronize()

    def run(self, calls: int, call) -> list[list]:
        """``call(r, i)`` on rank r's stream for every call ``i`` and rank ``r``, after the
        current stream's work, call by call across the ranks (a GPU queues a bounded number of
        launches: one rank's whole sequence queued first could fill it while its first kernel
        waits for a rank not yet queued); the current stream then waits for all of them.
        Returns each rank's results in call order."""
        ready = torch.cuda.current_stream()
        for stream in self.streams:
            stream.wait_stream(ready)
        results: list[list] = [[] for _ in self.streams]
        for i in range(calls):
            for r, stream in enumerate(self.streams):
                with torch.cuda.stream(stream):
                    results[r].append(call(r, i))
        for stream in self.streams:
            ready.wait_stream(stream)
        return results

    def sum_into(self, r: int, y: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None):
        return ps.push_sum(y, out, self.table, self.epochs[r], r, self.world, self.capacity, residual)


expected = rank_order_sum


SIZES = [1, 3, 17, 1000, 4096, 3 * 1001, 8 * 4096, 17 * 1000]  # elements; odd sizes end mid-chunk


def random_sequences(world: str, pdl: str) -> None:
    """200 calls of random sizes and dtypes, a residual in about half, back to back, with
    random delays on random ranks' streams between calls, so that ranks run ahead and behind
    each other. ``pdl`` "1" launches with programmatic dependent launch where the GPU has it
    (Hopper and later: triton_launch.pdl_enabled), "0" without."""
    saved = os.environ.get("HYBRIDGEMM_PDL")
    os.environ["HYBRIDGEMM_PDL"] = pdl  # read when a launch is planned
    try:
        _random_sequences(int(world), pdl)
    finally:
        if saved is None:
            os.environ.pop("HYBRIDGEMM_PDL")
        else:
            os.environ["HYBRIDGEMM_PDL"] = saved


def _random_sequences(world: int, pdl: str) -> None:
    group = Loopback(world, 128 * 1024)
    rng = random.Random(world * 10 + int(pdl))
    calls = []
    for _ in range(200):
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        n = rng.choice([s for s in SIZES if s * dtype.itemsize <= group.capacity])
        ys = [torch.randn(n, device="cuda").to(dtype) for _ in range(world)]
        res = torch.randn(n, device="cuda").to(dtype) * 8 if rng.random() < 0.5 else None
        delay = [rng.random() < 0.2 for _ in range(world)]
        calls.append((ys, res, delay))
    group.prime([[(ys[r], res) for r in range(world)] for ys, res, _ in calls])

    outs = [[torch.full_like(ys[r], float("nan")) for ys, _, _ in calls] for r in range(world)]
    torch.cuda.synchronize()

    def call(r, i):
        ys, res, delay = calls[i]
        if delay[r]:
            torch.cuda._sleep(20_000)
        return group.sum_into(r, ys[r], outs[r][i], res)

    outs = group.run(len(calls), call)
    torch.cuda.synchronize()
    for i, (ys, res, _) in enumerate(calls):
        want = expected(ys, res)
        for r in range(world):
            assert torch.equal(outs[r][i], want), f"call {i} ({ys[0].numel()} x {ys[0].dtype}), rank {r}"
    for r in range(1, world):
        assert torch.equal(group.epochs[r], group.epochs[0]), "the ranks counted different calls"


def one_rank_far_behind() -> None:
    """Rank 1 starts about 5 ms late (10^7 GPU cycles), then every call of rank 0 waits for it:
    no result is lost or taken from the wrong call."""
    group = Loopback(2, 64 * 1024)
    calls = [[torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2)] for _ in range(64)]
    group.prime([[(c[0], None), (c[1], None)] for c in calls[:1]])

    outs = [[torch.empty_like(c[r]) for c in calls] for r in range(2)]
    torch.cuda.synchronize()

    def call(r, i):
        if r == 1 and i == 0:
            torch.cuda._sleep(10_000_000)
        return group.sum_into(r, calls[i][r], outs[r][i])

    outs = group.run(len(calls), call)
    torch.cuda.synchronize()
    for i, ys in enumerate(calls):
        want = expected(ys)
        assert torch.equal(outs[0][i], want) and torch.equal(outs[1][i], want), i


def cuda_graph_replays() -> None:
    """Each rank's three sums (one with a residual) captured in a CUDA graph, the graphs
    replayed concurrently 30 times on new inputs: the counters on the device keep the ranks'
    calls paired."""
    world = 2
    group = Loopback(world, 64 * 1024)
    shapes = [(1, 4096), (8, 4096), (3, 1000)]
    xs = [[torch.zeros(s, device="cuda", dtype=torch.bfloat16) for s in shapes] for _ in range(world)]
    res = torch.zeros(shapes[0], device="cuda", dtype=torch.bfloat16)
    residuals = [res, None, None]
    group.prime([[(xs[r][j], residuals[j]) for r in range(world)] for j in range(len(shapes))])
    graphs, outs = [], []
    for r in range(world):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append([group.sum_into(r, x, torch.empty_like(x), rr) for x, rr in zip(xs[r], residuals)])
        graphs.append(graph)
    for i in range(30):
        for r in range(world):
            for x in xs[r]:
                x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype))
        res.copy_(torch.randn(res.shape, device="cuda", dtype=res.dtype) * 8)
        group.run(1, lambda r, _: graphs[r].replay())
        torch.cuda.synchronize()
        for j in range(len(shapes)):
            want = expected([xs[r][j] for r in range(world)], residuals[j])
            for r in range(world):
                assert torch.equal(outs[r][j], want), f"replay {i}, sum {j}, rank {r}"


def largest_message() -> None:
    group = Loopback(2, ps.MAX_PROGRAMS * ps.CHUNK_BYTES)
    ys = [torch.randn(ps.MAX_PROGRAMS * ps.CHUNK_BYTES // 4, device="cuda") for _ in range(2)]
    group.prime([[(ys[0], None), (ys[1], None)]])
    outs = [torch.empty_like(y) for y in ys]
    torch.cuda.synchronize()
    outs = group.run(1, lambda r, _: group.sum_into(r, ys[r], outs[r]))
    torch.cuda.synchronize()
    want = expected(ys)
    assert torch.equal(outs[0][0], want) and torch.equal(outs[1][0], want)


# name: (function, arguments)
SCENARIOS = {f"random_sequences[{w}-pdl{p}]": (random_sequences, (w, p)) for w in ("2", "4") for p in ("1", "0")}
SCENARIOS.update({name: (fn, ()) for name, fn in (("one_rank_far_behind", one_rank_far_behind),
                                                  ("cuda_graph_replays", cuda_graph_replays),
                                                  ("largest_message", largest_message))})

if __name__ == "__main__":
    for name in sys.argv[1:] or SCENARIOS:
        fn, args = SCENARIOS[name]
        try:
            fn(*args)
            result = "ok"
        except Exception:  # noqa: BLE001 (reported to the test, which fails with it)
            result = traceback.format_exc(limit=8)
        print(json.dumps({"scenario": name, "result": result}), flush=True)
