"""Which rank reads which sample under canonical partitions (:mod:`~streamcache.plan.partitions`).

Node ``n`` of ``N`` owns partitions ``[n P / N, (n + 1) P / N)``: a contiguous run of sample
ids, so the owner of a sample is a function of its id alone. Every sample of a step goes to
its owner; with global batches that are multiples of ``P`` every node gets exactly its ranks'
part and nothing moves. A step that is not (a last, partial batch) is balanced as the default
split does: surplus samples of the lowest chunk priority move to the nodes short of samples.

The split, the units a node holds and what its reader reads locally all follow the sample's
owner, so a piece (:mod:`streamcache.plan.units`) that straddles two nodes' runs is held by
both (each reads its own rows from it): one piece at each end of a node's run.
Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._util import PlanError, check_int
from .locality import LocalityAssignment
from .partitions import check_partition_layout, partition_of_ids
from .shards import ShardCounts
from .shuffle import MAX_PARTITIONS
from .units import UnitLayout


class PartitionAssignment(LocalityAssignment):
    """A :class:`~streamcache.plan.steps.RankAssignment` for an order with canonical
    partitions: each node's ranks read the samples of the node's partitions.

    Args:
        num_nodes: nodes the ranks are spread over (ranks of a node contiguous); must divide
            ``partitions``.
        key: the locality key (the chunk priorities of the rare moves).
        partitions: the order's partition count.
        counts: the dataset's shard row counts (a sample's id is its shard's offset plus its
            row).
        layout: how the shards are cut into units (None: whole shards).
        global_batch: checked to be a multiple of ``partitions`` where given.

    Raises:
        PlanError: a node count that does not divide ``partitions``, or a global batch that is
            not a multiple of it.

    Thread safety: as :class:`~streamcache.plan.locality.LocalityAssignment`.
    """

    def __init__(self, num_nodes: int, key: int, partitions: int,
                 counts: ShardCounts, layout: UnitLayout | None = None,
                 global_batch: int | None = None) -> None:
        check_int("partitions", partitions, minimum=1, maximum=MAX_PARTITIONS)
        check_partition_layout(partitions, num_nodes, global_batch)
        if partitions > counts.total:
            raise PlanError(f"{partitions} partitions of {counts.total} samples: every "
                            "partition needs a sample")
        # (no piece is held twice; the layout is set after, so that no per-shard offset table
        # is made: owners come from the sample ids here)
        super().__init__(num_nodes, key, None, None)
        self.layout = layout
        self.partitions = partitions
        self.counts = counts
        self._per_node = partitions // num_nodes

    def __repr__(self) -> str:
        return (f"PartitionAssignment(num_nodes={self.num_nodes}, "
                f"partitions={self.partitions}, key={self.key:#x})")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PartitionAssignment) and other.num_nodes == self.num_nodes
                and other.key == self.key and other.partitions == self.partitions
                and other.layout == self.layout
                and np.array_equal(other.counts.rows, self.counts.rows))

    def __hash__(self) -> int:
        return hash((self.num_nodes, self.key, self.partitions, self.counts.total))

    def __getstate__(self) -> dict[str, Any]:
        return {"num_nodes": self.num_nodes, "key": self.key, "partitions": self.partitions,
                "counts": self.counts, "layout": self.layout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["num_nodes"], state["key"],  # type: ignore[misc]
                      state["partitions"], state["counts"], state["layout"])

    def owners(self, shards: np.ndarray | Sequence[int],
               rows: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
        """The node (int64) whose partitions hold each (shard, row) (row 0 by default)."""
        shards = np.asarray(shards, dtype=np.int64)
        rows = np.zeros_like(shards) if rows is None else np.asarray(rows, dtype=np.int64)
        if self.num_nodes == 1 or shards.size == 0:
            return np.zeros(shards.shape, dtype=np.int64)
        ids = self.counts.offsets[shards] + rows
        return partition_of_ids(ids, self.counts.total, self.partitions) // self._per_node

    def _owners(self, facts: Any, targets: np.ndarray,
                width: int) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's node: its owner, and each step's surplus. With global batches that
        are multiples of the partitions every step is balanced already; a step that is not (a
        partial last batch) is balanced by the base class's fewest moves (no piece is held
        twice here)."""
        nodes = self.owners(facts.shards, facts.rows)
        count = self.num_nodes
        steps = nodes.size // width if width else 0
        first_group = np.repeat(np.arange(0, steps * count, count, dtype=np.int64), width)
        surplus = np.bincount(nodes + first_group, minlength=steps * count).reshape(
            steps, count) - targets
        return nodes, surplus
