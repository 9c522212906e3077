"""One pass over a StreamLoader: its batches from the reader threads or the worker
processes, and the dataset's cursor moved as the training loop receives them."""

from __future__ import annotations

import multiprocessing.context
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from .dataset import StreamDataset
from .stats import StepCounters
from .stats_logger import StatsLogger
from .thread_batches import ThreadBatches
from .worker_batches import WorkerBatches

BatchSource = ThreadBatches | WorkerBatches


class PassOwner(Protocol):
    """What a pass reads of its loader (:class:`~streamcache.loading.loader.StreamLoader`),
    when it opens and as it goes."""

    @property
    def dataset(self) -> StreamDataset: ...
    @property
    def counters(self) -> StepCounters: ...
    @property
    def stats_loggers(self) -> list[StatsLogger]: ...
    @property
    def uses_processes(self) -> bool: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def prefetch(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def pin_memory(self) -> bool: ...
    @property
    def timeout(self) -> float: ...
    @property
    def multiprocessing_context(self) -> str | multiprocessing.context.BaseContext | None: ...


class LoaderPass:
    """One pass over the loader; moves the dataset's cursor as batches are received.

    An iteration dropped without :meth:`close` (a ``break``, then the iterator collected)
    only *signals* its reader threads to start no more reads (a finalizer; they end by
    themselves after the read in hand); nothing joins them there. A finalizer runs on
    whichever thread the garbage collector interrupts, possibly one those threads wait on
    (fsspec's I/O thread, another loader's reader): a join there could deadlock the process.
    Worker processes are shut down by torch's own iterator when it is collected.
    """

    def __init__(self, loader: PassOwner, hold: Callable[[BatchSource], None]) -> None:
        """``hold(source)`` is called with each source the pass opens (the loader keeps the
        last one, to wait for it on close)."""
        self._loader = loader
        self._hold = hold
        self._done = False
        self._abandon: weakref.finalize | None = None
        self._open()

    def _open(self) -> None:
        """Start reading from the dataset's cursor (a pass starts, or the cursor was replaced)."""
        loader = self._loader
        dataset = loader.dataset
        self._schedule = dataset.schedule()
        self._steps = 0
        self._moved = False
        self._source: BatchSource
        if self._abandon is not None:
            self._abandon.detach()
            self._abandon = None
        if not loader.uses_processes:
            self._source = ThreadBatches(dataset, self._schedule, loader.prefetch,
                                         loader.threads, loader.pin_memory, loader.counters)
            self._abandon = weakref.finalize(self, self._source.stop)
        else:
            self._source = WorkerBatches(
                dataset, self._schedule, num_workers=loader.num_workers,
                prefetch=loader.prefetch, timeout=loader.timeout,
                multiprocessing_context=loader.multiprocessing_context,
                pin=loader.pin_memory, counters=loader.counters)
        self._hold(self._source)

    def __iter__(self) -> LoaderPass:
        return self

    @property
    def done(self) -> bool:
        return self._done

    def moved(self) -> None:
        """The dataset's cursor was replaced (``load_state_dict`` during the pass): stop the
        reads ahead now; the next batch comes from the new cursor."""
        self._close_source()
        self._moved = True

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._moved:
            self._open()
        counters = self._loader.counters
        started = time.perf_counter()
        try:
            batch = next(self._source)
        except StopIteration:
            self._finish()
            raise
        except BaseException as error:
            if not isinstance(error, Exception):
                self._interrupt()
            self.close()
            raise
        counters.received(time.perf_counter() - started)
        self._steps += 1
        self._loader.dataset.cursor = self._schedule.cursor_after(self._steps)
        for logger in self._loader.stats_loggers:
            logger.step(counters.steps)
        return batch

    def _interrupt(self) -> None:
        """Ctrl-C (or another BaseException) in the loop: start no more reads, then close
        the dataset's reader, whose downloads, stalled ones included, end at once, so that
        close() does not wait for them."""
        stop = getattr(self._source, "stop", None)
        if stop is not None:
            stop()
        self._loader.dataset.close()

    def _finish(self) -> None:
        # The epoch's steps are all consumed (or there were none): the cursor moves to the
        # start of the next epoch even when the last step was never yielded (an empty tail).
        if not self._schedule.infinite:
            self._loader.dataset.cursor = self._schedule.cursor_after(
                self._schedule.first.num_steps)
        self.close()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._close_source()

    def _close_source(self) -> None:
        if self._abandon is not None:
            self._abandon.detach()
            self._abandon = None
        closer = getattr(self._source, "close", None)
        if closer is not None:
            closer()
        shutdown = getattr(self._source, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
