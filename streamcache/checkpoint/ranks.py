"""The checkpointer's view of the job: this rank, the world, and its own two gloo groups.

``control`` is used only from the training thread (agreeing on candidates, checks across
ranks, loading); ``writer`` only from the background write. Neither is the training's default
group, so checkpoint collectives never interleave with the training's or with each other.
Without ``torch.distributed`` every collective degenerates to the local value.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist


class Ranks:
    """Collectives of one Checkpointer; constructing it is collective (two ``new_group``)."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = 0, 1
        self.control: Any = None
        self.writer: Any = None
        # the run's start time (ms, fixed width): attempts at one step sort by age
        run_id = f"{time.time_ns() // 1_000_000:012x}"
        if self.distributed:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.control = dist.new_group(backend="gloo", timeout=timeout)
            self.writer = dist.new_group(backend="gloo", timeout=timeout)
            run_id = self.broadcast(run_id, self.control)
        self.run_id: str = run_id

    def broadcast(self, value: Any, group: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=group)
        return holder[0]

    def all_gather(self, value: Any, group: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=group)
        return values

    def gather(self, value: Any, group: Any) -> list[Any]:
        """Every rank's ``value`` on rank 0 (an empty list elsewhere)."""
        if not self.distributed:
            return [value]
        gathered: list[Any] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(value, gathered if self.rank == 0 else None, dst=0, group=group)
        return gathered

    def all_true(self, flag: bool, group: Any) -> bool:
        return self._reduce(flag, dist.ReduceOp.MIN, group) if self.distributed else flag

    def any_true(self, flag: bool, group: Any) -> bool:
        return self._reduce(flag, dist.ReduceOp.MAX, group) if self.distributed else flag

    def close(self) -> None:
        """Destroy the two groups; groups already destroyed (an in-process restart engine
        such as NVRx aborts and destroys every group after a fault) are skipped, so that
        closing while a fault unwinds never replaces the fault's exception with another."""
        for group in (self.writer, self.control):
            if group is not None and dist.is_initialized() and \
                    group in dist.distributed_c10d._world.pg_names:
                dist.destroy_process_group(group)
        self.writer = self.control = None

    @staticmethod
    def _reduce(flag: bool, op: Any, group: Any) -> bool:
        value = torch.tensor([1 if flag else 0])
        dist.all_reduce(value, op=op, group=group)
        return bool(value.item())
