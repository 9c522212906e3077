"""Pure-Python twin of the native prefetch scheduler (``csrc/scheduler.h``)."""

from __future__ import annotations

import bisect
import threading
import time

SHARD_UNKNOWN, SHARD_QUEUED, SHARD_IN_FLIGHT, SHARD_READY, SHARD_FAILED = 0, 1, 2, 3, 4
WAIT_READY, WAIT_FAILED, WAIT_TIMEOUT, WAIT_STOPPED, WAIT_NOT_SCHEDULED = 0, 1, 2, 3, 4
TASK_STOPPED, TASK_TIMEOUT = -1, -2


class _Entry:
    __slots__ = ("bytes", "message", "priority", "state")

    def __init__(self) -> None:
        self.state = SHARD_UNKNOWN
        self.priority = 0
        self.bytes = 0
        self.message = ""


class Scheduler:
    """Twin of ``csrc/scheduler.h``: the same methods, states, sentinels and counters.

    The queue is a sorted list of (priority, shard) here (bisect), a std::set there.
    """

    def __init__(self, inflight_budget: int) -> None:
        self._budget = int(inflight_budget)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._entries: dict[int, _Entry] = {}
        self._queue: list[tuple[int, int]] = []
        self._inflight_bytes = 0
        self._inflight_tasks = 0
        self._stopping = False
        # hits, misses, bytes_fetched, bytes_evicted, wait_ns, tasks_done, tasks_failed
        self._counters = [0] * 7

    def submit(self, shard: int, priority: int, bytes: int) -> bool:
        with self._lock:
            if self._stopping:
                return False
            entry = self._entries.setdefault(shard, _Entry())
            if entry.state in (SHARD_IN_FLIGHT, SHARD_READY):
                return False
            if entry.state == SHARD_QUEUED:
                if entry.priority == priority:
                    return True
                self._queue.remove((entry.priority, shard))
            entry.state, entry.priority, entry.bytes, entry.message = (
                SHARD_QUEUED, priority, bytes, "")
            bisect.insort(self._queue, (priority, shard))
            self._work.notify_all()
            return True

    def cancel(self, shard: int) -> bool:
        with self._lock:
            entry = self._entries.get(shard)
            if entry is None or entry.state != SHARD_QUEUED:
                return False
            self._queue.remove((entry.priority, shard))
            del self._entries[shard]
            self._work.notify_all()
            return True

    def _head_fits(self) -> bool:
        if not self._queue:
            return False
        if self._inflight_tasks == 0:
            return True
        head = self._entries[self._queue[0][1]]
        return self._inflight_bytes + head.bytes <= self._budget

    def next_task(self, timeout_s: float) -> int:
        with self._lock:
            ready = self._work.wait_for(lambda: self._stopping or self._head_fits(),
                                        None if timeout_s < 0 else timeout_s)
            if self._stopping:
                return TASK_STOPPED
            if not ready:
                return TASK_TIMEOUT
            _, shard = self._queue.pop(0)
            entry = self._entries[shard]
            entry.state = SHARD_IN_FLIGHT
            self._inflight_bytes += entry.bytes
            self._inflight_tasks += 1
            return shard

    def complete(self, shard: int, ok: bool, bytes_fetched: int, message: str) -> None:
        with self._lock:
            entry = self._entries.get(shard)
            if entry is None or entry.state != SHARD_IN_FLIGHT:
                return
            self._inflight_bytes -= entry.bytes
            self._inflight_tasks -= 1
            entry.state = SHARD_READY if ok else SHARD_FAILED
            entry.message = "" if ok else message
            self._counters[2] += bytes_fetched
            self._counters[5 if ok else 6] += 1
            self._work.notify_all()
            self._done.notify_all()

    def mark_ready(self, shard: int) -> None:
        with self._lock:
            entry = self._entries.setdefault(shard, _Entry())
            if entry.state in (SHARD_IN_FLIGHT, SHARD_READY):  # (ready: nobody to wake)
                return
            if entry.state == SHARD_QUEUED:
                self._queue.remove((entry.priority, shard))
            entry.state, entry.message = SHARD_READY, ""
            self._work.notify_all()
            self._done.notify_all()

    def forget(self, shard: int, bytes_evicted: int) -> None:
        with self._lock:
            self._counters[3] += bytes_evicted
            entry = self._entries.get(shard)
            if entry is not None and entry.state in (SHARD_READY, SHARD_FAILED):
                del self._entries[shard]

    def _state(self, shard: int) -> int:
        entry = self._entries.get(shard)
        return SHARD_UNKNOWN if entry is None else entry.state

    def wait(self, shard: int, timeout_s: float, count_access: bool) -> tuple[int, str]:
        with self._lock:
            ready_on_entry = self._state(shard) == SHARD_READY
            if count_access:
                self._counters[0 if ready_on_entry else 1] += 1
            if not ready_on_entry:
                started = time.perf_counter_ns()
                self._done.wait_for(
                    lambda: self._stopping or self._state(shard) in (
                        SHARD_READY, SHARD_FAILED, SHARD_UNKNOWN),
                    None if timeout_s < 0 else timeout_s)
                self._counters[4] += time.perf_counter_ns() - started
            state = self._state(shard)
            if state == SHARD_READY:
                return WAIT_READY, ""
            if state == SHARD_FAILED:
                return WAIT_FAILED, self._entries[shard].message
            if self._stopping:
                return WAIT_STOPPED, ""
            if state == SHARD_UNKNOWN:
                return WAIT_NOT_SCHEDULED, ""
            return WAIT_TIMEOUT, ""

    def note_hit(self) -> None:
        with self._lock:
            self._counters[0] += 1

    def state(self, shard: int) -> int:
        with self._lock:
            return self._state(shard)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            self._done.notify_all()

    def stopped(self) -> bool:
        with self._lock:
            return self._stopping

    def counters(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._counters)

    def inflight_bytes(self) -> int:
        with self._lock:
            return self._inflight_bytes

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)
