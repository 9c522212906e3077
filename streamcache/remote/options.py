"""How a Fetcher reads: :class:`FetchOptions` (concurrency, stall timeout, retries, backoff,
block size, storage options), checked when made.

Free of fsspec and the HTTP stacks, so that importing the options costs nothing.
"""

from __future__ import annotations

import dataclasses
import numbers as numbers_module
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

_DEFAULT_BLOCK_SIZE = 4 << 20


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
        allow_unverified_ranges: read rows of shards that carry no per-range digests
            (Parquet files, Arrow files not written by ShardWriter) by range requests, and
            serve them before anything verified them (the file's own structure and Parquet
            page CRCs only: a rewritten object of the same size can serve wrong rows). Off by
            default: such shards are read whole and verified (size and the index's checksum)
            before any of their rows is served. ShardWriter's chunked shards are always
            verified chunk by chunk and need no switch (docs/cache.md, "Range reads").

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
    allow_unverified_ranges: bool = False

    def __post_init__(self) -> None:
        problems = type_problems(self, integers=("max_concurrency", "retries", "block_size"),
                                 numbers=("timeout_s", "backoff_initial_s", "backoff_max_s",
                                          "jitter"), flags=("allow_unverified_ranges",))
        if not isinstance(self.storage_options, Mapping):
            problems.append(f"storage_options must be a mapping, got {self.storage_options!r}")
        if problems:  # (the ranges below compare numbers: only once the types are right)
            raise ConfigError(f"invalid FetchOptions: {'; '.join(problems)}")
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


def type_problems(options: object, *, integers: tuple[str, ...] = (),
                  numbers: tuple[str, ...] = (), flags: tuple[str, ...] = (),
                  optional: tuple[str, ...] = ()) -> list[str]:
    """What is of the wrong type among the fields of an options dataclass: ``integers`` must
    be ints (not bools), ``numbers`` ints or floats (not bools), ``flags`` bools; a field in
    ``optional`` may also be None."""
    problems = []
    for name in (*integers, *numbers, *flags):
        value = getattr(options, name)
        if value is None and name in optional:
            continue
        if name in flags:
            ok, kind = isinstance(value, bool), "True or False"
        elif name in integers:
            ok = isinstance(value, numbers_module.Integral) and not isinstance(value, bool)
            kind = "an integer"
        else:
            ok = isinstance(value, numbers_module.Real) and not isinstance(value, bool)
            kind = "a number"
        if not ok:
            problems.append(f"{name} must be {kind}, got {value!r}")
    return problems
