"""The data path's integrity under careless use and hostile shared folders: what identifies
cached data, verification of shards read in place, confinement of the cache's bookkeeping,
faults of the local disk (full, removed, read-only) and the cache budget over all epochs.

Disk-full and read-only tests use real tmpfs mounts (root only; skipped with the reason
otherwise). Everything else uses real files, the loopback S3 server and the HTTP server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import FaultServer, S3Bucket
from test_cache import (
    ROWS_PER_SHARD,
    SCHEMA,
    accounting,
    check_batch,
    check_installed,
    installed_files,
    read_everything,
    sample,
    write_shards,
)

from streamcache import DatasetReader, ShardWriter, StreamDataset, StreamLoader, write_dataset
from streamcache.cache.accounting import ACCOUNTING_NAME
from streamcache.cache.advice import shard_usage, working_set_bound
from streamcache.cache.node import NodeCache, local_bytes_estimate
from streamcache.cache.prefetch import Prefetcher, PrefetchOptions
from streamcache.errors import (
    CacheBudgetError,
    CacheError,
    ChecksumMismatchError,
    StreamcacheError,
)
from streamcache.format.index import DatasetIndex, build_index, load_index
from streamcache.plan import EpochOrder, ShuffleOptions

PARQUET_FILES = 4
PARQUET_ROWS = 50


# --------------------------------------------------------------------------- helpers


def parquet_table(offset: int) -> pa.Table:
    ids = np.arange(PARQUET_ROWS, dtype=np.int64)
    return pa.table({"id": ids, "v": ids + offset})


def write_parquet_folder(folder: Path, offset: int) -> None:
    """Files whose names, rows and byte sizes do not depend on ``offset``; values do."""
    folder.mkdir(parents=True, exist_ok=True)
    for number in range(PARQUET_FILES):
        pq.write_table(parquet_table(offset + 1000 * number), folder / f"part-{number:05d}.parquet",
                       compression="none", use_dictionary=False, write_statistics=False)


def values(index: DatasetIndex, cache_dir: Path, **options: Any) -> list[int]:
    with DatasetReader(index, store=NodeCache(index, str(cache_dir), **options)) as reader:
        return [int(v) for v in reader.read_batch(np.arange(len(reader)))["v"]]


def expected_values(offset: int) -> list[int]:
    return [offset + 1000 * n + r for n in range(PARQUET_FILES) for r in range(PARQUET_ROWS)]


def sizes(folder: Path) -> list[int]:
    return [p.stat().st_size for p in sorted(folder.glob("*.parquet"))]


# --------------------------------------------------------------------------- cache identity


def test_two_folders_with_equal_names_rows_and_sizes_never_get_each_others_bytes(
        tmp_path: Path) -> None:
    write_parquet_folder(tmp_path / "a", offset=0)
    write_parquet_folder(tmp_path / "b", offset=7)
    first, second = build_index(str(tmp_path / "a")), build_index(str(tmp_path / "b"))
    assert sizes(tmp_path / "a") == sizes(tmp_path / "b")
    assert first.fingerprint == second.fingerprint  # footers alone cannot tell them apart
    cache_dir = tmp_path / "cache"  # one cache_dir for both, as ~/.cache/streamcache is
    assert values(first, cache_dir) == expected_values(0)
    assert values(second, cache_dir) == expected_values(7)
    assert values(first, cache_dir) == expected_values(0)


def test_a_dataset_rewritten_in_place_and_reindexed_is_fetched_again(tmp_path: Path) -> None:
    folder, cache_dir = tmp_path / "ds", tmp_path / "cache"
    write_parquet_folder(folder, offset=0)
    assert values(build_index(str(folder)), cache_dir) == expected_values(0)
    before = sizes(folder)
    write_parquet_folder(folder, offset=5)  # a nightly re-tokenization: same sizes
    for path in folder.glob("*.parquet"):  # (a later modification time, whatever the clock)
        stamp = path.stat().st_mtime + 10
        os.utime(path, (stamp, stamp))
    assert sizes(folder) == before
    index = build_index(str(folder))
    assert values(index, cache_dir) == expected_values(5)
    # the warm path: a later open installs nothing more
    with NodeCache(index, str(cache_dir)) as cache:
        for shard in range(len(index.shards)):
            cache.local_path(shard)
        assert cache.stats.installs == 0


def test_an_s3_object_rewritten_in_place_is_fetched_again(
        s3_bucket: S3Bucket, tmp_path: Path) -> None:
    import s3fs

    options = s3_bucket.storage_options()
    fs = s3fs.S3FileSystem(**options)
    prefix = f"rewritten-{uuid.uuid4().hex[:8]}"
    local = tmp_path / "src"
    write_parquet_folder(local, offset=0)
    fs.put(str(local) + "/", s3_bucket.url(prefix).removeprefix("s3://") + "/", recursive=True)
    url = s3_bucket.url(prefix)
    cache_dir = tmp_path / "cache"
    index = build_index(url, storage_options=options)
    assert values(index, cache_dir, storage_options=options) == expected_values(0)
    write_parquet_folder(local, offset=3)
    fs.put(str(local) + "/", s3_bucket.url(prefix).removeprefix("s3://") + "/", recursive=True)
    index = build_index(url, storage_options=options)
    assert values(index, cache_dir, storage_options=options) == expected_values(3)


def test_replacing_a_stale_copy_never_breaks_a_reader_that_maps_it(tmp_path: Path) -> None:
    folder, cache_dir = tmp_path / "ds", tmp_path / "cache"
    write_parquet_folder(folder, offset=0)
    old = DatasetReader(build_index(str(folder)), store=NodeCache(build_index(str(folder)),
                                                                   str(cache_dir)))
    assert int(old.read_batch([3])["v"][0]) == 3  # shard 0 is mapped now
    write_parquet_folder(folder, offset=9)
    stamp = (folder / "part-00000.parquet").stat().st_mtime + 10
    os.utime(folder / "part-00000.parquet", (stamp, stamp))
    assert values(build_index(str(folder)), cache_dir)[3] == 12  # the copy was replaced
    assert int(old.read_batch([3])["v"][0]) == 3  # (unlinked, not truncated: no SIGBUS)
    old.close()


def test_the_warm_path_asks_the_store_once_per_installed_shard_never_per_read(
        fault_server: FaultServer, tmp_path: Path) -> None:
    write_parquet_folder(Path(fault_server.root or "") / "pq", offset=0)
    build_index(str(Path(fault_server.root or "") / "pq"))
    index = load_index(fault_server.url_for("pq/index.json"))
    cache_dir = tmp_path / "cache"
    with DatasetReader(index, store=NodeCache(index, str(cache_dir))) as reader:
        for _ in range(3):
            reader.read_batch(np.arange(len(reader)))
    heads_after_install = fault_server.requests.count(method="HEAD")
    assert heads_after_install <= 2 * len(index.shards)
    with DatasetReader(index, store=NodeCache(index, str(cache_dir))) as reader:
        for _ in range(3):
            reader.read_batch(np.arange(len(reader)))
            reader._readers.clear()  # re-open every shard: still no request per read
        assert reader.store.stats.installs == 0  # type: ignore[attr-defined]
    assert fault_server.requests.count(method="HEAD") - heads_after_install <= len(index.shards)


# --------------------------------------------------------------------------- local shards in place


def flip_a_bit_of_sample(path: Path, sample_id: int) -> None:
    data = bytearray(path.read_bytes())
    at = bytes(data).index(sample(sample_id)["blob"][:24])
    data[at + 3] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_local_uncompressed_shard_is_refused(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=3, compression=None)
    victim = int(index.shard_rows[0]) + 5  # a sample of shard 1
    flip_a_bit_of_sample(tmp_path / "ds" / index.shards[1].path, victim)
    with DatasetReader(index, store=NodeCache(index, str(tmp_path / "cache"))) as reader:
        reader.read_batch(np.arange(int(index.shard_rows[0])))  # shard 0 is intact
        with pytest.raises(ChecksumMismatchError, match=index.shards[1].path):
            reader.read_batch([victim])
    with DatasetReader(index) as reader, pytest.raises(ChecksumMismatchError):
        reader.read_batch([victim])  # the folder store (no cache) verifies as well


def test_in_place_verification_is_remembered_per_file_size_and_mtime(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=3, compression=None)
    cache_dir = tmp_path / "cache"

    def verified_files() -> int:
        with DatasetReader(index, store=NodeCache(index, str(cache_dir))) as reader:
            read_everything(reader)
            read_everything(reader, seed=1)
            return int(reader.store.stats.verified)  # type: ignore[attr-defined]

    assert verified_files() == 3  # each hashed once, however often it is read
    assert verified_files() == 0  # a restart (or another process) trusts the record
    path = tmp_path / "ds" / index.shards[2].path
    stamp = path.stat().st_mtime + 5
    os.utime(path, (stamp, stamp))
    assert verified_files() == 1  # a changed file is hashed again
    assert installed_files(cache_dir) == []  # still read in place, never copied


# ------------------------------------------------------------------ bookkeeping confinement


def plant_accounting(cache_dir: Path, planted: dict[str, int]) -> None:
    """Append records of ``planted`` keys to the accounting file, as anyone who may write to
    the folder could (without the cache's lock)."""
    with open(cache_dir / ACCOUNTING_NAME, "a") as f:
        for key, nbytes in planted.items():
            f.write(json.dumps({"add": key, "bytes": nbytes, "installed": 1.0}) + "\n")


def installed_bytes(cache_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(cache_dir)): p.stat().st_size for p in installed_files(cache_dir)}


