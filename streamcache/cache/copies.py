"""The node cache's lookup: which local copy of a shard may be served. An installed copy only
while it is a copy of the object the index names now, a local shard read in place only once
it is verified (what identifies them: identity.py, docs/cache.md).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..format.index import DatasetIndex
from ..format.materialize import is_local_layout
from ..remote.fetch import Fetcher
from .accounting import Accounting
from .confine import check_folder_below
from .faults import NOT_WRITABLE, not_writable_error
from .identity import local_file, read_record, record_path, source_identity, verify_in_place


class CopyLookup(Accounting):
    """The lookup part of :class:`~streamcache.cache.node.NodeCache` (a base class: its
    state is the cache's, set by the cache's constructor)."""

    index: DatasetIndex
    fetcher: Fetcher
    verify_in_place: bool
    read_in_place: bool
    _storage_options: Mapping[str, Any]
    _shard_dir: str
    _in_place: dict[int, str | None]
    _confirmed: set[int]
    _verified: set[int]

    if TYPE_CHECKING:  # the cache's public method, defined in node.py
        def shard_path(self, shard: int) -> str: ...

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
            if error.errno in NOT_WRITABLE:
                raise not_writable_error(self.cache_dir, error) from error
            raise
        self._last_used[self._key(shard)] = time.time()
        return path

    def copy_of(self, shard: int) -> str | None:
        """What an installed file of ``shard`` must record it is a copy of (``ShardReader``'s
        ``copy_of``), or None where the entry is not stamped (a whole shard, identified by
        its dataset folder and name; the units of a node override this)."""
        return None

    def contains(self, shard: int) -> bool:
        """Whether ``shard`` can be served without a download or a request to the store: read
        in place, or installed and confirmed current by this process."""
        return self.in_place_path(shard) is not None or (
            shard in self._confirmed and os.path.exists(self.shard_path(shard)))

    def in_place_path(self, shard: int) -> str | None:
        """The source file itself when it is local and already in the local layout (not yet
        verified: :meth:`lookup` verifies it before handing it out)."""
        if shard not in self._in_place:
            self._in_place[shard] = self._find_in_place(shard)
        return self._in_place[shard]

    def _find_in_place(self, shard: int) -> str | None:
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        path = local_file(url)
        if not self.read_in_place or info.format != "arrow" or info.compression is not None \
                or path is None:
            return None  # remote, Parquet or compressed: never in the local layout as it is
        return path if is_local_layout(path, self.index.schema) else None

    def _confirm(self, shard: int) -> bool:
        """Whether the installed copy of ``shard`` is a copy of the object the index names
        now (remembered for the process). With a checksum in the index the folder already
        fixes the content; otherwise the recorded source identity must match the store's."""
        if not os.path.exists(self.shard_path(shard)):
            return False
        info = self.index.shards[shard]
        if info.checksum is None:
            url = self.index.shard_url(shard)
            record = read_record(record_path(self._shard_dir, shard))
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
            check_folder_below(self.cache_dir, os.path.relpath(self._shard_dir, self.cache_dir))
        if verify_in_place(path, info, where=path, record=record):
            self._count(verified=1)
        self._verified.add(shard)


__all__ = ["CopyLookup"]
