"""The shard table of an index: every shard's path, format, rows, bytes and checksum, as columns.

A dataset can have millions of shards. :class:`ShardTable` keeps them as a handful of numpy and
Arrow arrays (no Python object per shard) and builds a :class:`ShardInfo` only for the shard
asked for, so a large index costs tens of bytes per shard in every process that loads it.

Everything read from an index is untrusted: :meth:`ShardTable.from_json` and
:meth:`ShardTable.from_arrow` check the type and range of every field (rows and bytes are
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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import IndexFormatError
from .checksum import checksum_bytes

SHARD_FORMATS = ("arrow", "parquet", "arrow_stream")
MAX_COUNT = 2**63  # rows and bytes are below this (they must fit an int64)
MAX_SHARDS = 2**31 - 1  # the native gather addresses shards with int32
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 64  # compression names
_CHECKSUM = re.compile(r"xxh64:[0-9a-f]{16}")
_CHECKSUM_PATTERN = r"^xxh64:[0-9a-f]{16}$"
_UNKNOWN = -1  # raw_bytes (or a chunk layout) not recorded
#: The smallest tail an Arrow IPC file can have: footer length (4 bytes) and magic (6 bytes).
MIN_TAIL_BYTES = 10
_CHUNK = 65536  # shards turned into Python objects at a time when iterating

ARROW_SCHEMA = pa.schema([
    pa.field("path", pa.large_string(), nullable=False),
    pa.field("format", pa.string(), nullable=False),
    pa.field("rows", pa.int64(), nullable=False),
    pa.field("bytes", pa.int64(), nullable=False),
    pa.field("checksum", pa.string()),
    pa.field("compression", pa.string()),
    pa.field("raw_bytes", pa.int64()),
])
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

    Build it with :meth:`from_infos`, :meth:`from_json` or :meth:`from_arrow`; all three
    validate. ``table[k]`` builds one :class:`ShardInfo`; :attr:`rows` and :attr:`nbytes` are
    whole int64 columns (read-only).

    Thread safety: immutable; any thread may read.
    """

    __slots__ = ("_checksums", "_chunk_rows", "_compressions", "_digest", "_formats", "_paths",
                 "_raw_bytes", "_strings", "_tail_bytes", "_tail_checksums",
                 "nbytes", "rows", "total_rows")

    def __init__(self, paths: pa.Array, formats: np.ndarray, rows: np.ndarray,
                 nbytes: np.ndarray, checksums: pa.Array, compressions: pa.Array,
                 raw_bytes: np.ndarray, chunk_rows: np.ndarray | None = None,
                 tail_bytes: np.ndarray | None = None,
                 tail_checksums: pa.Array | None = None) -> None:
        self._paths = paths.cast(pa.large_string())
        self._formats = np.ascontiguousarray(formats, dtype=np.uint8)
        self.rows = _frozen(rows)
        self.nbytes = _frozen(nbytes)
        self._checksums = checksums.cast(pa.string())
        self._compressions = compressions.cast(pa.string())
        self._raw_bytes = _frozen(raw_bytes)
        count = len(self._paths)
        unknown = np.full(count, _UNKNOWN, np.int64)
        self._chunk_rows = _frozen(unknown if chunk_rows is None else chunk_rows)
        self._tail_bytes = _frozen(unknown if tail_bytes is None else tail_bytes)
        self._tail_checksums = (pa.nulls(count, pa.string()) if tail_checksums is None
                                else tail_checksums.cast(pa.string()))
        self._digest: str | None = None
        self._strings = tuple(_StringColumn(c) for c in (
            self._paths, self._checksums, self._compressions, self._tail_checksums))
        if count > MAX_SHARDS:
            raise IndexFormatError(f"the index lists {count} shards; at most {MAX_SHARDS} are "
                                   "supported: write larger shards")
        if not all(len(c) == count for c in (self._formats, self.rows, self.nbytes,
                                             self._checksums, self._compressions,
                                             self._raw_bytes, self._chunk_rows,
                                             self._tail_bytes, self._tail_checksums)):
            raise IndexFormatError("the shard table's columns have different lengths")
        self.total_rows = _exact_sum(self.rows)
        if self.total_rows >= MAX_COUNT:
            raise IndexFormatError(
                f"the shards hold {self.total_rows} rows in all; at most 2**63 - 1 are supported"
            )

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

    @classmethod
    def from_arrow(cls, table: pa.Table, where: str) -> ShardTable:
        """A table from a side file's Arrow table (columns of :data:`ARROW_SCHEMA`)."""
        chunked = "chunk_rows" in table.schema.names
        schema = pa.schema([*ARROW_SCHEMA, *CHUNK_FIELDS]) if chunked else ARROW_SCHEMA
        try:
            table = table.select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
            raise IndexFormatError(
                f"{where} is not a shard table with the columns {ARROW_SCHEMA.names}: {exc}"
            ) from exc
        columns = {name: table.column(name).combine_chunks() for name in schema.names}
        _check_arrow_columns(columns, where)
        formats = pc.index_in(columns["format"], _string_array(SHARD_FORMATS, pa.string()))
        shards = cls(
            columns["path"], numpy_values(formats).astype(np.uint8),
            numpy_values(columns["rows"]), numpy_values(columns["bytes"]),
            columns["checksum"], columns["compression"],
            numpy_values(columns["raw_bytes"], fill=_UNKNOWN),
            *((numpy_values(columns["chunk_rows"], fill=_UNKNOWN),
               numpy_values(columns["tail_bytes"], fill=_UNKNOWN), columns["tail_checksum"])
              if chunked else ()),
        )
        if chunked:
            shards._check_chunk_layouts(where)
        return shards

    def _check_chunk_layouts(self, where: str) -> None:
        """The chunk layouts of a side file obey the rules of a JSON entry (vectorized for
        the usual case; the first offending shard is named by the entry's own check)."""
        known = self._chunk_rows != _UNKNOWN
        if not known.any():
            return
        recorded = [known, self._tail_bytes != _UNKNOWN,
                    ~_null_mask(self._tail_checksums) if self._tail_checksums.null_count
                    else np.ones(len(self), bool)]
        fine = (recorded[0] == recorded[1]).all() and (recorded[0] == recorded[2]).all() and (
            (self._chunk_rows[known] >= 1).all()
            and (self._tail_bytes[known] >= MIN_TAIL_BYTES).all()
            and (self._tail_bytes[known] <= self.nbytes[known]).all()
            and (self._formats[known] == SHARD_FORMATS.index("arrow")).all())
        checksums = self._tail_checksums.drop_null()
        if fine and (not len(checksums) or pc.all(pc.match_substring_regex(
                checksums, _CHECKSUM_PATTERN)).as_py()):
            return
        for k in np.flatnonzero(known | recorded[1] | recorded[2]).tolist():
            try:
                validated_row(self[k].to_json())
            except IndexFormatError as exc:
                raise IndexFormatError(f"{where}: {exc}") from None
        raise IndexFormatError(f"{where}: a chunk layout is malformed")  # (not reached)

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
            parts = [checksum_bytes(column.tobytes()) for column in
                     (self._formats, self.rows, self.nbytes, self._raw_bytes)]
            parts += [_strings_digest(column) for column in
                      (self._paths, self._checksums, self._compressions)]
            self._digest = checksum_bytes(json.dumps([len(self), *parts]).encode())
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
        return ShardInfo(
            cast(str, self._strings[0][k]), SHARD_FORMATS[self._formats[k]], int(self.rows[k]),
            int(self.nbytes[k]), self._strings[1][k], self._strings[2][k],
            _optional(self._raw_bytes[k]), _optional(self._chunk_rows[k]),
            _optional(self._tail_bytes[k]), self._strings[3][k],
        )

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
        return (ShardTable, (self._paths, self._formats, self.rows, self.nbytes,
                             self._checksums, self._compressions, self._raw_bytes,
                             self._chunk_rows, self._tail_bytes, self._tail_checksums))


