"""A mixture of datasets as one global sequence of positions. Pure, no I/O.

Weights become integer *shares* (plan/shares.py), and each phase of the mixture (a stretch
read with one set of weights) a quota sequence that says which source owns each position
(plan/quota.py).

The ``k``-th sample (from 0) of source ``s`` over the whole run is position ``k % E_s`` of its
own epoch ``k // E_s`` (``E_s`` its epoch size), and that position is read through the
source's own :class:`~streamcache.plan.EpochOrder`: :class:`MixtureOrder` maps an epoch of the
mixture to (combined sample id, combined shard, row) exactly as an ``EpochOrder`` maps an
epoch of one dataset, so segments, rank assignments and prefetch advice work on it unchanged.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ._util import check_positions, check_span
from .bijection import derive_key
from .order import EpochOrder, first_uses
from .quota import quota
from .shards import ShardCounts
from .shuffle import ShuffleOptions

_TAG_SOURCE = 0x534F_5552  # distinguishes a source's seed from every other derived key
_ORDERS_PER_SOURCE = 3  # EpochOrders kept per source (a step may straddle two of its epochs)
#: Sources of at most this many samples read their orders from id tables (SourceOrders).
SMALL_SOURCE = 1 << 12


def source_seed(seed: int, source: int) -> int:
    """The seed of source ``source``'s own orders (distinct sources, distinct orders)."""
    return derive_key(seed, source, _TAG_SOURCE)


@dataclass(frozen=True)
class Phase:
    """A stretch of the mixture read with one set of shares, from global position ``start``
    on, when the sources had read ``counts`` samples (over the whole run)."""

    start: int
    counts: tuple[int, ...]
    shares: tuple[int, ...]

    def counts_at(self, position: int) -> tuple[int, ...]:
        """Each source's samples read before global ``position`` (>= ``start``)."""
        added = quota(self.shares).counts(position - self.start)
        return tuple(int(c) + int(a) for c, a in zip(self.counts, added, strict=True))


@dataclass(frozen=True)
class EpochPlan:
    """What fixes a mixture epoch: its number, length, first global position, and the phases
    that cover it (the first begins at or before ``start``)."""

    epoch: int
    num_samples: int
    start: int
    phases: tuple[Phase, ...]


@dataclass(frozen=True)
class SourceShape:
    """What the plan needs of a source: its shards' row counts (a :class:`ShardCounts`, as
    the shard table shares it, or an array) and its epoch size."""

    shard_rows: np.ndarray | ShardCounts
    epoch_samples: int

    @functools.cached_property
    def counts(self) -> ShardCounts:
        return ShardCounts.of(self.shard_rows)

    @property
    def num_samples(self) -> int:
        return self.counts.total


class CombinedShards:
    """The sources' shards as one table: source ``s``'s shard ``k`` is shard
    ``shard_base[s] + k``, its sample ``i`` is sample ``id_base[s] + i``. Made once per
    mixture (one concatenation of the sources' row counts), shared by its epochs' orders."""

    def __init__(self, shapes: Sequence[SourceShape]) -> None:
        counts = [shape.counts for shape in shapes]
        self.counts = ShardCounts(np.concatenate([c.rows for c in counts]).astype(np.int64))
        self.shard_base = np.cumsum([0] + [c.num_shards for c in counts])[:-1].astype(np.int64)
        self.id_base = np.cumsum([0] + [c.total for c in counts])[:-1].astype(np.int64)


