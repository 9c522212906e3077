"""What a hostile or careless input gives a mixture: saved states (of another mixture,
reordered, truncated, hostile numbers, wrong types, other versions), weights and repeats
(tiny, huge, NaN, inf, negative, bool, numpy types), source lists (empty, one, duplicates,
thousands) and the same dataset listed twice. Every case is the exact result or a clear
streamcache error (CursorMismatchError for a state, ConfigError for options), never a raw
Python error, a hang or a memory bomb."""

from __future__ import annotations

import copy
import json
import math
import time
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_helpers import make_dataset

from streamcache import ConfigError, CursorMismatchError, Source, StreamDataset, StreamLoader
from streamcache.plan import PlanError, ShuffleOptions
from streamcache.plan.mixture_cursor import MixtureCursor, SourceKey
from streamcache.plan.quota import Quota
from streamcache.plan.shares import MAX_PERIOD, _float_ratios, shares_of

SHUFFLE = ShuffleOptions(window=8)


# ---------------------------------------------------------------- saved states (pure)

def _keys(sizes: list[int]) -> tuple[SourceKey, ...]:
    return tuple(SourceKey(f"xxh64:{i:016x}", n, n) for i, n in enumerate(sizes))


def _cursor(infinite: bool = False) -> MixtureCursor:
    cursor = MixtureCursor.start(_keys([20, 12, 9]), (3, 2, 1), 4, SHUFFLE, infinite)
    return cursor.advanced(cursor.segment(6, 1), 2)


STATE = _cursor().to_dict()


def _edited(path: list[Any], value: Any) -> dict[str, Any]:
    state = copy.deepcopy(STATE)
    target: Any = state
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


