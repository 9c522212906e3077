"""This node's part of a multi-node job: who reads which sample, and what the node holds.

With several nodes (see :func:`~streamcache.loading.topology.resolve_nodes`), the shards are
cut into pieces (:mod:`streamcache.plan.units`) and every piece has one owner node
(:mod:`streamcache.plan.locality`); a node's ranks read the global batch's samples of its
pieces, plus the few that balance the nodes. So a node:

- prefetches, and keeps in its cache, only its pieces (:class:`UnitAdvice`: its units in
  order of first use, from a scan of the order ahead), in a
  :class:`~streamcache.cache.units.UnitCache`;
- reads a row of another node's piece from that row's chunk, which it installs once (a
  chunk unit) and reads later rows of from its cache (:mod:`streamcache.loading.node_reader`);
  rows of shards that are not cut (not chunked) are read by range, as before.

With one node nothing changes: the contiguous split, whole shards, every shard advised.
docs/multinode.md has the design and the bytes each node fetches.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..cache.advice import ShardAdvice
from ..cache.identity import local_file
from ..cache.node import LAYOUT_OVERHEAD
from ..cache.prefetch import Prefetcher, PrefetchOptions
from ..format.index import DatasetIndex
from ..plan import CONTIGUOUS, PlanError, RankAssignment, ShuffleOptions
from ..plan.backup_plan import PlannedBackups
from ..plan.locality import LocalityAssignment, ShardPositions, locality_key
from ..plan.partition_split import PartitionAssignment
from ..plan.partitions import check_partition_layout
from ..plan.shards import ShardCounts
from ..plan.units import UnitLayout, piece_rows_for
from .topology import NodeTopology, resolve_nodes


def fingerprint_of(cursor: Any) -> str:
    """What identifies the data a cursor reads: a dataset's fingerprint, or a mixture's
    sources' fingerprints in order (the key of the piece-to-node map)."""
    fingerprint = getattr(cursor, "dataset_fingerprint", None)
    if isinstance(fingerprint, str):
        return fingerprint
    return "+".join(source.dataset_fingerprint for source in cursor.sources)


def unit_layout(index: DatasetIndex, window_rows: int, num_nodes: int) -> UnitLayout:
    """The pieces of ``index``'s shards for ``num_nodes`` nodes reading windows of
    ``window_rows`` samples (see :class:`IndexUnitColumns` for which shards are cut)."""
    return UnitLayout.of([IndexUnitColumns(index, window_rows, num_nodes)])


