"""The node cache (streamcache/cache/node.py) with real files, a real HTTP server and real
processes.

Datasets are small (a dozen shards of a few KB) and served by the fault-injecting HTTP server
on 127.0.0.1, which counts requests per path: "one download per shard per node" is checked at
the server. Multi-process tests use ``spawn`` processes; the crash test uses SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dist import process_context  # fresh processes forked from a server, imports done once
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import FaultServer, S3Bucket

from streamcache import DatasetReader, StreamDataset, StreamLoader, load_index, write_dataset
from streamcache.cache import install, ledger
from streamcache.cache.accounting import ACCOUNTING_LOCK, ACCOUNTING_NAME, file_lock
from streamcache.cache.eviction import (
    Resident,
    choose_victims,
    simulate_fetches,
    victims_in_order,
)
from streamcache.cache.node import NodeCache
from streamcache.cache.temporaries import FOREIGN_TEMP_IDLE_S
from streamcache.errors import CacheBudgetError, ChecksumMismatchError
from streamcache.format.index import DatasetIndex, build_index
from streamcache.format.materialize import is_local_layout
from streamcache.format.reader import ShardReader
from streamcache.processes import process_alive, process_token
from streamcache.remote.options import FetchOptions
from streamcache.remote.retry import FetchError

SCHEMA = {"id": "int", "x": "tensor:int32:16", "blob": "bytes"}
ROWS_PER_SHARD = 40
FAST_RETRIES = FetchOptions(retries=6, backoff_initial_s=0.01, backoff_max_s=0.05,
                            timeout_s=5.0)


def sample(i: int) -> dict[str, Any]:
    """Sample ``i``: every field derived from its id, so any read can be checked."""
    rng = np.random.default_rng(i)
    return {"id": i, "x": np.arange(16, dtype=np.int32) + i,
            "blob": rng.bytes(100 + i % 50)}


def write_shards(folder: Path, num_shards: int = 12, compression: str | None = "zstd",
                 ) -> DatasetIndex:
    samples = (sample(i) for i in range(num_shards * ROWS_PER_SHARD))
    # shard_size in raw bytes: about ROWS_PER_SHARD rows of ~230 bytes
    # (min_savings 0: a compressed dataset here is every shard compressed, so installed;
    # its random blobs would leave some shards uncompressed, read in place, at the default)
    index = write_dataset(samples, str(folder), schema=SCHEMA, shard_size=ROWS_PER_SHARD * 228,
                          compression=compression, compression_min_savings=0)
    return index


def serve_dataset(server: FaultServer, name: str = "ds", **kwargs: Any) -> DatasetIndex:
    """Write a dataset under the server's root and load its index over HTTP."""
    write_shards(Path(server.root or "") / name, **kwargs)
    return load_index(server.url_for(f"{name}/index.json"))


def check_batch(batch: dict[str, Any], ids: np.ndarray) -> None:
    assert batch["id"].tolist() == ids.tolist()
    for row, i in enumerate(ids.tolist()):
        expected = sample(i)
        assert batch["x"][row].tolist() == expected["x"].tolist()
        assert batch["blob"][row] == expected["blob"]


def read_everything(reader: DatasetReader, seed: int = 0, batch: int = 32) -> int:
    ids = np.random.default_rng(seed).permutation(len(reader))
    for start in range(0, len(ids), batch):
        chunk = ids[start:start + batch]
        check_batch(reader.read_batch(chunk), chunk)
    return len(ids)


def shard_gets(server: FaultServer, name: str = "ds") -> dict[str, int]:
    return {p: n for p, n in server.requests.counts().items()
            if p.startswith(f"/{name}/shard-")}


def installed_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "datasets").glob("*/*.arrow"))


def check_installed(index: DatasetIndex, cache_dir: Path) -> int:
    """Every installed file is a whole shard in the local layout with the right rows."""
    for path in installed_files(cache_dir):
        shard = int(path.stem)
        assert is_local_layout(str(path), index.schema), path
        with ShardReader(str(path), index.schema,
                         expected_rows=index.shards[shard].rows) as reader:
            first = int(index.shard_rows[:shard].sum())
            last = first + index.shards[shard].rows - 1
            assert reader.row(0)["id"] == first
            row = reader.row(index.shards[shard].rows - 1)
            assert row["id"] == last and row["blob"] == sample(last)["blob"]
    return len(installed_files(cache_dir))


