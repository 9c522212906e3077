"""The lazy plan (no O(shards) table per epoch) gives exactly the order the eager one gave.

Saved states resume only if every release maps every position to the same sample, so the
lazy evaluation (the stream's starts found near the positions asked for, shard-sized
windows found by slot) is compared, position by position, with the eager oracle
(tests/helpers/eager_order.py), across group boundaries of the stream, empty shards, both
window units, stagger on and off, and resumes in the middle of an epoch.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.eager_order import EagerOrder
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.plan import EpochOrder, ShuffleOptions
from streamcache.plan import stream as stream_module
from streamcache.plan.shards import ShardCounts, fill_smallest


def _check_against_eager(rows: np.ndarray, seed: int, epoch: int,
                         shuffle: ShuffleOptions, probes: np.ndarray) -> None:
    order = EpochOrder(rows, seed, epoch, shuffle)
    eager = EagerOrder(rows, seed, epoch, shuffle)
    for got, want in zip(order.samples_at(probes), eager.samples_at(probes), strict=True):
        assert np.array_equal(got, want)
    whole = np.arange(order.num_samples, dtype=np.int64)
    for got, want in zip(order.samples(0, order.num_samples), eager.samples_at(whole),
                         strict=True):
        assert np.array_equal(got, want)
    ids = order.sample_ids(0, order.num_samples)
    assert np.array_equal(np.sort(ids), whole)  # a permutation of the epoch


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 9), min_size=1, max_size=40),
       window=st.integers(1, 60), unit=st.sampled_from(["samples", "shards"]),
       stagger=st.booleans(), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 3))
def test_the_lazy_order_is_the_eager_one(rows: list[int], window: int, unit: str,
                                         stagger: bool, seed: int, epoch: int) -> None:
    if sum(rows) == 0:
        rows[-1] = 1
    shard_rows = np.array(rows, dtype=np.int64)
    shuffle = ShuffleOptions(window=window, window_unit=unit, stagger=stagger)
    total = int(shard_rows.sum())
    probes = np.random.default_rng(seed % 1000).integers(0, total, 50)
    _check_against_eager(shard_rows, seed, epoch, shuffle, probes)


@pytest.mark.parametrize("unit, window", [("samples", 700), ("shards", 90), ("shards", 1),
                                          ("samples", 10**9)])
def test_many_groups_of_slots_with_empty_shards(monkeypatch, unit: str, window: int) -> None:
    monkeypatch.setattr(stream_module, "GROUP_BITS", 4)  # groups of 16 slots: many of them
    monkeypatch.setattr(stream_module, "GROUP", 16)
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 6, 2000)
    rows[rng.integers(0, 2000, 300)] = 0
    rows[100:160] = 0  # whole windows of empty shards (by shards)
    shuffle = ShuffleOptions(window=window, window_unit=unit)
    probes = rng.integers(0, int(rows.sum()), 400)
    _check_against_eager(rows, 5, 2, shuffle, probes)


def test_a_resume_in_the_middle_reads_no_table_of_every_shard(monkeypatch) -> None:
    # Positions far into the epoch are found first (as a resume does), then earlier ones.
    monkeypatch.setattr(stream_module, "_EXTEND_GROUPS", 2)
    monkeypatch.setattr(stream_module, "GROUP_BITS", 4)  # groups of 16 slots
    monkeypatch.setattr(stream_module, "GROUP", 16)
    rows = np.random.default_rng(3).integers(1, 50, 5000)
    order = EpochOrder(rows, 11, 1, ShuffleOptions(window=300))
    eager = EagerOrder(rows, 11, 1, ShuffleOptions(window=300))
    total = order.num_samples
    for start in (total - 500, total // 2, 10):
        positions = np.arange(start, start + 300, dtype=np.int64)
        assert np.array_equal(order.samples_at(positions)[0], eager.samples_at(positions)[0])
    stream = order._stream
    assert len(stream._spans) <= stream_module._SPANS_KEPT  # runs of slots, not all of them
    assert max(span.shards.size for span in stream._spans) <= 200  # of 5,000


def test_a_window_unit_of_shards_costs_no_pass_without_empty_shards(monkeypatch) -> None:
    calls = []
    original = stream_module.ShardStream.slot_shard

    def counted(self, slots):  # type: ignore[no-untyped-def]
        calls.append(len(slots))
        return original(self, slots)

    monkeypatch.setattr(stream_module.ShardStream, "slot_shard", counted)
    rows = np.full(100_000, 7, dtype=np.int64)
    order = EpochOrder(rows, 1, 0, ShuffleOptions(window=64, window_unit="shards"))
    order.samples(0, 5000)
    assert sum(calls) < 20_000  # the groups the first windows touch, not 100,000 slots


def test_counts_of_a_table_are_not_copied() -> None:
    rows = np.full(3000, 5, dtype=np.int64)
    rows.setflags(write=False)
    offsets = np.arange(0, 15001, 5, dtype=np.int64)
    counts = ShardCounts(rows, offsets, (np.array([5]), np.array([3000])))
    order = EpochOrder(counts, 0, 0)
    assert order.shard_rows is rows and order.shard_offsets is offsets
    assert order.num_samples == 15000


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.integers(0, 40), min_size=1, max_size=30), span=st.integers(0, 200))
def test_fill_smallest_is_the_greedy_fill_of_a_sort(rows: list[int], span: int) -> None:
    values = np.array(rows, dtype=np.int64)
    kept = np.sort(values[(values > 0) & (values <= span)])
    filled = np.cumsum(kept)
    taken = int(np.searchsorted(filled, span, side="right"))
    expected = (taken, int(filled[taken - 1]) if taken else 0,
                int(kept[taken]) if taken < kept.size else 0)
    assert fill_smallest(ShardCounts.of(values).histogram(), span) == expected
