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
arrays (O(shards) memory, nothing per unit); no I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ._util import PlanError

#: Pieces a node should have in each shuffle window: the ownership of a window's rows is then
#: balanced to within about 1/64 of a node's share (pieces are dealt round-robin).
PIECES_PER_NODE_WINDOW = 64


def piece_rows_for(window_rows: int, num_nodes: int, chunk_rows: np.ndarray) -> np.ndarray:
    """Rows of a piece of shards with ``chunk_rows`` rows a chunk (int64 array): whole
    chunks, as many as keep :data:`PIECES_PER_NODE_WINDOW` pieces per node in a window of
    ``window_rows`` samples (at least one chunk)."""
    chunk = np.maximum(np.asarray(chunk_rows, dtype=np.int64), 1)
    target = max(1, window_rows // (PIECES_PER_NODE_WINDOW * max(1, num_nodes)))
    return np.maximum(1, target // chunk) * chunk


@dataclass(frozen=True, eq=False)
class UnitLayout:
    """The pieces and chunk units of a dataset's shards.

    Args:
        shard_rows: rows of every shard (index order).
        chunk_rows: rows per chunk of every shard; 0 where a shard is not cut (not chunked, or
            not worth cutting: one piece, no chunk units).
        piece_rows: rows per piece of every shard (a multiple of its ``chunk_rows``; its row
            count, or more, where it is one piece).
        parts: in a combined layout (a mixture's sources side by side), the shards of each
            part (default: one part). Each part's units are also numbered on their own (its
            *keys*, offset by the parts before it: what each source's cache calls them).

    Raises:
        PlanError: arrays of different lengths, negative counts, or a piece that is not whole
            chunks.
    """

    shard_rows: np.ndarray
    chunk_rows: np.ndarray
    piece_rows: np.ndarray
    parts: tuple[int, ...] = ()
    pieces: np.ndarray = field(init=False)  # pieces of each shard
    piece_base: np.ndarray = field(init=False)  # first piece unit of each shard (and the end)
    chunks: np.ndarray = field(init=False)  # chunk units of each shard (0 where not cut)
    chunk_base: np.ndarray = field(init=False)  # first chunk unit of each shard (and the end)
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        rows, chunk, piece = (np.array(a, dtype=np.int64) for a in (
            self.shard_rows, self.chunk_rows, self.piece_rows))
        if not rows.shape == chunk.shape == piece.shape or rows.ndim != 1:
            raise PlanError("a unit layout needs one row count, chunk size and piece size "
                            "per shard")
        if (rows < 0).any() or (chunk < 0).any() or (piece < 1).any():
            raise PlanError("a unit layout's counts must be non-negative (pieces positive)")
        cut = chunk > 0
        if (piece[cut] % chunk[cut]).any():
            raise PlanError("a piece must hold whole chunks")
        piece = np.where(cut, piece, np.maximum(rows, 1))
        pieces = np.maximum(1, -(-rows // piece))
        chunks = np.where(cut, -(-rows // np.maximum(chunk, 1)), 0)
        for name, value in (("shard_rows", rows), ("chunk_rows", chunk), ("piece_rows", piece),
                            ("pieces", pieces), ("chunks", chunks)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)
        piece_base = np.concatenate(([0], np.cumsum(pieces))).astype(np.int64)
        chunk_base = np.concatenate(([0], np.cumsum(chunks))).astype(np.int64) + piece_base[-1]
        for name, value in (("piece_base", piece_base), ("chunk_base", chunk_base)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)
        parts = tuple(int(p) for p in self.parts) or (int(rows.size),)
        if sum(parts) != rows.size or any(p < 0 for p in parts):
            raise PlanError(f"the parts of a unit layout ({parts}) do not add up to its "
                            f"{rows.size} shards")
        object.__setattr__(self, "parts", parts)
        digest = hashlib.blake2b(digest_size=8)
        for array in (rows, chunk, piece, np.asarray(parts, dtype=np.int64)):
            digest.update(array.tobytes())
        object.__setattr__(self, "digest", digest.hexdigest())

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
        return (UnitLayout, (self.shard_rows, self.chunk_rows, self.piece_rows, self.parts))

    # ------------------------------------------------------------------ counts

    @property
    def num_shards(self) -> int:
        return int(self.shard_rows.size)

    @property
    def num_samples(self) -> int:
        return int(self.shard_rows.sum())

    @property
    def num_pieces(self) -> int:
        return int(self.piece_base[-1])

    @property
    def num_units(self) -> int:
        """Pieces and chunk units."""
        return int(self.chunk_base[-1])

    @property
    def cut(self) -> np.ndarray:
        """Whether each shard is cut (pieces of whole chunks, and chunk units)."""
        return self.chunk_rows > 0

    # ------------------------------------------------------------------ rows to units

    def piece_index(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's piece within its shard (0 for a shard that is one piece)."""
        return np.asarray(rows, dtype=np.int64) // self.piece_rows[shards]

    def piece_of(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's piece unit."""
        shards = np.asarray(shards, dtype=np.int64)
        return self.piece_base[shards] + self.piece_index(shards, rows)

    def chunk_of(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's chunk unit (-1 in shards that are not cut)."""
        shards = np.asarray(shards, dtype=np.int64)
        chunk = self.chunk_rows[shards]
        cut = chunk > 0
        return np.where(cut, self.chunk_base[shards] + np.asarray(rows, dtype=np.int64)
                        // np.maximum(chunk, 1), -1)

    def shard_of_units(self, units: np.ndarray) -> np.ndarray:
        """The shard of each unit (piece or chunk unit)."""
        units = np.asarray(units, dtype=np.int64)
        pieces = units < self.num_pieces
        shard = np.searchsorted(self.piece_base, units, side="right") - 1
        chunk_shard = np.searchsorted(self.chunk_base, units, side="right") - 1
        return np.where(pieces, shard, chunk_shard)

    def span(self, unit: int) -> tuple[int, int, int]:
        """``(shard, first row, rows)`` of one unit.

        Raises:
            PlanError: no such unit.
        """
        if not 0 <= unit < self.num_units:
            raise PlanError(f"unit {unit} does not exist (the layout has {self.num_units})")
        shard = int(self.shard_of_units(np.array([unit]))[0])
        total = int(self.shard_rows[shard])
        if unit < self.num_pieces:
            size = int(self.piece_rows[shard])
            first = (unit - int(self.piece_base[shard])) * size
        else:
            size = int(self.chunk_rows[shard])
            first = (unit - int(self.chunk_base[shard])) * size
        return shard, first, max(0, min(size, total - first))

    # ------------------------------------------------------------------ parts and keys

    def part(self, index: int) -> UnitLayout:
        """The layout of one part alone."""
        first, stop = (int(b) for b in self._part_shards()[index:index + 2])
        return UnitLayout(self.shard_rows[first:stop], self.chunk_rows[first:stop],
                          self.piece_rows[first:stop])

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

    def _part_shards(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.parts))).astype(np.int64)

    def _part_of(self, shards: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._part_shards(), np.asarray(shards, dtype=np.int64),
                               side="right") - 1

    def _part_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per part: the pieces and the chunk units of the parts before it (in the combined
        numbering), the first key of its units, and its own pieces."""
        first = self._part_shards()
        pieces_before = self.piece_base[first[:-1]]
        chunks_before = self.chunk_base[first[:-1]] - self.num_pieces
        own_pieces = self.piece_base[first[1:]] - pieces_before
        own_units = own_pieces + (self.chunk_base[first[1:]] - self.chunk_base[first[:-1]])
        base = np.concatenate(([0], np.cumsum(own_units)[:-1])).astype(np.int64)
        return pieces_before, chunks_before, base, own_pieces

    def is_whole(self, unit: int) -> bool:
        """Whether a unit is a whole shard (a shard that is one piece)."""
        return unit < self.num_pieces and self.span(unit)[2] == int(
            self.shard_rows[self.span(unit)[0]])


def concatenate(layouts: list[UnitLayout]) -> UnitLayout:
    """One layout of several datasets' shards in a combined shard space (a mixture's), each
    dataset a part."""
    rows, chunk, piece = (np.concatenate([getattr(layout, name) for layout in layouts])
                          for name in ("shard_rows", "chunk_rows", "piece_rows"))
    return UnitLayout(rows, chunk, piece, parts=tuple(layout.num_shards for layout in layouts))


__all__ = ["PIECES_PER_NODE_WINDOW", "UnitLayout", "concatenate", "piece_rows_for"]
