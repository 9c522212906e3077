"""Disk faults of the node cache: a full disk, and a ``cache_dir`` that cannot be written.

A full disk (ENOSPC, EDQUOT) during an install makes the cache evict more and try again,
:data:`DISK_FULL_ATTEMPTS` times in all (install.py); what is raised when that does not
help, or when the folder is read-only, says what to do.
"""

from __future__ import annotations

import errno
import os

from ..errors import CacheError

#: errnos of a ``cache_dir`` the process may not write to.
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
#: Installs tried on a full disk, each after evicting what one install needs (space of an
#: evicted shard that a reader still maps is freed only when it is unmapped).
DISK_FULL_ATTEMPTS = 4


def is_disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(error)


def not_writable_error(cache_dir: str, error: OSError) -> CacheError:
    return CacheError(
        f"the cache is not writable: cache_dir={cache_dir} ({error.strerror}); "
        "streamcache writes its locks, accounting and shards there, even to read: give "
        "each node a writable local folder (StreamDataset(cache_dir=...) or "
        "$STREAMCACHE_CACHE_DIR)")


def disk_full_error(cache_dir: str, shard: int, needed: int, accounted: int) -> CacheError:
    """The error of an install that found no room on the disk even after evicting.

    Args:
        cache_dir: the cache's folder (its free space is reported).
        shard: the shard being installed.
        needed: about the bytes it needs while it is installed (stored plus installed).
        accounted: the bytes the cache holds now.
    """
    try:
        st = os.statvfs(cache_dir)
        free = f"{st.f_bavail * st.f_frsize:,} bytes free"
    except OSError:
        free = "free space unknown"
    return CacheError(
        f"no space left on the disk of cache_dir={cache_dir} ({free}) for shard "
        f"{shard}, which needs about {needed:,} bytes while it is installed, and nothing "
        "of the cache that could be evicted frees enough: free disk space, or give a "
        "cache_limit that fits the disk (at most its free space plus what the cache "
        f"holds, {accounted:,} bytes now)")


__all__ = ["DISK_FULL_ATTEMPTS", "NOT_WRITABLE", "disk_full_error", "is_disk_full",
           "not_writable_error"]
