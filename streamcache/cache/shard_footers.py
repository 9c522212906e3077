"""The footer of a shard read by range, and the chunks it points at, decoded and checked.

A chunked Arrow IPC shard's footer is its tail, one request of exactly the size the index
records, verified against the index's checksum; it lists each chunk's bytes and digest. A
Parquet file's footer is read with one tail request (two for a footer over
:data:`PARQUET_TAIL`) and lists its row groups' bytes (no digests: see docs/cache.md, "Range
reads"). A chunk decoded from the fetched pieces is checked against its row count, its
schema and, for Arrow shards, its digest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from ..errors import ChecksumMismatchError, SchemaError, ShardCorruptError
from ..format.checksum import verify_bytes
from ..format.chunks import Block, chunk_digest, read_footer_metadata, record_batch_blocks
from ..format.columns import to_canonical
from ..format.schema import Schema
from ..format.shard_entry import ShardInfo
from .byte_ranges import sparse_file

#: The first read of a Parquet footer (the tail of the file): one request for most footers.
PARQUET_TAIL = 64 << 10


class FetchRanges(Protocol):
    """Fetches byte ranges ``[start, end)`` of one shard, ``verify(blocks)`` raising a
    ChecksumMismatchError to fetch them again (the reader's Fetcher, counted)."""

    def __call__(self, ranges: list[tuple[int, int]], verify: Any = None) -> list[bytes]: ...


@dataclass
class Footer:
    """What a range read of one shard needs from its footer."""

    pieces: list[tuple[int, bytes]]  # the tail: (offset, bytes)
    starts: np.ndarray  # first row of each chunk / row group, and the total at the end
    blocks: list[Block]  # the byte range of each chunk / row group
    digests: list[str] | None = None  # chunk digests (chunked Arrow shards)
    whole: bool = False  # not addressable: read the whole object
    nbytes: int = field(default=0)


def arrow_footer(info: ShardInfo, url: str, schema: Schema, fetch: FetchRanges) -> Footer:
    """The verified footer of a chunked Arrow shard: one request for exactly its tail."""
    assert info.chunk_rows is not None and info.tail_bytes is not None
    start = info.bytes - info.tail_bytes

    def verify(blocks: list[bytes]) -> None:
        verify_bytes(blocks[0], info.tail_checksum, what=f"{url} (its footer)")

    tail = fetch([(start, info.bytes)], verify)[0]
    chunks = -(-info.rows // info.chunk_rows)
    try:
        blocks = record_batch_blocks(tail, info.bytes)
        if len(blocks) != chunks:
            raise ValueError(f"its footer lists {len(blocks)} record batches, the index "
                             f"says {chunks} chunks of {info.chunk_rows} rows")
        reader = ipc.open_file(sparse_file(info.bytes, [(start, tail)]))
        _check_schema(reader.schema, schema, url)
        digests = read_footer_metadata(reader.metadata, chunks=chunks,
                                       chunk_rows=info.chunk_rows, where=url)
    except (ValueError, pa.ArrowInvalid, OSError) as exc:
        raise ShardCorruptError(f"{url} is not the chunked shard its index describes "
                                f"({exc}): rebuild the index or rewrite the dataset") from exc
    starts = np.minimum(np.arange(chunks + 1, dtype=np.int64) * info.chunk_rows, info.rows)
    return Footer([(start, tail)], starts, blocks, digests, nbytes=len(tail))


def parquet_footer(info: ShardInfo, url: str, fetch: FetchRanges) -> Footer:
    """A Parquet file's footer and the byte range of each row group."""
    first = min(info.bytes, PARQUET_TAIL)
    tail = fetch([(info.bytes - first, info.bytes)])[0]
    pieces = [(info.bytes - first, tail)]
    try:
        if len(tail) < 8 or tail[-4:] != b"PAR1":
            raise ValueError("the object does not end like a Parquet file")
        length = int.from_bytes(tail[-8:-4], "little") + 8
        if length > info.bytes - 4:
            raise ValueError(f"the footer length {length} does not fit the object")
        if length > len(tail):  # one piece: pyarrow reads the footer in one go
            more = info.bytes - length
            head = fetch([(more, info.bytes - first)])[0]
            pieces = [(more, head + tail)]
        metadata = pq.ParquetFile(sparse_file(info.bytes, pieces)).metadata
    except (ValueError, pa.ArrowInvalid, OSError) as exc:
        raise ShardCorruptError(f"{url} is not a readable Parquet file ({exc}); it is "
                                "truncated, corrupt or was rewritten: rebuild the index"
                                ) from exc
    groups = [metadata.row_group(i) for i in range(metadata.num_row_groups)]
    counts = np.array([g.num_rows for g in groups], np.int64)
    if int(counts.sum()) != info.rows:
        raise ShardCorruptError(f"{url} holds {int(counts.sum())} rows but the index says "
                                f"{info.rows}; it was rewritten after indexing: rebuild "
                                "the index")
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    blocks = [_row_group_block(g, info.bytes) for g in groups]
    nbytes = sum(len(p) for _, p in pieces)
    return Footer(pieces, starts, blocks, whole=len(groups) <= 1, nbytes=nbytes)


def open_pieces(footer: Footer, size: int, pieces: list[tuple[int, bytes]], url: str) -> Any:
    """The fetched ``pieces`` of a ``size``-byte shard (its footer among them), opened as an
    Arrow IPC file (chunked Arrow shards) or a ParquetFile that checks page CRCs."""
    source = sparse_file(size, pieces)
    try:
        if footer.digests is None:
            return pq.ParquetFile(source, page_checksum_verification=True)
        # (chunks decoded one at a time on the caller's thread: the pool's hand-over of a
        # 64 KiB chunk's buffers costs more than decoding them, see materialize.py)
        return ipc.open_file(source, options=ipc.IpcReadOptions(use_threads=False))
    except (pa.ArrowInvalid, OSError) as exc:  # (the footer was read before)
        raise ShardCorruptError(f"{url}: its footer cannot be read again ({exc})") from exc


def decode_unit(file: Any, footer: Footer, unit: int, url: str, stored: Schema,
                schema: Schema, *, digest: bool = True) -> pa.RecordBatch:
    """Chunk ``unit`` from an open Arrow IPC file or ParquetFile (of the fields
    ``stored``), checked, as a batch of the fields ``schema``. ``digest=False``: a chunk of
    an object whose every byte was verified already (its checksum) is not hashed again."""
    expected = int(footer.starts[unit + 1] - footer.starts[unit])
    try:
        if footer.digests is not None:
            batch = file.get_batch(unit)
        else:
            table = file.read_row_group(unit, columns=schema.names)
            batch = table.combine_chunks().to_batches()[0] if table.num_rows else None
    except (pa.ArrowInvalid, OSError) as exc:
        raise ChecksumMismatchError(f"{url}: chunk {unit} cannot be decoded ({exc}); the "
                                    "bytes are corrupt or the object was rewritten") from exc
    rows = 0 if batch is None else batch.num_rows
    if rows != expected:
        raise ShardCorruptError(f"{url}: chunk {unit} holds {rows} rows, its footer "
                                f"says {expected}: rebuild the index")
    if batch is None:
        return empty_batch(schema)
    columns = [to_canonical(f, batch.column(f.name), where=url) for f in stored
               if footer.digests is not None or f.name in schema.names]
    if footer.digests is not None:
        full = pa.RecordBatch.from_arrays(columns, schema=stored.arrow_schema())
        if digest and chunk_digest(full, stored) != footer.digests[unit]:
            raise ChecksumMismatchError(
                f"{url}: chunk {unit} does not match its digest in the footer; the bytes "
                "are corrupt or the object was rewritten after indexing")
        columns = [full.column(f.name) for f in schema]
    return pa.RecordBatch.from_arrays(columns, schema=schema.arrow_schema())


def _row_group_block(group: Any, file_size: int) -> Block:
    """The bytes of one Parquet row group: from its first column chunk's first page to its
    last column chunk's end."""
    starts, ends = [], []
    for j in range(group.num_columns):
        column = group.column(j)
        first = column.data_page_offset
        if column.dictionary_page_offset is not None and column.dictionary_page_offset > 0:
            first = min(first, column.dictionary_page_offset)
        starts.append(first)
        ends.append(first + column.total_compressed_size)
    start, end = min(starts), max(ends)
    if not 4 <= start < end <= file_size:
        raise ShardCorruptError(f"a row group spans bytes [{start}, {end}) of a "
                                f"{file_size}-byte file")
    return Block(start, end - start)


def _check_schema(actual: pa.Schema, expected: Schema, url: str) -> None:
    for f in expected:
        index = actual.get_field_index(f.name)
        if index < 0 or not actual.field(index).type.equals(f.arrow_type()):
            raise SchemaError(f"{url}: column {f.name!r} is missing or not of type "
                              f"{f.arrow_type()}; the shard is not the one indexed")


def empty_batch(schema: Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], type=f.arrow_type()) for f in schema],
                                      schema=schema.arrow_schema())

