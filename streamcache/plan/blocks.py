"""A small cache of the position -> stream-index map, in blocks of consecutive positions.

Evaluating the shuffle is cheapest on long arrays (numpy's per-call cost dominates short
ones), so a reader moving forward through the epoch pays for each block once, in one
vectorized pass, and then slices it. A single probe at a new place (the first sample after a
resume) is evaluated directly, so it costs microseconds rather than a whole block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
_PROBE_LIMIT = BLOCK // 8  # a first, shorter request in a block is answered directly
_MAX_TOUCHED = 4096


class PositionBlocks:
    """Least-recently-used blocks of ``compute(positions)`` for positions in ``[0, total)``.

    Args:
        compute: the pure map to cache; takes an int64 array of n positions and returns a
            (rows, n) array, one column per position.
        total: number of positions.
        cache_bytes: memory for cached blocks (int64, ``BLOCK`` entries each); below one block
            nothing is cached.

    Thread safety: safe; the lock guards the dictionaries only, never a computation.
    """

    def __init__(self, compute: Callable[[np.ndarray], np.ndarray], total: int,
                 cache_bytes: int) -> None:
        self._compute = compute
        self._total = total
        self._capacity = cache_bytes // (BLOCK * 16)
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._touched: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, start: int, stop: int) -> np.ndarray:
        """``compute(arange(start, stop))``; the result may be a read-only view of the cache."""
        if stop <= start:
            return self._compute(np.zeros(0, dtype=np.int64))
        first, last = start >> BLOCK_BITS, (stop - 1) >> BLOCK_BITS
        if last - first >= 2 or self._capacity == 0:
            # A long scan (prefetch planning): one direct pass, without evicting the reader's
            # blocks.
            return self._compute(np.arange(start, stop, dtype=np.int64))
        pieces = [self._piece(block, max(start, block << BLOCK_BITS),
                              min(stop, (block + 1) << BLOCK_BITS))
                  for block in range(first, last + 1)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)

    def _piece(self, block: int, start: int, stop: int) -> np.ndarray:
        base = block << BLOCK_BITS
        table = self._get(block, probing=stop - start < _PROBE_LIMIT)
        if table is None:
            return self._compute(np.arange(start, stop, dtype=np.int64))
        return table[:, start - base: stop - base]

    def _get(self, block: int, *, probing: bool) -> np.ndarray | None:
        """The cached block, a newly computed one, or None when a probe should go direct."""
        with self._lock:
            table = self._blocks.get(block)
            if table is not None:
                self._blocks.move_to_end(block)
                return table
            # A probe goes direct, unless the reader is moving forward from the block before.
            if probing and block not in self._touched and block - 1 not in self._blocks:
                self._touched[block] = None
                if len(self._touched) > _MAX_TOUCHED:
                    self._touched.popitem(last=False)
                return None
        base = block << BLOCK_BITS
        table = self._compute(np.arange(base, min(self._total, base + BLOCK), dtype=np.int64))
        table.flags.writeable = False
        with self._lock:
            self._blocks[block] = table
            self._blocks.move_to_end(block)
            while len(self._blocks) > self._capacity:
                self._blocks.popitem(last=False)
        return table