class _StringColumn:
    """Fast access to one string of an Arrow string column (numpy views of its buffers; a
    pyarrow scalar per access would cost several microseconds)."""

    __slots__ = ("_data", "_nulls", "_offsets")

    def __init__(self, column: pa.Array) -> None:
        column = column.cast(pa.large_string())
        buffers = column.buffers()
        self._offsets = np.frombuffer(buffers[1], dtype=np.int64)[
            column.offset:column.offset + len(column) + 1] if buffers[1] is not None else \
            np.zeros(1, np.int64)
        self._data = memoryview(buffers[2]) if buffers[2] is not None else memoryview(b"")
        self._nulls = _null_mask(column) if column.null_count else None

    def __getitem__(self, k: int) -> str | None:
        if self._nulls is not None and self._nulls[k]:
            return None
        return str(self._data[self._offsets[k]:self._offsets[k + 1]], "utf-8")


def numpy_values(array: pa.Array, *, fill: int | None = None) -> np.ndarray:
    """The values of a null-free, fixed-width numeric Arrow array: a numpy view of its buffer.

    pyarrow's own ``to_numpy`` (and ``pa.array`` of Python objects) imports pandas where it is
    installed, to ask whether its input is a pandas object: 0.4 s of a fresh process's first
    batch (``fill_null`` too: its ``pa.scalar`` does the same). Everything on the way from
    ``index.json`` to a batch reads Arrow through this, the string builder below and
    :func:`_null_mask` instead. Nulls become ``fill`` (a copy); without ``fill`` they are
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
    return np.where(_null_mask(array), dtype.type(fill), values)


def _null_mask(column: pa.Array) -> np.ndarray:
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


def _strings_digest(column: pa.Array) -> str:
    """A checksum of a string column: lengths (-1 for null) and the concatenated characters
    (digested in place, without a copy)."""
    lengths = numpy_values(pc.binary_length(column).cast(pa.int64()), fill=-1)
    filled = column.filter(pc.is_valid(column)).cast(pa.large_string())  # nulls add no bytes
    offsets = np.frombuffer(filled.buffers()[1], dtype=np.int64)[
        filled.offset:filled.offset + len(filled) + 1]
    values = filled.buffers()[2]
    data = b"" if values is None or not len(filled) else memoryview(values)[
        int(offsets[0]):int(offsets[-1])]
    return checksum_bytes((checksum_bytes(lengths) + checksum_bytes(data)).encode())


def _check_arrow_columns(columns: Mapping[str, pa.Array], where: str) -> None:
    """The side file's columns obey the same rules as a JSON shard entry."""
    for name in ("path", "format", "rows", "bytes"):
        if columns[name].null_count:
            raise IndexFormatError(f"{where}: column {name!r} has nulls")
    paths = columns["path"]
    if len(paths) and (pc.min(pc.utf8_length(paths)).as_py() == 0
                       or pc.max(pc.utf8_length(paths)).as_py() > MAX_PATH_CHARS
                       or pc.any(pc.match_substring(paths, "\0")).as_py()):
        raise IndexFormatError(f"{where}: a shard path is empty, over {MAX_PATH_CHARS} "
                               "characters, or holds a NUL")
    unknown = pc.invert(pc.is_in(columns["format"], _string_array(SHARD_FORMATS, pa.string())))
    if pc.any(unknown).as_py():
        raise IndexFormatError(f"{where}: unknown shard format(s) "
                               f"{pc.unique(columns['format'].filter(unknown)).to_pylist()}")
    for name in ("rows", "bytes", "raw_bytes"):
        if len(columns[name]) and (pc.min(columns[name]).as_py() or 0) < 0:
            raise IndexFormatError(f"{where}: column {name!r} has a negative value; it must "
                                   "be an integer in [0, 2**63)")
    checksums = columns["checksum"].drop_null()
    if len(checksums) and not pc.all(pc.match_substring_regex(checksums,
                                                              _CHECKSUM_PATTERN)).as_py():
        raise IndexFormatError(f"{where}: a checksum is not 'xxh64:' and 16 hex digits")
    compressions = columns["compression"].drop_null()
    if len(compressions) and pc.max(pc.utf8_length(compressions)).as_py() > MAX_NAME_CHARS:
        raise IndexFormatError(f"{where}: a compression name is malformed")


__all__ = ["MAX_SHARDS", "SHARD_FORMATS", "ShardInfo", "ShardRow", "ShardTable", "shard_entry_hook",
           "validated_row"]
