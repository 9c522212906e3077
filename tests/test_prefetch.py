"""The prefetcher (streamcache/cache/prefetch.py) over the node cache, the native scheduler (and its
twin) and a real HTTP server with faults."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from servers import FaultServer
from test_cache import (
    FAST_RETRIES,
    check_batch,
    serve_dataset,
    shard_gets,
    walked_bytes,
)

from streamcache import DatasetReader
from streamcache.cache.advice import shard_usage
from streamcache.cache.node import NodeCache
from streamcache.cache.prefetch import Prefetcher, PrefetchOptions, ShardUsage
from streamcache.format.index import DatasetIndex
from streamcache.plan import EpochOrder, ShuffleOptions
from streamcache.remote.options import FetchOptions
from streamcache.remote.retry import FetchError

BATCH = 16


def plan_for(index_rows: np.ndarray, window: int = 60) -> tuple[EpochOrder, ShardUsage]:
    order = EpochOrder(index_rows, seed=3, epoch=0, shuffle=ShuffleOptions(window=window))
    usage = shard_usage(order)
    return order, usage


def run_epoch(reader: DatasetReader, prefetcher: Prefetcher, order: EpochOrder,
              usage: ShardUsage, compute_s: float = 0.0,
              on_step: object = None) -> int:
    """Read one epoch batch by batch as a loader would: move the cursor, then read."""
    steps = 0
    for position in range(0, order.num_samples, BATCH):
        prefetcher.update(*usage.upcoming(position))
        ids = order.sample_ids(position, min(order.num_samples, position + BATCH))
        check_batch(reader.read_batch(ids), ids)
        reader._readers.clear()  # as a streaming reader does: map only the shards in use
        if callable(on_step):
            on_step()
        time.sleep(compute_s)
        steps += 1
    return steps


def stall_every_shard(server: FaultServer, index: DatasetIndex) -> None:
    server.faults.configure(delay_s=30.0)
    for shard in index.shards:
        server.faults.script(f"/ds/{shard.path}", ["stall"] * 10)


def wait_until_idle(prefetcher: Prefetcher) -> None:
    """Return once nothing is queued or downloading (bounded: a hang fails the test)."""
    scheduler = prefetcher.scheduler
    deadline = time.monotonic() + 30
    while scheduler.queued() or scheduler.inflight_bytes():
        assert time.monotonic() < deadline, "the prefetcher never went idle"
        time.sleep(0.005)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("streamcache-prefetch")]


# --------------------------------------------------------------------------- plan as data


def test_shard_usage_matches_a_scan_of_the_plan() -> None:
    rows = np.array([7, 0, 30, 12, 25, 9, 18, 40, 3, 21])
    order, usage = plan_for(rows, window=20)
    shards, _ = order.locate(0, order.num_samples)
    for k in range(len(rows)):
        where = np.flatnonzero(shards == k)
        assert (usage.first[k], usage.last[k]) == ((where[0], where[-1]) if where.size
                                                   else (-1, -1))
    for position in (0, 17, 60, order.num_samples - 1):
        upcoming, next_use = usage.upcoming(position)
        exact_shards, exact_next = order.shard_first_use(position, order.num_samples)
        assert set(upcoming.tolist()) == set(exact_shards.tolist())
        exact = dict(zip(exact_shards.tolist(), exact_next.tolist(), strict=True))
        assert all(next_use[i] <= exact[s] for i, s in enumerate(upcoming.tolist()))
        assert np.all(np.diff(next_use) >= 0)
    sizes = np.arange(len(rows)) * 100 + 1000
    brute = max(sum(int(sizes[k]) for k in range(len(rows))
                    if usage.first[k] <= p <= usage.last[k]) for p in range(order.num_samples))
    assert usage.working_set_bytes(sizes) == brute


# --------------------------------------------------------------------------- epochs


@pytest.mark.usefixtures("backend")
def test_an_epoch_completes_correctly_when_a_fifth_of_requests_fail(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    order, usage = plan_for(index.shard_rows)
    fault_server.faults.configure(rate=0.2, kinds=("error", "reset", "truncate", "corrupt"))
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    with Prefetcher(cache, PrefetchOptions(workers=3)) as prefetcher, \
            DatasetReader(index, store=prefetcher) as reader:
        run_epoch(reader, prefetcher, order, usage)
        stats = prefetcher.stats
    assert sum(fault_server.faults.injected.values()) > 0
    assert set(shard_gets(fault_server)) == {f"/ds/{s.path}" for s in index.shards}
    assert stats.tasks_done == len(index.shards) and stats.tasks_failed == 0
    assert stats.bytes_fetched == index.total_bytes
    assert stats.hits + stats.misses > 0


def test_an_epoch_with_cache_limit_at_30_percent_stays_within_it(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server, num_shards=20)
    order, usage = plan_for(index.shard_rows, window=40)
    probe = NodeCache(index, str(tmp_path / "probe"))
    sizes = [probe.estimated_bytes(k) for k in range(len(index.shards))]
    limit = int(0.3 * sum(sizes))
    cache = NodeCache(index, str(tmp_path / "cache"), cache_limit=limit,
                      working_set_bytes=usage.working_set_bytes(sizes))
    seen: list[int] = []
    with Prefetcher(cache, PrefetchOptions(workers=2)) as prefetcher, \
            DatasetReader(index, store=prefetcher) as reader:
        run_epoch(reader, prefetcher, order, usage,
                  on_step=lambda: seen.extend([cache.usage().bytes,
                                               walked_bytes(tmp_path / "cache")]))
        stats, cache_stats = prefetcher.stats, cache.stats
    assert max(seen) <= limit
    assert cache_stats.evictions > 0 and stats.bytes_evicted == cache_stats.bytes_evicted
    assert stats.tasks_done >= len(index.shards)


def test_prefetch_keeps_the_reader_from_waiting(fault_server: FaultServer,
                                                tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    order, usage = plan_for(index.shard_rows)
    fault_server.faults.configure(rate=1.0, kinds=("slow",), delay_s=0.05)
    waits = {}
    for lookahead in (1, 8):
        cache = NodeCache(index, str(tmp_path / f"cache{lookahead}"))
        options = PrefetchOptions(workers=4, lookahead_shards=lookahead)
        with Prefetcher(cache, options) as prefetcher, \
                DatasetReader(index, store=prefetcher) as reader:
            # a loop that computes long enough for the prefetcher to catch up every step
            run_epoch(reader, prefetcher, order, usage,
                      on_step=lambda p=prefetcher: wait_until_idle(p))
            waits[lookahead] = prefetcher.stats
    # one shard ahead leaves the reader waiting at shard changes; eight ahead does not
    assert waits[8].misses < waits[1].misses, waits


def test_lookahead_bounds_what_is_fetched(fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    cache = NodeCache(index, str(tmp_path / "cache"))
    with Prefetcher(cache, PrefetchOptions(lookahead_shards=3)) as prefetcher:
        prefetcher.update([5, 2, 9, 0, 1], [0, 10, 20, 30, 40])
        wait_until_idle(prefetcher)
        assert prefetcher.stats.tasks_done == 3
        assert sorted(shard_gets(fault_server)) == sorted(
            f"/ds/{index.shards[k].path}" for k in (5, 2, 9))
        assert prefetcher.local_path(5) == cache.shard_path(5)
        assert prefetcher.stats.hits == 1


def test_a_shard_another_process_evicted_is_fetched_again_without_a_reader_asking(
        fault_server: FaultServer, tmp_path: Path) -> None:
    # update() does not look at the files of shards it found installed on every call: a
    # shard that another process evicts (its file unlinked) is seen at the next full check,
    # within _FULL_CHECK_EVERY updates, and fetched ahead again
    from streamcache.cache import prefetch as prefetch_module

    index = serve_dataset(fault_server)
    cache = NodeCache(index, str(tmp_path / "cache"))
    with Prefetcher(cache, PrefetchOptions(lookahead_shards=3)) as prefetcher:
        advice = ([5, 2, 9], [0, 10, 20])
        prefetcher.update(*advice)
        wait_until_idle(prefetcher)
        prefetcher.update(*advice)  # now every one of them is known installed
        os.unlink(cache.shard_path(2))
        for _ in range(prefetch_module._FULL_CHECK_EVERY):
            prefetcher.update(*advice)
        wait_until_idle(prefetcher)
        assert os.path.exists(cache.shard_path(2))
        assert shard_gets(fault_server)[f"/ds/{index.shards[2].path}"] == 2
        assert prefetcher.local_path(2) == cache.shard_path(2)


# --------------------------------------------------------------------------- errors, threads


def test_a_missing_shard_reaches_the_reader_with_its_type(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    os.unlink(Path(fault_server.root or "") / "ds" / index.shards[1].path)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    with Prefetcher(cache) as prefetcher:
        prefetcher.update([1, 2], [0, 5])
        with pytest.raises(FetchError, match=index.shards[1].path):
            prefetcher.local_path(1)
        assert prefetcher.local_path(2) == cache.shard_path(2)
        assert prefetcher.stats.tasks_failed >= 1


def test_close_stops_every_thread_promptly_even_mid_download(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    stall_every_shard(fault_server, index)
    earlier = set(prefetch_threads())  # other tests' prefetchers may still be winding down
    # neither the read timeout nor the server's 30 s stall ends a download within the wait
    # below: only close() cancelling the stalled reads does
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FetchOptions(timeout_s=60.0))
    prefetcher = Prefetcher(cache, PrefetchOptions(workers=3))
    prefetcher.update(list(range(6)), list(range(6)))
    while len(shard_gets(fault_server)) < 3:
        time.sleep(0.01)
    prefetcher.close()
    deadline = time.monotonic() + 15  # a bound on waiting, not a measure
    while set(prefetch_threads()) - earlier and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(prefetch_threads()) - earlier == set()


def test_a_forked_child_gets_its_own_scheduler_and_threads(
        fault_server: FaultServer, tmp_path: Path) -> None:
    index = serve_dataset(fault_server)
    cache = NodeCache(index, str(tmp_path / "cache"))
    with Prefetcher(cache, PrefetchOptions(workers=2)) as prefetcher:
        prefetcher.update(list(range(4)), list(range(4)))
        parent_scheduler = prefetcher.scheduler
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
            pid = os.fork()
        if pid == 0:  # the child: a loader worker
            code = 1
            try:
                with DatasetReader(index, store=prefetcher) as reader:
                    ids = np.arange(index.num_samples - 40, index.num_samples)
                    check_batch(reader.read_batch(ids), ids)
                code = 0 if prefetcher.scheduler is not parent_scheduler else 2
            finally:
                os._exit(code)
        with DatasetReader(index, store=prefetcher) as reader:
            ids = np.arange(0, 40)
            check_batch(reader.read_batch(ids), ids)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert prefetcher.scheduler is parent_scheduler
    assert set(shard_gets(fault_server).values()) == {1}


def test_the_interpreter_exits_cleanly_with_a_prefetcher_left_open(
        fault_server: FaultServer, tmp_path: Path) -> None:
    stall_every_shard(fault_server, serve_dataset(fault_server))
    fault_server.faults.configure(delay_s=300.0)  # stalls that outlast the timeout below
    script = (
        "import sys, time\n"
        "from streamcache import load_index\n"
        "from streamcache.cache.node import NodeCache\n"
        "from streamcache.cache.prefetch import Prefetcher\n"
        "index = load_index(sys.argv[1])\n"
        "p = Prefetcher(NodeCache(index, sys.argv[2]))\n"
        "p.update(list(range(6)), list(range(6)))\n"
        "time.sleep(0.5)\n"
        "print('leaving')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, fault_server.url_for("ds/index.json"),
                           str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "leaving" and "Traceback" not in done.stderr
    assert not any((tmp_path / "cache" / "tmp").iterdir())


def test_a_prefetcher_left_open_and_dropped_stops_its_threads(
        fault_server: FaultServer, tmp_path: Path) -> None:
    """A dataset dropped without close() kept its four download threads polling forever (a
    test session accumulated 1,240 of them, which starved the process). Now its prefetcher is
    collected and its threads end."""
    import gc
    import threading

    index = serve_dataset(fault_server)
    cache = NodeCache(index, str(tmp_path / "cache"))
    prefetcher = Prefetcher(cache, PrefetchOptions(workers=3, poll_s=0.05))
    prefetcher.update(list(range(4)), list(range(4)))
    wait_until_idle(prefetcher)  # the downloads ran
    assert all(cache.contains(shard) for shard in range(4))
    threads = list(prefetcher._threads)
    assert len(threads) == 3 and all(t.is_alive() for t in threads)
    del prefetcher, cache  # never closed (the cache holds the prefetcher's eviction listener)
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in threads), [t.name for t in threading.enumerate()]
