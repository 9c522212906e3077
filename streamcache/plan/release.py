"""Which samples a node with a surplus gives away in a step: those of its lowest chunk
priority (a hash of the sample's chunk, the same in every step), so that step after step the
released samples come from the same few chunks (:mod:`streamcache.plan.locality`, "paid
moves"). Pure; no I/O.
"""

from __future__ import annotations

import numpy as np

#: Bits of a chunk priority that are ranked (the top bits of its 64-bit hash).
PRIORITY_BITS = 20


def released_samples(candidate: np.ndarray, owners: np.ndarray, hashed: np.ndarray, width: int,
              surplus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The samples each node gives away in each step, as flat indices (ascending) with their
    hashes: of the ``candidate`` samples (flat indices, ascending, on nodes with a surplus,
    ``owners`` theirs), as many as the node's surplus, lowest chunk priority first, then by
    slot.

    Only the samples whose priority is below a bound that their group (step, node) almost
    surely needs are sorted (a few times its surplus); a group that the bound leaves short
    is ranked whole. The result is the same either way."""
    count = surplus.shape[1]
    group = (candidate // width) * count + owners
    need = surplus.ravel()
    size = np.bincount(group, minlength=need.size)
    priority = (hashed >> np.uint64(64 - PRIORITY_BITS)).astype(np.int64)
    # (the lowest `need` of a group are below this more often than not; a group left short
    # is ranked whole below)
    wanted = need + 2 * np.sqrt(np.maximum(need, 0)).astype(np.int64) + 2
    bound = np.minimum(1 << PRIORITY_BITS, (wanted << PRIORITY_BITS) // np.maximum(size, 1))
    low = priority < bound[group]
    short = np.bincount(group[low], minlength=need.size) < need
    if short.any():  # (rare: this group's lowest priorities came out high; rank it whole)
        low |= short[group]
    picked = np.flatnonzero(low)
    ranked, ranked_group = sorted_by(group[picked], priority[picked], PRIORITY_BITS)
    ranked = picked[ranked]
    rank_in_group = np.arange(ranked.size) - np.searchsorted(ranked_group, ranked_group)
    chosen = np.sort(ranked[rank_in_group < need[ranked_group]])
    return candidate[chosen], hashed[chosen]


def sorted_by(major: np.ndarray, minor: np.ndarray, minor_bits: int,
               ) -> tuple[np.ndarray, np.ndarray]:
    """The indices that sort by (major, minor, index), non-negative int64 arrays with
    ``minor < 2**minor_bits``, and ``major`` in that order: a sort of packed keys (cheaper
    than an argsort) where they fit 63 bits, else a lexsort."""
    index_bits = max(1, int(major.size).bit_length())
    if int(major.max(initial=0)).bit_length() + minor_bits + index_bits <= 63:
        keys = (major << np.int64(minor_bits + index_bits)) | (minor << np.int64(index_bits))
        keys |= np.arange(major.size, dtype=np.int64)
        keys.sort()
        return keys & np.int64((1 << index_bits) - 1), keys >> np.int64(minor_bits + index_bits)
    order = np.lexsort((np.arange(major.size), minor, major))
    return order, major[order]


__all__ = ["PRIORITY_BITS", "released_samples", "sorted_by"]
