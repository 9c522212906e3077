"""Is the job input-bound? The counters behind ``StreamLoader.stats()``.

Per step the loader records the time the training loop waited inside ``next()`` for its
batch, whether that batch was ready when asked, how many batches were ready behind it
(the prefetch depth), the time reader threads spent reading and assembling batches, and the
time a transform took on the loop's thread. :meth:`StepCounters.snapshot` adds what this
process's reader counted: cache hits and misses, bytes fetched (whole shards and range
reads), the time readers waited for shards not installed yet, and the Fetcher's requests,
retries, stalls and failures.

A :class:`LoaderStats` is a snapshot: cumulative since the loader was made, so the
difference of two (:meth:`LoaderStats.since`) is what happened in between; ``metrics()``
flattens one into the numbers loggers take (see :mod:`streamcache.loading.stats_logger`).

Cost on the hot path: two clock reads and a few additions per step on the loop's thread;
two clock reads and an addition under an uncontended lock per step on a reader thread.

Thread safety: counters are written by the loop's thread and the loader's reader threads;
:meth:`StepCounters.snapshot` may be called from any thread at any time (also while the
loader closes) and returns a consistent-enough snapshot: each counter is read once.
Worker processes (``num_workers>0``) count their own reads, transforms, cache lookups and
downloads (:func:`worker_counters`) and send the totals with each batch; the snapshot adds each
worker process's latest totals.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

#: Counters whose difference is meaningful (everything but the "now" values).
_NOW_FIELDS = frozenset({"last_wait_s", "prefetch_depth", "prefetch_target", "workers"})


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """Where a loader's time and bytes went, cumulative since it was made.

    Attributes:
        steps: batches the training loop received.
        wait_s: seconds the loop spent inside ``next()`` waiting for them (the input's share
            of the loop's time; with a transform on the loop's thread, that too).
        last_wait_s: the last step's wait.
        ready_steps: steps whose batch was ready when the loop asked (no wait for reads).
        read_s: seconds reader threads (or worker processes) spent reading and assembling
            batches (shard waits included); more than the wall time when several read at once.
        transform_s: seconds transforms ran: on the loop's thread (part of ``wait_s``), or in
            the worker processes (``workers`` > 0).
        log_s: seconds spent in logger hooks (:meth:`StreamLoader.log_stats`).
        prefetch_depth: batches ready behind the one the loop took last.
        prefetch_target: batches the loader keeps in preparation (its ``prefetch``).
        workers: worker processes (their counters are added as their batches arrive), 0
            with threads.
        shard_wait_s: seconds readers were blocked on shards not installed yet (downloads).
        cache_hits, cache_misses: shard lookups in the node cache that found the shard
            installed, or had to wait for it.
        range_reads: shard reads served by range requests to the store (a cold start, or
            another node's shards) instead of from the cache.
        bytes_fetched: bytes downloaded from the store (whole shards and range reads).
        fetch_requests, fetch_retries, fetch_stalls, fetch_failures: the Fetcher's requests,
            attempts after a transient failure, attempts abandoned after ``timeout_s``
            without a byte, and objects given up on.
    """

    steps: int = 0
    wait_s: float = 0.0
    last_wait_s: float = 0.0
    ready_steps: int = 0
    read_s: float = 0.0
    transform_s: float = 0.0
    log_s: float = 0.0
    prefetch_depth: int = 0
    prefetch_target: int = 0
    workers: int = 0
    shard_wait_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    range_reads: int = 0
    bytes_fetched: int = 0
    fetch_requests: int = 0
    fetch_retries: int = 0
    fetch_stalls: int = 0
    fetch_failures: int = 0

    def since(self, earlier: LoaderStats) -> LoaderStats:
        """What happened between ``earlier`` and this snapshot (the "now" values, such as
        the prefetch depth, are this snapshot's)."""
        changes = {f.name: getattr(self, f.name) - getattr(earlier, f.name)
                   for f in dataclasses.fields(self) if f.name not in _NOW_FIELDS}
        return dataclasses.replace(self, **changes)

    @property
    def cache_hit_rate(self) -> float | None:
        """Hits over lookups, or None when there was no lookup."""
        lookups = self.cache_hits + self.cache_misses
        return self.cache_hits / lookups if lookups else None

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a logger: per step averages (milliseconds) and totals."""
        steps = max(1, self.steps)
        out = {"wait_ms_per_step": 1e3 * self.wait_s / steps}
        if not self.workers:  # worker processes count their reads where this cannot see
            out.update({
                "ready_fraction": self.ready_steps / steps,
                "prefetch_depth": float(self.prefetch_depth),
                "transform_ms_per_step": 1e3 * self.transform_s / steps,
                "read_ms_per_step": 1e3 * self.read_s / steps,
                "shard_wait_ms_per_step": 1e3 * self.shard_wait_s / steps,
            })
        out.update({
            "bytes_fetched": float(self.bytes_fetched),
            "range_reads": float(self.range_reads),
            "fetch_retries": float(self.fetch_retries),
            "fetch_stalls": float(self.fetch_stalls),
            "fetch_failures": float(self.fetch_failures),
            "steps": float(self.steps),
        })
        if self.cache_hit_rate is not None:
            out["cache_hit_rate"] = self.cache_hit_rate
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StepCounters:
    """The loader's running counters (one per :class:`StreamLoader`, across its passes)."""

    def __init__(self, prefetch_target: int, workers: int) -> None:
        self._lock = threading.Lock()  # reader threads add to read_s
        self.prefetch_target = prefetch_target
        self.workers = workers
        self.steps = 0
        self.wait_s = 0.0
        self.last_wait_s = 0.0
        self.ready_steps = 0
        self.read_s = 0.0
        self.transform_s = 0.0
        self.log_s = 0.0
        self.prefetch_depth = 0
        self._workers: dict[int, dict[str, Any]] = {}  # worker pid: its latest totals

    def received(self, waited_s: float) -> None:
        """The loop received a batch after waiting ``waited_s`` (the loop's thread)."""
        self.steps += 1
        self.wait_s += waited_s
        self.last_wait_s = waited_s

    def took(self, ready: bool, depth: int) -> None:
        """The loop took a batch that was (not) ready, with ``depth`` ready behind it."""
        self.ready_steps += ready
        self.prefetch_depth = depth

    def transformed(self, seconds: float) -> None:
        """A transform ran ``seconds`` on the loop's thread."""
        self.transform_s += seconds

    def read(self, seconds: float) -> None:
        """A reader thread spent ``seconds`` on one step."""
        with self._lock:
            self.read_s += seconds

    def worker(self, process: int, counters: dict[str, Any]) -> None:
        """Worker process ``process`` has counted ``counters`` so far (its latest totals)."""
        with self._lock:
            self._workers[process] = counters

    def snapshot(self, reader: Any) -> LoaderStats:
        """These counters and ``reader``'s (this process's reader, or None when none is
        open), read once each."""
        with self._lock:
            read_s = self.read_s
            workers = list(self._workers.values())
        counted: dict[str, Any] = dict(io_counters(reader))
        for totals in workers:
            for name, value in totals.items():
                counted[name] = counted.get(name, 0) + value
        read_s += counted.pop("read_s", 0.0)
        transform_s = self.transform_s + counted.pop("transform_s", 0.0)
        return LoaderStats(
            steps=self.steps, wait_s=self.wait_s, last_wait_s=self.last_wait_s,
            ready_steps=self.ready_steps, read_s=read_s, transform_s=transform_s,
            log_s=self.log_s, prefetch_depth=self.prefetch_depth,
            prefetch_target=self.prefetch_target, workers=self.workers, **counted,
        )


def open_reader(dataset: Any) -> Any:
    """The dataset's reader in this process if one is open, else None; never makes one
    (a snapshot must not open a cache and start download threads, nor reopen a closed
    loader's)."""
    feed = getattr(dataset, "_feed", None)
    lock = getattr(feed, "_lock", None)
    if lock is None:
        return None
    with lock:
        reader = getattr(feed, "_reader", None)
        return reader if getattr(feed, "_reader_pid", -1) == os.getpid() else None


def worker_counters(dataset: Any) -> dict[str, Any]:
    """What this (worker) process counted for ``dataset`` so far: the seconds its batches took
    to read and to transform, and its reader's cache, range-read and Fetcher counters."""
    read_s, transform_s = getattr(dataset, "work_seconds", (0.0, 0.0))
    return {"read_s": float(read_s), "transform_s": float(transform_s),
            **io_counters(open_reader(dataset))}


def io_counters(reader: Any) -> dict[str, Any]:
    """The cache, prefetch, range-read and Fetcher counters of ``reader`` (a DatasetReader or
    a mixture's reader); zeros for what it does not have."""
    if reader is None:
        return {}
    out: dict[str, Any] = {}
    store = getattr(reader, "store", None)
    scheduler = getattr(store, "stats", None)
    if scheduler is not None and hasattr(scheduler, "hits"):
        out.update(cache_hits=int(scheduler.hits), cache_misses=int(scheduler.misses),
                   shard_wait_s=float(scheduler.wait_s),
                   bytes_fetched=int(scheduler.bytes_fetched))
    readers = getattr(reader, "readers", None) or [reader]
    ranged = [r.range_stats for r in readers if hasattr(r, "range_stats")]
    out["bytes_fetched"] = out.get("bytes_fetched", 0) + sum(int(r.bytes) for r in ranged)
    out["range_reads"] = sum(int(r.shards) for r in ranged)
    fetcher_stats = _fetcher_stats(store)
    if fetcher_stats is not None:
        out.update(fetch_requests=int(fetcher_stats.requests),
                   fetch_retries=int(fetcher_stats.retries),
                   fetch_stalls=int(getattr(fetcher_stats, "stalls", 0)),
                   fetch_failures=int(fetcher_stats.failures))
    return out


def _fetcher_stats(store: Any) -> Any:
    try:
        return store.fetcher.stats
    except Exception:  # no store, or one without a Fetcher (local shards read in place)
        return None


__all__ = ["LoaderStats", "StepCounters", "io_counters", "open_reader", "worker_counters"]
