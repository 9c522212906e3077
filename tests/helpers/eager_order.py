"""The epoch order computed eagerly, with O(shards) tables: the test oracle of the plan.

This is how ``EpochOrder`` evaluated positions before the shard table was opened rather than
loaded (a permutation table of every shard, the cumulative rows of every slot, and every
shard-sized window's bounds): written plainly, with nothing lazy, so that the lazy plan can
be compared with it position by position. Saved states depend on the order being exactly
the same, release after release.
"""

from __future__ import annotations

import numpy as np

from streamcache.plan.bijection import TAG_SHARDS, TAG_STAGGER, TAG_WINDOW, derive_key, permute
from streamcache.plan.shuffle import ShuffleOptions
from streamcache.plan.windows import RegularWindows, ShuffleLayer, Windows


class BoundaryWindows:
    """Windows between consecutive entries of ``bounds`` (strictly increasing, 0 to total)."""

    def __init__(self, bounds: np.ndarray) -> None:
        self.bounds = bounds.astype(np.int64)
        self.count = int(bounds.size) - 1
        self.largest = int(np.max(np.diff(self.bounds)))

    @classmethod
    def of_shards(cls, slot_starts: np.ndarray, shards_per_window: int) -> BoundaryWindows:
        """Windows of ``shards_per_window`` consecutive slots; a last window of fewer than
        half as many shards is merged into the one before it."""
        count = slot_starts.size - 1
        edges = slot_starts[::shards_per_window]
        remainder = count % shards_per_window
        if edges.size > 1 and 0 < remainder < shards_per_window / 2:
            edges = edges[:-1]
        return cls(np.unique(np.append(edges, slot_starts[-1])))

    def index(self, positions: np.ndarray) -> np.ndarray:
        # Positions of one call span few windows: search only their bounds (cache-resident).
        first = int(np.searchsorted(self.bounds, positions.min(), side="right")) - 1
        last = int(np.searchsorted(self.bounds, positions.max(), side="right")) - 1
        if first == last:
            return np.full(positions.shape, first, dtype=np.int64)
        return first - 1 + np.searchsorted(self.bounds[first:last + 1], positions, side="right")

    def edges(self, first: int, last: int) -> np.ndarray:
        return self.bounds[first: last + 2]

    def staggered(self) -> BoundaryWindows:
        middles = (self.bounds[:-1] + self.bounds[1:]) // 2
        return BoundaryWindows(np.unique(np.concatenate(([0], middles, self.bounds[-1:]))))


class EagerOrder:
    """(sample id, shard, row) at every position of one epoch, from full tables."""

    def __init__(self, shard_rows: np.ndarray, seed: int, epoch: int,
                 shuffle: ShuffleOptions) -> None:
        rows = np.asarray(shard_rows, dtype=np.int64)
        count = rows.size
        self.offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(rows, out=self.offsets[1:])
        shards = np.arange(count, dtype=np.int64)
        if shuffle.enabled:
            shards = permute(shards, count, derive_key(seed, epoch, TAG_SHARDS))
        self.slot_shard = shards
        self.starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(rows[shards], out=self.starts[1:])
        self.total = int(self.starts[-1])
        self.layers: list[ShuffleLayer] = []
        if shuffle.enabled:
            windows: Windows
            if shuffle.window_unit == "samples":
                windows = RegularWindows(min(shuffle.window, self.total), 0, self.total)
            else:
                windows = BoundaryWindows.of_shards(self.starts, shuffle.window)
            self.layers = [ShuffleLayer(windows, derive_key(seed, epoch, TAG_WINDOW))]
            if shuffle.stagger and windows.count > 1:
                self.layers.insert(0, ShuffleLayer(windows.staggered(),
                                                   derive_key(seed, epoch, TAG_STAGGER)))

    def samples_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stream = np.asarray(positions, dtype=np.int64)
        for layer in self.layers:
            stream = layer.apply(stream)
        slots = np.searchsorted(self.starts, stream, side="right") - 1
        shards = self.slot_shard[slots]
        ids = stream - self.starts[slots] + self.offsets[shards]
        return ids, shards, ids - self.offsets[shards]
