"""Tests of the multi-node assignment (streamcache/plan/locality.py).

The contract of a RankAssignment (pure; each rank gets exactly its part size of distinct
slots; the ranks partition the batch), plus what makes it a locality assignment: each node's
ranks read the batch's samples of that node's shards, except the fewest needed to balance
the nodes, and the shard-to-node map is stable when the node count changes.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.plan import EpochOrder, EpochSegment, PlanError, ShuffleOptions, TailPolicy
from streamcache.plan.locality import (
    LocalityAssignment,
    batch_shards,
    locality_key,
    shard_owners,
    shard_scores,
)

KEY = locality_key("xxh64:0123456789abcdef")


class OnlyPositions:
    """An order reduced to what contract 3 lets the assignment use (a mixture's order
    offers these too): any other attribute is an AttributeError."""

    def __init__(self, order: EpochOrder) -> None:
        self._order = order

    @property
    def num_samples(self) -> int:
        return self._order.num_samples

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self._order.locate(start, stop)

    def samples_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._order.samples_at(positions)


layouts = st.tuples(st.integers(1, 6), st.integers(1, 3))  # (nodes, ranks per node)


@st.composite
def batches(draw: st.DrawFn) -> tuple[EpochOrder, EpochSegment, int, LocalityAssignment]:
    rows = draw(st.lists(st.integers(0, 40), min_size=1, max_size=30).filter(
        lambda r: sum(r) > 0))
    nodes, per_node = draw(layouts)
    world = nodes * per_node
    order = EpochOrder(rows, draw(st.integers(0, 99)), 0,
                       ShuffleOptions(window=draw(st.integers(1, 60))))
    per_rank = draw(st.integers(1, 8))
    tail = draw(st.sampled_from(list(TailPolicy)))
    start = draw(st.integers(0, order.num_samples - 1))
    segment = EpochSegment(order.num_samples, start, world * per_rank, world, tail)
    if segment.num_steps == 0:
        segment = EpochSegment(order.num_samples, start, world, world, TailPolicy.PAD)
    step = draw(st.integers(0, segment.num_steps - 1))
    return order, segment, step, LocalityAssignment(nodes, draw(st.integers(0, 2**64 - 1)))


def node_counts(nodes: np.ndarray, num_nodes: int) -> np.ndarray:
    return np.bincount(nodes, minlength=num_nodes)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_ranks_partition_every_batch_and_nodes_keep_their_shards(case) -> None:
    order, segment, step, assignment = case
    segment.check_assignment(order, step, assignment)
    first, _ = segment.step_span(step)
    sizes = segment.part_sizes(step)
    num_nodes = assignment.num_nodes
    per_node = len(sizes) // num_nodes
    nodes = assignment.node_of_slots(order, first, sizes)
    owners = shard_owners(assignment.key, batch_shards(order, first, sum(sizes)), num_nodes)
    targets = np.asarray(sizes).reshape(num_nodes, per_node).sum(axis=1)
    assert np.array_equal(node_counts(nodes, num_nodes), targets)
    # the fewest moves: only a node's surplus leaves it, and only to nodes that were short
    surplus = node_counts(owners, num_nodes) - targets
    moved = nodes != owners
    assert moved.sum() == np.maximum(surplus, 0).sum()
    assert np.all(surplus[owners[moved]] > 0) and np.all(surplus[nodes[moved]] < 0)
    for node in range(num_nodes):
        # nothing comes in where something goes out
        assert not (np.any(nodes[moved] == node) and np.any(owners[moved] == node))
    # each rank: its node's slots, in batch order, cut in rank order
    for node in range(num_nodes):
        ranks = range(node * per_node, (node + 1) * per_node)
        parts = [assignment.slots(order, first, sizes, rank) for rank in ranks]
        assert np.array_equal(np.concatenate(parts), np.flatnonzero(nodes == node))


@settings(max_examples=50, deadline=None)
@given(batches())
def test_pure_and_the_same_in_a_fresh_instance_and_after_pickling(case) -> None:
    order, segment, step, assignment = case
    first, _ = segment.step_span(step)
    sizes = segment.part_sizes(step)
    others = [LocalityAssignment(assignment.num_nodes, assignment.key),
              pickle.loads(pickle.dumps(assignment))]
    for rank in range(segment.world_size):
        mine = assignment.slots(order, first, sizes, rank)
        for other in others:
            assert np.array_equal(other.slots(OnlyPositions(order), first, sizes, rank), mine)
    assert others[1] == assignment and hash(others[1]) == hash(assignment)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(1, 30), min_size=1, max_size=25), layout=layouts,
       workers=st.integers(1, 3), tail=st.sampled_from(list(TailPolicy)))
def test_every_sample_once_over_an_epoch_and_global_batches_unchanged(rows, layout, workers,
                                                                      tail) -> None:
    nodes, per_node = layout
    world = nodes * per_node
    order = EpochOrder(rows, 5, 1, ShuffleOptions(window=17))
    segment = EpochSegment(order.num_samples, 0, world * 3, world, tail)
    assignment = LocalityAssignment(nodes, KEY)
    per_step: dict[int, list[np.ndarray]] = {}
    for rank in range(world):
        for worker in range(workers):
            for batch in segment.worker_batches(order, rank, worker, workers, assignment,
                                                positions_per_pass=16):
                alone = segment.rank_batch(order, batch.step, rank, assignment)
                assert np.array_equal(batch.positions, alone.positions)
                assert np.array_equal(batch.rows, alone.rows)
                per_step.setdefault(batch.step, []).append(batch.positions)
    assert sorted(per_step) == list(range(segment.num_steps))
    for step, parts in per_step.items():  # the same samples as the contiguous split's
        contiguous = np.concatenate([segment.rank_batch(order, step, rank).positions
                                     for rank in range(world)])
        assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(contiguous))
    read = np.concatenate([np.zeros(0, np.int64)]
                          + [p for parts in per_step.values() for p in parts])
    assert np.unique(read).size == read.size or tail is TailPolicy.PAD
    if tail is not TailPolicy.DROP:
        assert set(read.tolist()) == set(range(order.num_samples))
    if tail is TailPolicy.SPLIT:
        assert np.array_equal(np.sort(read), np.arange(order.num_samples))


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(2, 40), key=st.integers(0, 2**64 - 1))
def test_losing_a_node_moves_only_its_shards(nodes, key) -> None:
    shards = np.arange(4000)
    before = shard_owners(key, shards, nodes)
    after = shard_owners(key, shards, nodes - 1)
    moved = before != after
    assert np.array_equal(moved, before == nodes - 1)  # exactly the lost node's shards
    # about 1/N of the shards move, and every node owns about 1/N of them
    assert abs(moved.mean() - 1 / nodes) < 5 * np.sqrt(1 / nodes / len(shards)) + 0.002
    share = np.bincount(before, minlength=nodes) / len(shards)
    assert np.all(np.abs(share - 1 / nodes) < 6 * np.sqrt(1 / nodes / len(shards)) + 0.002)


def test_the_key_decides_the_owners_and_one_node_owns_everything() -> None:
    shards = np.arange(1000)
    assert not np.array_equal(shard_owners(1, shards, 4), shard_owners(2, shards, 4))
    assert np.array_equal(shard_owners(KEY, shards, 4), shard_owners(KEY, shards, 4))
    assert not shard_owners(KEY, shards, 1).any()
    assert locality_key("a") != locality_key("b") and 0 <= locality_key("a") < 2**64


def test_overflow_goes_to_the_shards_second_choice_while_it_is_short() -> None:
    """A moved sample goes to its shard's second choice (the node that would own the shard
    if its owner left) unless that node already takes all it lacks from its own askers."""
    order = EpochOrder(np.full(2000, 500), 3, 0, ShuffleOptions(window=1 << 15))
    assignment = LocalityAssignment(8, KEY)
    segment = EpochSegment(order.num_samples, 0, 1024, 8)
    at_second = moved_total = 0
    for step in range(64):
        first, _ = segment.step_span(step)
        shards = batch_shards(order, first, 1024)
        nodes = assignment.node_of_slots(order, first, segment.part_sizes(step))
        scores = shard_scores(KEY, shards, 8)
        ranked = np.argsort(scores, axis=1)[:, ::-1]
        owners, second = ranked[:, 0], ranked[:, 1]
        moved = np.flatnonzero(nodes != owners)
        for i in moved[nodes[moved] != second[moved]]:
            into = moved[nodes[moved] == second[i]]  # what the second choice received
            assert np.all(second[into] == second[i]), step
        at_second += int((nodes[moved] == second[moved]).sum())
        moved_total += moved.size
    # about half the nodes are short at a step, so about half the moves can go there
    assert at_second > 0.35 * moved_total, (at_second, moved_total)


def test_a_world_that_is_not_a_multiple_of_the_nodes_is_refused() -> None:
    order = EpochOrder([10, 10], 0, 0)
    with pytest.raises(PlanError, match="not a multiple of 2 nodes"):
        LocalityAssignment(2, KEY).slots(order, 0, [2, 2, 2], 0)
    with pytest.raises(PlanError, match="num_nodes"):
        LocalityAssignment(0, KEY)
