"""How a fault-tolerance library connects to the :class:`ReplicaLoader`.

The loader needs two things from the library, and nothing else:

1. **the committed groups of every step**: the groups whose data is in the update that was
   applied (empty when the step was discarded). Every live rank must see the same set;
2. **state transfer**: a rejoining group gets ``loader.state_dict()`` of a live peer before
   it reads its first batch.

:class:`QuorumAdapter` is that contract. Two implementations:

- :class:`ProcessGroupQuorum`: plain ``torch.distributed`` (any backend), for a process group
  of the live ranks that the caller manages, one rank per group per rank index (the
  simulator in the tests, or a home-grown supervisor);
- :class:`TorchftQuorum`: torchft's ``Manager``; the loader state travels with torchft's
  own state transfer to healing replicas, and the committed groups come from one small
  all-reduce over the quorum's process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .loader import ReplicaLoader

LOADER_STATE_KEY = "streamcache_loader"


class QuorumAdapter(Protocol):
    """What a fault-tolerance library gives the loader: the groups of a step's update.

    ``participants()`` is collective over the step's live ranks: called once per step after
    the batch was used (alongside the gradient all-reduce), it returns the groups whose data
    went into this step's update. The training loop then reports
    ``participants() if committed else ()`` through ``loader.commit``.
    A rejoining group gets the loader state from a live peer before it reads: with torchft
    through its healing (:class:`TorchftQuorum` registers the state), elsewhere through
    :func:`send_state` or :func:`broadcast_state`.
    """

    def participants(self) -> frozenset[int]: ...


def _mask_to_groups(mask: torch.Tensor) -> frozenset[int]:
    return frozenset(int(g) for g in torch.nonzero(mask > 0.5).flatten().tolist())


class ProcessGroupQuorum:
    """:class:`QuorumAdapter` over a ``torch.distributed`` process group of the live ranks.

    Args:
        group: this rank's replica group.
        num_groups: replica groups ``G``.
        process_group: the live ranks of this step that share this rank's index in their
            group (None: the default group); every member calls the collectives.

    Thread safety: one training loop.
    """

    def __init__(self, group: int, num_groups: int, process_group: Any = None) -> None:
        self.group = group
        self.num_groups = num_groups
        self.process_group = process_group

    def participants(self) -> frozenset[int]:
        mask = torch.zeros(self.num_groups)
        mask[self.group] = 1.0
        if self.process_group is None:
            torch.distributed.all_reduce(mask)
        else:  # also a ProcessGroup built directly on a store, outside the default group
            self.process_group.allreduce([mask]).wait()
        return _mask_to_groups(mask)


def send_state(loader: ReplicaLoader, source: int, process_group: Any = None) -> int:
    """Broadcast the loader state of global rank ``source`` to every member of
    ``process_group``, which all load it; returns the state's size in bytes (JSON).

    Collective: every member calls it. No disk is touched.
    """
    import json

    state: list[Any] = [loader.state_dict() if torch.distributed.get_rank() == source
                        else None]
    torch.distributed.broadcast_object_list(state, src=source, group=process_group)
    loader.load_state_dict(state[0])
    return len(json.dumps(state[0]))


class TorchftQuorum:
    """:class:`QuorumAdapter` for a torchft ``Manager``.

    Construct it once, after the Manager and the loader; it registers the loader's state with
    the Manager, so a healing replica receives it with the model from a live peer. The
    Manager must run with ``use_async_quorum=False``: with an asynchronous quorum the healing
    replica's state arrives only in ``should_commit``, after its batch was read (torchft then
    lets it sit the step out, which is the "one batch behind" of its own data loading).

    Training loop (per step)::

        manager.start_quorum()                 # a healing group loads the loader state here
        batch = loader.next_batch()
        ...forward, backward, gradient all-reduce through the manager...
        groups = quorum.participants()         # one small all-reduce over the quorum
        loader.commit(groups if manager.should_commit() else ())

    A replica that is not participating (torchft zeroes its contribution) is not counted, so
    its slice is re-issued; a replica whose own commit failed while others committed is
    behind at the next quorum and torchft heals it from a peer, loader state included.
    """

    def __init__(self, manager: Any, loader: ReplicaLoader) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("TorchftQuorum needs Manager(use_async_quorum=False): a healing "
                             "replica must have the loader state before it reads its batch")
        self.manager = manager
        self.loader = loader
        manager.register_state_dict_fn(LOADER_STATE_KEY, loader.load_state_dict,
                                       loader.state_dict)

    def participants(self) -> frozenset[int]:
        from torch.distributed import ReduceOp

        mask = torch.zeros(self.loader.plan.num_groups)
        mask[self.loader.group] = 1.0
        self.manager.allreduce(mask, reduce_op=ReduceOp.SUM).wait()
        return _mask_to_groups(mask)


def broadcast_state(loader: ReplicaLoader, root: int, process_group: Any) -> int:
    """Like :func:`send_state`, for any ``ProcessGroup`` object (one built directly on a
    store too, as a fault-tolerance library reconfiguring per quorum does): ``root`` is the
    sender's rank *within* ``process_group``. Returns the state's size in bytes.
    """
    import json

    mine = process_group.rank() == root
    data = json.dumps(loader.state_dict()).encode() if mine else b""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = root
    size = torch.tensor([len(data)], dtype=torch.int64)
    process_group.broadcast([size], options).wait()
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine
               else torch.empty(int(size.item()), dtype=torch.uint8))
    process_group.broadcast([payload], options).wait()
    loader.load_state_dict(json.loads(payload.numpy().tobytes()))
    return int(size.item())


def groups_of(ranks: Sequence[int], group_size: int) -> frozenset[int]:
    """The replica groups of global ranks laid out group by group (rank // group_size)."""
    return frozenset(rank // group_size for rank in ranks)


__all__ = ["LOADER_STATE_KEY", "ProcessGroupQuorum", "QuorumAdapter", "TorchftQuorum",
           "broadcast_state", "groups_of", "send_state"]