HOSTILE = {
    "huge count": (["phases", 0, "counts", 0], 10**30),
    "count past int64": (["phases", 0, "counts", 1], 2**63),
    "negative count": (["phases", 0, "counts", 1], -1),
    "share 0": (["phases", 0, "shares", 0], 0),
    "shares past the period": (["phases", 0, "shares", 0], MAX_PERIOD),
    "huge share": (["phases", 0, "shares", 0], 10**12),
    "epoch_start past int64": (["epoch_start"], 2**63),
    "epoch 2**62": (["epoch"], 2**62),
    "epoch 2**70": (["epoch"], 2**70),
    "negative epoch": (["epoch"], -1),
    "num_samples 0": (["num_samples"], 0),
    "num_samples huge": (["num_samples"], 2**70),
    "num_samples not the epoch's": (["num_samples"], 31),
    "consumed past the epoch": (["samples_consumed"], 10**6),
    "negative seed": (["seed"], -1),
    "seed past 64 bits": (["seed"], 2**64),
    "bool for an int": (["epoch"], True),
    "float for an int": (["samples_consumed"], 12.0),
    "string for an int": (["epoch"], "0"),
    "NaN": (["num_samples"], math.nan),
    "epoch of a finite epoch's start": (["phases", 0, "counts"], [1, 0, 0]),
    "no phases": (["phases"], []),
    "phases not a list": (["phases"], {"start": 0}),
    "a phase with an extra key": (["phases", 0, "extra"], 1),
    "too many phases": (["phases"], [{"start": i, "counts": [0, 0, 0], "shares": [1, 1, 1]}
                                     for i in range(2000)]),
    "phases out of order": (["phases"], [{"start": 5, "counts": [0, 0, 0], "shares": [3, 2, 1]},
                                         {"start": 0, "counts": [0, 0, 0],
                                          "shares": [3, 2, 1]}]),
    "counts of another length": (["phases", 0, "counts"], [0, 0]),
    "no sources": (["sources"], []),
    "a source without its data": (["sources", 0, "data"], KeyError),
    "a source with an extra key": (["sources", 0, "url"], "s3://x"),
    "empty fingerprint": (["sources", 0, "dataset_fingerprint"], ""),
    "source of 0 samples": (["sources", 1, "num_samples"], 0),
    "data of a wrong type": (["sources", 0, "data"], "s3://b/ds"),
    "data with a bad location": (["sources", 0, "data"], {"location": 5, "index_created": 1.0}),
    "data with a huge location": (["sources", 0, "data"], {"location": "s3://" + "x" * 10**6,
                                                           "index_created": 1.0}),
    "data with NaN created": (["sources", 0, "data"], {"location": "x",
                                                       "index_created": math.nan}),
    "data with a bool created": (["sources", 0, "data"], {"location": "x",
                                                          "index_created": True}),
    "infinite not a bool": (["infinite"], 1),
    "shuffle malformed": (["shuffle"], {"window": 3}),
    "source cursors tampered": (["source_cursors"], [[0, 0], [0, 0], [0, 0]]),
    "version 3": (["version"], 3),
    "version 0": (["version"], 0),
    "version a bool": (["version"], True),
    "version a string": (["version"], "2"),
    "kind missing": (["kind"], KeyError),
    "a key missing": (["epoch"], KeyError),
    "a key added": (["step"], 4),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_or_broken_state_is_refused_quickly_and_clearly(case: str) -> None:
    path, value = HOSTILE[case]
    state = _edited(path, value)
    started = time.process_time()
    with pytest.raises(CursorMismatchError):
        MixtureCursor.load(json.loads(json.dumps(state)), _cursor())
    assert time.process_time() - started < 5, "no quota table of a hostile size is built"


@pytest.mark.parametrize("epoch", [2**62, 2**70, -1])
def test_an_infinite_mixtures_epoch_is_below_2_62(epoch: int) -> None:
    # (an infinite mixture's epoch is bound to no source count, so only its limit refuses it)
    state = _cursor(infinite=True).to_dict()
    state["epoch"] = epoch
    with pytest.raises(CursorMismatchError, match="epoch"):
        MixtureCursor.load(json.loads(json.dumps(state)), _cursor(infinite=True))
    state["epoch"] = 2**62 - 1
    cursor, _ = MixtureCursor.load(json.loads(json.dumps(state)), _cursor(infinite=True))
    assert cursor.epoch == 2**62 - 1


@pytest.mark.parametrize("state", [None, [], "state", 3, {"version": 2}, {"kind": "mixture"},
                                   {"version": 1, "dataset_fingerprint": "x"}])
def test_a_state_that_is_no_mixture_state_is_refused(state: Any) -> None:
    with pytest.raises(CursorMismatchError):
        MixtureCursor.load(state, _cursor())


def test_states_of_another_mixture_are_refused_naming_what_differs() -> None:
    other_data = MixtureCursor.start(_keys([20, 12, 10]), (3, 2, 1), 4, SHUFFLE, False)
    with pytest.raises(CursorMismatchError, match="source 2 num samples"):
        MixtureCursor.load(STATE, other_data)
    for change, match in (({"seed": 5}, "seed"), ({"infinite": True}, "infinite"),
                          ({"shuffle": ShuffleOptions(window=9)}, "shuffle")):
        current = MixtureCursor.start(_keys([20, 12, 9]), (3, 2, 1),
                                      change.get("seed", 4), change.get("shuffle", SHUFFLE),
                                      change.get("infinite", False))
        with pytest.raises(CursorMismatchError, match=str(match)):
            MixtureCursor.load(STATE, current)


def test_a_reordered_mixture_is_mapped_and_an_ambiguous_one_refused() -> None:
    keys = _keys([20, 12, 9])
    reordered = MixtureCursor.start((keys[2], keys[0], keys[1]), (1, 3, 2), 4, SHUFFLE, False)
    cursor, order = MixtureCursor.load(STATE, reordered)
    assert order == (1, 2, 0)  # saved source i is today's order[i]
    assert cursor.sources == keys and cursor.shares == (3, 2, 1)
    assert (cursor.epoch, cursor.samples_consumed) == (0, 12)
    # the same data listed twice, then listed in another order: which is which is unknown
    twice = (keys[0], keys[0], keys[1])
    saved = MixtureCursor.start(twice, (1, 2, 3), 4, SHUFFLE, True).to_dict()
    same = MixtureCursor.start(twice, (1, 2, 3), 4, SHUFFLE, True)
    assert MixtureCursor.load(saved, same)[1] == (0, 1, 2)  # as listed: accepted
    moved = MixtureCursor.start((keys[1], keys[0], keys[0]), (3, 1, 2), 4, SHUFFLE, True)
    with pytest.raises(CursorMismatchError, match="match no source, or more than one"):
        MixtureCursor.load(saved, moved)


# ---------------------------------------------------------------- weights and repeats

@pytest.mark.parametrize("weight", [0, -1, math.nan, math.inf, -math.inf, True, False,
                                    np.bool_(True), "0.5", None, Decimal("0.5"), [1]])
def test_a_weight_that_is_no_positive_finite_number_is_refused(weight: Any) -> None:
    with pytest.raises(ConfigError, match="weight"):
        Source("unused", weight=weight)


@pytest.mark.parametrize("weight", [1e301, 1e308, np.float64(1e308),
                                    pytest.param(10**400, id="10**400"),
                                    pytest.param(Fraction(10**400, 3), id="10**400/3")])
def test_a_weight_too_large_to_add_up_is_refused(weight: Any) -> None:
    # (two of 1e308 were an OverflowError summing the weights; 10**400 one converting it)
    with pytest.raises(ConfigError, match=r"weight must be a finite number in \(0, 1e\+300\]"):
        Source("unused", weight=weight)


@pytest.mark.parametrize("repeat", [0, -2.0, math.nan, math.inf, True, "2",
                                    pytest.param(10**400, id="10**400"), 1e301])
def test_a_repeat_that_is_no_positive_finite_number_is_refused(repeat: Any) -> None:
    with pytest.raises(ConfigError, match="repeat"):
        Source("unused", repeat=repeat)


def test_a_repeat_of_a_large_dataset_past_a_float_is_an_epoch_too_long() -> None:
    # 1e300 x 10**9 samples is inf as a float (was an OverflowError rounding it)
    with pytest.raises(ConfigError, match="more than a mixture counts"):
        Source("unused", repeat=1e300).epoch_samples(10**9)


def test_an_epoch_of_2_62_samples_is_refused_and_one_fewer_kept() -> None:
    # (positions stay below 2**62, so that the sum of two stays inside int64)
    with pytest.raises(ConfigError, match="more than a mixture counts"):
        Source("unused", samples=2**62).epoch_samples(10)
    with pytest.raises(ConfigError, match="more than a mixture counts"):
        Source("unused", repeat=2.0).epoch_samples(2**61)
    assert Source("unused", samples=2**62 - 1).epoch_samples(10) == 2**62 - 1


@pytest.mark.parametrize("path", [["epoch_start"], ["num_samples"], ["phases", 0, "start"],
                                  ["phases", 0, "counts", 0]])
def test_a_saved_position_or_count_of_2_62_is_refused(path: list[Any]) -> None:
    state = _cursor().to_dict()
    target: Any = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = 2**62
    with pytest.raises(CursorMismatchError, match=r"<= 4611686018427387903, got "
                                                  "4611686018427387904"):
        MixtureCursor.load(json.loads(json.dumps(state)), _cursor())


@pytest.mark.parametrize("samples", [0, -1, True, 2.5, "3", np.float64(3.0)])
def test_samples_that_are_no_positive_integer_are_refused(samples: Any) -> None:
    with pytest.raises(ConfigError, match="samples"):
        Source("unused", samples=samples)


def test_numpy_and_exact_weights_give_the_shares_of_their_values() -> None:
    assert shares_of([np.float32(0.75), np.int64(1), Fraction(1, 4)]) == (3, 4, 1)
    assert shares_of([np.float64(0.7), np.float64(0.2), np.float64(0.1)]) == (7, 2, 1)
    assert shares_of([1e300, 1e300]) == (1, 1)  # huge but equal: representable
    assert shares_of([1e-12, 3e-12]) == (1, 3)  # tiny but alike: representable
    assert shares_of([1, MAX_PERIOD - 1]) == (1, MAX_PERIOD - 1)


@pytest.mark.parametrize(("weights", "shares"), [
    ([1e308, 1e308], (1, 1)),  # their sum is past the largest float
    ([1.7e308, 0.85e308, 1.7e308], (2, 1, 2)),
    ([10**308, 10**308, 5 * 10**307], (2, 2, 1)),  # ints, whose float sum overflows too
])
def test_weights_whose_sum_passes_the_largest_float_give_their_shares(
        weights: list[Any], shares: tuple[int, ...]) -> None:
    assert shares_of(weights) == shares


@pytest.mark.parametrize("weights", [[1e308, 1e308, 1e-300], [1.7e308] * (MAX_PERIOD + 1)])
def test_a_weight_too_small_beside_huge_ones_is_refused_saying_what_to_do(
        weights: list[Any]) -> None:
    with pytest.raises(PlanError, match=r"at least .*or leave it out"):
        shares_of(weights)


@pytest.mark.parametrize("weights", [[10**400, 1], [Fraction(10**400, 3), 1],
                                     [Fraction(1, 10**400)]], ids=["int", "fraction", "tiny"])
def test_a_weight_no_float_can_hold_is_refused(weights: list[Any]) -> None:
    with pytest.raises(PlanError, match="a float can hold"):
        shares_of(weights)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=1e-150, max_value=1e150), min_size=1, max_size=40))
