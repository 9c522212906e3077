"""Tests of the multi-node split (streamcache/plan/locality.py, flows.py, units.py).

The contract of a RankAssignment (pure; each rank gets exactly its part size of distinct
slots; the ranks partition the batch; several batches at once give what each alone gives),
plus what makes it a locality split: pieces are dealt evenly to the nodes, each node's ranks
read the batch's samples of the pieces its node holds except the fewest needed to balance
the nodes, and the samples a node gives away are those of its lowest chunk priority.
"""

from __future__ import annotations

import pickle
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.plan import EpochOrder, EpochSegment, PlanError, ShuffleOptions, TailPolicy
from streamcache.plan.bijection import counter_hash
from streamcache.plan.flows import FLOW_MAX_NODES, max_flow
from streamcache.plan.locality import (
    LocalityAssignment,
    batch_shards,
    dual_fraction,
    locality_key,
    piece_owners,
)
from streamcache.plan.units import UnitLayout, concatenate, piece_rows_for

KEY = locality_key("xxh64:0123456789abcdef")


class OnlyPositions:
    """An order reduced to what the assignment may use (a mixture's order offers these
    too): any other attribute is an AttributeError."""

    def __init__(self, order: EpochOrder) -> None:
        self._order = order

    @property
    def num_samples(self) -> int:
        return self._order.num_samples

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self._order.locate(start, stop)

    def samples(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._order.samples(start, stop)

    def samples_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._order.samples_at(positions)


@st.composite
def cases(draw: st.DrawFn) -> tuple[EpochOrder, EpochSegment, LocalityAssignment]:
    shards = draw(st.integers(1, 12))
    rows = np.array(draw(st.lists(st.integers(0, 90), min_size=shards, max_size=shards)))
    if rows.sum() == 0:
        rows[0] = 7
    chunk = np.array(draw(st.lists(st.integers(0, 12), min_size=shards, max_size=shards)))
    nodes = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 17]))
    per_node = draw(st.integers(1, 2))
    world = nodes * per_node
    window = draw(st.integers(1, 200))
    order = EpochOrder(rows, draw(st.integers(0, 99)), 0, ShuffleOptions(window=window))
    layout = UnitLayout(rows, chunk, np.where(chunk > 0, piece_rows_for(
        window, nodes, chunk), np.maximum(rows, 1)))
    per_rank = draw(st.integers(1, 6))
    tail = draw(st.sampled_from(list(TailPolicy)))
    start = draw(st.integers(0, order.num_samples - 1))
    segment = EpochSegment(order.num_samples, start, world * per_rank, world, tail)
    if segment.num_steps == 0:
        segment = EpochSegment(order.num_samples, start, world, world, TailPolicy.PAD)
    key = draw(st.integers(0, 2**64 - 1))
    # pieces held twice drawn blind, or chosen from the order (plan/backup_plan.py)
    first = draw(st.sampled_from([None, order, OnlyPositions(order)]))
    return order, segment, LocalityAssignment(nodes, key, layout, segment.global_batch, first)


def some_steps(segment: EpochSegment) -> list[int]:
    """A few steps of a segment: its first three and its last (which may be a tail)."""
    return sorted({*range(min(3, segment.num_steps)), segment.num_steps - 1})


@settings(max_examples=60, deadline=None)
@given(cases())
def test_ranks_partition_every_batch_alone_and_together(case) -> None:
    order, segment, assignment = case
    positions = OnlyPositions(order)
    world = segment.world_size
    steps = some_steps(segment)
    for step in steps:
        segment.check_assignment(positions, step, assignment)  # type: ignore[arg-type]
    together = [segment.rank_batches(positions, steps, rank, assignment)  # type: ignore[arg-type]
                for rank in range(world)]
    for index, step in enumerate(steps):
        first, stop = segment.step_span(step)
        alone = [segment.rank_batch(positions, step, rank, assignment)  # type: ignore[arg-type]
                 for rank in range(world)]
        for rank in range(world):
            mine = together[rank][index]
            assert np.array_equal(mine.positions, alone[rank].positions)
            assert np.array_equal(mine.sample_ids, alone[rank].sample_ids)
            assert np.array_equal(mine.shards, alone[rank].shards)
            assert np.array_equal(mine.rows, alone[rank].rows)
            assert mine.positions.size == segment.part_sizes(step)[rank]
        read = np.sort(np.concatenate([b.positions for b in alone]))
        expected = np.arange(first, stop) % order.num_samples
        assert np.array_equal(read, np.sort(expected))


