"""The push one-shot sum (kernels/triton_push_sum.py) under the Triton interpreter, on the CPU.

The interpreter runs one launch at a time, so a rank's kernel cannot wait for another rank's
kernel that has not run: each test writes, before a rank runs, what the ranks after it would
have pushed into its buffer (``_seed``, from the documented layout), then runs the ranks in
order; a rank's own pushes into the later ranks' buffers are real. What this checks: the
layout, the parity of consecutive calls, the counters, the flags, the rank-order fp32 sum and
its rounding, the masks of a last partial chunk. Concurrency (the waits, the release/acquire
ordering, slots reused under skew) needs the GPU: tests/kernels/test_push_sum_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from helpers import rank_order_sum
from hybridgemm.kernels import triton_push_sum as ps
from hybridgemm.kernels.triton_launch import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tensors need the Triton interpreter; on a GPU "
                                "machine tests/kernels/test_push_sum_gpu.py runs the kernel")


class Group:
    """Every rank's buffer, address table and counters, in this one process."""

    def __init__(self, world: int, capacity: int):
        self.world, self.capacity = world, capacity
        self.bufs = [torch.zeros(ps.buffer_bytes(world, capacity), dtype=torch.uint8) for _ in range(world)]
        self.table = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.epochs = [torch.zeros(ps.MAX_PROGRAMS, dtype=torch.int32) for _ in range(world)]

    def flags(self, rank: int) -> torch.Tensor:
        return ps.flag_view(self.bufs[rank], self.world)

    def slots(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        return self.bufs[rank][ps.FLAG_BYTES:].view(dtype).view(2, self.world, -1)

    def seed(self, src: int, dst: int, y: torch.Tensor) -> None:
        """What rank ``src``'s next call pushes into rank ``dst``'s buffer: chunk ``p`` into the
        slot of the parity of program ``p``'s next call count, the flag set to that count."""
        chunk = ps.CHUNK_BYTES // y.element_size()
        flat, slots, flags = y.reshape(-1), self.slots(dst, y.dtype), self.flags(dst)
        for p in range(-(-flat.numel() // chunk)):
            call = int(self.epochs[src][p]) + 1
            piece = flat[p * chunk:(p + 1) * chunk]
            slots[call & 1, src, p * chunk:p * chunk + piece.numel()] = piece
            flags[call & 1, src, p] = call

    def sum(self, ys: list[torch.Tensor], residual: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One call on every rank, ranks in order, each after the seeds of the ranks that
        follow it; outputs start poisoned."""
        outs = [torch.full_like(y, float("nan")) for y in ys]
        for r in range(self.world):
            for s in range(r + 1, self.world):
                self.seed(s, r, ys[s])
            ps.push_sum(ys[r], outs[r], self.table, self.epochs[r], r, self.world, self.capacity, residual)
        return outs


_expected = rank_order_sum


# bf16: the interpreter truncates fp32 -> bf16 where the GPU rounds; the GPU test covers it
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1,), (3,), (17, 1), (1000,), (3, 511), (1, 4096)])
def test_two_ranks_sum_in_rank_order(dtype, shape):
    group = Group(2, 32 * 1024)
    ys = [torch.randn(shape).to(dtype) for _ in range(2)]  # conftest seeds per test
    outs = group.sum(ys)
    expected = _expected(ys)
    assert torch.equal(outs[0], expected) and torch.equal(outs[1], expected)
    programs = -(-ys[0].numel() * ys[0].element_size() // ps.CHUNK_BYTES)
    for r in range(2):
        assert group.epochs[r][:programs].tolist() == [1] * programs
        assert group.epochs[r][programs:].count_nonzero() == 0, "a program past the message counted a call"
    # rank 0's real push into rank 1's buffer: its data in slot [1][0], its flags raised to 1
    assert torch.equal(group.slots(1, dtype)[1, 0, : ys[0].numel()], ys[0].reshape(-1))
    assert group.flags(1)[1, 0, :programs].tolist() == [1] * programs
    assert group.flags(1)[1, 0, programs:].count_nonzero() == 0


def test_consecutive_calls_alternate_slots_and_count():
    """Program p counts only the calls whose message reaches its chunk (512 fp32 values), and
    writes the parity of its own count."""
    group = Group(2, 16 * 1024)
    sizes = [4096, 700, 4096, 1, 2500]
    for n in sizes:
        ys = [torch.randn(n, dtype=torch.float32) for _ in range(2)]
        before = group.epochs[0].clone()
        outs = group.sum(ys)
        assert torch.equal(outs[0], _expected(ys)) and torch.equal(outs[1], _expected(ys)), n
        for p in range(-(-n // 512)):
            call = int(before[p]) + 1
            got = group.slots(1, torch.float32)[call & 1, 0, p * 512:min(n, (p + 1) * 512)]
            assert torch.equal(got, ys[0][p * 512:(p + 1) * 512]), (n, p)
            assert int(group.flags(1)[call & 1, 0, p]) == call, (n, p)
    counts = [sum(n > 512 * p for n in sizes) for p in range(9)]
    assert group.epochs[0][:9].tolist() == counts == [5, 4, 3, 3, 3, 2, 2, 2, 0]
    assert torch.equal(group.epochs[0], group.epochs[1])


@pytest.mark.parametrize("world", [3, 4])
def test_more_ranks_sum_in_rank_order(world):
    group = Group(world, 8 * 1024)
    gen = torch.Generator().manual_seed(world)
    for call in (1, 2):
        ys = [torch.randn(5, 300, generator=gen).to(torch.float16) for _ in range(world)]
        outs = group.sum(ys)
        for r in range(world):
            assert torch.equal(outs[r], _expected(ys)), (call, r)


@pytest.mark.parametrize("world", [2, 3])
def test_residual_is_added_to_the_fp32_sum_once(world):
    """out = (y_0 + ... + y_{w-1}) + residual in fp32, one rounding: fp16 partials whose own
    sum is exact but whose rounded sum with a large residual would lose the small parts if
    the residual were first added to one partial and rounded there."""
    group = Group(world, 16 * 1024)
    gen = torch.Generator().manual_seed(11 + world)
    n = 2500  # 5 chunks of fp16, the last one partial
    residual = (torch.randn(n, generator=gen) * 256).to(torch.float16)
    ys = [(torch.randn(n, generator=gen) / 8).to(torch.float16) for _ in range(world)]
    outs = group.sum(ys, residual)
    want = _expected(ys, residual)
    for r in range(world):
        assert torch.equal(outs[r], want), r
    # the other order (residual into rank 0's partial, rounded, then the sum) differs
    other = [(ys[0].float() + residual.float()).to(torch.float16), *ys[1:]]
    assert not torch.equal(_expected(other), want), "the data cannot tell the two orders apart"


def test_largest_message_fills_the_slot():
    cap = 64 * 1024
    group = Group(2, cap)
    gen = torch.Generator().manual_seed(5)
    ys = [torch.randn(cap // 2, generator=gen).to(torch.float16) for _ in range(2)]
    outs = group.sum(ys)
    assert torch.equal(outs[1], _expected(ys))


def _group_args(group: Group, rank: int = 0) -> tuple:
    return group.table, group.epochs[rank], rank, group.world, group.capacity


@pytest.mark.parametrize("make, words", [
    (lambda: (torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)), "dtype torch.int32"),
    (lambda: (torch.ones(9000, dtype=torch.float32), torch.ones(9000, dtype=torch.float32)), "36000 bytes, above"),
    (lambda: (torch.ones(8, 4).t(), torch.ones(4, 8)), "y and out must be contiguous tensors of one shape"),
    (lambda: (torch.ones(8), torch.ones(9)), "y and out must be contiguous tensors of one shape"),
    (lambda: (torch.ones(8), torch.ones(8, dtype=torch.float16)), "y and out must be contiguous tensors of one shape"),
    (lambda: (torch.ones(8), torch.ones(8), torch.ones(9)), "residual must be a contiguous tensor of y's shape"),
    (lambda: (torch.ones(8), torch.ones(8), torch.ones(8, dtype=torch.float16)), "residual must be a contiguous"),
    (lambda: (torch.ones(4, 2), torch.ones(4, 2), torch.ones(2, 4).t()), "residual must be a contiguous"),
])
def test_bad_operands_are_value_errors(make, words):
    group = Group(2, 32 * 1024)
    y, out, *residual = make()
    with pytest.raises(ValueError, match="push_sum: " + words):
        ps.push_sum(y, out, *_group_args(group), *residual)
    assert group.epochs[0].count_nonzero() == 0 and group.flags(1).count_nonzero() == 0, "a refused call ran"


def test_bad_groups_are_value_errors():
    group = Group(2, 32 * 1024)
    y = torch.ones(8)
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        ps.push_sum(y, y.clone(), group.table, group.epochs[0], 2, 2, group.capacity)
    with pytest.raises(ValueError, match="table must be int64"):
        ps.push_sum(y, y.clone(), group.table.int(), group.epochs[0], 0, 2, group.capacity)
    with pytest.raises(ValueError, match="table must be int64"):
        ps.push_sum(y, y.clone(), group.table, group.epochs[0][:8], 0, 2, group.capacity)
    assert ps.group_why_not(1, 1024).startswith("a group of 1 ranks")
    assert ps.group_why_not(ps.MAX_WORLD + 1, 1024).startswith(f"a group of {ps.MAX_WORLD + 1}")
    assert "multiple of 16" in ps.group_why_not(2, 1000)
    assert "multiple of 16" in ps.group_why_not(2, ps.MAX_PROGRAMS * ps.CHUNK_BYTES + 16)
    assert ps.group_why_not(2, ps.MAX_PROGRAMS * ps.CHUNK_BYTES) is None


def test_empty_message_launches_nothing():
    group = Group(2, 1024)
    y = torch.ones(0)
    assert ps.push_sum(y, y.clone(), *_group_args(group)).numel() == 0
    assert group.epochs[0].count_nonzero() == 0
