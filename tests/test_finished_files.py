"""A reader maps an install's finished file while the install fsyncs it before publishing
(``NodeCache.install(finished=)``, ``Prefetcher.readable_path``, cache/downloads.py): what an
install does where the OS gives no boot id (elsewhere it publishes first and fsyncs later:
cache/durability.py, tests/test_durability.py). Every test here runs without a boot id.

What is checked, with the install's fsync held, failing or slow: the rows read are the
stored ones and come before the shard is published; the published file is the one mapped
(its inode); ``local_path`` still returns only published files; a failed fsync publishes
nothing, leaves no temporary and the shard is read again; closing waits for a finishing
install (bounded) so that what was read is installed; another process waits for the publish
and does not fetch the shard again; an epoch over a remote dataset with slow fsyncs is
exact.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import FaultServer
from test_cache import (
    FAST_RETRIES,
    ROWS_PER_SHARD,
    check_batch,
    installed_files,
    read_everything,
    serve_dataset,
    shard_gets,
)

from streamcache import DatasetReader, StreamDataset, StreamLoader
from streamcache.cache import node
from streamcache.cache.node import NodeCache
from streamcache.cache.prefetch import Prefetcher
from streamcache.remote import storage


class HeldFsync:
    """``storage.fsync_file`` of the installs, held until :meth:`release` (or failing)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: int = 0) -> None:
        self.entered: list[str] = []
        self.inodes: list[int] = []
        self.gate = threading.Event()
        self.fail = fail
        real = storage.fsync_file

        def held(path: str) -> None:
            self.entered.append(path)
            self.inodes.append(os.stat(path).st_ino)
            if not self.gate.wait(30):
                raise AssertionError("the held fsync was never released")
            if self.fail:
                self.fail -= 1
                raise OSError(errno.EIO, "Input/output error (injected)")
            real(path)

        monkeypatch.setattr(storage, "fsync_file", held)

    def release(self) -> None:
        self.gate.set()

    def wait_entered(self, count: int = 1) -> None:
        deadline = time.monotonic() + 30
        while len(self.entered) < count:
            assert time.monotonic() < deadline, "no install reached its fsync"
            time.sleep(0.005)


@pytest.fixture(autouse=True)
def _no_boot_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "boot_id", lambda: None)


def _reader(index: Any, cache: NodeCache) -> DatasetReader:
    # (no cold range reads: every row comes from a file of the store)
    return DatasetReader(index, store=Prefetcher(cache), cold_ranges=False)


