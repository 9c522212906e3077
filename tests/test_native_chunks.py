"""The gathers over columns of several record batches each (``*_chunks``): the chunks of
every column numbered one after another, read where they lie. The native core and its twin
against a plain loop, with columns of one chunk or many, and chunks of no rows."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import RowOutOfRangeError

# columns (shards) -> chunks (a shard has at least one) -> row lengths in elements (fixed:
# every row STRIDE bytes)
layouts = st.lists(st.lists(st.lists(st.integers(0, 5), max_size=6), min_size=1, max_size=7),
                   min_size=1, max_size=6)
STRIDE = 3


def _var_columns(layout: list[list[list[int]]], rng: np.random.Generator,
                 elem: int) -> tuple[list[_native.ColumnChunks], list[list[bytes]]]:
    columns, rows_of = [], []
    for chunks in layout:
        values, offsets = [], []
        for lengths in chunks:
            bounds = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(lengths, out=bounds[1:])
            data = rng.integers(0, 256, int(bounds[-1]) * elem, dtype=np.uint8)
            values.append(data)
            offsets.append(bounds)
            rows_of.append([data[b * elem:e * elem].tobytes()
                            for b, e in itertools.pairwise(bounds.tolist())])
        columns.append(_native.ColumnChunks(values, offsets))
    return columns, rows_of


def _picks(rows_of: list[list[bytes]], rng: np.random.Generator,
           count: int) -> tuple[np.ndarray, np.ndarray]:
    chunks = [k for k, rows in enumerate(rows_of) if rows]
    if not chunks:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    which = rng.choice(chunks, count).astype(np.int32)
    rows = np.array([rng.integers(0, len(rows_of[k])) for k in which], np.int64)
    return which, rows


@given(layout=layouts, count=st.integers(0, 30), elem=st.sampled_from([1, 4]),
       seed=st.integers(0, 2**32 - 1))
@settings(max_examples=80, deadline=None)
def test_var_and_bytes_gathers_over_chunks_read_the_rows_numbered(
        layout: list[list[list[int]]], count: int, elem: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    columns, rows_of = _var_columns(layout, rng, elem)
    which, rows = _picks(rows_of, rng, count)
    want = [rows_of[k][r] for k, r in zip(which.tolist(), rows.tolist(), strict=True)]
    for name in _native.available_backends():
        with _native.use(name):
            values, offsets = _native.gather_var_chunks(columns, elem, which, rows)
            assert values.tobytes() == b"".join(want), name
            assert (np.diff(offsets) * elem).tolist() == [len(w) for w in want], name
            if elem == 1:
                assert _native.gather_bytes_chunks(columns, which, rows) == want, name


@given(layout=layouts, count=st.integers(0, 30), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=80, deadline=None)
def test_the_fixed_gather_over_chunks_reads_the_rows_numbered(
        layout: list[list[list[int]]], count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    columns, rows_of = [], []
    for chunks in layout:
        values = [rng.integers(0, 256, len(lengths) * STRIDE, dtype=np.uint8)
                  for lengths in chunks]
        columns.append(_native.ColumnChunks(values))
        rows_of += [[v[i * STRIDE:(i + 1) * STRIDE].tobytes() for i in range(len(v) // STRIDE)]
                    for v in values]
    which, rows = _picks(rows_of, rng, count)
    want = b"".join(rows_of[k][r] for k, r in zip(which.tolist(), rows.tolist(), strict=True))
    for name in _native.available_backends():
        out = np.empty((len(rows), STRIDE), np.uint8)
        with _native.use(name):
            _native.gather_fixed_chunks(columns, STRIDE, which, rows, out)
        assert out.tobytes() == want, name


@pytest.mark.parametrize("which, row", [(5, 0), (-1, 0), (1, 2), (0, -1)])
def test_a_chunk_or_row_that_does_not_exist_is_refused_by_both(backend: str, which: int,
                                                               row: int) -> None:
    # chunks: column 0 holds chunks 0 (2 rows) and 1 (no rows), column 1 chunks 2 and 3
    columns, _ = _var_columns([[[1, 2], []], [[3], [1, 1]]], np.random.default_rng(0), 1)
    with pytest.raises(RowOutOfRangeError):
        _native.gather_var_chunks(columns, 1, np.array([which], np.int32),
                                  np.array([row], np.int64))
