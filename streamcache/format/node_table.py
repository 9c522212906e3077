"""The node's copy of a large index's shard table: opened (memory-mapped), never loaded.

A dataset of a million shards has a shard table of about 100 MB decoded. Loading it in every
rank process (and again in every restarted one) cost seconds and hundreds of MB per process.
Instead the first process of a node that opens a dataset version decodes the Parquet side
file once (format/side_table.py), checks it as every index is checked (checksum, fingerprint,
paths), and writes it in the table layout (format/table_layout.py) to

    <cache_dir>/tables/<uid>/<fingerprint>-<side file checksum>.table

Every later process of the node, and of every later run, maps that file: opening costs a few
system calls and a header, nothing per shard; the pages are the page cache's, shared by the
node's processes and read only where a step looks.

Why a copy may be trusted without reading it again (docs/trust.md, "The node copy of a shard
table"): the copy is named by what identifies the dataset version (the index's fingerprint
and the side file's checksum, both read from the index.json of this open), lives in a folder
of this user's own (mode 0700, refused if it is a link or anyone else's), is written whole
(temporary file, fsync, read-only mode, rename) by a process of this user that decoded and
verified the side file, and is used only while it is the very file that process wrote: its
inode, size, modification and change times and owner are recorded beside it (``.stamp``)
right after the rename, and compared with the open file (``fstat`` of the descriptor that
is mapped) on every open. Any change to the file since (a write, a truncation, ``chmod``,
``touch``, a rename or a link put in its place, a copy of another dataset's table) changes
its inode or its change time, which no process can set back; the stamp, the header's
fingerprint and checksum, and the layout's sizes must all agree, or the copy is rebuilt
from the side file. Another user can neither write into the folder nor replace the file.

Building is serialized per copy by a file lock, so the ranks of a node wait for the one that
builds rather than each decoding the side file; a process killed while building leaves a
temporary file that the next builder (holding the lock, so no one else is writing it)
removes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import CacheError, IndexFormatError
from .shard_table import ShardTable
from .table_layout import LayoutWriter, open_layout, open_table

TABLES = "tables"
SUFFIX = ".table"
STAMP_SUFFIX = ".stamp"
STAMP_LIMIT = 4096
_HEX = re.compile(r"xxh64:([0-9a-f]{16})")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
# (O_NONBLOCK: a FIFO planted in a file's place must not block the open)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True)
class TableKey:
    """What identifies a dataset version's shard table, as its index.json records it."""

    fingerprint: str
    side_checksum: str
    side_bytes: int

    @property
    def name(self) -> str | None:
        """The copy's file name (without suffix); None when the index's values are not
        plain checksums (such an index gets no node copy)."""
        fingerprint = _HEX.fullmatch(self.fingerprint)
        checksum = _HEX.fullmatch(self.side_checksum)
        if fingerprint is None or checksum is None:
            return None
        return f"{fingerprint[1]}-{checksum[1]}"

    def metadata(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "side_checksum": self.side_checksum,
                "side_bytes": self.side_bytes}


Build = Callable[[LayoutWriter], dict[str, Any]]


def open_node_table(cache_dir: str, key: TableKey, build: Build) -> ShardTable | None:
    """The node copy of ``key``'s table; if there is no trustworthy one, it is built:
    ``build(writer)`` writes every column, verifies the table (raising if it is not
    ``key``'s) and returns the metadata to record with it (``shards`` among them). None if
    ``key`` has no name or ``cache_dir`` cannot hold copies (read-only): the caller loads
    the table in memory.

    Raises:
        CacheError: the copies' folder is a link or belongs to someone else (planted).
        IndexFormatError: from ``build``: the side file is not a valid table of this index
            (nothing is published).
    """
    name = key.name
    if name is None:
        return None
    try:
        folder = _folder(cache_dir)
    except CacheError:
        raise
    except OSError:  # read-only, not a folder, full: the table is loaded in memory instead
        return None
    try:
        table = _open(folder, cache_dir, name, key)
        if table is not None:
            return table
        with _locked(folder, name):
            table = _open(folder, cache_dir, name, key)
            if table is None:
                try:
                    _build(folder, name, key, build)
                except OSError:  # the cache's disk is full (or fails): load in memory
                    return None
                table = _open(folder, cache_dir, name, key)
        if table is None:
            raise IndexFormatError(f"the node copy of the shard table {name} in {cache_dir} "
                                   "changed as soon as it was written: check what else "
                                   "writes to this cache folder")
        return table
    finally:
        os.close(folder)


def reopen_node_table(cache_dir: str, key: TableKey) -> ShardTable:
    """The node copy of ``key`` in another process (a pickled table); it must be there."""
    table = None
    name = key.name
    if name is not None:
        folder = _folder(cache_dir)
        try:
            table = _open(folder, cache_dir, name, key)
        finally:
            os.close(folder)
    if table is None:
        raise IndexFormatError(f"the node copy of the shard table {name} in {cache_dir} is "
                               "gone or changed: open the dataset again")
    return table


