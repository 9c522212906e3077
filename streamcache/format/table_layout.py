"""A shard table in one buffer: written a column at a time, opened as zero-copy views.

This is the layout of the node copy of a large index's shard table (format/node_table.py),
and of a side file's table decoded in memory (the same code, a bytes buffer instead of a
file). Opening one costs O(columns): every column is a view of the buffer (numpy arrays,
Arrow string arrays), so a memory-mapped copy's pages are read only where a step looks, and
are shared by every process of the node that maps it.

The layout (little-endian)::

    MAGIC                                   8 bytes
    column, column, ...                     each at a multiple of ALIGN bytes
    header                                  JSON: version, shards, columns, metadata
    header length (uint64), MAGIC           the last 16 bytes

A string column ``c`` is three columns: ``c.offsets`` (int64 for paths, int32 otherwise),
``c.data`` (UTF-8 bytes) and, when it has nulls, ``c.valid`` (a validity bitmap). The
header says where each column is; :func:`open_layout` checks that every column lies inside
the buffer, is aligned and has the size its kind and the shard count give, and refuses
anything else with :class:`IndexFormatError`. The contents were validated when they were
written; whether a buffer may be trusted to hold what its writer wrote is the node copy's
question (node_table.py), not this module's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from ..errors import IndexFormatError
from .arrow_arrays import null_mask, string_buffers
from .shard_entry import SHARD_FORMATS, ShardInfo
from .shard_table import TABLE_COLUMNS, ShardTable

MAGIC = b"SCTABLE1"
LAYOUT_VERSION = 1
ALIGN = 64
MAX_HEADER_BYTES = 1 << 20
_FOOTER = struct.Struct("<Q8s")

#: Fixed-width columns: name -> numpy dtype (``offsets`` has one more value than shards).
FIXED = {"formats": np.uint8, "rows": np.int64, "bytes": np.int64, "raw_bytes": np.int64,
         "chunk_rows": np.int64, "tail_bytes": np.int64, "offsets": np.int64}
#: String columns: name -> Arrow type (``large_string``: int64 offsets).
STRINGS = {"paths": pa.large_string(), "checksums": pa.string(), "compressions": pa.string(),
           "tail_checksums": pa.string()}
HISTOGRAM = ("hist_values", "hist_counts")


class LayoutWriter:
    """Write a table's columns into ``sink``, one at a time (nothing else is kept).

    Args:
        read_back: ``read_back(offset, length)`` returns bytes already written (for checks
            of a column once it is whole, e.g. its digest); None: :meth:`read` fails.

    Thread safety: one writer, one thread.
    """

    def __init__(self, sink: BinaryIO, read_back: Callable[[int, int], Any] | None = None,
                 ) -> None:
        self._sink = sink
        self._read_back = read_back
        self._position = 0
        self._columns: dict[str, list[int]] = {}
        self._nulls: dict[str, int] = {}
        self._write(MAGIC)

    def _write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._sink.write(view)
        self._position += view.nbytes

    def _align(self) -> None:
        pad = -self._position % ALIGN
        if pad:
            self._write(bytes(pad))

    def add(self, name: str, values: Any) -> None:
        """One column's bytes (a contiguous numpy array or buffer), aligned."""
        self._align()
        data: Any = np.ascontiguousarray(values) if isinstance(values, np.ndarray) else values
        self._columns[name] = [self._position, memoryview(data).nbytes]
        self._write(data)

    def add_strings(self, name: str, array: pa.Array) -> None:
        """A whole string column (see :meth:`strings`)."""
        with self.strings(name) as column:
            column.append(array)

    @contextlib.contextmanager
    def strings(self, name: str) -> Iterator[_StringsWriter]:
        """A string column written a piece at a time (``append(array)``), as its data, then
        its offsets (of its :data:`STRINGS` type's width) and validity."""
        self._align()
        column = _StringsWriter(self)
        yield column
        self._columns[f"{name}.data"] = [column.start, column.length]
        width = np.int64 if pa.types.is_large_string(STRINGS[name]) else np.int32
        if width == np.int32 and column.length >= 2**31:
            raise IndexFormatError(f"column {name!r} holds {column.length} bytes of "
                                   "strings, over what its offsets can address")
        ends = np.concatenate([np.zeros(1, np.int64), *column.ends])
        self.add(f"{name}.offsets", ends.astype(width) if width != np.int64 else ends)
        self._nulls[name] = column.nulls
        if column.nulls:
            self.add(f"{name}.valid", np.packbits(np.concatenate(column.valid),
                                                  bitorder="little"))

    @property
    def columns(self) -> Mapping[str, list[int]]:
        """The columns written so far: name -> [offset, length]."""
        return self._columns

    def read(self, name: str) -> Any:
        """The bytes of a column written already (through ``read_back``)."""
        if self._read_back is None:
            raise ValueError("this LayoutWriter cannot read back")
        self._sink.flush()
        offset, length = self._columns[name]
        return self._read_back(offset, length)

    def finish(self, shards: int, metadata: Mapping[str, Any]) -> None:
        """Write the header and the footer."""
        header = json.dumps({"version": LAYOUT_VERSION, "shards": shards,
                             "columns": self._columns, "nulls": self._nulls,
                             "metadata": dict(metadata)}, sort_keys=True).encode()
        self._write(header)
        self._write(_FOOTER.pack(len(header), MAGIC))


