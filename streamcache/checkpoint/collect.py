"""The first phase of a save: this rank's DCP state dict and the bytes of ``global.json``,
with the ranks' agreement that their global states are identical (one small all-gather)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from ..format.checksum import checksum_bytes
from . import layout, rng
from .errors import CheckpointError
from .lease import Lease
from .ranks import Ranks
from .state import is_global_state


def collect(entries: Mapping[str, Any], ranks: Ranks, lease: Lease | None,
            ) -> tuple[dict[str, Any], bytes]:
    """This rank's DCP state dict and the bytes of ``global.json`` (``entries``: resolved;
    ``lease``: rank 0's, confirmed in the same collective). All ranks call it.

    Raises:
        CheckpointError: a reserved key, a global state that is not JSON-able or differs
            between ranks, or a lost lease; the save is not started.
    """
    for key in entries:
        if key.startswith("_streamcache"):
            raise CheckpointError(f"state key {key!r}: keys starting with _streamcache "
                                  "are reserved; rename it")
    state_dict: dict[str, Any] = {}
    global_states: dict[str, Any] = {}
    for key, value in entries.items():
        if is_global_state(value):
            global_states[key] = value.state_dict()
        elif isinstance(value, Stateful):
            state_dict[key] = value.state_dict()
        else:
            state_dict[key] = value
    try:
        states_bytes = layout.json_bytes(global_states)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"a global state is not JSON-able ({exc}); global states "
            "(global_state=True or GlobalState) must be small JSON-able dicts"
        ) from exc
    # one small all-gather: the ranks' global states must agree, and each rank's keys
    # are recorded so that a load can tell a partial state from a complete one
    lease_problem = lease.confirm() if lease is not None else None
    gathered = ranks.all_gather(
        (checksum_bytes(states_bytes), sorted(state_dict), lease_problem),
        ranks.control)
    if gathered[0][2] is not None:
        raise CheckpointError(f"{gathered[0][2]}; this save was not started")
    digests = [digest for digest, _, _ in gathered]
    if len(set(digests)) != 1:
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        raise CheckpointError(
            f"global states differ between ranks (ranks {differing} differ from "
            "rank 0); a global state must be identical on every rank: wrap only "
            "rank-independent state in GlobalState"
        )
    state_dict[rng.rng_key(ranks.rank)] = rng.encode(rng.capture())
    global_bytes = layout.json_bytes({"version": 1, "states": global_states,
                                      layout.K_RANK_KEYS: [keys for _, keys, _ in gathered]})
    return state_dict, global_bytes
