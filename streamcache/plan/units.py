"""Units: the parts of a dataset's shards that a node holds, in a multi-node job.

With several nodes each node holds (downloads and caches) only its share of the data. A whole
shard is too coarse a share at the library's defaults: a 64 MiB shard of 350-byte samples
holds 190,000 of them, and the default shuffle window of 2^18 samples spans one or two shards,
so the samples of a step come from two or three shards; with eight nodes most nodes would own
none of them. So a chunked shard (format/chunks.py) is cut into **pieces**, runs of
consecutive chunks, small enough that a shuffle window spans many pieces per node
(:func:`piece_rows_for`), large enough to be one range request of a few hundred KiB or more.
A shard that is not cut is one piece (shard-sized units, as before).

Each chunk is also a **chunk unit**: a node that reads a row of another node's piece installs
the row's chunk (the smallest part a range read can fetch and verify), once, and reads later
rows of it from its cache.

Unit ids: pieces are ``0 .. num_pieces - 1`` (shard by shard, in index order), chunk units
``num_pieces .. num_pieces + num_chunks - 1``. Everything here is pure arithmetic on per-shard
numbers read a block of shards at a time (:mod:`streamcache.plan.unit_columns`: nothing kept
per shard, nothing per unit); no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np

from ._util import PlanError
from .shards import ShardCounts
from .unit_columns import (
    CHUNK,
    CHUNK_BASE,
    FIELDS,
    KEY,
    KEY_ROWS,
    PIECE,
    PIECE_BASE,
    ROWS,
    ArrayColumns,
    ColumnTables,
    ShardColumns,
)

#: Pieces a node should have in each shuffle window: the ownership of a window's rows is then
#: balanced to within about 1/64 of a node's share (pieces are dealt round-robin).
PIECES_PER_NODE_WINDOW = 64
_SPANS_KEPT = 1 << 14  # units whose spans a layout keeps (a prefetcher asks again and again)


def piece_rows_for(window_rows: int, num_nodes: int, chunk_rows: np.ndarray) -> np.ndarray:
    """Rows of a piece of shards with ``chunk_rows`` rows a chunk (int64 array): whole
    chunks, as many as keep :data:`PIECES_PER_NODE_WINDOW` pieces per node in a window of
    ``window_rows`` samples (at least one chunk)."""
    chunk = np.maximum(np.asarray(chunk_rows, dtype=np.int64), 1)
    target = max(1, window_rows // (PIECES_PER_NODE_WINDOW * max(1, num_nodes)))
    return np.maximum(1, target // chunk) * chunk


class UnitLayout:
    """The pieces and chunk units of a dataset's shards.

    Nothing is kept per shard (see :mod:`streamcache.plan.unit_columns`): the per-shard
    numbers come from ``sources`` a block at a time, and what a step asks is looked up.

    Args:
        shard_rows: rows of every shard (index order).
        chunk_rows: rows per chunk of every shard; 0 where a shard is not cut (not chunked, or
            not worth cutting: one piece, no chunk units).
        piece_rows: rows per piece of every shard (a multiple of its ``chunk_rows``; its row
            count, or more, where it is one piece).
        parts: in a combined layout (a mixture's sources side by side), the shards of each
            part (default: one part). Each part's units are also numbered on their own (its
            *keys*, offset by the parts before it: what each source's cache calls them).

    :meth:`of` makes a layout of :class:`~streamcache.plan.unit_columns.ShardColumns`
    instead of arrays (the loader's: read from the index's shared columns).

    Raises:
        PlanError: arrays of different lengths, negative counts, or a piece that is not whole
            chunks.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, shard_rows: np.ndarray, chunk_rows: np.ndarray, piece_rows: np.ndarray,
                 parts: tuple[int, ...] = ()) -> None:
        columns = ArrayColumns(shard_rows, chunk_rows, piece_rows)
        counts = tuple(int(p) for p in parts) or (columns.num_shards,)
        if sum(counts) != columns.num_shards or any(p < 0 for p in counts):
            raise PlanError(f"the parts of a unit layout ({counts}) do not add up to its "
                            f"{columns.num_shards} shards")
        bounds = np.concatenate(([0], np.cumsum(counts))).astype(np.int64).tolist()
        self._set([ArrayColumns(*columns.block(lo, hi))
                   for lo, hi in itertools.pairwise(bounds)])

    @classmethod
    def of(cls, sources: Sequence[ShardColumns]) -> UnitLayout:
        """The layout of ``sources`` side by side, each a part."""
        layout = object.__new__(cls)
        layout._set(list(sources))
        return layout

    def _set(self, sources: list[ShardColumns], tables: ColumnTables | None = None,
             digest: str | None = None) -> None:
        self.sources = sources
        self.parts = tuple(int(s.num_shards) for s in sources)
        self._tables = ColumnTables(sources) if tables is None else tables
        if digest is None:
            hashed = self._tables.digest_state.copy()
            hashed.update(np.asarray(self.parts, dtype=np.int64).tobytes())
            digest = hashed.hexdigest()
        self.digest = digest
        self._part_first = np.concatenate(([0], np.cumsum(self.parts))).astype(np.int64)
        self._bounds: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._spans: dict[int, tuple[int, int, int]] = {}  # (the units asked last)

    @classmethod
    def whole_shards(cls, shard_rows: np.ndarray) -> UnitLayout:
        """Every shard one piece, no chunk units (what shard-level ownership was)."""
        rows = np.asarray(shard_rows, dtype=np.int64)
        return cls(rows, np.zeros_like(rows), np.maximum(rows, 1))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnitLayout) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __reduce__(self) -> tuple[object, ...]:
        return (_unpickled, (self._tables, self.digest))

    def __repr__(self) -> str:
        return (f"UnitLayout({self.num_shards} shards, {self.num_pieces} pieces, "
                f"{self.num_units - self.num_pieces} chunk units)")

    # ------------------------------------------------------------------ counts

    @property
    def num_shards(self) -> int:
        return self._tables.num_shards

    @property
    def num_samples(self) -> int:
        return self._tables.num_samples

    @property
    def num_pieces(self) -> int:
        return self._tables.num_pieces

    @property
    def num_units(self) -> int:
        """Pieces and chunk units."""
        return self._tables.num_pieces + self._tables.num_chunks

    @property
    def dense(self) -> bool:
        """Whether the layout keeps every shard's numbers (a small one; else looked up)."""
        return self._tables.dense

    @property
    def any_cut(self) -> bool:
        """Whether some shard is cut (pieces of whole chunks, and chunk units)."""
        return self._tables.any_cut

    @property
    def max_shard_rows(self) -> int:
        return self._tables.max_shard_rows

    def typical_chunk_rows(self) -> int:
        """The median rows per chunk of the cut shards (0: none is cut)."""
        return self._tables.median_chunk_rows()

    def scan(self) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
        """``(first, stop, rows, chunk rows, piece rows)`` of every run of shards in order
        (chunk rows 0 where a shard is not cut; a pass over every shard, a run at a time)."""
        return self._tables.scan()

    def shard_counts(self) -> ShardCounts:
        """The shards' row counts (a one-part layout of a source that keeps them: its own;
        else counted, ``8 n`` bytes)."""
        counts = getattr(self.sources[0], "counts", None)
        if len(self.sources) == 1 and counts is not None:
            return cast(ShardCounts, counts())
        rows = np.concatenate([block[2] for block in self.scan()] or [np.zeros(0, np.int64)])
        return ShardCounts.of(rows)

    # ------------------------------------------------------------------ per shard

    def lookup(self, shards: np.ndarray, fields: Sequence[int] = FIELDS) -> list[np.ndarray]:
        """``fields`` of each shard, one int64 array each: of ``ROWS``, ``CHUNK`` (rows per
        chunk, 0 where not cut), ``PIECE`` (rows per piece), ``PIECE_BASE`` (its first piece
        unit) and ``CHUNK_BASE`` (its first chunk unit, counted from the first chunk unit),
        from :mod:`streamcache.plan.unit_columns`."""
        return self._tables.lookup(shards, fields)

    def lookup_indexed(self, shards: np.ndarray, fields: Sequence[int] = FIELDS,
                       ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """:meth:`lookup` as ``(values, where)``: shard ``k``'s field ``f`` is
        ``values[f][where[k]]`` (``where`` None: ``values[f][k]``); for callers that gather
        only some of the shards."""
        return self._tables.lookup_indexed(shards, fields)

    def rows_of(self, shards: np.ndarray) -> np.ndarray:
        return self.lookup(shards, (ROWS,))[0]

    def piece_rows_of(self, shards: np.ndarray) -> np.ndarray:
        return self.lookup(shards, (PIECE,))[0]

    # ------------------------------------------------------------------ rows to units

    def piece_index(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's piece within its shard (0 for a shard that is one piece)."""
        return np.asarray(rows, dtype=np.int64) // self.piece_rows_of(shards)

    def piece_of(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's piece unit."""
        base, piece = self.lookup(shards, (PIECE_BASE, PIECE))
        return base + np.asarray(rows, dtype=np.int64) // piece

    def chunk_of(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's chunk unit (-1 in shards that are not cut)."""
        chunk, base = self.lookup(shards, (CHUNK, CHUNK_BASE))
        return np.where(chunk > 0, self.num_pieces + base + np.asarray(
            rows, dtype=np.int64) // np.maximum(chunk, 1), -1)

    def chunk_or_piece(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's chunk unit, or its piece unit in a shard that is not cut."""
        key, key_rows = self.lookup(shards, (KEY, KEY_ROWS))
        return key + np.asarray(rows, dtype=np.int64) // key_rows

    def shard_of_units(self, units: np.ndarray) -> np.ndarray:
        """The shard of each unit (piece or chunk unit)."""
        return self.unit_starts(units)[0]

    def unit_starts(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shard and the first row of each unit (piece or chunk unit)."""
        units = np.asarray(units, dtype=np.int64)
        if units.size and (int(units.min()) < 0 or int(units.max()) >= self.num_units):
            raise PlanError(f"a unit that does not exist (the layout has {self.num_units})")
        pieces = units < self.num_pieces
        shards = np.empty(units.size, dtype=np.int64)
        shards[pieces] = self._tables.shards_of(units[pieces], chunk_units=False)
        shards[~pieces] = self._tables.shards_of(units[~pieces] - self.num_pieces,
                                                 chunk_units=True)
        piece_base, piece, chunk_base, chunk = self.lookup(
            shards, (PIECE_BASE, PIECE, CHUNK_BASE, CHUNK))
        first = np.where(pieces, (units - piece_base) * piece,
                         (units - self.num_pieces - chunk_base) * np.maximum(chunk, 1))
        return shards, first

    def span(self, unit: int) -> tuple[int, int, int]:
        """``(shard, first row, rows)`` of one unit.

        Raises:
            PlanError: no such unit.
        """
        if not 0 <= unit < self.num_units:
            raise PlanError(f"unit {unit} does not exist (the layout has {self.num_units})")
        found = self._spans.get(unit)
        if found is None:
            found = self._span(unit)
            if len(self._spans) >= _SPANS_KEPT:
                self._spans.clear()
            self._spans[unit] = found
        return found

    def _span(self, unit: int) -> tuple[int, int, int]:
        shards, firsts = self.unit_starts(np.array([unit]))
        shard, first = int(shards[0]), int(firsts[0])
        rows, piece, chunk = (int(a[0]) for a in self.lookup(shards, (ROWS, PIECE, CHUNK)))
        size = piece if unit < self.num_pieces else chunk
        return shard, first, max(0, min(size, rows - first))

    # ------------------------------------------------------------------ parts and keys

    def part(self, index: int) -> UnitLayout:
        """The layout of one part alone."""
        if len(self.sources) == 1 and index in (0, -1):
            return self
        return UnitLayout.of([self.sources[index]])

    def piece_keys(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's piece as its part numbers it, offset by the units of the parts before
        (with one part: :meth:`piece_of`)."""
        pieces = self.piece_of(shards, rows)
        if len(self.parts) == 1:
            return pieces
        part = self._part_of(shards)
        bounds = self._part_bounds()
        return pieces - bounds[0][part] + bounds[2][part]

    def chunk_keys(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's chunk unit as its part numbers it, offset by the units of the parts
        before (-1 in shards that are not cut; with one part: :meth:`chunk_of`)."""
        chunks = self.chunk_of(shards, rows)
        if len(self.parts) == 1:
            return chunks
        part = self._part_of(shards)
        _, chunks_before, base, own_pieces = self._part_bounds()
        local = chunks - self.num_pieces - chunks_before[part] + own_pieces[part]
        return np.where(chunks >= 0, base[part] + local, -1)

    def key_rows(self, key: int) -> int:
        """The rows of the unit a key names (see :meth:`piece_keys`)."""
        if len(self.parts) == 1:
            return self.span(key)[2]
        base = self._part_bounds()[2]
        part = int(np.searchsorted(base, key, side="right")) - 1
        return self.part(part).span(key - int(base[part]))[2]

    def _part_of(self, shards: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._part_first, np.asarray(shards, dtype=np.int64),
                               side="right") - 1

    def _part_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per part: the pieces and the chunk units of the parts before it (in the combined
        numbering), the first key of its units, and its own pieces."""
        if self._bounds is None:
            first = self._part_first
            ends = first >= self.num_shards  # (after the last shard: the totals)
            piece_at = np.full(first.size, self.num_pieces, dtype=np.int64)
            chunk_at = np.full(first.size, self._tables.num_chunks, dtype=np.int64)
            piece_at[~ends], chunk_at[~ends] = self.lookup(first[~ends],
                                                           (PIECE_BASE, CHUNK_BASE))
            pieces_before, chunks_before = piece_at[:-1], chunk_at[:-1]
            own_pieces = piece_at[1:] - pieces_before
            own_units = own_pieces + (chunk_at[1:] - chunk_at[:-1])
            base = np.concatenate(([0], np.cumsum(own_units)[:-1])).astype(np.int64)
            self._bounds = (pieces_before, chunks_before, base, own_pieces)
        return self._bounds

    def is_whole(self, unit: int) -> bool:
        """Whether a unit is a whole shard (a shard that is one piece)."""
        if unit >= self.num_pieces:
            return False
        shard, _, rows = self.span(unit)
        return rows == int(self.rows_of(np.array([shard]))[0])


def _unpickled(tables: ColumnTables, digest: str) -> UnitLayout:
    """A layout pickled in another process (its tables carry the scan's results)."""
    layout = object.__new__(UnitLayout)
    layout._set(list(tables.sources), tables, digest)
    return layout


def concatenate(layouts: list[UnitLayout]) -> UnitLayout:
    """One layout of several datasets' shards in a combined shard space (a mixture's), each
    dataset a part.

    Raises:
        PlanError: a layout that has several parts itself.
    """
    if any(len(layout.sources) != 1 for layout in layouts):
        raise PlanError("layouts of one part each are concatenated")
    return UnitLayout.of([layout.sources[0] for layout in layouts])


__all__ = ["PIECES_PER_NODE_WINDOW", "UnitLayout", "concatenate", "piece_rows_for"]
