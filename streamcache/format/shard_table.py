"""The shard table of an index: every shard's path, format, rows, bytes and checksum, as columns.

A dataset can have millions of shards. :class:`ShardTable` keeps them as a handful of numpy and
Arrow arrays (no Python object per shard) and builds a :class:`ShardInfo` only for the shard
asked for, so a large index costs tens of bytes per shard in every process that loads it.

Everything read from an index is untrusted: :meth:`ShardTable.from_json` (and, for a
side file, format/side_table.py) check the type and range of every field (rows and bytes are
integers in ``[0, 2**63)``, checksums ``xxh64:`` plus 16 hex digits, formats known, at most
:data:`MAX_SHARDS` shards) and raise :class:`IndexFormatError` naming the shard and the rule.

A shard written in chunks (several record batches of ``chunk_rows`` rows each, the last one
shorter; see writer.py) also records its chunk layout: ``chunk_rows``, and the size and
checksum of its tail (the Arrow IPC footer and what follows it), so a range reader maps a row
to its chunk without reading any batch header and reads the footer in one verified request
(cache/ranges.py). The three are optional (absent in older indexes and for files written by
others), present together or not at all, and not part of the fingerprint: they describe how
the bytes are laid out, which the checksum already covers, and an older streamcache reads such
an index as before.

A table built from an index is validated and held in this process's memory; a table opened
from a node copy (:mod:`~streamcache.format.table_layout`, format/node_table.py) is a set of
zero-copy views of a memory-mapped file that was validated when it was written, so opening
one costs nothing per shard and its pages are shared by the node's processes.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast, overload

import numpy as np
import pyarrow as pa

from ..errors import IndexFormatError
from .checksum import checksum_bytes

if TYPE_CHECKING:
    from ..plan.shards import ShardCounts

SHARD_FORMATS = ("arrow", "parquet", "arrow_stream")
MAX_COUNT = 2**63  # rows and bytes are below this (they must fit an int64)
MAX_SHARDS = 2**31 - 1  # the native gather addresses shards with int32
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 64  # compression names
_CHECKSUM = re.compile(r"xxh64:[0-9a-f]{16}")
_UNKNOWN = -1  # raw_bytes (or a chunk layout) not recorded
#: The smallest tail an Arrow IPC file can have: footer length (4 bytes) and magic (6 bytes).
MIN_TAIL_BYTES = 10
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


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the index records it."""

    path: str  # relative to the index's folder, or an absolute URL
    format: str  # one of SHARD_FORMATS
    rows: int
    bytes: int
    checksum: str | None = None  # "xxh64:<hex>" of the object's bytes; None: size only
    compression: str | None = None  # of the stored buffers, for information
    raw_bytes: int | None = None  # uncompressed size of the data, when known
    chunk_rows: int | None = None  # rows per record batch (the last may have fewer)
    tail_bytes: int | None = None  # bytes of the Arrow IPC footer and what follows it
    tail_checksum: str | None = None  # "xxh64:<hex>" of those tail bytes

    @property
    def chunked(self) -> bool:
        """Whether the index records this shard's chunk layout (range reads by chunk)."""
        return self.chunk_rows is not None

    def to_json(self) -> dict[str, Any]:
        out = {
            "path": self.path, "format": self.format, "rows": self.rows, "bytes": self.bytes,
            "checksum": self.checksum, "compression": self.compression,
            "raw_bytes": self.raw_bytes,
        }
        if self.chunk_rows is not None:  # (absent otherwise: older indexes read the same)
            out.update(chunk_rows=self.chunk_rows, tail_bytes=self.tail_bytes,
                       tail_checksum=self.tail_checksum)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> ShardInfo:
        """A validated shard entry; :class:`IndexFormatError` names the shard and the rule."""
        return cls(*validated_row(obj))


class ShardRow(tuple[Any, ...]):
    """A validated shard entry as a plain tuple of :class:`ShardInfo`'s fields (compact: a
    JSON index of a million shards is parsed into these, not into dicts)."""

    __slots__ = ()


