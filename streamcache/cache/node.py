"""The node cache: one local directory shared by every process on a node, with a byte budget.

A shard is installed once per node: downloaded into a temporary file of the installing
process, verified (size and checksum), materialized into the uncompressed local layout the
reader memory-maps, and published by a rename. A per-shard file lock makes one process
install while the others on the node block on the lock and find the shard installed when it
is released. The installed bytes are kept in an accounting file under a cache-wide lock,
rebuilt from the directory once when a cache is opened. Eviction (see eviction.py) removes
the shard whose next use is farthest, or the least recently used one when no plan is known.
Local source shards already in the local layout are read in place, never copied or evicted;
they are verified once per file version (identity.py).

What identifies a cached shard (identity.py, docs/cache.md): its dataset folder is named from
the index fingerprint and the dataset's canonical location; without a checksum in the index,
the store's identity of the object (size, ETag or mtime) is recorded beside the copy and
compared once per process before the copy is first served.

Layout under ``cache_dir`` (see docs/cache.md)::

    accounting.json         installed bytes per shard, rewritten atomically under the lock
    accounting.lock         the cache-wide lock (flock)
    datasets/<ds>/NNNNNN.arrow    installed shards (read-only files) of the dataset <ds>
    datasets/<ds>/NNNNNN.source   the source object's identity, when the index has no checksum
    datasets/<ds>/NNNNNN.inplace  the verified version of a shard read in place
    locks/<ds>/NNNNNN.lock        per-shard install locks (empty files, never removed)
    tmp/<boot>-<pidns>-<pid>-<start>/   one process's temporaries; removed once it is gone

Everything read back from the folder is untrusted: accounting keys must name a shard file of
a real (not symlinked) dataset folder inside ``cache_dir``, or the file is rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .. import forksafe
from ..errors import CacheBudgetError, CacheError, ShardCorruptError
from ..format.index import DatasetIndex, ShardInfo
from ..format.materialize import is_local_layout, materialize
from ..remote import storage
from ..remote.fetch import Fetcher, FetchOptions
from .eviction import Resident, choose_victims
from .identity import (
    Identity,
    dataset_folder_name,
    read_record,
    source_identity,
    verify_in_place,
    write_record,
)

ACCOUNTING_NAME = "accounting.json"
ACCOUNTING_LOCK = "accounting.lock"
ACCOUNTING_FORMAT = "streamcache-cache-accounting"
ACCOUNTING_VERSION = 1
KEY_FORMAT, KEY_VERSION, KEY_ENTRIES = "format", "version", "entries"
KEY_BYTES, KEY_INSTALLED = "bytes", "installed"
_SHARD_FILE = re.compile(r"^(\d{6,})\.arrow$")
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
#: An accounting key: a shard file of a dataset folder; nothing else is ever trusted.
_KEY = re.compile(r"^datasets/([A-Za-z0-9][A-Za-z0-9_-]{0,127})/(\d{6,})\.arrow$")
#: Installed shards are read-only files: the cache never writes a published file (it only
#: renames new ones in and unlinks old ones), and a process that maps one would die of
#: SIGBUS if anything truncated it.
INSTALLED_MODE = 0o444
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
#: Installs tried on a full disk, each after evicting what one install needs (space of an
#: evicted shard that a reader still maps is freed only when it is unmapped).
DISK_FULL_ATTEMPTS = 4
#: A shard handed out by lookup() this recently (by any process) is evicted only when
#: nothing else can make room: the process may not have mapped it yet.
EVICTION_GRACE_S = 2.0
#: Temporaries of a process in another pid namespace (another container) whose liveness
#: cannot be checked are removed once nothing in them has changed for this long.
FOREIGN_TEMP_IDLE_S = 3600.0
#: Bytes a local-layout file holds beyond its raw column data (schema, footer, padding).
LAYOUT_OVERHEAD = 8 << 10

EvictionListener = Callable[[int, int], None]


@dataclass(frozen=True)
class CacheStats:
    """What this process's cache did (a snapshot)."""

    hits: int = 0  # local_path found the shard installed (or in place)
    misses: int = 0  # local_path had to install it (or wait for another process)
    installs: int = 0  # shards this process downloaded and published
    bytes_fetched: int = 0  # stored bytes this process downloaded
    evictions: int = 0  # shards this process removed to make room
    bytes_evicted: int = 0
    verified: int = 0  # local shards read in place that this process hashed (verify_in_place)


