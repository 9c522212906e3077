"""The shard-permuted stream: shards in a keyed order ("slots"), each shard's rows in order.

Slot ``k`` holds shard ``permute(k)`` (a keyed bijection, evaluated per slot: no table), and
covers the stream indices ``[starts[k], starts[k + 1])`` where ``starts`` sums the rows of the
shards in slot order. Stream index ``v`` of slot ``k`` is row ``v - starts[k]`` of its shard,
sample id ``offsets[shard] + v - starts[k]``.

Nothing here is O(shards) in memory unless the positions asked for are (a full shuffle):

- ``starts`` is known at every :data:`GROUP`-th slot ("coarse"), extended as far as the
  positions asked for reach, one pass over the slots they pass;
- positions are resolved in a *span*: the slots of a run of groups around them, with their
  shards, starts and a bucket table (one entry per ``2**shift`` stream indices, ``2**shift``
  at most the mean shard's rows, so about one a shard) that gives a slot to start from, a
  step or two forward finding the right one (a bucket of many tiny shards falls back to a
  binary search). A span reaches a run of groups ahead of the ones asked for, so a reader
  moving forward builds one every few windows; the last few are kept.
"""

from __future__ import annotations

import threading

import numpy as np

from .bijection import TAG_SHARDS, derive_key, permute
from .shards import ShardCounts

GROUP_BITS = 10
GROUP = 1 << GROUP_BITS  # slots per group: the coarse table's step
_EXTEND_GROUPS = 16  # groups summed per pass when the coarse table is extended
_SPANS_KEPT = 3  # spans kept (a reader's, the prefetch advice's, one more)
_FORWARD_STEPS = 3  # forward steps from the bucket's slot before the binary search


