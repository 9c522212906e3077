"""fsspec helpers (streamcache/remote/storage.py): URLs to filesystems, path joining, atomic
publication (old file or whole new one, never a part, no temporary left), exclusive
creation locally and on memory://, OS errors as one clear DestinationError, and bounded
reads of small local regular files."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import fsspec
import pytest

from streamcache.errors import DestinationError, UnknownProtocolError
from streamcache.remote import storage


def test_filesystem_and_paths() -> None:
    fs, path = storage.filesystem("/tmp/a/b")
    assert storage.is_local(fs) and path == "/tmp/a/b"
    assert storage.unstrip(fs, path) == "/tmp/a/b"
    mem, mem_path = storage.filesystem("memory://bucket/key")
    full = storage.unstrip(mem, mem_path)  # a URL that leads back to the same object
    assert not storage.is_local(mem) and full.startswith("memory://")
    assert storage.filesystem(full)[1] == mem_path
    with pytest.raises(UnknownProtocolError, match=r"s4://x: unknown protocol s4://"):
        storage.filesystem("s4://x")
    assert storage.join("root/ds", "shards/0.arrow") == "root/ds/shards/0.arrow"
    assert storage.join("root/ds/", "0.arrow") == "root/ds/0.arrow"
    assert storage.join("", "0.arrow") == "0.arrow"
    assert storage.join("root", "/abs/0.arrow") == "/abs/0.arrow"  # absolute: kept
    assert storage.join("root", "s3://b/0.arrow") == "s3://b/0.arrow"


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_publishes_the_whole_file_and_no_temporary(tmp_path: Path,
                                                                durable: bool) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    with storage.atomic_write(str(target), "w", durable=durable) as f:
        f.write("new")
        assert target.read_text() == "old"  # not yet published
        assert Path(f.name).name.startswith(".tmp-") and Path(f.name).parent == tmp_path
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["state.json"]
    storage.write_atomic_local(str(target), b"bytes", durable=durable)
    assert target.read_bytes() == b"bytes" and os.listdir(tmp_path) == ["state.json"]


def test_an_exception_while_writing_publishes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="midway"), \
            storage.atomic_write(str(target), "w") as f:
        f.write("half")
        raise RuntimeError("midway")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]
    with pytest.raises(KeyboardInterrupt), storage.atomic_path(str(tmp_path / "new")) as temp:
        Path(temp).write_text("half")
        raise KeyboardInterrupt  # also for BaseException
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_publish_removes_the_temporary(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "child").write_text("x")
    with pytest.raises(OSError), storage.atomic_path(str(tmp_path / "taken")) as temp:
        Path(temp).write_text("file over a non-empty folder")
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_temporaries_in_another_folder_and_with_a_suffix(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    name = storage.temp_path(str(tmp_path / "x.arrow"), suffix=".part", temp_dir=str(spool))
    assert Path(name).parent == spool and Path(name).name.startswith(".tmp-")
    assert name.endswith("x.arrow.part")
    assert storage.temp_path(str(tmp_path / "x")) != storage.temp_path(str(tmp_path / "x"))
    with storage.atomic_path(str(tmp_path / "x.arrow"), temp_dir=str(spool)) as temp:
        Path(temp).write_bytes(b"data")
    assert (tmp_path / "x.arrow").read_bytes() == b"data" and not os.listdir(spool)


def test_create_exclusive_locally_and_on_memory(tmp_path: Path) -> None:
    local, path = storage.filesystem(str(tmp_path / "lease"))
    assert storage.create_exclusive(local, path, b"first")
    assert not storage.create_exclusive(local, path, b"second")
    assert (tmp_path / "lease").read_bytes() == b"first"
    mem, key = storage.filesystem(f"memory://streamcache-test-{uuid.uuid4().hex}/lease")
    try:
        assert storage.create_exclusive(mem, key, b"first")
        assert not storage.create_exclusive(mem, key, b"second")
        assert mem.cat_file(key) == b"first"
    finally:
        mem.rm(key)


def test_publish_bytes_locally_and_on_memory(tmp_path: Path) -> None:
    local, path = storage.filesystem(str(tmp_path / "deep" / "folder" / "obj"))
    storage.publish_bytes(local, path, b"one")  # creates the folders
    assert Path(path).read_bytes() == b"one"
    url = f"memory://streamcache-test-{uuid.uuid4().hex}/obj"
    mem, key = storage.filesystem(url)
    try:
        storage.publish_bytes(mem, key, b"two")
        assert fsspec.open(url, "rb").open().read() == b"two"
    finally:
        mem.rm(key)


def test_os_errors_while_writing_say_what_to_do(tmp_path: Path) -> None:
    fs, path = storage.filesystem(str(tmp_path / "out"))
    with pytest.raises(DestinationError, match="permission denied; choose a writable"), \
            storage.destination_errors(fs, path):
        raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(DestinationError, match=r"is the disk full\?") as caught, \
            storage.destination_errors(fs, path):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(tmp_path / "out") in str(caught.value)
    with pytest.raises(ValueError, match="not an OS error"), \
            storage.destination_errors(fs, path):
        raise ValueError("not an OS error")  # other errors pass through unchanged
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fs, path = storage.filesystem(str(blocker / "under" / "obj"))
    with pytest.raises(DestinationError, match="cannot write"):
        storage.publish_bytes(fs, path, b"data")  # a file where a folder should be


def test_fsync_dir_is_a_no_op_where_a_folder_cannot_be_opened(tmp_path: Path) -> None:
    storage.fsync_dir(str(tmp_path))
    storage.fsync_dir(str(tmp_path / "absent"))


def test_read_regular_local_reads_a_bounded_prefix_and_follows_links_only_when_told(
        tmp_path: Path) -> None:
    """One reader of small local files for the checkpoint tiers (a link is refused: the
    root's writers are not trusted) and the Trainer's checkpoint folders (followed: they may
    be copies made of links)."""
    data = tmp_path / "state.json"
    data.write_bytes(b"x" * 10)
    link = tmp_path / "link.json"
    link.symlink_to(data)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for follow in (False, True):
        assert storage.read_regular_local(str(data), 100, follow_links=follow) == b"x" * 10
        assert storage.read_regular_local(str(data), 4, follow_links=follow) == b"x" * 5
        for not_regular in (fifo, tmp_path):  # a FIFO is refused at once, not waited on
            with pytest.raises(storage.UnreadableFileError, match="not a regular file"):
                storage.read_regular_local(str(not_regular), 100, follow_links=follow)
        with pytest.raises(FileNotFoundError):
            storage.read_regular_local(str(tmp_path / "missing"), 100, follow_links=follow)
    assert storage.read_regular_local(str(link), 100, follow_links=True) == b"x" * 10
    with pytest.raises(storage.UnreadableFileError, match="symbolic link"):
        storage.read_regular_local(str(link), 100, follow_links=False)