class SourceOrders:
    """A source's own orders, by pass over its samples (a source epoch of ``E`` samples is
    ``ceil(E / N)`` passes, the last in part), kept a few at a time.

    A source of at most :data:`SMALL_SOURCE` samples keeps each pass it reads as a table of
    sample ids (4 bytes a sample, :data:`_ORDERS_PER_SOURCE` passes), read by index: an
    order answers any positions for about a millisecond whatever their number, and a mixture
    of thousands of small sources would pay that for every source a scan touches.

    Thread safety: every method may be called from several threads.
    """

    def __init__(self, shape: SourceShape, seed: int, shuffle: ShuffleOptions) -> None:
        self.shape = shape
        self.seed = seed
        self.shuffle = shuffle
        self.size = shape.num_samples
        self.passes = -(-shape.epoch_samples // self.size)
        self._orders: OrderedDict[int, EpochOrder] = OrderedDict()
        self._tables: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def order(self, number: int) -> EpochOrder:
        with self._lock:
            order = self._orders.get(number)
            if order is not None:
                self._orders.move_to_end(number)
                return order
        order = EpochOrder(self.shape.counts, self.seed, number, self.shuffle)
        with self._lock:
            self._orders[number] = order
            while len(self._orders) > _ORDERS_PER_SOURCE:
                self._orders.popitem(last=False)
        return order

    def _table(self, number: int) -> np.ndarray:
        """The sample ids of pass ``number``, position by position (a small source)."""
        with self._lock:
            table = self._tables.get(number)
            if table is not None:
                self._tables.move_to_end(number)
                return table
        table = self.order(number).sample_ids(0, self.size).astype(np.int32)
        with self._lock:
            self._tables[number] = table
            while len(self._tables) > _ORDERS_PER_SOURCE:
                self._tables.popitem(last=False)
        return table

    def samples_at(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(id, shard, row) of the source's samples ``k`` (counted over the whole run)."""
        epoch, within = np.divmod(k, self.shape.epoch_samples)
        number = epoch * self.passes + within // self.size
        position = within % self.size
        if self.size <= SMALL_SOURCE:
            ids = np.empty(k.size, dtype=np.int64)
            for n, here in groups(number):
                ids[here] = self._table(n)[position[here]]
            offsets = self.shape.counts.offsets
            shards = np.searchsorted(offsets, ids, side="right") - 1
            return ids, shards, ids - offsets[shards]
        if k.size and number[0] == number[-1] and (number == number[0]).all():
            return self.order(int(number[0])).samples_at(position)  # one pass (the usual)
        out = np.empty((3, k.size), dtype=np.int64)
        for n, here in groups(number):
            out[:, here] = self.order(n).samples_at(position[here])
        return out[0], out[1], out[2]


def groups(keys: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(key, the indices holding it)`` for each distinct key, in key order: one sort, so
    O(n log n) for n keys however many are distinct (a mask per key would be O(n x keys)).
    No keys (a rank's empty part of a split tail) yield nothing."""
    if not keys.size:
        return
    if keys[0] == keys[-1] and (keys == keys[0]).all():
        yield int(keys[0]), np.arange(keys.size)  # one key (the usual within a source)
        return
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    for start, stop in zip(starts.tolist(), [*starts[1:].tolist(), keys.size], strict=True):
        yield int(ordered[start]), order[start:stop]


class MixtureOrder:
    """The order of one mixture epoch; duck-types :class:`EpochOrder` in a combined space.

    Combined shard ``shard_base[s] + k`` is shard ``k`` of source ``s``; combined sample id
    ``id_base[s] + i`` is sample ``i`` of source ``s``. ``samples``, ``samples_at``,
    ``locate``, ``sample_ids(_at)``, ``shard_first_use`` and ``shard_of_ids`` answer as an
    EpochOrder's do, so segments, rank assignments and prefetch advice use it unchanged.

    Thread safety: every method may be called from several threads.
    """

    def __init__(self, sources: Sequence[SourceOrders], plan: EpochPlan,
                 combined: CombinedShards | None = None) -> None:
        self.sources = list(sources)
        self.plan = plan
        self.epoch = plan.epoch
        self.num_samples = plan.num_samples
        combined = combined or CombinedShards([s.shape for s in self.sources])
        self.counts = combined.counts
        self.shard_rows = combined.counts.rows
        self.shard_offsets = combined.counts.offsets
        self.num_shards = combined.counts.num_shards
        self.shard_base = combined.shard_base
        self.id_base = combined.id_base
        self._starts = np.asarray([p.start for p in plan.phases], dtype=np.int64)

    def source_samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, its sample number over the whole run) at epoch positions."""
        g = self.plan.start + positions
        phase_of = np.searchsorted(self._starts, g, side="right") - 1
        source = np.empty(g.size, dtype=np.int64)
        k = np.empty(g.size, dtype=np.int64)
        for i, here in groups(phase_of):
            phase = self.plan.phases[i]
            source[here], taken = quota(phase.shares).at(g[here] - phase.start)
            k[here] = np.asarray(phase.counts, dtype=np.int64)[source[here]] + taken
        return source, k

    def samples_at(self, positions: np.ndarray | Sequence[int]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(combined id, combined shard, row) at epoch positions (any shape)."""
        pos = check_positions(positions, self.num_samples)
        flat = pos.ravel()
        source, k = self.source_samples(flat)
        out = np.empty((3, flat.size), dtype=np.int64)
        for s, here in groups(source):
            ids, shards, rows = self.sources[s].samples_at(k[here])
            out[0, here] = ids + self.id_base[s]
            out[1, here] = shards + self.shard_base[s]
            out[2, here] = rows
        return (out[0].reshape(pos.shape), out[1].reshape(pos.shape),
                out[2].reshape(pos.shape))

    def samples(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        check_span(start, stop, self.num_samples)
        return self.samples_at(np.arange(start, stop, dtype=np.int64))

    def sample_ids(self, start: int, stop: int) -> np.ndarray:
        return self.samples(start, stop)[0]

    def sample_ids_at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        return self.samples_at(positions)[0]

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        _, shards, rows = self.samples(start, stop)
        return shards, rows

    def shard_first_use(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Each combined shard read in ``[start, stop)`` with its first position, by position."""
        check_span(start, stop, self.num_samples)
        return first_uses(self.locate, self.num_shards, start, stop)

    def shard_of_ids(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(combined shard, row) of combined sample ids."""
        ids = np.asarray(ids, dtype=np.int64)
        shards = np.searchsorted(self.shard_offsets, ids, side="right") - 1
        return shards, ids - self.shard_offsets[shards]

    def source_ids(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, id within the source) of combined sample ids."""
        ids = np.asarray(ids, dtype=np.int64)
        source = np.searchsorted(self.id_base, ids, side="right") - 1
        return source, ids - self.id_base[source]

    def __repr__(self) -> str:
        return (f"MixtureOrder(sources={len(self.sources)}, num_samples={self.num_samples}, "
                f"epoch={self.epoch})")


__all__ = [
    "CombinedShards",
    "EpochPlan",
    "MixtureOrder",
    "Phase",
    "SourceOrders",
    "SourceShape",
    "source_seed",
]
