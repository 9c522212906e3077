"""Canonical partitions: an epoch order whose every node reads only its own part of the data.

The default order (:class:`~streamcache.plan.order.EpochOrder`) shuffles the whole dataset in
one stream: its global batches do not depend on the node count, and
:class:`~streamcache.plan.locality.LocalityAssignment` then lets each node read the batch's
samples of the pieces it holds, moving a few to balance the nodes. When a node's part of a
step is small (8-32 samples of an LLM job on 64 nodes), a step's samples fall on the nodes
unevenly, and the moves fetch other nodes' chunks: the bytes a node fetches grow well above
its share (docs/multinode.md). No assignment can avoid that while the order ignores the
nodes.

With ``ShuffleOptions(partitions=P)`` the order itself is cut in ``P`` parts:

- **Partitions.** The samples, in index order, are cut into ``P`` contiguous runs of equal
  size (the first ``total % P`` one sample longer). Each is shuffled on its own, as a dataset
  of its own (its own seed, windows of ``window // P`` samples).
- **Interleaving.** Position ``i < P * q`` (``q = total // P``) is sample ``i // P`` of
  partition ``i % P``; the ``total % P`` last positions are the longer partitions' last
  samples. So any ``P`` consecutive positions starting at a multiple of ``P`` hold exactly
  one sample of every partition, and a global batch that is a multiple of ``P`` holds
  ``batch / P`` of each.
- **Nodes.** Node ``n`` of ``N`` holds partitions ``[n P / N, (n + 1) P / N)`` (``N`` must
  divide ``P``): one contiguous run of ``total / N`` samples, the same run every epoch. Every
  step gives every node exactly its ranks' part, so no sample moves (only a last, partial
  batch may need a few) and a node fetches its run and the pieces at its ends: about
  ``D / N``, whatever the samples' size or the batch.

What it costs: the order depends on ``P`` (fixed when the job starts, part of the cursor), not
on the node count, so a state resumes exactly on any node count that divides ``P`` (elastic
across ``1, 2, 4, ...`` for ``P = 64``), and is refused on others. Each global batch draws
the same number of samples from every partition (a stratified draw over the dataset's
index order, where the default draws from one stream); within a partition the shuffle is the
default's, over a window ``P`` times smaller. Pure; no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from .. import forksafe
from ._util import PlanError
from .bijection import MASK64, derive_key
from .shards import ClippedCounts, ShardCounts
from .shuffle import ShuffleOptions

TAG_PARTITION = 8  # domain tag of the partitions' seeds (see bijection's tags)


class _Order(Protocol):
    """What a partition's own order offers (an ``EpochOrder``)."""

    def samples_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ...


def partition_bounds(total: int, partitions: int) -> np.ndarray:
    """The first sample id of every partition, and ``total`` (``partitions + 1`` int64): the
    first ``total % partitions`` partitions hold one sample more."""
    quotient, remainder = divmod(total, partitions)
    index = np.arange(partitions + 1, dtype=np.int64)
    return index * quotient + np.minimum(index, remainder)


