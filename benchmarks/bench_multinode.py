"""Remote bytes of a multi-node job, per node, by sample size, batch and node count.

Run:  python benchmarks/bench_multinode.py [--sizes 100B,1KB,8KB,100KB]
          [--batches 64,256,1024,4096] [--nodes 2,8] [--model-nodes 8,16,64]
          [--partitions 0,64] [--scale 1.0]

Two kinds of rows. ``measured``: real node processes against a counting HTTP server (below).
``model``: the same bytes computed from the plan by benchmarks/multinode_model.py, for node
counts one machine cannot run as processes (16, 64); tests/test_multinode.py checks the model
against real processes at 2, 4 and 8 nodes. ``--partitions 0`` is the default split (the
order independent of the node count); ``64`` is ``StreamDataset(partitions=64)``, canonical
partitions (docs/multinode.md).

Setup (docs/multinode.md, "Bytes per node"): each dataset is written by ShardWriter at its
defaults (zstd, 64 KiB chunks, 64 MiB shards): token samples of about 100 B, 350 B and 1 KB
(int32 ids of a Zipf vocabulary, lengths varying +-25%, plus an int64 ``x``), and 100 KB
samples of random bytes (as encoded images). Served over HTTP on 127.0.0.1 by the tests'
counting server (tests/servers.py). A job is N simulated nodes (2 nodes x 2 ranks, or 8 nodes
x 1 rank): every rank is a forked process with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) and nothing else telling it its node; each node has
a cache folder of its own; nodes run one after the other (ranks never talk: every rank
computes the split alone), so the server's byte counters give each node's remote bytes. Each
rank reads one whole epoch with the default options (shuffle window 2^18 samples, the
prefetcher on; a node reads its pieces, and other nodes' pieces it needs, as units), and
the union of every step's parts is checked against the global batches of a 1-rank run
(exactly once, identical batches).

Rows: ``locality`` is the job as users run it (the node count from torchrun's environment);
``no locality`` is node 0 of the same job with ``nodes=1`` (every node reads every shard: the
contiguous split), measured in the same run; its per-node bytes are every node's. Columns:
bytes per node as a multiple of the dataset's share D/N (max and mean over nodes), the whole
job as a multiple of the dataset D, and the wall time of the job.

Goals (issue 22): 2 nodes: job <= 1.3 D; 8 nodes: every node <= 1.3 D/8; never above 1.0 D
per node (the no-locality row).

Last run (2026-12-02, ``--sizes 100B,1KB,100KB --scale 0.1``; job x D with 2 nodes, most
loaded node x D/8 with 8 nodes, for global batches 64 / 256 / 1024):
100 B 1.38 / 1.22 / 1.12 and 4.16 / 2.32 / 1.49; 1 KB 1.31 / 1.15 / 1.08 and 2.63 / 1.77 / 1.53;
100 KB 1.06 / 1.03 / 1.00 and 1.19 / 1.10 / 1.05 (no locality: 2.0x and 8.0 x D/8). The table and
what it shows: docs/multinode.md, "Measured at the defaults".

Results go to benchmarks/out/multinode.json; datasets are kept in benchmarks/out/multinode/
(written once).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import multinode_model  # noqa: E402
from dist import torchrun_environment  # noqa: E402
from servers import FaultServer  # noqa: E402

from streamcache import ShardWriter, StreamDataset, StreamLoader, load_index  # noqa: E402

OUT = os.path.join(HERE, "out")
DATA = os.path.join(OUT, "multinode")


@dataclass(frozen=True)
class Size:
    """One dataset: samples of about ``sample_bytes``, ``samples`` of them."""

    name: str
    sample_bytes: int
    samples: int


SIZES = {
    "100B": Size("100B", 100, 1 << 20),
    "350B": Size("350B", 350, 1 << 19),
    "1KB": Size("1KB", 1000, 1 << 18),
    "8KB": Size("8KB", 8000, 1 << 15),
    "100KB": Size("100KB", 100_000, 16384),
}
#: (nodes, ranks per node) of each node count
LAYOUTS = {2: 2, 4: 1, 8: 1}
WRITE_BATCH = 8192


def batches(size: Size, samples: int) -> Any:
    """Record batches of the dataset, deterministic."""
    rng = np.random.default_rng(size.sample_bytes)
    for first in range(0, samples, WRITE_BATCH):
        count = min(WRITE_BATCH, samples - first)
        ids = np.arange(first, first + count, dtype=np.int64)
        if size.sample_bytes >= 10_000:
            lengths = rng.integers(size.sample_bytes * 9 // 10, size.sample_bytes * 11 // 10,
                                   count)
            blobs = [rng.bytes(int(n)) for n in lengths]
            yield pa.record_batch({"x": ids, "blob": pa.array(blobs, pa.large_binary())})
            continue
        tokens = max(1, size.sample_bytes // 4)
        lengths = rng.integers(tokens * 3 // 4, tokens * 5 // 4 + 1, count)
        values = np.minimum(rng.zipf(1.2, int(lengths.sum())), 50_000).astype(np.int32)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
        yield pa.record_batch({"x": ids, "tokens": column})


def dataset(size: Size, scale: float) -> str:
    """The dataset's folder (written at the defaults on first use)."""
    samples = max(1, int(size.samples * scale))
    folder = os.path.join(DATA, f"{size.name}-{samples}")
    if not os.path.exists(os.path.join(folder, "index.json")):
        shutil.rmtree(folder, ignore_errors=True)
        with ShardWriter(folder) as writer:
            for batch in batches(size, samples):
                writer.write_batch(batch)
    return folder


