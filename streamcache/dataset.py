"""StreamDataset: a rank- and worker-disjoint ``IterableDataset`` of whole batches.

It composes the parts: the index (what the shards hold), the plan (which samples each rank
and worker reads at each step), a shard store (local copies) and the native reader (gathers
rows into contiguous arrays). Each item it yields is one step's batch for this rank, with the
global sample ids in ``__id__``. Progress is a :class:`~streamcache.plan.Cursor`; the
:class:`~streamcache.loader.StreamLoader` moves it as the training loop receives batches.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from .advice import ShardAdvice, working_set_bound
from .batching import (
    ID_KEY,
    PADDING_KEY,
    RAGGED_MODES,
    SEED_KEY,
    apply_sample_transform,
    seeded_global_rngs,
    step_seed,
    to_torch,
)
from .cache import NodeCache, local_bytes_estimate
from .dataset_reader import DatasetReader, ShardStore
from .errors import CacheBudgetError
from .index import DatasetIndex, load_index
from .plan import (
    Cursor,
    EpochOrder,
    EpochSegment,
    PlanError,
    RankBatch,
    ShuffleOptions,
    TailPolicy,
)
from .plan import sample_seeds as plan_sample_seeds
from .plan.order import DEFAULT_WINDOW
from .prefetch import Prefetcher, PrefetchOptions


@dataclass(frozen=True)
class StreamOptions:
    """Everything that configures a :class:`StreamDataset` (see its docstring)."""

    batch_size: int | None = None
    global_batch_size: int | None = None
    shuffle: bool = True
    shuffle_window: int = DEFAULT_WINDOW
    shuffle_window_unit: str = "samples"
    seed: int = 0
    tail: str = "drop"
    fields: tuple[str, ...] | None = None
    ragged: str = "padded"
    pad_value: int | float = 0
    transform: Callable[[dict[str, Any]], Any] | None = None
    batch_transform: Callable[[dict[str, Any]], Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    with_seeds: bool = False
    infinite: bool = False
    cache_dir: str | None = None
    cache_limit: int | None = None
    prefetch_shards: int | None = None
    prefetch_workers: int = 4
    storage_options: Mapping[str, Any] | None = None
    allow_external_paths: bool = False  # shards outside the index's folder (same protocol)
    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if (self.batch_size is None) == (self.global_batch_size is None):
            raise PlanError("give exactly one of batch_size (per rank) and global_batch_size")
        if self.ragged not in RAGGED_MODES:
            raise PlanError(f"ragged must be one of {RAGGED_MODES}, not {self.ragged!r}")
        if self.transform is not None and self.batch_transform is not None:
            raise PlanError("give a per-sample transform or a batch_transform, not both")
        TailPolicy(self.tail)
        if self.fields is not None:
            object.__setattr__(self, "fields", tuple(self.fields))


def resolve_topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): the arguments, else torch.distributed, else RANK/WORLD_SIZE, else 0/1.

    Raises:
        PlanError: an impossible pair (rank outside [0, world size)).
    """
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank() if rank is None else rank
            world_size = torch.distributed.get_world_size() if world_size is None else world_size
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank = int(os.environ["RANK"]) if rank is None else rank
            world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise PlanError(f"rank {rank} is impossible with world size {world_size}")
    return rank, world_size


@dataclass(frozen=True)
class StepRef:
    """One global step: its epoch, the segment it belongs to and its index there."""

    epoch: int
    segment: EpochSegment
    step: int
    number: int  # global step number counted from the schedule's start


