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

_FEW_WINDOWS = 3


class Windows(Protocol):
    """Consecutive windows that tile ``[0, total)``."""

    count: int
    largest: int

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(window index, window start, window size) of each position, all int64."""
        ...

    def staggered(self) -> Windows:
        """Windows whose boundaries sit halfway between this tiling's boundaries."""
        ...


class RegularWindows:
    """Windows of ``width`` positions, the first shortened to ``width - offset``."""

    def __init__(self, width: int, offset: int, total: int) -> None:
        self.width = width
        self.offset = offset
        self.total = total
        self.count = (total + offset + width - 1) // width
        self.largest = min(width, total)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        index = (positions + self.offset) // self.width
        nominal = index * self.width - self.offset
        start = np.maximum(nominal, 0)
        stop = np.minimum(nominal + self.width, self.total)
        return index, start, stop - start

    def staggered(self) -> Windows:
        return RegularWindows(self.width, self.width // 2, self.total)


class BoundaryWindows:
    """Windows between consecutive entries of ``bounds`` (strictly increasing, 0 to total)."""

    def __init__(self, bounds: np.ndarray) -> None:
        self.bounds = bounds.astype(np.int64)
        self.count = int(bounds.size) - 1
        self.largest = int(np.max(np.diff(self.bounds)))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        index = np.searchsorted(self.bounds, positions, side="right") - 1
        start = self.bounds[index]
        return index, start, self.bounds[index + 1] - start

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
        index, start, size = self.windows.locate(positions)
        first, last = int(index.min()), int(index.max())
        if first == last:
            return start + permute(positions - start, int(size[0]), fold_key(self.key, first))
        if last - first > _FEW_WINDOWS:
            # Many small windows: per-window parameters, gathered per point.
            group = index - first
            sizes = np.zeros(last - first + 1, dtype=np.int64)
            sizes[group] = size
            keys = derive_keys(self.key, np.arange(first, last + 1, dtype=np.int64))
            return start + permute(positions - start, sizes, keys, group)
        # A few windows (a block across a boundary): one shared-parameter pass each is
        # cheaper than per-point parameters.
        out = np.empty_like(positions)
        for window in range(first, last + 1):
            members = np.flatnonzero(index == window)
            if members.size:
                base = int(start[members[0]])
                out[members] = base + permute(positions[members] - base,
                                              int(size[members[0]]), fold_key(self.key, window))
        return out
