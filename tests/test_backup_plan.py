"""Pieces held twice chosen from the first epoch's order (plan/backup_plan.py): the choice's
properties, that every rank and worker process of a job holds the same pieces, that a process
chooses once, and what a damaged choice handed to a process gets.

The bytes this saves are checked with real node processes in tests/test_multinode.py; the
split's exactness with chosen pieces in tests/test_locality.py (its cases draw both kinds)."""

from __future__ import annotations

import os
import pickle
import signal
import time

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_helpers import ids_of

from streamcache.format.writer import ShardWriter
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader
from streamcache.plan import EpochOrder, PlanError, ShuffleOptions, backup_plan
from streamcache.plan.backup_plan import PlannedBackups, plan_backups
from streamcache.plan.locality import LocalityAssignment, locality_key
from streamcache.plan.units import UnitLayout, piece_rows_for

KEY = locality_key("xxh64:00000000deadbeef")


def layout_of(rows: np.ndarray, chunk: np.ndarray, window: int, nodes: int) -> UnitLayout:
    return UnitLayout(rows, chunk, np.where(chunk > 0, piece_rows_for(window, nodes, chunk),
                                            np.maximum(rows, 1)))


@st.composite
def step_facts(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    nodes = draw(st.integers(3, 9))
    batch = nodes * draw(st.integers(1, 12))
    steps = draw(st.integers(1, 12))
    pieces = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    piece = rng.integers(0, pieces, steps * batch + draw(st.integers(0, batch - 1)))
    owner_of = rng.integers(0, nodes, pieces)
    chunks_of = rng.integers(0, 4, pieces)  # (0: an uncut shard's piece)
    shards = piece // 5
    return (shards, piece % 5, owner_of[piece], chunks_of[piece], np.array([nodes, batch]),
            np.array([draw(st.floats(0, 1))]))


@settings(max_examples=150, deadline=None)
@given(step_facts())
def test_chosen_pairs_are_cut_pieces_held_by_another_node_within_the_budget(facts) -> None:
    shards, piece, owners, chunks, (nodes, batch), (budget,) = facts
    # the pieces numbered in (shard, piece) order, as a layout numbers its piece units
    numbered = (shards * 5 + piece, int((shards * 5 + piece).max()) + 1)
    planned = plan_backups(shards, piece, owners, chunks, int(nodes), int(batch), budget,
                           numbered)
    assert planned == plan_backups(shards, piece, owners, chunks, int(nodes), int(batch),
                                   budget, numbered)
    # the same with the (piece, step) table sorted instead of counted densely
    dense, backup_plan.DENSE_CELLS = backup_plan.DENSE_CELLS, 0
    try:
        assert planned == plan_backups(shards, piece, owners, chunks, int(nodes), int(batch),
                                       budget, numbered)
    finally:
        backup_plan.DENSE_CELLS = dense
    whole = owners.size // batch * batch  # (only whole steps are planned for)
    keys = backup_plan.piece_keys(shards, piece)[:whole]
    cut = np.unique(keys[chunks[:whole] > 0])
    assert len(planned) <= round(budget * cut.size)
    assert np.isin(planned.keys, cut).all() and (np.diff(planned.keys) > 0).all()
    second = planned.backups(shards, piece)
    chosen = second >= 0
    assert (second[chosen] != owners[chosen]).all()
    assert ((second[chosen] >= 0) & (second[chosen] < nodes)).all()
    assert planned.fraction == pytest.approx(len(planned) / max(1, cut.size))
    # a chosen pair moves more than one sample per chunk of its piece, from a node with a
    # surplus to one with a deficit, in the steps as they were before any pair was chosen
    steps = whole // batch
    step = np.arange(whole) // batch
    counts = np.zeros((steps, nodes), dtype=np.int64)
    np.add.at(counts, (step, owners[:whole]), 1)
    over, under = np.maximum(counts - batch // nodes, 0), np.maximum(batch // nodes - counts, 0)
    for key, node in zip(planned.keys.tolist(), planned.nodes.tolist(), strict=True):
        mine = np.flatnonzero(keys == key)
        rows = np.bincount(step[mine], minlength=steps)
        owner = int(owners[mine[0]])
        movable = np.minimum(np.minimum(rows, over[:, owner]), under[:, node]).sum()
        assert movable > chunks[mine[0]]


def test_nothing_is_chosen_without_a_budget_or_a_cut_piece_or_an_imbalance() -> None:
    shards = np.zeros(64, dtype=np.int64)
    piece = np.arange(64) % 8
    owners = piece % 4
    numbered = (piece, 8)
    assert len(plan_backups(shards, piece, owners, np.full(64, 2), 4, 16, 0.0, numbered)) == 0
    assert len(plan_backups(shards, piece, owners, np.zeros(64), 4, 16, 1.0, numbered)) == 0
    balanced = plan_backups(shards, piece, owners, np.ones(64), 4, 16, 1.0, numbered)
    assert len(balanced) == 0  # every step gives every node its 4 samples
    assert np.array_equal(balanced.backups(shards, piece), np.full(64, -1))


def assignment(first_order=None, nodes: int = 4, batch: int = 64, seed: int = 5,
               window: int = 4096) -> tuple[LocalityAssignment, EpochOrder]:
    rows = np.array([900, 700, 600])
    order = EpochOrder(rows, seed, 0, ShuffleOptions(window=window))
    layout = layout_of(rows, np.array([10, 10, 0]), window, nodes)
    return LocalityAssignment(nodes, KEY, layout, batch,
                              order if first_order is None else first_order), order


def test_the_choice_is_made_once_the_same_for_every_process_and_pickled_whole(
        monkeypatch) -> None:
    first, order = assignment()
    second, _ = assignment()
    planned = first.planned_backups()
    assert planned is not None and len(planned) > 0
    assert first.dual == planned.fraction > 0
    assert second.planned_backups() == planned  # another rank: the same pairs
    calls = []
    monkeypatch.setattr(backup_plan, "plan_backups",
                        lambda *a, **k: calls.append(a) or pytest.fail("chosen again"))
    assert assignment()[0].planned_backups() == planned  # kept by the process
    again = pickle.loads(pickle.dumps(first))  # a worker: the pairs travel, not the order
    assert again.planned_backups() == planned and calls == []
    sizes = [16] * 4
    for start in (0, 64, 1088):
        assert np.array_equal(again.node_of_slots(order, start, sizes),
                              first.node_of_slots(order, start, sizes))
    _, shards, rows = order.samples(0, order.num_samples)
    backups = first.backups(shards, rows)
    owners = first.owners(shards, rows)
    held = sum(first.holds(shards, rows, node).astype(int) for node in range(4))
    assert np.array_equal(held, np.where(backups >= 0, 2, 1))
    assert (backups[backups >= 0] != owners[backups >= 0]).all()


def test_orders_too_large_or_shorter_than_a_step_keep_the_blind_draw(monkeypatch) -> None:
    drawn = LocalityAssignment(4, KEY, assignment()[0].layout, 64)
    small = assignment(batch=4096, seed=6)[0]  # 2,200 samples: no whole step
    assert small.planned_backups() is None
    monkeypatch.setattr(backup_plan, "PLAN_MAX_SAMPLES", 1000)
    large, order = assignment(seed=7)
    assert large.planned_backups() is None
    assert large.dual == drawn.dual > 0
    assert np.array_equal(large.node_of_slots(order, 64, [16] * 4),
                          drawn.node_of_slots(order, 64, [16] * 4))


def test_a_damaged_choice_handed_to_a_process_is_refused() -> None:
    split, order = assignment()
    planned = split.planned_backups()
    assert planned is not None
    for keys, nodes, why in [
            (planned.keys, np.full(len(planned), 4), "node 4 of 4"),
            (planned.keys, np.full(len(planned), -1), "node -1 of 4"),
            (planned.keys[::-1], planned.nodes, "ascending"),
            (planned.keys, planned.nodes[:-1], "a node for each")]:
        with pytest.raises(PlanError, match=why):
            LocalityAssignment(4, KEY, split.layout, 64).use_planned(
                PlannedBackups(keys, nodes, 0.1))
    owners = split.owners(*order.samples(0, order.num_samples)[1:])
    _, shards, rows = order.samples(0, order.num_samples)
    own_keys = backup_plan.piece_keys(shards, split.layout.piece_index(shards, rows))
    at_owner = np.array([owners[np.flatnonzero(own_keys == key)[0]]
                         for key in planned.keys.tolist()])
    damaged = LocalityAssignment(4, KEY, split.layout, 64)
    damaged.use_planned(PlannedBackups(planned.keys, at_owner, 0.1))  # second == owner
    with pytest.raises(PlanError, match="its owner"):
        damaged.node_of_slots(order, 0, [16] * 4)


def write_chunked(folder: str, samples: int = 4096) -> str:
    """A local dataset at the writer's defaults (zstd, 64 KiB chunks: cut into pieces)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, samples * 256).astype(np.int32)
    offsets = np.arange(0, samples * 256 + 1, 256, dtype=np.int64)
    with ShardWriter(folder) as writer:
        writer.write_batch(pa.record_batch({
            "x": np.arange(samples, dtype=np.int64),
            "tokens": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(tokens))}))
    return folder


def test_ranks_hold_the_same_pieces_and_workers_read_what_their_rank_reads(tmp_path) -> None:
    url = write_chunked(str(tmp_path / "ds"))

    def dataset(rank: int) -> StreamDataset:
        return StreamDataset(url, global_batch_size=64, rank=rank, world_size=4, nodes=4,
                             cache_dir=str(tmp_path / f"cache-{rank}"), fields=["x"])

    datasets = [dataset(rank) for rank in range(4)]
    splits = [d.locality.split for d in datasets]
    assert all(s is not None for s in splits)
    planned = {s.planned_backups() for s in splits if s is not None}
    assert len(planned) == 1 and None not in planned and len(next(iter(planned))) > 0
    steps = []
    for rank, data in enumerate(datasets):
        with StreamLoader(data, num_workers=0) as loader:
            alone = [ids_of(batch).tolist() for batch in loader]
        with StreamLoader(dataset(rank), num_workers=2, worker_mode="process") as loader:
            assert [ids_of(batch).tolist() for batch in loader] == alone
        steps.append(alone)
        data.close()
    for step in range(len(steps[0])):  # the ranks partition every global batch
        union = sorted(i for rank in steps for i in rank[step])
        assert len(union) == len(set(union)) == 64
    assert sorted(i for rank in steps for batch in rank for i in batch) == list(range(4096))


def test_a_child_forked_while_the_parent_chooses_chooses_them_itself() -> None:
    split, _ = assignment(seed=11)
    expected = assignment(seed=11)[0].planned_backups()  # (the same inputs, another split)
    read, write = os.pipe()
    with split._plan_lock:  # the parent's thread is choosing when the fork comes
        pid = os.fork()
        if pid == 0:  # the child: it must not wait for the parent's lock
            os.close(read)
            try:
                got = split.planned_backups()
                os.write(write, b"1" if got == expected else b"0")
            finally:
                os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waited for its parent's lock")
    status = done[1]
    with os.fdopen(read, "rb") as f:
        assert f.read() == b"1" and status == 0


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.tuples(st.integers(0, 40), st.integers(0, 30)), st.integers(0, 7),
                       max_size=60),
       st.lists(st.tuples(st.integers(-2, 50), st.integers(-2, 40)), max_size=80))
def test_a_choice_answers_every_shard_and_piece_asked(chosen, asked) -> None:
    keys = sorted(chosen)
    planned = PlannedBackups(backup_plan.piece_keys(np.array([k[0] for k in keys], np.int64),
                                                    np.array([k[1] for k in keys], np.int64)),
                             np.array([chosen[k] for k in keys], np.int64), 0.5)
    shards = np.array([a[0] for a in asked], dtype=np.int64)
    pieces = np.array([a[1] for a in asked], dtype=np.int64)
    expected = [chosen.get(a, -1) for a in asked]
    assert planned.backups(shards, pieces).tolist() == expected
    assert pickle.loads(pickle.dumps(planned)) == planned
