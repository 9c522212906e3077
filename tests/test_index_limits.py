"""index.json as untrusted input: every field checked, caps on size and depth, and a shard
table that scales (a Parquet side file for large indexes, columns in memory)."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamcache.format.index as index_module
import streamcache.format.index_format as index_format
from streamcache.errors import IndexFormatError
from streamcache.format.checksum import checksum_bytes
from streamcache.format.index import build_index, load_index, parse_index
from streamcache.format.shard_entry import ShardInfo
from streamcache.format.shard_table import ShardTable
from streamcache.format.side_table import decode_side_table
from streamcache.format.table_layout import memory_writer, open_memory
from streamcache.format.writer import write_dataset
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.dataset_reader import DatasetReader
from streamcache.loading.loader import StreamLoader


def _fingerprint_v1(obj: dict[str, Any]) -> str:
    """The fingerprint a version-1 index records (computed here, independently of the code)."""
    content = {"version": 1, "schema": obj["schema"],
               "shards": [[s["path"], s["format"], s["rows"], s["bytes"], s["checksum"]]
                          for s in obj["shards"]]}
    return checksum_bytes(json.dumps(content, sort_keys=True).encode())


def rewrite_index(folder: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a dataset's index.json and record a matching fingerprint (as an attacker would)."""
    path = Path(folder) / "index.json"
    obj = json.loads(path.read_text())
    edit(obj)
    obj["fingerprint"] = _fingerprint_v1(obj)
    path.write_text(json.dumps(obj))


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    dst = str(tmp_path / "ds")
    write_dataset(({"x": np.full(10, i, np.int64)} for i in range(40)), dst, shard_size=800)
    return dst


