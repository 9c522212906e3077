"""Pieces held twice, chosen from the first epoch's order (multi-node locality).

With 3 to 16 nodes a fraction of the pieces is held by a second node (a *backup*), so that a
step's imbalance between nodes can be moved at no cost (docs/multinode.md, "How the split
works"). Drawn blind (a Weyl sequence over each shard's pieces, a backup at a hashed distance:
:mod:`streamcache.plan.locality`), many of those pairs sit where no step needs them. When the
whole epoch is small enough to read at once (at most :data:`PLAN_MAX_SAMPLES` samples: a
dataset that one shuffle window holds at the defaults), the pairs are chosen from the order
of epoch 0 instead: greedily, each time the (piece, second node) that moves the most samples
from a node with a surplus to one with a deficit in the epoch's steps, counted by what the
pairs chosen before have left. The choice stops at the blind draw's number of pieces, or
earlier once a pair would move no more than one sample per chunk of its piece (a piece held
twice costs its chunks; a sample moved otherwise costs part of a chunk).

The same pairs serve every later epoch: a node keeps the pieces it holds from epoch to epoch;
on another epoch's order they fetched less than a blind draw in 6 of 8 settings probed and
up to 2.4% more in the other 2 (benchmarks/RESULTS.md). Pure: the same inputs give the same
pairs on every rank.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .. import _native, forksafe
from ._util import PlanError
from .split_lookup import StepFacts
from .unit_columns import CHUNK, PIECE, PIECE_BASE, ROWS, distinct_values
from .units import UnitLayout

#: Largest epoch (samples) whose order is read whole to choose the pieces held twice.
PLAN_MAX_SAMPLES = 1 << 18
#: Largest (pieces x steps) table counted densely (int64 cells: 64 MiB); beyond, sorted.
DENSE_CELLS = 1 << 23
#: Choices a process keeps (a pass of each epoch would otherwise choose again).
PLANS_KEPT = 8
_PIECE_BITS = 32
_plans: collections.OrderedDict[Hashable, PlannedBackups | None] = collections.OrderedDict()
_plans_lock = threading.Lock()


def _forget_plans_in_child() -> None:
    global _plans_lock  # (a parent's thread may have held it at the fork)
    _plans_lock = threading.Lock()


forksafe.at_fork(after_in_child=_forget_plans_in_child)


class ChoiceLock:
    """The lock one split chooses its pieces under; a forked child gets a fresh one (the
    parent's thread may have held it at the fork: the child then chooses them itself)."""

    def __init__(self) -> None:
        self._after_fork_in_child()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def piece_keys(shards: np.ndarray, piece: np.ndarray) -> np.ndarray:
    """One int64 per (shard, piece within the shard)."""
    return (np.asarray(shards, dtype=np.int64) << _PIECE_BITS) | np.asarray(piece, np.int64)


class PlannedBackups:
    """The pieces two nodes hold and the second node of each.

    Args:
        keys: :func:`piece_keys` of the pieces, ascending, distinct.
        nodes: each piece's second node (not its owner).
        fraction: the pieces held twice over the pieces that could be (of cut shards).

    Thread safety: immutable. Pickles as its arrays.

    Raises:
        PlanError: keys not ascending and distinct, or not a node for each.
    """

    def __init__(self, keys: np.ndarray, nodes: np.ndarray, fraction: float) -> None:
        self.keys = np.asarray(keys, dtype=np.int64)
        self.nodes = np.asarray(nodes, dtype=np.int64)
        self.fraction = float(fraction)
        if self.keys.ndim != 1 or self.nodes.shape != self.keys.shape:
            raise PlanError(f"pieces held twice need a node for each: {self.keys.shape} "
                            f"pieces, {self.nodes.shape} nodes")
        if (np.diff(self.keys) <= 0).any():
            raise PlanError("the pieces held twice must be named in ascending order, each once")
        # a direct table: piece j of shard k at flat[bases[k] + j] (shards up to the last one
        # named; each as long as its last piece named)
        shard, piece = self.keys >> _PIECE_BITS, self.keys & ((1 << _PIECE_BITS) - 1)
        lengths = np.zeros(int(shard.max()) + 1 if shard.size else 0, dtype=np.int64)
        np.maximum.at(lengths, shard, piece + 1)
        self._bases = np.concatenate(([0], np.cumsum(lengths)))
        self._flat = np.full(int(self._bases[-1]), -1, dtype=np.int64)
        self._flat[self._bases[shard] + piece] = self.nodes

    def check(self, num_nodes: int) -> None:
        """Raise :class:`PlanError` unless every second node is one of ``num_nodes``."""
        bad = self.nodes[(self.nodes < 0) | (self.nodes >= num_nodes)]
        if bad.size:
            raise PlanError(f"the pieces held twice name node {int(bad[0])} of {num_nodes}: "
                            "they were chosen for another job, or damaged on the way; make "
                            "the dataset again in this job")

    def __len__(self) -> int:
        return int(self.keys.size)

    def __repr__(self) -> str:
        return f"PlannedBackups({len(self)} pieces, fraction {self.fraction:.3f})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PlannedBackups) and np.array_equal(other.keys, self.keys)
                and np.array_equal(other.nodes, self.nodes))

    def __hash__(self) -> int:
        return hash((len(self), self.keys[:4].tobytes(), self.nodes[:4].tobytes()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (PlannedBackups, (self.keys, self.nodes, self.fraction))

    def backups(self, shards: np.ndarray, piece: np.ndarray) -> np.ndarray:
        """The second node of each (shard, piece within it), -1 where only its owner holds
        it."""
        shards = np.asarray(shards, dtype=np.int64)
        piece = np.asarray(piece, dtype=np.int64)
        count = self._bases.size - 1
        if count == 0:
            return np.full(shards.shape, -1, dtype=np.int64)
        inside = (shards >= 0) & (shards < count)
        shard = np.where(inside, shards, 0)
        at = self._bases[shard] + piece
        inside &= (piece >= 0) & (at < self._bases[shard + 1])
        return np.where(inside, self._flat[np.where(inside, at, 0)], -1)


def planned_for(order: Any, layout: UnitLayout,
                owners_of: Callable[[StepFacts], np.ndarray], num_nodes: int,
                global_batch: int, budget_fraction: float,
                split: Hashable) -> PlannedBackups | None:
    """:func:`plan_backups` over the whole steps of ``order`` (epoch 0's), its samples' owners
    from ``owners_of``; None where the order holds more than :data:`PLAN_MAX_SAMPLES`
    samples or less than a step. The last :data:`PLANS_KEPT` choices are kept per process,
    by ``split`` (what else the owners depend on) and the order's seed and shuffle.
    """
    total = order.num_samples
    if total > PLAN_MAX_SAMPLES or total < global_batch:
        return None
    seed, shuffle = getattr(order, "seed", None), getattr(order, "shuffle", None)
    kept = None if seed is None or shuffle is None else (
        split, num_nodes, global_batch, budget_fraction, seed, shuffle, total)
    if kept is not None:
        with _plans_lock:
            if kept in _plans:
                _plans.move_to_end(kept)
                return _plans[kept]
    _, shards, rows = (np.asarray(a, dtype=np.int64)
                       for a in order.samples(0, total // global_batch * global_batch))
    facts = StepFacts(layout, shards, rows)
    owners = owners_of(facts)
    piece = facts.piece()
    distinct, at = distinct_values(shards, layout.num_shards)  # (no sort)
    shard_rows, piece_rows, chunk, base = (a[at] for a in layout.lookup(
        distinct, (ROWS, PIECE, CHUNK, PIECE_BASE)))
    size = np.minimum(piece_rows, shard_rows - piece * piece_rows)
    chunks = np.where(chunk > 0, -(-size // np.maximum(chunk, 1)), 0)
    planned = plan_backups(shards, piece, owners, chunks, num_nodes, global_batch,
                           budget_fraction, (base + piece, layout.num_pieces))
    if kept is not None:
        with _plans_lock:
            _plans[kept] = planned
            while len(_plans) > PLANS_KEPT:
                _plans.popitem(last=False)
    return planned


def plan_backups(shards: np.ndarray, piece: np.ndarray, owners: np.ndarray,
                 piece_chunks: np.ndarray, num_nodes: int, global_batch: int,
                 budget_fraction: float, numbered: tuple[np.ndarray, int]) -> PlannedBackups:
    """Choose the pieces held twice for the steps of an order (see the module docstring).

    Args:
        shards, piece, owners: per position of the order's whole steps (``steps *
            global_batch`` of them, in position order): the sample's shard, its piece within
            the shard and that piece's owner node.
        piece_chunks: the chunks of each sample's piece (0: a piece of a shard that is not
            cut, never held twice).
        num_nodes: nodes (each takes ``global_batch // num_nodes`` samples a step).
        budget_fraction: at most this fraction of the cut pieces is held twice.
        numbered: each sample's piece numbered in ``[0, count)`` in (shard, piece) order (the
            layout's piece units), and ``count``: the pieces are told apart by these numbers,
            without a sort of the samples.
    """
    steps = owners.size // global_batch
    size = steps * global_batch
    keys = piece_keys(shards[:size], piece[:size])
    owners = np.asarray(owners[:size], dtype=np.int64)
    unique, which = _compact(keys, numbered[0][:size], numbered[1])
    step = np.arange(size, dtype=np.int64) // global_batch
    # the rows of each piece in each step it is read in: entries ordered by piece, then step
    cells = unique.size * max(1, steps)
    if cells <= DENSE_CELLS:
        counted = np.bincount(which * max(1, steps) + step, minlength=cells)
        entry = np.flatnonzero(counted)
        rows = counted[entry]
    else:
        entry, rows = np.unique(which * max(1, steps) + step, return_counts=True)
    entry_piece, entry_step = np.divmod(entry, max(1, steps))
    bounds = np.searchsorted(entry_piece, np.arange(unique.size + 1))
    owner = np.zeros(unique.size, dtype=np.int64)
    owner[which] = owners
    chunks = np.zeros(unique.size, dtype=np.int64)
    chunks[which] = np.asarray(piece_chunks[:size], dtype=np.int64)
    surplus = (np.bincount(step * num_nodes + owners, minlength=steps * num_nodes)
               .reshape(steps, num_nodes) - global_batch // num_nodes)
    cut = int((chunks > 0).sum())
    chosen = _native.choose_backups(bounds, entry_step, rows, owner, chunks,
                                    np.ascontiguousarray(surplus, dtype=np.int64),
                                    round(budget_fraction * cut))
    picked = np.flatnonzero(chosen >= 0)
    return PlannedBackups(unique[picked], chosen[picked], picked.size / max(1, cut))


def _compact(keys: np.ndarray, numbers: np.ndarray,
             count: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``keys`` (ascending) and where each key is among them, as
    :func:`numpy.unique` gives them, where ``numbers`` (in ``[0, count)``) number the keys in
    the same order: the distinct numbers found without a sort (a scatter), then only those
    few sorted."""
    distinct, where = distinct_values(numbers, count)
    ranked = np.argsort(distinct)
    rank = np.empty(distinct.size, dtype=np.int64)
    rank[ranked] = np.arange(distinct.size)
    which = rank[where]
    unique = np.empty(distinct.size, dtype=np.int64)
    unique[which] = keys
    return unique, which


__all__ = ["PLANS_KEPT", "PLAN_MAX_SAMPLES", "ChoiceLock", "PlannedBackups", "piece_keys",
           "plan_backups", "planned_for"]
