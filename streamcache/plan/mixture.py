"""A mixture of datasets as one global sequence of positions. Pure, no I/O.

Weights become integer *shares* ``a_s`` (``sum a_s = D``, the period). Position ``j`` of a
*phase* (a stretch of the mixture read with one set of weights) belongs to one source; the
count of source ``s`` among the first ``n`` positions, its quota ``T_s(n)``, always lies
between ``floor(a_s n / D)`` and ``ceil(a_s n / D)``: within one sample of the weights at every
prefix, exact at every multiple of ``D``, and nondecreasing (it is a count). Such a sequence
exists for any weights (the chairman assignment problem); earliest-deadline-first over the
windows the two bounds allow each of a source's samples finds one (see docs/mixtures.md).
Being exact at ``D``, the sequence repeats with period ``D``, so a table of one period gives
any position in O(1).

The ``k``-th sample (from 0) of source ``s`` over the whole run is position ``k % E_s`` of its
own epoch ``k // E_s`` (``E_s`` its epoch size), and that position is read through the
source's own :class:`~streamcache.plan.EpochOrder`: :class:`MixtureOrder` maps an epoch of the
mixture to (combined sample id, combined shard, row) exactly as an ``EpochOrder`` maps an
epoch of one dataset, so segments, rank assignments and prefetch advice work on it unchanged.
"""

from __future__ import annotations

import functools
import heapq
import math
import numbers
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ._util import PlanError, check_positions, check_span
from .bijection import derive_key
from .order import EpochOrder, ShuffleOptions, first_uses

#: The longest period of the quota sequence; weights whose exact ratio needs a longer one are
#: rounded to shares of this period (an error below 1/MAX_PERIOD per source).
MAX_PERIOD = 1 << 16
_TAG_SOURCE = 0x534F_5552  # distinguishes a source's seed from every other derived key
_ORDERS_PER_SOURCE = 3  # EpochOrders kept per source (a step may straddle two of its epochs)


