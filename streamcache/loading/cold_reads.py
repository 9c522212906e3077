"""The cold-start part of :class:`~streamcache.loading.dataset_reader.DatasetReader`
(a base class: its state is the reader's, set by the reader's constructor): which of a
batch's shards are read by range instead of from a local copy, those reads, and the first
step's rows taken from a download while its install decodes it. The module docstring of
dataset_reader.py states the rule.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cache.ranges import RangeReader, RangeStats
from ..errors import ShardNotFoundError, StreamcacheError
from ..format.index import DatasetIndex
from ..format.reader import ShardReader
from ..format.schema import Schema
from ..processes import node_ranks, node_readers
from ..remote.fetch import Fetcher
from ..remote.options import FetchOptions
from ..remote.retry import FetchError


def is_gone(error: BaseException) -> bool:
    """Whether ``error`` says a shard's file or object is not there (a local file vanished,
    or a download found no object), rather than one of streamcache's own errors."""
    if isinstance(error, FetchError):
        return error.permanent and isinstance(error.cause, FileNotFoundError)
    return not isinstance(error, StreamcacheError)


class ColdReads:
    """Reads by range and the cold-start rule, for :class:`DatasetReader`."""

    index: DatasetIndex
    schema: Schema
    store: Any
    by_range: Callable[[np.ndarray], np.ndarray] | None
    cold_ranges: bool
    _ready: Callable[[int], bool] | None
    _cold_steps_left: int
    _release: Callable[[], None] | None
    _fetch_options: FetchOptions | None
    _storage_options: Mapping[str, Any] | None
    _ranges: RangeReader | None
    _own_fetcher: Fetcher | None
    _readers: Any
    _lock: threading.Lock

    if TYPE_CHECKING:  # the reader's own methods, defined in dataset_reader.py
        def shard_reader(self, shard: int) -> ShardReader: ...
        def _gone(self, shard: int) -> ShardNotFoundError: ...

    def _cold_step_done(self, ranged: bool) -> None:
        """One of the first steps was read: after the last one (or a step with no cold shard:
        the cache is warm), release the store's downloads."""
        with self._lock:
            self._cold_steps_left = self._cold_steps_left - 1 if ranged else 0
            release = self._release if self._cold_steps_left <= 0 else None
            if release is not None:
                self._release = None
        if release is not None:
            release()

    def _read_ranged(self, unique: np.ndarray, which: np.ndarray, rows: np.ndarray,
                     ranged: np.ndarray, cold: np.ndarray, starting: bool, first: bool,
                     ) -> tuple[list[ShardReader], np.ndarray]:
        """:meth:`batch_readers` when some shards are read by range; ``first``: a cold
        start's first step, which takes the rows too dense for a cold read from the download
        while the install decodes it (later steps' decodes slowed the installs more)."""
        rows = np.array(rows, dtype=np.int64)
        ranges = self.range_reader()
        pending: dict[int, Future[tuple[ShardReader, np.ndarray] | None]] = {
            k: ranges.submit(int(unique[k]), rows[which == k], cold=bool(cold[k]),
                             dense=starting)
            for k in np.flatnonzero(ranged).tolist()}
        # (the shards that are not range-read are opened, or awaited, meanwhile)
        found: list[ShardReader | None] = [None if ranged[k] else self.shard_reader(int(s))
                                           for k, s in enumerate(unique)]
        for k, future in pending.items():
            try:
                result = future.result()
            except (FileNotFoundError, FetchError, StreamcacheError) as error:
                if cold[k]:
                    # a cold read is a shortcut: whatever failed it (a server that gets
                    # ranges wrong, a chunk that fails its digest), the install fetches the
                    # whole object and verifies it, and raises its own error if it must
                    result = None
                elif not is_gone(error):
                    raise
                else:
                    raise self._gone(int(unique[k])) from error
            if result is None and first:  # too dense for a cold read: the first step takes
                # the rows from the download while the install decodes it
                result = self._from_download(int(unique[k]), rows[which == k])
            if result is None:
                found[k] = self.shard_reader(int(unique[k]))
            else:
                found[k], rows[which == k] = result
        return [r for r in found if r is not None], rows

    def _from_download(self, shard: int, rows: np.ndarray,
                       ) -> tuple[ShardReader, np.ndarray] | None:
        """Rows of ``shard`` from its downloaded bytes while this process's install decodes
        them, or None where the store does not offer them (installed already, too large to
        hold in memory, installed by another process): the caller awaits the install."""
        downloaded = getattr(self.store, "downloaded", None)
        if downloaded is None or not self.index.shards[shard].chunked:
            return None  # (only a chunked shard's chunks are decoded alone)
        data = downloaded(shard)
        if data is None:
            return None
        try:
            return self.range_reader().read_rows(shard, rows, source=data)
        except (FetchError, StreamcacheError):
            return None  # (a shortcut: the install verifies and raises its own error)

    def _ranged(self, unique: np.ndarray, starting: bool = False,
                ) -> tuple[np.ndarray, np.ndarray] | None:
        """Which of a batch's shards to read by range, and which of those by the cold-start
        rule (None: none of them); ``starting``: one of the first steps (no cold budget)."""
        if self.by_range is None:  # the warm path, every step: decide in a few microseconds
            if not self.cold_ranges or self._ready is None:
                return None
            with self._lock:
                readers = self._readers
                if all(s in readers for s in unique.tolist()):
                    return None  # every shard of the batch is open already: none is cold
        picked = np.zeros(unique.shape, bool)
        if self.by_range is not None:
            picked = np.asarray(self.by_range(unique), dtype=bool)
            if picked.shape != unique.shape:
                raise ValueError(f"by_range returned {picked.shape} flags for "
                                 f"{unique.shape[0]} shards")
        cold = np.zeros(unique.shape, bool)
        if self.cold_ranges and self._ready is not None:
            with self._lock:
                open_now = set(self._readers)
            ready = self._ready
            ranges = self.range_reader()
            cold = ~picked & np.array(
                [s not in open_now and not ready(s) and ranges.addressable(s)
                 and (starting or ranges.cold_budget_left(s)) for s in unique.tolist()], bool)
        ranged = picked | cold
        return (ranged, cold) if ranged.any() else None

    def range_reader(self) -> RangeReader:
        """The reader of rows by range (made on first use; it shares the store's Fetcher
        when the store has one, so its options and concurrency bound apply)."""
        with self._lock:
            if self._ranges is None:
                fetcher = getattr(self.store, "fetcher", None)
                if not isinstance(fetcher, Fetcher):
                    options = self._fetch_options or FetchOptions()
                    if self._storage_options is not None:
                        options = dataclasses.replace(
                            options, storage_options=dict(self._storage_options))
                    fetcher = self._own_fetcher = Fetcher(options)
                self._ranges = RangeReader(self.index, fetcher, schema=self.schema,
                                           budget_share=1 / node_readers(),
                                           node_ranks=node_ranks())
            return self._ranges

    @property
    def range_stats(self) -> RangeStats:
        """What range reads cost so far (all zero when there were none)."""
        with self._lock:
            ranges = self._ranges
        return ranges.stats if ranges is not None else RangeStats()


__all__ = ["ColdReads", "is_gone"]
