"""Range reads against servers that answer badly, and data that range reads cannot verify.

The server surface (tests/servers.py faults): a server that ignores ``Range`` (200 and the
whole object), one that sends the wrong bytes for a range (right length and Content-Range),
short bodies, stalls, and a store with a first-byte latency. What the user gets: the exact
batches (falling back to whole, verified downloads), or a clear error; never a wrong sample.

The data surface: shards without per-range digests (Parquet, Arrow files not written by
ShardWriter) are never served by range before they are verified, unless the user allows it
(``FetchOptions(allow_unverified_ranges=True)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from servers import FaultServer, StoreModel

from streamcache import DatasetReader, StreamDataset, StreamLoader, load_index, write_dataset
from streamcache.cache.node import NodeCache
from streamcache.cache.prefetch import Prefetcher
from streamcache.errors import ChecksumMismatchError
from streamcache.format.index import build_index
from streamcache.format.reader import Ragged
from streamcache.remote.options import FetchOptions

ROWS = 4000
FAST = FetchOptions(retries=2, backoff_initial_s=0.0, backoff_max_s=0.0)


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"tokens": rng.integers(0, 50_000, 250, dtype=np.int32), "id": i}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dataset at the defaults (zstd, default chunk and shard sizes: one ~4 MB shard of
    ~64 KiB chunks), written once for the module; each test serves a copy."""
    folder = tmp_path_factory.mktemp("data") / "ds"
    write_dataset((sample(i) for i in range(ROWS)), str(folder))
    return folder


@pytest.fixture
def served(dataset: Path, fault_server: FaultServer) -> tuple[FaultServer, str]:
    target = Path(fault_server.root or "") / "ds"
    target.mkdir()
    for item in dataset.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return fault_server, fault_server.url_for("ds")


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, Ragged):
            np.testing.assert_array_equal(x.values, y.values)
            np.testing.assert_array_equal(x.offsets, y.offsets)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def cold_batches(url: str, cache: Path, steps: int, batch: int = 8,
                 out: list[dict[str, Any]] | None = None, **options: Any,
                 ) -> list[dict[str, Any]]:
    """The first ``steps`` batches of a cold StreamLoader at the defaults (appended to
    ``out`` as they arrive)."""
    dataset = StreamDataset(url, global_batch_size=batch, rank=0, world_size=1,
                            cache_dir=str(cache), **options)
    out = [] if out is None else out
    with StreamLoader(dataset) as loader:
        for batch in loader:
            out.append(batch)
            if len(out) == steps:
                break
    dataset.close()
    return out


def check_ids(batches: list[dict[str, Any]]) -> None:
    for batch in batches:
        ids = np.asarray(batch["__id__"])
        np.testing.assert_array_equal(np.asarray(batch["id"]), ids)
        for row, i in zip(batch["tokens"], ids.tolist(), strict=True):
            np.testing.assert_array_equal(np.asarray(row), sample(i)["tokens"])


# --------------------------------------------------------------------------- the server


