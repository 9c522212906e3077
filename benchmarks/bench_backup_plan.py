"""What choosing the pieces held twice from the first epoch's order costs, and what it moves.

Run:  python benchmarks/bench_backup_plan.py [--repeats 5] [--first-batch DATASET]

A multi-node job whose epoch is small (at most 2^18 samples: plan/backup_plan.py) chooses which
pieces two nodes hold from the order of epoch 0, once per process; a larger epoch draws them
blind. For an epoch of 2^18 samples in 4 shards cut into 64-row chunks (1 KB samples in
64 KiB chunks, the layout of bench_multinode.py's 1 KB dataset, no files needed), per node
count and global batch:

- ``choose ms``: CPU of the choice in a fresh process cache (reading the epoch's order, each
  sample's owner, the greedy), median of ``--repeats``; ``peak MB``: its peak of Python and
  numpy allocations (tracemalloc, in a second run);
- ``split us/step``: CPU of one rank's part of every step of the epoch (``rank_batches`` over
  all steps at once, as the loader asks), the pieces held twice chosen and drawn blind,
  interleaved, medians of ``--repeats``;
- ``paid/step``: samples a step reads from a piece its node does not hold (each may cost a
  chunk), chosen and drawn.

The bytes these save are in benchmarks/multinode_model.py's terms: bench_multinode.py's table.

``--first-batch DATASET`` (a dataset folder written by ShardWriter of at most 2^18 samples,
e.g. bench_multinode.py's 1 KB one at full scale): the cold first batch of rank 0 of an
8-node job of one rank per node, global batch 1,024, served over HTTP on 127.0.0.1 by the
tests' server: a fresh process and a fresh cache folder each time, torchrun's variables,
the choice on and off (``PLAN_MAX_SAMPLES = 0`` in the process: the blind draw), alternated,
``--repeats`` pairs; the seconds from making the dataset to the first batch, and the
process's CPU seconds to then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

from streamcache.plan import EpochOrder, EpochSegment, ShuffleOptions, backup_plan
from streamcache.plan.locality import LocalityAssignment, locality_key
from streamcache.plan.shards import ShardCounts
from streamcache.plan.units import UnitLayout, piece_rows_for

SAMPLES = 1 << 18
SHARDS = 4
CHUNK_ROWS = 64
CASES = [(4, 256), (8, 64), (8, 256), (8, 1024), (8, 4096), (16, 1024), (16, 4096)]


def setting(nodes: int, batch: int, first: bool) -> tuple[EpochOrder, EpochSegment,
                                                         LocalityAssignment]:
    rows = np.full(SHARDS, SAMPLES // SHARDS, dtype=np.int64)
    chunk = np.full(SHARDS, CHUNK_ROWS, dtype=np.int64)
    layout = UnitLayout(rows, chunk, piece_rows_for(1 << 18, nodes, chunk))
    order = EpochOrder(ShardCounts.of(rows), 9, 0, ShuffleOptions())
    segment = EpochSegment(order.num_samples, 0, batch, nodes)
    split = LocalityAssignment(nodes, locality_key("bench"), layout, batch,
                               order if first else None)
    return order, segment, split


def choose_cost(nodes: int, batch: int) -> tuple[float, float, int]:
    """CPU ms and peak MB of one choice (the process cache emptied first: timed, then again
    under tracemalloc for the peak, which slows it), and its pieces."""
    backup_plan._plans.clear()
    _, _, split = setting(nodes, batch, True)
    begin = time.process_time()
    planned = split.planned_backups()
    spent = (time.process_time() - begin) * 1e3
    backup_plan._plans.clear()
    _, _, split = setting(nodes, batch, True)
    tracemalloc.start()
    split.planned_backups()
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return spent, peak, 0 if planned is None else len(planned)


def split_cost(nodes: int, batch: int, first: bool) -> tuple[float, float]:
    """CPU us a step of one rank's part of every step, and paid samples a step."""
    order, segment, split = setting(nodes, batch, first)
    split.planned_backups()  # (chosen before the clock: once per process, measured above)
    steps = range(segment.num_steps)
    begin = time.process_time()
    segment.rank_batches(order, steps, nodes // 2, split)
    spent = (time.process_time() - begin) / segment.num_steps * 1e6
    paid = 0
    for step in steps:
        start, stop = segment.step_span(step)
        nodes_of = split.node_of_slots(order, start, segment.part_sizes(step))
        _, shards, rows = order.samples(start, stop)
        held = (nodes_of == split.owners(shards, rows)) | (
            nodes_of == split.backups(shards, rows))
        paid += int((~held).sum())
    return spent, paid / segment.num_steps


_FIRST_BATCH = """
import json, os, sys, time
began, cpu = time.perf_counter(), time.process_time()
from streamcache import StreamDataset, StreamLoader
from streamcache.plan import backup_plan
if sys.argv[3] == "off":
    backup_plan.PLAN_MAX_SAMPLES = 0
dataset = StreamDataset(sys.argv[1], global_batch_size=1024, cache_dir=sys.argv[2])
with StreamLoader(dataset) as loader:
    next(iter(loader))
    print(json.dumps({"s": time.perf_counter() - began, "cpu": time.process_time() - cpu,
                      "dual": dataset.locality.split.dual}))
"""


def first_batch(folder: str, repeats: int) -> None:
    """The cold first batch with the choice on and off (see the module docstring)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests"))
    from servers import FaultServer  # (the tests' counting HTTP server)

    root, name = os.path.split(os.path.abspath(folder))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}
    found: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    with FaultServer(root=root) as server:
        url = server.url_for(f"{name}/index.json")
        for _ in range(repeats):
            for mode in ("on", "off"):
                with tempfile.TemporaryDirectory(prefix="bench-first-") as cache:
                    out = subprocess.run([sys.executable, "-c", _FIRST_BATCH, url, cache, mode],
                                         env=env, capture_output=True, text=True, check=True)
                found[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"first batch, rank 0 of 8 nodes, cold, {repeats} pairs: s (CPU s), each run")
    for mode, runs in found.items():
        print(f"  choice {mode:3} dual {runs[0]['dual']:.3f}: median "
              f"{statistics.median(r['s'] for r in runs):.2f} s "
              f"({statistics.median(r['cpu'] for r in runs):.2f}); "
              + ", ".join(f"{r['s']:.2f} ({r['cpu']:.2f})" for r in runs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--first-batch", metavar="DATASET", default=None)
    args = parser.parse_args(argv)
    if args.first_batch:
        first_batch(args.first_batch, args.repeats)
        return 0
    print(f"epoch of {SAMPLES} samples, {SHARDS} shards, {CHUNK_ROWS}-row chunks; CPU, "
          f"medians of {args.repeats}")
    print(f"{'nodes':>5} {'batch':>5} {'pieces':>6} {'choose ms':>9} {'peak MB':>7} "
          f"{'split us/step chosen':>20} {'drawn':>6} {'paid/step chosen':>16} {'drawn':>6}")
    for nodes, batch in CASES:
        chosen = [choose_cost(nodes, batch) for _ in range(args.repeats)]
        timed: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for first in (True, False):  # interleaved
                timed[first].append(split_cost(nodes, batch, first))
        med = {k: statistics.median(t for t, _ in v) for k, v in timed.items()}
        paid = {k: v[0][1] for k, v in timed.items()}
        print(f"{nodes:5d} {batch:5d} {chosen[0][2]:6d} "
              f"{statistics.median(c for c, _, _ in chosen):9.1f} "
              f"{max(p for _, p, _ in chosen):7.1f} {med[True]:20.1f} {med[False]:6.1f} "
              f"{paid[True]:16.2f} {paid[False]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