def _set_shard(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(obj: dict[str, Any]) -> None:
        obj["shards"][0][key] = value
    return edit


@pytest.mark.parametrize("key, value, message", [
    ("rows", 2**64, r"rows=18446744073709551616; it must be an integer in \[0, 2\*\*63\)"),
    ("rows", 2**63, r"rows=9223372036854775808; it must be an integer in \[0, 2\*\*63\)"),
    ("rows", -1, r"rows=-1; it must be an integer"),
    ("rows", "5", r"rows='5'; it must be an integer"),
    ("rows", 5.0, r"rows=5.0; it must be an integer"),
    ("rows", True, r"rows=True; it must be an integer"),
    ("bytes", 2**64, r"bytes=18446744073709551616; it must be an integer"),
    ("raw_bytes", -3, r"raw_bytes=-3; it must be an integer"),
    ("checksum", "md5:abc", r"checksum 'md5:abc'; expected 'xxh64:' and 16 hex digits"),
    ("checksum", 7, r"checksum 7; expected 'xxh64:'"),
    ("format", "zip", r"unknown format 'zip'"),
    ("path", 12, r"shard path 12 is not a non-empty string"),
    ("path", "", r"shard path '' is not a non-empty string"),
    ("compression", ["zstd"], r"malformed compression"),
])
def test_every_shard_field_is_checked(dataset: str, key: str, value: Any, message: str) -> None:
    rewrite_index(dataset, _set_shard(key, value))
    with pytest.raises(IndexFormatError, match=message):
        load_index(dataset)


def test_rows_summing_past_int64_are_refused(dataset: str) -> None:
    def edit(obj: dict[str, Any]) -> None:
        for shard in obj["shards"]:
            shard["rows"] = 2**62
    rewrite_index(dataset, edit)
    with pytest.raises(IndexFormatError, match=r"at most 2\*\*63 - 1 are supported"):
        load_index(dataset)


@pytest.mark.parametrize("schema, message", [
    ({"name": "x"}, "a list of at most"),
    ([{"name": "x", "kind": "tensor", "dtype": "int64", "shape": [2**40, 2**40]}],
     "malformed schema field"),
    ([{"name": "x", "kind": "tensor", "dtype": "int64", "shape": [2**30, 2**30]}],
     r"over the cap of 1099511627776"),
    ([{"name": "x", "kind": "tensor", "dtype": "int64", "shape": ["3"]}],
     "malformed schema field"),
    ([{"name": 5, "kind": "str"}], "malformed schema field"),
    ([{"name": "x", "kind": "tensor", "dtype": "object"}], "not supported"),
])
def test_schema_fields_are_checked(dataset: str, schema: Any, message: str) -> None:
    def edit(obj: dict[str, Any]) -> None:
        obj["schema"] = schema
    rewrite_index(dataset, edit)
    with pytest.raises(IndexFormatError, match=message):
        load_index(dataset)


def test_deep_json_is_refused_with_the_cap(dataset: str) -> None:
    Path(dataset, "index.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(IndexFormatError, match="nests 100000 levels deep, over the cap of 32"):
        load_index(dataset)


def test_json_depth_ignores_brackets_inside_strings() -> None:
    document = json.dumps({"a": "[[[[{{{", "b": [1, {"c": '"]]]\\'}], "d": "\\\\"}).encode()
    assert index_format.json_depth(document) == 3
    assert index_format.json_depth(b'{"x": "\\\\\\"[[["}') == 1
    assert index_format.json_depth(b"[[[]],[]]") == 3


def test_an_oversized_index_is_refused_with_the_cap(dataset: str, monkeypatch) -> None:
    size = os.path.getsize(os.path.join(dataset, "index.json"))
    monkeypatch.setattr(index_module, "MAX_INDEX_BYTES", size - 1)
    with pytest.raises(IndexFormatError, match=rf"is over {size - 1} bytes \(the cap"):
        load_index(dataset)
    with pytest.raises(IndexFormatError, match=r"the cap on index\.json"):
        parse_index(b" " * size, "somewhere/index.json")


# ---------------------------------------------------------------- the side-file shard table


@pytest.fixture
def large_dataset(tmp_path: Path, monkeypatch) -> str:
    """A dataset of 9 shards written with the side-file threshold lowered to 5 shards."""
    monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 5)
    dst = str(tmp_path / "large")
    write_dataset(({"x": np.full(10, i, np.int64), "s": str(i)} for i in range(60)), dst,
                  shard_size=500)
    return dst


def _side_file(folder: str) -> Path:
    (side,) = Path(folder).glob("_streamcache-shards-*.parquet")
    return side


def test_large_index_keeps_its_shards_in_a_parquet_side_file(large_dataset: str,
                                                              tmp_path: Path) -> None:
    obj = json.loads(Path(large_dataset, "index.json").read_text())
    assert obj["version"] == 2 and "shards" not in obj
    side = _side_file(large_dataset)
    assert obj["shard_table"]["path"] == side.name
    assert obj["shard_table"]["bytes"] == side.stat().st_size
    index = load_index(large_dataset)
    assert obj["shard_table"]["shards"] == pq.read_metadata(side).num_rows == len(index.shards)
    assert isinstance(index.shards, ShardTable)
    assert index.shard_rows.dtype == np.int64 and index.shard_rows.sum() == 60
    assert index.num_samples == 60 and len(index.shards) >= 5
    assert index.shards[3].checksum is not None and index.shards[3].format == "arrow"
    assert [s.rows for s in index.shards] == index.shard_rows.tolist()
    with DatasetReader(large_dataset, local_dir=str(tmp_path / "c")) as reader:
        assert reader.read_batch(np.arange(60))["s"].tolist() == [str(i) for i in range(60)]
    dataset = StreamDataset(large_dataset, batch_size=7, shuffle=False, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"))
    assert dataset.cursor.dataset_fingerprint == obj["fingerprint"]
    with StreamLoader(dataset) as loader:
        ids = [i for batch in loader for i in batch["__id__"].tolist()]
    assert sorted(ids) == list(range(56))  # the last partial batch dropped
    # the folder can be indexed again: the side file is not taken for data
    assert build_index(large_dataset, write=False).num_samples == 60


def test_opening_a_dataset_never_imports_pandas(large_dataset: str, tmp_path: Path) -> None:
    # pyarrow's pa.array / to_numpy / fill_null / read_table import pandas where it is
    # installed: 0.4 s of every fresh process's first batch. Both index layouts, loaded as a
    # StreamDataset does, fingerprint included.
    small = str(tmp_path / "small")
    write_dataset(({"x": np.full(4, i, np.int64)} for i in range(20)), small, shard_size=200)
    code = ("import sys\n"
            "from streamcache import StreamDataset\n"
            "for url in sys.argv[1:]:\n"
            "    dataset = StreamDataset(url, batch_size=4, rank=0, world_size=1)\n"
            "    assert dataset.index.fingerprint and len(dataset.index.shards) > 1\n"
            "print('pandas' in sys.modules)")
    env = {**os.environ, "STREAMCACHE_CACHE_DIR": str(tmp_path / "cache")}  # (the copy's)
    result = subprocess.run([sys.executable, "-c", code, small, large_dataset],
                            capture_output=True, text=True, check=True, env=env)
    assert _side_file(large_dataset).exists()
    assert result.stdout.strip() == "False"


def test_the_fingerprint_covers_the_side_file(large_dataset: str) -> None:
    side = _side_file(large_dataset)
    table = pq.read_table(side)
    rows = table.column("rows").to_numpy().copy()
    rows[0], rows[1] = rows[1] + 1, rows[0] - 1  # same total, different shards
    edited = table.set_column(2, "rows", pa.array(rows))
    pq.write_table(edited, side)
    with pytest.raises(IndexFormatError, match="shard table was rewritten or damaged"):
        load_index(large_dataset)  # the recorded size catches it first
    pq.write_table(edited.replace_schema_metadata({"pad": "x"}), side)
    obj = json.loads(Path(large_dataset, "index.json").read_text())
    obj["shard_table"]["bytes"] = side.stat().st_size
    Path(large_dataset, "index.json").write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match=r"not a readable shard table.*checksum"):
        load_index(large_dataset)  # then the recorded checksum
    data = side.read_bytes()
    obj = json.loads(Path(large_dataset, "index.json").read_text())
    obj["shard_table"].update(bytes=len(data), checksum=checksum_bytes(data))
    Path(large_dataset, "index.json").write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match="does not match its content"):
        load_index(large_dataset)  # a matching checksum: the fingerprint catches it


