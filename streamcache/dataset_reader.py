"""Random access to a whole dataset by global sample id.

:class:`DatasetReader` resolves a sample id to (shard, row) with the index's row counts, asks
its shard store for a local copy of the shard in the local layout, and gathers rows with the
native core. It is the building block under the streaming dataset; it is also useful on its
own (inspection, evaluation, tests).

:class:`FolderStore` is the simplest store: local shards already in the local layout are read
in place, once verified against the index (size, and checksum when recorded); anything else
(remote, compressed, Parquet) is fetched whole, verified against the index (size and checksum)
and materialized into a folder, once. Copies are identified like the node cache's (see
identity.py): a folder per dataset location and fingerprint, and the source object's identity
recorded beside each copy when the index has no checksum. It has no byte budget and no
prefetching; the node cache (cache.py) adds those for streaming.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from . import storage
from .checksum import verify_bytes
from .errors import RowOutOfRangeError, ShardCorruptError, ShardNotFoundError, StreamcacheError
from .fetch import Fetcher, FetchOptions
from .identity import (
    dataset_folder_name,
    read_record,
    source_identity,
    verify_in_place,
    write_record,
)
from .index import DatasetIndex, load_index
from .materialize import is_local_layout, materialize
from .reader import Ragged, ShardReader, first_row, gather


class ShardStore(Protocol):
    """Gives the local path of a shard in the local layout, installing it if needed."""

    def local_path(self, shard: int) -> str: ...

    def close(self) -> None: ...


def _local_name(index: DatasetIndex, shard: int) -> str:
    stem = os.path.basename(index.shards[shard].path).rsplit(".", 1)[0]
    return f"{shard:06d}-{stem}.arrow"


class FolderStore:
    """Materialize shards into ``folder`` (a temporary one by default) on first use.

    ``verify``: hash a local shard read in place against the index's checksum before it is
    first served (once per store, and once per file version when ``folder`` is kept); False
    checks its size only. ``fetch``: how remote shards are read (timeouts, retries; see
    :class:`~streamcache.fetch.FetchOptions`); ``storage_options`` replace its own.

    Thread safety: ``local_path`` may be called from several threads; a shard is installed
    once per store (concurrent callers wait for the first).
    """

    def __init__(self, index: DatasetIndex, folder: str | None = None, *,
                 storage_options: Mapping[str, Any] | None = None, verify: bool = True,
                 fetch: FetchOptions | None = None) -> None:
        self.index = index
        self._owned = folder is None
        self.folder = folder or tempfile.mkdtemp(prefix="streamcache-")
        self.verify = verify
        self._dataset_folder = os.path.join(self.folder,
                                            dataset_folder_name(index, storage_options))
        os.makedirs(self._dataset_folder, exist_ok=True)
        self._storage_options = storage_options
        fetch = fetch or FetchOptions()
        if storage_options is not None:
            fetch = replace(fetch, storage_options=dict(storage_options))
        self._fetch_options = fetch
        self._fetcher: Fetcher | None = None
        self._paths: dict[int, str] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def local_path(self, shard: int) -> str:
        if shard in self._paths:
            return self._paths[shard]
        with self._guard:
            lock = self._locks.setdefault(shard, threading.Lock())
        with lock:
            if shard not in self._paths:
                self._paths[shard] = self._install(shard)
        return self._paths[shard]

    def _install(self, shard: int) -> str:
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        fs, path = storage.filesystem(url, self._storage_options)
        if storage.is_local(fs) and info.format == "arrow" and is_local_layout(
            path, self.index.schema
        ):
            record = os.path.join(self._dataset_folder, f"{shard:06d}.inplace")
            verify_in_place(str(path), info if self.verify else replace(info, checksum=None),
                            where=url, record=record)
            return str(path)
        target = os.path.join(self._dataset_folder, _local_name(self.index, shard))
        record_path = target.removesuffix(".arrow") + ".source"
        identity = source_identity(info, url, self._storage_options, self._fetch_options)
        if os.path.exists(target) and identity is not None and (
                info.checksum is not None or (read_record(record_path) or {}).get(
                    "identity") == identity):
            return target
        if info.checksum is None and identity is not None:
            write_record(record_path, {"url": url, "identity": identity})
        if storage.is_local(fs):  # never more than one byte past what the index says
            data = fs.cat_file(path, start=0, end=info.bytes + 1)
        else:  # timeouts, retries, bounded by the index's size
            data = self._remote().fetch(url, size=info.bytes, checksum=info.checksum)
        if len(data) != info.bytes:
            raise ShardCorruptError(
                f"{url} is {len(data)} bytes, the index says {info.bytes}; it is truncated or "
                "was rewritten after indexing"
            )
        verify_bytes(data, info.checksum, what=url)
        materialize(data, info.format, self.index.schema, target, where=url,
                    expected_rows=info.rows)
        return target

    def _remote(self) -> Fetcher:
        with self._guard:
            if self._fetcher is None:
                self._fetcher = Fetcher(self._fetch_options)
            return self._fetcher

    def close(self) -> None:
        with self._guard:
            fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:
            fetcher.close()
        if self._owned:
            shutil.rmtree(self.folder, ignore_errors=True)


class DatasetReader:
    """Read samples of a dataset by global id (shard k's row r has id sum(rows[:k]) + r).

    Args:
        source: a dataset URL (folder or index.json) or a loaded :class:`DatasetIndex`.
        fields: the fields to read (default: all).
        store: where local copies of shards come from (default: a :class:`FolderStore` in
            ``local_dir``, or a temporary folder removed on close).
        allow_external_paths: read shards the index names outside its own folder (on the
            index's filesystem only; see :func:`streamcache.index.check_shard_paths`).
        fetch: how remote shards are read by the default store (timeouts, retries; see
            :class:`~streamcache.fetch.FetchOptions`).

    Thread safety: ``read_batch`` may be called from several threads.
    """

    def __init__(self, source: str | DatasetIndex, *, fields: Sequence[str] | None = None,
                 local_dir: str | None = None, store: ShardStore | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 max_open_shards: int = 256, allow_external_paths: bool = False,
                 fetch: FetchOptions | None = None) -> None:
        self.index = source if isinstance(source, DatasetIndex) else load_index(
            source, storage_options, allow_external_paths=allow_external_paths, fetch=fetch
        )
        self.schema = self.index.schema.select(fields)
        self.store: ShardStore = store or FolderStore(self.index, local_dir,
                                                      storage_options=storage_options,
                                                      fetch=fetch)
        rows = self.index.shard_rows
        self._starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(rows, out=self._starts[1:])
        # Open shards, least recently used first. Dropping one does not unmap it while a
        # gather still holds its buffers; it lets an evicted shard's disk space be freed.
        self._readers: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()
        self._max_open = max(1, max_open_shards)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_samples(self) -> int:
        return len(self)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) for each global id. Raises RowOutOfRangeError for a bad id."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = int(ids[(ids < 0) | (ids >= len(self))][0])
            raise RowOutOfRangeError(f"sample id {bad} is outside [0, {len(self)})")
        shards = np.searchsorted(self._starts, ids, side="right") - 1
        return shards, ids - self._starts[shards]

    def shard_reader(self, shard: int) -> ShardReader:
        with self._lock:
            reader = self._readers.get(shard)
            if reader is not None:
                self._readers.move_to_end(shard)
                return reader
        reader = self._open(shard)
        with self._lock:
            reader = self._readers.setdefault(shard, reader)
            while len(self._readers) > self._max_open:
                self._readers.popitem(last=False)
        return reader

    def _open(self, shard: int) -> ShardReader:
        rows = self.index.shards[shard].rows
        try:
            return ShardReader(self.store.local_path(shard), self.schema, expected_rows=rows)
        except FileNotFoundError:
            pass  # evicted by another process between being handed out and being mapped
        try:
            return ShardReader(self.store.local_path(shard), self.schema, expected_rows=rows)
        except FileNotFoundError as error:
            if isinstance(error, StreamcacheError):
                raise
            raise ShardNotFoundError(
                f"shard {shard} of {self.index.root} ({self.index.shard_url(shard)}) cannot be "
                "found: the dataset was replaced or removed after its index was loaded (a "
                "ShardWriter with overwrite=True removes the old version's shards once the new "
                "index is published); load the dataset again"
            ) from error

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray | Ragged]:
        """The samples ``ids`` as batch arrays, in the order given."""
        shards, rows = self.locate(np.asarray(ids, dtype=np.int64))
        return self.read_located(shards, rows)

    def read_located(self, shards: np.ndarray, rows: np.ndarray,
                     ) -> dict[str, np.ndarray | Ragged]:
        """Rows ``rows[i]`` of shards ``shards[i]`` (index order) as batch arrays."""
        unique, which = np.unique(shards, return_inverse=True)
        readers = [self.shard_reader(int(s)) for s in unique]
        return gather(readers, which.astype(np.int32), rows, list(self.schema))

    def __getitem__(self, sample_id: int) -> dict[str, Any]:
        batch = self.read_batch([int(sample_id)])
        return {f.name: first_row(f, batch[f.name]) for f in self.schema}

    def close(self) -> None:
        with self._lock:
            readers, self._readers = self._readers, collections.OrderedDict()
        for reader in readers.values():
            with contextlib.suppress(Exception):
                reader.close()
        self.store.close()

    def __enter__(self) -> DatasetReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
