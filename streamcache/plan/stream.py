"""The shard-permuted stream: shards in a keyed order ("slots"), each shard's rows in order.

A stream index ``v`` lies in the slot ``k`` with ``starts[k] <= v < starts[k + 1]``; its
sample id is ``v + delta[k]``. Finding ``k`` is a binary search, O(log shards); for the long
arrays of a block it is a gather from a dense slot table over the few windows being read,
rebuilt as the reader moves on (memory O(window), time O(1) per sample).
"""

from __future__ import annotations

import numpy as np

from .bijection import TAG_SHARDS, derive_key, permute

_DENSE_LIMIT = 1 << 24  # most stream indices a dense slot table may span
_DENSE_MIN_QUERY = 4096  # shorter queries use the binary search


class ShardStream:
    """The shards of an epoch in permuted (or index) order.

    Args:
        shard_rows: row count of each shard in index order (int64, at least one sample).
        shuffled: permute the shards by ``(seed, epoch)``; otherwise keep index order.

    Thread safety: safe; the dense table is replaced by one attribute assignment.
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
        self.slot_rows = shard_rows[shards]
        self.starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(self.slot_rows, out=self.starts[1:])
        self.total = int(self.starts[-1])
        self.delta = offsets[shards] - self.starts[:-1]
        self._slot_dtype = np.int32 if count < (1 << 31) else np.int64
        self._dense: tuple[int, int, np.ndarray] = (0, 0, np.zeros(0, self._slot_dtype))

    def slots(self, stream: np.ndarray) -> np.ndarray:
        """The slot holding each stream index (int64 array in ``[0, total)``)."""
        if stream.size == 0:
            return np.zeros(0, dtype=np.int64)
        low, high = int(stream.min()), int(stream.max())
        first = int(np.searchsorted(self.starts, low, side="right")) - 1
        last = int(np.searchsorted(self.starts, high, side="right")) - 1
        if stream.size >= _DENSE_MIN_QUERY:
            base, end, table = self._dense
            if not (base <= low and high < end):
                base, end, table = self._build_dense(first, last)
            if base <= low and high < end:
                return table[stream - base].astype(np.int64)
        window = self.starts[first: last + 2]
        # side="right" skips empty shards, whose start equals the next shard's start.
        return first - 1 + np.searchsorted(window, stream, side="right")

    def _build_dense(self, first: int, last: int) -> tuple[int, int, np.ndarray]:
        """A slot table from slot ``first`` on, reaching past ``last`` for a forward reader."""
        base = int(self.starts[first])
        reach = int(self.starts[last + 1]) - base
        if reach > _DENSE_LIMIT:
            return (0, 0, np.zeros(0, self._slot_dtype))
        end = min(self.total, base + max(2 * reach, 1 << 16), base + _DENSE_LIMIT)
        stop_slot = max(last + 1, int(np.searchsorted(self.starts, end, side="left")))
        if int(self.starts[stop_slot]) - base > _DENSE_LIMIT:  # a huge shard just ahead
            stop_slot = last + 1
        end = int(self.starts[stop_slot])
        table = np.repeat(np.arange(first, stop_slot, dtype=self._slot_dtype),
                          self.slot_rows[first:stop_slot])
        self._dense = (base, end, table)
        return self._dense
