"""The lock that gives ``gpu_alone`` tests the GPU to themselves (tests/device_lock.py, taken
around every test by tests/conftest.py where there is a GPU), on the CPU: shared holds coexist
and an exclusive one excludes every other; an exclusive hold waiting for shared ones goes
before shared ones that come after it; and processes hammering the lock never overlap an
exclusive holder. No GPU and no wall-clock bound: the processes signal what they hold, and
overlaps are counted."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
from device_lock import DeviceLock, private_directory

HANG_S = 120  # a hang guard for each wait on another process (each takes milliseconds)


def _free(lock: DeviceLock, exclusive: bool) -> bool:
    """Whether a hold could be taken right now without waiting (it is released at once)."""
    try:
        with lock.hold(exclusive=exclusive, blocking=False):
            return True
    except BlockingIOError:
        return False


@pytest.fixture
def lock_dir(tmp_path):
    return private_directory(tmp_path / "gpu-lock")


def test_shared_holds_coexist_and_an_exclusive_one_excludes_all(lock_dir):
    lock = DeviceLock(lock_dir)
    assert _free(lock, exclusive=False) and _free(lock, exclusive=True)
    with lock.hold():
        assert _free(lock, exclusive=False)  # another shared hold: both at once
        assert not _free(lock, exclusive=True)
    with lock.hold(exclusive=True):
        assert not _free(lock, exclusive=False) and not _free(lock, exclusive=True)
    assert _free(lock, exclusive=True)  # all released


def test_the_lock_directory_must_be_this_users_own(tmp_path):
    (tmp_path / "target").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(RuntimeError, match="not a directory of this user's"):
        private_directory(tmp_path / "link")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o777)
    with pytest.raises(RuntimeError, match="only it can write"):
        private_directory(tmp_path / "shared")
    assert private_directory(tmp_path / "target") == tmp_path / "target"


def _hold_until(directory, exclusive, entered, leave):
    with DeviceLock(directory).hold(exclusive=exclusive):
        entered.set()
        assert leave.wait(HANG_S)


def _wait_for(condition) -> None:
    """Poll ``condition`` until it holds (a hang guard ends the wait)."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, "the other process never got there"
        time.sleep(0.005)


def test_a_waiting_exclusive_hold_goes_before_later_shared_ones(lock_dir):
    ctx = multiprocessing.get_context("spawn")
    lock = DeviceLock(lock_dir)
    shared_in, shared_out, alone_in, alone_out = (ctx.Event() for _ in range(4))
    sharer = ctx.Process(target=_hold_until, args=(lock_dir, False, shared_in, shared_out))
    alone = ctx.Process(target=_hold_until, args=(lock_dir, True, alone_in, alone_out))
    try:
        sharer.start()
        assert shared_in.wait(HANG_S)
        alone.start()
        # waiting for the shared holder, the exclusive one keeps the gate: a later shared hold waits too
        _wait_for(lambda: not _free(lock, exclusive=False))
        assert not alone_in.is_set() and not _free(lock, exclusive=True)
        shared_out.set()
        sharer.join(HANG_S)
        assert alone_in.wait(HANG_S)  # the shared holder gone, the exclusive one goes in
        assert not _free(lock, exclusive=False) and not _free(lock, exclusive=True)
        alone_out.set()
        alone.join(HANG_S)
        assert (sharer.exitcode, alone.exitcode) == (0, 0)
        assert _free(lock, exclusive=True)
    finally:
        for p in (sharer, alone):
            if p.is_alive():
                p.kill()


def _exclusive_beside_another(inside) -> bool:
    shared, exclusive = inside[:]
    return exclusive > 1 or (exclusive > 0 and shared > 0)


def _hammer(directory, exclusive, rounds, start, inside, counts):
    """``rounds`` holds; in each, count itself in (``inside``: [shared, exclusive] holders now),
    give the CPU away a few times, and record in ``counts`` ([exclusive overlaps, shared
    overlaps, rounds done]) what it saw: an exclusive holder beside any other is an overlap."""
    lock = DeviceLock(directory)
    assert start.wait(HANG_S)
    for _ in range(rounds):
        with lock.hold(exclusive=exclusive):
            with inside.get_lock():
                inside[exclusive] += 1
                counts[0] += _exclusive_beside_another(inside)
                counts[1] += inside[0] > 1
            for _ in range(20):
                os.sched_yield()
                with inside.get_lock():
                    counts[0] += _exclusive_beside_another(inside)
            with inside.get_lock():
                inside[exclusive] -= 1
                counts[2] += 1


def test_no_hold_overlaps_an_exclusive_one_across_processes(lock_dir):
    """Two processes taking shared holds and two taking exclusive ones, 100 rounds each, all
    at once: no exclusive holder ever sees another holder beside it."""
    ctx = multiprocessing.get_context("spawn")
    start, rounds = ctx.Event(), 100
    inside, counts = ctx.Array("i", 2), ctx.Array("i", 3)
    procs = [ctx.Process(target=_hammer, args=(lock_dir, exclusive, rounds, start, inside, counts))
             for exclusive in (False, True, False, True)]
    try:
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(HANG_S)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    exclusive_overlaps, shared_overlaps, done = counts[:]
    assert done == rounds * len(procs) and list(inside[:]) == [0, 0]
    assert exclusive_overlaps == 0, f"{exclusive_overlaps} overlaps with an exclusive holder ({shared_overlaps} shared)"
