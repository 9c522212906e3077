"""The shard-permuted stream: shards in a keyed order ("slots"), each shard's rows in order.

Slot ``k`` holds shard ``permute(k)`` (a keyed bijection, evaluated per slot: no table), and
covers the stream indices ``[starts[k], starts[k + 1])`` where ``starts`` sums the rows of the
shards in slot order. Stream index ``v`` of slot ``k`` is row ``v - starts[k]`` of its shard,
sample id ``offsets[shard] + v - starts[k]``.

Nothing here is O(shards) in memory: ``starts`` is known at every :data:`GROUP`-th slot
("coarse", extended as far as the stream is read, one pass over the slots it passes), and
inside the groups that positions touch ("fine": the group's shards and starts, computed on
demand and kept in a small cache that grows with the groups one call touches, so a shuffle
window's groups stay cached). A position costs a binary search in the coarse table and one
in its group; resuming in the middle of an epoch costs one pass over the slots before it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .bijection import TAG_SHARDS, derive_key, permute
from .shards import ShardCounts

GROUP_BITS = 10
GROUP = 1 << GROUP_BITS  # slots per group of the stream's starts
_EXTEND_GROUPS = 64  # groups summed per pass when the coarse table is extended
_MIN_KEPT_GROUPS = 64


class ShardStream:
    """The shards of an epoch in permuted (or index) order.

    Args:
        counts: the shards' row counts (at least one sample).
        shuffled: permute the shards by ``(seed, epoch)``; otherwise keep index order.

    Memory: ``16 * shards / GROUP`` bytes of coarse starts plus the groups in use (16 KB
    each). Thread safety: every method may be called from several threads at once.
    """

    def __init__(self, counts: ShardCounts, seed: int, epoch: int, shuffled: bool) -> None:
        self.counts = counts
        self.num_shards = counts.num_shards
        self.shard_offsets = counts.offsets
        self.total = counts.total
        self._key = derive_key(seed, epoch, TAG_SHARDS) if shuffled else None
        self.num_groups = -(-self.num_shards // GROUP)
        self._coarse = np.zeros(1, dtype=np.int64)  # starts of groups 0..m, m groups summed
        self._groups: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._kept = _MIN_KEPT_GROUPS
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
            shards = np.searchsorted(self.shard_offsets, stream, side="right") - 1
            return stream.copy(), shards
        if stream.size == 0:
            return stream.copy(), stream.copy()
        _, shards, starts, at = self._place(stream)
        shard = shards[at]
        return stream - starts[at] + self.shard_offsets[shard], shard

    def slots_of(self, stream: np.ndarray) -> np.ndarray:
        """The slot holding each stream index (int64, each in ``[0, total)``)."""
        if self._key is None or stream.size == 0:
            return np.searchsorted(self.shard_offsets, stream, side="right") - 1
        first, _, _, at = self._place(stream)
        sizes = np.minimum(GROUP, self.num_shards - (first << GROUP_BITS))
        ends = np.cumsum(sizes)
        which = np.searchsorted(ends, at, side="right")  # the touched group of each place
        return (first[which] << GROUP_BITS) + at - (ends[which] - sizes[which])

    def _place(self, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                  np.ndarray]:
        """(touched groups, their shards and starts concatenated, the place of each stream
        index in them)."""
        first, shards, starts = self._touched(self._groups_of(stream))
        # side="right": an empty shard's start equals the next one's, so it holds no index
        return first, shards, starts, np.searchsorted(starts, stream, side="right") - 1

    def starts_at(self, slots: np.ndarray) -> np.ndarray:
        """The first stream index of each slot (``total`` for slot ``num_shards``)."""
        slots = np.asarray(slots, dtype=np.int64)
        out = np.full(slots.shape, self.total, dtype=np.int64)
        inside = slots < self.num_shards
        if not inside.any():
            return out
        if self._key is None:
            out[inside] = self.shard_offsets[slots[inside]]
            return out
        groups = slots[inside] >> GROUP_BITS
        self._extend_to_group(int(groups.max()) + 1)
        first, _, starts = self._touched(groups)
        # the touched groups' slots, concatenated in group order: find each slot's place
        sizes = np.minimum(GROUP, self.num_shards - (first << GROUP_BITS))
        base = np.cumsum(sizes) - sizes
        place = base[np.searchsorted(first, groups)] + (slots[inside] & (GROUP - 1))
        out[inside] = starts[place]
        return out

    # ------------------------------------------------------------ the coarse table

    def _groups_of(self, stream: np.ndarray) -> np.ndarray:
        """The group holding each stream index (extending the coarse table to cover them)."""
        top = int(stream.max()) if stream.size else 0
        coarse = self._coarse
        while coarse[-1] <= top and coarse.size - 1 < self.num_groups:
            self._extend_to_group(coarse.size - 1 + _EXTEND_GROUPS)
            coarse = self._coarse
        return np.searchsorted(coarse, stream, side="right") - 1

    def _extend_to_group(self, group: int) -> None:
        """Sum the rows of the groups up to ``group`` (exclusive) into the coarse table."""
        with self._extend_lock:
            known = self._coarse.size - 1
            stop = min(group, self.num_groups)
            if stop <= known:
                return
            slots = np.arange(known << GROUP_BITS, min(self.num_shards, stop << GROUP_BITS),
                              dtype=np.int64)
            rows = self.counts.rows[self.slot_shard(slots)]
            sums = np.add.reduceat(rows, np.arange(0, slots.size, GROUP))
            grown = np.empty(stop + 1, dtype=np.int64)
            grown[:known + 1] = self._coarse
            np.cumsum(sums, out=grown[known + 1:])
            grown[known + 1:] += self._coarse[-1]
            self._coarse = grown  # (replaced whole: readers hold the old one meanwhile)

    # ------------------------------------------------------------ the groups in use

    def _touched(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct groups of ``groups`` (ascending), and the shards and starts of their
        slots, concatenated in group order."""
        low, high = int(groups.min()), int(groups.max())
        if high - low < 4 * groups.size:
            first = np.flatnonzero(np.bincount(groups - low, minlength=high - low + 1)) + low
        else:
            first = np.unique(groups)
        parts = [self._group(int(g)) for g in first.tolist()]
        with self._lock:
            self._kept = max(self._kept, 4 * len(parts))
        if len(parts) == 1:
            return first, *parts[0]
        return (first, np.concatenate([p[0] for p in parts]),
                np.concatenate([p[1] for p in parts]))

    def _group(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(shards, starts) of the slots of one group (cached)."""
        with self._lock:
            found = self._groups.get(group)
            if found is not None:
                self._groups.move_to_end(group)
                return found
        start = int(self._coarse[group])
        slots = np.arange(group << GROUP_BITS,
                          min(self.num_shards, (group + 1) << GROUP_BITS), dtype=np.int64)
        shards = self.slot_shard(slots)
        starts = np.empty(slots.size, dtype=np.int64)
        starts[0] = start
        np.cumsum(self.counts.rows[shards[:-1]], out=starts[1:])
        starts[1:] += start
        shards.setflags(write=False)
        starts.setflags(write=False)
        with self._lock:
            self._groups[group] = (shards, starts)
            while len(self._groups) > self._kept:
                self._groups.popitem(last=False)
        return shards, starts
