"""Prefetch and eviction advice from the plan: which shards are needed next, and when.

The prefetcher wants the next few shards in first-use order from the cursor, and the cache
wants, for eviction, when each of them is read next (shards not among them have no known
next use, so eviction takes them first). Both follow from where each shard is first and last
read near the cursor. :class:`ShardAdvice` scans a stretch of the order ahead of the cursor
(the "horizon": a few working sets of positions, every ``stride``-th position, with a stride
well below the smallest shard's row count: a shard's rows are spread over its shuffle window,
so every shard is still seen) and answers "what comes next from position p" from it until
the cursor has used it up; then it scans the next stretch. Memory and work are O(window),
never O(shards) or O(epoch): a million shards cost what a thousand do.

How many shards are in use at once (the prefetcher's default lookahead) is a bound the plan
guarantees (:func:`working_set_bound`), found from the distribution of row counts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..plan import EpochOrder, ShuffleOptions
from ..plan.shards import ShardCounts, fill_smallest
from .prefetch import ShardUsage

_CHUNK = 1 << 20  # positions evaluated per pass
_HORIZON_CHUNK = 1 << 15  # sampled positions per pass of a horizon scan
_HORIZON_SHARDS = 2  # a horizon holds this many times the shards asked for


class ShardAdvice:
    """The shards read from any position of one epoch on, in order of next use.

    Args:
        order: the epoch's order (an :class:`EpochOrder`, or any order with
            ``num_samples``, ``samples_at`` and ``shard_rows``).
        stride: positions between samples of the order (default: 1/64 of the smallest
            non-empty shard's rows, at least 1). Shards with fewer rows than the stride may
            be missed: a missed shard is fetched on demand, never read wrongly.
        working_set_shards: a bound on the shards in use at once that the caller knows (a
            mixture: the sum of its sources' bounds), instead of one computed here.

    Thread safety: every method may be called from several threads at once.
    """

    def __init__(self, order: EpochOrder | Any, *, stride: int | None = None,
                 working_set_shards: int | None = None) -> None:
        self.order = order
        counts = getattr(order, "counts", None)
        self._counts: ShardCounts | None = counts if isinstance(counts, ShardCounts) else None
        if self._counts is not None:
            smallest = self._counts.min_nonzero_rows()
        else:
            rows = np.asarray(order.shard_rows)
            smallest = int(rows[rows > 0].min())
        self.stride = stride or max(1, smallest // 64)
        self.num_samples = order.num_samples
        self._lock = threading.Lock()
        self._horizon: _Horizon | None = None
        self._last: tuple[Any, ...] | None = None  # the last answer (see upcoming)
        self._usage: ShardUsage | None = None
        self._working_set_shards: int | None = working_set_shards

    def upcoming(self, position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``count`` shards read at ``position`` or later, in order of next use, with
        that next use (shards already in use come first, with next use ``position``)."""
        # First and last reads are sampled at multiples of the stride, so the shards (and
        # which of them are in use) are the same for every position of ((k-1)s, ks]: the
        # last answer is reused, its in-use next uses moved to `position` (a step is a few
        # hundred positions, a stride often more).
        interval = (position + self.stride - 1) // self.stride
        with self._lock:
            horizon, last = self._horizon, self._last
        if last is not None and last[0] is horizon and last[2] == count:
            if last[6] <= position < last[7]:
                # a later position before any shard of the answer is done with: the same
                # shards, those first read by now in use (next use `position`)
                return last[3], np.maximum(last[4], position)
            if last[1] == interval:  # an earlier position of the same interval
                next_use = last[4].copy()
                next_use[:last[5]] = position
                return last[3], next_use
        answer = None if horizon is None else horizon.upcoming(position, count, self.stride)
        if answer is None:
            horizon = _Horizon.scan(self.order, position, count * _HORIZON_SHARDS, self.stride)
            answer = horizon.upcoming(position, count, self.stride)
            assert answer is not None  # a horizon scanned from `position` answers for it
        shards, next_use, in_use, until = answer
        with self._lock:
            self._horizon = horizon
            self._last = (horizon, interval, count, shards, next_use, in_use, position, until)
        return shards, next_use.copy()

    def working_set_shards(self) -> int:
        """The most shards in use at once in any epoch: :func:`working_set_bound` with one
        unit per shard (for an order without its shard counts and shuffle options, the
        most in use over this epoch, from a scan of it)."""
        if self._working_set_shards is None:
            shuffle = getattr(self.order, "shuffle", None)
            if self._counts is not None and isinstance(shuffle, ShuffleOptions):
                self._working_set_shards = working_set_shards_bound(self._counts, shuffle)
            else:
                ones = np.ones(len(self.usage.first), dtype=np.int64)
                self._working_set_shards = self.usage.working_set_bytes(ones)
        return self._working_set_shards

    @property
    def usage(self) -> ShardUsage:
        """First and last read of every shard over the whole epoch: a scan of the epoch,
        O(shards) memory (for diagnostics and tests; the prefetcher never needs it)."""
        if self._usage is None:
            self._usage = shard_usage(self.order, self.stride)
        return self._usage

    def working_set_bytes(self, shard_bytes: np.ndarray) -> int:
        """The most bytes of shards in use at once over the epoch (a scan; see
        :attr:`usage`)."""
        return self.usage.working_set_bytes(shard_bytes)


class _Horizon:
    """First and last sampled read of each shard read in positions ``[start, stop)``,
    sorted by first read (a stretch of the epoch, scanned once)."""

    def __init__(self, start: int, stop: int, shards: np.ndarray, first: np.ndarray,
                 last: np.ndarray, complete: bool) -> None:
        by_first = np.argsort(first, kind="stable")
        self.start, self.stop, self.complete = start, stop, complete
        self.shards, self.first, self.last = shards[by_first], first[by_first], last[by_first]

    @classmethod
    def scan(cls, order: Any, position: int, wanted: int, stride: int) -> _Horizon:
        """Scan from ``position`` (rounded down to a multiple of ``stride``) until
        ``wanted`` distinct shards are seen or the epoch ends."""
        start = position - position % stride
        stop = start
        shards = first = last = np.zeros(0, dtype=np.int64)
        total = order.num_samples
        while stop < total and shards.size < wanted:
            end = min(total, stop + _HORIZON_CHUNK * stride)
            positions = np.arange(stop, end, stride, dtype=np.int64)
            seen = np.asarray(order.samples_at(positions)[1], dtype=np.int64)
            unique, at = np.unique(seen, return_index=True)
            _, at_end = np.unique(seen[::-1], return_index=True)
            shards, first, last = _merge(shards, first, last, unique, positions[at],
                                         positions[len(positions) - 1 - at_end])
            stop = end
        return cls(start, stop, shards, first, last, complete=stop >= total)

    def upcoming(self, position: int, count: int, stride: int,
                 ) -> tuple[np.ndarray, np.ndarray, int, int] | None:
        """The answer of :meth:`ShardAdvice.upcoming`, how many of its shards are in use
        (they come first) and the first later position whose answer differs in its shards
        (one of those in use is done with), or None when this horizon cannot give it
        (``position`` before it, or too few of its shards left).

        Until that bound the answer only moves shards from ahead to in use as their first
        read passes: both are ordered by first read, so the list of shards is the same.
        """
        if position < self.start:
            return None
        begin = int(np.searchsorted(self.first, position, side="left"))
        in_use = np.flatnonzero(self.last[:begin] >= position - stride)
        ahead = np.arange(begin, min(begin + count, self.first.size))
        chosen = np.concatenate([in_use, ahead])[:count]
        if chosen.size < count and not self.complete:
            return None  # shards beyond the horizon could come next
        next_use = np.concatenate([np.full(in_use.size, position, dtype=np.int64),
                                   self.first[ahead]])[:count]
        kept = min(int(in_use.size), count)
        # a shard of the answer is done with once position - stride passes its last read;
        # with more in use than count, which of them are cut may change at any position
        until = int(self.last[chosen].min()) + stride + 1 if chosen.size else self.stop
        if in_use.size > count:
            until = position + 1
        return self.shards[chosen], next_use, kept, until


def _merge(shards: np.ndarray, first: np.ndarray, last: np.ndarray, more: np.ndarray,
           more_first: np.ndarray, more_last: np.ndarray,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-shard (first, last) of two scans, the second one later in the epoch (both sorted
    by shard)."""
    if not shards.size:
        return more, more_first, more_last
    merged = np.union1d(shards, more)
    out_first = np.full(merged.size, np.iinfo(np.int64).max, dtype=np.int64)
    out_last = np.full(merged.size, -1, dtype=np.int64)
    at = np.searchsorted(merged, shards)
    out_first[at], out_last[at] = first, last
    at = np.searchsorted(merged, more)
    out_first[at] = np.minimum(out_first[at], more_first)
    out_last[at] = more_last
    return merged, out_first, out_last


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


def working_set_shards_bound(counts: ShardCounts, shuffle: ShuffleOptions) -> int:
    """:func:`working_set_bound` with one unit per shard (how many shards are in use at
    once), from the distribution of row counts: no sort of every shard."""
    values, numbers = counts.histogram()
    read = int(numbers[values > 0].sum())
    if read == 0:
        return 0
    if not shuffle.enabled:
        return 1
    window = shuffle.window
    span = window + window // 2 + (window if shuffle.stagger else 0)
    if shuffle.window_unit == "shards":
        return min(read, span)
    taken, filled, following = fill_smallest((values, numbers), span)
    inside = float(taken)
    if following:  # the next one, in part
        inside += (span - filled) * (1.0 / following)
    return min(read, min(read, 2) + int(np.ceil(inside)))


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