class _StringsWriter:
    """The pieces of one string column being written (its data goes out at once; the
    offsets and validity are kept, 8 bytes and one bool a value)."""

    def __init__(self, writer: LayoutWriter) -> None:
        self.writer = writer
        self.start = writer._position
        self.length = 0
        self.nulls = 0
        self.ends: list[np.ndarray] = []
        self.valid: list[np.ndarray] = []

    def append(self, array: pa.Array) -> None:
        offsets, data = string_buffers(array)
        self.writer._write(data)
        self.ends.append(offsets[1:] + self.length)
        self.length += int(data.size)
        valid = np.ones(len(array), bool)
        if array.null_count:
            valid = ~null_mask(array)
        self.nulls += int(array.null_count)
        self.valid.append(valid)


def memory_writer() -> tuple[io.BytesIO, LayoutWriter]:
    """A writer of a layout in memory, and its buffer (open it with :func:`open_memory`)."""
    buffer = io.BytesIO()

    def read_back(offset: int, length: int) -> bytes:
        with buffer.getbuffer() as view:
            return bytes(view[offset:offset + length])

    return buffer, LayoutWriter(buffer, read_back)


def open_memory(buffer: io.BytesIO, where: str) -> ShardTable:
    """The table of a layout written by :func:`memory_writer` (views of its buffer)."""
    header, columns = open_layout(buffer.getbuffer(), where)
    return open_table(header, columns, where, keepalive=buffer)


def write_table(sink: BinaryIO, table: ShardTable, metadata: Mapping[str, Any]) -> None:
    """Write a whole in-memory table (its offsets and row distribution included)."""
    writer = LayoutWriter(sink)
    for name, column in table.columns().items():
        if name in STRINGS:
            writer.add_strings(name, column)
        else:
            writer.add(name, column)
    writer.add("offsets", table.offsets)
    for name, values in zip(HISTOGRAM, table.row_histogram(), strict=True):
        writer.add(name, values)
    writer.finish(len(table), metadata)


def open_layout(buffer: Any, where: str) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """The header and the columns (memoryviews of ``buffer``) of a table layout.

    Raises:
        IndexFormatError: no layout, a header that does not parse, a column outside the
            buffer or misaligned.
    """
    view = memoryview(buffer).cast("B")
    size = view.nbytes
    if size < len(MAGIC) + _FOOTER.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise IndexFormatError(f"{where} is not a shard table copy (no {MAGIC!r} at its start)")
    length, magic = _FOOTER.unpack(view[size - _FOOTER.size:])
    header_start = size - _FOOTER.size - length
    if magic != MAGIC or not 0 < length <= MAX_HEADER_BYTES or header_start < len(MAGIC):
        raise IndexFormatError(f"{where} is not a whole shard table copy (its footer is "
                               "damaged or it was cut short)")
    try:
        header = json.loads(bytes(view[header_start:header_start + length]))
        if not isinstance(header, dict) or header.get("version") != LAYOUT_VERSION:
            raise ValueError(f"not a version-{LAYOUT_VERSION} header")
        entries = header["columns"]
        if not isinstance(entries, dict):
            raise ValueError("'columns' is not an object")
        columns = {}
        for name, entry in entries.items():
            offset, nbytes = entry
            if not (type(offset) is int and type(nbytes) is int and offset % ALIGN == 0
                    and len(MAGIC) <= offset and 0 <= nbytes <= header_start - offset):
                raise ValueError(f"column {name!r} at {entry!r} is outside the copy")
            columns[str(name)] = view[offset:offset + nbytes]
    except (ValueError, TypeError, KeyError) as exc:
        raise IndexFormatError(f"{where} has a malformed header ({exc})") from None
    return header, columns


def open_table(header: Mapping[str, Any], columns: Mapping[str, memoryview], where: str, *,
               keepalive: Any = None, reopen: tuple[Any, ...] | None = None,
               fd: int | None = None) -> ShardTable:
    """The :class:`ShardTable` of an opened layout: zero-copy views, each column's size
    checked against the shard count (one value of each string column's offsets is read).
    With ``fd`` (the layout's file), one shard's values are read with ``pread`` rather than
    through the views (see :class:`PointReader`).

    Raises:
        IndexFormatError: a column is missing or of the wrong size.
    """
    shards, nulls = header.get("shards"), header.get("nulls")
    if type(shards) is not int or shards < 0 or not isinstance(nulls, dict):
        raise IndexFormatError(f"{where} has a malformed header (shards={shards!r})")
    out: dict[str, Any] = {}
    for name, dtype in FIXED.items():
        out[name] = _fixed(columns, name, dtype, shards + (name == "offsets"), where)
    for name, arrow_type in STRINGS.items():
        out[name] = _strings(columns, name, arrow_type, shards, nulls.get(name), where)
    values, counts = (_fixed(columns, name, np.int64, -1, where) for name in HISTOGRAM)
    if values.size != counts.size:
        raise IndexFormatError(f"{where}: the row histogram's columns differ in length")
    offsets = out.pop("offsets")
    metadata = header.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    digest, outside = metadata.get("digest"), metadata.get("paths_outside")
    point = None if fd is None else PointReader(fd, header["columns"], nulls)
    return ShardTable.opened({name: out[name] for name in TABLE_COLUMNS}, offsets,
                             (values, counts), keepalive=keepalive, reopen=reopen,
                             digest=digest if isinstance(digest, str) else None,
                             paths_outside=outside if type(outside) is int else None,
                             point=point)


