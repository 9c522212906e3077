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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, SupportsFloat

import numpy as np

from ._util import PlanError, check_positions, check_span
from .bijection import derive_key
from .order import EpochOrder, ShuffleOptions, first_uses
from .shards import ShardCounts

#: The longest period of the quota sequence; weights whose exact ratio needs a longer one are
#: rounded to shares of this period (an error below 1/MAX_PERIOD per source).
MAX_PERIOD = 1 << 16
_TAG_SOURCE = 0x534F_5552  # distinguishes a source's seed from every other derived key
_ORDERS_PER_SOURCE = 3  # EpochOrders kept per source (a step may straddle two of its epochs)
#: Sources of at most this many samples read their orders from id tables (SourceOrders).
SMALL_SOURCE = 1 << 12


def shares_of(weights: Sequence[float | int | Fraction | numbers.Real]) -> tuple[int, ...]:
    """Integer shares with the weights' ratios (reduced), their sum at most :data:`MAX_PERIOD`.

    A float is read as the simplest fraction within 1e-9 of it (0.7 is 7/10), so common
    weights are exact; otherwise shares of ``MAX_PERIOD`` by largest remainder. The cost grows
    with the number of weights, not with their product: exact integers where the weights
    have a small common denominator, else float ratios, computed exactly only for the few
    shares that a float could decide wrongly (the result is the exact one either way).

    Raises:
        PlanError: no weights, a weight that is not a finite number > 0, or a weight below
            ``1 / MAX_PERIOD`` of the total (no share can represent it).
    """
    if not weights:
        raise PlanError("a mixture needs at least one source")
    fractions = [_fraction(weight) for weight in weights]
    ratios = _float_ratios(fractions)
    exact = _Exact(fractions)
    for s, (weight, ratio) in enumerate(zip(weights, ratios, strict=True)):
        if ratio * MAX_PERIOD < 1 + _CLOSE and exact.numerators[s] * MAX_PERIOD < exact.total:
            raise PlanError(
                f"source {s}'s weight {weight!r} is {ratio:.3g} of the total weight; a mixture "
                f"represents shares down to 1/{MAX_PERIOD} of it (one sample in "
                f"{MAX_PERIOD:,}): give that source a weight of at least "
                f"{_least_weight(fractions):.3g}, or leave it out")
    return _small_period_shares(ratios, exact) or _rounded_shares(ratios, exact)


_CLOSE = 1e-9  # floats within this of a boundary are decided exactly (their error is < 1e-10)


def _fraction(weight: Any) -> Fraction:
    """A weight as an exact fraction (a float as the simplest fraction within 1e-9 of it)."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or \
            not 0 < _float_or_inf(weight) < math.inf:  # (NaN fails it too)
        raise PlanError(f"a weight must be a finite number > 0 that a float can hold, got "
                        f"{weight!r}")
    if isinstance(weight, numbers.Integral):
        return Fraction(int(weight))
    if isinstance(weight, Fraction):
        return weight
    return _float_fraction(float(weight))


@functools.lru_cache(maxsize=4096)
def _float_fraction(weight: float) -> Fraction:
    """(cached: a mixture of many sources repeats its weights)"""
    exact = Fraction(weight)
    simple = exact.limit_denominator(10**9)
    # a weight far below 1 has no simple fraction that close: keep it as it is
    return simple if simple and abs(simple - exact) <= exact / 10**9 else exact


class _Exact:
    """The weights over their least common denominator (numerators, and their sum), made
    when first asked for: with many weights of unrelated denominators these are integers of
    thousands of digits, needed only where a float cannot decide."""

    def __init__(self, fractions: list[Fraction]) -> None:
        self.fractions = fractions

    @functools.cached_property
    def numerators(self) -> list[int]:
        common = 1
        for fraction in self.fractions:  # big % small and big * small: linear in the digits
            common = common // math.gcd(common, fraction.denominator) * fraction.denominator
        return [f.numerator * (common // f.denominator) for f in self.fractions]

    @functools.cached_property
    def total(self) -> int:
        return sum(self.numerators)


def _float_or_inf(value: SupportsFloat) -> float:
    """``float(value)``, or inf where the value is past the largest float (an int or a
    Fraction can be: ``float`` raises OverflowError for them)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _float_ratios(fractions: list[Fraction]) -> list[float]:
    """Each weight's part of the total weight, as floats (every weight a float can hold).

    The weights are scaled by the power of two that brings the largest into [0.5, 1) before
    they are summed: exact, so each ratio is the one of the weights as they are, to the last
    bit, and weights whose sum passes the largest float (two of 1e308) have ratios too. (Only
    a weight below 2**-1022 of the largest loses bits, and no share can represent it.)
    """
    values = [float(f) for f in fractions]
    _, exponent = math.frexp(max(values))
    scaled = [math.ldexp(value, -exponent) for value in values]
    total = math.fsum(scaled)
    return [value / total for value in scaled]


def _least_weight(fractions: list[Fraction]) -> float:
    """The least weight a source can have beside these (a share of one in
    :data:`MAX_PERIOD`), for a message: inf where it is past the largest float."""
    return _float_or_inf(sum(fractions) / (MAX_PERIOD - 1))


