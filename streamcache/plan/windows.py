"""Shuffle windows and the shuffle layer that permutes samples inside them.

A layer maps a position to a position of the same epoch: the window holding the position is
found (arithmetic for sample-sized windows; for shard-sized ones, the slot holding it in the
shard stream) and a keyed bijection of that window is applied to the offset inside it.
Evaluation is vectorized across any number of windows, so a block of positions costs the
same wherever it lies, and no table of every window is built.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .bijection import MAX_DOMAIN, derive_keys, fold_key, permute
from .stream import ShardStream

_FEW_WINDOWS = 2


class Windows(Protocol):
    """Consecutive windows that tile ``[0, total)``."""

    count: int
    largest: int  # no window holds more samples (exact for sample-sized windows)

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


class ShardWindows:
    """Windows of ``shards_per_window`` consecutive slots of a :class:`ShardStream`; a last
    window of fewer than half as many shards is merged into the one before it, and a window
    of empty shards only is no window (its bounds coincide with the next one's).

    Lazy: a bound is the stream's start of a slot, found when asked (the stream keeps those
    O(window)). Only a dataset with empty shards, or one whose windows could be larger than
    a permutation's domain, takes one pass over its slots (summing each window's rows).
    Thread safety: read-only after construction.
    """

    def __init__(self, stream: ShardStream, shards_per_window: int) -> None:
        self.stream = stream
        self.width = shards_per_window
        whole, remainder = divmod(stream.num_shards, shards_per_window)
        merged = remainder == 0 or (whole >= 1 and remainder < shards_per_window / 2)
        self.raw_count = whole if merged else whole + 1  # windows before dropping empty ones
        empty = np.zeros(0, dtype=np.int64)
        # a window holds at most 1.5 windows of shards (the merged last one)
        self.largest = int(stream.counts.histogram()[0][-1]) * (
            shards_per_window + shards_per_window // 2)
        if stream.counts.has_empty_shards() or self.largest > MAX_DOMAIN:
            sums = self._window_rows()
            empty = np.flatnonzero(sums == 0).astype(np.int64)
            self.largest = int(sums.max())
        self._empty = empty
        self._skip = empty - np.arange(empty.size, dtype=np.int64)
        self.count = self.raw_count - int(empty.size)

    def _window_rows(self) -> np.ndarray:
        """The rows of every raw window (one pass over the slots, a chunk at a time)."""
        chunk = max(1, (1 << 16) // self.width) * self.width
        sums = []
        for first in range(0, self.stream.num_shards, chunk):
            slots = np.arange(first, min(self.stream.num_shards, first + chunk), dtype=np.int64)
            rows = self.stream.counts.rows_of(self.stream.slot_shard(slots))
            sums.append(np.add.reduceat(rows, np.arange(0, slots.size, self.width)))
        out = np.concatenate(sums)
        if out.size > self.raw_count:  # the short last window, merged into the one before
            out[self.raw_count - 1] += out[self.raw_count:].sum()
        return out[:self.raw_count]

    def _raw_bounds(self, raw: np.ndarray) -> np.ndarray:
        """The start of each raw window (``total`` for ``raw_count``)."""
        slots = np.where(raw < self.raw_count, raw * self.width, self.stream.num_shards)
        return self.stream.starts_at(slots)

    def index(self, positions: np.ndarray) -> np.ndarray:
        raw = np.minimum(self.stream.slots_of(positions) // self.width, self.raw_count - 1)
        if not self._empty.size:
            return raw
        return raw - np.searchsorted(self._empty, raw, side="left")

    def edges(self, first: int, last: int) -> np.ndarray:
        windows = np.arange(first, last + 2, dtype=np.int64)
        if self._empty.size:  # the raw window of each remaining one
            windows = windows + np.searchsorted(self._skip, windows, side="right")
        return self._raw_bounds(windows)

    def staggered(self) -> Windows:
        return StaggeredWindows(self)


class StaggeredWindows:
    """The windows whose bounds lie halfway between those of ``base``'s windows (a first
    middle at 0 is no bound): the stagger layer's tiling of shard-sized windows."""

    def __init__(self, base: ShardWindows) -> None:
        self.base = base
        self.total = base.stream.total
        self._drop = int(base.count >= 1 and int(self._middles(np.array([1]))[0]) == 0)
        self.count = base.count + 1 - self._drop
        self.largest = base.largest  # half of one window and half of the next

    def _middles(self, windows: np.ndarray) -> np.ndarray:
        """The middle of each of ``base``'s windows ``w - 1`` (``1 <= w <= base.count``)."""
        low = int(windows.min())
        edges = self.base.edges(low - 1, int(windows.max()) - 1)
        at = windows - low
        return (edges[at] + edges[at + 1]) // 2

    def index(self, positions: np.ndarray) -> np.ndarray:
        window = self.base.index(positions)
        # a position of base window k is in the staggered window that starts at k's middle
        # once it is past that middle (k's middle is staggered bound k + 1)
        following = np.minimum(window + 1, self.base.count)
        past = positions >= self._middles(following)
        return np.maximum(window + past - self._drop, 0)

    def edges(self, first: int, last: int) -> np.ndarray:
        bounds = np.arange(first, last + 2, dtype=np.int64) + self._drop
        out = np.zeros(bounds.size, dtype=np.int64)
        out[bounds == self.base.count + 1] = self.total
        inner = (bounds >= 1) & (bounds <= self.base.count)
        if inner.any():
            out[inner] = self._middles(bounds[inner])
        return out

    def staggered(self) -> Windows:
        raise NotImplementedError("staggered windows are not staggered again")


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
