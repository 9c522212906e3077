"""index.json: strict loading, and indexing Parquet / Arrow files written by others."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

import streamcache.format.index as index_module
from streamcache.errors import (
    ChecksumMismatchError,
    EmptyDatasetError,
    IndexFormatError,
    IndexNotFoundError,
    SchemaError,
    ShardCorruptError,
    SourceError,
)
from streamcache.format.index import build_index, load_index
from streamcache.format.writer import write_dataset
from streamcache.loading.dataset_reader import DatasetReader


def _table(start: int, n: int) -> pa.Table:
    ids = np.arange(start, start + n)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "tokens": pa.array([list(range(i % 7)) for i in ids], pa.list_(pa.int32())),
        "text": pa.array([f"row {i}" for i in ids]),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 3).astype(np.float32)), 3),
        "flag": pa.array(ids % 2 == 0),
        "blob": pa.array([bytes([i % 256]) * (i % 5) for i in ids], pa.binary()),
    })


def test_parquet_written_by_pyarrow_is_indexed_from_footers_and_read(backend: str,
                                                                     tmp_path) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    for k in range(3):  # several row groups per file, a codec of pyarrow's choosing
        pq.write_table(_table(k * 50, 50), folder / f"part-{k}.parquet", row_group_size=16)
    (folder / "_SUCCESS").write_text("")
    index = build_index(str(folder))
    assert index.num_samples == 150 and len(index.shards) == 3
    assert all(s.checksum is None and s.format == "parquet" for s in index.shards)
    kinds = {f.name: (f.kind, f.dtype, f.shape) for f in index.schema}
    assert kinds["tokens"] == ("sequence", "int32", ())
    assert kinds["vec"] == ("tensor", "float32", (3,))
    assert kinds["flag"] == ("tensor", "bool", ())
    assert kinds["text"] == ("str", None, ())
    with DatasetReader(str(folder), local_dir=str(tmp_path / "cache")) as reader:
        for i in (0, 49, 50, 149):
            row = reader[i]
            assert row["id"] == i and row["text"] == f"row {i}" and row["flag"] == (i % 2 == 0)
            assert row["tokens"].tolist() == list(range(i % 7))
            assert row["vec"].tolist() == [float(i)] * 3
            assert row["blob"] == bytes([i % 256]) * (i % 5)
        batch = reader.read_batch([149, 0, 75])
        assert batch["id"].tolist() == [149, 0, 75]


def test_hive_partitions_and_arrow_files(tmp_path) -> None:
    for year in (2023, 2024):
        part = tmp_path / "data" / f"year={year}"
        part.mkdir(parents=True)
        with ipc.new_file(part / "0.arrow", _table(year, 10).schema) as w:
            w.write_table(_table(year, 10), max_chunksize=4)  # several record batches
        (part / ".0.arrow.crc").write_bytes(b"x")
    index = build_index(str(tmp_path / "data"))
    assert [s.path for s in index.shards] == ["year=2023/0.arrow", "year=2024/0.arrow"]
    assert index.num_samples == 20
    with DatasetReader(str(tmp_path / "data"), local_dir=str(tmp_path / "c")) as reader:
        assert reader[10]["id"] == 2024


def test_glob_fields_and_checksums(tmp_path) -> None:
    for k in range(2):
        pq.write_table(_table(k * 5, 5), tmp_path / f"{k}.parquet")
    (tmp_path / "notes.txt").write_text("ignored")
    index = build_index(str(tmp_path / "*.parquet"), fields=["id", "text"], checksums=True,
                        output=str(tmp_path / "idx"))
    assert index.schema.names == ["id", "text"]
    assert all(s.checksum and s.checksum.startswith("xxh64:") for s in index.shards)
    with pytest.raises(IndexFormatError, match="allow_external_paths=True"):
        load_index(str(tmp_path / "idx"))  # its files lie outside its folder
    loaded = load_index(str(tmp_path / "idx"), allow_external_paths=True)
    assert loaded.fingerprint == index.fingerprint
    assert [s.path for s in loaded.shards] == [str(tmp_path / "0.parquet"),
                                               str(tmp_path / "1.parquet")]
    with DatasetReader(loaded) as reader:
        assert reader[7] == {"id": 7, "text": "row 7"}


def test_schema_mismatch_between_files_names_both(tmp_path) -> None:
    pq.write_table(pa.table({"x": pa.array([1, 2], pa.int64())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([1.0], pa.float32())}), tmp_path / "b.parquet")
    with pytest.raises(SchemaError, match=r"b\.parquet does not match the schema of .*a\.parquet"):
        build_index(str(tmp_path))


def test_unsupported_column_type(tmp_path) -> None:
    pq.write_table(pa.table({"s": pa.array([{"a": 1}])}), tmp_path / "a.parquet")
    with pytest.raises(SchemaError, match="column 's' has Arrow type struct"):
        build_index(str(tmp_path))
    pq.write_table(pa.table({"s": pa.array([{"a": 1}]), "x": [1]}), tmp_path / "a.parquet")
    assert build_index(str(tmp_path), fields=["x"]).schema.names == ["x"]


def test_nulls_are_refused_when_indexed(tmp_path, monkeypatch) -> None:
    # #27: the README says so; they were refused only at the first batch
    pq.write_table(pa.table({"x": pa.array([1, None, 3], pa.int64()), "y": [1, 2, 3]}),
                   tmp_path / "a.parquet")
    with pytest.raises(SchemaError, match=r"a\.parquet: column 'x' holds 1 nulls.*--fields"):
        build_index(str(tmp_path))
    assert not (tmp_path / "index.json").exists()
    assert build_index(str(tmp_path), fields=["y"]).num_samples == 3
    # an index written without the check (an older streamcache) is refused when read
    monkeypatch.setattr(index_module, "check_nulls", lambda *args: None)
    build_index(str(tmp_path))
    with DatasetReader(str(tmp_path), local_dir=str(tmp_path / "c")) as reader, pytest.raises(
        SchemaError, match="holds 1 nulls"
    ):
        reader[0]


@pytest.mark.parametrize("table, statistics, nulls", [
    ({"x": pa.array([1, None, 3], pa.int64())}, False, 1),  # no statistics: the column read
    ({"t": pa.array([[1], None, [2, 3]], pa.list_(pa.int32()))}, True, 1),
    ({"t": pa.array([[1], [None, 4], []], pa.list_(pa.int32()))}, True, 1),
    ({"t": pa.array([[1], [], [2, 3]], pa.list_(pa.int32()))}, True, 0),  # empty is no null
    ({"s": pa.array(["a", None, "c"])}, True, 1),
])
def test_nulls_the_footer_cannot_rule_out_are_counted(tmp_path, table: dict[str, Any],
                                                      statistics: bool, nulls: int) -> None:
    pq.write_table(pa.table(table), tmp_path / "a.parquet", write_statistics=statistics)
    if nulls:
        with pytest.raises(SchemaError, match=rf"holds {nulls} nulls"):
            build_index(str(tmp_path))
    else:
        assert build_index(str(tmp_path)).num_samples == 3


def test_nulls_in_arrow_files_are_refused_when_indexed(tmp_path) -> None:
    table = pa.table({"x": pa.array([1, 2, None], pa.int64())})
    with ipc.new_file(str(tmp_path / "a.arrow"), table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(SchemaError, match="column 'x' holds 1 nulls"):
        build_index(str(tmp_path))


def test_no_files_and_empty_files(tmp_path) -> None:
    with pytest.raises(SourceError, match="nothing at"):
        build_index(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no Parquet or Arrow IPC files"):
        build_index(str(tmp_path / "empty"))
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "empty" / "a.parquet")
    with pytest.raises(EmptyDatasetError, match="hold no rows"):
        build_index(str(tmp_path / "empty"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SourceError, match="not a readable parquet file"):
        build_index(str(tmp_path / "bad"))


@pytest.fixture
def dataset(tmp_path) -> str:
    dst = str(tmp_path / "ds")
    write_dataset(({"x": np.full(100, i, np.int64)} for i in range(40)), dst, shard_size=2000)
    return dst


def test_missing_index(tmp_path) -> None:
    with pytest.raises(IndexNotFoundError, match="streamcache index"):
        load_index(str(tmp_path))


def test_corrupt_index(dataset: str) -> None:
    path = os.path.join(dataset, "index.json")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(IndexFormatError, match="not valid JSON"):
        load_index(dataset)


def test_edited_index_fails_its_fingerprint(dataset: str) -> None:
    path = os.path.join(dataset, "index.json")
    obj = json.loads(Path(path).read_text())
    obj["shards"][0]["rows"] += 1
    Path(path).write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match="does not match its content"):
        load_index(dataset)


@pytest.mark.parametrize("version", [0, 3, "1", True])
def test_unknown_format_version(dataset: str, version: object) -> None:
    path = os.path.join(dataset, "index.json")
    obj = json.loads(Path(path).read_text())
    obj["version"] = version
    Path(path).write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match="upgrade streamcache or rebuild"):
        load_index(dataset)


def test_missing_key(dataset: str) -> None:
    path = os.path.join(dataset, "index.json")
    obj = json.loads(Path(path).read_text())
    del obj["schema"]
    Path(path).write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match="missing or has a malformed key"):
        load_index(dataset)


def test_truncated_shard(backend: str, dataset: str, tmp_path) -> None:
    shard = os.path.join(dataset, load_index(dataset).shards[1].path)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with DatasetReader(dataset, local_dir=str(tmp_path / "c")) as reader:
        assert reader[0]["x"][0] == 0  # other shards still read
        with pytest.raises(ShardCorruptError, match="truncated"):
            reader.read_batch(np.arange(40))


def test_wrong_checksum(dataset: str, tmp_path) -> None:
    shard = os.path.join(dataset, load_index(dataset).shards[0].path)
    data = bytearray(Path(shard).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(shard).write_bytes(bytes(data))
    with DatasetReader(dataset, local_dir=str(tmp_path / "c")) as reader, pytest.raises(
        ChecksumMismatchError, match="does not match the index"
    ):
        reader[0]


def test_memory_filesystem(tmp_path) -> None:
    write_dataset(({"x": i, "s": str(i)} for i in range(20)), "memory://idx-test/ds",
                  shard_size=64)
    index = load_index("memory://idx-test/ds")
    assert index.url.startswith("memory://") and index.url.endswith("idx-test/ds/index.json")
    with DatasetReader("memory://idx-test/ds", local_dir=str(tmp_path / "c")) as reader:
        assert reader[19] == {"x": 19, "s": "19"}
