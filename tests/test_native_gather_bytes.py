"""gather_bytes (one bytes object per row, copied once from the shard): the C++ core against
its twin and against slicing, and the same refusals as the other variable-width gathers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import CorruptDataError, NativeError, RowOutOfRangeError


def _sources(rng: np.random.Generator, lengths: list[list[int]],
             ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    values, offsets = [], []
    for shard in lengths:
        off = np.zeros(len(shard) + 1, np.int64)
        np.cumsum(shard, out=off[1:])
        offsets.append(off)
        values.append(rng.integers(0, 256, int(off[-1]), dtype=np.uint8))
    return values, offsets


@given(lengths=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=8), min_size=1,
                        max_size=4),
       picks=st.integers(0, 40), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_gather_bytes_native_equals_twin_and_slicing(lengths: list[list[int]], picks: int,
                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    values, offsets = _sources(rng, lengths)
    which = rng.integers(0, len(lengths), picks).astype(np.int32)
    rows = np.array([rng.integers(0, len(lengths[w])) for w in which], dtype=np.int64)
    expected = [values[w][offsets[w][r]:offsets[w][r + 1]].tobytes()
                for w, r in zip(which, rows, strict=True)]
    for name in _native.available_backends():
        with _native.use(name):
            got = _native.gather_bytes(values, offsets, which, rows)
        assert got == expected and all(type(row) is bytes for row in got), name


def test_a_large_batch_is_copied_by_the_pool_and_matches(backend: str) -> None:
    rng = np.random.default_rng(7)
    values, offsets = _sources(rng, [[100_000] * 40, [80_000 + i for i in range(30)]])
    which = rng.integers(0, 2, 64).astype(np.int32)
    rows = np.array([rng.integers(0, 40 if w == 0 else 30) for w in which], np.int64)
    got = _native.gather_bytes(values, offsets, which, rows)
    assert sum(map(len, got)) > 4 << 20  # over the size the native core copies in parallel
    assert got == [values[w][offsets[w][r]:offsets[w][r + 1]].tobytes()
                   for w, r in zip(which, rows, strict=True)]


def test_rows_and_shards_out_of_range_name_the_batch_item(backend: str) -> None:
    values, offsets = _sources(np.random.default_rng(1), [[3, 4], [5]])
    rows = np.array([0, 1], np.int64)
    with pytest.raises(RowOutOfRangeError, match="batch item 1 asks for shard 1 row 1"):
        _native.gather_bytes(values, offsets, np.array([0, 1], np.int32), rows)
    with pytest.raises(RowOutOfRangeError, match="batch item 0 names shard 2 of 2"):
        _native.gather_bytes(values, offsets, np.array([2, 0], np.int32), rows)


def test_corrupt_offsets_and_mismatched_arguments_are_refused(backend: str) -> None:
    values, offsets = _sources(np.random.default_rng(2), [[3, 4]])
    which, rows = np.zeros(2, np.int32), np.array([0, 1], np.int64)
    bad = [np.array([0, 3, 99], np.int64)]  # past the end of the values
    with pytest.raises(CorruptDataError, match="do not fit"):
        _native.gather_bytes(values, bad, which, rows)
    with pytest.raises(NativeError, match="which and rows differ in length"):
        _native.gather_bytes(values, offsets, which, rows[:1])
    with pytest.raises(NativeError, match="values and offsets lists differ in length"):
        _native.gather_bytes(values, offsets * 2, which, rows)
    with pytest.raises(NativeError, match="rows must have dtype int64"):
        _native.gather_bytes(values, offsets, which, rows.astype(np.int32))
