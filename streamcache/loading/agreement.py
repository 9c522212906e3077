"""The ranks of a job agree on its layout when a pass starts, or the pass is refused.

Every rank computes its part of a global batch alone, from what it resolved itself: the world
size, the node count, its node. Ranks that resolved different layouts (``LOCAL_WORLD_SIZE`` 2
on some ranks and 4 on others, a ``nodes=`` that differs per node, a stale ``WORLD_SIZE`` in
one rank's environment) would split the same batch differently: some samples read twice,
others never, and nothing would say so. So where a process group of the job's ranks exists,
a pass starts with one small collective (``all_gather_object`` of each rank's
:class:`RankView`, a few hundred bytes), and every rank checks the same gathered views:
:func:`agreed_nodes` returns the node count they agree on, or raises one
:class:`~streamcache.plan.PlanError` on every rank that names what differs and on which ranks.

The rule that makes a collective safe (docs/multinode.md): every rank of the process group
starts each pass (iterates the loader), as in data-parallel training. A rank reading alone
(an evaluation on rank 0) passes ``rank=`` and ``world_size=`` of its own, which describe
another job than the group's: no collective then.
"""

from __future__ import annotations

import socket
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..plan import PlanError

FIX = ("start every rank with the same launcher settings (torchrun sets LOCAL_WORLD_SIZE, "
       "GROUP_RANK and WORLD_SIZE for every rank) or pass the same nodes= on every rank")


@dataclass(frozen=True)
class RankView:
    """What one rank resolved alone when a pass starts.

    Attributes:
        rank, world_size: as resolved (the process group's, or the arguments).
        nodes: the node count this rank's own settings give (``nodes=`` or
            ``LOCAL_WORLD_SIZE``), None where they say nothing (the hosts decide).
        source: where ``nodes`` came from, for the message (``"nodes=2"``).
        host: the host name.
        job: what else every rank must see alike (global batch, data, cursor), as
            ``(name, value)`` pairs.
        error: what this rank's settings got wrong (raised on every rank once gathered, so
            that no rank waits in the collective for one that gave up before it).
    """

    rank: int
    world_size: int
    nodes: int | None
    source: str
    host: str
    job: tuple[tuple[str, str], ...] = ()
    error: str = ""


def local_view(rank: int, world_size: int, nodes: int | None, source: str,
               job: Sequence[tuple[str, Any]] = (), error: str = "") -> RankView:
    return RankView(rank, world_size, nodes, source, socket.gethostname(),
                    tuple((str(name), str(value)) for name, value in job), error)


def gather_views(view: RankView) -> list[RankView]:
    """Every rank's view (one ``all_gather_object`` on the default process group: every rank
    of it must be starting a pass)."""
    views: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, view)
    return [v if isinstance(v, RankView) else RankView(i, -1, None, "?", "?")
            for i, v in enumerate(views)]


def agreed_nodes(views: Sequence[RankView]) -> int:
    """The node count every rank's view agrees on (from the views' node counts, or from the
    hosts where no rank's settings say), checked: the same world size and job on every rank,
    each rank where the group puts it.

    Raises:
        PlanError: naming what differs and on which ranks.
    """
    world = len(views)
    errors = [f"rank {v.rank}: {v.error}" for v in views if v.error]
    if errors:
        raise PlanError(f"the job's layout is impossible on some ranks ({'; '.join(errors)})")
    wrong = [f"rank {i} calls itself rank {v.rank}" for i, v in enumerate(views) if v.rank != i]
    if wrong:
        raise PlanError(f"the ranks disagree on who they are ({'; '.join(wrong)}): {FIX}")
    _same("the world size", {v.rank: str(v.world_size) for v in views}, world)
    for name in sorted({name for v in views for name, _ in v.job}):
        _same(name, {v.rank: dict(v.job).get(name, "(none)") for v in views}, world)
    said = {v.rank: v.source for v in views if v.nodes is not None}
    if said and len(said) < world:
        silent = {v.rank: v.source or "no setting" for v in views if v.nodes is None}
        raise PlanError(f"the ranks disagree on the node count: ranks {_ranks(sorted(said))} "
                        f"take it from their settings ({_values(said)}), ranks "
                        f"{_ranks(sorted(silent))} would take it from the hosts "
                        f"({_values(silent)}): {FIX}")
    if said:
        _same("the node count", {v.rank: v.source for v in views}, world,
              key={v.rank: str(v.nodes) for v in views})
        return int(next(v.nodes for v in views if v.nodes is not None))
    return nodes_from_hosts([v.host for v in views])


def _same(what: str, values: dict[int, str], world: int,
          key: dict[int, str] | None = None) -> None:
    """Raise unless every rank has the same ``key`` (default: ``values``), naming the ranks
    of each value."""
    key = key or values
    groups: defaultdict[str, list[int]] = defaultdict(list)
    for rank in range(world):
        groups[key[rank]].append(rank)
    if len(groups) > 1:
        parts = [f"{values[ranks[0]]} on ranks {_ranks(ranks)}"
                 for ranks in sorted(groups.values())]
        raise PlanError(f"the ranks disagree on {what}: {'; '.join(parts)}. Every rank would "
                        f"split the global batch its own way (samples read twice, others "
                        f"never): {FIX}")


def _values(sources: dict[int, str]) -> str:
    return ", ".join(sorted(set(sources.values())))


def _ranks(ranks: Sequence[int]) -> str:
    """``0-3, 6`` for [0, 1, 2, 3, 6]."""
    runs: list[str] = []
    start = previous = None
    for rank in [*ranks, None]:
        if rank is not None and previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    return ", ".join(runs)


def nodes_from_hosts(hosts: Sequence[str]) -> int:
    """The node count of ranks on ``hosts`` (one name per rank): refused unless each host's
    ranks are contiguous and every host has as many."""
    runs = [host for i, host in enumerate(hosts) if i == 0 or host != hosts[i - 1]]
    per_node = len(hosts) // len(runs)
    if len(set(runs)) != len(runs) or any(host != runs[i // per_node]
                                          for i, host in enumerate(hosts)):
        raise PlanError(f"the ranks' hosts {list(hosts)} are not contiguous runs of equal "
                        "length: node locality needs the ranks of a node numbered contiguously "
                        "and as many ranks on every node (as torchrun does); pass nodes= "
                        "explicitly (nodes=1 reads without locality)")
    return len(runs)


__all__ = ["RankView", "agreed_nodes", "gather_views", "local_view", "nodes_from_hosts"]
