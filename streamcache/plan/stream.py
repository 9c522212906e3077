"""The shard-permuted stream: shards in a keyed order ("slots"), each shard's rows in order.

A stream index ``v`` lies in the slot ``k`` with ``starts[k] <= v < starts[k + 1]``; its
sample id is ``v + delta[k]``. Finding ``k`` is O(1) on average: a bucket table (one entry
per ``2**shift`` stream indices, about one per shard) gives the slot holding the bucket's
first index, and a step or two forward finds the one holding ``v``; the rare index that is
further on (many tiny shards in one bucket) falls back to a binary search, O(log shards).
"""

from __future__ import annotations

import numpy as np

from .bijection import TAG_SHARDS, derive_key, permute

_FORWARD_STEPS = 3  # forward steps from the bucket's slot before the binary search


class ShardStream:
    """The shards of an epoch in permuted (or index) order.

    Args:
        shard_rows: row count of each shard in index order (int64, at least one sample).
        shuffled: permute the shards by ``(seed, epoch)``; otherwise keep index order.

    Memory: O(shards). Thread safety: immutable after construction.
    """

    def __init__(self, shard_rows: np.ndarray, seed: int, epoch: int, shuffled: bool) -> None:
        count = int(shard_rows.size)
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(shard_rows, out=offsets[1:])
        shards = np.arange(count, dtype=np.int64)
        if shuffled:
            shards = permute(shards, count, derive_key(seed, epoch, TAG_SHARDS))
        self.shard_offsets = offsets
        self.slot_shard = shards
        self.starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(shard_rows[shards], out=self.starts[1:])
        self.total = int(self.starts[-1])
        self.delta = offsets[shards] - self.starts[:-1]
        self._shift = max(0, (self.total // max(1, count)).bit_length() - 1)
        # Bucket b starts at b << shift; slot k holds the buckets whose start it holds.
        first_bucket = (self.starts + ((1 << self._shift) - 1)) >> self._shift
        slot_dtype = np.int32 if count < (1 << 31) else np.int64
        self._bucket_slot = np.repeat(np.arange(count, dtype=slot_dtype), np.diff(first_bucket))

    def slots(self, stream: np.ndarray) -> np.ndarray:
        """The slot holding each stream index (int64 array, each in ``[0, total)``)."""
        slot = self._bucket_slot[stream >> self._shift].astype(np.int64)
        for _ in range(_FORWARD_STEPS):
            behind = self.starts[slot + 1] <= stream
            if not behind.any():
                return slot
            slot += behind
        behind_at = np.flatnonzero(self.starts[slot + 1] <= stream)
        if behind_at.size:
            # side="right" skips empty shards, whose start equals the next shard's start.
            slot[behind_at] = np.searchsorted(self.starts, stream[behind_at], side="right") - 1
        return slot
