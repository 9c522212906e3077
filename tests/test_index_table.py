"""A large index's shard table: the side file as hostile input, and the node copy.

The side file (a Parquet table beside index.json) is decoded with memory bounded by what is
decoded, never by what the file says: bombs (columns of the null type, one value repeated
millions of times, a long string repeated), wrong types and lies are refused with
IndexFormatError before they cost memory (#21 item 6). The node copy in the cache folder
(format/node_table.py) is made once per node and dataset version and opened, never loaded,
by every later process; a copy that was changed in any way (tampered, truncated, swapped for
another dataset's, replaced by a link, left half-written by a killed process) is never
served: it is rebuilt from the side file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamcache.format.index_format as index_format
import streamcache.format.side_table as side_table
from streamcache.errors import CacheError, IndexFormatError
from streamcache.format.checksum import checksum_bytes
from streamcache.format.index import load_index
from streamcache.format.node_table import TABLES
from streamcache.format.writer import write_dataset
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader

SCHEMA = [{"name": "x", "kind": "tensor", "dtype": "int64", "shape": []}]


@pytest.fixture
def large(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A dataset of 12 shards whose index keeps them in a side file (threshold lowered)."""
    monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 5)
    dst = str(tmp_path / "large")
    write_dataset(({"x": np.full(10, i, np.int64), "s": str(i)} for i in range(96)), dst,
                  shard_size=600)
    return dst


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The side files decoded in this process, in order (a decode per build or load)."""
    seen: list[str] = []
    original = side_table.decode_side_table

    def counted(data: bytes, where: str, *args: Any) -> Any:
        seen.append(where)
        return original(data, where, *args)

    monkeypatch.setattr(index_format, "decode_side_table", counted)
    return seen


def _copy(cache: Path) -> Path:
    (table,) = (cache / TABLES / str(os.geteuid())).glob("*.table")
    return table


def _expected(url: str) -> list[Any]:
    return list(load_index(url).shards)  # decoded in memory: the reference


# ---------------------------------------------------------------- the side file as input


def _side_index(folder: Path, table: pa.Table | None, *, stated: int | None = None,
                **write: Any) -> str:
    """An index.json naming ``table`` written as its side file (None: the side file is
    there already), as an attacker would write them."""
    folder.mkdir(parents=True, exist_ok=True)
    side = folder / "_streamcache-shards-0000000000000000.parquet"
    if table is not None:
        pq.write_table(table, side, **write)
    data = side.read_bytes()
    shards = stated if stated is not None else pq.read_metadata(side).num_rows
    doc = {"format": "streamcache-index", "version": 2, "fingerprint": "xxh64:0000000000000000",
           "created": 0.0, "num_samples": 1, "schema": SCHEMA,
           "shard_table": {"path": side.name, "bytes": len(data),
                           "checksum": checksum_bytes(data), "shards": shards}}
    (folder / "index.json").write_text(json.dumps(doc))
    return str(folder)


def _load_and_report_memory(url: str) -> dict[str, Any]:
    """Load ``url`` in a fresh process; what it raised and the most memory pyarrow held."""
    code = ("import json, sys, pyarrow as pa\n"
            "from streamcache.format.index import load_index\n"
            "try:\n"
            "    load_index(sys.argv[1])\n"
            "    error = None\n"
            "except Exception as exc:\n"
            "    error = f'{type(exc).__name__}: {exc}'\n"
            "print(json.dumps({'error': error,\n"
            "                  'peak': pa.default_memory_pool().max_memory()}))\n")
    done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_side_file_of_null_columns_is_refused_before_a_byte_is_allocated(
        tmp_path: Path) -> None:
    # 16M rows of Arrow's null type: a few kilobytes on disk, nothing in memory; the cast to
    # the table's types allocated 4 to 8 bytes a row per column (a 3.3 KB file made every
    # process allocate 4 GB). Now the types are checked before anything is decoded.
    rows = 16_000_000
    names = ["path", "format", "rows", "bytes", "checksum", "compression", "raw_bytes"]
    url = _side_index(tmp_path / "nulls", pa.table({n: pa.nulls(rows) for n in names}))
    report = _load_and_report_memory(url)
    assert report["error"].startswith("IndexFormatError: ")
    assert "column 'path' is of type null, not the type streamcache writes" in report["error"]
    assert report["peak"] < 32 << 20, report


def test_a_side_file_of_one_repeated_row_is_refused_by_what_it_would_decode_to(
        tmp_path: Path) -> None:
    # 8M copies of one valid row, dictionary- and run-length encoded: tens of kilobytes
    # stored, 400 MB decoded. The row count alone says so, before anything is decoded.
    count = 1_000_000
    piece = pa.table({
        "path": pa.array(["a.arrow"] * count, pa.string()).dictionary_encode(),
        "format": pa.array(["arrow"] * count, pa.string()).dictionary_encode(),
        "rows": pa.array(np.ones(count, np.int64)), "bytes": pa.array(np.ones(count, np.int64)),
        "checksum": pa.nulls(count, pa.string()), "compression": pa.nulls(count, pa.string()),
        "raw_bytes": pa.nulls(count, pa.int64())})
    folder = tmp_path / "repeated"
    folder.mkdir()
    side = folder / "_streamcache-shards-0000000000000000.parquet"
    with pq.ParquetWriter(side, piece.schema, compression="zstd") as writer:
        for _ in range(8):
            writer.write_table(piece)
    assert side.stat().st_size < 1 << 20
    report = _load_and_report_memory(_side_index(folder, None))
    assert "IndexFormatError" in report["error"] and "would decode to more than" in \
        report["error"] and "(8000000 shards)" in report["error"], report
    assert report["peak"] < 32 << 20, report


def test_a_long_path_repeated_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    count = 200_000
    long = "p/" + "x" * 4000  # a legal path, 200,000 times: 800 MB once expanded
    table = pa.table({
        "path": pa.DictionaryArray.from_arrays(pa.array(np.zeros(count, np.int32)),
                                               pa.array([long], pa.string())),
        "format": pa.array(["arrow"] * count).dictionary_encode(),
        "rows": pa.array(np.ones(count, np.int64)), "bytes": pa.array(np.ones(count, np.int64)),
        "checksum": pa.nulls(count, pa.string()), "compression": pa.nulls(count, pa.string()),
        "raw_bytes": pa.nulls(count, pa.int64())})
    url = _side_index(tmp_path / "long", table, compression="zstd")
    report = _load_and_report_memory(url)
    assert "would decode to more than" in report["error"] and "column 'path'" in \
        report["error"], report
    assert report["peak"] < 64 << 20, report


@pytest.mark.parametrize("column, values, message", [
    ("rows", pa.array([1, 2], pa.int32()), "column 'rows' is of type int32"),
    ("rows", pa.array(["1", "2"]), "column 'rows' is of type string"),
    ("bytes", pa.array([1.0, 2.0]), "column 'bytes' is of type double"),
    ("path", pa.array([b"a", b"b"], pa.binary()), "column 'path' is of type .*binary"),
    ("path", pa.array([1, 2], pa.int64()), "column 'path' is of type .*int64"),
    ("format", pa.array([0, 0], pa.uint8()), "column 'format' is of type .*uint8"),
    ("rows", pa.array([1, None], pa.int64()), "column 'rows' has nulls"),
    ("rows", pa.array([1, -1], pa.int64()), "column 'rows' has a negative value"),
    ("format", pa.array(["arrow", "zip"]), r"unknown shard format\(s\) \['zip'\]"),
    ("checksum", pa.array(["xxh64:0123456789abcdef", "md5:1"]), "a checksum is not"),
    ("path", pa.array(["a", "b\0c"]), "holds a NUL"),
    ("path", pa.array(["a", ""]), "is empty"),
    ("path", pa.array(["a", "é" * 4097]), "over 4096 characters"),
])
def test_a_side_file_column_of_another_type_or_value_is_refused(
        tmp_path: Path, column: str, values: pa.Array, message: str) -> None:
    columns = {"path": pa.array(["a", "b"]), "format": pa.array(["arrow", "arrow"]),
               "rows": pa.array([1, 2], pa.int64()), "bytes": pa.array([5, 6], pa.int64()),
               "checksum": pa.nulls(2, pa.string()), "compression": pa.nulls(2, pa.string()),
               "raw_bytes": pa.nulls(2, pa.int64())}
    columns[column] = values
    url = _side_index(tmp_path / "typed", pa.table(columns))
    with pytest.raises(IndexFormatError, match=message):
        load_index(url)


def test_invalid_utf8_in_a_path_is_refused(tmp_path: Path) -> None:
    broken = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(
        np.array([0, 1, 3], np.int32).tobytes()), pa.py_buffer(b"a\xff\xfe")])
    columns = {"path": broken, "format": pa.array(["arrow", "arrow"]),
               "rows": pa.array([1, 2], pa.int64()), "bytes": pa.array([5, 6], pa.int64()),
               "checksum": pa.nulls(2, pa.string()), "compression": pa.nulls(2, pa.string()),
               "raw_bytes": pa.nulls(2, pa.int64())}
    url = _side_index(tmp_path / "utf8", pa.table(columns))
    with pytest.raises(IndexFormatError, match="not a readable shard table"):
        load_index(url)


def test_a_file_that_is_not_parquet_or_misses_columns_is_refused(tmp_path: Path) -> None:
    url = _side_index(tmp_path / "partial", pa.table({"path": pa.array(["a"])}))
    with pytest.raises(IndexFormatError, match="it has no column 'format'"):
        load_index(url)
    side = next((tmp_path / "partial").glob("_streamcache-shards-*"))
    side.write_bytes(b"PAR1" + b"\0" * 100)
    doc = json.loads((tmp_path / "partial" / "index.json").read_text())
    doc["shard_table"].update(bytes=104, checksum=checksum_bytes(side.read_bytes()))
    (tmp_path / "partial" / "index.json").write_text(json.dumps(doc))
    with pytest.raises(IndexFormatError, match="not a readable shard table"):
        load_index(url)


# ---------------------------------------------------------------- the node copy


def test_the_node_copy_is_made_once_and_then_opened(large: str, tmp_path: Path,
                                                    builds: list[str]) -> None:
    expected = _expected(large)
    cache = tmp_path / "cache"
    first = load_index(large, table_cache=str(cache))
    assert len(builds) == 2  # the reference, then the copy's build
    again = load_index(large, table_cache=str(cache))
    assert len(builds) == 2  # opened, not decoded
    for index in (first, again):
        assert list(index.shards) == expected and index.fingerprint == load_index(
            large).fingerprint
        assert [index.shards[k] for k in range(len(expected))] == expected
    copy = _copy(cache)
    assert stat.S_IMODE(copy.stat().st_mode) == 0o444
    assert stat.S_IMODE(copy.parent.stat().st_mode) == 0o700
    assert not [p for p in copy.parent.iterdir() if p.name.startswith(".")]
    # pickled (to a worker process): the copy is opened again, its columns do not travel
    blob = pickle.dumps(again.shards)
    assert len(blob) < 1000 and list(pickle.loads(blob)) == expected


def test_a_stream_dataset_reads_exactly_through_its_node_copy(large: str,
                                                              tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    dataset = StreamDataset(large, global_batch_size=8, rank=0, world_size=1, cache_dir=cache,
                            seed=3)
    assert dataset.index.shard_table._point is not None  # (opened from the copy)
    with StreamLoader(dataset) as loader:
        batches = [batch for batch in loader]
    ids = np.concatenate([b["__id__"].numpy() for b in batches])
    values = np.concatenate([b["x"].numpy()[:, 0] for b in batches])
    assert sorted(ids.tolist()) == list(range(96)) and np.array_equal(values, ids)


def _tamper(copy: Path, change: Any) -> None:
    os.chmod(copy, 0o644)
    change(copy)
    os.chmod(copy, 0o444)


def _flip_byte_restoring_times(copy: Path) -> None:
    before = copy.stat()
    data = bytearray(copy.read_bytes())
    at = data.index(b"shard-")  # inside the paths' data
    data[at] ^= 0x20
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))  # as a careful forger would


@pytest.mark.parametrize("damage", [
    pytest.param(lambda c: _tamper(c, _flip_byte_restoring_times), id="tampered"),
    pytest.param(lambda c: _tamper(c, lambda p: os.truncate(p, p.stat().st_size // 2)),
                 id="truncated"),
    pytest.param(lambda c: os.chmod(c, 0o644), id="made-writable"),
    pytest.param(lambda c: c.unlink(), id="removed"),
    pytest.param(lambda c: c.with_suffix(".stamp").unlink(), id="stamp-removed"),
    pytest.param(lambda c: c.with_suffix(".stamp").write_text("[" * 100_000), id="stamp-bomb"),
    # under the stamp's size cap, too deep to decode (#33: a raw RecursionError on every open)
    pytest.param(lambda c: c.with_suffix(".stamp").write_text("[" * 4000), id="stamp-deep"),
    pytest.param(lambda c: c.with_suffix(".stamp").write_bytes(b"\xff" * 100),
                 id="stamp-not-utf8"),
    pytest.param(lambda c: (c.with_suffix(".stamp").unlink(), c.with_suffix(".stamp").mkdir()),
                 id="stamp-folder"),
    pytest.param(lambda c: (c.unlink(), c.symlink_to("/etc/passwd")), id="symlink"),
    pytest.param(lambda c: (c.unlink(), os.mkfifo(c)), id="fifo"),
])
def test_a_changed_copy_is_never_served_but_rebuilt(large: str, tmp_path: Path,
                                                    builds: list[str], damage: Any) -> None:
    expected = _expected(large)
    cache = tmp_path / "cache"
    load_index(large, table_cache=str(cache))
    copy = _copy(cache)
    damage(copy)
    count = len(builds)
    index = load_index(large, table_cache=str(cache))
    assert len(builds) == count + 1  # rebuilt from the side file
    assert list(index.shards) == expected
    assert index.shard_table._point is not None  # served from the new copy, not in memory
    assert _copy(cache).is_file() and not _copy(cache).is_symlink()
    assert Path("/etc/passwd").exists()


def test_a_swapped_copy_of_another_dataset_is_refused(large: str, tmp_path: Path,
                                                      builds: list[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    other = str(tmp_path / "other")
    write_dataset(({"x": np.full(10, -i, np.int64), "s": "z"} for i in range(96)), other,
                  shard_size=600)
    cache = tmp_path / "cache"
    load_index(large, table_cache=str(cache))
    ours = _copy(cache)
    other_cache = tmp_path / "other-cache"
    load_index(other, table_cache=str(other_cache))
    theirs = _copy(other_cache)
    # another dataset's copy and a stamp that matches it exactly, under our copy's name
    os.rename(theirs, ours)
    stamp = json.loads(theirs.with_suffix(".stamp").read_text())
    st = os.stat(ours)
    stamp.update(dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns,
                 ctime_ns=st.st_ctime_ns)
    ours.with_suffix(".stamp").write_text(json.dumps(stamp))
    count = len(builds)
    index = load_index(large, table_cache=str(cache))
    assert len(builds) == count + 1 and list(index.shards) == _expected(large)


def test_an_index_edited_beside_a_good_copy_is_still_refused(large: str,
                                                             tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    load_index(large, table_cache=cache)
    path = Path(large, "index.json")
    doc = json.loads(path.read_text())
    doc["schema"][0]["name"] = "y"  # the schema changed, the fingerprint kept
    path.write_text(json.dumps(doc))
    with pytest.raises(IndexFormatError, match="does not match its content"):
        load_index(large, table_cache=cache)
    doc["schema"][0]["name"] = "x"
    doc["num_samples"] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(IndexFormatError, match="says num_samples="):
        load_index(large, table_cache=cache)


def test_a_tampered_side_file_publishes_no_copy(large: str, tmp_path: Path) -> None:
    side = next(Path(large).glob("_streamcache-shards-*"))
    table = pq.read_table(side)
    rows = table.column("rows").to_numpy().copy()
    rows[0] += 1
    pq.write_table(table.set_column(2, "rows", pa.array(rows)), side)
    doc = json.loads(Path(large, "index.json").read_text())
    doc["shard_table"].update(bytes=side.stat().st_size, checksum=checksum_bytes(
        side.read_bytes()))
    Path(large, "index.json").write_text(json.dumps(doc))
    cache = tmp_path / "cache"
    with pytest.raises(IndexFormatError, match="does not match its content"):
        load_index(large, table_cache=str(cache))
    folder = cache / TABLES / str(os.geteuid())
    assert not list(folder.glob("*.table")) and not list(folder.glob(".*"))


def test_paths_outside_the_folder_are_refused_on_every_open(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            ) -> None:
    monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 2)
    src = tmp_path / "src"
    write_dataset(({"x": i} for i in range(30)), str(src), shard_size=100)
    elsewhere = tmp_path / "elsewhere"
    index = load_index(str(src))
    from dataclasses import replace

    from streamcache.format.index import DatasetIndex, save_index
    moved = [replace(s, path=str(src / s.path)) for s in index.shards]
    save_index(DatasetIndex(index.schema, moved), str(elsewhere))
    cache = str(tmp_path / "cache")
    for _ in range(2):  # cold (the copy is made), then warm
        with pytest.raises(IndexFormatError, match="outside the dataset's folder"):
            load_index(str(elsewhere), table_cache=cache)
    assert len(load_index(str(elsewhere), table_cache=cache,
                          allow_external_paths=True).shards) == len(moved)


def test_a_planted_tables_folder_is_refused(large: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    target = tmp_path / "victim"
    target.mkdir()
    (cache / TABLES).symlink_to(target)
    with pytest.raises(CacheError, match="is a symbolic link"):
        load_index(large, table_cache=str(cache))
    assert not list(target.iterdir())
    (cache / TABLES).unlink()
    ours = cache / TABLES / str(os.geteuid())
    ours.mkdir(parents=True)
    os.chmod(ours, 0o777)  # open to others: made private again before anything is written
    assert load_index(large, table_cache=str(cache)).shard_table._point is not None
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700
    if os.geteuid() == 0:  # (only root can give a folder away)
        os.chown(ours, 12345, 12345)
        with pytest.raises(CacheError, match="belongs to uid 12345"):
            load_index(large, table_cache=str(cache))


def test_a_cache_folder_that_cannot_hold_copies_loads_in_memory(large: str,
                                                                 tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    index = load_index(large, table_cache=str(not_a_folder / "cache"))
    assert list(index.shards) == _expected(large) and index.shard_table._point is None


def _load_in_child(url: str, cache: str, threshold: int, log: str, stall: float) -> None:
    index_format.SHARD_TABLE_MIN_SHARDS = threshold
    original = side_table.decode_side_table

    def logged(data: bytes, where: str, writer: Any, limit: int) -> Any:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        facts = original(data, where, writer, limit)
        time.sleep(stall)  # the columns are written, the copy is not published yet
        return facts

    index_format.decode_side_table = logged
    index = load_index(url, table_cache=cache)
    print(len(index.shards), flush=True)


def test_ranks_opening_at_once_build_one_copy(large: str, tmp_path: Path) -> None:
    cache, log = str(tmp_path / "cache"), str(tmp_path / "builds.log")
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_load_in_child, args=(large, cache, 5, log, 0.5))
                for _ in range(3)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    assert len(Path(log).read_text().split()) == 1  # one process decoded; two opened it
    assert list(load_index(large, table_cache=cache).shards) == _expected(large)


def test_a_builder_killed_mid_write_leaves_nothing_that_is_served(large: str,
                                                                  tmp_path: Path,
                                                                  builds: list[str]) -> None:
    cache, log = str(tmp_path / "cache"), str(tmp_path / "builds.log")
    child = multiprocessing.get_context("fork").Process(
        target=_load_in_child, args=(large, cache, 5, log, 60))
    child.start()
    deadline = time.monotonic() + 60
    folder = tmp_path / "cache" / TABLES / str(os.geteuid())
    while not (folder.exists() and list(folder.glob(".*.tmp"))):
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert list(folder.glob(".*.tmp")) and not list(folder.glob("*.table"))
    expected = _expected(large)
    count = len(builds)
    assert list(load_index(large, table_cache=cache).shards) == expected
    assert len(builds) == count + 1
    assert not list(folder.glob(".*"))  # the killed builder's leftover is gone


def test_a_full_cache_disk_loads_the_table_in_memory(large: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import io

    from streamcache.format import node_table
    original = node_table.LayoutWriter.finish

    def full(self: Any, *args: Any) -> None:
        if not isinstance(self._sink, io.BytesIO):  # the copy's file, not a table in memory
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, *args)

    monkeypatch.setattr(node_table.LayoutWriter, "finish", full)
    cache = tmp_path / "cache"
    index = load_index(large, table_cache=str(cache))
    assert list(index.shards) == _expected(large) and index.shard_table._point is None
    folder = cache / TABLES / str(os.geteuid())
    assert not list(folder.glob("*.table")) and not list(folder.glob(".*"))
    monkeypatch.setattr(node_table.LayoutWriter, "finish", original)
    assert load_index(large, table_cache=str(cache)).shard_table._point is not None
