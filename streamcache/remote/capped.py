"""Small objects read whole under a cap (an index, a side file), by a short-lived Fetcher."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .options import FetchOptions
from .retry import FetchError


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
    from .fetch import Fetcher  # on first use: it imports the HTTP stacks under fsspec

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
