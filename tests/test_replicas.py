"""Tests of the replica-group plan and ledger (streamcache/replicas/ledger.py).

The contract: for any history of committed groups (groups down, failing mid-step, discarded
steps, drops in the last steps of an epoch), every slice of an epoch, hence every sample, is
committed exactly once; every group gets the same number of samples every step; at most one
slice per group is ever pending, so the state does not grow with failures; and with no
failures the global batches are the plain loader's.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.plan import (
    CursorMismatchError,
    EpochOrder,
    EpochSegment,
    PlanError,
    ShuffleOptions,
    TailPolicy,
)
from streamcache.replicas import PAD_SLICE, Ledger, ReplicaPlan, replay


@st.composite
def plans(draw: st.DrawFn) -> ReplicaPlan:
    groups = draw(st.integers(1, 6))
    group_size = draw(st.integers(1, 3))
    global_batch = groups * group_size * draw(st.integers(1, 4))
    num_samples = draw(st.integers(global_batch, global_batch * 12 + 7))
    tail = draw(st.sampled_from([TailPolicy.DROP, TailPolicy.PAD]))
    return ReplicaPlan(num_samples, global_batch, groups, group_size, tail)


def committed_sets(groups: int) -> st.SearchStrategy[frozenset[int]]:
    """Mostly healthy steps, some with groups missing, some discarded (nobody commits)."""
    everyone = frozenset(range(groups))
    return st.one_of(
        st.just(everyone),
        st.frozensets(st.integers(0, groups - 1)),
        st.just(frozenset()),
    )


def run_epoch(plan: ReplicaPlan, trace: list[frozenset[int]],
              ledger: Ledger | None = None) -> tuple[list[int], list[Ledger]]:
    """Replay ``trace`` (then healthy steps) until the epoch ends; the positions committed,
    in order, and the ledger before every step."""
    ledger = Ledger() if ledger is None else ledger
    epoch, committed, ledgers = ledger.epoch, [], []
    everyone = frozenset(range(plan.num_groups))
    step = 0
    while ledger.epoch == epoch and not ledger.exhausted(plan):
        groups = trace[step] if step < len(trace) else everyone
        ledgers.append(ledger)
        for group, slice_index in enumerate(ledger.assignment(plan)):
            parts = [plan.rank_positions(slice_index, group, r) for r in range(plan.group_size)]
            assert all(p.size == plan.per_rank and f.size == plan.per_rank for p, f in parts)
            if group in groups:
                positions = np.concatenate([p for p, _ in parts])
                padding = np.concatenate([f for _, f in parts])
                committed.extend(positions[~padding].tolist())
        ledger = ledger.committed(plan, groups)
        step += 1
        assert step < 10 * (plan.num_slices + len(trace) + 2), "the epoch does not end"
    ledgers.append(ledger)
    return committed, ledgers


def expected_positions(plan: ReplicaPlan) -> list[int]:
    if plan.tail is TailPolicy.DROP:
        return list(range(plan.num_samples // plan.global_batch * plan.global_batch))
    return list(range(plan.num_samples))


@given(plan=plans(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_every_sample_is_committed_once_per_epoch(plan: ReplicaPlan, data: st.DataObject) -> None:
    trace = data.draw(st.lists(committed_sets(plan.num_groups), max_size=40))
    committed, ledgers = run_epoch(plan, trace)
    assert sorted(committed) == expected_positions(plan)
    assert ledgers[-1] == Ledger(1, 0, 0, (), ledgers[-1].behind)
    for ledger in ledgers:
        assert len(ledger.pending) <= plan.num_groups
        # the state grows with the failures of the last step only: a pending slice and a
        # group behind per failure, a few bytes each
        assert len(ledger.pending) <= max(len(ledger.behind), plan.num_groups * (
            not ledger.behind))
        assert len(json.dumps(ledger.to_dict())) <= 100 + 12 * (
            len(ledger.pending) + len(ledger.behind))


@given(plan=plans(), data=st.data())
@settings(max_examples=200, deadline=None)
def test_every_group_gets_one_distinct_slice_a_step(plan: ReplicaPlan,
                                                    data: st.DataObject) -> None:
    trace = data.draw(st.lists(committed_sets(plan.num_groups), max_size=30))
    _, ledgers = run_epoch(plan, trace)
    for ledger in ledgers[:-1]:
        slices = ledger.assignment(plan)
        assert len(slices) == plan.num_groups
        real = [s for s in slices if s != PAD_SLICE]
        assert len(set(real)) == len(real)
        assert set(ledger.pending) <= set(real), "pending slices are all re-issued at once"
        # groups that committed the last step get the pending slices first
        line = sorted(range(plan.num_groups), key=lambda g: (g in ledger.behind, g))
        served = {g for g, s in enumerate(slices) if s in ledger.pending}
        assert served == set(line[:len(ledger.pending)])


@given(plan=plans(), data=st.data())
@settings(max_examples=150, deadline=None)
def test_state_round_trips_at_every_step(plan: ReplicaPlan, data: st.DataObject) -> None:
    """Resuming from the saved ledger at any step gives the same rest of the epoch: the
    ledger is all the state there is (what a rejoining group copies from a peer)."""
    trace = data.draw(st.lists(committed_sets(plan.num_groups), max_size=25))
    committed, ledgers = run_epoch(plan, trace)
    cut = data.draw(st.integers(0, len(ledgers) - 1))
    loaded = Ledger.from_dict(json.loads(json.dumps(ledgers[cut].to_dict())), plan)
    assert loaded == ledgers[cut]
    rest, _ = run_epoch(plan, trace[cut:], loaded) if not loaded.epoch else ([], [])
    assert committed[len(committed) - len(rest):] == rest


@given(plan=plans())
@settings(max_examples=100, deadline=None)
def test_without_failures_the_global_batches_are_the_plain_loaders(plan: ReplicaPlan) -> None:
    order = EpochOrder([plan.num_samples], 7, 0, ShuffleOptions(enabled=False))
    ranks = plan.num_groups * plan.group_size
    segment = EpochSegment(plan.num_samples, 0, plan.global_batch, ranks, plan.tail)
    ledger = Ledger()
    for step in range(segment.num_steps):
        slices = ledger.assignment(plan)
        for group in range(plan.num_groups):
            for group_rank in range(plan.group_size):
                positions, padding = plan.rank_positions(slices[group], group, group_rank)
                plain = segment.rank_batch(order, step, group * plan.group_size + group_rank)
                if not plain.is_padding.any():
                    assert np.array_equal(positions, plain.positions)
                    assert not padding.any()
        ledger = ledger.committed(plan, range(plan.num_groups))
    assert ledger.epoch == 1 or segment.num_steps == 0


def test_a_group_down_for_a_while_and_back() -> None:
    plan = ReplicaPlan(num_samples=80, global_batch=8, num_groups=4)  # 40 slices, 10 steps
    ledger = Ledger()
    assert ledger.assignment(plan) == (0, 1, 2, 3)
    ledger = ledger.committed(plan, {0, 2, 3})       # group 1 fails at step 0
    assert ledger.pending == (1,)
    assert ledger.assignment(plan) == (1, 6, 4, 5)   # its slice goes to group 0, first in line
    ledger = ledger.committed(plan, {0, 2, 3})       # group 1 still down: slice 6 pending
    assert ledger.pending == (6,)
    ledger = ledger.committed(plan, {0, 1, 2, 3})    # back: everything committed
    assert ledger.pending == ()
    assert ledger.assignment(plan) == (10, 11, 12, 13)


def test_a_drop_in_the_last_step_adds_a_makeup_step_with_padding() -> None:
    plan = ReplicaPlan(num_samples=16, global_batch=8, num_groups=4)  # 8 slices, 2 steps
    ledger = replay(plan, [{0, 1, 2, 3}])
    assert ledger.assignment(plan) == (4, 5, 6, 7)
    ledger = ledger.committed(plan, {0, 1})           # groups 2 and 3 fail at the last step
    assert (ledger.epoch, ledger.pending) == (0, (6, 7))
    slices = ledger.assignment(plan)
    assert slices == (6, 7, PAD_SLICE, PAD_SLICE)     # the makeup step; the rest is padding
    _, padding = plan.rank_positions(PAD_SLICE, 2, 0)
    assert padding.all()
    ledger = ledger.committed(plan, {0, 1, 2, 3})
    assert ledger == Ledger(1)


def test_a_discarded_step_is_re_issued_whole() -> None:
    plan = ReplicaPlan(num_samples=40, global_batch=8, num_groups=4)
    ledger = replay(plan, [{0, 1, 2, 3}, set()])
    assert ledger.pending == (4, 5, 6, 7)
    assert ledger.assignment(plan) == (4, 5, 6, 7)


def test_state_size_does_not_grow_with_failures() -> None:
    plan = ReplicaPlan(num_samples=1 << 30, global_batch=1024, num_groups=64)
    rng = np.random.default_rng(0)
    ledger, sizes = Ledger(), []
    for _ in range(2000):
        down = set(rng.choice(64, size=int(rng.integers(0, 8)), replace=False).tolist())
        ledger = ledger.committed(plan, set(range(64)) - down)
        sizes.append(len(json.dumps(ledger.to_dict())))
    assert max(sizes) < 7 * 2 * 12 + 100  # at most 7 groups down at once


@pytest.mark.parametrize("bad", [
    {"version": 2, "epoch": 0, "step": 0, "next_fresh": 0, "pending": [], "behind": []},
    {"version": 1, "epoch": 0, "step": 0, "next_fresh": 0, "pending": []},
    {"version": 1, "epoch": 0, "step": 0, "next_fresh": 99, "pending": [],
     "behind": []},
    {"version": 1, "epoch": 0, "step": 0, "next_fresh": 4, "pending": [3, 1],
     "behind": []},
    {"version": 1, "epoch": 0, "step": 0, "next_fresh": 4, "pending": [5],
     "behind": []},
    {"version": 1, "epoch": -1, "step": 0, "next_fresh": 0, "pending": [],
     "behind": []},
    {"version": 1, "epoch": 0, "step": 0, "next_fresh": 0, "pending": [],
     "behind": [7]},
    {"version": 1, "epoch": 0, "step": 0, "next_fresh": 0, "pending": "[]",
     "behind": []},
    [1, 2],
])
def test_loading_is_strict(bad: object) -> None:
    plan = ReplicaPlan(num_samples=80, global_batch=8, num_groups=4)
    with pytest.raises(CursorMismatchError):
        Ledger.from_dict(bad, plan)


def test_impossible_plans_are_refused() -> None:
    with pytest.raises(PlanError, match="multiple"):
        ReplicaPlan(100, 10, 4)
    with pytest.raises(PlanError, match="split"):
        ReplicaPlan(100, 8, 4, tail=TailPolicy.SPLIT)
    plan = ReplicaPlan(100, 8, 4)
    with pytest.raises(PlanError, match="committed group"):
        Ledger().committed(plan, {4})


def test_counter_of_slices_is_a_partition_for_one_long_random_trace() -> None:
    plan = ReplicaPlan(num_samples=10_000, global_batch=48, num_groups=4, group_size=3)
    rng = np.random.default_rng(1)
    trace = [frozenset(g for g in range(4) if rng.random() > 0.2) for _ in range(400)]
    committed, _ = run_epoch(plan, trace)
    counts = Counter(committed)
    assert set(counts.values()) == {1}
    assert len(counts) == 10_000 // 48 * 48
