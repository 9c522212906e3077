"""One step's batch, as a StreamDataset makes it: the rows of this rank's part read, then
transformed (with the process-wide RNGs seeded per sample or per batch) and made into
tensors (see :mod:`streamcache.loading.batching`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import get_worker_info

from ..format.ragged import Ragged
from ..format.schema import Field
from ..plan import RankBatch, TailPolicy
from ..plan import sample_seeds as plan_sample_seeds
from .batching import (
    ID_KEY,
    PADDING_KEY,
    SEED_KEY,
    SampleColumns,
    apply_batch_transform,
    apply_sample_transform,
    empty_like,
    gathering,
    to_torch,
)
from .batching import sample_columns as batching_columns
from .dataset_reader import DatasetReader
from .feed import ShardFeed
from .mixture import MixtureFeed
from .mixture_store import MixtureReader
from .node_reader import NodeReader
from .options import StreamOptions
from .schedule import StepRef
from .seeding import GlobalRngSeeder, preserved_global_rngs, process_seeder, step_seed

Reader = DatasetReader | NodeReader | MixtureReader


def transformed(options: StreamOptions) -> bool:
    """Whether a batch goes through a transform (per sample or per batch)."""
    return options.transform is not None or options.batch_transform is not None


def read_arrays(options: StreamOptions, tail: TailPolicy, feed: ShardFeed | MixtureFeed,
                reader: Reader, ref: StepRef, part: RankBatch) -> dict[str, Any]:
    """This rank's raw arrays of one step (no transform). Safe from any thread."""
    with _gathering(options):
        arrays: dict[str, Any] = dict(reader.read_located(part.shards, part.rows,
                                                          first=part.step == 0))
    return _with_keys(options, tail, feed, ref, part, arrays)


def read_steps_together(options: StreamOptions, tail: TailPolicy,
                        feed: ShardFeed | MixtureFeed, reader: Reader,
                        steps: Sequence[tuple[StepRef, RankBatch]],
                        ) -> list[dict[str, Any]] | None:
    """The raw arrays of several steps (each what :func:`read_arrays` gives) from one gather
    of all their rows, or None where the reader cannot read them so: a reader of units or of
    a mixture, a cold start, rows read by range or a shard not open yet (the caller then reads
    the steps one by one, as the cold-start rule counts steps). One gather of a few steps
    costs the Python around it once (a step of 256 rows of 1 KB: the gather ~60 us, the rest
    ~35) and can split over the gather threads. Safe from any thread."""
    read_warm = getattr(reader, "read_warm", None)
    if read_warm is None or len(steps) < 2:
        return None
    parts = [part for _, part in steps]
    bounds = np.cumsum([0] + [len(part.rows) for part in parts]).tolist()
    with _gathering(options):
        arrays = read_warm(np.concatenate([part.shards for part in parts]),
                           np.concatenate([part.rows for part in parts]))
    if arrays is None:
        return None
    split = {name: value.split(bounds) if isinstance(value, Ragged) else
             [value[a:b] for a, b in itertools.pairwise(bounds)]
             for name, value in arrays.items()}
    return [_with_keys(options, tail, feed, ref, part,
                       {name: pieces[k] for name, pieces in split.items()})
            for k, (ref, part) in enumerate(steps)]


def _gathering(options: StreamOptions) -> contextlib.AbstractContextManager[None]:
    """The form the options' batches gather ``bytes`` fields in (:func:`gathering`)."""
    return gathering(options.ragged, transform=options.transform is not None,
                     batch_transform=options.batch_transform is not None)


def _with_keys(options: StreamOptions, tail: TailPolicy, feed: ShardFeed | MixtureFeed,
               ref: StepRef, part: RankBatch, arrays: dict[str, Any]) -> dict[str, Any]:
    """A step's arrays with the keys that come from its plan: the sample ids (a mixture: the
    source too), the padding flags and the per-sample seeds where they are asked for."""
    arrays.update(feed.batch_keys(part.sample_ids))
    if tail is TailPolicy.PAD:
        arrays[PADDING_KEY] = part.is_padding
    if transformed(options) or options.with_seeds:
        arrays[SEED_KEY] = plan_sample_seeds(options.seed, ref.epoch, part.sample_ids)
    return arrays


def sample_columns(options: StreamOptions, fields: Mapping[str, Field],
                   arrays: dict[str, Any]) -> SampleColumns | None:
    """The per-sample values a per-sample transform's dicts are made of (each
    ``__seed__`` a Python int), made where the step is read (a reader thread), so that the
    loop's thread only makes the dicts and transforms them; None without a per-sample
    transform or for an empty part."""
    if options.transform is None or len(arrays[ID_KEY]) == 0:
        return None
    return batching_columns(_with_int_seeds(arrays), fields)


def _with_int_seeds(arrays: dict[str, Any]) -> dict[str, Any]:
    samples_arrays = dict(arrays)
    samples_arrays[SEED_KEY] = np.asarray(arrays[SEED_KEY], dtype=np.uint64).tolist()
    return samples_arrays


def finish(options: StreamOptions, fields: Mapping[str, Field], ref: StepRef,
           arrays: dict[str, Any], first_of_step: Callable[[], dict[str, Any]],
           samples: SampleColumns | None = None) -> Any:
    """Transform (if any) and convert one step's arrays to the batch the loop receives.

    ``first_of_step()`` reads the raw arrays of the step's first sample: the template of an
    empty part (a transform's output has a structure only a sample can show). A transform
    runs with the process-wide RNGs seeded and restored after, so this must run on one
    thread at a time. ``samples``: :func:`sample_columns` of ``arrays``, where made already.
    """
    if not transformed(options):
        return tensors(options, fields, arrays)
    # In a worker process nothing else draws from its generators: nothing to put back.
    with preserved_global_rngs() if get_worker_info() is None else contextlib.nullcontext():
        seeder = process_seeder()
        seeder(step_seed(options.seed, ref.epoch, ref.segment.step_span(ref.step)[0]))
        if options.transform is not None:
            if len(arrays[ID_KEY]) == 0:  # an empty part of a "split" tail
                return empty_like(_transform_samples(options, fields, first_of_step(),
                                                     seeder))
            return _transform_samples(options, fields, arrays, seeder, samples)
        assert options.batch_transform is not None
        return tensors(options, fields, apply_batch_transform(arrays, options.batch_transform))


def _transform_samples(options: StreamOptions, fields: Mapping[str, Field],
                       arrays: dict[str, Any], seeder: GlobalRngSeeder,
                       samples: SampleColumns | None = None) -> Any:
    assert options.transform is not None
    return apply_sample_transform(arrays if samples is not None else _with_int_seeds(arrays),
                                  fields, options.transform, options.collate_fn, seeder,
                                  samples=samples)


def tensors(options: StreamOptions, fields: Mapping[str, Field],
            arrays: Mapping[str, Any]) -> dict[str, Any]:
    """A step's arrays as the tensors of a batch."""
    out = dict(arrays)
    if SEED_KEY in out and isinstance(out[SEED_KEY], np.ndarray):
        out[SEED_KEY] = out[SEED_KEY].view(np.int64)  # torch has no full uint64 support
    return to_torch(out, fields, ragged=options.ragged, pad_value=options.pad_value)
