"""The node cache: one local directory shared by every process on a node, with a byte budget.

A shard is installed once per node: downloaded into a temporary file of the installing
process, verified (size and checksum), materialized into the uncompressed local layout the
reader memory-maps, and published by a rename. A per-shard file lock makes one process
install while the others on the node block on the lock and find the shard installed when it
is released. The installed bytes are kept in an accounting file under a cache-wide lock (an
install appends a record: ledger.py), rebuilt from the directory once when a cache is opened.
Eviction (see eviction.py) removes the shard whose next use is farthest, or the least recently
used one when no plan is known.
Local source shards already in the local layout are read in place, never copied or evicted;
they are verified once per file version (identity.py).

What identifies a cached shard (identity.py, docs/cache.md): its dataset folder is named from
the index fingerprint and the dataset's canonical location; without a checksum in the index,
the store's identity of the object (size, ETag or mtime) is recorded beside the copy and
compared once per process before the copy is first served.

Layout under ``cache_dir`` (see docs/cache.md)::

    accounting.json         installed bytes per shard: a header, then records appended under
                            the lock (JSON lines; rewritten whole now and then: ledger.py)
    accounting.lock         the cache-wide lock (flock)
    datasets/<ds>/NNNNNN.arrow    installed shards (read-only files) of the dataset <ds>
    datasets/<ds>/NNNNNN.source   the source object's identity, when the index has no checksum
    datasets/<ds>/NNNNNN.inplace  the verified version of a shard read in place
    locks/<ds>/NNNNNN.lock        per-shard install locks (empty files, never removed)
    unsynced/<boot>/<ds>/NNNNNN   installs published before their fsync (durability.py)
    tmp/<boot>-<pidns>-<pid>-<start>/   one process's temporaries; removed once it is gone

Everything read back from the folder is untrusted: accounting keys must name a shard file of
a real (not symlinked) dataset folder inside ``cache_dir``, or the file is rebuilt.

The parts: copies.py (lookup: which local copy may be served), install.py (fetch, verify,
materialize, publish), durability.py (the fsync after the publish, the sweep after a
reboot), accounting.py (the accounting under its lock, evictions, counters), ledger.py (the
accounting file, its validation, a process's view of it), faults.py (a full disk, a
read-only folder), temporaries.py (each process's temporaries, and the sweep of dead ones).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from .. import forksafe
from ..errors import CacheBudgetError, CacheError
from ..format.index import DatasetIndex, ShardInfo
from ..processes import boot_id
from ..remote.fetch import Fetcher
from ..remote.options import FetchOptions
from .accounting import CacheStats, CacheUsage, EvictionListener, LockHeld, file_lock
from .confine import check_folder_below
from .copies import CopyLookup
from .durability import Markers, PendingSyncs, sweep_other_boots
from .faults import NOT_WRITABLE, not_writable_error
from .identity import dataset_folder_name
from .install import Installer
from .ledger import Ledger
from .temporaries import remove_dead_temporaries

#: The longest :meth:`NodeCache.close` waits for installs that are fsyncing and publishing.
FINISH_WAIT_S = 10.0
#: Bytes a local-layout file holds beyond its raw column data (schema, footer, padding).
LAYOUT_OVERHEAD = 8 << 10


def local_bytes_estimate(info: ShardInfo) -> int:
    """Bytes a shard is expected to take installed (its raw column bytes plus the layout's
    overhead; its stored size when the index does not record the raw size)."""
    return (info.raw_bytes if info.raw_bytes is not None else info.bytes) + LAYOUT_OVERHEAD


class NodeCache(Installer, CopyLookup):
    """Shards of one dataset in a node-wide cache directory. A :class:`ShardStore`.

    Args:
        index: the dataset's index.
        cache_dir: the node-local directory (created if needed). Every process of the node
            that passes the same directory shares one copy of each shard.
        cache_limit: bytes the installed shards of the whole directory may occupy (None: no
            limit). Temporaries of downloads in flight are not counted.
        working_set_bytes: bytes of shards that must be cached at once (the reader's shuffle
            window); default: the largest shard. A smaller ``cache_limit`` is refused.
        fetcher: the :class:`Fetcher` to download with (default: one made from
            ``fetch_options`` and ``storage_options``, closed with the cache).
        owns_fetcher: close ``fetcher`` with the cache (it is handed over: a dataset that
            read its index with it passes it to its first cache). A Fetcher the cache made
            is always its own.
        storage_options: fsspec options of the dataset's filesystem (replace those of
            ``fetch_options``).
        durable: a power loss never leaves a shard that is served while its bytes are not
            on disk: an install is published at once with a marker, and fsynced once
            ``durability.SYNC_DELAY_S`` has passed; after a reboot a shard still marked is
            installed again (where the OS gives no boot id, each install is fsynced before
            it is published). False: no fsync at all (a temporary folder).
        verify_in_place: hash a local shard that is read in place against the index's
            checksum before it is first served, once per (path, size, mtime, inode) and
            remembered in ``cache_dir``; its size is always checked. False: size only.
        read_in_place: serve local uncompressed shards where they lie (default). False:
            install them like remote ones (a slow mount read once, then the local disk).

    Raises:
        CacheBudgetError: ``cache_limit`` is below ``working_set_bytes``; the message states
            the minimum.
        CacheError: ``cache_dir`` cannot be written (read-only, no permission).

    Thread safety: every method may be called from any number of threads. Fork: a child
    process may use a cache made by its parent (it gets its own locks and temporaries).
    """

    def __init__(self, index: DatasetIndex, cache_dir: str, *, cache_limit: int | None = None,
                 working_set_bytes: int | None = None, fetcher: Fetcher | None = None,
                 fetch_options: FetchOptions | None = None,
                 storage_options: Mapping[str, Any] | None = None, durable: bool = True,
                 verify_in_place: bool = True, read_in_place: bool = True,
                 owns_fetcher: bool = False) -> None:
        self.index = index
        self.read_in_place = read_in_place
        self.cache_dir = os.path.abspath(cache_dir)
        self.cache_limit = cache_limit
        self.durable = durable
        self._boot = boot_id()
        self.verify_in_place = verify_in_place
        self._own_fetcher = fetcher is None or owns_fetcher
        options = fetch_options or FetchOptions()
        if storage_options is not None:
            options = replace(options, storage_options=dict(storage_options))
        self.fetcher = fetcher or Fetcher(options)
        self._storage_options = dict(self.fetcher.options.storage_options)
        name = dataset_folder_name(index, self._storage_options)
        self._shard_dir = os.path.join(self.cache_dir, "datasets", name)
        self._lock_dir = os.path.join(self.cache_dir, "locks", name)
        self._dataset_key = f"datasets/{name}"
        self._markers = Markers(self.cache_dir, name, self._boot) if (
            durable and self._boot is not None) else None
        self._in_place: dict[int, str | None] = {}
        self._verified: set[int] = set()  # shards read in place, checked in this process
        self._confirmed: set[int] = set()  # installed copies known current in this process
        self._last_used: dict[str, float] = {}
        self._shard_ids: dict[str, int] = {}  # key -> shard of this dataset (-1: none)
        self._actual_bytes: dict[int, int] = {}
        self._next_use: Callable[[int], float] | None = None
        self._listeners: list[EvictionListener] = []
        self._stats = CacheStats()
        self._ledger = Ledger()
        self._closed = False
        self._reset_process_state()
        self.working_set_bytes = self._check_budget(working_set_bytes)
        try:
            self._make_layout()
            self._open()
        except OSError as error:
            if error.errno in NOT_WRITABLE:
                raise not_writable_error(self.cache_dir, error) from error
            raise
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """Fresh in-process locks and temporary folder (also run in a forked child)."""
        self._guard = threading.Lock()
        self._shard_locks: dict[int, threading.Lock] = {}
        self._book_lock = threading.Lock()
        self._tmp: str | None = None
        self._finish_changed = threading.Condition(threading.Lock())
        self._finish_count = 0
        self._pending = PendingSyncs()  # (a forked child leaves its parent's to the parent)

    # ------------------------------------------------------------------ public API

    def local_path(self, shard: int) -> str:
        """The local-layout file of ``shard``, installing it first if needed.

        Raises:
            FetchError, ChecksumMismatchError, ShardCorruptError: the shard cannot be
                downloaded or decoded (after the Fetcher's retries).
            CacheBudgetError: the shard alone does not fit ``cache_limit``.
        """
        path = self.lookup(shard)
        if path is not None:
            self._count(hits=1)
            return path
        self._count(misses=1)
        self.install(shard)
        path = self.lookup(shard)
        # Evicted again before we could use it (a budget that is barely the working set,
        # under another process's pressure): the path is still right, install once more.
        return path if path is not None else self._install_and_path(shard)

    def install(self, shard: int, downloaded: Callable[[bytes], None] | None = None,
                finished: Callable[[str | None], None] | None = None) -> int:
        """Make sure ``shard`` is installed and current; returns the bytes this call
        downloaded (0 when it was installed already, by this process or another, or is read
        in place). ``downloaded`` is called with the shard's stored bytes once they are
        downloaded and verified, before they are decoded, where the install holds them in
        memory (a compressed shard of at most ``install.MEMORY_INSTALL_BYTES``): a reader may
        take the rows it needs from them meanwhile. ``finished`` is called with the path of
        the finished local-layout file (this process's temporary: written and checked) while
        it is fsynced before the rename, then with None before the rename: a reader of this
        process may map it meanwhile (the same inode as the published file).

        Room is made within ``cache_limit`` before the download. A full disk evicts more
        (farthest next use first) and retries. ``cache_dir`` removed meanwhile is made
        again.

        Raises:
            FetchError, ChecksumMismatchError, ShardCorruptError: as :meth:`local_path`.
            CacheError: the disk stays full, or ``cache_dir`` is not writable.
        """
        self._check_open()
        if self.contains(shard):
            return 0
        try:
            with self._shard_lock(shard):
                if os.path.exists(self.shard_path(shard)) and self._confirm(shard):
                    return 0  # another process installed it while we waited for the lock
                self._remove_copy(self.shard_path(shard))  # absent, or of an older object
                fetched = self._install_with_room(shard, downloaded, finished)
        except OSError as error:
            if error.errno in NOT_WRITABLE:
                raise not_writable_error(self.cache_dir, error) from error
            raise
        self._count(installs=1, bytes_fetched=fetched)
        self._sync_due()  # (no shard lock held: it takes each one's)
        return fetched

    def sync(self) -> None:
        """Make every shard this process installed durable now (durability.py): fsync them
        and remove their markers. Installs are published first and fsynced
        ``durability.SYNC_DELAY_S`` later, by the process's next install or its close; a
        shard still unsynced when a power loss strikes is installed again after the reboot.
        Call this where a node is about to be imaged or rebooted with its cache kept."""
        self._sync_due(everything=True)

    def installed(self, shard: int) -> bool:
        """Whether ``shard`` can be served now without a download: read in place, or
        installed and current. Never blocks and never makes a request: a copy whose currency
        would need one (an index without checksums) counts as installed only once this
        process has confirmed it."""
        if self.contains(shard):
            return True
        return self.index.shards[shard].checksum is not None and self._confirm(shard)

    def set_next_use(self, next_use: Callable[[int], float] | None) -> None:
        """Where each shard of this dataset is read next (a plan position; ``math.inf`` when
        not again). Eviction removes the farthest first; None falls back to LRU."""
        self._next_use = next_use

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        """Call ``listener(shard, nbytes)`` whenever this process evicts a shard of this
        dataset (from the thread that evicts it, with the cache-wide lock held)."""
        self._listeners.append(listener)

    def shard_path(self, shard: int) -> str:
        return os.path.join(self._shard_dir, f"{shard:06d}.arrow")

    def estimated_bytes(self, shard: int) -> int:
        """Bytes ``shard`` occupies installed: exact once seen, else from the index."""
        if self.in_place_path(shard) is not None:
            return 0
        if shard in self._actual_bytes:
            return self._actual_bytes[shard]
        return local_bytes_estimate(self.index.shards[shard])

    @property
    def stats(self) -> CacheStats:
        with self._guard:
            return self._stats

    def usage(self) -> CacheUsage:
        """Installed bytes and shards of the whole directory, from the accounting file."""
        with self._accounting_lock():
            books = self._books()
            return CacheUsage(books.total, len(books.entries), self.cache_limit)

    def close(self) -> None:
        """Release the Fetcher (if the cache made it) and this process's temporaries, once
        the installs that have finished downloading are published (at most
        :data:`FINISH_WAIT_S` seconds)."""
        if self._closed:
            return
        self._closed = True
        if self._own_fetcher:
            self.fetcher.close()
        # an install past its download fsyncs and publishes a file a reader of this process
        # may have read already: published, the next run need not fetch it again
        self._await_finishing(FINISH_WAIT_S)
        self._sync_due()  # (the rest: the next process of this boot, or installed again)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self._tmp))  # the process folder, once empty

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ construction

    def _check_budget(self, working_set_bytes: int | None) -> int:
        if working_set_bytes is None and self.cache_limit is None:
            return 0  # nothing to check (and no pass over every shard of a large index)
        if working_set_bytes is None:
            working_set_bytes = max(
                (self.estimated_bytes(k) for k in range(len(self.index.shards))), default=0)
        if self.cache_limit is not None and self.cache_limit < working_set_bytes:
            raise CacheBudgetError(
                f"cache_limit={self.cache_limit} bytes is smaller than the working set: "
                f"{working_set_bytes} bytes of shards are needed at once; set cache_limit to "
                f"at least {working_set_bytes} bytes (or shrink the shuffle window)"
            )
        return working_set_bytes

    def _open(self) -> None:
        """Remove temporaries of dead processes and rebuild the accounting from the files."""
        remove_dead_temporaries(os.path.join(self.cache_dir, "tmp"))
        with self._accounting_lock():
            # shards published unsynced before a reboot may be partial: installed again
            sweep_other_boots(self.cache_dir, self._boot, self._remove_marked)
            self._rebuild()
        if self._markers is not None:  # left unsynced by a process of this boot: ours now
            for shard in self._markers.marked():
                self._pending.add(shard)

    def _make_layout(self) -> None:
        """Create the folders this cache writes to (again, if someone removed them).

        Raises:
            CacheError: one of them, or a folder above it inside ``cache_dir``, is a symbolic
                link (planted: the cache would write, lock and replace stale copies wherever
                it points). Checked before anything is made, so nothing is created there.
        """
        for folder in (self._shard_dir, self._lock_dir, os.path.join(self.cache_dir, "tmp")):
            check_folder_below(self.cache_dir, os.path.relpath(folder, self.cache_dir))

    def _remove_marked(self, dataset: str, shard: int) -> None:
        path = self._confined(f"datasets/{dataset}/{shard:06d}.arrow")
        if path is not None:  # (a marker naming anything else removes nothing)
            self._remove_copy(path)

    def _install_and_path(self, shard: int) -> str:
        self.install(shard)
        path = self.lookup(shard)
        if path is None:
            raise CacheError(f"shard {shard} was evicted as soon as it was installed; "
                             f"cache_limit={self.cache_limit} is too tight for the processes "
                             "sharing it: raise it")
        return path

    # ------------------------------------------------------------------ locks and helpers

    @contextlib.contextmanager
    def _shard_lock(self, shard: int, *, wait: bool = True) -> Iterator[None]:
        """The shard's lock (this process's threads, then the node's processes); with
        ``wait`` false, :class:`~.accounting.LockHeld` at once where another holds it."""
        with self._guard:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        relative = os.path.join(os.path.relpath(self._lock_dir, self.cache_dir),
                                f"{shard:06d}.lock")
        if not lock.acquire(blocking=wait):
            raise LockHeld(f"shard {shard} is being installed by another thread")
        try:
            with file_lock(self.cache_dir, relative, wait=wait):
                yield
        finally:
            lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError("the cache is closed")


__all__ = ["NodeCache", "local_bytes_estimate"]
