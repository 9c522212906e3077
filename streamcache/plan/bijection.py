"""Counter-based hashing and keyed bijections: the only randomness the plan uses.

Everything here is plain integer arithmetic (splitmix64-style mixing and a Feistel network),
so the same (seed, epoch) gives the same order on every machine, every Python and every
numpy version. Nothing here draws from a stateful generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._util import PlanError, check_int, check_seed

MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
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


def mix64_array(values: np.ndarray) -> np.ndarray:
    """:func:`mix64` on every element of a uint64 array (wrapping arithmetic, new array)."""
    z = values ^ (values >> np.uint64(30))
    z *= np.uint64(_MUL1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MUL2)
    z ^= z >> np.uint64(31)
    return z


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


def counter_hash(key: int, counters: np.ndarray) -> np.ndarray:
    """The splitmix64 stream of ``key`` at the given counters: ``mix64(key + (c + 1) * gamma)``.

    Args:
        key: 64-bit stream key (see :func:`derive_key`).
        counters: non-negative int64 or uint64 array.

    Returns:
        A new uint64 array of the same shape.
    """
    state = counters.astype(np.uint64) + np.uint64(1)
    state *= np.uint64(_GAMMA)
    state += np.uint64(key & MASK64)
    return mix64_array(state)


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
    cycle-walking to stay inside ``[0, size)``.

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
    if group is None:
        size = int(sizes)
        return _Network(np.uint32(size), _width(size), round_keys(int(keys))).walk(points)
    group_sizes = np.asarray(sizes, dtype=np.int64)
    group_keys = round_keys_array(np.asarray(keys, dtype=np.uint64))
    widths = [_width(int(size)) for size in group_sizes.tolist()]
    if len(set(widths)) == 1:
        return _Network(group_sizes.astype(np.uint32)[group], widths[0],
                        [k[group] for k in group_keys]).walk(points)
    out = np.empty(points.size, dtype=np.int64)
    # Points whose domains share a bit width share the shift arithmetic: one pass each.
    for width in sorted(set(widths)):
        members = np.flatnonzero(np.array([w == width for w in widths])[group])
        member_group = group[members]
        network = _Network(group_sizes.astype(np.uint32)[member_group], width,
                           [k[member_group] for k in group_keys])
        out[members] = network.walk(points[members])
    return out


def _width(size: int) -> int:
    """The Feistel bit width for a domain of ``size`` points."""
    return max(2, (max(size, 2) - 1).bit_length())


class _Network:
    """A Feistel network of one bit width; the domain sizes and round keys are each either
    one value shared by every point or an array with one value per point."""

    def __init__(self, sizes: Any, width: int, keys: list[Any]) -> None:
        self.sizes = sizes
        self.keys = keys
        self.width = width
        low = width // 2
        # Per round: (low-part mask, low-part bits, the shift that keeps a hash's top bits).
        self.rounds = [
            (np.uint32((1 << split) - 1), np.uint32(split), np.uint32(width - split),
             np.uint32(32 - (width - split)))
            for split in (low, width - low)
        ] * (FEISTEL_ROUNDS // 2)

    def walk(self, points: np.ndarray) -> np.ndarray:
        """The permutation with cycle-walking: every image lands inside its domain."""
        out = self.run(points.astype(np.uint32))
        if not isinstance(self.sizes, np.ndarray) and int(self.sizes) == 1 << self.width:
            return out.astype(np.int64)  # the domain is exactly the network's: no walking
        walking = np.flatnonzero(out >= self.sizes)
        while walking.size:
            sub = self.take(walking)
            stepped = sub.run(out[walking])
            out[walking] = stepped
            walking = walking[stepped >= sub.sizes]
        return out.astype(np.int64)

    def take(self, index: np.ndarray) -> _Network:
        """The network for the points at ``index`` (shared values stay shared)."""
        sub = object.__new__(_Network)
        sub.sizes = _pick(self.sizes, index)
        sub.keys = [_pick(k, index) for k in self.keys]
        sub.width = self.width
        sub.rounds = self.rounds
        return sub

    def run(self, x: np.ndarray) -> np.ndarray:
        """One pass of the network on 32-bit values (a new array; ``x`` is left alone)."""
        for (mask, split, width, keep_top), key in zip(self.rounds, self.keys, strict=True):
            low = x & mask
            high = x >> split
            # Round function: a keyed multiply-xorshift hash; its top bits are the best mixed.
            z = low ^ key
            z *= np.uint32(0x9E3779B1)
            z ^= z >> np.uint32(16)
            z *= np.uint32(0x85EBCA77)
            z >>= keep_top
            z ^= high
            low <<= width
            low |= z
            x = low
        return x


def _pick(value: Any, index: np.ndarray) -> Any:
    return value[index] if isinstance(value, np.ndarray) else value
