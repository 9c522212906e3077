"""Tests of the epoch order (streamcache/plan/order.py and the bijections under it)."""

from __future__ import annotations

import itertools
import pickle
import threading
import tracemalloc

import numpy as np
import pytest
from helpers.eager_order import BoundaryWindows
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.errors import EmptyDatasetError, StreamcacheError
from streamcache.plan import (
    NO_SHUFFLE,
    EpochOrder,
    PlanError,
    PositionOutOfRangeError,
    ShuffleOptions,
    sample_seeds,
)
from streamcache.plan import order as order_module
from streamcache.plan.bijection import permute
from streamcache.plan.blocks import BLOCK
from streamcache.plan.windows import RegularWindows

shard_rows_st = st.lists(st.integers(0, 300), min_size=1, max_size=12).filter(any)
options_st = st.builds(
    ShuffleOptions,
    enabled=st.booleans(),
    window=st.integers(1, 700),
    window_unit=st.sampled_from(["samples", "shards"]),
    stagger=st.booleans(),
)
seed_st = st.integers(0, 2**64 - 1)
epoch_st = st.integers(0, 2**40)


def index_ids(rows: list[int]) -> np.ndarray:
    return np.arange(sum(rows), dtype=np.int64)


@settings(max_examples=300, deadline=None)
@given(rows=shard_rows_st, seed=seed_st, epoch=epoch_st, options=options_st)
def test_order_is_a_permutation_of_the_samples(
    rows: list[int], seed: int, epoch: int, options: ShuffleOptions
) -> None:
    order = EpochOrder(rows, seed, epoch, options)
    ids = order.sample_ids(0, order.num_samples)
    assert ids.dtype == np.int64
    assert np.array_equal(np.sort(ids), index_ids(rows))


@settings(max_examples=150, deadline=None)
@given(rows=shard_rows_st, seed=seed_st, options=options_st, data=st.data())
def test_every_access_path_gives_the_same_ids(
    rows: list[int], seed: int, options: ShuffleOptions, data: st.DataObject
) -> None:
    order = EpochOrder(rows, seed, 3, options)
    whole = order.sample_ids(0, order.num_samples)
    cuts = sorted(data.draw(st.lists(st.integers(0, order.num_samples), max_size=6)))
    bounds = [0, *cuts, order.num_samples]
    pieces = [order.sample_ids(a, b) for a, b in itertools.pairwise(bounds)]
    assert np.array_equal(np.concatenate(pieces), whole)
    probes = np.array(data.draw(st.lists(st.integers(0, order.num_samples - 1), max_size=20)),
                      dtype=np.int64)
    assert np.array_equal(order.sample_ids_at(probes), whole[probes])
    shards, row = order.locate(0, order.num_samples)
    assert np.array_equal(order.shard_offsets[shards] + row, whole)
    for ids, in_shards, in_rows in (order.samples(0, order.num_samples),
                                    order.samples_at(np.arange(order.num_samples))):
        assert np.array_equal(ids, whole)
        assert np.array_equal(in_shards, shards) and np.array_equal(in_rows, row)
    assert np.all(row < np.asarray(rows)[shards])
    assert np.array_equal(np.stack(order.shard_of_ids(whole)), np.stack([shards, row]))


def test_no_shuffle_is_index_order() -> None:
    order = EpochOrder([3, 0, 5, 2], seed=9, epoch=4, shuffle=NO_SHUFFLE)
    assert np.array_equal(order.sample_ids(0, 10), np.arange(10))
    shards, rows = order.locate(0, 10)
    assert shards.tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 3]
    assert rows.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]


def test_order_is_pinned_across_versions() -> None:
    # Known answers: a change here changes every saved cursor's meaning. Do not update these
    # numbers without bumping the cursor version.
    order = EpochOrder([100, 50, 0, 250, 1], seed=1234, epoch=7,
                       shuffle=ShuffleOptions(window=64))
    assert order.sample_ids(0, 12).tolist() == [
        132, 144, 6, 1, 113, 123, 119, 8, 142, 112, 137, 104]
    assert order.sample_ids(395, 401).tolist() == [385, 329, 324, 339, 395, 383]
    by_shards = EpochOrder([100, 50, 0, 250, 1, 7, 9], seed=99, epoch=0,
                           shuffle=ShuffleOptions(window=2, window_unit="shards"))
    assert by_shards.sample_ids(0, 4).tolist() == [321, 4, 232, 360]
    assert by_shards.sample_ids(413, 417).tolist() == [404, 403, 407, 401]
    assert sample_seeds(1234, 7, np.array([0, 1, 2**40])).tolist() == [
        18012817363071762220, 2786370469924164992, 6376247160387014944]
    assert permute(np.arange(8, dtype=np.int64), 8, 99).tolist() == [6, 4, 5, 3, 7, 1, 0, 2]


