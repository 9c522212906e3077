"""Which rank of how many ranks this process is, resolved when a pass starts, never guessed.

A loader is often made before the process group exists: in a ``LightningModule.__init__``,
or before ``Trainer.fit`` starts the other processes. Its rank is therefore not taken when it
is made but when a pass over it starts (by then the trainer has made the process group).
Where nothing names the rank but the environment says the job is distributed (Lightning's
launcher sets ``LOCAL_RANK`` and ``WORLD_SIZE``, not ``RANK``, before the group exists), the
answer "rank 0 of 1" would make every rank read every global batch whole; that is refused.
Read before a pass (``dataset.rank``), the topology is the answer of that moment: in
Lightning's launching process, before ``trainer.fit`` makes the group, nothing says the job
is distributed, so it is 0 of 1 there; the pass itself takes the group's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, StreamcacheError
from ..integrations.accelerate import refuse_accelerate_world_mismatch
from ..plan import PlanError
from .agreement import agreed_nodes, gather_views, local_view

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
    fix = ("The rank is taken where it is needed: when a pass starts, or when "
           "dataset.rank, .world_size, .topology or, with batch_size=, len() is read. Making "
           "the dataset and loader before the group exists is fine (in a LightningModule's "
           "__init__, say); reading their rank there is not: read it after "
           "torch.distributed.init_process_group (with Lightning: in setup() or later, where "
           "self.global_rank is known too), or pass rank= and world_size= explicitly.")
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
        ConfigError: the world size taken from the process group or the environment is
            not the number of processes Hugging Face Accelerate's state counts (see
            :func:`~streamcache.integrations.accelerate.refuse_accelerate_world_mismatch`).
    """
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank() if rank is None else rank
            if world_size is None:
                world_size = torch.distributed.get_world_size()
                refuse_accelerate_world_mismatch(world_size, "torch.distributed's process group")
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank = _env_int("RANK") if rank is None else rank
            if world_size is None:
                world_size = _env_int("WORLD_SIZE")
                assert world_size is not None
                refuse_accelerate_world_mismatch(world_size, "the environment (WORLD_SIZE)")
        else:
            _refuse_guess(rank, world_size)
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    assert rank is not None and world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise PlanError(f"rank {rank} is impossible with world size {world_size}")
    return rank, world_size


@dataclass(frozen=True)
class NodeTopology:
    """Where a rank runs: ranks ``[n * L, (n + 1) * L)`` are node ``n``'s, ``L`` ranks a node
    (contiguous, as torchrun numbers them).

    Raises:
        PlanError: an impossible combination (the world not a multiple of the node count).
    """

    rank: int
    world_size: int
    num_nodes: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise PlanError(f"rank {self.rank} is impossible with world size {self.world_size}")
        if self.num_nodes < 1 or self.world_size % self.num_nodes:
            raise PlanError(f"{self.num_nodes} nodes cannot share {self.world_size} ranks: "
                            "every node must run the same number of ranks (the world size "
                            "must be a multiple of the node count)")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    @property
    def node_rank(self) -> int:
        """This rank's node, ``0 .. num_nodes - 1``."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index among its node's ranks."""
        return self.rank % self.ranks_per_node


def check_nodes_option(nodes: int | None) -> int | None:
    """``nodes=`` as given to a dataset: None or an int >= 1, else a :class:`ConfigError`."""
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int)
                              or nodes < 1):
        raise ConfigError(f"nodes must be an integer >= 1 (the number of nodes the ranks run "
                          f"on), or None to take it from the launcher; got {nodes!r}")
    return nodes


