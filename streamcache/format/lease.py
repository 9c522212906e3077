"""The writer's lease: one :class:`~streamcache.format.writer.ShardWriter` per destination at a
time.

A writer takes the lease by creating ``_streamcache-writer.lease`` at its destination before
it writes anything, and gives it back after it has published (or aborted). The file names
the holder: a random token (also part of every shard name the writer produces), the host,
the process id and when it was taken. A second writer finds it and is refused with an error
that names the holder. Just before publishing ``index.json`` the writer reads the lease again
and publishes only if it still holds it (a conditional publish), so a writer whose lease was
broken or taken over publishes nothing.

What each kind of destination guarantees:

- A local (or NFS) folder: the lease is created with ``O_CREAT | O_EXCL``, which is atomic: of
  two writers starting at once, exactly one gets it.
- An object store with conditional writes (S3 ``If-None-Match``, fsspec ``mode="create"``,
  also ``memory://``): the same, by the store.
- A store without them: the writer checks that no lease exists, writes its own and reads it
  back. Two writers starting within the same moment can then both get past this; the lease
  re-read before the index is published refuses the one that lost, except in a window of a
  single request. Because every writer's shards have names of their own, even then an index
  never mixes two writers' shards: the last published index is one writer's, whole.

A lease left by a writer that died (SIGKILL, power loss) is taken over automatically when it
names this host and a process that no longer exists; anywhere else (another machine, an
object store written from elsewhere), the error says which file to remove once no writer is
running.

The lease file's name starts with ``_`` so that readers, ``streamcache index``,
``streamcache convert`` and data tools (Spark, pyarrow) take it for a side file, not data.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import DestinationError
from ..processes import pid_gone, process_alive, process_token
from ..remote import storage

LEASE_NAME = "_streamcache-writer.lease"
_MAX_LEASE_BYTES = 4096


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a destination: what the lease file says."""

    token: str
    host: str
    pid: int
    taken: float
    process: str = ""  # the holder's process token (processes.py); absent in older leases

    @classmethod
    def parse(cls, raw: bytes) -> LeaseHolder | None:
        """The holder in a lease file's bytes; None when they are not a lease (torn, foreign)."""
        try:
            obj = json.loads(raw[:_MAX_LEASE_BYTES])
            return cls(str(obj["token"]), str(obj["host"]), int(obj["pid"]), float(obj["taken"]),
                       str(obj.get("process", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.taken))
        return f"writer {self.token} (process {self.pid} on {self.host}, since {when})"

    def is_dead_here(self) -> bool:
        """Whether this holder was a process of this host that no longer runs: gone, a
        zombie not yet reaped, or its pid now reused by another process."""
        if self.host != socket.gethostname() or self.pid <= 0:
            return False
        if self.process:
            return process_alive(self.process) is False
        return pid_gone(self.pid)


def new_token() -> str:
    """A writer's token: random, short, safe in a file name."""
    return uuid.uuid4().hex[:12]


class WriterLease:
    """The lease of one writer on one destination folder.

    Args:
        fs: the destination's fsspec filesystem.
        root: the destination folder's path in ``fs``.
        token: this writer's token (see :func:`new_token`).

    Thread safety: used by the writer's own thread only.
    """

    def __init__(self, fs: Any, root: str, token: str) -> None:
        self._fs = fs
        self.path = storage.join(root, LEASE_NAME)
        self.url = storage.unstrip(fs, self.path)
        self.holder = LeaseHolder(token, socket.gethostname(), os.getpid(), time.time(),
                                  process_token())
        self.held = False

    def acquire(self) -> None:
        """Take the lease, or take over one left by a dead process of this host.

        Raises:
            DestinationError: another writer holds it (the message names it and the file).
        """
        data = json.dumps(asdict(self.holder)).encode()
        for _ in range(2):
            if self._create(data):
                self.held = True
                self.confirm()
                return
            other = self.read()
            if other is None or not other.is_dead_here():
                raise self._busy(other)
            self._remove_stale(other)
        raise self._busy(self.read())

    def read(self) -> LeaseHolder | None:
        """The current holder (None: no lease, or one that is not readable as a lease)."""
        self._fs.invalidate_cache(self.path)  # a listing cached by fsspec may be stale
        try:
            with self._fs.open(self.path, "rb") as f:
                raw = f.read(_MAX_LEASE_BYTES + 1)
        except FileNotFoundError:
            return None
        return LeaseHolder.parse(raw)

    def confirm(self) -> None:
        """Check that this writer still holds the lease (call it just before publishing).

        Raises:
            DestinationError: the lease is gone or another writer's.
        """
        current = self.read()
        if current is None or current.token != self.holder.token:
            self.held = False
            holder = current.describe() if current else "nobody (it was removed)"
            raise DestinationError(
                f"this writer ({self.holder.token}) no longer holds the lease {self.url}: it is "
                f"held by {holder}. Another writer took the destination over; nothing was "
                "published by this one. Write to another destination, or rerun once the other "
                "writer is done"
            )

    def release(self) -> None:
        """Give the lease back (only if this writer still holds it). Never raises."""
        if not self.held:
            return
        self.held = False
        with contextlib.suppress(Exception):
            current = self.read()
            if current is not None and current.token == self.holder.token:
                self._fs.rm_file(self.path)

    # ------------------------------------------------------------------ internals

    def _create(self, data: bytes) -> bool:
        """Create the lease file if none exists; False if one does."""
        return storage.create_exclusive(self._fs, self.path, data)

    def _remove_stale(self, stale: LeaseHolder) -> None:
        """Remove a dead holder's lease, unless it changed meanwhile."""
        if storage.is_local(self._fs):
            # a rename is atomic: of two writers taking over at once, one moves it away
            aside = f"{self.path}.stale-{self.holder.token}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return
            moved = self._read_local(aside)
            if moved is not None and moved.token != stale.token:
                # a live writer's lease replaced the stale one meanwhile: put it back
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
                os.unlink(aside)
                raise self._busy(moved)
            os.unlink(aside)
            return
        current = self.read()
        if current is not None and current.token == stale.token:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(self.path)

    @staticmethod
    def _read_local(path: str) -> LeaseHolder | None:
        with open(path, "rb") as f:
            return LeaseHolder.parse(f.read(_MAX_LEASE_BYTES + 1))

    def _busy(self, other: LeaseHolder | None) -> DestinationError:
        holder = other.describe() if other is not None else "another writer"
        return DestinationError(
            f"{storage.unstrip(self._fs, posixpath.dirname(self.path))} is being written by "
            f"{holder}: two writers to one destination would publish a mix of their shards. "
            "Wait for it to finish, or write to another destination; if no writer is running "
            f"(one was killed on another machine), remove {self.url}"
        )


__all__ = ["LEASE_NAME", "LeaseHolder", "WriterLease", "new_token"]