def test_float_ratios_are_the_weights_over_their_sum(weights: list[float]) -> None:
    """Scaling the weights before summing them (for sums past the largest float) leaves
    every ratio of ordinary weights as it was, to the last bit."""
    total = math.fsum(weights)
    assert _float_ratios([Fraction(w) for w in weights]) == [w / total for w in weights]


@pytest.mark.parametrize("weights", [[1.0, 1e-12], [1e300, 1.0], [1, MAX_PERIOD],
                                     [1.0] * (MAX_PERIOD + 1)])
def test_weights_no_share_can_represent_are_refused_saying_what_to_do(weights: list[Any],
                                                                      ) -> None:
    started = time.process_time()
    with pytest.raises(PlanError, match=r"at least .*or leave it out"):
        shares_of(weights)
    assert time.process_time() - started < 5


def test_thousands_of_unrelated_weights_make_exact_shares_fast() -> None:
    weights = np.random.default_rng(11).uniform(0.5, 1.5, 2000).tolist()
    started = time.process_time()
    shares = shares_of(weights)
    quota = Quota(shares)
    assert time.process_time() - started < 20  # was minutes (a 20,000-digit denominator)
    assert sum(shares) <= MAX_PERIOD and min(shares) >= 1
    total = sum(weights)
    for weight, share in zip(weights, shares, strict=True):  # within 1/MAX_PERIOD
        assert abs(weight / total - share / quota.period) < 1 / MAX_PERIOD
    n = quota.period // 3 + 17
    owner, _ = quota.at(np.arange(n))
    assert (quota.counts(n) == np.bincount(owner, minlength=len(shares))).all()


