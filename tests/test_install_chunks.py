"""Installing a chunked shard chunk by chunk (format/chunk_install.py): a compressed Arrow file of
many record batches whose fields are canonical (ShardWriter's chunks) becomes, without a
shard-sized allocation, the very file the whole decode writes (one uncompressed canonical
batch, byte for byte); what a hostile or damaged file holds is refused with what is wrong,
leaving nothing behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import ShardWriter, load_index
from streamcache.errors import SchemaError, ShardCorruptError
from streamcache.format import chunk_install
from streamcache.format import materialize as materialize_module
from streamcache.format.columns import build_column
from streamcache.format.materialize import (
    decode_shard,
    materialize,
    recorded_copy_of,
    write_local_layout,
)
from streamcache.format.reader import ShardReader
from streamcache.format.schema import Field, Schema

SCHEMA = Schema([Field.tensor("x", "int64"), Field.sequence("t", "int32"), Field("s", "str"),
                 Field("b", "bytes"), Field.tensor("m", "float32", (2, 3)),
                 Field.tensor("c", "bool", (3,)), Field.sequence("r", "bool")])
#: fixed widths only: installed in one pass where the index gives the row count
FIXED = Schema([SCHEMA["x"], SCHEMA["m"], SCHEMA["c"]])


def rows(start: int, count: int) -> pa.RecordBatch:
    ids = np.arange(start, start + count, dtype=np.int64)
    return pa.RecordBatch.from_arrays([
        build_column(SCHEMA["x"], list(ids)),
        build_column(SCHEMA["t"], [np.arange(i % 5, dtype=np.int32) + i for i in ids]),
        build_column(SCHEMA["s"], [f"row {i} é" for i in ids]),
        build_column(SCHEMA["b"], [bytes([i % 256]) * (i % 7) for i in ids]),
        build_column(SCHEMA["m"], np.arange(count * 6, dtype=np.float32).reshape(count, 2, 3)),
        build_column(SCHEMA["c"], (np.arange(count * 3) % 3 == 0).reshape(count, 3)),
        build_column(SCHEMA["r"], [np.arange(i % 3) % 2 == 0 for i in ids]),  # (raw bytes)
    ], schema=SCHEMA.arrow_schema())


def whole_decode(data: bytes, schema: Schema, tmp: Path, copy_of: str | None) -> bytes:
    """The file the whole decode installs (decode_shard, then write_local_layout)."""
    write_local_layout(decode_shard(data, "arrow", schema, where="s"), str(tmp),
                       copy_of=copy_of)
    return tmp.read_bytes()


def write_file(path: Path, batches: list[pa.RecordBatch], schema: pa.Schema | None = None,
               compression: str | None = "zstd") -> bytes:
    with ipc.new_file(str(path), schema or SCHEMA.arrow_schema(),
                      options=ipc.IpcWriteOptions(compression=compression)) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return path.read_bytes()


def batches_of(path: Path) -> list[pa.RecordBatch]:
    with pa.memory_map(str(path)) as source:
        reader = ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]


def mapped_as_it_is(path: Path) -> bool:
    """Every buffer of every non-empty batch lies in the file's memory map (none was
    decompressed into memory)."""
    with pa.memory_map(str(path)) as source:
        source.seek(0)
        base = source.read_buffer(1).address
        end = base + source.size()
        reader = ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return all(buffer is None or base <= buffer.address < end
                   for batch in batches if batch.num_rows for column in batch.columns
                   for buffer in column.buffers() if buffer is None or buffer.size)


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 7), min_size=2, max_size=6),
       fixed_only=st.booleans(), rows_known=st.booleans(), as_path=st.booleans(),
       copy_of=st.sampled_from([None, "fp#3"]))
def test_a_chunked_shard_installs_as_the_whole_decodes_file_byte_for_byte(
        tmp_path_factory: pytest.TempPathFactory, counts: list[int], fixed_only: bool,
        rows_known: bool, as_path: bool, copy_of: str | None) -> None:
    folder = tmp_path_factory.mktemp("chunks")
    schema = FIXED if fixed_only else SCHEMA
    starts = np.cumsum([0, *counts[:-1]])
    batches = [rows(int(s), c).select(schema.names) for s, c in zip(starts, counts,
                                                                    strict=True)]
    data = write_file(folder / "stored", batches, schema.arrow_schema())
    reference = whole_decode(data, schema, folder / "reference", copy_of)
    source: bytes | str = str(folder / "stored") if as_path else data
    target = folder / "installed.arrow"
    total = int(sum(counts))
    # the chunk by chunk path, never the whole decode
    with mock.patch.object(materialize_module, "decode_shard", None):
        size = materialize(source, "arrow", schema, str(target), where="shard-0",
                           expected_rows=total if rows_known else None, copy_of=copy_of)
    assert size == target.stat().st_size
    assert target.read_bytes() == reference
    assert mapped_as_it_is(target)
    (installed,) = batches_of(target)
    assert installed.num_rows == total and recorded_copy_of(str(target)) == copy_of
    reader = ShardReader(str(target), schema, expected_rows=total, copy_of=copy_of)
    try:
        for i in np.random.default_rng(total).permutation(total)[:5].tolist():
            assert reader.row(i)["x"] == i
    finally:
        reader.close()
    assert sorted(os.listdir(folder)) == ["installed.arrow", "reference", "stored"]


def test_a_shard_of_shard_writer_at_the_defaults_installs_its_chunks_as_one_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ShardWriter(str(tmp_path / "ds"), chunk_size=4096) as writer:
        writer.write_batch(rows(0, 600))
    index = load_index(str(tmp_path / "ds"))
    info = index.shards[0]
    assert info.compression == "zstd" and info.chunk_rows is not None
    path = tmp_path / "ds" / info.path
    monkeypatch.setattr(materialize_module, "decode_shard", None)  # never decoded whole
    materialize(str(path), "arrow", index.schema, str(tmp_path / "one.arrow"), where="s",
                expected_rows=info.rows)
    with pa.memory_map(str(path)) as source:
        assert ipc.open_file(source).num_record_batches == -(-info.rows // info.chunk_rows) > 1
    (installed,) = batches_of(tmp_path / "one.arrow")
    assert installed.equals(rows(0, 600))


def test_fields_that_need_a_cast_are_cast_over_every_chunk(
        tmp_path: Path) -> None:
    """x stored as int32 (a checked cast to the schema's int64) and an extra column."""
    schema = pa.schema([("x", pa.int32()), ("extra", pa.float64())])
    batches = [pa.record_batch({"x": pa.array([1, 2], pa.int32()), "extra": [0.5, 1.5]},
                               schema=schema) for _ in range(3)]
    data = write_file(tmp_path / "stored", batches, schema)
    target = tmp_path / "installed.arrow"
    materialize(data, "arrow", Schema([Field.tensor("x", "int64")]), str(target), where="s")
    (batch,) = batches_of(target)
    assert batch.schema.names == ["x"] and batch.column(0).type == pa.int64()
    assert batch.column(0).to_pylist() == [1, 2] * 3


def test_an_extra_column_is_dropped_and_the_fields_come_in_the_schema_order(
        tmp_path: Path) -> None:
    base = rows(0, 4)
    names = ["m", "extra", "r", "s", "x", "c", "b", "t"]
    arrays = [pa.array([9] * 4, pa.int8()) if n == "extra" else base.column(n) for n in names]
    fields = [SCHEMA.arrow_schema().field(n) if n != "extra" else pa.field("extra", pa.int8())
              for n in names]
    batch = pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))
    data = write_file(tmp_path / "stored", [batch, batch], pa.schema(fields))
    materialize(data, "arrow", SCHEMA, str(tmp_path / "i.arrow"), where="s")
    (installed,) = batches_of(tmp_path / "i.arrow")
    assert installed.schema.names == SCHEMA.names
    assert installed.equals(pa.Table.from_batches([rows(0, 4)] * 2).combine_chunks()
                            .to_batches()[0])


