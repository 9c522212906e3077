"""A writer that fails at the end leaves nothing of its own (#21 item 11): a full disk while
index.json (or the shard table's side file) is published removes the writer's shards and
side file, keeps a dataset that was there, and keeps everything when the index did get
published (the failure came after the rename)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streamcache.format.index_format as index_format
from streamcache.errors import DestinationError
from streamcache.format.index import load_index
from streamcache.format.writer import write_dataset
from streamcache.remote import storage

CONTROL_FILES = {"_streamcache-writer.lease"}


class FullDisk:
    """Makes the local disk "fill up" while a file whose name ends with ``name`` is being
    published: its temporary file's write fails with ENOSPC (``after_rename``: the rename
    succeeds, the folder's fsync fails)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, *,
                 after_rename: bool = False) -> None:
        self.name, self.hits = name, 0
        original_write, original_sync = storage.write_atomic_local, storage.fsync_dir
        published: list[str] = []

        def write(path: str, data: bytes, *, durable: bool = True) -> None:
            if path.endswith(name) and not after_rename:
                self.hits += 1
                with storage.atomic_write(path, durable=durable) as f:
                    f.write(data[:len(data) // 2])
                    raise OSError(errno.ENOSPC, "No space left on device")
            if path.endswith(name):
                published.append(path)
            original_write(path, data, durable=durable)

        def sync(folder: str) -> None:
            if published and after_rename:
                published.clear()
                self.hits += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            original_sync(folder)

        monkeypatch.setattr(storage, "write_atomic_local", write)
        monkeypatch.setattr(storage, "fsync_dir", sync)


def _samples(count: int, start: int = 0) -> Any:
    return ({"x": np.int64(start + i)} for i in range(count))


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("side_file", [False, True])
def test_a_full_disk_at_the_index_leaves_nothing_of_the_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, side_file: bool) -> None:
    if side_file:
        monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 2)
    dst = tmp_path / "ds"
    disk = FullDisk(monkeypatch, "index.json")
    with pytest.raises(DestinationError, match="No space left on device"):
        write_dataset(_samples(40), str(dst), shard_size=100)
    assert disk.hits == 1
    assert _files(dst) == set()  # no shard, no side file, no temporary, no lease


def test_a_full_disk_at_the_side_file_leaves_nothing_either(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 2)
    dst = tmp_path / "ds"
    FullDisk(monkeypatch, ".parquet")
    with pytest.raises(DestinationError, match="No space left on device"):
        write_dataset(_samples(40), str(dst), shard_size=100)
    assert _files(dst) == set()


def test_a_failure_after_the_rename_keeps_the_published_dataset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "ds"
    FullDisk(monkeypatch, "index.json", after_rename=True)
    with pytest.raises(DestinationError, match="No space left on device"):
        write_dataset(_samples(40), str(dst), shard_size=100)
    monkeypatch.undo()
    assert load_index(str(dst)).num_samples == 40  # published: its shards are kept


def test_a_failed_overwrite_keeps_the_old_dataset_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "ds"
    write_dataset(_samples(30, 100), str(dst), shard_size=100)
    before = _files(dst)
    FullDisk(monkeypatch, "index.json")
    with pytest.raises(DestinationError, match="No space left on device"):
        write_dataset(_samples(40), str(dst), shard_size=100, overwrite=True)
    monkeypatch.undo()
    assert _files(dst) == before
    index = load_index(str(dst))
    assert index.num_samples == 30
    assert os.path.exists(index.shard_url(0))


def test_reindexing_that_fails_keeps_the_side_file_the_old_index_uses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `streamcache index` of the same files again writes the same side file (same content,
    # same name): a failed publish of the new index.json must not remove it
    from streamcache.format.index import build_index
    monkeypatch.setattr(index_format, "SHARD_TABLE_MIN_SHARDS", 2)
    dst = tmp_path / "ds"
    write_dataset(_samples(40), str(dst), shard_size=100, compression=None)
    build_index(str(dst))
    FullDisk(monkeypatch, "index.json")
    with pytest.raises(DestinationError):
        build_index(str(dst))
    monkeypatch.undo()
    assert load_index(str(dst)).num_samples == 40


def test_a_shard_that_fails_in_the_background_stops_the_writer_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # many shards, the 6th fails while later ones are cut: the failure reaches the caller
    # (at a later write or at close), nothing is published, every stored shard is removed
    from streamcache import ShardWriter
    from streamcache.format import writer as writer_module

    original = writer_module.ShardWriter._encode_and_store

    def store(self: Any, name: str, batch: Any) -> Any:
        if name.endswith("-00005.arrow"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, name, batch)

    monkeypatch.setattr(writer_module.ShardWriter, "_encode_and_store", store)
    writer = ShardWriter(str(tmp_path / "out"), shard_size=1)
    with pytest.raises(OSError, match="No space left"):
        for i in range(40):
            writer.write({"x": np.int64(i)})
        writer.close()
    writer.abort()  # (a no-op when the failure already stopped it)
    assert not (tmp_path / "out" / "index.json").exists()
    left = {p.name for p in (tmp_path / "out").iterdir()} - CONTROL_FILES
    assert not any(name.endswith(".arrow") for name in left), left