@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 50), total=st.integers(1, 400), stagger=st.booleans())
def test_regular_windows_tile_the_epoch(width: int, total: int, stagger: bool) -> None:
    windows = RegularWindows(width, 0, total)
    if stagger:
        windows = windows.staggered()
    index = windows.index(np.arange(total, dtype=np.int64))
    edges = windows.edges(0, windows.count - 1)
    assert edges[0] == 0 and edges[-1] == total and np.all(np.diff(edges) > 0)
    for window in range(windows.count):
        members = np.flatnonzero(index == window)
        assert members.tolist() == list(range(edges[window], edges[window + 1]))
        if 0 < window == windows.count - 1:
            assert members.size >= width // 2  # no sliver of a window at the end
    assert int(np.max(np.diff(edges))) == windows.largest
    middle = windows.count // 2
    assert np.array_equal(windows.edges(middle, middle), edges[middle:middle + 2])


def test_shard_windows_merge_a_short_last_window() -> None:
    starts = np.cumsum([0, 10, 10, 10, 10, 10, 10, 10])  # 7 shards
    windows = BoundaryWindows.of_shards(starts, 3)
    assert windows.bounds.tolist() == [0, 30, 70]
    assert BoundaryWindows.of_shards(starts, 4).bounds.tolist() == [0, 40, 70]


def test_order_depends_on_seed_and_epoch_only() -> None:
    rows = [1000] * 20
    base = EpochOrder(rows, 1, 0).sample_ids(0, 20000)
    assert np.array_equal(EpochOrder(rows, 1, 0).sample_ids(0, 20000), base)
    assert not np.array_equal(EpochOrder(rows, 2, 0).sample_ids(0, 20000), base)
    assert not np.array_equal(EpochOrder(rows, 1, 1).sample_ids(0, 20000), base)
    # A window at least as large as the dataset is one full shuffle, whatever its size.
    full = ShuffleOptions(window=10**9)
    assert np.array_equal(EpochOrder(rows, 1, 0, full).sample_ids(0, 20000),
                          EpochOrder(rows, 1, 0, ShuffleOptions(window=20000)).sample_ids(0, 20000))


def test_windows_bound_where_samples_come_from() -> None:
    rows = [10] * 40
    order = EpochOrder(rows, 5, 0, ShuffleOptions(window=4, window_unit="shards", stagger=False))
    shards, _ = order.locate(0, order.num_samples)
    for window in range(10):
        assert len(set(shards[window * 40:(window + 1) * 40].tolist())) == 4
    staggered = EpochOrder(rows, 5, 0, ShuffleOptions(window=4, window_unit="shards"))
    shards, _ = staggered.locate(0, staggered.num_samples)
    # The stagger mixes each half window with its neighbour: more shards per run, still local.
    spans = [len(set(shards[w * 40:(w + 1) * 40].tolist())) for w in range(10)]
    assert max(spans) <= 12 and np.mean(spans) > 4


def test_large_dataset_random_access_is_cheap() -> None:
    rows = np.full(10**6, 1000, dtype=np.int64)  # 1e9 samples
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        order = EpochOrder(rows, 42, 3)
        first = order.sample_ids(0, 1)
        last = order.sample_ids(order.num_samples - 1, order.num_samples)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # per-shard tables only (about 70 MB here); the permutation itself would be 8 GB
    assert peak_bytes < 1 << 30
    assert 0 <= first[0] < 10**9 and 0 <= last[0] < 10**9
    middle = order.sample_ids(5 * 10**8, 5 * 10**8 + 3 * BLOCK + 7)
    assert np.unique(middle).size == middle.size


