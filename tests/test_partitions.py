"""Canonical partitions (streamcache/plan/partitions.py, partition_split.py): the order is a
permutation made of P equal runs taken in turn; on any node count that divides P each node's
ranks read only its runs' samples and every rank its part; a state resumes exactly on another
node count that divides P; and every value a user or a saved state can give is checked."""

from __future__ import annotations

import json
import math
import os
import signal
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_helpers import ids_of, make_dataset

from streamcache import (
    ConfigError,
    CursorMismatchError,
    PlanError,
    Source,
    StreamDataset,
    StreamLoader,
)
from streamcache.plan import EpochOrder, ShuffleOptions
from streamcache.plan.bijection import MASK64, derive_key
from streamcache.plan.partition_split import PartitionAssignment
from streamcache.plan.partitions import (
    TAG_PARTITION,
    check_partition_layout,
    partition_bounds,
    partition_of_ids,
)
from streamcache.plan.shards import ShardCounts
from streamcache.plan.shuffle import MAX_PARTITIONS
from streamcache.plan.units import UnitLayout, piece_rows_for


@st.composite
def orders(draw: st.DrawFn) -> tuple[EpochOrder, int]:
    rows = draw(st.lists(st.integers(0, 120), min_size=1, max_size=10))
    if sum(rows) == 0:
        rows[0] = 1
    partitions = draw(st.integers(1, min(64, sum(rows))))
    shuffle = ShuffleOptions(enabled=draw(st.booleans()), window=draw(st.integers(1, 300)),
                             stagger=draw(st.booleans()), partitions=partitions)
    seed, epoch = draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 5))
    return EpochOrder(rows, seed, epoch, shuffle), partitions


@settings(max_examples=150, deadline=None)
@given(orders())
def test_the_order_is_a_permutation_of_equal_runs_taken_in_turn(case) -> None:
    order, partitions = case
    total = order.num_samples
    ids = order.sample_ids(0, total)
    assert np.array_equal(np.sort(ids), np.arange(total))  # every sample once
    bounds = partition_bounds(total, partitions)
    sizes = np.diff(bounds)
    assert sizes.max() - sizes.min() <= 1 and bounds[-1] == total
    parts = partition_of_ids(ids, total, partitions)
    assert np.array_equal(parts, np.searchsorted(bounds, ids, side="right") - 1)
    whole = total // partitions * partitions
    assert np.array_equal(parts[:whole], np.arange(whole) % partitions)  # one of each in turn
    # every access path gives the same samples
    positions = np.arange(total)[::-1].copy()
    found, shards, rows = order.samples_at(positions)
    assert np.array_equal(found, ids[::-1])
    assert np.array_equal(order.shard_offsets[shards] + rows, found)
    half = total // 2
    assert np.array_equal(np.concatenate([order.sample_ids(0, half),
                                          order.sample_ids(half, total)]), ids)


def test_partitions_are_shuffled_alone_and_differ_by_seed_and_epoch() -> None:
    rows = [400, 300, 324]
    order = EpochOrder(rows, 7, 0, ShuffleOptions(window=256, partitions=4))
    ids = order.sample_ids(0, order.num_samples)
    runs = [ids[p::4] for p in range(4)]
    for p, run in enumerate(runs):
        assert not np.array_equal(run, np.sort(run))  # shuffled within its run
        assert run.min() >= 256 * p and run.max() < 256 * (p + 1)
    other_seed = EpochOrder(rows, 8, 0, ShuffleOptions(window=256, partitions=4))
    other_epoch = EpochOrder(rows, 7, 1, ShuffleOptions(window=256, partitions=4))
    assert not np.array_equal(other_seed.sample_ids(0, 1024), ids)
    assert not np.array_equal(other_epoch.sample_ids(0, 1024), ids)
    unpartitioned = EpochOrder(rows, 7, 0, ShuffleOptions(window=256))
    assert not np.array_equal(unpartitioned.sample_ids(0, 1024), ids)


