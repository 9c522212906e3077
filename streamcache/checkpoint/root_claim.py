"""A Checkpointer's hold on its root: rank 0's lease, taken before this job's first write,
the root's id, and the live timeline that later saves extend (a rollback starts a new one).

All methods are collective: every rank calls them, rank 0 reads and writes the root and
broadcasts what the others need.
"""

from __future__ import annotations

import logging

from . import layout
from .errors import CheckpointError
from .layout import CheckpointInfo
from .lease import Lease
from .ranks import Ranks
from .tiers import Location

log = logging.getLogger("streamcache.checkpoint")


class RootClaim:
    """This job's lease on ``root`` (rank 0's; None on the other ranks) and its timeline.

    Attributes:
        leased: whether the lease was taken (:meth:`ensure`).
        timeline: the live timeline's id, the one a save extends.
        root_id: the root's id (``layout.ensure_root_id``), known once leased.
    """

    def __init__(self, ranks: Ranks, root: Location, lease: Lease | None) -> None:
        self._ranks = ranks
        self._root = root
        self.lease = lease
        self.leased = False
        self.root_id = ""
        live = layout.live_timeline(layout.read_timelines(root)) if ranks.rank == 0 else ""
        self.timeline: str = ranks.broadcast(live, ranks.control)

    def ensure(self) -> None:
        """Take the lease on ``root`` before this job's first write (collective).

        Raises:
            CheckpointError: another live job holds it, or the root's id cannot be written.
        """
        if self.leased:
            return
        problem, live, root_id = None, self.timeline, ""
        if self.lease is not None:
            try:
                self.lease.acquire()
                # the live timeline as of now: a job that held the lease before may have
                # rolled back since this one was constructed
                live = layout.live_timeline(layout.read_timelines(self._root))
                root_id = layout.ensure_root_id(self._root)
            except CheckpointError as exc:
                problem = str(exc)
            except OSError as exc:
                problem = (f"cannot write {self._root.join(layout.ROOT_ID_NAME)} ({exc}); "
                           "remove what is in its place")
        problem, live, root_id = self._ranks.broadcast((problem, live, root_id),
                                                       self._ranks.control)
        if problem is not None:
            raise CheckpointError(problem)
        self.leased, self.timeline, self.root_id = True, live, root_id

    def start_timeline(self, info: CheckpointInfo) -> None:
        """Record a rollback to ``info``: later saves form a new timeline forking there."""
        self.ensure()
        new_id = ""
        lost = self.lease.confirm() if self.lease is not None else None
        lost = self._ranks.broadcast(lost, self._ranks.control)
        if lost is not None:
            raise CheckpointError(f"{lost}; the rollback was not recorded")
        if self._ranks.rank == 0:
            timelines = layout.read_timelines(self._root)
            new_id = f"{self._ranks.run_id}-{len(timelines) + 1}"
            timelines.append(layout.Timeline(new_id, info.timeline, info.step, info.name))
            layout.write_timelines(self._root, timelines)
            log.warning("rolled back to step %d: later saves form timeline %s; the checkpoints "
                        "after it on the previous timeline are abandoned (kept, not loaded)",
                        info.step, new_id)
        self.timeline = self._ranks.broadcast(new_id, self._ranks.control)