def test_block_cache_paths_agree() -> None:
    rows = [977] * 300  # 293,100 samples: several blocks, windows that straddle them
    options = ShuffleOptions(window=30011)
    cached = EpochOrder(rows, 8, 2, options)
    uncached = EpochOrder(rows, 8, 2, options, cache_bytes=0)
    whole = uncached.sample_ids(0, uncached.num_samples)
    # probes (answered directly), then sequential steps (materialized blocks), then a scan
    for start in (5, 70000, 70001, 130000):
        assert np.array_equal(cached.sample_ids(start, start + 3), whole[start:start + 3])
    for start in range(60000, 200000, 1500):
        assert np.array_equal(cached.sample_ids(start, start + 1500), whole[start:start + 1500])
    assert np.array_equal(cached.sample_ids(0, cached.num_samples), whole)


def test_shard_first_use_is_the_order_of_first_reads() -> None:
    rows = [7, 0, 13, 1, 30, 0, 9]
    order = EpochOrder(rows, 3, 1, ShuffleOptions(window=5))
    shards, _ = order.locate(0, order.num_samples)
    for start, stop in [(0, order.num_samples), (17, 41), (59, 60), (12, 12)]:
        found, positions = order.shard_first_use(start, stop)
        expected: dict[int, int] = {}
        for offset, shard in enumerate(shards[start:stop].tolist()):
            expected.setdefault(shard, start + offset)
        assert found.tolist() == list(expected)
        assert positions.tolist() == list(expected.values())
    assert set(order.shard_first_use(0, order.num_samples)[0].tolist()) == {0, 2, 3, 4, 6}


def test_shard_first_use_across_scan_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    order = EpochOrder([7, 0, 13, 1, 30, 0, 9], 3, 1, ShuffleOptions(window=5))
    whole = order.shard_first_use(3, 55)
    monkeypatch.setattr(order_module, "_CHUNK", 4)
    chunked = order.shard_first_use(3, 55)
    assert np.array_equal(np.stack(whole), np.stack(chunked))


def test_sample_seeds_are_per_sample_and_reproducible() -> None:
    ids = np.array([5, 3, 5, 0], dtype=np.int64)
    seeds = sample_seeds(11, 2, ids)
    assert seeds.dtype == np.uint64
    assert seeds[0] == seeds[2] and len(set(seeds.tolist())) == 3
    assert np.array_equal(sample_seeds(11, 2, ids[::-1])[::-1], seeds)
    assert not np.array_equal(sample_seeds(11, 3, ids), seeds)
    assert not np.array_equal(sample_seeds(12, 2, ids), seeds)
    assert sample_seeds(1, 1, np.zeros((2, 0), dtype=np.int64)).shape == (2, 0)
    with pytest.raises(PlanError):
        sample_seeds(1, 1, np.array([-1]))
    with pytest.raises(PlanError):
        sample_seeds(-1, 1, np.array([1]))


@pytest.mark.parametrize("rows", [[], [0], [0, 0, 0]])
def test_an_empty_dataset_is_refused(rows: list[int]) -> None:
    with pytest.raises(EmptyDatasetError):
        EpochOrder(rows, 0, 0)


def test_empty_shards_hold_no_positions() -> None:
    order = EpochOrder([0, 4, 0, 0, 2, 0], 1, 0, ShuffleOptions(window=1, window_unit="shards"))
    shards, _ = order.locate(0, 6)
    assert sorted(set(shards.tolist())) == [1, 4]


@pytest.mark.parametrize(
    ("start", "stop"),
    [(-1, 3), (0, 11), (5, 4), (2**70, 2**70 + 1), (0.0, 1)],
)
def test_positions_outside_the_epoch_are_refused(start: object, stop: object) -> None:
    order = EpochOrder([4, 6], 0, 0)
    with pytest.raises(PlanError):
        order.sample_ids(start, stop)  # type: ignore[arg-type]


