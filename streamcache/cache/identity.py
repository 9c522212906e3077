"""What identifies cached data, and the once-per-file verification of shards read in place.

A local copy of a shard may be served only when it is a copy of the object the index names
now. Two things establish that (docs/cache.md, "What identifies cached data"):

- **The dataset folder.** Copies live in a folder named from the index fingerprint (schema,
  shard paths, rows, sizes and checksums) and the dataset's canonical location (its
  absolute, symlink-free path, or its URL with the storage endpoint). Two datasets that look
  alike (same names, rows, sizes) but live elsewhere never share a folder.
- **The object.** Where the index records a checksum, the fingerprint fixes the content and
  the copy was verified against it when it was made: nothing more is needed. Otherwise what
  the store says about the object (its size plus ETag, or modification time and inode) is
  recorded beside the copy when it is installed (:func:`write_record`) and compared with
  the store once per process before the copy is first served: a rewritten object is
  fetched again.

A local uncompressed shard is read in place, not copied: :func:`verify_in_place` checks its
size and (when the index has one) its checksum once per (path, size, mtime, inode) and
records that beside the cache, so later opens cost one ``stat``.

Everything read back from these records is untrusted: a record that cannot be parsed, or
says anything else, means "not verified".
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Mapping
from typing import Any

from ..errors import CacheError, ChecksumMismatchError, ShardCorruptError
from ..format.checksum import checksum_bytes, checksum_file
from ..format.index import DatasetIndex, ShardInfo
from ..remote import storage
from ..remote.options import FetchOptions
from ..remote.retry import backoff_delay, is_transient

#: Fields of fsspec ``info`` that change when an object's content is replaced, strongest
#: first: content hashes and versions, then modification times (with the inode, locally).
STRONG_FIELDS = ("ETag", "etag", "md5Hash", "crc32c", "Content-MD5", "VersionId", "generation")
WEAK_FIELDS = ("mtime", "ino", "LastModified", "Last-Modified", "last_modified", "updated",
               "created")
RECORD_LIMIT = 64 << 10  # bytes read of a record at most (a planted huge file is refused)
Identity = dict[str, str]


def canonical_location(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """The dataset's location as one string: ``file://`` plus the real path for local data,
    else the full URL, with the endpoint of the storage options when one is set."""
    fs, path = storage.filesystem(url or ".", storage_options)
    if storage.is_local(fs):
        return "file://" + os.path.realpath(path)
    location = storage.unstrip(fs, path).rstrip("/")
    options = dict(storage_options or {})
    client = options.get("client_kwargs") or {}
    endpoint = options.get("endpoint_url") or (
        client.get("endpoint_url") if isinstance(client, Mapping) else None)
    return f"{location} at {endpoint}" if endpoint else location


def dataset_folder_name(index: DatasetIndex,
                        storage_options: Mapping[str, Any] | None = None) -> str:
    """``<fingerprint digest>-<location digest>``: the name of the dataset's cache folder."""
    fingerprint = index.fingerprint.partition(":")[2] or index.fingerprint
    location = checksum_bytes(canonical_location(index.root, storage_options).encode())
    return f"{fingerprint}-{location.partition(':')[2]}"


def object_identity(info: Mapping[str, Any], *, local: bool) -> Identity:
    """What identifies an object, from its fsspec ``info``: the size plus its strong
    validators (ETag, ...) when the store gives any, else its modification time (and inode)."""
    identity = {"size": str(info.get("size"))}
    strong = {k: str(info[k]) for k in STRONG_FIELDS if info.get(k) is not None}
    if strong:
        return identity | strong
    weak = {k: str(info[k]) for k in WEAK_FIELDS if info.get(k) is not None}
    if local or "mtime" in weak:
        weak.pop("created", None)  # a local file's ctime changes on chmod: not the content
    return identity | weak


