"""Installed shards made durable after they are published, not before.

A power loss must not leave a published shard that is served while its bytes are not on disk.
An install used to fsync each shard before renaming it into place; on a cold start those
fsyncs were the last ~0.4-0.6 s before any shard was readable, and ~20% of the rate of the
first 4,096 samples even once readers mapped the finished file meanwhile (docs/cache.md, "The
cold start"). Now, where the OS gives a boot id:

1. before the rename that publishes ``datasets/<ds>/NNNNNN.arrow``, an empty *marker*
   ``unsynced/<boot id>/<ds>/NNNNNN`` is made and its folder fsynced: the marker's name is on
   disk before the shard's name can be;
2. the shard is renamed in with no fsync: every process of the node maps it at once;
3. once :data:`SYNC_DELAY_S` has passed (the kernel has usually written the pages back by
   then), a process of this boot fsyncs the shard and removes the marker, under the shard's
   lock: the installing process at its next install or its close (which skip a lock held
   elsewhere, for the next time), or one that opens the cache later in this boot (it adopts
   the markers of its dataset).

Within one boot a published file is whole whatever process crashed (the page cache outlives
processes); only a power loss or a kernel crash loses unsynced pages, and both change the boot
id. So the first cache opened after a reboot removes every shard that a marker of another boot
names, then those markers (:func:`sweep_other_boots`); lookups read no marker. Where the OS
gives no boot id, each install is fsynced before it is published, as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable

from ..errors import CacheError
from ..remote import storage
from .confine import open_below
from .faults import is_disk_full
from .ledger import DATASET_NAME
from .temporaries import listdir

#: The folder of ``cache_dir`` that holds the markers: ``unsynced/<boot id>/<ds>/NNNNNN``.
UNSYNCED = "unsynced"
#: Seconds after its publish that an install is fsynced and its marker removed: the kernel's
#: default dirty-page expiry is 30 s, so by then the fsync finds the pages mostly written.
SYNC_DELAY_S = 30.0


def marker_of(cache_dir: str, boot: str, shard_path: str) -> str:
    """The marker of the installed ``datasets/<ds>/NNNNNN.arrow`` at ``shard_path`` for the
    boot ``boot`` (of any dataset: an eviction removes whatever shard it chose)."""
    dataset, name = os.path.basename(os.path.dirname(shard_path)), os.path.basename(shard_path)
    return os.path.join(cache_dir, UNSYNCED, boot, dataset, name.removesuffix(".arrow"))


class Markers:
    """The markers of one dataset's unsynced installs in ``cache_dir``, for the boot ``boot``."""

    def __init__(self, cache_dir: str, dataset: str, boot: str) -> None:
        self.cache_dir = cache_dir
        self._relative = os.path.join(UNSYNCED, boot, dataset)
        self.folder = os.path.join(cache_dir, self._relative)

    def path(self, shard: int) -> str:
        return os.path.join(self.folder, f"{shard:06d}")

    def mark(self, shard: int) -> None:
        """Make the marker of ``shard`` and put its name on disk (the caller then renames
        the shard in). Never through a link planted below ``cache_dir``.

        Raises:
            CacheError: something other than a file of ours is at the marker's path (a
                link, a folder, a FIFO).
        """
        made = not os.path.isdir(self.folder)  # (the folders' own names go to disk too)
        relative = os.path.join(self._relative, f"{shard:06d}")
        try:
            fd = open_below(self.cache_dir, relative, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)
        except CacheError:
            raise
        except OSError as error:
            if is_disk_full(error):
                raise
            raise CacheError(f"{self.path(shard)} is not a file the cache made ({error}); "
                             "remove it") from error
        os.close(fd)
        storage.fsync_dir(self.folder)
        if made:
            for folder in (os.path.dirname(self.folder), os.path.dirname(
                    os.path.dirname(self.folder)), self.cache_dir):
                storage.fsync_dir(folder)

    def unmark(self, shard: int) -> None:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(self.path(shard))

    def marked(self) -> list[int]:
        """The shards marked now (those a process of this boot left unsynced)."""
        return sorted(int(name) for name in listdir(self.folder) if name.isdigit())


def sweep_other_boots(cache_dir: str, boot: str | None,
                      remove_copy: Callable[[str, int], None]) -> int:
    """Remove every shard that a marker of another boot names (``remove_copy(dataset,
    shard)``), then those markers; returns how many. Run under the cache-wide lock when a
    cache opens. A folder of ours that is a link is unlinked, never followed."""
    root = os.path.join(cache_dir, UNSYNCED)
    if os.path.islink(root):  # planted: its target is not ours to sweep
        with contextlib.suppress(OSError):
            os.unlink(root)
        return 0
    removed = 0
    for name in listdir(root):
        if name == boot:
            continue
        folder = os.path.join(root, name)
        if os.path.islink(folder) or not os.path.isdir(folder):
            with contextlib.suppress(OSError):
                os.unlink(folder)
            continue
        for dataset in listdir(folder):
            marks = os.path.join(folder, dataset)
            if not DATASET_NAME.fullmatch(dataset) or os.path.islink(marks):
                continue
            for shard in listdir(marks):
                if shard.isdigit():
                    remove_copy(dataset, int(shard))
                    removed += 1
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def sync_installed(shard_path: str) -> bool:
    """fsync the installed ``shard_path`` (the caller holds the shard's lock, so no install
    replaces it meanwhile, and removes its marker after); False where the fsync failed: the
    marker stays, and after a reboot the copy is installed again. A shard evicted meanwhile
    needs nothing."""
    try:
        fd = os.open(shard_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return True  # evicted
    except OSError:
        return False
    try:
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class PendingSyncs:
    """The shards this process published unsynced, with when (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}

    def add(self, shard: int, since: float | None = None) -> None:
        """Note ``shard``, published (or found marked) now, or at ``since`` (a time
        :meth:`take` gave: put back)."""
        when = time.time() if since is None else since
        with self._lock:
            self._since.setdefault(shard, when)

    def take(self, *, everything: bool = False) -> list[tuple[int, float]]:
        """Remove and return the shards due now (noted at least :data:`SYNC_DELAY_S` ago;
        every one with ``everything``), each with when it was noted, in shard order."""
        due = time.time() - SYNC_DELAY_S
        with self._lock:
            taken = sorted((k, since) for k, since in self._since.items()
                           if everything or since <= due)
            for shard, _ in taken:
                del self._since[shard]
        return taken

    def __len__(self) -> int:
        with self._lock:
            return len(self._since)


__all__ = ["SYNC_DELAY_S", "UNSYNCED", "Markers", "PendingSyncs", "marker_of",
           "sweep_other_boots", "sync_installed"]
