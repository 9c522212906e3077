"""The rank, world size and node layout of a StreamDataset's passes.

They are resolved when a pass starts, not when the dataset is made (users make loaders
before the process group exists), and kept for the pass: worker processes receive them with
the dataset rather than resolving again in a process that has no group. Before a pass they
are resolved on demand, without asking the process group (docs/design.md, "Topology").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from ..plan import PlanError
from .feed import ShardFeed
from .mixture import MixtureFeed
from .nodes import NodeLocality, fingerprint_of
from .options import StreamOptions
from .topology import resolve_topology


class PassTopology:
    """A dataset's topology (``(rank, world_size)``) and node locality, as resolved when the
    last pass started (:meth:`start`), else resolved when asked.

    Thread safety: :meth:`start` runs where a pass starts (one thread); the rest reads.
    """

    def __init__(self, options: StreamOptions, feed: ShardFeed | MixtureFeed) -> None:
        self._options = options
        self._feed = feed
        self._topology: tuple[int, int] | None = None  # as resolved when the last pass started
        self._locality: NodeLocality | None = None  # as resolved when the last pass started

    @property
    def topology(self) -> tuple[int, int]:
        """``(rank, world_size)``: as resolved when the last pass started, else resolved now
        (see :func:`~streamcache.loading.topology.resolve_topology`)."""
        if self._topology is not None:
            return self._topology
        return resolve_topology(self._options.rank, self._options.world_size)

    def global_batch(self) -> int:
        """Samples per step over all ranks (with ``batch_size``, this needs the topology)."""
        opts = self._options
        if opts.global_batch_size is not None:
            return opts.global_batch_size
        return int(opts.batch_size or 0) * self.topology[1]

    def locality(self, cursor: Any) -> NodeLocality:
        """This rank's node: which slots of a batch it reads and which shards its node
        caches; as resolved when the last pass started, else now (without asking the
        process group)."""
        if self._locality is not None:
            return self._locality
        return NodeLocality.resolve(cursor, *self.topology, self._options.nodes,
                                    collective=False, layout=self.unit_layout(),
                                    global_batch=self.global_batch(),
                                    first_order=self.first_order(cursor))

    def start(self, cursor: Any) -> tuple[int, int]:
        """A pass starts at ``cursor``: resolve the topology and the node layout now (the
        ranks agree on it where a process group exists), check the cache budget against
        it, and point the feed at this node's share. Returns the topology."""
        self._topology = resolve_topology(self._options.rank, self._options.world_size)
        self._locality = NodeLocality.resolve(cursor, *self._topology, self._options.nodes,
                                              layout=self.unit_layout(), job=self._job(cursor),
                                              global_batch=self.global_batch(),
                                              first_order=self.first_order(cursor))
        self.check_budget(self._locality.num_nodes)
        self._feed.use_locality(self._locality)
        return self._topology

    def known_nodes(self, cursor: Any) -> int | None:
        """The node count where it is known before a pass (None: at the pass)."""
        if self._options.nodes is not None:
            return self._options.nodes
        try:
            return self.locality(cursor).num_nodes
        except PlanError:  # (e.g. a launcher's variables before the process group exists)
            return None

    def check_budget(self, nodes: int | None) -> None:
        """``cache_limit`` against what the node's cache must hold (the whole working set,
        or with several nodes the node's share); nothing while the node count is unknown."""
        limit = self._options.cache_limit
        if limit is None or nodes is None:
            return
        if isinstance(self._feed, ShardFeed):
            self._feed.check_budget(limit, nodes)
        else:
            self._feed.check_budget(limit)

    def _job(self, cursor: Any) -> list[tuple[str, Any]]:
        """What every rank must see alike when a pass starts (checked where a process group
        exists: see loading/agreement.py)."""
        state = hashlib.blake2b(json.dumps(cursor.to_dict(), sort_keys=True).encode(),
                                digest_size=6).hexdigest()
        where = f"epoch {cursor.epoch}, {getattr(cursor, 'samples_consumed', '?')} samples in"
        return [("the global batch", self.global_batch()),
                ("the data", fingerprint_of(cursor)),
                ("the loader state", f"{where} (state {state})")]

    def first_order(self, cursor: Any) -> Callable[[], Any] | None:
        """The order of epoch 0, made when called (a dataset's; None for a mixture, whose
        pieces held twice are drawn blind)."""
        make = getattr(self._feed, "first_order", None)
        return None if make is None else (lambda: make(cursor))

    def unit_layout(self) -> Callable[[int], Any] | None:
        """How the shards are cut into units for a node count."""
        return getattr(self._feed, "unit_layout", None)
