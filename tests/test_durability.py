"""Installs are published first and made durable later (cache/durability.py).

The contract: a shard is served at once after its install, with no fsync on the way; it is
fsynced ``SYNC_DELAY_S`` later (by the next install, ``close`` or ``sync``) and its marker
removed; within a boot a marked shard is served (every process, a crash of the installer
included); after a reboot (another boot id) every shard a marker names is removed when a
cache opens and installed again, whatever a power loss left in it, while shards that were
synced are kept. And the adversarial side: the ``unsynced`` folder is shared and untrusted
(links planted at every level, names that are not ours, a folder where a marker goes).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from servers import FaultServer
from test_cache import (
    FAST_RETRIES,
    ROWS_PER_SHARD,
    check_batch,
    check_installed,
    installed_files,
    read_everything,
    serve_dataset,
    shard_gets,
)

from streamcache import DatasetReader
from streamcache.cache import durability
from streamcache.cache.durability import UNSYNCED
from streamcache.cache.node import NodeCache, local_bytes_estimate
from streamcache.errors import CacheError
from streamcache.format.index import DatasetIndex
from streamcache.processes import boot_id
from streamcache.remote import storage

BOOT = boot_id()
OTHER_BOOT = "0123456789ab"
pytestmark = pytest.mark.skipif(BOOT is None, reason="the OS gives no boot id")


def marks(cache: NodeCache) -> list[int]:
    """The shards of ``cache``'s dataset marked unsynced in this boot."""
    assert cache._markers is not None
    return cache._markers.marked()


def dataset_name(cache: NodeCache) -> str:
    return os.path.basename(cache._shard_dir)


def power_loss(cache_dir: Path, torn: list[Path]) -> None:
    """What a reboot after a power loss can leave: this boot's markers are another boot's,
    and the unsynced shards ``torn`` lost their tail."""
    (cache_dir / UNSYNCED / str(BOOT)).rename(cache_dir / UNSYNCED / OTHER_BOOT)
    for path in torn:
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)


