"""Counter-based hashing and keyed bijections: the only randomness the plan uses.

Everything here is plain integer arithmetic (splitmix64-style mixing and a Feistel network),
so the same (seed, epoch) gives the same order on every machine, every Python and every
numpy version. Nothing here draws from a stateful generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._mix import _GAMMA, _MUL1, _MUL2
from .._mix import MASK64 as MASK64  # (the mixing lives in streamcache._mix: see there)
from .._mix import counter_hash as counter_hash
from .._mix import mix64_array as mix64_array
from .._native_plan import feistel_walk
from ._util import PlanError, check_int, check_seed

_FOLD_START = 0x243F6A8885A308D3

# Domain tags keep the keys of different uses of the same (seed, epoch) independent.
TAG_SHARDS = 1
TAG_WINDOW = 2
TAG_STAGGER = 3
TAG_SAMPLE_SEED = 4

FEISTEL_ROUNDS = 6
MAX_DOMAIN = (1 << 32) - 1  # Feistel domains use 32-bit arithmetic (see docs/plan.md)


def mix64(value: int) -> int:
    """The splitmix64 finalizer on one Python int (taken modulo 2**64)."""
    z = value & MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & MASK64
    return z ^ (z >> 31)


def derive_key(*words: int) -> int:
    """A 64-bit key from a sequence of integers, by folding each word through :func:`mix64`."""
    key = _FOLD_START
    for word in words:
        key = mix64((key ^ (word & MASK64)) + _GAMMA)
    return key


def sample_seeds(seed: int, epoch: int, ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """A 64-bit seed for every sample id, from (seed, epoch, id) alone (uint64 array, same
    shape as ``ids``).

    Counter-based: whichever rank or worker reads a sample, its seed is the same, so a
    transform that draws its randomness from it is reproducible across topologies.

    Raises:
        PlanError: a bad seed or epoch, or ids that are not non-negative integers.
    """
    key = derive_key(check_seed(seed), check_int("epoch", epoch, minimum=0), TAG_SAMPLE_SEED)
    values = np.asarray(ids)
    if values.size == 0:
        return np.zeros(values.shape, dtype=np.uint64)
    if values.dtype.kind not in "iu" or int(values.min()) < 0:
        raise PlanError(f"sample ids must be non-negative integers, got dtype {values.dtype}")
    return counter_hash(key, values)


def round_keys(key: int) -> list[np.uint32]:
    """The 32-bit Feistel round keys of a permutation key."""
    return [np.uint32(mix64(key + (r + 1) * _GAMMA) & 0xFFFFFFFF)
            for r in range(FEISTEL_ROUNDS)]


def round_keys_array(keys: np.ndarray) -> list[np.ndarray]:
    """:func:`round_keys` of every key of a uint64 array (the same arithmetic, so a window's
    permutation does not depend on whether it is evaluated alone or with its neighbours)."""
    return [(counter_hash_keys(keys, r) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
            for r in range(FEISTEL_ROUNDS)]


def counter_hash_keys(keys: np.ndarray, counter: int) -> np.ndarray:
    """``mix64(key + (counter + 1) * gamma)`` for every key of a uint64 array."""
    return mix64_array(keys + np.uint64(((counter + 1) * _GAMMA) & MASK64))


def derive_keys(key: int, words: np.ndarray) -> np.ndarray:
    """``derive_key(*prefix, w)`` for every ``w`` of an int64 array, given ``key =
    derive_key(*prefix)``: one more fold, vectorized (uint64 result)."""
    state = words.astype(np.uint64) ^ np.uint64(key & MASK64)
    state += np.uint64(_GAMMA)
    return mix64_array(state)


def fold_key(key: int, word: int) -> int:
    """``derive_key(*prefix, word)`` given ``key = derive_key(*prefix)``."""
    return mix64((key ^ (word & MASK64)) + _GAMMA)


def permute(
    points: np.ndarray,
    sizes: int | np.ndarray,
    keys: int | np.ndarray,
    group: np.ndarray | None = None,
) -> np.ndarray:
    """Keyed bijections of ``[0, size)`` evaluated at ``points``: O(1) per point, no table.

    A Feistel network on the smallest bit width ``t >= 2`` with ``2**t >= size`` (halves of
    ``t // 2`` and ``t - t // 2`` bits, :data:`FEISTEL_ROUNDS` rounds, 32-bit arithmetic) and
    cycle-walking to stay inside ``[0, size)``, in one native pass per bit width
    (``_native_plan.feistel_walk``; its numpy twin gives the same images).

    Args:
        points: int64 array, each point inside its domain.
        sizes: the domain size (``<= MAX_DOMAIN``) shared by every point, or, with ``group``,
            an int64 array of sizes, one per group.
        keys: the 64-bit key shared by every point, or, with ``group``, a uint64 array of
            keys, one per group.
        group: None, or for every point the index of its group in ``sizes`` and ``keys``.

    A (size, key) pair is one bijection, whether its points are passed alone or with others.

    Returns:
        A new int64 array: the image of each point.
    """
    shape = np.shape(points)
    flat = np.ascontiguousarray(points, dtype=np.int64).reshape(-1)
    if group is None:
        size = int(sizes)
        key_column = np.array(round_keys(int(keys)), dtype=np.uint32).reshape(-1, 1)
        return feistel_walk(flat, np.array([size], dtype=np.uint64), key_column,
                                    _width(size)).reshape(shape)
    group = np.asarray(group).reshape(-1)
    group_sizes = np.asarray(sizes, dtype=np.int64).astype(np.uint64)
    group_keys = np.stack(round_keys_array(np.asarray(keys, dtype=np.uint64)))  # (rounds, g)
    widths = np.array([_width(int(size)) for size in group_sizes.tolist()], dtype=np.int64)
    if widths.size and (widths == widths[0]).all():
        return feistel_walk(flat, group_sizes[group],
                                    np.ascontiguousarray(group_keys[:, group]),
                                    int(widths[0])).reshape(shape)
    out = np.empty(flat.size, dtype=np.int64)
    # Points whose domains share a bit width share the shift arithmetic: one pass each.
    point_widths = widths[group]
    for width in np.unique(widths).tolist():
        members = np.flatnonzero(point_widths == width)
        member_group = group[members]
        out[members] = feistel_walk(np.ascontiguousarray(flat[members]),
                                            group_sizes[member_group],
                                            np.ascontiguousarray(group_keys[:, member_group]),
                                            int(width))
    return out.reshape(shape)


def _width(size: int) -> int:
    """The Feistel bit width for a domain of ``size`` points."""
    return max(2, (max(size, 2) - 1).bit_length())