class _Span:
    """Slots ``[first, first + count)`` with their shards, their starts (and the end), and a
    bucket table from stream indices to slots. Immutable."""

    def __init__(self, first: int, shards: np.ndarray, starts: np.ndarray) -> None:
        self.first = first
        self.shards = shards
        self.starts = starts  # count + 1 values
        self.low, self.high = int(starts[0]), int(starts[-1])
        count = shards.size
        self.shift = max(0, ((self.high - self.low) // max(1, count)).bit_length() - 1)
        first_bucket = (starts - self.low + ((1 << self.shift) - 1)) >> self.shift
        self.bucket_slot = np.repeat(np.arange(count, dtype=np.int32), np.diff(first_bucket))

    def covers(self, low: int, high: int) -> bool:
        return self.low <= low and high < self.high

    def place(self, stream: np.ndarray) -> np.ndarray:
        """The span-local slot of each stream index (each inside the span)."""
        slot = self.bucket_slot[(stream - self.low) >> self.shift].astype(np.int64)
        starts = self.starts
        for _ in range(_FORWARD_STEPS):
            behind = starts[slot + 1] <= stream
            if not behind.any():
                return slot
            slot += behind
        behind_at = np.flatnonzero(starts[slot + 1] <= stream)
        if behind_at.size:
            # side="right" skips empty shards, whose start equals the next shard's start
            slot[behind_at] = np.searchsorted(starts, stream[behind_at], side="right") - 1
        return slot


class ShardStream:
    """The shards of an epoch in permuted (or index) order.

    Args:
        counts: the shards' row counts (at least one sample).
        shuffled: permute the shards by ``(seed, epoch)``; otherwise keep index order.

    Memory: ``8 * shards / GROUP`` bytes of coarse starts, plus the spans kept (about 20
    bytes a slot of the runs of groups read lately: a few windows; every shard for a full
    shuffle). Thread safety: every method may be called from several threads at once.
    """

    def __init__(self, counts: ShardCounts, seed: int, epoch: int, shuffled: bool) -> None:
        self.counts = counts
        self.num_shards = counts.num_shards
        self.total = counts.total
        self._key = derive_key(seed, epoch, TAG_SHARDS) if shuffled else None
        self.num_groups = -(-self.num_shards // GROUP)
        self._coarse = np.zeros(1, dtype=np.int64)  # starts of groups 0..m, m groups summed
        self._spans: list[_Span] = []
        self._lock = threading.Lock()
        self._extend_lock = threading.Lock()

    @property
    def shuffled(self) -> bool:
        return self._key is not None

    def slot_shard(self, slots: np.ndarray) -> np.ndarray:
        """The shard in each slot (int64)."""
        slots = np.asarray(slots, dtype=np.int64)
        if self._key is None:
            return slots.copy()
        return permute(slots, self.num_shards, self._key)

    def resolve(self, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample id, shard) of each stream index (int64 arrays, each in ``[0, total)``)."""
        if self._key is None:  # index order: the stream index is the sample id
            return stream.copy(), self.counts.shard_of(stream)
        if stream.size == 0:
            return stream.copy(), stream.copy()
        span = self._span(int(stream.min()), int(stream.max()))
        local = span.place(stream)
        shard = span.shards[local]
        return stream - span.starts[local] + self.counts.first_ids(shard), shard

    def slots_of(self, stream: np.ndarray) -> np.ndarray:
        """The slot holding each stream index (int64, each in ``[0, total)``)."""
        if self._key is None or stream.size == 0:
            return self.counts.shard_of(stream)
        span = self._span(int(stream.min()), int(stream.max()))
        return span.place(stream) + span.first

    def starts_at(self, slots: np.ndarray) -> np.ndarray:
        """The first stream index of each slot (``total`` for slot ``num_shards``)."""
        slots = np.asarray(slots, dtype=np.int64)
        out = np.full(slots.shape, self.total, dtype=np.int64)
        inside = slots < self.num_shards
        if not inside.any():
            return out
        if self._key is None:
            out[inside] = self.counts.first_ids(slots[inside])
            return out
        wanted = slots[inside]
        low, high = int(wanted.min()) >> GROUP_BITS, int(wanted.max()) >> GROUP_BITS
        self._extend_to_group(high + 1)
        span = self._span_of_groups(low, high + 1)
        out[inside] = span.starts[wanted - span.first]
        return out

    # ------------------------------------------------------------ the coarse table

    def _group_of(self, index: int) -> int:
        """The group holding stream index ``index`` (extending the coarse table to it)."""
        coarse = self._coarse
        while coarse[-1] <= index and coarse.size - 1 < self.num_groups:
            self._extend_to_group(coarse.size - 1 + _EXTEND_GROUPS)
            coarse = self._coarse
        return int(np.searchsorted(coarse, index, side="right")) - 1

    def _extend_to_group(self, group: int) -> None:
        """Sum the rows of the groups up to ``group`` (exclusive) into the coarse table."""
        with self._extend_lock:
            known = self._coarse.size - 1
            stop = min(group, self.num_groups)
            if stop <= known:
                return
            slots = np.arange(known << GROUP_BITS, min(self.num_shards, stop << GROUP_BITS),
                              dtype=np.int64)
            rows = self.counts.rows_of(self.slot_shard(slots))
            sums = np.add.reduceat(rows, np.arange(0, slots.size, GROUP))
            grown = np.empty(stop + 1, dtype=np.int64)
            grown[:known + 1] = self._coarse
            np.cumsum(sums, out=grown[known + 1:])
            grown[known + 1:] += self._coarse[-1]
            self._coarse = grown  # (replaced whole: readers hold the old one meanwhile)

    # ------------------------------------------------------------ spans

    def _span(self, low: int, high: int) -> _Span:
        """A span holding stream indices ``low`` to ``high`` (a kept one, or a new one that
        also reaches as far ahead as it is long)."""
        with self._lock:
            for span in self._spans:
                if span.covers(low, high):
                    return span
        first, last = self._group_of(low), self._group_of(high)
        return self._span_of_groups(first, last + 1 + max(2, last - first + 1))

    def _span_of_groups(self, first: int, stop: int) -> _Span:
        """A span of groups ``[first, stop)`` (a kept one that holds them, or a new one)."""
        stop = min(stop, self.num_groups)
        with self._lock:
            for span in self._spans:
                if span.first <= first << GROUP_BITS and \
                        min(self.num_shards, stop << GROUP_BITS) <= span.first + span.shards.size:
                    return span
        self._extend_to_group(stop)
        slots = np.arange(first << GROUP_BITS, min(self.num_shards, stop << GROUP_BITS),
                          dtype=np.int64)
        shards = self.slot_shard(slots)
        starts = np.empty(slots.size + 1, dtype=np.int64)
        starts[0] = self._coarse[first]
        np.cumsum(self.counts.rows_of(shards), out=starts[1:])
        starts[1:] += starts[0]
        span = _Span(int(slots[0]), shards, starts)
        with self._lock:
            self._spans = [span, *self._spans][:_SPANS_KEPT]
        return span
