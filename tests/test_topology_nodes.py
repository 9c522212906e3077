"""Tests of the node topology (streamcache/loading/topology.py: NodeTopology, resolve_nodes).

Which node a rank is on comes from the dataset's ``nodes=``, else torchrun's environment,
else the process group's host names; a topology that cannot be (a node count that does not
divide the world, ranks of a node not numbered contiguously) is refused with a clear error.
"""

from __future__ import annotations

import socket

import pytest
from dist import run_ranks

from streamcache.errors import ConfigError
from streamcache.loading.topology import (
    NodeTopology,
    _nodes_from_hosts,
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

    def set_env(**values: int) -> None:
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
])
def test_inconsistent_environments_are_refused(torchrun_env, env, message) -> None:
    torchrun_env(**env)
    with pytest.raises(PlanError, match=message) as error:
        resolve_nodes(env["RANK"], env["WORLD_SIZE"])
    assert "nodes=" in str(error.value)


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
    assert _nodes_from_hosts(["a", "a", "b", "b"]) == 2
    assert _nodes_from_hosts(["a"] * 3) == 1
    for hosts in (["a", "b", "a", "b"], ["a", "a", "b"], ["a", "b", "b", "b"]):
        with pytest.raises(PlanError, match="contiguous runs of equal length"):
            _nodes_from_hosts(hosts)


def _hosts_body(rank: int, world_size: int) -> list[tuple[int, int]]:
    import os

    os.environ.pop("LOCAL_WORLD_SIZE", None)  # a launcher that does not set it
    found = [(resolve_nodes(rank, world_size).num_nodes, -1)]
    socket.gethostname = lambda: f"host-{rank}"  # type: ignore[assignment]
    topology = resolve_nodes(rank, world_size)
    found.append((topology.num_nodes, topology.node_rank))
    return found


def test_the_process_group_gives_the_nodes_from_host_names() -> None:
    results = run_ranks(_hosts_body, 2)
    # the same host: one node; then each rank on a host of its own: two nodes
    assert [r.value for r in results] == [[(1, -1), (2, 0)], [(1, -1), (2, 1)]]


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