def partition_of_ids(ids: np.ndarray, total: int, partitions: int) -> np.ndarray:
    """The partition (int64) of each sample id in ``[0, total)`` (``partitions <= total``)."""
    quotient, remainder = divmod(total, partitions)
    ids = np.asarray(ids, dtype=np.int64)
    longer = remainder * (quotient + 1)  # the ids of the longer partitions come first
    return np.where(ids < longer, ids // (quotient + 1),
                    remainder + (ids - longer) // max(quotient, 1))


class Partitions:
    """The position -> (sample id, shard) map of an order with ``shuffle.partitions`` parts.

    Args:
        counts: the dataset's shard row counts.
        seed, epoch: the order's.
        shuffle: the order's options (``partitions > 0``).
        make_order: builds a partition's own order (``EpochOrder``), from its shards' counts
            (a :class:`ClippedCounts`: views of ``counts``), a seed, the epoch and options
            without partitions.

    Raises:
        PlanError: more partitions than samples.

    Memory: each partition's order is built when first used; its shards' counts are views of
    ``counts`` (nothing per shard is copied; they were, ~16 bytes a shard an epoch). Thread
    safety: :meth:`resolve` may be called from several threads at once.
    """

    def __init__(self, counts: ShardCounts, seed: int, epoch: int, shuffle: ShuffleOptions,
                 make_order: Callable[[ShardCounts, int, int, ShuffleOptions], _Order],
                 ) -> None:
        count = shuffle.partitions
        if count > counts.total:
            raise PlanError(f"{count} partitions of {counts.total} samples: every partition "
                            "needs a sample; choose fewer partitions (or none)")
        self.count = count
        self.counts = counts
        self.total = counts.total
        self.bounds = partition_bounds(self.total, count)
        self._quotient = self.total // count
        window = shuffle.window // count if shuffle.window_unit == "samples" else shuffle.window
        self._options = replace(shuffle, partitions=0, window=max(1, window))
        self._seed, self._epoch, self._make = seed, epoch, make_order
        self._orders: list[tuple[_Order, int, int] | None] = [None] * count
        self._lock = threading.Lock()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # (a parent's thread may have been building an order)

    def resolve(self, positions: np.ndarray) -> np.ndarray:
        """A (2, n) int64 array: the sample id and the shard at each position."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty((2, positions.size), dtype=np.int64)
        if positions.size == 0:
            return out
        first, count = int(positions[0]), self.count
        interleaved = self._quotient * count
        if positions.size >= count and int(positions[-1]) < interleaved and \
                int(positions[-1]) - first + 1 == positions.size:
            # a run of positions (what the block cache asks): partition p's are every
            # count-th, at consecutive positions of its own order
            for offset in range(count):
                local_first = (first + offset) // count
                size = len(range(offset, positions.size, count))
                self._fill(out[:, offset::count], (first + offset) % count,
                           np.arange(local_first, local_first + size, dtype=np.int64))
            return out
        parts = np.where(positions < interleaved, positions % count, positions - interleaved)
        local = np.where(positions < interleaved, positions // count, self._quotient)
        by_part = np.argsort(parts, kind="stable")
        sorted_parts = parts[by_part]
        present = np.flatnonzero(np.diff(sorted_parts, prepend=-1))
        ends = np.append(present[1:], by_part.size)
        for begin, end in zip(present.tolist(), ends.tolist(), strict=True):
            which = by_part[begin:end]
            found = np.empty((2, which.size), dtype=np.int64)
            self._fill(found, int(sorted_parts[begin]), local[which])
            out[:, which] = found
        return out

    def _fill(self, out: np.ndarray, part: int, local: np.ndarray) -> None:
        """``out[0]``, ``out[1]``: the sample ids and shards at positions ``local`` of
        partition ``part``'s own order."""
        order, first_id, first_shard = self._order(part)
        ids, shards, _ = order.samples_at(local)
        np.add(ids, first_id, out=out[0])
        np.add(shards, first_shard, out=out[1])

    def _order(self, part: int) -> tuple[_Order, int, int]:
        """Partition ``part``'s order, its first sample id and its first shard."""
        built = self._orders[part]
        if built is not None:
            return built
        with self._lock:  # (built once, whichever thread asks first; no I/O here)
            built = self._orders[part]
            if built is None:
                start, stop = int(self.bounds[part]), int(self.bounds[part + 1])
                offsets = self.counts.offsets
                first = int(np.searchsorted(offsets, start, side="right")) - 1
                last = int(np.searchsorted(offsets, stop, side="left"))  # (exclusive)
                # (a view of the dataset's offsets: nothing per shard is copied)
                counts = ClippedCounts(offsets[first:last + 1], start, stop)
                seed = derive_key(self._seed, part, TAG_PARTITION) & MASK64
                built = (self._make(counts, seed, self._epoch, self._options), start, first)
                self._orders[part] = built
        return built

    def __repr__(self) -> str:
        return f"Partitions(count={self.count}, total={self.total})"


def check_partition_layout(partitions: int, num_nodes: int, global_batch: int | None) -> None:
    """Refuse a node count or a global batch that canonical partitions cannot serve evenly.

    Raises:
        PlanError: ``num_nodes`` does not divide ``partitions``, or ``global_batch`` is not a
            multiple of ``partitions``.
    """
    if partitions % num_nodes:
        divisors = [str(n) for n in range(1, partitions + 1) if partitions % n == 0]
        listed = ", ".join(divisors[:12]) + (", ..." if len(divisors) > 12 else "")
        raise PlanError(f"{num_nodes} nodes cannot share {partitions} canonical partitions "
                        f"evenly: run on a node count that divides {partitions} ({listed}), "
                        "or start the job with another partitions=")
    if global_batch is not None and global_batch % partitions:
        raise PlanError(f"a global batch of {global_batch} is not a multiple of "
                        f"partitions={partitions}: every step takes as many samples of every "
                        "partition; choose a global batch that is a multiple of it, or fewer "
                        "partitions")
