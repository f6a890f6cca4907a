"""The process groups of a perf/bench_tp.py run, one :class:`Ranks` per process: the group the
tp=2 variants shard over, and a gloo group that keeps the ranks in lockstep (barriers, and
every step's errors exchanged, so that a failure on one rank is recorded on both and never
leaves the other waiting in a collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    """This process's place in the run: ``group`` (the default group, which the tp=2 variants
    shard over) and ``control``, a gloo group for the barriers and error exchanges, so that a
    rank waiting out another's work holds no GPU and no NCCL collective."""

    rank: int
    world: int
    group: object
    control: object
    _mesh: object = None

    def mesh(self, device):
        """A 1-D DeviceMesh over the world (made on first use)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(torch.device(device).type, (self.world,))
        return self._mesh

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def agree(self, err: BaseException | None) -> BaseException | None:
        """Every rank's ``err`` gathered: this rank's own, else another rank's (as a
        RuntimeError naming it), else None."""
        text = None if err is None else f"{type(err).__name__}: {err}"
        texts: list = [None] * self.world
        dist.all_gather_object(texts, text, group=self.control)
        if err is not None:
            return err
        other = next(((r, t) for r, t in enumerate(texts) if t is not None), None)
        return None if other is None else RuntimeError(f"on rank {other[0]}: {other[1]}")
