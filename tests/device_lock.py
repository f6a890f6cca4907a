"""A device shared by the tests of several processes (pytest-xdist workers, or separate pytest
runs on one machine): a test that needs the GPU alone (marker ``gpu_alone``: it times kernels,
or its kernels wait for each other and only make progress with the GPU to themselves) holds it
exclusively; every other test holds it shared, so any number of them run together, never beside
an exclusive holder (tests/conftest.py takes the hold around each test).

Two lock files in one directory, locked with flock (a lock belongs to the open file, so it is
released when the file is closed, and by the kernel when its process dies): ``hold``, shared or
exclusive, and ``gate``, exclusive, which every hold passes first. A process waiting for an
exclusive hold keeps the gate meanwhile, so holders that arrive later queue behind it instead of
keeping the device shared for ever.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def private_directory(path: Path) -> Path:
    """``path`` as a directory that only this user can write (made if missing); a symlink, or a
    directory of another user, is refused (a lock file in it could be swapped or held by them)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path} is not a directory of this user's that only it can write: "
                           "the GPU test lock cannot be kept there")
    return path


class DeviceLock:
    """Shared or exclusive holds of one device, across processes, through lock files in
    ``directory`` (a directory only this user can write: see ``private_directory``)."""

    def __init__(self, directory: Path):
        self.gate_path = Path(directory) / "gate.lock"
        self.hold_path = Path(directory) / "hold.lock"

    @staticmethod
    def _open(path: Path) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    @contextmanager
    def hold(self, exclusive: bool = False, blocking: bool = True) -> Iterator[None]:
        """The device, shared or ``exclusive``, for the ``with`` block: through the gate, then the
        hold. Without ``blocking``, BlockingIOError where either would have to wait."""
        nb = 0 if blocking else fcntl.LOCK_NB
        gate = self._open(self.gate_path)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | nb)
            hold = self._open(self.hold_path)
            try:
                fcntl.flock(hold, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | nb)
            except BaseException:
                os.close(hold)
                raise
        finally:
            os.close(gate)  # releases the gate (where it was taken): the next holder may queue
        try:
            yield
        finally:
            os.close(hold)