# ---------------------------------------------------------------- sources, with real shards

@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture-adversarial")
    return [make_dataset(str(root / f"s{i}"), rows) for i, rows in enumerate(([7, 6], [5]))]


def _loader(sources: list[Source], cache: Any, **options: Any) -> StreamLoader:
    options.setdefault("global_batch_size", 4)
    return StreamLoader(StreamDataset(sources, seed=2, shuffle_window=4, cache_dir=str(cache),
                                      **options))


def test_an_epoch_longer_than_a_mixture_counts_is_refused(urls, tmp_path):
    for source in (Source(urls[0], repeat=1e300), Source(urls[0], samples=10**30),
                   Source(urls[0], samples=10**400)):  # (10**400 was an OverflowError)
        with pytest.raises(ConfigError, match="more than a mixture counts"):
            _loader([source, Source(urls[1])], tmp_path)
    tiny = _loader([Source(urls[0], repeat=1e-300), Source(urls[1])], tmp_path,
                   global_batch_size=1)  # an epoch of 1 sample: the mixture's epoch ends there
    assert tiny.dataset.cursor.sources[0].epoch_samples == 1


def test_the_largest_weights_mix_and_larger_ones_are_a_config_error(urls, tmp_path):
    with _loader([Source(urls[0], weight=1e300), Source(urls[1], weight=1e300)],
                 tmp_path) as loader:
        assert loader.dataset.cursor.shares == (1, 1)
    with pytest.raises(ConfigError, match="weight"):  # (#33: a raw OverflowError)
        _loader([Source(urls[0], weight=1e308), Source(urls[1], weight=1e308)], tmp_path)


