"""From a stored shard to the local layout the reader maps: uncompressed, canonical Arrow IPC.

A stored shard (zstd-compressed Arrow IPC, an Arrow IPC stream such as Hugging Face
``save_to_disk`` writes, or a Parquet file written by anyone) is decoded
once, on install, into an Arrow IPC file with one record batch, no compression and the
canonical type of every field. Reads after that are memcpy from a memory map. A local file
that is already in that layout is read in place (:func:`is_local_layout`).

A chunked Arrow shard of canonical fields (``ShardWriter``'s) is installed one chunk at a time
into that layout (chunk_install.py: no shard-sized allocation, the same file). Arrow IPC is
decoded on the installing thread (``use_threads=False``): a prefetcher runs several installs
at once, and their chunks' buffers handed to pyarrow's CPU pool (as many threads as cores)
contended for it. Three 64 MB zstd token shards at once, 2 cores, fresh processes: decoded
whole with the pool 0.55-1.5 s, without it 0.16-0.22 s in one run and 0.65-1.1 s in another
(fresh memory's page faults vary here), chunk by chunk 0.27-0.38 s in both. One batch is
kept rather than the chunks as stored: a 1,024-chunk shard took 14-145 ms to open against
0.5-5 ms (in every process and every new reader), and a 256-row gather from it 64 us against
27 us (21 us locating the rows' chunks); an epoch of a fresh loader over 3 such shards ran
at 0.62x.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from ..errors import SchemaError, ShardCorruptError
from ..remote import storage
from .chunk_install import ONE_THREAD, check_rows, install_chunks, unreadable
from .columns import to_canonical
from .schema import Schema


def decode_shard(data: Any, fmt: str, schema: Schema, *, where: str,
                 expected_rows: int | None = None) -> pa.RecordBatch:
    """Decode a stored shard (bytes-like or a local path) into one canonical record batch.

    Raises:
        ShardCorruptError: the bytes are not a readable shard of that format, or hold another
            number of rows than the index says.
        SchemaError: a column is missing, null or of a type that cannot be cast.
    """
    source = pa.BufferReader(data) if not isinstance(data, str) else data
    try:
        if fmt == "parquet":  # a missing column is a schema error, not a corrupt file
            with pq.ParquetFile(source) as parquet:
                _require_columns(schema, parquet.schema_arrow.names, where)
                table = parquet.read(columns=schema.names)
        elif fmt == "arrow_stream":  # footer-less (e.g. Hugging Face save_to_disk)
            with pa.OSFile(source) if isinstance(source, str) else source as stream:
                table = ipc.open_stream(stream, options=ONE_THREAD).read_all()
        else:  # (on this thread: see the module's docstring)
            table = ipc.open_file(source, options=ONE_THREAD).read_all()
        # offsets in order and inside their values, strings UTF-8: what the casts below and
        # the reader of the installed copy rely on; the names decoded inside this check
        table.validate(full=True)
        if len(set(table.column_names)) != table.num_columns:
            raise ShardCorruptError(f"{where} names a column twice")
    except SchemaError:
        raise
    except pa.ArrowKeyError as exc:
        raise SchemaError(f"{where}: {exc}") from exc
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise unreadable(where, fmt, exc) from exc
    check_rows(table.num_rows, expected_rows, where)
    _require_columns(schema, table.column_names, where)
    columns = [to_canonical(f, table.column(f.name), where=where) for f in schema]
    return pa.RecordBatch.from_arrays(columns, schema=schema.arrow_schema())


def _require_columns(schema: Schema, names: list[str], where: str) -> None:
    missing = [n for n in schema.names if n not in names]
    if missing:
        raise SchemaError(f"{where} lacks the columns {missing}")


#: The schema metadata key of an installed copy that records what it is a copy of (a cache
#: entry's identity, e.g. a unit of a layout): a reader that expects another refuses it.
COPY_OF_KEY = b"streamcache.copy_of"


def write_local_layout(batch: pa.RecordBatch, path: str, *, durable: bool = False,
                       copy_of: str | None = None) -> int:
    """Write ``batch`` as an uncompressed one-batch Arrow IPC file, published by rename.

    ``copy_of`` (when given) is recorded in the file's schema metadata (:data:`COPY_OF_KEY`),
    so that the file cannot be served as another entry's (``ShardReader(copy_of=...)``).

    Returns the file's size. A crash leaves at most a temporary file (named ``.tmp-*``), never
    a partial file under ``path``.
    """
    if copy_of is not None:
        batch = batch.replace_schema_metadata(_stamped(batch.schema, copy_of).metadata)
    with storage.atomic_path(path, durable=durable) as temp:
        with open(temp, "wb") as raw, ipc.new_file(raw, batch.schema) as writer:
            writer.write_batch(batch)
        size = os.path.getsize(temp)
    return size


def materialize(data: Any, fmt: str, schema: Schema, path: str, *, where: str,
                expected_rows: int | None = None, durable: bool = False,
                copy_of: str | None = None) -> int:
    """Decode a stored shard and install it at ``path`` in the local layout (recording
    ``copy_of``, see :func:`write_local_layout`); returns bytes. A chunked Arrow shard of
    canonical fields is installed chunk by chunk (chunk_install.py), anything else decoded
    whole."""
    if fmt == "arrow":
        stamped = schema.arrow_schema()
        if copy_of is not None:
            stamped = _stamped(stamped, copy_of)
        size = install_chunks(data, schema, path, stamped, where=where,
                              expected_rows=expected_rows, durable=durable)
        if size is not None:
            return size
    batch = decode_shard(data, fmt, schema, where=where, expected_rows=expected_rows)
    return write_local_layout(batch, path, durable=durable, copy_of=copy_of)


def _stamped(schema: pa.Schema, copy_of: str) -> pa.Schema:
    """``schema`` recording that its file is a copy of ``copy_of`` (:data:`COPY_OF_KEY`)."""
    metadata = dict(schema.metadata or {})
    metadata[COPY_OF_KEY] = copy_of.encode()
    return schema.with_metadata(metadata)


def recorded_copy_of(path: str) -> str | None:
    """What a local-layout file records it is a copy of (:data:`COPY_OF_KEY`), or None.

    Raises:
        OSError, pyarrow.ArrowException: the file cannot be read as Arrow IPC.
    """
    with pa.memory_map(path, "r") as mm:
        metadata = ipc.open_file(mm).schema.metadata or {}
    value = metadata.get(COPY_OF_KEY)
    return None if value is None else value.decode("utf-8", "replace")


def restamp(path: str, copy_of: str, *, durable: bool = False) -> None:
    """Make the local-layout file ``path`` record ``copy_of``: rewritten once if it records
    nothing or something else, left as it is if it records ``copy_of`` already."""
    if recorded_copy_of(path) == copy_of:
        return
    with pa.memory_map(path, "r") as mm:
        reader = ipc.open_file(mm)
        stamped = _stamped(reader.schema, copy_of)
        with storage.atomic_path(path, durable=durable) as temp, open(temp, "wb") as raw, \
                ipc.new_file(raw, stamped) as writer:
            for i in range(reader.num_record_batches):  # every batch (chunks included)
                writer.write_batch(reader.get_batch(i).replace_schema_metadata(
                    stamped.metadata))


def is_local_layout(path: str, schema: Schema) -> bool:
    """Whether a local file can be memory-mapped as it is (and need not be materialized):
    uncompressed Arrow IPC whose record batches (one, or chunks as ``ShardWriter`` writes
    them with ``compression=None``) hold every field in its canonical type without nulls,
    every buffer inside the file's mapping.

    The schema and the first record batch decide: a writer compresses every batch of a file
    or none, and a file that mixes them would still be read right (``ShardReader`` reads
    whatever each batch holds; a compressed one is decoded into memory), so reading the other
    ~1,000 batches' headers here (from disk, on a first run) would buy nothing.
    """
    if not path.endswith((".arrow", ".feather", ".ipc")):
        return False
    return is_mappable_arrow(path, schema)


def is_mappable_arrow(path: str, schema: Schema) -> bool:
    """:func:`is_local_layout` without the file name's extension: for a file known to hold
    Arrow IPC whatever its name (a download in the cache's temporaries)."""
    try:
        with pa.memory_map(path, "r") as mm:
            reader = ipc.open_file(mm)
            if reader.num_record_batches == 0:
                return True
            base = _base_address(mm)
            return _mappable(reader.get_batch(0), schema, base, base + mm.size())
    except (pa.ArrowException, OSError):  # any damage: not mapped; installing verifies it
        return False


def _mappable(batch: pa.RecordBatch, schema: Schema, base: int, end: int) -> bool:
    """Whether every field of ``batch`` is canonical, null-free and inside [base, end)."""
    for f in schema:
        if f.name not in batch.schema.names:
            return False
        column = batch.column(f.name)
        if not column.type.equals(f.arrow_type()) or column.null_count:
            return False
        if not all(b is None or base <= b.address < end for b in column.buffers()):
            return False  # decompressed into memory: not mappable as it is
    return True


def _base_address(mm: pa.MemoryMappedFile) -> int:
    mm.seek(0)
    address = int(mm.read_buffer(1).address)
    mm.seek(0)
    return address