def _rank_main(env: dict[str, str], url: str, cache: str, global_batch: int,
               nodes: int | None, partitions: int, out: str) -> None:
    try:
        os.environ.update(env)
        data = StreamDataset(url, global_batch_size=global_batch, cache_dir=cache, nodes=nodes,
                             fields=["x"], partitions=partitions)
        steps: list[np.ndarray] = []
        with StreamLoader(data) as loader:
            for batch in loader:
                ids = batch["__id__"].numpy()
                if not np.array_equal(batch["x"].numpy(), ids):
                    raise AssertionError("a sample's x is not its id")
                steps.append(ids)
        np.save(out, np.stack(steps) if steps else np.zeros((0, 0), np.int64))
    except BaseException:
        with open(out + ".error", "w") as f:
            f.write(traceback.format_exc())


def run_node(node: int, nodes: int, per_node: int, url: str, cache: str, global_batch: int,
             scratch: str, nodes_arg: int | None, partitions: int) -> list[np.ndarray]:
    """The ranks of one node, forked with torchrun's environment; their ids per step."""
    context = mp.get_context("fork")
    outs, processes = [], []
    for local in range(per_node):
        env = torchrun_environment(node, local, per_node, nodes)
        out = os.path.join(scratch, f"rank-{env['RANK']}.npy")
        outs.append(out)
        processes.append(context.Process(target=_rank_main, args=(
            env, url, cache, global_batch, nodes_arg, partitions, out)))
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    parts = []
    for out in outs:
        if os.path.exists(out + ".error"):
            with open(out + ".error") as f:
                raise RuntimeError(f.read())
        parts.append(np.load(out))
    return parts


def shard_bytes(server: FaultServer) -> int:
    """Shard bytes sent so far, once no request is in flight (the last moments of a node's
    ranks are not counted as the next node's)."""
    deadline = time.monotonic() + 30
    while server.requests.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    return sum(n for path, n in server.requests.sent_by_path().items()
               if path.endswith(".arrow"))


def reference(url: str, global_batch: int, scratch: str, partitions: int) -> np.ndarray:
    """The global batches of a 1-rank run (sorted ids per step), from the plan's order (a
    pass is not started: its prefetcher would fetch shards while the job is measured)."""
    data = StreamDataset(url, global_batch_size=global_batch, rank=0, world_size=1, nodes=1,
                         cache_dir=scratch, partitions=partitions)
    steps = len(data)
    ids = data.order(0).sample_ids(0, steps * global_batch).reshape(steps, global_batch)
    data.close()
    return np.sort(ids, axis=1)


def run_job(server: FaultServer, url: str, nodes: int, global_batch: int, scratch: str,
            locality: bool, partitions: int) -> dict[str, Any]:
    """One epoch of the job (every node, or node 0 alone without locality)."""
    per_node = LAYOUTS[nodes]
    started = time.perf_counter()
    node_bytes, parts = [], []
    for node in range(nodes if locality else 1):
        cache = tempfile.mkdtemp(dir=scratch, prefix=f"node{node}-")
        before = shard_bytes(server)
        parts += run_node(node, nodes, per_node, url, cache, global_batch, scratch,
                          None if locality else 1, partitions)
        node_bytes.append(shard_bytes(server) - before)
        shutil.rmtree(cache, ignore_errors=True)
    return {"node_bytes": node_bytes, "seconds": time.perf_counter() - started,
            "parts": parts}


