"""Which rank of how many ranks this process is, resolved when a pass starts, never guessed.

A loader is often made before the process group exists: in a ``LightningModule.__init__``,
or before ``Trainer.fit`` starts the other processes. Its rank is therefore not taken when it
is made but when a pass over it starts (by then the trainer has made the process group).
Where nothing names the rank but the environment says the job is distributed (Lightning's
launcher sets ``LOCAL_RANK`` and ``WORLD_SIZE``, not ``RANK``, before the group exists), the
answer "rank 0 of 1" would make every rank read every global batch whole; that is refused.
"""

from __future__ import annotations

import os

import torch

from ..plan import PlanError

# Variables that launchers (torchrun, Lightning, accelerate, DeepSpeed) set in every process of
# a distributed job, with the value each takes in a job of one process.
_DISTRIBUTED_ENV = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1}


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"the environment variable {name}={value!r} is not an integer; fix "
                        "it, or pass rank= and world_size= explicitly") from None


def _distributed_markers() -> list[str]:
    """``NAME=value`` for each launcher variable that says this is not a one-process job."""
    markers = []
    for name, alone in _DISTRIBUTED_ENV.items():
        value = _env_int(name)
        if value is not None and value != alone:
            markers.append(f"{name}={value}")
    return markers


def _refuse_guess(rank: int | None, world_size: int | None) -> None:
    """Raise where the default (rank 0 of 1) would be a guess the environment contradicts."""
    fix = ("Start iterating after torch.distributed.init_process_group (Lightning's Trainer "
           "makes the group before the first epoch, so a loader made in __init__ is fine), "
           "or pass rank= and world_size= explicitly.")
    if world_size is not None and world_size > 1 and rank is None:
        raise PlanError(f"world_size={world_size} without rank=, and there is no process group "
                        "or RANK to take the rank from: every process would read as rank 0 "
                        f"of {world_size}, the same samples. {fix}")
    markers = _distributed_markers()
    if markers:
        raise PlanError(f"the environment says this process belongs to a distributed job "
                        f"({', '.join(markers)}) but torch.distributed has no process group "
                        "yet: the loader would read as rank 0 of 1, and every rank would read "
                        f"every global batch whole. {fix}")


def resolve_topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` now: the arguments; else torch.distributed's process group; else
    ``RANK`` and ``WORLD_SIZE`` (torchrun); else 0 of 1 where nothing says otherwise.

    Call it when a pass starts, not when a loader is made (see the module docstring).

    Raises:
        PlanError: an impossible pair (rank outside ``[0, world_size)``); or no process group
            and no ``RANK`` while the environment says the job is distributed (``WORLD_SIZE``
            or ``LOCAL_WORLD_SIZE`` above 1, ``LOCAL_RANK`` above 0) or ``world_size`` above 1
            was given without ``rank``: reading as rank 0 would read other ranks' samples.
    """
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank() if rank is None else rank
            world_size = torch.distributed.get_world_size() if world_size is None else world_size
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank = _env_int("RANK") if rank is None else rank
            world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        else:
            _refuse_guess(rank, world_size)
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    assert rank is not None and world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise PlanError(f"rank {rank} is impossible with world size {world_size}")
    return rank, world_size


__all__ = ["resolve_topology"]
