"""Chunked shards: an Arrow IPC file of several record batches that a reader can address.

:class:`~streamcache.format.writer.ShardWriter` cuts every shard into chunks (record batches)
of ``chunk_rows`` rows each (the last one shorter), about ``chunk_size`` bytes each, so a
reader that needs a few rows of a remote shard fetches its footer and only the chunks that
hold them (cache/ranges.py), not the whole object. The layout on the wire is plain Arrow IPC:
every Arrow reader reads these files.

What the chunks carry for a range reader:

- the index records ``chunk_rows`` (row r is in chunk ``r // chunk_rows``) and the size and
  checksum of the file's tail (:func:`tail_size`: the footer, its length and the magic), so
  the footer is read in one request and verified against the index;
- the footer's custom metadata (:data:`FOOTER_KEY`) holds a digest of every chunk's content
  (:func:`chunk_digest`, over the decoded canonical buffers), so a chunk read alone is
  verified too: a corrupt, truncated or substituted chunk is an error, never wrong rows.

:func:`record_batch_blocks` reads the byte ranges of the record batches from a footer (a
small flatbuffer walk: pyarrow does not expose them).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .checksum import checksum_bytes
from .columns import column_buffers
from .schema import Schema

#: Default target bytes of one chunk (uncompressed). Measured on 1 KB token samples with zstd
#: (docs/cache.md, "Chunked shards"): stored bytes grow by 18% at 8 KiB, 5% at 32 KiB, 3.1% at
#: 64 KiB and 2.1% at 128 KiB over one batch per shard; a 64 KiB chunk is ~24 KiB on the wire,
#: one request's worth on an object store. A sample of 64 KiB or more is a chunk of its own.
DEFAULT_CHUNK_SIZE = 64 << 10
#: The key of the footer metadata that describes the chunks (a JSON document).
FOOTER_KEY = b"streamcache.chunks"
CHUNKS_VERSION = 1
_MAGIC = b"ARROW1"
_BLOCK = struct.Struct("<qi4xq")  # Block { offset: long; metaDataLength: int; bodyLength: long }
_RECORD_BATCHES_FIELD = 3  # Footer { version; schema; dictionaries; recordBatches; metadata }


@dataclass(frozen=True)
class Block:
    """One record batch's bytes in the file: ``[offset, offset + length)``."""

    offset: int
    length: int


def chunk_rows_for(num_rows: int, nbytes: int, chunk_size: int) -> int:
    """Rows per chunk for a shard of ``num_rows`` rows and ``nbytes`` bytes: as many as fit in
    ``chunk_size`` bytes on average, at least one."""
    if num_rows <= 0:
        return 1
    per_row = max(1.0, nbytes / num_rows)
    return int(min(num_rows, max(1, chunk_size // per_row)))


def chunk_digest(batch: pa.RecordBatch, schema: Schema) -> str:
    """A checksum of one chunk's content: every field's canonical buffers of those rows
    (packed rows; or offsets counted from the chunk's first row and the values they span).

    The same rows give the same digest however they are sliced, compressed or decoded.
    """
    parts = []
    for field in schema:
        view = column_buffers(field, batch.column(field.name))
        if view.offsets is None:
            parts.append(checksum_bytes(view.data))
            continue
        offsets = view.offsets - view.offsets[0]
        scale = field.elem_size
        data = view.data[int(view.offsets[0]) * scale:int(view.offsets[-1]) * scale]
        parts.append(checksum_bytes(offsets) + checksum_bytes(data))
    return checksum_bytes("".join(parts).encode())


def footer_metadata(chunk_rows: int, digests: Sequence[str]) -> dict[bytes, bytes]:
    """The footer metadata a chunked shard is written with."""
    document = {"version": CHUNKS_VERSION, "chunk_rows": chunk_rows,
                "digests": "".join(d.partition(":")[2] for d in digests)}
    return {FOOTER_KEY: json.dumps(document).encode()}


def read_footer_metadata(metadata: dict[bytes, bytes] | None, *, chunks: int, chunk_rows: int,
                         where: str) -> list[str]:
    """The chunk digests of a footer's metadata, checked against what the index says.

    Raises:
        ValueError: the metadata is missing, malformed, or disagrees with the index.
    """
    raw = (metadata or {}).get(FOOTER_KEY)
    if raw is None:
        raise ValueError(f"{where} has no chunk description in its footer")
    document = json.loads(raw)
    digests = document.get("digests") if isinstance(document, dict) else None
    if (not isinstance(document, dict) or document.get("version") != CHUNKS_VERSION
            or document.get("chunk_rows") != chunk_rows or not isinstance(digests, str)
            or len(digests) != 16 * chunks):
        raise ValueError(f"{where}: the footer's chunk description does not match the index "
                         f"({chunks} chunks of {chunk_rows} rows)")
    return [f"xxh64:{digests[16 * i:16 * i + 16]}" for i in range(chunks)]


def tail_size(data: bytes | memoryview, file_size: int) -> int:
    """The bytes of an Arrow IPC file's tail (footer, its int32 length, the magic), read from
    the file's last 10 bytes. Raises ValueError if they are not an Arrow IPC file's end."""
    if len(data) < 10 or bytes(data[-6:]) != _MAGIC:
        raise ValueError("the object does not end like an Arrow IPC file")
    footer = int.from_bytes(bytes(data[-10:-6]), "little", signed=True)
    if footer <= 0 or footer + 10 > file_size - 8:
        raise ValueError(f"the footer length {footer} does not fit the object")
    return footer + 10


def record_batch_blocks(tail: bytes | memoryview, file_size: int) -> list[Block]:
    """The record batches' byte ranges, from an Arrow IPC file's tail (see :func:`tail_size`).

    The footer is untrusted: every offset is checked against the tail before it is followed,
    and every block must lie between the leading magic and the footer.

    Raises:
        ValueError: the footer is malformed, or a block does not fit the file.
    """
    footer = memoryview(bytes(tail[:-10]))
    end = file_size - len(tail)

    def u32(at: int) -> int:
        if not 0 <= at <= len(footer) - 4:
            raise ValueError("the footer refers outside itself")
        return int.from_bytes(footer[at:at + 4], "little")

    table = u32(0)
    vtable = table - int.from_bytes(footer[table:table + 4], "little", signed=True)
    vtable_len = u32(vtable) & 0xFFFF
    slot = 4 + 2 * _RECORD_BATCHES_FIELD
    if vtable_len < slot + 2:
        return []
    field = u32(vtable + slot) & 0xFFFF
    if field == 0:
        return []
    vector = table + field + u32(table + field)
    count = u32(vector)
    if count * _BLOCK.size > len(footer) - vector - 4:
        raise ValueError("the footer's record batch list does not fit it")
    blocks = []
    for i in range(count):
        offset, meta, body = _BLOCK.unpack_from(footer, vector + 4 + i * _BLOCK.size)
        if offset < 8 or meta <= 0 or body < 0 or offset + meta + body > end:
            raise ValueError(f"record batch {i} ({offset}, {meta}, {body}) lies outside "
                             "the file's data")
        blocks.append(Block(offset, meta + body))
    return blocks


def rows_to_chunks(rows: np.ndarray, chunk_rows: int) -> np.ndarray:
    """The chunk of each row."""
    return np.asarray(rows, dtype=np.int64) // chunk_rows


__all__ = ["DEFAULT_CHUNK_SIZE", "FOOTER_KEY", "Block", "chunk_digest", "chunk_rows_for",
           "footer_metadata", "read_footer_metadata", "record_batch_blocks", "rows_to_chunks",
           "tail_size"]
