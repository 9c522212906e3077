"""Where each shard is read in an epoch (the prefetcher's and the eviction's view of the
plan: first and last read positions, nothing else). Pure; no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardUsage:
    """Where each shard is read in an epoch: first and last position (-1: not read).

    Between its first and last read a shard counts as in use: its next use from a position
    inside that span is taken to be now (exact for a shard read contiguously, an upper bound
    on its urgency otherwise).
    """

    first: np.ndarray
    last: np.ndarray

    def upcoming(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Shards read at ``position`` or later, in order of next use, with that next use."""
        alive = np.flatnonzero(self.last >= position)
        next_use = np.maximum(self.first[alive], position)
        order = np.lexsort((alive, next_use))
        return alive[order], next_use[order]

    def working_set_bytes(self, shard_bytes: Sequence[int] | np.ndarray) -> int:
        """The most bytes of shards in use at any one position."""
        read = np.flatnonzero(self.first >= 0)
        sizes = np.asarray(shard_bytes, dtype=np.int64)[read]
        positions = np.concatenate([self.first[read], self.last[read] + 1])
        deltas = np.concatenate([sizes, -sizes])
        order = np.lexsort((deltas, positions))  # at one position, departures first
        return int(np.cumsum(deltas[order]).max(initial=0))


__all__ = ["ShardUsage"]