def validated_row(obj: Any) -> ShardRow:
    """Check one JSON shard entry: (path, format, rows, bytes, checksum, compression,
    raw_bytes, chunk_rows, tail_bytes, tail_checksum), each of the right type and range, or
    :class:`IndexFormatError`."""
    if type(obj) is not dict and not isinstance(obj, Mapping):
        raise IndexFormatError(f"a shard entry is a {type(obj).__name__}, not an object")
    path = obj.get("path")
    if type(path) is not str or not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise IndexFormatError(
            f"shard path {path!r} is not a non-empty string of at most {MAX_PATH_CHARS} "
            "characters"
        )
    fmt = obj.get("format")
    if fmt not in SHARD_FORMATS:
        raise IndexFormatError(
            f"shard {path!r} has unknown format {fmt!r}; known: {list(SHARD_FORMATS)}"
        )
    checksum = obj.get("checksum")
    if checksum is not None and not (type(checksum) is str and _CHECKSUM.fullmatch(checksum)):
        raise IndexFormatError(
            f"shard {path!r} has checksum {checksum!r}; expected 'xxh64:' and 16 hex digits"
        )
    compression = obj.get("compression")
    if compression is not None and not (type(compression) is str
                                        and len(compression) <= MAX_NAME_CHARS):
        raise IndexFormatError(f"shard {path!r} has a malformed compression {compression!r}")
    rows, nbytes = _count(obj.get("rows"), path, "rows"), _count(obj.get("bytes"), path, "bytes")
    return ShardRow((path, fmt, rows, nbytes, checksum, compression,
                     _count(obj.get("raw_bytes"), path, "raw_bytes", optional=True),
                     *_chunk_layout(obj, path, fmt, nbytes)))


def _chunk_layout(obj: Any, path: str, fmt: str, nbytes: int,
                  ) -> tuple[int | None, int | None, str | None]:
    """(chunk_rows, tail_bytes, tail_checksum) of an entry: all three or none, in range."""
    values = (obj.get("chunk_rows"), obj.get("tail_bytes"), obj.get("tail_checksum"))
    if values == (None, None, None):
        return None, None, None
    chunk_rows, tail_bytes, tail_checksum = values
    if not (fmt == "arrow" and type(chunk_rows) is int and 1 <= chunk_rows < MAX_COUNT
            and type(tail_bytes) is int and MIN_TAIL_BYTES <= tail_bytes <= nbytes
            and type(tail_checksum) is str and _CHECKSUM.fullmatch(tail_checksum)):
        raise IndexFormatError(
            f"shard {path!r} has a malformed chunk layout (chunk_rows={chunk_rows!r}, "
            f"tail_bytes={tail_bytes!r}, tail_checksum={tail_checksum!r}); it must be an "
            f"'arrow' shard with chunk_rows >= 1, {MIN_TAIL_BYTES} <= tail_bytes <= "
            "bytes and an 'xxh64:' checksum, all three or none: rebuild the index"
        )
    return chunk_rows, tail_bytes, tail_checksum


def shard_entry_hook(obj: dict[str, Any]) -> Any:
    """A ``json.loads`` object hook: each shard entry becomes a validated :class:`ShardRow` as
    soon as it is parsed (so the parse holds no dict per shard)."""
    if "path" in obj and "rows" in obj and "format" in obj:
        return validated_row(obj)
    return obj


