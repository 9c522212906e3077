"""Which cached shards to evict: farthest next use first (Belady), least recently used as the
tie-break and as the whole rule when no plan is known. Pure functions, no I/O.

:func:`choose_victims` is the rule; :func:`victims_in_order` is what the node cache runs when
an install would exceed the budget (the same choice, ranked once with numpy).
:func:`simulate_fetches` replays a sequence of shard reads through a cache of a given budget
under either policy and counts the fetches, so the two can be compared on a real plan order
(benchmarks/bench_cache.py) and tested exhaustively.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)

#: ``next_use(key)``: the plan position at which a cached entry is read next; ``math.inf``
#: when it is not read again (or when nothing is known about it).
NextUse = Callable[[K], float]


@dataclass(frozen=True)
class Resident:
    """One cached entry as eviction sees it."""

    nbytes: int
    last_used: float  # any monotone clock shared by the entries compared


def choose_victims(residents: Mapping[K, Resident], incoming: int, limit: int,
                   next_use: Callable[[K], float] | None = None,
                   last_resort: Collection[K] = ()) -> list[K]:
    """The entries to evict so that ``incoming`` more bytes fit within ``limit``.

    Victims are taken farthest next use first; among equal next uses (and for every entry
    when ``next_use`` is None) least recently used first; entries in ``last_resort`` only
    after all others. Returns as few as that order allows, possibly all of them: the caller
    decides what to do when even that is not enough.
    """
    total = sum(r.nbytes for r in residents.values())
    if total + incoming <= limit:
        return []

    def rank(key: K) -> tuple[bool, float, float]:
        far = next_use(key) if next_use is not None else math.inf
        return (key in last_resort, -far, residents[key].last_used)

    victims: list[K] = []
    for key in sorted(residents, key=rank):
        victims.append(key)
        total -= residents[key].nbytes
        if total + incoming <= limit:
            break
    return victims


def victims_in_order(keys: Sequence[K], nbytes: np.ndarray, last_used: np.ndarray,
                     far: np.ndarray, incoming: int, limit: int,
                     fresh: Callable[[K], bool]) -> list[K]:
    """:func:`choose_victims` for a cache of many entries, with entries that prove ``fresh``
    kept as last resort, ranked once: what ``choose_victims`` returns when it is run again
    with every entry of its answer asked ``fresh`` (those that are join ``last_resort``)
    until its answer holds no entry not asked yet, as :meth:`.accounting.Accounting._evict`
    did. ``keys[i]`` holds ``nbytes[i]`` bytes, was last used at ``last_used[i]`` and is
    read next at ``far[i]`` (``math.inf``: never, or unknown).

    One stable sort of the arrays (numpy) instead of a Python key per entry per round: with
    10,000 entries an eviction took 80-122 ms, two full rankings of Python calls (50,000:
    0.5 s), on every install once the cache is full. ``fresh`` is asked once per entry, in
    eviction order, only until enough bytes are found.
    """
    nbytes = np.asarray(nbytes, dtype=np.int64)
    total = int(nbytes.sum())
    if total + incoming <= limit:
        return []
    # farthest next use first, then least recently used, then the keys' order (as the stable
    # sort of choose_victims)
    order = np.lexsort((np.arange(len(keys)), np.asarray(last_used, dtype=np.float64),
                        -np.asarray(far, dtype=np.float64)))
    victims: list[K] = []
    deferred: list[int] = []
    for index in order.tolist():
        key = keys[index]
        if fresh(key):
            deferred.append(index)
            continue
        victims.append(key)
        total -= int(nbytes[index])
        if total + incoming <= limit:
            return victims
    for index in deferred:  # (already in eviction order)
        victims.append(keys[index])
        total -= int(nbytes[index])
        if total + incoming <= limit:
            break
    return victims


def next_use_table(reads: np.ndarray) -> np.ndarray:
    """For each read i of ``reads`` (shard ids), the index of the next read of the same shard
    (``len(reads)`` when there is none): the oracle Belady needs."""
    reads = np.asarray(reads, dtype=np.int64)
    following = np.full(len(reads), len(reads), dtype=np.int64)
    last_seen: dict[int, int] = {}
    for i in range(len(reads) - 1, -1, -1):
        shard = int(reads[i])
        following[i] = last_seen.get(shard, len(reads))
        last_seen[shard] = i
    return following


def simulate_fetches(reads: Sequence[int] | np.ndarray, shard_bytes: Sequence[int] | np.ndarray,
                     limit: int, policy: str) -> int:
    """Fetches needed to serve ``reads`` (shard ids, in read order) through a cache of
    ``limit`` bytes that evicts by ``policy`` (``"belady"`` or ``"lru"``).

    The first read of a shard is a fetch under both policies; the difference is re-fetches.
    The shard being read is never its own victim.
    """
    if policy not in ("belady", "lru"):
        raise ValueError(f"policy must be 'belady' or 'lru', not {policy!r}")
    reads = np.asarray(reads, dtype=np.int64)
    following = next_use_table(reads)
    resident: dict[int, Resident] = {}
    upcoming: dict[int, float] = {}
    fetches = 0
    for i, shard_id in enumerate(reads.tolist()):
        upcoming[shard_id] = float(following[i])
        if shard_id in resident:
            resident[shard_id] = Resident(resident[shard_id].nbytes, i)
            continue
        fetches += 1
        size = int(shard_bytes[shard_id])
        rule = upcoming.__getitem__ if policy == "belady" else None
        for victim in choose_victims(resident, size, limit, rule):
            del resident[victim]
        resident[shard_id] = Resident(size, i)
    return fetches
