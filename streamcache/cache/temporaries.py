"""Each process's temporary folder in the cache, and the sweep of folders left by dead ones.

A process downloads and stages into ``cache_dir/tmp/<token>/`` (see node.py's layout), where
the token names the process uniquely across pid reuse, reboots and containers sharing the
cache directory, so that a cache opened later can tell whose temporaries may be removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

from ..processes import process_alive, process_token
from .confine import check_folder_below

#: Temporaries of a process in another pid namespace (another container) whose liveness
#: cannot be checked are removed once nothing in them has changed for this long.
FOREIGN_TEMP_IDLE_S = 3600.0

def temp_dir(cache_dir: str, current: str | None, owner: object) -> str:
    """The temporary folder of ``owner`` in this process: ``current`` if it is still this
    process's and exists, else a new one (made on first use, and again if it was removed)."""
    token = process_token()
    if current is None or os.path.basename(os.path.dirname(current)) != token or (
            not os.path.isdir(current)):
        current = os.path.join(cache_dir, "tmp", token, f"{id(owner):x}")
        check_folder_below(cache_dir, os.path.relpath(current, cache_dir))
    return current


def remove_dead_temporaries(tmp_root: str) -> None:
    """Remove the folders under ``tmp_root`` of processes that are gone (and those of
    another container once idle for :data:`FOREIGN_TEMP_IDLE_S`)."""
    for name in listdir(tmp_root):
        folder = os.path.join(tmp_root, name)
        alive = process_alive(name)
        if alive is False or (alive is None and _idle_s(folder) > FOREIGN_TEMP_IDLE_S):
            shutil.rmtree(folder, ignore_errors=True)


def _idle_s(folder: str) -> float:
    """Seconds since anything under ``folder`` last changed."""
    newest = 0.0
    for root, dirs, files in os.walk(folder):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.stat(name).st_mtime)
    return time.time() - newest


def listdir(folder: str) -> list[str]:
    """The names in ``folder``; none when it does not exist."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


__all__ = ["FOREIGN_TEMP_IDLE_S", "listdir", "process_alive", "process_token",
           "remove_dead_temporaries", "temp_dir"]
