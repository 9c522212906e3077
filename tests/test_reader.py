"""Reading local shards (streamcache/format/reader.py): rows and batches gathered from several
shards match what was written, with the C++ core and its twin; Ragged batches; and shards
that are missing, truncated, of another layout or of the wrong row count are refused."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

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


def write_shard(path: Path, ids: range, schema: Schema = SCHEMA) -> str:
    rows = [sample(i) for i in ids]
    columns = []
    for field in schema:
        values = [r[field.name] for r in rows]
        if field.name == "x":
            values = [np.int64(v) for v in values]
        columns.append(build_column(field, values))
    write_local_layout(pa.RecordBatch.from_arrays(columns, schema=schema.arrow_schema()),
                       str(path))
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
    with pytest.raises(ShardCorruptError, match=r"2 record batches; .* materialize"):
        ShardReader(str(two), Schema([Field.tensor("x", "int64")]))
    foreign = tmp_path / "foreign.arrow"  # int32 where the schema says int64
    narrow = pa.RecordBatch.from_arrays([pa.array([1, 2], pa.int32())], names=["x"])
    with ipc.new_file(str(foreign), narrow.schema) as writer:
        writer.write_batch(narrow)
    with pytest.raises(SchemaError, match="not the canonical"):
        ShardReader(str(foreign), Schema([Field.tensor("x", "int64")]))
