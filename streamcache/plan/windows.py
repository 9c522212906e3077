"""Shuffle windows and the shuffle layer that permutes samples inside them.

A layer maps a position to a position of the same epoch: the window holding the position is
found (arithmetic for sample-sized windows, a binary search for shard-sized ones) and a keyed
bijection of that window is applied to the offset inside it. Evaluation is vectorized across
any number of windows, so a block of positions costs the same wherever it lies.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .bijection import derive_keys, fold_key, permute

_FEW_WINDOWS = 2


class Windows(Protocol):
    """Consecutive windows that tile ``[0, total)``."""

    count: int
    largest: int

    def index(self, positions: np.ndarray) -> np.ndarray:
        """The window holding each position (int64)."""
        ...

    def edges(self, first: int, last: int) -> np.ndarray:
        """Start positions of windows ``first .. last + 1`` (the last is where ``last`` ends)."""
        ...

    def staggered(self) -> Windows:
        """Windows whose boundaries sit halfway between this tiling's boundaries."""
        ...


class RegularWindows:
    """Windows of ``width`` positions with boundaries at ``j * width - offset``.

    The first window is shortened to ``width - offset``; a last window shorter than half a
    window is merged into the one before it, so the end of an epoch is shuffled as well as
    the rest (windows hold at most ``1.5 * width`` positions).
    """

    def __init__(self, width: int, offset: int, total: int) -> None:
        self.width = width
        self.offset = offset
        self.total = total
        boundaries = max(0, -(-(total + offset) // width) - 1)  # j*width - offset < total
        if boundaries and total - (boundaries * width - offset) < width // 2:
            boundaries -= 1
        self.count = boundaries + 1
        if boundaries == 0:
            self.largest = total
        else:
            first, last = width - offset, total - (boundaries * width - offset)
            self.largest = max(first, last, width if boundaries > 1 else 0)

    def index(self, positions: np.ndarray) -> np.ndarray:
        index = (positions + self.offset) // self.width
        np.minimum(index, self.count - 1, out=index)
        return index

    def edges(self, first: int, last: int) -> np.ndarray:
        edges = np.arange(first, last + 2, dtype=np.int64) * self.width - self.offset
        edges[0] = max(int(edges[0]), 0)
        if last == self.count - 1:
            edges[-1] = self.total
        return edges

    def staggered(self) -> Windows:
        return RegularWindows(self.width, self.width // 2, self.total)


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

    def staggered(self) -> Windows:
        middles = (self.bounds[:-1] + self.bounds[1:]) // 2
        return BoundaryWindows(np.unique(np.concatenate(([0], middles, self.bounds[-1:]))))


class ShuffleLayer:
    """A keyed permutation of the samples inside each window of a tiling.

    Thread safety: immutable; safe to share.
    """

    def __init__(self, windows: Windows, key: int) -> None:
        self.windows = windows
        self.key = key

    def apply(self, positions: np.ndarray) -> np.ndarray:
        """The layer's image of each position (int64 array in, new int64 array out)."""
        if positions.size == 0:
            return positions.copy()
        index = self.windows.index(positions)
        first, last = int(index.min()), int(index.max())
        edges = self.windows.edges(first, last)
        if first == last:
            start = int(edges[0])
            local = permute(positions - start, int(edges[1]) - start, fold_key(self.key, first))
            local += start
            return local
        if last - first > _FEW_WINDOWS:
            # Many small windows: per-window parameters, gathered per point.
            group = index - first
            starts = edges[:-1][group]
            keys = derive_keys(self.key, np.arange(first, last + 1, dtype=np.int64))
            return starts + permute(positions - starts, np.diff(edges), keys, group)
        # A few windows (a block across a boundary): one shared-parameter pass each is
        # cheaper than per-point parameters.
        out = np.empty_like(positions)
        for window in range(first, last + 1):
            members = np.flatnonzero(index == window)
            start, stop = int(edges[window - first]), int(edges[window - first + 1])
            out[members] = start + permute(positions[members] - start, stop - start,
                                           fold_key(self.key, window))
        return out