def _folder(cache_dir: str) -> int:
    """A descriptor of ``cache_dir/tables/<uid>``, made if missing (0700), refused if it or
    ``tables`` is a link or it is another user's (CacheError), made private if it is open to
    others (an OSError where it cannot be: no copies on that file system)."""
    uid = os.geteuid()
    os.makedirs(cache_dir, exist_ok=True)
    fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part, mode in ((TABLES, 0o755), (str(uid), 0o700)):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _planted(cache_dir, part) from error
                raise
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise CacheError(
                f"{os.path.join(cache_dir, TABLES, str(uid))} belongs to uid {st.st_uid}; the "
                "node copies of shard tables are kept in a private folder of their user: "
                "remove it (or use another cache_dir)")
        if st.st_mode & 0o077:  # ours, but open to others: made private, where it can be
            os.fchmod(fd, 0o700)
            if os.fstat(fd).st_mode & 0o077:
                raise PermissionError("a private folder cannot be made here")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _planted(cache_dir: str, part: str) -> CacheError:
    return CacheError(f"{os.path.join(cache_dir, TABLES)}/{part} is a symbolic link or not a "
                      "folder; the node copies of shard tables are written only into a "
                      "folder of their own: remove it (or use another cache_dir)")


@contextlib.contextmanager
def _locked(folder: int, name: str) -> Iterator[None]:
    """The build lock of one copy (flock of ``<name>.lock``; the kernel frees it when its
    holder dies)."""
    fd = os.open(f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=folder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _stamp(st: os.stat_result, key: TableKey) -> dict[str, Any]:
    """What the copy's writer saw of the file it published, and the version it holds."""
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "uid": st.st_uid,
            **key.metadata()}


def _open(folder: int, cache_dir: str, name: str, key: TableKey) -> ShardTable | None:
    """The copy, if it is the file its writer published for ``key``; else None."""
    try:
        fd = os.open(name + SUFFIX, _FILE_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None  # a link in its place: not the copy (the build replaces it)
        raise
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o222 or _read_stamp(folder, name) != _stamp(st, key)):
            return None
        try:
            mapping = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # (empty, or a file system that cannot map)
            return None
        where = os.path.join(cache_dir, TABLES, str(os.geteuid()), name + SUFFIX)
        try:
            header, columns = open_layout(mapping, where)
            metadata = header.get("metadata")
            if not isinstance(metadata, dict) or metadata.get("fingerprint") != \
                    key.fingerprint or metadata.get("side_checksum") != key.side_checksum:
                return None
            return open_table(header, columns, where, keepalive=mapping, fd=fd,
                              reopen=(reopen_node_table, (cache_dir, key)))
        except IndexFormatError:
            return None  # (damaged although its stamp matches: rebuilt like a changed one)
    finally:
        os.close(fd)


def _read_stamp(folder: int, name: str) -> Any:
    """The copy's stamp as its writer recorded it, or None where there is none that can be
    read (missing, not a regular file, over ``STAMP_LIMIT``, not JSON, nested too deeply):
    a stamp that is not one matches no copy, which is then rebuilt."""
    try:
        fd = os.open(name + STAMP_SUFFIX, _FILE_FLAGS, dir_fd=folder)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, STAMP_LIMIT + 1)  # (a regular file: one read, up to the limit)
        return json.loads(raw) if len(raw) <= STAMP_LIMIT else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def _remove(folder: int, entry: str) -> None:
    """Remove ``entry`` of the copies' folder, whatever it is (a link is removed, not
    followed; a folder in a file's place is removed with what it holds, links unfollowed)."""
    try:
        os.unlink(entry, dir_fd=folder)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(entry, dir_fd=folder)


def _build(folder: int, name: str, key: TableKey, build: Build) -> None:
    """Write the copy (lock held): leftovers removed, a temporary file written (``build``
    verifies what it writes), synced, made read-only, renamed into place, then its stamp
    published."""
    for entry in os.listdir(folder):
        if entry.startswith(f".{name}.") or entry in (name + SUFFIX, name + STAMP_SUFFIX):
            _remove(folder, entry)
    temporary = f".{name}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20, closefd=False) as sink:
            writer = LayoutWriter(sink, lambda offset, length: os.pread(fd, length, offset))
            metadata = build(writer)
            writer.finish(metadata["shards"], {**metadata, **key.metadata()})
        os.fsync(fd)
        os.fchmod(fd, 0o444)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder)
        raise
    os.close(fd)
    os.rename(temporary, name + SUFFIX, src_dir_fd=folder, dst_dir_fd=folder)
    st = os.stat(name + SUFFIX, dir_fd=folder, follow_symlinks=False)
    stamp_temporary = f".{name}.{os.getpid()}.stamp"
    fd = os.open(stamp_temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600, dir_fd=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(_stamp(st, key), f, sort_keys=True)
    os.rename(stamp_temporary, name + STAMP_SUFFIX, src_dir_fd=folder, dst_dir_fd=folder)
    os.fsync(folder)


__all__ = ["TABLES", "TableKey", "open_node_table", "reopen_node_table"]
