"""Prefetch advice from a stretch of the order ahead of the cursor, never from the whole epoch.

:class:`ShardAdvice` answers "which shards next, and when" from a horizon it scans ahead of
the position asked for (cache/advice.py): exactly the shards with the nearest next uses
(with stride 1), the same answer however many shards the dataset has, and at a cost that
does not grow with the epoch. The prefetcher's default lookahead comes from a bound the plan
guarantees, computed from the distribution of row counts instead of a sort of every shard.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.cache import advice as advice_module
from streamcache.cache.advice import (
    ShardAdvice,
    working_set_bound,
    working_set_shards_bound,
)
from streamcache.plan import EpochOrder, ShuffleOptions
from streamcache.plan.shards import ShardCounts


def _next_uses(order: EpochOrder, position: int) -> dict[int, int]:
    """Every shard read at ``position`` or later, with its first such position (a scan)."""
    positions = np.arange(position, order.num_samples, dtype=np.int64)
    shards = order.samples_at(positions)[1]
    unique, at = np.unique(shards, return_index=True)
    return dict(zip(unique.tolist(), (positions[at]).tolist(), strict=True))


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(1, 30), min_size=1, max_size=60), window=st.integers(1, 300),
       unit=st.sampled_from(["samples", "shards"]), seed=st.integers(0, 100),
       count=st.integers(1, 12), where=st.floats(0, 0.99))
def test_the_first_answer_is_the_shards_with_the_nearest_next_uses(
        rows: list[int], window: int, unit: str, seed: int, count: int, where: float) -> None:
    order = EpochOrder(rows, seed, 1, ShuffleOptions(window=window, window_unit=unit))
    position = int(where * order.num_samples)
    shards, next_use = ShardAdvice(order, stride=1).upcoming(position, count)
    truth = _next_uses(order, position)
    expected = sorted(truth, key=lambda shard: (truth[shard], shard))[:count]
    assert shards.tolist() == expected
    assert next_use.tolist() == [truth[s] for s in expected]


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(1, 40), min_size=2, max_size=80), seed=st.integers(0, 50),
       count=st.integers(1, 10))
def test_later_answers_miss_no_shard_that_comes_sooner(rows: list[int], seed: int,
                                                       count: int) -> None:
    # As the cursor moves on, answers come from the horizon scanned before (shards begun
    # and not finished count as in use, next use now); no shard that is read sooner than
    # one that is given is ever left out.
    order = EpochOrder(rows, seed, 0, ShuffleOptions(window=50))
    advice = ShardAdvice(order, stride=1)
    for position in range(0, order.num_samples, max(1, order.num_samples // 15)):
        shards, next_use = advice.upcoming(position, count)
        truth = _next_uses(order, position)
        assert len(shards) >= min(count, len(truth))
        # each is still to be read, or in use (read a stride ago)
        assert set(shards.tolist()) <= set(_next_uses(order, max(0, position - 1)))
        assert (np.diff(next_use) >= 0).all() and (next_use >= position).all()
        latest = int(next_use.max())
        sooner = {s for s, use in truth.items() if use < latest}
        assert sooner <= set(shards.tolist())


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.integers(0, 40), min_size=1, max_size=40), seed=st.integers(0, 50),
       window=st.integers(1, 120), stride=st.integers(1, 6), count=st.integers(1, 10),
       steps=st.lists(st.integers(0, 40), min_size=1, max_size=40))
def test_an_answer_reused_for_later_positions_is_the_answer_computed_there(
        rows: list[int], seed: int, window: int, stride: int, count: int,
        steps: list[int]) -> None:
    # A step asks again at a later position; until a shard of the last answer is done with,
    # the last answer is handed out again (shards first read since then now in use). It must
    # be exactly what the same horizon computes at that position.
    if sum(rows) == 0:
        rows = [*rows, 1]
    order = EpochOrder(rows, seed, 0, ShuffleOptions(window=window))
    walked = ShardAdvice(order, stride=stride)
    computed = ShardAdvice(order, stride=stride)
    position = 0
    for step in steps:
        position = min(order.num_samples - 1, position + step)
        computed._last = None  # no reuse: the answer from its horizon at this position
        got, expected = walked.upcoming(position, count), computed.upcoming(position, count)
        assert got[0].tolist() == expected[0].tolist(), position
        assert got[1].tolist() == expected[1].tolist(), position


def test_advice_on_a_million_shards_scans_a_horizon_not_the_epoch(monkeypatch) -> None:
    rows = np.full(1_000_000, 1000, dtype=np.int64)
    rows.setflags(write=False)
    offsets = np.arange(0, 1_000_000_001, 1000, dtype=np.int64)
    counts = ShardCounts(rows, offsets, (np.array([1000]), np.array([1_000_000])))
    order = EpochOrder(counts, 7, 0)
    scanned = []
    original = order.samples_at

    def counted(positions):  # type: ignore[no-untyped-def]
        scanned.append(len(positions))
        return original(positions)

    monkeypatch.setattr(order, "samples_at", counted)
    advice = ShardAdvice(order)
    lookahead = advice.working_set_shards() + 16
    shards, _ = advice.upcoming(0, lookahead)
    assert len(shards) == lookahead
    assert sum(scanned) < 200_000  # a few windows at the stride, of 1e9 positions
    before = sum(scanned)
    for position in range(256, 100_000, 256):  # the steps that follow reuse the horizon
        advice.upcoming(position, lookahead)
    assert sum(scanned) == before


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(0, 60), min_size=1, max_size=20),
       window=st.integers(1, 200), unit=st.sampled_from(["samples", "shards"]),
       stagger=st.booleans(), enabled=st.booleans())
def test_the_shard_bound_is_the_byte_bound_with_one_unit_a_shard(
        rows: list[int], window: int, unit: str, stagger: bool, enabled: bool) -> None:
    shard_rows = np.array(rows, dtype=np.int64)
    shuffle = ShuffleOptions(enabled=enabled, window=window, window_unit=unit,
                             stagger=stagger)
    expected = working_set_bound(shard_rows, np.ones(len(rows), np.int64), shuffle)
    assert working_set_shards_bound(ShardCounts.of(shard_rows), shuffle) == expected


def test_an_order_without_counts_still_gets_advice(monkeypatch) -> None:
    class Plain:  # an order of another kind (a mixture's): rows, positions, no counts
        def __init__(self, order: EpochOrder) -> None:
            self.shard_rows = np.asarray(order.shard_rows)
            self.num_samples = order.num_samples
            self.num_shards = order.num_shards
            self._order = order

        def samples_at(self, positions):  # type: ignore[no-untyped-def]
            return self._order.samples_at(positions)

        def sample_ids_at(self, positions):  # type: ignore[no-untyped-def]
            return self._order.sample_ids_at(positions)

        def shard_of_ids(self, ids):  # type: ignore[no-untyped-def]
            return self._order.shard_of_ids(ids)

    order = EpochOrder([30, 20, 10, 40], 3, 0, ShuffleOptions(window=25))
    plain = ShardAdvice(Plain(order))
    assert plain.upcoming(5, 3)[0].tolist() == ShardAdvice(order).upcoming(5, 3)[0].tolist()
    assert plain.working_set_shards() >= 1


@pytest.mark.parametrize("chunk", [3, 1 << 15])
def test_horizon_scans_in_small_chunks_agree(monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(advice_module, "_HORIZON_CHUNK", chunk)
    order = EpochOrder(np.arange(1, 50), 9, 2, ShuffleOptions(window=40))
    truth = _next_uses(order, 100)
    shards, _ = ShardAdvice(order, stride=1).upcoming(100, 8)
    assert shards.tolist() == sorted(truth, key=lambda s: (truth[s], s))[:8]


def test_the_answer_kept_for_a_stride_is_the_answer_computed_again() -> None:
    order = EpochOrder(np.full(200, 640), 5, 0, ShuffleOptions(window=5000))
    advice = ShardAdvice(order)  # stride 10: the positions of a stride share their shards
    reused = 0
    for position in range(3000, 3400, 3):
        before = advice._last
        got = advice.upcoming(position, 30)
        reused += advice._last is before
        horizon = advice._horizon
        assert horizon is not None
        want = horizon.upcoming(position, 30, advice.stride)
        assert want is not None
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert reused > 50  # (most calls were answered from the kept answer)
