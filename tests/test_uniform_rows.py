"""Variable-width columns whose rows all have one length (sequences written with the
defaults: streamcache/format/reader.py's ``uniform_chunks``) are gathered with the fixed-width
gather: the batch is the one the offsets gather gives, for any mix of shards, lengths and
rows, on both backends; a batch over shards of other lengths, or of empty rows, takes the
offsets gather; rows outside their shards are refused as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamcache.errors import RowOutOfRangeError
from streamcache.format import reader as reader_module
from streamcache.format.columns import build_column
from streamcache.format.materialize import write_local_layout
from streamcache.format.reader import Ragged, ShardReader, gather
from streamcache.format.schema import Field, Schema

SCHEMA = Schema([Field.sequence("t", "int32"), Field.sequence("h", "float16"),
                 Field("b", "bytes"), Field.tensor("x", "int64")])


def _write(path: Path, first: int, rows: int, length: int | None) -> ShardReader:
    """A shard of ``rows`` rows whose variable-width fields hold ``length`` elements each
    (None: lengths 1, 2, 3, ... by row)."""
    lengths = [length if length is not None else 1 + i % 3 for i in range(rows)]
    ids = range(first, first + rows)
    columns = [
        build_column(SCHEMA["t"], [np.arange(n, dtype=np.int32) + i for i, n in zip(
            ids, lengths, strict=True)]),
        build_column(SCHEMA["h"], [np.full(n, i % 100, np.float16) for i, n in zip(
            ids, lengths, strict=True)]),
        build_column(SCHEMA["b"], [bytes([i % 256]) * n for i, n in zip(ids, lengths,
                                                                         strict=True)]),
        build_column(SCHEMA["x"], [np.int64(i) for i in ids]),
    ]
    write_local_layout(pa.RecordBatch.from_arrays(columns, schema=SCHEMA.arrow_schema()),
                       str(path))
    return ShardReader(str(path), SCHEMA, expected_rows=rows)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for name, value in a.items():
        other = b[name]
        if isinstance(value, Ragged):
            if not (np.array_equal(value.values, other.values)
                    and value.values.dtype == other.values.dtype
                    and np.array_equal(value.offsets, other.offsets)):
                return False
        elif not np.array_equal(value, other):
            return False
    return True


@pytest.mark.usefixtures("backend")
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shards=st.lists(st.tuples(st.integers(1, 30), st.sampled_from([0, 1, 4, 4, 4, None])),
                       min_size=1, max_size=4),
       picks=st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 31)), max_size=50))
def test_uniform_rows_gather_what_the_offsets_gather_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        shards: list[tuple[int, int | None]], picks: list[tuple[int, int]]) -> None:
    folder = tmp_path / f"case-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    readers, first = [], 0
    for n, (rows, length) in enumerate(shards):
        readers.append(_write(folder / f"s{n}.arrow", first, rows, length))
        first += rows
    try:
        which = np.array([s % len(readers) for s, _ in picks], dtype=np.int32)
        rows = np.array([r for _, r in picks], dtype=np.int64)
        valid = all(0 <= r < readers[s].num_rows for s, r in zip(which.tolist(),
                                                                 rows.tolist(), strict=True))
        if not valid:
            with pytest.raises(RowOutOfRangeError):
                gather(readers, which, rows, list(SCHEMA))
            return
        fast = gather(readers, which, rows, list(SCHEMA))
        with monkeypatch.context() as patch:
            patch.setattr(reader_module, "_uniform_batch", lambda shards, field: None)
            offsets = gather(readers, which, rows, list(SCHEMA))
        assert _same(fast, offsets)
    finally:
        for reader in readers:
            reader.close()


def _count_uniform(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    taken: list[bool] = []
    original = reader_module._uniform_batch

    def counting(shards: Any, field: Field) -> Any:
        found = original(shards, field)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(reader_module, "_uniform_batch", counting)
    return taken


def test_shards_of_one_length_take_the_fixed_gather(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    readers = [_write(tmp_path / "a.arrow", 0, 10, 4), _write(tmp_path / "b.arrow", 10, 10, 4)]
    taken = _count_uniform(monkeypatch)
    out = gather(readers, np.array([1, 0, 1], np.int32), np.array([9, 0, 3], np.int64),
                 [SCHEMA["t"], SCHEMA["b"]])
    assert taken == [True, True]
    assert [row.tolist() for row in out["t"].tolist()] == [list(range(19, 23)),
                                                           list(range(0, 4)),
                                                           list(range(13, 17))]
    assert out["b"].tolist() == [bytes([19]) * 4, b"\0" * 4, bytes([13]) * 4]
    for reader in readers:
        reader.close()


@pytest.mark.parametrize("lengths", [(4, 5), (4, None), (0, 0)])
def test_other_lengths_or_empty_rows_take_the_offsets_gather(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        lengths: tuple[int | None, int | None]) -> None:
    readers = [_write(tmp_path / f"{n}.arrow", 10 * n, 10, length)
               for n, length in enumerate(lengths)]
    taken = _count_uniform(monkeypatch)
    gather(readers, np.array([0, 1], np.int32), np.array([2, 2], np.int64), [SCHEMA["t"]])
    assert taken == [False]
    for reader in readers:
        reader.close()