GARBAGE = {
    "torn": b'{"add":"datasets/x/000001.arro',
    "negative": b'{"add":"datasets/x/000001.arrow","bytes":-5,"installed":1}\n',
    "nan": b'{"add":"datasets/x/000001.arrow","bytes":1,"installed":NaN}\n',
    "bool": b'{"add":"datasets/x/000001.arrow","bytes":true,"installed":1}\n',
    "newline-key": b'{"add":"datasets/x/000001.arrow\\n","bytes":1,"installed":1}\n',
    "extra-key": b'{"add":"datasets/x/000001.arrow","bytes":1,"installed":1,"x":0}\n',
    "outside": b'{"remove":"/etc/passwd"}\n',
    "deep": b"[" * 100_000 + b"\n",
    "binary": b"\xff\xfe\x00\n",
    "blank": b"\n",
}


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
def test_anything_appended_to_the_accounting_makes_a_live_cache_rebuild_it_from_the_files(
        tmp_path: Path, garbage: bytes) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    cache_dir = tmp_path / "cache"
    cache = NodeCache(index, str(cache_dir))
    cache.install(0)
    cache.install(1)
    with open(cache_dir / ACCOUNTING_NAME, "ab") as f:
        f.write(garbage)
    usage = cache.usage()  # the same cache object: it read the file before
    assert (usage.bytes, usage.shards) == (sum(installed_bytes(cache_dir).values()), 2)
    cache.install(2)
    assert accounting(cache_dir) == installed_bytes(cache_dir)


