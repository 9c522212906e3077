"""Shard checksums: ``"xxh64:<16 hex digits>"`` strings over an object's exact bytes.

The digest is computed by the native core (GIL released) or its twin. An index entry whose
checksum is ``None`` (an index built from footers only) is verified by size alone.
"""

from __future__ import annotations

import os
from typing import Any

from .. import _native
from ..errors import ChecksumMismatchError, StreamcacheError

ALGORITHM = "xxh64"


def format_digest(digest: int) -> str:
    return f"{ALGORITHM}:{digest:016x}"


def checksum_bytes(data: Any) -> str:
    """Checksum of a bytes-like object."""
    return format_digest(_native.xxh64(data))


def checksum_file(path: str | os.PathLike[str]) -> str:
    """Checksum of a local file's bytes, read in large blocks without the GIL."""
    digest, _ = _native.xxh64_file(os.fspath(path))
    return format_digest(digest)


def parse(checksum: str) -> int:
    """The digest inside a checksum string; a clear error for an unknown algorithm."""
    algorithm, _, hex_digest = checksum.partition(":")
    if algorithm != ALGORITHM or len(hex_digest) != 16:
        raise StreamcacheError(
            f"unsupported checksum {checksum!r}: expected '{ALGORITHM}:' and 16 hex digits; "
            "rebuild the index with this version of streamcache"
        )
    return int(hex_digest, 16)


def verify_bytes(data: Any, expected: str | None, *, what: str) -> None:
    """Raise :class:`ChecksumMismatchError` naming ``what`` unless ``data`` matches ``expected``.

    ``expected=None`` checks nothing (the index recorded no checksum).
    """
    if expected is None:
        return
    actual = checksum_bytes(data)
    if actual != expected:
        raise ChecksumMismatchError(
            f"{what}: checksum {actual} does not match the index's {expected}; the object is "
            "corrupt or was rewritten after indexing (re-run `streamcache index` if it was "
            "rewritten on purpose)"
        )
