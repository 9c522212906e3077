"""Decoding a shard table's Parquet side file, safely, a column at a time.

The side file is untrusted input (it sits beside the index, in a folder others may write),
and Parquet is a compressed format whose own metadata can lie: a few kilobytes can describe
hundreds of millions of rows (columns of Arrow's ``null`` type, or a repeated value,
encode to almost nothing), and a cast or a decode of them would allocate gigabytes. So
memory is bounded by what is decoded, never by what the file says:

- every column's type must be the type the library writes (int64, a string), or the file
  is refused before anything is decoded (no ``null`` columns, no casts that expand);
- the fixed-width columns' size follows from the row count (8 bytes a value), checked
  against the cap before they are decoded;
- string columns are decoded as dictionaries (the distinct values and an int32 index per
  row: never larger than the file's own pages); their values are checked, and the size of
  the strings they expand to is computed and checked before they are expanded;
- the cap is :func:`decoded_cap` of the stored size (a legitimate table expands about 10 to
  40 times; a floor keeps small tables free), and every failure of pyarrow on the way
  (malformed pages, an allocation that fails) is an :class:`IndexFormatError`.

Each column is written to a :class:`~streamcache.format.table_layout.LayoutWriter` as soon as
it is decoded and checked, so decoding holds one column at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import IndexFormatError
from .arrow_arrays import contains, numpy_values, string_buffers
from .shard_entry import (
    MAX_COUNT,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_SHARDS,
    SHARD_FORMATS,
    UNKNOWN,
    check_chunk_columns,
    exact_sum,
)
from .table_digest import fixed_digest, strings_digest_of, table_digest
from .table_layout import HISTOGRAM, LayoutWriter

#: A side file may decode to at most this many times its stored size ...
MAX_EXPANSION = 256
#: ... or this many bytes, whichever is larger (and never more than MAX_SHARD_TABLE_DECODED).
DECODED_FLOOR = 64 << 20
#: Bytes a shard takes decoded, at least: five int64 columns, its format, its offset.
FIXED_BYTES_PER_SHARD = 8 * 5 + 1 + 8

#: Side-file column -> (layout column, kind, nullable).
INTEGER_COLUMNS = {"rows": False, "bytes": False, "raw_bytes": True, "chunk_rows": True,
                   "tail_bytes": True}
STRING_COLUMNS = {"path": ("paths", pa.large_string(), False),
                  "checksum": ("checksums", pa.string(), True),
                  "compression": ("compressions", pa.string(), True),
                  "tail_checksum": ("tail_checksums", pa.string(), True)}
REQUIRED = ("path", "format", "rows", "bytes", "checksum", "compression", "raw_bytes")
#: The columns :meth:`ShardTable.digest` covers, in its order (layout names).
DIGESTED = ("formats", "rows", "bytes", "raw_bytes", "paths", "checksums", "compressions")
CHUNKED = ("chunk_rows", "tail_bytes", "tail_checksum")


def decoded_cap(stored_bytes: int, limit: int) -> int:
    """The most bytes a side file of ``stored_bytes`` may decode to (at most ``limit``)."""
    return min(limit, max(DECODED_FLOOR, MAX_EXPANSION * stored_bytes))


@dataclass(frozen=True)
class SideFacts:
    """What decoding established about a side table: its shard count, its digest (what the
    index's fingerprint covers) and how many of its paths name places outside the index's
    folder (absolute, URLs, '..')."""

    shards: int
    digest: str
    paths_outside: int


def decode_side_table(data: bytes, where: str, writer: LayoutWriter, limit: int) -> SideFacts:
    """Decode the side file ``data`` into ``writer`` (every column of the layout but the
    header), checking every value as a JSON entry's; returns what it established.

    Raises:
        IndexFormatError: not a Parquet shard table, a column of another type, a value out
            of its range, or more decoded bytes than :func:`decoded_cap` allows.
    """
    import pyarrow.parquet as pq
    cap = decoded_cap(len(data), limit)
    try:
        names = pq.ParquetFile(pa.BufferReader(data)).schema_arrow.names
        strings = [n for n in (*STRING_COLUMNS, "format") if n in names]
        parquet = pq.ParquetFile(pa.BufferReader(data), read_dictionary=strings)
        shards = parquet.metadata.num_rows
        _check_columns(parquet.schema_arrow, where)
        budget = _Budget(cap, where)
        if not 0 <= shards <= MAX_SHARDS:
            raise IndexFormatError(f"{where} says it holds {shards} shards; at most "
                                   f"{MAX_SHARDS} are supported")
        budget.spend(shards * FIXED_BYTES_PER_SHARD, f"{shards} shards")
        digests: dict[str, Any] = {}
        for name in STRING_COLUMNS:  # (first: what is kept of the integers waits less)
            digests.update(_decode_strings(parquet, name, shards, where, writer, budget))
        integers = _decode_integers(parquet, shards, where, writer)
        formats = _decode_formats(parquet, shards, where)
        writer.add("formats", formats)
        digests.update({name: fixed_digest(values) for name, values in
                        (("formats", formats), *integers.items()) if name in DIGESTED})
    except IndexFormatError:
        raise
    except (pa.ArrowException, MemoryError, OSError, ValueError, KeyError) as exc:
        raise IndexFormatError(f"{where} is not a readable shard table "
                               f"({type(exc).__name__}: {exc}): rebuild the index") from None
    rows = integers["rows"]
    check_chunk_columns(formats, integers["bytes"], integers["chunk_rows"],
                        integers["tail_bytes"], digests.pop("tail_valid"), where)
    total = exact_sum(rows)
    if total >= MAX_COUNT:
        raise IndexFormatError(f"{where}: the shards hold {total} rows in all; at most "
                               "2**63 - 1 are supported")
    offsets = np.zeros(shards + 1, dtype=np.int64)
    np.cumsum(rows, out=offsets[1:])
    writer.add("offsets", offsets)
    from ..plan.shards import row_histogram
    for name, values in zip(HISTOGRAM, row_histogram(rows), strict=True):
        writer.add(name, values)
    outside = digests.pop("paths_outside")
    return SideFacts(shards, table_digest(shards, [digests[name] for name in DIGESTED]),
                     outside)


class _Budget:
    """The decoded bytes a side file may still take."""

    def __init__(self, cap: int, where: str) -> None:
        self.left = cap
        self.cap = cap
        self.where = where

    def spend(self, nbytes: int, what: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise IndexFormatError(
                f"{self.where} would decode to more than {self.cap} bytes ({what}), over the "
                f"cap for a shard table stored in its size: it is damaged or hostile; "
                "rebuild the index")


def _check_columns(schema: pa.Schema, where: str) -> None:
    """Every column the table needs, of the type the library writes (checked before any
    column is decoded)."""
    names = set(schema.names)
    chunked = [name for name in CHUNKED if name in names]
    if chunked and len(chunked) != len(CHUNKED):
        raise IndexFormatError(f"{where} has the chunk columns {chunked}, not all of "
                               f"{list(CHUNKED)}: rebuild the index")
    for name in (*REQUIRED, *chunked):
        if name not in names:
            raise IndexFormatError(f"{where} is not a shard table with the columns "
                                   f"{list(REQUIRED)}: it has no column {name!r}")
        kind = schema.field(name).type
        if name in INTEGER_COLUMNS:
            fine = kind == pa.int64()
        else:
            fine = pa.types.is_dictionary(kind) and kind.index_type == pa.int32() and (
                kind.value_type in (pa.string(), pa.large_string()))
        if not fine:
            raise IndexFormatError(
                f"{where}: column {name!r} is of type {kind}, not the type streamcache "
                "writes (int64, or a string): rebuild the index")


def _read(parquet: Any, name: str, shards: int, where: str) -> pa.ChunkedArray:
    column = parquet.read(columns=[name], use_threads=False).column(name)
    if len(column) != shards:
        raise IndexFormatError(f"{where}: column {name!r} holds {len(column)} values, the "
                               f"file says {shards} shards")
    return column


def _decode_integers(parquet: Any, shards: int, where: str, writer: LayoutWriter,
                     ) -> dict[str, np.ndarray]:
    """Write the int64 columns; returns them (nulls as -1: "not recorded")."""
    import pyarrow.compute as pc

    chunked = "chunk_rows" in parquet.schema_arrow.names
    out = {}
    for name, nullable in INTEGER_COLUMNS.items():
        if name in CHUNKED and not chunked:
            out[name] = np.full(shards, UNKNOWN, dtype=np.int64)
        else:
            array = _read(parquet, name, shards, where).combine_chunks()
            if array.null_count and not nullable:
                raise IndexFormatError(f"{where}: column {name!r} has nulls")
            if len(array) and (pc.min(array).as_py() or 0) < 0:
                raise IndexFormatError(f"{where}: column {name!r} has a negative value; it "
                                       "must be an integer in [0, 2**63)")
            out[name] = np.array(numpy_values(array, fill=UNKNOWN))  # (a copy: array freed)
            del array
        writer.add(name, out[name])
    return out


def _decode_formats(parquet: Any, shards: int, where: str) -> np.ndarray:
    """The format code of every shard (uint8)."""
    codes = np.zeros(shards, dtype=np.uint8)
    done = 0
    for chunk in _read(parquet, "format", shards, where).chunks:
        if chunk.null_count:
            raise IndexFormatError(f"{where}: column 'format' has nulls")
        known = chunk.dictionary.to_pylist()
        unknown = sorted({str(v) for v in known if v not in SHARD_FORMATS})
        if unknown:
            raise IndexFormatError(f"{where}: unknown shard format(s) {unknown}")
        table = np.array([SHARD_FORMATS.index(v) for v in known], dtype=np.uint8)
        indices = numpy_values(chunk.indices)
        codes[done:done + len(chunk)] = table[indices] if table.size else 0
        done += len(chunk)
    return codes


def _decode_strings(parquet: Any, name: str, shards: int, where: str, writer: LayoutWriter,
                    budget: _Budget) -> dict[str, Any]:
    """Check, size and expand one dictionary-encoded string column, a row group at a time,
    writing it as it goes; returns what the table's checks need of it, read back once it
    is whole (its digest; for paths, how many leave the folder; for tail checksums, which
    are recorded)."""
    import pyarrow.compute as pc

    target, kind, nullable = STRING_COLUMNS[name]
    if name not in parquet.schema_arrow.names:  # the chunk columns of an unchunked table
        writer.add_strings(target, pa.nulls(shards, kind))
        return {"tail_valid": np.zeros(shards, bool)}
    count = 0
    with writer.strings(target) as column:
        for group in range(parquet.num_row_groups):
            read = parquet.read_row_group(group, columns=[name], use_threads=False)
            for chunk in read.column(name).chunks:
                if chunk.null_count and not nullable:
                    raise IndexFormatError(f"{where}: column {name!r} has nulls")
                values = chunk.dictionary
                values.validate(full=True)  # UTF-8, offsets
                _check_values(name, values, where)
                lengths = numpy_values(pc.binary_length(values).cast(pa.int64()), fill=0)
                indices = numpy_values(chunk.indices, fill=0)
                expanded = int(np.take(lengths, indices).sum()) if lengths.size else 0
                budget.spend(expanded + 9 * len(chunk), f"column {name!r}")
                if not chunk.null_count and len(values) == len(chunk) and np.array_equal(
                        indices, np.arange(len(chunk), dtype=indices.dtype)):
                    column.append(values)  # distinct values in order (paths): the values
                else:
                    column.append(chunk.dictionary_decode())
                count += len(chunk)
            del read
    if count != shards:
        raise IndexFormatError(f"{where}: column {name!r} holds {count} values, the file "
                               f"says {shards} shards")
    return _string_facts(writer, target, name, shards)


def _string_facts(writer: LayoutWriter, target: str, name: str, shards: int,
                  ) -> dict[str, Any]:
    """A written string column's digest, and what the paths and tail checksums tell."""
    from .shard_paths import count_outside
    width = np.int64 if STRING_COLUMNS[name][1] == pa.large_string() else np.int32
    offsets = np.frombuffer(writer.read(f"{target}.offsets"), width).astype(np.int64)
    data = np.frombuffer(writer.read(f"{target}.data"), np.uint8)
    valid = None
    if f"{target}.valid" in writer.columns:
        bits = np.frombuffer(writer.read(f"{target}.valid"), np.uint8)
        valid = np.unpackbits(bits, bitorder="little")[:shards].astype(bool)
    facts: dict[str, Any] = {}
    if target in DIGESTED:
        facts[target] = strings_digest_of(offsets, valid, data)
    if name == "path":
        facts["paths_outside"] = count_outside(pa.Array.from_buffers(
            pa.large_string(), shards, [None, pa.py_buffer(offsets), pa.py_buffer(data)]))
    if name == "tail_checksum":
        facts["tail_valid"] = np.ones(shards, bool) if valid is None else valid
    return facts


def _check_values(name: str, values: pa.Array, where: str) -> None:
    """The distinct values of a string column obey the rules of a JSON shard entry (on
    their bytes, vectorized: a regular expression over a million checksums takes a
    second)."""
    import pyarrow.compute as pc
    if not len(values):
        return
    values = values.drop_null() if values.null_count else values
    offsets, data = string_buffers(values)
    lengths = np.diff(offsets)
    if name == "path":
        if (lengths.min(initial=1) == 0 or contains(data, b"\0") or (
                lengths.max(initial=0) > MAX_PATH_CHARS
                and pc.max(pc.utf8_length(values)).as_py() > MAX_PATH_CHARS)):
            raise IndexFormatError(f"{where}: a shard path is empty, over {MAX_PATH_CHARS} "
                                   "characters, or holds a NUL")
    elif name in ("checksum", "tail_checksum"):
        width = len("xxh64:") + 16
        fine = bool((lengths == width).all())
        if fine and data.size:
            rows = data.reshape(-1, width)
            digits = rows[:, 6:]
            fine = bool((rows[:, :6] == np.frombuffer(b"xxh64:", np.uint8)).all()) and bool(
                (((digits >= ord("0")) & (digits <= ord("9")))
                 | ((digits >= ord("a")) & (digits <= ord("f")))).all())
        if not fine:
            raise IndexFormatError(f"{where}: a checksum is not 'xxh64:' and 16 hex digits")
    elif lengths.max(initial=0) > MAX_NAME_CHARS and \
            pc.max(pc.utf8_length(values)).as_py() > MAX_NAME_CHARS:
        raise IndexFormatError(f"{where}: a compression name is malformed")


__all__ = ["DECODED_FLOOR", "MAX_EXPANSION", "SideFacts", "decode_side_table", "decoded_cap"]
