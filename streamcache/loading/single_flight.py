"""One call per key at a time, whichever threads ask: the others wait for its result.

Two reader threads of a pass start together and ask for the same shards (a cold first batch
touches nearly every shard): each opened every one, twice the CPU of the opens (14-35 ms a
shard of 672 chunks on this project's machine), on the cores the first batch waits for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """``run(key, call)``: ``call()`` in the first thread that asks for ``key``; threads that
    ask while it runs get its result, or raise what it raised. Nothing is kept after the call
    ends (the caller keeps what it wants kept).

    Thread safety: any thread may call :meth:`run`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Hashable, Future[T]] = {}

    def run(self, key: Hashable, call: Callable[[], T]) -> T:
        with self._lock:
            running = self._running.get(key)
            if running is None:
                mine: Future[T] = Future()
                self._running[key] = mine
        if running is not None:
            return running.result()
        try:
            value = call()
        except BaseException as error:
            mine.set_exception(error)
            raise
        finally:
            with self._lock:
                del self._running[key]
        mine.set_result(value)
        return value


__all__ = ["SingleFlight"]