def shares_of(weights: Sequence[float | int | Fraction | numbers.Real]) -> tuple[int, ...]:
    """Integer shares with the weights' ratios (reduced), their sum at most :data:`MAX_PERIOD`.

    A float is read as the simplest fraction within 1e-9 of it (0.7 is 7/10), so common
    weights are exact; otherwise shares of ``MAX_PERIOD`` by largest remainder.

    Raises:
        PlanError: no weights, or a weight that is not a finite number > 0.
    """
    if not weights:
        raise PlanError("a mixture needs at least one source")
    exact = []
    for weight in weights:
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or \
                not math.isfinite(float(weight)) or weight <= 0:
            raise PlanError(f"a weight must be a finite number > 0, got {weight!r}")
        exact.append(Fraction(int(weight)) if isinstance(weight, numbers.Integral) else
                     weight if isinstance(weight, Fraction) else
                     Fraction(float(weight)).limit_denominator(10**9))
    total = sum(exact)
    ratios = [w / total for w in exact]
    period = math.lcm(*(r.denominator for r in ratios))
    if period <= MAX_PERIOD:
        return tuple(int(r * period) for r in ratios)
    raw = [r * MAX_PERIOD for r in ratios]
    shares = [max(1, int(x)) for x in raw]
    by_remainder = sorted(range(len(raw)), key=lambda s: (-(raw[s] - int(raw[s])), s))
    for s in by_remainder[:MAX_PERIOD - sum(shares)]:
        shares[s] += 1
    divisor = math.gcd(*shares)
    return tuple(s // divisor for s in shares)


class Quota:
    """The quota sequence of one set of shares: who owns each position of a phase.

    Thread safety: immutable after construction (use :func:`quota`, which caches).
    """

    def __init__(self, shares: tuple[int, ...]) -> None:
        self.shares = np.asarray(shares, dtype=np.int64)
        self.period = int(self.shares.sum())
        self.owner = _earliest_deadline_first(shares)
        # rank[r]: how many samples of owner[r] come before r within a period
        self.rank = np.zeros(self.period, dtype=np.int64)
        self.prefix = np.zeros((len(shares), self.period + 1), dtype=np.int64)
        for s in range(len(shares)):
            mine = self.owner == s
            self.rank[mine] = np.arange(int(mine.sum()))
            np.cumsum(mine, out=self.prefix[s, 1:])
        self.slots = [np.flatnonzero(self.owner == s) for s in range(len(shares))]

    def at(self, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, samples of that source before ``j`` in the phase) of phase positions."""
        periods, r = np.divmod(j, self.period)
        owner = self.owner[r]
        return owner.astype(np.int64), periods * self.shares[owner] + self.rank[r]

    def counts(self, n: int) -> np.ndarray:
        """``T_s(n)`` for every source: samples of each among the first ``n`` positions."""
        periods, r = divmod(n, self.period)
        return periods * self.shares + self.prefix[:, r]

    def positions_for(self, source: int, samples: int) -> int:
        """The fewest positions holding ``samples`` samples of ``source``."""
        if samples <= 0:
            return 0
        periods, r = divmod(samples - 1, int(self.shares[source]))
        return periods * self.period + int(self.slots[source][r]) + 1


@functools.lru_cache(maxsize=32)
def quota(shares: tuple[int, ...]) -> Quota:
    """The (cached) :class:`Quota` of ``shares``."""
    return Quota(shares)


def _earliest_deadline_first(shares: tuple[int, ...]) -> np.ndarray:
    """Owner of each position of one period. Sample ``j`` of source ``s`` may sit at positions
    ``[floor(j D / a), ceil((j+1) D / a))``: after it, the count is at most ``ceil(a n / D)``;
    by the end, at least ``floor(a n / D)``. The windows admit a schedule (every interval holds
    at most as many whole windows as positions), and earliest deadline first finds one."""
    period = sum(shares)
    owner = np.empty(period, dtype=np.int16 if len(shares) < 1 << 15 else np.int64)
    taken = [0] * len(shares)
    waiting = [(0, s) for s in range(len(shares))]  # (release, source), sorted
    ready: list[tuple[int, int]] = []  # (deadline, source)
    for position in range(period):
        while waiting and waiting[0][0] <= position:
            _, s = heapq.heappop(waiting)
            heapq.heappush(ready, (-(-(taken[s] + 1) * period // shares[s]), s))
        deadline, s = heapq.heappop(ready)
        assert deadline > position, "the quota windows admit no schedule"
        owner[position] = s
        taken[s] += 1
        if taken[s] < shares[s]:
            heapq.heappush(waiting, (taken[s] * period // shares[s], s))
    return owner


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
    """What the plan needs of a source: its shards' row counts and its epoch size."""

    shard_rows: np.ndarray
    epoch_samples: int

    @property
    def num_samples(self) -> int:
        return int(self.shard_rows.sum())


class SourceOrders:
    """A source's own orders, by pass over its samples (a source epoch of ``E`` samples is
    ``ceil(E / N)`` passes, the last in part), kept a few at a time.

    Thread safety: every method may be called from several threads.
    """

    def __init__(self, shape: SourceShape, seed: int, shuffle: ShuffleOptions) -> None:
        self.shape = shape
        self.seed = seed
        self.shuffle = shuffle
        self.size = shape.num_samples
        self.passes = -(-shape.epoch_samples // self.size)
        self._orders: OrderedDict[int, EpochOrder] = OrderedDict()
        self._lock = threading.Lock()

    def order(self, number: int) -> EpochOrder:
        with self._lock:
            order = self._orders.get(number)
            if order is not None:
                self._orders.move_to_end(number)
                return order
        order = EpochOrder(self.shape.shard_rows, self.seed, number, self.shuffle)
        with self._lock:
            self._orders[number] = order
            while len(self._orders) > _ORDERS_PER_SOURCE:
                self._orders.popitem(last=False)
        return order

    def samples_at(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(id, shard, row) of the source's samples ``k`` (counted over the whole run)."""
        epoch, within = np.divmod(k, self.shape.epoch_samples)
        number = epoch * self.passes + within // self.size
        position = within % self.size
        out = np.empty((3, k.size), dtype=np.int64)
        for n in np.unique(number).tolist():
            here = number == n
            out[:, here] = self.order(int(n)).samples_at(position[here])
        return out[0], out[1], out[2]


class MixtureOrder:
    """The order of one mixture epoch; duck-types :class:`EpochOrder` in a combined space.

    Combined shard ``shard_base[s] + k`` is shard ``k`` of source ``s``; combined sample id
    ``id_base[s] + i`` is sample ``i`` of source ``s``. ``samples``, ``samples_at``,
    ``locate``, ``sample_ids(_at)``, ``shard_first_use`` and ``shard_of_ids`` answer as an
    EpochOrder's do, so segments, rank assignments and prefetch advice use it unchanged.

    Thread safety: every method may be called from several threads.
    """

    def __init__(self, sources: Sequence[SourceOrders], plan: EpochPlan) -> None:
        self.sources = list(sources)
        self.plan = plan
        self.epoch = plan.epoch
        self.num_samples = plan.num_samples
        rows = [s.shape.shard_rows for s in self.sources]
        self.shard_rows = np.concatenate(rows).astype(np.int64)
        self.num_shards = int(self.shard_rows.size)
        self.shard_base = np.cumsum([0] + [r.size for r in rows])[:-1].astype(np.int64)
        self.id_base = np.cumsum([0] + [s.size for s in self.sources])[:-1].astype(np.int64)
        self.shard_offsets = np.zeros(self.num_shards, dtype=np.int64)
        np.cumsum(self.shard_rows[:-1], out=self.shard_offsets[1:])
        self._starts = np.asarray([p.start for p in plan.phases], dtype=np.int64)

    def source_samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, its sample number over the whole run) at epoch positions."""
        g = self.plan.start + positions
        phase_of = np.searchsorted(self._starts, g, side="right") - 1
        source = np.empty(g.size, dtype=np.int64)
        k = np.empty(g.size, dtype=np.int64)
        for i in np.unique(phase_of).tolist():
            phase = self.plan.phases[i]
            here = phase_of == i
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
        for s in np.unique(source).tolist():
            here = source == s
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
    "MAX_PERIOD",
    "EpochPlan",
    "MixtureOrder",
    "Phase",
    "Quota",
    "SourceOrders",
    "SourceShape",
    "quota",
    "shares_of",
    "source_seed",
]