def test_a_tiny_weight_is_a_config_error_at_the_dataset(urls, tmp_path):
    with pytest.raises(ConfigError, match="source 1's weight 1e-12"):
        _loader([Source(urls[0], weight=1.0), Source(urls[1], weight=1e-12)], tmp_path)


@pytest.mark.parametrize("sources", [[], (), [None], ["s3://b/ds"], [Source], {"a": 1}])
def test_a_list_that_is_no_list_of_sources_is_refused(sources: Any, tmp_path) -> None:
    with pytest.raises(ConfigError):
        StreamDataset(sources, global_batch_size=4, cache_dir=str(tmp_path))


def test_one_source_is_read_whole_each_epoch(urls, tmp_path):
    loader = _loader([Source(urls[0])], tmp_path, global_batch_size=13)
    for _ in range(2):
        [batch] = list(loader)
        assert sorted(batch["__id__"].tolist()) == list(range(13))
        assert set(batch["__source__"].tolist()) == {0}


def test_the_same_dataset_listed_twice_reads_each_listing_once_per_its_epoch(urls, tmp_path):
    sources = [Source(urls[0], weight=1), Source(urls[0], weight=1), Source(urls[1], weight=2)]
    loader = _loader(sources, tmp_path, infinite=True)
    steps = []
    for batch in loader:
        steps.append(list(zip(batch["__source__"].tolist(), batch["__id__"].tolist(),
                              strict=True)))
        if len(steps) == 13:  # 52 positions: each listing of urls[0] reads 13 samples
            break
    read = [p for step in steps for p in step]
    first, second = ([i for s, i in read if s == k] for k in (0, 1))
    assert sorted(first) == sorted(second) == list(range(13))
    assert first != second  # two listings, two orders
    state = loader.state_dict()
    again = _loader(sources, tmp_path, infinite=True)
    again.load_state_dict(state)
    batch = next(iter(again))
    reference = _loader(sources, tmp_path, infinite=True)
    expected = [list(zip(b["__source__"].tolist(), b["__id__"].tolist(), strict=True))
                for _, b in zip(range(14), reference, strict=False)][13]
    assert list(zip(batch["__source__"].tolist(), batch["__id__"].tolist(),
                    strict=True)) == expected


def test_a_mixture_state_tampered_on_disk_is_refused_by_the_loader(urls, tmp_path):
    loader = _loader([Source(urls[0]), Source(urls[1])], tmp_path)
    next(iter(loader))
    state = loader.state_dict()
    for edit in (lambda c: c["phases"][0].update(shares=[10**9, 1]),
                 lambda c: c.update(num_samples=c["num_samples"] + 1),
                 lambda c: c["sources"].reverse(),
                 lambda c: c["sources"][0].update(num_samples=14)):
        bad = copy.deepcopy(state)
        edit(bad["cursor"])
        with pytest.raises(CursorMismatchError):
            _loader([Source(urls[0]), Source(urls[1])], tmp_path).load_state_dict(bad)
