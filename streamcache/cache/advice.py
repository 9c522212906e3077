"""Prefetch and eviction advice from the plan: which shards are needed next, and when.

The prefetcher wants the next few shards in first-use order from the cursor, and the cache
wants, for eviction, when each resident shard is read next. Both follow from where each
shard is first and last read in the epoch. Scanning every position of a billion-sample epoch
costs about a minute, so :class:`ShardAdvice` samples the order with a stride well below the
smallest shard's row count: a shard's rows are spread over its shuffle window, so every
shard is still seen, and its first and last use are known to within a stride. Shards sorted
by first use then answer "what comes next from position p" in O(log shards).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..plan import EpochOrder, ShuffleOptions
from .prefetch import ShardUsage

_CHUNK = 1 << 20  # positions evaluated per pass


class ShardAdvice:
    """First/last read position of every shard of one epoch, and the upcoming shards.

    Args:
        order: the epoch's order.
        stride: positions between samples of the order (default: 1/64 of the smallest
            non-empty shard's rows, at least 1). Shards with fewer rows than the stride may
            be missed: a missed shard is fetched on demand, never read wrongly.

    Thread safety: read-only after construction.
    """

    def __init__(self, order: EpochOrder, *, stride: int | None = None) -> None:
        rows = order.shard_rows[order.shard_rows > 0]
        self.stride = stride or max(1, int(rows.min()) // 64)
        self.num_samples = order.num_samples
        self.usage = shard_usage(order, self.stride)
        first = self.usage.first
        read = np.flatnonzero(first >= 0)
        self._by_first = read[np.argsort(first[read], kind="stable")]
        self._firsts = first[self._by_first]
        self._working_set_shards: int | None = None

    def upcoming(self, position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``count`` shards read at ``position`` or later, in order of next use, with
        that next use (shards already in use come first, with next use ``position``)."""
        usage = self.usage
        start = int(np.searchsorted(self._firsts, position, side="left"))
        # shards begun before `position` and not finished are in use now
        back = self._by_first[max(0, start - 4 * count):start]
        in_use = back[usage.last[back] >= position - self.stride]
        ahead = self._by_first[start:start + count]
        shards = np.concatenate([in_use, ahead])[:count]
        next_use = np.concatenate([np.full(len(in_use), position, dtype=np.int64),
                                   self._firsts[start:start + count]])[:count]
        return shards, next_use

    def working_set_bytes(self, shard_bytes: np.ndarray) -> int:
        """The most bytes of shards in use at once over the epoch."""
        return self.usage.working_set_bytes(shard_bytes)

    def working_set_shards(self) -> int:
        """The most shards in use at once over the epoch."""
        if self._working_set_shards is None:
            ones = np.ones(len(self.usage.first), dtype=np.int64)
            self._working_set_shards = self.usage.working_set_bytes(ones)
        return self._working_set_shards


def shard_usage(order: EpochOrder, stride: int = 1) -> ShardUsage:
    """First and last read position of every shard in ``order``, from every ``stride``-th
    position (exact with ``stride=1``; see :class:`ShardAdvice` for larger strides)."""
    first = np.full(order.num_shards, -1, dtype=np.int64)
    last = np.full(order.num_shards, -1, dtype=np.int64)
    step = _CHUNK * stride
    for start in range(0, order.num_samples, step):
        positions = np.arange(start, min(order.num_samples, start + step), stride,
                              dtype=np.int64)
        shards, _ = order.shard_of_ids(order.sample_ids_at(positions))
        unique, at = np.unique(shards, return_index=True)
        fresh = first[unique] < 0
        first[unique[fresh]] = positions[at[fresh]]
        tail, at_end = np.unique(shards[::-1], return_index=True)
        last[tail] = positions[len(positions) - 1 - at_end]
    return ShardUsage(first, last)


def working_set_bound(shard_rows: Sequence[int] | np.ndarray,
                      shard_bytes: Sequence[int] | np.ndarray, shuffle: ShuffleOptions) -> int:
    """Bytes of shards that no epoch keeps in use at once (in use: between a shard's first
    and last read), whatever the epoch's shard permutation. Pure; O(shards log shards).

    Why it holds (docs/plan.md has the layers): a position is moved by the stagger shuffle
    inside a staggered window, then by the window shuffle inside a regular window. A shard
    is therefore read only inside the regular windows its rows lie in, widened by the
    staggered windows that straddle their edges, so every shard in use at a position holds
    rows of the two regular windows that the position's staggered window touches (one window
    without stagger). Regular windows hold ``window`` samples (the last up to 1.5 times
    that), or ``window`` shards (the last fewer than 1.5 times that).

    - ``window_unit="shards"``: the largest shards that fit two windows (one without stagger).
    - ``window_unit="samples"``: shards meeting a stretch of ``L`` = 2.5 windows of samples
      (1.5 without stagger): at most two cut at its ends plus whole shards of at most ``L``
      rows in all; bounded by the two largest shards plus the most bytes ``L`` rows can hold
      (by bytes per row, the last shard counted in part).
    - no shuffle: one shard at a time, the largest.
    """
    rows = np.asarray(shard_rows, dtype=np.int64)
    nbytes = np.asarray(shard_bytes, dtype=np.int64)
    read = rows > 0
    rows, nbytes = rows[read], nbytes[read]
    everything = int(nbytes.sum())
    if rows.size == 0:
        return 0
    if not shuffle.enabled:
        return int(nbytes.max())
    window = shuffle.window
    largest_first = np.sort(nbytes)[::-1]
    if shuffle.window_unit == "shards":
        count = window + window // 2 + (window if shuffle.stagger else 0)
        return min(everything, int(largest_first[:count].sum()))
    span = window + window // 2 + (window if shuffle.stagger else 0)
    edges = int(largest_first[:2].sum())
    whole = rows <= span
    density = nbytes[whole] / rows[whole]
    by_density = np.argsort(-density, kind="stable")
    filled = np.cumsum(rows[whole][by_density])
    taken = int(np.searchsorted(filled, span, side="right"))  # whole shards that fit
    inside = float(nbytes[whole][by_density][:taken].sum())
    if taken < len(by_density):  # the next one, in part
        left = span - (int(filled[taken - 1]) if taken else 0)
        inside += left * float(density[by_density][taken])
    return min(everything, edges + int(np.ceil(inside)))
