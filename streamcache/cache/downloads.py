"""Shards whose stored bytes an install of this process holds in memory: downloaded and
verified (size and checksum), not yet decoded and published.

A compressed shard is decoded on install (cache/install.py), which takes longer than its
download; a cold reader that waits for such a shard can take the rows it needs from the
downloaded bytes meanwhile (a range read with no request: cache/ranges.py), instead of
waiting for the decode. The Prefetcher offers the bytes while its download thread decodes,
and withdraws them once the install ended, either way.

Thread safety: every method may be called from any thread. Fork: a child starts empty (the
parent's download threads are not in it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .. import forksafe


class HeldDownloads:
    """The stored bytes of the shards being decoded by this process's installs."""

    def __init__(self) -> None:
        self._after_fork_in_child()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._held: dict[int, bytes] = {}

    def offer(self, shard: int, data: bytes) -> None:
        """``data``, the verified stored bytes of ``shard``, may be read until :meth:`done`."""
        with self._changed:
            self._held[shard] = data
            self._changed.notify_all()

    def done(self, shard: int) -> None:
        """The install of ``shard`` ended (published or failed): its bytes are withdrawn, and
        whoever waits is woken to look again."""
        with self._changed:
            self._held.pop(shard, None)
            self._changed.notify_all()

    def wait(self, shard: int, settled: Callable[[], bool], poll_s: float) -> bytes | None:
        """The held bytes of ``shard``, waiting until they are held or ``settled()`` (the
        shard installed, its install failed, nothing will install it) says to stop: None
        then. ``settled`` is asked at least every ``poll_s`` seconds and after every
        :meth:`done`."""
        with self._changed:
            while True:
                data = self._held.get(shard)
                if data is not None:
                    return data
                if settled():
                    return None
                self._changed.wait(poll_s)

    def __len__(self) -> int:
        with self._changed:
            return len(self._held)


__all__ = ["HeldDownloads"]