def test_a_server_that_ignores_range_falls_back_to_whole_downloads(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    server, url = served
    server.faults.configure(rate=1.0, kinds=("ignore_range",))
    batches = cold_batches(url, tmp_path / "cache", steps=3)
    check_ids(batches)
    assert server.faults.injected["ignore_range"] >= 1  # the cold start did try a range
    index = load_index(url)
    with DatasetReader(index, by_range=lambda u: np.ones(len(u), bool), fetch=FAST) as reader:
        ids = np.array([3, 1999, 17])
        batch = reader.read_batch(ids)
        np.testing.assert_array_equal(batch["id"], ids)
        assert reader.range_stats.whole == 1  # the whole object, verified, once


def test_a_server_that_sends_the_wrong_bytes_for_a_range_serves_nothing_wrong(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    server, url = served
    server.faults.configure(rate=1.0, kinds=("shifted_range",))
    check_ids(cold_batches(url, tmp_path / "cache", steps=2))  # installs, verified
    index = load_index(url)
    with DatasetReader(index, by_range=lambda u: np.ones(len(u), bool), fetch=FAST) as reader, \
            pytest.raises(ChecksumMismatchError, match="corrupt or the object was rewritten"):
        reader.read_batch([5])


def test_short_and_stalled_range_answers_are_retried(
        served: tuple[FaultServer, str], tmp_path: Path) -> None:
    server, url = served
    index = load_index(url)
    path = f"/ds/{index.shards[0].path}"
    server.faults.configure(delay_s=2.0)
    server.faults.script(path, ["truncate", None, "stall"])
    options = FetchOptions(retries=3, backoff_initial_s=0.0, timeout_s=0.5)
    with DatasetReader(index, by_range=lambda u: np.ones(len(u), bool), fetch=options) as reader:
        ids = np.array([1, 2000, 3999])
        np.testing.assert_array_equal(reader.read_batch(ids)["id"], ids)
        assert reader.range_stats.whole == 0
    assert server.faults.injected["truncate"] == 1 and server.faults.injected["stall"] == 1


def test_a_store_with_latency_serves_exact_batches_cold(
        dataset: Path, tmp_path: Path) -> None:
    store = StoreModel(latency_s=0.03, bandwidth=200e6)
    with FaultServer(root=dataset.parent, store=store) as server:
        batches = cold_batches(server.url_for("ds"), tmp_path / "cache", steps=3)
        check_ids(batches)
        assert server.requests.count() >= 2


def test_the_server_lists_a_bucket_as_s3_does(dataset: Path) -> None:
    import s3fs

    with FaultServer(root=dataset.parent) as server:
        fs = s3fs.S3FileSystem(anon=True, client_kwargs={"endpoint_url": server.url},
                               skip_instance_cache=True)
        names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("ds"))
        assert names == sorted(p.name for p in dataset.iterdir())
        info = fs.info("ds/index.json")
        assert info["size"] == (dataset / "index.json").stat().st_size
        assert fs.cat_file("ds/index.json", start=2, end=10) == \
            (dataset / "index.json").read_bytes()[2:10]


# --------------------------------------------------------------------------- unverified data


def _parquet(root: Path, seed: int, rows: int = 3000, group: int = 100) -> pa.Table:
    """Uncompressed, so that another seed gives a file of the same size."""
    rng = np.random.default_rng(seed)
    table = pa.table({"id": pa.array(np.arange(rows), pa.int64()),
                      "payload": pa.array([rng.bytes(300) for _ in range(rows)])})
    pq.write_table(table, root / "a.parquet", row_group_size=group, compression="none")
    return table


def test_checksummed_parquet_rewritten_with_the_same_size_serves_no_wrong_sample(
        fault_server: FaultServer, tmp_path: Path) -> None:
    root = Path(fault_server.root or "") / "pq"
    root.mkdir()
    # ~9 MB in 60 row groups: a batch of 2 rows fits the cold budget (1/16 of the file)
    _parquet(root, seed=1, rows=30_000, group=500)
    size = (root / "a.parquet").stat().st_size
    build_index(str(root), checksums=True)
    _parquet(root, seed=2, rows=30_000, group=500)  # rewritten: other payloads, same size
    assert (root / "a.parquet").stat().st_size == size
    served: list[dict[str, Any]] = []
    with pytest.raises(ChecksumMismatchError):
        cold_batches(fault_server.url_for("pq"), tmp_path / "cache", steps=8, batch=2,
                     out=served, fetch=FAST)
    assert served == []  # no batch was delivered before the download was verified


def test_unverified_range_reads_are_a_documented_choice(
        fault_server: FaultServer, tmp_path: Path) -> None:
    root = Path(fault_server.root or "") / "pq"
    root.mkdir()
    table = _parquet(root, seed=1, rows=30_000, group=250)
    build_index(str(root), checksums=True)
    index = load_index(fault_server.url_for("pq"))
    ids = np.array([5, 50])  # one row group: with its footer, within the cold budget
    for allowed in (False, True):
        cache = NodeCache(index, str(tmp_path / f"cache-{allowed}"),
                          fetch_options=FetchOptions(allow_unverified_ranges=allowed))
        with DatasetReader(index, store=Prefetcher(cache)) as reader:
            batch = reader.read_batch(ids)
            assert [batch["payload"][i] for i in range(2)] == \
                [table["payload"][int(i)].as_py() for i in ids]
            assert (reader.range_stats.shards > 0) == allowed
    assert os.path.exists(root / "a.parquet")


def test_reads_that_start_at_once_fetch_a_shards_footer_once(dataset: Path) -> None:
    """Threads that read rows of the same shard at once (a node's first unit installs) wait
    for one footer request instead of each making one (a store's first-byte latency makes
    them overlap)."""
    from streamcache.cache.ranges import RangeReader
    from streamcache.remote.fetch import Fetcher

    with FaultServer(root=dataset.parent, store=StoreModel(latency_s=0.2)) as server:
        index = load_index(server.url_for("ds"))
        info = index.shards[0]
        assert info.chunk_rows is not None and info.rows // info.chunk_rows >= 8
        path = "/ds/" + info.path
        before = server.requests.count(path)
        reader = RangeReader(index, Fetcher(FAST), threads=8)
        try:
            rows = [np.array([chunk * info.chunk_rows]) for chunk in range(8)]
            found = reader.read_many([(0, r) for r in rows])
        finally:
            reader.close()
        for (shard_reader, local), wanted in zip(found, rows, strict=True):
            ids = shard_reader.batch.column("id").to_numpy()
            assert ids[local].tolist() == wanted.tolist()
        assert server.requests.count(path) - before == 1 + 8  # one footer, one range a chunk
