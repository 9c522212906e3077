"""Range reads (cache/ranges.py) and the cold start they make possible.

Chunked shards (format/chunks.py) let a reader fetch a footer and the chunks holding the rows it
needs; these tests count requests and bytes on a real HTTP server and on moto S3, check that
damaged or changed objects are errors, that older layouts still work, and that every batch is
identical whether it is read cold (by range), warm (from the cache) or by range on request.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch
from servers import FaultServer, S3Bucket

from streamcache import (
    DatasetReader,
    ShardWriter,
    Source,
    StreamDataset,
    load_index,
    processes,
    write_dataset,
)
from streamcache.cache import prefetch, ranges
from streamcache.cache.byte_ranges import coalesce
from streamcache.cache.node import NodeCache
from streamcache.cache.prefetch import Prefetcher, PrefetchOptions
from streamcache.cache.ranges import RangeReader
from streamcache.errors import ChecksumMismatchError, IndexFormatError, ShardCorruptError
from streamcache.format.chunks import (
    FOOTER_KEY,
    Block,
    chunk_digest,
    record_batch_blocks,
    tail_size,
)
from streamcache.format.index import build_index
from streamcache.format.reader import Ragged
from streamcache.loading import dataset_reader
from streamcache.remote.fetch import Fetcher
from streamcache.remote.options import FetchOptions
from streamcache.remote.retry import FetchError

ROWS = 2000
NO_RETRIES = FetchOptions(retries=0, backoff_initial_s=0.0)


def sample(i: int) -> dict[str, Any]:
    # ~1 KB, not compressible to nothing: a chunk of 64 KiB holds about 60 rows
    rng = np.random.default_rng(i)
    return {"tokens": rng.integers(0, 50_000, 200 + i % 50, dtype=np.int32), "id": i,
            "name": f"s{i}"}


def write(folder: Path | str, **options: Any) -> str:
    options.setdefault("shard_size", 512 << 10)
    write_dataset((sample(i) for i in range(ROWS)), str(folder), **options)
    return str(folder)


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, Ragged):
            assert x.kind == y.kind
            np.testing.assert_array_equal(x.values, y.values)
            np.testing.assert_array_equal(x.offsets, y.offsets)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def every_shard(unique: np.ndarray) -> np.ndarray:
    return np.ones(len(unique), bool)


def served_bytes(server: FaultServer) -> int:
    return sum(server.requests.bytes_sent(path) for path in server.requests.counts())


@pytest.fixture(autouse=True)
def small_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    """These shards are ~300 KB: with the default 256 KiB gap most reads would merge into one
    range, and the counts below could not tell a chunk from a shard; and one chunk is more
    than the default cold budget of such a shard (1/16), so the cold tests raise it."""
    monkeypatch.setattr(ranges, "COALESCE_GAP", 16 << 10)
    monkeypatch.setattr(ranges, "COLD_BUDGET", 0.5)
    monkeypatch.setattr(ranges, "COLD_START_BUDGET", 0.5)


@pytest.fixture
def served(fault_server: FaultServer) -> tuple[FaultServer, str]:
    write(Path(fault_server.root or "") / "ds")
    return fault_server, fault_server.url_for("ds")


# --------------------------------------------------------------------------- the format


def test_shards_are_written_in_chunks_with_their_layout_in_the_index(tmp_path: Path) -> None:
    index = load_index(write(tmp_path / "ds"))
    assert len(index.shards) > 1
    for info in index.shards:
        assert info.chunked and 40 <= info.chunk_rows <= 80  # ~64 KiB of ~1 KB rows
        data = (tmp_path / "ds" / info.path).read_bytes()
        assert info.tail_bytes == tail_size(data, len(data))
        reader = ipc.open_file(pa.BufferReader(data))
        assert reader.num_record_batches == -(-info.rows // info.chunk_rows)
        assert len(record_batch_blocks(data[-info.tail_bytes:], len(data))) == \
            reader.num_record_batches
        digests = json.loads(reader.metadata[FOOTER_KEY])["digests"]
        first = reader.get_batch(0)
        assert digests[:16] == chunk_digest(first, index.schema).partition(":")[2]
        assert all(reader.get_batch(i).num_rows == info.chunk_rows
                   for i in range(reader.num_record_batches - 1))


def test_a_chunk_digest_ignores_slicing_and_compression(tmp_path: Path) -> None:
    index = load_index(write(tmp_path / "ds"))
    table = pa.Table.from_batches(
        [ipc.open_file(str(tmp_path / "ds" / index.shards[0].path)).get_batch(1)])
    whole = table.combine_chunks().to_batches()[0]
    sliced = pa.concat_tables([table, table]).combine_chunks().to_batches()[0].slice(
        whole.num_rows, whole.num_rows)
    assert chunk_digest(whole, index.schema) == chunk_digest(sliced, index.schema)
    assert chunk_digest(whole, index.schema) != chunk_digest(whole.slice(1), index.schema)


def test_an_index_without_chunk_layouts_loads_and_reads_as_before(tmp_path: Path) -> None:
    folder = write(tmp_path / "ds")
    path = Path(folder, "index.json")
    doc = json.loads(path.read_text())
    fingerprint = doc["fingerprint"]
    for entry in doc["shards"]:
        for key in ("chunk_rows", "tail_bytes", "tail_checksum"):
            del entry[key]
    path.write_text(json.dumps(doc))
    index = load_index(folder)  # the fingerprint does not cover the layout: still valid
    assert index.fingerprint == fingerprint and not index.shards[0].chunked
    with DatasetReader(folder) as reader:
        assert reader[1234]["id"] == 1234


@pytest.mark.parametrize("edit", [
    {"chunk_rows": 0}, {"tail_bytes": 3}, {"tail_bytes": 10**9},
    {"tail_checksum": "md5:x"}, {"tail_checksum": None}, {"chunk_rows": "32"},
])
def test_a_malformed_chunk_layout_is_refused(tmp_path: Path, edit: dict[str, Any]) -> None:
    folder = write(tmp_path / "ds")
    path = Path(folder, "index.json")
    doc = json.loads(path.read_text())
    doc["shards"][1].update(edit)
    path.write_text(json.dumps(doc))
    with pytest.raises(IndexFormatError, match="malformed chunk layout"):
        load_index(folder)


def test_chunk_layouts_survive_a_side_file(tmp_path: Path, monkeypatch: Any) -> None:
    from streamcache.format import index_format
    monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 2)
    folder = write(tmp_path / "ds")
    index = load_index(folder)
    assert index.has_side_table and index.shards[1].chunked
    assert list(index.shards) == list(load_index(folder).shards)
    side = next(Path(folder).glob("_streamcache-shards-*"))
    table = pq.read_table(side)
    tails = table.column("tail_bytes").to_pylist()
    tails[0] = 2  # below the smallest tail
    pq.write_table(table.set_column(table.schema.get_field_index("tail_bytes"), "tail_bytes",
                                    pa.array(tails, pa.int64())), side)
    doc = json.loads(Path(folder, "index.json").read_text())
    from streamcache.format.checksum import checksum_bytes
    doc["shard_table"].update(bytes=side.stat().st_size,
                              checksum=checksum_bytes(side.read_bytes()))
    Path(folder, "index.json").write_text(json.dumps(doc))
    with pytest.raises(IndexFormatError, match="malformed chunk layout"):
        load_index(folder)


def test_a_local_chunked_uncompressed_shard_is_read_in_place(tmp_path: Path) -> None:
    folder = write(tmp_path / "ds", compression=None)
    index = load_index(folder)
    with NodeCache(index, str(tmp_path / "cache")) as cache:
        path = cache.local_path(0)
        assert os.path.samefile(path, tmp_path / "ds" / index.shards[0].path)  # in place
        assert ipc.open_file(path).num_record_batches > 1  # its chunks, as written
        assert not list((tmp_path / "cache").rglob("*.arrow"))


def test_coalesce_merges_near_blocks_within_the_limit() -> None:
    blocks = [Block(100, 10), Block(0, 10), Block(10_000, 10), Block(115, 5)]
    assert coalesce(blocks, gap=16) == [Block(0, 10), Block(100, 20), Block(10_000, 10)]
    assert coalesce(blocks, gap=200) == [Block(0, 120), Block(10_000, 10)]
    assert coalesce(blocks, gap=10**6, limit=50) == [Block(0, 10), Block(100, 20),
                                                     Block(10_000, 10)]


# --------------------------------------------------------------------------- range reads


def test_a_range_read_costs_the_chunks_not_the_shard(served: tuple[FaultServer, str]) -> None:
    server, url = served
    index = load_index(url)
    info = index.shards[1]
    ids = [int(index.shard_rows[0]) + r for r in (3, 5, info.chunk_rows * 4 + 1)]
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm:
        expected = warm.read_batch(ids)
    server.requests.reset()
    with DatasetReader(index, by_range=every_shard) as reader:
        same(reader.read_batch(ids), expected)
        stats = reader.range_stats
    assert server.requests.counts() == {f"/ds/{info.path}": 3}  # tail + two chunks
    assert stats.chunks == 2 and stats.whole == 0
    assert served_bytes(server) == stats.bytes
    assert stats.bytes < info.tail_bytes + 3 * (info.bytes // (info.rows // info.chunk_rows))
    assert stats.bytes < info.bytes / 4


def test_range_reads_match_the_warm_path_for_random_batches(
        served: tuple[FaultServer, str]) -> None:
    server, url = served
    rng = np.random.default_rng(7)
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm, \
            DatasetReader(load_index(url), by_range=every_shard) as ranged, \
            DatasetReader(load_index(url), fields=["name", "id"],
                          by_range=every_shard) as some:
        for size in (1, 7, 64, 500):
            ids = rng.choice(ROWS, size, replace=False)
            expected = warm.read_batch(ids)
            same(ranged.read_batch(ids), expected)
            same(some.read_batch(ids), {k: expected[k] for k in ("name", "id")})
        assert ranged.range_stats.whole == 0 and ranged.range_stats.rows == 572


def test_range_reads_from_s3(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    folder = write(tmp_path / "ds")
    for name in os.listdir(folder):
        s3_bucket.put(f"ranges/{name}", Path(folder, name).read_bytes())
    options = s3_bucket.storage_options()
    index = load_index(s3_bucket.url("ranges"), options)
    ids = np.arange(0, ROWS, 400)
    with DatasetReader(folder) as warm, DatasetReader(
            index, storage_options=options, by_range=every_shard) as reader:
        same(reader.read_batch(ids), warm.read_batch(ids))
        stats = reader.range_stats
    assert stats.whole == 0 and stats.chunks == 5 and stats.bytes < index.total_bytes / 3


def test_old_one_batch_shards_are_read_whole_and_verified(fault_server: FaultServer) -> None:
    folder = write(Path(fault_server.root or "") / "ds", chunk_size=1 << 30)  # one chunk each
    index = load_index(fault_server.url_for("ds"))
    assert not RangeReader(index, Fetcher()).addressable(0)
    ids = np.arange(0, ROWS, 50)
    with DatasetReader(folder) as warm, DatasetReader(index, by_range=every_shard) as reader:
        expected = warm.read_batch(ids)
        same(reader.read_batch(ids), expected)
        same(reader.read_batch(ids), expected)  # the decoded shards are kept
        assert reader.range_stats.whole == len(index.shards)


def test_parquet_row_groups_are_read_by_range(fault_server: FaultServer, tmp_path: Path) -> None:
    root = Path(fault_server.root or "") / "pq"
    root.mkdir()
    table = pa.table({"id": pa.array(range(4000), pa.int64()),
                      "payload": pa.array([os.urandom(200) for _ in range(4000)])})
    pq.write_table(table.slice(0, 3000), root / "a.parquet", row_group_size=250)
    pq.write_table(table.slice(3000), root / "b.parquet")  # one row group: read whole
    build_index(str(root))
    index = load_index(fault_server.url_for("pq"))
    fault_server.requests.reset()
    ids = [5, 6, 2600, 3999]
    unverified = FetchOptions(allow_unverified_ranges=True)  # (Parquet has no chunk digests)
    with DatasetReader(index, by_range=every_shard, fetch=unverified) as reader:
        batch = reader.read_batch(ids)
        stats = reader.range_stats
    assert batch["id"].tolist() == ids
    assert [batch["payload"][i] for i in range(4)] == [table["payload"][i].as_py() for i in ids]
    assert stats.chunks == 2 and stats.whole == 1
    a_bytes = fault_server.requests.bytes_sent("/pq/a.parquet")
    assert a_bytes < (root / "a.parquet").stat().st_size / 3


# --------------------------------------------------------------------------- integrity


def test_a_corrupt_chunk_is_an_error(fault_server: FaultServer) -> None:
    folder = write(Path(fault_server.root or "") / "ds", compression=None)
    index = load_index(fault_server.url_for("ds"))
    info = index.shards[0]
    path = Path(folder, info.path)
    data = bytearray(path.read_bytes())
    block = record_batch_blocks(bytes(data[-info.tail_bytes:]), len(data))[2]
    data[block.offset + block.length - 64] ^= 0x01  # a value byte of chunk 2
    path.write_bytes(bytes(data))
    with DatasetReader(index, by_range=every_shard, fetch=NO_RETRIES) as reader:
        reader.read_batch([0, 1])  # chunk 0 is intact
        with pytest.raises(ChecksumMismatchError, match="chunk 2 does not match its digest"):
            reader.read_batch([info.chunk_rows * 2 + 1])


def test_a_changed_object_is_an_error(fault_server: FaultServer, tmp_path: Path) -> None:
    folder = write(Path(fault_server.root or "") / "ds")
    index = load_index(fault_server.url_for("ds"))
    info = index.shards[0]
    other = write(tmp_path / "other", shard_size=600 << 10)  # other rows, same names soon
    replacement = Path(other, load_index(other).shards[0].path).read_bytes()
    Path(folder, info.path).write_bytes(replacement[:info.bytes].ljust(info.bytes, b"\0"))
    with DatasetReader(index, by_range=every_shard, fetch=NO_RETRIES) as reader, \
            pytest.raises((ChecksumMismatchError, ShardCorruptError), match="footer"):
        reader.read_batch([0])


def test_a_truncated_object_is_an_error(fault_server: FaultServer) -> None:
    folder = write(Path(fault_server.root or "") / "ds")
    index = load_index(fault_server.url_for("ds"))
    path = Path(folder, index.shards[0].path)
    path.write_bytes(path.read_bytes()[:-100])
    with DatasetReader(index, by_range=every_shard, fetch=NO_RETRIES) as reader, \
            pytest.raises(FetchError, match="received"):
        reader.read_batch([0])


def test_a_chunk_corrupted_in_transit_is_fetched_again(served: tuple[FaultServer, str]) -> None:
    server, url = served
    index = load_index(url)
    info = index.shards[0]
    server.faults.script(f"/ds/{info.path}", [None, "corrupt"])  # tail fine, chunk flipped
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm, DatasetReader(
            index, by_range=every_shard,
            fetch=FetchOptions(retries=2, backoff_initial_s=0.0)) as reader:
        same(reader.read_batch([40]), warm.read_batch([40]))
    assert server.requests.count(f"/ds/{info.path}") == 3


# --------------------------------------------------------------------------- cold start


def test_ready_says_whether_a_shard_is_installed_without_a_request(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    server, url = served
    index = load_index(url)
    with Prefetcher(NodeCache(index, str(tmp_path / "cache"))) as prefetcher:
        server.requests.reset()
        assert not prefetcher.ready(0)
        assert server.requests.counts() == {}
        prefetcher.local_path(0)
        assert prefetcher.ready(0) and not prefetcher.ready(1)
    with Prefetcher(NodeCache(index, str(tmp_path / "cache"))) as again:  # another process
        assert again.ready(0)


def test_a_cold_batch_reads_its_chunks_and_waits_for_no_shard(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    server, url = served
    index = load_index(url)
    ids = np.random.default_rng(1).choice(ROWS, 4, replace=False)
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm:
        expected = warm.read_batch(ids)
    cache = NodeCache(index, str(tmp_path / "cache"))
    with DatasetReader(index, store=Prefetcher(cache)) as reader:
        server.requests.reset()
        same(reader.read_batch(ids), expected)
        stats = reader.range_stats
        touched = len(set(reader.locate(ids)[0].tolist()))
        assert stats.shards == touched and stats.whole == 0
        assert server.requests.count() == touched + stats.chunks - _merged(stats, reader)
        assert served_bytes(server) == stats.bytes <= _chunk_bound(index, server, stats)
        assert stats.bytes < index.total_bytes / 3
        assert cache.stats.installs == 0  # a range read installs nothing
        for shard in range(len(index.shards)):
            cache.install(shard)
        server.requests.reset()
        same(reader.read_batch(ids), expected)  # now from the cache
        assert server.requests.counts() == {} and reader.range_stats == stats


def _chunk_bound(index: Any, server: FaultServer, stats: Any) -> int:
    """The most a range read of ``stats.chunks`` chunks may cost: every shard's tail, the
    chunks at the largest chunk's size, and the gaps that coalescing fetches."""
    tails, largest = 0, 0
    for info in index.shards:
        data = Path(server.root or "", "ds", info.path).read_bytes()
        tails += info.tail_bytes
        largest = max(largest, *(b.length for b in record_batch_blocks(
            data[-info.tail_bytes:], len(data))))
    return tails + stats.chunks * (largest + ranges.COALESCE_GAP)


