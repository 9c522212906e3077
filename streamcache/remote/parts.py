"""A large object fetched as concurrent byte ranges ("parts"), then checked whole.

An object store caps each connection's bandwidth (S3 documents tens of MB/s up to ~100 MB/s
per connection and recommends byte-range requests in parallel for large objects): one GET of
a 64 MB shard then takes ~0.65 s at 100 MB/s however many cores wait for it. Fetched as
:data:`PART_BYTES` ranges at once (within the Fetcher's ``max_concurrency``), it arrives in
about one part's time. Measured with the store model of benchmarks/peers/cold.py (20 ms to
the first byte, 100 MB/s a connection): 100 KB samples 1,717-1,772 -> 2,042-2,545 samples/s
over a cold start's first 4,096, tokens 2,920-3,552 -> 3,949-4,535, and no loss on plain
loopback (benchmarks/RESULTS.md, "Shards in parts", 2026-12-06).

On s3fs each part's GET is streamed and its pieces written (or joined once) as they arrive:
a part read whole was joined on the event loop's thread, which all downloads share (cold 100
KB samples 2,730 -> 3,048 samples/s on loopback, RESULTS.md "Parts streamed").

What is checked: each part must come back exactly as long as asked (a longer answer means the
server ignores ``Range``: the object is then fetched with one GET), and the whole object
against the index's size and XXH64 checksum, in memory or in the file the parts were written
into at their offsets; a mismatch retries the whole set (the Fetcher's retries). Parts are used
only where that checksum exists (a server or proxy that shifts a range would otherwise pass
unnoticed), the filesystem streams asynchronously (s3, gs, az, http), and the object is at
least two parts and at most :data:`PARTS_MAX_BYTES` (on filesystems other than s3fs, and for a
shard decoded from memory, all parts are held at once; on s3fs a file's pieces are written as
they arrive).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

from ..format.checksum import verify_bytes
from .fetch import Fetcher
from .retry import FetchError, ranges_ignored

#: Bytes of one part.
PART_BYTES = 16 << 20
#: The largest object fetched in parts (its parts are all held in memory before they are
#: written); a larger one is streamed by one GET.
PARTS_MAX_BYTES = 256 << 20


def fetch_bytes(fetcher: Fetcher, url: str, *, size: int | None, checksum: str | None,
                ) -> bytes:
    """The object at ``url``: in parts where this module's rules allow, else as
    :meth:`Fetcher.fetch` reads it.

    Raises: as :meth:`Fetcher.fetch`.
    """
    if not _in_parts(fetcher, url, size, checksum):
        return fetcher.fetch(url, size=size, checksum=checksum)
    held: list[bytes] = []

    def joined(blocks: list[list[bytes]]) -> None:
        data = b"".join(piece for pieces in blocks for piece in pieces)
        verify_bytes(data, checksum, what=url)
        held[:] = [data]

    if not _fetch_parts(fetcher, url, _parts(size), joined):
        return fetcher.fetch(url, size=size, checksum=checksum)
    return held[0]


def fetch_to_path(fetcher: Fetcher, url: str, path: str, *, size: int | None,
                  checksum: str | None) -> int:
    """Write the object at ``url`` to the file ``path`` (not fsynced: the caller renames it)
    and return its length: in parts where this module's rules allow, else as
    :meth:`Fetcher.fetch_to_file` writes it.

    Raises: as :meth:`Fetcher.fetch`.
    """
    if not _in_parts(fetcher, url, size, checksum):
        return fetcher.fetch_to_file(url, path, size=size, checksum=checksum, durable=False)
    parts = _parts(size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        def write(offset: int, piece: bytes) -> None:
            os.pwrite(fd, piece, offset)

        def verify(_: list[list[bytes]]) -> None:  # (every byte written by this attempt)
            with mmap.mmap(fd, parts[-1][1], prot=mmap.PROT_READ) as view:
                verify_bytes(view, checksum, what=url)

        in_parts = _fetch_parts(fetcher, url, parts, verify, each=write)
    finally:
        os.close(fd)
    if not in_parts:
        return fetcher.fetch_to_file(url, path, size=size, checksum=checksum, durable=False)
    return parts[-1][1]


def _parts(size: int | None) -> list[tuple[int, int]]:
    assert size is not None
    return [(start, min(start + PART_BYTES, size)) for start in range(0, size, PART_BYTES)]


def _fetch_parts(fetcher: Fetcher, url: str, parts: list[tuple[int, int]],
                 verify: Callable[[list[list[bytes]]], None],
                 each: Callable[[int, bytes], object] | None = None) -> bool:
    """Fetch ``parts`` of ``url`` and hand them to ``verify`` (which checks them whole, and
    keeps or writes them); False where the server ignores ranges (the caller makes one
    GET)."""
    try:
        fetcher.fetch_range_pieces(url, parts, verify=verify, each=each)
    except FetchError as error:
        if not ranges_ignored(error):
            raise
        return False
    return True


def _in_parts(fetcher: Fetcher, url: str, size: int | None, checksum: str | None) -> bool:
    return (checksum is not None and size is not None
            and 2 * PART_BYTES <= size <= PARTS_MAX_BYTES and fetcher.streams_remote(url))


__all__ = ["PARTS_MAX_BYTES", "PART_BYTES", "fetch_bytes", "fetch_to_path"]
