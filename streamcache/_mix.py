"""The splitmix64 mixing of the plan's counter-based hashes (streamcache/plan/bijection.py
re-exports them), in a module of its own that imports nothing of the package: the native
core's twin hashes with it too, and the plan imports the native core."""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def mix64_array(values: np.ndarray) -> np.ndarray:
    """``plan.bijection.mix64`` on every element of a uint64 array (wrapping arithmetic, a
    new array)."""
    z = values ^ (values >> np.uint64(30))
    z *= np.uint64(_MUL1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MUL2)
    z ^= z >> np.uint64(31)
    return z


def counter_hash(key: int, counters: np.ndarray) -> np.ndarray:
    """The splitmix64 stream of ``key`` at the given counters: ``mix64(key + (c + 1) * gamma)``.

    Args:
        key: 64-bit stream key (see ``plan.bijection.derive_key``).
        counters: non-negative int64 or uint64 array.

    Returns:
        A new uint64 array of the same shape.
    """
    state = counters.astype(np.uint64) + np.uint64(1)
    state *= np.uint64(_GAMMA)
    state += np.uint64(key & MASK64)
    return mix64_array(state)