def test_rows_come_from_the_finished_file_before_it_is_published(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = serve_dataset(fault_server, num_shards=3)
    fsync = HeldFsync(monkeypatch)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    with _reader(index, cache) as reader:
        ids = np.array([5, 0, ROWS_PER_SHARD - 1, 17, 5])
        check_batch(reader.read_batch(ids), ids)  # (the fsync is held: not published)
        assert len(fsync.entered) == 1 and cache.lookup(0) is None
        assert Path(fsync.entered[0]).parent != Path(cache.shard_path(0)).parent
        fsync.release()
        published = reader.store.local_path(0)
        assert published == cache.shard_path(0)
        assert os.stat(published).st_ino == fsync.inodes[0]  # the file that was mapped
        check_batch(reader.read_batch(ids), ids)
        assert read_everything(reader) == index.num_samples
    assert len(installed_files(tmp_path / "cache")) == len(index.shards)


def test_local_path_returns_only_a_published_file(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = serve_dataset(fault_server, num_shards=2)
    fsync = HeldFsync(monkeypatch)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    with Prefetcher(cache) as prefetcher:
        found: list[str] = []
        waiter = threading.Thread(target=lambda: found.append(prefetcher.local_path(1)),
                                  daemon=True)
        waiter.start()
        fsync.wait_entered()
        written = prefetcher.readable_path(1)  # (offered: returns at once)
        assert written == fsync.entered[0] and os.path.exists(written)
        time.sleep(0.3)
        assert waiter.is_alive() and not found  # local_path waits for the publish
        fsync.release()
        waiter.join(30)
        assert found == [cache.shard_path(1)]
        assert not os.path.exists(written)  # (renamed into place)


def test_a_failed_fsync_publishes_nothing_and_the_shard_is_read_again(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = serve_dataset(fault_server, num_shards=2)
    fsync = HeldFsync(monkeypatch, fail=1)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    with _reader(index, cache) as reader:
        ids = np.arange(ROWS_PER_SHARD)
        check_batch(reader.read_batch(ids), ids)  # the finished file's rows are right
        fsync.release()  # ... then its fsync fails: the shard is not installed
        deadline = time.monotonic() + 30
        while reader.store.stats.tasks_failed < 1:
            assert time.monotonic() < deadline, "the install never failed"
            time.sleep(0.005)
        assert cache.lookup(0) is None
        assert not os.path.exists(fsync.entered[0])  # no temporary left behind
        assert read_everything(reader) == index.num_samples  # installed again, then read
        assert reader.store.local_path(0) == cache.shard_path(0)
    assert len(installed_files(tmp_path / "cache")) == len(index.shards)
    assert not list((tmp_path / "cache" / "tmp").glob("*/*/*"))


def test_close_publishes_a_file_a_reader_read_and_waits_no_longer_than_its_bound(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = serve_dataset(fault_server, num_shards=2)
    fsync = HeldFsync(monkeypatch)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    reader = _reader(index, cache)
    ids = np.arange(ROWS_PER_SHARD)
    check_batch(reader.read_batch(ids), ids)
    threading.Timer(0.3, fsync.release).start()
    started = time.monotonic()
    reader.close()  # waits for the held fsync, then publishes
    assert 0.2 < time.monotonic() - started < 10
    assert os.path.exists(cache.shard_path(0))

    # an fsync that never ends (a hung disk): close gives up after FINISH_WAIT_S
    monkeypatch.setattr(node, "FINISH_WAIT_S", 0.5)
    hung = HeldFsync(monkeypatch)
    cache = NodeCache(index, str(tmp_path / "cache2"), fetch_options=FAST_RETRIES)
    reader = _reader(index, cache)
    check_batch(reader.read_batch(ids), ids)
    started = time.monotonic()
    reader.close()
    assert time.monotonic() - started < 5
    hung.release()  # (the install then finds its file gone: nothing is published)
    time.sleep(0.2)
    assert not os.path.exists(cache.shard_path(0))


def test_an_epoch_with_slow_fsyncs_is_exact(fault_server: FaultServer, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    serve_dataset(fault_server, num_shards=6)
    real = storage.fsync_file

    def slow(path: str) -> None:
        time.sleep(0.2)
        real(path)

    monkeypatch.setattr(storage, "fsync_file", slow)
    dataset = StreamDataset(fault_server.url_for("ds"), global_batch_size=24, rank=0,
                            world_size=1, cache_dir=str(tmp_path / "cache"),
                            shuffle_window=120, fetch=FAST_RETRIES)
    with StreamLoader(dataset) as loader:
        ids = np.concatenate([batch["__id__"].numpy() for batch in loader])
    assert sorted(ids.tolist()) == list(range(6 * ROWS_PER_SHARD))
    assert len(installed_files(tmp_path / "cache")) == 6


def test_another_process_waits_for_the_publish_and_does_not_fetch_again(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finished file is this process's: another process of the node (a rank, a worker)
    asking for the shard meanwhile waits for the publish, then reads the installed file;
    the shard is downloaded once."""
    index = serve_dataset(fault_server, num_shards=2)
    fsync = HeldFsync(monkeypatch)
    cache_dir = tmp_path / "cache"
    cache = NodeCache(index, str(cache_dir), fetch_options=FAST_RETRIES)
    with _reader(index, cache) as reader:
        ids = np.arange(ROWS_PER_SHARD)
        check_batch(reader.read_batch(ids), ids)  # (ours: the finished file, fsync held)
        script = (
            "import sys, time\n"
            "from streamcache.cache.node import NodeCache\n"
            "from streamcache.format.index import load_index\n"
            "cache = NodeCache(load_index(sys.argv[1]), sys.argv[2])\n"
            "print('ready', flush=True)\n"
            "print(cache.local_path(0), flush=True)\n")
        other = subprocess.Popen([sys.executable, "-c", script,
                                  fault_server.url_for("ds/index.json"), str(cache_dir)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout is not None
            assert other.stdout.readline().strip() == "ready"
            time.sleep(0.5)
            assert other.poll() is None  # waiting: the shard is not published yet
            fsync.release()
            found, _ = other.communicate(timeout=60)
        finally:
            if other.poll() is None:
                other.kill()
        assert found.strip() == cache.shard_path(0)
        assert os.stat(found.strip()).st_ino == fsync.inodes[0]
    assert shard_gets(fault_server)[f"/ds/{index.shards[0].path}"] == 1
