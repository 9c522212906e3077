"""Twin of ``_core.locate_chunks`` (csrc/gather.h): each row's record batch over a batch's
shards and its row inside it, in numpy (the reference the native kernel is checked against;
``streamcache/format/reader.py`` builds the per-shard counts)."""

from __future__ import annotations

import numpy as np

from ._twin_checks import INVALID, OK, OUT_OF_RANGE, Status

_INT32_MAX = (1 << 31) - 1


def locate_chunks(counts: np.ndarray, fixed: np.ndarray, which: np.ndarray, rows: np.ndarray,
                  flat_out: np.ndarray, local_out: np.ndarray) -> Status:
    """``flat_out[i]``: row i's chunk numbered over the shards one after another;
    ``local_out[i]``: its row inside that chunk (see csrc/gather.h)."""
    n = which.size
    if fixed.size != counts.size or rows.size != n or flat_out.size != n or local_out.size != n:
        return INVALID, -1, ("fixed must hold one entry per shard; rows and both outputs one "
                             "per batch item")
    bad = np.flatnonzero((counts < 1) | (fixed < 1))
    if bad.size:
        k = int(bad[0])
        return INVALID, k, (f"shard {k} has {int(counts[k])} chunks of {int(fixed[k])} rows; "
                            f"both must be at least 1")
    total = np.cumsum(counts)
    if total.size and int(total[-1]) > _INT32_MAX:
        k = int(np.flatnonzero(total > _INT32_MAX)[0])
        return INVALID, k, "more than 2**31 - 1 chunks in one batch's shards"
    outside = np.flatnonzero((which < 0) | (which >= counts.size))
    if outside.size:
        i = int(outside[0])
        return OUT_OF_RANGE, i, f"batch item {i} names shard {int(which[i])} of {counts.size}"
    base = total - counts
    step = fixed[which]
    chunk = np.minimum(np.where(rows >= 0, rows // step, 0), counts[which] - 1)
    with np.errstate(over="ignore"):
        local_out[:] = (rows.astype(np.uint64)
                        - chunk.astype(np.uint64) * step.astype(np.uint64)).astype(np.int64)
    flat_out[:] = (base[which] + chunk).astype(np.int32)
    return OK, -1, ""
