"""A node's reader in a multi-node job: rows from the units the node holds.

A row of a piece this node owns is read from the piece, installed in the node's
:class:`~streamcache.cache.units.UnitCache` by the prefetcher ahead of use. A row of another
node's piece (one of the few that balance the nodes) is read from its chunk, installed as a
chunk unit on first use (one verified range read of the chunk) and kept under the cache's
budget and eviction by next use, so a chunk is fetched at most once while its rows are read,
and by one rank of the node for all of them. Rows of other nodes' shards that are not cut
(not chunked) are read by range by a :class:`~streamcache.loading.dataset_reader.DatasetReader`
as before. One native gather reads them all: the batch is the one any reader would give.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..cache.prefetch import Prefetcher, PrefetchOptions
from ..cache.ranges import RangeStats
from ..cache.units import UnitCache
from ..errors import ShardNotFoundError
from ..format.index import DatasetIndex
from ..format.reader import Ragged, ShardReader, gather
from ..format.schema import Schema
from ..plan.locality import LocalityAssignment
from ..plan.unit_columns import CHUNK, PIECE
from ..plan.units import UnitLayout
from ..remote.fetch import Fetcher
from .dataset_reader import DatasetReader
from .mixture_store import MixtureCache
from .nodes import NodeLocality, node_working_set, scan_span, units_in_span
from .single_flight import SingleFlight

#: Open readers of units kept per process (a window's pieces and the chunks in use).
MAX_OPEN_UNITS = 4096
#: Units of one step opened at once (each waits for its install in native code, GIL free).
OPENING_THREADS = 8


class _RangeOnly:
    """The store of the reader of other nodes' uncut shards: everything it reads is read by
    range (its ``by_range`` is always True); it shares the node cache's Fetcher."""

    def __init__(self, fetcher: Fetcher) -> None:
        self.fetcher = fetcher

    def local_path(self, shard: int) -> str:
        raise ShardNotFoundError(f"shard {shard} belongs to another node: its rows are read "
                                 "by range, never installed here")

    def close(self) -> None:
        pass