# ------------------------------------------------------------------ hostile or damaged files


def test_a_null_in_a_later_chunk_is_refused_naming_the_column_and_leaves_nothing(
        tmp_path: Path) -> None:
    nullable = pa.schema([pa.field("x", pa.int64())])  # a foreign writer's nullable field
    batches = [pa.record_batch({"x": [1, 2]}, schema=nullable),
               pa.record_batch({"x": [3, None]}, schema=nullable)]
    data = write_file(tmp_path / "stored", batches, nullable)
    (tmp_path / "cache").mkdir()
    with pytest.raises(SchemaError, match="shard-4: column 'x' holds 1 nulls"):
        materialize(data, "arrow", Schema([Field.tensor("x", "int64")]),
                    str(tmp_path / "cache" / "s.arrow"), where="shard-4")
    assert os.listdir(tmp_path / "cache") == []


def test_a_row_count_other_than_the_index_is_refused_and_leaves_nothing(
        tmp_path: Path) -> None:
    data = write_file(tmp_path / "stored", [rows(0, 3), rows(3, 3)])
    (tmp_path / "cache").mkdir()
    with pytest.raises(ShardCorruptError, match="shard-2 holds 6 rows but the index says 7"):
        materialize(data, "arrow", SCHEMA, str(tmp_path / "cache" / "s.arrow"),
                    where="shard-2", expected_rows=7)
    assert os.listdir(tmp_path / "cache") == []