def _count(value: Any, path: str, key: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value < MAX_COUNT:
        raise IndexFormatError(
            f"shard {path!r} has {key}={value!r}; it must be an integer in [0, 2**63)"
        )
    return value


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
        unknown = np.full(count, _UNKNOWN, np.int64)
        self._set(paths.cast(pa.large_string()), np.ascontiguousarray(formats, dtype=np.uint8),
                  _frozen(rows), _frozen(nbytes), checksums.cast(pa.string()),
                  compressions.cast(pa.string()), _frozen(raw_bytes),
                  _frozen(unknown if chunk_rows is None else chunk_rows),
                  _frozen(unknown if tail_bytes is None else tail_bytes),
                  pa.nulls(count, pa.string()) if tail_checksums is None
                  else tail_checksums.cast(pa.string()))
        self.total_rows = _exact_sum(self.rows)
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
        self._strings = tuple(_StringColumn(c) for c in (
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
            _string_array(paths, pa.large_string()),
            np.array([SHARD_FORMATS.index(f) for f in formats], np.uint8),
            np.array(counts, np.int64), np.array(sizes, np.int64),
            _string_array(checksums, pa.string()), _string_array(compressions, pa.string()),
            _known(raw), _known(chunk_rows), _known(tail_bytes),
            _string_array(tail_checksums, pa.string()),
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
        raw = pa.array(self._raw_bytes, pa.int64(), mask=self._raw_bytes == _UNKNOWN)
        formats = pa.array(SHARD_FORMATS, pa.string()).take(pa.array(self._formats))
        columns = [self._paths, formats, pa.array(self.rows), pa.array(self.nbytes),
                   self._checksums, self._compressions, raw]
        if not self.has_chunk_layouts:  # the columns an older streamcache reads
            return pa.table(columns, schema=ARROW_SCHEMA)
        columns += [pa.array(self._chunk_rows, pa.int64(), mask=self._chunk_rows == _UNKNOWN),
                    pa.array(self._tail_bytes, pa.int64(), mask=self._tail_bytes == _UNKNOWN),
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
            self._chunk_rows == _UNKNOWN, 0, self._chunk_rows))

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
        return np.where(self._raw_bytes != _UNKNOWN, self._raw_bytes, self.nbytes)

    @property
    def all_checksummed(self) -> bool:
        """Whether every shard records a checksum (the fingerprint then fixes the content)."""
        return self._checksums.null_count == 0

    @property
    def has_chunk_layouts(self) -> bool:
        """Whether any shard records its chunk layout."""
        return bool((self._chunk_rows != _UNKNOWN).any())

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


class _StringColumn:
    """Fast access to one string of an Arrow string column (numpy views of its buffers; a
    pyarrow scalar per access would cost several microseconds). Nothing is copied or
    scanned: a string's offsets and validity bit are read when it is asked for."""

    __slots__ = ("_data", "_offsets", "_start", "_valid")

    def __init__(self, column: pa.Array) -> None:
        buffers = column.buffers()
        width = np.int64 if pa.types.is_large_string(column.type) else np.int32
        self._offsets = np.frombuffer(buffers[1], dtype=width)[
            column.offset:column.offset + len(column) + 1] if buffers[1] is not None else \
            np.zeros(1, np.int64)
        self._data = memoryview(buffers[2]) if buffers[2] is not None else memoryview(b"")
        self._valid = np.frombuffer(buffers[0], np.uint8) \
            if buffers[0] is not None and column.null_count else None
        self._start = column.offset

    def __getitem__(self, k: int) -> str | None:
        if self._valid is not None:
            bit = self._start + k
            if not (int(self._valid[bit >> 3]) >> (bit & 7)) & 1:
                return None
        return str(self._data[int(self._offsets[k]):int(self._offsets[k + 1])], "utf-8")


def numpy_values(array: pa.Array, *, fill: int | None = None) -> np.ndarray:
    """The values of a null-free, fixed-width numeric Arrow array: a numpy view of its buffer.

    pyarrow's own ``to_numpy`` (and ``pa.array`` of Python objects) imports pandas where it is
    installed, to ask whether its input is a pandas object: 0.4 s of a fresh process's first
    batch (``fill_null`` too: its ``pa.scalar`` does the same). Everything on the way from
    ``index.json`` to a batch reads Arrow through this, the string builder below and
    :func:`null_mask` instead. Nulls become ``fill`` (a copy); without ``fill`` they are
    refused.
    """
    dtype = np.dtype(str(array.type))
    if len(array) == 0:
        return np.zeros(0, dtype)
    values = np.frombuffer(array.buffers()[1], dtype)[array.offset:array.offset + len(array)]
    if not array.null_count:
        return values
    if fill is None:
        raise ValueError(f"{array.null_count} nulls in an array read as plain values")
    return np.where(null_mask(array), dtype.type(fill), values)


def string_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets rebased to 0, UTF-8 bytes) of a string array: numpy views, no copy of the
    characters (``offsets[k]:offsets[k + 1]`` of the bytes is value ``k``; a null's is
    empty)."""
    width = np.int64 if pa.types.is_large_string(column.type) else np.int32
    buffers = column.buffers()
    if buffers[1] is None:
        return np.zeros(len(column) + 1, np.int64), np.zeros(0, np.uint8)
    offsets = np.frombuffer(buffers[1], width)[column.offset:column.offset + len(column) + 1]
    first, last = int(offsets[0]), int(offsets[-1])
    data = np.frombuffer(buffers[2], np.uint8)[first:last] if buffers[2] is not None and \
        last > first else np.zeros(0, np.uint8)
    return offsets.astype(np.int64) - first, data


def contains(data: np.ndarray, pattern: bytes) -> bool:
    """Whether the bytes ``data`` contain ``pattern`` anywhere (a megabyte at a time)."""
    step = 1 << 20
    for start in range(0, data.size, step):
        if bytes(data[start:start + step + len(pattern) - 1]).find(pattern) >= 0:
            return True
    return False


def null_mask(column: pa.Array) -> np.ndarray:
    """True where ``column`` is null, read from its validity bitmap (see
    :func:`numpy_values`)."""
    bits = np.unpackbits(np.frombuffer(column.buffers()[0], np.uint8), bitorder="little")
    return bits[column.offset:column.offset + len(column)] == 0


def _known(values: Sequence[int | None]) -> np.ndarray:
    return np.array([_UNKNOWN if v is None else v for v in values], np.int64)


def _optional(value: Any) -> int | None:
    value = int(value)
    return None if value == _UNKNOWN else value


def _frozen(values: np.ndarray) -> np.ndarray:
    array = np.array(values, dtype=np.int64)  # a private copy, then read-only
    array.setflags(write=False)
    return array


def _exact_sum(values: np.ndarray) -> int:
    """The exact sum of int64 values in [0, 2**63), without int64 overflow."""
    high = int((values >> 32).sum(dtype=np.int64))
    low = int((values & 0xFFFFFFFF).sum(dtype=np.int64))
    return (high << 32) + low


def _string_array(values: Sequence[str | None], type_: pa.DataType) -> pa.Array:
    """An Arrow string array built from its buffers (see :func:`numpy_values`)."""
    encoded = [b"" if value is None else value.encode() for value in values]
    offsets = np.zeros(len(encoded) + 1, np.int64 if type_ == pa.large_string() else np.int32)
    np.cumsum([len(item) for item in encoded], out=offsets[1:])
    valid = np.fromiter((value is not None for value in values), bool, len(encoded))
    nulls = len(encoded) - int(valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little").tobytes()) if nulls else None
    return pa.Array.from_buffers(type_, len(encoded), [bitmap, pa.py_buffer(offsets.tobytes()),
                                                       pa.py_buffer(b"".join(encoded))],
                                 null_count=nulls)


def fixed_digest(column: np.ndarray) -> str:
    """A checksum of a fixed-width column's bytes (a part of :meth:`ShardTable.digest`)."""
    return checksum_bytes(np.ascontiguousarray(column).tobytes())


def table_digest(count: int, parts: Sequence[str]) -> str:
    """:meth:`ShardTable.digest` from its parts: the formats, rows, bytes and raw bytes
    columns (:func:`fixed_digest`), then the paths, checksums and compressions
    (:func:`strings_digest`)."""
    return checksum_bytes(json.dumps([count, *parts]).encode())


def check_chunk_columns(formats: np.ndarray, nbytes: np.ndarray, chunk_rows: np.ndarray,
                        tail_bytes: np.ndarray, tail_valid: np.ndarray | None, where: str,
                        entry: Any = None) -> None:
    """Chunk layouts (chunk rows, tail bytes, whether a tail checksum is recorded, -1 or
    False for none) are all three or none, an 'arrow' shard's, in range (the tail
    checksums' form is checked with their values). ``entry(k)``, when given, names the
    first offending shard.

    Raises:
        IndexFormatError: naming the shard (or its number) and the rule.
    """
    known = chunk_rows != _UNKNOWN
    tails = tail_bytes != _UNKNOWN
    checksums = np.ones(known.size, bool) if tail_valid is None else tail_valid
    if not (known.any() or tails.any() or (tail_valid is not None and tail_valid.any())):
        return
    if (known == tails).all() and (known == checksums).all() and (
            (chunk_rows[known] >= 1).all() and (tail_bytes[known] >= MIN_TAIL_BYTES).all()
            and (tail_bytes[known] <= nbytes[known]).all()
            and (formats[known] == SHARD_FORMATS.index("arrow")).all()):
        return
    for k in np.flatnonzero(known | tails | checksums).tolist():
        if entry is not None:
            try:
                validated_row(entry(k).to_json())
            except IndexFormatError as exc:
                raise IndexFormatError(f"{where}: {exc}") from None
        elif not (known[k] and tails[k] and checksums[k] and chunk_rows[k] >= 1
                  and MIN_TAIL_BYTES <= tail_bytes[k] <= nbytes[k]
                  and formats[k] == SHARD_FORMATS.index("arrow")):
            raise IndexFormatError(
                f"{where}: shard {k} has a malformed chunk layout (chunk_rows="
                f"{int(chunk_rows[k])}, tail_bytes={int(tail_bytes[k])}, a tail checksum: "
                f"{bool(checksums[k])}); it must be an 'arrow' shard with chunk_rows >= 1, "
                f"{MIN_TAIL_BYTES} <= tail_bytes <= bytes and an 'xxh64:' checksum, all "
                "three or none: rebuild the index")
    raise IndexFormatError(f"{where}: a chunk layout is malformed")  # (not reached)


def strings_digest(column: pa.Array) -> str:
    """A checksum of a string column: lengths (-1 for null) and the concatenated characters
    (digested in place, without a copy)."""
    offsets, data = string_buffers(column)
    return strings_digest_of(offsets, ~null_mask(column) if column.null_count else None, data)


def strings_digest_of(offsets: np.ndarray, valid: np.ndarray | None, data: Any) -> str:
    """:func:`strings_digest` of a column given as its offsets (from 0), validity (None: no
    nulls) and bytes."""
    lengths = np.diff(offsets).astype(np.int64)
    if valid is not None:
        if (lengths[~valid] != 0).any():  # a null that spans bytes adds none of them
            data = b"".join(bytes(data[int(offsets[k]):int(offsets[k + 1])])
                            for k in np.flatnonzero(valid).tolist())
        lengths[~valid] = -1
    return checksum_bytes((checksum_bytes(lengths) + checksum_bytes(data)).encode())


__all__ = ["MAX_SHARDS", "SHARD_FORMATS", "ShardInfo", "ShardRow", "ShardTable", "shard_entry_hook",
           "validated_row"]