def test_out_of_range_positions_raise_index_errors() -> None:
    order = EpochOrder([4, 6], 0, 0)
    for bad in ([10], [-1], [0, 2**62]):
        with pytest.raises(PositionOutOfRangeError) as info:
            order.sample_ids_at(np.array(bad))
        assert isinstance(info.value, IndexError) and isinstance(info.value, StreamcacheError)
    with pytest.raises(PlanError):
        order.sample_ids_at(np.array([0.5]))
    with pytest.raises(PositionOutOfRangeError):
        order.shard_of_ids(np.array([10]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": -1},
        {"seed": 2**64},
        {"seed": True},
        {"seed": 1.5},
        {"epoch": -1},
        {"shard_rows": [3, -1]},
        {"shard_rows": [1.5]},
        {"shard_rows": [[1, 2]]},
        {"shuffle": "yes"},
    ],
)
def test_bad_order_arguments_are_refused(kwargs: dict[str, object]) -> None:
    arguments: dict[str, object] = {"shard_rows": [3, 4], "seed": 0, "epoch": 0}
    arguments.update(kwargs)
    with pytest.raises(PlanError):
        EpochOrder(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 0}, {"window": -3}, {"window": True}, {"window_unit": "bytes"},
     {"enabled": 1}, {"stagger": None}],
)
def test_bad_shuffle_options_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(PlanError):
        ShuffleOptions(**kwargs)  # type: ignore[arg-type]


def test_a_window_beyond_32_bits_is_refused() -> None:
    with pytest.raises(PlanError, match="window"):
        EpochOrder([2**33], 0, 0, ShuffleOptions(window=2**33))


def test_shuffle_options_round_trip_strictly() -> None:
    options = ShuffleOptions(window=3, window_unit="shards", stagger=False)
    assert ShuffleOptions.from_dict(options.to_dict()) == options
    with pytest.raises(PlanError):
        ShuffleOptions.from_dict({**options.to_dict(), "extra": 1})
    with pytest.raises(PlanError):
        ShuffleOptions.from_dict({"window": 3})


@pytest.mark.parametrize("options", [ShuffleOptions(window=97), NO_SHUFFLE])
def test_skewed_shard_sizes_locate_correctly(options: ShuffleOptions) -> None:
    # Many tiny and empty shards beside huge ones: the slot lookup's binary-search fallback.
    rows = [5000] + [1] * 50 + [0] * 10 + [3] * 20 + [5000, 0, 2]
    order = EpochOrder(rows, 4, 0, options)
    ids = order.sample_ids(0, order.num_samples)
    shards, row = order.locate(0, order.num_samples)
    assert np.array_equal(np.stack(order.shard_of_ids(ids)), np.stack([shards, row]))
    assert np.array_equal(np.sort(ids), np.arange(order.num_samples))


def test_one_order_serves_several_threads() -> None:
    rows = [977] * 300
    shared = EpochOrder(rows, 8, 2, ShuffleOptions(window=30011), cache_bytes=4 << 20)
    expected = EpochOrder(rows, 8, 2, ShuffleOptions(window=30011), cache_bytes=0)
    failures: list[str] = []

    def read(offset: int) -> None:
        for start in range(offset, shared.num_samples - 2000, 7919):
            if not np.array_equal(shared.sample_ids(start, start + 2000),
                                  expected.sample_ids(start, start + 2000)):
                failures.append(f"ids at {start}")

    threads = [threading.Thread(target=read, args=(offset,)) for offset in range(0, 4000, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []


def test_an_order_pickles_as_its_arguments() -> None:
    order = EpochOrder([30, 0, 45], 6, 1, ShuffleOptions(window=8), cache_bytes=1 << 21)
    order.sample_ids(0, 75)
    copy = pickle.loads(pickle.dumps(order))
    assert np.array_equal(copy.sample_ids(0, 75), order.sample_ids(0, 75))
    assert (copy.seed, copy.epoch, copy.shuffle) == (6, 1, ShuffleOptions(window=8))


@pytest.mark.parametrize("size", [100, 1000, 5000])
def test_window_permutations_look_uniformly_random(size: int) -> None:
    # Over many keys, the correlation of position and original index of a uniformly random
    # permutation has mean 0 and standard deviation 1/sqrt(n-1); four Feistel rounds gave a
    # spread 20-30% too wide, six match within a few percent.
    points = np.arange(size, dtype=np.int64)
    correlations = [np.corrcoef(points, permute(points, size, key * 7919 + 1))[0, 1]
                    for key in range(300)]
    expected = 1 / np.sqrt(size - 1)
    assert abs(float(np.mean(correlations))) < 3 * expected / np.sqrt(300)
    assert 0.85 * expected < float(np.std(correlations)) < 1.15 * expected
