"""A pass's steps read by the loader's own reader threads (``num_workers=0``, or worker
processes not needed): each thread plans and reads its share of the steps a few ahead of the
training loop, and the loop takes them in step order."""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import os
import threading
import time
import weakref
from concurrent.futures import CancelledError
from typing import Any

from .. import _native
from ..format.buffers import gather_into
from ..plan import RankBatch
from ..processes import usable_cores
from .batching import SampleColumns
from .dataset import StreamDataset
from .pinning import pinned, pinned_pool
from .schedule import Schedule, StepRef
from .stats import StepCounters


class _Producer:
    """One reader thread: the steps ``t % threads == index`` of a pass, in order, read (and
    made into batches, without a transform) at most ``depth`` ahead of the loop, or a group
    of small steps read with one gather (up to ``together`` steps, grown from 1 by doubling)
    whenever fewer than a group (at least ``depth``) are ready: the next group is read while
    the loop takes the last one, so a thread holds at most two groups' batches (waiting for
    the queue to empty first left both cores idle while the loop took a group: 1 KB rows,
    w0, 1.08-1.58x samples/s with this rule, five interleaved pairs)."""

    _END = object()

    def __init__(self, owner: ThreadBatches, index: int, threads: int,
                 schedule: Schedule) -> None:
        self._owner = owner
        self._steps = owner.dataset.planned(index, threads, schedule)
        self._ready: collections.deque[Any] = collections.deque()  # batches, errors, _END
        self._changed = threading.Condition()
        self._ahead = owner.depth  # the thread reads on while fewer are ready
        self._thread = threading.Thread(target=self._run, name=f"streamcache-loader-{index}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        owner = self._owner
        _native.set_gather_threads(owner.gather_width)  # (this thread's own setting)
        steps = iter(self._steps)
        together = 1  # steps read at once: 1 first (the first batch comes as soon as it can)
        try:
            while True:
                # a group is read while the one before it is taken: up to two groups ahead
                self._ahead = max(owner.depth, together)
                with self._changed:
                    self._changed.wait_for(
                        lambda: owner.stopped or len(self._ready) < self._ahead)
                    if owner.stopped:  # interrupted: no read may start (it opens a reader)
                        self._ready.append(_Failed(CancelledError("the loader was interrupted")))
                        return
                group = list(itertools.islice(steps, together))
                if not group:
                    break
                self._read(group)
                together = min(owner.together, 2 * together)
            self._put(self._END)
        except BaseException as error:  # the loop raises it, with its type
            self._put(_Failed(error))

    def _read(self, group: list[tuple[StepRef, RankBatch]]) -> None:
        """Read the steps of ``group`` and hand their batches over: with one gather where the
        reader can (then all at once), else one by one, so that an error comes at the step
        that has it, after the steps before it."""
        owner = self._owner
        if len(group) > 1:
            try:
                batches = owner.work_together(group)
            except Exception:  # read again one by one: the error comes at its own step
                batches = None
            if batches is not None:
                with self._changed:
                    self._ready.extend(batches)
                    self._changed.notify_all()
                return
        for ref, part in group:
            self._put(owner.work(ref, part))

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
            if len(self._ready) < self._ahead:  # (the thread waits for no more)
                self._changed.notify_all()
            return item, ready, len(self._ready)

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class _Failed:
    """What a read raised, for the loop. A StopIteration (a ``next()`` on an exhausted
    iterator somewhere in the read) becomes a RuntimeError, as PEP 479 does in generators:
    raised from ``__next__`` as it is, it would end the loop's ``for`` as if the epoch were
    over."""

    def __init__(self, error: BaseException) -> None:
        if isinstance(error, StopIteration):
            stopped = RuntimeError(f"a read of the loader raised StopIteration: {error!r}")
            stopped.__cause__ = error
            error = stopped
        self.error = error


class ThreadBatches:
    """Steps of a schedule read by ``threads`` reader threads, each about ``depth`` steps
    ahead of the loop (of small steps: two groups), delivered in order (step ``t`` comes
    from thread ``t % threads``).

    Each thread plans and reads its own steps and hands their batches to the loop (a pool of
    per-step tasks cost two hand-overs, a future and a task each, and ran the plan on the
    loop's thread: 1.3-1.9 times the CPU of reading the steps inline, measured on 1 KB
    samples). Small steps are read a few at a time with one gather and handed over together
    (:func:`steps_together`; docs/design.md).
    """

    def __init__(self, dataset: StreamDataset, schedule: Schedule, depth: int, threads: int,
                 pin: bool, counters: StepCounters) -> None:
        self.dataset = dataset
        threads = max(1, threads)
        self.depth = max(1, -(-depth // threads))  # ready batches per thread: ~depth in all
        self.gather_width = gather_width(threads)
        self.together = steps_together(dataset)
        self.stopped = False
        self._counters = counters
        self._pin = pin
        self._closed = False
        self._next = 0
        self._pid = os.getpid()
        self._producers = [_Producer(self, index, threads, schedule)
                           for index in range(threads)]
        _running.add(self)

    def work_together(self, steps: list[tuple[StepRef, RankBatch]]) -> list[Any] | None:
        """:meth:`work` of each of ``steps`` from one gather, or None where the reader
        cannot read them together (:meth:`StreamDataset.read_steps`)."""
        started = time.perf_counter()
        with self._outputs():
            arrays = self.dataset.read_steps(steps)
        if arrays is None:
            return None
        batches = [self._made(ref, step) for (ref, _), step in zip(steps, arrays, strict=True)]
        self._counters.read(time.perf_counter() - started)
        return batches

    def work(self, ref: StepRef, part: RankBatch) -> Any:
        """One step's arrays (with a transform: finished on the loop's thread) or batch."""
        started = time.perf_counter()
        with self._outputs():
            arrays = self.dataset.read_step(ref, part)
        batch = self._made(ref, arrays)
        self._counters.read(time.perf_counter() - started)
        return batch

    def _outputs(self) -> contextlib.AbstractContextManager[None]:
        """Where a read gathers into: with ``pin``, page-locked buffers (pinned with no
        copy); else the gather's own pool."""
        return gather_into(pinned_pool()) if self._pin else contextlib.nullcontext()

    def _made(self, ref: StepRef, arrays: dict[str, Any]) -> Any:
        """A step's batch from its arrays; with a transform, its arrays and samples, finished
        on the loop's thread."""
        if self.dataset.transformed:
            return _Arrays(ref, arrays, self.dataset.sample_columns(arrays))
        batch = self.dataset.finish_step(ref, arrays)
        return pinned(batch) if self._pin else batch

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        producer = self._producers[self._next % len(self._producers)]
        result, ready, behind = producer.take()
        self._next += 1
        self._counters.took(ready, behind)
        if isinstance(result, _Arrays):
            started = time.perf_counter()
            batch = self.dataset.finish_step(result.ref, result.arrays, result.samples)
            self._counters.transformed(time.perf_counter() - started)
            return pinned(batch) if self._pin else batch
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


# Iterations whose reader threads may still run, for the interpreter's exit (weakly: one the
# loop dropped is collected as usual).
_running: weakref.WeakSet[ThreadBatches] = weakref.WeakSet()
EXIT_JOIN_S = 10.0  # the longest the exit waits for the reads in hand of live iterations


def _end_at_exit() -> None:
    """At the interpreter's exit, end the reader threads of iterations still alive (the loop
    kept one, or iter() had started the next epoch's reads): a daemon thread left parked
    holds its shards' readers and native objects past the extension's teardown, which
    reports them as leaked. Each iteration stops and its dataset's reader is closed (its
    downloads end at once, as on Ctrl-C); the threads are then joined, within EXIT_JOIN_S in
    all, so an exit never hangs on a read."""
    live = [batches for batches in list(_running) if batches._pid == os.getpid()]
    for batches in live:
        batches.stop()
        batches.dataset.close()
    deadline = time.monotonic() + EXIT_JOIN_S
    for batches in live:
        for producer in batches._producers:
            producer.join(max(0.0, deadline - time.monotonic()))


atexit.register(_end_at_exit)


def gather_width(readers: int) -> int:
    """How many threads one of ``readers`` reader threads may split a large gather over:
    itself, plus its share of the cores that the loop and the readers leave free (1 where
    they keep every core busy: on 2 cores a split only added wake-ups, 18% fewer 100 KB
    samples a second with the default two readers)."""
    return 1 + max(0, usable_cores() - readers - 1) // max(1, readers)


class _Arrays:
    """A step's arrays, read ahead, to be transformed on the loop's thread (with a per-sample
    transform, its samples' values already split into columns on the reader thread)."""

    __slots__ = ("arrays", "ref", "samples")

    def __init__(self, ref: StepRef, arrays: dict[str, Any],
                 samples: SampleColumns | None) -> None:
        self.ref = ref
        self.arrays = arrays
        self.samples = samples


#: A reader thread reads up to this many bytes of its steps with one gather (rows of 1 KB,
#: 256 a step: 8 steps at once; rows of 100 KB, 32 a step: each step alone), at most
#: MAX_TOGETHER steps.
TOGETHER_BYTES = 2 << 20
MAX_TOGETHER = 16


def steps_together(dataset: StreamDataset) -> int:
    """How many of its steps a reader thread reads at once, by the dataset's average row
    (all its fields: a bound) and this rank's rows a step; 1 for a mixture (its reader reads
    each step's sources alone)."""
    index = getattr(dataset, "index", None)
    if index is None or index.num_samples == 0:
        return 1
    row_bytes = float(index.shard_table.raw_or_stored_bytes().sum()) / index.num_samples
    step_bytes = row_bytes * dataset.global_batch / max(1, dataset.world_size)
    return int(max(1, min(MAX_TOGETHER, TOGETHER_BYTES // max(1.0, step_bytes))))
