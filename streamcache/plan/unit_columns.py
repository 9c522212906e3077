"""The per-shard numbers of a unit layout, read a block of shards at a time.

A :class:`~streamcache.plan.units.UnitLayout` needs, for the shards a step reads, their rows,
rows per chunk, rows per piece and the first unit of each (prefix sums over every shard
before). Kept as arrays, that is seven int64 values a shard in every rank and worker process:
about 55 MB at a million shards, twice where a mixture's part is taken apart, beside the
index's own columns, which a node shares (format/node_table.py). Here nothing is kept per
shard:

- a :class:`ShardColumns` gives a block of shards' rows, chunk rows and piece rows when
  asked (:class:`ArrayColumns` from arrays; the loader's from the index's shared columns);
- :class:`ColumnTables` scans them once when made (checks, totals, the digest, and the prefix
  sums at every :data:`BLOCK`-th shard: 16 bytes per 128 shards), then answers lookups for
  the shards asked from a cache of :data:`SLOTS` shards (two slots each, cuckoo hashing),
  reading a miss's own numbers and those of the shards before it in its block (a step's
  shards are few and recur step after step).

Pure; no I/O beyond what a ShardColumns reads.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from .. import forksafe
from ._util import PlanError

BLOCK_BITS = 7
#: Shards a block holds: the prefix sums are kept at every BLOCK-th shard (16 bytes per
#: BLOCK shards: 125 KB at a million).
BLOCK = 1 << BLOCK_BITS
#: Shards a scan reads at once when the tables are made (a multiple of BLOCK).
SCAN = 1 << 16
#: Shards the lookup cache holds (shard ``k`` in slot ``k % SLOTS`` or in a second slot
#: that a multiplicative hash gives it).
SLOTS = 1 << 14
#: Layouts of at most this many shards keep every shard's numbers (56 bytes a shard, what
#: the cache takes) and look them up by index.
DENSE_SHARDS = SLOTS
#: Lookups of more shards than this (a plan of many steps at once) look up each distinct
#: shard once (:func:`distinct_values`).
DISTINCT_AT = 4096
#: Rows per chunk up to which the median is exact (a chunk of more rows counts as this
#: many: what the median decides, pieces held twice below 4 rows a chunk, does not change).
MEDIAN_CAP = 1 << 16
_MOVES = 16  # slots an insertion tries before it drops what it moved last
_EMPTY = np.iinfo(np.int64).min
_GOLDEN = 0x9E3779B97F4A7C15
# what a lookup gives of a shard
ROWS, CHUNK, PIECE, PIECE_BASE, CHUNK_BASE, KEY, KEY_ROWS = range(7)
FIELDS = (ROWS, CHUNK, PIECE, PIECE_BASE, CHUNK_BASE, KEY, KEY_ROWS)
_NONE = np.iinfo(np.int64).max
_SHIFT = 64 - (SLOTS.bit_length() - 1)


def distinct_values(values: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of an int64 array of values in ``[0, bound)`` (in no particular
    order) and where each value is among them: ``distinct[where] == values``.

    Without a sort: each value writes its position into a scratch table indexed by value
    (the last write wins), the values that find their own position are the distinct ones.
    The table is ``4 * bound`` bytes of address space, of which only the pages the values
    touch are ever written (made and dropped in the call).

    Raises:
        PlanError: a value outside ``[0, bound)``.
    """
    values = np.asarray(values, dtype=np.int64).ravel()
    if values.size and (int(values.min()) < 0 or int(values.max()) >= bound):
        raise PlanError(f"a shard out of range (the layout has {bound})")
    count = values.size
    index = np.int32 if count < 1 << 31 else np.int64
    table = np.empty(bound, dtype=index)
    positions = np.arange(count, dtype=index)
    table[values] = positions
    distinct = values[table[values] == positions]
    table[distinct] = np.arange(distinct.size, dtype=index)
    return distinct, table[values]