def accounting(cache_dir: Path) -> dict[str, int]:
    """Bytes per key, from the accounting file replayed (a header, then "add" and "remove"
    records: the format of cache/ledger.py, read independently)."""
    header, *records = (cache_dir / ACCOUNTING_NAME).read_bytes().splitlines()
    assert json.loads(header)["version"] == 2
    entries: dict[str, int] = {}
    for line in records:
        record = json.loads(line)
        if "remove" in record:
            entries.pop(record["remove"], None)
        else:
            entries[record["add"]] = record["bytes"]
    return entries


def write_one_row_shards(folder: Path, count: int) -> DatasetIndex:
    """``count`` zstd Arrow files of one row each (sample i: {"id": i}), indexed with
    checksums: each is installed (decoded), none read in place. Written with pyarrow and
    indexed, which is much faster than ShardWriter for thousands of shards."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    folder.mkdir(parents=True)
    schema = pa.schema([("id", pa.int64())])
    options = ipc.IpcWriteOptions(compression="zstd")
    for i in range(count):
        with ipc.new_file(str(folder / f"part-{i:06d}.arrow"), schema, options=options) as f:
            f.write_batch(pa.record_batch([pa.array([i], pa.int64())], schema=schema))
    return build_index(str(folder), checksums=True)


_accounting_watchers: list[list[str]] = []
_hook_added = False


def _watch_accounting(event: str, args: tuple[Any, ...]) -> None:
    """An audit hook: each write of an accounting file by this process, to every watcher."""
    if not _accounting_watchers:
        return
    if event == "os.rename" and os.path.basename(str(args[1])) == ACCOUNTING_NAME:
        kind = "rewrite"  # a whole new file renamed over it
    elif (event == "open" and os.path.basename(str(args[0])) == ACCOUNTING_NAME
          and args[2] & (os.O_WRONLY | os.O_RDWR)):
        kind = "append" if args[2] & os.O_APPEND else "rewrite"
    else:
        return
    for watcher in list(_accounting_watchers):
        watcher.append(kind)


@contextlib.contextmanager
def accounting_writes() -> Iterator[list[str]]:
    """The writes of accounting files this process makes while the block runs, from any
    thread: "rewrite" (a file renamed over it, or opened to write in place) or "append"."""
    global _hook_added
    if not _hook_added:
        sys.addaudithook(_watch_accounting)  # (hooks cannot be removed: added once)
        _hook_added = True
    seen: list[str] = []
    _accounting_watchers.append(seen)
    try:
        yield seen
    finally:
        _accounting_watchers.remove(seen)



def node_view(cache_dir: Path) -> tuple[dict[str, int], dict[str, int] | None]:
    """What the node holds at one moment, read with the cache-wide lock held (no install or
    eviction in between): the installed files (bytes per key) and the accounting file
    replayed (None when it does not validate: the next process rebuilds it from the files)."""
    with file_lock(str(cache_dir), ACCOUNTING_LOCK):
        files = {str(path.relative_to(cache_dir)): path.stat().st_size
                 for path in installed_files(cache_dir)}
        try:
            books: dict[str, int] | None = accounting(cache_dir)
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            books = None
    return files, books


def installed_size(index: DatasetIndex, folder: Path) -> int:
    """Bytes shard 0 of ``index`` takes installed (installed into ``folder`` to see)."""
    with NodeCache(index, str(folder)) as probe:
        return os.path.getsize(probe.local_path(0))


def walked_bytes(cache_dir: Path) -> int:
    """Bytes of the installed files now (one evicted between the listing and its stat is gone,
    and counts nothing)."""
    total = 0
    for path in installed_files(cache_dir):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


# --------------------------------------------------------------------------- single process


def test_installs_each_shard_once_and_serves_dataset_reader(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    cache_dir = tmp_path / "cache"
    with DatasetReader(index, store=NodeCache(index, str(cache_dir))) as reader:
        assert read_everything(reader) == index.num_samples
        stats = reader.store.stats  # type: ignore[attr-defined]
    assert set(shard_gets(fault_server).values()) == {1}
    assert stats.installs == len(index.shards) and stats.bytes_fetched == index.total_bytes
    assert check_installed(index, cache_dir) == len(index.shards)
    assert accounting(cache_dir) and sum(accounting(cache_dir).values()) == walked_bytes(cache_dir)
    assert not any((cache_dir / "tmp").iterdir())  # close removed this process's temporaries
    # a second cache on the same directory (a restart, another process) downloads nothing
    with DatasetReader(index, store=NodeCache(index, str(cache_dir))) as reader:
        read_everything(reader, seed=1)
    assert set(shard_gets(fault_server).values()) == {1}


def test_local_uncompressed_source_is_read_in_place_never_copied(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", compression=None)
    cache = NodeCache(index, str(tmp_path / "cache"), cache_limit=1)  # 1 byte: nothing to cache
    with DatasetReader(index, store=cache) as reader:
        read_everything(reader)
        assert cache.local_path(0) == str(tmp_path / "ds" / index.shards[0].path)
    assert installed_files(tmp_path / "cache") == []
    assert cache.usage().bytes == 0


def test_local_compressed_source_is_materialized_into_the_cache(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=3)
    with DatasetReader(index, store=NodeCache(index, str(tmp_path / "cache"))) as reader:
        read_everything(reader)
    assert check_installed(index, tmp_path / "cache") == len(index.shards)


def test_a_remote_uncompressed_shard_is_installed_as_downloaded_without_a_decode(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An uncompressed chunked shard (what ShardWriter stores where compression does not pay)
    is already the layout the reader maps: the install keeps the verified download, byte for
    byte, and never decodes and rewrites it (its download used to be named ``*.download``,
    which the layout check refused by its extension)."""
    index = serve_dataset(fault_server, num_shards=3, compression=None)

    def no_decode(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an uncompressed shard was decoded on install")

    monkeypatch.setattr("streamcache.cache.install.materialize", no_decode)
    with DatasetReader(index, store=NodeCache(index, str(tmp_path / "cache"))) as reader:
        read_everything(reader)
    assert check_installed(index, tmp_path / "cache") == 3
    for path in installed_files(tmp_path / "cache"):
        source = Path(fault_server.root or "") / "ds" / index.shards[int(path.stem)].path
        assert path.read_bytes() == source.read_bytes()


def test_budget_smaller_than_the_working_set_is_refused_with_the_minimum(
        tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=3)
    largest = max(NodeCache(index, str(tmp_path / "c0")).estimated_bytes(k)
                  for k in range(len(index.shards)))
    with pytest.raises(CacheBudgetError, match=f"at least {largest} bytes"):
        NodeCache(index, str(tmp_path / "c1"), cache_limit=largest - 1)
    with pytest.raises(CacheBudgetError, match="at least 500000 bytes"):
        NodeCache(index, str(tmp_path / "c2"), cache_limit=400_000, working_set_bytes=500_000)
    NodeCache(index, str(tmp_path / "c3"), cache_limit=500_000, working_set_bytes=500_000)


def test_eviction_takes_the_farthest_next_use_then_falls_back_to_lru(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=6)
    probe = NodeCache(index, str(tmp_path / "probe"))
    probe.install(0)
    size = os.path.getsize(probe.shard_path(0))
    limit = 3 * size + size // 2  # three shards (they are about the same size)
    cache = NodeCache(index, str(tmp_path / "cache"), cache_limit=limit)
    for shard in (0, 1, 2):
        cache.install(shard)
    next_use = {0: 50.0, 1: 900.0, 2: 10.0, 3: 5.0}
    cache.set_next_use(lambda k: next_use.get(k, float("inf")))
    cache.install(3)
    assert [cache.contains(k) for k in range(4)] == [True, False, True, True]
    cache.set_next_use(None)  # no plan: least recently used goes
    time.sleep(0.01)
    cache.local_path(0)
    cache.local_path(3)
    cache.install(4)
    assert [cache.contains(k) for k in range(5)] == [True, False, False, True, True]
    assert cache.usage().bytes <= limit and walked_bytes(tmp_path / "cache") <= limit
    assert cache.stats.evictions == 2


def test_victims_in_order_counts_huge_entries_exactly() -> None:
    """Entries as large as the accounting allows (< 2**62 each) sum past int64 without
    wrapping around: the cache still evicts what it must."""
    huge = (1 << 62) - 1
    keys = ["a", "b", "c"]
    got = victims_in_order(keys, np.array([huge, huge, 10], np.int64), np.array([1.0, 2.0, 3.0]),
                           np.full(3, math.inf), 10, 1 << 62, lambda key: False)
    assert got == ["a", "b"]


def test_without_a_plan_a_shard_read_after_the_others_installs_outlives_them(
        tmp_path: Path) -> None:
    """Recency is a read's as well as an install's (the process's own reads, after the grace
    that protects a shard just handed out has passed)."""
    index = write_shards(tmp_path / "ds", num_shards=4)
    probe = NodeCache(index, str(tmp_path / "probe"))
    sizes = []
    for shard in range(4):
        probe.install(shard)
        sizes.append(os.path.getsize(probe.shard_path(shard)))
    limit = sum(sizes) - min(sizes) // 2  # room for three, not four
    cache = NodeCache(index, str(tmp_path / "cache"), cache_limit=limit)
    for shard in (0, 1, 2):
        cache.install(shard)
        time.sleep(0.01)
    assert cache.local_path(0) is not None  # read last, installed first
    long_ago = time.time() - 3600  # (past the grace of a shard just handed out)
    for shard in (0, 1, 2):
        os.utime(cache.shard_path(shard), (long_ago, long_ago))
    cache.install(3)
    assert [cache.contains(k) for k in range(4)] == [True, False, True, True]


def test_evicting_a_mapped_shard_does_not_break_its_reader(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    probe = NodeCache(index, str(tmp_path / "x"))
    largest = max(probe.estimated_bytes(k) for k in range(len(index.shards)))
    cache = NodeCache(index, str(tmp_path / "cache"), cache_limit=largest + 10)
    reader = ShardReader(cache.local_path(0), index.schema, expected_rows=index.shards[0].rows)
    cache.install(1)  # evicts shard 0 while it is mapped
    assert not cache.contains(0)
    assert [reader.row(r)["id"] for r in range(3)] == [0, 1, 2]
    assert reader.row(5)["blob"] == sample(5)["blob"]
    reader.close()


def test_accounting_is_rebuilt_from_the_directory_when_a_cache_opens(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    cache_dir = tmp_path / "cache"
    cache = NodeCache(index, str(cache_dir))
    for shard in range(3):
        cache.install(shard)
    # what a crash can leave: an entry without its file (renamed away) or a torn file
    os.unlink(cache.shard_path(2))
    NodeCache(index, str(cache_dir))
    assert sum(accounting(cache_dir).values()) == walked_bytes(cache_dir)
    assert len(accounting(cache_dir)) == 2
    (cache_dir / ACCOUNTING_NAME).write_text("{not json")
    assert NodeCache(index, str(cache_dir)).usage().bytes == walked_bytes(cache_dir)


def test_many_small_shards_install_without_a_rewrite_of_the_accounting_each(
        tmp_path: Path) -> None:
    """A first epoch of one-row shards used to rewrite the whole accounting file on every
    install (O(installs) rewrites of an O(installs) file: ~16 installs/s at 10,000 shards).
    Installs now append a record; the file is rewritten when a cache opens and now and
    then to drop records of evicted shards."""
    shards = 1000
    index = write_one_row_shards(tmp_path / "ds", shards)
    cache_dir = tmp_path / "cache"
    with accounting_writes() as writes:
        dataset = StreamDataset(index.url, global_batch_size=50, rank=0, world_size=1,
                                cache_dir=str(cache_dir))
        with StreamLoader(dataset) as loader:
            ids = [i for batch in loader for i in batch["id"].tolist()]
        dataset.close()
    assert sorted(ids) == list(range(shards))
    assert len(installed_files(cache_dir)) == shards
    assert writes.count("rewrite") <= shards // 100, writes.count("rewrite")
    assert writes.count("append") >= shards  # (the records are written, one install at a time)
    assert sum(accounting(cache_dir).values()) == walked_bytes(cache_dir)
    assert len(accounting(cache_dir)) == shards


def test_stale_temporaries_of_dead_processes_are_removed_live_ones_kept(
        tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c",
         "from streamcache.processes import process_token as t; print(t())"],
        check=True, capture_output=True, text=True).stdout.strip()
    assert process_alive(dead) is False and process_alive(process_token()) is True
    assert process_alive("garbage") is False and process_alive("nobootid-1-1-1") is False
    boot, _, pid, start = process_token().split("-")
    container = f"{boot}-1-{pid}-{start}"  # another pid namespace: liveness unknown
    old_container = f"{boot}-2-{pid}-{start}"
    assert process_alive(container) is None
    index = write_shards(tmp_path / "ds", num_shards=2)
    tmp = tmp_path / "cache" / "tmp"
    for token in (dead, process_token(), container, old_container):
        (tmp / token / "abc").mkdir(parents=True)
        (tmp / token / "abc" / "000001.download").write_bytes(b"partial")
    long_ago = time.time() - 2 * FOREIGN_TEMP_IDLE_S
    for path in [tmp / old_container, *(tmp / old_container).rglob("*")]:
        os.utime(path, (long_ago, long_ago))
    NodeCache(index, str(tmp_path / "cache"))
    assert sorted(p.name for p in tmp.iterdir()) == sorted([process_token(), container])


def test_a_permanently_missing_shard_fails_at_once_with_the_url(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    os.unlink(Path(fault_server.root or "") / "ds" / index.shards[3].path)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    started = time.monotonic()
    with pytest.raises(FetchError, match=index.shards[3].path) as caught:
        cache.local_path(3)
    assert caught.value.permanent and time.monotonic() - started < 5
    assert installed_files(tmp_path / "cache") == []
    assert cache.local_path(4)  # the others are fine


def test_a_corrupted_body_is_detected_and_fetched_again(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    path = f"/ds/{index.shards[2].path}"
    fault_server.faults.script(path, ["corrupt", "corrupt"])
    with DatasetReader(index, store=NodeCache(index, str(tmp_path / "cache"),
                                              fetch_options=FAST_RETRIES)) as reader:
        read_everything(reader)
    assert fault_server.requests.count(path) == 3
    fault_server.faults.configure(rate=1.0, kinds=("corrupt",))
    cache = NodeCache(index, str(tmp_path / "other"),
                      fetch_options=FetchOptions(retries=1, backoff_initial_s=0.01))
    with pytest.raises(ChecksumMismatchError):
        cache.local_path(5)
    assert installed_files(tmp_path / "other") == []


# --------------------------------------------------------------------------- several processes


def _stream_in_process(index_url: str, cache_dir: str, seed: int, prefetch: bool,
                       start: Any, results: Any, storage_options: dict[str, Any]) -> None:
    """A 'rank' of a node: stream the whole dataset through the shared cache."""
    from streamcache.cache.prefetch import Prefetcher, PrefetchOptions

    index = load_index(index_url, storage_options)
    cache = NodeCache(index, cache_dir, fetch_options=FAST_RETRIES,
                      storage_options=storage_options)
    store: Any = Prefetcher(cache, PrefetchOptions(workers=3)) if prefetch else cache
    start.wait()
    if prefetch:
        order = np.random.default_rng(seed).permutation(len(index.shards))
        store.update(order, np.arange(len(order)))
    with DatasetReader(index, store=store) as reader:
        results.put((seed, read_everything(reader, seed=seed)))


def run_processes(index_url: str, cache_dir: Path, count: int, prefetch: bool,
                  storage_options: dict[str, Any] | None = None) -> list[int]:
    ctx = process_context()
    start, results = ctx.Barrier(count), ctx.Queue()
    procs = [ctx.Process(target=_stream_in_process,
                         args=(index_url, str(cache_dir), seed, prefetch, start, results,
                               storage_options or {}))
             for seed in range(count)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [p.exitcode for p in procs] == [0] * count
    return sorted(results.get(timeout=5)[1] for _ in range(count))


@pytest.mark.parametrize("prefetch", [False, True], ids=["cache", "prefetch"])
def test_four_processes_on_a_node_download_every_shard_exactly_once(
        fault_server: FaultServer, tmp_path: Path, prefetch: bool) -> None:
    index = serve_dataset(fault_server)
    fault_server.faults.configure(rate=1.0, kinds=("slow",), delay_s=0.05)  # widen the races
    counts = run_processes(fault_server.url_for("ds/index.json"), tmp_path / "cache", 4,
                           prefetch)
    assert counts == [index.num_samples] * 4
    gets = shard_gets(fault_server)
    assert len(gets) == len(index.shards) and set(gets.values()) == {1}, gets
    assert check_installed(index, tmp_path / "cache") == len(index.shards)
    assert sum(accounting(tmp_path / "cache").values()) == walked_bytes(tmp_path / "cache")


def test_four_processes_stream_one_s3_dataset_with_one_get_per_shard(
        s3_bucket: S3Bucket, s3_fault_proxy: FaultServer, tmp_path: Path) -> None:
    prefix = f"cache-{tmp_path.name}"
    direct = s3_bucket.storage_options()
    index = write_dataset((sample(i) for i in range(8 * ROWS_PER_SHARD)),
                          s3_bucket.url(prefix), schema=SCHEMA,
                          shard_size=ROWS_PER_SHARD * 228, storage_options=direct)
    via_proxy = s3_bucket.storage_options(via=s3_fault_proxy.url)
    counts = run_processes(s3_bucket.url(prefix), tmp_path / "cache", 4, True, via_proxy)
    assert counts == [index.num_samples] * 4
    # (and the first steps' range reads of each process: rows, not shards)
    gets = {p: n for p, n in s3_fault_proxy.requests.whole_counts().items() if "/shard-" in p}
    assert gets == {f"/{s3_bucket.name}/{prefix}/{s.path}": 1 for s in index.shards}


def _stream_until_killed(index_url: str, cache_dir: str, seed: int) -> None:
    # downloads through a temporary file, whose presence shows that a kill landed
    # mid-download (a small compressed shard is otherwise fetched into memory, where a kill
    # leaves nothing behind to see; test_sigkill_while_small_shards_install_... covers that)
    install.MEMORY_INSTALL_BYTES = 0
    index = load_index(index_url)
    cache = NodeCache(index, cache_dir, fetch_options=FAST_RETRIES)
    threads = [threading.Thread(target=lambda k=k: [cache.install(s) for s in range(k, len(
        index.shards), 3)]) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    while True:  # (every shard installed before the kill: a later round; wait for it)
        time.sleep(1)


def test_sigkill_during_downloads_and_installs_leaves_nothing_trusted(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server, num_shards=24)
    url = fault_server.url_for("ds/index.json")
    cache_dir = tmp_path / "cache"
    fault_server.faults.configure(rate=0.5, kinds=("slow", "stall"), delay_s=0.1)
    ctx = process_context()
    rng = random.Random(7)
    killed_with_temporaries = 0
    for round_number in range(4):
        proc = ctx.Process(target=_stream_until_killed, args=(url, str(cache_dir), round_number))
        proc.start()
        deadline = time.monotonic() + 20
        before = len(installed_files(cache_dir))  # wait until it is busy installing
        while len(installed_files(cache_dir)) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        killed_with_temporaries += any((cache_dir / "tmp").rglob("*.*"))
        check_installed(index, cache_dir)  # only whole shards were ever published
    assert killed_with_temporaries >= 1  # the kills did land mid-download
    fault_server.faults.clear()
    with DatasetReader(index, store=NodeCache(index, str(cache_dir))) as reader:
        read_everything(reader)
        assert list((cache_dir / "tmp").iterdir()) in ([], [cache_dir / "tmp" / process_token()])
    assert check_installed(index, cache_dir) == len(index.shards)
    assert sum(accounting(cache_dir).values()) == walked_bytes(cache_dir)
    assert not any((cache_dir / "tmp").iterdir())


def _install_until_killed(index_folder: str, cache_dir: str, limit: int, seed: int) -> None:
    ledger.COMPACT_SLACK = 8  # the file is rewritten often, so that kills land there too
    index = load_index(index_folder)
    cache = NodeCache(index, cache_dir, cache_limit=limit, working_set_bytes=1)
    rng = random.Random(seed)
    while True:
        cache.install(rng.randrange(len(index.shards)))


def test_sigkill_while_small_shards_install_and_evict_leaves_books_the_next_process_trusts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed at random moments of installs, evictions and accounting rewrites:
    after each kill every installed file is counted (so it can be evicted) and within the
    budget; a process that lived through the kill goes on within the budget; the next
    process counts exactly the files there."""
    index = write_one_row_shards(tmp_path / "ds", 60)
    cache_dir = tmp_path / "cache"
    limit = 12 * installed_size(index, tmp_path / "probe")
    monkeypatch.setattr(ledger, "COMPACT_SLACK", 8)
    survivor = NodeCache(index, str(cache_dir), cache_limit=limit, working_set_bytes=1)
    ctx = process_context()
    rng = random.Random(11)
    left_temporaries = 0
    for round_number in range(5):
        proc = ctx.Process(target=_install_until_killed,
                           args=(str(tmp_path / "ds"), str(cache_dir), limit, round_number))
        proc.start()
        deadline = time.monotonic() + 20
        while not any((cache_dir / "tmp").rglob("*.*")) and time.monotonic() < deadline:
            time.sleep(0.005)  # until it is installing
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        left_temporaries += any(p.is_file() for p in (cache_dir / "tmp").rglob("*"))
        files, books = node_view(cache_dir)
        assert sum(files.values()) <= limit
        assert books is None or set(files) <= set(books)  # nothing there that is not counted
        assert survivor.usage().bytes >= sum(files.values())
        for shard in rng.sample(range(len(index.shards)), 10):
            survivor.install(shard)
        files, books = node_view(cache_dir)
        assert sum(files.values()) <= limit and books is not None and set(files) <= set(books)
        with NodeCache(index, str(cache_dir), cache_limit=limit, working_set_bytes=1) as after:
            usage = after.usage()
            files, books = node_view(cache_dir)
            assert (usage.bytes, usage.shards) == (sum(files.values()), len(files))
            assert books == files  # nothing counted that is not there
    assert left_temporaries >= 1  # the kills did land mid-install
    survivor.close()


def test_the_accounting_file_stays_small_while_a_tight_budget_evicts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evictions append records too; the file is rewritten once they outnumber the entries
    (twice over, plus a slack), so it does not grow with the installs."""
    monkeypatch.setattr(ledger, "COMPACT_SLACK", 16)
    index = write_one_row_shards(tmp_path / "ds", 40)
    cache_dir = tmp_path / "cache"
    limit = 4 * installed_size(index, tmp_path / "probe")
    cache = NodeCache(index, str(cache_dir), cache_limit=limit, working_set_bytes=1)
    with accounting_writes() as writes:
        for shard in [*range(40), *range(40)]:
            cache.install(shard)
            records = len((cache_dir / ACCOUNTING_NAME).read_bytes().splitlines()) - 1
            assert records <= 16 + 2 * 4 + 2
    assert cache.stats.evictions == 76
    assert 2 <= writes.count("rewrite") < 80 // 4
    files, books = node_view(cache_dir)
    assert books == files and sum(files.values()) <= limit


# --------------------------------------------------------------------------- eviction policy


def test_choose_victims_orders_by_next_use_then_recency() -> None:
    residents = {k: Resident(10, float(t)) for k, t in [("a", 3), ("b", 1), ("c", 2)]}
    assert choose_victims(residents, 0, 30) == []
    assert choose_victims(residents, 10, 30) == ["b"]  # LRU
    assert choose_victims(residents, 15, 30) == ["b", "c"]
    far = {"a": 100.0, "b": 5.0, "c": 100.0}
    assert choose_victims(residents, 10, 30, far.__getitem__) == ["c"]  # tie: older first
    assert choose_victims(residents, 100, 30) == ["b", "c", "a"]


def _ranked_victims(residents: dict[str, Resident], far: dict[str, float], incoming: int,
                    limit: int, last_resort: set[str]) -> list[str]:
    """The eviction rule, written plainly: a stable sort on (last resort, farthest next use,
    least recently used)."""
    total = sum(r.nbytes for r in residents.values())
    if total + incoming <= limit:
        return []
    victims = []
    for key in sorted(residents, key=lambda k: (k in last_resort, -far[k],
                                                residents[k].last_used)):
        victims.append(key)
        total -= residents[key].nbytes
        if total + incoming <= limit:
            break
    return victims


def _victims_by_rounds(residents: dict[str, Resident], far: dict[str, float], incoming: int,
                       limit: int, fresh: set[str]) -> list[str]:
    """The rule as the node cache ran it before victims_in_order: ranked again and again,
    each new candidate asked whether it is fresh, fresh ones last."""
    known: set[str] = set()
    asked: set[str] = set()
    while True:
        victims = _ranked_victims(residents, far, incoming, limit, known)
        new = [key for key in victims if key not in asked]
        if not new:
            return victims
        asked.update(new)
        known.update(key for key in new if key in fresh)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), count=st.integers(0, 12))
def test_victims_in_order_chooses_what_the_rule_chose_round_by_round(
        data: st.DataObject, count: int) -> None:
    keys = [f"k{i}" for i in range(count)]
    # few distinct values, so that ties in next use and in recency are common
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=count, max_size=count))
    used = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=count, max_size=count))
    far = data.draw(st.lists(st.sampled_from([1.0, 5.0, math.inf]), min_size=count,
                             max_size=count))
    fresh = set(data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else [])
    incoming, limit = data.draw(st.integers(0, 8)), data.draw(st.integers(0, 40))
    residents = {k: Resident(n, t) for k, n, t in zip(keys, sizes, used, strict=True)}
    asked: list[str] = []

    def is_fresh(key: str) -> bool:
        asked.append(key)
        return key in fresh

    got = victims_in_order(keys, np.array(sizes, np.int64), np.array(used), np.array(far),
                           incoming, limit, is_fresh)
    assert got == _victims_by_rounds(residents, dict(zip(keys, far, strict=True)), incoming,
                                     limit, fresh)
    assert len(asked) == len(set(asked))  # each entry asked at most once
    assert not set(got) - set(asked)  # and every victim was asked
    far_of = dict(zip(keys, far, strict=True))
    assert choose_victims(residents, incoming, limit, far_of.__getitem__, fresh) == \
        _ranked_victims(residents, far_of, incoming, limit, fresh)


