"""A multi-node job simulated on this machine, at the library's defaults (loading/nodes.py,
node_reader.py, cache/units.py and the split of plan/locality.py).

The dataset is written by ShardWriter at its defaults (zstd, 64 KiB chunks, 64 MiB shards:
here one shard of 1 KB token samples). Each "node" has its own cache folder and its ranks are
real processes (forked, so torch is not imported again) with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK); nothing tells a rank its node but that
environment. They read over HTTP from the project's counting server. Ranks do not talk to
each other (the split is computed by every rank alone), so the nodes run one after the other
and the server's byte counters give each node's remote bytes exactly.

What must hold: the global batch of every step is the 1-rank run's, every sample is read
once; a node never fetches more than the dataset; 2 and 4 nodes fetch at most 1.3x the
dataset for the whole job, 8 nodes at most 1.3/8 of it each at a global batch of 1024; a
node installs only units (pieces and chunks), never the whole shard. A 4-node state resumes
on 3 nodes exactly. (benchmarks/bench_multinode.py measures the bytes by sample size, batch
and node count; docs/multinode.md has the model.)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from dist import torchrun_environment
from loader_helpers import ids_of, make_dataset
from servers import FaultServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import multinode_model

from streamcache import Source
from streamcache.format.writer import ShardWriter
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader

SAMPLES, TOKENS = 16384, 256  # 1 KB samples: one default shard, 261 chunks of 63 rows


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """The dataset at the writer's defaults (row i holds x == i and 256 Zipf token ids)
    behind an HTTP server."""
    root = tmp_path_factory.mktemp("served")
    rng = np.random.default_rng(0)
    tokens = np.minimum(rng.zipf(1.2, SAMPLES * TOKENS), 50_000).astype(np.int32)
    offsets = np.arange(0, SAMPLES * TOKENS + 1, TOKENS, dtype=np.int64)
    with ShardWriter(str(root / "ds")) as writer:
        writer.write_batch(pa.record_batch({
            "x": np.arange(SAMPLES, dtype=np.int64),
            "tokens": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(tokens))}))
    index = writer.index
    assert index is not None and index.shards[0].compression == "zstd"
    assert index.shards[0].chunk_rows == 63 and len(index.shards) == 1  # (1,040 B a row)
    with FaultServer(root=root) as server:
        yield server, index, server.url_for("ds/index.json")


def shard_bytes(server: FaultServer) -> int:
    """Shard bytes the server sent so far, once no request is in flight (a request of an
    earlier job's last moments is not counted as the next one's)."""
    deadline = time.monotonic() + 30
    while server.requests.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    return sum(n for path, n in server.requests.sent_by_path().items()
               if path.endswith(".arrow"))


def dataset_bytes(index: Any) -> int:
    return sum(int(info.bytes) for info in index.shards)


def reference_steps(index: Any, global_batch: int, cache: Path,
                    partitions: int = 0) -> list[set[int]]:
    """The global batches of a 1-rank run, as sets of ids, from the plan's order (no pass is
    started: its prefetcher would fetch while the job is measured)."""
    dataset = StreamDataset(index, global_batch_size=global_batch, rank=0, world_size=1,
                            nodes=1, cache_dir=str(cache), partitions=partitions)
    steps = len(dataset)
    ids = dataset.order(0).sample_ids(0, steps * global_batch).reshape(steps, global_batch)
    return [set(step.tolist()) for step in ids]


def _rank_main(env: dict[str, str], url: Any, cache: str, global_batch: int, steps: int | None,
               state: dict[str, Any] | None, out: str, partitions: int = 0) -> None:
    try:
        os.environ.update(env)
        source: Any = url if isinstance(url, str) else [Source(u, weight=w) for u, w in url]
        dataset = StreamDataset(source, global_batch_size=global_batch, cache_dir=cache,
                                fields=["x"], partitions=partitions)
        with StreamLoader(dataset) as loader:
            if state is not None:
                loader.load_state_dict(state)
            ids: list[list[Any]] = []
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


def run_node(node: int, nodes: int, per_node: int, url: Any, cache: Path, global_batch: int,
             tmp: Path, steps: int | None = None, state: dict[str, Any] | None = None,
             partitions: int = 0) -> list[dict[str, Any]]:
    """Run the ranks of one node (forked processes, torchrun's environment) to the end."""
    context = mp.get_context("fork")
    outs, processes = [], []
    for local in range(per_node):
        env = torchrun_environment(node, local, per_node, nodes)
        out = str(tmp / f"rank-{nodes}-{env['RANK']}.json")
        outs.append(out)
        processes.append(context.Process(target=_rank_main, args=(
            env, url, str(cache), global_batch, steps, state, out, partitions)))
    for process in processes:
        process.start()
    for process in processes:
        process.join(240)
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
    server, _, url = served
    results, node_bytes = [], []
    for node in range(nodes):
        before = shard_bytes(server)
        results.append(run_node(node, nodes, per_node, url, tmp / f"node-{node}", global_batch,
                                tmp, **kwargs))
        node_bytes.append(shard_bytes(server) - before)
    return results, node_bytes


def global_steps(results: list[list[dict[str, Any]]]) -> list[set[Any]]:
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


def installed_units(cache: Path) -> list[Path]:
    return sorted((cache / "datasets").glob("*/*.arrow"))


def check_job(served: Any, nodes: int, per_node: int, global_batch: int, tmp: Path,
              partitions: int = 0) -> list[float]:
    """One epoch on ``nodes`` nodes: the 1-rank run's global batches, every sample once,
    units installed (never the whole shard); each node's bytes / the dataset's."""
    _, index, _ = served
    reference = reference_steps(index, global_batch, tmp / "reference", partitions)
    results, node_bytes = run_job(served, nodes, per_node, global_batch, tmp,
                                  partitions=partitions)
    steps = global_steps(results)
    assert steps == reference and len(steps) == SAMPLES // global_batch
    for node in range(nodes):
        assert f"node {node} of {nodes}" in results[node][0]["locality"]
        units = installed_units(tmp / f"node-{node}")
        assert units and all(path.stat().st_size < dataset_bytes(index) for path in units)
    total = dataset_bytes(index)
    shares = [b / total for b in node_bytes]
    # the model that stands in for 16 and 64 nodes in benchmarks/bench_multinode.py
    modelled = multinode_model.node_bytes(os.path.join(served[0].root, "ds"), global_batch,
                                          nodes, per_node, partitions)
    ratios = [m / b for m, b in zip(modelled, node_bytes, strict=True)]
    print(f"\nmodel / measured, per node: {[round(r, 3) for r in ratios]}")
    assert all(abs(r - 1) <= 0.02 for r in ratios), (modelled, node_bytes)
    print(f"{nodes} nodes x {per_node} ranks, batch {global_batch}, partitions "
          f"{partitions or 'none (the default)'}: bytes per "
          f"node / dataset {[round(s, 3) for s in shares]}, job {sum(shares):.3f}")
    assert max(shares) <= 1.0  # never more than without locality (every node: the dataset)
    return shares


def test_two_nodes_at_the_defaults_fetch_at_most_1_3x_the_dataset(served, tmp_path) -> None:
    shares = check_job(served, 2, 2, 256, tmp_path)
    assert sum(shares) <= 1.3


def test_four_nodes_at_the_defaults_fetch_what_the_model_says(served, tmp_path) -> None:
    """The model of benchmarks/multinode_model.py against real node processes at 4 nodes
    (check_job compares it at 2 and 8 too). At 64 samples a node a step the default split
    fetches about 1.21x the dataset here (1.30x with the pieces held twice drawn blind;
    partitions=: about 1.04x)."""
    shares = check_job(served, 4, 1, 256, tmp_path)
    assert sum(shares) <= 1.3


def test_eight_nodes_at_the_defaults_fetch_about_1_3_eighths_each(served, tmp_path) -> None:
    """The goal at 128 samples a node a step: the job <= 1.3x the dataset and the most loaded
    node <= 1.3 x D/8, with margin for the job (about 1.19x here; 1.22-1.48x, mean 1.27x, over
    40 keys with the pieces held twice drawn blind, which this dataset's one-window epoch
    lets the split choose from the order instead: plan/backup_plan.py).

    The key (a hash of the dataset's fingerprint, which the writer's random shard names draw
    anew in each run) decides the owners; one real 8-node run checks exactness and the model
    (check_job: every node within 2% of it), and the model, checked so, gives the bytes under
    8 more keys."""
    shares = check_job(served, 8, 1, 1024, tmp_path)
    assert sum(shares) <= 1.25 and max(shares) * 8 <= 1.3, (served[1].fingerprint, shares)
    _, index, _ = served
    total = dataset_bytes(index)
    nodes = np.array([multinode_model.node_bytes(
        os.path.join(served[0].root, "ds"), 1024, 8, key=7919 * key + 1)
        for key in range(8)]) / total
    jobs, peaks = nodes.sum(axis=1), nodes.max(axis=1) * 8
    print(f"over 8 keys: job max {jobs.max():.3f}, most loaded node max {peaks.max():.3f}")
    assert jobs.max() <= 1.25 and peaks.max() <= 1.3, (jobs.round(3), peaks.round(3))


@pytest.mark.parametrize("nodes, global_batch", [(8, 64), (8, 1024)])
def test_eight_nodes_with_canonical_partitions_fetch_about_an_eighth_each(
        served, tmp_path, nodes: int, global_batch: int) -> None:
    """partitions=64: every node reads only its own runs of samples, so even at 8 samples a
    node a step (where the default split fetches 2-4x a node's share) each node fetches its
    eighth plus the pieces at the ends of its run, whatever the dataset's key."""
    shares = check_job(served, nodes, 1, global_batch, tmp_path, partitions=64)
    assert sum(shares) <= 1.1 and max(shares) * nodes <= 1.15, (served[1].fingerprint, shares)


def test_a_four_node_state_with_partitions_resumes_on_two_nodes_exactly(served,
                                                                        tmp_path) -> None:
    _, index, _ = served
    global_batch, first_steps, later_steps = 64, 7, 9
    reference = reference_steps(index, global_batch, tmp_path / "reference", 8)
    before, _ = run_job(served, 4, 1, global_batch, tmp_path, steps=first_steps, partitions=8)
    states = {json.dumps(rank["state"], sort_keys=True) for node in before for rank in node}
    assert len(states) == 1  # the same state on every rank
    after, _ = run_job(served, 2, 2, global_batch, tmp_path, steps=later_steps,
                       state=json.loads(states.pop()), partitions=8)
    steps = global_steps(before) + global_steps(after)
    assert steps == reference[:first_steps + later_steps]
    read = [i for step in steps for i in step]
    assert len(read) == len(set(read)) == len(steps) * global_batch


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


def test_a_mixture_on_two_nodes_at_the_defaults_reads_the_one_node_batches(
        tmp_path: Path) -> None:
    """Sources of a mixture share one combined shard space and its split: each node holds its
    pieces of every source (one unit cache per source, one prefetcher), the global batches
    are the one-node run's, and the job fetches about the sources' bytes once, not twice."""
    for name, seed in (("web", 1), ("code", 2)):
        rng = np.random.default_rng(seed)
        count = SAMPLES // 2
        tokens = np.minimum(rng.zipf(1.2, count * TOKENS), 50_000).astype(np.int32)
        offsets = np.arange(0, count * TOKENS + 1, TOKENS, dtype=np.int64)
        with ShardWriter(str(tmp_path / name)) as writer:
            writer.write_batch(pa.record_batch({
                "x": np.arange(count, dtype=np.int64),
                "tokens": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(tokens))}))
    with FaultServer(root=tmp_path) as server:
        sources = [(server.url_for("web/index.json"), 0.6),
                   (server.url_for("code/index.json"), 0.4)]

        def job(nodes: int) -> tuple[list[set[Any]], list[int]]:
            results, node_bytes = [], []
            for node in range(nodes):
                before = shard_bytes(server)
                results.append(run_node(node, nodes, 1, sources, tmp_path / f"{nodes}-{node}",
                                        256, tmp_path))
                node_bytes.append(shard_bytes(server) - before)
            return global_steps(results), node_bytes

        one_node, (one_node_bytes,) = job(1)
        two_nodes, two_node_bytes = job(2)
    assert two_nodes == one_node and len(one_node) > 10
    assert {source for step in one_node for source, _ in step} == {0, 1}
    print(f"\nmixture on 2 nodes, defaults: remote bytes per node "
          f"{[round(b / one_node_bytes, 3) for b in two_node_bytes]} x one node's")
    assert max(two_node_bytes) <= one_node_bytes
    assert sum(two_node_bytes) <= 1.3 * one_node_bytes


def test_two_units_of_the_same_rows_swapped_in_a_nodes_folder_are_an_error(served,
                                                                         tmp_path) -> None:
    """Installed units of equal row counts swapped in a node's cache folder (by hand, or by a
    process that writes there): a ShardCorruptError naming the file, never rows served under
    another unit's ids."""
    _, _, url = served
    cache = tmp_path / "node-0"
    run_node(0, 2, 1, url, cache, 256, tmp_path, steps=8)
    by_size: dict[int, list[Path]] = {}
    for path in installed_units(cache):
        by_size.setdefault(path.stat().st_size, []).append(path)
    first, second = next(paths for paths in by_size.values() if len(paths) >= 2)[:2]
    os.replace(first, tmp_path / "aside")
    os.replace(second, first)
    os.replace(tmp_path / "aside", second)
    out = tmp_path / "swapped.json"
    process = mp.get_context("fork").Process(target=_rank_main, args=(
        torchrun_environment(0, 0, 1, 2), url, str(cache), 256, None, None, str(out)))
    process.start()
    process.join(240)
    with open(out) as f:
        error = json.load(f).get("error", "no error")
    assert "ShardCorruptError" in error and "another entry's file" in error, error[-3000:]
