"""Helpers shared by the loader tests: small datasets and epoch bookkeeping."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from streamcache import write_dataset
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader


def make_dataset(folder: str, shard_rows: Iterable[int], *, seq: bool = True) -> str:
    """A local dataset whose sample i holds x == i (and a sequence of length i % 5)."""
    url = os.path.join(folder, "ds")
    sizes = list(shard_rows)
    start = 0
    samples: list[dict[str, Any]] = []
    for rows in sizes:
        samples.extend({"x": i, **({"t": np.arange(i % 5, dtype=np.int32)} if seq else {})}
                       for i in range(start, start + rows))
        start += rows
    write_exact_shards(url, sizes, samples)
    return url


def write_exact_shards(url: str, sizes: list[int], samples: list[dict[str, Any]]) -> None:
    from streamcache.format.writer import ShardWriter

    with ShardWriter(url, shard_size=1 << 40, compression=None) as writer:
        position = 0
        for rows in sizes:
            for sample in samples[position:position + rows]:
                writer.write(sample)
            position += rows
            writer.cut()  # shard sizes exactly as asked


def loader(url: str, cache: str, *, rank: int = 0, world: int = 1, workers: int = 0,
           **options: Any) -> StreamLoader:
    options.setdefault("global_batch_size", 8)
    dataset = StreamDataset(url, rank=rank, world_size=world, cache_dir=cache, **options)
    # workers > 0 here means worker processes, even without a transform
    return StreamLoader(dataset, num_workers=workers, worker_mode="process")


def ids_of(batch: dict[str, Any]) -> np.ndarray:
    value = batch["__id__"]
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


__all__ = ["ids_of", "loader", "make_dataset", "write_dataset"]