def _small_period_shares(ratios: list[float], exact: _Exact) -> tuple[int, ...] | None:
    """The exact shares when the ratios repeat within :data:`MAX_PERIOD` positions, else
    None: candidate shares from the float ratios, checked in exact integers."""
    period = 1
    candidates = []
    for ratio in ratios:
        candidates.append(Fraction(ratio).limit_denominator(MAX_PERIOD))
        period = period // math.gcd(period, candidates[-1].denominator) * \
            candidates[-1].denominator
        if period > MAX_PERIOD:
            return None
    shares = [int(c * period) for c in candidates]
    if sum(shares) != period or any(
            a * period != share * exact.total
            for a, share in zip(exact.numerators, shares, strict=True)):
        return None
    divisor = math.gcd(*shares)
    return tuple(share // divisor for share in shares)


def _rounded_shares(ratios: list[float], exact: _Exact) -> tuple[int, ...]:
    """Shares of :data:`MAX_PERIOD` by largest remainder (ties to the lower index), reduced:
    floors and remainders from the floats, made exact where a float is within
    :data:`_CLOSE` of a boundary (an integer, or the remainder where the cut falls)."""
    floors: list[int] = []
    remainders: list[float | Fraction] = []
    for ratio in ratios:
        scaled = ratio * MAX_PERIOD
        floors.append(math.floor(scaled))
        remainders.append(scaled - floors[-1])

    def make_exact(s: int) -> None:
        floor, rest = divmod(exact.numerators[s] * MAX_PERIOD, exact.total)
        floors[s], remainders[s] = floor, Fraction(rest, exact.total)

    for s, rest in enumerate(remainders):
        if rest < _CLOSE or rest > 1 - _CLOSE:
            make_exact(s)
    by_remainder = sorted(range(len(ratios)), key=lambda s: (-remainders[s], s))
    extra = MAX_PERIOD - sum(floors)
    if 0 < extra < len(ratios):
        cut = float(remainders[by_remainder[extra]])
        near = [s for s in range(len(ratios)) if abs(float(remainders[s]) - cut) < _CLOSE]
        if len({exact.fractions[s] for s in near}) > 1:  # equal weights tie exactly already
            for s in near:
                make_exact(s)
            by_remainder = sorted(range(len(ratios)), key=lambda s: (-remainders[s], s))
    shares = floors
    for s in by_remainder[:extra]:
        shares[s] += 1
    divisor = math.gcd(*shares)
    return tuple(share // divisor for share in shares)


class Quota:
    """The quota sequence of one set of shares: who owns each position of a phase.

    Its tables are O(period), whatever the number of sources (a count per source and
    position would be O(sources x period): 1.5 GB for 3,000 sources).

    Thread safety: immutable after construction (use :func:`quota`, which caches).
    """

    def __init__(self, shares: tuple[int, ...]) -> None:
        self.shares = np.asarray(shares, dtype=np.int64)
        self.period = int(self.shares.sum())
        self.owner = _earliest_deadline_first(shares)
        # by_owner: the positions of a period, source by source (each source's in order);
        # first[s]: where source s's begin there; rank[r]: samples of owner[r] before r
        self.by_owner = np.argsort(self.owner, kind="stable").astype(np.int64)
        self.first = np.zeros(len(shares) + 1, dtype=np.int64)
        np.cumsum(self.shares, out=self.first[1:])
        self.rank = np.empty(self.period, dtype=np.int64)
        self.rank[self.by_owner] = np.arange(self.period) - self.first[self.owner[self.by_owner]]

    def at(self, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, samples of that source before ``j`` in the phase) of phase positions."""
        periods, r = np.divmod(j, self.period)
        owner = self.owner[r]
        return owner.astype(np.int64), periods * self.shares[owner] + self.rank[r]

    def counts(self, n: int) -> np.ndarray:
        """``T_s(n)`` for every source: samples of each among the first ``n`` positions."""
        periods, r = divmod(n, self.period)
        return periods * self.shares + np.bincount(self.owner[:r], minlength=len(self.shares))

    def positions_for(self, source: int, samples: int) -> int:
        """The fewest positions holding ``samples`` samples of ``source``."""
        if samples <= 0:
            return 0
        periods, r = divmod(samples - 1, int(self.shares[source]))
        return periods * self.period + int(self.by_owner[self.first[source] + r]) + 1


@functools.lru_cache(maxsize=32)
def quota(shares: tuple[int, ...]) -> Quota:
    """The (cached) :class:`Quota` of ``shares``."""
    return Quota(shares)


def _earliest_deadline_first(shares: tuple[int, ...]) -> np.ndarray:
    """Owner of each position of one period. Sample ``j`` of source ``s`` may sit at positions
    ``[floor(j D / a), ceil((j+1) D / a))``: after it, the count is at most ``ceil(a n / D)``;
    by the end, at least ``floor(a n / D)``. The windows admit a schedule (every interval holds
    at most as many whole windows as positions), and earliest deadline first finds one: at
    each position, of the samples released by then, the one whose window closes first (ties
    to the lower source). O(D log D) whatever the number of sources."""
    period = sum(shares)
    counts = np.asarray(shares, dtype=np.int64)
    source = np.repeat(np.arange(len(shares), dtype=np.int64), counts)
    j = np.arange(period, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    release = j * period // counts[source]
    deadline = -(-(j + 1) * period // counts[source])
    by_release = np.lexsort((source, release))
    releases = release[by_release].tolist()
    samples = list(zip(deadline[by_release].tolist(), source[by_release].tolist(), strict=True))
    owners: list[int] = []
    ready: list[tuple[int, int]] = []  # (deadline, source)
    released, push, pop = 0, heapq.heappush, heapq.heappop
    for position in range(period):
        while released < period and releases[released] <= position:
            push(ready, samples[released])
            released += 1
        due, taken = pop(ready)
        assert due > position, "the quota windows admit no schedule"
        owners.append(taken)
    return np.asarray(owners, dtype=np.int16 if len(shares) < 1 << 15 else np.int64)


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
    "MAX_PERIOD",
    "CombinedShards",
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
