"""Which process made something, and whether it still runs: across pid reuse, reboots and
containers that share a folder.

A process token ``<boot id>-<pid namespace>-<pid>-<start time>`` names one process run. The
cache names each process's temporaries with it (cache/temporaries.py), and the shard writer's
and the checkpointer's leases record it, so that a later process can tell a dead holder (a
crashed job, a zombie not yet reaped, a pid reused by an unrelated process) from a live one.
Also how many processes of this node read a dataset (:func:`node_readers`).
"""

from __future__ import annotations

import os
import sys

_token: tuple[int, str] | None = None


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a rank pinned to its share of a
    node, a container's CPU set) where the OS has one, else every core."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:12]
    except OSError:
        return "noboot"


def boot_id() -> str | None:
    """This boot's id (the kernel's, shared by every container of the host; a reboot, a
    power loss or a kernel crash changes it); None where the OS gives none."""
    boot = _boot_id()
    return None if boot == "noboot" else boot


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
    if ticks == "":  # no /proc: whether the pid exists is all we can tell
        return not pid_gone(pid)
    return ticks is not None and ticks == start


def pid_gone(pid: int) -> bool:
    """Whether no running process of this host has ``pid`` (a zombie counts as gone): for
    records that name a pid but no process token."""
    ticks = _start_ticks(pid)
    if ticks != "":
        return ticks is None
    try:  # no /proc: the best we can do is ask whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


#: The most reading processes :func:`node_readers` counts on a node.
MAX_NODE_READERS = 1024


def node_readers() -> int:
    """The reading processes of this node, as far as this process can tell: its ranks
    (:func:`node_ranks`) times the DataLoader worker processes of this rank when this is one.
    Each has its own range reader; the node's later cold budget (``ranges.COLD_BUDGET``) is
    split among them (one download per node makes their range reads redundant alike)."""
    return max(1, min(MAX_NODE_READERS, node_ranks() * _worker_count()))


def node_ranks() -> int:
    """The ranks of this node: torchrun's ``LOCAL_WORLD_SIZE`` (1 when unset or not a
    positive integer, at most :data:`MAX_NODE_READERS`). Each reads its part of every global
    step, so a rank's rows of a step, times this, are about the node's."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(ranks) if ranks.isdigit() and 0 < int(ranks) <= MAX_NODE_READERS else 1


def _worker_count() -> int:
    """Worker processes of this rank's DataLoader when this is one of them, else 1."""
    utils = sys.modules.get("torch.utils.data")  # (never imports torch)
    info = utils.get_worker_info() if utils is not None else None
    return max(1, int(getattr(info, "num_workers", 1) or 1))


__all__ = ["MAX_NODE_READERS", "boot_id", "node_ranks", "node_readers", "pid_gone", "process_alive",
           "process_token", "usable_cores"]
