"""What an install of this process offers a reader before it publishes the shard.

- The stored bytes, downloaded and verified (size and checksum), not yet decoded: a
  compressed shard is decoded on install (cache/install.py), which takes longer than its
  download; a cold reader that waits for such a shard can take the rows it needs from the
  downloaded bytes meanwhile (a range read with no request: cache/ranges.py), instead of
  waiting for the decode.
- The finished local-layout file (this process's temporary), while the install makes it
  durable: a power loss must not find a published shard that is not on disk, so the install
  fsyncs it before the rename, and that fsync took longer than the decode (three 64 MB token
  shards: 0.28-0.32 s decoded and written, 0.69-0.95 s with the fsyncs). A reader of this
  process maps the file meanwhile: the same bytes, and the same inode once published.

The Prefetcher offers either while its download thread works on the install, and withdraws
it once the install moved on or ended, either way.

Thread safety: every method may be called from any thread. Fork: a child starts empty (the
parent's download threads are not in it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .. import forksafe

T = TypeVar("T")


class HeldDownloads(Generic[T]):
    """What this process's installs offer, by shard: stored bytes (``HeldDownloads[bytes]``)
    or the path of a finished file (``HeldDownloads[str]``)."""

    def __init__(self) -> None:
        self._after_fork_in_child()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._held: dict[int, T] = {}

    def offer(self, shard: int, data: T) -> None:
        """``data`` (of ``shard``) may be read until :meth:`done`."""
        with self._changed:
            self._held[shard] = data
            self._changed.notify_all()

    def done(self, shard: int) -> None:
        """The offer of ``shard`` is withdrawn (its install moved on, or ended: published or
        failed), and whoever waits is woken to look again."""
        with self._changed:
            self._held.pop(shard, None)
            self._changed.notify_all()

    def wait(self, shard: int, settled: Callable[[], bool], poll_s: float) -> T | None:
        """What is offered of ``shard``, waiting until it is offered or ``settled()`` (the
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
