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

#: Temporaries of a process in another pid namespace (another container) whose liveness
#: cannot be checked are removed once nothing in them has changed for this long.
FOREIGN_TEMP_IDLE_S = 3600.0

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


def temp_dir(cache_dir: str, current: str | None, owner: object) -> str:
    """The temporary folder of ``owner`` in this process: ``current`` if it is still this
    process's and exists, else a new one (made on first use, and again if it was removed)."""
    token = process_token()
    if current is None or os.path.basename(os.path.dirname(current)) != token or (
            not os.path.isdir(current)):
        current = os.path.join(cache_dir, "tmp", token, f"{id(owner):x}")
        os.makedirs(current, exist_ok=True)
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
