"""The shards of a mixture in one node cache, one prefetcher and one reader.

Each source keeps its own :class:`~streamcache.cache.node.NodeCache` (its identity, its folder
under ``datasets/``), all on the same ``cache_dir`` with the same ``cache_limit``, so the
budget is one (the accounting file covers the whole folder). :class:`MixtureCache` puts them
in the mixture's combined shard space (source ``s``'s shard ``k`` is ``base[s] + k``) for one
:class:`~streamcache.cache.prefetch.Prefetcher`: one queue, one set of download threads, one
plan of first uses across sources. Eviction compares every source's shards by their next use
in that one plan (:class:`SourceCache`), never treating another source's shard as unneeded.
:class:`MixtureReader` gathers a step's rows from every source in one native gather.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast, overload

import numpy as np

from ..cache.accounting import EvictionListener
from ..cache.node import NodeCache
from ..cache.prefetch import Prefetcher
from ..format.index import DatasetIndex, ShardInfo
from ..format.reader import Ragged, ShardReader, gather
from ..format.schema import Schema
from ..remote.fetch import Fetcher
from .dataset_reader import DatasetReader


class SourceCache(NodeCache):
    """A source's node cache that knows its sibling sources' next uses for eviction.

    ``peers`` maps each sibling's dataset key (``datasets/<folder>``) to its cache; the
    caches of one mixture share the dict. Opening a cache sweeps dead processes'
    temporaries and rebuilds the folder's accounting from its files: the mixture's first
    cache does it for the whole folder, its siblings (made right after, on the same folder)
    do not repeat it (with 500 sources that walk ran 500 times: 69 s of a 99 s first batch).
    """

    peers: dict[str, NodeCache]

    def __init__(self, *args: Any, peers: dict[str, NodeCache], **options: Any) -> None:
        self.peers = peers
        super().__init__(*args, **options)
        peers[self._dataset_key] = self

    def _open(self) -> None:
        if not self.peers:  # the first of the mixture's caches
            super()._open()

    def _next_uses(self, keys: list[str]) -> np.ndarray:
        """Each key's next read, as the cache of its dataset (this source's or a sibling's)
        knows it."""
        uses = np.full(len(keys), math.inf)
        folders: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            folders.setdefault(key.rpartition("/")[0], []).append(i)
        for folder, indexes in folders.items():
            owner = self.peers.get(folder, self)
            uses[indexes] = NodeCache._next_uses(owner, [keys[i] for i in indexes])
        return uses


def source_caches(indexes: Sequence[DatasetIndex], cache_dir: str, *,
                  cache_limit: int | None, working_set_bytes: int | None,
                  storage_options: Sequence[Mapping[str, Any] | None],
                  fetchers: Sequence[Fetcher], **options: Any) -> list[NodeCache]:
    """One :class:`SourceCache` per source on ``cache_dir``, peers of each other, each
    downloading with its entry of ``fetchers`` (shared by sources of the same storage
    options; the :class:`MixtureCache` closes them)."""
    peers: dict[str, NodeCache] = {}
    return [SourceCache(index, cache_dir, cache_limit=cache_limit,
                        working_set_bytes=working_set_bytes, storage_options=storage,
                        fetcher=fetcher, peers=peers, **options)
            for index, storage, fetcher in zip(indexes, storage_options, fetchers,
                                               strict=True)]


class _CombinedShards(Sequence[ShardInfo]):
    """The sources' shard tables as one sequence in the combined space, read shard by shard
    (no object per shard is made up front)."""

    def __init__(self, cache: MixtureCache) -> None:
        self._cache = cache

    def __len__(self) -> int:
        return int(self._cache.base[-1]) + len(self._cache.caches[-1].index.shards)

    @overload
    def __getitem__(self, shard: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, shard: slice) -> Sequence[ShardInfo]: ...

    def __getitem__(self, shard: int | slice) -> ShardInfo | Sequence[ShardInfo]:
        if isinstance(shard, slice):
            return [self[k] for k in range(*shard.indices(len(self)))]
        cache, local = self._cache._route(range(len(self))[shard])
        return cache.index.shards[local]


class _CombinedIndex:
    """What the prefetcher reads of an index: the shards, in the combined space."""

    def __init__(self, cache: MixtureCache) -> None:
        self.shards = _CombinedShards(cache)


class MixtureCache:
    """The sources' caches as one store in the combined shard space (what a
    :class:`Prefetcher` uses of a :class:`NodeCache`). Thread safety: as NodeCache's."""

    def __init__(self, caches: Sequence[NodeCache], fetchers: Sequence[Fetcher] = ()) -> None:
        """``fetchers``: the Fetchers the caches share (not their own), closed with this."""
        self.caches = list(caches)
        self._fetchers = list(dict.fromkeys(fetchers))
        self.base = np.cumsum([0] + [len(c.index.shards) for c in caches])[:-1]
        self._bases = self.base.tolist()  # (the prefetcher routes shards one at a time)
        self.index = _CombinedIndex(self)
        self.cache_limit = caches[0].cache_limit

    def _route(self, shard: int) -> tuple[NodeCache, int]:
        source = bisect.bisect_right(self._bases, shard) - 1
        return self.caches[source], shard - self._bases[source]

    def contains(self, shard: int) -> bool:
        cache, local = self._route(shard)
        return cache.contains(local)

    def installed(self, shard: int) -> bool:
        cache, local = self._route(shard)
        return cache.installed(local)

    def lookup(self, shard: int) -> str | None:
        cache, local = self._route(shard)
        return cache.lookup(local)

    def install(self, shard: int, downloaded: Callable[[bytes], None] | None = None,
                finished: Callable[[str | None], None] | None = None) -> int:
        cache, local = self._route(shard)
        return cache.install(local, downloaded, finished)

    def local_path(self, shard: int) -> str:
        cache, local = self._route(shard)
        return cache.local_path(local)

    def estimated_bytes(self, shard: int) -> int:
        cache, local = self._route(shard)
        return cache.estimated_bytes(local)

    def copy_of(self, shard: int) -> str | None:
        cache, local = self._route(shard)
        return cache.copy_of(local)

    def set_next_use(self, next_use: Callable[[int], float] | None) -> None:
        for cache, base in zip(self.caches, self.base.tolist(), strict=True):
            cache.set_next_use(None if next_use is None else _shifted(next_use, base))

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        for cache, base in zip(self.caches, self.base.tolist(), strict=True):
            cache.add_eviction_listener(_shifted_listener(listener, base))

    def close(self) -> None:
        for fetcher in self._fetchers:  # first: downloads in flight, stalled ones too, end
            fetcher.close()
        for cache in self.caches:
            cache.close()


