"""Reading local shards (streamcache/format/reader.py): rows and batches gathered from several
shards match what was written, with the C++ core and its twin; Ragged batches; and shards
that are missing, truncated, of another layout or of the wrong row count are refused."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamcache.errors import RowOutOfRangeError, SchemaError, ShardCorruptError
from streamcache.format.columns import build_column
from streamcache.format.materialize import write_local_layout
from streamcache.format.reader import Ragged, ShardReader, gather
from streamcache.format.schema import Field, Schema

SCHEMA = Schema([Field.tensor("x", "int64"), Field.tensor("img", "uint8", (2, 2)),
                 Field.sequence("t", "int32"), Field.sequence("z", "complex64"),
                 Field("b", "bytes"), Field("s", "str")])


def sample(i: int) -> dict:
    return {"x": i, "img": np.full((2, 2), i % 256, np.uint8),
            "t": np.arange(i % 4, dtype=np.int32) + i, "z": np.full(i % 3, i, np.complex64),
            "b": bytes([i % 256]) * (i % 5), "s": f"é{i}"}


def batch_of(ids: range, schema: Schema = SCHEMA) -> pa.RecordBatch:
    rows = [sample(i) for i in ids]
    columns = []
    for field in schema:
        values = [r[field.name] for r in rows]
        if field.name == "x":
            values = [np.int64(v) for v in values]
        columns.append(build_column(field, values))
    return pa.RecordBatch.from_arrays(columns, schema=schema.arrow_schema())


def write_shard(path: Path, ids: range, schema: Schema = SCHEMA) -> str:
    write_local_layout(batch_of(ids, schema), str(path))
    return str(path)


def assert_row(got: dict, i: int) -> None:
    want = sample(i)
    assert got["x"] == i and isinstance(got["x"], int)
    for name in ("img", "t", "z"):
        assert np.array_equal(got[name], want[name]) and got[name].dtype == want[name].dtype
    assert got["b"] == want["b"] and got["s"] == want["s"]


@pytest.mark.usefixtures("backend")
def test_rows_and_batches_from_several_shards(tmp_path: Path) -> None:
    with ShardReader(write_shard(tmp_path / "a.arrow", range(0, 7)), SCHEMA) as a, \
            ShardReader(write_shard(tmp_path / "b.arrow", range(7, 12)), SCHEMA,
                        expected_rows=5) as b:
        assert (a.num_rows, b.num_rows) == (7, 5)
        assert_row(a.row(3), 3)
        assert a.row(1, fields=["s"]) == {"s": "é1"}
        ids = [11, 0, 8, 8, 6]
        which = np.array([1 if i >= 7 else 0 for i in ids], np.int32)
        rows = np.array([i - 7 if i >= 7 else i for i in ids], np.int64)
        batch = gather([a, b], which, rows, list(SCHEMA))
    assert batch["x"].tolist() == ids and batch["img"].shape == (5, 2, 2)
    assert isinstance(batch["t"], Ragged) and batch["t"].lengths.tolist() == [i % 4 for i in ids]
    for position, i in enumerate(ids):
        assert_row({"x": int(batch["x"][position]),
                    **{name: batch[name][position] for name in ("img", "t", "z", "b", "s")}},
                   i)
    assert batch["s"].tolist() == [f"é{i}" for i in ids]


@pytest.mark.usefixtures("backend")
def test_rows_that_do_not_exist_are_refused(tmp_path: Path) -> None:
    with ShardReader(write_shard(tmp_path / "a.arrow", range(3)), SCHEMA) as a:
        for which, row in ((0, 3), (0, -1), (1, 0)):
            with pytest.raises(RowOutOfRangeError):
                gather([a], np.array([which], np.int32), np.array([row], np.int64),
                       [SCHEMA["x"], SCHEMA["t"]])


def test_ragged_rows_lists_and_padding() -> None:
    ragged = Ragged(np.arange(6, dtype=np.int32), np.array([0, 2, 2, 6]))
    assert len(ragged) == 3 and ragged.lengths.tolist() == [2, 0, 4]
    assert [row.tolist() for row in ragged] == [[0, 1], [], [2, 3, 4, 5]]
    padded, lengths = ragged.to_padded(pad_value=-1)
    assert padded.tolist() == [[0, 1, -1, -1], [-1] * 4, [2, 3, 4, 5]]
    assert lengths.tolist() == [2, 0, 4] and padded.dtype == np.int32
    cut, kept = ragged.to_padded(max_length=3)
    assert cut.tolist() == [[0, 1, 0], [0, 0, 0], [2, 3, 4]] and kept.tolist() == [2, 0, 3]
    assert Ragged(np.frombuffer(b"abc", np.uint8), np.array([0, 1, 3]), "bytes").tolist() \
        == [b"a", b"bc"]
    text = "é!".encode()
    assert Ragged(np.frombuffer(text, np.uint8), np.array([0, len(text)]), "str")[0] == "é!"
    empty, lengths = Ragged(np.empty(0, np.int32), np.zeros(1, np.int64)).to_padded()
    assert empty.shape == (0, 0) and lengths.size == 0


def test_a_shard_of_no_rows_reads_as_empty(tmp_path: Path) -> None:
    with ShardReader(write_shard(tmp_path / "e.arrow", range(0)), SCHEMA) as empty:
        assert empty.num_rows == 0
    path = tmp_path / "nobatch.arrow"
    with ipc.new_file(str(path), SCHEMA.arrow_schema()):
        pass  # a file with a schema and no record batch
    with ShardReader(str(path), SCHEMA, expected_rows=0) as reader:
        assert reader.num_rows == 0


def test_unlinking_an_open_shard_keeps_its_rows_readable(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "a.arrow", range(4))
    with ShardReader(path, SCHEMA) as reader:
        os.unlink(path)
        assert_row(reader.row(2), 2)


def test_bad_shards_are_refused_with_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ShardReader(str(tmp_path / "absent.arrow"), SCHEMA)
    good = Path(write_shard(tmp_path / "a.arrow", range(4)))
    truncated = tmp_path / "cut.arrow"
    truncated.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(ShardCorruptError, match=r"cut\.arrow is not a readable local shard"):
        ShardReader(str(truncated), SCHEMA)
    with pytest.raises(ShardCorruptError, match="holds 4 rows, the index says 5"):
        ShardReader(str(good), SCHEMA, expected_rows=5)
    with pytest.raises(SchemaError, match="has no column 'label'"):
        ShardReader(str(good), Schema([*SCHEMA, Field("label", "str")]))
    batch = pa.RecordBatch.from_arrays([pa.array([1, 2], pa.int64())], names=["x"])
    two = tmp_path / "two.arrow"
    with ipc.new_file(str(two), batch.schema) as writer:
        writer.write_batch(batch)
        writer.write_batch(batch)
    chunked = ShardReader(str(two), Schema([Field.tensor("x", "int64")]))  # read as chunks
    assert chunked.num_rows == 4 and [chunked.row(i)["x"] for i in range(4)] == [1, 2, 1, 2]
    chunked.close()
    foreign = tmp_path / "foreign.arrow"  # int32 where the schema says int64
    narrow = pa.RecordBatch.from_arrays([pa.array([1, 2], pa.int32())], names=["x"])
    with ipc.new_file(str(foreign), narrow.schema) as writer:
        writer.write_batch(narrow)
    with pytest.raises(SchemaError, match="not the canonical"):
        ShardReader(str(foreign), Schema([Field.tensor("x", "int64")]))


def _write_chunked(path: Path, ids: range, cuts: list[int]) -> str:
    """A shard of ``ids`` written as record batches cut at ``cuts`` (uncompressed)."""
    whole = batch_of(ids)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    with ipc.new_file(str(path), whole.schema) as writer:
        for start, stop in itertools.pairwise(bounds):
            writer.write_batch(whole.slice(start, stop - start))
    return str(path)


@pytest.mark.usefixtures("backend")
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layouts=st.lists(st.tuples(st.integers(1, 40),
                                  st.sampled_from(["fixed", "uneven", "one"]),
                                  st.integers(1, 9)), min_size=1, max_size=4),
       picks=st.lists(st.tuples(st.integers(0, 3), st.integers(-2, 45)), min_size=0, max_size=60))
def test_rows_gathered_from_chunked_shards_are_the_rows_written(
        tmp_path: Path, layouts: list[tuple[int, str, int]], picks: list[tuple[int, int]]) -> None:
    """Shards read where they lie as record batches (fixed row counts as ShardWriter cuts,
    uneven ones as foreign files have, or one batch), mixed in one gather: every row is the
    row written; a row outside its shard is a RowOutOfRangeError, never another row."""
    readers, first = [], 0
    for n, (rows, kind, step) in enumerate(layouts):
        cuts = (list(range(step, rows, step)) if kind == "fixed" else
                [step, step + 1, 3 * step] if kind == "uneven" else [])
        path = _write_chunked(tmp_path / f"c{n}-{len(os.listdir(tmp_path))}.arrow",
                              range(first, first + rows), cuts)
        readers.append((ShardReader(path, SCHEMA, expected_rows=rows), first, rows))
        first += rows
    try:
        which = np.array([s % len(readers) for s, _ in picks], dtype=np.int32)
        rows = np.array([r for _, r in picks], dtype=np.int64)
        valid = all(0 <= r < readers[s][2] for s, r in zip(which.tolist(), rows.tolist(),
                                                           strict=True))
        shards = [reader for reader, _, _ in readers]
        if not valid:
            with pytest.raises(RowOutOfRangeError):
                gather(shards, which, rows, list(SCHEMA))
            return
        out = gather(shards, which, rows, list(SCHEMA))
        for i, (s, r) in enumerate(zip(which.tolist(), rows.tolist(), strict=True)):
            assert_row({f.name: _row_of(out[f.name], i, f) for f in SCHEMA}, readers[s][1] + r)
    finally:
        for reader, _, _ in readers:
            reader.close()


def _row_of(column: object, i: int, field: Field) -> object:
    value = column[i]  # type: ignore[index]
    return value.item() if field.shape == () and isinstance(value, np.generic) else value
