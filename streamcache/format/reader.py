"""Reading local shards: one row as Python values, or a batch of rows as contiguous arrays.

A :class:`ShardReader` memory-maps one shard in the local layout (see materialize.py) and
keeps zero-copy byte views of its columns. :func:`gather` hands those views to the native
core, which copies the chosen rows, from any number of shards, into fresh contiguous arrays
with the GIL released: fixed-width fields as one ``[B, ...]`` array, variable-width fields as
a :class:`Ragged` (values plus int64 offsets).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from .. import _native
from ..errors import SchemaError, ShardCorruptError
from .buffers import output_pool, settle_allocator
from .columns import ColumnBuffers, chunk_buffers
from .ipc_chunks import located_columns
from .materialize import COPY_OF_KEY
from .ragged import Ragged
from .schema import Field, Schema


class ShardReader:
    """One shard in the local layout, memory-mapped (zero-copy column views).

    The file is uncompressed Arrow IPC: one record batch, or chunks (record batches of a
    fixed row count, as ``ShardWriter(compression=None)`` writes them, or any foreign
    uncompressed file's batches). A chunked file is read where it lies: each chunk's columns
    are viewed in place and :func:`gather` finds a row's chunk (arithmetic for a fixed row
    count, a binary search otherwise), so nothing is copied to make it one batch.

    Unlinking the file while it is open is safe: the mapping stays valid until close.

    Raises:
        FileNotFoundError: no file at ``path``.
        ShardCorruptError: the file is not a readable shard in the local layout.
    Thread safety: read-only after construction; any thread may read.
    """

    #: the chunks of a file of several record batches (None: one batch, in ``_buffers``)
    _chunks: ChunkTable | None = None
    #: each field's views, one per record batch (None: a reader built otherwise, whose one
    #: batch is in ``_buffers``)
    _views: dict[str, list[ColumnBuffers]] | None = None

    def __init__(self, path: str, schema: Schema, *, expected_rows: int | None = None,
                 copy_of: str | None = None) -> None:
        """``copy_of``: what the file must record it is a copy of (materialize.COPY_OF_KEY),
        for a cache entry whose copies are stamped; a file that records another entry or
        nothing is a :class:`ShardCorruptError` (another entry's file under this name)."""
        self.path = path
        self.schema = schema
        self._copy_of = copy_of
        self._buffers: dict[str, ColumnBuffers] = {}
        try:
            self._mmap = pa.memory_map(path, "r")
        except FileNotFoundError:
            raise  # gone (evicted, deleted): the caller may install it again
        except (pa.ArrowException, OSError) as exc:
            raise corrupt_shard_error(path, exc) from exc
        try:
            reader = self._open_reader()
            located = None
            if reader.num_record_batches > 1:  # located from the file's own bytes (ipc_chunks)
                self._mmap.seek(0)
                located = located_columns(self._mmap.read_buffer(), reader.schema,
                                          list(self.schema))
            if located is not None:  # chunks located natively: no Arrow object per chunk
                rows, self.__dict__["_columns"] = located
                self._views = {}
            else:
                batches = self._read_batches(reader)
                rows = [batch.num_rows for batch in batches]
                self._views = self._field_views(batches)
            self.num_rows = sum(rows)
            if expected_rows is not None and self.num_rows != expected_rows:
                raise ShardCorruptError(
                    f"{path} holds {self.num_rows} rows, the index says {expected_rows}")
        except BaseException:
            self.close()
            raise
        if len(rows) == 1:
            self._buffers = {name: views[0] for name, views in self._views.items()}
            self.__dict__["_batch"] = batches[0]
        else:
            self._chunks = ChunkTable(rows)

    @functools.cached_property
    def _batch(self) -> pa.RecordBatch | pa.Table:
        """The file's rows as Arrow, zero-copy (for inspection)."""
        return ipc.open_file(self._mmap).read_all()

    def _open_reader(self) -> ipc.RecordBatchFileReader:
        """The file's footer and schema, the file checked to be the copy it must be."""
        try:
            reader = ipc.open_file(self._mmap)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise corrupt_shard_error(self.path, exc) from exc
        if self._copy_of is not None:
            self._check_copy_of(reader.schema.metadata or {})
        return reader

    def _read_batches(self, reader: ipc.RecordBatchFileReader) -> list[pa.RecordBatch]:
        """The shard's record batches, each checked whole: offsets in order and inside their
        values, strings UTF-8 (this reads the offsets, 8 bytes a row, and str values), so no
        later read meets a contradiction."""
        try:
            table = reader.read_all()  # (every batch at once: a chunked shard has ~1,000)
            table.validate(full=True)
            # the names are decoded here, inside this check (a flipped bit may leave one that
            # is not UTF-8, or two alike)
            if len(set(table.schema.names)) != table.num_columns:
                raise ShardCorruptError(f"{self.path} names a column twice")
            batches: list[pa.RecordBatch] = table.to_batches()
            if not batches:  # a shard of zero rows
                return [pa.RecordBatch.from_arrays(
                    [pa.array([], type=f.arrow_type()) for f in self.schema],
                    schema=self.schema.arrow_schema())]
            return batches
        except (pa.ArrowException, OSError, ValueError) as exc:
            # any pyarrow error: a flipped bit may read as an unknown type or a huge length
            raise corrupt_shard_error(self.path, exc) from exc

    def _check_copy_of(self, metadata: dict[bytes, bytes]) -> None:
        recorded = metadata.get(COPY_OF_KEY)
        if recorded != (self._copy_of or "").encode():
            found = "nothing" if recorded is None else repr(recorded.decode("utf-8", "replace"))
            raise ShardCorruptError(
                f"{self.path} is a copy of {found}, not of {self._copy_of!r}: another entry's "
                "file under this name (moved or swapped in the cache folder); delete it and "
                "the cache installs it again")

    def _field_views(self, batches: list[pa.RecordBatch]) -> dict[str, list[ColumnBuffers]]:
        """Each field's views, one per record batch (its type checked once for them all)."""
        names = batches[0].schema.names
        per_field = {}
        for field in self.schema:
            if field.name not in names:
                raise SchemaError(f"{self.path} has no column {field.name!r}")
            index = names.index(field.name)
            try:
                per_field[field.name] = chunk_buffers(field, [b.column(index) for b in batches])
            except SchemaError as exc:
                raise SchemaError(f"{self.path}: {exc}") from exc
            except (pa.ArrowException, ValueError) as exc:
                raise corrupt_shard_error(self.path, exc) from exc
        return per_field

    def column_chunks(self, name: str) -> _native.ColumnChunks:
        """The column's buffers, one per record batch, as the native gather takes them (made
        on first use, then kept: a batch converts one object per shard, not per chunk)."""
        columns = self.__dict__.setdefault("_columns", {})
        found = columns.get(name)
        if found is None:
            parts = [self._buffers[name]] if self._views is None else self._views[name]
            offsets = [part.offsets for part in parts if part.offsets is not None]
            found = columns[name] = _native.ColumnChunks(
                [part.data for part in parts], offsets if offsets else None)
        return found

    def uniform_chunks(self, name: str, elem_size: int) -> tuple[int, _native.ColumnChunks] | None:
        """For a variable-width column whose rows all hold the same number ``L > 0`` of
        elements: ``L`` and its values as fixed rows of ``L * elem_size`` bytes, one buffer
        per record batch (what :func:`gather` reads with the fixed-width gather, without the
        offsets pass); None otherwise. Checked once per shard and column (the offsets, once)."""
        found = self.__dict__.setdefault("_uniform", {})
        if name not in found:
            parts = [self._buffers[name]] if name in self._buffers else \
                (self._views or {}).get(name)
            # (None for chunks located natively: their offsets stay in the native object)
            found[name] = _uniform_rows(parts, elem_size) if parts else None
        result: tuple[int, _native.ColumnChunks] | None = found[name]
        return result

    def buffers(self, name: str) -> ColumnBuffers:
        """The column's views (a shard of one record batch; :func:`gather` reads a chunked
        one chunk by chunk)."""
        if self._chunks is not None:
            raise AssertionError(f"{self.path} is chunked: read it with gather()")
        return self._buffers[name]

    def row(self, i: int, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Row ``i`` as Python values (arrays for tensors and sequences)."""
        names = fields if fields is not None else self.schema.names
        batch = gather([self], np.zeros(1, np.int32), np.array([i], np.int64),
                       [self.schema[n] for n in names])
        return {name: first_row(self.schema[name], value) for name, value in batch.items()}

    def close(self) -> None:
        self._buffers.clear()
        self._chunks = self._views = None
        self.__dict__.pop("_columns", None)
        self.__dict__.pop("_uniform", None)
        self._mmap.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _uniform_rows(parts: Sequence[ColumnBuffers], elem_size: int
                  ) -> tuple[int, _native.ColumnChunks] | None:
    """:meth:`ShardReader.uniform_chunks` of a column's parts."""
    length = None
    views = []
    for part in parts:
        offsets = part.offsets
        if offsets is None or len(offsets) < 2:
            return None
        lengths = np.diff(offsets)
        first = int(lengths[0])
        if first <= 0 or (length is not None and first != length) or \
                not (lengths == first).all():
            return None
        length = first
        views.append(part.data[int(offsets[0]) * elem_size:int(offsets[-1]) * elem_size])
    if length is None:
        return None
    return length, _native.ColumnChunks(views, None)


def _uniform_batch(shards: Sequence[ShardReader], field: Field
                   ) -> tuple[int, list[_native.ColumnChunks]] | None:
    """The row length shared by every row of ``field`` in all of ``shards``, with their
    columns as fixed rows (:meth:`ShardReader.uniform_chunks`); None where any differs."""
    length, columns = None, []
    for shard in shards:
        found = shard.uniform_chunks(field.name, field.elem_size)
        if found is None or (length is not None and found[0] != length):
            return None
        length = found[0]
        columns.append(found[1])
    return None if length is None else (length, columns)


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


def corrupt_shard_error(path: str, exc: BaseException) -> ShardCorruptError:
    """The error for a local shard that cannot be read (``exc`` says why)."""
    return ShardCorruptError(
        f"{path} is not a readable local shard ({type(exc).__name__}: {exc}); it is "
        "truncated or corrupt: delete it so that it is fetched again")


def first_row(field: Field, value: Any) -> Any:
    """The first row of a gathered batch column, as a sample value."""
    if isinstance(value, Ragged):
        return value[0]
    row = value[0]
    return row.item() if field.shape == () and isinstance(row, np.generic) else row


_BYTES_AS_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "streamcache_bytes_as_rows", default=False)

@contextlib.contextmanager
def bytes_as_rows() -> Iterator[None]:
    """Inside the block, :func:`gather` (on this thread) makes each ``bytes`` field a
    :meth:`Ragged.from_rows`: one ``bytes`` object per row, copied once from the shard, which
    is what a batch of encoded images becomes. Outside it, bytes fields are contiguous values
    plus offsets, as every other variable-width field (what ``ragged="offsets"`` hands out)."""
    token = _BYTES_AS_ROWS.set(True)
    try:
        yield
    finally:
        _BYTES_AS_ROWS.reset(token)


def batch_shards(shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct shards of a batch in increasing order, and each row's index among them
    (int32, what :func:`gather` takes as ``which``): ``numpy.unique`` with the inverse, in
    a microsecond or two instead of 30 (native)."""
    return _native.group_shards(np.ascontiguousarray(shards, dtype=np.int64))


def locate_in_chunks(shards: Sequence[ShardReader], which: np.ndarray, rows: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Each row's record batch, numbered over ``shards`` one after another (shard k's batch j
    is the shards' batches before k plus j: what the ``*_chunks`` gathers take), and its row
    inside that batch (``_native.locate_chunks``: one pass, where numpy's dozen calls cost
    ~50 us a batch). A row outside its shard stays in that shard's first or last batch,
    outside its rows, so the native gather refuses it as it refuses any row that does not
    exist (it never reaches another shard's batch)."""
    tables = [shard._chunks for shard in shards]
    counts = np.array([1 if t is None else t.count for t in tables], dtype=np.int64)
    # rows a chunk; one batch, or uneven ones (found below): all in its first chunk
    fixed = np.array([t.fixed_rows if t is not None and t.fixed_rows else _WHOLE
                      for t in tables], dtype=np.int64)
    flat, local = _native.locate_chunks(counts, fixed, which, rows)
    for i, table in enumerate(tables):  # batches of uneven row counts (foreign files)
        if table is None or table.fixed_rows:
            continue
        mine = np.flatnonzero(which == i)
        found = np.clip(table.locate(rows[mine]), 0, table.count - 1)
        flat[mine] = int(counts[:i].sum()) + found
        local[mine] = rows[mine] - table.starts[found]
    return flat, local


_WHOLE = 1 << 62  # the rows a chunk of a shard read whole (more than any shard has)


def gather(shards: Sequence[ShardReader], which: np.ndarray, rows: np.ndarray,
           fields: Sequence[Field]) -> dict[str, np.ndarray | Ragged]:
    """Rows ``rows[i]`` of ``shards[which[i]]`` for each field, as contiguous batch arrays.

    Fixed-width fields are one ``[B, ...]`` array, variable-width ones a :class:`Ragged`
    (``bytes`` fields as ``bytes`` objects per row inside :func:`bytes_as_rows`). Arrays are
    written into pooled buffers (:mod:`~streamcache.format.buffers`).

    Args:
        which: int32 indices into ``shards``; rows: int64 row numbers inside those shards.

    Raises:
        RowOutOfRangeError: a row or shard index does not exist.
        CorruptDataError: a shard's offsets contradict its buffers.
    """
    which = np.ascontiguousarray(which, dtype=np.int32)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if any(shard._chunks is not None for shard in shards):
        which, rows = locate_in_chunks(shards, which, rows)
    pool = output_pool()
    out: dict[str, np.ndarray | Ragged] = {}
    for field in fields:
        columns = [shard.column_chunks(field.name) for shard in shards]
        if field.fixed_width:
            # a pooled buffer: no page faults on fresh memory (see buffers.py)
            array = pool.take(len(rows) * field.row_bytes).view(field.numpy_dtype).reshape(
                (len(rows), *field.shape))
            _native.gather_fixed_chunks(columns, field.row_bytes, which, rows, array)
            out[field.name] = array
            continue
        if field.kind == "bytes" and _BYTES_AS_ROWS.get():
            settle_allocator()
            out[field.name] = Ragged.from_rows(_native.gather_bytes_chunks(columns, which,
                                                                           rows))
            continue
        uniform = _uniform_batch(shards, field)
        if uniform is not None:
            # every row of these shards has the same length (sequences written with the
            # defaults): the fixed-width gather, without the offsets pass
            length, fixed_columns = uniform
            values = pool.take(len(rows) * length * field.elem_size)
            _native.gather_fixed_chunks(fixed_columns, length * field.elem_size, which, rows,
                                        values)
            offsets = np.arange(0, (len(rows) + 1) * length, length, dtype=np.int64)
        else:
            values, offsets = _native.gather_var_chunks(columns, field.elem_size, which, rows,
                                                        pool.take)
        dtype = field.numpy_dtype
        if field.kind == "sequence" and field.elem_size != dtype.itemsize:
            offsets //= dtype.itemsize  # stored as raw bytes: offsets counted bytes
        out[field.name] = Ragged(values.view(dtype), offsets, field.kind)
    return out