@settings(max_examples=80, deadline=None)
@given(cases())
def test_only_surplus_samples_move_and_the_lowest_chunk_priority_first(case) -> None:
    order, segment, assignment = case
    count = assignment.num_nodes
    for step in some_steps(segment):
        first, stop = segment.step_span(step)
        sizes = segment.part_sizes(step)
        nodes = assignment.node_of_slots(order, first, sizes)
        targets = np.asarray(sizes).reshape(count, -1).sum(axis=1)
        assert np.array_equal(np.bincount(nodes, minlength=count), targets)
        positions = np.arange(first, stop) % order.num_samples
        _, shards, rows = order.samples_at(positions)
        owners = assignment.owners(shards, rows)
        backups = assignment.backups(shards, rows)
        surplus = np.maximum(0, np.bincount(owners, minlength=count) - targets)
        paid = (nodes != owners) & (nodes != backups)
        assert paid.sum() <= surplus.sum()  # the fewest paid moves
        assert ((backups == -1) | (backups != owners)).all()
        if assignment.dual == 0:  # released: the surplus's lowest chunk priorities
            keys = assignment._chunk_keys(shards, rows)
            priority = counter_hash(assignment._release_key, keys) >> np.uint64(44)
            for node in np.flatnonzero(surplus):
                given = priority[(owners == node) & (nodes != node)]
                kept = priority[(owners == node) & (nodes == node)]
                assert given.size == surplus[node]
                assert kept.size == 0 or given.max() <= kept.min()


def test_pieces_are_dealt_round_robin_so_every_window_is_shared_evenly() -> None:
    rows = np.array([1000, 700, 0, 64, 5])
    layout = UnitLayout(rows, np.array([10, 10, 10, 0, 1]), np.array([30, 20, 10, 64, 1]))
    for nodes in (2, 3, 8):
        owners = piece_owners(KEY, layout, np.repeat(0, 1000), np.arange(1000), nodes)
        pieces = np.arange(1000) // 30
        for start in range(0, 34 - nodes):  # any run of N consecutive pieces: one each
            run = np.unique(owners[(pieces >= start) & (pieces < start + nodes)])
            assert run.size == nodes
    assignment = LocalityAssignment(3, KEY, layout)
    assert np.array_equal(assignment.owners(np.repeat(0, 1000), np.arange(1000)),
                          piece_owners(KEY, layout, np.repeat(0, 1000), np.arange(1000), 3))
    units = np.arange(layout.num_units)
    spans = [layout.span(int(u)) for u in units]
    assert np.array_equal(assignment.unit_owners(units),
                          [assignment.owners([s], [r])[0] for s, r, _ in spans])


def test_the_split_is_pure_pickles_and_depends_on_key_nodes_layout_and_batch() -> None:
    rows = np.full(20, 100)
    layout = UnitLayout(rows, np.full(20, 10), np.full(20, 20))
    order = EpochOrder(rows, 3, 0)
    assignment = LocalityAssignment(4, KEY, layout, 64)
    again = pickle.loads(pickle.dumps(assignment))
    assert again == assignment and hash(again) == hash(assignment)
    first = assignment.node_of_slots(order, 64, [16] * 4)
    assert np.array_equal(again.node_of_slots(order, 64, [16] * 4), first)
    for other in (LocalityAssignment(4, KEY + 1, layout, 64), LocalityAssignment(4, KEY),
                  LocalityAssignment(4, KEY, layout, 128)):
        assert other != assignment
    assert not np.array_equal(LocalityAssignment(4, KEY + 1, layout, 64).node_of_slots(
        order, 64, [16] * 4), first)


def test_pieces_held_twice_only_between_three_and_sixteen_nodes() -> None:
    assert dual_fraction(2, 1024) == 0 and dual_fraction(1, 64) == 0
    assert dual_fraction(FLOW_MAX_NODES + 1, 1024) == 0
    assert dual_fraction(8, 1024) == pytest.approx(2.3 / np.sqrt(128))
    assert dual_fraction(8, 64) == 0.6 and dual_fraction(8, None) == 0
    assert dual_fraction(8, 64, chunk_rows=1) == 0  # large samples: a move costs a row
    rows = np.full(50, 200)
    layout = UnitLayout(rows, np.full(50, 10), np.full(50, 10))
    assignment = LocalityAssignment(8, KEY, layout, 1024)
    shards, pieces = np.repeat(np.arange(50), 20), np.tile(np.arange(20) * 10, 50)
    backups = assignment.backups(shards, pieces)
    assert 0.1 < (backups >= 0).mean() < 0.3  # about dual_fraction(8, 1024) = 0.2
    held = [assignment.holds(shards, pieces, node) for node in range(8)]
    assert (np.sum(held, axis=0) == np.where(backups >= 0, 2, 1)).all()