@dataclass(frozen=True)
class CacheUsage:
    """The node cache's accounting (all datasets, all processes)."""

    bytes: int
    shards: int
    limit: int | None


def local_bytes_estimate(info: ShardInfo) -> int:
    """Bytes a shard is expected to take installed (its raw column bytes plus the layout's
    overhead; its stored size when the index does not record the raw size)."""
    return (info.raw_bytes if info.raw_bytes is not None else info.bytes) + LAYOUT_OVERHEAD


class NodeCache:
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
        storage_options: fsspec options of the dataset's filesystem (replace those of
            ``fetch_options``).
        durable: fsync installed shards and the directory, so a power loss cannot leave a
            renamed but empty shard.
        verify_in_place: hash a local shard that is read in place against the index's
            checksum before it is first served, once per (path, size, mtime, inode) and
            remembered in ``cache_dir``; its size is always checked. False: size only.

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
                 verify_in_place: bool = True) -> None:
        self.index = index
        self.cache_dir = os.path.abspath(cache_dir)
        self.cache_limit = cache_limit
        self.durable = durable
        self.verify_in_place = verify_in_place
        self._own_fetcher = fetcher is None
        options = fetch_options or FetchOptions()
        if storage_options is not None:
            options = replace(options, storage_options=dict(storage_options))
        self.fetcher = fetcher or Fetcher(options)
        self._storage_options = dict(self.fetcher.options.storage_options)
        name = dataset_folder_name(index, self._storage_options)
        self._shard_dir = os.path.join(self.cache_dir, "datasets", name)
        self._lock_dir = os.path.join(self.cache_dir, "locks", name)
        self._dataset_key = f"datasets/{name}"
        self._in_place: dict[int, str | None] = {}
        self._verified: set[int] = set()  # shards read in place, checked in this process
        self._confirmed: set[int] = set()  # installed copies known current in this process
        self._last_used: dict[str, float] = {}
        self._actual_bytes: dict[int, int] = {}
        self._next_use: Callable[[int], float] | None = None
        self._listeners: list[EvictionListener] = []
        self._stats = CacheStats()
        self._closed = False
        self._reset_process_state()
        self.working_set_bytes = self._check_budget(working_set_bytes)
        try:
            self._make_layout()
            self._open()
        except OSError as error:
            if error.errno in _NOT_WRITABLE:
                raise self._not_writable(error) from error
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

    def lookup(self, shard: int) -> str | None:
        """The local-layout file of ``shard`` if it is installed and current (or read in
        place, verified), else None.

        Costs a ``utime`` per call; the first call for a shard in a process also checks the
        copy's source identity (one request to the store when the index has no checksum) or
        verifies the in-place file (one hash, or one ``stat`` when already recorded).

        Raises:
            ShardCorruptError, ChecksumMismatchError: a local shard read in place differs
                from its index entry.
        """
        in_place = self.in_place_path(shard)
        if in_place is not None:
            if shard not in self._verified:
                self._verify_in_place(shard, in_place)
            return in_place
        path = self.shard_path(shard)
        if shard not in self._confirmed and not self._confirm(shard):
            return None  # not installed, or a copy of an older object: install() replaces it
        try:
            os.utime(path)  # tells every process's eviction that it was just handed out
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno in _NOT_WRITABLE:
                raise self._not_writable(error) from error
            raise
        self._last_used[self._key(shard)] = time.time()
        return path

    def contains(self, shard: int) -> bool:
        """Whether ``shard`` can be served without a download or a request to the store: read
        in place, or installed and confirmed current by this process."""
        return self.in_place_path(shard) is not None or (
            shard in self._confirmed and os.path.exists(self.shard_path(shard)))

    def install(self, shard: int) -> int:
        """Make sure ``shard`` is installed and current; returns the bytes this call
        downloaded (0 when it was installed already, by this process or another, or is read
        in place).

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
                downloaded = self._install_with_room(shard)
        except OSError as error:
            if error.errno in _NOT_WRITABLE:
                raise self._not_writable(error) from error
            raise
        self._count(installs=1, bytes_fetched=downloaded)
        return downloaded

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

    def in_place_path(self, shard: int) -> str | None:
        """The source file itself when it is local and already in the local layout (not yet
        verified: :meth:`lookup` verifies it before handing it out)."""
        if shard not in self._in_place:
            self._in_place[shard] = self._find_in_place(shard)
        return self._in_place[shard]

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
            entries = self._read_accounting()
        return CacheUsage(sum(e[KEY_BYTES] for e in entries.values()), len(entries),
                          self.cache_limit)

    def close(self) -> None:
        """Release the Fetcher (if the cache made it) and this process's temporaries."""
        if self._closed:
            return
        self._closed = True
        if self._own_fetcher:
            self.fetcher.close()
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
        tmp_root = os.path.join(self.cache_dir, "tmp")
        for name in _listdir(tmp_root):
            folder = os.path.join(tmp_root, name)
            alive = process_alive(name)
            if alive is False or (alive is None and _idle_s(folder) > FOREIGN_TEMP_IDLE_S):
                shutil.rmtree(folder, ignore_errors=True)
        with self._accounting_lock():
            self._write_accounting(self._walk())

    def _walk(self) -> dict[str, dict[str, Any]]:
        """Every installed shard of every dataset in the directory, from the files: regular
        files of real folders only (a planted symlink is never counted or evicted)."""
        entries: dict[str, dict[str, Any]] = {}
        root = os.path.join(self.cache_dir, "datasets")
        for dataset in _listdir(root):
            if not _DATASET_NAME.match(dataset) or os.path.islink(os.path.join(root, dataset)):
                continue
            for name in _listdir(os.path.join(root, dataset)):
                if not _SHARD_FILE.match(name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(os.path.join(root, dataset, name))
                    if stat.S_ISREG(st.st_mode):
                        entries[f"datasets/{dataset}/{name}"] = {
                            KEY_BYTES: st.st_size, KEY_INSTALLED: st.st_mtime}
        return entries

    def _make_layout(self) -> None:
        """Create the folders this cache writes to (again, if someone removed them).

        Raises:
            CacheError: one of them is a symlink (planted: the cache would write, and
                replace stale copies, wherever it points).
        """
        for folder in (self._shard_dir, self._lock_dir, os.path.join(self.cache_dir, "tmp")):
            os.makedirs(folder, exist_ok=True)
            if os.path.islink(folder):
                raise CacheError(
                    f"{folder} is a symbolic link to {os.path.realpath(folder)}; the cache "
                    "writes only into folders of its own: remove the link (or use another "
                    "cache_dir)")

    def _not_writable(self, error: OSError) -> CacheError:
        return CacheError(
            f"the cache is not writable: cache_dir={self.cache_dir} ({error.strerror}); "
            "streamcache writes its locks, accounting and shards there, even to read: give "
            "each node a writable local folder (StreamDataset(cache_dir=...) or "
            "$STREAMCACHE_CACHE_DIR)")

    def _find_in_place(self, shard: int) -> str | None:
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        path = _local_file(url)
        if info.format != "arrow" or info.compression is not None or path is None:
            return None  # remote, Parquet or compressed: never in the local layout as it is
        return path if is_local_layout(path, self.index.schema) else None

    # ------------------------------------------------------------------ install

    def _install_and_path(self, shard: int) -> str:
        self.install(shard)
        path = self.lookup(shard)
        if path is None:
            raise CacheError(f"shard {shard} was evicted as soon as it was installed; "
                             f"cache_limit={self.cache_limit} is too tight for the processes "
                             "sharing it: raise it")
        return path

    def _install_with_room(self, shard: int) -> int:
        """Download, materialize and publish ``shard`` (shard lock held); returns the bytes
        downloaded. Makes room first; on a full disk evicts more and tries again."""
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
                staged, downloaded = self._download(shard)
                try:
                    self._publish(shard, staged, identity)
                finally:
                    _remove_quietly(staged)
                return downloaded
            except OSError as error:
                if not _disk_full(error):
                    raise
                needed = info.bytes + self.estimated_bytes(shard)
                if attempt == DISK_FULL_ATTEMPTS or self._evict_for_disk(needed) == 0:
                    raise self._disk_full_error(shard, needed) from error
        raise AssertionError("unreachable")

    def _disk_full_error(self, shard: int, needed: int) -> CacheError:
        try:
            st = os.statvfs(self.cache_dir)
            free = f"{st.f_bavail * st.f_frsize:,} bytes free"
        except OSError:
            free = "free space unknown"
        return CacheError(
            f"no space left on the disk of cache_dir={self.cache_dir} ({free}) for shard "
            f"{shard}, which needs about {needed:,} bytes while it is installed, and nothing "
            "of the cache that could be evicted frees enough: free disk space, or give a "
            "cache_limit that fits the disk (at most its free space plus what the cache "
            f"holds, {self._accounted_bytes():,} bytes now)")

    def _download(self, shard: int) -> tuple[str, int]:
        """Fetch and materialize ``shard`` into this process's temporaries: (file, bytes)."""
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        tmp = self._tmp_dir()
        download = os.path.join(tmp, f"{shard:06d}.download")
        staged = os.path.join(tmp, f"{shard:06d}.arrow")
        try:
            nbytes = self.fetcher.fetch_to_file(url, download, size=info.bytes,
                                                checksum=info.checksum)
            # (a compressed shard is never in the layout; checking would decompress it once more)
            if info.format == "arrow" and info.compression is None and is_local_layout(
                    download, self.index.schema):
                os.replace(download, staged)  # stored uncompressed already: no decode
            else:
                materialize(download, info.format, self.index.schema, staged, where=url,
                            expected_rows=info.rows, durable=self.durable)
        finally:
            _remove_quietly(download)
        return staged, nbytes

    def _publish(self, shard: int, staged: str, identity: Identity | None) -> None:
        """Make room, account and rename ``staged`` into place, all under the cache lock.

        Order, chosen so that a crash at any point leaves the accounting at or above the
        truth (never a budget overrun): victims are unlinked before the accounting is
        written, the accounting is written before the new shard is renamed into place. The
        source record is written before the shard appears, so a shard is never without it.
        """
        nbytes = os.path.getsize(staged)
        os.chmod(staged, INSTALLED_MODE)
        os.makedirs(self._shard_dir, exist_ok=True)  # (again, if cache_dir was removed)
        if identity is not None and self.index.shards[shard].checksum is None:
            write_record(self._record_path(shard),
                         {"url": self.index.shard_url(shard), "identity": identity})
        self._actual_bytes[shard] = nbytes
        key = self._key(shard)
        with self._accounting_lock():
            entries = self._read_accounting()
            entries.pop(key, None)
            if self.cache_limit is not None:
                if nbytes > self.cache_limit:
                    raise CacheBudgetError(
                        f"shard {shard} takes {nbytes} bytes installed; cache_limit="
                        f"{self.cache_limit} cannot hold it: set cache_limit to at least "
                        f"{max(nbytes, self.working_set_bytes)} bytes")
                self._evict(entries, nbytes)
            now = time.time()
            entries[key] = {KEY_BYTES: nbytes, KEY_INSTALLED: now}
            self._write_accounting(entries)
            # installed is not handed out: only lookup() makes a shard fresh for eviction
            os.utime(staged, (now - EVICTION_GRACE_S, now - EVICTION_GRACE_S))
            # the publishing half of storage.atomic_path, split: the staged file was written
            # and verified before the lock, and the accounting must come between
            os.replace(staged, self.shard_path(shard))
            if self.durable:
                storage.fsync_dir(self._shard_dir)
        self._last_used[key] = time.time()
        self._confirmed.add(shard)

    def _evict(self, entries: dict[str, dict[str, Any]], incoming: int,
               limit: int | None = None) -> None:
        """Evict from ``entries`` until ``incoming`` more bytes fit ``limit`` (default:
        ``cache_limit``), farthest next use first."""
        limit = self.cache_limit if limit is None else limit
        assert limit is not None
        residents = {key: Resident(int(e[KEY_BYTES]),
                                   max(float(e[KEY_INSTALLED]), self._last_used.get(key, 0.0)))
                     for key, e in entries.items()}
        fresh: set[str] = set()
        checked: set[str] = set()
        while True:  # stat only the candidates, never the whole directory
            victims = choose_victims(residents, incoming, limit,
                                     self._key_next_use, last_resort=fresh)
            unchecked = [key for key in victims if key not in checked]
            if not unchecked:
                break
            checked.update(unchecked)
            fresh.update(key for key in unchecked if self._handed_out_lately(key))
        for key in victims:
            path = self._confined(key)
            if path is not None:  # an entry naming anything else is dropped, never followed
                self._remove_copy(path)
            nbytes = int(entries.pop(key)[KEY_BYTES])
            self._count(evictions=1, bytes_evicted=nbytes)
            shard = self._shard_of(key)
            if shard is not None:
                for listener in self._listeners:
                    listener(shard, nbytes)

    def _make_room(self, incoming: int) -> None:
        """Evict (under the cache lock) so that ``incoming`` more bytes fit ``cache_limit``:
        before a download, so that a disk sized to the budget has room for it."""
        assert self.cache_limit is not None
        with self._accounting_lock():
            entries = self._read_accounting()
            total = sum(int(e[KEY_BYTES]) for e in entries.values())
            if total + incoming > self.cache_limit:
                self._evict(entries, min(incoming, self.cache_limit))
                self._write_accounting(entries)

    def _evict_for_disk(self, needed: int) -> int:
        """The disk is full: evict about ``needed`` bytes of shards, farthest next use first,
        whatever the budget. Returns the bytes evicted (0: nothing left to evict)."""
        with self._accounting_lock():
            entries = self._read_accounting()
            before = sum(int(e[KEY_BYTES]) for e in entries.values())
            if not entries:
                return 0
            self._evict(entries, needed, limit=before)
            self._write_accounting(entries)
            return before - sum(int(e[KEY_BYTES]) for e in entries.values())

    def _accounted_bytes(self) -> int:
        with contextlib.suppress(OSError, CacheError), self._accounting_lock():
            return sum(int(e[KEY_BYTES]) for e in self._read_accounting().values())
        return 0

    def _confined(self, key: str) -> str | None:
        """The file an accounting key names, if it is a shard file of a real dataset folder
        directly under ``cache_dir/datasets`` (symlinks resolved); else None."""
        match = _KEY.match(key)
        if match is None:
            return None
        datasets = os.path.join(os.path.realpath(self.cache_dir), "datasets")
        folder = os.path.join(self.cache_dir, "datasets", match.group(1))
        if os.path.islink(folder) or os.path.realpath(folder) != os.path.join(
                datasets, match.group(1)):
            return None
        return os.path.join(folder, f"{match.group(2)}.arrow")

    def _remove_copy(self, path: str) -> None:
        """Unlink an installed shard and its source record (a reader that mapped it keeps
        its pages)."""
        _remove_quietly(path)
        _remove_quietly(path.removesuffix(".arrow") + ".source")

    def _record_path(self, shard: int) -> str:
        return os.path.join(self._shard_dir, f"{shard:06d}.source")

    def _confirm(self, shard: int) -> bool:
        """Whether the installed copy of ``shard`` is a copy of the object the index names
        now (remembered for the process). With a checksum in the index the folder already
        fixes the content; otherwise the recorded source identity must match the store's."""
        if not os.path.exists(self.shard_path(shard)):
            return False
        info = self.index.shards[shard]
        if info.checksum is None:
            url = self.index.shard_url(shard)
            record = read_record(self._record_path(shard))
            if record is None or record.get("url") != url:
                return False
            now = source_identity(info, url, self._storage_options, self.fetcher.options)
            if now is None or record.get("identity") != now:
                return False
        self._confirmed.add(shard)
        return True

    def _verify_in_place(self, shard: int, path: str) -> None:
        """Check a shard read in place (size, and checksum once per file version)."""
        info = self.index.shards[shard]
        if not self.verify_in_place:
            info = replace(info, checksum=None)  # the size alone
        record = os.path.join(self._shard_dir, f"{shard:06d}.inplace")
        with contextlib.suppress(OSError):
            os.makedirs(self._shard_dir, exist_ok=True)
        if verify_in_place(path, info, where=path, record=record):
            self._count(verified=1)
        self._verified.add(shard)

    def _handed_out_lately(self, key: str) -> bool:
        """Whether some process's lookup() returned this shard in the last few seconds: it
        may be about to map it, and an unlink before the mapping would make it fail."""
        try:
            return time.time() - os.stat(os.path.join(self.cache_dir, key)).st_mtime < (
                EVICTION_GRACE_S)
        except FileNotFoundError:
            return False

    def _key_next_use(self, key: str) -> float:
        shard = self._shard_of(key)
        if shard is None or self._next_use is None:
            return math.inf  # another dataset's shard, or no plan: LRU decides
        return float(self._next_use(shard))

    # ------------------------------------------------------------------ accounting

    def _read_accounting(self) -> dict[str, dict[str, Any]]:
        """The accounting entries (the cache lock must be held). A missing or unreadable
        file is rebuilt from the directory."""
        try:
            with open(os.path.join(self.cache_dir, ACCOUNTING_NAME), "rb") as f:
                obj = json.loads(f.read())
            if obj[KEY_FORMAT] != ACCOUNTING_FORMAT or obj[KEY_VERSION] != ACCOUNTING_VERSION:
                raise ValueError("unknown accounting format")
            entries = {str(k): {KEY_BYTES: int(v[KEY_BYTES]),
                                KEY_INSTALLED: float(v[KEY_INSTALLED])}
                       for k, v in obj[KEY_ENTRIES].items()}
            if any(not _KEY.match(k) or e[KEY_BYTES] < 0 or not math.isfinite(e[KEY_INSTALLED])
                   for k, e in entries.items()):
                raise ValueError("an entry that does not name a shard of this cache")
            return entries
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
            return self._walk()  # untrusted input: the files are the truth

    def _write_accounting(self, entries: Mapping[str, Mapping[str, Any]]) -> None:
        obj = {KEY_FORMAT: ACCOUNTING_FORMAT, KEY_VERSION: ACCOUNTING_VERSION,
               KEY_ENTRIES: entries}
        # the temporary lives in this process's folder, which is swept once it is dead
        with storage.atomic_write(os.path.join(self.cache_dir, ACCOUNTING_NAME), "w",
                                  durable=False, temp_dir=self._tmp_dir()) as f:
            json.dump(obj, f, separators=(",", ":"))

    # ------------------------------------------------------------------ locks and helpers

    @contextlib.contextmanager
    def _accounting_lock(self) -> Iterator[None]:
        with self._book_lock, _file_lock(os.path.join(self.cache_dir, ACCOUNTING_LOCK)):
            yield

    @contextlib.contextmanager
    def _shard_lock(self, shard: int) -> Iterator[None]:
        with self._guard:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        with lock, _file_lock(os.path.join(self._lock_dir, f"{shard:06d}.lock")):
            yield

    def _tmp_dir(self) -> str:
        """This cache object's temporary folder in this process (made on first use, and again
        if it was removed)."""
        token = process_token()
        if self._tmp is None or os.path.basename(os.path.dirname(self._tmp)) != token or (
                not os.path.isdir(self._tmp)):
            self._tmp = os.path.join(self.cache_dir, "tmp", token, f"{id(self):x}")
            os.makedirs(self._tmp, exist_ok=True)
        return self._tmp

    def _key(self, shard: int) -> str:
        return f"{self._dataset_key}/{shard:06d}.arrow"

    def _shard_of(self, key: str) -> int | None:
        folder, _, name = key.rpartition("/")
        match = _SHARD_FILE.match(name)
        return int(match.group(1)) if folder == self._dataset_key and match else None

    def _count(self, **increments: int) -> None:
        with self._guard:
            self._stats = replace(self._stats, **{
                name: getattr(self._stats, name) + value for name, value in increments.items()})

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError("the cache is closed")


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, on a descriptor of its own (blocks, GIL released).

    ``flock``, not POSIX record locks (``lockf``): record locks belong to the whole process,
    so the kernel's deadlock detection sees two threads of one process as one owner and fails
    a legitimate wait with EDEADLK. A flock belongs to the open file; a child forked while it
    is held shares it, which is why it is released with an explicit LOCK_UN (that releases it
    for every copy of the descriptor) rather than by closing. The kernel releases it when the
    process dies, SIGKILL included (and its forked children, if they still hold the copy).
    """
    import fcntl  # POSIX only

    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:  # the cache folder was removed: make it again
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- process tokens

_token: tuple[int, str] | None = None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:12]
    except OSError:
        return "noboot"


def _start_ticks(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot); None if it is gone or a zombie;
    "" where /proc does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None if os.path.isdir("/proc") else ""
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def process_token() -> str:
    """``<boot id>-<pid namespace>-<pid>-<start time>``: names this process's temporaries
    uniquely across pid reuse, reboots and containers sharing the cache directory."""
    global _token
    pid = os.getpid()
    if _token is None or _token[0] != pid:
        _token = (pid, f"{_boot_id()}-{_pid_namespace()}-{pid}-{_start_ticks(pid) or 0}")
    return _token[1]


def process_alive(token: str) -> bool | None:
    """Whether the process that made ``token`` still runs: False for a malformed token or
    one of an earlier boot, None when it belongs to another pid namespace (another container
    on this node: its pids mean nothing here)."""
    parts = token.split("-")
    if len(parts) != 4 or not parts[2].isdigit():
        return False
    boot, namespace, pid, start = parts[0], parts[1], int(parts[2]), parts[3]
    if boot != _boot_id():
        return False
    if namespace != _pid_namespace():
        return None
    ticks = _start_ticks(pid)
    if ticks == "":  # no /proc: the best we can do is ask whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return ticks is not None and ticks == start


def _idle_s(folder: str) -> float:
    """Seconds since anything under ``folder`` last changed."""
    newest = 0.0
    for root, dirs, files in os.walk(folder):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.stat(name).st_mtime)
    return time.time() - newest


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _local_file(url: str) -> str | None:
    """The path of a shard URL on the local disk; None for any other filesystem."""
    if "://" in url and not url.startswith("file://"):
        return None
    return url.removeprefix("file://")


def local_size_error(url: str, expected: int) -> ShardCorruptError | None:
    """A ShardCorruptError if ``url`` is a local file of another size than ``expected``."""
    path = _local_file(url)
    try:
        size = os.path.getsize(path) if path is not None else expected
    except OSError:
        return None
    if size == expected:
        return None
    return ShardCorruptError(f"{url} is {size} bytes, the index says {expected}; it is "
                             "truncated or was rewritten after indexing: restore it, or "
                             "rebuild the index")


def _disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(error)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


__all__ = ["CacheStats", "CacheUsage", "NodeCache", "local_bytes_estimate"]