def test_an_install_is_served_at_once_and_fsynced_later(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = serve_dataset(fault_server, num_shards=3)
    fsyncs: list[str] = []
    monkeypatch.setattr(storage, "fsync_file", lambda path: fsyncs.append(path))
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    with DatasetReader(index, store=cache, cold_ranges=False) as reader:
        ids = np.arange(2 * ROWS_PER_SHARD)
        check_batch(reader.read_batch(ids), ids)
        assert fsyncs == []  # no shard was fsynced before its rows were served
        assert marks(cache) == [0, 1] and cache.stats.synced == 0
        cache.sync()  # everything now
        assert marks(cache) == [] and cache.stats.synced == 2
    assert check_installed(index, tmp_path / "cache") == 2


def test_due_installs_are_synced_by_the_next_install_and_by_close(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = serve_dataset(fault_server, num_shards=3)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    cache.local_path(0)
    assert marks(cache) == [0]  # not due yet
    monkeypatch.setattr(durability, "SYNC_DELAY_S", 0.0)
    cache.local_path(1)  # due at once: this install syncs itself and the one before
    assert marks(cache) == [] and cache.stats.synced == 2
    monkeypatch.setattr(durability, "SYNC_DELAY_S", 600.0)
    cache.local_path(2)
    assert marks(cache) == [2]
    cache.close()  # not due: left marked, for a later process of this boot
    assert marks(NodeCache(index, str(tmp_path / "cache"))) == [2]


@contextlib.contextmanager
def held_by_another_process(cache: NodeCache, shard: int) -> Iterator[None]:
    """``shard``'s lock held by a second process (as while it installs the shard again)."""
    path = os.path.join(cache._lock_dir, f"{shard:06d}.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
         "os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
         "sys.stdin.read()", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(30)
        holder.stdout.close()


def in_thread(call: Callable[[], object], seconds: float = 20.0) -> bool:
    """Whether ``call()`` returned within ``seconds`` (the thread is left to end later)."""
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()


def test_a_due_sync_never_waits_for_a_shard_another_process_holds(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An install or a close syncs the due shards it can lock now and leaves one whose lock
    another process holds (it installs the shard again, for its download's time) for the next
    time; ``sync()``, asked for everything, waits for it."""
    index = serve_dataset(fault_server, num_shards=4)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    cache.local_path(0)
    monkeypatch.setattr(durability, "SYNC_DELAY_S", 0.0)
    with held_by_another_process(cache, 0):
        assert in_thread(lambda: cache.local_path(1))  # (waiting would outlast the holder)
        assert marks(cache) == [0] and cache.stats.synced == 1
    cache.local_path(2)  # released: shard 0's turn came again
    assert marks(cache) == [] and cache.stats.synced == 3
    monkeypatch.setattr(durability, "SYNC_DELAY_S", 600.0)
    cache.local_path(3)
    with held_by_another_process(cache, 3):
        done = threading.Event()
        syncing = threading.Thread(target=lambda: (cache.sync(), done.set()), daemon=True)
        syncing.start()
        assert not done.wait(0.5) and marks(cache) == [3]  # sync() waits for the lock
    syncing.join(20)
    assert done.is_set() and marks(cache) == [] and cache.stats.synced == 4
    monkeypatch.setattr(durability, "SYNC_DELAY_S", 0.0)
    cache._pending.add(3)  # (as if it were due again)
    with held_by_another_process(cache, 3):
        assert in_thread(cache.close)
    assert marks(NodeCache(index, str(tmp_path / "cache"))) == []


def test_after_a_reboot_the_unsynced_shards_are_installed_again_and_the_synced_kept(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server, num_shards=4)
    cache_dir = tmp_path / "cache"
    with NodeCache(index, str(cache_dir), fetch_options=FAST_RETRIES) as cache:
        for shard in (0, 2):
            cache.local_path(shard)
        cache.sync()  # these are on disk: a power loss cannot touch them
        for shard in (1, 3):
            cache.local_path(shard)
        assert marks(cache) == [1, 3]
    torn = [Path(cache.shard_path(1)), Path(cache.shard_path(3))]
    power_loss(cache_dir, torn)
    fault_server.requests.reset()
    with DatasetReader(index, store=NodeCache(index, str(cache_dir), fetch_options=FAST_RETRIES),
                       cold_ranges=False) as reader:
        assert not (cache_dir / UNSYNCED / OTHER_BOOT).exists()  # swept when it opened
        assert len(installed_files(cache_dir)) == 2  # the torn ones are gone
        assert read_everything(reader) == index.num_samples
    gets = shard_gets(fault_server)
    assert sorted(gets) == sorted(f"/ds/{index.shards[k].path}" for k in (1, 3))
    assert check_installed(index, cache_dir) == 4


def test_a_marked_shard_of_this_boot_is_served_after_its_installer_is_killed(
        fault_server: FaultServer, tmp_path: Path) -> None:
    """SIGKILL is not a power loss: the page cache keeps the file whole. A later process of
    this boot serves it without fetching it again and makes it durable (it adopts the
    marker)."""
    index = serve_dataset(fault_server, num_shards=2)
    cache_dir = tmp_path / "cache"
    script = (
        "import os, signal, sys\n"
        "from streamcache.cache.node import NodeCache\n"
        "from streamcache.format.index import load_index\n"
        "cache = NodeCache(load_index(sys.argv[1]), sys.argv[2])\n"
        "cache.local_path(0); cache.local_path(1)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script, fault_server.url_for("ds/index.json"),
                           str(cache_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    fault_server.requests.reset()
    with NodeCache(index, str(cache_dir), fetch_options=FAST_RETRIES) as cache:
        assert marks(cache) == [0, 1] and len(cache._pending) == 2  # adopted
        with DatasetReader(index, store=cache, cold_ranges=False) as reader:
            assert read_everything(reader) == index.num_samples
        cache.sync()
        assert marks(cache) == [] and cache.stats.synced == 2
    assert shard_gets(fault_server) == {}


def test_an_evicted_shard_takes_its_marker_with_it(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server, num_shards=6)
    one = max(local_bytes_estimate(info) for info in index.shards)
    cache = NodeCache(index, str(tmp_path / "cache"), cache_limit=2 * one + 1024,
                      working_set_bytes=one, fetch_options=FAST_RETRIES)
    with DatasetReader(index, store=cache, cold_ranges=False) as reader:
        assert read_everything(reader) == index.num_samples
        assert cache.stats.evictions > 0
        installed = sorted(int(p.stem) for p in installed_files(tmp_path / "cache"))
        assert marks(cache) == installed  # a marker for what is there, none for the evicted


def test_a_temporary_cache_writes_no_marker(fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server, num_shards=2)
    with NodeCache(index, str(tmp_path / "cache"), durable=False) as cache:
        cache.local_path(0)
        assert cache._markers is None
    assert not (tmp_path / "cache" / UNSYNCED).exists()


# -------------------------------------------------------------------- the folder is untrusted


def installed(fault_server: FaultServer, tmp_path: Path, shards: list[int], *,
              sync: bool = False) -> tuple[DatasetIndex, Path, str]:
    """A served 2-shard dataset with ``shards`` installed in ``tmp_path/cache`` (synced
    with ``sync``): its index, the cache folder and the dataset's folder name."""
    index = serve_dataset(fault_server, num_shards=2)
    cache_dir = tmp_path / "cache"
    with NodeCache(index, str(cache_dir), fetch_options=FAST_RETRIES) as cache:
        for shard in shards:
            cache.local_path(shard)
        if sync:
            cache.sync()
        return index, cache_dir, dataset_name(cache)


def test_links_planted_in_the_unsynced_folder_are_never_followed(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index, cache_dir, name = installed(fault_server, tmp_path, [0])
    victim = tmp_path / "victim"  # what a planted link points at: must survive
    (victim / name).mkdir(parents=True)
    (victim / name / "000000").write_text("x")
    (victim / "datasets" / name).mkdir(parents=True)
    (victim / "datasets" / name / "000000.arrow").write_text("x")
    unsynced = cache_dir / UNSYNCED
    os.symlink(victim, unsynced / "111111111111")  # another boot's folder, a link
    other = unsynced / "222222222222"
    other.mkdir()
    os.symlink(victim / name, other / name)  # a dataset folder, a link
    os.symlink(victim, other / "x..")  # not a dataset name
    (other / "ab").mkdir()
    (other / "ab" / "not-a-shard").write_text("x")
    NodeCache(index, str(cache_dir)).close()
    assert (victim / name / "000000").read_text() == "x"
    assert (victim / "datasets" / name / "000000.arrow").read_text() == "x"
    assert sorted(os.listdir(unsynced)) == [str(BOOT)]  # the others swept
    assert len(installed_files(cache_dir)) == 1  # this boot's marked shard: kept

    shutil.rmtree(unsynced)
    os.symlink(victim, unsynced)  # the folder itself, a link
    NodeCache(index, str(cache_dir)).close()  # (the sweep unlinks it)
    assert not unsynced.exists() and (victim / name / "000000").exists()
    cache = NodeCache(index, str(cache_dir), fetch_options=FAST_RETRIES)
    os.symlink(victim, unsynced)  # planted after the open: the install refuses it
    with pytest.raises(CacheError, match="symbolic link"):
        cache.local_path(1)
    assert sorted(os.listdir(victim)) == sorted(["datasets", name])
    assert not (victim / str(BOOT)).exists()
    cache.close()


def test_a_marker_of_another_boot_naming_a_shard_of_another_folder_removes_nothing_else(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index, cache_dir, name = installed(fault_server, tmp_path, [0, 1], sync=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "000000.arrow").write_text("keep")
    os.symlink(outside, cache_dir / "datasets" / "planted")
    stale = cache_dir / UNSYNCED / OTHER_BOOT
    (stale / "planted").mkdir(parents=True)
    (stale / "planted" / "000000").write_text("")  # names the linked folder's shard
    (stale / name).mkdir()
    (stale / name / "999999").write_text("")  # names a shard that is not there
    with NodeCache(index, str(cache_dir)) as cache:
        assert cache.lookup(0) is not None and cache.lookup(1) is not None
    assert (outside / "000000.arrow").read_text() == "keep"
    assert not stale.exists()


def test_a_folder_where_a_marker_goes_is_a_clear_error_and_publishes_nothing(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server, num_shards=2)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    assert cache._markers is not None
    path = Path(cache._markers.path(0))
    path.mkdir(parents=True)
    (path / "inside").write_text("x")
    with pytest.raises(CacheError, match=rf"{path}.*remove it"):
        cache.local_path(0)
    assert cache.lookup(0) is None and installed_files(tmp_path / "cache") == []
    shutil.rmtree(path)
    assert cache.local_path(0) == cache.shard_path(0) and marks(cache) == [0]
    cache.close()


@pytest.mark.parametrize("planted", ["fifo", "link"])
def test_a_fifo_or_a_link_where_a_marker_goes_is_replaced_never_opened(
        fault_server: FaultServer, tmp_path: Path, planted: str) -> None:
    """The install removes what is at its marker's path (as it removes a stale copy): a FIFO
    is never opened (no hang), a link is unlinked, its target untouched."""
    index = serve_dataset(fault_server, num_shards=2)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    assert cache._markers is not None
    path = Path(cache._markers.path(0))
    path.parent.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("keep")
    if planted == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(target, path)
    assert cache.local_path(0) == cache.shard_path(0)
    assert path.is_file() and not path.is_symlink() and marks(cache) == [0]
    assert target.read_text() == "keep"
    cache.close()