class Schedule:
    """The steps from a cursor on: the rest of its epoch, then (infinite) whole epochs."""

    def __init__(self, cursor: Cursor, global_batch: int, world_size: int, tail: TailPolicy,
                 infinite: bool) -> None:
        self.cursor = cursor
        self.first = cursor.segment(global_batch, world_size, tail)
        self.full = EpochSegment(cursor.num_samples, 0, global_batch, world_size, tail)
        self.infinite = infinite
        if infinite and self.full.num_steps == 0:
            raise PlanError(
                f"an epoch of {cursor.num_samples} samples holds no whole global batch of "
                f"{global_batch} (tail={tail.value}): infinite iteration would never yield"
            )

    def segments(self) -> Iterator[tuple[int, EpochSegment, int]]:
        """(epoch, segment, number of its first step): the first, then (infinite) full ones."""
        number, epoch, segment = 0, self.cursor.epoch, self.first
        while True:
            yield epoch, segment, number
            if not self.infinite:
                return
            number += segment.num_steps
            epoch, segment = epoch + 1, self.full

    def cursor_after(self, steps_done: int) -> Cursor:
        """The cursor once ``steps_done`` global steps of this schedule are consumed."""
        cursor, segment = self.cursor, self.first
        if not self.infinite:
            return cursor.advanced(segment, steps_done)
        while steps_done >= segment.num_steps:
            steps_done -= segment.num_steps
            cursor = cursor.advanced(segment, segment.num_steps)
            segment = self.full
        return cursor.advanced(segment, steps_done)


