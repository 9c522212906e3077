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

import multiprocessing.context
import numbers
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Literal, get_args

import torch

from ..errors import ConfigError
from ..plan import Cursor, CursorMismatchError
from ..plan._util import check_state
from ..plan.mixture_cursor import MixtureCursor
from .dataset import StreamDataset
from .loader_pass import BatchSource, LoaderPass
from .stats import LoaderStats, StepCounters, open_reader
from .stats_logger import StatsLogger, metrics_sink

STATE_VERSION = 1
WorkerMode = Literal["auto", "process", "thread"]
WORKER_MODES: tuple[WorkerMode, ...] = get_args(WorkerMode)
KEY_VERSION = "version"
KEY_CURSOR = "cursor"


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
        self._active: weakref.ref[LoaderPass] | None = None
        # the last iteration's readers (or workers), held strongly: the iterator does not
        # refer to them back, so no cycle; close() waits for them
        self._source: BatchSource | None = None
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
            iterator = LoaderPass(self, self._hold)
            # held weakly: an iteration the loop dropped is collected at once (its readers
            # told to stop), not kept alive by the loader until a cycle collection
            self._active = weakref.ref(iterator)
            return iterator

    def _hold(self, source: BatchSource) -> None:
        self._source = source

    def _current(self) -> LoaderPass | None:
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
