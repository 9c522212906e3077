"""One checkpoint file written in one pass: direct I/O where the disk allows, checksummed as
it is written.

:class:`OutputFile` takes the file's bytes in order, as small byte strings (headers, pickled
values) and large memory regions (staged tensors), and

- writes them with ``O_DIRECT`` where the file system supports it: the bytes go from the
  staging buffers to the disk by DMA, without a copy into the page cache (about a tenth of
  the CPU time of buffered writes here, and twice their speed, since the write-back of a
  gigabyte of dirty pages no longer comes after the write); a memory region is written
  straight from where it lies (its file position is chosen congruent to its address, see
  :meth:`OutputFile.pad_for`), only the unaligned ends of each region and the small byte
  strings pass through an aligned bounce buffer; where ``O_DIRECT`` is refused (tmpfs,
  network file systems) the same calls write through the page cache;
- feeds the same bytes, in file order, to a streaming XXH64 (the native core, no GIL), so
  the file's checksum is known when its last byte is written: no second pass reads it back.
  A large region is hashed while the previous part of it is being written (a thread of its
  own does the I/O), and the hashing yields to a busy training thread (:class:`~.pace.Pace`).

Thread safety: one thread writes a file; the file owns its I/O thread (closed by
:meth:`OutputFile.finish` or :meth:`OutputFile.abort`).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import _native
from ..format.checksum import checksum_file, format_digest
from .layout import FileEntry
from .pace import Pace

BLOCK = 4096  # O_DIRECT alignment of addresses, offsets and lengths (logical blocks up to 4K)
BOUNCE = 4 << 20  # bytes of the aligned bounce buffer
CHUNK = 16 << 20  # a large region is written and hashed in parts of this size

_DIRECT = getattr(os, "O_DIRECT", 0)


def streaming_hash() -> Any | None:
    """A new streaming XXH64 of the native core, or None where it has none (then the file's
    checksum is computed by reading it back)."""
    try:
        return _native.Xxh64()
    except AttributeError:  # a native core built before it had one
        return None


class OutputFile:
    """A new file (created exclusively) written front to back; see the module doc.

    Args:
        path: where to create it (must not exist).
        durable: fsync the file before :meth:`finish` returns.
        pace: where the hashing yields to the training thread (None: never).
        direct: try ``O_DIRECT`` (falls back to buffered writes where it is refused).
    """

    def __init__(self, path: str, *, durable: bool, pace: Pace | None = None,
                 direct: bool = True) -> None:
        self.path, self.durable, self.pace = path, durable, pace
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        if direct and _DIRECT:
            try:
                self._fd = os.open(path, flags | _DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # only "not supported here" falls back
                    raise
        if not self.direct:
            self._fd = os.open(path, flags, 0o644)
        self.position = 0  # bytes given so far (the file's size when finished)
        self._written = 0  # bytes on disk (a multiple of BLOCK while direct)
        self._bounce = mmap.mmap(-1, BOUNCE)  # page-aligned
        self._buffered = 0  # bytes waiting in the bounce buffer (file range _written..)
        self._hash = streaming_hash()
        self._io: ThreadPoolExecutor | None = None  # made for the first large region

    # ------------------------------------------------------------------ the bytes, in order

    def write_bytes(self, data: Any) -> None:
        """Append a small byte string (a header, a pickled value): copied, not referenced."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, BOUNCE - self._buffered)
            self._bounce[self._buffered:self._buffered + take] = view[:take]
            self._buffered += take
            self.position += take
            view = view[take:]
            if self._buffered == BOUNCE:
                self._flush_bounce()

    def pad_for(self, header: int, address: int) -> int:
        """Zero bytes to append before a record of ``header`` bytes followed by a memory
        region at ``address``, so that the region's file position is congruent to its
        address modulo :data:`BLOCK` (its aligned middle is then written where it lies)."""
        if not self.direct:
            return 0
        return (address - header - self.position) % BLOCK

    def write_memory(self, region: memoryview) -> None:
        """Append a large memory region (a staged tensor's bytes), written from where it lies.

        The region must stay unchanged until :meth:`finish` returns.
        """
        view = region.cast("B") if region.format != "B" or region.ndim != 1 else region
        if not self.direct:
            self._flush_bounce()
            self._write_region(view)
            return
        head = min(view.nbytes, (-self.position) % BLOCK)
        self.write_bytes(view[:head])  # up to the first aligned block, through the bounce
        view = view[head:]
        middle = view.nbytes - view.nbytes % BLOCK
        if middle:
            self._flush_bounce()
            self._write_region(view[:middle])
        self.write_bytes(view[middle:])

    # ------------------------------------------------------------------ finishing

    def finish(self) -> FileEntry:
        """Write what is left, cut the file to its size, fsync if durable, close it.

        Returns:
            its size and checksum.
        """
        try:
            self._flush_bounce(final=True)
            if self.direct and self._written != self.position:
                os.ftruncate(self._fd, self.position)  # the last block was written padded
            if self.durable:
                os.fsync(self._fd)
        finally:
            self._close()
        digest = self._hash.digest() if self._hash is not None else None
        checksum = format_digest(digest) if digest is not None else checksum_file(self.path)
        return FileEntry(self.position, checksum)

    def abort(self) -> None:
        """Close without finishing (the caller removes or abandons the file)."""
        self._close()

    def _close(self) -> None:
        if self._fd < 0:
            return
        if self._io is not None:
            self._io.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1
        self._bounce.close()

    # ------------------------------------------------------------------ internals

    def _flush_bounce(self, final: bool = False) -> None:
        """Write the bounce buffer's whole blocks (all of it, padded, when ``final``)."""
        whole = self._buffered if not self.direct else self._buffered - self._buffered % BLOCK
        if final and self._buffered > whole:
            whole = self._buffered + (-self._buffered) % BLOCK
            self._bounce[self._buffered:whole] = bytes(whole - self._buffered)
        if whole == 0:
            return
        view = memoryview(self._bounce)
        hashed = min(whole, self._buffered)  # padding is not part of the file
        self._update_hash(view[:hashed])
        self._pwrite_all(view[:whole], self._written)
        self._written += whole
        rest = self._buffered - hashed
        if rest:
            self._bounce[:rest] = self._bounce[hashed:self._buffered]
        self._buffered = rest
        view.release()

    def _write_region(self, view: memoryview) -> None:
        """Write ``view`` at the end of the file in parts, hashing each part while the
        previous one is written."""
        assert self._buffered == 0 and self._written == self.position
        pending: Future[None] | None = None
        offset = self._written
        for start in range(0, view.nbytes, CHUNK):
            part = view[start:start + CHUNK]
            if pending is not None:
                pending.result()
            if view.nbytes <= CHUNK:  # one part: nothing to overlap with
                self._update_hash(part)
                self._pwrite_all(part, offset)
                offset += part.nbytes
                continue
            if self._io is None:
                self._io = ThreadPoolExecutor(1, thread_name_prefix="streamcache-ckpt-io")
            pending = self._io.submit(self._pwrite_all, part, offset)
            offset += part.nbytes
            self._update_hash(part)
        if pending is not None:
            pending.result()
        self._written = self.position = offset

    def _update_hash(self, view: memoryview) -> None:
        if self._hash is None or not view.nbytes:
            return
        started = time.thread_time()
        self._hash.update(view)
        if self.pace is not None:
            self.pace.after(time.thread_time() - started)

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            try:
                done = os.pwrite(self._fd, view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._leave_direct()  # this file system refused this direct write
                continue
            view, offset = view[done:], offset + done

    def _leave_direct(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_DIRECT)
        self.direct = False
