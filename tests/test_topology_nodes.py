"""Tests of the node topology (streamcache/loading/topology.py: NodeTopology, resolve_nodes).

Which node a rank is on comes from the dataset's ``nodes=``, else torchrun's environment,
else the process group's host names; a topology that cannot be (a node count that does not
divide the world, ranks of a node not numbered contiguously) is refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Any

import pytest
from dist import run_ranks

from streamcache.errors import ConfigError
from streamcache.loading.agreement import RankView, agreed_nodes, nodes_from_hosts
from streamcache.loading.topology import (
    NodeTopology,
    check_nodes_option,
    resolve_nodes,
)
from streamcache.plan import PlanError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "NODE_RANK")


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch):
    """Sets a torchrun-style environment (and clears the launcher variables first)."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values: int | str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
    return set_env


def test_torchrun_environment_gives_the_node(torchrun_env) -> None:
    # rank 5 of 8, 4 ranks a node: node 1, local rank 1
    torchrun_env(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    topology = resolve_nodes(5, 8)
    assert topology == NodeTopology(5, 8, 2)
    assert (topology.node_rank, topology.local_rank, topology.ranks_per_node) == (1, 1, 4)


def test_no_launcher_is_one_node_and_nodes_argument_wins(torchrun_env) -> None:
    assert resolve_nodes(0, 1) == NodeTopology(0, 1, 1)
    assert resolve_nodes(3, 4) == NodeTopology(3, 4, 1)  # no LOCAL_WORLD_SIZE, no group
    torchrun_env(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    assert resolve_nodes(5, 8, nodes=1).num_nodes == 1  # locality off
    assert resolve_nodes(5, 8, nodes=8).node_rank == 5


def test_an_environment_of_another_job_is_not_used(torchrun_env) -> None:
    """rank= and world_size= that describe another grouping (e.g. each rank evaluating
    alone) do not take the launcher's node layout."""
    torchrun_env(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    assert resolve_nodes(0, 1) == NodeTopology(0, 1, 1)


@pytest.mark.parametrize("env, message", [
    (dict(RANK=2, WORLD_SIZE=6, LOCAL_WORLD_SIZE=4), "LOCAL_WORLD_SIZE=4 does not divide"),
    (dict(RANK=2, WORLD_SIZE=8, LOCAL_WORLD_SIZE=4, GROUP_RANK=1), "GROUP_RANK=1 but rank 2"),
    (dict(RANK=2, WORLD_SIZE=8, LOCAL_WORLD_SIZE=4, NODE_RANK=1), "NODE_RANK=1 but rank 2"),
    (dict(RANK=2, WORLD_SIZE=8, LOCAL_WORLD_SIZE=4, LOCAL_RANK=0), "LOCAL_RANK=0 but rank 2"),
    (dict(RANK=2, WORLD_SIZE=8, LOCAL_WORLD_SIZE=0), "LOCAL_WORLD_SIZE=0 does not divide"),
    (dict(RANK=2, WORLD_SIZE=8, LOCAL_WORLD_SIZE=-4), "LOCAL_WORLD_SIZE=-4 does not divide"),
    (dict(RANK=2, WORLD_SIZE=8, LOCAL_WORLD_SIZE="four"), "LOCAL_WORLD_SIZE='four' is not an"),
    (dict(RANK=2, WORLD_SIZE=8, LOCAL_WORLD_SIZE=4, GROUP_RANK="1.0"), "GROUP_RANK='1.0' is not"),
])
def test_inconsistent_environments_are_refused(torchrun_env, env, message) -> None:
    torchrun_env(**env)
    with pytest.raises(PlanError, match=message) as error:
        resolve_nodes(env["RANK"], env["WORLD_SIZE"])
    assert "nodes=" in str(error.value) or "is not an integer" in str(error.value)


def test_impossible_node_counts_are_refused() -> None:
    with pytest.raises(PlanError, match="3 nodes cannot share 8 ranks"):
        resolve_nodes(0, 8, nodes=3)
    with pytest.raises(PlanError, match="impossible"):
        NodeTopology(8, 8, 1)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="nodes must be an integer"):
            check_nodes_option(bad)  # type: ignore[arg-type]
    assert check_nodes_option(None) is None and check_nodes_option(4) == 4


def test_hosts_must_hold_contiguous_equal_runs_of_ranks() -> None:
    assert nodes_from_hosts(["a", "a", "b", "b"]) == 2
    assert nodes_from_hosts(["a"] * 3) == 1
    for hosts in (["a", "b", "a", "b"], ["a", "a", "b"], ["a", "b", "b", "b"]):
        with pytest.raises(PlanError, match="contiguous runs of equal length"):
            nodes_from_hosts(hosts)


def _views(nodes: list[int | None], **changes: list[object]) -> list[RankView]:
    views = [RankView(rank, len(nodes), n, "" if n is None else f"nodes={n}", f"h{rank // 2}",
                      (("the global batch", "8"),)) for rank, n in enumerate(nodes)]
    for name, values in changes.items():
        views = [dataclasses.replace(v, **{name: value}) for v, value in zip(
            views, values, strict=True)]
    return views


def test_gathered_views_must_agree_or_name_what_differs_and_where() -> None:
    """The check every rank runs on the gathered views (loading/agreement.py)."""
    assert agreed_nodes(_views([2, 2, 2, 2])) == 2
    assert agreed_nodes(_views([None] * 4)) == 2  # from the hosts: h0 h0 h1 h1
    cases = [
        (_views([2, 2, 4, 4]), r"node count: nodes=2 on ranks 0-1; nodes=4 on ranks 2-3"),
        (_views([2, 2, 2, None]), r"ranks 0-2 take it from their settings \(nodes=2\), "
                                  r"ranks 3 would take it from the hosts"),
        (_views([2] * 4, world_size=[4, 4, 4, 3]),
         r"world size: 4 on ranks 0-2; 3 on ranks 3"),
        (_views([2] * 4, rank=[0, 1, 1, 3]), r"rank 2 calls itself rank 1"),
        (_views([2] * 4, job=[(("the global batch", "8"),)] * 3 + [(("the global batch", "16"),)]),
         r"global batch: 8 on ranks 0-2; 16 on ranks 3"),
        (_views([2] * 4, error=["", "LOCAL_WORLD_SIZE=3 does not divide", "", ""]),
         r"impossible on some ranks \(rank 1: LOCAL_WORLD_SIZE=3 does not divide\)"),
    ]
    for views, message in cases:
        with pytest.raises(PlanError, match=message):
            agreed_nodes(views)


def test_a_dataset_refuses_a_node_count_its_world_cannot_have(tmp_path) -> None:
    from loader_helpers import make_dataset

    from streamcache import StreamDataset

    url = make_dataset(str(tmp_path), [10, 10], seq=False)
    with pytest.raises(PlanError, match="3 nodes cannot share 4 ranks"):
        StreamDataset(url, global_batch_size=4, world_size=4, nodes=3,
                      cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="nodes must be"):
        StreamDataset(url, global_batch_size=4, nodes=0, cache_dir=str(tmp_path / "cache"))
    dataset = StreamDataset(url, global_batch_size=4, rank=1, world_size=4, nodes=2,
                            cache_dir=str(tmp_path / "cache"))
    assert dataset.locality.topology == NodeTopology(1, 4, 2)


def _disagreeing_body(rank: int, world_size: int, url: str, cache: str) -> list[str]:
    """Phases of one job of 2 real ranks, each with settings that differ between them (or
    not); every phase's outcome on this rank: the error's message, or the ids it read and
    where it found itself."""
    from streamcache import StreamDataset, StreamLoader

    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    real_hostname = socket.gethostname

    def launcher(per_node: int, **more: str) -> dict[str, str]:
        return {"LOCAL_WORLD_SIZE": str(per_node), "LOCAL_RANK": str(rank % per_node), **more}

    phases: list[tuple[dict[str, str], dict[str, Any], str]] = [
        # torchrun's LOCAL_WORLD_SIZE 1 on rank 0, 2 on rank 1
        (launcher(1 + rank), {}, ""),
        # nodes= that differs per node
        (launcher(1), {"nodes": 2 - rank}, ""),
        # a stale WORLD_SIZE in rank 1's environment (its LOCAL_WORLD_SIZE is then not used)
        (launcher(1, WORLD_SIZE="3" if rank else "2"), {}, ""),
        # an impossible setting on one rank: the other is told, and does not wait for it
        (launcher(3 if rank else 1), {}, ""),
        # agreement: 2 nodes of 1 rank
        (launcher(1), {}, ""),
        # no launcher setting: the hosts decide (the same host: one node; two: two)
        ({}, {}, real_hostname()),
        ({}, {}, f"host-{rank}"),
        # canonical partitions on one rank only: another order
        (launcher(1), {"partitions": 8 if rank else 0}, ""),
    ]
    outcomes = []
    for env, options, host in phases:
        os.environ.clear()
        os.environ.update(base, **env)
        socket.gethostname = lambda host=host: host  # type: ignore[assignment]
        dataset = StreamDataset(url, global_batch_size=8, cache_dir=cache, **options)
        try:
            with StreamLoader(dataset) as loader:
                ids = [str(i) for batch in loader for i in batch["__id__"].tolist()]
            outcomes.append(f"{dataset.locality!r}: {' '.join(ids)}")
        except PlanError as error:
            outcomes.append(f"PlanError: {error}")
    socket.gethostname = real_hostname  # type: ignore[assignment]
    return outcomes


def test_ranks_that_disagree_on_the_layout_are_refused_on_every_rank(tmp_path) -> None:
    """Issue 21.1: real gloo ranks whose settings differ. Before, each rank split the batches
    its own way (samples read twice and never, no error) or waited forever in a collective
    only one rank made; now both get the same error, naming what differs where. With no
    launcher setting the process group's host names give the nodes."""
    from loader_helpers import make_dataset

    url = make_dataset(str(tmp_path), [12, 20, 16], seq=False)
    results = [r.value for r in run_ranks(_disagreeing_body, 2, url, str(tmp_path / "cache"),
                                          timeout_s=240)]
    expected = [r"node count: LOCAL_WORLD_SIZE=1 on ranks 0; LOCAL_WORLD_SIZE=2 on ranks 1",
                r"node count: nodes=2 on ranks 0; nodes=1 on ranks 1",
                r"ranks 0 take it from their settings \(LOCAL_WORLD_SIZE=1\), ranks 1 would "
                r"take it from the hosts \(LOCAL_WORLD_SIZE=1 ignored: this rank's WORLD_SIZE=3 "
                r"is not the job's 2\)",
                r"impossible on some ranks \(rank 1: LOCAL_WORLD_SIZE=3 does not divide"]
    for phase, message in enumerate(expected):
        for rank in range(2):
            assert re.search(message, results[rank][phase]), (phase, rank, results[rank][phase])
    for rank in range(2):  # (partitions= on rank 1 only: its cursor, so its order, differs)
        assert re.search(r"PlanError: .*the loader state", results[rank][7]), results[rank][7]
    for phase, nodes in ((4, 2), (5, 1), (6, 2)):
        read = []
        for rank in range(2):
            where, _, ids = results[rank][phase].partition(": ")
            assert where == f"NodeLocality(node {rank if nodes == 2 else 0} of {nodes}, rank " \
                            f"{rank} of 2)", results[rank][phase]
            read += [int(i) for i in ids.split()]
        assert sorted(read) == list(range(48))  # every sample once over the ranks