def _older_format(path: Path, victim: Path, kept: bytes) -> None:
    path.write_text(json.dumps({"format": "streamcache-cache-accounting", "version": 1,
                                "entries": {}}))


def _empty(path: Path, victim: Path, kept: bytes) -> None:
    path.write_bytes(b"")


def _fifo(path: Path, victim: Path, kept: bytes) -> None:
    os.mkfifo(path)  # opening it to read would block without a writer


def _link(path: Path, victim: Path, kept: bytes) -> None:
    victim.write_bytes(kept)  # a valid accounting file: appended to, were the link followed
    os.symlink(victim, path)


REPLACEMENTS = {"older-format": _older_format, "empty": _empty, "fifo": _fifo, "link": _link}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replace", REPLACEMENTS.values(), ids=REPLACEMENTS.keys())
def test_an_accounting_file_replaced_by_anything_is_rebuilt_never_followed(
        tmp_path: Path, replace: Any) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    cache_dir = tmp_path / "cache"
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = NodeCache(index, str(cache_dir))
    cache.install(0)
    path = cache_dir / ACCOUNTING_NAME
    kept = path.read_bytes()
    path.unlink()
    replace(path, outside / "victim", kept)
    cache.install(1)
    assert accounting(cache_dir) == installed_bytes(cache_dir)
    assert path.is_file() and not path.is_symlink()
    assert all(p.read_bytes() == kept for p in outside.iterdir())  # nothing written there


