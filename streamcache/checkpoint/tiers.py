"""Storage locations for checkpoints: a local directory or any fsspec URL, behind one small API.

The checkpointer always writes DCP files to a local directory (``local_dir``, or ``root``
itself when it is local, or a private temporary directory when ``root`` is remote) and
uploads from there, so every file is checksummed from local disk before it leaves the node.

Reads from a remote location (listings, markers, checksums) retry transient errors (5xx,
throttling, timeouts, resets; :func:`streamcache.remote.retry.is_transient` decides) with backoff,
so that a flaky object store is never mistaken for a damaged checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec

from ..format.checksum import checksum_bytes, checksum_file
from ..remote import storage
from ..remote.options import FetchOptions
from ..remote.retry import backoff_delay, is_transient
from ..remote.storage import UnreadableFileError

log = logging.getLogger("streamcache.checkpoint")

T = TypeVar("T")

READ_ATTEMPTS = 8  # attempts of one remote read, about 5 s of backoff in all
_READ_BACKOFF = FetchOptions(backoff_initial_s=0.05, backoff_max_s=2.0, jitter=0.5)


def retrying(call: Callable[[], T], what: str) -> T:
    """``call()``, attempted up to :data:`READ_ATTEMPTS` times while it fails transiently.

    Raises:
        the last error: a permanent one at once, a transient one after the last attempt.
    """
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            return call()
        except Exception as exc:
            if attempt == READ_ATTEMPTS or not is_transient(exc):
                raise
            log.warning("%s: transient error, attempt %d of %d: %s: %s", what, attempt,
                        READ_ATTEMPTS, type(exc).__name__, exc)
            time.sleep(backoff_delay(attempt, _READ_BACKOFF, random.random()))
    raise AssertionError("unreachable")


class Location:
    """A directory given by an fsspec URL or a local path.

    Thread safety: methods are independent I/O calls; callers coordinate who writes what.
    """

    def __init__(
        self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
    ) -> None:
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        fs, path = fsspec.core.url_to_fs(self.url, **storage.plain_copy(self.storage_options))
        self.fs: Any = fs
        self.path: str = path.rstrip("/") or "/"
        self.is_local = storage.is_local(fs)

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def join(self, name: str) -> str:
        return self.url.rstrip("/") + "/" + name

    def child(self, name: str) -> Location:
        return Location(self.join(name), self.storage_options)

    def local_path(self, name: str = "") -> str:
        """The OS path of ``name`` inside this (local) directory."""
        if not self.is_local:
            raise ValueError(f"{self.url} is not a local directory")
        return os.path.join(self.path, name) if name else self.path

    def makedirs(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def exists(self, name: str = "") -> bool:
        return bool(self.fs.exists(self._p(name)))

    def list_names(self) -> list[str]:
        """Names of the entries directly inside this directory ([] if it does not exist)."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path))
            except FileNotFoundError:
                return []
        try:
            entries = retrying(lambda: self.fs.ls(self.path, detail=False, refresh=True),
                               f"listing {self.url}")
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def list_sizes(self) -> dict[str, int]:
        """{file name: size} of the files directly inside this directory ({} if missing)."""
        if self.is_local:
            sizes = {}
            try:
                with os.scandir(self.path) as it:
                    for entry in it:
                        try:
                            if entry.is_file(follow_symlinks=False):
                                sizes[entry.name] = entry.stat().st_size
                        except FileNotFoundError:
                            # renamed or removed since the listing (another rank's temp file)
                            continue
            except (FileNotFoundError, NotADirectoryError):
                return {}
            return sizes
        try:
            entries = retrying(lambda: self.fs.ls(self.path, detail=True, refresh=True),
                               f"listing {self.url}")
        except FileNotFoundError:
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
            for e in entries
            if e.get("type") == "file"
        }

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The bytes of the small file ``name`` (a marker, a lease, ``global.json``).

        Everything under a root is untrusted: locally a symlink is never followed and a FIFO,
        device or directory is never read; anywhere at most ``limit + 1`` bytes are read.

        Raises:
            FileNotFoundError: there is no such file.
            UnreadableFileError: a symlink, not a regular file, or larger than ``limit``.
        """
        if not self.is_local:
            data = bytes(retrying(lambda: self.fs.cat_file(self._p(name), start=0,
                                                           end=limit + 1), self.join(name)))
        else:
            data = storage.read_regular_local(self.local_path(name), limit, follow_links=False)
        if len(data) > limit:
            raise UnreadableFileError(f"{self.join(name)} is larger than {limit} bytes")
        return data

    def checksum(self, name: str) -> str:
        """Checksum of a file's bytes (local: streamed by the native core; remote: one GET)."""
        if self.is_local:
            return checksum_file(self.local_path(name))
        return checksum_bytes(retrying(lambda: self.fs.cat_file(self._p(name)), self.join(name)))

    def write_atomic(self, name: str, data: bytes) -> None:
        """Publish ``data`` as ``name`` all at once.

        Local: temp file, fsync, rename, fsync of the directory. Object stores: one PUT,
        which is atomic there (a reader sees the whole object or none).
        """
        if not self.is_local:
            self.fs.pipe_file(self._p(name), data)
            return
        storage.write_atomic_local(self.local_path(name), data)

    def create_new(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` only if it does not exist; False if it does.

        Atomic locally (``O_EXCL``) and on stores with conditional writes (fsspec's
        ``mode="create"``); elsewhere a check and a write, which two callers can both pass.
        """
        path = self.local_path(name) if self.is_local else self._p(name)
        return storage.create_exclusive(self.fs, path, data)

    def put_file(self, local_file: str, name: str) -> None:
        """Copy a local file into this location as ``name`` (durable for local targets)."""
        if not self.is_local:
            self.fs.put_file(local_file, self._p(name))
            return
        target = self.local_path(name)
        with open(local_file, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
            dst.flush()
            os.fsync(dst.fileno())

    def remove_tree(self) -> None:
        """Delete this directory and everything in it; a missing directory is fine."""
        if self.is_local:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path, recursive=True)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(name))

    def _p(self, name: str) -> str:
        return f"{self.path}/{name}" if name else self.path