def resolve_nodes(rank: int, world_size: int, nodes: int | None = None, *,
                  collective: bool = True,
                  job: Sequence[tuple[str, Any]] = ()) -> NodeTopology:
    """How many nodes the ranks run on, and this rank's, when a pass starts.

    In order: ``nodes`` (the dataset's argument; ``nodes=1`` turns locality off); else
    torchrun's environment (``LOCAL_WORLD_SIZE``, checked against ``GROUP_RANK`` or
    ``NODE_RANK`` and ``LOCAL_RANK``) when it describes this job (its ``WORLD_SIZE`` and
    ``RANK``, where set, are ``world_size`` and ``rank``); else the host names of the ranks;
    else one node.

    With ``collective`` and a process group of this job's ranks (its rank and size are
    ``rank`` and ``world_size``), the ranks agree (:mod:`streamcache.loading.agreement`: one
    ``all_gather_object``, so every rank of the group must be starting a pass): the same
    world size, node count and ``job`` (global batch, data, cursor) on every rank, or a
    :class:`PlanError` on every rank naming what differs on which ranks.

    Raises:
        PlanError: a topology that cannot be (``LOCAL_WORLD_SIZE`` not dividing the world
            size, a node or local rank that contradicts contiguous numbering, hosts whose
            ranks are not contiguous or not equally many, ``nodes`` not dividing the world),
            or ranks that disagree.
        ConfigError: ``nodes`` is not an integer >= 1 (without a process group).
    """
    if collective and world_size > 1 and _group_matches(rank, world_size):
        try:
            local, source = _local_nodes(rank, world_size, nodes)
            if local is not None:
                NodeTopology(rank, world_size, local)  # (checked before it is gathered)
            error = ""
        except StreamcacheError as exc:  # told to every rank: none waits for this one
            local, source, error = None, "", str(exc)
        views = gather_views(local_view(rank, world_size, local, source, job, error))
        return NodeTopology(rank, world_size, agreed_nodes(views))
    local, _ = _local_nodes(rank, world_size, nodes)
    return NodeTopology(rank, world_size, local or 1)


def _local_nodes(rank: int, world_size: int, nodes: int | None) -> tuple[int | None, str]:
    """The node count this rank's own settings give, and where it comes from: ``nodes``,
    else ``LOCAL_WORLD_SIZE`` where the environment describes this job; (None, why not)."""
    if nodes is not None:
        return check_nodes_option(nodes), f"nodes={nodes}"
    per_node = _env_ranks_per_node(rank, world_size)
    if per_node is not None:
        return world_size // per_node, f"LOCAL_WORLD_SIZE={per_node}"
    per_node, env_world = _env_int("LOCAL_WORLD_SIZE"), _env_int("WORLD_SIZE")
    if per_node is not None and env_world is not None and env_world != world_size:
        return None, (f"LOCAL_WORLD_SIZE={per_node} ignored: this rank's WORLD_SIZE="
                      f"{env_world} is not the job's {world_size}")
    return None, ""


def _env_ranks_per_node(rank: int, world_size: int) -> int | None:
    """``LOCAL_WORLD_SIZE`` where the environment describes this job, checked; else None."""
    per_node = _env_int("LOCAL_WORLD_SIZE")
    env_world, env_rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    if per_node is None or (env_world is not None and env_world != world_size) or (
            env_rank is not None and env_rank != rank):
        return None  # another launcher, or rank= and world_size= describing another job
    fix = "pass nodes= explicitly (nodes=1 reads without locality)"
    if per_node < 1 or world_size % per_node:
        raise PlanError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size "
                        f"{world_size}: every node must run the same number of ranks; {fix}")
    for name in ("GROUP_RANK", "NODE_RANK"):
        node = _env_int(name)
        if node is not None and node != rank // per_node:
            raise PlanError(f"{name}={node} but rank {rank} with {per_node} ranks a node is on "
                            f"node {rank // per_node}: the ranks of a node must be numbered "
                            f"contiguously (as torchrun does); {fix}")
    local = _env_int("LOCAL_RANK")
    if local is not None and local != rank % per_node:
        raise PlanError(f"LOCAL_RANK={local} but rank {rank} is local rank {rank % per_node} "
                        f"of its node with {per_node} ranks a node: the ranks of a node must "
                        f"be numbered contiguously (as torchrun does); {fix}")
    return per_node


def _group_matches(rank: int, world_size: int) -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized()
                and dist.get_world_size() == world_size and dist.get_rank() == rank)


__all__ = ["NodeTopology", "check_nodes_option", "resolve_nodes", "resolve_topology"]