def check_exact(parts: list[np.ndarray], expected: np.ndarray) -> None:
    joined = np.sort(np.concatenate(parts, axis=1), axis=1)
    if not np.array_equal(joined, expected):
        raise AssertionError("the ranks' parts do not make the 1-rank run's global batches")


def measure(size: Size, scale: float, batches_: list[int], node_counts: list[int],
            model_nodes: list[int], partition_counts: list[int],
            scratch: str) -> list[dict[str, Any]]:
    folder = dataset(size, scale)
    index = load_index(folder)
    total = int(index.total_bytes)
    base = {"size": size.name, "samples": int(index.num_samples), "shards": len(index.shards),
            "dataset_bytes": total}
    rows = []
    with FaultServer(root=folder) as server:
        url = server.url_for("index.json")
        for global_batch in batches_:
            for partitions in partition_counts:
                if partitions and global_batch % partitions:
                    continue
                expected = reference(url, global_batch, scratch, partitions)
                for nodes in node_counts:
                    cases = (True, False) if not partitions else (True,)
                    for locality in cases:
                        job = run_job(server, url, nodes, global_batch, scratch, locality,
                                      partitions)
                        if locality:
                            check_exact(job.pop("parts"), expected)
                        else:
                            job.pop("parts")
                        row = _row(base, global_batch, nodes, partitions, "measured" if
                                   locality else "no locality", job["node_bytes"], locality,
                                   job["seconds"])
                        rows.append(row)
                        print_row(row)
                for nodes in model_nodes:
                    started = time.perf_counter()
                    per_node = multinode_model.node_bytes(folder, global_batch, nodes,
                                                          LAYOUTS.get(nodes, 1), partitions)
                    row = _row(base, global_batch, nodes, partitions, "model", per_node, True,
                               time.perf_counter() - started)
                    rows.append(row)
                    print_row(row)
    return rows


def _row(base: dict[str, Any], global_batch: int, nodes: int, partitions: int, case: str,
         node_bytes: list[int], locality: bool, seconds: float) -> dict[str, Any]:
    total = base["dataset_bytes"]
    per_node = np.array(node_bytes, float) / (total / nodes)
    # (without locality every node fetches what node 0 does)
    job_x = per_node.sum() / nodes if locality else float(per_node[0])
    return {**base, "batch": global_batch, "nodes": nodes, "partitions": partitions,
            "case": case, "per_node_max": float(per_node.max()),
            "per_node_mean": float(per_node.mean()), "job": job_x,
            "per_node_max_of_dataset": float(per_node.max()) / nodes,
            "per_node": per_node.round(3).tolist(), "seconds": seconds}


def print_header() -> None:
    print(f"{'size':>6} {'batch':>5} {'nodes':>5} {'parts':>5} {'case':<12} {'node max':>9} "
          f"{'node mean':>9} {'job':>7} {'time s':>7}   (per node: x D/N, job: x D)")


def print_row(row: dict[str, Any]) -> None:
    print(f"{row['size']:>6} {row['batch']:>5} {row['nodes']:>5} "
          f"{row['partitions'] or '-':>5} {row['case']:<12} "
          f"{row['per_node_max']:>9.3f} {row['per_node_mean']:>9.3f} {row['job']:>7.3f} "
          f"{row['seconds']:>7.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100B,1KB,8KB,100KB")
    parser.add_argument("--batches", default="64,256,1024,4096")
    parser.add_argument("--nodes", default="2,8", help="node counts run as processes")
    parser.add_argument("--model-nodes", default="8,16,64",
                        help="node counts computed by the model ('' for none)")
    parser.add_argument("--partitions", default="0,64",
                        help="0: the default split; P: StreamDataset(partitions=P)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="fraction of each dataset's samples (1.0: the sizes above)")
    args = parser.parse_args(argv)
    sizes = [SIZES[name] for name in args.sizes.split(",")]
    batches_ = [int(b) for b in args.batches.split(",")]
    node_counts = [int(n) for n in args.nodes.split(",") if n]
    model_nodes = [int(n) for n in args.model_nodes.split(",") if n]
    partition_counts = [int(n) for n in args.partitions.split(",") if n]
    os.makedirs(DATA, exist_ok=True)
    print_header()
    rows: list[dict[str, Any]] = []
    scratch = tempfile.mkdtemp(prefix="bench-multinode-")
    try:
        for size in sizes:
            rows += measure(size, args.scale, batches_, node_counts, model_nodes,
                            partition_counts, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(OUT, "multinode.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
