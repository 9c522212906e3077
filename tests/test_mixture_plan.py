"""The mixture's plan (streamcache/plan/mixture.py, mixture_cursor.py): quotas, exactly-once
per source epoch, elastic resumes and weight changes, finite and infinite. Pure: no I/O."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from helpers.mixture_model import MixtureModel, Sample
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from streamcache.plan import CursorMismatchError, PlanError, ShuffleOptions, TailPolicy
from streamcache.plan.mixture import (
    MixtureOrder,
    SourceOrders,
    SourceShape,
    groups,
    source_seed,
)
from streamcache.plan.mixture_cursor import MixtureCursor, SourceKey
from streamcache.plan.quota import Quota
from streamcache.plan.shares import MAX_PERIOD, shares_of

SHUFFLE = ShuffleOptions(window=16)


def resume(state: object, current: MixtureCursor) -> MixtureCursor:
    """:meth:`MixtureCursor.load` of a mixture whose sources are listed as they were."""
    cursor, order = MixtureCursor.load(state, current)
    assert order == tuple(range(len(current.sources)))
    return cursor
FAST = settings(max_examples=25, deadline=None)

shares_st = st.lists(st.integers(1, 30), min_size=1, max_size=5).map(tuple)


def drift_ok(owner: np.ndarray, shares: tuple[int, ...]) -> bool:
    """Every prefix of ``owner`` within one sample of the shares, for every source."""
    total = sum(shares)
    n = np.arange(1, owner.size + 1)
    for s, a in enumerate(shares):
        counts = np.cumsum(owner == s)
        if not (np.abs(counts - Fraction(a, total).__float__() * n) < 1 - 1e-9).all():
            return False
    return True


@FAST
@given(shares_st)
def test_quota_stays_within_one_sample_of_the_weights_at_every_prefix(shares):
    quota = Quota(shares)
    positions = np.arange(3 * quota.period + 7)
    owner, before = quota.at(positions)
    assert drift_ok(owner, shares)
    for s in range(len(shares)):  # the count before each position, and T_s(n)
        mine = owner == s
        assert (before[mine] == np.arange(mine.sum())).all()
        for n in (0, 1, quota.period, 2 * quota.period + 3):
            assert quota.counts(n)[s] == int((owner[:n] == s).sum())
        assert quota.counts(len(positions)).sum() == len(positions)
        for samples in (1, shares[s], 2 * shares[s] + 1):
            end = quota.positions_for(s, samples)
            assert (owner[:end] == s).sum() == samples and owner[end - 1] == s


def test_shares_are_exact_for_common_weights_and_bounded_otherwise():
    assert shares_of([0.7, 0.2, 0.1]) == (7, 2, 1)
    assert shares_of([7, 2, 1]) == (7, 2, 1)
    assert shares_of([np.int64(7), np.float32(0.5), Fraction(1, 2)]) == (14, 1, 1)
    assert shares_of([1 / 3, 1 / 3, 1 / 3]) == (1, 1, 1)
    odd = [0.123457, 0.5, 0.1]
    shares = shares_of(odd)
    assert sum(shares) <= MAX_PERIOD
    for weight, share in zip(odd, shares, strict=True):
        assert abs(weight / sum(odd) - share / sum(shares)) < 1 / MAX_PERIOD
    for bad in ([], [0.5, 0], [1, -1], [float("nan")], [True]):
        with pytest.raises(PlanError):
            shares_of(bad)


# ---------------------------------------------------------------- a small mixture, pure

def make(rows: list[list[int]], shares: tuple[int, ...], *, infinite: bool,
         epochs: list[int] | None = None, seed: int = 3
         ) -> tuple[MixtureCursor, list[SourceOrders]]:
    shapes = [SourceShape(np.asarray(r, dtype=np.int64), (epochs or [0] * len(rows))[i]
                          or sum(r)) for i, r in enumerate(rows)]
    keys = tuple(SourceKey(f"fp{i}", s.num_samples, s.epoch_samples)
                 for i, s in enumerate(shapes))
    orders = [SourceOrders(s, source_seed(seed, i), SHUFFLE) for i, s in enumerate(shapes)]
    return MixtureCursor.start(keys, shares, seed, SHUFFLE, infinite), orders


def run(cursor: MixtureCursor, orders: list[SourceOrders], steps: int, batch: int,
        world: int = 1, workers: int = 1, tail: TailPolicy = TailPolicy.DROP,
        ) -> tuple[list[list[int]], MixtureCursor]:
    """``steps`` global batches (combined ids), read as ranks and workers would read them,
    and the cursor after them."""
    batches: list[list[int]] = []
    while len(batches) < steps:
        segment = cursor.segment(batch, world, tail)
        order = MixtureOrder(orders, cursor.epoch_plan(cursor.epoch))
        count = min(segment.num_steps, steps - len(batches))
        assert segment.num_steps or segment.start, "an epoch shorter than a global batch"
        parts = {}
        for rank in range(world):
            for worker in range(workers):
                for part in segment.worker_batches(order, rank, worker, workers):
                    if part.step >= count:
                        break
                    parts[part.step, rank] = part.sample_ids[~part.is_padding].tolist()
        batches += [[i for rank in range(world) for i in parts[step, rank]]
                    for step in range(count)]
        cursor = cursor.advanced(segment, count)
    return batches, cursor


def per_source(ids: list[int], sizes: list[int]) -> list[list[int]]:
    base = np.cumsum([0, *sizes])
    out: list[list[int]] = [[] for _ in sizes]
    for i in ids:
        s = int(np.searchsorted(base, i, side="right")) - 1
        out[s].append(i - int(base[s]))
    return out


ROWS = [[7, 5, 9], [4, 4], [11]]
SIZES = [sum(r) for r in ROWS]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


@FAST
@given(shares=st.tuples(*(st.integers(1, 9) for _ in ROWS)), steps=st.integers(5, 40),
       batch=st.sampled_from([2, 3, 4, 6]))
def test_infinite_reads_every_sample_of_each_source_epoch_once(shares, steps, batch):
    cursor, orders = make(ROWS, shares, infinite=True)
    batches, _ = run(cursor, orders, steps, batch)
    ids = flat(batches)
    assert drift_ok(np.searchsorted(np.cumsum([0, *SIZES]), ids, side="right") - 1, shares)
    for size, mine in zip(SIZES, per_source(ids, SIZES), strict=True):
        for start in range(0, len(mine), size):
            block = mine[start:start + size]
            assert len(set(block)) == len(block)
            if len(block) == size:
                assert sorted(block) == list(range(size))


def test_repeat_and_samples_set_a_source_epoch():
    # source 0 twice per source epoch (two passes), source 1 capped at 3 of its 8
    cursor, orders = make(ROWS[:2], (1, 1), infinite=True, epochs=[42, 3])
    mine = per_source(flat(run(cursor, orders, 40, 4)[0]), SIZES[:2])
    first = mine[0][:42]
    assert sorted(first) == sorted(list(range(21)) * 2)
    assert first[:21] != first[21:]  # each pass its own order
    for start in range(0, len(mine[1]) - 3, 3):
        assert len(set(mine[1][start:start + 3])) == 3
    assert len(set(mine[1][:8])) > 3  # a fresh part of the source each epoch


@FAST
@given(shares=st.tuples(*(st.integers(1, 9) for _ in ROWS)))
def test_finite_epoch_ends_when_the_first_source_finishes_its_epoch(shares):
    cursor, orders = make(ROWS, shares, infinite=False)
    length = cursor.num_samples
    for epoch in range(2):
        batches, after = run(cursor, orders, 1, length, tail=TailPolicy.SPLIT)
        assert after.epoch == epoch + 1 and after.samples_consumed == 0
        counts = [len(m) for m in per_source(flat(batches), SIZES)]
        assert all(c <= size for c, size in zip(counts, SIZES, strict=True))
        assert any(c == size for c, size in zip(counts, SIZES, strict=True))
        for mine in per_source(flat(batches), SIZES):
            assert len(set(mine)) == len(mine)
        # the limiting source is exhausted exactly at the last position, not before
        last = per_source(flat(batches)[:-1], SIZES)
        assert all(len(m) < size for m, size in zip(last, SIZES, strict=True)) or \
            sum(c == s for c, s in zip(counts, SIZES, strict=True)) > 1
        cursor = after


topology = st.tuples(st.sampled_from([1, 2, 4]), st.integers(1, 3)).map(
    lambda t: (t[0], t[1]))


@FAST
@given(shares=st.tuples(*(st.integers(1, 5) for _ in ROWS)), first=topology, second=topology,
       batches=st.tuples(st.sampled_from([4, 8]), st.sampled_from([4, 8])),
       stop=st.integers(0, 30), infinite=st.booleans())
def test_resume_on_any_topology_and_batch_size_is_exact(shares, first, second, batches, stop,
                                                       infinite):
    fresh, orders = make(ROWS, shares, infinite=infinite)
    reference, _ = run(fresh, orders, 80, batches[0])
    head, cursor = run(fresh, orders, stop, batches[0], *first)
    assert head == reference[:stop]
    state = json.loads(json.dumps(cursor.to_dict()))
    resumed = resume(state, fresh)
    same, _ = run(resumed, orders, 80 - stop, batches[0], *second)
    assert same == reference[stop:]  # same global batch: the very same batches
    other, after = run(resumed, orders, 20, batches[1], *second)
    if infinite:  # nothing skipped or repeated, even where an epoch's tail is dropped
        assert flat(other) == flat(reference[stop:])[:len(flat(other))]
    else:  # each epoch is read as a prefix of its order
        assert flat(other)[:len(flat(same))] == flat(same)[:len(flat(other))] or \
            after.epoch > resumed.epoch


@FAST
@given(shares=st.tuples(*(st.integers(1, 5) for _ in ROWS)),
       new=st.tuples(*(st.integers(1, 5) for _ in ROWS)), stop=st.integers(0, 25),
       batch=st.sampled_from([2, 4, 6]))
def test_new_weights_on_resume_continue_every_source_without_repeat_or_skip(shares, new, stop,
                                                                          batch):
    fresh, orders = make(ROWS, shares, infinite=True)
    reference = per_source(flat(run(fresh, orders, 120, batch)[0]), SIZES)
    head, cursor = run(fresh, orders, stop, batch)
    fresh_new, _ = make(ROWS, new, infinite=True)
    resumed = resume(cursor.to_dict(), fresh_new)
    assert resumed.shares == fresh_new.shares
    tail, _ = run(resumed, orders, 30, batch)
    changed = per_source(flat(head) + flat(tail), SIZES)
    for mine, ref in zip(changed, reference, strict=True):
        common = min(len(mine), len(ref))  # each source goes on exactly where it stood
        assert common and mine[:common] == ref[:common]
    # the new weights from the resume on (unchanged weights: the phase goes on)
    since = flat(tail) if resumed.shares != cursor.shares else flat(head) + flat(tail)
    owner = np.searchsorted(np.cumsum([0, *SIZES]), since, side="right") - 1
    assert drift_ok(owner, fresh_new.shares)
    again = resume(resumed.to_dict(), fresh_new)
    assert again == resumed  # a state saved after the change resumes as it was


def test_new_weights_in_a_finite_epoch_cut_it_where_the_first_source_now_ends():
    fresh, orders = make(ROWS, (1, 1, 1), infinite=False)
    head, cursor = run(fresh, orders, 3, 2)
    favour, _ = make(ROWS, (1, 8, 1), infinite=False)
    resumed = resume(cursor.to_dict(), favour)
    rest, after = run(resumed, orders, 1, resumed.num_samples - resumed.samples_consumed,
                      tail=TailPolicy.SPLIT)
    counts = [len(m) for m in per_source(flat(head) + flat(rest), SIZES)]
    assert counts[1] == SIZES[1] and counts[0] < SIZES[0] and counts[2] < SIZES[2]
    assert after.epoch == 1 and after.num_samples == favour.num_samples


def test_state_is_strict_and_names_what_differs():
    cursor, orders = make(ROWS, (2, 1, 1), infinite=True)
    _, cursor = run(cursor, orders, 5, 4)
    state = json.loads(json.dumps(cursor.to_dict()))
    assert MixtureCursor.from_dict(state) == cursor
    other = MixtureCursor.start(tuple(SourceKey(f"fp{i}" if i != 1 else "other", n, n)
                                      for i, n in enumerate(SIZES)), (2, 1, 1), 3, SHUFFLE,
                                True)
    with pytest.raises(CursorMismatchError, match="source 1 dataset fingerprint"):
        resume(state, other)
    fewer, _ = make(ROWS[:2], (1, 1), infinite=True)
    with pytest.raises(CursorMismatchError, match="number of sources: saved 3, now 2"):
        resume(state, fewer)
    finite, _ = make(ROWS, (2, 1, 1), infinite=False)
    with pytest.raises(CursorMismatchError, match="infinite"):
        resume(state, finite)
    tampered = {**state, "source_cursors": [[0, 0]] * 3}
    with pytest.raises(CursorMismatchError, match="do not follow from its phases"):
        MixtureCursor.from_dict(tampered)
    with pytest.raises(CursorMismatchError, match="single dataset"):
        MixtureCursor.from_dict({"version": 1, "dataset_fingerprint": "x"})
    with pytest.raises(CursorMismatchError):
        MixtureCursor.from_dict({**state, "phases": [{"start": 0, "counts": [0], "shares": [1]}]})


def test_mixture_order_answers_as_an_epoch_order_does():
    cursor, orders = make(ROWS, (3, 1, 2), infinite=True)
    order = MixtureOrder(orders, cursor.epoch_plan(0))
    ids, shards, rows = order.samples(0, order.num_samples)
    assert (order.sample_ids_at(np.arange(order.num_samples)) == ids).all()
    assert np.array_equal(np.stack(order.shard_of_ids(ids)), np.stack([shards, rows]))
    assert (rows < order.shard_rows[shards]).all()
    used, firsts = order.shard_first_use(0, order.num_samples)
    for shard, position in zip(used.tolist(), firsts.tolist(), strict=True):
        assert shards[position] == shard and shard not in shards[:position]


# ---------------------------------------------------------------- against the reference model

def combined(samples: list[Sample]) -> list[int]:
    """The model's (source, id) as the plan's combined ids."""
    base = np.cumsum([0, *SIZES])
    return [int(base[s]) + i for s, i in samples]


plans = st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6, 8]), st.integers(0, 9)),
                 min_size=1, max_size=4)


@FAST
@given(shares=st.tuples(*(st.integers(1, 5) for _ in ROWS)), infinite=st.booleans(),
       plan=plans, topologies=st.lists(topology, min_size=4, max_size=4))
def test_batches_follow_the_model_across_resumes_with_other_batch_sizes(shares, infinite,
                                                                        plan, topologies):
    model = MixtureModel(ROWS, shares, 3, SHUFFLE)
    assume(model.epoch_length() >= max(b for b, _ in plan))  # else no step fits an epoch
    fresh, orders = make(ROWS, shares, infinite=infinite)
    cursor, got = fresh, []
    for (batch, steps), (world, workers) in zip(plan, topologies, strict=False):
        world = world if batch % world == 0 else 1
        cursor = resume(json.loads(json.dumps(cursor.to_dict())), fresh)
        read, cursor = run(cursor, orders, steps, batch, world, workers)
        got += read
    assert got == [combined(b) for b in model.batches(infinite, plan)]


@FAST
@given(shares=st.tuples(*(st.integers(1, 5) for _ in ROWS)), batch=st.integers(1, 8),
       epoch=st.integers(0, 4), before=st.integers(0, 12), infinite=st.booleans())
def test_set_epoch_starts_where_an_uninterrupted_run_reaches_the_epoch(shares, batch, epoch,
                                                                      before, infinite):
    model = MixtureModel(ROWS, shares, 3, SHUFFLE)
    length = model.epoch_length()
    assume(length >= batch)
    fresh, orders = make(ROWS, shares, infinite=infinite)
    _, cursor = run(fresh, orders, before, batch)  # set_epoch from anywhere in the run
    started = cursor.at_epoch(epoch, batch, TailPolicy.DROP)
    assert started.epoch == epoch and started.samples_consumed == 0
    read, _ = run(started, orders, min(3, length // batch), batch)
    if infinite:
        first = model.infinite_epoch_start(epoch, batch)
        assert started.position == first
        assert flat(read) == combined(model.sequence(first + len(flat(read)))[first:])
        # the uninterrupted run is at that very position when its epoch begins
        steps = length // batch
        _, reached = run(fresh, orders, epoch * steps, batch)
        assert (reached.epoch, reached.samples_consumed) == (epoch, 0)
        assert reached.position == first
    else:
        assert flat(read) == combined(model.finite_epoch(epoch))[:len(flat(read))]


@pytest.mark.parametrize("rows", [[7, 5, 9], [64], [1000, 3000, 96], [3, 0, 4]])
def test_a_small_source_reads_its_order_from_a_table_with_the_same_answers(rows, monkeypatch):
    from streamcache.plan import mixture

    shape = SourceShape(np.asarray(rows), sum(rows) * 2 + 3)  # three passes a source epoch
    k = np.random.default_rng(len(rows)).integers(0, shape.epoch_samples * 3, 500)
    tabled = SourceOrders(shape, 5, SHUFFLE).samples_at(k)
    monkeypatch.setattr(mixture, "SMALL_SOURCE", 0)  # every source evaluates its order
    evaluated = SourceOrders(shape, 5, SHUFFLE).samples_at(k)
    for a, b in zip(tabled, evaluated, strict=True):
        assert (a == b).all()


# ---------------------------------------------------------------- a split tail with empty parts

ISSUE_ROWS = [[20, 30], [15, 15], [12, 8]]  # 50, 30 and 20 samples (issue 33, item 8)


def test_groups_of_no_keys_is_empty():
    assert list(groups(np.zeros(0, dtype=np.int64))) == []
    assert [(k, ix.tolist()) for k, ix in groups(np.asarray([2, 0, 2]))] == \
        [(0, [1]), (2, [0, 2])]


@pytest.mark.parametrize("infinite", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_split_tail_whose_part_is_empty_on_a_rank_reads_every_sample_once(infinite,
                                                                           workers):
    """Weights 0.7/0.2/0.1 over 50/30/20 samples: an epoch of 71 positions, read in global
    batches of 3 by 3 ranks, ends with a step of 2 in which rank 0's part is empty; that
    part has no positions, so no phase, source or pass to look up (it raised ValueError)."""
    model = MixtureModel(ISSUE_ROWS, (7, 2, 1), 3, SHUFFLE)
    length = model.epoch_length()
    assert length % 3 == 2  # the last step: parts of 0, 1 and 1
    fresh, orders = make(ISSUE_ROWS, (7, 2, 1), infinite=infinite)
    per_epoch = -(-length // 3)
    read, after = run(fresh, orders, 2 * per_epoch, 3, world=3, workers=workers,
                      tail=TailPolicy.SPLIT)
    assert [len(step) for step in read] == ([3] * (per_epoch - 1) + [2]) * 2
    assert (after.epoch, after.samples_consumed) == (2, 0)
    if infinite:  # with a split tail an infinite epoch is L positions
        expected = model.sequence(2 * length)
    else:
        expected = model.finite_epoch(0) + model.finite_epoch(1)
    base = np.cumsum([0, *(sum(rows) for rows in ISSUE_ROWS)])
    assert flat(read) == [int(base[s]) + i for s, i in expected]
    first = per_source(flat(read)[:length], [sum(rows) for rows in ISSUE_ROWS])
    assert sorted(first[0]) == list(range(50))  # the limiting source, each sample once
    assert all(len(set(ids)) == len(ids) for ids in first)
