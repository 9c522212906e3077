"""The twin's thread settings (``streamcache._twin``): the native core's pool size and a
thread's gather split limit, kept so that the two backends answer alike, and not used (the
twin gathers on the calling thread)."""

from __future__ import annotations

import threading

_num_threads = 1
_gather_limit = threading.local()


def set_num_threads(threads: int) -> None:
    global _num_threads
    _num_threads = max(1, threads)


def get_num_threads() -> int:
    return _num_threads


def set_gather_threads(threads: int) -> None:
    _gather_limit.threads = max(0, threads)


def get_gather_threads() -> int:
    return int(getattr(_gather_limit, "threads", 0))


__all__ = ["get_gather_threads", "get_num_threads", "set_gather_threads", "set_num_threads"]
