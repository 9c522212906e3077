"""The Fetcher: whole-object reads through fsspec, made dependable.

One :class:`Fetcher` reads whole objects from any filesystem fsspec knows (``s3://``,
``gs://``, ``az://``, ``http(s)://``, ``file://`` or a plain path, ``memory://``) with

- bounded concurrency: at most ``max_concurrency`` requests in flight per Fetcher and process,
  whichever threads call it;
- timeouts: a stall, no response or no new bytes of the body for ``timeout_s`` seconds, is
  abandoned and retried, while a large transfer that keeps moving is never cut off (there is
  no limit on the total time);
- bounded bodies: a body is read to its expected size (or to ``max_bytes``) and not one block
  further: a larger object fails at once instead of filling the disk;
- prompt stops: :meth:`Fetcher.close` ends the requests in flight, stalled ones included,
  and a ``KeyboardInterrupt`` in a waiting thread cancels its request;
- retries with exponential backoff and jitter on transient errors (5xx, 408, 429, connection
  reset or refused, timeouts, short reads, bodies that fail their checksum); permanent errors
  (not found, permission denied, other 4xx, programming errors, a body larger than expected,
  a local file of the wrong size) fail at once;
- verification of the size and the ``"xxh64:..."`` checksum the index records;
- one clear error after the last attempt: :class:`FetchError` naming the URL, the number of
  attempts and the cause, or :class:`~streamcache.errors.ChecksumMismatchError`.

How an error is classified is decided by :func:`is_transient`, from exception types and the
HTTP status that aiohttp and botocore expose; there is no per-cloud client code. Filesystems
with retries of their own (s3fs and botocore retry some errors internally) multiply with the
Fetcher's; turn theirs down through ``storage_options`` where that matters.

Fork safety: the filesystem instances (with their event loop, sessions and connections) and
the Fetcher's locks and threads belong to the process that made them. A Fetcher used in a
child created by ``fork()`` builds fresh ones there. It never closes or collects its
parent's there either: fork() shares the event loop's epoll set, so closing a connection in
the child would stall the same connection in the parent. For the same reason, garbage is
collected just before ``fork()`` when a filesystem a Fetcher let go of is still alive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import gc
import http.client
import importlib
import inspect
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
import fsspec.core
from fsspec.exceptions import FSTimeoutError

from .. import forksafe
from ..errors import ChecksumMismatchError, ConfigError, StreamcacheError
from ..format import checksum as _checksum
from . import storage

T = TypeVar("T")

#: Suffix of the temporary files :meth:`Fetcher.fetch_to_file` writes before the rename; a
#: file with this suffix is an unfinished download (a crash can leave one) and never data.
TEMP_SUFFIX = ".fetching"

_DEFAULT_BLOCK_SIZE = 4 << 20
_STOP_POLL_S = 0.1  # how often a thread waiting for a request looks whether to stop


class FetchError(StreamcacheError):
    """An object could not be read; raised after the last attempt, or at once if permanent.

    Attributes:
        url: the object's URL, as given to the Fetcher.
        attempts: how many requests were made for it.
        cause: the last error (also ``__cause__``).
        permanent: True when the cause is not worth retrying (not found, access denied, ...).
    """

    def __init__(self, url: str, attempts: int, cause: BaseException, *, permanent: bool) -> None:
        if permanent:
            how = f"permanent error after {_plural(attempts, 'attempt')}, not retried"
        else:
            how = f"gave up after {_plural(attempts, 'attempt')}"
        super().__init__(f"cannot fetch {url} ({how}): {_describe(cause)}")
        self.url = url
        self.attempts = attempts
        self.cause = cause
        self.permanent = permanent


class _SizeMismatchError(Exception):
    """The body's length is not the size the index records (a short read, or a rewrite)."""


class _SizeRefusedError(Exception):
    """Not worth another attempt: the body is larger than expected (or than the cap), or a
    local file has the wrong size. Neither is a glitch of the wire."""


class _RequestTimeoutError(Exception):
    """No response, or no data, within ``timeout_s``.

    Deliberately not a ``TimeoutError``: fsspec's ``sync`` would replace it with a bare
    ``FSTimeoutError`` and lose the message.
    """


class _ClosedError(StreamcacheError):
    """The Fetcher was closed while this request was waiting or running."""


