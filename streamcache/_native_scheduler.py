"""The prefetch scheduler of the native core (``csrc/scheduler.h``): its queue, in-flight
byte budget, shard states and waits, from the C++ extension or its twin
(``streamcache._twin_scheduler``)."""

from __future__ import annotations

from dataclasses import dataclass

from . import _native_backend
from ._native_backend import backend_name

#: Shard states of :class:`Scheduler` (``csrc/scheduler.h`` ShardState).
SHARD_UNKNOWN, SHARD_QUEUED, SHARD_IN_FLIGHT, SHARD_READY, SHARD_FAILED = 0, 1, 2, 3, 4
#: Results of :meth:`Scheduler.wait` (WaitResult).
WAIT_READY, WAIT_FAILED, WAIT_TIMEOUT, WAIT_STOPPED, WAIT_NOT_SCHEDULED = 0, 1, 2, 3, 4
#: What :meth:`Scheduler.next_task` returns instead of a shard.
TASK_STOPPED, TASK_TIMEOUT = -1, -2


@dataclass(frozen=True)
class SchedulerCounters:
    """A snapshot of a :class:`Scheduler`'s counters."""

    hits: int
    misses: int
    bytes_fetched: int
    bytes_evicted: int
    wait_s: float
    tasks_done: int
    tasks_failed: int


class Scheduler:
    """The prefetch queue, in-flight byte budget, shard states and waits of the C++ core.

    A thin facade over ``_core.Scheduler`` or its twin (chosen when it is made). See
    ``csrc/scheduler.h`` for the contract of every method. ``next_task`` and ``wait`` release
    the GIL while they block.

    Thread safety: every method may be called from any thread. Not to be used in a child
    process forked after it was made.
    """

    def __init__(self, inflight_budget: int) -> None:
        self._impl = _native_backend.active.Scheduler(int(inflight_budget))
        self.backend = backend_name()

    def submit(self, shard: int, priority: int, nbytes: int) -> bool:
        return bool(self._impl.submit(int(shard), int(priority), int(nbytes)))

    def cancel(self, shard: int) -> bool:
        return bool(self._impl.cancel(int(shard)))

    def next_task(self, timeout_s: float) -> int:
        return int(self._impl.next_task(float(timeout_s)))

    def complete(self, shard: int, ok: bool, bytes_fetched: int = 0, message: str = "") -> None:
        self._impl.complete(int(shard), bool(ok), int(bytes_fetched), str(message))

    def mark_ready(self, shard: int) -> None:
        self._impl.mark_ready(int(shard))

    def forget(self, shard: int, bytes_evicted: int = 0) -> None:
        self._impl.forget(int(shard), int(bytes_evicted))

    def wait(self, shard: int, timeout_s: float, *, count_access: bool = False,
             ) -> tuple[int, str]:
        code, message = self._impl.wait(int(shard), float(timeout_s), bool(count_access))
        return int(code), str(message)

    def note_hit(self) -> None:
        self._impl.note_hit()

    def state(self, shard: int) -> int:
        return int(self._impl.state(int(shard)))

    def stop(self) -> None:
        self._impl.stop()

    def stopped(self) -> bool:
        return bool(self._impl.stopped())

    def counters(self) -> SchedulerCounters:
        hits, misses, fetched, evicted, wait_ns, done, failed = self._impl.counters()
        return SchedulerCounters(int(hits), int(misses), int(fetched), int(evicted),
                                 wait_ns / 1e9, int(done), int(failed))

    def inflight_bytes(self) -> int:
        return int(self._impl.inflight_bytes())

    def queued(self) -> int:
        return int(self._impl.queued())