@settings(max_examples=60, deadline=None)
@given(reads=st.lists(st.integers(0, 9), min_size=1, max_size=80),
       sizes=st.lists(st.integers(1, 5), min_size=10, max_size=10),
       slack=st.integers(0, 20))
def test_belady_never_fetches_more_than_lru_for_equal_shards(
        reads: list[int], sizes: list[int], slack: int) -> None:
    limit = max(sizes) + slack
    for shard_bytes in (sizes, [5] * 10):  # optimality is a theorem for equal sizes only
        belady = simulate_fetches(reads, shard_bytes, limit, "belady")
        lru = simulate_fetches(reads, shard_bytes, limit, "lru")
        assert len(set(reads)) <= min(belady, lru) and max(belady, lru) <= len(reads)
        if shard_bytes == [5] * 10:
            assert belady <= lru
        if limit >= sum(shard_bytes):
            assert belady == lru == len(set(reads))


def test_a_shard_just_handed_out_elsewhere_is_evicted_only_as_a_last_resort(
        tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=5)
    probe = NodeCache(index, str(tmp_path / "probe"))
    for shard in range(4):
        probe.install(shard)
    largest = max(os.path.getsize(probe.shard_path(k)) for k in range(4))
    limit = 2 * largest + largest // 2  # two shards
    ours = NodeCache(index, str(tmp_path / "cache"), cache_limit=limit, working_set_bytes=1)
    other = NodeCache(index, str(tmp_path / "cache"), cache_limit=limit,
                      working_set_bytes=1)  # as another process would
    ours.install(0)
    ours.install(1)
    ours.set_next_use({0: 100.0, 1: 5.0, 2: 1.0}.__getitem__)  # 0 is Belady's victim...
    assert other.lookup(0) is not None  # ...but another process is about to map it
    ours.install(2)
    assert [ours.contains(k) for k in range(3)] == [True, False, True]
    assert other.lookup(2) is not None  # now both residents were just handed out
    ours.set_next_use({0: 100.0, 2: 1.0, 3: 2.0}.__getitem__)
    ours.install(3)  # no resident is stale: the plan decides among the fresh ones
    assert [ours.contains(k) for k in range(4)] == [False, False, True, True]


# ------------------------------------------------------------- DatasetReader's default store


def test_a_bare_dataset_reader_caches_in_a_temporary_folder_it_removes(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "zstd", num_shards=3)
    with DatasetReader(index) as reader:
        assert isinstance(reader.store, NodeCache)
        folder = reader.store.cache_dir
        check_batch(reader.read_batch(np.arange(len(reader))), np.arange(len(reader)))
        assert reader.store.stats.installs == 3
    assert not os.path.exists(folder)


@pytest.mark.parametrize("verify", [True, False])
def test_a_bare_dataset_reader_reads_local_uncompressed_shards_in_place(
        tmp_path: Path, verify: bool) -> None:
    index = write_shards(tmp_path / "plain", num_shards=2, compression=None)
    cache = tmp_path / "cache"
    with DatasetReader(index, local_dir=str(cache), verify=verify) as reader:
        assert reader.store.local_path(1) == index.shard_url(1)
        check_batch(reader.read_batch(np.arange(len(reader))), np.arange(len(reader)))
        # hashed against the index before first use, unless verify=False (size only)
        assert reader.store.stats.verified == (2 if verify else 0)
    assert cache.is_dir()  # the caller's folder is kept