def _median(histogram: np.ndarray) -> int:
    """``int(np.median(...))`` of the values a histogram counts (0: none)."""
    total = int(histogram.sum())
    if total == 0:
        return 0
    cumulative = np.cumsum(histogram)
    low, high = np.searchsorted(cumulative, [(total - 1) // 2 + 1, total // 2 + 1])
    return int((int(low) + int(high)) / 2)


def _other_slot(shards: np.ndarray) -> np.ndarray:
    """Each shard's second slot (a multiplicative hash: unlike the first, ``shard % SLOTS``,
    it spreads shards that share their low bits)."""
    hashed = shards.astype(np.uint64) * np.uint64(_GOLDEN)
    return (hashed >> np.uint64(_SHIFT)).astype(np.int64)


def _slot2(shard: int) -> int:
    """:func:`_other_slot` of one shard."""
    return ((shard * _GOLDEN) & 0xFFFFFFFFFFFFFFFF) >> _SHIFT


class ShardColumns(Protocol):
    """Where a layout's per-shard numbers come from (picklable)."""

    @property
    def num_shards(self) -> int: ...

    def block(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows, rows per chunk (0: not cut) and rows per piece of shards ``[first, stop)``
        (int64 arrays, as given: :func:`normalized` checks them)."""
        ...

    def at(self, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`block`'s numbers of the shards ``shards`` (any order, each existing)."""
        ...


class ArrayColumns:
    """:class:`ShardColumns` of three arrays (one entry per shard, kept as given)."""

    def __init__(self, rows: np.ndarray, chunk: np.ndarray, piece: np.ndarray) -> None:
        arrays = [np.array(a, dtype=np.int64) for a in (rows, chunk, piece)]
        if not arrays[0].shape == arrays[1].shape == arrays[2].shape or arrays[0].ndim != 1:
            raise PlanError("a unit layout needs one row count, chunk size and piece size "
                            "per shard")
        for array in arrays:
            array.setflags(write=False)
        self.rows, self.chunk, self.piece = arrays

    @property
    def num_shards(self) -> int:
        return int(self.rows.size)

    def block(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.rows[first:stop], self.chunk[first:stop], self.piece[first:stop]

    def at(self, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.rows[shards], self.chunk[shards], self.piece[shards]

    def __reduce__(self) -> tuple[object, ...]:
        return (ArrayColumns, (self.rows, self.chunk, self.piece))


def normalized(rows: np.ndarray, chunk: np.ndarray, piece: np.ndarray,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Checked int64 rows, chunk rows, piece rows (a shard that is not cut: one piece of all
    its rows) and each shard's pieces and chunk units.

    Raises:
        PlanError: negative counts, a piece below one row, or a piece that is not whole
            chunks.
    """
    rows, chunk, piece = (np.asarray(a, dtype=np.int64) for a in (rows, chunk, piece))
    if (rows < 0).any() or (chunk < 0).any() or (piece < 1).any():
        raise PlanError("a unit layout's counts must be non-negative (pieces positive)")
    cut = chunk > 0
    if (piece[cut] % chunk[cut]).any():
        raise PlanError("a piece must hold whole chunks")
    return _derived(rows, chunk, piece)


def _derived(rows: np.ndarray, chunk: np.ndarray, piece: np.ndarray,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`normalized` of counts checked before."""
    rows, chunk, piece = (np.asarray(a, dtype=np.int64) for a in (rows, chunk, piece))
    cut = chunk > 0
    piece = np.where(cut, piece, np.maximum(rows, 1))
    pieces = np.maximum(1, -(-rows // piece))
    chunks = np.where(cut, -(-rows // np.maximum(chunk, 1)), 0)
    return rows, chunk, piece, pieces, chunks


class _Joined:
    """Several sources side by side in one shard space."""

    def __init__(self, sources: Sequence[ShardColumns]) -> None:
        self.sources = list(sources)
        self.starts = np.concatenate(
            ([0], np.cumsum([s.num_shards for s in self.sources]))).astype(np.int64)

    def block(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = []
        for k, source in enumerate(self.sources):
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            if lo < stop and first < hi:
                parts.append(source.block(max(first, lo) - lo, min(stop, hi) - lo))
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate([np.asarray(p[i], dtype=np.int64) for p in parts])
                     for i in range(3))  # type: ignore[return-value]

    def at(self, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self.sources) == 1:
            return self.sources[0].at(shards)
        source = np.searchsorted(self.starts, shards, side="right") - 1
        out = tuple(np.empty(shards.shape, dtype=np.int64) for _ in range(3))
        for k in np.unique(source).tolist():
            here = source == k
            for array, values in zip(out, self.sources[k].at(shards[here] - self.starts[k]),
                                     strict=True):
                array[here] = values
        return out  # type: ignore[return-value]


class ColumnTables:
    """The layout's numbers over ``sources`` (each a part of one shard space, in order):
    totals, aggregates and the digest from one scan, and per-shard lookups.

    Raises:
        PlanError: see :func:`normalized`.

    Thread safety: lookups may be called from any thread (the cache fills under a lock).
    """

    def __init__(self, sources: Sequence[ShardColumns]) -> None:
        self._joined = _Joined(sources)
        self.num_shards = int(self._joined.starts[-1])
        blocks = -(-self.num_shards // BLOCK)
        piece_base = np.zeros(blocks + 1, dtype=np.int64)
        chunk_base = np.zeros(blocks + 1, dtype=np.int64)
        samples = pieces = chunks = 0
        # how many cut shards have each number of rows per chunk (beyond MEDIAN_CAP: there)
        histogram = np.zeros(MEDIAN_CAP + 1, dtype=np.int64)
        largest = 0
        digest = hashlib.blake2b(digest_size=8)
        # (the digest is of every shard's rows, then chunk rows, then piece rows: one kind
        # per scan, as it always was, so a layout's units keep their cache folder)
        for kind in range(3):
            for first, _, block in self._scan():
                rows, chunk, piece, n_pieces, n_chunks = block
                digest.update((rows, chunk, piece)[kind].tobytes())
                if kind:
                    continue
                first_block = first >> BLOCK_BITS
                sums = np.cumsum(n_pieces)[BLOCK - 1::BLOCK] + pieces
                piece_base[first_block + 1:first_block + 1 + sums.size] = sums
                sums = np.cumsum(n_chunks)[BLOCK - 1::BLOCK] + chunks
                chunk_base[first_block + 1:first_block + 1 + sums.size] = sums
                samples += int(rows.sum())
                pieces += int(n_pieces.sum())
                chunks += int(n_chunks.sum())
                histogram += np.bincount(np.minimum(chunk[chunk > 0], MEDIAN_CAP),
                                         minlength=MEDIAN_CAP + 1)
                largest = max(largest, int(rows.max(initial=0)))
        piece_base[-1], chunk_base[-1] = pieces, chunks
        self.num_samples, self.num_pieces, self.num_chunks = samples, pieces, chunks
        self._piece_blocks, self._chunk_blocks = piece_base, chunk_base
        self._cut_shards = int(histogram.sum())
        self._median_chunk_rows = _median(histogram)
        self.max_shard_rows = largest
        self.digest_state: Any = digest  # (None in a copy unpickled: not needed again)
        self._start_lookups()

    def _start_lookups(self) -> None:
        forksafe.register(self)
        self._lock = threading.Lock()
        self._tags = np.full(0, _EMPTY, dtype=np.int64)
        self._values = np.zeros((len(FIELDS), 0), dtype=np.int64)
        self._dense: np.ndarray | None = None
        if self.num_shards <= DENSE_SHARDS:  # (as small as the cache: every shard's, indexed)
            self._dense = self._compute(np.arange(self.num_shards, dtype=np.int64))
        else:
            self._tags = np.full(SLOTS, _EMPTY, dtype=np.int64)
            self._values = np.zeros((len(FIELDS), SLOTS), dtype=np.int64)

    def _after_fork_in_child(self) -> None:
        """A fresh lock and an empty cache: a parent's thread may have held the lock, or been
        between a slot's tag and its values, when the fork came."""
        self._lock = threading.Lock()
        self._tags.fill(_EMPTY)

    @property
    def sources(self) -> list[ShardColumns]:
        return self._joined.sources

    _KEPT = ("num_shards", "num_samples", "num_pieces", "num_chunks", "_piece_blocks",
             "_chunk_blocks", "_cut_shards", "_median_chunk_rows", "max_shard_rows")

    def __getstate__(self) -> dict[str, Any]:
        """What a copy in another process needs, the scan's results included (a DataLoader
        worker, a restarted rank's child: no second scan of every shard)."""
        return {"sources": self._joined.sources,
                **{name: getattr(self, name) for name in self._KEPT}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._joined = _Joined(state["sources"])
        for name in self._KEPT:
            setattr(self, name, state[name])
        self.digest_state = None
        self._start_lookups()

    def _scan(self) -> Iterator[tuple[int, int, tuple[np.ndarray, ...]]]:
        for first in range(0, self.num_shards, SCAN):
            stop = min(self.num_shards, first + SCAN)
            yield first, stop, normalized(*self._joined.block(first, stop))

    def scan(self) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
        """``(first, stop, rows, chunk rows, piece rows)`` of every run of shards in order
        (at most :data:`SCAN` shards each; what a pass over every shard reads)."""
        for first, stop, block in self._scan():
            yield first, stop, block[0], block[1], block[2]

    @property
    def dense(self) -> bool:
        """Whether every shard's numbers are kept (a small layout: see DENSE_SHARDS)."""
        return self._dense is not None

    @property
    def any_cut(self) -> bool:
        return self._cut_shards > 0

    def median_chunk_rows(self) -> int:
        """The median rows per chunk of the cut shards (as ``int(np.median(...))``, with
        chunks of more than :data:`MEDIAN_CAP` rows counted as that many; 0: none is cut)."""
        return self._median_chunk_rows

    # ------------------------------------------------------------------ lookups

    def lookup(self, shards: np.ndarray, fields: Sequence[int] = FIELDS) -> list[np.ndarray]:
        """``fields`` of each shard (which must exist), one int64 array each: of :data:`ROWS`,
        :data:`CHUNK`, :data:`PIECE`, :data:`PIECE_BASE` (its first piece unit),
        :data:`CHUNK_BASE` (its first chunk unit, counted from the first chunk unit), and
        :data:`KEY` and :data:`KEY_ROWS`: a row's chunk key is ``KEY + row // KEY_ROWS`` (its
        chunk unit; its piece unit in a shard that is not cut)."""
        found, where = self.lookup_indexed(shards, fields)
        return found if where is None else [values[where] for values in found]

    def lookup_indexed(self, shards: np.ndarray, fields: Sequence[int] = FIELDS,
                       ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """:meth:`lookup` as ``(values, where)``: shard ``k``'s field ``f`` is
        ``values[f][where[k]]`` (``where`` None: ``values[f][k]``), so that a caller reading
        only some of the shards, or some fields, gathers only those."""
        shards = np.asarray(shards, dtype=np.int64)
        dense = self._dense
        if dense is not None:
            if shards.size and (int(shards.min()) < 0 or int(shards.max()) >= self.num_shards):
                raise PlanError(f"a shard out of range (the layout has {self.num_shards})")
            return [dense[f] for f in fields], shards
        if shards.size > DISTINCT_AT:
            distinct, where = distinct_values(shards, self.num_shards)
            return self._cached(distinct, fields), where
        return self._cached(shards, fields), None

    def _cached(self, shards: np.ndarray, fields: Sequence[int]) -> list[np.ndarray]:
        """The fields of ``shards`` from the cache, the missing ones read and kept."""
        slots = shards & (SLOTS - 1)
        with self._lock:
            hit = self._tags[slots] == shards
            if not hit.all():
                slots = np.where(hit, slots, _other_slot(shards))
                hit = self._tags[slots] == shards
            out = [self._values[f][slots] for f in fields]
        if hit.all():
            return out
        missed, where = np.unique(shards[~hit], return_inverse=True)
        if int(missed[0]) < 0 or int(missed[-1]) >= self.num_shards:
            raise PlanError(f"a shard out of range (the layout has {self.num_shards})")
        found = self._compute(missed)
        for values, f in zip(out, fields, strict=True):
            values[~hit] = found[f][where]
        if missed.size <= SLOTS // 4:  # (more at once is a scan, not a working set)
            with self._lock:
                self._insert_many(missed, found)
        return out

    def _insert_many(self, shards: np.ndarray, found: np.ndarray) -> None:
        """Keep the values of ``shards`` (distinct; under the lock): each in one of its two slots,
        moving what is there to its other slot where both are taken (cuckoo hashing; after
        a few moves the last one moved is dropped: this is a cache)."""
        tags, table = self._tags, self._values
        for k, shard in enumerate(shards.tolist()):
            entry = found[:, k].copy()
            home, other = shard & (SLOTS - 1), _slot2(shard)
            if shard in (tags[home], tags[other]):
                continue
            slot = other if tags[home] != _EMPTY and tags[other] == _EMPTY else home
            for _ in range(_MOVES):
                victim = int(tags[slot])
                moved = table[:, slot].copy()
                tags[slot], table[:, slot] = shard, entry
                if victim == _EMPTY:
                    break
                shard, entry = victim, moved
                home = shard & (SLOTS - 1)
                slot = _slot2(shard) if slot == home else home

    def _compute(self, shards: np.ndarray) -> np.ndarray:
        """The :data:`FIELDS` of ``shards``, ``(len(FIELDS), len(shards))``, read from their
        blocks: each block's shards once, the first units of a shard from its block's base
        and the shards before it in the block."""
        blocks = shards >> BLOCK_BITS
        unique, which = np.unique(blocks, return_inverse=True)
        every, inside = self._block_rows(unique)
        rows, chunk, piece, pieces, chunks = (a.reshape(every.shape) for a in _derived(
            *self._joined.at(every.ravel())))
        pieces, chunks = pieces * inside, chunks * inside
        at = (which, shards & (BLOCK - 1))
        out = np.empty((len(FIELDS), shards.size), dtype=np.int64)
        out[ROWS], out[CHUNK], out[PIECE] = rows[at], chunk[at], piece[at]
        out[PIECE_BASE] = self._piece_blocks[blocks] + (np.cumsum(pieces, 1) - pieces)[at]
        out[CHUNK_BASE] = self._chunk_blocks[blocks] + (np.cumsum(chunks, 1) - chunks)[at]
        cut = out[CHUNK] > 0
        out[KEY] = np.where(cut, self.num_pieces + out[CHUNK_BASE], out[PIECE_BASE])
        out[KEY_ROWS] = np.where(cut, out[CHUNK], _NONE)
        return out

    def _block_rows(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shards of each block, one row each (clipped to the last shard), and which of
        them exist."""
        every = (blocks[:, None] << BLOCK_BITS) + np.arange(BLOCK, dtype=np.int64)
        inside = every < self.num_shards
        return np.minimum(every, self.num_shards - 1), inside

    def shards_of(self, units: np.ndarray, chunk_units: bool) -> np.ndarray:
        """The shard of each piece unit (``chunk_units``: of each chunk unit, counted from
        the first chunk unit); every unit must exist."""
        units = np.asarray(units, dtype=np.int64)
        if units.size == 0:
            return np.zeros(0, dtype=np.int64)
        bases = self._chunk_blocks if chunk_units else self._piece_blocks
        blocks = np.searchsorted(bases, units, side="right") - 1
        shards, inside = self._block_rows(blocks)
        _, _, _, pieces, chunks = _derived(*self._joined.at(shards.ravel()))
        counts = (chunks if chunk_units else pieces).reshape(shards.shape) * inside
        starts = bases[blocks][:, None] + np.cumsum(counts, axis=1) - counts
        # (the last shard of the block whose units start at or before the unit, with units)
        holds = (starts <= units[:, None]) & (counts > 0)
        last = BLOCK - 1 - np.argmax(holds[:, ::-1], axis=1)
        return (blocks << BLOCK_BITS) + last


__all__ = ["BLOCK", "SCAN", "SLOTS", "ArrayColumns", "ColumnTables", "ShardColumns",
           "distinct_values", "normalized"]