def test_offsets_that_go_backwards_in_one_chunk_are_refused_and_leave_nothing(
        tmp_path: Path) -> None:
    """A chunk whose list offsets go backwards (a writer's bug or a crafted file; reading IPC
    checks only the last one): the install checks every row's offsets."""
    schema = Schema([Field.sequence("t", "int32")])
    good = pa.record_batch([build_column(schema["t"], [np.arange(2, dtype=np.int32)] * 2)],
                           schema=schema.arrow_schema())
    values = pa.array(np.arange(4, dtype=np.int32))
    offsets = pa.py_buffer(np.array([0, 3, 1, 4], dtype=np.int64))
    bad_column = pa.Array.from_buffers(schema.arrow_schema().field("t").type, 3,
                                       [None, offsets], children=[values])
    bad = pa.RecordBatch.from_arrays([bad_column], schema=schema.arrow_schema())
    data = write_file(tmp_path / "stored", [good, bad, good], schema.arrow_schema())
    (tmp_path / "cache").mkdir()
    with pytest.raises(ShardCorruptError, match="shard-9 is not a readable arrow shard"):
        materialize(data, "arrow", schema, str(tmp_path / "cache" / "s.arrow"),
                    where="shard-9")
    assert os.listdir(tmp_path / "cache") == []


def test_a_truncated_chunked_shard_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    data = write_file(tmp_path / "stored", [rows(0, 50), rows(50, 50)])
    (tmp_path / "cache").mkdir()
    for cut in (len(data) // 2, len(data) - 3):
        with pytest.raises(ShardCorruptError, match="shard-1 is not a readable arrow shard"):
            materialize(data[:cut], "arrow", SCHEMA, str(tmp_path / "cache" / "s.arrow"),
                        where="shard-1")
    assert os.listdir(tmp_path / "cache") == []


def test_a_column_named_twice_is_refused(tmp_path: Path) -> None:
    twice = pa.schema([("x", pa.int64()), ("x", pa.int64())])
    batch = pa.RecordBatch.from_arrays([pa.array([1]), pa.array([2])], schema=twice)
    data = write_file(tmp_path / "stored", [batch, batch], twice)
    with pytest.raises(ShardCorruptError, match="names a column twice"):
        materialize(data, "arrow", Schema([Field.tensor("x", "int64")]),
                    str(tmp_path / "s.arrow"), where="shard-0")


@pytest.mark.parametrize("stored_rows", [5, 9])
def test_fixed_widths_installed_in_one_pass_refuse_a_row_count_other_than_the_index(
        tmp_path: Path, stored_rows: int) -> None:
    """Fixed widths with the index's row count are installed in one pass, the count checked
    as the chunks come: more rows than the index (never written past the layout) or fewer."""
    batches = [rows(0, 3).select(FIXED.names), rows(3, stored_rows - 3).select(FIXED.names)]
    data = write_file(tmp_path / "stored", batches, FIXED.arrow_schema())
    (tmp_path / "cache").mkdir()
    with pytest.raises(ShardCorruptError,
                       match=f"shard-5 holds {stored_rows} rows but the index says 7"):
        materialize(data, "arrow", FIXED, str(tmp_path / "cache" / "s.arrow"),
                    where="shard-5", expected_rows=7)
    assert os.listdir(tmp_path / "cache") == []


def test_a_shard_file_rewritten_between_the_two_passes_is_refused_and_leaves_nothing(
        tmp_path: Path) -> None:
    """Variable widths are read twice (offsets, then values). The source is immutable bytes or
    this process's own verified download, but a file rewritten in between is still never
    installed half old: a rewrite that moves the chunks fails to decode; one that keeps
    every chunk's size (strings one byte longer, inside the same padding) fails the check of
    the values' length."""
    schema = Schema([Field("s", "str")])

    def write(values: list[str]) -> None:
        batch = pa.RecordBatch.from_arrays([build_column(schema["s"], values)],
                                           schema=schema.arrow_schema())
        write_file(stored, [batch, batch], schema.arrow_schema(), compression=None)

    stored = tmp_path / "stored"
    layout = chunk_install._write_layout
    (tmp_path / "cache").mkdir()
    for rewritten, message in ((["much longer strings"] * 4, "not a readable arrow shard"),
                               (["aa", "b", "c", "d"], "changed between two reads")):
        write(["a", "b", "c", "d"])
        size = stored.stat().st_size

        def rewrite_then_layout(*args: Any, again: list[str] = rewritten, **kwargs: Any) -> Any:
            write(again)
            return layout(*args, **kwargs)

        with mock.patch.object(chunk_install, "_write_layout", rewrite_then_layout), \
                pytest.raises(ShardCorruptError, match=f"shard-3.*{message}"):
            materialize(str(stored), "arrow", schema, str(tmp_path / "cache" / "s.arrow"),
                        where="shard-3")
        assert os.listdir(tmp_path / "cache") == []
    assert stored.stat().st_size == size  # (the second rewrite kept every size)
