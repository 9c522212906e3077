"""A multi-node job simulated on this machine (streamcache/loading/nodes.py and the hooks).

Each "node" has its own cache folder and its ranks are real processes (forked, so torch is
not imported again) with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK); nothing tells a rank its node but that environment. They read
over HTTP from the project's counting server. Ranks do not talk to each other (the split is
computed by every rank alone), so the nodes run one after the other and the server's byte
counters give each node's remote bytes exactly.

What must hold: the global batch of every step is the 1-rank run's, every sample is read
once, and each node fetches about its share of the dataset (whole job <= 1.3x the dataset
with 2 nodes; each node <= 1.3/N with N = 8), reading other nodes' rows by range, with the
reader's defaults (its cold-start rule included). A 4-node state resumes on 3 nodes exactly.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from loader_helpers import ids_of, make_dataset
from servers import FaultServer

from streamcache import Source
from streamcache.format.writer import ShardWriter
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader
from streamcache.plan.locality import locality_key, shard_owners

SHARDS, ROWS, ROW_BYTES = 960, 8, 2048
WINDOW = 2048  # samples: a window spans 256 shards


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """The dataset (SHARDS shards of ROWS rows, row i holding x == i and ROW_BYTES random
    bytes, uncompressed, one row a chunk where the writer chunks) behind an HTTP server."""
    root = tmp_path_factory.mktemp("served")
    # every shard may be pending at once: no waiting on the writer's background stores
    options: dict[str, Any] = {"compression": None, "shard_size": 1 << 40,
                               "max_pending": SHARDS + 1}
    options["chunk_size"] = ROW_BYTES
    rng = np.random.default_rng(0)
    with ShardWriter(str(root / "ds"), **options) as writer:
        for shard in range(SHARDS):
            for row in range(ROWS):
                writer.write({"x": shard * ROWS + row, "blob": rng.bytes(ROW_BYTES)})
            writer.cut()
    index = writer.index
    assert index is not None and len(index.shards) == SHARDS
    with FaultServer(root=root) as server:
        yield server, index, server.url_for("ds/index.json")


def shard_bytes(server: FaultServer, index: Any) -> int:
    return sum(server.requests.bytes_sent(f"/ds/{info.path}") for info in index.shards)


def dataset_bytes(index: Any) -> int:
    return sum(int(info.bytes) for info in index.shards)


def reference_steps(index: Any, global_batch: int, cache: Path) -> list[set[int]]:
    """The global batches of a 1-rank run, as sets of ids: what its loader yields, from the
    dataset's own plan (without reading the rows: a batch's ``__id__`` is its plan's ids)."""
    dataset = StreamDataset(index, global_batch_size=global_batch, rank=0, world_size=1,
                            nodes=1, shuffle_window=WINDOW, cache_dir=str(cache))
    return [set(part.sample_ids.tolist()) for _, part in dataset.planned()]


def _rank_main(env: dict[str, str], url: str, cache: str, global_batch: int, steps: int | None,
               state: dict[str, Any] | None, out: str) -> None:
    try:
        os.environ.update(env)
        source: Any = url if isinstance(url, str) else [Source(u, weight=w) for u, w in url]
        dataset = StreamDataset(source, global_batch_size=global_batch, shuffle_window=WINDOW,
                                cache_dir=cache)
        with StreamLoader(dataset) as loader:
            if state is not None:
                loader.load_state_dict(state)
            ids: list[list[int]] = []
            for batch in loader:
                assert np.array_equal(batch["x"].numpy(), ids_of(batch))
                sources = batch.get("__source__")  # a mixture's: ids are (source, id) pairs
                ids.append(ids_of(batch).tolist() if sources is None else
                           [[*pair] for pair in zip(sources.tolist(), ids_of(batch).tolist(),
                                                    strict=True)])
                if steps is not None and len(ids) == steps:
                    break
            result: dict[str, Any] = {"ids": ids, "state": loader.state_dict(),
                                      "locality": repr(dataset.locality)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)


def run_node(node: int, nodes: int, per_node: int, url: str | list[tuple[str, float]],
             cache: Path, global_batch: int,
             tmp: Path, steps: int | None = None, state: dict[str, Any] | None = None,
             ) -> list[dict[str, Any]]:
    """Run the ranks of one node (forked processes, torchrun's environment) to the end."""
    context = mp.get_context("fork")
    world = nodes * per_node
    outs, processes = [], []
    for local in range(per_node):
        rank = node * per_node + local
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node)}
        out = str(tmp / f"rank-{nodes}-{rank}.json")
        outs.append(out)
        processes.append(context.Process(target=_rank_main, args=(
            env, url, str(cache), global_batch, steps, state, out)))
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0, f"a rank of node {node} ended with {process.exitcode}"
    results = []
    for out in outs:
        with open(out) as f:
            result = json.load(f)
        assert "error" not in result, result["error"]
        results.append(result)
    return results


def run_job(served: Any, nodes: int, per_node: int, global_batch: int, tmp: Path,
            **kwargs: Any) -> tuple[list[list[dict[str, Any]]], list[int]]:
    """Every node in turn; each node's results and remote shard bytes."""
    server, index, url = served
    results, node_bytes = [], []
    for node in range(nodes):
        before = shard_bytes(server, index)
        results.append(run_node(node, nodes, per_node, url, tmp / f"node-{node}", global_batch,
                                tmp, **kwargs))
        node_bytes.append(shard_bytes(server, index) - before)
    return results, node_bytes


