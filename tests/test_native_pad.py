"""Padding a variable-width batch into a [B, L] matrix (``pad_rows``, and
``Ragged.to_padded`` over it): the native core and its twin against a plain loop, and what
each refuses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import NativeError
from streamcache.format.reader import Ragged

_PADS = {np.int8: -3, np.uint8: 7, np.int16: 0x0102, np.int32: -2, np.int64: 2**40 + 5,
         np.float32: 1.5, np.float64: -0.25}


def _expected(values: np.ndarray, offsets: np.ndarray, width: int, pad: object) -> np.ndarray:
    out = np.full((len(offsets) - 1, width), pad, dtype=values.dtype)
    for i in range(len(offsets) - 1):
        row = values[offsets[i]:offsets[i + 1]][:width]
        out[i, :len(row)] = row
    return out


@given(lengths=st.lists(st.integers(0, 12), max_size=40), extra=st.integers(-5, 4),
       dtype=st.sampled_from(sorted(_PADS, key=str)), lead=st.integers(0, 3),
       seed=st.integers(0, 2**32 - 1))
@settings(max_examples=120, deadline=None)
def test_pad_rows_is_a_loop_over_the_rows(lengths: list[int], extra: int, dtype: type,
                                          lead: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    offsets += lead  # values may hold elements before the batch's first row
    values = rng.integers(-100, 100, int(offsets[-1]) + 2).astype(dtype)
    width = max(0, max(lengths, default=0) + extra)
    want = _expected(values, offsets, width, _PADS[dtype])
    for name in _native.available_backends():
        out = np.empty((len(lengths), width), dtype)
        with _native.use(name):
            _native.pad_rows(values, offsets, width, _PADS[dtype], out)
        assert out.tobytes() == want.tobytes(), name


@given(rows=st.integers(0, 20), width=st.integers(0, 9), ragged=st.booleans(),
       max_length=st.sampled_from([None, 0, 3, 20]))
@settings(max_examples=60, deadline=None)
def test_to_padded_shares_the_values_only_when_asked_and_every_row_fits(
        rows: int, width: int, ragged: bool, max_length: int | None) -> None:
    lengths = np.full(rows, width, np.int64)
    if ragged and rows:
        lengths[0] = max(0, width - 1)
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.arange(int(offsets[-1]), dtype=np.int32)
    ragged_batch = Ragged(values, offsets)
    cut = int(lengths.max(initial=0)) if max_length is None else max_length
    want = _expected(values, offsets, cut, -1)
    copied, kept = ragged_batch.to_padded(-1, max_length)
    shared, kept_too = ragged_batch.to_padded(-1, max_length, share=True)
    assert copied.tolist() == want.tolist() == shared.tolist()
    assert kept.tolist() == kept_too.tolist() == np.minimum(lengths, cut).tolist()
    assert not np.shares_memory(copied, values)
    every_row_fits = bool((lengths == cut).all())
    assert np.shares_memory(shared, values) == (every_row_fits and rows > 0 and cut > 0)


def _call(**changes: object) -> None:
    arguments: dict[str, object] = {
        "values": np.arange(6, dtype=np.int32), "offsets": np.array([0, 2, 6], np.int64),
        "width": 4, "pad_value": 0, "out": np.empty((2, 4), np.int32)}
    arguments.update(changes)
    _native.pad_rows(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("changes, message", [
    ({"offsets": np.array([0, 4, 2], np.int64)}, r"offsets\[1:3\] = \[4, 2\] is not a "
                                                 "non-decreasing range"),
    ({"offsets": np.array([0, 2, 7], np.int64)}, r"inside the 6 elements of values"),
    ({"offsets": np.array([-1, 2, 6], np.int64)}, r"offsets\[0:2\] = \[-1, 2\]"),
    ({"offsets": np.array([0, 2, 6], np.int32)}, "offsets must have dtype int64"),
    ({"offsets": np.zeros(0, np.int64)}, "offsets must hold at least one entry"),
    ({"out": np.empty((2, 3), np.int32)}, "output holds 24 bytes, 2 rows of 4 elements"),
    ({"out": np.empty((3, 4), np.int32)}, "output holds 48 bytes"),
    ({"out": np.empty((2, 4), np.int64)}, "out must have dtype int32"),
    ({"out": np.empty((4, 2), np.int32).T}, "out must be C-contiguous"),
    ({"values": np.arange(12, dtype=np.int32)[::2]}, "values must be C-contiguous"),
    ({"width": -1, "out": np.empty((2, 0), np.int32)}, "width must not be negative"),
])
def test_pad_rows_refuses_what_it_cannot_fill_and_says_why(backend: str, changes: dict,
                                                           message: str) -> None:
    with pytest.raises(NativeError, match=message):
        _call(**changes)


def test_pad_rows_refuses_a_read_only_output(backend: str) -> None:
    out = np.empty((2, 4), np.int32)
    out.setflags(write=False)
    with pytest.raises(NativeError, match="out must be writable"):
        _call(out=out)


def test_a_pad_value_the_dtype_cannot_hold_is_refused_before_anything_is_written(
        backend: str) -> None:
    out = np.full((2, 4), 9, np.uint8)
    with pytest.raises(OverflowError):
        _call(values=np.arange(6, dtype=np.uint8), pad_value=-1, out=out)
    assert (out == 9).all()
