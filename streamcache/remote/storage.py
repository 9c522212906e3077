"""fsspec helpers shared by the writer, the index and the readers, and small local-file I/O
(atomic writes, bounded reads of regular files) shared by the checkpoint and the Trainer.

fsspec is the only remote layer: a URL is anything fsspec knows (a local path, file://,
memory://, s3://, gs://, az://, http(s)://). Nothing here knows a particular cloud.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
import uuid
from collections.abc import Iterator, Mapping
from typing import IO, Any

from fsspec.core import url_to_fs

from ..errors import DestinationError, StorageError, StreamcacheError, UnknownProtocolError


def plain_copy(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``storage_options`` whose nested dicts and lists are copies too (other values,
    such as a session object, are shared), to hand to fsspec: botocore rewrites a ``retries``
    dict in place (``max_attempts`` becomes ``total_max_attempts``), and the user's options,
    reused for another dataset or compared later, must stay as they were written."""
    def copied(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: copied(item) for key, item in value.items()}
        if isinstance(value, list):
            return [copied(item) for item in value]
        return value

    return {key: copied(value) for key, value in (storage_options or {}).items()}


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it.

    Raises:
        UnknownProtocolError: fsspec knows no protocol of that name (``s4://``).
        StorageError: the protocol's fsspec backend is not installed (e.g. s3fs).
    """
    try:
        fs, path = url_to_fs(url, **plain_copy(storage_options))
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


def temp_path(path: str, *, suffix: str = "", temp_dir: str | None = None) -> str:
    """A fresh temporary name for a file to be published as ``path``.

    It lies in ``temp_dir`` (default: ``path``'s folder, which must be on the same filesystem
    for the rename) and starts with ``.tmp-``, so listings of published files skip it.
    """
    folder = temp_dir or os.path.dirname(os.path.abspath(path))
    return os.path.join(
        folder, f".tmp-{uuid.uuid4().hex[:12]}-{os.path.basename(path)}{suffix}")


def fsync_file(path: str) -> None:
    """Put ``path``'s bytes on disk (before it is renamed into place)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_temp(temp: str, path: str, *, durable: bool = True) -> None:
    """Rename the finished file ``temp`` over ``path``; when ``durable``, fsync the file first
    and ``path``'s folder after, so a power loss leaves the old file or the whole new one."""
    if durable:
        fsync_file(temp)
    os.replace(temp, path)
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_path(path: str, *, durable: bool = True, suffix: str = "",
                temp_dir: str | None = None) -> Iterator[str]:
    """Yield a temporary path to write; publish it as ``path`` when the block ends.

    A reader sees the old file or the whole new one, never a part. An exception in the block
    (or in publishing) removes the temporary and publishes nothing; a crash may leave the
    temporary (see :func:`temp_path` for its name and folder).
    """
    temp = temp_path(path, suffix=suffix, temp_dir=temp_dir)
    try:
        yield temp
        publish_temp(temp, path, durable=durable)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb", *, durable: bool = True,
                 temp_dir: str | None = None) -> Iterator[IO[Any]]:
    """:func:`atomic_path` with the temporary opened in ``mode`` ("wb" or "w")."""
    with atomic_path(path, durable=durable, temp_dir=temp_dir) as temp, \
            open(temp, mode) as f:  # closed before atomic_path publishes it
        yield f


def write_atomic_local(path: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to a local ``path`` atomically (:func:`atomic_write`)."""
    with atomic_write(path, durable=durable) as f:
        f.write(data)


class UnreadableFileError(ValueError):
    """A small file that must not be read as it is: a symlink, not a regular file, too large."""


def read_regular_local(path: str, limit: int, *, follow_links: bool) -> bytes:
    """At most ``limit + 1`` bytes of the local regular file ``path``: one byte more than
    ``limit`` tells the caller the file is too large, without reading the rest.

    The file is opened without blocking, so a FIFO in its place is refused at once rather
    than waited on. ``follow_links=False`` refuses a symbolic link as the last part of the
    path (a folder whose writers are not trusted, such as a checkpoint root);
    ``follow_links=True`` follows it (a Trainer checkpoint folder may be a copy made of links).

    Raises:
        FileNotFoundError: nothing is at ``path``.
        UnreadableFileError: ``path`` is a symbolic link (with ``follow_links=False``) or
            not a regular file (a FIFO, a device, a folder).
        OSError: another failure to open or read it.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise UnreadableFileError(f"{path} is a symbolic link") from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnreadableFileError(f"{path} is not a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def fsync_dir(folder: str) -> None:
    """Make renames inside ``folder`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_exclusive(fs: Any, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if nothing is there; False if something is.

    Atomic on a local disk (``O_EXCL``, then fsync) and on stores with conditional writes
    (fsspec's ``mode="create"``); elsewhere a check and a write, which two callers can both
    pass (callers that need more read the object back).
    """
    if is_local(fs):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True
    fs.invalidate_cache(path)  # a listing cached by fsspec may be stale
    if fs.exists(path):  # also where conditional writes are silently ignored
        return False
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except (TypeError, NotImplementedError, ValueError):  # no conditional writes here
        fs.pipe_file(path, data)
    return True


# Packages whose exceptions are a store's answer (credentials, endpoint, throttling), not a bug.
_STORE_CLIENTS = frozenset({
    "botocore", "aiobotocore", "boto3", "s3fs", "gcsfs", "google", "adlfs", "azure", "aiohttp",
    "requests", "urllib3", "fsspec", "ocifs", "huggingface_hub"})


@contextlib.contextmanager
def destination_errors(fs: Any, path: str) -> Iterator[None]:
    """Turn an error of the store while writing ``path`` (an OS error, or a cloud client's:
    no credentials, an unreachable endpoint) into one clear :class:`DestinationError`."""
    try:
        yield
    except StreamcacheError:
        raise
    except PermissionError as exc:
        raise DestinationError(
            f"cannot write {unstrip(fs, path)}: permission denied; choose a writable destination"
        ) from exc
    except OSError as exc:
        raise DestinationError(
            f"cannot write {unstrip(fs, path)}: {exc} (is the disk full?)"
        ) from exc
    except Exception as exc:  # botocore, gcsfs, adlfs... raise their own classes
        if type(exc).__module__.split(".")[0] not in _STORE_CLIENTS:
            raise  # a bug of ours or the caller's is not a store's error
        names = {cls.__name__ for cls in type(exc).__mro__}
        hint = ("set the store's credentials (e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or storage_options)" if any("Credential" in n for n in names)
                else "check the URL, the endpoint and the credentials")
        message = " ".join(str(exc).split())
        raise DestinationError(
            f"cannot write {unstrip(fs, path)}: {type(exc).__name__}: {message}; {hint}"
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
    "UnreadableFileError",
    "atomic_path",
    "atomic_write",
    "create_exclusive",
    "destination_errors",
    "filesystem",
    "fsync_dir",
    "is_absolute_url",
    "is_local",
    "join",
    "publish_bytes",
    "publish_temp",
    "read_regular_local",
    "temp_path",
    "unstrip",
    "write_atomic_local",
]
