"""The Fetcher: whole-object reads through fsspec, made dependable.

One :class:`Fetcher` reads whole objects from any filesystem fsspec knows (``s3://``,
``gs://``, ``az://``, ``http(s)://``, ``file://`` or a plain path, ``memory://``) with

- bounded concurrency: at most ``max_concurrency`` requests in flight per Fetcher and process,
  whichever threads call it (its own pool of threads serves :meth:`Fetcher.fetch_many`);
- bounded transfers (:mod:`.transfer`): stall timeouts, bodies read to their expected size
  and not one block further, and prompt stops: :meth:`Fetcher.close` ends the requests in
  flight, stalled ones included;
- retries with exponential backoff and jitter on transient errors, permanent ones failing at
  once (:mod:`.retry` decides which is which);
- verification of the size and the ``"xxh64:..."`` checksum the index records, and atomic
  downloads to files (:mod:`.download`);
- one clear error after the last attempt: :class:`~.retry.FetchError` naming the URL, the
  number of attempts and the cause, or :class:`~streamcache.errors.ChecksumMismatchError`.

Filesystems with retries of their own (s3fs and botocore retry some errors internally)
multiply with the Fetcher's; turn theirs down through ``storage_options`` where that matters.

Fork safety: the filesystem instances (with their event loop, sessions and connections) and
the Fetcher's locks and threads belong to the process that made them. A Fetcher used in a
child created by ``fork()`` builds fresh ones there. It never closes or collects its
parent's there either: fork() shares the event loop's epoll set, so closing a connection in
the child would stall the same connection in the parent. For the same reason, garbage is
collected just before ``fork()`` when a filesystem a Fetcher let go of is still alive.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
import fsspec.core

from .. import forksafe
from ..errors import ChecksumMismatchError
from ..format import checksum as _checksum
from . import storage
from .download import _LocalIOError, write_file
from .options import FetchOptions
from .retry import _chain, _final_error, _RequestTimeoutError, backoff_delay, is_transient
from .transfer import Transfers, _ClosedError, _protocols

T = TypeVar("T")


@dataclasses.dataclass
class FetchStats:
    """Counters of one Fetcher (a snapshot; see :attr:`Fetcher.stats`).

    Attributes:
        requests: requests made, every attempt counted.
        retries: attempts that followed a transient failure.
        bytes: bytes of the objects delivered (failed attempts not counted).
        objects: objects delivered.
        failures: objects given up on (a :class:`FetchError` or a checksum mismatch raised).
        stalls: attempts abandoned because nothing arrived for ``timeout_s`` (each is
            also a retry, or the last attempt's failure).
    """

    requests: int = 0
    retries: int = 0
    bytes: int = 0
    objects: int = 0
    failures: int = 0
    stalls: int = 0


@dataclasses.dataclass(frozen=True)
class FetchRequest:
    """One object for :meth:`Fetcher.fetch_many`; with ``path``, it is written to that file."""

    url: str
    size: int | None = None
    checksum: str | None = None
    path: str | None = None


@dataclasses.dataclass(frozen=True)
class FetchResult:
    """The outcome of one :class:`FetchRequest`: ``data`` is None when it went to a file."""

    request: FetchRequest
    nbytes: int
    data: bytes | None = None


# Filesystems a forked child inherited from its parent, kept unused for the child's lifetime.
# Were they collected in the child, their finalizers would close their sessions there, and
# closing a connection unregisters its socket from the event loop's epoll set, which fork()
# shares with the parent: the parent's connection would then wait for data it never sees.
_inherited_filesystems: list[Any] = []
_async_filesystems: weakref.WeakSet[Any] = weakref.WeakSet()  # every one made, until freed


def _before_fork() -> None:
    # A filesystem a Fetcher dropped (on close) but that is still alive, typically kept by a
    # reference cycle through a traceback, would be collected in the child instead: its
    # finalizer then waits about a second for the parent's event loop, which does not run
    # in the child, and unregisters its socket from the shared epoll set. Collect it here;
    # in the usual case (none dropped and alive) this costs no collection.
    held = {id(fs) for fetcher in forksafe.live(Fetcher) for fs in fetcher._filesystems.values()}
    if any(id(fs) not in held for fs in list(_async_filesystems)):
        gc.collect()


# fsspec's own fork hook forgets its event loop but not its lock (a lock held by another
# thread at fork() time would never be released in the child); reset both.
forksafe.at_fork(before=_before_fork, after_in_child=fsspec.asyn.reset_lock)


class Fetcher:
    """Reads whole objects through fsspec; see the module docstring for what it guarantees.

    Thread safety: every method may be called from any number of threads at once; the
    concurrency bound holds across all of them. A Fetcher may be used in a forked child.
    Owns: filesystem instances and a pool of ``max_concurrency`` named daemon threads
    (``streamcache-fetch-*``, started by the first :meth:`fetch_many`), released by
    :meth:`close` or the end of a ``with`` block.
    """

    def __init__(self, options: FetchOptions | None = None) -> None:
        self.options = options or FetchOptions()
        self._stopping = threading.Event()
        self._stats = FetchStats()
        self._transfers = Transfers(self.options, self._stopping)
        self._reset_process_state()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        _inherited_filesystems.extend(self._filesystems.values())
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """New locks, filesystems and pool for this process (also run in a forked child)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.options.max_concurrency)
        self._filesystems: dict[tuple[int, str], Any] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------------ public API

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._stopping.is_set()

    @property
    def stats(self) -> FetchStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def fetch(self, url: str, *, size: int | None = None, checksum: str | None = None,
              max_bytes: int | None = None) -> bytes:
        """The whole object at ``url``.

        Args:
            url: any URL fsspec understands, or a local path.
            size: the expected length in bytes. A shorter remote body is retried like a
                short read; a longer one is refused at once, after reading one byte past
                ``size``; a local file of another size is refused at once.
            checksum: the expected ``"xxh64:<16 hex>"``; a mismatch is retried (not for a
                local or in-memory object: read again, the same bytes fail again).
            max_bytes: the most bytes to accept when ``size`` is not known (an index file);
                a larger object is refused at once, after reading one byte past the cap.

        Raises:
            FetchError: a permanent error, or a transient one on every attempt.
            ChecksumMismatchError: the bytes failed their checksum on every attempt.
            StreamcacheError: the Fetcher is closed.
        """

        def attempt() -> bytes:
            parts: list[bytes] = []
            self._transfer(url, size, parts.append, max_bytes)
            data = b"".join(parts)
            _checksum.verify_bytes(data, checksum, what=url)
            return data

        data = self._with_retries(url, attempt)
        self._count(bytes=len(data), objects=1)
        return data

    def fetch_prefix(self, url: str, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes of the object at ``url`` (all of it if shorter), with the
        timeouts and retries of :meth:`fetch`; nothing past them is read.

        For small objects of unknown size read under a cap (an index): ask for one byte more
        than the cap, and a longer result means a larger object.

        Raises: as :meth:`fetch`.
        """

        def attempt() -> bytes:
            parts: list[bytes] = []
            self._transfer(url, None, parts.append, stop_at=nbytes)
            return b"".join(parts)

        data = self._with_retries(url, attempt)
        self._count(bytes=len(data), objects=1)
        return data

    def fetch_to_file(
        self,
        url: str,
        path: str | os.PathLike[str],
        *,
        size: int | None = None,
        checksum: str | None = None,
        durable: bool = True,
    ) -> int:
        """Download ``url`` to ``path`` atomically (and durably, by default); returns the byte
        count.

        The body goes to a temporary file (suffix
        :data:`~streamcache.remote.download.TEMP_SUFFIX`) in the directory of ``path``, is
        verified (and fsynced), then renamed over ``path`` (and the directory fsynced): a
        reader sees the old file or the complete new one, never a part, and a failed or
        interrupted download leaves no file behind (a crash may leave a temporary).

        Args: as :meth:`fetch`, and ``path``, the file to create or replace; ``durable``:
            fsync it (and its folder) around the rename (False: a caller that renames it
            again, and makes that durable, skips the fsync here).
        Raises: as :meth:`fetch`; and the ``OSError`` itself, not retried, when the local
        file cannot be written (no such directory, no space left, ...).
        """
        target = os.path.abspath(os.fspath(path))

        def attempt() -> int:
            return write_file(target, url, checksum, lambda sink: self._transfer(url, size, sink),
                              durable=durable)

        received = self._with_retries(url, attempt)
        self._count(bytes=received, objects=1)
        return received

    def fetch_ranges(self, url: str, ranges: Sequence[tuple[int, int]], *,
                     verify: Callable[[list[bytes]], None] | None = None) -> list[bytes]:
        """Byte ranges ``[start, end)`` of the object at ``url`` (concurrent requests on
        s3, gs, az and http, as many as the concurrency slots free at the time allow, so
        ``max_concurrency`` bounds them too; see :meth:`.transfer.Transfers.read_ranges`),
        with the retries of :meth:`fetch`; a range that comes back short is retried, the
        whole set at once.

        Args:
            verify: called with the ranges' bytes inside each attempt; a
                :class:`~streamcache.errors.ChecksumMismatchError` it raises is retried like
                a body that fails its checksum (the last one is raised).

        Raises: as :meth:`fetch`.
        """

        if not ranges:
            return []
        blocks = self._ranges_with_retries(url, ranges, self._transfers.read_ranges, verify)
        self._count(bytes=sum(len(block) for block in blocks))
        return blocks

    def fetch_range_pieces(self, url: str, ranges: Sequence[tuple[int, int]], *,
                           verify: Callable[[list[list[bytes]]], None] | None = None,
                           each: Callable[[int, bytes], object] | None = None,
                           ) -> list[list[bytes]]:
        """:meth:`fetch_ranges` for a shard's parts: each range in the pieces it arrived in, or
        each piece handed to ``each(offset, piece)`` as it arrives (every attempt hands on
        every byte: :meth:`.transfer.Transfers.read_range_pieces`). Raises: as :meth:`fetch`.
        """
        if not ranges:
            return []
        pieces = self._ranges_with_retries(url, ranges, functools.partial(
            self._transfers.read_range_pieces, each=each), verify)
        self._count(bytes=sum(end - start for start, end in ranges) if each is not None
                    else sum(len(p) for got in pieces for p in got))
        return pieces

    def _ranges_with_retries(self, url: str, ranges: Sequence[tuple[int, int]],
                             read: Callable[..., T], verify: Callable[[T], None] | None) -> T:
        """``read(fs, path, url, ranges, parallel)`` in attempts (the Fetcher's retries),
        each within the concurrency slots free at the time, then ``verify``."""

        def attempt() -> T:
            fs, path = self._filesystem(url)
            self._count(requests=len(ranges) - 1)  # (the attempt itself counted one)
            extra = 0  # slots free now, besides the attempt's own: ranges in flight at once
            while extra < len(ranges) - 1 and self._slots.acquire(blocking=False):
                extra += 1
            try:
                got = read(fs, path, url, ranges, 1 + extra)
            finally:
                for _ in range(extra):
                    self._slots.release()
            if verify is not None:
                verify(got)
            return got

        return self._with_retries(url, attempt)

    def fetch_many(self, requests: Iterable[FetchRequest]) -> list[FetchResult]:
        """Fetch several objects in parallel (within ``max_concurrency``), results in order.

        A request with ``path`` is written there as by :meth:`fetch_to_file`; one without
        is returned in memory. If one fails, requests not yet started are cancelled, the
        running ones finish, and the error of the first failed request (in request order,
        among those that failed) is raised, as :meth:`fetch` raises it. Not to be called from
        inside a ``fetch_many`` of the same Fetcher (its threads would wait on themselves).
        """
        pool = self._executor()
        futures = [pool.submit(self._fetch_request, request) for request in requests]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        errors = [_error_of(f) for f in futures if f.done()]
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
            raise first_error
        return [future.result() for future in futures]

    def close(self) -> None:
        """Stop: waiting requests fail, and running ones on asynchronous filesystems (s3,
        gs, az, http) are cancelled within a fraction of a second, stalled ones included; a
        read of a synchronous filesystem (a local file) ends when its current block does.

        Idempotent. Afterwards every method raises :class:`StreamcacheError`.
        """
        self._stopping.set()
        with self._lock:
            pool, self._pool = self._pool, None
            self._filesystems.clear()  # their sessions close when collected
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals

    def _fetch_request(self, request: FetchRequest) -> FetchResult:
        if request.path is None:
            data = self.fetch(request.url, size=request.size, checksum=request.checksum)
            return FetchResult(request, len(data), data)
        nbytes = self.fetch_to_file(
            request.url, request.path, size=request.size, checksum=request.checksum
        )
        return FetchResult(request, nbytes)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        self._check_open()
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.options.max_concurrency,
                    thread_name_prefix="streamcache-fetch",
                )
            return self._pool

    def _check_open(self) -> None:
        self._transfers.check_open()

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def _with_retries(self, url: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` within a concurrency slot until it succeeds or must give up."""
        attempts_allowed = self.options.retries + 1
        for number in range(1, attempts_allowed + 1):
            self._check_open()
            try:
                with self._slots:
                    self._count(requests=1)
                    return attempt()
            except _ClosedError:
                raise
            except _LocalIOError as error:  # not the remote's fault: raised as it is
                self._count(failures=1)
                raise error.original from None
            except Exception as error:
                if any(isinstance(e, _RequestTimeoutError) for e in _chain(error)):
                    self._count(stalls=1)
                transient = is_transient(error) and not self._local_mismatch(url, error)
                if not transient or number == attempts_allowed:
                    self._count(failures=1)
                    raise _final_error(url, number, error, permanent=not transient) from error
            self._count(retries=1)
            if self._stopping.wait(backoff_delay(number, self.options, random.random())):
                raise _ClosedError(f"the Fetcher was closed while retrying {url}")
        raise AssertionError("unreachable")

    def streams_remote(self, url: str) -> bool:
        """Whether ``url``'s filesystem is a remote one read asynchronously (s3, gs, az,
        http): requests to it may run concurrently."""
        fs, _ = self._filesystem(url)
        return bool(getattr(fs, "async_impl", False))

    def _local_mismatch(self, url: str, error: BaseException) -> bool:
        """Whether ``error`` is a checksum mismatch of a local file (or an in-memory one):
        read again, the same bytes fail again, so it is not retried (a remote body may have
        been damaged on the way; a local file was changed after indexing)."""
        if not any(isinstance(e, ChecksumMismatchError) for e in _chain(error)):
            return False
        fs, _ = self._filesystem(url)
        return storage.is_local(fs) or "memory" in _protocols(fs)

    def _filesystem(self, url: str) -> tuple[Any, str]:
        """This process's filesystem for ``url`` and the path inside it."""
        if "::" in url:  # a chained URL: let fsspec build (and cache, per process) the chain
            return fsspec.core.url_to_fs(url, **storage.plain_copy(self.options.storage_options))
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        key = (os.getpid(), protocol)
        with self._lock:
            fs = self._filesystems.get(key)
        if fs is None:
            # A private instance: another user's fsspec cache, or a closed Fetcher's, cannot
            # hand us a filesystem with a different configuration or a dead session.
            fs, _ = fsspec.core.url_to_fs(
                url, skip_instance_cache=True, **storage.plain_copy(self.options.storage_options)
            )
            if getattr(fs, "async_impl", False):
                _async_filesystems.add(fs)
            with self._lock:
                fs = self._filesystems.setdefault(key, fs)
        return fs, fs._strip_protocol(url)

    def _transfer(self, url: str, size: int | None, sink: Callable[[bytes], object],
                  max_bytes: int | None = None, *, stop_at: int | None = None) -> int:
        """One request for the body of ``url``, bounded as :meth:`.transfer.Transfers.read` says."""
        fs, path = self._filesystem(url)
        return self._transfers.read(fs, path, url, size, sink, max_bytes, stop_at=stop_at)


def _error_of(future: concurrent.futures.Future[Any]) -> BaseException | None:
    if future.cancelled():
        return _ClosedError("the Fetcher was closed during fetch_many")
    return future.exception()