def _shifted(next_use: Callable[[int], float], base: int) -> Callable[[int], float]:
    return lambda shard: next_use(base + shard)


def _shifted_listener(listener: EvictionListener, base: int) -> EvictionListener:
    return lambda shard, nbytes: listener(base + shard, nbytes)


class _SourceStore:
    """Source ``s``'s view of the mixture's store: its shard ``k`` is ``base + k`` there.
    Closing it does nothing: the mixture's reader closes the shared store once.

    It has no ``readable_path``: a source's reader waits for the publish. Mapping the
    finished file, then the published one once the reader sees the path gone, cost 500
    small sources 61 ms a step against 43 (``bench_mixture.py --sources 500``, cold;
    RESULTS.md, "Sources on an S3 store")."""

    def __init__(self, store: Prefetcher | MixtureCache, base: int) -> None:
        self._store = store
        self._base = base

    def local_path(self, shard: int) -> str:
        return self._store.local_path(self._base + shard)

    @property
    def fetcher(self) -> Fetcher:
        """The source's cache's Fetcher (its range reads share it, as a dataset's do)."""
        store = self._store
        caches = cast(MixtureCache, store.cache if isinstance(store, Prefetcher) else store)
        return caches._route(self._base)[0].fetcher

    def ready(self, shard: int) -> bool:
        """Whether the shard is installed now (the reader's cold-start rule asks)."""
        ready = getattr(self._store, "ready", None)
        return bool(ready(self._base + shard)) if ready is not None else True

    def close(self) -> None:
        pass


class MixtureReader:
    """Reads a mixture's steps: rows of combined shards, gathered from every source at once.

    Thread safety: ``read_located`` may be called from several threads.
    """

    def __init__(self, indexes: Sequence[DatasetIndex], schemas: Sequence[Schema],
                 store: Prefetcher | MixtureCache, *,
                 storage_options: Sequence[Mapping[str, Any] | None]) -> None:
        self.store = store
        self.schema = schemas[0]
        self.base = np.cumsum([0] + [len(i.shards) for i in indexes])[:-1].astype(np.int64)
        self.readers = [DatasetReader(index, fields=schema.names,
                                      store=_SourceStore(store, int(base)),
                                      storage_options=storage)
                        for index, schema, base, storage in zip(
                            indexes, schemas, self.base, storage_options, strict=True)]

    def read_located(self, shards: np.ndarray, rows: np.ndarray, *, first: bool = False,
                     ) -> dict[str, np.ndarray | Ragged]:
        """Rows ``rows[i]`` of combined shards ``shards[i]`` as batch arrays: each source's
        reader provides its shards' readers (local copies, or rows read by range), and one
        gather reads them all (``first`` is DatasetReader's hint; a source's shards are not
        offered from downloads)."""
        unique, which = np.unique(shards, return_inverse=True)
        which = which.astype(np.int32)
        rows = np.array(rows, dtype=np.int64)
        source = np.searchsorted(self.base, unique, side="right") - 1
        readers: list[ShardReader] = []
        for s in np.unique(source).tolist():
            start, stop = (int(i) for i in np.searchsorted(source, [s, s + 1]))
            in_source = (which >= start) & (which < stop)  # unique is sorted: one run a source
            found, rows[in_source] = self.readers[s].batch_readers(
                unique[start:stop] - self.base[s], which[in_source] - start, rows[in_source])
            readers.extend(found)
        return gather(readers, which, rows, list(self.schema))

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.store.close()


__all__ = ["MixtureCache", "MixtureReader", "SourceCache", "source_caches"]