class NodeReader:
    """Reads a step's rows on one node of a multi-node job (see the module docstring).

    Args:
        indexes: the dataset's index; a mixture's sources' (in the order of its combined
            shard space, one part of the layout each).
        schema: the fields to read.
        store: the node's unit store (a Prefetcher over a UnitCache, or over a MixtureCache of
            the sources' UnitCaches): ``local_path(key)``, keys as the layout numbers them
            (:meth:`~streamcache.plan.units.UnitLayout.piece_keys`).
        fetcher: the Fetcher of range reads of other nodes' uncut shards.
        assignment: the split (its layout and owners).
        node: this node.
        storage_options: each source's fsspec options (None: the Fetcher's).

    Owns: up to :data:`OPENING_THREADS` named daemon threads (``streamcache-units-*``) that
    open a step's units at once, made on first use (again in a forked child), stopped by
    :meth:`close`.

    Thread safety: ``read_located`` may be called from several threads.
    """

    def __init__(self, indexes: Sequence[DatasetIndex], schema: Schema, store: Prefetcher,
                 fetcher: Fetcher, assignment: LocalityAssignment, node: int,
                 storage_options: Sequence[Mapping[str, Any] | None] | None = None) -> None:
        assert assignment.layout is not None
        self.indexes = list(indexes)
        self.schema = schema
        self.store = store
        self.layout: UnitLayout = assignment.layout
        self.assignment = assignment
        self.node = node
        self.base = np.cumsum([0] + [len(i.shards) for i in indexes])[:-1].astype(np.int64)
        storage = list(storage_options or [None] * len(self.indexes))
        self.ranged = [DatasetReader(index, fields=schema.names, store=_RangeOnly(fetcher),
                                     by_range=_everything, cold_ranges=False,
                                     storage_options=options)
                       for index, options in zip(self.indexes, storage, strict=True)]
        self._readers: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._opening: SingleFlight[ShardReader] = SingleFlight()  # each unit opened once
        self._opener: ThreadPoolExecutor | None = None
        self._opener_pid = -1

    def read_located(self, shards: np.ndarray, rows: np.ndarray, *, first: bool = False,
                     ) -> dict[str, np.ndarray | Ragged]:
        """Rows ``rows[i]`` of shards ``shards[i]`` (index order) as batch arrays (``first``
        is DatasetReader's hint; a node's units are not offered from downloads)."""
        shards = np.asarray(shards, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        units, local = self.units_of(shards, rows)
        held = units >= 0
        unique, which = np.unique(units[held], return_inverse=True)
        readers = self.unit_readers(unique.tolist())
        which_all = np.empty(shards.size, dtype=np.int32)
        which_all[held] = which
        if not held.all():  # rows of other nodes' uncut shards: by range
            self._ranged_readers(shards, rows, ~held, readers, which_all, local)
        return gather(readers, which_all, local, list(self.schema))

    def _ranged_readers(self, shards: np.ndarray, rows: np.ndarray, ranged: np.ndarray,
                        readers: list[ShardReader], which: np.ndarray,
                        local: np.ndarray) -> None:
        """Readers of the ``ranged`` rows from their sources' range readers, appended to
        ``readers`` (``which`` and ``local`` filled for those rows)."""
        source = np.searchsorted(self.base, shards, side="right") - 1
        for s in np.unique(source[ranged]).tolist():
            rows_here = ranged & (source == s)
            others, which_other = np.unique(shards[rows_here], return_inverse=True)
            found, local[rows_here] = self.ranged[s].batch_readers(
                others - self.base[s], which_other.astype(np.int32), rows[rows_here])
            which[rows_here] = which_other + len(readers)
            readers.extend(found)

    def units_of(self, shards: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The unit each row is read from (its piece where this node holds it, else its chunk;
        -1: a row of another node's uncut shard) and its row there."""
        layout = self.layout
        mine = self.assignment.holds(shards, rows, self.node)
        units = np.where(mine, layout.piece_keys(shards, rows), layout.chunk_keys(shards, rows))
        piece, chunk = layout.lookup(shards, (PIECE, CHUNK))
        local = np.where(mine, rows % piece, rows % np.maximum(chunk, 1))
        return units, local

    def unit_readers(self, units: list[int]) -> list[ShardReader]:
        """Readers of ``units``: those not open yet are opened (installed first where
        needed) at once, each on a thread of its own, so that a step waits for its slowest
        unit, not for the sum of them."""
        with self._lock:
            missing = [u for u in units if u not in self._readers]
        if len(missing) > 1:
            for future in [self._pool().submit(self.unit_reader, u) for u in missing]:
                future.result()
        return [self.unit_reader(u) for u in units]

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._opener is None or self._opener_pid != os.getpid():
                self._opener = ThreadPoolExecutor(OPENING_THREADS,
                                                  thread_name_prefix="streamcache-units")
                self._opener_pid = os.getpid()
            return self._opener

    def unit_reader(self, unit: int) -> ShardReader:
        """A reader of unit ``unit``, installed first if needed (the prefetcher's queue)."""
        with self._lock:
            reader = self._readers.get(unit)
            if reader is not None:
                self._readers.move_to_end(unit)
                return reader
        return self._opening.run(unit, lambda: self._open_and_keep(unit))

    def _open_and_keep(self, unit: int) -> ShardReader:
        reader = self._open(unit)
        with self._lock:
            reader = self._readers.setdefault(unit, reader)
            while len(self._readers) > MAX_OPEN_UNITS:
                self._readers.popitem(last=False)
        return reader

    def _open(self, unit: int) -> ShardReader:
        rows = self.layout.key_rows(unit)
        for attempt in (1, 2):  # evicted by another process between handed out and mapped
            path = self.store.local_path(unit)
            try:
                return ShardReader(path, self.schema, expected_rows=rows,
                                   copy_of=self.store.copy_of(unit))
            except FileNotFoundError as error:
                if attempt == 2:
                    raise ShardNotFoundError(
                        f"unit {unit} ({path}) was evicted as soon as it was installed, "
                        "twice: cache_limit is too tight for the processes sharing the "
                        "cache; raise it") from error
        raise AssertionError("unreachable")

    @property
    def range_stats(self) -> RangeStats:
        """What range reads of other nodes' uncut shards cost so far (the first source's)."""
        return self.ranged[0].range_stats

    def close(self) -> None:
        with self._lock:
            readers, self._readers = self._readers, collections.OrderedDict()
            opener, self._opener = self._opener, None
        if opener is not None and self._opener_pid == os.getpid():
            opener.shutdown(wait=True, cancel_futures=True)
        for reader in readers.values():
            with contextlib.suppress(Exception):
                reader.close()
        for ranged in self.ranged:
            ranged.close()
        self.store.close()


def _everything(shards: np.ndarray) -> np.ndarray:
    return np.ones(np.shape(shards), dtype=bool)




def node_reader(indexes: Sequence[DatasetIndex], schema: Schema, folder: str, options: Any,
                locality: NodeLocality, working_set: int, window: int,
                storage_options: Sequence[Mapping[str, Any] | None] | None = None,
                ) -> NodeReader:
    """The reader of one node of a multi-node job: a Prefetcher over a UnitCache of each
    source's units on ``folder`` (a mixture's together in a MixtureCache), with ``options`` a
    StreamOptions (cache_limit, fetch, prefetch, storage_options), ``locality`` a NodeLocality
    that holds units (one part of its layout per source), ``working_set`` the data's whole
    working set (the cache must hold the node's share of it) and ``window`` the samples of a
    shuffle window.

    Raises:
        CacheBudgetError: ``cache_limit`` below the node's share of the working set.
    """
    layout = locality.units
    assert layout is not None and locality.split is not None
    storage = list(storage_options or [options.storage_options] * len(indexes))
    share = node_working_set(indexes, layout, working_set, locality.num_nodes)
    caches = [UnitCache(index, layout.part(n), folder, cache_limit=options.cache_limit,
                        working_set_bytes=share, fetch_options=options.fetch,
                        storage_options=storage[n])
              for n, index in enumerate(indexes)]
    cache: Any = caches[0] if len(caches) == 1 else MixtureCache(caches)
    prefetch = options.prefetch or PrefetchOptions()
    ahead = units_in_span(layout, locality.num_nodes, scan_span(window, layout.num_samples))
    store = Prefetcher(cache, dataclasses.replace(
        prefetch, lookahead_shards=prefetch.lookahead(ahead)))
    return NodeReader(indexes, schema, store, caches[0].fetcher, locality.split,
                      locality.topology.node_rank, storage)


__all__ = ["MAX_OPEN_UNITS", "NodeReader", "node_reader"]
