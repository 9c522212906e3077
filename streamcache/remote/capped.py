"""Small objects read whole under a cap (an index, a side file), by a short-lived Fetcher."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .options import FetchOptions
from .retry import FetchError

if TYPE_CHECKING:
    from .fetch import Fetcher


def read_capped(url: str, limit: int, *, options: FetchOptions | None = None,
                storage_options: Mapping[str, Any] | None = None,
                fetcher: Fetcher | None = None) -> bytes:
    """At most ``limit + 1`` bytes of a small object (an index, a side file): a result longer
    than ``limit`` means the object is larger. Read by a :class:`Fetcher`, so it has its stall
    timeout and retries, and a failure names ``url``.

    Args:
        options: the options of the short-lived Fetcher made for this read (default:
            :class:`FetchOptions`'s); ``storage_options`` replace theirs.
        fetcher: read with this Fetcher instead (left open: a dataset reads its index with
            the Fetcher its shards are then downloaded by, so one client and its connections
            serve both; making an S3 client costs ~0.1 s).

    Raises:
        FileNotFoundError: there is no object at ``url`` (not retried).
        FetchError: any other failure, after the retries.
    """
    from .fetch import Fetcher  # on first use: it imports the HTTP stacks under fsspec

    if fetcher is not None:
        return _prefix(fetcher, url, limit)
    options = options or FetchOptions()
    if storage_options is not None:
        options = dataclasses.replace(options, storage_options=dict(storage_options))
    with Fetcher(options) as own:
        return _prefix(own, url, limit)


def _prefix(fetcher: Fetcher, url: str, limit: int) -> bytes:
    try:
        return fetcher.fetch_prefix(url, limit + 1)
    except FetchError as error:
        if error.permanent and isinstance(error.cause, FileNotFoundError):
            raise FileNotFoundError(f"no object at {url}") from error
        raise
