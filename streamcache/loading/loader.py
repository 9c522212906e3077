"""StreamLoader: a DataLoader drop-in with an exact, elastic ``state_dict``.

Two modes:

- ``num_workers=0`` (default): no worker processes. A small pool of native-backed threads
  reads and assembles the next ``prefetch`` steps while the training loop works (the gather
  releases the GIL); a transform, if any, runs on the consumer thread so that seeding the
  global RNGs for it cannot race.
- ``num_workers>0``: worker processes (torch's DataLoader machinery) for heavy Python
  transforms; worker k produces the steps ``t % num_workers == k`` and batches arrive in step
  order.

The loader counts a step as consumed when the training loop receives its batch; its state is
the plan's cursor, identical on every rank, and loading it on another world size, worker count
or batch size continues the epoch exactly.
"""

from __future__ import annotations

import collections
import multiprocessing.context
import numbers
import os
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import CancelledError
from typing import Any, Literal, get_args

import torch
from torch.utils.data import DataLoader

from ..errors import ConfigError
from ..format.buffers import BufferPool
from ..format.reader import gather_into
from ..plan import Cursor, CursorMismatchError, RankBatch
from ..plan._util import check_state
from ..plan.bijection import derive_key
from ..plan.mixture_cursor import MixtureCursor
from .dataset import StreamDataset
from .schedule import Schedule, StepRef
from .shared_batches import SharedBatchDataset, SlotReader, WorkerBatch
from .stats import LoaderStats, StepCounters, open_reader
from .stats_logger import StatsLogger, metrics_sink

STATE_VERSION = 1
WorkerMode = Literal["auto", "process", "thread"]
WORKER_MODES: tuple[WorkerMode, ...] = get_args(WorkerMode)
KEY_VERSION = "version"
KEY_CURSOR = "cursor"
_WORKER_SEED_TAG = 0x574B_5253  # distinguishes worker base seeds from every other derived key


def worker_generator(cursor: Cursor | MixtureCursor) -> torch.Generator:
    """The generator a pass's DataLoader draws its workers' base seed from.

    Seeded from the plan (seed, epoch, samples consumed), so starting worker processes draws
    nothing from the training loop's torch RNG: the loop's random stream continues exactly
    after a resume, and a pass's workers are seeded the same in a rerun.
    """
    key = derive_key(cursor.seed, cursor.epoch, cursor.samples_consumed, _WORKER_SEED_TAG)
    return torch.Generator().manual_seed(key % (1 << 63))


