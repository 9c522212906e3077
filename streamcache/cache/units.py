"""The node cache of a multi-node job: units (pieces and chunks of shards), not whole shards.

With several nodes a node holds only its share of each shard (docs/multinode.md): the pieces
it owns, and the chunks of other nodes' pieces it reads rows of (:mod:`streamcache.plan.units`).
:class:`UnitCache` is a :class:`~streamcache.cache.node.NodeCache` whose entries are those
units: the same folder, budget, eviction by next use, file locks (one download per unit per
node, shared by the node's ranks) and atomic publication. What differs is the download: a unit
of a shard that is cut is read by range (:class:`~streamcache.cache.ranges.RangeReader`: the
shard's footer, verified against the index, then exactly the unit's chunks, each verified
against its digest) and written in the local layout; a unit that is a whole shard is
downloaded whole, as any shard.

The cache sees the units through :func:`unit_index`: an index whose "shards" are the units
(built on the fly, one entry when asked for: a dataset of a million shards has tens of
millions of units), whose fingerprint digests the dataset's and the layout's (so the units
of one layout never share a folder with whole shards or another layout's units).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import numpy as np
import pyarrow as pa

from ..format.checksum import checksum_bytes
from ..format.index import DatasetIndex, ShardInfo
from ..format.materialize import restamp, write_local_layout
from ..format.shard_table import ShardTable
from ..plan.units import UnitLayout
from .accounting import remove_quietly
from .node import LAYOUT_OVERHEAD, NodeCache
from .ranges import RangeReader

#: Bumped when unit files change what they hold (2: each records the unit it is a copy of),
#: so a node's folder of older units is never read as this version's.
UNITS_FORMAT = 2


class UnitTable(ShardTable):
    """The units of a layout as a shard table: ``table[u]`` describes unit ``u`` (its
    shard's path, format and checksum; its rows; its stored and raw bytes estimated pro rata,
    or the shard's own for a unit that is a whole shard). Nothing is stored per unit.

    Thread safety: immutable.
    """

    def __init__(self, index: DatasetIndex, layout: UnitLayout) -> None:
        # (not ShardTable's constructor: the columns would be one entry per unit)
        self._index = index
        self._layout = layout
        self.rows = np.zeros(0, dtype=np.int64)  # (per-unit columns are not kept)
        self.nbytes = np.zeros(0, dtype=np.int64)
        self.total_rows = int(index.num_samples)

    def __len__(self) -> int:
        return self._layout.num_units

    @overload
    def __getitem__(self, index: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ShardInfo]: ...

    def __getitem__(self, index: int | slice) -> ShardInfo | Sequence[ShardInfo]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        shard, _, rows = self._layout.span(int(index))
        info = self._index.shards[shard]
        if rows == info.rows:
            return info
        share = rows / max(1, info.rows)
        raw = info.raw_bytes if info.raw_bytes is not None else info.bytes
        return ShardInfo(path=info.path, format=info.format, rows=rows,
                         bytes=max(1, int(info.bytes * share)), checksum=info.checksum,
                         compression=info.compression, raw_bytes=int(raw * share))

    def __iter__(self) -> Iterator[ShardInfo]:
        return (self[i] for i in range(len(self)))

    def digest(self) -> str:
        return self._layout.digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnitTable) and other._layout == self._layout and (
            other._index.fingerprint == self._index.fingerprint)

    def __hash__(self) -> int:
        return hash((self._layout, self._index.fingerprint))

    def __repr__(self) -> str:
        return f"UnitTable({len(self)} units of {len(self._index.shards)} shards)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (UnitTable, (self._index, self._layout))


def unit_index(index: DatasetIndex, layout: UnitLayout) -> DatasetIndex:
    """An index whose shards are the units of ``layout`` (see the module docstring)."""
    digest = checksum_bytes(f"{index.fingerprint}|units{UNITS_FORMAT}|{layout.digest}".encode())
    return DatasetIndex(index.schema, UnitTable(index, layout), fingerprint=digest,
                        url=index.url, created=index.created)


class UnitCache(NodeCache):
    """A :class:`NodeCache` of the units of ``layout`` (a :class:`ShardStore` whose shard
    numbers are unit ids).

    Args:
        index: the dataset's index (the real one; the cache keeps :func:`unit_index` of it).
        layout: the units.
        cache_dir, cache_limit, working_set_bytes, fetch_options, storage_options, durable:
            as :class:`NodeCache`'s (``working_set_bytes`` is required: the node's share).

    Thread safety: as NodeCache's. Fork: the range reader makes a fresh pool in a child.
    """

    def __init__(self, index: DatasetIndex, layout: UnitLayout, cache_dir: str, *,
                 working_set_bytes: int, **options: Any) -> None:
        self.dataset = index
        self.layout = layout
        # (never read in place: every unit file records which unit it is, so even a whole
        # local shard is installed as a unit, stamped)
        super().__init__(unit_index(index, layout), cache_dir,
                         working_set_bytes=working_set_bytes, read_in_place=False, **options)
        self._ranges = RangeReader(index, self.fetcher)
        self._range_lock = threading.Lock()

    def _download(self, shard: int, downloaded: Callable[[bytes], None] | None = None,
                  ) -> tuple[str, int]:
        """Fetch unit ``shard`` into this process's temporaries in the local layout: a whole
        shard as any shard, a part of one by range (its chunks, verified). (``downloaded`` is
        not told: a unit's id is not its shard's, so its bytes are not offered to readers.)"""
        if self.layout.is_whole(shard):
            staged, nbytes = super()._download(shard)
            try:  # (a shard stored uncompressed is not rewritten on install: stamped here)
                restamp(staged, self.copy_of(shard))  # (fsynced before publishing)
            except BaseException:
                remove_quietly(staged)
                raise
            return staged, nbytes
        real, first, rows = self.layout.span(shard)
        staged = os.path.join(self._tmp_dir(), f"{shard:06d}.arrow")
        before = self._ranges.stats.bytes
        try:
            found = self._ranges.read_rows(real, np.arange(first, first + rows))
            assert found is not None  # (only a cold read may decline)
            batch = _rows_of(*found)
            write_local_layout(batch, staged, copy_of=self.copy_of(shard))  # (see restamp)
        except BaseException:
            remove_quietly(staged)
            raise
        return staged, max(0, self._ranges.stats.bytes - before)

    def copy_of(self, unit: int) -> str:
        """What an installed file of ``unit`` records it is a copy of (the layout's index
        fingerprint and the unit): a reader refuses a unit file under another unit's name,
        whatever its rows (materialize.COPY_OF_KEY)."""
        return f"{self.index.fingerprint}#{unit}"

    def estimated_bytes(self, shard: int) -> int:
        """Bytes unit ``shard`` takes installed: exact once seen, else pro rata."""
        if shard in self._actual_bytes:
            return self._actual_bytes[shard]
        info = self.index.shards[shard]
        return (info.raw_bytes if info.raw_bytes is not None else info.bytes) + LAYOUT_OVERHEAD

    def close(self) -> None:
        self._ranges.close()
        super().close()


def _rows_of(reader: Any, local: np.ndarray) -> pa.RecordBatch:
    """The rows ``local`` (consecutive, ascending) of a range reader's in-memory shard as one
    record batch in the dataset's canonical types (a slice: no copy)."""
    batch: pa.RecordBatch = reader.batch  # the decoded, verified chunks (memory_shard.MemoryShard)
    start = int(local[0]) if local.size else 0
    if local.size and not np.array_equal(local, np.arange(start, start + local.size)):
        raise AssertionError("a unit's rows come back from a range read out of order")
    return batch.slice(start, int(local.size))


__all__ = ["UnitCache", "UnitTable", "unit_index"]
