"""A bounded transfer: one request's body read under a Fetcher's limits.

- caps: a body is read to its expected size (or to ``max_bytes``) and not one block further:
  a larger object fails at once instead of filling the disk;
- stall timeouts: a request with no response, or no new bytes of the body, for ``timeout_s``
  seconds is abandoned (to be retried), while a large transfer that keeps moving is never cut
  off (there is no limit on the total time);
- cancellation: when the Fetcher is closed, requests in flight on an asynchronous filesystem
  (s3, gs, az, http) end within a fraction of a second, stalled ones included, and a
  ``KeyboardInterrupt`` in a waiting thread cancels its request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ..errors import StreamcacheError
from . import storage
from .options import FetchOptions
from .retry import (
    RangesIgnoredError,
    _RequestTimeoutError,
    _SizeMismatchError,
    _SizeRefusedError,
)

T = TypeVar("T")

_STOP_POLL_S = 0.1  # how often a thread waiting for a request looks whether to stop


class _ClosedError(StreamcacheError):
    """The Fetcher was closed while this request was waiting or running."""


class Transfers:
    """The body reads of one Fetcher, within its options and until its stop event is set.

    Thread safety: stateless but for the options and the event; any number of threads may
    read at once.
    """

    def __init__(self, options: FetchOptions, stopping: threading.Event) -> None:
        self.options = options
        self._stopping = stopping

    def check_open(self) -> None:
        """Raise if the Fetcher has been closed."""
        if self._stopping.is_set():
            raise _ClosedError("the Fetcher is closed")

    def read(self, fs: Any, path: str, url: str, size: int | None,
             sink: Callable[[bytes], object], max_bytes: int | None = None, *,
             stop_at: int | None = None) -> int:
        """One request: stream the body of ``path`` in ``fs`` (the object at ``url``) into
        ``sink`` block by block; returns the length.

        Reads at most one byte past ``size`` (or ``max_bytes``): a body that goes on is
        refused there, not read to its end. With ``stop_at``, reads that many bytes at most
        and judges no length.
        """
        limit = _read_limit(size, max_bytes) if stop_at is None else stop_at
        if getattr(fs, "async_impl", False):
            total = self._read_async(fs, path, size, sink, limit)
        else:
            total = 0
            with fs.open(path, "rb") as stream:
                while block := stream.read(self._next_read(total, limit)):
                    sink(block)
                    total += len(block)
                    self.check_open()
                    if limit is not None and total >= limit:
                        break
        if stop_at is None:
            local = storage.is_local(fs) or "memory" in _protocols(fs)
            _check_size(total, size, max_bytes, url, local=local)
        return total

    def read_ranges(self, fs: Any, path: str, url: str, ranges: Sequence[tuple[int, int]],
                    parallel: int = 1) -> list[bytes]:
        """One request per byte range ``[start, end)`` of ``path`` in ``fs`` (the object at
        ``url``): concurrently on an asynchronous filesystem (at most ``parallel`` at once,
        each within ``timeout_s`` as a whole: keep ranges small), one after another on a
        synchronous one. Every range must come back exactly as long as asked: a short one
        is retried like a short read, a longer one (a server that ignores ranges) is refused.
        """
        if getattr(fs, "async_impl", False):
            blocks = self._run(fs, _gather_ranges(fs, path, ranges, self.options.timeout_s,
                                                  max(1, parallel)))
        else:
            blocks = []
            for start, end in ranges:
                blocks.append(bytes(fs.cat_file(path, start=start, end=end)))
                self.check_open()
        _check_ranges(fs, url, ranges, [len(block) for block in blocks])
        return blocks

    def read_range_pieces(self, fs: Any, path: str, url: str,
                          ranges: Sequence[tuple[int, int]], parallel: int = 1, *,
                          each: Callable[[int, bytes], object] | None = None,
                          ) -> list[list[bytes]]:
        """:meth:`read_ranges` for large ranges: each range in the pieces its body arrived in,
        each wait for a piece (not the whole range) within ``timeout_s``. On s3fs the GET is
        streamed: a body read whole is joined on the event loop's thread, which every
        download of the process shares, and a 64 MB shard in four ranges cost that thread 66 ms
        of CPU against 32 streamed (benchmarks/RESULTS.md, "Parts streamed"). Elsewhere each
        range is one piece, as :meth:`read_ranges` reads it.

        With ``each``, every piece goes to ``each(offset in the object, piece)`` on this
        thread as it arrives and is not kept (the lists come back empty): on s3fs only the
        pieces not yet handed on are held, not the ranges."""
        if not getattr(fs, "async_impl", False) or not callable(getattr(fs, "_call_s3", None)):
            blocks = self.read_ranges(fs, path, url, ranges, parallel)
            if each is None:
                return [[block] for block in blocks]
            for (start, _), block in zip(ranges, blocks, strict=True):
                each(start, block)
            return [[] for _ in blocks]
        timeout, parallel = self.options.timeout_s, max(1, parallel)
        if each is None:
            got = self._run(fs, _gather_streamed(fs, path, ranges, timeout, parallel, None))
        else:
            arrived: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()
            got = self._run_handing(fs, _gather_streamed(fs, path, ranges, timeout, parallel,
                                                         arrived.put), arrived, each)
        _check_ranges(fs, url, ranges, [length for _, length in got])
        return [pieces for pieces, _ in got]

    def _run_handing(self, fs: Any, coroutine: Any, arrived: queue.SimpleQueue[tuple[int, bytes]],
                     each: Callable[[int, bytes], object]) -> Any:
        """:meth:`_run`, handing each ``(offset, piece)`` the coroutine puts in ``arrived`` to
        ``each`` on this thread meanwhile (an error of ``each`` cancels the coroutine)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, fs.loop)
        try:
            while True:
                try:
                    offset, piece = arrived.get(timeout=_STOP_POLL_S)
                except queue.Empty:
                    if future.done() and arrived.empty():  # (its puts come before its end)
                        return future.result()
                    if self._stopping.is_set():
                        raise _ClosedError("the Fetcher was closed during a request") from None
                    continue
                each(offset, piece)
        except BaseException:
            future.cancel()
            raise

    def _next_read(self, total: int, limit: int | None) -> int:
        """How many bytes to ask for next: a block, but never past ``limit``."""
        if limit is None:
            return self.options.block_size
        return max(1, min(self.options.block_size, limit - total))

    def _read_async(self, fs: Any, path: str, size: int | None,
                    sink: Callable[[bytes], object], limit: int | None) -> int:
        timeout = self.options.timeout_s
        # A known size spares fsspec's http filesystem a HEAD request before the GET.
        open_kwargs = {} if size is None else {"size": size}
        try:
            stream = self._run(fs, _within(fs.open_async(path, "rb", **open_kwargs), timeout))
        except NotImplementedError:  # no streamed reads here: ranges, or one request
            return self._read_ranges(fs, path, sink, limit)
        total = 0
        try:
            while block := self._run(fs, _read_block(stream, self._next_read(total, limit),
                                                     timeout, total)):
                sink(block)
                total += len(block)
                self.check_open()
                if limit is not None and total >= limit:
                    break
        finally:
            self._cleanup(fs, _close_stream(stream))
        return total

    def _read_ranges(self, fs: Any, path: str, sink: Callable[[bytes], object],
                     limit: int | None) -> int:
        """Ranged reads of ``block_size``, each within ``timeout_s``, up to ``limit`` bytes;
        without a limit, the whole body in one request within ``timeout_s``."""
        timeout = self.options.timeout_s
        if limit is None:
            data = self._run(fs, _within(fs._cat_file(path), timeout))
            sink(data)
            return len(data)
        total = 0
        while total < limit:
            wanted = self._next_read(total, limit)
            block = self._run(fs, _within(fs._cat_file(path, start=total, end=total + wanted),
                                          timeout))
            if block:
                sink(block)
                total += len(block)
            if len(block) < wanted:
                break
            self.check_open()
        return total

    def _run(self, fs: Any, coroutine: Any) -> Any:
        """Run ``coroutine`` on the filesystem's event loop and return its result.

        Unlike fsspec's ``sync``, the wait ends promptly when the Fetcher is closed, and the
        request is cancelled (its connection dropped) when the wait ends early for any
        reason, a ``KeyboardInterrupt`` included: nothing keeps running for nobody.
        """
        future = asyncio.run_coroutine_threadsafe(coroutine, fs.loop)
        try:
            while not concurrent.futures.wait([future], timeout=_STOP_POLL_S).done:
                if self._stopping.is_set():
                    raise _ClosedError("the Fetcher was closed during a request")
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def _cleanup(self, fs: Any, coroutine: Any) -> None:
        """Run a closing coroutine; wait for it (bounded) unless the Fetcher is stopping."""
        future = asyncio.run_coroutine_threadsafe(coroutine, fs.loop)
        if not self._stopping.is_set():
            with contextlib.suppress(BaseException):
                future.result(timeout=self.options.timeout_s)