class StreamDataset(IterableDataset):
    """Batches of a streamcache dataset for this rank, exactly once per epoch over all ranks.

    Args:
        url: dataset folder or index.json (any fsspec URL).
        batch_size: samples per rank per step; or ``global_batch_size``: samples per step
            over all ranks (keep it fixed to resume on another world size with identical
            global batches). Exactly one.
        shuffle, seed, shuffle_window, shuffle_window_unit: the epoch order (see the plan).
        tail: ``"drop"`` (default), ``"pad"`` (flagged in ``__padding__``) or ``"split"``.
        fields: the fields to read (default: all).
        ragged: variable-length fields as ``"padded"`` tensors plus ``<name>_lengths``, or as
            ``"offsets"`` (values plus ``<name>_offsets``).
        transform: per-sample callable ``sample -> sample``; each sample has ``__id__`` and
            ``__seed__`` (use ``numpy.random.default_rng(sample["__seed__"])``); outputs are
            collated with ``collate_fn`` (default: torch's default_collate).
        batch_transform: callable on the dict of numpy batch arrays (with ``__seed__``).
            Both kinds run with the global RNGs seeded from (seed, epoch, step) and restored.
        with_seeds: add ``__seed__`` to batches without a transform.
        infinite: iterate across epochs without end (LLM jobs count steps).
        cache_dir: the node-local cache folder shared by every process of the node
            (default: $STREAMCACHE_CACHE_DIR, else ~/.cache/streamcache). Local shards in the
            local layout are read in place and never copied.
        cache_limit: bytes the cache may hold (None: no limit). Below the working set (the
            shards one shuffle window keeps in use) it is refused at construction, with the
            minimum in the message: lower ``shuffle_window`` to stream with less disk.
        prefetch_shards: shards kept ahead of the reader (default: the working set + 16);
            prefetch_workers: download threads per process.
        allow_external_paths: read shards the index names outside its own folder (on the
            index's filesystem only; see :func:`streamcache.index.check_shard_paths`).
        rank, world_size: default: torch.distributed, else RANK/WORLD_SIZE, else 0/1.

    Raises:
        PlanError: impossible batch/world sizes or options; IndexNotFoundError etc. for URL.

    Thread safety: iterating the same dataset from several threads is safe (the loader does).
    """

    def __init__(self, url: str | DatasetIndex, **options: Any) -> None:
        super().__init__()
        self.options = StreamOptions(**options)
        opts = self.options
        self.index = url if isinstance(url, DatasetIndex) else load_index(
            url, opts.storage_options, allow_external_paths=opts.allow_external_paths
        )
        self.schema = self.index.schema.select(opts.fields)
        self._fields = {f.name: f for f in self.schema}
        self.rank, self.world_size = resolve_topology(opts.rank, opts.world_size)
        self.global_batch = (opts.global_batch_size if opts.global_batch_size is not None
                             else int(opts.batch_size or 0) * self.world_size)
        self.tail = TailPolicy(opts.tail)
        self.shuffle = ShuffleOptions(enabled=opts.shuffle, window=opts.shuffle_window,
                                      window_unit=opts.shuffle_window_unit)
        self.cursor = Cursor(self.index.fingerprint, self.index.num_samples, opts.seed,
                             self.shuffle)
        self.schedule()  # validates the batch and world sizes now, not at the first step
        self._lock = threading.RLock()  # the reader property builds the store under it
        self._orders: dict[int, EpochOrder] = {}
        self._advice: dict[int, ShardAdvice] = {}
        self._advised: tuple[int, int] | None = None
        if opts.cache_limit is not None:
            self._check_budget(opts.cache_limit)
        self._reader: DatasetReader | None = None
        self._reader_pid = -1

    # ------------------------------------------------------------ the plan

    def schedule(self) -> Schedule:
        return Schedule(self.cursor, self.global_batch, self.world_size, self.tail,
                        self.options.infinite)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        self.cursor = Cursor(self.cursor.dataset_fingerprint, self.cursor.num_samples,
                             self.cursor.seed, self.cursor.shuffle, epoch, 0)

    def __len__(self) -> int:
        """Steps left in the current epoch (the same on every rank)."""
        return self.cursor.segment(self.global_batch, self.world_size, self.tail).num_steps

    def order(self, epoch: int) -> EpochOrder:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                order = self.cursor.order(self.index.shard_rows) if epoch == self.cursor.epoch \
                    else EpochOrder(self.index.shard_rows, self.cursor.seed, epoch, self.shuffle)
                self._orders = {epoch: order, **{e: o for e, o in self._orders.items()
                                                 if e == epoch - 1}}
        return order

    def advice(self, epoch: int) -> ShardAdvice:
        """Where each shard is read in ``epoch`` (for prefetching and eviction)."""
        with self._lock:
            advice = self._advice.get(epoch)
        if advice is None:
            advice = ShardAdvice(self.order(epoch))
            with self._lock:
                self._advice = {epoch: advice, **{e: a for e, a in self._advice.items()
                                                  if e == epoch - 1}}
        return advice

    def working_set_bytes(self) -> int:
        """Local bytes of shards that no epoch keeps in use at once: a bound the plan
        guarantees (:func:`~streamcache.advice.working_set_bound`), the same for every
        epoch, rank and worker, so a budget accepted once holds for the whole run."""
        sizes = [local_bytes_estimate(info) for info in self.index.shards]
        return working_set_bound(self.index.shard_rows, sizes, self.shuffle)

    def _check_budget(self, cache_limit: int) -> None:
        needed = self.working_set_bytes()
        if cache_limit < needed:
            raise CacheBudgetError(
                f"cache_limit={cache_limit:,} bytes is below the working set: with a shuffle "
                f"window of {self.shuffle.window} {self.shuffle.window_unit}, any epoch keeps "
                f"at most {needed:,} bytes of shards in use at once (a bound the plan "
                f"guarantees, checked once for every epoch); give at least {needed:,} bytes, "
                "or lower shuffle_window"
            )

    def _advise(self, epoch: int, position: int) -> None:
        """Tell the prefetcher (and the cache's eviction) what the reader needs next."""
        store = self.reader.store
        if not isinstance(store, Prefetcher):
            return
        advice = self.advice(epoch)
        count = self.options.prefetch_shards or advice.working_set_shards() + 16
        shards, next_use = advice.upcoming(position, count)
        key = (epoch, int(shards[0]) if len(shards) else -1)
        if key != self._advised or position % max(1, advice.stride * 16) < self.global_batch:
            self._advised = key
            store.update(shards, next_use)

    # ------------------------------------------------------------ reading

    @property
    def reader(self) -> DatasetReader:
        """This process's reader (made again after fork: file locks and threads do not fork)."""
        with self._lock:
            if self._reader is None or self._reader_pid != os.getpid():
                self._reader = DatasetReader(self.index, fields=self.schema.names,
                                             store=self._make_store(),
                                             storage_options=self.options.storage_options)
                self._reader_pid = os.getpid()
            return self._reader

    def _make_store(self) -> ShardStore:
        opts = self.options
        folder = opts.cache_dir or os.environ.get("STREAMCACHE_CACHE_DIR") or \
            os.path.join(os.path.expanduser("~"), ".cache", "streamcache")
        working_set = self.working_set_bytes() if opts.cache_limit is not None else None
        cache = NodeCache(self.index, folder, cache_limit=opts.cache_limit,
                          working_set_bytes=working_set, storage_options=opts.storage_options)
        lookahead = opts.prefetch_shards or self.advice(self.cursor.epoch).working_set_shards() + 16
        return Prefetcher(cache, PrefetchOptions(workers=opts.prefetch_workers,
                                                 lookahead_shards=lookahead))

    @property
    def transformed(self) -> bool:
        return self.options.transform is not None or self.options.batch_transform is not None

    def planned(self, worker: int = 0, num_workers: int = 1, schedule: Schedule | None = None,
                ) -> Iterator[tuple[StepRef, RankBatch]]:
        """This rank's steps for worker ``worker`` of ``num_workers`` (global step numbers
        ``% num_workers == worker``), each with its part of the global batch. The plan is
        computed many steps per pass. ``schedule`` defaults to one from the current cursor."""
        for epoch, segment, first in (schedule or self.schedule()).segments():
            order = self.order(epoch)
            local_worker = (worker - first) % num_workers
            if local_worker >= segment.num_steps:
                continue
            for part in segment.worker_batches(order, self.rank, local_worker, num_workers):
                self._advise(epoch, segment.step_span(part.step)[0])
                yield StepRef(epoch, segment, part.step, first + part.step), part

    def read_step(self, ref: StepRef, part: RankBatch) -> dict[str, Any]:
        """This rank's raw arrays of one step (no transform). Safe from any thread."""
        opts = self.options
        arrays: dict[str, Any] = dict(self.reader.read_located(part.shards, part.rows))
        arrays[ID_KEY] = part.sample_ids
        if self.tail is TailPolicy.PAD:
            arrays[PADDING_KEY] = part.is_padding
        if self.transformed or opts.with_seeds:
            arrays[SEED_KEY] = plan_sample_seeds(opts.seed, ref.epoch, part.sample_ids)
        return arrays

    def finish_step(self, ref: StepRef, arrays: dict[str, Any]) -> Any:
        """Transform (if any) and convert one step's arrays to the batch the loop receives.

        With a transform, the process-wide RNGs are seeded for the step and restored after,
        so this must run on one thread at a time (the loader runs it on the consumer thread).
        """
        opts = self.options
        if not self.transformed:
            return self._tensors(arrays)
        first_position = ref.segment.step_span(ref.step)[0]
        with seeded_global_rngs(step_seed(opts.seed, ref.epoch, first_position)):
            if opts.transform is not None:
                samples_arrays = dict(arrays)
                samples_arrays[SEED_KEY] = [int(s) for s in arrays[SEED_KEY]]
                return apply_sample_transform(samples_arrays, self._fields, opts.transform,
                                              opts.collate_fn or default_collate)
            assert opts.batch_transform is not None
            return self._tensors(opts.batch_transform(arrays))

    def make_batch(self, ref: StepRef, part: RankBatch | None = None) -> Any:
        """This rank's batch of one step: read, transform, convert to tensors."""
        if part is None:
            part = ref.segment.rank_batch(self.order(ref.epoch), ref.step, self.rank)
        return self.finish_step(ref, self.read_step(ref, part))

    def _tensors(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(arrays)
        if SEED_KEY in out and isinstance(out[SEED_KEY], np.ndarray):
            out[SEED_KEY] = out[SEED_KEY].view(np.int64)  # torch has no full uint64 support
        return to_torch(out, self._fields, ragged=self.options.ragged,
                        pad_value=self.options.pad_value)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for ref, part in self.planned(worker, workers):
            yield self.make_batch(ref, part)

    # ------------------------------------------------------------ pickling for workers

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state["_reader"], state["_reader_pid"], state["_orders"] = None, -1, {}
        state["_advice"], state["_advised"] = {}, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()  # the reader property builds the store under it

    def close(self) -> None:
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None and self._reader_pid == os.getpid():
            reader.close()




__all__ = ["Schedule", "StepRef", "StreamDataset", "StreamOptions", "resolve_topology"]


