"""Where a batch's rows lie in chunked shards (``_native.locate_chunks``, csrc/gather.cpp; its
numpy twin in streamcache/_twin_chunks.py): the native kernel gives the twin's places for any
shards and rows, rows outside their shards stay in their own shard's first or last chunk, and
inputs no reader makes are refused with a message."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import NativeError, RowOutOfRangeError


def _locate(backend: str, counts: list[int], fixed: list[int], which: list[int],
            rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    with _native.use(backend):
        return _native.locate_chunks(np.array(counts, dtype=np.int64),
                                     np.array(fixed, dtype=np.int64),
                                     np.array(which, dtype=np.int32),
                                     np.array(rows, dtype=np.int64))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shards=st.integers(1, 8), n=st.integers(0, 64))
def test_native_places_are_the_twins(data: st.DataObject, shards: int, n: int) -> None:
    counts = data.draw(st.lists(st.integers(1, 50), min_size=shards, max_size=shards))
    fixed = data.draw(st.lists(st.sampled_from([1, 3, 64, 1000, 1 << 62]), min_size=shards,
                               max_size=shards))
    which = data.draw(st.lists(st.integers(0, shards - 1), min_size=n, max_size=n))
    rows = data.draw(st.lists(st.integers(-5, 60_000), min_size=n, max_size=n))
    results = [_locate(b, counts, fixed, which, rows) for b in _native.available_backends()]
    for flat, local in results[1:]:
        assert np.array_equal(flat, results[0][0]) and np.array_equal(local, results[0][1])
    flat, local = results[0]
    base = np.concatenate(([0], np.cumsum(counts)[:-1]))
    for i, (k, row) in enumerate(zip(which, rows, strict=True)):
        chunk = int(flat[i]) - int(base[k])
        assert 0 <= chunk < counts[k]  # never another shard's chunk
        if 0 <= row < counts[k] * fixed[k]:
            assert (chunk, int(local[i])) == (row // fixed[k], row % fixed[k])
        else:  # outside the shard: outside its chunk's rows too, so the gather refuses it
            assert not 0 <= int(local[i]) < fixed[k] or row < 0


@pytest.mark.parametrize("counts, fixed, which, rows, error, message", [
    ([2], [10], [1], [0], RowOutOfRangeError, "names shard 1 of 1"),
    ([2], [10], [-1], [0], RowOutOfRangeError, "names shard -1 of 1"),
    ([0], [10], [0], [0], NativeError, "at least 1"),
    ([2], [0], [0], [0], NativeError, "at least 1"),
    ([1 << 30, 1 << 30], [1, 1], [0], [0], NativeError, "2\\*\\*31 - 1 chunks"),
])
def test_what_no_reader_makes_is_refused(backend: str, counts: list[int], fixed: list[int],
                                         which: list[int], rows: list[int],
                                         error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        _locate(backend, counts, fixed, which, rows)


def test_arrays_of_the_wrong_kind_or_length_are_refused(backend: str) -> None:
    counts, fixed = np.array([2], dtype=np.int64), np.array([4], dtype=np.int64)
    which, rows = np.zeros(3, dtype=np.int32), np.arange(3, dtype=np.int64)
    with pytest.raises(NativeError, match="one entry per shard"):
        _native.locate_chunks(counts, np.array([4, 4], dtype=np.int64), which, rows)
    with pytest.raises(NativeError, match="one per batch item"):
        _native.locate_chunks(counts, fixed, which, rows[:2])
    flat, local = _native.locate_chunks(counts, fixed, which[:0], rows[:0])
    assert flat.size == local.size == 0


@pytest.mark.skipif("native" not in _native.available_backends(), reason="no extension")
def test_the_native_kernel_refuses_arrays_it_does_not_convert() -> None:
    with _native.use("native"), pytest.raises(NativeError):
        _native.locate_chunks(np.array([2], dtype=np.int64), np.array([4], dtype=np.int64),
                              np.zeros(3, dtype=np.int64), np.arange(3, dtype=np.int64))