@pytest.mark.parametrize("entry, message", [
    ({"path": "../elsewhere.parquet", "bytes": 10, "checksum": "xxh64:0000000000000000"},
     "must name a '_streamcache-shards-\\*' file beside it"),
    ({"path": "_streamcache-shards-x.parquet", "bytes": 2**40, "checksum": "x"},
     "bytes \\(at most 4294967296\\)"),
    ("_streamcache-shards-x.parquet", "not an object"),
])
def test_a_malformed_side_file_entry_is_refused(large_dataset: str, entry: Any,
                                                message: str) -> None:
    obj = json.loads(Path(large_dataset, "index.json").read_text())
    obj["shard_table"] = entry
    Path(large_dataset, "index.json").write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match=message):
        load_index(large_dataset)


def test_a_missing_side_file_says_so(large_dataset: str) -> None:
    _side_file(large_dataset).unlink()
    with pytest.raises(IndexFormatError, match=r"the shard table of .* is missing"):
        load_index(large_dataset)


def test_side_file_values_are_checked_like_json_ones(large_dataset: str) -> None:
    side = _side_file(large_dataset)
    table = pq.read_table(side)
    rows = table.column("rows").to_numpy().copy()
    rows[2] = -5
    pq.write_table(table.set_column(2, "rows", pa.array(rows)), side)
    data = side.read_bytes()
    obj = json.loads(Path(large_dataset, "index.json").read_text())
    obj["shard_table"].update(bytes=len(data), checksum=checksum_bytes(data))
    Path(large_dataset, "index.json").write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match="column 'rows' has a negative value"):
        load_index(large_dataset)


