"""Install a chunked Arrow shard into the one-batch local layout, one chunk at a time.

A shard ``ShardWriter`` wrote (zstd chunks of ~64 KiB, every field in its canonical type) was
installed by decoding it whole (a table of ~1,000 chunks), combining every column into one
array and handing that to the IPC writer: three fresh shard-sized allocations in a process
that just started. Their page faults (and pyarrow's CPU pool, see materialize.py), not zstd,
were the cost: in a cold start's install of three 64 MB token shards at once, one decode took
0.10 s of CPU and the two beside it 0.38 s each; the combine and the write added 0.2-0.3 s
more each.

Here no shard-sized memory is allocated: the one-batch file is first written with the right
layout and zeros where the values go (the zeros are pages the kernel never allocates), then
each chunk is decoded on this thread into memory the pool reuses and written at its place in
the file with ``pwrite``. The file is byte for byte the one the whole decode writes. Fields
of variable length need their offsets before the layout is known, so their shards are
decoded twice (once for the offsets and the checks, once for the values): cheaper than the
allocations (a 64 MB shard of 1,024 zstd chunks decodes in ~0.06 s on one thread).

The source is immutable bytes or this process's own download, verified against the index's
checksum before this reads it (as the whole decode's source always was). A file rewritten
between the two reads anyway is refused where that moves a chunk (it fails to decode) or
changes a column's values' length; a rewrite that keeps both would put the new values under
the old offsets, so a source that others may write must not come here.

Every chunk is checked as the whole decode checks its table: offsets in order and inside
their values and strings UTF-8 (``validate(full=True)``), no nulls, the row count against the
index; a file that needs more (a field to cast, a name twice, one batch) is left to the whole
decode (:func:`install_chunks` returns None).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ..errors import SchemaError, ShardCorruptError
from ..remote import storage
from .columns import column_buffers
from .schema import Field, Schema

#: Arrow IPC read options of an install: decoded on the installing thread (a prefetcher runs
#: several installs at once; each handing its chunks' buffers to pyarrow's CPU pool cost more
#: than decoding them: see materialize.py)
ONE_THREAD = ipc.IpcReadOptions(use_threads=False)


def _variable(field: Field) -> bool:
    arrow = field.arrow_type()  # (a sequence of a dtype Arrow lacks is raw bytes)
    return (pa.types.is_large_list(arrow) or pa.types.is_large_binary(arrow)
            or pa.types.is_large_string(arrow))


def _unit(field: Field) -> int:
    """Bytes per value of a field's last buffer (per row for fixed widths; per element of a
    variable one)."""
    return field.elem_size if _variable(field) else field.row_bytes


def install_chunks(data: Any, schema: Schema, path: str, out_schema: pa.Schema, *,
                   where: str, expected_rows: int | None, durable: bool) -> int | None:
    """Write the shard ``data`` (bytes-like or a local path) to ``path`` as one uncompressed
    batch of ``out_schema`` (the canonical schema, stamped as the caller wants); returns the
    file's size, or None where the file is not a chunked shard of canonical fields.

    Raises:
        ShardCorruptError: a chunk cannot be decoded or fails its checks, or the rows are not
            the index's.
        SchemaError: a field holds nulls.
    """
    source = pa.BufferReader(data) if not isinstance(data, str) else data
    try:
        reader = ipc.open_file(source, options=ONE_THREAD)
        names = reader.schema.names
        if reader.num_record_batches < 2 or len(set(names)) != len(names) or not all(
                f.name in names and reader.schema.field(f.name).type.equals(f.arrow_type())
                for f in schema):
            return None
        fields = list(schema)
        chunks = reader.num_record_batches
        if expected_rows is None or any(_variable(f) for f in fields):
            rows, offsets = _scan(reader, fields, where)
            check_rows(rows, expected_rows, where)
        else:  # fixed widths and a known row count: one pass, checked as it goes
            rows, offsets = expected_rows, {}
        with storage.atomic_path(path, durable=durable) as temp:
            places = _write_layout(temp, out_schema, fields, rows, offsets)
            written = dict.fromkeys(places, 0)
            seen = 0
            fd = os.open(temp, os.O_WRONLY)
            try:
                for chunk in _checked_chunks(reader, chunks, fields, where):
                    seen += chunk.num_rows
                    if seen > rows:
                        continue  # more rows than the index says: counted, refused below
                    for f in fields:
                        piece = _values(chunk.column(f.name), f)
                        if piece.size:
                            os.pwrite(fd, piece.data, places[f.name] + written[f.name])
                            written[f.name] += piece.size
            finally:
                os.close(fd)
            check_rows(seen, rows, where)
            for f in fields:  # (the offsets said so: a chunk that disagreed was refused)
                expected = (int(offsets[f.name][-1]) if f.name in offsets else rows) * _unit(f)
                if written[f.name] != expected:
                    raise ShardCorruptError(f"{where}: column {f.name!r} changed between two "
                                            "reads of the same bytes; re-fetch it")
            return os.path.getsize(temp)
    except (SchemaError, ShardCorruptError):
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise unreadable(where, "arrow", exc) from exc


def _checked_chunks(reader: Any, chunks: int, fields: list[Field],
                    where: str) -> Iterator[pa.RecordBatch]:
    """Each chunk decoded and checked: no nulls, offsets and strings in full."""
    for i in range(chunks):
        chunk = reader.get_batch(i)
        for f in fields:
            column = chunk.column(f.name)
            if column.null_count:
                raise SchemaError(
                    f"{where}: column {f.name!r} holds {column.null_count} nulls; streamcache "
                    "fields cannot be null (fill or drop them before indexing)")
            column.validate(full=True)
        yield chunk


def _scan(reader: Any, fields: list[Field], where: str) -> tuple[int, dict[str, np.ndarray]]:
    """The first pass: the rows, and each variable field's offsets over the whole shard."""
    parts: dict[str, list[np.ndarray]] = {
        f.name: [np.zeros(1, dtype=np.int64)] for f in fields if _variable(f)}
    ends = dict.fromkeys(parts, 0)
    rows = 0
    for chunk in _checked_chunks(reader, reader.num_record_batches, fields, where):
        rows += chunk.num_rows
        for f in fields:
            if f.name not in parts:
                continue
            own = column_buffers(f, chunk.column(f.name)).offsets
            assert own is not None  # (a variable field)
            parts[f.name].append(own[1:] - own[0] + ends[f.name])
            ends[f.name] += int(own[-1] - own[0])
    return rows, {name: np.concatenate(p) for name, p in parts.items()}


