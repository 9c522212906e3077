"""This node's part of a multi-node job: who reads which sample, and which shards it caches.

With several nodes (see :func:`~streamcache.loading.topology.resolve_nodes`), every shard
has one owner node (:mod:`streamcache.plan.locality`); a node's ranks read the global
batch's samples of its shards, plus the few that balance the nodes. So a node:

- prefetches, and keeps in its cache, only the shards it owns (the advice to its
  prefetcher is filtered; other shards have no next use, so eviction takes them first);
- reads the rows it takes from other nodes' shards by range (the reader's ``by_range``),
  without installing those shards, where the reader can (see docs/multinode.md).

With one node nothing changes: the contiguous split, every shard advised. docs/multinode.md
has the design and the bytes each node fetches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cache.advice import ShardAdvice
from ..plan import CONTIGUOUS, RankAssignment
from ..plan.locality import LocalityAssignment, locality_key
from .topology import NodeTopology, resolve_nodes


def fingerprint_of(cursor: Any) -> str:
    """What identifies the data a cursor reads: a dataset's fingerprint, or a mixture's
    sources' fingerprints in order (the key of the shard-to-node map)."""
    fingerprint = getattr(cursor, "dataset_fingerprint", None)
    if isinstance(fingerprint, str):
        return fingerprint
    return "+".join(source.dataset_fingerprint for source in cursor.sources)


class NodeLocality:
    """The rank assignment and the shard ownership of one rank's node.

    Args:
        topology: this rank's place (:class:`~streamcache.loading.topology.NodeTopology`).
        key: the shard-to-node key (:func:`~streamcache.plan.locality.locality_key` of the
            fingerprint), the same on every node.

    Thread safety: read-only after construction (the assignment's tables fill under a lock).
    Pickles as its arguments.
    """

    def __init__(self, topology: NodeTopology, key: int) -> None:
        self.topology = topology
        self.key = key
        self._split = LocalityAssignment(topology.num_nodes, key) \
            if topology.num_nodes > 1 else None

    @classmethod
    def resolve(cls, cursor: Any, rank: int, world_size: int, nodes: int | None, *,
                collective: bool = True) -> NodeLocality:
        """This rank's locality now (see :func:`resolve_nodes` for where the node count comes
        from; ``collective`` allows asking the process group)."""
        topology = resolve_nodes(rank, world_size, nodes, collective=collective)
        return cls(topology, locality_key(fingerprint_of(cursor)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (NodeLocality, (self.topology, self.key))

    def __repr__(self) -> str:
        t = self.topology
        return f"NodeLocality(node {t.node_rank} of {t.num_nodes}, rank {t.rank} of {t.world_size})"

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    @property
    def assignment(self) -> RankAssignment:
        """Which slots of a global batch each rank reads: contiguous on one node."""
        return CONTIGUOUS if self._split is None else self._split

    def owns(self, shards: np.ndarray) -> np.ndarray:
        """Whether this node owns each shard (bool; all True on one node)."""
        if self._split is None:
            return np.ones(np.shape(shards), dtype=bool)
        return self._split.owners(shards) == self.topology.node_rank

    def read_by_range(self, shards: np.ndarray) -> np.ndarray:
        """The reader's ``by_range``: True for the shards another node owns (their rows are
        read by range, not installed here)."""
        return ~self.owns(shards)

    def upcoming(self, advice: ShardAdvice, position: int,
                 count: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``count`` of this node's shards read from ``position`` on, in order of next
        use, with that next use (the prefetcher's advice: a node caches only its shards)."""
        if self._split is None:
            return advice.upcoming(position, count)
        # about 1/N of the upcoming shards are this node's: look N times as far
        shards, next_use = advice.upcoming(position, count * self.num_nodes)
        mine = self.owns(shards)
        return shards[mine][:count], next_use[mine][:count]


def upcoming_on_node(locality: NodeLocality | None, advice: ShardAdvice, position: int,
                     count: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`NodeLocality.upcoming`, or every upcoming shard without a locality."""
    if locality is None:
        return advice.upcoming(position, count)
    return locality.upcoming(advice, position, count)


def read_by_range(locality: NodeLocality | None, shards: np.ndarray) -> np.ndarray:
    """:meth:`NodeLocality.read_by_range`, or nothing by range without a locality."""
    if locality is None:
        return np.zeros(np.shape(shards), dtype=bool)
    return locality.read_by_range(shards)


def by_range_option(reader_type: Callable[..., Any], locality: NodeLocality | None,
                    by_range: Callable[[np.ndarray], np.ndarray]) -> dict[str, Any]:
    """``{"by_range": by_range}`` for a reader made for ``locality``: where the reader takes
    it (its range path) and there are several nodes; else ``{}`` (one node reads everything
    from its cache; a reader without the range path reads whole copies of other nodes'
    shards)."""
    if locality is None or locality.num_nodes == 1:
        return {}
    try:
        parameters = inspect.signature(reader_type).parameters
    except (TypeError, ValueError):
        return {}
    return {"by_range": by_range} if "by_range" in parameters else {}


def follow_locality(reader: Any, locality: NodeLocality | None,
                    by_range: Callable[[np.ndarray], np.ndarray]) -> None:
    """Point a reader made before ``locality`` was known at it (its ``by_range``)."""
    if hasattr(reader, "by_range"):
        reader.by_range = by_range_option(type(reader), locality, by_range).get("by_range")


__all__ = ["NodeLocality", "by_range_option", "fingerprint_of", "follow_locality",
           "read_by_range", "upcoming_on_node"]
