"""One shard's bytes, as :class:`~.writer.ShardWriter` stores them.

A record batch is written as an Arrow IPC file of chunks of a fixed row count (about
``chunk_size`` bytes each) with the digest of each chunk in the footer (chunks.py), compressed
only where the codec pays (codec_choice.py). :meth:`ShardEncoder.store_local` encodes straight
into a temporary file beside the destination, checksums it, fsyncs and renames it into place;
:meth:`ShardEncoder.to_bytes` encodes into memory for a remote store. Each returns what the
index records of the shard: size, checksum, the file's tail (footer) and the compression it
was stored with.

Thread safety: an encoder holds only settings; any thread may call it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from ..remote import storage
from .checksum import checksum_bytes, checksum_file
from .chunks import chunk_digest, chunk_rows_for, footer_metadata, tail_size
from .codec_choice import PLAIN, compression_pays
from .schema import Schema


@dataclass(frozen=True)
class ShardEncoder:
    """How shards are encoded: chunk size, codec and when it pays."""

    chunk_size: int
    compression: str | None
    options: ipc.IpcWriteOptions
    min_savings: float

    def store_local(self, path: str, batch: pa.RecordBatch,
                    schema: Schema) -> tuple[int, str, bytes, str | None]:
        """Write ``batch`` as the shard file ``path`` (temporary file, checksum, fsync,
        rename); returns (bytes, checksum, the file's tail, the compression it has)."""
        with storage.atomic_path(path) as temp:
            with pa.OSFile(temp, "wb") as sink:
                compression = self.encode(sink, batch, schema)
            checksum = checksum_file(temp)
            size = os.path.getsize(temp)
            with open(temp, "rb") as file:
                file.seek(max(0, size - 10))
                footer = int.from_bytes(file.read(4), "little")  # (then the magic)
                file.seek(max(0, size - 10 - footer))
                tail = file.read()
            tail_size(tail, size)  # it is the end of an Arrow IPC file
        return size, checksum, tail, compression

    def to_bytes(self, batch: pa.RecordBatch,
                 schema: Schema) -> tuple[bytes, int, str, bytes, str | None]:
        """``batch`` as a shard's bytes in memory: (bytes, size, checksum, tail,
        compression)."""
        stream = pa.BufferOutputStream()
        compression = self.encode(stream, batch, schema)
        data = stream.getvalue()
        tail = data[data.size - tail_size(data, data.size):].to_pybytes()
        return data.to_pybytes(), data.size, checksum_bytes(data), tail, compression

    def encode(self, sink: Any, batch: pa.RecordBatch, schema: Schema) -> str | None:
        """Write ``batch`` into ``sink`` as chunks of a fixed row count, their digests in the
        footer; returns the compression the shard was stored with."""
        rows = chunk_rows_for(batch.num_rows, batch.nbytes, self.chunk_size)
        chunks = [batch.slice(start, rows) for start in range(0, batch.num_rows, rows)]
        metadata = footer_metadata(rows, [chunk_digest(c, schema) for c in chunks])
        compression = self.compression if compression_pays(
            chunks, self.compression and self.options, self.min_savings) else None
        options = self.options if compression else PLAIN
        with ipc.new_file(sink, batch.schema, options=options, metadata=metadata) as writer:
            for chunk in chunks:
                writer.write_batch(chunk)
        return compression