def _values(column: pa.Array, field: Field) -> np.ndarray:
    """The bytes a chunk's column adds to the installed file's values buffer (its views as
    the reader takes them: columns.column_buffers)."""
    views = column_buffers(field, column)
    if views.offsets is None:
        return views.data
    first, last = int(views.offsets[0]), int(views.offsets[-1])
    return views.data[first * field.elem_size:last * field.elem_size]


def _write_layout(temp: str, out_schema: pa.Schema, fields: list[Field], rows: int,
                  offsets: dict[str, np.ndarray]) -> dict[str, int]:
    """Write the one-batch file with zeros for its values (np.zeros: pages the kernel maps to
    its zero page, never allocated) and return where each field's values start in it."""
    columns = []
    for f in fields:
        arrow = f.arrow_type()
        if _variable(f):
            count = int(offsets[f.name][-1])
            values = pa.py_buffer(np.zeros(count * _unit(f), dtype=np.uint8))
            index = pa.py_buffer(offsets[f.name])
            if pa.types.is_large_list(arrow):
                child = pa.Array.from_buffers(arrow.value_type, count, [None, values])
                columns.append(pa.Array.from_buffers(arrow, rows, [None, index],
                                                     children=[child]))
            else:
                columns.append(pa.Array.from_buffers(arrow, rows, [None, index, values]))
        elif pa.types.is_fixed_size_list(arrow):
            count = rows * arrow.list_size
            values = pa.py_buffer(np.zeros(rows * f.row_bytes, dtype=np.uint8))
            child = pa.Array.from_buffers(arrow.value_type, count, [None, values])
            columns.append(pa.Array.from_buffers(arrow, rows, [None], children=[child]))
        else:
            values = pa.py_buffer(np.zeros(rows * f.row_bytes, dtype=np.uint8))
            columns.append(pa.Array.from_buffers(arrow, rows, [None, values]))
    batch = pa.RecordBatch.from_arrays(columns, schema=out_schema)
    with open(temp, "wb") as raw, ipc.new_file(raw, out_schema) as writer:
        writer.write_batch(batch)
    with pa.memory_map(temp, "r") as mm:
        mm.seek(0)
        base = mm.read_buffer(1).address
        written = ipc.open_file(mm).get_batch(0)
        places = {}
        for f in fields:  # (an empty buffer may lie outside the map: nothing goes there)
            last = written.column(f.name).buffers()[-1]
            places[f.name] = 0 if last is None or not last.size else int(last.address - base)
    return places


def unreadable(where: str, fmt: str, exc: Exception) -> ShardCorruptError:
    """The error of a shard pyarrow cannot read (any pyarrow error: a flipped bit may read as
    an unknown type or a huge length)."""
    return ShardCorruptError(
        f"{where} is not a readable {fmt} shard ({type(exc).__name__}: {exc}); it is "
        "truncated or corrupt: re-fetch it, or rewrite it and rebuild the index")


def check_rows(rows: int, expected_rows: int | None, where: str) -> None:
    """Refuse a shard whose rows are not the index's."""
    if expected_rows is not None and rows != expected_rows:
        raise ShardCorruptError(
            f"{where} holds {rows} rows but the index says {expected_rows}; the "
            "shard was rewritten after indexing: rebuild the index")