def test_a_key_outside_the_cache_in_the_accounting_never_deletes_a_file(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    cache_dir = tmp_path / "cache"
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"weights")
    largest = max(local_bytes_estimate(s) for s in index.shards)
    cache = NodeCache(index, str(cache_dir), cache_limit=2 * largest)
    cache.install(0)
    plant_accounting(cache_dir, {"../checkpoint.pt": 10 * largest,
                                 "datasets/../../checkpoint.pt": 10 * largest,
                                 str(checkpoint): 10 * largest})
    for shard in range(1, 4):
        cache.install(shard)
    assert checkpoint.read_bytes() == b"weights"
    assert cache.usage().bytes <= 2 * largest


def test_a_symlinked_dataset_folder_in_the_cache_is_never_evicted_through(
        tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    cache_dir = tmp_path / "cache"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "000001.arrow").write_bytes(b"x" * 50_000)
    (cache_dir / "datasets").mkdir(parents=True)
    os.symlink(outside, cache_dir / "datasets" / "evil")
    largest = max(local_bytes_estimate(s) for s in index.shards)
    cache = NodeCache(index, str(cache_dir), cache_limit=2 * largest)
    plant_accounting(cache_dir, {"datasets/evil/000001.arrow": 50_000})
    for shard in range(4):
        cache.install(shard)
    assert (outside / "000001.arrow").stat().st_size == 50_000


# ------------------------------------------------------------------ faults of the local disk


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a size-capped tmpfs cannot be mounted here ({mounted.stderr.strip()}); "
                    "the disk-full and read-only tests need root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def read_in_order(reader: DatasetReader, batch: int = 16) -> int:
    """Read every sample in index order: few shards in use at once, as a streaming reader."""
    for start in range(0, len(reader), batch):
        ids = np.arange(start, min(len(reader), start + batch))
        check_batch(reader.read_batch(ids), ids)
    return len(reader)


def test_a_full_disk_evicts_and_retries_then_a_fitting_budget_works(tmp_path: Path) -> None:
    first = write_shards(tmp_path / "a", num_shards=24)
    other = write_shards(tmp_path / "b", num_shards=24)
    need = sum(local_bytes_estimate(s) for s in first.shards)
    with tmpfs(tmp_path / "small", f"{need // 2 // 4096 * 4096}") as disk:
        # no budget: the disk fills up; the cache evicts what is needed last and retries
        # (a streaming reader maps the shards in use only: an unlinked shard still mapped
        # keeps its disk space)
        with DatasetReader(first, store=NodeCache(first, str(disk / "c")),
                           max_open_shards=2) as reader:
            assert read_in_order(reader) == first.num_samples
            assert reader.store.stats.evictions > 0  # type: ignore[attr-defined]
        # a later run, another dataset, a budget that fits the disk: evict first, then fetch
        limit = need // 4
        with DatasetReader(other, store=NodeCache(other, str(disk / "c"), cache_limit=limit),
                           max_open_shards=2) as reader:
            assert read_in_order(reader) == other.num_samples
            assert reader.store.usage().bytes <= limit  # type: ignore[attr-defined]


