"""Random access to a whole dataset by global sample id.

:class:`DatasetReader` resolves a sample id to (shard, row) with the index's row counts, asks
its shard store for a local copy of the shard in the local layout, and gathers rows with the
native core. It is the building block under the streaming dataset; it is also useful on its
own (inspection, evaluation, tests).

Its default store is a :class:`~streamcache.cache.node.NodeCache` (no byte budget, no
prefetching): local shards already in the local layout are read in place, once verified
against the index; anything else (remote, compressed, Parquet) is fetched whole, verified and
materialized into the cache folder, once.

Some rows are read by range instead (:class:`~streamcache.cache.ranges.RangeReader`: only the
chunks that hold them, into memory, installing nothing):

- the rows of shards the caller's ``by_range`` picks (e.g. shards another node caches);
- the cold-start rule: with a store that installs in the background (a
  :class:`~streamcache.cache.prefetch.Prefetcher`, which has ``ready(shard)``), the rows of
  shards that are not installed yet and can be read by range (chunked Arrow shards, Parquet
  files of several row groups), so the first batches do not wait for whole shards while the
  prefetcher installs them in first-use order; once installed, rows come from the cache. The
  first steps (``COLD_START_STEPS``) are read so while the chunks the node's ranks need of a
  shard stay within 1/16 of its size (``ranges.COLD_START_BUDGET``); later steps wait for
  the installs (``ranges.COLD_BUDGET``, 0 by default, the node's budget for them: split
  among its reading processes), and rows dense in a shard wait for its install (the first
  steps' rows are taken from a compressed shard's downloaded bytes while the install
  decodes them).

Either way the rows are the same canonical arrays, gathered by the same native gather: a
batch is identical cold, warm, or read by range.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..cache.identity import local_size_error
from ..cache.node import NodeCache
from ..cache.ranges import RangeReader
from ..errors import RowOutOfRangeError, ShardNotFoundError
from ..format.index import DatasetIndex, load_index
from ..format.reader import Ragged, ShardReader, batch_shards, first_row, gather
from ..remote.fetch import Fetcher
from ..remote.options import FetchOptions
from ..remote.retry import FetchError
from .cold_reads import ColdReads, is_gone
from .single_flight import SingleFlight

#: Steps of a cold start read by range whatever their density (ranges.COLD_BUDGET applies
#: afterwards), with the store's downloads held back meanwhile.
COLD_START_STEPS = 2
#: How often a reader looks whether the files it maps were evicted by another process.
SWEEP_S = 2.0


class ShardStore(Protocol):
    """Gives the local path of a shard in the local layout, installing it if needed."""

    def local_path(self, shard: int) -> str: ...

    def close(self) -> None: ...


class DatasetReader(ColdReads):
    """Read samples of a dataset by global id (shard k's row r has id sum(rows[:k]) + r).

    Args:
        source: a dataset URL (folder or index.json) or a loaded :class:`DatasetIndex`.
        fields: the fields to read (default: all).
        local_dir: the cache folder of the default store (a
            :class:`~streamcache.cache.node.NodeCache`; it may be shared with a StreamDataset's
            ``cache_dir``). Default: a temporary folder, removed on close.
        store: where local copies of shards come from (default: the node cache above).
        allow_external_paths: read shards the index names outside its own folder (on the
            index's filesystem only; see
            :func:`streamcache.format.shard_paths.check_shard_paths`).
        fetch: how remote shards are read by the default store (timeouts, retries; see
            :class:`~streamcache.remote.options.FetchOptions`).
        verify: hash a local shard read in place against the index's checksum before it is
            first served (once per file version); False checks its size only.
        by_range: given the unique shards of a batch (int64 array), True for those whose rows
            are to be read by range requests rather than from a local copy (nothing is
            installed for them). Any shard format works; chunked Arrow shards and Parquet
            files of several row groups cost only the bytes of the chunks read.
        cold_ranges: with a store that has ``ready(shard)`` (a Prefetcher), read the rows of
            shards that are not installed yet by range when they are addressable, instead of
            waiting for the whole shard (the cold-start rule; see the module docstring).

    Thread safety: ``read_batch`` may be called from several threads.
    """

    def __init__(self, source: str | DatasetIndex, *, fields: Sequence[str] | None = None,
                 local_dir: str | None = None, store: ShardStore | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 max_open_shards: int = 256, allow_external_paths: bool = False,
                 fetch: FetchOptions | None = None, verify: bool = True,
                 by_range: Callable[[np.ndarray], np.ndarray] | None = None,
                 cold_ranges: bool = True) -> None:
        self.index = source if isinstance(source, DatasetIndex) else load_index(
            source, storage_options, allow_external_paths=allow_external_paths, fetch=fetch
        )
        self.schema = self.index.schema.select(fields)
        self._owned_dir: str | None = None
        self._own_store = store is None
        if store is None:
            durable = local_dir is not None  # a temporary folder does not outlive a crash
            if local_dir is None:
                local_dir = self._owned_dir = tempfile.mkdtemp(prefix="streamcache-")
            store = NodeCache(self.index, local_dir, fetch_options=fetch, durable=durable,
                              storage_options=storage_options, verify_in_place=verify)
        self.store: ShardStore = store
        self.by_range = by_range
        self.cold_ranges = cold_ranges
        ready = getattr(store, "ready", None)
        self._ready: Callable[[int], bool] | None = ready if callable(ready) else None
        # The cold start: the first steps are read by range, whatever their density, while
        # the store's downloads are held back (hold/release: a Prefetcher), then released.
        self.cold_start_steps = COLD_START_STEPS
        self._cold_steps_left = COLD_START_STEPS if cold_ranges and self._ready else 0
        hold = getattr(store, "hold", None)
        self._release: Callable[[], None] | None = None
        if self._cold_steps_left and callable(hold):
            hold()
            self._release = getattr(store, "release", None)
        self._fetch_options = fetch
        self._storage_options = storage_options
        self._ranges: RangeReader | None = None
        self._own_fetcher: Fetcher | None = None
        self._starts = self.index.shard_table.offsets  # (shared, read-only)
        # Open shards, least recently used first. Dropping one does not unmap it while a
        # gather still holds its buffers; it lets an evicted shard's disk space be freed.
        self._readers: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()
        self._max_open = max(1, max_open_shards)
        self._lock = threading.Lock()
        self._opening: SingleFlight[ShardReader] = SingleFlight()  # each shard opened once
        # Evicted shards are dropped from the open ones (their mapping then goes once no
        # batch refers to it, which frees their disk space): this process's evictions as
        # they happen, other processes' by a look at the open files every few seconds.
        self._evicted: set[int] = set()
        self._inodes: dict[int, tuple[int, int]] = {}  # (st_dev, st_ino) of mapped files
        self._next_sweep = time.monotonic() + SWEEP_S
        cache = getattr(store, "cache", store)
        listen = getattr(cache, "add_eviction_listener", None)
        if callable(listen):
            listen(self._on_evicted)

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

    def _on_evicted(self, shard: int, nbytes: int) -> None:
        """Eviction listener (called by the evicting thread with the cache-wide lock held:
        it only notes the shard)."""
        self._evicted.add(shard)

    def _drop_evicted(self) -> None:
        """Forget the open readers of evicted shards (cheap when there are none)."""
        now = time.monotonic()
        if not self._evicted and now < self._next_sweep:
            return
        gone = set()
        while self._evicted:
            gone.add(self._evicted.pop())
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            with self._lock:
                mapped = dict(self._inodes)
            gone.update(shard for shard, inode in mapped.items() if not self._current(shard, inode))
        if gone:
            with self._lock:
                for shard in gone:
                    self._readers.pop(shard, None)
                    self._inodes.pop(shard, None)

    def _current(self, shard: int, inode: tuple[int, int]) -> bool:
        """Whether the file mapped for ``shard`` is still the one at its path (another process
        evicts by unlinking it)."""
        with self._lock:
            reader = self._readers.get(shard)
        if reader is None:
            return False
        try:
            st = os.stat(reader.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == inode

    def shard_readers(self, shards: list[int]) -> list[ShardReader]:
        """:meth:`shard_reader` of each, with one eviction check and one lock for all."""
        found = self._open_readers(shards)
        return [reader if reader is not None else self.shard_reader(shard)
                for shard, reader in zip(shards, found, strict=True)]

    def _open_readers(self, shards: list[int]) -> list[ShardReader | None]:
        """The readers of ``shards`` open now (None: not open), after one eviction check,
        each marked as used last."""
        self._drop_evicted()
        with self._lock:
            readers = self._readers
            found = [readers.get(shard) for shard in shards]
            for shard, reader in zip(shards, found, strict=True):
                if reader is not None:
                    readers.move_to_end(shard)
        return found

    def shard_reader(self, shard: int) -> ShardReader:
        self._drop_evicted()
        with self._lock:
            reader = self._readers.get(shard)
            if reader is not None:
                self._readers.move_to_end(shard)
                return reader
        return self._opening.run(shard, lambda: self._open_and_keep(shard))

    def _open_and_keep(self, shard: int) -> ShardReader:
        reader = self._open(shard)
        try:
            st = os.stat(reader.path)
            inode: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            inode = None  # (evicted already: the mapping is used for this batch only)
        with self._lock:
            if inode is None:
                return reader
            reader = self._readers.setdefault(shard, reader)
            self._inodes.setdefault(shard, inode)
            while len(self._readers) > self._max_open:
                dropped, _ = self._readers.popitem(last=False)
                self._inodes.pop(dropped, None)
        return reader

    def _open(self, shard: int) -> ShardReader:
        rows = self.index.shards[shard].rows
        for attempt in (1, 2):  # evicted by another process between handed out and mapped
            try:
                return ShardReader(self._readable_path(shard), self.schema,
                                   expected_rows=rows)
            except (FileNotFoundError, FetchError) as error:
                if isinstance(error, FetchError) and self._own_store:
                    # a local file of the wrong size, as DatasetReader has always said
                    corrupt = local_size_error(self.index.shard_url(shard),
                                               self.index.shards[shard].bytes)
                    if corrupt is not None:
                        raise corrupt from error
                if not is_gone(error):
                    raise
                if attempt == 2:
                    raise self._gone(shard) from error
        raise AssertionError("unreachable")

    def _readable_path(self, shard: int) -> str:
        """The store's file of ``shard`` to map: where the store offers it, a finished file
        that is not published yet (a Prefetcher's ``readable_path``)."""
        readable = getattr(self.store, "readable_path", None)
        return readable(shard) if readable is not None else self.store.local_path(shard)

    def _gone(self, shard: int) -> ShardNotFoundError:
        return ShardNotFoundError(
            f"shard {shard} of {self.index.root} ({self.index.shard_url(shard)}) cannot be "
            "found: the dataset was replaced or removed after its index was loaded (a "
            "ShardWriter with overwrite=True removes the old version's shards once the new "
            "index is published); load the dataset again")

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray | Ragged]:
        """The samples ``ids`` as batch arrays, in the order given."""
        shards, rows = self.locate(np.asarray(ids, dtype=np.int64))
        return self.read_located(shards, rows)

    def read_located(self, shards: np.ndarray, rows: np.ndarray, *, first: bool = False,
                     ) -> dict[str, np.ndarray | Ragged]:
        """Rows ``rows[i]`` of shards ``shards[i]`` (index order) as batch arrays; ``first``:
        the first step of a pass (a cold one may take its rows from a download)."""
        unique, which = batch_shards(shards)
        readers, rows = self.batch_readers(unique, which, rows, first=first)
        return gather(readers, which, rows, list(self.schema))

    def read_warm(self, shards: np.ndarray, rows: np.ndarray,
                  ) -> dict[str, np.ndarray | Ragged] | None:
        """:meth:`read_located` where it is a plain gather from shards open already (no
        step of a cold start left, nothing read by range); None otherwise, reading nothing
        (the rows of several steps are read so at once: the cold-start rule counts steps)."""
        if self.by_range is not None or self._cold_steps_left > 0:
            return None
        unique, which = batch_shards(shards)
        found = self._open_readers(unique.tolist())
        readers = [reader for reader in found if reader is not None]
        if len(readers) < len(found):
            return None
        return gather(readers, which, rows, list(self.schema))

    def batch_readers(self, unique: np.ndarray, which: np.ndarray, rows: np.ndarray, *,
                      first: bool = False) -> tuple[list[ShardReader], np.ndarray]:
        """A reader for each shard ``unique[k]`` of a batch, and the rows to gather (row ``i``
        of the batch is ``rows[i]`` of ``unique[which[i]]``): local copies as they are, the
        rows of shards read by range (``by_range``, the cold-start rule) renumbered into the
        in-memory reader of just those rows."""
        self._drop_evicted()
        starting = self._cold_steps_left > 0
        chosen = None
        try:
            chosen = self._ranged(unique, starting)
            if chosen is None:
                return self.shard_readers(unique.tolist()), rows
            return self._read_ranged(unique, which, rows, *chosen, starting, starting and first)
        finally:
            if starting:
                self._cold_step_done(chosen is not None)

    def __getitem__(self, sample_id: int) -> dict[str, Any]:
        batch = self.read_batch([int(sample_id)])
        return {f.name: first_row(f, batch[f.name]) for f in self.schema}

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
        with self._lock:
            readers, self._readers = self._readers, collections.OrderedDict()
            self._inodes.clear()
        for reader in readers.values():
            with contextlib.suppress(Exception):
                reader.close()
        if self._ranges is not None:
            self._ranges.close()
        if self._own_fetcher is not None:
            self._own_fetcher.close()
        self.store.close()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

    def __enter__(self) -> DatasetReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
