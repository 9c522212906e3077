"""The quota sequence of a mixture's shares: which source owns each position of a phase.
Pure, no I/O.

Position ``j`` of a *phase* (a stretch of the mixture read with one set of weights) belongs to
one source; the count of source ``s`` among the first ``n`` positions, its quota ``T_s(n)``,
always lies between ``floor(a_s n / D)`` and ``ceil(a_s n / D)``: within one sample of the
weights at every prefix, exact at every multiple of ``D``, and nondecreasing (it is a count).
Such a sequence exists for any weights (the chairman assignment problem); earliest-deadline-
first over the windows the two bounds allow each of a source's samples finds one (see
docs/mixtures.md). Being exact at ``D``, the sequence repeats with period ``D``, so a table of
one period gives any position in O(1).
"""

from __future__ import annotations

import functools
import heapq

import numpy as np


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



__all__ = ["Quota", "quota"]