def _reference_max_flow(capacity: np.ndarray, excess: np.ndarray) -> int:
    """Edmonds-Karp, one step, plainly (the oracle of flows.max_flow)."""
    count = capacity.shape[0]
    residual = capacity.astype(np.int64).copy()
    excess = excess.copy()
    total = 0
    while True:
        parent = {int(s): -1 for s in np.flatnonzero(excess > 0)}
        queue = deque(parent)
        sink = None
        while queue and sink is None:
            node = queue.popleft()
            for nxt in range(count):
                if residual[node, nxt] > 0 and nxt not in parent:
                    parent[nxt] = node
                    if excess[nxt] < 0:
                        sink = nxt
                        break
                    queue.append(nxt)
        if sink is None:
            return total
        path, node = [], sink
        while parent[node] != -1:
            path.append((parent[node], node))
            node = parent[node]
        amount = min([-excess[sink], excess[node]] + [residual[a, b] for a, b in path])
        for a, b in path:
            residual[a, b] -= amount
            residual[b, a] += amount
        excess[node] -= amount
        excess[sink] += amount
        total += amount


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 9), st.integers(1, 6), st.integers(0, 2**32))
def test_the_flow_of_every_step_is_a_maximum_flow(count: int, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    capacity = rng.integers(0, 3, (steps, count, count)) * (rng.random((steps, count, count))
                                                            < 0.4)
    for k in range(steps):
        np.fill_diagonal(capacity[k], 0)
    excess = rng.integers(-5, 6, (steps, count))
    excess[:, -1] -= excess.sum(axis=1)  # (each step's surplus and deficit balance)
    net = max_flow(capacity, excess.copy())
    assert (net >= 0).all() and (net <= capacity).all()
    for k in range(steps):
        moved = net[k].sum(axis=1) - net[k].sum(axis=0)
        assert (np.sign(moved) * np.sign(excess[k]) >= 0).all()  # from surplus to deficit
        assert (np.abs(moved) <= np.abs(excess[k])).all()
        assert np.maximum(0, moved).sum() == _reference_max_flow(capacity[k], excess[k])


def test_unit_layouts_map_rows_to_pieces_and_chunks() -> None:
    layout = UnitLayout(np.array([10, 7, 0, 5]), np.array([3, 0, 2, 2]), np.array([6, 7, 2, 4]))
    assert layout.num_pieces == 2 + 1 + 1 + 2 and layout.num_units == 6 + 4 + 0 + 0 + 3
    shards = np.array([0, 0, 0, 1, 3, 3])
    rows = np.array([0, 5, 9, 6, 3, 4])
    assert layout.piece_of(shards, rows).tolist() == [0, 0, 1, 2, 4, 5]
    assert layout.chunk_of(shards, rows).tolist() == [6, 7, 9, -1, 11, 12]
    assert [layout.span(u) for u in (0, 1, 2, 6, 9, 12)] == [
        (0, 0, 6), (0, 6, 4), (1, 0, 7), (0, 0, 3), (0, 9, 1), (3, 4, 1)]
    assert layout.is_whole(2) and not layout.is_whole(0)
    assert layout.shard_of_units(np.arange(13)).tolist() == [
        0, 0, 1, 2, 3, 3, 0, 0, 0, 0, 3, 3, 3]
    assert pickle.loads(pickle.dumps(layout)) == layout
    both = concatenate([layout, UnitLayout.whole_shards(np.array([4]))])
    assert both.num_shards == 5 and both.piece_of(np.array([4]), np.array([3])).tolist() == [6]
    for bad in ((np.array([1]), np.array([2, 2]), np.array([2])),
                (np.array([-1]), np.array([0]), np.array([1])),
                (np.array([4]), np.array([2]), np.array([3]))):
        with pytest.raises(PlanError):
            UnitLayout(*bad)
    with pytest.raises(PlanError, match="does not exist"):
        layout.span(13)
    assert piece_rows_for(1 << 18, 2, np.array([187, 1, 64])).tolist() == [1870, 2048, 2048]


def test_batch_shards_and_bad_arguments() -> None:
    order = EpochOrder([5, 6, 7], 1, 0)
    assert np.array_equal(batch_shards(order, 3, 6), order.locate(3, 9)[0])
    wrapped = batch_shards(order, 15, 6)  # PAD: positions past the end wrap
    assert np.array_equal(wrapped, order.samples_at(np.arange(15, 21) % 18)[1])
    with pytest.raises(PlanError, match="not a multiple of 2 nodes"):
        LocalityAssignment(2, KEY).slots(order, 0, [2, 2, 2], 0)
    with pytest.raises(PlanError):
        LocalityAssignment(0, KEY)
