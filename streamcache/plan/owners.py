"""Which node owns which piece of the data, and which pieces two nodes hold (multi-node
locality, :mod:`streamcache.plan.locality`).

The pieces of a shard (:mod:`streamcache.plan.units`) are dealt to the nodes round-robin from
an offset drawn per shard (a hash of the dataset's key and the shard), so any ``N``
consecutive pieces of a shard lie on ``N`` different nodes. A fraction of the pieces also has
a backup node (:func:`dual_fraction`). Pure; no I/O.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ._util import check_int
from .bijection import counter_hash, derive_key
from .flows import FLOW_MAX_NODES
from .units import UnitLayout

TAG_NODES = 5  # domain tag of the per-shard offsets (see bijection's tags)
TAG_DUAL = 7  # domain tag of the pieces held by two nodes, and their backups


def locality_key(fingerprint: str) -> int:
    """The 64-bit key of the piece-to-node assignment of a dataset (or mixture) fingerprint:
    the same on every node and every epoch."""
    digest = hashlib.blake2b(fingerprint.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_offsets(key: int, shards: np.ndarray, num_nodes: int) -> np.ndarray:
    """The node that owns piece 0 of each shard (int64); piece ``j`` is on
    ``(offset + j) % num_nodes``."""
    shards = np.asarray(shards, dtype=np.int64)
    if num_nodes == 1:
        return np.zeros(shards.shape, dtype=np.int64)
    hashed = counter_hash(derive_key(key, TAG_NODES), shards)
    return (hashed % np.uint64(num_nodes)).astype(np.int64)


def piece_owners(key: int, layout: UnitLayout, shards: np.ndarray, rows: np.ndarray,
                 num_nodes: int) -> np.ndarray:
    """The node (int64) that owns the piece holding each (shard, row).

    Raises:
        PlanError: ``num_nodes`` below 1.
    """
    check_int("num_nodes", num_nodes, minimum=1)
    shards = np.asarray(shards, dtype=np.int64)
    pieces = layout.piece_index(shards, rows)
    return (shard_offsets(key, shards, num_nodes) + pieces) % num_nodes


#: Rows a chunk must hold for pieces to be held twice: below, a sample read from another
#: node's piece costs about itself (a chunk of a few rows), less than holding pieces twice.
DUAL_MIN_CHUNK_ROWS = 4


def dual_fraction(num_nodes: int, global_batch: int | None, chunk_rows: int = 64) -> float:
    """The fraction of pieces held by two nodes (their owner and a backup), for chunks of
    ``chunk_rows`` rows (the layout's typical).

    None with two nodes or fewer: the chunks a node reads of the other's pieces, which it
    keeps, do that job (the released samples come from the same few chunks). None beyond
    :data:`~streamcache.plan.flows.FLOW_MAX_NODES` nodes, where the flow that uses them would
    cost more per step than the split may, nor with chunks of fewer than
    :data:`DUAL_MIN_CHUNK_ROWS` rows (large samples). Else enough that a step's imbalance,
    about ``sqrt(B/N)`` samples a node, can mostly move at no cost: ``2.3 / sqrt(B/N)`` (the
    best of those simulated at 128 and 32 samples a node: docs/multinode.md), at most 0.6.
    """
    if (num_nodes <= 2 or num_nodes > FLOW_MAX_NODES or not global_batch
            or chunk_rows < DUAL_MIN_CHUNK_ROWS):
        return 0.0
    return min(0.6, 2.3 / float(np.sqrt(max(1.0, global_batch / num_nodes))))


def typical_chunk_rows(layout: UnitLayout | None) -> int:
    """The median rows per chunk of a layout's cut shards (0: none is cut)."""
    return 0 if layout is None else layout.typical_chunk_rows()


__all__ = ["DUAL_MIN_CHUNK_ROWS", "TAG_DUAL", "TAG_NODES", "dual_fraction", "locality_key",
           "piece_owners", "shard_offsets", "typical_chunk_rows"]