class IndexUnitColumns:
    """The unit layout's per-shard numbers, read from an index's columns a block at a time
    (:class:`~streamcache.plan.unit_columns.ShardColumns`; with a node copy of the shard
    table those are shared pages, so no process keeps anything per shard).

    A shard is cut when it is chunked (rows addressable by range, each chunk verified), has
    a checksum (its units are then identified by it), holds more than one chunk, and is not
    read in place (a local uncompressed file costs no transfer); its pieces are
    :func:`~streamcache.plan.units.piece_rows_for` the window and node count.

    Pickles as its arguments (the index pickles as the node copy it maps, where it is one).
    """

    def __init__(self, index: DatasetIndex, window_rows: int, num_nodes: int) -> None:
        self.index = index
        self.window_rows = window_rows
        self.num_nodes = num_nodes
        self._local = local_file(index.url) is not None

    @property
    def num_shards(self) -> int:
        return len(self.index.shard_table)

    def block(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        columns = self.index.shard_table.columns()
        return self._numbers(
            self.index.shard_rows[first:stop], columns["chunk_rows"][first:stop],
            np.asarray(columns["checksums"][first:stop].is_valid(), dtype=bool),
            np.asarray(columns["compressions"][first:stop].is_valid(), dtype=bool))

    def at(self, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        columns = self.index.shard_table.columns()
        return self._numbers(self.index.shard_rows[shards], columns["chunk_rows"][shards],
                             valid_at(columns["checksums"], shards),
                             valid_at(columns["compressions"], shards))

    def _numbers(self, rows: np.ndarray, chunk: np.ndarray, checked: np.ndarray,
                 compressed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        chunk = np.maximum(np.asarray(chunk, dtype=np.int64), 0)  # (-1: no chunk layout)
        cut = (chunk > 0) & (chunk < rows) & checked & (compressed | (not self._local))
        chunk = np.where(cut, chunk, 0)
        pieces = np.where(cut, piece_rows_for(self.window_rows, self.num_nodes, chunk),
                          np.maximum(rows, 1))
        return rows, chunk, pieces.astype(np.int64)

    def counts(self) -> ShardCounts:
        """The index's shard counts (shared, not counted again)."""
        return self.index.shard_table.counts()

    def __reduce__(self) -> tuple[Any, ...]:
        return (IndexUnitColumns, (self.index, self.window_rows, self.num_nodes))


def valid_at(column: pa.Array, at: np.ndarray) -> np.ndarray:
    """Whether each entry ``at`` of an Arrow column is set (read from its validity bitmap:
    nothing made per entry of the column; a chunked column, which the shard table does not
    keep, is combined first)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    bitmap = column.buffers()[0]
    if bitmap is None:
        return np.full(np.shape(at), column.null_count == 0, dtype=bool)
    bits = np.frombuffer(bitmap, dtype=np.uint8)
    where = np.asarray(at, dtype=np.int64) + column.offset
    return ((bits[where >> 3] >> (where & 7).astype(np.uint8)) & 1).astype(bool)


class NodeLocality:
    """The rank assignment and what one rank's node holds.

    Args:
        topology: this rank's place (:class:`~streamcache.loading.topology.NodeTopology`).
        key: the piece-to-node key (:func:`~streamcache.plan.locality.locality_key` of the
            fingerprint), the same on every node.
        layout: how the shards are cut into units (None: whole shards).
        global_batch: samples a step (None: no piece is held twice).
        partitions: the order's canonical partitions (0: none).
        first_order: the order of epoch 0, from which the pieces held twice are chosen where
            it is small enough (:mod:`~streamcache.plan.backup_plan`).

    Thread safety: read-only after construction (the assignment's tables fill under a lock).
    Pickles as its arguments and the pieces held twice as chosen (a worker process does not
    choose them again).
    """

    def __init__(self, topology: NodeTopology, key: int, layout: UnitLayout | None = None,
                 global_batch: int | None = None, partitions: int = 0,
                 first_order: ShardPositions | None = None) -> None:
        self.topology = topology
        self.key = key
        self.layout = layout
        self.global_batch = global_batch
        self.partitions = partitions
        self._split: LocalityAssignment | None = None
        if partitions:
            check_partition_layout(partitions, topology.num_nodes, global_batch)
        if topology.num_nodes > 1 and partitions:
            if layout is None:
                raise PlanError("canonical partitions on several nodes need the dataset's "
                                "shard layout (a mixture cannot use partitions)")
            self._split = PartitionAssignment(topology.num_nodes, key, partitions,
                                              layout.shard_counts(), layout, global_batch)
        elif topology.num_nodes > 1:
            # (pieces held by two nodes only where the node holds units)
            held_twice = layout is not None and layout.any_cut
            self._split = LocalityAssignment(topology.num_nodes, key, layout,
                                             global_batch if held_twice else None,
                                             first_order)

    @classmethod
    def resolve(cls, cursor: Any, rank: int, world_size: int, nodes: int | None, *,
                collective: bool = True,
                layout: Callable[[int], UnitLayout | None] | None = None,
                job: Sequence[tuple[str, Any]] = (),
                global_batch: int | None = None,
                first_order: Callable[[], ShardPositions] | None = None) -> NodeLocality:
        """This rank's locality now (see :func:`resolve_nodes` for where the node count comes
        from, and how the ranks agree on it and on ``job`` where ``collective`` allows a
        process group); ``layout`` gives the units for a node count, ``first_order`` the
        order of epoch 0 (see the class)."""
        topology = resolve_nodes(rank, world_size, nodes, collective=collective, job=job)
        units = layout(topology.num_nodes) if layout is not None and \
            topology.num_nodes > 1 else None
        partitions = int(getattr(cursor.shuffle, "partitions", 0))
        first = first_order() if first_order is not None and units is not None and \
            not partitions else None
        return cls(topology, locality_key(fingerprint_of(cursor)), units, global_batch,
                   partitions, first)

    def __reduce__(self) -> tuple[Any, ...]:
        split = self._split
        planned = None if split is None or self.partitions else split.planned_backups()
        return (_rebuild_locality, (self.topology, self.key, self.layout, self.global_batch,
                                    self.partitions, planned))

    def __repr__(self) -> str:
        t = self.topology
        return f"NodeLocality(node {t.node_rank} of {t.num_nodes}, rank {t.rank} of {t.world_size})"

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    @property
    def split(self) -> LocalityAssignment | None:
        """The locality split (None on one node)."""
        return self._split

    @property
    def assignment(self) -> RankAssignment:
        """Which slots of a global batch each rank reads: contiguous on one node."""
        return CONTIGUOUS if self._split is None else self._split

    @property
    def units(self) -> UnitLayout | None:
        """The units this node holds, where the node holds units rather than whole shards
        (several nodes, and some shard cut into pieces); else None."""
        layout = self.layout
        if self._split is None or layout is None or not layout.any_cut:
            return None
        return layout

    def owns(self, shards: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Whether this node owns the piece of each (shard, row) (row 0 by default; all True
        on one node)."""
        if self._split is None:
            return np.ones(np.shape(shards), dtype=bool)
        return self._split.owners(shards, rows) == self.topology.node_rank

    def read_by_range(self, shards: np.ndarray) -> np.ndarray:
        """The reader's ``by_range`` with whole shards: True for the shards another node owns
        (their rows are read by range, not installed here)."""
        return ~self.owns(shards)

    def upcoming(self, advice: ShardAdvice, position: int,
                 count: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``count`` of this node's shards read from ``position`` on, in order of next
        use, with that next use (the prefetcher's advice with whole shards)."""
        if self._split is None:
            return advice.upcoming(position, count)
        # about 1/N of the upcoming shards are this node's: look N times as far
        shards, next_use = advice.upcoming(position, count * self.num_nodes)
        mine = self.owns(shards)
        return shards[mine][:count], next_use[mine][:count]

    def unit_advice(self, order: ShardPositions, window_rows: int) -> UnitAdvice:
        """The advice of this node's units over ``order`` (see :class:`UnitAdvice`)."""
        layout = self.units
        assert layout is not None and self._split is not None
        return UnitAdvice(order, layout, self._split, self.topology.node_rank, window_rows)


def _rebuild_locality(topology: NodeTopology, key: int, layout: UnitLayout | None,
                      global_batch: int | None, partitions: int,
                      planned: PlannedBackups | None) -> NodeLocality:
    """A pickled :class:`NodeLocality`, with its pieces held twice as chosen."""
    locality = NodeLocality(topology, key, layout, global_batch, partitions)
    if locality.split is not None and planned is not None:
        locality.split.use_planned(planned)
    return locality


class UnitAdvice:
    """The units one node reads next, and when: from a scan of the order ahead.

    Every position ``span`` ahead (a window and a half) is looked at, so each of the node's
    pieces is found at its first use. (A piece's rows are spread over the shuffle window that
    reads its part of the shard, about one in ``window / piece rows`` positions: a scan at a
    stride of ``s`` would find a piece only about ``s * window / piece rows`` positions after
    its first use, an eighth of a window late at a stride of an eighth of a piece.) Chunks of
    other nodes' pieces are not advised (they are installed when first read).

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, order: ShardPositions, layout: UnitLayout,
                 assignment: LocalityAssignment, node: int, window_rows: int) -> None:
        self.order = order
        self.layout = layout
        self.assignment = assignment
        self.node = node
        total = order.num_samples
        self.span = scan_span(window_rows, total)
        self.stride = 1
        self._lock = threading.Lock()
        self._scanned: tuple[int, np.ndarray, np.ndarray] | None = None

    def upcoming(self, position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``count`` of the node's units read from ``position`` on, in order of next
        use, with that next use."""
        _, units, first = self._scan(position)
        ahead = first >= position
        units = np.concatenate([units[~ahead], units[ahead]])  # (in use already: now)
        first = np.concatenate([np.full(int((~ahead).sum()), position, np.int64),
                                first[ahead]])
        return units[:count], first[:count]

    def next_use(self, position: int) -> Callable[[int], float]:
        """Where each unit is read next from ``position`` (math.inf: not in the scan)."""
        _, units, first = self._scan(position)
        table = dict(zip(units.tolist(), np.maximum(first, position).tolist(), strict=True))
        return lambda unit: table.get(unit, math.inf)

    def _scan(self, position: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The node's pieces in ``[start, start + span)`` by first position, where ``start``
        is at most a quarter span behind ``position`` (rescanned beyond)."""
        with self._lock:
            scanned = self._scanned
        if scanned is not None and scanned[0] <= position < scanned[0] + self.span // 4 + 1:
            return scanned
        total = self.order.num_samples
        positions = np.arange(position, min(total, position + self.span), self.stride,
                              dtype=np.int64)
        if positions.size:
            _, shards, rows = self.order.samples_at(positions)
            mine = self.assignment.holds(shards, rows, self.node)
            units, at = np.unique(self.layout.piece_keys(shards[mine], rows[mine]),
                                  return_index=True)
            first = positions[mine][at]
            by_first = np.argsort(first, kind="stable")
            scanned = (position, units[by_first], first[by_first])
        else:
            scanned = (position, np.zeros(0, np.int64), np.zeros(0, np.int64))
        with self._lock:
            self._scanned = scanned
        return scanned

    def working_set_units(self) -> int:
        """The node's units a span holds at most, about (the prefetcher's lookahead)."""
        return units_in_span(self.layout, self.assignment.num_nodes, self.span)


def scan_span(window_rows: int, num_samples: int) -> int:
    """Positions a unit scan looks ahead: a window and a half (the stagger), at most the
    epoch."""
    return max(1, min(num_samples, window_rows + window_rows // 2))


def units_in_span(layout: UnitLayout, num_nodes: int, span: int) -> int:
    """A bound on the units of one node that ``span`` consecutive positions read: a unit
    per position, the node's share of them, and one more piece per shard the span cuts."""
    shards = span // max(1, layout.max_shard_rows) + 2
    return -(-span // num_nodes) + shards


def node_working_set(indexes: Sequence[DatasetIndex], layout: UnitLayout, working_set: int,
                     num_nodes: int) -> int:
    """Bytes a node's cache must hold at once: its share of the working set, plus a piece of
    every shard the working set can span (the round-robin deal is even only over whole runs of
    ``num_nodes`` pieces), plus room for the chunks of other nodes' rows of a few steps
    (``indexes``: the dataset's, or a mixture's sources' in the layout's order)."""
    sizes = np.concatenate([index.shard_table.raw_or_stored_bytes() for index in indexes]) \
        + LAYOUT_OVERHEAD
    largest_piece = largest_chunk = 0
    for first, stop, shard_rows, chunk_rows, piece_rows in layout.scan():
        here = sizes[first:stop]
        rows = np.maximum(shard_rows, 1)
        piece = here * np.minimum(piece_rows, rows) // rows
        chunk = np.where(chunk_rows > 0, here * np.maximum(chunk_rows, 1) // rows, 0)
        largest_piece = max(largest_piece, int(piece.max(initial=0)))
        largest_chunk = max(largest_chunk, int(chunk.max(initial=0)))
    spanned = working_set // max(1, int(sizes.min(initial=1))) + 2
    share = -(-working_set // num_nodes)
    return min(working_set, share + min(len(sizes), spanned) * largest_piece) + (
        64 * largest_chunk)


def window_rows(shuffle: ShuffleOptions, shard_rows: np.ndarray) -> int:
    """Samples in a shuffle window (a window of shards: that many shards of average rows;
    no shuffle: one shard), at most the dataset."""
    rows = np.asarray(shard_rows, dtype=np.int64)
    total = int(rows.sum())
    if not shuffle.enabled:
        return max(1, min(total, int(rows.max(initial=1))))
    if shuffle.window_unit == "shards":
        return max(1, min(total, shuffle.window * total // max(1, rows.size)))
    return max(1, min(total, shuffle.window))


def advise_units(store: Prefetcher, advice: UnitAdvice, prefetch: PrefetchOptions | None,
                 where: tuple[int, int, int], advised: tuple[int, int] | None,
                 ) -> tuple[int, int] | None:
    """Give ``store`` (a Prefetcher over a UnitCache) the node's units read next from
    ``where`` = (epoch, position, global batch); returns what to pass as ``advised`` next
    time (sent again when the first upcoming unit changes, and every quarter span)."""
    epoch, position, global_batch = where
    count = (prefetch or PrefetchOptions()).lookahead(advice.working_set_units())
    units, next_use = advice.upcoming(position, count)
    key = (epoch, int(units[0]) if len(units) else -1)
    if key != advised or position % max(1, advice.span // 4) < global_batch:
        store.update(units, next_use)
        return key
    return advised


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


__all__ = ["NodeLocality", "UnitAdvice", "advise_units", "by_range_option", "fingerprint_of",
           "follow_locality", "node_working_set", "read_by_range", "scan_span", "unit_layout",
           "units_in_span", "upcoming_on_node", "window_rows"]
