"""Which cached shards to evict: farthest next use first (Belady), least recently used as the
tie-break and as the whole rule when no plan is known. Pure functions, no I/O.

:func:`choose_victims` is the rule; :func:`victims_in_order`, the same over arrays, is what the
node cache runs when an install would exceed the budget.
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
    when ``next_use`` is None) least recently used first, then in the mapping's order;
    entries in ``last_resort`` only after all others. Returns as few as that order allows,
    possibly all of them: the caller decides what to do when even that is not enough.
    """
    keys = list(residents)
    far = [math.inf if next_use is None else next_use(key) for key in keys]
    return victims_in_order(keys, np.array([residents[key].nbytes for key in keys], np.int64),
                            np.array([residents[key].last_used for key in keys], np.float64),
                            np.array(far, np.float64), incoming, limit,
                            last_resort.__contains__)


def victims_in_order(keys: Sequence[K], nbytes: np.ndarray, last_used: np.ndarray,
                     far: np.ndarray, incoming: int, limit: int,
                     fresh: Callable[[K], bool]) -> list[K]:
    """:func:`choose_victims` over arrays, with the entries that prove ``fresh`` as its last
    resort: ``keys[i]`` holds ``nbytes[i]`` bytes, was last used at ``last_used[i]`` and is
    read next at ``far[i]`` (``math.inf``: never, or unknown). ``fresh`` is asked of each
    entry at most once, in eviction order, only until enough bytes are found (the node cache
    asks whether another process handed the shard out lately: a ``stat``).

    One stable sort of the arrays: the node cache ranked its entries with a Python key per
    entry, twice an eviction (once more after asking), which took 80-122 ms with 10,000
    entries and 0.5 s with 50,000, on every install once the cache is full.
    """
    nbytes = np.asarray(nbytes, dtype=np.int64)
    total = sum(nbytes.tolist())  # (Python ints: an accounting of huge entries cannot wrap)
    if total + incoming <= limit:
        return []
    # farthest next use first, then least recently used, then the keys' order
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
