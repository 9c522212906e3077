"""A chunked shard read where it lies, each chunk parsed when a read first needs it.

A local uncompressed shard holds many record batches (``ShardWriter(compression=None)`` cuts
one about every 64 KiB: a 64 MB shard of 100 KB rows holds 672). Opened eagerly, each batch is
parsed, checked and viewed before the first row can be read: 12 ms a shard here, so 0.35 s
before the first batch of a 1 GB dataset of 16 such shards, paid again by every process that
opens them (a resumed job, a DataLoader worker). Where the index gives the chunk layout (row
``r`` is in chunk ``r // chunk_rows``) and the file holds that many batches, the reader reads
only the file's footer at open; a chunk is parsed, checked whole (as an eager open checks
every batch) and viewed the first time a gather needs one of its rows, and the native
columns' placeholder for it (no rows: a gather that reached it would be refused, never
wrong) is replaced.

What an eager open refuses at open (a batch that does not parse, offsets outside their
values, a null, a chunk of another row count than the index says) is refused here when the
chunk is first read, with the same :class:`~streamcache.errors.ShardCorruptError`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from .. import _native
from ..errors import SchemaError, ShardCorruptError
from .columns import ColumnBuffers, chunk_buffers
from .schema import Schema

_NO_BYTES = np.empty(0, dtype=np.uint8)
_NO_ROWS = np.zeros(1, dtype=np.int64)  # the offsets of a chunk of no rows


def corrupt_shard_error(path: str, exc: BaseException) -> ShardCorruptError:
    """The error for a local shard that cannot be read (``exc`` says why)."""
    return ShardCorruptError(
        f"{path} is not a readable local shard ({type(exc).__name__}: {exc}); it is "
        "truncated or corrupt: delete it so that it is fetched again")


def chunk_layout(num_rows: int, chunk_rows: int | None, batches: int) -> list[int] | None:
    """Each chunk's rows where the index's layout (``chunk_rows``) matches the file's
    ``batches`` record batches; None where it does not (the file is read eagerly, which
    checks every batch's rows itself)."""
    if not chunk_rows or chunk_rows <= 0 or num_rows <= 0 or batches <= 1:
        return None
    if -(-num_rows // chunk_rows) != batches:
        return None
    return [chunk_rows] * (batches - 1) + [num_rows - chunk_rows * (batches - 1)]


class ChunkTable:
    """Where each chunk of a shard of several record batches starts (``count`` of them).
    ``fixed_rows``: the rows of every chunk but the last when they are all equal and the last
    is not longer (how ShardWriter cuts), else 0 (found by binary search).

    Thread safety: immutable.
    """

    def __init__(self, rows: list[int]) -> None:
        self.count = len(rows)
        self.starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(rows, out=self.starts[1:])
        first = rows[0]
        uniform = first > 0 and all(r == first for r in rows[:-1]) and rows[-1] <= first
        self.fixed_rows = first if uniform else 0

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """The chunk of each row (rows inside the shard)."""
        if self.fixed_rows:
            return rows // self.fixed_rows
        return np.searchsorted(self.starts, rows, side="right") - 1


class LazyChunks:
    """The chunks of one shard, viewed as reads first need them.

    Args:
        path: the file (for errors).
        reader: its Arrow IPC file reader (only the footer has been read).
        schema: the fields read; the file's schema is checked against them here.
        rows: each chunk's row count (:func:`chunk_layout`).

    Thread safety: any thread may call :meth:`ensure` and :meth:`column_chunks`; chunks are
    loaded under one lock, and a chunk is marked loaded only once every column has it.
    """

    def __init__(self, path: str, reader: ipc.RecordBatchFileReader, schema: Schema,
                 rows: Sequence[int]) -> None:
        self.path = path
        self._reader = reader
        self._schema = schema
        self._rows = list(rows)
        names = reader.schema.names
        if len(set(names)) != len(names):
            raise ShardCorruptError(f"{path} names a column twice")
        self._index: dict[str, int] = {}
        for field in schema:
            if field.name not in names:
                raise SchemaError(f"{path} has no column {field.name!r}")
            self._index[field.name] = names.index(field.name)
            found = reader.schema.field(field.name).type
            if not found.equals(field.arrow_type()):
                raise SchemaError(f"{path}: column {field.name!r} has type {found}, not the "
                                  f"canonical {field.arrow_type()}; the shard must be "
                                  "materialized first")
        self._loaded = np.zeros(len(self._rows), dtype=bool)
        self._views: list[dict[str, ColumnBuffers] | None] = [None] * len(self._rows)
        self._columns: dict[str, _native.ColumnChunks] = {}
        self._lock = threading.Lock()
        self.complete = False

    def ensure(self, chunks: np.ndarray) -> None:
        """Load the chunks ``chunks`` (indices into this shard's chunks) not loaded yet."""
        if self.complete:
            return
        wanted = np.asarray(chunks, dtype=np.int64)
        missing = wanted[~self._loaded[wanted]]
        if missing.size == 0:
            return
        with self._lock:
            for i in np.unique(missing).tolist():
                if self._loaded[i]:
                    continue  # (another thread loaded it meanwhile)
                views = self._load(i)
                self._views[i] = views
                for name, column in self._columns.items():
                    column.set(i, views[name].data, views[name].offsets)
                self._loaded[i] = True  # only now may a gather read it
            self.complete = bool(self._loaded.all())

    def column_chunks(self, name: str) -> _native.ColumnChunks:
        """The column's chunks as the native gather takes them (loaded ones viewed, the
        others empty placeholders that :meth:`ensure` replaces)."""
        found = self._columns.get(name)
        if found is not None:
            return found
        with self._lock:
            found = self._columns.get(name)
            if found is None:
                variable = not self._schema[name].fixed_width
                values = [_NO_BYTES if v is None else v[name].data for v in self._views]
                offsets = [_NO_ROWS if v is None else v[name].offsets for v in self._views]
                found = self._columns[name] = _native.ColumnChunks(
                    values, offsets if variable else None)  # type: ignore[arg-type]
            return found

    def _load(self, i: int) -> dict[str, ColumnBuffers]:
        try:
            batch = self._reader.get_batch(i)
            batch.validate(full=True)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise corrupt_shard_error(self.path, exc) from exc
        if batch.num_rows != self._rows[i]:
            raise ShardCorruptError(
                f"{self.path}: chunk {i} holds {batch.num_rows} rows, where the index's "
                f"layout says {self._rows[i]}; the shard is corrupt or not the one the index "
                "describes: write or fetch it again")
        views = {}
        for field in self._schema:
            try:
                views[field.name] = chunk_buffers(field, [batch.column(self._index[field.name])])[0]
            except SchemaError as exc:
                raise SchemaError(f"{self.path}: {exc}") from exc
            except (pa.ArrowException, ValueError) as exc:
                raise corrupt_shard_error(self.path, exc) from exc
        return views


__all__ = ["ChunkTable", "LazyChunks", "chunk_layout", "corrupt_shard_error"]
