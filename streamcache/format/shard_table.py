"""The shard table of an index: every shard's path, format, rows, bytes and checksum, as columns.

A dataset can have millions of shards. :class:`ShardTable` keeps them as a handful of numpy and
Arrow arrays (no Python object per shard) and builds a :class:`ShardInfo` only for the shard
asked for, so a large index costs tens of bytes per shard in every process that loads it.
What one entry holds and the rules it obeys are format/shard_entry.py's; the digest of the
columns (what a large index's fingerprint covers) is format/table_digest.py's.

A table built from an index is validated and held in this process's memory; a table opened
from a node copy (:mod:`~streamcache.format.table_layout`, format/node_table.py) is a set of
zero-copy views of a memory-mapped file that was validated when it was written, so opening
one costs nothing per shard and its pages are shared by the node's processes.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast, overload

import numpy as np
import pyarrow as pa

from ..errors import IndexFormatError
from .arrow_arrays import StringColumn, null_mask, string_array
from .shard_entry import (
    MAX_COUNT,
    MAX_SHARDS,
    SHARD_FORMATS,
    UNKNOWN,
    ShardInfo,
    ShardRow,
    check_chunk_columns,
    exact_sum,
    validated_row,
)
from .table_digest import fixed_digest, strings_digest, table_digest

if TYPE_CHECKING:
    from ..plan.shards import ShardCounts

_CHUNK = 65536  # shards turned into Python objects at a time when iterating
_POINTS_KEPT = 1 << 14  # entries of a node copy's shards kept once read

ARROW_SCHEMA = pa.schema([
    pa.field("path", pa.large_string(), nullable=False),
    pa.field("format", pa.string(), nullable=False),
    pa.field("rows", pa.int64(), nullable=False),
    pa.field("bytes", pa.int64(), nullable=False),
    pa.field("checksum", pa.string()),
    pa.field("compression", pa.string()),
    pa.field("raw_bytes", pa.int64()),
])
#: The columns of a :class:`ShardTable`, in the order its constructor takes them.
TABLE_COLUMNS = ("paths", "formats", "rows", "bytes", "checksums", "compressions", "raw_bytes",
                 "chunk_rows", "tail_bytes", "tail_checksums")
#: Columns of a side file that only indexes of chunked shards have.
CHUNK_FIELDS = (
    pa.field("chunk_rows", pa.int64()),
    pa.field("tail_bytes", pa.int64()),
    pa.field("tail_checksum", pa.string()),
)



class ShardTable(Sequence[ShardInfo]):
    """An immutable, columnar sequence of :class:`ShardInfo` (index order).

    Build it with :meth:`from_infos` or :meth:`from_json` (both validate), or open a
    validated layout (:meth:`opened`). ``table[k]`` builds one :class:`ShardInfo`;
    :attr:`rows` and :attr:`nbytes` are whole int64 columns (read-only).

    Thread safety: immutable; any thread may read.
    """

    __slots__ = ("_checksums", "_chunk_rows", "_columns_made", "_compressions", "_counts",
                 "_digest", "_formats", "_histogram", "_keepalive", "_offsets", "_paths",
                 "_point", "_points", "_raw_bytes", "_reopen", "_strings", "_tail_bytes",
                 "_tail_checksums", "nbytes", "paths_outside", "rows", "total_rows")

    def __init__(self, paths: pa.Array, formats: np.ndarray, rows: np.ndarray,
                 nbytes: np.ndarray, checksums: pa.Array, compressions: pa.Array,
                 raw_bytes: np.ndarray, chunk_rows: np.ndarray | None = None,
                 tail_bytes: np.ndarray | None = None,
                 tail_checksums: pa.Array | None = None) -> None:
        count = len(paths)
        unknown = np.full(count, UNKNOWN, np.int64)
        self._set(paths.cast(pa.large_string()), np.ascontiguousarray(formats, dtype=np.uint8),
                  _frozen(rows), _frozen(nbytes), checksums.cast(pa.string()),
                  compressions.cast(pa.string()), _frozen(raw_bytes),
                  _frozen(unknown if chunk_rows is None else chunk_rows),
                  _frozen(unknown if tail_bytes is None else tail_bytes),
                  pa.nulls(count, pa.string()) if tail_checksums is None
                  else tail_checksums.cast(pa.string()))
        self.total_rows = exact_sum(self.rows)
        if self.total_rows >= MAX_COUNT:
            raise IndexFormatError(
                f"the shards hold {self.total_rows} rows in all; at most 2**63 - 1 are supported"
            )

    def _set(self, paths: pa.Array, formats: np.ndarray, rows: np.ndarray, nbytes: np.ndarray,
             checksums: pa.Array, compressions: pa.Array, raw_bytes: np.ndarray,
             chunk_rows: np.ndarray, tail_bytes: np.ndarray, tail_checksums: pa.Array) -> None:
        """Take the columns as they are (typed, read-only) and check their lengths."""
        self._paths, self._formats, self.rows, self.nbytes = paths, formats, rows, nbytes
        self._checksums, self._compressions, self._raw_bytes = checksums, compressions, raw_bytes
        self._chunk_rows, self._tail_bytes = chunk_rows, tail_bytes
        self._tail_checksums = tail_checksums
        self._digest: str | None = None
        self._offsets: np.ndarray | None = None
        self._histogram: tuple[np.ndarray, np.ndarray] | None = None
        self._counts: ShardCounts | None = None
        self._keepalive: Any = None
        self._reopen: tuple[Any, ...] | None = None
        self._point: Any = None  # reads one shard's entry without mapping it (node copies)
        self._points: OrderedDict[int, ShardInfo] = OrderedDict()
        self._columns_made: dict[str, np.ndarray] = {}  # derived columns, made when asked
        #: How many paths are absolute, URLs or climb with '..' (None: not counted yet).
        self.paths_outside: int | None = None
        self._strings = tuple(StringColumn(c) for c in (
            self._paths, self._checksums, self._compressions, self._tail_checksums))
        count = len(self._paths)
        if count > MAX_SHARDS:
            raise IndexFormatError(f"the index lists {count} shards; at most {MAX_SHARDS} are "
                                   "supported: write larger shards")
        if not all(len(c) == count for c in (self._formats, self.rows, self.nbytes,
                                             self._checksums, self._compressions,
                                             self._raw_bytes, self._chunk_rows,
                                             self._tail_bytes, self._tail_checksums)):
            raise IndexFormatError("the shard table's columns have different lengths")

    @classmethod
    def opened(cls, columns: Mapping[str, Any], offsets: np.ndarray,
               histogram: tuple[np.ndarray, np.ndarray], *, keepalive: Any = None,
               reopen: tuple[Any, ...] | None = None, digest: str | None = None,
               paths_outside: int | None = None, point: Any = None) -> ShardTable:
        """A table of columns that were validated when they were written (a node copy's
        zero-copy views; see format/table_layout.py): nothing is copied or scanned.

        Args:
            columns: the columns by name (:data:`TABLE_COLUMNS`), typed as this class keeps
                them (numpy int64 / uint8 arrays, Arrow string arrays).
            offsets: ``n + 1`` int64: each shard's first sample id, then the total.
            histogram: the distinct row counts, ascending, and how many shards have each.
            keepalive: what the views borrow (the mapping), kept as long as the table.
            reopen: ``(callable, args)`` that opens the same table in another process
                (pickling), instead of copying its columns.
            digest, paths_outside: :meth:`digest` and :attr:`paths_outside`, as computed
                when the columns were validated (None: computed when asked).
            point: reads one shard's entry (``point.shard(k)``) for ``table[k]`` instead
                of the views (see :class:`~streamcache.format.table_layout.PointReader`);
                the last :data:`_POINTS_KEPT` entries read are kept.
        """
        table = object.__new__(cls)
        table._set(*(columns[name] for name in TABLE_COLUMNS))
        table._offsets, table._histogram = offsets, histogram
        table._keepalive, table._reopen = keepalive, reopen
        table._digest, table.paths_outside = digest, paths_outside
        table._point = point
        table.total_rows = int(offsets[-1])
        if offsets.size != len(table) + 1:
            raise IndexFormatError("the shard table's offsets do not match its shards")
        return table

    # ------------------------------------------------------------ construction

    @classmethod
    def from_infos(cls, infos: Iterable[ShardInfo]) -> ShardTable:
        """A table of already-built shard entries (each is validated)."""
        return cls.from_rows([validated_row(s.to_json()) for s in infos])

    @classmethod
    def from_json(cls, entries: Any) -> ShardTable:
        """A table from the ``shards`` list of an index document (dicts, or rows made by
        :func:`shard_entry_hook`; validated)."""
        if not isinstance(entries, list):
            raise IndexFormatError(f"'shards' is a {type(entries).__name__}, not a list")
        if len(entries) > MAX_SHARDS:
            raise IndexFormatError(f"the index lists {len(entries)} shards; at most "
                                   f"{MAX_SHARDS} are supported")
        return cls.from_rows([e if isinstance(e, ShardRow) else validated_row(e)
                              for e in entries])

    @classmethod
    def from_rows(cls, rows: Sequence[ShardRow]) -> ShardTable:
        (paths, formats, counts, sizes, checksums, compressions, raw, chunk_rows, tail_bytes,
         tail_checksums) = zip(*rows, strict=True) if rows else ((),) * 10
        return cls(
            string_array(paths, pa.large_string()),
            np.array([SHARD_FORMATS.index(f) for f in formats], np.uint8),
            np.array(counts, np.int64), np.array(sizes, np.int64),
            string_array(checksums, pa.string()), string_array(compressions, pa.string()),
            _known(raw), _known(chunk_rows), _known(tail_bytes),
            string_array(tail_checksums, pa.string()),
        )

    def check_chunk_layouts(self, where: str) -> None:
        """The chunk layouts obey the rules of a JSON entry (see :func:`check_chunk_columns`;
        the first offending shard is named by the entry's own check)."""
        valid = None if not self._tail_checksums.null_count else ~null_mask(
            self._tail_checksums)
        check_chunk_columns(self._formats, self.nbytes, self._chunk_rows, self._tail_bytes,
                            valid, where, entry=lambda k: self[k])

    # ------------------------------------------------------------ output

    def to_arrow(self) -> pa.Table:
        raw = pa.array(self._raw_bytes, pa.int64(), mask=self._raw_bytes == UNKNOWN)
        formats = pa.array(SHARD_FORMATS, pa.string()).take(pa.array(self._formats))
        columns = [self._paths, formats, pa.array(self.rows), pa.array(self.nbytes),
                   self._checksums, self._compressions, raw]
        if not self.has_chunk_layouts:  # the columns an older streamcache reads
            return pa.table(columns, schema=ARROW_SCHEMA)
        columns += [pa.array(self._chunk_rows, pa.int64(), mask=self._chunk_rows == UNKNOWN),
                    pa.array(self._tail_bytes, pa.int64(), mask=self._tail_bytes == UNKNOWN),
                    self._tail_checksums]
        return pa.table(columns, schema=pa.schema([*ARROW_SCHEMA, *CHUNK_FIELDS]))

    def columns(self) -> dict[str, Any]:
        """Every column by name (:data:`TABLE_COLUMNS`), as this table keeps it (read-only)."""
        return dict(zip(TABLE_COLUMNS, (
            self._paths, self._formats, self.rows, self.nbytes, self._checksums,
            self._compressions, self._raw_bytes, self._chunk_rows, self._tail_bytes,
            self._tail_checksums), strict=True))

    @property
    def offsets(self) -> np.ndarray:
        """``n + 1`` int64 values: the first sample id of each shard, then the total
        (read-only)."""
        if self._offsets is None:
            offsets = np.zeros(len(self) + 1, dtype=np.int64)
            np.cumsum(self.rows, out=offsets[1:])
            offsets.setflags(write=False)
            self._offsets = offsets
        return self._offsets

    def row_histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct row counts, ascending, and how many shards have each."""
        if self._histogram is None:
            from ..plan.shards import row_histogram
            self._histogram = row_histogram(self.rows)
        return self._histogram

    def counts(self) -> ShardCounts:
        """What the plan reads of the shards (rows, offsets, their distribution), shared by
        every order of this table (nothing copied)."""
        if self._counts is None:
            from ..plan.shards import ShardCounts
            self._counts = ShardCounts(self.rows, self.offsets, self.row_histogram())
        return self._counts

    @property
    def chunk_row_counts(self) -> np.ndarray:
        """Each shard's rows per chunk, 0 where its chunk layout is not recorded (int64,
        read-only; made once per table: 8 bytes a shard in this process)."""
        return self._derived("chunk_row_counts", lambda: np.where(
            self._chunk_rows == UNKNOWN, 0, self._chunk_rows))

    @property
    def checksummed(self) -> np.ndarray:
        """Whether each shard records a checksum (bool, read-only; made once per table)."""
        return self._derived("checksummed", lambda: np.ones(len(self), bool)
                             if not self._checksums.null_count else ~null_mask(self._checksums))

    @property
    def compressed(self) -> np.ndarray:
        """Whether each shard records a compression (bool, read-only; made once per table)."""
        return self._derived("compressed", lambda: np.ones(len(self), bool)
                             if not self._compressions.null_count
                             else ~null_mask(self._compressions))

    def _derived(self, name: str, make: Any) -> np.ndarray:
        found = self._columns_made.get(name)
        if found is None:
            found = np.ascontiguousarray(make())
            found.setflags(write=False)
            self._columns_made[name] = found
        return found

    def raw_or_stored_bytes(self) -> np.ndarray:
        """Each shard's uncompressed size where the index records it, else its stored size."""
        return np.where(self._raw_bytes != UNKNOWN, self._raw_bytes, self.nbytes)

    @property
    def all_checksummed(self) -> bool:
        """Whether every shard records a checksum (the fingerprint then fixes the content)."""
        return self._checksums.null_count == 0

    @property
    def has_chunk_layouts(self) -> bool:
        """Whether any shard records its chunk layout."""
        return bool((self._chunk_rows != UNKNOWN).any())

    def to_json(self) -> list[dict[str, Any]]:
        return [shard.to_json() for shard in self]

    def digest(self) -> str:
        """A checksum of every column's content (what the fingerprint covers), chunk layouts
        excepted (see the module docstring)."""
        if self._digest is None:
            parts = [fixed_digest(column) for column in
                     (self._formats, self.rows, self.nbytes, self._raw_bytes)]
            parts += [strings_digest(column) for column in
                      (self._paths, self._checksums, self._compressions)]
            self._digest = table_digest(len(self), parts)
        return self._digest

    # ------------------------------------------------------------ sequence protocol

    def __len__(self) -> int:
        return len(self._formats)

    @overload
    def __getitem__(self, index: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ShardInfo]: ...

    def __getitem__(self, index: int | slice) -> ShardInfo | Sequence[ShardInfo]:
        if isinstance(index, slice):
            return tuple(self[k] for k in range(*index.indices(len(self))))
        k = range(len(self))[index]  # IndexError for a shard that does not exist
        if self._point is not None:
            return self._point_entry(k)
        return ShardInfo(
            cast(str, self._strings[0][k]), SHARD_FORMATS[self._formats[k]], int(self.rows[k]),
            int(self.nbytes[k]), self._strings[1][k], self._strings[2][k],
            _optional(self._raw_bytes[k]), _optional(self._chunk_rows[k]),
            _optional(self._tail_bytes[k]), self._strings[3][k],
        )

    def _point_entry(self, k: int) -> ShardInfo:
        """Shard ``k``'s entry from the point reader (the recent ones kept)."""
        points = self._points
        try:
            info = points[k]
        except KeyError:
            info = self._point.shard(k)
            points[k] = info
            if len(points) > _POINTS_KEPT:
                with contextlib.suppress(KeyError):
                    points.popitem(last=False)
        return info

    def __iter__(self) -> Iterator[ShardInfo]:
        for start in range(0, len(self), _CHUNK):
            for (path, fmt, rows, nbytes, checksum, compression, raw, chunk_rows, tail_bytes,
                 tail_checksum) in zip(*self._columns(start, start + _CHUNK), strict=True):
                yield ShardInfo(path, fmt, rows, nbytes, checksum, compression,
                                _optional(raw), _optional(chunk_rows), _optional(tail_bytes),
                                tail_checksum)

    def _columns(self, start: int, stop: int) -> list[list[Any]]:
        """Python lists of every column over shards [start, stop), in ShardInfo's order."""
        codes = self._formats[start:stop].tolist()
        return [self._paths[start:stop].to_pylist(), [SHARD_FORMATS[c] for c in codes],
                self.rows[start:stop].tolist(), self.nbytes[start:stop].tolist(),
                self._checksums[start:stop].to_pylist(),
                self._compressions[start:stop].to_pylist(),
                self._raw_bytes[start:stop].tolist(), self._chunk_rows[start:stop].tolist(),
                self._tail_bytes[start:stop].tolist(),
                self._tail_checksums[start:stop].to_pylist()]

    def identity_rows(self) -> list[list[Any]]:
        """[path, format, rows, bytes, checksum] per shard (what a version-1 index digests)."""
        return [list(row) for row in zip(*self._columns(0, len(self))[:5], strict=True)]

    def paths(self) -> pa.Array:
        """Every shard's path (a large_string array)."""
        return self._paths

    def formats(self) -> list[str]:
        """The distinct formats of the shards."""
        return [SHARD_FORMATS[code] for code in np.unique(self._formats)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardTable):
            return NotImplemented
        return len(self) == len(other) and self.digest() == other.digest()

    def __hash__(self) -> int:
        return hash(self.digest())

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards, {self.total_rows} rows)"

    def __reduce__(self) -> tuple[Any, ...]:
        if self._reopen is not None:  # a node copy: the other process opens it too
            return self._reopen
        return (ShardTable, (self._paths, self._formats, self.rows, self.nbytes,
                             self._checksums, self._compressions, self._raw_bytes,
                             self._chunk_rows, self._tail_bytes, self._tail_checksums))



def _known(values: Sequence[int | None]) -> np.ndarray:
    return np.array([UNKNOWN if v is None else v for v in values], np.int64)


def _optional(value: Any) -> int | None:
    value = int(value)
    return None if value == UNKNOWN else value


def _frozen(values: np.ndarray) -> np.ndarray:
    array = np.array(values, dtype=np.int64)  # a private copy, then read-only
    array.setflags(write=False)
    return array



__all__ = ["ShardInfo", "ShardTable"]
