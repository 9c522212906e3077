"""From a stored shard to the local layout (streamcache/format/materialize.py): every stored format
decodes to the same canonical batch, bad shards are refused with what is wrong, and a file
already in the local layout is recognized (and one that is not, is not)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from streamcache.errors import SchemaError, ShardCorruptError
from streamcache.format.columns import build_column
from streamcache.format.materialize import (
    decode_shard,
    is_local_layout,
    materialize,
    recorded_copy_of,
    restamp,
)
from streamcache.format.schema import Field, Schema

SCHEMA = Schema([Field.tensor("x", "int64"), Field.sequence("t", "int32"), Field("s", "str")])
ROWS = 5


def canonical() -> pa.RecordBatch:
    columns = [build_column(SCHEMA["x"], list(np.arange(ROWS, dtype=np.int64))),
               build_column(SCHEMA["t"], [np.arange(i, dtype=np.int32) for i in range(ROWS)]),
               build_column(SCHEMA["s"], [f"row {i}" for i in range(ROWS)])]
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA.arrow_schema())


def foreign_table() -> pa.Table:
    """The same rows as someone else writes them: plain types, an extra column."""
    return pa.table({"x": pa.array(range(ROWS), pa.int64()),
                     "t": pa.array([list(range(i)) for i in range(ROWS)], pa.list_(pa.int64())),
                     "s": pa.array([f"row {i}" for i in range(ROWS)]),
                     "extra": pa.array([0.5] * ROWS)})


def stored(fmt: str) -> bytes:
    sink = io.BytesIO()
    table = foreign_table()
    if fmt == "parquet":
        pq.write_table(table, sink)
    elif fmt == "arrow_stream":
        with ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        options = ipc.IpcWriteOptions(compression="zstd")
        with ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table, max_chunksize=2)  # several record batches
    return sink.getvalue()


@pytest.mark.parametrize("fmt", ["parquet", "arrow_stream", "arrow"])
@pytest.mark.parametrize("as_path", [False, True], ids=["bytes", "path"])
def test_every_stored_format_decodes_to_the_canonical_batch(fmt: str, as_path: bool,
                                                            tmp_path: Path) -> None:
    data: bytes | str = stored(fmt)
    if as_path:
        (tmp_path / "shard").write_bytes(data)  # type: ignore[arg-type]
        data = str(tmp_path / "shard")
    batch = decode_shard(data, fmt, SCHEMA, where="shard-0", expected_rows=ROWS)
    assert batch.equals(canonical())


def test_materialize_installs_a_mappable_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "local" / "shard.arrow"
    target.parent.mkdir()
    size = materialize(stored("arrow"), "arrow", SCHEMA, str(target), where="shard-0")
    assert size == target.stat().st_size
    assert os.listdir(target.parent) == ["shard.arrow"]
    assert is_local_layout(str(target), SCHEMA)
    with pa.memory_map(str(target)) as source:
        reader = ipc.open_file(source)
        assert reader.num_record_batches == 1 and reader.get_batch(0).equals(canonical())


def test_is_local_layout_only_for_files_mappable_as_they_are(tmp_path: Path) -> None:
    def write(name: str, batches: list[pa.RecordBatch], **options: object) -> str:
        path = str(tmp_path / name)
        with ipc.new_file(path, SCHEMA.arrow_schema(),
                          options=ipc.IpcWriteOptions(**options)) as writer:
            for batch in batches:
                writer.write_batch(batch)
        return path

    batch = canonical()
    assert is_local_layout(write("one.arrow", [batch]), SCHEMA)
    assert is_local_layout(write("empty.arrow", []), SCHEMA)
    # chunks (ShardWriter(compression=None)'s record batches) are read where they lie
    assert is_local_layout(write("two.arrow", [batch.slice(0, 2), batch.slice(2)]), SCHEMA)
    assert not is_local_layout(write("zstd.arrow", [batch], compression="zstd"), SCHEMA)
    assert not is_local_layout(write("zstd2.arrow", [batch.slice(0, 2), batch.slice(2)],
                                     compression="zstd"), SCHEMA)
    assert not is_local_layout(write("one.parquet", [batch]), SCHEMA)  # by its name
    assert not is_local_layout(write("one.ipc", [batch]),
                               Schema([Field.tensor("x", "int32")]))  # another type
    assert not is_local_layout(write("other.feather", [batch]),
                               Schema([Field("missing", "str")]))
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    assert not is_local_layout(str(tmp_path / "junk.arrow"), SCHEMA)
    assert not is_local_layout(str(tmp_path / "absent.arrow"), SCHEMA)


def test_bad_shards_are_refused_with_what_is_wrong() -> None:
    good = stored("arrow")
    with pytest.raises(ShardCorruptError, match="shard-7 is not a readable arrow shard"):
        decode_shard(good[:len(good) // 2], "arrow", SCHEMA, where="shard-7")
    with pytest.raises(ShardCorruptError, match="not a readable parquet shard"):
        decode_shard(b"garbage", "parquet", SCHEMA, where="shard-7")
    with pytest.raises(ShardCorruptError, match="holds 5 rows but the index says 6"):
        decode_shard(good, "arrow", SCHEMA, where="shard-7", expected_rows=6)
    wider = Schema([*SCHEMA, Field("label", "str")])
    with pytest.raises(SchemaError, match=r"shard-7 lacks the columns \['label'\]"):
        decode_shard(good, "arrow", wider, where="shard-7")
    with pytest.raises(SchemaError, match=r"shard-7 lacks the columns \['label'\]"):
        decode_shard(stored("parquet"), "parquet", wider, where="shard-7")  # not "corrupt"
    narrow = Schema([Field.tensor("x", "int8"), Field.sequence("t", "int32"), Field("s", "str")])
    with pytest.raises(SchemaError, match="shard-7: column 'x' of type int64 cannot be read"):
        decode_shard(good, "arrow", Schema([Field("x", "bytes")]), where="shard-7")
    # a narrower integer is a checked cast: the values 0..4 fit in int8
    assert decode_shard(good, "arrow", narrow, where="shard-7").column("x").type == pa.int8()


def test_restamp_keeps_every_chunk_of_an_uncompressed_chunked_file(tmp_path: Path) -> None:
    """A node's unit that is a whole shard stored uncompressed is installed as downloaded,
    then stamped with what it is a copy of: the stamp rewrote only the first record batch
    (of ~1,000 chunks), so the unit held the first chunk's rows."""
    batch = canonical()
    path = tmp_path / "unit.arrow"
    with ipc.new_file(str(path), SCHEMA.arrow_schema()) as writer:
        for part in (batch.slice(0, 2), batch.slice(2, 0), batch.slice(2)):
            writer.write_batch(part)
    restamp(str(path), "fp#12")
    assert recorded_copy_of(str(path)) == "fp#12"
    for _ in range(2):  # the second: already stamped, left as it is
        with pa.memory_map(str(path)) as source:
            reader = ipc.open_file(source)
            assert [reader.get_batch(i).num_rows for i in range(3)] == [2, 0, 3]
            assert reader.read_all().combine_chunks().to_batches()[0].equals(
                batch.replace_schema_metadata(reader.schema.metadata))
        restamp(str(path), "fp#12")
    assert os.listdir(tmp_path) == ["unit.arrow"]
