"""The epoch order: one global sequence of sample ids per (shards, seed, epoch, options).

Position ``p`` of an epoch maps to a sample id in three steps, each a bijection:

1. a *stagger* shuffle inside windows offset by half a window (only when there is more than
   one window and ``stagger`` is on), so that no batch sees a hard window boundary;
2. a *window* shuffle inside consecutive windows of the shard-permuted stream;
3. the shard-permuted stream itself: shards in a keyed random order, rows in file order.

A sample's global id is its index-order id: row ``r`` of shard ``k`` has id
``sum(shard_rows[:k]) + r``. The order never depends on ranks, nodes or workers. See
docs/plan.md for the reasons behind each choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import EmptyDatasetError
from ._util import PlanError, check_int, check_positions, check_seed, check_span
from .bijection import MAX_DOMAIN, TAG_STAGGER, TAG_WINDOW, derive_key
from .blocks import BLOCK, PositionBlocks
from .partitions import Partitions
from .shards import ShardCounts
from .shuffle import DEFAULT_SHUFFLE, ShuffleOptions
from .stream import ShardStream
from .windows import RegularWindows, ShardWindows, ShuffleLayer, Windows

_CHUNK = 1 << 20  # positions per pass when scanning long ranges


class EpochOrder:
    """The sample order of one epoch, with O(log shards) random access to any position.

    Args:
        shard_rows: row count of every shard, in index order (empty shards are allowed and
            simply hold no positions), or their :class:`~streamcache.plan.shards.ShardCounts`
            (a dataset's, shared by its orders: nothing of the shards is copied).
        seed: 0 <= seed < 2**64.
        epoch: >= 0.
        shuffle: :class:`ShuffleOptions` (default: shuffled, 2**18-sample staggered windows).
        cache_bytes: memory for materialized blocks of the order (a least-recently-used
            cache; a sequential reader uses one or two blocks at a time).

    Raises:
        EmptyDatasetError: no shards, or every shard is empty.
        PlanError: a negative row count, a bad seed, epoch or option.

    Memory is O(window): the shard permutation is evaluated per slot, and the stream's and
    the windows' bounds are found near the positions asked for (see stream.py), plus the
    cache. Thread safety: every method may be called from several threads at once (the
    caches take locks).
    """

    def __init__(
        self,
        shard_rows: Sequence[int] | np.ndarray | ShardCounts,
        seed: int,
        epoch: int,
        shuffle: ShuffleOptions = DEFAULT_SHUFFLE,
        *,
        cache_bytes: int = 16 << 20,
    ) -> None:
        self.seed = check_seed(seed)
        self.epoch = check_int("epoch", epoch, minimum=0)
        if not isinstance(shuffle, ShuffleOptions):
            raise PlanError(f"shuffle must be a ShuffleOptions, got {shuffle!r}")
        self.shuffle = shuffle
        counts = ShardCounts.of(shard_rows)
        if counts.num_shards > MAX_DOMAIN:
            raise PlanError(f"too many shards ({counts.num_shards}); at most {MAX_DOMAIN}")
        self.counts = counts
        self._stream = ShardStream(counts, self.seed, self.epoch, shuffle.enabled)
        self.num_shards = counts.num_shards
        self.num_samples = counts.total
        if self.num_samples == 0:
            raise EmptyDatasetError("the dataset holds no samples (every shard is empty); "
                                    "check the index or the dataset URL")
        self._partitions = Partitions(counts, self.seed, self.epoch, shuffle, EpochOrder) \
            if shuffle.partitions else None
        self._layers = self._build_layers() if shuffle.enabled and \
            self._partitions is None else []
        self._cache_bytes = check_int("cache_bytes", cache_bytes, minimum=0)
        self._blocks = PositionBlocks(self._resolve, self.num_samples, self._cache_bytes)

    @property
    def shard_rows(self) -> np.ndarray:
        """Every shard's row count (the counts' own array; made on demand for a partition's)."""
        return self.counts.rows

    @property
    def shard_offsets(self) -> np.ndarray:
        """Every shard's first sample id, and the total (as :attr:`shard_rows`)."""
        return self.counts.offsets

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its arguments (for worker processes started with spawn): the order is
        # rebuilt, not copied, and the cache and its lock stay behind.
        return (_rebuild, (self.counts, self.seed, self.epoch, self.shuffle,
                           self._cache_bytes))

    def _build_layers(self) -> list[ShuffleLayer]:
        """The shuffle layers applied to a position, outermost (stagger) first."""
        total = self.num_samples
        windows: Windows
        if self.shuffle.window_unit == "samples":
            windows = RegularWindows(min(self.shuffle.window, total), 0, total)
        else:
            windows = ShardWindows(self._stream, self.shuffle.window)
        if windows.largest > MAX_DOMAIN:
            raise PlanError(f"a shuffle window of {windows.largest} samples is too large: "
                            f"windows hold at most {MAX_DOMAIN} samples; choose a smaller "
                            "window")
        layers = [ShuffleLayer(windows, derive_key(self.seed, self.epoch, TAG_WINDOW))]
        if self.shuffle.stagger and windows.count > 1:
            layers.insert(0, ShuffleLayer(windows.staggered(),
                                          derive_key(self.seed, self.epoch, TAG_STAGGER)))
        return layers

    # ---------------------------------------------------------------- positions -> ids

    def sample_ids(self, start: int, stop: int) -> np.ndarray:
        """Global sample ids (int64) at positions ``[start, stop)`` of the epoch.

        Raises:
            PositionOutOfRangeError: unless ``0 <= start <= stop <= num_samples``.
        """
        check_span(start, stop, self.num_samples)
        if not self.shuffle.enabled and self._partitions is None:
            return np.arange(start, stop, dtype=np.int64)
        return self._blocks.lookup(start, stop)[0].copy()

    def sample_ids_at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Global sample ids (int64) at arbitrary positions (any shape, each in range).

        Evaluated directly, without the block cache: best for long arrays (a rank's positions
        for many steps) or scattered probes.

        Raises:
            PositionOutOfRangeError: a position outside ``[0, num_samples)``.
            PlanError: positions that are not integers.
        """
        pos = check_positions(positions, self.num_samples)
        return self._resolve(pos.ravel())[0].reshape(pos.shape)

    def samples(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sample id, shard index, row within shard) at positions ``[start, stop)``, all
        int64, through the block cache. Raises like :meth:`sample_ids`."""
        check_span(start, stop, self.num_samples)
        resolved = self._blocks.lookup(start, stop)
        shards = resolved[1].copy()
        return resolved[0].copy(), shards, resolved[0] - self.counts.first_ids(shards)

    def samples_at(self, positions: np.ndarray | Sequence[int]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sample id, shard index, row within shard) at arbitrary positions, all int64 and
        of the positions' shape: everything the reader needs, in one pass. Raises like
        :meth:`sample_ids_at`."""
        pos = check_positions(positions, self.num_samples)
        resolved = self._resolve(pos.ravel())
        shards = resolved[1]
        rows = resolved[0] - self.counts.first_ids(shards)
        return (resolved[0].reshape(pos.shape), shards.reshape(pos.shape),
                rows.reshape(pos.shape))

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, row within shard) of positions ``[start, stop)``, both int64: what
        the reader gathers. Raises like :meth:`sample_ids`."""
        _, shards, rows = self.samples(start, stop)
        return shards, rows

    def shard_first_use(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Each shard read in positions ``[start, stop)``, with the first position that reads it.

        Returns:
            ``(shards, positions)``, int64 arrays sorted by position: the order in which a
            reader starting at ``start`` first needs each shard (prefetch and eviction order).
        """
        check_span(start, stop, self.num_samples)
        return first_uses(self.locate, self.num_shards, start, stop)

    def shard_of_ids(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, row within shard) of global sample ids, both int64.

        Raises:
            PositionOutOfRangeError: an id outside ``[0, num_samples)``.
        """
        ids = check_positions(ids, self.num_samples)
        shards = self.counts.shard_of(ids)
        return shards, ids - self.counts.first_ids(shards)

    # ---------------------------------------------------------------- internals

    def _resolve(self, positions: np.ndarray) -> np.ndarray:
        """A (2, n) int64 array: the sample id and the shard of each position."""
        if self._partitions is not None:
            return self._partitions.resolve(positions)
        out = np.empty((2, positions.size), dtype=np.int64)
        # Pieces of one block keep every temporary array in the CPU caches (3x faster on
        # long arrays than one pass).
        for first in range(0, positions.size, BLOCK):
            stream = positions[first:first + BLOCK]
            for layer in self._layers:
                stream = layer.apply(stream)
            out[0, first:first + BLOCK], out[1, first:first + BLOCK] = \
                self._stream.resolve(stream)
        return out

    def __repr__(self) -> str:
        return (f"EpochOrder(num_samples={self.num_samples}, num_shards={self.num_shards}, "
                f"seed={self.seed}, epoch={self.epoch}, shuffle={self.shuffle})")


def _rebuild(counts: ShardCounts, seed: int, epoch: int, shuffle: ShuffleOptions,
             cache_bytes: int) -> EpochOrder:
    return EpochOrder(counts, seed, epoch, shuffle, cache_bytes=cache_bytes)


def first_uses(locate: Callable[[int, int], tuple[np.ndarray, np.ndarray]], num_shards: int,
               start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Each shard read in positions ``[start, stop)`` (by ``locate(lo, hi) -> (shards,
    rows)``), with its first position, sorted by position; shared by every order. Memory:
    the shards the range reads, not ``num_shards``."""
    del num_shards  # (the shards read are found, not looked up in a table of all of them)
    shards_seen, firsts = [], []
    for chunk in range(start, stop, _CHUNK):
        shards, _ = locate(chunk, min(stop, chunk + _CHUNK))
        unique, at = np.unique(shards, return_index=True)
        shards_seen.append(unique)
        firsts.append(at.astype(np.int64) + chunk)
    if not shards_seen:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    shards, positions = np.concatenate(shards_seen), np.concatenate(firsts)
    by_shard = np.lexsort((positions, shards))  # a shard's earliest chunk first
    keep = by_shard[np.concatenate(([True], np.diff(shards[by_shard]) != 0))]
    by_position = keep[np.argsort(positions[keep], kind="stable")]
    return shards[by_position].astype(np.int64), positions[by_position]
