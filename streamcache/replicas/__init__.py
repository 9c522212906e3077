"""Replica-group fault tolerance: exactly-once data while data-parallel replicas drop out and
rejoin (the FT-HSDP / torchft regime).

- :class:`ReplicaPlan` and :class:`Ledger` (pure): which slice of the global batch every
  group reads at every step, and the slices not yet committed.
- :class:`ReplicaLoader`: a loader over a :class:`~streamcache.StreamDataset` that hands this
  rank its part of its group's slice and moves the ledger by the committed groups.
- :class:`QuorumAdapter` (:class:`ProcessGroupQuorum`, :class:`TorchftQuorum`): how a
  fault-tolerance library tells the loader who committed, and how a rejoining group gets the
  loader state from a live peer.

See docs/replicas.md for the design.
"""

from __future__ import annotations

from .adapters import (
    LOADER_STATE_KEY,
    ProcessGroupQuorum,
    QuorumAdapter,
    TorchftQuorum,
    broadcast_state,
    groups_of,
    send_state,
)
from .ledger import LEDGER_VERSION, PAD_SLICE, Ledger, ReplicaPlan, replay
from .loader import STATE_VERSION, ReplicaError, ReplicaLoader, positions_of

__all__ = [
    "LEDGER_VERSION",
    "LOADER_STATE_KEY",
    "PAD_SLICE",
    "STATE_VERSION",
    "Ledger",
    "ProcessGroupQuorum",
    "QuorumAdapter",
    "ReplicaError",
    "ReplicaLoader",
    "ReplicaPlan",
    "TorchftQuorum",
    "broadcast_state",
    "groups_of",
    "positions_of",
    "replay",
    "send_state",
]
