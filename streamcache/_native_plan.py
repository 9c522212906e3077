"""The plan's native kernel (``csrc/feistel.h``), from the C++ extension or its twin
(``streamcache._twin_bijection``): the keyed Feistel bijections of its shuffles. Re-exported
by :mod:`streamcache._native`.

Thread safety: may be called from any thread; the native pass releases the GIL for long
arrays.
"""

from __future__ import annotations

import numpy as np

from . import _native_backend, _twin_checks
from ._native_backend import raise_error, refused


def feistel_walk(points: np.ndarray, sizes: np.ndarray, keys: np.ndarray,
                 width: int) -> np.ndarray:
    """Keyed bijections of ``[0, size)`` at ``points`` (int64), by a Feistel network of
    ``width`` bits with cycle-walking: ``sizes`` (uint64) and the columns of ``keys`` (uint32,
    one row per round) one per point or one for all (csrc/feistel.h). A new int64 array.

    Raises:
        NativeError: a point outside its domain, a size beyond ``2**width``, arrays of other
            types or lengths.
    """
    out = np.empty(len(points), dtype=np.int64)
    try:
        status = _native_backend.active.feistel_walk(points, sizes, keys, width, out)
    except TypeError as exc:
        refused(exc, _twin_checks.array_problem_status("feistel_walk", "points", points,
                                                        np.dtype(np.int64)))
    raise_error(*status)
    return out
