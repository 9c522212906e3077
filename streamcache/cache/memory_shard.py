"""Rows of a shard held in memory (read by range, or a whole object decoded), served to the
native gather like a mapped shard (cache/ranges.py makes them)."""

from __future__ import annotations

import pyarrow as pa

from ..format.columns import column_buffers
from ..format.reader import ShardReader
from ..format.schema import Schema


class MemoryShard(ShardReader):
    """Rows of a shard decoded into memory, readable by the native gather like a mapped one.

    Thread safety: read-only after construction.
    """

    def __init__(self, batch: pa.RecordBatch, schema: Schema, *, where: str) -> None:
        # (not ShardReader's constructor: nothing is mapped; the gather needs only buffers)
        self.path = where
        self.schema = schema
        self.num_rows = batch.num_rows
        self._batch = batch
        self._buffers = {f.name: column_buffers(f, batch.column(f.name)) for f in schema}

    @property
    def batch(self) -> pa.RecordBatch:
        """The rows held, as one record batch of the canonical types (verified: every chunk
        it came from matched its digest, or the whole object its checksum). Read-only."""
        return self._batch

    def close(self) -> None:
        self._buffers.clear()


__all__ = ["MemoryShard"]