class PointReader:
    """One shard's entry read from a layout file with ``pread``, a few bytes per column.

    A step asks for the entries of a few hundred shards scattered over the table. Read
    through a memory map, each of those reads would map pages (and, with the page cache's
    large folios, their neighbourhood) into the process, so that its resident memory grew
    by most of the table although nothing was copied; read with ``pread``, the bytes come
    from the same page cache and nothing is mapped. Thread safety: ``pread`` has no file
    position; any thread may read.
    """

    def __init__(self, fd: int, columns: Mapping[str, Any], nulls: Mapping[str, Any]) -> None:
        self._fd = os.dup(fd)
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        self._at = {name: int(entry[0]) for name, entry in columns.items()}
        self._nulls = {name: bool(count) for name, count in nulls.items()}

    def _read(self, column: str, k: int, width: int, count: int = 1) -> bytes:
        data = os.pread(self._fd, width * count, self._at[column] + k * width)
        if len(data) != width * count:
            raise IndexFormatError("the node copy of the shard table was cut short")
        return data

    def _integer(self, column: str, k: int) -> int:
        return int.from_bytes(self._read(column, k, 8), "little", signed=True)

    def _string(self, column: str, k: int) -> str | None:
        if self._nulls.get(column):
            bits = self._read(f"{column}.valid", k >> 3, 1)[0]
            if not (bits >> (k & 7)) & 1:
                return None
        width = 8 if column == "paths" else 4
        start, stop = struct.unpack("<2q" if width == 8 else "<2i",
                                    self._read(f"{column}.offsets", k, width, 2))
        if not 0 <= start <= stop:
            raise IndexFormatError("the node copy of the shard table is damaged")
        data = os.pread(self._fd, stop - start, self._at[f"{column}.data"] + start)
        return data.decode()

    def shard(self, k: int) -> ShardInfo:
        def optional(value: int) -> int | None:
            return None if value == -1 else value
        return ShardInfo(
            str(self._string("paths", k)), SHARD_FORMATS[self._read("formats", k, 1)[0]],
            self._integer("rows", k), self._integer("bytes", k),
            self._string("checksums", k), self._string("compressions", k),
            optional(self._integer("raw_bytes", k)), optional(self._integer("chunk_rows", k)),
            optional(self._integer("tail_bytes", k)), self._string("tail_checksums", k))


def _fixed(columns: Mapping[str, memoryview], name: str, dtype: Any, count: int,
           where: str) -> np.ndarray:
    view = _column(columns, name, where)
    width = np.dtype(dtype).itemsize
    if view.nbytes % width or (count >= 0 and view.nbytes != count * width):
        raise IndexFormatError(f"{where}: column {name!r} holds {view.nbytes} bytes, not "
                               f"{count} values of {width} bytes")
    array = np.frombuffer(view, dtype)
    if array.flags.writeable:  # (a bytes buffer is read-only already; a bytearray is not)
        array.setflags(write=False)
    return array


def _strings(columns: Mapping[str, memoryview], name: str, arrow_type: pa.DataType,
             shards: int, nulls: Any, where: str) -> pa.Array:
    width = np.int64 if pa.types.is_large_string(arrow_type) else np.int32
    offsets = _fixed(columns, f"{name}.offsets", width, shards + 1, where)
    data = _column(columns, f"{name}.data", where)
    if int(offsets[0]) != 0 or int(offsets[-1]) != data.nbytes or type(nulls) is not int \
            or not 0 <= nulls <= shards:
        raise IndexFormatError(f"{where}: string column {name!r} does not match its data")
    validity = None
    if nulls:
        valid = _column(columns, f"{name}.valid", where)
        if valid.nbytes != -(-shards // 8):
            raise IndexFormatError(f"{where}: the validity of {name!r} has the wrong size")
        validity = pa.py_buffer(valid)
    return pa.Array.from_buffers(arrow_type, shards, [validity, pa.py_buffer(columns[
        f"{name}.offsets"]), pa.py_buffer(data)], null_count=nulls)


def _column(columns: Mapping[str, memoryview], name: str, where: str) -> memoryview:
    if name not in columns:
        raise IndexFormatError(f"{where} has no column {name!r}")
    return columns[name]


__all__ = ["ALIGN", "MAGIC", "LayoutWriter", "memory_writer", "open_layout", "open_memory",
           "open_table", "write_table"]