def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _read_limit(size: int | None, max_bytes: int | None) -> int | None:
    """Bytes to read at most: one past what is acceptable, so that more is noticed."""
    bounds = [bound for bound in (size, max_bytes) if bound is not None]
    return min(bounds) + 1 if bounds else None


async def _within(awaitable: Any, timeout: float) -> Any:
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise _RequestTimeoutError(f"no response within timeout_s={timeout:g}") from None


async def _gather_ranges(fs: Any, path: str, ranges: Sequence[tuple[int, int]], timeout: float,
                         limit: int) -> list[bytes]:
    async def whole(start: int, end: int) -> bytes:
        return bytes(await _within(fs._cat_file(path, start=start, end=end), timeout))

    return await _gather_within(ranges, limit, whole)


async def _gather_within(ranges: Sequence[tuple[int, int]], limit: int,
                         read: Callable[[int, int], Awaitable[T]]) -> list[T]:
    """``read(start, end)`` of every range, at most ``limit`` at once, results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(start: int, end: int) -> T:
        async with gate:
            return await read(start, end)

    return list(await asyncio.gather(*(one(start, end) for start, end in ranges)))


#: The most bytes asked of a streamed range's body at once (it gives what has arrived).
_PIECE_BYTES = 4 << 20


async def _gather_streamed(fs: Any, path: str, ranges: Sequence[tuple[int, int]],
                           timeout: float, limit: int,
                           hand: Callable[[tuple[int, bytes]], object] | None,
                           ) -> list[tuple[list[bytes], int]]:
    async def streamed(start: int, end: int) -> tuple[list[bytes], int]:
        return await _s3_range(fs, path, start, end, timeout, hand)

    return await _gather_within(ranges, limit, streamed)


async def _s3_range(fs: Any, path: str, start: int, end: int, timeout: float,
                    hand: Callable[[tuple[int, bytes]], object] | None = None,
                    ) -> tuple[list[bytes], int]:
    """Bytes ``[start, end)`` of ``path`` on s3fs, as its GET's body arrives: the pieces (or
    none, each handed to ``hand`` as ``(offset, piece)`` instead) and their length. Read to
    the body's end, or one piece past the range (a server that ignores ``Range`` sends the
    whole object: that is noticed, not read to its end). s3fs translates the request's
    errors."""
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    response = await _within(fs._call_s3("get_object", Bucket=bucket, Key=key,
                                         Range=f"bytes={start}-{end - 1}", **extra), timeout)
    body = response["Body"]
    pieces: list[bytes] = []
    received = 0
    try:
        while received <= end - start:
            try:
                piece = await _bounded(body.read(_PIECE_BYTES), timeout)
            except asyncio.TimeoutError:
                raise _RequestTimeoutError(
                    f"no data for timeout_s={timeout:g} after {start + received} bytes of the "
                    "body") from None
            if not piece:
                break
            if hand is None:
                pieces.append(piece)
            elif received + len(piece) <= end - start:  # (past the range: counted, not kept)
                hand((start + received, piece))
            received += len(piece)
    finally:
        body.close()
    return pieces, received


def _check_ranges(fs: Any, url: str, ranges: Sequence[tuple[int, int]],
                  lengths: Sequence[int]) -> None:
    """Every range came back exactly as long as asked: a longer one (a server that ignores
    ranges) is refused, a shorter one retried like a short read (refused for a local file)."""
    local = storage.is_local(fs) or "memory" in _protocols(fs)
    for (start, end), length in zip(ranges, lengths, strict=True):
        if length > end - start:
            raise RangesIgnoredError(f"asked {url} for bytes [{start}, {end}) and received "
                                    f"{length} bytes: the server ignores ranges")
        if length < end - start:
            message = (f"bytes [{start}, {end}) of {url}: received {length} (a short "
                       "read, or the object is shorter than the index records)")
            raise _SizeRefusedError(message) if local else _SizeMismatchError(message)


async def _bounded(awaitable: Any, timeout: float) -> Any:
    """``await awaitable`` within ``timeout`` seconds (``asyncio.TimeoutError`` past it).

    ``asyncio.timeout`` (Python 3.11) arms one timer in the running task; ``wait_for`` wraps
    the awaitable in a task of its own, for each read of ~64 KiB (thousands a shard). The
    fetch's CPU time moved within this machine's noise (0.67 -> 0.62 s for 460 MB): the
    cheaper form, not a measured speed-up."""
    if _TIMEOUT is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout)
    async with _TIMEOUT(timeout):
        return await awaitable


_TIMEOUT = getattr(asyncio, "timeout", None)


async def _read_block(stream: Any, block_size: int, timeout: float, offset: int) -> bytes:
    """Up to ``block_size`` bytes (fewer only at the end), each wait bounded by ``timeout``."""
    parts: list[bytes] = []
    received = 0
    while received < block_size:
        try:
            part = await _bounded(stream.read(block_size - received), timeout)
        except asyncio.TimeoutError:
            raise _RequestTimeoutError(
                f"no data for timeout_s={timeout:g} after {offset + received} bytes of the body"
            ) from None
        if not part:
            break
        parts.append(part)
        received += len(part)
    return b"".join(parts)


async def _close_stream(stream: Any) -> None:
    try:
        await stream.close()
        # fsspec's streamed files keep the HTTP response in ``r`` and not all of them close
        # it; an unfinished response must be closed so its connection is not reused.
        response = getattr(stream, "r", None)
        if response is not None and callable(getattr(response, "close", None)):
            closing = response.close()
            if inspect.isawaitable(closing):
                await closing
    except Exception:  # closing after a failure must not hide the failure
        pass



def _check_size(received: int, expected: int | None, max_bytes: int | None, url: str, *,
                local: bool) -> None:
    """Refuse a body of the wrong length; only a short remote body is worth a retry."""
    if expected is not None and received > expected:
        raise _SizeRefusedError(
            f"the body goes on for more than the {expected} bytes the index records: the "
            "object changed after indexing (re-run `streamcache index`, or rewrite the dataset)"
        )
    if max_bytes is not None and received > max_bytes:
        raise _SizeRefusedError(
            f"{url} holds more than the {max_bytes} bytes accepted for it; it is not what "
            "it should be (or raise the limit)"
        )
    if expected is not None and received != expected:
        message = (f"received {received} bytes, the index records {expected} "
                   "(a short read, or the object changed after indexing)")
        if local:  # a local file is what it is: reading it again gives the same
            raise _SizeRefusedError(
                f"{message}; the local file {url} has the wrong size: rebuild the index or "
                "restore the file"
            )
        raise _SizeMismatchError(message)