def global_steps(results: list[list[dict[str, Any]]]) -> list[set[int]]:
    """The union over ranks of each step's ids, checking parts are disjoint and equal."""
    ranks = [rank for node in results for rank in node]
    count = len(ranks[0]["ids"])
    assert all(len(rank["ids"]) == count for rank in ranks)
    steps = []
    for step in range(count):
        parts = [rank["ids"][step] for rank in ranks]
        assert len({len(part) for part in parts}) == 1
        parts = [[tuple(i) if isinstance(i, list) else i for i in part] for part in parts]
        union = set().union(*parts)
        assert len(union) == sum(len(part) for part in parts)
        steps.append(union)
    return steps


def installed_shards(cache: Path) -> set[int]:
    return {int(path.stem) for path in (cache / "datasets").glob("*/*.arrow")}


def test_two_nodes_read_the_one_rank_batches_and_fetch_their_share(served, tmp_path) -> None:
    _, index, _ = served
    global_batch = 128
    reference = reference_steps(index, global_batch, tmp_path / "reference")
    results, node_bytes = run_job(served, 2, 2, global_batch, tmp_path)
    assert global_steps(results) == reference
    assert all("node 1 of 2" in rank["locality"] for rank in results[1])
    total = dataset_bytes(index)
    print(f"\n2 nodes x 2 ranks, batch {global_batch}: bytes per node / dataset "
          f"{[round(b / total, 3) for b in node_bytes]}, job {sum(node_bytes) / total:.3f}")
    assert sum(node_bytes) <= 1.3 * total
    # each node installs only its own shards; others' rows are read by range
    owners = shard_owners(locality_key(index.fingerprint), np.arange(SHARDS), 2)
    for node in range(2):
        assert installed_shards(tmp_path / f"node-{node}") <= set(
            np.flatnonzero(owners == node).tolist())


def test_eight_nodes_each_fetch_about_an_eighth(served, tmp_path) -> None:
    _, index, _ = served
    global_batch = 512
    reference = reference_steps(index, global_batch, tmp_path / "reference")
    results, node_bytes = run_job(served, 8, 1, global_batch, tmp_path)
    assert global_steps(results) == reference
    total = dataset_bytes(index)
    shares = [b / total * 8 for b in node_bytes]
    print(f"\n8 nodes, batch {global_batch}: bytes per node x 8 / dataset "
          f"{[round(s, 3) for s in shares]}, job {sum(node_bytes) / total:.3f}")
    assert max(shares) <= 1.3


def test_a_four_node_state_resumes_on_three_nodes_exactly(served, tmp_path) -> None:
    _, index, _ = served
    global_batch, first_steps, later_steps = 48, 7, 9
    reference = reference_steps(index, global_batch, tmp_path / "reference")
    before, _ = run_job(served, 4, 1, global_batch, tmp_path, steps=first_steps)
    states = {json.dumps(rank["state"], sort_keys=True) for node in before for rank in node}
    assert len(states) == 1  # the same state on every rank
    after, _ = run_job(served, 3, 1, global_batch, tmp_path, steps=later_steps,
                       state=json.loads(states.pop()))
    steps = global_steps(before) + global_steps(after)
    assert steps == reference[:first_steps + later_steps]
    read = [i for step in steps for i in step]
    assert len(read) == len(set(read)) == len(steps) * global_batch


def test_worker_processes_read_the_split_their_rank_reads(tmp_path) -> None:
    """The locality resolved when a pass starts travels to worker processes with the dataset
    (nodes given as an argument here), and splits each global batch as in the rank itself."""
    url = make_dataset(str(tmp_path), [30, 40, 20, 25], seq=False)

    def parts(nodes: int, workers: int) -> list[list[list[int]]]:
        found = []
        for rank in range(4):
            dataset = StreamDataset(url, global_batch_size=8, rank=rank, world_size=4,
                                    nodes=nodes, cache_dir=str(tmp_path / "cache"))
            with StreamLoader(dataset, num_workers=workers, worker_mode="process") as loader:
                found.append([ids_of(batch).tolist() for batch in loader])
        return found

    by_node = parts(2, 0)
    assert parts(2, 2) == by_node
    contiguous = parts(1, 0)
    assert by_node != contiguous
    for step in range(len(contiguous[0])):
        assert sorted(i for rank in by_node for i in rank[step]) == sorted(
            i for rank in contiguous for i in rank[step])


def test_a_mixture_on_two_nodes_reads_the_one_node_batches_and_splits_the_bytes(
        tmp_path: Path) -> None:
    """Sources of a mixture share one combined shard space: each node installs and fetches
    its share of every source, and the global batches are the one-node run's."""
    shards, rows = 240, 8
    for name in ("web", "code"):
        with ShardWriter(str(tmp_path / name), compression=None, shard_size=1 << 40,
                         chunk_size=ROW_BYTES, max_pending=shards + 1) as writer:
            for shard in range(shards):
                for row in range(rows):
                    writer.write({"x": shard * rows + row, "blob": bytes(ROW_BYTES)})
                writer.cut()
    with FaultServer(root=tmp_path) as server:
        sources = [(server.url_for("web/index.json"), 0.6),
                   (server.url_for("code/index.json"), 0.4)]

        def job(nodes: int) -> tuple[list[set[Any]], int]:
            results = []
            for node in range(nodes):
                results.append(run_node(node, nodes, 1, sources, tmp_path / f"{nodes}-{node}",
                                        64, tmp_path))
            shard_bytes = sum(n for path, n in server.requests.sent_by_path().items()
                              if path.endswith(".arrow"))
            server.requests.reset()
            return global_steps(results), shard_bytes

        one_node, one_node_bytes = job(1)
        two_nodes, two_node_bytes = job(2)
    assert two_nodes == one_node and len(one_node) > 10
    assert {source for step in one_node for source, _ in step} == {0, 1}
    print(f"\nmixture on 2 nodes: remote bytes {two_node_bytes / one_node_bytes:.3f}x one node's")
    assert two_node_bytes <= 1.3 * one_node_bytes