@st.composite
def splits(draw: st.DrawFn) -> tuple[EpochOrder, PartitionAssignment, int, int]:
    rows = draw(st.lists(st.integers(0, 200), min_size=1, max_size=8))
    rows[0] += 64
    nodes = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    partitions = nodes * draw(st.integers(1, 4))
    ranks_per_node = draw(st.integers(1, 3))
    global_batch = math.lcm(partitions, nodes * ranks_per_node) * draw(st.integers(1, 2))
    chunk = np.array([draw(st.integers(0, 20)) for _ in rows], dtype=np.int64)
    counts = np.asarray(rows, dtype=np.int64)
    chunk = np.where((chunk > 0) & (chunk < counts), chunk, 0)
    pieces = np.where(chunk > 0, piece_rows_for(256, nodes, chunk), np.maximum(counts, 1))
    layout = UnitLayout(counts, chunk, pieces.astype(np.int64))
    order = EpochOrder(rows, draw(st.integers(0, 2**32)), 0,
                       ShuffleOptions(window=draw(st.integers(1, 400)), partitions=partitions))
    split = PartitionAssignment(nodes, 99, partitions, ShardCounts.of(rows), layout,
                                global_batch)
    return order, split, global_batch, ranks_per_node


@settings(max_examples=120, deadline=None)
@given(splits())
def test_each_node_reads_only_its_runs_and_the_ranks_partition_every_batch(case) -> None:
    order, split, global_batch, ranks_per_node = case
    nodes = split.num_nodes
    world = nodes * ranks_per_node
    sizes = [global_batch // world] * world
    steps = order.num_samples // global_batch
    for step in range(steps):
        first = step * global_batch
        _, shards, rows = order.samples(first, first + global_batch)
        nodes_of = split.node_of_slots(order, first, sizes)
        assert np.array_equal(nodes_of, split.owners(shards, rows))  # nothing moves
        taken = [split.slots(order, first, sizes, rank) for rank in range(world)]
        assert [len(t) for t in taken] == sizes
        assert np.array_equal(np.sort(np.concatenate(taken)), np.arange(global_batch))
        for rank, slots in enumerate(taken):
            assert (nodes_of[slots] == rank // ranks_per_node).all()
    # a node's samples are one contiguous run of ids: its partitions
    ids = np.arange(order.num_samples)
    shards, rows = order.shard_of_ids(ids)
    owners = split.owners(shards, rows)
    assert (np.diff(owners) >= 0).all() and set(owners.tolist()) == set(range(nodes))


def test_a_partial_last_batch_is_balanced_by_the_fewest_moves() -> None:
    rows = [1000]
    order = EpochOrder(rows, 1, 0, ShuffleOptions(window=128, partitions=8))
    split = PartitionAssignment(4, 5, 8, ShardCounts.of(rows))
    # the last 40 samples: not a multiple of 8 from a multiple of 8 on (1000 = 8 * 125)
    first, sizes = 960, [10, 10, 10, 10]
    nodes = split.node_of_slots(order, first, sizes)
    _, shards, rows_at = order.samples(first, first + 40)
    owners = split.owners(shards, rows_at)
    assert np.bincount(nodes, minlength=4).tolist() == [10, 10, 10, 10]
    surplus = np.maximum(np.bincount(owners, minlength=4) - 10, 0).sum()
    assert (nodes != owners).sum() == surplus
    shifted = split.node_of_slots(order, 964, sizes)  # (a batch that starts off the grid)
    assert np.bincount(shifted, minlength=4).tolist() == [10, 10, 10, 10]


def test_the_assignment_pickles_and_compares_by_value() -> None:
    import pickle
    counts = ShardCounts.of([100, 50])
    split = PartitionAssignment(2, 5, 4, counts, None, 8)
    again = pickle.loads(pickle.dumps(split))
    assert again == split and hash(again) == hash(split)
    assert again != PartitionAssignment(2, 5, 8, counts, None, 8)
    assert again.owners([0, 1], [0, 49]).tolist() == [0, 1]


# ---------------------------------------------------------------- what a user may give


@pytest.mark.parametrize("value, error", [(-1, "partitions must be >= 0"),
                                          (MAX_PARTITIONS + 1, "at most"),
                                          (True, "must be an integer"),
                                          ("8", "must be an integer"),
                                          (None, "partitions must be an integer"),
                                          (2.0, "must be an integer")])
def test_a_partitions_value_that_cannot_be_is_a_config_error(tmp_path, value, error) -> None:
    url = make_dataset(str(tmp_path), [40, 40], seq=False)
    with pytest.raises(ConfigError, match=error):
        StreamDataset(url, global_batch_size=8, partitions=value, cache_dir=str(tmp_path))


def test_a_global_batch_that_is_not_a_multiple_is_refused_when_made(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [40, 40], seq=False)
    with pytest.raises(ConfigError, match="not a multiple of partitions=8"):
        StreamDataset(url, global_batch_size=12, partitions=8, cache_dir=str(tmp_path))
    # with a per-rank batch the global batch is known when a pass starts
    dataset = StreamDataset(url, batch_size=3, rank=0, world_size=2, nodes=1, partitions=4,
                            cache_dir=str(tmp_path))
    with pytest.raises(PlanError, match="not a multiple of partitions=4"):
        next(iter(dataset))


def test_a_node_count_that_does_not_divide_the_partitions_is_refused(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [40, 40], seq=False)
    dataset = StreamDataset(url, global_batch_size=12, rank=0, world_size=3, nodes=3,
                            partitions=4, cache_dir=str(tmp_path))
    with pytest.raises(PlanError, match=r"3 nodes cannot share 4 .*divides 4 \(1, 2, 4\)"):
        next(iter(dataset))
    with pytest.raises(PlanError, match="divides"):
        check_partition_layout(64, 48, None)


def test_more_partitions_than_samples_is_refused(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [3, 2], seq=False)
    with pytest.raises(PlanError, match="8 partitions of 5 samples"):
        dataset = StreamDataset(url, global_batch_size=8, partitions=8, rank=0, world_size=1,
                                tail="pad", cache_dir=str(tmp_path))
        next(iter(dataset))


def test_a_mixture_refuses_partitions(tmp_path) -> None:
    a = make_dataset(str(tmp_path / "a"), [40], seq=False)
    b = make_dataset(str(tmp_path / "b"), [40], seq=False)
    with pytest.raises(ConfigError, match="not to a mixture"):
        StreamDataset([Source(a, weight=1), Source(b, weight=1)], global_batch_size=8,
                      partitions=4, cache_dir=str(tmp_path / "cache"))


# ---------------------------------------------------------------- what a saved state may hold


def _state_after(url: str, cache: Path, steps: int, **options) -> dict:
    dataset = StreamDataset(url, global_batch_size=16, rank=0, world_size=1, nodes=1,
                            cache_dir=str(cache), **options)
    with StreamLoader(dataset) as loader:
        for step, _ in enumerate(loader):
            if step + 1 == steps:
                break
        return loader.state_dict()


def _ids(url: str, cache: Path, state: dict | None, **options) -> list[list[int]]:
    dataset = StreamDataset(url, global_batch_size=16, rank=0, world_size=1, nodes=1,
                            cache_dir=str(cache), **options)
    with StreamLoader(dataset) as loader:
        if state is not None:
            loader.load_state_dict(state)
        return [ids_of(batch).tolist() for batch in loader]


def test_a_state_records_its_partitions_and_loads_only_with_the_same(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [60, 70], seq=False)
    state = _state_after(url, tmp_path / "cache", 3, partitions=8)
    assert '"partitions": 8' in json.dumps(state)
    whole = _ids(url, tmp_path / "cache", None, partitions=8)
    assert _ids(url, tmp_path / "cache", json.loads(json.dumps(state)), partitions=8) == \
        whole[3:]
    for other in (0, 4, 16):
        with pytest.raises(CursorMismatchError, match="shuffle options"):
            _ids(url, tmp_path / "cache", state, partitions=other)
    plain = _state_after(url, tmp_path / "cache", 2)
    assert "partitions" not in json.dumps(plain)  # (states without them read as before)
    with pytest.raises(CursorMismatchError, match="shuffle options"):
        _ids(url, tmp_path / "cache", plain, partitions=8)


def _with_shuffle_partitions(state: dict, value: object) -> dict:
    text = json.dumps(state)
    assert text.count('"partitions": 8') == 1
    return json.loads(text.replace('"partitions": 8', f'"partitions": {json.dumps(value)}'))


@pytest.mark.parametrize("value", [0, -8, 8.0, "8", None, True, [8], 2**70, MAX_PARTITIONS + 1])
def test_a_hostile_partitions_value_in_a_state_is_refused_and_changes_nothing(
        tmp_path, value) -> None:
    url = make_dataset(str(tmp_path), [60, 70], seq=False)
    state = _with_shuffle_partitions(_state_after(url, tmp_path / "cache", 3, partitions=8),
                                     value)
    dataset = StreamDataset(url, global_batch_size=16, rank=0, world_size=1, nodes=1,
                            cache_dir=str(tmp_path / "cache"), partitions=8)
    with StreamLoader(dataset) as loader:
        before = loader.state_dict()
        with pytest.raises((CursorMismatchError, PlanError)):
            loader.load_state_dict(state)
        assert loader.state_dict() == before
        assert len([batch for batch in loader]) == 130 // 16


def test_a_child_forked_while_a_partition_order_was_being_built_reads_alike() -> None:
    # (a DataLoader worker forked while a parent's thread held the build lock)
    counts = ShardCounts.of(np.full(40, 25, dtype=np.int64))
    order = EpochOrder(counts, 3, 0, ShuffleOptions(partitions=4))
    expected = order.samples(0, 1000)[0]
    fresh = EpochOrder(counts, 3, 0, ShuffleOptions(partitions=4))
    with fresh._partitions._lock:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)
                code = 0 if np.array_equal(fresh.samples(0, 1000)[0], expected) else 3
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@settings(max_examples=120, deadline=None)
@given(rows=st.lists(st.integers(0, 90), min_size=1, max_size=12),
       partitions=st.integers(1, 40), seed=st.integers(0, 2**64 - 1),
       window=st.integers(1, 300), enabled=st.booleans())
def test_a_partitions_order_over_views_of_the_counts_is_the_one_over_copied_counts(
        rows: list[int], partitions: int, seed: int, window: int, enabled: bool) -> None:
    """Each partition's order reads its shards' counts as views of the dataset's (a
    ClippedCounts: its first and last shard cut to the partition) instead of a copy of
    them: the samples at every position, and so every saved cursor, are what the copies
    gave (each partition's order built from its clipped row counts, as before)."""
    rows[0] += partitions
    shuffle = ShuffleOptions(enabled=enabled, window=window, partitions=partitions)
    order = EpochOrder(rows, seed, 3, shuffle)
    total = order.num_samples
    inner = replace(shuffle, partitions=0, window=max(1, window // partitions))
    bounds = partition_bounds(total, partitions)
    offsets = np.concatenate(([0], np.cumsum(rows)))
    expected = np.empty(total, dtype=np.int64)
    for part in range(partitions):
        start, stop = int(bounds[part]), int(bounds[part + 1])
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop, side="left"))
        copied = np.minimum(offsets[first + 1:last + 1], stop) - np.maximum(offsets[first:last],
                                                                            start)
        key = derive_key(seed, part, TAG_PARTITION) & MASK64
        own = EpochOrder(copied, key, 3, inner).sample_ids(0, stop - start) + start
        whole = total // partitions * partitions
        positions = np.arange(part, whole, partitions)
        expected[positions] = own[:positions.size]
        if part < total % partitions:  # the longer partitions' last samples
            expected[whole + part] = own[-1]
    assert np.array_equal(order.sample_ids(0, total), expected)
    found, shards, within = order.samples_at(np.arange(total)[::-1].copy())
    assert np.array_equal(found, expected[::-1])
    assert np.array_equal(offsets[shards] + within, found)


def test_a_partitions_orders_copy_nothing_per_shard() -> None:
    """800,000 shards in 64 partitions: the first step touches every partition, which builds
    its order. Their counts are views of the dataset's: what they keep is the first spans of
    their shard streams (about 3 groups of 1,024 shards each), about 5 MB whatever the shard
    count. They copied their shards' counts and offsets before: 16 bytes a shard more
    (12.8 MB here; 17.6 MB in all before, 4.5 MB now)."""
    counts = ShardCounts.of(np.full(800_000, 3, dtype=np.int64))
    order = EpochOrder(counts, 5, 0, ShuffleOptions(window=1 << 18, partitions=64))
    small = EpochOrder(np.full(1000, 3), 5, 0, ShuffleOptions(window=1 << 18, partitions=64))
    small.samples_at(np.arange(64, dtype=np.int64))  # (first-use allocations elsewhere)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ids, _, _ = order.samples_at(np.arange(64, dtype=np.int64))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert np.unique(partition_of_ids(ids, counts.total, 64)).size == 64
    assert held < 8 << 20, held
