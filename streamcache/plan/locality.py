"""Multi-node locality: which node holds which piece of data, and which rank reads which sample.

The global batch of a step is fixed by the order; which rank reads which of its samples is
free (see :class:`~streamcache.plan.steps.RankAssignment`). Across nodes this module makes
that choice follow what each node holds (docs/multinode.md has the reasons and the bytes):

1. **Pieces to nodes.** The shards are cut into pieces (:mod:`streamcache.plan.units`: runs of
   chunks, or whole shards where a shard is not cut). The pieces of a shard are dealt to the
   nodes round-robin from an offset drawn per shard (a hash of the dataset key and the shard):
   any run of ``N`` consecutive pieces of a shard has one piece on every node, so every
   shuffle window, which reads a run of a shard's rows, is shared evenly by the nodes.
2. **Samples to nodes.** Every sample of the global batch goes to its piece's owner. A node
   whose count exceeds what its ranks take (its surplus) releases the samples of its lowest
   *chunk* priority (a hash of the sample's chunk): step after step, the samples released
   come from the same few chunks, which the receiving node then holds (it installs a chunk
   it reads once, and reads its later rows from its cache). Each released sample goes to its
   chunk's backup node if that node is short of samples (so a chunk's released rows tend to
   land on one node), else to the lowest node still short. Only surplus samples move: the
   fewest moves that balance the nodes.
3. **Samples to ranks** within a node: the node's slots in batch order, cut into its ranks'
   parts in rank order (ranks of a node are contiguous, as torchrun numbers them).

Everything is a pure function of (key, node count, layout, the order's shards and rows at the
batch's positions, part sizes): every rank computes the same split without talking. It
touches the order only through ``num_samples``, ``locate`` and ``samples_at``, so it also
works for a mixture's order (a combined shard index space). Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .. import _native
from ._util import PlanError, check_int
from .backup_plan import ChoiceLock, PlannedBackups, planned_for
from .bijection import MASK64, counter_hash, derive_key
from .flows import flexible_moves
from .owners import (
    TAG_DUAL,
    dual_fraction,
    locality_key,
    piece_owners,
    shard_offsets,
    typical_chunk_rows,
)
from .split_lookup import ShardOffsets, StepFacts
from .units import UnitLayout

TAG_RELEASE = 6  # domain tag of the chunk priorities
#: Bits of a chunk priority that are ranked (the top bits of its 64-bit hash).
PRIORITY_BITS = 20
_WEYL_SIZE = 1 << 32
_WEYL_MASK = np.uint64(_WEYL_SIZE - 1)
_GOLDEN = np.uint64(0x9E3779B9)  # 2**32 / golden ratio: the Weyl sequence's step
#: Nodes an assignment can spread a batch over (a node index takes 11 bits of a sort key).
MAX_NODES = (1 << 11) - 1
_MAX_SLOT_BITS = 31


class ShardPositions(Protocol):
    """What the assignment needs of an order (an ``EpochOrder`` or a mixture's order)."""

    @property
    def num_samples(self) -> int: ...

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]: ...

    def samples(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def samples_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


class LocalityAssignment:
    """A :class:`~streamcache.plan.steps.RankAssignment` that gives each node's ranks the
    batch's samples of that node's pieces (see the module docstring for the rule).

    Args:
        num_nodes: nodes the ranks are spread over; ranks ``[n * L, (n + 1) * L)`` are node
            ``n``'s, with ``L = world_size // num_nodes`` (the world size is
            ``len(part_sizes)`` of each call and must be a multiple of ``num_nodes``).
        key: the assignment's key, e.g. :func:`locality_key` of the dataset's fingerprint.
        layout: how the shards are cut into pieces and chunks (default: every shard one
            piece, its chunk priority the shard's).
        global_batch: samples a step (None: no piece is held twice).
        first_order: the order of epoch 0. Where pieces are held twice and it holds at most
            :data:`~streamcache.plan.backup_plan.PLAN_MAX_SAMPLES` samples, which pieces and
            which second nodes are chosen from it (:mod:`~streamcache.plan.backup_plan`), when
            first needed; else they are drawn blind.

    Thread safety: ``slots`` may be called from any thread; the last batch's split is kept
    (every rank of a process, and :meth:`EpochSegment.check_assignment`, ask for the same one).
    """

    def __init__(self, num_nodes: int, key: int, layout: UnitLayout | None = None,
                 global_batch: int | None = None,
                 first_order: ShardPositions | None = None) -> None:
        check_int("num_nodes", num_nodes, minimum=1, maximum=MAX_NODES)
        self.num_nodes = num_nodes
        self.key = key & MASK64
        self.layout = layout
        self.global_batch = global_batch
        self._drawn = dual_fraction(num_nodes, global_batch, typical_chunk_rows(layout))
        self._dual_threshold = np.uint64(min(_WEYL_SIZE - 1, int(self._drawn * _WEYL_SIZE)))
        # (chosen from the first epoch's order when first needed; None: drawn blind)
        self._planned: PlannedBackups | None = None
        self._first_order = first_order if self._drawn > 0 and layout is not None else None
        self._plan_lock = ChoiceLock()
        self._release_key = derive_key(self.key, TAG_RELEASE)
        dual_key = derive_key(self.key, TAG_DUAL)
        self._weyl_shard = np.uint64(dual_key % _WEYL_SIZE | 1)  # (per dataset)
        self._weyl_group = np.uint64((dual_key >> 32) % _WEYL_SIZE | 1)
        self._last: tuple[Any, int, tuple[int, ...], np.ndarray, np.ndarray] | None = None
        # each shard's offset, kept for the last shards seen (a small direct-mapped cache:
        # nothing per shard of the dataset)
        self._offsets = ShardOffsets(self.key, num_nodes)

    def __repr__(self) -> str:
        return (f"LocalityAssignment(num_nodes={self.num_nodes}, key={self.key:#x}, "
                f"dual={self.dual:.3f})")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LocalityAssignment) and other.num_nodes == self.num_nodes
                and other.key == self.key and other.layout == self.layout
                and other.global_batch == self.global_batch)

    def __hash__(self) -> int:
        return hash((self.num_nodes, self.key, self.layout, self.global_batch))

    def __getstate__(self) -> dict[str, Any]:
        return {"num_nodes": self.num_nodes, "key": self.key, "layout": self.layout,
                "global_batch": self.global_batch, "planned": self.planned_backups()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["num_nodes"], state["key"], state["layout"],  # type: ignore[misc]
                      state["global_batch"])
        self.use_planned(state.get("planned"))

    @property
    def dual(self) -> float:
        """The fraction of pieces held by two nodes (0: none)."""
        planned = self.planned_backups()
        return self._drawn if planned is None else planned.fraction

    def planned_backups(self) -> PlannedBackups | None:
        """The pieces held twice as chosen from the first epoch's order (chosen now if not
        yet), or None where they are drawn blind."""
        if self._first_order is not None:
            with self._plan_lock:
                order, layout = self._first_order, self.layout
                if order is not None and layout is not None:
                    self._planned = planned_for(
                        order, layout, self._sample_nodes, self.num_nodes,
                        self.global_batch or 0, self._drawn, (self.key, self.layout))
                    self._first_order = None
        return self._planned

    def use_planned(self, planned: PlannedBackups | None) -> None:
        """Hold twice the pieces ``planned`` names (as chosen from the first epoch's order
        elsewhere: a pickled split), instead of choosing or drawing them."""
        if planned is not None:
            planned.check(self.num_nodes)
        with self._plan_lock:
            self._planned = planned
            self._first_order = None

    # ------------------------------------------------------------ the RankAssignment

    def slots(self, order: ShardPositions, batch_start: int, part_sizes: Sequence[int],
              rank: int) -> np.ndarray:
        """Rank ``rank``'s slots of the global batch at ``batch_start`` (ascending)."""
        sizes = tuple(map(int, part_sizes))
        by_rank, starts = self._split(order, batch_start, sizes)
        return by_rank[starts[rank]:starts[rank + 1]]

    def slots_many(self, order: ShardPositions, batch_starts: Sequence[int],
                   part_sizes: Sequence[int], rank: int) -> np.ndarray:
        """:meth:`slots` of several whole batches with the same part sizes, one row each
        (``(len(batch_starts), part_sizes[rank])``, ascending), computed together."""
        return self.batches_many(order, batch_starts, part_sizes, rank)[0]

    def batches_many(self, order: ShardPositions, batch_starts: Sequence[int],
                     part_sizes: Sequence[int], rank: int,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rank ``rank``'s slots of several whole batches with the same part sizes, and the
        sample id, shard and row at each: four ``(len(batch_starts), part_sizes[rank])``
        arrays. Consecutive batches inside the epoch are read with one ``samples`` call, and
        the rank's samples come from it (not looked up again)."""
        sizes = tuple(map(int, part_sizes))
        length = sum(sizes)
        firsts = np.asarray(batch_starts, dtype=np.int64)
        targets = self._node_targets(sizes)
        if firsts.size == 0:
            empty = np.zeros((0, sizes[rank]), dtype=np.int64)
            return empty, empty, empty, empty
        ids, shards, rows = _samples_of_batches(order, firsts, length)
        nodes = self._nodes(shards, rows, targets)
        slots = _rank_slots(nodes, sizes, rank, self.num_nodes)
        return (slots, np.take_along_axis(ids, slots, axis=1),
                np.take_along_axis(shards, slots, axis=1), np.take_along_axis(rows, slots, axis=1))

    def nodes_many(self, order: ShardPositions, batch_starts: Sequence[int],
                   part_sizes: Sequence[int],
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The sample id, shard, row and reading node of every slot of several whole batches:
        four ``(len(batch_starts), sum(part_sizes))`` arrays (what every node reads: a model
        of the job's bytes, benchmarks/multinode_model.py)."""
        sizes = tuple(map(int, part_sizes))
        firsts = np.asarray(batch_starts, dtype=np.int64)
        ids, shards, rows = _samples_of_batches(order, firsts, sum(sizes))
        return ids, shards, rows, self._nodes(shards, rows, self._node_targets(sizes))

    def node_of_slots(self, order: ShardPositions, batch_start: int,
                      part_sizes: Sequence[int]) -> np.ndarray:
        """The node (int64) that reads each slot of the global batch at ``batch_start``."""
        sizes = tuple(map(int, part_sizes))
        _, shards, rows = _samples_of_batches(order, np.array([batch_start]), sum(sizes))
        return self._nodes(shards, rows, self._node_targets(sizes))[0]

    def owners(self, shards: np.ndarray | Sequence[int],
               rows: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
        """The node (int64) that owns the piece of each (shard, row) (row 0 by default)."""
        shards = np.asarray(shards, dtype=np.int64)
        rows = np.zeros_like(shards) if rows is None else np.asarray(rows, dtype=np.int64)
        if self.num_nodes == 1 or shards.size == 0:
            return np.zeros(shards.shape, dtype=np.int64)
        facts = StepFacts(self.layout, shards.ravel(), rows.ravel())
        return self._sample_nodes(facts).reshape(shards.shape)

    def backups(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The node that also holds the piece of each (shard, row), -1 where only its owner
        does (a fraction :attr:`dual` of the pieces has a backup)."""
        shards = np.asarray(shards, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        if self.dual == 0 or shards.size == 0:
            return np.full(shards.shape, -1, dtype=np.int64)
        facts = StepFacts(self.layout, shards.ravel(), rows.ravel())
        return self._backups(facts, self._sample_nodes(facts)
                             ).reshape(shards.shape)

    def holds(self, shards: np.ndarray, rows: np.ndarray, node: int) -> np.ndarray:
        """Whether ``node`` holds the piece of each (shard, row): its owner or its backup
        (each distinct shard looked up once for both)."""
        shards = np.asarray(shards, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        if self.dual == 0 or shards.size == 0:
            return self.owners(shards, rows) == node
        facts = StepFacts(self.layout, shards.ravel(), rows.ravel())
        owners = self._sample_nodes(facts)
        held = (owners == node) | (self._backups(facts, owners) == node)
        return held.reshape(shards.shape)

    def _backups(self, facts: StepFacts, owners: np.ndarray) -> np.ndarray:
        """:meth:`backups` of flat samples whose owners are known."""
        dual, second = self._held_twice(facts.shards, facts.piece(), owners)
        backups = np.full(owners.shape, -1, dtype=np.int64)
        backups[dual] = second
        return backups

    def _held_twice(self, shards: np.ndarray, piece: np.ndarray,
                    owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples (indices) of pieces held twice, and each one's second node: as chosen
        from the first epoch's order, or drawn blind (:meth:`_twice`, :meth:`_backup`)."""
        planned = self.planned_backups()
        if planned is not None:
            second = planned.backups(shards, piece)
            dual = np.flatnonzero(second >= 0)
            if (second[dual] == owners[dual]).any():
                raise PlanError("a piece held twice names its owner as its second node: the "
                                "pieces were chosen for another job or damaged; make the "
                                "dataset again in this job")
            return dual, second[dual]
        dual = np.flatnonzero(self._twice(shards, piece))
        return dual, self._backup(shards[dual], piece[dual], owners[dual])

    def _twice(self, shards: np.ndarray, piece: np.ndarray) -> np.ndarray:
        """Whether each piece (shard, index in it) is held twice.

        A low-discrepancy sequence over a shard's pieces, not a hash, so that every node holds
        as many: where ``(j * golden + shard * w) mod 2**32`` is below the fraction (a Weyl
        sequence: spread evenly over the pieces, and over each node's)."""
        weyl = piece.astype(np.uint64) * _GOLDEN
        weyl += shards.astype(np.uint64) * self._weyl_shard
        return (weyl & _WEYL_MASK) < self._dual_threshold

    def _backup(self, shards: np.ndarray, piece: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """The backup node of each piece held twice: its owner plus a distance that is the
        same for the ``N`` pieces of a round of the deal, so each node backs one of them."""
        count = self.num_nodes
        rounds = (piece // count).astype(np.uint64) * self._weyl_group
        rounds += shards.astype(np.uint64) * _GOLDEN
        distance = 1 + ((rounds >> np.uint64(32)) % np.uint64(count - 1)).astype(np.int64)
        return (owners + distance) % count

    def unit_owners(self, units: np.ndarray) -> np.ndarray:
        """The node (int64) that owns each piece unit of :attr:`layout` (chunk units: their
        piece's owner)."""
        if self.layout is None:
            raise PlanError("unit owners need a unit layout")
        return self.owners(*self.layout.unit_starts(units))

    # ------------------------------------------------------------ the split

    def _split(self, order: ShardPositions, batch_start: int,
               sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Slots grouped by rank (each rank's ascending) and each rank's start in them."""
        last = self._last
        if last is not None and last[0] is order and last[1] == batch_start and last[2] == sizes:
            return last[3], last[4]
        nodes = self.node_of_slots(order, batch_start, sizes)
        # stable: a node's slots stay in batch order, then are cut into its ranks' parts
        by_rank = np.argsort(nodes, kind="stable")
        starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        self._last = (order, batch_start, sizes, by_rank, starts)  # (one rebinding: atomic)
        return by_rank, starts

    def _node_targets(self, sizes: tuple[int, ...]) -> np.ndarray:
        """Samples each node's ranks take (ranks of a node are contiguous)."""
        if len(sizes) % self.num_nodes:
            raise PlanError(f"world size {len(sizes)} is not a multiple of {self.num_nodes} "
                            "nodes: every node must run the same number of ranks")
        if sum(sizes) >= 1 << _MAX_SLOT_BITS:
            raise PlanError(f"a global batch of {sum(sizes)} is too large to split by node "
                            f"(at most {(1 << _MAX_SLOT_BITS) - 1})")
        return np.asarray(sizes, dtype=np.int64).reshape(self.num_nodes, -1).sum(axis=1)

    def _nodes(self, shards: np.ndarray, rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """The node of each slot of ``(steps, batch)`` arrays: its piece's owner, balanced to
        ``targets`` in every step: first by samples of pieces held by two nodes (free), then
        by the fewest other moves."""
        count = self.num_nodes
        if count == 1:
            return np.zeros(shards.shape, dtype=np.int64)
        steps, width = shards.shape
        shards, rows = shards.ravel(), rows.ravel()
        facts = StepFacts(self.layout, shards, rows)
        nodes, surplus = self._owners(facts, targets, width)
        if surplus.any() and self.dual > 0:
            self._move_flexible(shards, facts, nodes, surplus, width)
        if surplus.any():
            self._move_paid(facts, nodes, surplus, width)
        return nodes.reshape(steps, width)

    def _owners(self, facts: StepFacts, targets: np.ndarray,
                width: int) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's node before its step is balanced (its piece's owner; flat), and each
        step's surplus against ``targets`` (``_native.owner_nodes``, native code: one pass)."""
        at = facts.entries()
        offsets, piece_rows = facts.owner_tables(self._offsets)
        nodes, piece, surplus = _native.owner_nodes(at, facts.rows, offsets, piece_rows,
                                                    targets, width)
        facts.known_piece(piece)
        return nodes, surplus

    def _sample_nodes(self, facts: StepFacts) -> np.ndarray:
        """Each sample's node before the step is balanced: its piece's owner (flat arrays)."""
        return self._owners(facts, np.zeros(self.num_nodes, dtype=np.int64),
                            facts.shards.size)[0]

    def _move_flexible(self, shards: np.ndarray, facts: StepFacts, nodes: np.ndarray,
                       surplus: np.ndarray, width: int) -> None:
        """Move samples of pieces held by two nodes from owner to backup where that balances
        the step (:func:`~streamcache.plan.flows.flexible_moves`); ``nodes`` and ``surplus``
        are updated."""
        dual, backups = self._held_twice(shards, facts.piece(), nodes)
        if dual.size == 0:
            return
        owners = nodes[dual]
        priority = counter_hash(self._release_key, facts.chunk_keys(dual))
        moved = dual[flexible_moves(dual // width, owners, backups,
                                    (priority >> np.uint64(64 - PRIORITY_BITS)).astype(
                                        np.int64), surplus)]
        count = self.num_nodes
        moved_group = moved // width * count
        surplus -= np.bincount(moved_group + nodes[moved],
                               minlength=surplus.size).reshape(surplus.shape)
        nodes[moved] = backups[np.searchsorted(dual, moved)]
        surplus += np.bincount(moved_group + nodes[moved],
                               minlength=surplus.size).reshape(surplus.shape)

    def _move_paid(self, facts: StepFacts, nodes: np.ndarray, surplus: np.ndarray,
                   width: int) -> None:
        """Balance what is left: each node with a surplus gives the samples of its lowest
        chunk priority (a hash of the chunk, the same in every step) to their chunk's backup
        while it is short, else to the lowest node still short (``_native.release_moves``, in
        native code: a few passes over each step's slots). ``nodes`` is updated."""
        base, key_rows = facts.chunk_tables()
        _native.release_moves(nodes, surplus, facts.entries(), facts.rows, base, key_rows,
                              self._release_key, width, PRIORITY_BITS)

    def _chunk_keys(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each row's chunk unit, or its piece unit in a shard that is not cut (its shard
        without a layout): what a sample's release priority is a hash of."""
        return StepFacts(self.layout, shards, rows).chunk_keys()


def _samples_of_batches(order: ShardPositions, firsts: np.ndarray, length: int,
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample ids, shards and rows, ``(len(firsts), length)``, of the batches starting at
    ``firsts`` (positions past ``num_samples`` are PAD's wrapped ones). Consecutive whole
    batches inside the epoch are read with one ``samples``."""
    total = order.num_samples
    count = firsts.size
    start = int(firsts[0])
    if start + count * length <= total and np.array_equal(
            firsts, start + length * np.arange(count, dtype=np.int64)):
        found = order.samples(start, start + count * length)
    else:
        positions = (firsts[:, None] + np.arange(length, dtype=np.int64)).ravel() % total
        found = order.samples_at(positions)
    ids, shards, rows = (np.asarray(a, dtype=np.int64).reshape(count, length) for a in found)
    return ids, shards, rows


def _rank_slots(nodes: np.ndarray, sizes: tuple[int, ...], rank: int,
                num_nodes: int) -> np.ndarray:
    """Rank ``rank``'s slots in each row of ``nodes``: its node's slots in slot order, from
    where the node's earlier ranks' parts end."""
    per_node = len(sizes) // num_nodes
    node = rank // per_node
    first_rank = node * per_node
    lo = sum(sizes[first_rank:rank])
    # (every step gives the node exactly its target: its slots, step by step, are one block)
    target = sum(sizes[first_rank:first_rank + per_node])
    slots = np.flatnonzero(nodes.ravel() == node).reshape(nodes.shape[0], target)
    return slots[:, lo:lo + sizes[rank]] % nodes.shape[1]


def batch_shards(order: ShardPositions, batch_start: int, length: int) -> np.ndarray:
    """The shard of each slot of the batch ``[batch_start, batch_start + length)``
    (positions past ``num_samples`` are PAD's wrapped ones)."""
    return _samples_of_batches(order, np.array([batch_start]), length)[1][0]


__all__ = [
    "LocalityAssignment",
    "ShardPositions",
    "batch_shards",
    "dual_fraction",
    "locality_key",
    "piece_owners",
    "shard_offsets",
]
