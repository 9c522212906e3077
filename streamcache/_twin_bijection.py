"""Twin of ``_core.feistel_walk`` (csrc/feistel.h): keyed bijections of ``[0, size)`` by a
Feistel network with cycle-walking, in numpy (the reference the native pass is checked
against; ``streamcache/plan/bijection.py`` builds the sizes and round keys)."""

from __future__ import annotations

import numpy as np

from ._twin_checks import INVALID, OK, Status

_MUL_A = np.uint32(0x9E3779B1)
_MUL_B = np.uint32(0x85EBCA77)


def feistel_walk(points: np.ndarray, sizes: np.ndarray, keys: np.ndarray, width: int,
                 out: np.ndarray) -> Status:
    """``out[i]``: the image of ``points[i]`` under the bijection of ``[0, sizes[i])`` whose
    round ``r`` key is ``keys[r, i]`` (``sizes`` and ``keys``' columns: one per point or one
    for all), on ``width`` bits; see csrc/feistel.h."""
    n = points.size
    per_point = keys.shape[1] == n and n != 1
    if out.size != n or sizes.size not in (1, n) or keys.shape[1] not in (1, n):
        return INVALID, -1, ("out must hold one entry per point; sizes and keys' columns one "
                             "per point or one")
    if not 2 <= width <= 32:
        return INVALID, -1, f"width must be 2..32, got {width}"
    if not 0 <= keys.shape[0] <= 64:
        return INVALID, -1, f"rounds must be 0..64, got {keys.shape[0]}"
    domain = np.broadcast_to(sizes.astype(np.uint64), (n,))
    over = np.flatnonzero(domain > np.uint64(1 << width))
    outside = np.flatnonzero((points < 0) | (points.astype(np.uint64) >= domain))
    if over.size and (not outside.size or over[0] <= outside[0]):
        i = int(over[0])
        return INVALID, i, (f"domain size {int(domain[i])} of point {i} exceeds "
                            f"2**{width}")
    if outside.size:
        i = int(outside[0])
        return INVALID, i, (f"point {i} ({int(points[i])}) is outside its domain "
                                 f"[0, {int(domain[i])})")
    round_keys = [row if per_point else row[0] for row in keys]
    x = _run(points.astype(np.uint32), width, round_keys)
    walking = np.flatnonzero(x.astype(np.uint64) >= domain)
    while walking.size:
        stepped = _run(x[walking], width,
                       [k[walking] if per_point else k for k in round_keys])
        x[walking] = stepped
        walking = walking[stepped.astype(np.uint64) >= domain[walking]]
    out[:] = x.astype(np.int64)
    return OK, -1, ""


def _run(x: np.ndarray, width: int, keys: list[np.ndarray]) -> np.ndarray:
    """One pass of the network on 32-bit values (a new array)."""
    low_bits = width // 2
    for r, key in enumerate(keys):
        split = low_bits if r % 2 == 0 else width - low_bits
        other = width - split
        low = x & np.uint32((1 << split) - 1)
        high = x >> np.uint32(split)
        z = low ^ key
        z *= _MUL_A
        z ^= z >> np.uint32(16)
        z *= _MUL_B
        z >>= np.uint32(32 - other)
        z ^= high
        low <<= np.uint32(other)
        low |= z
        x = low
    return x
