"""How far ahead and how hard a :class:`~streamcache.cache.prefetch.Prefetcher` works."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..remote.options import type_problems

#: Shards a prefetcher keeps ahead beyond the working set, unless told otherwise.
DEFAULT_LOOKAHEAD_SHARDS = 16


@dataclass(frozen=True)
class PrefetchOptions:
    """How far ahead and how hard the prefetcher works (``StreamDataset(prefetch=...)``).

    Attributes:
        workers: download threads per process (each runs one fetch + verify + materialize
            at a time; >= 1).
        lookahead_shards: at most this many upcoming shards (the current ones included) are
            queued, in flight or kept (>= 1). None (default): a :class:`StreamDataset`'s
            working set (the shards one shuffle window keeps in use) plus 16; 16 for a
            Prefetcher made without a dataset.
        lookahead_bytes: at most this many installed bytes of upcoming shards (None: the
            cache's ``cache_limit``, so prefetching never evicts a shard needed sooner).
        inflight_bytes: stored bytes downloading at once (one shard always may; >= 1).
        poll_s: longest single block in native code, so that close() and Ctrl-C are noticed
            (> 0).

    Raises:
        ConfigError: a value out of its range (the message names the field).
    """

    workers: int = 4
    lookahead_shards: int | None = None
    lookahead_bytes: int | None = None
    inflight_bytes: int = 1 << 30
    poll_s: float = 0.25

    def __post_init__(self) -> None:
        typed = type_problems(self, integers=("workers", "lookahead_shards", "lookahead_bytes",
                                              "inflight_bytes"), numbers=("poll_s",),
                              optional=("lookahead_shards", "lookahead_bytes"))
        if typed:  # (the ranges below compare numbers: only once the types are right)
            raise ConfigError(f"invalid PrefetchOptions: {'; '.join(typed)}")
        problems = [f"{name} must be >= 1, got {value!r}" for name, value in (
            ("workers", self.workers), ("lookahead_shards", self.lookahead_shards),
            ("lookahead_bytes", self.lookahead_bytes), ("inflight_bytes", self.inflight_bytes),
        ) if value is not None and value < 1]
        if self.poll_s <= 0:
            problems.append(f"poll_s must be > 0, got {self.poll_s!r}")
        if problems:
            raise ConfigError(f"invalid PrefetchOptions: {'; '.join(problems)}")

    def lookahead(self, working_set_shards: int = 0) -> int:
        """Shards kept ahead: ``lookahead_shards``, else ``working_set_shards + 16``."""
        if self.lookahead_shards is not None:
            return self.lookahead_shards
        return working_set_shards + DEFAULT_LOOKAHEAD_SHARDS


__all__ = ["DEFAULT_LOOKAHEAD_SHARDS", "PrefetchOptions"]
