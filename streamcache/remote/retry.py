"""Which failures are worth another attempt, and how long to wait before it.

How an error is classified is decided by :func:`is_transient`, from exception types and the
HTTP status that aiohttp and botocore expose; there is no per-cloud client code. Transient:
5xx, 408, 429, connection reset or refused, timeouts, short reads, bodies that fail their
checksum. Permanent: not found, permission denied, other 4xx, programming errors, a body
larger than expected, a local file of the wrong size. :func:`backoff_delay` is the
exponential backoff with jitter between attempts, and :class:`FetchError` the one error
raised after the last attempt, naming the URL, the number of attempts and the cause.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import http.client
import importlib
from collections.abc import Mapping
from typing import Any

from fsspec.exceptions import FSTimeoutError

from ..errors import ChecksumMismatchError, StreamcacheError
from .options import FetchOptions


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


class RangesIgnoredError(_SizeRefusedError):
    """A range request came back longer than asked: the server ignores ``Range`` (it answers
    200 with the whole object). Not retried; a range reader falls back to whole objects."""


def ranges_ignored(error: BaseException) -> bool:
    """Whether ``error`` (a :class:`FetchError` or its cause) says the server ignores ranges."""
    cause = error.cause if isinstance(error, FetchError) else error
    return isinstance(cause, RangesIgnoredError)


class _RequestTimeoutError(Exception):
    """No response, or no data, within ``timeout_s``.

    Deliberately not a ``TimeoutError``: fsspec's ``sync`` would replace it with a bare
    ``FSTimeoutError`` and lose the message.
    """


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

_BUILTIN_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    TimeoutError, asyncio.TimeoutError, ConnectionError, http.client.HTTPException,
    FSTimeoutError, ChecksumMismatchError, _SizeMismatchError, _RequestTimeoutError,
)


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    """Looked up on the first failure, not at import: importing aiohttp and botocore costs a
    fresh process a quarter of a second, and ``import streamcache`` reaches this module."""
    return _BUILTIN_TRANSIENT_TYPES + _optional_transient_types()


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
        if isinstance(e, _transient_types()):
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


def _final_error(url: str, attempts: int, error: Exception, *, permanent: bool) -> Exception:
    if isinstance(error, ChecksumMismatchError):
        return ChecksumMismatchError(f"{error} [{_plural(attempts, 'attempt')}]")
    return FetchError(url, attempts, error, permanent=permanent)

