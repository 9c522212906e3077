"""The prefetch Scheduler (csrc/scheduler.h), against the C++ core and its Python twin."""

from __future__ import annotations

import threading
import time

import pytest

from streamcache import _native
from streamcache._native_scheduler import (
    SHARD_FAILED,
    SHARD_IN_FLIGHT,
    SHARD_QUEUED,
    SHARD_READY,
    SHARD_UNKNOWN,
    TASK_STOPPED,
    TASK_TIMEOUT,
    WAIT_FAILED,
    WAIT_NOT_SCHEDULED,
    WAIT_READY,
    WAIT_STOPPED,
    WAIT_TIMEOUT,
    Scheduler,
)

pytestmark = pytest.mark.usefixtures("backend")


def test_tasks_come_out_in_priority_order_and_can_be_reprioritized() -> None:
    s = Scheduler(1 << 30)
    for shard, priority in [(5, 50), (1, 10), (7, 70), (3, 30)]:
        assert s.submit(shard, priority, 1)
    assert s.submit(7, 5, 1)  # the plan moved shard 7 forward
    assert s.cancel(3) and not s.cancel(3)
    assert s.state(3) == SHARD_UNKNOWN
    assert [s.next_task(0) for _ in range(3)] == [7, 1, 5]
    assert s.next_task(0) == TASK_TIMEOUT
    assert s.state(7) == SHARD_IN_FLIGHT and s.queued() == 0


def test_inflight_budget_holds_back_the_head_but_one_task_always_runs() -> None:
    s = Scheduler(100)
    s.submit(0, 0, 250)  # bigger than the budget: runs alone
    s.submit(1, 1, 60)
    s.submit(2, 2, 60)
    assert s.next_task(0) == 0
    assert s.inflight_bytes() == 250
    assert s.next_task(0.01) == TASK_TIMEOUT
    s.complete(0, True, 250)
    assert s.next_task(0) == 1
    assert s.next_task(0.01) == TASK_TIMEOUT  # 60 + 60 > 100
    s.complete(1, True, 60)
    assert s.next_task(0) == 2
    assert s.counters().bytes_fetched == 310


def test_submit_leaves_ready_and_inflight_alone_and_retries_failed() -> None:
    s = Scheduler(1 << 20)
    s.submit(4, 0, 1)
    assert s.next_task(0) == 4
    assert not s.submit(4, 0, 1)  # in flight
    s.complete(4, False, 0, "boom")
    assert s.state(4) == SHARD_FAILED
    assert s.wait(4, 0) == (WAIT_FAILED, "boom")
    assert s.submit(4, 0, 1) and s.state(4) == SHARD_QUEUED
    assert s.next_task(0) == 4
    s.complete(4, True, 1)
    assert s.state(4) == SHARD_READY and not s.submit(4, 0, 1)
    s.forget(4, 123)
    assert s.state(4) == SHARD_UNKNOWN and s.counters().bytes_evicted == 123


def wait_for_misses(s: Scheduler, misses: int) -> None:
    """Return once ``misses`` counted waits have begun: the waiter is inside ``wait``.

    A counted wait bumps ``misses`` under the scheduler's lock before it blocks, so a thread
    that sees the count and then takes the lock (any call) finds the waiter blocked.
    """
    deadline = time.monotonic() + 10  # a bound on waiting only
    while s.counters().misses < misses:
        assert time.monotonic() < deadline, "the waiter never entered wait()"
        time.sleep(0.001)


def test_wait_blocks_until_complete_and_counts_hits_misses_and_time() -> None:
    s = Scheduler(1 << 20)
    assert s.wait(9, 0, count_access=True) == (WAIT_NOT_SCHEDULED, "")
    s.submit(9, 0, 1)
    before = time.perf_counter()
    assert s.wait(9, 0.01) == (WAIT_TIMEOUT, "")
    task = s.next_task(0)

    def finish() -> None:
        wait_for_misses(s, 2)  # the first wait above was a miss too
        s.complete(task, True, 10)

    worker = threading.Thread(target=finish)
    worker.start()
    assert s.wait(9, 30.0, count_access=True) == (WAIT_READY, "")
    away_s = time.perf_counter() - before
    worker.join(10)
    assert s.wait(9, 5.0, count_access=True) == (WAIT_READY, "")
    counters = s.counters()
    assert (counters.hits, counters.misses, counters.tasks_done) == (1, 2, 1)
    # both blocked waits are counted, and never more than the time the caller spent in them
    assert 0 < counters.wait_s <= away_s + 1e-3


def test_mark_ready_unqueues_and_wakes_waiters() -> None:
    s = Scheduler(1 << 20)
    s.submit(2, 0, 1)
    results: list[tuple[int, str]] = []
    waiter = threading.Thread(target=lambda: results.append(s.wait(2, 30.0, count_access=True)))
    waiter.start()
    wait_for_misses(s, 1)
    s.mark_ready(2)
    waiter.join(10)
    assert results == [(WAIT_READY, "")]
    assert s.queued() == 0 and s.next_task(0) == TASK_TIMEOUT


def test_stop_wakes_every_blocked_call_at_once() -> None:
    s = Scheduler(1 << 20)
    s.submit(1, 0, 1)
    assert s.next_task(0) == 1  # in flight, never completed
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(s.wait(1, -1, count_access=True))),
               threading.Thread(target=lambda: results.append(s.next_task(-1)))]
    for thread in threads:
        thread.start()
    wait_for_misses(s, 1)
    s.stop()
    for thread in threads:
        thread.join(10)  # both wait forever unless stop() wakes them
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(map(str, results)) == sorted(map(str, [(WAIT_STOPPED, ""), TASK_STOPPED]))
    assert s.stopped() and not s.submit(3, 0, 1) and s.next_task(-1) == TASK_STOPPED


def test_many_workers_run_every_task_once_within_the_budget() -> None:
    s = Scheduler(300)
    done: list[int] = []
    peak = [0]
    lock = threading.Lock()

    def work() -> None:
        while (shard := s.next_task(-1)) != TASK_STOPPED:
            with lock:
                peak[0] = max(peak[0], s.inflight_bytes())
            time.sleep(0.001)
            with lock:
                done.append(shard)
            s.complete(shard, True, 100)

    workers = [threading.Thread(target=work) for _ in range(8)]
    for worker in workers:
        worker.start()
    for shard in range(200):
        s.submit(shard, 200 - shard, 100)
    for shard in range(200):
        assert s.wait(shard, 10.0)[0] == WAIT_READY
    s.stop()
    for worker in workers:
        worker.join(5)
    assert sorted(done) == list(range(200))
    assert peak[0] <= 300
    assert s.counters().tasks_done == 200


def test_facade_reports_its_backend(backend: str) -> None:
    assert Scheduler(1).backend == backend == _native.backend_name()