def test_a_disk_full_of_other_files_gives_a_clear_error(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    with tmpfs(tmp_path / "small", "64k") as disk:
        cache = NodeCache(index, str(disk / "c"))
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        with pytest.raises(CacheError, match=r"no space left.*cache_dir") as caught:
            cache.local_path(0)
        assert isinstance(caught.value, StreamcacheError)


@pytest.mark.parametrize("prefetch", [False, True], ids=["cache", "prefetch"])
def test_the_cache_dir_removed_mid_epoch_is_made_again(tmp_path: Path, prefetch: bool) -> None:
    index = write_shards(tmp_path / "ds", num_shards=6)
    cache_dir = tmp_path / "cache"
    cache = NodeCache(index, str(cache_dir), cache_limit=1 << 20)
    store: Any = Prefetcher(cache, PrefetchOptions(workers=2)) if prefetch else cache
    with DatasetReader(index, store=store) as reader:
        if prefetch:
            store.update(np.arange(len(index.shards)), np.arange(len(index.shards)))
        reader.read_batch(np.arange(2 * ROWS_PER_SHARD))
        if prefetch:  # (let the download threads finish: rmtree of a folder being written fails)
            deadline = time.monotonic() + 30
            while store.stats.tasks_done < len(index.shards) and time.monotonic() < deadline:
                time.sleep(0.01)
        shutil.rmtree(cache_dir)  # a cleanup script, an operator
        reader._readers.clear()
        if prefetch:
            store.update(np.arange(len(index.shards)), np.arange(len(index.shards)))
        assert read_everything(reader) == index.num_samples
    assert len(installed_files(cache_dir)) == len(index.shards)


def test_a_symlinked_temporary_folder_is_never_removed_through(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    (tmp_path / "cache" / "tmp").mkdir(parents=True)
    dead = "nobootid-1-1-1"  # a token of no live process: its folder is cleaned up
    os.symlink(outside, tmp_path / "cache" / "tmp" / dead)
    NodeCache(index, str(tmp_path / "cache"))
    assert (outside / "keep").read_bytes() == b"x"


def test_a_symlinked_folder_of_the_cache_itself_is_refused(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    probe = NodeCache(index, str(tmp_path / "probe"))
    name = os.path.basename(os.path.dirname(probe.shard_path(0)))
    (tmp_path / "cache" / "datasets").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "cache" / "datasets" / name)
    with pytest.raises(CacheError, match="symbolic link"):
        NodeCache(index, str(tmp_path / "cache"))


def test_a_read_only_cache_dir_gives_a_clear_error(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    with tmpfs(tmp_path / "ro", "1m") as disk:
        NodeCache(index, str(disk / "c")).install(0)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(CacheError, match=r"not writable.*cache_dir"):
            NodeCache(index, str(disk / "c"))
        with pytest.raises(CacheError, match=r"not writable.*cache_dir"):
            NodeCache(index, str(disk / "other"))


def test_installed_shards_are_read_only_files(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    cache = NodeCache(index, str(tmp_path / "cache"))
    path = cache.local_path(0)
    assert os.stat(path).st_mode & 0o222 == 0  # an accidental truncation needs a chmod first


# --------------------------------------------------------------------------- the budget over epochs


def minimum_limit(url: str, cache_dir: Path, **options: Any) -> int:
    with pytest.raises(CacheBudgetError) as caught:
        StreamDataset(url, cache_dir=str(cache_dir), cache_limit=1, **options)
    return int(re.search(r"at least ([\d,]+) bytes", str(caught.value))[1].replace(",", ""))  # type: ignore[index]


def test_a_cache_limit_accepted_at_construction_holds_for_every_epoch(tmp_path: Path) -> None:
    write_shards(tmp_path / "ds", num_shards=12)
    url = str(tmp_path / "ds")
    options: dict[str, Any] = {"global_batch_size": 8, "shuffle_window": 5, "rank": 0,
                               "world_size": 1}
    limit = minimum_limit(url, tmp_path / "cache", **options)
    probe = StreamDataset(url, cache_dir=str(tmp_path / "cache"), **options)
    local = np.array([local_bytes_estimate(s) for s in probe.index.shards])
    per_epoch = [probe.advice(e).working_set_bytes(local) for e in range(12)]
    assert max(per_epoch) > per_epoch[0]  # the premise: epoch 0 is not the largest
    assert limit >= max(per_epoch)
    for epoch in range(12):  # a state from any epoch, loaded into a fresh loader
        dataset = StreamDataset(url, cache_dir=str(tmp_path / "cache"), cache_limit=limit,
                                **options)
        dataset.set_epoch(epoch)
        next(iter(dataset))
        dataset.close()


def test_the_budget_message_states_the_bound_it_checks(tmp_path: Path) -> None:
    write_shards(tmp_path / "ds", num_shards=6)
    with pytest.raises(CacheBudgetError, match="any epoch"):
        StreamDataset(str(tmp_path / "ds"), global_batch_size=8, shuffle_window=5, rank=0,
                      world_size=1, cache_dir=str(tmp_path / "cache"), cache_limit=1)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, 60), min_size=1, max_size=14),
       window=st.integers(1, 200), unit=st.sampled_from(["samples", "shards"]),
       stagger=st.booleans(), enabled=st.booleans(), seed=st.integers(0, 5))
def test_no_epoch_keeps_more_in_use_than_the_bound(rows: list[int], window: int, unit: str,
                                                   stagger: bool, enabled: bool,
                                                   seed: int) -> None:
    if sum(rows) == 0:
        rows[0] = 1
    shard_rows = np.array(rows, dtype=np.int64)
    shard_bytes = shard_rows * 13 + 7 + np.arange(len(rows)) % 5 * 11
    shuffle = ShuffleOptions(enabled=enabled, window=window, window_unit=unit, stagger=stagger)
    bound = working_set_bound(shard_rows, shard_bytes, shuffle)
    for epoch in range(4):
        order = EpochOrder(shard_rows, seed, epoch, shuffle)
        usage = shard_usage(order)
        assert usage.working_set_bytes(shard_bytes) <= bound


def test_a_tight_budget_that_fits_the_disk_reads_a_whole_epoch(tmp_path: Path) -> None:
    """Evicted shards must not stay mapped by the reader: their disk space is freed only
    when the last mapping goes, so a budget that fits the disk would fill it anyway. Default
    options (zstd, chunk size, loader) but for the budget, its window and 1 MB shards (at
    64 MB shards the same test would take half a gigabyte)."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "ds"
    SAMPLES = 2400
    with ShardWriter(str(folder), shard_size=1 << 20) as writer:
        for i in range(SAMPLES):  # ~24 MB installed, incompressible, 24 shards
            writer.write({"blob": rng.bytes(10_000), "id": i})
    # the budget plus the temporaries of 4 download threads (a stored and a local copy of
    # a shard each, 8 MB) plus a few shards mapped by batches in flight fit the disk; the
    # dataset does not
    with tmpfs(tmp_path / "small", "18m") as disk:
        dataset = StreamDataset(str(folder), global_batch_size=32, rank=0, world_size=1,
                                cache_dir=str(disk / "c"), cache_limit=5 << 20,
                                shuffle_window=100)
        seen: list[int] = []
        with StreamLoader(dataset) as loader:
            for batch in loader:
                seen.extend(batch["id"].tolist())
        dataset.close()
        assert sorted(seen) == list(range(SAMPLES))


# ------------------------------------------------------ an index wrong about compression


@pytest.mark.parametrize("stored,claimed", [("zstd", None), (None, "zstd")],
                         ids=["compressed-called-plain", "plain-called-compressed"])
@pytest.mark.parametrize("where", ["remote", "local"])
def test_an_index_wrong_about_a_shards_compression_still_serves_its_rows(
        fault_server: FaultServer, tmp_path: Path, where: str, stored: str | None,
        claimed: str | None) -> None:
    """The index's ``compression`` (per shard, outside the fingerprint; ShardWriter now
    decides it per shard) only routes the install: what is mapped in place or kept as
    downloaded is decided by the file itself, so an index that calls a compressed shard
    uncompressed (or the reverse) costs a decode at most, never wrong or unreadable rows."""
    root = Path(fault_server.root or "") if where == "remote" else tmp_path
    write_dataset((sample(i) for i in range(4 * ROWS_PER_SHARD)), str(root / "ds"),
                  schema=SCHEMA, shard_size=ROWS_PER_SHARD * 228, compression=stored or "zstd",
                  compression_min_savings=0 if stored else 0.999)
    path = root / "ds" / "index.json"
    document = json.loads(path.read_text())
    assert {s["compression"] for s in document["shards"]} == {stored}
    for shard in document["shards"]:
        shard["compression"] = claimed
    path.write_text(json.dumps(document))
    index = load_index(fault_server.url_for("ds") if where == "remote" else str(root / "ds"))
    cache_dir = tmp_path / "cache"
    with DatasetReader(index, store=NodeCache(index, str(cache_dir))) as reader:
        assert read_everything(reader) == index.num_samples
    # a compressed file is never mapped as it is, and a plain local one is read in place
    # only where the index calls it plain: every shard here is a whole installed copy
    assert check_installed(index, cache_dir) == len(index.shards)
