"""The node cache's books: the accounting of installed bytes per shard of every dataset in the
directory (its file and format: ledger.py) under the cache-wide lock, the evictions made under
that lock (the rule itself is eviction.py's), and this process's counters.

The accounting is read and changed only under ``accounting.lock``; it is rebuilt from the
directory when the cache opens and whenever the file is missing or does not validate:
everything read back from the folder is untrusted, and the files are the truth (see node.py
for the layout, docs/cache.md for the order that keeps the accounting at or above the files).
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from ..errors import CacheError
from .confine import open_below
from .durability import marker_of
from .eviction import victims_in_order
from .ledger import (
    ACCOUNTING_NAME,
    DATASET_NAME,
    KEY_PATTERN,
    SHARD_FILE,
    Entry,
    Ledger,
    LedgerError,
)
from .temporaries import listdir, temp_dir

ACCOUNTING_LOCK = "accounting.lock"
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
    synced: int = 0  # installs this process fsynced after publishing them (durability.py)


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
    _shard_ids: dict[str, int]
    _next_use: Callable[[int], float] | None
    _listeners: list[EvictionListener]
    _book_lock: threading.Lock
    _ledger: Ledger
    _guard: threading.Lock
    _stats: CacheStats
    _tmp: str | None
    _boot: str | None  # this boot's id (durability.py); None where the OS gives none

    def _books(self) -> Ledger:
        """The accounting, up to date (the cache lock must be held): the records other
        processes appended since this cache last looked, or the whole file when it was
        rewritten; rebuilt from the directory when it is missing or does not validate
        (untrusted input: the files are the truth)."""
        try:
            self._ledger.refresh(self.cache_dir)
        except LedgerError:
            self._rebuild()
        return self._ledger

    def _rebuild(self) -> None:
        """Rewrite the accounting from the directory (the cache lock must be held)."""
        self._ledger.rewrite(self.cache_dir, self._walk(), self._tmp_dir())

    def _record(self, removed: list[str], added: dict[str, Entry] | None = None) -> None:
        """Record evictions and an install in the accounting (the cache lock must be held,
        and the books read under it)."""
        self._ledger.commit(self.cache_dir, removed, added or {}, self._tmp_dir())

    def _walk(self) -> dict[str, Entry]:
        """Every installed shard of every dataset in the directory, from the files: regular
        files of real folders only (a planted symlink is never counted or evicted)."""
        entries: dict[str, Entry] = {}
        root = os.path.join(self.cache_dir, "datasets")
        for dataset in listdir(root):
            if not DATASET_NAME.fullmatch(dataset) or os.path.islink(
                    os.path.join(root, dataset)):
                continue
            for name in listdir(os.path.join(root, dataset)):
                if not SHARD_FILE.fullmatch(name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(os.path.join(root, dataset, name))
                    if stat.S_ISREG(st.st_mode):
                        entries[f"datasets/{dataset}/{name}"] = Entry(st.st_size, st.st_mtime)
        return entries

    def _evict(self, books: Ledger, incoming: int, limit: int | None = None,
               exclude: str | None = None) -> list[str]:
        """Unlink shards of ``books`` until ``incoming`` more bytes fit ``limit`` (default:
        ``cache_limit``), farthest next use first; ``exclude`` (a shard being installed
        again) neither counts nor is chosen. Returns the keys evicted: the caller records
        them (after the unlinks, so that a crash leaves the accounting above the files)."""
        limit = self.cache_limit if limit is None else limit
        assert limit is not None
        keys = [key for key in books.entries if key != exclude]
        entries = list(map(books.entries.__getitem__, keys))
        nbytes = np.fromiter(map(operator.attrgetter("nbytes"), entries), np.int64, len(keys))
        last_used = np.fromiter(map(operator.attrgetter("installed"), entries), np.float64,
                                len(keys))
        if self._last_used:  # (reads this process made since the install)
            position = dict(zip(keys, range(len(keys)), strict=True))
            for key, when in self._last_used.items():
                i = position.get(key)
                if i is not None and when > last_used[i]:
                    last_used[i] = when
        # stat only the candidates, never the whole directory (a shard handed out lately may
        # be about to be mapped: it goes last)
        victims = victims_in_order(keys, nbytes, last_used, self._next_uses(keys), incoming,
                                   limit, self._handed_out_lately)
        for key in victims:
            self._evict_one(key, books.entries[key].nbytes)
        return victims

    def _next_uses(self, keys: list[str]) -> np.ndarray:
        """The plan position of each key's next read (``math.inf``: another dataset's shard,
        or no plan)."""
        uses = np.full(len(keys), math.inf)
        next_use = self._next_use
        if next_use is None:
            return uses
        known = self._shard_ids  # (a key's shard never changes: parsed once)
        if len(known) > 2 * len(keys) + 1024:
            known.clear()
        found = list(map(known.get, keys))
        if None in found:
            for i, key in enumerate(keys):
                if found[i] is None:
                    parsed = self._shard_of(key)
                    found[i] = known[key] = -1 if parsed is None else parsed
        shards = cast(list[int], found)
        mine = [i for i, shard in enumerate(shards) if shard >= 0]
        uses[mine] = [next_use(shards[i]) for i in mine]
        return uses

    def _evict_one(self, key: str, nbytes: int) -> None:
        path = self._confined(key)
        if path is not None:  # an entry naming anything else is dropped, never followed
            self._remove_copy(path)
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
            books = self._books()
            if books.total + incoming > self.cache_limit:
                self._record(self._evict(books, min(incoming, self.cache_limit)))

    def _evict_for_disk(self, needed: int) -> int:
        """The disk is full: evict about ``needed`` bytes of shards, farthest next use first,
        whatever the budget. Returns the bytes evicted (0: nothing left to evict)."""
        with self._accounting_lock():
            books = self._books()
            before = books.total
            if not books.entries:
                return 0
            self._record(self._evict(books, needed, limit=before))
            return before - books.total

    def _handed_out_lately(self, key: str) -> bool:
        """Whether some process's lookup() returned this shard in the last few seconds: it
        may be about to map it, and an unlink before the mapping would make it fail."""
        try:
            return time.time() - os.stat(os.path.join(self.cache_dir, key)).st_mtime < (
                EVICTION_GRACE_S)
        except FileNotFoundError:
            return False

    def _remove_copy(self, path: str) -> None:
        """Unlink an installed shard, its source record and its marker (a reader that mapped
        it keeps its pages)."""
        remove_quietly(path)
        remove_quietly(path.removesuffix(".arrow") + ".source")
        if self._boot is not None:  # its marker (durability.py): nothing left to make durable
            with contextlib.suppress(IsADirectoryError):  # (refused by name at the install)
                remove_quietly(marker_of(self.cache_dir, self._boot, path))

    def _accounted_bytes(self) -> int:
        with contextlib.suppress(OSError, CacheError), self._accounting_lock():
            return self._books().total
        return 0

    def _confined(self, key: str) -> str | None:
        """The file an accounting key names, if it is a shard file of a real dataset folder
        directly under ``cache_dir/datasets`` (symlinks resolved); else None."""
        match = KEY_PATTERN.fullmatch(key)
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
        match = SHARD_FILE.fullmatch(name)
        return int(match.group(1)) if folder == self._dataset_key and match else None

    def _count(self, **increments: int) -> None:
        with self._guard:
            self._stats = replace(self._stats, **{
                name: getattr(self._stats, name) + value for name, value in increments.items()})


class LockHeld(BlockingIOError):
    """A lock asked for without waiting is held by another thread or process."""


@contextlib.contextmanager
def file_lock(root: str, relative: str, *, wait: bool = True) -> Iterator[None]:
    """An exclusive ``flock`` on ``root/relative``, on a descriptor of its own (blocks, GIL
    released; with ``wait`` false, raises :class:`LockHeld` at once where another holds it).
    The file and its folders are made as needed and never through a symbolic link below
    ``root`` (:func:`open_below`).

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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LockHeld(f"{os.path.join(root, relative)} is locked by another process") \
                from None
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
           "EvictionListener", "LockHeld", "file_lock", "remove_quietly"]
