"""What the locality split reads per sample, looked up without a table per shard: each
shard's offset (the node of its piece 0, a hash) and its numbers in the unit layout.

Both are asked for many samples at once (a plan of hundreds of steps) and for a step's few;
both keep only the shards seen last (:class:`ShardOffsets`; the layout's own cache, see
:mod:`streamcache.plan.unit_columns`), and a call of many samples looks each distinct shard
up once. Pure; no I/O.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import forksafe
from .owners import shard_offsets
from .unit_columns import DISTINCT_AT, KEY, KEY_ROWS, PIECE, distinct_values
from .units import UnitLayout

#: Shards whose offsets a split keeps (direct-mapped: shard ``k`` in slot ``k % SLOTS``).
OFFSET_SLOTS = 1 << 14
#: The rows of a piece or chunk key where a shard is one (no row reaches it).
_WHOLE = np.iinfo(np.int64).max


class ShardOffsets:
    """Each shard's offset (:func:`~streamcache.plan.owners.shard_offsets`), kept for the
    shards seen last (a shard is in many consecutive batches, and a lookup is cheaper than
    hashing).

    Thread safety: may be called from any thread (the cache fills under a lock).
    """

    def __init__(self, key: int, num_nodes: int) -> None:
        self.key, self.num_nodes = key, num_nodes
        self._values = np.zeros(OFFSET_SLOTS, dtype=np.int64)
        self._every: np.ndarray | None = None
        self._after_fork_in_child()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        """A fresh lock and an empty cache (also what a new one starts with): a parent's
        thread may have held the lock, or been between a slot's tag and its value, when the
        fork came."""
        self._lock = threading.Lock()
        # (an empty slot's tag is a shard of another slot: no shard asked matches it)
        self._tags = (np.arange(OFFSET_SLOTS, dtype=np.int64) + 1) & (OFFSET_SLOTS - 1)

    def __call__(self, shards: np.ndarray) -> np.ndarray:
        shards = np.asarray(shards, dtype=np.int64)
        if shards.size > OFFSET_SLOTS // 4:  # (a scan: each distinct shard hashed once)
            distinct, where = distinct_values(shards, int(shards.max()) + 1)
            return shard_offsets(self.key, distinct, self.num_nodes)[where].reshape(
                shards.shape)
        slots = shards & (OFFSET_SLOTS - 1)
        with self._lock:
            hit = self._tags[slots] == shards
            found = self._values[slots]
        if hit.all():
            return found
        missed = ~hit
        found[missed] = shard_offsets(self.key, shards[missed], self.num_nodes)
        with self._lock:
            self._values[slots[missed]] = found[missed]
            self._tags[slots[missed]] = shards[missed]
        return found

    def every(self, num_shards: int) -> np.ndarray:
        """Every shard's offset, of a small layout's ``num_shards`` shards (made once)."""
        table = self._every
        if table is None or table.size != num_shards:
            table = shard_offsets(self.key, np.arange(num_shards, dtype=np.int64),
                                  self.num_nodes)
            self._every = table
        return table


class StepFacts:
    """What the split reads of the layout for the samples of some steps, looked up once per
    distinct shard: each sample's piece within its shard, its shard offset, and the chunk
    key of the samples asked (its chunk unit, or its piece unit in a shard that is not cut;
    its shard without a layout).

    ``values`` are the looked-up fields (piece rows, key, key rows) of ``keys`` (None: of
    every shard, a dense layout's), and a sample ``k``'s are at ``where[k]`` (None: at
    ``k``)."""

    def __init__(self, layout: UnitLayout | None, shards: np.ndarray, rows: np.ndarray) -> None:
        self.layout, self.shards, self.rows = layout, shards, rows
        self._looked_up = layout is None
        self.keys: np.ndarray | None = shards
        self.where: np.ndarray | None = None
        self.values: list[np.ndarray] = []
        self._piece: np.ndarray | None = None
        self._entries: np.ndarray | None = None

    def _look_up(self) -> None:
        """Look the samples' shards up (once, when first needed: a balanced step of canonical
        partitions needs nothing)."""
        if self._looked_up:
            return
        self._looked_up = True
        layout, shards = self.layout, self.shards
        assert layout is not None
        fields = (PIECE, KEY, KEY_ROWS)
        if layout.dense:
            self.values, self.where = layout.lookup_indexed(shards, fields)
            self.keys = None
            return
        keys = shards
        if shards.size > DISTINCT_AT:  # (many steps at once: each shard looked up once)
            keys, where = distinct_values(shards, layout.num_shards)
            # (gathers by intp indices are 2-3x faster than by the table's int32 ones)
            self.where = where.astype(np.intp)
        self.keys, self.values = keys, layout.lookup(keys, fields)

    def per_sample(self, values: np.ndarray, which: np.ndarray | None = None) -> np.ndarray:
        """``values`` (of :attr:`keys`) at each sample (of ``which``)."""
        at = self._at(which)
        return values if at is None else np.take(values, at)

    def _at(self, which: np.ndarray | None) -> np.ndarray | None:
        """Where the values of each sample (of ``which``) are (None: at the sample)."""
        self._look_up()
        if self.where is None:
            return which
        return self.where if which is None else np.take(self.where, which)

    def entries(self) -> np.ndarray:
        """Each sample's entry in the looked-up tables (int64): of :meth:`owner_tables` and
        :meth:`chunk_tables`."""
        self._look_up()
        if self.where is not None:
            return self.where
        if self._entries is None:
            self._entries = np.arange(self.shards.size, dtype=np.int64)
        return self._entries

    def owner_tables(self, offsets: ShardOffsets) -> tuple[np.ndarray, np.ndarray]:
        """The shard offsets and piece rows of the looked-up tables (a shard without a layout
        is one piece): what ``_native.owner_nodes`` reads at :meth:`entries`."""
        self._look_up()
        if self.keys is None:
            assert self.layout is not None
            table = offsets.every(self.layout.num_shards)
        else:
            table = offsets(self.keys)
        if self.layout is None:
            return table, np.full(table.size, _WHOLE, dtype=np.int64)
        return table, self.values[0]

    def chunk_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The chunk key bases and key rows of the looked-up tables (a sample's chunk key is
        ``base + row // key_rows``; without a layout, its shard)."""
        self._look_up()
        if self.layout is None:
            return self.shards, np.full(self.shards.size, _WHOLE, dtype=np.int64)
        return self.values[1], self.values[2]

    def known_piece(self, piece: np.ndarray) -> None:
        """Keep each sample's piece, computed elsewhere (``_native.owner_nodes``)."""
        self._piece = piece

    def piece(self) -> np.ndarray:
        """Each sample's piece within its shard (kept: the split and ``holds`` ask twice)."""
        if self._piece is None:
            if self.layout is None:
                self._piece = np.zeros(self.shards.shape, dtype=np.int64)
            else:
                self._look_up()
                self._piece = self.rows // self.per_sample(self.values[0])
        return self._piece

    def chunk_keys(self, which: np.ndarray | None = None) -> np.ndarray:
        """The chunk keys of the samples ``which`` (all by default)."""
        if self.layout is None:
            return self.shards if which is None else self.shards[which]
        rows = self.rows if which is None else np.take(self.rows, which)
        at = self._at(which)
        keys, key_rows = (self.values[1], self.values[2]) if at is None else (
            np.take(self.values[1], at), np.take(self.values[2], at))
        return keys + rows // key_rows


__all__ = ["OFFSET_SLOTS", "ShardOffsets", "StepFacts"]
