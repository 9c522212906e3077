"""Tests of steps, topology and the cursor (streamcache/plan/steps.py, cursor.py).

The contract: whatever the world size, worker count or global batch of each stretch of an
epoch, and however often it is interrupted, every sample of the epoch is read exactly once
(DROP: except the dropped tail), ranks never overlap, and every rank has the same number of
steps; with the same global batch, the global batches do not depend on the world size.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.errors import StreamcacheError
from streamcache.plan import (
    CONTIGUOUS,
    Cursor,
    CursorMismatchError,
    EpochOrder,
    EpochSegment,
    PlanError,
    RankBatch,
    ShuffleOptions,
    TailPolicy,
)

FINGERPRINT = "xxh64:0123456789abcdef"


options_st = st.builds(
    ShuffleOptions,
    enabled=st.booleans(),
    window=st.integers(1, 50),
    window_unit=st.sampled_from(["samples", "shards"]),
    stagger=st.booleans(),
)


def new_cursor(rows: list[int], seed: int = 7, options: ShuffleOptions | None = None,
               **kwargs: int) -> Cursor:
    return Cursor(FINGERPRINT, sum(rows), seed, options or ShuffleOptions(window=13), **kwargs)


def rank_batches(order: EpochOrder, segment: EpochSegment, steps: int,
                 num_workers: int) -> list[list[RankBatch]]:
    """What every rank's workers produce for the first ``steps`` steps, per step and rank.

    Each (rank, worker) pair walks only its own steps, as a real worker would; the training
    loop consumes them round-robin, so the consumed steps are a prefix.
    """
    per_step: dict[int, list[RankBatch]] = {}
    for rank in range(segment.world_size):
        for worker in range(num_workers):
            for batch in segment.worker_batches(order, rank, worker, num_workers):
                if batch.step >= steps:
                    break
                assert batch.step % num_workers == worker
                per_step.setdefault(batch.step, []).append(batch)
    assert sorted(per_step) == list(range(steps))
    # Every rank produced every step: the same step count on every rank.
    assert all(len(parts) == segment.world_size for parts in per_step.values())
    return [per_step[step] for step in range(steps)]


@dataclass
class EpochLog:
    """Positions read in one epoch, and the global batches in order."""

    real: list[int] = field(default_factory=list)
    padding: list[int] = field(default_factory=list)
    batches: list[list[int]] = field(default_factory=list)
    final_batch: int = 0  # the global batch of the stretch that ended the epoch


def consume(rows: list[int], cursor: Cursor, global_batch: int, world_size: int,
            num_workers: int, tail: TailPolicy, steps: int,
            logs: dict[int, EpochLog]) -> Cursor:
    """Run a training loop for ``steps`` steps (or to the end of the epoch) and log it."""
    order = cursor.order(rows)
    segment = cursor.segment(global_batch, world_size, tail)
    steps = min(steps, segment.num_steps)
    log = logs.setdefault(cursor.epoch, EpochLog())
    for parts in rank_batches(order, segment, steps, num_workers):
        assert len(parts) == world_size  # in rank order
        global_ids: list[int] = []
        for part in parts:
            assert np.array_equal(part.sample_ids, order.sample_ids_at(part.positions))
            log.real += part.positions[~part.is_padding].tolist()
            log.padding += part.positions[part.is_padding].tolist()
            global_ids += part.sample_ids.tolist()
        log.batches.append(global_ids)
    after = cursor.advanced(segment, steps)
    if after.epoch != cursor.epoch:
        log.final_batch = global_batch
    return after


def check_complete_epoch(log: EpochLog, num_samples: int, tail: TailPolicy) -> None:
    """Every position exactly once (DROP: all but a tail shorter than the last batch)."""
    real = sorted(log.real)
    assert len(real) == len(set(real)), "a position was read twice"
    if tail is TailPolicy.DROP:
        assert real == list(range(len(real)))
        assert num_samples - len(real) < log.final_batch
    else:
        assert real == list(range(num_samples))
    if tail is not TailPolicy.PAD:
        assert log.padding == []


segment_st = st.tuples(
    st.integers(1, 6),  # per-rank batch
    st.sampled_from([1, 2, 3, 4]),  # world size
    st.integers(1, 4),  # workers
    st.integers(0, 12),  # steps before the interruption
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda r: sum(r) > 0),
    seed=st.integers(0, 2**64 - 1),
    options=options_st,
    tail=st.sampled_from(list(TailPolicy)),
    segments=st.lists(segment_st, min_size=1, max_size=6),
)
def test_interrupted_epochs_read_every_sample_exactly_once(
    rows: list[int], seed: int, options: ShuffleOptions, tail: TailPolicy,
    segments: list[tuple[int, int, int, int]],
) -> None:
    num_samples = sum(rows)
    cursor = new_cursor(rows, seed, options)
    logs: dict[int, EpochLog] = {}
    # Each resume may change the world size, the worker count and the global batch; the last
    # stretch runs to the end of the epoch.
    for index, (per_rank, world, workers, steps) in enumerate(segments):
        last = index == len(segments) - 1
        start_epoch = cursor.epoch
        cursor = Cursor.from_dict(json.loads(json.dumps(cursor.to_dict())))
        cursor = consume(rows, cursor, per_rank * world, world, workers, tail,
                         10**9 if last else steps, logs)
        if last:
            assert cursor.epoch == start_epoch + 1 and cursor.samples_consumed == 0
    for epoch, log in logs.items():
        if epoch < cursor.epoch:
            check_complete_epoch(log, num_samples, tail)
        else:
            assert len(set(log.real)) == len(log.real)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.integers(0, 30), min_size=1, max_size=6).filter(lambda r: sum(r) > 0),
    per_rank=st.integers(1, 5),
    world=st.integers(1, 5),
    workers=st.integers(1, 4),
    start=st.integers(0, 200),
    tail=st.sampled_from(list(TailPolicy)),
)
def test_ranks_are_disjoint_and_get_equal_step_counts(
    rows: list[int], per_rank: int, world: int, workers: int, start: int, tail: TailPolicy
) -> None:
    num_samples = sum(rows)
    order = EpochOrder(rows, 3, 1, ShuffleOptions(window=5))
    segment = EpochSegment(num_samples, start % (num_samples + 1), per_rank * world, world, tail)
    per_rank_positions: list[list[int]] = [[] for _ in range(world)]
    for parts in rank_batches(order, segment, segment.num_steps, workers):
        for rank, part in enumerate(parts):
            per_rank_positions[rank] += part.positions[~part.is_padding].tolist()
            if tail is not TailPolicy.SPLIT:
                assert part.positions.size == per_rank
    seen = [p for positions in per_rank_positions for p in positions]
    assert len(seen) == len(set(seen))
    expected = range(segment.start, segment.start + len(seen))
    assert sorted(seen) == list(expected)
    if tail is not TailPolicy.DROP:
        assert len(seen) == num_samples - segment.start
    assert sum(len(segment.worker_steps(w, workers)) for w in range(workers)) == segment.num_steps


@pytest.mark.parametrize("tail", list(TailPolicy))
@pytest.mark.parametrize("world_after", [1, 2, 4, 8])
def test_same_batch_resume_on_another_world_size_gives_the_same_global_batches(
    tail: TailPolicy, world_after: int
) -> None:
    rows = [37, 0, 81, 12, 55]
    global_batch = 16
    uninterrupted: dict[int, EpochLog] = {}
    consume(rows, new_cursor(rows), global_batch, 2, 3, tail, 10**9, uninterrupted)
    interrupted: dict[int, EpochLog] = {}
    cursor = consume(rows, new_cursor(rows), global_batch, 2, 3, tail, 5, interrupted)
    consume(rows, cursor, global_batch, world_after, 1, tail, 10**9, interrupted)
    assert interrupted[0].batches == uninterrupted[0].batches


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(lambda r: sum(r) > 0),
    tail=st.sampled_from(list(TailPolicy)),
    stretches=st.lists(st.tuples(st.sampled_from([1, 2, 3, 6]), st.integers(1, 3),
                                 st.integers(0, 6)), min_size=1, max_size=5),
)
def test_same_batch_global_batches_do_not_depend_on_world_size_or_workers(
    rows: list[int], tail: TailPolicy, stretches: list[tuple[int, int, int]]
) -> None:
    global_batch = 6
    expected: dict[int, EpochLog] = {}
    consume(rows, new_cursor(rows), global_batch, 1, 1, tail, 10**9, expected)
    logs: dict[int, EpochLog] = {}
    cursor = new_cursor(rows)
    for index, (world, workers, steps) in enumerate(stretches):
        last = index == len(stretches) - 1
        cursor = consume(rows, cursor, global_batch, world, workers, tail,
                         10**9 if last else steps, logs)
        if cursor.epoch == 1:
            break
    if cursor.epoch == 1:
        assert logs[0].batches == expected[0].batches


# --------------------------------------------------------------------------- resume helper

Run = Callable[[Cursor, int], tuple[list[list[int]], Cursor]]


def check_resume(start: Cursor, run: Run, resumed_run: Run, steps_per_epoch: int) -> None:
    """The house resume check: a run interrupted at the start, a midpoint, the end of an
    epoch, or inside the next epoch, saved through JSON and resumed with ``resumed_run``,
    yields what an uninterrupted run yields. ``run(cursor, steps)`` returns the batches of
    the next ``steps`` steps and the cursor after them."""
    total = 2 * steps_per_epoch
    expected, _ = run(start, total)
    for stop in (0, steps_per_epoch // 2, steps_per_epoch, steps_per_epoch + 1):
        first, cursor = run(start, stop)
        saved = json.loads(json.dumps(cursor.to_dict()))
        resumed = Cursor.load(saved, dataset_fingerprint=start.dataset_fingerprint,
                              num_samples=start.num_samples, seed=start.seed,
                              shuffle=start.shuffle)
        rest, _ = resumed_run(resumed, total - stop)
        assert first + rest == expected, f"resume after {stop} steps differs"


def loop(rows: list[int], global_batch: int, world: int, workers: int) -> Run:
    def run(cursor: Cursor, steps: int) -> tuple[list[list[int]], Cursor]:
        batches: list[list[int]] = []
        while steps > 0:
            logs: dict[int, EpochLog] = {}
            before = cursor
            cursor = consume(rows, cursor, global_batch, world, workers, TailPolicy.PAD,
                             steps, logs)
            done = logs[before.epoch].batches
            batches += done
            steps -= len(done)
        return batches, cursor
    return run


@pytest.mark.parametrize(("world", "world_after", "workers_after"), [(1, 1, 1), (2, 4, 3),
                                                                      (4, 1, 2)])
def test_resume_from_start_midpoint_end_and_next_epoch(
    world: int, world_after: int, workers_after: int
) -> None:
    rows = [20, 3, 0, 17]
    steps_per_epoch = -(-sum(rows) // 8)
    check_resume(new_cursor(rows), loop(rows, 8, world, 2),
                 loop(rows, 8, world_after, workers_after), steps_per_epoch)


# --------------------------------------------------------------------------- tail policies


def test_pad_fills_the_last_batch_from_the_start_of_the_epoch() -> None:
    rows = [6, 4]
    order = EpochOrder(rows, 1, 0)
    segment = EpochSegment(10, 0, 4, 2, TailPolicy.PAD)
    assert segment.num_steps == 3
    last = [segment.rank_batch(order, 2, rank) for rank in range(2)]
    assert last[0].is_padding.tolist() == [False, False]
    assert last[1].is_padding.tolist() == [True, True]
    assert last[1].positions.tolist() == [0, 1]
    assert last[1].sample_ids.tolist() == order.sample_ids(0, 2).tolist()


def test_pad_wraps_more_than_once_when_the_batch_exceeds_the_epoch() -> None:
    order = EpochOrder([3], 1, 0)
    segment = EpochSegment(3, 0, 8, 1, TailPolicy.PAD)
    batch = segment.rank_batch(order, 0, 0)
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert batch.is_padding.sum() == 5


def test_split_shares_the_tail_without_padding_and_keeps_step_counts_equal() -> None:
    order = EpochOrder([5], 1, 0)
    segment = EpochSegment(5, 0, 4, 4, TailPolicy.SPLIT)
    assert segment.num_steps == 2
    assert segment.part_sizes(1) == [0, 0, 0, 1]
    parts = [segment.rank_batch(order, 1, rank) for rank in range(4)]
    assert [p.positions.tolist() for p in parts] == [[], [], [], [4]]
    drop = EpochSegment(5, 0, 4, 4, TailPolicy.DROP)
    assert drop.num_steps == 1


def test_an_exhausted_segment_has_no_steps_and_rolls_over() -> None:
    cursor = new_cursor([5], samples_consumed=5, epoch=2)
    segment = cursor.segment(2, 1, "pad")
    assert segment.num_steps == 0
    assert cursor.advanced(segment, 0) == new_cursor([5], epoch=3)


@given(rows=st.lists(st.integers(1, 40), min_size=1, max_size=4), batch=st.integers(1, 9),
       start=st.integers(0, 200), steps=st.integers(0, 30))
@settings(max_examples=60, deadline=None)
def test_an_advanced_cursor_is_the_one_built_and_checked_anew(rows: list[int], batch: int,
                                                              start: int, steps: int) -> None:
    """advanced() moves a cursor inside its epoch without re-checking its other fields: the
    result must be the cursor a checked construction gives (equal, same hash, same state)."""
    consumed = start % (sum(rows) + 1)
    cursor = new_cursor(rows, samples_consumed=consumed, epoch=1)
    segment = cursor.segment(batch, 1, "drop")
    done = min(steps, segment.num_steps)
    after = cursor.advanced(segment, done)
    if done == segment.num_steps:
        built = dataclasses.replace(cursor, epoch=2, samples_consumed=0)
    else:
        built = dataclasses.replace(cursor, samples_consumed=consumed + done * batch)
    assert after == built and hash(after) == hash(built) and type(after) is Cursor
    assert after.to_dict() == built.to_dict() == Cursor.from_dict(after.to_dict()).to_dict()
    assert cursor.samples_consumed == consumed  # the original is unchanged


def test_a_cursor_is_not_moved_outside_its_epoch() -> None:
    from streamcache.plan.cursor import moved_within_epoch

    cursor = new_cursor([5])
    for bad in (-1, 6):
        with pytest.raises(StreamcacheError, match="samples_consumed must be in"):
            moved_within_epoch(cursor, bad)


# --------------------------------------------------------------------------- assignment hook


class Strided:
    """Rank r takes every world-th slot: a different, valid assignment."""

    def slots(self, order: EpochOrder, batch_start: int, part_sizes: list[int],
              rank: int) -> np.ndarray:
        return np.arange(rank, sum(part_sizes), len(part_sizes))[: part_sizes[rank]]


def test_a_custom_assignment_changes_who_reads_not_what_is_read() -> None:
    order = EpochOrder([9, 14], 2, 0)
    segment = EpochSegment(23, 0, 6, 3, TailPolicy.PAD)
    for step in range(segment.num_steps):
        default = [segment.rank_batch(order, step, r) for r in range(3)]
        strided = [segment.rank_batch(order, step, r, Strided()) for r in range(3)]
        flat = sorted(np.concatenate([b.positions for b in default]).tolist())
        assert sorted(np.concatenate([b.positions for b in strided]).tolist()) == flat
        assert strided[1].positions.tolist()[0] == default[0].positions.tolist()[1]


def test_the_default_assignment_survives_pickling() -> None:
    order = EpochOrder([9, 14], 2, 0)
    segment = pickle.loads(pickle.dumps(EpochSegment(23, 0, 6, 3, TailPolicy.PAD)))
    copied = pickle.loads(pickle.dumps(CONTIGUOUS))
    assert copied is not CONTIGUOUS
    for step in range(segment.num_steps):
        assert np.array_equal(segment.rank_batch(order, step, 1, copied).sample_ids,
                              segment.rank_batch(order, step, 1).sample_ids)


def test_a_broken_assignment_is_refused() -> None:
    class TooMany:
        def slots(self, order: EpochOrder, batch_start: int, part_sizes: list[int],
                  rank: int) -> np.ndarray:
            return np.arange(sum(part_sizes))

    class Repeats:
        def slots(self, order: EpochOrder, batch_start: int, part_sizes: list[int],
                  rank: int) -> np.ndarray:
            return np.zeros(part_sizes[rank], dtype=np.int64)

    class Overlaps:
        def slots(self, order: EpochOrder, batch_start: int, part_sizes: list[int],
                  rank: int) -> np.ndarray:
            return np.arange(part_sizes[rank])  # every rank takes the first slots

    order, segment = EpochOrder([10], 0, 0), EpochSegment(10, 0, 4, 2)
    for broken in (TooMany(), Repeats()):
        with pytest.raises(PlanError, match="assignment"):
            segment.rank_batch(order, 0, 0, broken)
    with pytest.raises(PlanError, match="partition"):
        segment.check_assignment(order, 0, Overlaps())
    segment.check_assignment(order, 0, Strided())
    segment.check_assignment(order, 1, CONTIGUOUS)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("global_batch", "world", "match"),
    [(10, 4, "not divisible"), (2, 4, "larger than the global batch"), (0, 1, "global batch"),
     (4, 0, "world size")],
)
def test_impossible_topologies_are_refused(global_batch: int, world: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        EpochSegment(100, 0, global_batch, world)


def test_an_unknown_tail_policy_is_refused() -> None:
    with pytest.raises(PlanError, match="tail policy"):
        new_cursor([4]).segment(2, 1, "wrap")


def test_bad_step_rank_and_worker_are_refused() -> None:
    order = EpochOrder([10], 0, 0)
    segment = EpochSegment(10, 0, 4, 2)
    with pytest.raises(PlanError):
        segment.rank_batch(order, 2, 0)  # DROP: only steps 0 and 1
    with pytest.raises(PlanError):
        segment.rank_batch(order, 0, 2)
    with pytest.raises(PlanError):
        segment.worker_steps(3, 3)
    with pytest.raises(PlanError):
        segment.worker_steps(0, 0)
    with pytest.raises(PlanError):
        EpochSegment(10, 11, 4, 2)
    with pytest.raises(PlanError):
        segment.rank_batch(EpochOrder([11], 0, 0), 0, 0)


# --------------------------------------------------------------------------- the cursor


def test_cursor_round_trips_through_json() -> None:
    cursor = new_cursor([10, 20], seed=2**64 - 1, epoch=3, samples_consumed=17)
    assert Cursor.from_dict(json.loads(json.dumps(cursor.to_dict()))) == cursor


@pytest.mark.parametrize(
    ("change", "match"),
    [({"dataset_fingerprint": "xxh64:ffffffffffffffff"}, "dataset fingerprint"),
     ({"seed": 8}, "seed"),
     ({"shuffle": ShuffleOptions(window=14)}, "shuffle"),
     ({"num_samples": 31}, "number of samples")],
)
def test_a_cursor_from_another_dataset_or_order_is_refused(
    change: dict[str, object], match: str
) -> None:
    saved = new_cursor([10, 20], samples_consumed=4).to_dict()
    current: dict[str, object] = {"dataset_fingerprint": FINGERPRINT, "num_samples": 30,
                                  "seed": 7, "shuffle": ShuffleOptions(window=13)}
    current.update(change)
    with pytest.raises(CursorMismatchError, match=match) as info:
        Cursor.load(saved, **current)  # type: ignore[arg-type]
    assert isinstance(info.value, StreamcacheError)


@pytest.mark.parametrize(
    "edit",
    [lambda d: d.pop("epoch"), lambda d: d.update(extra=1), lambda d: d.update(version=3),
     lambda d: d.update(samples_consumed=31), lambda d: d.update(samples_consumed=-1),
     lambda d: d.update(epoch="1"), lambda d: d.update(shuffle={"window": 3}),
     lambda d: d.update(dataset_fingerprint=""),
     # epochs are below 2**62 (docs/trust.md; #33 accepted these)
     lambda d: d.update(epoch=2**62), lambda d: d.update(epoch=2**70),
     lambda d: d.update(epoch=-1)],
)
def test_a_malformed_cursor_is_refused(edit: Callable[[dict[str, object]], object]) -> None:
    data = new_cursor([10, 20]).to_dict()
    edit(data)
    with pytest.raises(CursorMismatchError):
        Cursor.from_dict(data)


def test_the_largest_epoch_a_state_may_hold_round_trips() -> None:
    cursor = new_cursor([10, 20], epoch=2**62 - 1)
    assert Cursor.from_dict(json.loads(json.dumps(cursor.to_dict()))) == cursor


def test_a_cursor_refuses_shards_of_another_size() -> None:
    with pytest.raises(CursorMismatchError):
        new_cursor([10, 20]).order([10, 21])


def test_a_cursor_refuses_a_segment_it_did_not_begin() -> None:
    cursor = new_cursor([10, 20])
    other = new_cursor([10, 20], samples_consumed=2).segment(2, 1)
    with pytest.raises(PlanError):
        cursor.advanced(other, 1)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.integers(0, 60), min_size=1, max_size=6).filter(lambda r: sum(r) > 0),
    per_rank=st.integers(1, 5),
    world=st.integers(1, 4),
    start=st.integers(0, 300),
    tail=st.sampled_from(list(TailPolicy)),
    per_pass=st.integers(1, 40),
)
def test_batched_steps_equal_single_steps(
    rows: list[int], per_rank: int, world: int, start: int, tail: TailPolicy, per_pass: int
) -> None:
    order = EpochOrder(rows, 5, 0, ShuffleOptions(window=7))
    segment = EpochSegment(sum(rows), start % (sum(rows) + 1), per_rank * world, world, tail)
    for rank in range(world):
        single = [segment.rank_batch(order, step, rank) for step in range(segment.num_steps)]
        batched = list(segment.worker_batches(order, rank, 0, 1, positions_per_pass=per_pass))
        assert len(single) == len(batched)
        for one, many in zip(single, batched, strict=True):
            assert one.step == many.step
            for field_name in ("positions", "sample_ids", "shards", "rows", "is_padding"):
                assert np.array_equal(getattr(one, field_name), getattr(many, field_name))
            shards, rows_in_shard = order.shard_of_ids(many.sample_ids)
            assert np.array_equal(many.shards, shards)
            assert np.array_equal(many.rows, rows_in_shard)


def test_the_first_batch_of_a_pass_waits_for_its_own_ids_only() -> None:
    """An epoch's (or a resume's) first batch resolves only its own positions; the rest of
    the pass comes after it, an eighth of a pass first."""
    order = EpochOrder([5000] * 4, 5, 0, ShuffleOptions(window=7))
    segment = EpochSegment(20_000, 0, 32, 1, TailPolicy.DROP)
    resolved: list[int] = []
    resolve = order._resolve

    def counting(positions: np.ndarray) -> np.ndarray:
        resolved.append(int(positions.size))
        return resolve(positions)

    order._resolve = counting  # type: ignore[method-assign]
    order._blocks._compute = counting
    batches = segment.worker_batches(order, 0, 0, 1, positions_per_pass=32 * 64)
    first = next(batches)
    assert first.step == 0 and resolved == [32]
    rest = list(batches)
    assert resolved[:3] == [32, 32 * 8, 32 * 64]  # one step, an eighth of a pass, a pass
    assert [b.step for b in rest] == list(range(1, segment.num_steps))
