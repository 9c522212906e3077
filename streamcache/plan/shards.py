"""The shards an order is made of: their row counts, where each starts, and how rows vary.

The plan reads a dataset's shards only through :class:`ShardCounts`: every shard's row
count and first sample id (index order), and the distribution of row counts (each distinct
count and how many shards have it). A dataset of a million shards keeps these in its node
copy of the shard table (format/node_table.py), memory-mapped and shared by the node's
processes, so no process builds or copies them; for a plain array they are computed here.
Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import EmptyDatasetError
from ._util import PlanError

MAX_SAMPLES = 1 << 62  # an epoch's positions, ids and their sums stay far inside int64


class ShardCounts:
    """Row counts of every shard in index order, with their offsets and distribution.

    Args:
        rows: int64 row count of each shard (read-only; may be a view of a mapped file).
        offsets: ``n + 1`` int64 values, ``offsets[k]`` the first sample id of shard ``k``
            and ``offsets[n]`` the total; None to compute them (one pass, ``8 n`` bytes).
        histogram: ``(values, counts)``: the distinct row counts, ascending, and how many
            shards have each; None to compute it when first asked.

    Use :meth:`of` for untrusted input (it checks every count); the constructor trusts its
    arguments (the node copy was checked when it was made).

    Thread safety: read-only after construction (the histogram, computed once, is the same
    whichever thread computes it).
    """

    __slots__ = ("_histogram", "offsets", "rows", "total")

    def __init__(self, rows: np.ndarray, offsets: np.ndarray | None = None,
                 histogram: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.rows = rows
        if offsets is None:
            offsets = np.zeros(rows.size + 1, dtype=np.int64)
            np.cumsum(rows, out=offsets[1:])
            offsets.setflags(write=False)
        self.offsets = offsets
        self.total = int(offsets[-1])
        self._histogram = histogram

    @classmethod
    def of(cls, shard_rows: Sequence[int] | np.ndarray | ShardCounts) -> ShardCounts:
        """Checked counts: a :class:`ShardCounts` as it is, else a 1-d sequence of
        non-negative integers.

        Raises:
            EmptyDatasetError: no shards.
            PlanError: not 1-d integers, a negative count, more than 2**62 samples.
        """
        if isinstance(shard_rows, ShardCounts):
            return shard_rows
        rows = np.asarray(shard_rows)
        if rows.ndim != 1:
            raise PlanError(f"shard_rows must be a 1-d sequence of row counts, got shape "
                            f"{rows.shape}")
        if rows.size == 0:
            raise EmptyDatasetError("the dataset has no shards; check the index or the "
                                    "dataset URL")
        if rows.dtype.kind not in "iu":
            raise PlanError(f"shard row counts must be integers, got dtype {rows.dtype}")
        if rows.min() < 0:
            raise PlanError(f"shard row counts must be >= 0, got {int(rows.min())} "
                            f"(shard {int(np.argmin(rows))})")
        if rows.max() >= MAX_SAMPLES or int(rows.astype(np.float64).sum()) >= MAX_SAMPLES:
            raise PlanError("the dataset is too large: more than 2**62 samples")
        rows = rows.astype(np.int64)
        rows.setflags(write=False)
        return cls(rows)

    @property
    def num_shards(self) -> int:
        return int(self.rows.size)

    def rows_of(self, shards: np.ndarray) -> np.ndarray:
        """The row counts of ``shards``, from the offsets (the plan reads one column of a
        mapped table, not two: its pages are what each process maps)."""
        return self.offsets[shards + 1] - self.offsets[shards]

    def first_ids(self, shards: np.ndarray) -> np.ndarray:
        """The sample id of each of ``shards``' first row (``offsets[shards]``)."""
        return self.offsets[shards]

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """The shard holding each sample id (empty shards hold none)."""
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """``(values, counts)``: each distinct row count, ascending, and its number of shards."""
        if self._histogram is None:
            self._histogram = row_histogram(self.rows)
        return self._histogram

    def min_nonzero_rows(self) -> int:
        """The fewest rows of a shard that has any (0 when every shard is empty)."""
        values = self.histogram()[0]
        nonzero = values[values > 0]
        return int(nonzero[0]) if nonzero.size else 0

    def has_empty_shards(self) -> bool:
        values = self.histogram()[0]
        return bool(values.size) and int(values[0]) == 0

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardCounts, (np.array(self.rows), np.array(self.offsets), self._histogram))

    def __repr__(self) -> str:
        return f"ShardCounts({self.num_shards} shards, {self.total} rows)"


