"""Replica-group fault tolerance: exactly-once data while data-parallel replicas drop out and
rejoin (the FT-HSDP / torchft regime).

- :class:`ReplicaPlan` and :class:`Ledger` (pure): which slice of the global batch every
  group reads at every step, and the slices not yet committed.
- :class:`ReplicaLoader`: a loader over a :class:`~streamcache.StreamDataset` that hands this
  rank its part of its group's slice and moves the ledger by the committed groups.
- :class:`QuorumAdapter` and helpers: how a fault-tolerance library tells the loader who
  committed, and how a rejoining group gets the state from a live peer.

See docs/replicas.md for the design.
"""

from __future__ import annotations

from .ledger import LEDGER_VERSION, PAD_SLICE, Ledger, ReplicaPlan, replay

__all__ = ["LEDGER_VERSION", "PAD_SLICE", "Ledger", "ReplicaPlan", "replay"]
