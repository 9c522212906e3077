"""StreamDataset: a rank- and worker-disjoint ``IterableDataset`` of whole batches.

It composes the parts: the index (what the shards hold), the plan (which samples each rank
and worker reads at each step), a shard store (local copies) and the native reader (gathers
rows into contiguous arrays). Each item it yields is one step's batch for this rank, with the
global sample ids in ``__id__``. Progress is a :class:`~streamcache.plan.Cursor`; the
:class:`~streamcache.loading.loader.StreamLoader` moves it as the training loop receives batches.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from ..cache.advice import ShardAdvice
from ..cache.prefetch import PrefetchOptions
from ..format.index import DatasetIndex, load_index
from ..integrations.accelerate import refuse_accelerate_wrapping
from ..plan import (
    EpochOrder,
    EpochSegment,
    RankBatch,
    ShuffleOptions,
    TailPolicy,
)
from ..plan.cursor import ResumeCheck
from ..plan.shuffle import DEFAULT_WINDOW
from ..remote.options import FetchOptions
from . import step_batch
from .batching import SampleColumns
from .dataset_reader import DatasetReader
from .feed import ShardFeed, dataset_fetcher, default_cache_dir
from .mixture import MixtureFeed
from .mixture_store import MixtureReader
from .node_reader import NodeReader
from .nodes import NodeLocality
from .options import LocalData, RaggedMode, StreamOptions, TailMode, WindowUnit
from .pass_topology import PassTopology
from .schedule import Schedule, StepRef, later_epoch_samples
from .source import Source
from .topology import NodeTopology, resolve_topology


class StreamDataset(IterableDataset):
    """Batches of a streamcache dataset for this rank, exactly once per epoch over all ranks.

    Args:
        url: dataset folder or index.json (any fsspec URL); or a list of :class:`Source`: a
            weighted mixture, whose batches also carry ``__source__`` (the index in the list)
            and ``__id__`` within that source (docs/mixtures.md).
        batch_size: samples per rank per step; or ``global_batch_size``: samples per step
            over all ranks (keep it fixed to resume on another world size with identical
            global batches). Exactly one.
        shuffle, seed, shuffle_window, shuffle_window_unit: the epoch order (see the plan).
        tail: ``"drop"`` (default), ``"pad"`` (flagged in ``__padding__``) or ``"split"``.
        fields: the fields to read (default: all).
        ragged: variable-length fields as ``"padded"`` tensors plus ``<name>_lengths``, or as
            ``"offsets"`` (values plus ``<name>_offsets``); ``pad_value`` fills the padding.
        transform: per-sample callable ``sample -> dict`` (with ``collate_fn``: anything it
            batches); each sample has ``__id__`` and
            ``__seed__`` (use ``numpy.random.default_rng(sample["__seed__"])``), and each call
            runs with the global RNGs (``random``, ``numpy.random``, torch's CPU generator)
            seeded from that sample alone, so its output does not depend on the world size,
            workers or resumes. The dicts are collated with ``collate_fn`` (default: torch's
            default_collate).
        batch_transform: callable on the dict of numpy batch arrays (with ``__seed__``),
            returning a dict; it runs with the global RNGs seeded from the batch's first
            sample: reproducible for the same global batch and world size, not across world
            sizes (draw per sample from ``__seed__`` for that). The loop's RNG states are
            restored after either kind.
        with_seeds: add ``__seed__`` to batches without a transform.
        infinite: iterate across epochs without end (LLM jobs count steps).
        cache_dir: the node-local cache folder shared by every process of the node
            (default: $STREAMCACHE_CACHE_DIR, else ~/.cache/streamcache). Local uncompressed
            shards (``ShardWriter(compression=None)``, chunked or not) are read in place and
            never copied; compressed or Parquet shards are decoded once into it.
        cache_limit: bytes the cache may hold (None: no limit). Below the working set (the
            shards one shuffle window keeps in use) it is refused at construction, with the
            minimum in the message: lower ``shuffle_window`` to stream with less disk.
        local_data: ``"in_place"`` (default, for a local disk): local uncompressed shards are
            memory-mapped where they lie. ``"copy"``: they are copied into ``cache_dir`` first,
            as remote shards are, for a slow mount (NFS, Lustre, a mounted bucket) whose
            per-read latency a page-cache read path would pay on every batch.
        storage_options: keyword arguments of the URL's fsspec filesystem (credentials,
            endpoint); they replace ``fetch.storage_options``.
        fetch: how shards and the index are downloaded: a
            :class:`~streamcache.FetchOptions` (stall timeout, retries, backoff, requests in
            flight). Default: a stall is 10 s without a byte, retried 4 times.
        prefetch: how shards are fetched ahead of the reader: a
            :class:`~streamcache.PrefetchOptions` (download threads per process, shards and
            bytes kept ahead). Default: 4 threads, the working set + 16 shards.
        allow_external_paths: read shards the index names outside its own folder (on the
            index's filesystem only; see
            :func:`streamcache.format.shard_paths.check_shard_paths`).
        rank, world_size: resolved when a pass starts, not when the dataset is made (so it
            may be made before the process group, e.g. in a LightningModule's __init__):
            the arguments, else torch.distributed, else RANK/WORLD_SIZE, else 0 of 1 where
            the environment does not say the job is distributed (that is refused).
        nodes: how many nodes the ranks run on (ranks of a node numbered contiguously, as
            torchrun does); resolved when a pass starts: the argument, else torchrun's
            LOCAL_WORLD_SIZE, else the process group's host names, else 1. With several,
            each node caches only its share of the shards (docs/multinode.md); ``nodes=1``
            turns that off. The global batches are the same either way.
        partitions: 0 (default): the order does not depend on the node count, and each node
            reads the batch's samples of the pieces it holds, plus a few of other nodes' to
            balance them. ``P > 0``: *canonical partitions* for many nodes with small
            per-node parts (docs/multinode.md, "Canonical partitions"): the samples are cut
            into ``P`` equal contiguous runs, each shuffled alone, and every global batch
            takes as many of each; node ``n`` of ``N`` reads only its ``P / N`` runs (about
            ``1/N`` of the bytes, whatever the batch). The node count must divide ``P`` and
            the global batch be a multiple of it; a state resumes on any node count that
            divides ``P``. Part of the order, so of the cursor: fix it for the whole run.
        resume_check: what a loaded state must match: ``"identity"`` (default) the data's
            fingerprint and, where its index has no checksums (the fingerprint then fixes only
            the shape), where the data lives and which index describes it;
            ``"fingerprint"`` the fingerprint alone, for the same files copied to another
            folder or bucket or indexed again (docs/trust.md, "Loader states").

    ``len()`` is the number of steps of a whole epoch (as a DataLoader's, also after a
    mid-epoch resume); ``steps_remaining`` the steps left in the cursor's epoch. With
    ``global_batch_size`` both are the same on every world size; with ``batch_size`` (per
    rank) the global batch is ``batch_size * world_size``, so they resolve the topology
    when called.

    Every option is keyword-only and typed (an unknown keyword is a ``TypeError``, and a
    type checker reports it); the values are kept in :attr:`options`, a
    :class:`StreamOptions`.

    Raises:
        ConfigError: an option's value is invalid (an unknown mode, a negative size, both or
            neither of ``batch_size`` and ``global_batch_size``); the message names it.
        PlanError: batch and world sizes impossible together, or with this dataset.
        CacheBudgetError: ``cache_limit`` below the working set.
        IndexNotFoundError, StorageError, FetchError: the URL cannot be read.

    Thread safety: iterating the same dataset from several threads is safe (the loader does).
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | DatasetIndex | Sequence[Source],
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        shuffle: bool = True,
        shuffle_window: int = DEFAULT_WINDOW,
        shuffle_window_unit: WindowUnit = "samples",
        seed: int = 0,
        tail: TailMode = "drop",
        fields: Sequence[str] | None = None,
        ragged: RaggedMode = "padded",
        pad_value: int | float = 0,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        batch_transform: Callable[[dict[str, Any]], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        with_seeds: bool = False,
        infinite: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        local_data: LocalData = "in_place",
        storage_options: Mapping[str, Any] | None = None,
        fetch: FetchOptions | None = None,
        prefetch: PrefetchOptions | None = None,
        allow_external_paths: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        nodes: int | None = None,
        resume_check: ResumeCheck = "identity",
        partitions: int = 0,
    ) -> None:
        super().__init__()
        self.options = StreamOptions(
            batch_size=batch_size, global_batch_size=global_batch_size, shuffle=shuffle,
            shuffle_window=shuffle_window, shuffle_window_unit=shuffle_window_unit, seed=seed,
            tail=tail, fields=fields, ragged=ragged, pad_value=pad_value, transform=transform,
            batch_transform=batch_transform, collate_fn=collate_fn, with_seeds=with_seeds,
            infinite=infinite, cache_dir=cache_dir, cache_limit=cache_limit,
            local_data=local_data, storage_options=storage_options, fetch=fetch, prefetch=prefetch,
            allow_external_paths=allow_external_paths, rank=rank, world_size=world_size,
            nodes=nodes, resume_check=resume_check, partitions=partitions,
        )
        opts = self.options
        self.tail = TailPolicy(opts.tail)
        # seconds make_batch spent (reading, transforming) in this process: what a worker
        # process reports with its batches (loading/shared_batches.py)
        self.work_seconds = [0.0, 0.0]
        self.shuffle = ShuffleOptions(enabled=opts.shuffle, window=opts.shuffle_window,
                                      window_unit=opts.shuffle_window_unit,
                                      partitions=opts.partitions)
        self._feed: ShardFeed | MixtureFeed
        if isinstance(url, os.PathLike):  # a local folder as a pathlib.Path
            url = os.fspath(url)
        if isinstance(url, (str, DatasetIndex)):
            # one Fetcher reads the index, then this process's first cache downloads with it
            fetcher = None if isinstance(url, DatasetIndex) else dataset_fetcher(
                opts.fetch, opts.storage_options)
            try:
                self.index = url if isinstance(url, DatasetIndex) else load_index(
                    url, opts.storage_options, allow_external_paths=opts.allow_external_paths,
                    fetch=opts.fetch, table_cache=default_cache_dir(opts.cache_dir),
                    fetcher=fetcher)
                self.schema = self.index.schema.select(opts.fields)
                self._feed = ShardFeed(self.index, self.schema.names, opts, self.shuffle,
                                       fetcher=fetcher)
            except BaseException:
                if fetcher is not None:
                    fetcher.close()
                raise
        else:  # a mixture: its sources' indexes, and transforms of their own, are its feed's
            self._feed = MixtureFeed(url, opts, self.shuffle)
            self.schema = self._feed.schema
            self.options = opts = dataclasses.replace(
                opts, transform=self._feed.transform() or opts.transform)
        self._fields = {f.name: f for f in self.schema}
        self.cursor: Any = self._feed.start_cursor()  # a MixtureCursor for a mixture
        self._passes = PassTopology(opts, self._feed)
        self._validate()
        if opts.cache_limit is not None:
            self._passes.check_budget(self._passes.known_nodes(self.cursor))

    # ------------------------------------------------------------ the topology

    @property
    def topology(self) -> tuple[int, int]:
        """``(rank, world_size)``: as resolved when the last pass started, else resolved now
        (see :func:`~streamcache.loading.topology.resolve_topology`)."""
        return self._passes.topology

    @property
    def rank(self) -> int:
        return self.topology[0]

    @property
    def world_size(self) -> int:
        return self.topology[1]

    @property
    def locality(self) -> NodeLocality:
        """This rank's node: which slots of a batch it reads and which shards its node
        caches; as resolved when the last pass started, else now (without asking the
        process group)."""
        return self._passes.locality(self.cursor)

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks (with ``batch_size``, this needs the topology)."""
        return self._passes.global_batch()

    def _validate(self) -> None:
        """Refuse impossible options when the dataset is made, as far as they are known
        before the topology: all of them when rank and world size are given."""
        opts = self.options
        if opts.rank is not None and opts.world_size is not None:
            rank, world_size = resolve_topology(opts.rank, opts.world_size)
            self._schedule(rank, world_size, int(opts.global_batch_size or
                                                 int(opts.batch_size or 0) * world_size))
        elif opts.global_batch_size is not None:
            self._schedule(0, 1, opts.global_batch_size)
        if opts.nodes is not None and opts.world_size is not None:
            NodeTopology(0, opts.world_size, opts.nodes)  # a node count the world cannot have

    # ------------------------------------------------------------ the plan

    def schedule(self) -> Schedule:
        """This rank's steps from the cursor on. A pass starts here: the topology is resolved
        now, and kept for the pass (worker processes receive it with the dataset)."""
        return self._schedule(*self._passes.start(self.cursor), self.global_batch)

    def _schedule(self, rank: int, world_size: int, global_batch: int) -> Schedule:
        return Schedule(self.cursor, global_batch, rank, world_size, self.tail,
                        self.options.infinite)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration; the epoch the
        cursor is in already keeps its cursor (``set_epoch`` before every epoch, as with a
        DistributedSampler, also right after a mid-epoch resume). An infinite mixture's
        epoch starts where a run with this global batch reaches it (docs/mixtures.md)."""
        if isinstance(self._feed, MixtureFeed):
            self.cursor = self._feed.at_epoch(self.cursor, epoch, lambda: self.global_batch,
                                              self.tail)
        else:
            self.cursor = self._feed.at_epoch(self.cursor, epoch)

    def load_cursor(self, data: Any) -> Any:
        """A saved cursor of this dataset, checked (strict), ready to replace :attr:`cursor`."""
        return self._feed.load_cursor(data, self.cursor)

    def __len__(self) -> int:
        """Steps in a whole epoch (as a DataLoader's ``len``; also during and after a mid-epoch
        resume). The same on every rank."""
        # the count of steps does not depend on the world size, only on the global batch
        return EpochSegment(later_epoch_samples(self.cursor), 0, self.global_batch, 1,
                            self.tail).num_steps

    @property
    def steps_remaining(self) -> int:
        """Steps left in the cursor's epoch (after a mid-epoch resume: fewer than ``len``)."""
        return self.cursor.segment(self.global_batch, 1, self.tail).num_steps

    def order(self, epoch: int) -> EpochOrder:
        """The sample order of ``epoch``."""
        return self._feed.order(self.cursor, epoch)

    def advice(self, epoch: int) -> ShardAdvice:
        """Where each shard is read in ``epoch`` (for prefetching and eviction)."""
        return self._feed.advice(self.cursor, epoch)

    def working_set_bytes(self) -> int:
        """Local bytes of shards that no epoch keeps in use at once: a bound the plan
        guarantees (:func:`~streamcache.cache.advice.working_set_bound`), the same for every
        epoch, rank and worker, so a budget accepted once holds for the whole run."""
        return self._feed.working_set_bytes()

    # ------------------------------------------------------------ reading

    @property
    def reader(self) -> DatasetReader | NodeReader | MixtureReader:
        """This process's reader (made again after fork: file locks and threads do not fork)."""
        return self._feed.reader(self.cursor)

    @property
    def transformed(self) -> bool:
        return step_batch.transformed(self.options)

    def planned(self, worker: int = 0, num_workers: int = 1, schedule: Schedule | None = None,
                ) -> Iterator[tuple[StepRef, RankBatch]]:
        """This rank's steps for worker ``worker`` of ``num_workers`` (global step numbers
        ``% num_workers == worker``), each with its part of the global batch. The plan is
        computed many steps per pass. ``schedule`` defaults to one from the current cursor."""
        schedule = schedule or self.schedule()
        assignment = self.locality.assignment
        for epoch, segment, first in schedule.segments():
            if segment.num_steps == 0:  # a rest shorter than a global batch: nothing to read
                continue  # (and its cursor is the next epoch's, which has no order for it)
            # the epoch's start as this schedule reaches it (a mixture's may depend on it)
            start: Any = schedule.cursor_after(first)
            order = self._feed.order(start, epoch)
            local_worker = (worker - first) % num_workers
            if local_worker >= segment.num_steps:
                continue
            for part in segment.worker_batches(order, schedule.rank, local_worker,
                                               num_workers, assignment):
                self._feed.advise(self.cursor, epoch, segment.step_span(part.step)[0],
                                  self.global_batch)
                yield StepRef(epoch, segment, part.step, first + part.step), part

    def read_step(self, ref: StepRef, part: RankBatch) -> dict[str, Any]:
        """This rank's raw arrays of one step (no transform). Safe from any thread."""
        return step_batch.read_arrays(self.options, self.tail, self._feed, self.reader, ref,
                                      part)

    def read_steps(self, steps: Sequence[tuple[StepRef, RankBatch]],
                   ) -> list[dict[str, Any]] | None:
        """:meth:`read_step` of each of ``steps`` from one gather, or None where they must be
        read one by one (:func:`~streamcache.loading.step_batch.read_steps_together`)."""
        return step_batch.read_steps_together(self.options, self.tail, self._feed,
                                              self.reader, steps)

    def sample_columns(self, arrays: dict[str, Any]) -> SampleColumns | None:
        """The per-sample values a per-sample transform's dicts are made of (None: no such
        transform), for :meth:`finish_step`; safe from any thread."""
        return step_batch.sample_columns(self.options, self._fields, arrays)

    def finish_step(self, ref: StepRef, arrays: dict[str, Any],
                    samples: SampleColumns | None = None) -> Any:
        """Transform (if any) and convert one step's arrays to the batch the loop receives.

        A transform runs with the process-wide RNGs seeded (per sample for ``transform``, per
        batch for ``batch_transform``; see :mod:`streamcache.loading.batching`) and restored
        after, so this must run on one thread at a time (the loader runs it on the consumer thread).
        ``samples``: :meth:`sample_columns` of ``arrays``, where made already.
        """
        return step_batch.finish(self.options, self._fields, ref, arrays,
                                 lambda: self._first_of_step(ref), samples)

    def _first_of_step(self, ref: StepRef) -> dict[str, Any]:
        """The raw arrays of the step's first sample: the template of an empty batch (a
        transform's output has a structure only a sample can show)."""
        first = ref.segment.step_span(ref.step)[0]
        positions = np.array([first % ref.segment.num_samples], dtype=np.int64)
        ids, shards, rows = self.order(ref.epoch).samples_at(positions)
        return self.read_step(ref, RankBatch(ref.step, positions, ids, shards, rows,
                                             np.zeros(1, dtype=bool)))

    def make_batch(self, ref: StepRef, part: RankBatch | None = None) -> Any:
        """This rank's batch of one step: read, transform, convert to tensors."""
        if part is None:
            part = ref.segment.rank_batch(self.order(ref.epoch), ref.step, self.rank,
                                          self.locality.assignment)
        started = time.perf_counter()
        arrays = self.read_step(ref, part)
        read = time.perf_counter()
        batch = self.finish_step(ref, arrays)
        self.work_seconds[0] += read - started
        self.work_seconds[1] += time.perf_counter() - read
        return batch

    def __iter__(self) -> Iterator[Any]:
        refuse_accelerate_wrapping()  # a DataLoader Accelerate prepared would split it again
        info = get_worker_info()
        if info is None:  # a pass starts in this process
            worker, workers, schedule = 0, 1, self.schedule()
        else:  # a worker process: the topology its parent resolved, if it did
            worker, workers = info.id, info.num_workers
            schedule = self._schedule(*self.topology, self.global_batch)
        for ref, part in self.planned(worker, workers, schedule):
            yield self.make_batch(ref, part)

    def close(self) -> None:
        self._feed.close()


__all__ = [
    "Schedule",
    "StepRef",
    "StreamDataset",
    "resolve_topology",
]