class ClippedCounts(ShardCounts):
    """The samples ``[start, stop)`` of a dataset as shards of their own, numbered from 0:
    the dataset's shards that hold them, the first and last cut to them (a canonical
    partition's, plan/partitions.py). Nothing is copied: ``absolute`` is a view of the
    dataset's offsets (``offsets[first:last + 1]``, the shards holding ``start`` and
    ``stop - 1``); counts and starts are computed from it when asked. ``rows`` and
    ``offsets`` are made on demand (O(shards)): the order asks only for the methods.
    """

    __slots__ = ("_absolute", "_start", "_stop")

    def __init__(self, absolute: np.ndarray, start: int, stop: int) -> None:
        self._absolute = absolute
        self._start, self._stop = start, stop
        self.total = stop - start
        self._histogram = None

    @property
    def rows(self) -> np.ndarray:  # type: ignore[override]
        return self.rows_of(np.arange(self.num_shards, dtype=np.int64))

    @property
    def offsets(self) -> np.ndarray:  # type: ignore[override]
        return np.clip(self._absolute, self._start, self._stop) - self._start

    @property
    def num_shards(self) -> int:
        return int(self._absolute.size) - 1

    def rows_of(self, shards: np.ndarray) -> np.ndarray:
        absolute = self._absolute
        return (np.minimum(absolute[shards + 1], self._stop)
                - np.maximum(absolute[shards], self._start))

    def first_ids(self, shards: np.ndarray) -> np.ndarray:
        return np.maximum(self._absolute[shards], self._start) - self._start

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._absolute, ids + self._start, side="right") - 1

    def __reduce__(self) -> tuple[Any, ...]:
        return (ClippedCounts, (np.array(self._absolute), self._start, self._stop))

    def __repr__(self) -> str:
        return f"ClippedCounts({self.num_shards} shards, {self.total} rows)"


def row_histogram(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``rows``, ascending, and how often each occurs (int64)."""
    values, counts = np.unique(np.asarray(rows, dtype=np.int64), return_counts=True)
    return values.astype(np.int64), counts.astype(np.int64)


def fill_smallest(histogram: tuple[np.ndarray, np.ndarray], span: int
                  ) -> tuple[int, int, int]:
    """The greedy fill of ``span`` rows with whole shards, smallest first, among the
    non-empty shards of at most ``span`` rows: ``(shards taken, rows they hold, rows of the
    next shard)`` (0 when none is left). What
    :func:`~streamcache.cache.advice.working_set_bound` computes with a unit weight per
    shard, from the distribution of row counts instead of a sort of every shard."""
    values, counts = histogram
    keep = (values > 0) & (values <= span)
    values, counts = values[keep], counts[keep]
    if values.size == 0:
        return 0, 0, 0
    filled = np.cumsum(values * counts)
    full = int(np.searchsorted(filled, span, side="right"))  # whole value groups that fit
    taken = int(counts[:full].sum())
    rows = int(filled[full - 1]) if full else 0
    if full == values.size:
        return taken, rows, 0
    value = int(values[full])
    more = (span - rows) // value  # fewer than the group holds: all of it does not fit
    return taken + more, rows + more * value, value


__all__ = ["MAX_SAMPLES", "ShardCounts", "fill_smallest", "row_histogram"]