def source_identity(info: ShardInfo, url: str, storage_options: Mapping[str, Any] | None,
                    options: FetchOptions) -> Identity | None:
    """The identity of shard ``info`` stored at ``url``: its checksum when the index has
    one (no request), else the store's answer (one ``info`` request, retried on transient
    errors like a fetch). None when the object is gone.

    Raises:
        CacheError: the store cannot be asked (after the retries).
    """
    if info.checksum is not None:
        return {"checksum": info.checksum}
    fs, path = storage.filesystem(url, storage_options)
    for attempt in range(1, options.retries + 2):
        try:
            return object_identity(fs.info(path), local=storage.is_local(fs))
        except FileNotFoundError:
            return None
        except Exception as error:
            if not is_transient(error) or attempt > options.retries:
                raise CacheError(
                    f"cannot ask the store what {url} is now ({type(error).__name__}: "
                    f"{error}); its cached copy is served only once it is known to be the "
                    "same object: check the connection and credentials") from error
            time.sleep(backoff_delay(attempt, options, random.random()))
    raise AssertionError("unreachable")


def read_record(path: str) -> dict[str, Any] | None:
    """A JSON object recorded at ``path``; None if missing, too large or not an object."""
    try:
        with open(path, "rb") as f:
            raw = f.read(RECORD_LIMIT + 1)
        obj = json.loads(raw) if len(raw) <= RECORD_LIMIT else None
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def write_record(path: str, record: Mapping[str, Any]) -> None:
    """Publish a small JSON record atomically (temporary file and rename, no fsync: a lost
    record only costs one more check)."""
    with storage.atomic_write(path, "w", durable=False) as f:
        json.dump(record, f, sort_keys=True)


def file_stamp(path: str, info: ShardInfo) -> dict[str, Any]:
    """What a verification of a local file is remembered by."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ino": st.st_ino, "checksum": info.checksum}


def verify_in_place(path: str, info: ShardInfo, *, where: str, record: str | None) -> bool:
    """Check a local shard read in place against its index entry: its size always, its
    checksum when the index has one, once per (path, size, mtime, inode): a matching
    ``record`` file (None: no record) says it was done. Returns whether the file was hashed.

    Raises:
        ShardCorruptError: the size differs from the index's.
        ChecksumMismatchError: the content does not hash to the index's checksum.
    """
    stamp = file_stamp(path, info)
    if stamp["size"] != info.bytes:
        raise ShardCorruptError(
            f"{where} is {stamp['size']} bytes, the index says {info.bytes}; it is truncated "
            "or was rewritten after indexing: restore it, or rebuild the index")
    if info.checksum is None or (record is not None and read_record(record) == stamp):
        return False
    actual = checksum_file(path)
    if actual != info.checksum:
        raise ChecksumMismatchError(
            f"{where}: checksum {actual} does not match the index's {info.checksum}; the "
            "file is corrupt or was rewritten after indexing (restore it, or re-run "
            "`streamcache index` if it was rewritten on purpose)")
    if record is not None and file_stamp(path, info) == stamp:  # unchanged while hashed
        with contextlib.suppress(OSError):
            write_record(record, stamp)
    return True


def record_path(shard_dir: str, shard: int) -> str:
    """Where the source record of an installed shard lives, beside the copy."""
    return os.path.join(shard_dir, f"{shard:06d}.source")


def local_file(url: str) -> str | None:
    """The path of a shard URL on the local disk; None for any other filesystem."""
    if "://" in url and not url.startswith("file://"):
        return None
    return url.removeprefix("file://")


def local_size_error(url: str, expected: int) -> ShardCorruptError | None:
    """A ShardCorruptError if ``url`` is a local file of another size than ``expected``."""
    path = local_file(url)
    try:
        size = os.path.getsize(path) if path is not None else expected
    except OSError:
        return None
    if size == expected:
        return None
    return ShardCorruptError(f"{url} is {size} bytes, the index says {expected}; it is "
                             "truncated or was rewritten after indexing: restore it, or "
                             "rebuild the index")


__all__ = [
    "canonical_location",
    "dataset_folder_name",
    "file_stamp",
    "local_file",
    "local_size_error",
    "object_identity",
    "read_record",
    "record_path",
    "source_identity",
    "verify_in_place",
    "write_record",
]