class _Producer:
    """One reader thread: the steps ``t % threads == index`` of a pass, in order, read (and
    made into batches, without a transform) at most ``depth`` ahead of the loop."""

    _END = object()

    def __init__(self, owner: _NativeBatches, index: int, threads: int,
                 schedule: Schedule) -> None:
        self._owner = owner
        self._steps = owner.dataset.planned(index, threads, schedule)
        self._ready: collections.deque[Any] = collections.deque()  # batches, errors, _END
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"streamcache-loader-{index}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        owner = self._owner
        try:
            for ref, part in self._steps:
                with self._changed:
                    self._changed.wait_for(
                        lambda: owner.stopped or len(self._ready) < owner.depth)
                    if owner.stopped:  # interrupted: no read may start (it opens a reader)
                        self._ready.append(_Failed(CancelledError("the loader was interrupted")))
                        return
                self._put(owner.work(ref, part))
            self._put(self._END)
        except BaseException as error:  # the loop raises it, with its type
            self._put(_Failed(error))

    def _put(self, item: Any) -> None:
        with self._changed:
            self._ready.append(item)
            self._changed.notify_all()

    def take(self) -> tuple[Any, bool, int]:
        """The next batch (raising what the read raised; StopIteration after the last),
        whether it was ready when asked, and how many more are ready behind it."""
        with self._changed:
            ready = bool(self._ready)
            self._changed.wait_for(lambda: bool(self._ready))
            item = self._ready[0]
            if item is self._END:  # (left in place: the thread has ended, so do later takes)
                raise StopIteration
            if isinstance(item, _Failed):
                raise item.error
            self._ready.popleft()
            self._changed.notify_all()
            return item, ready, len(self._ready)

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def join(self) -> None:
        self._thread.join()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _NativeBatches:
    """Steps of a schedule read by ``threads`` reader threads, each at most ``depth`` steps
    ahead of the loop, delivered in order (step ``t`` comes from thread ``t % threads``).

    Each thread plans and reads its own steps: one hand-over per step, from the thread that
    made the batch to the loop (a pool of per-step tasks cost two hand-overs, a future and a
    task each, and ran the plan on the loop's thread: 1.3-1.9 times the CPU of reading the
    steps inline, measured on 1 KB samples).
    """

    def __init__(self, dataset: StreamDataset, schedule: Schedule, depth: int, threads: int,
                 pin: bool, counters: StepCounters) -> None:
        self.dataset = dataset
        threads = max(1, threads)
        self.depth = max(1, -(-depth // threads))  # ready batches per thread: ~depth in all
        self.stopped = False
        self._counters = counters
        self._pin = pin
        self._closed = False
        self._next = 0
        self._producers = [_Producer(self, index, threads, schedule)
                           for index in range(threads)]

    def work(self, ref: StepRef, part: RankBatch) -> Any:
        """One step's arrays (with a transform: finished on the loop's thread) or batch."""
        started = time.perf_counter()
        if self._pin:  # gathered straight into page-locked buffers: pinned with no copy
            with gather_into(pinned_pool()):
                arrays = self.dataset.read_step(ref, part)
        else:
            arrays = self.dataset.read_step(ref, part)
        if self.dataset.transformed:
            self._counters.read(time.perf_counter() - started)
            return _Arrays(ref, arrays)
        batch = self.dataset.finish_step(ref, arrays)
        batch = _pinned(batch) if self._pin else batch
        self._counters.read(time.perf_counter() - started)
        return batch

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        producer = self._producers[self._next % len(self._producers)]
        result, ready, behind = producer.take()
        self._next += 1
        self._counters.took(ready, behind)
        if isinstance(result, _Arrays):
            started = time.perf_counter()
            batch = self.dataset.finish_step(result.ref, result.arrays)
            self._counters.transformed(time.perf_counter() - started)
            return _pinned(batch) if self._pin else batch
        return result

    def stop(self) -> None:
        """Start no more reads; reads already running end with their reader (close() waits)."""
        self.stopped = True
        for producer in self._producers:
            producer.wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        for producer in self._producers:
            producer.join()


class _Arrays:
    """A step's arrays, read ahead, to be transformed on the loop's thread."""

    __slots__ = ("arrays", "ref")

    def __init__(self, ref: StepRef, arrays: dict[str, Any]) -> None:
        self.ref = ref
        self.arrays = arrays


# multiprocessing's socket for passing file descriptors: <tmp>/pymp-XXXXXXXX/listener-XXXXXXXX
_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
_SUN_PATH = 108  # bytes of sockaddr_un.sun_path on Linux (CPython refuses longer paths)


def check_socket_folder() -> None:
    """Refuse worker processes that could not hand their batches over.

    With torch's default sharing strategy (``file_descriptor``) a worker passes its shared
    memory to the loop over a Unix socket that multiprocessing makes in the temporary
    folder. When ``TMPDIR`` is too long for a socket path, that fails in the worker's queue
    thread, which only prints it: the batch never arrives and the loop waits forever.
    """
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    folder = tempfile.gettempdir()
    if len(os.fsencode(folder)) + _SOCKET_SUFFIX > _SUN_PATH:
        raise ConfigError(
            f"worker processes cannot hand batches to the training loop: the temporary folder "
            f"{folder} ({len(os.fsencode(folder))} bytes) is too long for the Unix socket "
            f"torch passes shared memory through (at most {_SUN_PATH - _SOCKET_SUFFIX} bytes); "
            "set TMPDIR to a shorter folder, or call "
            "torch.multiprocessing.set_sharing_strategy('file_system'), or use num_workers=0")


class _WorkerBatches:
    """Steps made by worker processes (torch's DataLoader machinery), in step order; their
    tensors arrive in shared slots set up once per worker (:mod:`.shared_batches`)."""

    def __init__(self, loader: StreamLoader, schedule: Schedule) -> None:
        check_socket_folder()
        self._pin = loader.pin_memory
        self._counters = loader.counters
        self._slots = SlotReader()
        torch_loader = DataLoader(
            SharedBatchDataset(loader.dataset, slots=loader.prefetch + 3), batch_size=None,
            num_workers=loader.num_workers, prefetch_factor=loader.prefetch,
            persistent_workers=False, timeout=loader.timeout,
            multiprocessing_context=loader.multiprocessing_context,
            generator=worker_generator(schedule.cursor),
        )
        self._batches = iter(torch_loader)

    def __next__(self) -> Any:
        item = next(self._batches)
        if isinstance(item, WorkerBatch):  # (and the worker's counters so far)
            self._counters.worker(item.process, item.counters)
            item = item.batch
        batch = self._slots.unpack(item)
        return _pinned(batch) if self._pin else batch

    def close(self) -> None:
        shutdown = getattr(self._batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._slots.forget()


_pinned_pool: BufferPool | None = None


def pinned_pool() -> BufferPool:
    """The gather's pool of page-locked (pinned) buffers (needs CUDA), made on first use."""
    global _pinned_pool
    if _pinned_pool is None:
        _pinned_pool = BufferPool(min_bytes=0, allocate=_page_locked)
    return _pinned_pool


def _page_locked(nbytes: int) -> Any:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def _pinned(batch: Any) -> Any:
    """``batch`` with every tensor in page-locked memory (``pin_memory()`` returns a tensor
    that already is, such as one gathered into :func:`pinned_pool`, as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pinned(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pinned(v) for v in batch)
    return batch


class _LoaderIterator:
    """One pass over the loader; moves the dataset's cursor as batches are received.

    An iteration dropped without :meth:`close` (a ``break``, then the iterator collected)
    only *signals* its reader threads to start no more reads (a finalizer; they end by
    themselves after the read in hand); nothing joins them there. A finalizer runs on
    whichever thread the garbage collector interrupts, possibly one those threads wait on
    (fsspec's I/O thread, another loader's reader): a join there could deadlock the process.
    Worker processes are shut down by torch's own iterator when it is collected.
    """

    def __init__(self, loader: StreamLoader) -> None:
        self._loader = loader
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
        self._source: Any
        if self._abandon is not None:
            self._abandon.detach()
            self._abandon = None
        if not loader.uses_processes:
            self._source = _NativeBatches(dataset, self._schedule, loader.prefetch,
                                          loader.threads, loader.pin_memory, loader.counters)
            self._abandon = weakref.finalize(self, self._source.stop)
        else:
            self._source = _WorkerBatches(loader, self._schedule)
        loader._source = self._source

    def __iter__(self) -> _LoaderIterator:
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



def _check_options(*, num_workers: int, prefetch: int, threads: int, worker_mode: str,
                   timeout: float, pin_memory: bool) -> None:
    """Refuse a StreamLoader option that cannot work, naming it and what it accepts."""
    for name, value, minimum in (("num_workers", num_workers, 0), ("prefetch", prefetch, 1),
                                 ("threads", threads, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
                value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not isinstance(pin_memory, bool):
        raise ConfigError(f"pin_memory must be True or False, got {pin_memory!r}")
    if worker_mode not in WORKER_MODES:
        raise ConfigError(f"worker_mode must be one of {', '.join(map(repr, WORKER_MODES))}; "
                          f"got {worker_mode!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout < 0:
        raise ConfigError(f"timeout must be a number of seconds >= 0, got {timeout!r}")


class StreamLoader:
    """Iterate a :class:`StreamDataset` the way a training loop iterates a DataLoader.

    Args:
        dataset: the :class:`StreamDataset` (it decides batch size, order, rank).
        num_workers: 0 for native threads, >0 for worker processes (heavy transforms).
        worker_mode: ``"auto"`` (default): worker processes only when the dataset has a
            transform; without one, processes add only the cost of moving every batch
            between processes, so ``num_workers`` native threads read instead.
            ``"process"`` or ``"thread"`` force one or the other.
        pin_memory: pin batches in page-locked memory (needs CUDA; a warning otherwise).
        prefetch: steps prepared ahead (per worker with worker processes).
        threads: reader threads with ``num_workers=0``.
        timeout, multiprocessing_context: as DataLoader's, for worker processes
            (``timeout`` >= 0 seconds, 0: wait forever; a start method name such as
            ``"spawn"`` or a context).

    Raises:
        TypeError: ``dataset`` is not a :class:`StreamDataset`.
        ConfigError: an option's value is invalid (the message names it and the values it
            accepts).

    Iterating again continues from the cursor: after a complete epoch that is the next epoch,
    after a ``break`` it is the rest of the current one. ``state_dict()`` is small,
    JSON-able, versioned and the same on every rank; ``load_state_dict`` is strict.

    Thread safety: one training loop iterates a loader at a time.
    """

    # The state is global (JSON-able, the same on every rank): the Checkpointer saves it once.
    global_state = True

    def __init__(self, dataset: StreamDataset, *, num_workers: int = 0,
                 pin_memory: bool = False, prefetch: int = 2, threads: int = 2,
                 worker_mode: WorkerMode = "auto", timeout: float = 0,
                 multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
                 ) -> None:
        if not isinstance(dataset, StreamDataset):
            raise TypeError("StreamLoader takes a StreamDataset")
        _check_options(num_workers=num_workers, prefetch=prefetch, threads=threads,
                       worker_mode=worker_mode, timeout=timeout, pin_memory=pin_memory)
        self.dataset = dataset
        self.num_workers = num_workers
        self.worker_mode = worker_mode
        self.uses_processes = num_workers > 0 and (
            worker_mode == "process" or (worker_mode == "auto" and dataset.transformed))
        if num_workers > 0 and not self.uses_processes:
            threads = max(threads, num_workers)
        self.prefetch = prefetch
        self.threads = threads
        self.timeout = timeout
        self.multiprocessing_context = multiprocessing_context
        self.pin_memory = pin_memory and self._can_pin()
        self._active: weakref.ref[_LoaderIterator] | None = None
        # the last iteration's readers (or workers), held strongly: the iterator does not
        # refer to them back, so no cycle; close() waits for them
        self._source: _NativeBatches | _WorkerBatches | None = None
        self._lock = threading.Lock()
        self.counters = StepCounters(prefetch, num_workers if self.uses_processes else 0)
        self.stats_loggers: list[StatsLogger] = []

    @staticmethod
    def _can_pin() -> bool:
        if torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True but no CUDA device is available: batches are not "
                      "pinned", stacklevel=3)
        return False

    @property
    def batch_size(self) -> int:
        """Samples per rank in a full step."""
        return self.dataset.global_batch // self.dataset.world_size

    def __iter__(self) -> Iterator[Any]:
        with self._lock:
            self._close_iteration()
            iterator = _LoaderIterator(self)
            # held weakly: an iteration the loop dropped is collected at once (its readers
            # told to stop), not kept alive by the loader until a cycle collection
            self._active = weakref.ref(iterator)
            return iterator

    def _current(self) -> _LoaderIterator | None:
        """The active iteration, while someone still holds it."""
        return self._active() if self._active is not None else None

    def __len__(self) -> int:
        """Steps in a whole epoch, as a DataLoader's ``len``: also during and after a
        mid-epoch resume (trainers count epochs with it; Lightning does). The steps left in
        the current epoch are :attr:`steps_remaining`.

        Raises:
            TypeError: an infinite loader has no length.
        """
        if self.dataset.options.infinite:
            raise TypeError("an infinite StreamLoader has no length")
        return len(self.dataset)

    @property
    def steps_remaining(self) -> int:
        """Steps left in the cursor's epoch: ``len(loader)`` at its start, fewer after a
        mid-epoch resume or during a pass (the cursor moves as batches are received)."""
        return self.dataset.steps_remaining

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration (as DistributedSampler);
        setting the epoch the cursor is in keeps the cursor, so ``set_epoch`` before every
        epoch also works right after a mid-epoch resume."""
        self._close_active()
        self.dataset.set_epoch(epoch)

    @property
    def cursor(self) -> Cursor | MixtureCursor:
        return self.dataset.cursor

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from: 0 for a fresh loader, the saved epoch after
        ``load_state_dict`` (the next one when the state was taken after an epoch's last
        batch). A training loop that counts epochs starts there, so that a resumed job trains
        as many epochs in all as an uninterrupted one::

            for epoch in range(loader.epoch, 10):
                for batch in loader:
                    ...

        During a pass it moves as batches are received (after an epoch's last batch it is
        the next epoch)."""
        return int(self.dataset.cursor.epoch)

    def stats(self) -> LoaderStats:
        """Where this loader's time and bytes went so far: the loop's wait for batches, how
        many were ready when asked, the prefetch depth, reads and transforms, cache hits and
        misses, bytes fetched, and the Fetcher's retries and stalls (see
        :class:`~streamcache.loading.stats.LoaderStats`). The difference of two snapshots,
        ``later.since(earlier)``, is what happened in between.

        Thread safety: may be called from any thread, also while the loop runs or the
        loader closes; it never opens a reader.
        """
        return self.counters.snapshot(open_reader(self.dataset))

    def log_stats(self, target: Any, *, every_n_steps: int = 50,
                  prefix: str = "streamcache/") -> StatsLogger:
        """Report :meth:`stats` to a logger every ``every_n_steps`` received batches.

        ``target``: a Lightning logger (``trainer.logger``: ``log_metrics``), a TensorBoard
        ``SummaryWriter`` (``add_scalar``), ``wandb`` or a wandb Run (``log``, added to the
        job's next step), or a function ``(metrics, step)``. Each report holds what happened
        since the previous one (wait per step in ms, fraction of batches ready, bytes
        fetched, cache hit rate, retries, stalls, prefetch depth), named ``prefix + name``.
        A logger that raises is warned about once and then dropped; training goes on.
        Returns the :class:`~streamcache.loading.stats_logger.StatsLogger` (``close()`` stops
        it).

        Raises:
            ConfigError: ``target`` is none of those, or ``every_n_steps`` is not >= 1.
        """
        logger = StatsLogger(metrics_sink(target), self.stats, self.counters,
                             every_n_steps=every_n_steps, prefix=prefix)
        self.stats_loggers = [*(x for x in self.stats_loggers if not x.closed), logger]
        return logger

    def state_dict(self) -> dict[str, Any]:
        """The loader state: ``{"version": 1, "cursor": {...}}``, the same on every rank."""
        return {KEY_VERSION: STATE_VERSION, KEY_CURSOR: self.dataset.cursor.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, on any world size, worker count or batch size: at the next
        iteration, or, when called while a ``for batch in loader`` loop runs (a rollback), with
        that loop's next batch (the reads ahead of the old position are dropped).

        A mixture's state holds its position, each source's cursor and the weights in force
        since they last changed: loaded with other weights, the new weights apply from the
        saved position on (docs/mixtures.md).

        Raises:
            CursorMismatchError: the state belongs to another dataset (or mixture: the
                message names the source that differs), seed or shuffle, is of an unknown
                version, or lacks or adds keys.
        """
        cursor = self._checked_cursor(state)
        with self._lock:
            self.dataset.cursor = cursor
            active = self._current()
            if active is not None and not active.done:
                active.moved()

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing
        (the Checkpointer checks every part of a checkpoint before it applies any)."""
        self._checked_cursor(state)

    def _checked_cursor(self, state: dict[str, Any]) -> Cursor | MixtureCursor:
        """The cursor in ``state``, checked against this dataset (strict)."""
        if not isinstance(state, dict) or state.get(KEY_VERSION) != STATE_VERSION:
            version = state.get(KEY_VERSION) if isinstance(state, dict) else None
            raise CursorMismatchError(
                f"loader state version {version!r} is not supported (expected "
                f"{STATE_VERSION}); it was not written by this StreamLoader")
        check_state(state, "loader state", frozenset({KEY_VERSION, KEY_CURSOR}), STATE_VERSION,
                    hint=" (pass what StreamLoader.state_dict() returned, unchanged)")
        cursor: Cursor | MixtureCursor = self.dataset.load_cursor(state[KEY_CURSOR])
        return cursor

    def _close_active(self) -> None:
        with self._lock:
            self._close_iteration()

    def _close_iteration(self) -> None:
        """Close the last iteration (lock held): the iterator if someone still holds it, and
        its readers or workers in any case (an iteration dropped after a ``break`` has told
        its readers to stop; here they are waited for, so none reads after close())."""
        active = self._current()
        if active is not None:
            active.close()
        source, self._source = self._source, None
        if source is not None:
            source.close()
        self._active = None

    def close(self) -> None:
        """Stop the active iteration's threads or workers and release the reader."""
        self._close_active()
        self.dataset.close()

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["StreamLoader", "WorkerMode"]