@dataclasses.dataclass(frozen=True)
class FetchOptions:
    """How a :class:`Fetcher` reads (``StreamDataset(fetch=...)``, ``load_index(fetch=...)``).

    Attributes:
        max_concurrency: requests in flight at once, per Fetcher and process (>= 1).
        timeout_s: what counts as a stall: seconds without a response, or without a new byte
            of the body (the clock restarts whenever data arrives; a large object that keeps
            moving is never cut off). Enforced for asynchronous filesystems (s3, gs, az,
            http); one without streamed reads is read by ranges of ``block_size``, each
            within ``timeout_s`` (as one whole request when the size is unknown);
            synchronous ones (local files, memory) block in their own calls. The default,
            10 s, is far beyond any healthy object store's wait for a byte.
        retries: extra attempts after the first for transient errors (>= 0). With the
            defaults a stalled object fails after about a minute (5 stalls and the waits
            between them), with a :class:`FetchError` naming its URL.
        backoff_initial_s: the wait before the first retry; it doubles on each retry.
        backoff_max_s: the longest wait between two attempts.
        jitter: fraction of each wait drawn at random, 0 (none) to 1 (the whole wait), so
            that many clients that failed together do not retry together.
        block_size: bytes of a body handed on per step (to memory or to the file).
        storage_options: keyword arguments of the filesystem of the URLs' protocol
            (credentials, endpoint); one Fetcher serves one storage configuration.

    Raises:
        ConfigError: a value out of its range (the message names the field and the range).
    """

    max_concurrency: int = 16
    timeout_s: float = 10.0
    retries: int = 4
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    jitter: float = 0.5
    block_size: int = _DEFAULT_BLOCK_SIZE
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if self.max_concurrency < 1:
            problems.append(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.retries < 0:
            problems.append(f"retries must be >= 0, got {self.retries!r}")
        if self.backoff_initial_s < 0 or self.backoff_max_s < 0:
            problems.append("backoff times must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            problems.append(f"jitter must be between 0 and 1, got {self.jitter!r}")
        if self.block_size < 1:
            problems.append(f"block_size must be >= 1, got {self.block_size!r}")
        if problems:
            raise ConfigError(f"invalid FetchOptions: {'; '.join(problems)}")


@dataclasses.dataclass
class FetchStats:
    """Counters of one Fetcher (a snapshot; see :attr:`Fetcher.stats`).

    Attributes:
        requests: requests made, every attempt counted.
        retries: attempts that followed a transient failure.
        bytes: bytes of the objects delivered (failed attempts not counted).
        objects: objects delivered.
        failures: objects given up on (a :class:`FetchError` or a checksum mismatch raised).
    """

    requests: int = 0
    retries: int = 0
    bytes: int = 0
    objects: int = 0
    failures: int = 0


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


# ----------------------------------------------------------------------------- classification

_HTTP_TRANSIENT = frozenset({408, 425, 429})
_HTTP_PERMANENT_5XX = frozenset({501, 505})
_PERMANENT_ERRNOS = frozenset(
    {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EROFS}
)
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
)


def _optional_transient_types() -> tuple[type[BaseException], ...]:
    """Network error types of the HTTP stacks under fsspec, where they are installed."""
    found: list[type[BaseException]] = []
    try:
        import aiohttp

        found.append(aiohttp.ClientError)  # statuses are judged before types
    except ImportError:
        pass
    try:
        boto = importlib.import_module("botocore.exceptions")  # untyped; Any is fine here
        names = ("HTTPClientError", "ConnectionError", "IncompleteReadError",
                 "ResponseStreamingError", "FlexibleChecksumError")  # the last: corrupt body
        found += [getattr(boto, name) for name in names if hasattr(boto, name)]
    except ImportError:
        pass
    return tuple(found)


_PERMANENT_TYPES += (_SizeRefusedError,)

_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    TimeoutError, asyncio.TimeoutError, ConnectionError, http.client.HTTPException,
    FSTimeoutError, ChecksumMismatchError, _SizeMismatchError, _RequestTimeoutError,
    *_optional_transient_types(),
)


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def http_status(error: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp, botocore, requests styles), if any."""
    candidates: list[Any] = [getattr(error, "status", None), getattr(error, "status_code", None)]
    response = getattr(error, "response", None)
    if isinstance(response, Mapping):
        candidates.append(response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
    elif response is not None:
        candidates.append(getattr(response, "status_code", None))
    for status in candidates:
        if isinstance(status, int) and 100 <= status <= 599:
            return status
    return None


def is_transient(error: BaseException) -> bool:
    """Whether another attempt may succeed where ``error`` failed.

    The chain of causes is read from the outermost error inwards and the first decisive
    fact decides: a permanent OS error type (not found, permission denied, is a directory)
    means permanent; an HTTP status means transient for 5xx (but 501 and 505), 408, 425 and
    429, permanent otherwise; a network, timeout, short-read or checksum error type means
    transient. With no decisive fact, an ``OSError`` is transient unless its errno says
    not-found or access-denied, and anything else (a bug, a bad argument) is permanent.
    """
    for e in _chain(error):
        if isinstance(e, _PERMANENT_TYPES):
            return False
        status = http_status(e)
        if status is not None:
            return status in _HTTP_TRANSIENT or (
                status >= 500 and status not in _HTTP_PERMANENT_5XX
            )
        if isinstance(e, _TRANSIENT_TYPES):
            return True
    if isinstance(error, OSError):
        return error.errno not in _PERMANENT_ERRNOS
    return False


def backoff_delay(retry: int, options: FetchOptions, draw: float) -> float:
    """Seconds to wait before retry number ``retry`` (1-based); ``draw`` is uniform in [0, 1)."""
    ceiling = min(options.backoff_max_s, options.backoff_initial_s * 2.0 ** (retry - 1))
    return ceiling * (1.0 - options.jitter * draw)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _describe(error: BaseException) -> str:
    """``Type: message`` of the first error in the chain that has a message."""
    for e in _chain(error):
        if str(e):
            return f"{type(e).__name__.lstrip('_')}: {e}"
    return type(error).__name__.lstrip("_")


# ------------------------------------------------------------------------------- the Fetcher

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
            checksum: the expected ``"xxh64:<16 hex>"``; a mismatch is retried.
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
    ) -> int:
        """Download ``url`` to ``path`` atomically and durably; returns the byte count.

        The body goes to a temporary file (suffix :data:`TEMP_SUFFIX`) in the directory of
        ``path``, is fsynced and verified, then renamed over ``path`` and the directory is
        fsynced: a reader sees the old file or the complete new one, never a part, and a
        failed or interrupted download leaves no file behind (a crash may leave a temporary).

        Args: as :meth:`fetch`, and ``path``, the file to create or replace.
        Raises: as :meth:`fetch`; and the ``OSError`` itself, not retried, when the local
        file cannot be written (no such directory, no space left, ...).
        """
        target = os.path.abspath(os.fspath(path))

        def attempt() -> int:
            # storage.atomic_path in two halves: only local errors bypass the retries
            temp = storage.temp_path(target, suffix=TEMP_SUFFIX)
            try:
                with _local_io():
                    out = open(temp, "wb")  # noqa: SIM115  (closed by the with below)
                with out:
                    received = self._transfer(url, size, _local_writer(out))
                _verify_file(temp, checksum, url)
                with _local_io():
                    storage.publish_temp(temp, target)
            except BaseException:
                _remove_quietly(temp)
                raise
            return received

        received = self._with_retries(url, attempt)
        self._count(bytes=received, objects=1)
        return received

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
        if self._stopping.is_set():
            raise _ClosedError("the Fetcher is closed")

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
                transient = is_transient(error)
                if not transient or number == attempts_allowed:
                    self._count(failures=1)
                    raise _final_error(url, number, error, permanent=not transient) from error
            self._count(retries=1)
            if self._stopping.wait(backoff_delay(number, self.options, random.random())):
                raise _ClosedError(f"the Fetcher was closed while retrying {url}")
        raise AssertionError("unreachable")

    def _filesystem(self, url: str) -> tuple[Any, str]:
        """This process's filesystem for ``url`` and the path inside it."""
        if "::" in url:  # a chained URL: let fsspec build (and cache, per process) the chain
            return fsspec.core.url_to_fs(url, **self.options.storage_options)
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        key = (os.getpid(), protocol)
        with self._lock:
            fs = self._filesystems.get(key)
        if fs is None:
            # A private instance: another user's fsspec cache, or a closed Fetcher's, cannot
            # hand us a filesystem with a different configuration or a dead session.
            fs, _ = fsspec.core.url_to_fs(
                url, skip_instance_cache=True, **self.options.storage_options
            )
            if getattr(fs, "async_impl", False):
                _async_filesystems.add(fs)
            with self._lock:
                fs = self._filesystems.setdefault(key, fs)
        return fs, fs._strip_protocol(url)

    def _transfer(self, url: str, size: int | None, sink: Callable[[bytes], object],
                  max_bytes: int | None = None, *, stop_at: int | None = None) -> int:
        """One request: stream the body into ``sink`` block by block; returns the length.

        Reads at most one byte past ``size`` (or ``max_bytes``): a body that goes on is
        refused there, not read to its end. With ``stop_at``, reads that many bytes at most
        and judges no length.
        """
        fs, path = self._filesystem(url)
        limit = _read_limit(size, max_bytes) if stop_at is None else stop_at
        if getattr(fs, "async_impl", False):
            total = self._transfer_async(fs, path, size, sink, limit)
        else:
            total = 0
            with fs.open(path, "rb") as stream:
                while block := stream.read(self._next_read(total, limit)):
                    sink(block)
                    total += len(block)
                    self._check_open()
                    if limit is not None and total >= limit:
                        break
        if stop_at is None:
            local = storage.is_local(fs) or "memory" in _protocols(fs)
            _check_size(total, size, max_bytes, url, local=local)
        return total

    def _next_read(self, total: int, limit: int | None) -> int:
        """How many bytes to ask for next: a block, but never past ``limit``."""
        if limit is None:
            return self.options.block_size
        return max(1, min(self.options.block_size, limit - total))

    def _transfer_async(self, fs: Any, path: str, size: int | None,
                        sink: Callable[[bytes], object], limit: int | None) -> int:
        timeout = self.options.timeout_s
        # A known size spares fsspec's http filesystem a HEAD request before the GET.
        open_kwargs = {} if size is None else {"size": size}
        try:
            stream = self._run(fs, _within(fs.open_async(path, "rb", **open_kwargs), timeout))
        except NotImplementedError:  # no streamed reads here: ranges, or one request
            return self._transfer_ranges(fs, path, sink, limit)
        total = 0
        try:
            while block := self._run(fs, _read_block(stream, self._next_read(total, limit),
                                                     timeout, total)):
                sink(block)
                total += len(block)
                self._check_open()
                if limit is not None and total >= limit:
                    break
        finally:
            self._cleanup(fs, _close_stream(stream))
        return total

    def _transfer_ranges(self, fs: Any, path: str, sink: Callable[[bytes], object],
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
            self._check_open()
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


def read_capped(url: str, limit: int, *, options: FetchOptions | None = None,
                storage_options: Mapping[str, Any] | None = None) -> bytes:
    """At most ``limit + 1`` bytes of a small object (an index, a side file): a result longer
    than ``limit`` means the object is larger. Read by a short-lived :class:`Fetcher`, so it
    has its stall timeout and retries, and a failure names ``url``.

    Args:
        options: the Fetcher's options (default: :class:`FetchOptions`'s);
            ``storage_options`` replace theirs.

    Raises:
        FileNotFoundError: there is no object at ``url`` (not retried).
        FetchError: any other failure, after the retries.
    """
    options = options or FetchOptions()
    if storage_options is not None:
        options = dataclasses.replace(options, storage_options=dict(storage_options))
    with Fetcher(options) as fetcher:
        try:
            return fetcher.fetch_prefix(url, limit + 1)
        except FetchError as error:
            if error.permanent and isinstance(error.cause, FileNotFoundError):
                raise FileNotFoundError(f"no object at {url}") from error
            raise


def _error_of(future: concurrent.futures.Future[Any]) -> BaseException | None:
    if future.cancelled():
        return _ClosedError("the Fetcher was closed during fetch_many")
    return future.exception()


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


async def _read_block(stream: Any, block_size: int, timeout: float, offset: int) -> bytes:
    """Up to ``block_size`` bytes (fewer only at the end), each wait bounded by ``timeout``."""
    parts: list[bytes] = []
    received = 0
    while received < block_size:
        try:
            part = await asyncio.wait_for(stream.read(block_size - received), timeout)
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


class _LocalIOError(Exception):
    """Carries an ``OSError`` of a local file past the retry logic, which re-raises it."""

    def __init__(self, original: OSError) -> None:
        super().__init__(str(original))
        self.original = original


@contextlib.contextmanager
def _local_io() -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise _LocalIOError(error) from error


def _local_writer(out: Any) -> Callable[[bytes], None]:
    def write(block: bytes) -> None:
        with _local_io():
            out.write(block)

    return write


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


def _verify_file(path: str, expected: str | None, url: str) -> None:
    if expected is None:
        return
    with _local_io():
        actual = _checksum.checksum_file(path)
    if actual != expected:
        raise ChecksumMismatchError(
            f"{url}: checksum {actual} does not match the index's {expected}; the object is "
            "corrupt or was rewritten after indexing (re-run `streamcache index` if it was "
            "rewritten on purpose)"
        )


def _final_error(url: str, attempts: int, error: Exception, *, permanent: bool) -> Exception:
    if isinstance(error, ChecksumMismatchError):
        return ChecksumMismatchError(f"{error} [{_plural(attempts, 'attempt')}]")
    return FetchError(url, attempts, error, permanent=permanent)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
