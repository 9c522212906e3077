"""Multi-node locality: which node caches which shard, and which rank reads which sample.

The global batch of a step is fixed by the order; which rank reads which of its samples is
free (see :class:`~streamcache.plan.steps.RankAssignment`). Across nodes this module makes
that choice follow the cache:

1. **Shards to nodes** by rendezvous (highest-random-weight) hashing: shard ``k`` belongs to
   the node ``n`` with the highest ``score(key, k, n)``. The score of a pair does not depend
   on the node count, so going from ``N`` to ``N - 1`` nodes moves exactly the shards of the
   node that left (each to its second choice) and nothing else. The key comes from the
   dataset's fingerprint, not the seed or epoch: a node keeps its shards every epoch.
2. **Samples to nodes**: each sample of the global batch goes to its shard's owner. A node
   whose count exceeds what its ranks take (its surplus) releases samples picked by a hash
   of their position (spread over its shards, so a node reading another's rows needs few
   rows of any one shard at a time: small range reads); each released sample goes to its
   shard's second choice if that node is short of samples (so a shard's overflow tends to
   land on one node, the one that would own it if its owner left, which then reads that
   shard's footer once), else to the lowest node still short. Only surplus samples move:
   the fewest moves that balance the nodes.
3. **Samples to ranks** within a node: the node's slots in batch order, cut into its ranks'
   parts in rank order (ranks of a node are contiguous, as torchrun numbers them).

Everything is a pure function of (key, node count, the order's shards at the batch's
positions, part sizes): every rank computes the same split without talking. It touches the
order only through ``num_samples``, ``locate`` and ``samples_at``, so it also works for a
mixture's order (a combined shard index space). Pure; no I/O.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ._util import PlanError, check_int
from .bijection import MASK64, counter_hash, derive_key, derive_keys, mix64_array

TAG_NODES = 5  # domain tag of the node keys (see bijection's tags)
TAG_RELEASE = 6  # domain tag of the release priority of a position
#: Nodes an assignment can spread a batch over (a node index takes 11 bits of a sort key).
MAX_NODES = (1 << 11) - 1
_PRIORITY_BITS = 20
_NODE_MASK = np.int64(MAX_NODES)
_SLOT_MASK = np.int64((1 << 32) - 1)


class ShardPositions(Protocol):
    """What the assignment needs of an order (an ``EpochOrder`` or a mixture's order)."""

    @property
    def num_samples(self) -> int: ...

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]: ...

    def samples_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def locality_key(fingerprint: str) -> int:
    """The 64-bit key of the shard-to-node assignment of a dataset (or mixture) fingerprint:
    the same on every node and every epoch."""
    digest = hashlib.blake2b(fingerprint.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_scores(key: int, shards: np.ndarray, num_nodes: int) -> np.ndarray:
    """Rendezvous scores, a ``(len(shards), num_nodes)`` uint64 array: the score of (shard,
    node) depends on nothing else, so adding or removing nodes leaves the others' unchanged."""
    shard_words = derive_keys(derive_key(key, TAG_NODES), np.asarray(shards, dtype=np.int64))
    node_words = derive_keys(derive_key(key, TAG_NODES, 1), np.arange(num_nodes, dtype=np.int64))
    return mix64_array(shard_words[:, None] ^ node_words[None, :])


def shard_owners(key: int, shards: np.ndarray | Sequence[int], num_nodes: int) -> np.ndarray:
    """The node (int64) that owns each shard: its highest rendezvous score.

    Raises:
        PlanError: ``num_nodes`` below 1.
    """
    check_int("num_nodes", num_nodes, minimum=1)
    shards = np.asarray(shards, dtype=np.int64)
    if num_nodes == 1:
        return np.zeros(shards.shape, dtype=np.int64)
    return np.argmax(shard_scores(key, shards.ravel(), num_nodes), axis=1).reshape(shards.shape)


class LocalityAssignment:
    """A :class:`~streamcache.plan.steps.RankAssignment` that gives each node's ranks the
    batch's samples of that node's shards (see the module docstring for the rule).

    Args:
        num_nodes: nodes the ranks are spread over; ranks ``[n * L, (n + 1) * L)`` are node
            ``n``'s, with ``L = world_size // num_nodes`` (the world size is
            ``len(part_sizes)`` of each call and must be a multiple of ``num_nodes``).
        key: the assignment's key, e.g. :func:`locality_key` of the dataset's fingerprint.

    Thread safety: ``slots`` may be called from any thread; the last batch's split is kept
    (every rank of a process, and :meth:`EpochSegment.check_assignment`, ask for the same one).
    """

    def __init__(self, num_nodes: int, key: int) -> None:
        check_int("num_nodes", num_nodes, minimum=1, maximum=MAX_NODES)
        self.num_nodes = num_nodes
        self.key = key & MASK64
        self._release_key = derive_key(self.key, TAG_RELEASE)
        self._last: tuple[Any, int, tuple[int, ...], np.ndarray, np.ndarray] | None = None
        self._lock = threading.Lock()
        # per shard index: second choice << 16 | owner (-1: not computed yet)
        self._table = np.full(0, -1, dtype=np.int64)

    def __repr__(self) -> str:
        return f"LocalityAssignment(num_nodes={self.num_nodes}, key={self.key:#x})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LocalityAssignment) and other.num_nodes == self.num_nodes
                and other.key == self.key)

    def __hash__(self) -> int:
        return hash((self.num_nodes, self.key))

    def __getstate__(self) -> dict[str, int]:
        return {"num_nodes": self.num_nodes, "key": self.key}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["num_nodes"], state["key"])  # type: ignore[misc]

    # ------------------------------------------------------------ the RankAssignment

    def slots(self, order: ShardPositions, batch_start: int, part_sizes: Sequence[int],
              rank: int) -> np.ndarray:
        """Rank ``rank``'s slots of the global batch at ``batch_start`` (ascending)."""
        sizes = tuple(map(int, part_sizes))
        by_rank, starts = self._split(order, batch_start, sizes)
        return by_rank[starts[rank]:starts[rank + 1]]

    def node_of_slots(self, order: ShardPositions, batch_start: int,
                      part_sizes: Sequence[int]) -> np.ndarray:
        """The node (int64) that reads each slot of the global batch at ``batch_start``."""
        sizes = tuple(map(int, part_sizes))
        shards = batch_shards(order, batch_start, sum(sizes))
        return self._nodes(shards, self._node_targets(sizes), batch_start)

    def owners(self, shards: np.ndarray | Sequence[int]) -> np.ndarray:
        """The node (int64) that owns each shard (as :func:`shard_owners`, from the table)."""
        shards = np.asarray(shards, dtype=np.int64)
        if self.num_nodes == 1 or shards.size == 0:
            return np.zeros(shards.shape, dtype=np.int64)
        return (self._lookup(shards.ravel()) & _NODE_MASK).reshape(shards.shape)

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
        with self._lock:
            self._last = (order, batch_start, sizes, by_rank, starts)
        return by_rank, starts

    def _node_targets(self, sizes: tuple[int, ...]) -> np.ndarray:
        """Samples each node's ranks take (ranks of a node are contiguous)."""
        if len(sizes) % self.num_nodes:
            raise PlanError(f"world size {len(sizes)} is not a multiple of {self.num_nodes} "
                            "nodes: every node must run the same number of ranks")
        if sum(sizes) > _SLOT_MASK:
            raise PlanError(f"a global batch of {sum(sizes)} is too large to split by node "
                            f"(at most {int(_SLOT_MASK)})")
        return np.asarray(sizes, dtype=np.int64).reshape(self.num_nodes, -1).sum(axis=1)

    def _nodes(self, shards: np.ndarray, targets: np.ndarray, batch_start: int) -> np.ndarray:
        """The node of each slot: its shard's owner, balanced to ``targets`` with the fewest
        moves."""
        if self.num_nodes == 1:
            return np.zeros(shards.size, dtype=np.int64)
        entries = self._lookup(shards)
        nodes = entries & _NODE_MASK
        surplus = np.bincount(nodes, minlength=self.num_nodes) - targets
        if not surplus.any():
            return nodes
        released = self._released(nodes, batch_start, surplus)
        nodes[released] = self._receivers(entries[released], np.maximum(0, -surplus))
        return nodes

    def _lookup(self, shards: np.ndarray) -> np.ndarray:
        """Each shard's table entry, ``second choice << 16 | owner``, from a table filled as
        shards are first seen (a shard is in many consecutive batches, and a table lookup is
        much cheaper than hashing)."""
        table = self._table
        if shards.size and int(shards.max()) < table.size:
            entries = table[shards]
            if not (entries < 0).any():
                return entries
        with self._lock:
            self._fill(shards)
            return self._table[shards]

    def _fill(self, shards: np.ndarray) -> None:
        """Add the shards missing from the table (lock held)."""
        size = self._table.size
        if shards.size and int(shards.max()) >= size:
            grown = max(int(shards.max()) + 1, 2 * size)
            table = np.full(grown, -1, dtype=np.int64)
            table[:size] = self._table
            self._table = table
        missing = np.unique(shards[self._table[shards] < 0])
        if missing.size:
            scores = shard_scores(self.key, missing, self.num_nodes)
            owner = np.argmax(scores, axis=1)
            scores[np.arange(missing.size), owner] = 0
            second = np.argmax(scores, axis=1) if self.num_nodes > 1 else owner
            self._table[missing] = (second << 16) | owner

    def _released(self, nodes: np.ndarray, batch_start: int,
                  surplus: np.ndarray) -> np.ndarray:
        """The slots each node with a surplus gives away: its samples with the lowest
        release priority (a hash of the position), then by slot."""
        slots = np.arange(nodes.size, dtype=np.int64)
        priority = counter_hash(self._release_key, slots + batch_start)
        # one int64 key orders by (node, priority, slot): 11 + 20 + 32 bits
        keys = (nodes << np.int64(52)) | (
            (priority >> np.uint64(64 - _PRIORITY_BITS)).astype(np.int64) << np.int64(32))
        keys |= slots
        keys.sort()
        nodes = keys >> np.int64(52)
        rank_in_node = np.arange(keys.size) - np.searchsorted(nodes, nodes, side="left")
        return keys[rank_in_node < surplus[nodes]] & _SLOT_MASK

    def _receivers(self, entries: np.ndarray, deficit: np.ndarray) -> np.ndarray:
        """The node each released sample (given in slot order) goes to: its shard's second
        choice, which takes its askers in slot order while it is short; the rest fill the
        remaining deficits in node order."""
        count = entries.size
        # (second choice, sample) in one key: the askers of each node, in slot order
        asks = ((entries >> np.int64(16)) & _NODE_MASK) << np.int64(32)
        asks |= np.arange(count, dtype=np.int64)
        asks.sort()
        wanted = asks >> np.int64(32)
        accept = np.arange(count) - np.searchsorted(wanted, wanted) < deficit[wanted]
        receiver = np.empty(count, dtype=np.int64)
        receiver[asks[accept] & _SLOT_MASK] = wanted[accept]
        room = deficit - np.bincount(wanted[accept], minlength=self.num_nodes)
        receiver[np.sort(asks[~accept] & _SLOT_MASK)] = np.repeat(
            np.arange(self.num_nodes), room)
        return receiver


def batch_shards(order: ShardPositions, batch_start: int, length: int) -> np.ndarray:
    """The shard of each slot of the batch ``[batch_start, batch_start + length)``
    (positions past ``num_samples`` are PAD's wrapped ones)."""
    total = order.num_samples
    if batch_start + length <= total:
        return np.asarray(order.locate(batch_start, batch_start + length)[0], dtype=np.int64)
    positions = np.arange(batch_start, batch_start + length, dtype=np.int64) % total
    return np.asarray(order.samples_at(positions)[1], dtype=np.int64)


__all__ = [
    "LocalityAssignment",
    "ShardPositions",
    "batch_shards",
    "locality_key",
    "shard_owners",
    "shard_scores",
]
