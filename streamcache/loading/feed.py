"""ShardFeed: the shards a :class:`~streamcache.StreamDataset` reads, and how they get here.

Each epoch's order and shard advice (where each shard is read), the cache budget the plan's
working set allows, and this process's :class:`~streamcache.loading.dataset_reader.DatasetReader`
over the node cache and its prefetcher, which the feed tells what the plan reads next.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..cache.advice import ShardAdvice, working_set_bound
from ..cache.node import LAYOUT_OVERHEAD, NodeCache
from ..cache.prefetch import Prefetcher, PrefetchOptions
from ..errors import CacheBudgetError
from ..format.index import DatasetIndex
from ..plan import Cursor, EpochOrder, ShuffleOptions
from ..plan.units import UnitLayout
from ..remote.fetch import Fetcher
from ..remote.options import FetchOptions
from .batching import ID_KEY
from .dataset_reader import DatasetReader, ShardStore
from .node_reader import NodeReader, node_reader
from .nodes import (
    NodeLocality,
    UnitAdvice,
    advise_units,
    by_range_option,
    follow_locality,
    node_working_set,
    read_by_range,
    unit_layout,
    upcoming_on_node,
    window_rows,
)
from .options import StreamOptions
from .source import data_identity


class FeedBase:
    """What the feed of one dataset and a mixture's share: the prefetch advice, the node's
    locality, the prefetcher over a cache, closing, and pickling the configuration only.

    A subclass has ``options``, ``locality``, ``_lock``, ``_reader``, ``_reader_pid`` and
    ``_advised``, implements ``reader``, ``advice``, ``_forget`` and ``_follow_locality``,
    and names the attributes that travel to worker processes in ``_PICKLED``.
    """

    _PICKLED: tuple[str, ...] = ()
    #: Re-send the advice when the set of upcoming shards changes (a mixture, whose first
    #: upcoming shard changes at nearly every step) rather than its first shard.
    _ADVISE_BY_SET = False
    options: StreamOptions
    locality: NodeLocality | None
    _lock: threading.RLock
    _reader: Any
    _reader_pid: int
    _advised: tuple[int, int] | None
    _unit_advices: dict[int, UnitAdvice]

    def reader(self, cursor: Any) -> Any:
        raise NotImplementedError

    def order(self, cursor: Any, epoch: int) -> Any:
        raise NotImplementedError

    def _window_rows(self) -> int:
        """Samples of a shuffle window (a node's units are scanned a window ahead)."""
        raise NotImplementedError

    def advice(self, cursor: Any, epoch: int) -> ShardAdvice:
        raise NotImplementedError

    def _forget(self) -> None:
        raise NotImplementedError

    def _follow_locality(self, reader: Any) -> None:
        """Point this process's reader at :attr:`locality` (its ``by_range``)."""
        raise NotImplementedError

    def advise(self, cursor: Any, epoch: int, position: int, global_batch: int) -> None:
        """Tell the prefetcher (and the cache's eviction) what the reader needs next: this
        node's shards only, with several nodes."""
        store = self.reader(cursor).store
        if not isinstance(store, Prefetcher):
            return
        where = (epoch, position, global_batch)
        if self.locality is not None and self.locality.units is not None:  # a node's units
            self._advised = advise_units(store, self._unit_advice(cursor, epoch),
                                         self.options.prefetch, where, self._advised)
            return
        self._advised = advise_store(store, self.advice(cursor, epoch), self.options.prefetch,
                                     self.locality, where, self._advised,
                                     by_set=self._ADVISE_BY_SET)

    def use_locality(self, locality: NodeLocality) -> None:
        """This rank's node, resolved when a pass starts: the advice to the prefetcher and
        the reader's ``by_range`` follow it."""
        self.locality = locality
        with self._lock:
            reader = self._reader if self._reader_pid == os.getpid() else None
            if reader is not None and isinstance(reader, NodeReader) != (
                    locality.units is not None):
                self._reader = None  # (a node's units, or whole shards: made again)
                self._unit_advices = {}
        if reader is not None and self._reader is None:
            reader.close()
        elif reader is not None:
            self._follow_locality(reader)

    def _unit_advice(self, cursor: Any, epoch: int) -> UnitAdvice:
        """The advice of this node's units in ``epoch`` (this and the previous kept)."""
        with self._lock:
            advice = self._unit_advices.get(epoch)
        if advice is None:
            assert self.locality is not None
            advice = self.locality.unit_advice(self.order(cursor, epoch), self._window_rows())
            with self._lock:
                self._unit_advices = {epoch: advice, **{
                    e: a for e, a in self._unit_advices.items() if e == epoch - 1}}
        return advice

    def _prefetcher(self, cache: NodeCache, cursor: Any) -> Prefetcher:
        """A prefetcher over ``cache`` that keeps the plan's working set ahead."""
        prefetch = self.options.prefetch or PrefetchOptions()
        lookahead = prefetch.lookahead(self.advice(cursor, cursor.epoch).working_set_shards())
        return Prefetcher(cache, dataclasses.replace(prefetch, lookahead_shards=lookahead))

    def close(self) -> None:
        """Close this process's reader (a forked copy's belongs to its parent)."""
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None and self._reader_pid == os.getpid():
            reader.close()

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._forget()


class ShardFeed(FeedBase):
    """The shards of one dataset for this process.

    The cursor is passed in, not kept: the dataset's cursor moves (the loader replaces it), and
    the epoch it is in reads its order through it (which checks the cursor fits the shards).

    Thread safety: every method may be called from any thread. Pickling (for worker processes)
    keeps the configuration only: orders, advice and the reader (file locks and threads do not
    fork) are made again in the process that uses them.
    """

    def __init__(self, index: DatasetIndex, fields: Sequence[str], options: StreamOptions,
                 shuffle: ShuffleOptions, fetcher: Fetcher | None = None) -> None:
        """``fetcher``: the one the index was read with (:func:`dataset_fetcher`), handed to
        this process's first cache, so that its client and connections are not made twice."""
        self.index = index
        self.fields = fields
        self.options = options
        self.shuffle = shuffle
        self.locality: NodeLocality | None = None  # this rank's node, set when a pass starts
        self._forget()
        self._fetcher = fetcher  # (_forget: None after unpickling)

    _PICKLED = ("index", "fields", "options", "shuffle", "locality")
    _fetcher: Fetcher | None

    def _forget(self) -> None:
        self._lock = threading.RLock()  # the reader is built under it
        self._orders: dict[int, EpochOrder] = {}
        self._advice: dict[int, ShardAdvice] = {}
        self._advised: tuple[int, int] | None = None
        self._unit_advices = {}
        self._layouts: dict[int, UnitLayout] = {}
        self._reader: DatasetReader | NodeReader | None = None
        self._reader_pid = -1
        self._fetcher = None  # not handed to a cache yet (never pickled)

    def close(self) -> None:
        super().close()
        with self._lock:
            fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:
            fetcher.close()

    def start_cursor(self) -> Cursor:
        return Cursor(self.index.fingerprint, self.index.num_samples, self.options.seed,
                      self.shuffle, data=data_identity(self.index, self.options.storage_options))

    def at_epoch(self, cursor: Cursor, epoch: int) -> Cursor:
        """The start of ``epoch`` (the cursor itself when it is in that epoch already)."""
        return cursor if epoch == cursor.epoch else dataclasses.replace(
            cursor, epoch=epoch, samples_consumed=0)

    def load_cursor(self, data: Any, current: Cursor) -> Cursor:
        """A saved cursor, checked against this dataset and order (strict)."""
        return Cursor.load(data, dataset_fingerprint=current.dataset_fingerprint,
                           num_samples=current.num_samples, seed=current.seed,
                           shuffle=current.shuffle, identity=current.data,
                           check=self.options.resume_check)

    def batch_keys(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        return {ID_KEY: sample_ids}

    def transform(self) -> None:
        return None  # only a mixture's sources bring transforms of their own

    def order(self, cursor: Cursor, epoch: int) -> EpochOrder:
        """The sample order of ``epoch`` (this and the previous epoch's are kept)."""
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                counts = self.index.shard_table.counts()
                order = cursor.order(counts) if epoch == cursor.epoch \
                    else EpochOrder(counts, cursor.seed, epoch, self.shuffle)
                self._orders = {epoch: order, **{e: o for e, o in self._orders.items()
                                                 if e == epoch - 1}}
        return order

    def first_order(self, cursor: Cursor) -> EpochOrder:
        """The order of epoch 0, from which a multi-node job chooses the pieces two nodes hold
        (plan/backup_plan.py): the pass's own at epoch 0 (its blocks read once for both), else
        made anew (the orders kept are the pass's)."""
        if cursor.epoch == 0:
            return self.order(cursor, 0)
        return EpochOrder(self.index.shard_table.counts(), cursor.seed, 0, self.shuffle)

    def advice(self, cursor: Cursor, epoch: int) -> ShardAdvice:
        """Where each shard is read in ``epoch`` (for prefetching and eviction)."""
        with self._lock:
            advice = self._advice.get(epoch)
        if advice is None:
            advice = ShardAdvice(self.order(cursor, epoch))
            with self._lock:
                self._advice = {epoch: advice, **{e: a for e, a in self._advice.items()
                                                  if e == epoch - 1}}
        return advice

    def working_set_bytes(self) -> int:
        """Local bytes of shards that no epoch keeps in use at once: a bound the plan
        guarantees (:func:`~streamcache.cache.advice.working_set_bound`), the same for every
        epoch, rank and worker, so a budget accepted once holds for the whole run."""
        sizes = self.index.shard_table.raw_or_stored_bytes() + LAYOUT_OVERHEAD
        return working_set_bound(self.index.shard_rows, sizes, self.shuffle)

    def check_budget(self, cache_limit: int, num_nodes: int = 1) -> None:
        """Raises :class:`CacheBudgetError` if ``cache_limit`` is below what a node's cache
        must hold at once: the working set, or with several nodes the node's share of it."""
        needed = self.working_set_bytes()
        what = "the working set"
        if num_nodes > 1:
            layout = self.unit_layout(num_nodes)
            if layout.any_cut:
                needed = node_working_set([self.index], layout, needed, num_nodes)
                what = f"a node's share of the working set with {num_nodes} nodes"
        if cache_limit < needed:
            raise CacheBudgetError(
                f"cache_limit={cache_limit:,} bytes is below {what}: with a shuffle "
                f"window of {self.shuffle.window} {self.shuffle.window_unit}, any epoch keeps "
                f"at most {needed:,} bytes of shards in use at once (a bound the plan "
                f"guarantees, checked once for every epoch); give at least {needed:,} bytes, "
                "or lower shuffle_window"
            )

    def reader(self, cursor: Cursor) -> DatasetReader | NodeReader:
        """This process's reader (made again after fork: file locks and threads do not fork):
        a node's units with several nodes (docs/multinode.md), else the dataset's shards."""
        with self._lock:
            locality = self.locality
            if (self._reader is None or self._reader_pid != os.getpid()) and (
                    locality is not None and locality.units is not None):
                self._reader = node_reader([self.index], self.index.schema.select(self.fields),
                                           default_cache_dir(self.options.cache_dir),
                                           self.options, locality, self.working_set_bytes(),
                                           self._window_rows())
                self._reader_pid = os.getpid()
            if self._reader is None or self._reader_pid != os.getpid():
                self._reader = DatasetReader(self.index, fields=self.fields,
                                             store=self._make_store(cursor),
                                             storage_options=self.options.storage_options,
                                             **by_range_option(DatasetReader, self.locality,
                                                               self._read_by_range))
                self._reader_pid = os.getpid()
            return self._reader

    def _follow_locality(self, reader: DatasetReader | NodeReader) -> None:
        follow_locality(reader, self.locality, self._read_by_range)

    def _window_rows(self) -> int:
        return window_rows(self.shuffle, self.index.shard_rows)

    def unit_layout(self, num_nodes: int) -> UnitLayout:
        """How this dataset's shards are cut into units for ``num_nodes`` nodes (kept)."""
        with self._lock:
            layout = self._layouts.get(num_nodes)
        if layout is None:
            layout = unit_layout(self.index, self._window_rows(), num_nodes)
            with self._lock:
                self._layouts = {num_nodes: layout}
        return layout

    def _read_by_range(self, shards: np.ndarray) -> np.ndarray:
        """The reader's ``by_range``: the shards another node caches (none on one node)."""
        return read_by_range(self.locality, shards)

    def _make_store(self, cursor: Cursor) -> ShardStore:
        opts = self.options
        folder = default_cache_dir(opts.cache_dir)
        working_set = self.working_set_bytes() if opts.cache_limit is not None else None
        fetcher, self._fetcher = self._fetcher, None  # (the caller holds the lock)
        if fetcher is not None and fetcher.closed:
            fetcher = None
        try:
            cache = NodeCache(self.index, folder, cache_limit=opts.cache_limit,
                              working_set_bytes=working_set, fetcher=fetcher,
                              owns_fetcher=True, fetch_options=opts.fetch,
                              storage_options=opts.storage_options,
                              read_in_place=opts.local_data == "in_place")
        except BaseException:
            if fetcher is not None:
                fetcher.close()
            raise
        return self._prefetcher(cache, cursor)


# made once: PrefetchOptions() checks its fields (microseconds), and advise_store runs each step
_DEFAULT_PREFETCH = PrefetchOptions()


def advise_store(store: Prefetcher, advice: ShardAdvice, prefetch: PrefetchOptions | None,
                 locality: NodeLocality | None, where: tuple[int, int, int],
                 advised: tuple[int, int] | None, *, by_set: bool = False,
                 ) -> tuple[int, int] | None:
    """Give ``store`` the shards the reader needs next from ``where`` = (epoch, position,
    global batch), this node's only; returns what to pass as ``advised`` next time (the
    advice is sent again when the first upcoming shard changes, or with ``by_set`` the set of
    upcoming shards, and every so often: with ``by_set`` every as many positions as there
    are upcoming shards, so that a step costs what it reads, not what the lookahead holds)."""
    epoch, position, global_batch = where
    count = (prefetch or _DEFAULT_PREFETCH).lookahead(advice.working_set_shards())
    shards, next_use = upcoming_on_node(locality, advice, position, count)
    refresh = max(1, advice.stride * 16)
    if by_set:
        key = (epoch, hash(np.sort(shards).tobytes()))
        refresh = max(refresh, advice.stride * len(shards))
    else:
        key = (epoch, int(shards[0]) if len(shards) else -1)
    if key != advised or position % refresh < global_batch:
        store.update(shards, next_use)
        return key
    return advised


def dataset_fetcher(fetch: FetchOptions | None,
                    storage_options: Mapping[str, Any] | None) -> Fetcher:
    """The Fetcher a dataset reads its index with and its first cache downloads with: the
    options a :class:`NodeCache` would make its own from."""
    fetch = fetch or FetchOptions()
    if storage_options is not None:
        fetch = dataclasses.replace(fetch, storage_options=dict(storage_options))
    return Fetcher(fetch)


def options_key(storage_options: Mapping[str, Any] | None) -> str:
    """Equal for equal storage options (a value JSON cannot write compares by its repr: two
    such options may get two Fetchers, never one for different options). Take it before the
    options are used: s3fs rewrites parts of the options it is given."""
    return json.dumps(storage_options, sort_keys=True, default=repr)


def shared_fetchers(fetch: FetchOptions | None,
                    storage: Sequence[Mapping[str, Any] | None]) -> list[Fetcher]:
    """A Fetcher for each of ``storage`` (a mixture's sources), one per distinct options:
    each makes its own client (an S3 client costs ~0.1-0.2 s, one after another on fsspec's
    event loop), so sources on one store share one."""
    keys = [options_key(options) for options in storage]
    made: dict[str, Fetcher] = {}
    for key, options in zip(keys, storage, strict=True):
        if key not in made:
            made[key] = dataset_fetcher(fetch, options)
    return [made[key] for key in keys]


def default_cache_dir(cache_dir: str | os.PathLike[str] | None) -> str:
    """``cache_dir``, else $STREAMCACHE_CACHE_DIR, else ~/.cache/streamcache."""
    if cache_dir is not None:
        return os.fspath(cache_dir)
    return os.environ.get("STREAMCACHE_CACHE_DIR") or \
        os.path.join(os.path.expanduser("~"), ".cache", "streamcache")
