"""A model of the remote bytes each node of a multi-node job fetches in one epoch.

Real node processes (benchmarks/bench_multinode.py, tests/test_multinode.py) measure the bytes
at 2 to 8 nodes on this machine; 16 and 64 nodes would take 16-64 processes each importing
torch per job. This model computes the same bytes from the plan alone, by what the readers do
(docs/multinode.md, "What a node holds and reads"), and tests/test_multinode.py checks it
against the real processes at 2, 4 and 8 nodes:

- a node downloads every piece it holds (owner or backup) that the epoch reads: its prefetcher
  is advised them all; a piece of a cut shard is the bytes of its chunks (from the shard's
  footer), a shard that is not cut is one piece, the whole file;
- a row it reads of a piece it does not hold costs its chunk, once (a chunk unit, kept: no
  ``cache_limit``); of a shard that is not cut, the row's chunk in every step that reads it
  (read by range, nothing installed);
- every rank process reads the footer of each shard it installs units of, once.

Usage: ``node_bytes(folder, global_batch, nodes, ranks_per_node, partitions)`` -> bytes per
node (a list); the folder is a dataset written by ShardWriter (local, so footers are read
from disk; the layout is the one a remote job would use).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from streamcache import StreamDataset, load_index
from streamcache.format.chunks import record_batch_blocks, tail_size
from streamcache.loading.nodes import NodeLocality


def shard_chunk_bytes(path: str) -> tuple[np.ndarray, int, int]:
    """(bytes of every chunk, bytes of the file's tail, file size) of one shard."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(size - 10)
        end = f.read(10)
        tail_bytes = tail_size(end, size)
        f.seek(size - tail_bytes)
        tail = f.read(tail_bytes)
    blocks = record_batch_blocks(tail, size)
    return np.array([b.length for b in blocks], dtype=np.int64), tail_bytes, size


class _Shards:
    """Per shard: prefix sums of its chunks' bytes, its tail and its size."""

    def __init__(self, folder: str, index: Any) -> None:
        self.prefix, self.tail, self.size = [], [], []
        for info in index.shards:
            chunks, tail, size = shard_chunk_bytes(os.path.join(folder, info.path))
            self.prefix.append(np.concatenate(([0], np.cumsum(chunks))))
            self.tail.append(tail)
            self.size.append(size)

    def chunk_span_bytes(self, shard: int, first: int, stop: int) -> int:
        prefix = self.prefix[shard]
        stop = min(stop, prefix.size - 1)
        return int(prefix[stop] - prefix[first])


def node_bytes(folder: str, global_batch: int, nodes: int, ranks_per_node: int = 1,
               partitions: int = 0, seed: int = 0, key: int | None = None) -> list[int]:
    """The remote shard bytes each node fetches in one epoch (see the module docstring);
    ``key``: another piece-to-node key than the dataset's (to see how the bytes vary with
    it: the key is a hash of the dataset's fingerprint)."""
    index = load_index(folder)
    world = nodes * ranks_per_node
    with tempfile.TemporaryDirectory(prefix="multinode-model-") as scratch:
        data = StreamDataset(folder, global_batch_size=global_batch, rank=0, world_size=world,
                             nodes=nodes, partitions=partitions, seed=seed, cache_dir=scratch)
        locality = data.locality
        order = data.order(0)
        if key is not None:
            locality = NodeLocality(locality.topology, key, locality.layout, global_batch,
                                    partitions, None if partitions else order)
        steps = len(data)
        data.close()
    split, layout = locality.split, locality.layout
    if split is None or layout is None:
        raise ValueError("the model is of a job on several nodes")
    shards_info = _Shards(folder, index)
    sizes = [global_batch // world] * world
    _, shards, rows, readers = split.nodes_many(
        order, np.arange(steps, dtype=np.int64) * global_batch, sizes)
    every_shard, every_row = order.locate(0, order.num_samples)
    chunk_of_shard = np.concatenate([block[3] for block in layout.scan()])  # (0: not cut)
    cut = chunk_of_shard > 0
    result = []
    for node in range(nodes):
        total = 0
        touched: set[int] = set()
        held = split.holds(every_shard, every_row, node)
        pieces = np.unique(layout.piece_of(every_shard[held], every_row[held]))
        for piece in pieces.tolist():
            shard, first_row, piece_rows = layout.span(piece)
            if cut[shard]:
                chunk = int(chunk_of_shard[shard])
                total += shards_info.chunk_span_bytes(shard, first_row // chunk,
                                                      -(-(first_row + piece_rows) // chunk))
                touched.add(shard)
            else:
                total += shards_info.size[shard]
        mine = readers == node
        foreign = mine & ~split.holds(shards, rows, node)
        f_shards, f_rows = shards[foreign], rows[foreign]
        f_steps = np.nonzero(foreign)[0]
        in_cut = cut[f_shards]
        chunk_rows = np.maximum(chunk_of_shard[f_shards], 1)
        chunks = np.unique(np.stack([f_shards[in_cut], (f_rows // chunk_rows)[in_cut]]), axis=1)
        for shard, chunk in chunks.T.tolist():
            total += shards_info.chunk_span_bytes(shard, chunk, chunk + 1)
            touched.add(shard)
        by_step = np.unique(np.stack([f_steps[~in_cut], f_shards[~in_cut],
                                      (f_rows // chunk_rows)[~in_cut]]), axis=1)
        for _, shard, chunk in by_step.T.tolist():
            total += shards_info.chunk_span_bytes(shard, chunk, chunk + 1)
        total += ranks_per_node * sum(shards_info.tail[shard] for shard in touched)
        result.append(total)
    return result