def test_a_side_file_index_on_s3(s3_bucket: Any, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 3)
    url = s3_bucket.url("index-limits/large")
    options = s3_bucket.storage_options()
    write_dataset(({"x": i} for i in range(30)), url, shard_size=100, storage_options=options)
    index = load_index(url, options)
    assert len(index.shards) >= 3 and index.url.startswith("s3://")
    with DatasetReader(index, local_dir=str(tmp_path / "c"), storage_options=options) as reader:
        assert reader.read_batch(np.arange(30))["x"].tolist() == list(range(30))


def test_the_stated_sample_count_must_match(dataset: str) -> None:
    def edit(obj: dict[str, Any]) -> None:
        obj["num_samples"] = 2**64
    rewrite_index(dataset, edit)
    with pytest.raises(IndexFormatError, match=r"says num_samples=18446744073709551616, its "
                                               r"shards hold 40"):
        load_index(dataset)


def test_the_stated_shard_count_must_match(large_dataset: str) -> None:
    obj = json.loads(Path(large_dataset, "index.json").read_text())
    obj["shard_table"]["shards"] += 1
    Path(large_dataset, "index.json").write_text(json.dumps(obj))
    with pytest.raises(IndexFormatError, match="says its shard table holds"):
        load_index(large_dataset)


def decoded_side_table(table: ShardTable) -> ShardTable:
    """``table`` written as a side file and decoded again (in memory)."""
    sink = io.BytesIO()
    pq.write_table(table.to_arrow(), sink)
    buffer, writer = memory_writer()
    facts = decode_side_table(sink.getvalue(), "t", writer, 1 << 30)
    writer.finish(facts.shards, {"digest": facts.digest})
    decoded = open_memory(buffer, "t")
    assert facts.digest == table.digest() and list(decoded) == list(table)
    return decoded


def test_shard_table_is_a_sequence_of_shard_infos() -> None:
    infos = [ShardInfo(f"s{k}.arrow", "arrow", k, 10 * k,
                       None if k % 2 else f"xxh64:{k:016x}",
                       None if k % 3 else "zstd", None if k % 4 else 7 * k)
             for k in range(9)]
    table = ShardTable.from_infos(infos)
    assert len(table) == 9 and list(table) == infos and table[-1] == infos[-1]
    assert [table[k] for k in range(9)] == infos and list(table[2:5]) == infos[2:5]
    assert table.total_rows == 36 and table.rows.tolist() == list(range(9))
    assert not table.rows.flags.writeable
    copy = pickle.loads(pickle.dumps(table))
    assert copy == table and list(copy) == infos
    assert decoded_side_table(table) == table  # (the side file's round trip)
    assert table != ShardTable.from_infos(infos[:8])
    with pytest.raises(IndexError):
        table[9]


def test_a_side_file_over_the_decoded_cap_is_refused_before_decoding(large_dataset: str,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(index_format, "MAX_SHARD_TABLE_DECODED", 100)
    with pytest.raises(IndexFormatError, match=r"would decode to more than 100 bytes \(9 "
                                               r"shards\), over the cap"):
        load_index(large_dataset)


def test_per_shard_columns_without_an_arrow_table() -> None:
    infos = [ShardInfo(f"s{k}.arrow", "arrow", 10, 100, None if k % 2 else f"xxh64:{k:016x}",
                       None if k % 3 else "zstd", None, *((5, 20, f"xxh64:{k:016x}")
                                                          if k < 2 else (None,) * 3))
             for k in range(6)]
    table = ShardTable.from_infos(infos)
    assert table.chunk_row_counts.tolist() == [5, 5, 0, 0, 0, 0]
    assert table.checksummed.tolist() == [True, False, True, False, True, False]
    assert table.compressed.tolist() == [True, False, False, True, False, False]
    assert table.checksummed is table.checksummed and not table.compressed.flags.writeable
