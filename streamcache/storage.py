"""fsspec helpers shared by the writer, the index and the readers.

fsspec is the only remote layer: a URL is anything fsspec knows (a local path, file://,
memory://, s3://, gs://, az://, http(s)://). Nothing here knows a particular cloud.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from fsspec.core import url_to_fs

from .errors import DestinationError, StorageError, UnknownProtocolError


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it.

    Raises:
        UnknownProtocolError: fsspec knows no protocol of that name (``s4://``).
        StorageError: the protocol's fsspec backend is not installed (e.g. s3fs).
    """
    try:
        fs, path = url_to_fs(url, **dict(storage_options or {}))
    except ValueError as exc:
        if "Protocol not known" not in str(exc):
            raise
        protocol = url.split("://", 1)[0]
        raise UnknownProtocolError(
            f"{url}: unknown protocol {protocol}://; use a local path or one fsspec knows "
            "(s3://, gs://, az://, http(s)://, memory://, file://)") from None
    except ImportError as exc:
        raise StorageError(f"{url}: {exc}") from None
    return fs, path


def is_local(fs: Any) -> bool:
    protocol = fs.protocol
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return "file" in protocols or "local" in protocols


def is_absolute_url(path: str) -> bool:
    return "://" in path or path.startswith("/")


def join(base: str, relative: str) -> str:
    """Join a path inside a filesystem with a relative, '/'-separated path."""
    if is_absolute_url(relative):
        return relative
    return posixpath.join(base.rstrip("/"), relative) if base else relative


def unstrip(fs: Any, path: str) -> str:
    """A full URL for a path of ``fs`` (local paths stay plain paths)."""
    if is_local(fs):
        return path
    return str(fs.unstrip_protocol(path))


def write_atomic_local(path: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to a local ``path``: temporary file, fsync, rename, fsync of the folder.

    A reader sees the old file or the whole new one, never a part; an exception publishes
    nothing.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix="-" + os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def destination_errors(fs: Any, path: str) -> Iterator[None]:
    """Turn an OS error while writing ``path`` into one clear :class:`DestinationError`."""
    try:
        yield
    except PermissionError as exc:
        raise DestinationError(
            f"cannot write {unstrip(fs, path)}: permission denied; choose a writable destination"
        ) from exc
    except OSError as exc:
        raise DestinationError(
            f"cannot write {unstrip(fs, path)}: {exc} (is the disk full?)"
        ) from exc


def publish_bytes(fs: Any, path: str, data: bytes) -> None:
    """Publish a whole object atomically: rename on a local disk, one PUT on an object store."""
    with destination_errors(fs, path):
        if is_local(fs):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            write_atomic_local(path, data)
        else:
            fs.pipe_file(path, data)


__all__ = [
    "destination_errors",
    "filesystem",
    "fsync_dir",
    "is_absolute_url",
    "is_local",
    "join",
    "publish_bytes",
    "unstrip",
    "write_atomic_local",
]
