"""The prefetcher: keeps the next shards of the plan in flight so the reader rarely waits.

Policy (here, in Python): from the plan's upcoming shards in first-use order, take the
prefix that fits the lookahead limits (shards and bytes) and submit it to the native
:class:`~streamcache._native_scheduler.Scheduler` with the first-use position as priority;
cancel what fell out of that prefix; tell the cache where each shard is read next, for
eviction.

Mechanism (in C++): the priority queue, the in-flight byte budget, the shard states, the
blocking ``next_task`` of the download threads and the blocking ``wait`` of readers, with
the GIL released, plus the counters. The download threads themselves are Python threads,
because a download is fsspec (Python) code: see docs/cache.md.

:class:`ShardUsage` is the plain data the prefetcher takes from a plan (first and last
position of every shard; ``streamcache.cache.advice.shard_usage`` scans an order for it), so
neither the cache nor the prefetcher imports the plan.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import forksafe
from .._native_scheduler import (
    SHARD_FAILED,
    SHARD_READY,
    SHARD_UNKNOWN,
    TASK_STOPPED,
    TASK_TIMEOUT,
    WAIT_FAILED,
    WAIT_NOT_SCHEDULED,
    WAIT_READY,
    WAIT_STOPPED,
    Scheduler,
    SchedulerCounters,
)
from ..errors import PrefetchError
from ..remote.fetch import Fetcher
from .downloads import HeldDownloads
from .node import NodeCache
from .prefetch_options import DEFAULT_LOOKAHEAD_SHARDS, PrefetchOptions
from .usage import ShardUsage

#: Priority of a shard a reader is blocked on: ahead of every plan position.
URGENT = -1
#: The longest a cold reader may hold the downloads back (:meth:`Prefetcher.hold`).
HOLD_S = 5.0
#: The prefetcher's counters (hits and misses count ``local_path`` calls): the native
#: scheduler's snapshot, its ``wait_s`` with the readers' waits for an install's offer added.
PrefetchStats = SchedulerCounters


#: updates between two checks of every upcoming shard's file (see Prefetcher.update)
_FULL_CHECK_EVERY = 16


class Prefetcher:
    """A :class:`NodeCache` with download threads that stay ahead of the reader.

    A ShardStore: ``DatasetReader(index, store=Prefetcher(cache))``. The loader calls
    :meth:`update` as its cursor moves; :meth:`local_path` returns a
    shard, waiting (GIL released) only when it is not installed yet.

    Owns: ``options.workers`` named daemon threads (``streamcache-prefetch-*``), started on
    first use, and the cache: :meth:`close` stops the threads and closes the cache.
    Thread safety: every method may be called from any thread. Fork: a child process gets a
    new scheduler and new threads on first use; the parent's are never touched.
    """

    def __init__(self, cache: NodeCache, options: PrefetchOptions | None = None) -> None:
        self.cache = cache
        self.options = options or PrefetchOptions()
        self._closed = False
        self._held: HeldDownloads[bytes] = HeldDownloads()  # stored bytes being decoded
        self._finished: HeldDownloads[str] = HeldDownloads()  # files being made durable
        self._reset_process_state()
        cache.add_eviction_listener(self._evicted)
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        _abandoned.append(self._scheduler)
        if self._finalizer is not None:
            self._finalizer.detach()  # it would stop the parent's scheduler, unusable here
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self._open = threading.Event()  # set: download threads may start downloads
        self._open.set()
        self._held_until = 0.0
        self._lock = threading.Lock()
        self._scheduler = Scheduler(self.options.inflight_bytes)
        self._threads: list[threading.Thread] = []
        self._queued: set[int] = set()
        self._known_ready: set[int] = set()  # installed when update last checked
        self._checks_left = 0
        self._errors: dict[int, BaseException] = {}
        self._pid = os.getpid()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._offer_wait_s = 0.0  # readers' waits for an install's offer (not the scheduler's)

    # ------------------------------------------------------------------ policy

    def update(self, shards: Sequence[int] | np.ndarray,
               positions: Sequence[int] | np.ndarray) -> None:
        """The upcoming shards in first-use order and their next-use positions, from the
        cursor on (e.g. ``ShardUsage.upcoming`` or ``EpochOrder.shard_first_use``)."""
        shards = np.asarray(shards, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        next_use = dict(zip(shards.tolist(), positions.tolist(), strict=True))
        self.cache.set_next_use(lambda shard: next_use.get(shard, math.inf))
        chosen = self._lookahead(shards.tolist())
        with self._lock:
            self._start()
            scheduler = self._scheduler
            queued = set(chosen)
            for shard in self._queued - queued:
                scheduler.cancel(shard)
            # Shards found installed stay so unless evicted: by this process (the listener
            # forgets them) or by another one, which a reader finds out when it opens the
            # shard, and so does the full check every _FULL_CHECK_EVERY updates. A step
            # of a batch over 16 shards checked each of them every step: 60 us.
            self._checks_left -= 1
            if self._checks_left <= 0:
                self._checks_left = _FULL_CHECK_EVERY
                self._known_ready = set()
            known = self._known_ready
            for shard in chosen:
                if shard in known:
                    continue
                state = scheduler.state(shard)
                if self.cache.contains(shard):
                    scheduler.mark_ready(shard)
                    known.add(shard)
                elif state != SHARD_FAILED:  # a failed shard is retried only by a reader
                    if state == SHARD_READY:
                        scheduler.forget(shard)  # evicted by another process
                    scheduler.submit(shard, next_use[shard], self._stored_bytes(shard))
            self._queued = queued

    def _lookahead(self, upcoming: list[int]) -> list[int]:
        limit = self.options.lookahead_bytes
        if limit is None:
            limit = self.cache.cache_limit
        budget = math.inf if limit is None else float(limit)
        chosen: list[int] = []
        used = 0
        for shard in upcoming[: self.options.lookahead()]:
            used += self.cache.estimated_bytes(shard)
            if chosen and used > budget:
                break
            chosen.append(shard)
        return chosen

    # ------------------------------------------------------------------ the store

    def local_path(self, shard: int) -> str:
        """The installed shard; blocks (GIL released) until a download thread installs it.

        Raises:
            The download's own error (FetchError, ChecksumMismatchError, ...) with its type.
            PrefetchError: the prefetcher was closed while waiting.
        """
        return self._path(shard, finished=False)

    def readable_path(self, shard: int) -> str:
        """A file holding the installed shard's bytes, for a reader to map: :meth:`local_path`,
        or, where this process installs the shard, its finished file (in this process's
        temporaries) as soon as it is written, while the install fsyncs it before publishing
        it. The file keeps its inode when published; its path does not (a reader that checks
        the path finds it gone and opens the installed one). Raises as :meth:`local_path`."""
        return self._path(shard, finished=True)

    def _path(self, shard: int, *, finished: bool) -> str:
        with self._lock:
            self._start()
            scheduler = self._scheduler
        path = self.cache.lookup(shard)
        if path is not None:
            scheduler.note_hit()
            scheduler.mark_ready(shard)
            return path
        self._demand(scheduler, shard)
        count = True
        if finished:
            code, _ = scheduler.wait(shard, 0.0, count_access=True)  # (counts the miss)
            count = False
            if code != WAIT_READY:  # this process installs it: its file, once written
                written = self._offered(self._finished, scheduler, shard)
                if written is not None:
                    return written
        while True:
            code, message = scheduler.wait(shard, self.options.poll_s, count_access=count)
            count = False
            if code == WAIT_READY:
                path = self.cache.lookup(shard)
                if path is not None:
                    return path
                scheduler.forget(shard)  # evicted between install and now: once more
            elif code == WAIT_FAILED:
                error = self._errors.get(shard)
                raise error if error is not None else PrefetchError(message)
            elif code == WAIT_STOPPED:
                raise PrefetchError(f"the prefetcher was closed while shard {shard} was awaited")
            if code in (WAIT_READY, WAIT_NOT_SCHEDULED):
                scheduler.submit(shard, URGENT, self._stored_bytes(shard))

    def downloaded(self, shard: int) -> bytes | None:
        """The stored bytes of ``shard`` (downloaded and verified) while this process's
        install decodes them, for a reader that would otherwise wait for the decode: starts
        the install at once as :meth:`local_path` does, and waits until the bytes are held.
        None once the shard is installed, its install failed or nobody installs it: the
        reader then opens it with :meth:`local_path` (which raises the install's error).
        Only a shard whose install holds its bytes in memory is offered (a compressed shard
        of at most ``install.MEMORY_INSTALL_BYTES``); any other returns None at its install."""
        if self.ready(shard):
            return None
        with self._lock:
            self._start()
            scheduler = self._scheduler
        self._demand(scheduler, shard)
        return self._offered(self._held, scheduler, shard)

    def _offered(self, offers: HeldDownloads[Any], scheduler: Scheduler, shard: int) -> Any:
        """What this process's install of ``shard`` offers, once offered; None once the
        shard is installed, its install failed or nothing installs it. The wait counts in
        :attr:`stats` ``wait_s``, as the scheduler's waits do."""

        def settled() -> bool:
            state = scheduler.state(shard)
            return state in (SHARD_READY, SHARD_FAILED, SHARD_UNKNOWN) or scheduler.stopped()

        started = time.perf_counter()
        try:
            return offers.wait(shard, settled, self.options.poll_s)
        finally:
            waited = time.perf_counter() - started
            with self._lock:
                self._offer_wait_s += waited

    def _demand(self, scheduler: Scheduler, shard: int) -> None:
        """A reader waits for ``shard``: the hold ends and the shard is installed next."""
        self.release()  # a reader waits for a download: nothing is held any more
        self._known_ready.discard(shard)
        scheduler.forget(shard)  # it may be marked ready but gone: evicted by another process
        scheduler.submit(shard, URGENT, self._stored_bytes(shard))

    def hold(self, timeout_s: float | None = None) -> None:
        """Start no new download for a while: a cold reader reads its first steps by range
        first, with every connection and core to itself, then calls :meth:`release`. A
        reader that blocks on a shard (:meth:`local_path`) releases at once, and the hold
        ends by itself after ``timeout_s`` (default :data:`HOLD_S`). Downloads in flight go
        on."""
        with self._lock:
            self._held_until = time.monotonic() + (HOLD_S if timeout_s is None else timeout_s)
            self._open.clear()

    def release(self) -> None:
        """End a :meth:`hold` (no-op when there is none)."""
        self._open.set()

    def ready(self, shard: int) -> bool:
        """Whether ``shard`` is installed now (non-blocking; no request is made): a reader
        may read it from the cache without waiting. A reader that finds it not ready may
        read the rows it needs by range instead (cache/ranges.py) and let the download
        threads install it in first-use order."""
        return self.cache.installed(shard)

    def copy_of(self, shard: int) -> str | None:
        """What an installed file of ``shard`` must record it is a copy of (the cache's)."""
        return self.cache.copy_of(shard)

    @property
    def fetcher(self) -> Fetcher:
        """The cache's Fetcher (range reads share its concurrency bound and options)."""
        return self.cache.fetcher

    @property
    def stats(self) -> PrefetchStats:
        counters = self._scheduler.counters()
        with self._lock:
            offer_wait_s = self._offer_wait_s
        return dataclasses.replace(counters, wait_s=counters.wait_s + offer_wait_s)

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def close(self) -> None:
        """Stop the threads and close the cache; returns within about ``poll_s + 2`` s.

        Downloads waiting for a slot or a retry fail at once (the Fetcher is closed), and
        so do remote reads in flight, stalled ones included (the Fetcher cancels them); a
        read of a local file ends with its current block.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads, self._threads = self._threads, []
        self._scheduler.stop()
        self._open.set()
        self.cache.close()
        self._join(threads, self.options.poll_s + 2.0)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ threads

    def _start(self) -> None:
        """Start the download threads if this process has none yet (lock held)."""
        if self._closed:
            raise PrefetchError("the prefetcher is closed")
        if self._threads:
            return
        # A prefetcher that nobody closes (its dataset dropped) is still collected: the threads
        # hold it only while they install a shard, and collecting it stops them.
        self._finalizer = weakref.finalize(self, _stop, self._scheduler, self._open)
        for number in range(self.options.workers):
            thread = threading.Thread(target=_download_loop,
                                      args=(weakref.ref(self), self._scheduler),
                                      name=f"streamcache-prefetch-{number}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _install(self, shard: int, scheduler: Scheduler) -> None:
        """Install ``shard`` for a download thread and tell the scheduler how it went."""
        try:
            fetched = self.cache.install(
                shard, lambda data: self._held.offer(shard, data),
                lambda path: self._finished.done(shard) if path is None
                else self._finished.offer(shard, path))
        except Exception as error:  # carried to the reader that waits for this shard
            self._errors[shard] = error
            scheduler.complete(shard, False, 0, f"{type(error).__name__}: {error}")
        else:
            self._errors.pop(shard, None)
            scheduler.complete(shard, True, fetched, "")
        finally:
            self._held.done(shard)  # (after complete: a waiter looks at the state again)
            self._finished.done(shard)

    def _evicted(self, shard: int, nbytes: int) -> None:
        self._known_ready.discard(shard)
        self._scheduler.forget(shard, nbytes)

    def _stored_bytes(self, shard: int) -> int:
        return int(self.cache.index.shards[shard].bytes)

    @staticmethod
    def _join(threads: list[threading.Thread], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


def _download_loop(ref: weakref.ReferenceType[Prefetcher], scheduler: Scheduler) -> None:
    """A download thread: take the scheduler's next shard and install it, until stopped.

    It holds its prefetcher (``ref``) only to read its settings and to install a shard, never
    while it blocks, so that a prefetcher left open is collected (and stops its threads).
    """
    while True:
        prefetcher = ref()
        if prefetcher is None:
            return
        opened, poll_s = prefetcher._open, prefetcher.options.poll_s
        held_s = 0.0
        if not opened.is_set():  # held by a cold reader (bounded: see hold())
            held_s = prefetcher._held_until - time.monotonic()
            if held_s <= 0:
                opened.set()
        del prefetcher
        if held_s > 0:
            opened.wait(min(held_s, poll_s))
            if scheduler.stopped():
                return
            continue
        shard = scheduler.next_task(poll_s)
        if shard == TASK_STOPPED:
            return
        if shard == TASK_TIMEOUT:
            continue
        prefetcher = ref()
        if prefetcher is None:
            scheduler.complete(shard, False, 0, "the prefetcher was closed")
            return
        prefetcher._install(shard, scheduler)
        del prefetcher


def _stop(scheduler: Scheduler, opened: threading.Event) -> None:
    """What collecting a prefetcher left open does: its download threads end."""
    scheduler.stop()
    opened.set()


# Schedulers a forked child inherited: never used there (a parent's thread may have held their
# mutex at fork time) and never destroyed (destroying a locked mutex is undefined).
_abandoned: list[Scheduler] = []


def _close_all() -> None:
    for prefetcher in forksafe.live(Prefetcher):
        if prefetcher._pid == os.getpid():
            prefetcher.close()


atexit.register(_close_all)

__all__ = ["DEFAULT_LOOKAHEAD_SHARDS", "URGENT", "PrefetchOptions", "PrefetchStats", "Prefetcher",
           "ShardUsage"]
