"""ShardWriter: samples in, Arrow IPC shards and an index.json out, on any fsspec destination.

Shards are cut at a target size, encoded (zstd by default) and uploaded by a background
thread while the caller keeps writing, so the caller's core and the encoder's run in
parallel. ``index.json`` is published last and atomically, only by a clean ``close()``: an
exception inside the ``with`` body (or :meth:`ShardWriter.abort`) publishes no index, so a
half-written dataset is never readable.

Each shard is a sequence of record batches ("chunks") of about ``chunk_size`` bytes, with a
digest of each chunk in the footer and the chunk layout in the index (format/chunks.py), so
a reader can fetch the rows it needs by range instead of the whole shard (cache/ranges.py).
A shard is compressed only where the codec pays (codec_choice.py); an uncompressed one is
installed as downloaded, a compressed one decoded into the local layout (materialize.py).

One writer per destination: a writer holds the destination's lease (lease.py) from its start
to its end, a second one is refused, and the index is published only if the lease is still
this writer's. Every shard's name carries the writer's token, so no two writers (nor two
versions of a dataset) ever share a shard file. Replacing a dataset (``overwrite=True``)
never destroys it first: the old version stays whole and readable until the new index is
published, and only then are the old version's shards removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from ..errors import (
    DestinationError,
    EmptyDatasetError,
    IndexFormatError,
    IndexNotFoundError,
    SchemaError,
    StreamcacheError,
)
from ..remote import storage
from .checksum import checksum_bytes
from .chunks import DEFAULT_CHUNK_SIZE, chunk_rows_for
from .codec_choice import DEFAULT_MIN_SAVINGS, check_min_savings
from .columns import build_column, field_from_arrow, normalize_value, to_canonical
from .index import INDEX_NAME, DatasetIndex, ShardInfo, load_index, save_index
from .lease import WriterLease, new_token
from .schema import Field, Schema, infer_schema
from .shard_encode import ShardEncoder

DEFAULT_SHARD_SIZE = 64 << 20
COMPRESSIONS = ("zstd", "lz4", None)

#: The names ShardWriter gives shards (with the writer's token; without one before it had
#: them). Only such files, in the dataset's own folder, are ever removed by an overwrite.
_WRITER_SHARD = re.compile(r"shard-(?:[0-9a-f]{12}-)?\d{5,}\.arrow")


@dataclass
class WriterStats:
    """What a writer has produced so far."""

    samples: int = 0
    shards: int = 0
    bytes_written: int = 0  # stored (compressed) bytes
    raw_bytes: int = 0  # uncompressed Arrow bytes


class ShardWriter:
    """Write samples into shards of about ``shard_size`` bytes under ``dst``, then an index.

    Args:
        dst: a folder URL (local path, ``memory://...``, ``s3://bucket/prefix``...).
        schema: a :class:`Schema`, a ``{name: Field | "spec"}`` mapping (see
            :meth:`Field.parse`), or None to infer it from the first sample.
        shard_size: target uncompressed bytes per shard.
        compression: ``"zstd"`` (default), ``"lz4"`` or None for the Arrow IPC buffers.
        compression_level: codec level (None: the codec's default).
        compression_min_savings: a shard is stored compressed only where the codec saves
            this share of the bytes of a few of its chunks (default 0.1; 0: always);
            otherwise uncompressed (the index says ``compression: null``), so JPEG, audio
            or random bytes cost no decode on install and a local copy is read in place.
        chunk_size: target uncompressed bytes per chunk (record batch) of a shard: the unit
            a range read fetches (default 64 KiB; a sample larger than that is a chunk of
            its own). Rows per chunk are fixed per shard (from its average row size).
        overwrite: replace a dataset already at ``dst``. The old version stays readable
            until the new index is published; then the old version's shards that this
            writer's naming produced are removed (files of other origins, such as Parquet
            files that ``streamcache index`` described, are never removed). A reader still
            on the old version reads it or gets a clear error once its shards are gone,
            never rows of the new version.
        storage_options: passed to fsspec.
        max_pending: shards encoded or uploaded in the background at once.

    Attributes:
        token: this writer's random token; every shard it writes is named
            ``shard-<token>-<number>.arrow``.

    Raises:
        DestinationError: ``dst`` is not writable, holds a dataset and not ``overwrite``,
            or another writer is writing to it (see lease.py for what each kind of
            destination guarantees).
        SchemaError: a sample does not match the schema (the message names the field).

    Thread safety: one writer is used from one thread.
    """

    def __init__(self, dst: str, *, schema: Schema | Mapping[str, Field | str] | None = None,
                 shard_size: int = DEFAULT_SHARD_SIZE, compression: str | None = "zstd",
                 compression_level: int | None = None, overwrite: bool = False,
                 storage_options: Mapping[str, Any] | None = None, max_pending: int = 2,
                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                 compression_min_savings: float = DEFAULT_MIN_SAVINGS) -> None:
        if compression == "none":
            compression = None
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
        if shard_size <= 0:
            raise ValueError("shard_size must be positive")
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.compression_min_savings = check_min_savings(compression_min_savings)
        self.chunk_size = int(chunk_size)
        self.url = dst
        self.schema: Schema | None = Schema.coerce(schema) if schema is not None else None
        self.shard_size = int(shard_size)
        self.compression = compression
        self._encoder = ShardEncoder(self.chunk_size, compression, ipc.IpcWriteOptions(
            compression=pa.Codec(compression, compression_level) if compression else None,
        ), self.compression_min_savings)
        self._storage_options = storage_options
        self._fs, self._root = storage.filesystem(dst, storage_options)
        self.token = new_token()
        self._lease = WriterLease(self._fs, self._root, self.token)
        self._prepare_destination(overwrite)
        self.stats = WriterStats()
        self._rows: dict[str, list[Any]] = {}
        self._row_bytes = 0
        self._parts: list[pa.RecordBatch] = []
        self._part_bytes = 0
        self._shards: list[ShardInfo] = []
        self._futures: list[Future[ShardInfo]] = []
        # submitted and not yet seen finished (a cut checks these, not every shard written)
        self._unchecked: list[Future[ShardInfo]] = []
        self._max_pending = max(1, max_pending)
        self._pool = ThreadPoolExecutor(max_workers=self._max_pending,
                                        thread_name_prefix="streamcache-writer")
        self._closed = False
        self._publishing = False
        self.index: DatasetIndex | None = None

    # ------------------------------------------------------------ destination

    def _prepare_destination(self, overwrite: bool) -> None:
        where = storage.unstrip(self._fs, self._root)
        index_path = storage.join(self._root, INDEX_NAME)
        # (the first requests to the store: no credentials, a wrong endpoint or a full disk
        # show here, as one DestinationError line)
        with storage.destination_errors(self._fs, self._root):
            if storage.is_local(self._fs):
                os.makedirs(self._root, exist_ok=True)
                if not os.access(self._root, os.W_OK | os.X_OK):
                    raise PermissionError(f"{self._root} is not writable")
            else:
                self._fs.makedirs(self._root, exist_ok=True)
            self._lease.acquire()  # before looking: a writer that just finished is seen
            try:
                self._fs.invalidate_cache(self._root)  # a cached listing may be stale
                exists = self._fs.exists(index_path)
            except BaseException:
                self._lease.release()
                raise
        if exists and not overwrite:
            self._lease.release()
            raise DestinationError(
                f"{where} already holds a dataset ({INDEX_NAME}); pass overwrite=True "
                "(--overwrite) to replace it, or choose another destination"
            )

    # ------------------------------------------------------------ writing

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample (a dict of field name -> value)."""
        self._check_open()
        if self.schema is None:
            self.schema = infer_schema(sample)
        schema = self.schema
        if len(sample) != len(schema) or any(name not in sample for name in schema.names):
            missing = [n for n in schema.names if n not in sample]
            extra = [str(n) for n in sample if n not in schema]
            raise SchemaError(
                f"sample {self.stats.samples} does not match the schema: missing fields "
                f"{missing}, unexpected fields {extra}"
            )
        if not self._rows:
            self._rows = {name: [] for name in schema.names}
        # validate every field before storing any, so a bad sample leaves no partial row
        values = [normalize_value(field, sample[field.name]) for field in schema]
        size = 0
        for field, value in zip(schema, values, strict=True):
            self._rows[field.name].append(value)
            size += value.nbytes if hasattr(value, "nbytes") else len(value)
        self._row_bytes += size
        self.stats.samples += 1
        if self._row_bytes + self._part_bytes >= self.shard_size:
            self._move_rows_to_parts()
            self._cut_shard()

    def write_batch(self, data: pa.RecordBatch | pa.Table) -> None:
        """Add many samples at once from Arrow data (the fast path for conversions).

        Columns are matched by name and cast to the schema's canonical types; a schema is
        inferred from the Arrow schema when none was given.
        """
        self._check_open()
        if self.schema is None:
            self.schema = Schema(field_from_arrow(f) for f in data.schema)
        schema = self.schema
        missing = [n for n in schema.names if n not in data.schema.names]
        if missing:
            raise SchemaError(f"a batch lacks the fields {missing}; it has {data.schema.names}")
        where = f"batch at sample {self.stats.samples}"
        columns = [to_canonical(f, data.column(f.name), where=where) for f in schema]
        table = pa.Table.from_arrays(columns, schema=schema.arrow_schema())
        self._move_rows_to_parts()
        self.stats.samples += table.num_rows
        offset = 0
        row_bytes = max(1, table.nbytes // max(1, table.num_rows))
        while offset < table.num_rows:
            room = max(1, -(-(self.shard_size - self._part_bytes) // row_bytes))
            piece = table.slice(offset, room)
            offset += piece.num_rows
            self._parts.extend(piece.to_batches())
            self._part_bytes += piece.nbytes
            if self._part_bytes >= self.shard_size:
                self._cut_shard()

    def cut(self) -> None:
        """End the current shard here; the next sample starts a new one (no-op if empty)."""
        self._check_open()
        self._move_rows_to_parts()
        self._cut_shard()

    def _move_rows_to_parts(self) -> None:
        if not self._rows or not next(iter(self._rows.values())):
            return
        assert self.schema is not None
        columns = [build_column(f, self._rows[f.name]) for f in self.schema]
        self._parts.append(pa.RecordBatch.from_arrays(columns, schema=self.schema.arrow_schema()))
        self._part_bytes += self._row_bytes
        self._rows = {name: [] for name in self.schema.names}
        self._row_bytes = 0

    def _cut_shard(self) -> None:
        if not self._parts:
            return
        assert self.schema is not None
        table = pa.Table.from_batches(self._parts, schema=self.schema.arrow_schema())
        batch = table.combine_chunks().to_batches()[0]
        self._parts, self._part_bytes = [], 0
        name = f"shard-{self.token}-{len(self._futures):05d}.arrow"
        self._raise_background_errors()  # (keeps only the stores still running)
        while len(self._unchecked) >= self._max_pending:
            wait(self._unchecked, return_when=FIRST_COMPLETED)
            self._raise_background_errors()
        future = self._pool.submit(self._encode_and_store, name, batch)
        self._futures.append(future)
        self._unchecked.append(future)

    def _encode_and_store(self, name: str, batch: pa.RecordBatch) -> ShardInfo:
        path = storage.join(self._root, name)
        assert self.schema is not None
        with storage.destination_errors(self._fs, path):
            if storage.is_local(self._fs):
                size, checksum, tail, compression = self._encoder.store_local(path, batch,
                                                                              self.schema)
            else:
                data, size, checksum, tail, compression = self._encoder.to_bytes(batch,
                                                                                 self.schema)
                self._fs.pipe_file(path, data)
        return ShardInfo(name, "arrow", batch.num_rows, size, checksum, compression,
                         batch.nbytes, chunk_rows_for(batch.num_rows, batch.nbytes,
                                                      self.chunk_size),
                         len(tail), checksum_bytes(tail))

    def _raise_background_errors(self) -> None:
        """Raise the first failure among the stores finished since the last check."""
        unfinished = []
        for future in self._unchecked:
            if not future.done():
                unfinished.append(future)
            elif future.exception() is not None:
                self.abort()
                raise future.exception()  # type: ignore[misc]
        self._unchecked = unfinished

    def _check_open(self) -> None:
        if self._closed:
            raise StreamcacheError("this ShardWriter is closed; open a new one to write more")

    # ------------------------------------------------------------ finishing

    def close(self) -> DatasetIndex:
        """Finish the last shard, wait for every upload, publish index.json; returns the index.

        Raises:
            EmptyDatasetError: nothing was written (nothing is published).
        """
        if self._closed:
            if self.index is None:
                raise StreamcacheError("this ShardWriter was aborted; nothing was published")
            return self.index
        try:
            self._move_rows_to_parts()
            self._cut_shard()
            shards = [future.result() for future in self._futures]
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            url, index, replaced = self._publish(shards)
        except BaseException:
            # A failed publish (a full disk, a dropped PUT) may still have published: the
            # index there is read back; only when it is not this writer's are the shards
            # removed (when it cannot be read, they are kept: it may be)
            if not self._publishing or self._published(shards) is False:
                self._remove_own_shards()
            self._lease.release()
            raise
        self._remove_replaced(replaced, index)
        self._lease.release()
        self.index = DatasetIndex(index.schema, index.shards, index.fingerprint, url,
                                  index.created)
        self.stats.shards = len(shards)
        self.stats.bytes_written = sum(s.bytes for s in shards)
        self.stats.raw_bytes = sum(s.raw_bytes or 0 for s in shards)
        return self.index

    def _publish(self, shards: list[ShardInfo]) -> tuple[str, DatasetIndex, DatasetIndex | None]:
        """Publish the index if the lease is still ours: (its URL, it, the index it replaced)."""
        if not shards or self.schema is None:
            raise EmptyDatasetError(
                f"no samples were written to {self.url}; nothing was published"
            )
        index = DatasetIndex(self.schema, tuple(shards), created=time.time())
        folder = storage.unstrip(self._fs, self._root)
        replaced = self._current_index(folder)
        self._lease.confirm()  # the conditional publish: only while the destination is ours
        self._publishing = True
        return save_index(index, folder, self._storage_options), index, replaced

    def _published(self, shards: list[ShardInfo]) -> bool | None:
        """Whether the index at the destination is the one this writer was publishing (its
        shards, which carry this writer's token); None when it cannot be read (a store
        that fails reads too)."""
        folder = storage.unstrip(self._fs, self._root)
        try:
            found = load_index(folder, self._storage_options)
        except (IndexNotFoundError, IndexFormatError):
            return False  # none, or not a whole one: ours was not published
        except (StreamcacheError, OSError, ValueError):
            return None
        return [s.path for s in found.shards] == [s.path for s in shards]

    def _current_index(self, folder: str) -> DatasetIndex | None:
        """The index about to be replaced, if there is a readable one."""
        try:
            return load_index(folder, self._storage_options)
        except (StreamcacheError, OSError, ValueError):
            return None  # none, or unreadable: nothing of it is removed

    def _remove_replaced(self, old: DatasetIndex | None, new: DatasetIndex) -> None:
        """Remove the replaced version's shards: ShardWriter-named files of this folder that
        the new index does not list. Best effort: a file left behind is only disk space."""
        if old is None:
            return
        keep = {info.path for info in new.shards}
        for info in old.shards:
            if info.path not in keep and _WRITER_SHARD.fullmatch(info.path):
                with contextlib.suppress(Exception):
                    self._fs.rm_file(storage.join(self._root, info.path))

    def _remove_own_shards(self) -> None:
        """Remove the shards this writer stored (nothing refers to them). Best effort."""
        for future in self._futures:
            if future.done() and not future.cancelled() and future.exception() is None:
                with contextlib.suppress(Exception):
                    self._fs.rm_file(storage.join(self._root, future.result().path))

    def abort(self) -> None:
        """Stop without publishing an index; remove the shards stored so far and give the
        destination's lease back. A dataset that was there stays as it was."""
        if self._closed:
            return
        self._closed = True
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
        self._remove_own_shards()
        self._lease.release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


def write_dataset(samples: Iterable[Mapping[str, Any]], dst: str, **options: Any) -> DatasetIndex:
    """Write an iterable of sample dicts to ``dst`` (see :class:`ShardWriter` for options)."""
    with ShardWriter(dst, **options) as writer:
        for sample in samples:
            writer.write(sample)
    assert writer.index is not None
    return writer.index
