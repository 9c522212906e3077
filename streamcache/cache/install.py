"""The node cache's install path: fetch a shard into this process's temporaries, verify it
(size and checksum, by the Fetcher), materialize it into the local layout the reader maps,
and publish it by a rename, accounted under the cache-wide lock.

Room is made within ``cache_limit`` before the download; a full disk evicts more and tries
again (faults.py). The caller holds the shard's install lock (node.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CacheBudgetError, CacheError
from ..format.index import DatasetIndex
from ..format.materialize import is_mappable_arrow, materialize
from ..remote import storage
from ..remote.fetch import Fetcher
from ..remote.parts import fetch_bytes, fetch_to_path
from .accounting import EVICTION_GRACE_S, Accounting, LockHeld, remove_quietly
from .confine import check_folder_below
from .durability import Markers, PendingSyncs, sync_installed
from .faults import DISK_FULL_ATTEMPTS, disk_full_error, is_disk_full
from .identity import Identity, record_path, source_identity, write_record
from .ledger import Entry

#: Installed shards are read-only files: the cache never writes a published file (it only
#: renames new ones in and unlinks old ones), and a process that maps one would die of
#: SIGBUS if anything truncated it.
INSTALLED_MODE = 0o444

#: A shard that must be decoded anyway (compressed, Parquet, an Arrow stream) and stores at
#: most this many bytes is fetched into memory and decoded from there: writing it to a
#: temporary file, syncing it and reading it back twice (checksum, decode) cost more than the
#: download itself (one 64 MB shard: 0.2-0.7 s against 0.16-0.2 s). A larger one goes through
#: a file, so that the memory an install holds stays bounded by this (per download thread).
MEMORY_INSTALL_BYTES = 256 << 20


class Installer(Accounting):
    """The install part of :class:`~streamcache.cache.node.NodeCache` (a base class: its
    state is the cache's, set by the cache's constructor)."""

    index: DatasetIndex
    fetcher: Fetcher
    durable: bool
    working_set_bytes: int
    _storage_options: Mapping[str, Any]
    _shard_dir: str
    _actual_bytes: dict[int, int]
    _confirmed: set[int]
    _markers: Markers | None  # where installs are fsynced after their publish (durability.py)
    _pending: PendingSyncs  # (per process: NodeCache._reset_process_state)
    _finish_changed: threading.Condition  # (per process: NodeCache._reset_process_state)
    _finish_count: int

    if TYPE_CHECKING:  # the cache's public methods, defined in node.py
        def shard_path(self, shard: int) -> str: ...
        def estimated_bytes(self, shard: int) -> int: ...
        def _shard_lock(self, shard: int, *, wait: bool = True,
                        ) -> contextlib.AbstractContextManager[None]: ...

    def _install_with_room(self, shard: int,
                           downloaded: Callable[[bytes], None] | None = None,
                           finished: Callable[[str | None], None] | None = None) -> int:
        """Download, materialize and publish ``shard`` (shard lock held); returns the bytes
        downloaded. Makes room first; on a full disk evicts more and tries again.
        ``downloaded``, ``finished``: see :meth:`NodeCache.install`."""
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        if self.cache_limit is not None:
            # its raw bytes, not the padded estimate: evicting more than the install needs
            # would cost a re-fetch; publishing evicts the rest once the size is exact
            raw = info.raw_bytes if info.raw_bytes is not None else info.bytes
            self._make_room(self._actual_bytes.get(shard, raw))
        # Before the download: an object replaced in between is then fetched again later,
        # never served under the old object's identity.
        identity = source_identity(info, url, self._storage_options, self.fetcher.options)
        for attempt in range(1, DISK_FULL_ATTEMPTS + 1):
            try:
                staged, nbytes = self._download(shard, downloaded)
                try:
                    with self._finishing():  # (close() lets a reader's file be published)
                        self._make_durable(staged, finished)
                        self._publish(shard, staged, identity)
                finally:
                    remove_quietly(staged)
                return nbytes
            except OSError as error:
                if not is_disk_full(error):
                    raise
                needed = info.bytes + self.estimated_bytes(shard)
                if attempt == DISK_FULL_ATTEMPTS or self._evict_for_disk(needed) == 0:
                    raise self._disk_full_error(shard, needed) from error
        raise AssertionError("unreachable")

    def _disk_full_error(self, shard: int, needed: int) -> CacheError:
        return disk_full_error(self.cache_dir, shard, needed, self._accounted_bytes())

    @contextlib.contextmanager
    def _finishing(self) -> Iterator[None]:
        """An install past its download: fsync and publish, which :meth:`_await_finishing`
        waits for (a reader may be reading the file already)."""
        with self._finish_changed:
            self._finish_count += 1
        try:
            yield
        finally:
            with self._finish_changed:
                self._finish_count -= 1
                self._finish_changed.notify_all()

    def _await_finishing(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no install of this process is finishing."""
        with self._finish_changed:
            self._finish_changed.wait_for(lambda: self._finish_count == 0, timeout_s)

    def _make_durable(self, staged: str,
                      finished: Callable[[str | None], None] | None) -> None:
        """fsync the finished file ``staged`` before it is published where ``durable`` and
        the fsync cannot wait (no boot id), offering it to ``finished`` meanwhile (withdrawn
        before the rename)."""
        if not self.durable or self._markers is not None:  # (fsynced after the publish)
            return
        if finished is not None:
            finished(staged)
        try:
            storage.fsync_file(staged)
        finally:
            if finished is not None:
                finished(None)

    def _sync_due(self, *, everything: bool = False) -> None:
        """fsync the shards this process published unsynced whose time has come (every one
        with ``everything``) and remove their markers, each under its shard lock. A shard
        whose fsync fails keeps its marker (installed again after a reboot); a lock that
        cannot be taken leaves it too: making a served copy durable never fails a read.
        Only ``everything`` (:meth:`NodeCache.sync`) waits for a lock: a due shard that
        another thread or process is installing again (after an eviction: its download) is
        left for the next time, not waited for by an install or a close."""
        for shard, since in self._pending.take(everything=everything):
            assert self._markers is not None
            try:
                with self._shard_lock(shard, wait=everything):
                    if sync_installed(self.shard_path(shard)):
                        self._markers.unmark(shard)
                        self._count(synced=1)
            except LockHeld:
                self._pending.add(shard, since)
            except (OSError, CacheError):
                pass

    def _download(self, shard: int, downloaded: Callable[[bytes], None] | None = None,
                  ) -> tuple[str, int]:
        """Fetch and materialize ``shard`` into this process's temporaries: (file, bytes),
        not yet fsynced (:meth:`_make_durable`); ``downloaded`` is told the stored bytes when
        they are held in memory."""
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        tmp = self._tmp_dir()
        download = os.path.join(tmp, f"{shard:06d}.download")
        staged = os.path.join(tmp, f"{shard:06d}.arrow")
        decoded = info.compression is not None or info.format != "arrow"
        if decoded and info.bytes is not None and info.bytes <= MEMORY_INSTALL_BYTES:
            data = fetch_bytes(self.fetcher, url, size=info.bytes, checksum=info.checksum)
            if downloaded is not None:
                downloaded(data)
            materialize(data, info.format, self.index.schema, staged, where=url,
                        expected_rows=info.rows)
            return staged, len(data)
        try:
            nbytes = fetch_to_path(self.fetcher, url, download, size=info.bytes,
                                   checksum=info.checksum)
            # (a compressed shard is never in the layout; checking would decompress it once more)
            if info.format == "arrow" and info.compression is None and is_mappable_arrow(
                    download, self.index.schema):
                os.replace(download, staged)  # stored uncompressed already: no decode
            else:
                materialize(download, info.format, self.index.schema, staged, where=url,
                            expected_rows=info.rows)
        finally:
            remove_quietly(download)
        return staged, nbytes

    def _publish(self, shard: int, staged: str, identity: Identity | None) -> None:
        """Make room, account and rename ``staged`` into place, all under the cache lock.

        Order, chosen so that a crash at any point leaves the accounting at or above the
        truth (never a budget overrun): victims are unlinked before they are recorded gone,
        the new shard is recorded before it is renamed into place. The source record is
        written before the shard appears, so a shard is never without it.
        """
        nbytes = os.path.getsize(staged)
        os.chmod(staged, INSTALLED_MODE)
        # (again, if cache_dir was removed; never through a planted link)
        check_folder_below(self.cache_dir, os.path.relpath(self._shard_dir, self.cache_dir))
        if identity is not None and self.index.shards[shard].checksum is None:
            write_record(record_path(self._shard_dir, shard),
                         {"url": self.index.shard_url(shard), "identity": identity})
        self._actual_bytes[shard] = nbytes
        key = self._key(shard)
        if self._markers is not None:  # its name on disk before the shard's can be
            self._markers.mark(shard)
        with self._accounting_lock():
            victims = self._room_to_publish(shard, key, nbytes)
            now = time.time()
            self._record(victims, {key: Entry(nbytes, now)})
            # installed is not handed out: only lookup() makes a shard fresh for eviction
            os.utime(staged, (now - EVICTION_GRACE_S, now - EVICTION_GRACE_S))
            # the publishing half of storage.atomic_path, split: the staged file was written
            # and verified before the lock, and the accounting must come between
            os.replace(staged, self.shard_path(shard))
            if self.durable and self._markers is None:
                storage.fsync_dir(self._shard_dir)
        self._last_used[key] = time.time()
        self._confirmed.add(shard)
        if self._markers is not None:
            self._pending.add(shard)

    def _room_to_publish(self, shard: int, key: str, nbytes: int) -> list[str]:
        """Unlink what must go for ``nbytes`` more to fit ``cache_limit`` (the cache lock must
        be held); returns the keys evicted. An entry ``key`` already has (a copy removed before
        this install) is replaced, so it neither counts nor is evicted.

        Raises:
            CacheBudgetError: the shard alone is larger than ``cache_limit``.
        """
        books = self._books()
        if self.cache_limit is None:
            return []
        if nbytes > self.cache_limit:
            raise CacheBudgetError(
                f"shard {shard} takes {nbytes} bytes installed; cache_limit="
                f"{self.cache_limit} cannot hold it: set cache_limit to at least "
                f"{max(nbytes, self.working_set_bytes)} bytes")
        replaced = books.entries.get(key)
        others = books.total - (replaced.nbytes if replaced is not None else 0)
        if others + nbytes <= self.cache_limit:
            return []
        return self._evict(books, nbytes, exclude=key)


__all__ = ["INSTALLED_MODE", "Installer"]