def _merged(stats: Any, reader: DatasetReader) -> int:
    """Chunk fetches saved by coalescing (requests = tails + chunk ranges)."""
    return stats.chunks - (stats.requests - stats.shards)


def test_stream_batches_are_identical_cold_warm_and_by_range(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    _, url = served

    def epoch(cache: str, by_range: DatasetReader | None = None,
              ) -> tuple[list[dict[str, Any]], Any]:
        dataset = StreamDataset(url, global_batch_size=10, rank=0, world_size=1, seed=5,
                                cache_dir=cache, shuffle_window=ROWS,
                                prefetch=PrefetchOptions(workers=1))
        batches = []
        for ref, part in dataset.planned():  # the plan's steps, as the loader reads them
            arrays = dataset.read_step(ref, part) if by_range is None else \
                {**by_range.read_located(part.shards, part.rows), "__id__": part.sample_ids}
            batches.append(dict(arrays))
        stats = dataset.reader.range_stats
        dataset.close()
        return batches, stats

    cold, cold_stats = epoch(str(tmp_path / "a"))
    warm, warm_stats = epoch(str(tmp_path / "a"))
    with DatasetReader(load_index(url), by_range=every_shard) as reader:
        ranged, _ = epoch(str(tmp_path / "b"), by_range=reader)
        assert reader.range_stats.rows == ROWS
    assert cold_stats.rows > 0 and warm_stats.rows == 0
    ids = np.concatenate([b["__id__"] for b in cold])
    assert sorted(ids.tolist()) == list(range(ROWS))  # exactly once
    for a, b, c in zip(cold, warm, ranged, strict=True):
        same(a, b)
        same(a, c)


def test_a_cold_mixture_reads_by_range_and_matches_the_warm_batches(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    """Each source's reader keeps the cold-start rule inside a mixture (one gather over
    them all), and a cold epoch equals a warm one."""
    server, url = served
    write(Path(server.root or "") / "ds2")
    sources = [Source(url, weight=0.5), Source(server.url_for("ds2"), weight=0.5)]

    def epoch() -> tuple[list[dict[str, Any]], int]:
        dataset = StreamDataset(sources, global_batch_size=10, rank=0, world_size=1, seed=5,
                                cache_dir=str(tmp_path / "cache"), shuffle_window=ROWS,
                                prefetch=PrefetchOptions(workers=1))
        batches = [dict(dataset.read_step(ref, part)) for ref, part in dataset.planned()]
        rows = sum(reader.range_stats.rows for reader in dataset.reader.readers)
        dataset.close()
        return batches, rows

    cold, cold_rows = epoch()
    warm, warm_rows = epoch()
    assert cold_rows > 0 and warm_rows == 0
    assert {int(s) for b in cold for s in b["__source__"]} == {0, 1}
    for a, b in zip(cold, warm, strict=True):
        same(a, b)


def test_a_new_writer_option_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        ShardWriter(str(tmp_path / "x"), chunk_size=0)


def test_a_dense_cold_read_waits_for_the_install(
        served: tuple[FaultServer, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ranges, "COLD_BUDGET", 1 / 16)  # less than one chunk of these shards
    monkeypatch.setattr(dataset_reader, "COLD_START_STEPS", 0)  # past the first steps
    server, url = served
    index = load_index(url)
    cache = NodeCache(index, str(tmp_path / "cache"))
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm, \
            DatasetReader(index, store=Prefetcher(cache)) as reader:
        same(reader.read_batch([3, 700]), warm.read_batch([3, 700]))
        assert reader.range_stats.chunks == 0 and cache.stats.installs == 2


def test_a_cold_shard_is_read_by_range_within_its_budget_then_installed(
        served: tuple[FaultServer, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ranges, "COLD_BUDGET", 0.25)
    monkeypatch.setattr(dataset_reader, "COLD_START_STEPS", 0)  # past the first steps
    server, url = served
    index = load_index(url)
    info = index.shards[0]
    cache = NodeCache(index, str(tmp_path / "cache"))
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm, \
            DatasetReader(index, store=Prefetcher(cache)) as reader:
        for chunk in range(-(-info.rows // info.chunk_rows)):
            ids = [chunk * info.chunk_rows]
            before = reader.range_stats.bytes
            same(reader.read_batch(ids), warm.read_batch(ids))
            if reader.range_stats.bytes == before:  # not read by range: installed for it
                break
        # (read from the install's finished file: published once it is on disk)
        assert reader.store.local_path(0) == cache.shard_path(0)
        assert cache.stats.installs == 1 and reader.range_stats.whole == 0
        assert reader.range_stats.chunks >= 1 and before <= 0.25 * info.bytes


def test_an_arrow_stream_is_read_whole_by_range(fault_server: FaultServer) -> None:
    root = Path(fault_server.root or "") / "hf"
    root.mkdir()
    table = pa.table({"id": pa.array(range(300), pa.int64())})
    with ipc.new_stream(str(root / "data-00000-of-00001.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=100):
            writer.write_batch(batch)
    build_index(str(root))
    index = load_index(fault_server.url_for("hf"))
    assert index.shards[0].format == "arrow_stream"
    with DatasetReader(index, by_range=every_shard) as reader:
        assert reader.read_batch([299, 0, 150])["id"].tolist() == [299, 0, 150]
        assert reader.range_stats.whole == 1


def test_a_forked_child_reads_by_range_through_its_parents_reader(
        served: tuple[FaultServer, str]) -> None:
    import multiprocessing

    server, url = served
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm:
        expected = warm.read_batch([5, 1500])["id"].tolist()
    reader = DatasetReader(load_index(url), by_range=every_shard)
    reader.read_batch([1, 2, 1000])  # the parent's pool threads and filesystem exist
    queue = multiprocessing.get_context("fork").Queue()

    def child() -> None:
        queue.put(reader.read_batch([5, 1500])["id"].tolist())

    process = multiprocessing.get_context("fork").Process(target=child, daemon=True)
    process.start()
    try:
        assert queue.get(timeout=60) == expected  # (a child on its parent's pool hung here)
    finally:
        process.join(30)
        if process.is_alive():
            process.terminate()
        reader.close()
    assert process.exitcode == 0


def test_the_first_steps_are_read_by_range_ahead_of_the_downloads_then_installs_take_over(
        served: tuple[FaultServer, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cold start: the first steps by range whatever their density, with the prefetcher's
    downloads held back meanwhile; then the downloads in first-use order, and later steps
    that are too dense for the cold budget wait for them."""
    monkeypatch.setattr(ranges, "COLD_BUDGET", 1 / 16)  # less than one chunk of these shards
    monkeypatch.setattr(ranges, "COLD_START_BUDGET", 1.0)  # the first steps: any density
    monkeypatch.setattr(prefetch, "HOLD_S", 600.0)  # released by the reader, not by the clock
    server, url = served
    index = load_index(url)
    cache = NodeCache(index, str(tmp_path / "cache"))
    store = Prefetcher(cache)
    shards = np.arange(len(index.shards))
    rng = np.random.default_rng(3)
    with DatasetReader(str(Path(server.root or "") / "ds")) as warm, \
            DatasetReader(index, store=store) as reader:
        store.update(shards, shards)  # every shard queued, in first-use order
        for step in range(dataset_reader.COLD_START_STEPS):
            ids = rng.choice(ROWS, 8, replace=False)  # (a few chunks of these small shards)
            same(reader.read_batch(ids), warm.read_batch(ids))
            if step < dataset_reader.COLD_START_STEPS - 1:  # (released after the last one)
                assert store.stats.tasks_done == 0 and cache.stats.installs == 0  # held
        assert reader.range_stats.shards >= 2 * len(index.shards) - 2  # (read by range)
        assert store.stats.misses == 0  # no step waited for a download
        chunks, asked = reader.range_stats.chunks, store.stats.hits + store.stats.misses
        ids = rng.choice(ROWS, 24, replace=False)
        same(reader.read_batch(ids), warm.read_batch(ids))  # released: installs serve it
        assert reader.range_stats.chunks == chunks  # (no range read)
        assert store.stats.hits + store.stats.misses > asked  # (the prefetcher's files)
        # A reader may map an install's finished file before its fsync and publish, so the
        # task may count as done only after the batch was read.
        deadline = time.monotonic() + 30
        while store.stats.tasks_done == 0:
            assert time.monotonic() < deadline, "no install was published"
            time.sleep(0.005)


def test_a_cold_epoch_costs_about_one_request_per_shard_beyond_the_first_steps(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    server, url = served
    index = load_index(url)
    dataset = StreamDataset(url, global_batch_size=64, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"))
    server.requests.reset()
    seen = []
    for batch in dataset:
        seen.extend(batch["__id__"].tolist())
    ranged = dataset.reader.range_stats.requests
    dataset.close()
    assert len(set(seen)) == len(seen) == ROWS // 64 * 64  # (the default tail: dropped)
    requests = server.requests.count() + server.requests.count(method="HEAD")
    assert requests <= 2 * len(index.shards) + ranged + 1  # (+ the index)


# ------------------------------------------------------ a node's processes share the budgets


def test_a_readers_budget_share_scales_its_cold_budgets(
        served: tuple[FaultServer, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reading process of a node has its own range reader; with the budgets split
    among them (``budget_share``) the node's range reads stay within one reader's budget."""
    _, url = served
    index = load_index(url)
    info = index.shards[0]
    monkeypatch.setattr(ranges, "COLD_BUDGET", 0.5)
    rows = np.arange(0, info.rows, 2 * info.chunk_rows)  # every other chunk: ~half the shard
    whole = RangeReader(index, Fetcher(NO_RETRIES))
    shared = RangeReader(index, Fetcher(NO_RETRIES), budget_share=0.25)
    try:
        assert whole.cold_budget_left(0, int(0.45 * info.bytes))
        assert not shared.cold_budget_left(0, int(0.45 * info.bytes))
        assert shared.cold_budget_left(0, int(0.1 * info.bytes))
        assert shared.read_rows(0, rows, cold=True) is None  # past 1/4 of the budget: awaited
        assert whole.read_rows(0, rows[:2], cold=True) is not None
    finally:
        whole.close()
        shared.close()


@pytest.mark.parametrize("value,expected", [("4", 4), ("1", 1), ("", 1), ("abc", 1), ("0", 1),
                                            ("-2", 1), ("4.0", 1), ("99999999", 1)])
def test_the_node_readers_come_from_torchruns_local_world_size(
        monkeypatch: pytest.MonkeyPatch, value: str, expected: int) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert processes.node_readers() == expected
    assert processes.node_ranks() == expected


def test_a_dataset_readers_range_reader_takes_its_share(
        served: tuple[FaultServer, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = served
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with DatasetReader(load_index(url)) as reader:
        assert reader.range_reader().budget_share == 0.25
        assert reader.range_reader().node_ranks == 4


@pytest.mark.parametrize("spread", ["even", "clustered", "every_third"])
def test_the_first_steps_budget_judges_the_nodes_step_not_a_ranks_part(
        fault_server: FaultServer, monkeypatch: pytest.MonkeyPatch, spread: str) -> None:
    """A node of 1, 2 or 4 ranks (``node_ranks``) makes the same choice for the same first
    step: each rank reads its part by range where the node's rows are sparse in the shard,
    and every rank waits for the install (None, no request) where they are dense, however
    small its own part; counted in the chunks' own bytes, so chunks far apart, side by side
    or with gaps that coalescing fetches too are judged alike; a rank's footer is its own
    cost, not the node's."""
    monkeypatch.setattr(ranges, "COLD_START_BUDGET", 1 / 16)
    write(Path(fault_server.root or "") / "fine", chunk_size=4 << 10, shard_size=8 << 20)
    index = load_index(fault_server.url_for("fine"))
    info = index.shards[0]
    assert len(index.shards) == 1 and info.chunk_rows is not None
    chunks = -(-info.rows // info.chunk_rows)
    assert chunks >= 256
    for share, sparse in ((1 / 40, True), (1 / 10, False)):
        count = int(chunks * share)
        picked = {"even": np.linspace(0, chunks - 1, count).astype(np.int64),
                  "clustered": np.arange(count, dtype=np.int64),  # one span
                  "every_third": np.arange(0, 3 * count, 3, dtype=np.int64),  # spans of 3
                  }[spread]
        node_rows = picked * info.chunk_rows  # one row of each picked chunk
        for ranks in (1, 2, 4):
            before = served_bytes(fault_server)
            reader = RangeReader(index, Fetcher(NO_RETRIES), node_ranks=ranks)
            try:
                part = node_rows[::ranks]  # (a rank's part: every ranks-th row of the step)
                result = reader.read_rows(0, part, cold=True, dense=True)
                assert (result is not None) == sparse, (share, ranks)
                if result is None:
                    assert reader.stats.chunks == 0  # (its footer only: nothing of the rows)
                else:
                    held, local = result  # the rows asked for, from shard 0 (ids 0, 1, ...)
                    ids = held.batch.column("id").to_numpy()[local]
                    np.testing.assert_array_equal(ids, part)
            finally:
                reader.close()
            assert served_bytes(fault_server) > before  # (the footer at least was read)


class _Readers(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        yield processes.node_readers()


def test_a_dataloader_worker_counts_its_rank_s_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loader = torch.utils.data.DataLoader(_Readers(), num_workers=2, batch_size=None)
    assert sorted(int(x) for x in loader) == [4, 4]
