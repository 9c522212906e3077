"""The node cache's books: ``accounting.json`` (installed bytes per shard of every dataset in
the directory) under the cache-wide lock, its validation, the evictions made under that lock
(the rule itself is eviction.py's), and this process's counters.

The file is rewritten atomically under ``accounting.lock`` and rebuilt from the directory
when it is missing or does not validate: everything read back from the folder is untrusted,
so an accounting key must name a shard file of a real (not symlinked) dataset folder inside
``cache_dir``, or the file is rebuilt (see node.py for the layout).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CacheError
from ..remote import storage
from .confine import open_below
from .eviction import Resident, choose_victims
from .temporaries import listdir, temp_dir

ACCOUNTING_NAME = "accounting.json"
ACCOUNTING_LOCK = "accounting.lock"
ACCOUNTING_FORMAT = "streamcache-cache-accounting"
ACCOUNTING_VERSION = 1
KEY_FORMAT, KEY_VERSION, KEY_ENTRIES = "format", "version", "entries"
KEY_BYTES, KEY_INSTALLED = "bytes", "installed"
SHARD_FILE = re.compile(r"^(\d{6,})\.arrow$")
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
#: An accounting key: a shard file of a dataset folder; nothing else is ever trusted.
_KEY = re.compile(r"^datasets/([A-Za-z0-9][A-Za-z0-9_-]{0,127})/(\d{6,})\.arrow$")
#: A shard handed out by lookup() this recently (by any process) is evicted only when
#: nothing else can make room: the process may not have mapped it yet.
EVICTION_GRACE_S = 2.0

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


class Accounting:
    """The accounting part of :class:`~streamcache.cache.node.NodeCache` (a base class: its
    state is the cache's, set by the cache's constructor)."""

    cache_dir: str
    cache_limit: int | None
    _dataset_key: str
    _last_used: dict[str, float]
    _next_use: Callable[[int], float] | None
    _listeners: list[EvictionListener]
    _book_lock: threading.Lock
    _guard: threading.Lock
    _stats: CacheStats
    _tmp: str | None

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

    def _walk(self) -> dict[str, dict[str, Any]]:
        """Every installed shard of every dataset in the directory, from the files: regular
        files of real folders only (a planted symlink is never counted or evicted)."""
        entries: dict[str, dict[str, Any]] = {}
        root = os.path.join(self.cache_dir, "datasets")
        for dataset in listdir(root):
            if not _DATASET_NAME.match(dataset) or os.path.islink(os.path.join(root, dataset)):
                continue
            for name in listdir(os.path.join(root, dataset)):
                if not SHARD_FILE.match(name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(os.path.join(root, dataset, name))
                    if stat.S_ISREG(st.st_mode):
                        entries[f"datasets/{dataset}/{name}"] = {
                            KEY_BYTES: st.st_size, KEY_INSTALLED: st.st_mtime}
        return entries

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

    def _remove_copy(self, path: str) -> None:
        """Unlink an installed shard and its source record (a reader that mapped it keeps
        its pages)."""
        remove_quietly(path)
        remove_quietly(path.removesuffix(".arrow") + ".source")

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

    @contextlib.contextmanager
    def _accounting_lock(self) -> Iterator[None]:
        with self._book_lock, file_lock(self.cache_dir, ACCOUNTING_LOCK):
            yield

    def _tmp_dir(self) -> str:
        """This cache object's temporary folder in this process (made on first use, and again
        if it was removed)."""
        self._tmp = temp_dir(self.cache_dir, self._tmp, self)
        return self._tmp

    def _key(self, shard: int) -> str:
        return f"{self._dataset_key}/{shard:06d}.arrow"

    def _shard_of(self, key: str) -> int | None:
        folder, _, name = key.rpartition("/")
        match = SHARD_FILE.match(name)
        return int(match.group(1)) if folder == self._dataset_key and match else None

    def _count(self, **increments: int) -> None:
        with self._guard:
            self._stats = replace(self._stats, **{
                name: getattr(self._stats, name) + value for name, value in increments.items()})


@contextlib.contextmanager
def file_lock(root: str, relative: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``root/relative``, on a descriptor of its own (blocks, GIL
    released). The file and its folders are made as needed and never through a symbolic
    link below ``root`` (:func:`open_below`).

    ``flock``, not POSIX record locks (``lockf``): record locks belong to the whole process,
    so the kernel's deadlock detection sees two threads of one process as one owner and fails
    a legitimate wait with EDEADLK. A flock belongs to the open file; a child forked while it
    is held shares it, which is why it is released with an explicit LOCK_UN (that releases it
    for every copy of the descriptor) rather than by closing. The kernel releases it when the
    process dies, SIGKILL included (and its forked children, if they still hold the copy).

    Raises:
        CacheError: a folder or the file below ``root`` is a symbolic link (planted).
    """
    import fcntl  # POSIX only

    fd = open_below(root, relative, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


__all__ = ["ACCOUNTING_NAME", "EVICTION_GRACE_S", "Accounting", "CacheStats", "CacheUsage",
           "EvictionListener", "file_lock", "remove_quietly"]
