"""MixtureFeed: the shards a :class:`~streamcache.StreamDataset` of several sources reads.

The mixture's counterpart of :class:`~streamcache.loading.feed.ShardFeed` (the same methods,
so the dataset treats both alike): each source's index and fields, the mixture's cursor and
orders (:mod:`streamcache.plan.mixture`), prefetch advice over the combined shard space, the
cache budget, and this process's reader over one node cache and one prefetcher
(:mod:`streamcache.loading.mixture_store`). See docs/mixtures.md.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from ..cache.advice import ShardAdvice, working_set_bound, working_set_shards_bound
from ..cache.node import LAYOUT_OVERHEAD, NodeCache
from ..cache.prefetch import Prefetcher
from ..errors import CacheBudgetError, ConfigError
from ..format.index import DatasetIndex, load_index
from ..format.schema import Schema
from ..plan import EpochOrder, PlanError, ShuffleOptions, TailPolicy
from ..plan.mixture import (
    CombinedShards,
    MixtureOrder,
    SourceOrders,
    SourceShape,
    source_seed,
)
from ..plan.mixture_cursor import MixtureCursor, SourceKey
from ..plan.shares import shares_of
from ..plan.units import UnitLayout, concatenate
from ..remote.fetch import Fetcher
from .batching import ID_KEY
from .feed import FeedBase, default_cache_dir, shared_fetchers
from .mixture_store import MixtureCache, MixtureReader, source_caches
from .node_reader import NodeReader, node_reader
from .nodes import NodeLocality, follow_locality, read_by_range, unit_layout, window_rows
from .options import StreamOptions
from .source import SOURCE_KEY, Source, SourceTransforms, data_identity


class MixtureFeed(FeedBase):
    """The shards of a mixture of sources for this process.

    Raises (when made):
        ConfigError: no sources, an item that is not a :class:`Source`, or sources whose
            selected fields differ in names or kinds (the message names the field).
        IndexNotFoundError, StorageError, FetchError: a source's URL cannot be read.

    Thread safety and pickling: as :class:`~streamcache.loading.feed.ShardFeed`'s.
    """

    def __init__(self, sources: Sequence[Source], options: StreamOptions,
                 shuffle: ShuffleOptions) -> None:
        if not isinstance(sources, Sequence):
            raise ConfigError(f"url must be a URL string, a DatasetIndex or a list of "
                              f"streamcache.Source; got {type(sources).__name__}")
        sources = list(sources)
        if not sources or not all(isinstance(s, Source) for s in sources):
            raise ConfigError("a mixture is a non-empty list of streamcache.Source; got "
                              f"{[type(s).__name__ for s in sources]}")
        if shuffle.partitions:
            raise ConfigError(f"partitions={shuffle.partitions} applies to one dataset, not to "
                              "a mixture (its sources' orders are drawn by weight); leave "
                              "partitions unset for a mixture")
        self.sources = sources
        self.options = options
        self.shuffle = shuffle
        storage = [s.storage_options if s.storage_options is not None
                   else options.storage_options for s in sources]
        indexes = _load_indexes(sources, storage, options)
        schemas = _agreeing_schemas(sources, indexes, options.fields)
        self.schema = schemas[0]
        keys = tuple(SourceKey(i.fingerprint, i.num_samples, s.epoch_samples(i.num_samples),
                               data_identity(i, st))
                     for s, i, st in zip(sources, indexes, storage, strict=True))
        # in the order of the list; the mixture reads them in self.read_order (see arrange)
        self.listed = (storage, indexes, schemas, keys, _shares(sources))
        self.locality: NodeLocality | None = None  # this rank's node, set when a pass starts
        self._set_order(tuple(range(len(sources))))

    _ADVISE_BY_SET = True
    _PICKLED = ("sources", "options", "shuffle", "listed", "read_order", "labels", "storage",
                "indexes", "schemas", "schema", "shares", "keys", "locality")

    def arrange(self, order: tuple[int, ...]) -> None:
        """Read the sources in ``order`` (its ``n``-th is the index in the list of the
        mixture's source ``n``): the order a resumed run began with, when its state lists the
        same sources in another order. Batches name each sample's source by its index in
        the list (``__source__``) whatever the order."""
        self.close()  # a reader of the former order (none before the first pass)
        self._set_order(order)

    def _set_order(self, order: tuple[int, ...]) -> None:
        storage, indexes, schemas, keys, shares = self.listed
        self.read_order = order
        self.labels = np.asarray(order, dtype=np.int64)
        self.storage = [storage[j] for j in order]
        self.indexes = [indexes[j] for j in order]
        self.schemas = [schemas[j] for j in order]
        self.keys = tuple(keys[j] for j in order)
        self.shares = tuple(shares[j] for j in order)
        self._forget()

    def _forget(self) -> None:
        self._lock = threading.RLock()
        self._orders: dict[Any, MixtureOrder] = {}
        self._advice: dict[Any, ShardAdvice] = {}
        self._advised: tuple[int, int] | None = None
        self._unit_advices = {}
        self._layouts: dict[int, UnitLayout] = {}
        self._reader: MixtureReader | NodeReader | None = None
        self._reader_pid = -1
        shapes = [SourceShape(i.shard_table.counts(), k.epoch_samples)
                  for i, k in zip(self.indexes, self.keys, strict=True)]
        self._source_orders = [SourceOrders(shape, source_seed(self.options.seed, n),
                                            self.shuffle) for n, shape in enumerate(shapes)]
        self._combined = CombinedShards(shapes)
        self._id_base = self._combined.id_base
        # the shards in use at once: the sources' bounds together (they are read side by side)
        self._working_set_shards = sum(working_set_shards_bound(shape.counts, self.shuffle)
                                       for shape in shapes)

    # ------------------------------------------------------------ cursor and batches

    def start_cursor(self) -> MixtureCursor:
        return MixtureCursor.start(self.keys, self.shares, self.options.seed, self.shuffle,
                                   self.options.infinite)

    def at_epoch(self, cursor: MixtureCursor, epoch: int, global_batch: Callable[[], int],
                 tail: TailPolicy) -> MixtureCursor:
        """The start of ``epoch`` (the cursor itself when it is in that epoch already); an
        infinite mixture's as a schedule of ``global_batch()`` reaches it."""
        if epoch == cursor.epoch:
            return cursor
        return cursor.at_epoch(epoch, global_batch() if cursor.infinite else None, tail)

    def load_cursor(self, data: Any, current: MixtureCursor) -> MixtureCursor:
        """The saved cursor, checked against this mixture's sources (in the order of the
        list or in another: then they are read in the saved order, see :meth:`arrange`),
        with today's weights from the saved position on."""
        *_, keys, shares = self.listed
        listed = MixtureCursor.start(keys, shares, current.seed, current.shuffle,
                                     current.infinite)
        cursor, order = MixtureCursor.load(data, listed, self.options.resume_check)
        if order != self.read_order:
            self.arrange(order)
        return cursor

    def batch_keys(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        """``__source__`` (the index in the list) and ``__id__`` (the id within the source)
        of combined ids."""
        source = np.searchsorted(self._id_base, sample_ids, side="right") - 1
        return {SOURCE_KEY: self.labels[source], ID_KEY: sample_ids - self._id_base[source]}

    def transform(self) -> SourceTransforms | None:
        """The per-sample transform, when a source has one of its own."""
        if all(s.transform is None for s in self.sources):
            return None
        return SourceTransforms([s.transform for s in self.sources], self.options.transform)

    # ------------------------------------------------------------ orders and advice

    def order(self, cursor: MixtureCursor, epoch: int) -> EpochOrder:
        """The order of mixture epoch ``epoch``: the cursor's, or one kept from a schedule
        that reached it, else a later one as reached by reading every position; typed as
        the EpochOrder it duck-types."""
        with self._lock:
            if epoch != cursor.epoch:  # as a schedule reached it, if one did
                kept = [o for o in self._orders.values() if o.epoch == epoch]
                if kept:
                    return cast(EpochOrder, kept[-1])
            plan = cursor.epoch_plan(epoch)
            order = self._orders.get(plan)
            if order is None:
                order = MixtureOrder(self._source_orders, plan, self._combined)
                self._orders = {plan: order, **{p: o for p, o in self._orders.items()
                                                if p.epoch == epoch - 1}}
        return cast(EpochOrder, order)

    def advice(self, cursor: MixtureCursor, epoch: int) -> ShardAdvice:
        order = self.order(cursor, epoch)
        plan = cast(MixtureOrder, order).plan
        with self._lock:
            advice = self._advice.get(plan)
        if advice is None:
            advice = ShardAdvice(order, working_set_shards=self._working_set_shards)
            with self._lock:
                self._advice = {plan: advice, **{p: a for p, a in self._advice.items()
                                                 if p.epoch == epoch - 1}}
        return advice

    def working_set_bytes(self) -> int:
        """The sources' working sets together (each source's order keeps at most its own
        bound in use at once, and a mixture reads them side by side)."""
        return sum(working_set_bound(i.shard_rows,
                                     i.shard_table.raw_or_stored_bytes() + LAYOUT_OVERHEAD,
                                     self.shuffle) for i in self.indexes)

    def check_budget(self, cache_limit: int) -> None:
        needed = self.working_set_bytes()
        if cache_limit < needed:
            raise CacheBudgetError(
                f"cache_limit={cache_limit:,} bytes is below the working set of the mixture: "
                f"its {len(self.sources)} sources, read side by side with a shuffle window of "
                f"{self.shuffle.window} {self.shuffle.window_unit}, keep at most {needed:,} "
                f"bytes of shards in use at once; give at least {needed:,} bytes, or lower "
                "shuffle_window")

    def _follow_locality(self, reader: MixtureReader | NodeReader) -> None:
        if not isinstance(reader, MixtureReader):
            return  # (a node's units: nothing is read by range but their rows)
        for source_reader, base in zip(reader.readers, reader.base.tolist(), strict=True):
            follow_locality(source_reader, self.locality,
                            functools.partial(self._read_by_range, base))

    def _read_by_range(self, base: int, shards: np.ndarray) -> np.ndarray:
        """A source reader's ``by_range``: its shards (``base`` + shard in the combined space)
        that another node owns."""
        return read_by_range(self.locality, np.asarray(shards, dtype=np.int64) + base)

    # ------------------------------------------------------------ reading

    def reader(self, cursor: MixtureCursor) -> MixtureReader | NodeReader:
        """This process's reader (made again after fork): a node's units of every source with
        several nodes (docs/multinode.md), else the sources' shards."""
        with self._lock:
            locality = self.locality
            if (self._reader is None or self._reader_pid != os.getpid()) and (
                    locality is not None and locality.units is not None):
                self._reader = node_reader(self.indexes, self.schema,
                                           default_cache_dir(self.options.cache_dir),
                                           self.options, locality, self.working_set_bytes(),
                                           self._window_rows(), self.storage)
                self._reader_pid = os.getpid()
            if self._reader is None or self._reader_pid != os.getpid():
                self._reader = MixtureReader(self.indexes, self.schemas,
                                             self._make_store(cursor),
                                             storage_options=self.storage)
                self._reader_pid = os.getpid()
                self._follow_locality(self._reader)
            return self._reader

    def _window_rows(self) -> int:
        """Samples of the sources' shuffle windows together (a node scans them ahead)."""
        return sum(window_rows(self.shuffle, i.shard_rows) for i in self.indexes)

    def unit_layout(self, num_nodes: int) -> UnitLayout:
        """How the sources' shards are cut into units for ``num_nodes`` nodes: each source's
        layout, one part of the combined shard space each (kept)."""
        with self._lock:
            layout = self._layouts.get(num_nodes)
        if layout is None:
            layout = concatenate([unit_layout(i, window_rows(self.shuffle, i.shard_rows),
                                              num_nodes) for i in self.indexes])
            with self._lock:
                self._layouts = {num_nodes: layout}
        return layout

    def _make_store(self, cursor: MixtureCursor) -> Prefetcher:
        opts = self.options
        working_set = self.working_set_bytes() if opts.cache_limit is not None else None
        fetchers = shared_fetchers(opts.fetch, self.storage)
        try:
            caches = source_caches(self.indexes, default_cache_dir(opts.cache_dir),
                                   cache_limit=opts.cache_limit, working_set_bytes=working_set,
                                   storage_options=self.storage, fetchers=fetchers,
                                   read_in_place=opts.local_data == "in_place")
        except BaseException:
            for fetcher in set(fetchers):
                fetcher.close()
            raise
        return self._prefetcher(cast(NodeCache, MixtureCache(caches, fetchers)), cursor)

#: Indexes read at once when a mixture is made (remote ones are a request each).
INDEX_THREADS = 16


def _load_indexes(sources: Sequence[Source], storage: Sequence[Mapping[str, Any] | None],
                  options: StreamOptions) -> list[DatasetIndex]:
    """Every source's index, read by up to :data:`INDEX_THREADS` threads (the first error,
    in list order, is raised), with one Fetcher for the sources of the same storage options
    (:func:`feed.shared_fetchers`: a Fetcher each made 8 sources on one store take 1.5-2 s
    to open)."""
    chosen = shared_fetchers(options.fetch, storage)

    def load(source: Source, storage_options: Mapping[str, Any] | None,
             fetcher: Fetcher) -> DatasetIndex:
        if isinstance(source.url, DatasetIndex):
            return source.url
        return load_index(source.url, storage_options,
                          allow_external_paths=options.allow_external_paths,
                          fetch=options.fetch, table_cache=default_cache_dir(options.cache_dir),
                          fetcher=fetcher)

    try:
        if len(sources) == 1:
            return [load(sources[0], storage[0], chosen[0])]
        with ThreadPoolExecutor(min(INDEX_THREADS, len(sources)),
                                thread_name_prefix="streamcache-mixture-index") as pool:
            return list(pool.map(load, sources, storage, chosen))
    finally:
        for fetcher in set(chosen):
            fetcher.close()


def _shares(sources: Sequence[Source]) -> tuple[int, ...]:
    """The sources' weights as shares (plan.mixture.shares_of).

    Raises:
        ConfigError: a weight too small against the others to be represented.
    """
    try:
        return shares_of([s.weight for s in sources])
    except PlanError as error:
        raise ConfigError(str(error)) from None


def _agreeing_schemas(sources: Sequence[Source], indexes: Sequence[DatasetIndex],
                      fields: Sequence[str] | None) -> list[Schema]:
    """Each source's selected fields, in the first source's field order.

    Raises:
        ConfigError: the sources' selected fields differ in names, kinds, dtypes or shapes.
    """
    first = indexes[0].schema.select(sources[0].fields or fields)
    schemas = [first]
    for n, (source, index) in enumerate(zip(sources[1:], indexes[1:], strict=True), start=1):
        mine = index.schema.select(source.fields or fields)
        if set(mine.names) != set(first.names):
            raise ConfigError(
                f"the sources of a mixture must yield the same fields: source 0 has "
                f"{sorted(first.names)}, source {n} has {sorted(mine.names)}; choose common "
                "ones with fields= (on the dataset or on each Source)")
        mine = mine.select(first.names)
        for a, b in zip(first, mine, strict=True):
            if a != b:
                raise ConfigError(
                    f"field {a.name!r} differs between the sources of the mixture: source 0 "
                    f"has {a}, source {n} has {b}; a batch stacks every source's rows, so "
                    "the kinds, dtypes and shapes must match")
        schemas.append(mine)
    return schemas


__all__ = ["MixtureFeed"]
