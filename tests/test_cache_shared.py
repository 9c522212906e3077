"""The shared cache folder as hostile input: links planted by another user of the folder,
foreign files where the cache's own should be, and a second process sharing the folder.

The rule under test (cache/confine.py): the cache never creates, locks or writes a file
through a symbolic link below ``cache_dir``; a planted link is refused with a CacheError that
names it, and nothing is created where it points.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cache import (
    check_batch,
    installed_size,
    node_view,
    process_context,
    write_one_row_shards,
    write_shards,
)

from streamcache import DatasetReader, load_index
from streamcache.cache import ledger
from streamcache.cache.node import NodeCache
from streamcache.errors import CacheError


def everything_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """Another user's folder: nothing may appear in it."""
    folder = tmp_path / "other-user"
    folder.mkdir()
    (folder / "keep").write_bytes(b"mine")
    return folder


@pytest.mark.parametrize("planted", ["locks", "datasets", "tmp"])
def test_a_planted_top_folder_link_is_refused_and_nothing_is_created_there(
        tmp_path: Path, outside: Path, planted: str) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.symlink(outside, cache_dir / planted)
    with pytest.raises(CacheError, match=rf"{planted} is a symbolic link.*remove the link"):
        NodeCache(index, str(cache_dir)).install(0)
    assert everything_under(outside) == ["keep"]


def test_a_locks_link_planted_after_the_cache_opened_is_never_followed(
        tmp_path: Path, outside: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=3)
    cache_dir = tmp_path / "cache"
    cache = NodeCache(index, str(cache_dir))
    cache.install(0)
    os.rename(cache_dir / "locks", tmp_path / "old-locks")
    os.symlink(outside, cache_dir / "locks")
    with pytest.raises(CacheError, match="symbolic link"):
        cache.install(1)
    assert everything_under(outside) == ["keep"]


def test_a_planted_lock_file_link_is_never_followed(tmp_path: Path, outside: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    cache_dir = tmp_path / "cache"
    cache = NodeCache(index, str(cache_dir))
    lock_dir = next((cache_dir / "locks").iterdir())
    os.symlink(outside / "victim", lock_dir / "000001.lock")
    with pytest.raises(CacheError, match="symbolic link"):
        cache.install(1)
    assert everything_under(outside) == ["keep"]
    cache.install(0)  # the other shards are unaffected


def test_a_planted_accounting_lock_link_is_never_followed(tmp_path: Path, outside: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.symlink(outside / "victim", cache_dir / "accounting.lock")
    with pytest.raises(CacheError, match=r"accounting\.lock is a symbolic link"):
        NodeCache(index, str(cache_dir))
    assert everything_under(outside) == ["keep"]


def test_a_file_where_a_cache_folder_should_be_is_refused(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=2)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "locks").write_bytes(b"not a folder")
    with pytest.raises(CacheError, match="not a folder of its own"):
        NodeCache(index, str(cache_dir))


def test_the_cache_dir_itself_may_be_a_link(tmp_path: Path) -> None:
    """The user chose it (e.g. ~/.cache/streamcache -> /nvme/cache)."""
    index = write_shards(tmp_path / "ds", num_shards=2)
    (tmp_path / "nvme").mkdir()
    os.symlink(tmp_path / "nvme", tmp_path / "cache")
    cache = NodeCache(index, str(tmp_path / "cache"))
    cache.install(0)
    assert any(p.name == "000000.arrow" for p in (tmp_path / "nvme" / "datasets").rglob("*"))


def test_open_below_refuses_dot_dot_and_empty_paths(tmp_path: Path) -> None:
    from streamcache.cache.confine import open_below

    for bad in ("", "../x", "locks/../../x"):
        with pytest.raises(ValueError, match="plain path"):
            open_below(str(tmp_path), bad, os.O_RDONLY)


def _install_all(index_folder: str, cache_dir: str, report: str) -> None:
    index = load_index(index_folder)
    with NodeCache(index, cache_dir) as cache:
        installed = sum(cache.install(shard) > 0 for shard in range(len(index.shards)))
    Path(report).write_text(str(installed))


def test_a_second_process_sharing_the_folder_installs_each_shard_once(tmp_path: Path) -> None:
    index = write_shards(tmp_path / "ds", num_shards=4)
    cache_dir = str(tmp_path / "cache")
    context = multiprocessing.get_context("fork")
    report = tmp_path / "theirs"
    other = context.Process(target=_install_all,
                            args=(str(tmp_path / "ds"), cache_dir, str(report)))
    other.start()
    with DatasetReader(index, store=NodeCache(index, cache_dir)) as reader:
        cache = reader.store
        assert isinstance(cache, NodeCache)
        mine = sum(cache.install(shard) > 0 for shard in range(4))
        other.join(60)
        assert other.exitcode == 0
        ids = np.arange(len(reader))
        check_batch(reader.read_batch(ids), ids)
    assert mine + int(report.read_text()) == 4  # each shard downloaded once on the node
    assert len(list((tmp_path / "cache" / "datasets").rglob("*.arrow"))) == 4


def _install_in_turn(index_folder: str, cache_dir: str, limit: int, reverse: bool,
                     start: Any) -> None:
    ledger.COMPACT_SLACK = 8  # the accounting file is rewritten while the other appends
    index = load_index(index_folder)
    order = list(range(len(index.shards)))
    with NodeCache(index, cache_dir, cache_limit=limit, working_set_bytes=1,
                   durable=False) as cache:  # (fsyncs would only slow the races down)
        start.wait()
        for shard in (order[::-1] if reverse else order) * 2:
            cache.install(shard)


def test_two_processes_installing_at_once_keep_the_node_within_its_budget(
        tmp_path: Path) -> None:
    """Each process evicts with the other's installs counted: at every moment (read under
    the cache lock) the installed files fit cache_limit and each of them is counted."""
    index = write_one_row_shards(tmp_path / "ds", 80)
    cache_dir = tmp_path / "cache"
    limit = 10 * installed_size(index, tmp_path / "probe")
    ctx = process_context()
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_install_in_turn,
                         args=(str(tmp_path / "ds"), str(cache_dir), limit, reverse, start))
             for reverse in (False, True)]
    for proc in procs:
        proc.start()
    start.wait(60)  # both opened the cache
    views = 0
    while any(proc.is_alive() for proc in procs):
        files, books = node_view(cache_dir)
        assert sum(files.values()) <= limit
        assert books is not None and set(files) <= set(books), set(files) - set(books or {})
        views += 1
        time.sleep(0.01)  # (the lock is theirs most of the time)
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert views >= 10  # the budget was looked at while they installed
    files, books = node_view(cache_dir)
    assert books == files and len(files) == 10
