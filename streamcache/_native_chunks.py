"""Where a batch's rows lie in chunked shards (``csrc/gather.h``'s ``locate_chunks``), from
the C++ extension or its twin (``streamcache._twin_chunks``). Re-exported by
:mod:`streamcache._native`.

Thread safety: may be called from any thread (the native kernel keeps the GIL: a batch's rows
take a microsecond or two).
"""

from __future__ import annotations

import numpy as np

from . import _native_backend, _twin_checks
from ._native_backend import raise_error, refused


def locate_chunks(counts: np.ndarray, fixed: np.ndarray, which: np.ndarray,
                  rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's record batch over a batch's shards (shard k's chunk j is ``sum(counts[:k])
    + j``; int32) and its row inside it (int64), for shards whose chunks hold ``fixed[k]``
    rows each (int64 arrays, one entry per shard; ``which`` int32 and ``rows`` int64, one per
    row). A row outside its shard stays in its first or last chunk, outside its rows.

    Raises:
        RowOutOfRangeError: a shard index outside the shards.
        NativeError: a count or row count below 1, over 2**31 - 1 chunks, arrays of other
            types or lengths.
    """
    flat = np.empty(len(which), dtype=np.int32)
    local = np.empty(len(which), dtype=np.int64)
    try:
        status = _native_backend.active.locate_chunks(counts, fixed, which, rows, flat, local)
    except TypeError as exc:
        refused(exc, _twin_checks.array_problem_status("locate_chunks", "counts", counts,
                                                        np.dtype(np.int64)))
    raise_error(*status)
    return flat, local
