"""The memory tier as a Checkpointer uses it: which saves its snapshots continue (the last
save started, the last known committed), the restore a load tries first, and the removal of
earlier jobs' snapshots once this job holds the root (docs/recovery.md).

All methods but :meth:`Snapshots.started` and :meth:`Snapshots.committed` are collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import layout, rng
from .guards import UpdateGuard, guarded_keys
from .memory import MemoryTier
from .memory_format import RootView
from .memory_restore import restore_agreed, snapshot_entries
from .ranks import Ranks
from .tiers import Location


class Snapshots:
    """A Checkpointer's memory tier (``tier``) and what its snapshots continue; with
    ``guard``, model and optimizer entries are copied on the tier's thread while ``guard``
    holds back their updates (``MemoryOptions.background_copy``)."""

    def __init__(self, tier: MemoryTier, ranks: Ranks, root: Location,
                 guard: UpdateGuard | None = None) -> None:
        self.tier = tier
        self._guard = guard
        self._ranks = ranks
        self._root = root
        # (the last save started, the last known committed): what snapshots continue
        self._saves: tuple[str | None, str | None] = (None, None)
        self._saves_known = False
        self._pruned = False

    def started(self, name: str) -> None:
        """A save named ``name`` started."""
        self._saves = (name, self._saves[1])

    def committed(self, name: str) -> None:
        """The save named ``name`` is committed."""
        self._saves = (self._saves[0], name)

    def write(self, step: int, entries: Mapping[str, Any], *, timeline: str,
              root_id: str) -> bool:
        """Snapshot the resolved ``entries`` as ``step``; False when it did not fit."""
        if self._guard is not None:  # the previous copy checked here, not left to a hook
            self._guard.wait()       # (a loop of snapshots without steps queues nothing)
        if not self._saves_known:  # no load yet: the root's newest is what we continue
            newest = layout.latest(self._root) if self._ranks.rank == 0 else None
            known = self._ranks.broadcast(newest.name if newest else None, self._ranks.control)
            self._saves, self._saves_known = (self._saves[0], known), True
        if not self._pruned:  # this job holds the lease: earlier jobs are gone
            self.tier.remove_other_jobs()
            self._pruned = True
        started, committed = self._saves
        collected, rng_state = snapshot_entries(entries), rng.capture()
        later, hold = [], None
        if self._guard is not None:
            later = guarded_keys(entries)
            if later:
                hold = self._guard.hold(entries[k] for k in later)  # the tier releases it
        return self.tier.write(step, collected, rng_state, timeline=timeline, started=started,
                               committed=committed, root_id=root_id, later=later, hold=hold)

    def restore(self, state: dict[str, Any]) -> int | None:
        """Restore the newest step every rank holds in memory into ``state``, or None (and
        the snapshots are cleared: they do not continue what the disk tiers hold)."""
        view = None
        if self._ranks.rank == 0:
            newest = layout.latest(self._root)
            view = RootView((newest.name, newest.step) if newest else None,
                            layout.read_root_id(self._root))
        restored, agreed = restore_agreed(self.tier, self._ranks, view, state)
        if restored is not None:  # later snapshots continue the root's newest, every rank
            self._saves, self._saves_known = (None, agreed.latest_name), True
            return restored
        self.tier.clear()
        return None

    def loaded(self, name: str, *, rollback: bool) -> None:
        """The checkpoint ``name`` was loaded from the disk tiers (a rollback: an older one,
        so the snapshots, newer, are cleared)."""
        self._saves, self._saves_known = (None, name), True
        if rollback:
            self.tier.clear()
