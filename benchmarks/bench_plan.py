"""The plan: random access, step generation speed and shuffle quality.

Run:  python benchmarks/bench_plan.py [--repeats 5] [--quick] [--nodes-only]

1. Time to the first sample id (build the order of an epoch of 1e9 samples in 1e6 shards,
   then read one id) at position 0 and at the last position, interleaved, several times;
   and the cost of ``shard_first_use`` (the prefetcher's planning query) per position.
2. Step generation, amortized over 1024 consecutive steps of a global batch of 1024, for
   several shuffle settings: ``sample_ids`` and ``locate`` of whole steps (the cached-block
   path a prefetcher uses), and ``worker_batches`` (the loader's path) for one rank of one
   (1024 ids a step) and for rank 3 of 8 (128 ids a step).
3. Shuffle quality on 1e7 samples in 1e4 shards of 1000 rows, for several windows, with and
   without the stagger: distinct shards per global batch of 1024, correlation between
   position and sample id, the least overlap between the shards of consecutive batches (0 is
   a hard seam), and how many shards a run of one window's positions needs (cache cost).

4. The multi-node split (docs/multinode.md): one rank's part of a global batch of 1024 under
   the locality assignment, for 2, 8 and 64 nodes, against the contiguous split, CPU time
   per step over 1024 steps asked at once, and the fraction of samples moved off their
   shard's node. ``--nodes-only`` runs just this section.

Writes benchmarks/out/bench_plan.json.

Times are CPU seconds of this process (time.process_time): the 2-core machine is shared
with other work, which inflates wall-clock times unevenly; this run had a load average of
about 8, and CPU times were 10-40% lower in an earlier run at load 2.

Last result (2026-11-29, this 2-core machine, `python benchmarks/bench_plan.py --repeats 5`):

  1. first sample id, epoch of 1e9 samples in 1e6 shards (median of 5, build included)
     build 147.0 ms | id at 0: 148.2 ms | id at last: 146.9 ms | random probe on a built
     order: 280 us
     shard_first_use over 2^20 positions: 57 ns a position

  2. steps of 1024 (us per step, amortized over 1024 steps)
     setting                          sample_ids   locate worker 1/1 rank 3/8 Mids/s 1/1
     window 2^18, stagger (default)         49.5     55.5       56.3     14.5       18.2
     window 2^18, no stagger                35.1     40.6       39.1      9.5       26.2
     window 2^16, stagger                   62.8     63.0       57.7     14.0       17.7
     window 2^20, stagger                   50.8     50.1       49.0     11.3       20.9
     window 300000, stagger                114.1    114.4      122.2     27.5        8.4
     window 256 shards, stagger             76.8     71.6       74.6     18.0       13.7
     full shuffle of 1e9                    88.3    134.8      185.8     19.8        5.5
     no shuffle                              2.0     19.2       17.4      5.8       58.9

  3. shuffle quality, 1e7 samples in 1e4 shards of 1000, batches of 1024
        window stagger shards/batch   min     corr min overlap shards/run
          4096   False          5.6     5   0.0156       0.100        7.6
          4096    True          9.6     6   0.0119       0.538       11.6
         16384   False         18.0    17   0.0109       0.000       28.4
         16384    True         33.9    23   0.0136       0.420       44.6
         65536   False         67.3    39   0.0047       0.000      113.4
         65536    True        132.7   104   0.0090       0.658      166.0
        262144   False        259.8   249   0.0107       0.000      428.0
        262144    True        448.6   286   0.0083       0.456      690.2
       1048576   False        648.1   465   0.0090       0.000     1791.0
       1048576    True        803.9   717   0.0141       0.208     2630.2
      10000000   False        976.7   961  -0.0048       0.041    10000.0
      10000000    True        976.7   961  -0.0048       0.041    10000.0

  4. (2026-11-30, `python benchmarks/bench_plan.py --nodes-only --repeats 3`, load average 7)
     case                      us/step   moved
     contiguous, 8 ranks          15.7   0.000
     2 nodes x 4 ranks           373.7   0.022
     8 nodes x 1 rank            413.2   0.053
     8 nodes x 8 ranks           368.3   0.053
     64 nodes x 1 rank           432.8   0.166
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from streamcache.plan import (
    CONTIGUOUS,
    EpochOrder,
    EpochSegment,
    RankAssignment,
    ShuffleOptions,
    TailPolicy,
)
from streamcache.plan.locality import LocalityAssignment, locality_key
from streamcache.plan.partition_split import PartitionAssignment
from streamcache.plan.shards import ShardCounts
from streamcache.plan.units import UnitLayout, piece_rows_for

BIG_SHARDS = 10**6
BIG_ROWS = 1000
STEP = 1024


def time_first_id(repeats: int) -> dict[str, float]:
    """Median seconds to build an order of 1e9 samples and read one id at 0 and at the end."""
    rows = np.full(BIG_SHARDS, BIG_ROWS, dtype=np.int64)
    last = BIG_SHARDS * BIG_ROWS - 1
    results: dict[str, list[float]] = {"first_id_at_0_ms": [], "first_id_at_last_ms": [],
                                       "build_ms": []}
    for repeat in range(repeats):
        for name, position in (("first_id_at_0_ms", 0), ("first_id_at_last_ms", last)):
            start = time.process_time()
            order = EpochOrder(rows, 1234 + repeat, 5)
            built = time.process_time()
            order.sample_ids(position, position + 1)
            done = time.process_time()
            results[name].append((done - start) * 1e3)
            results["build_ms"].append((built - start) * 1e3)
    probe = EpochOrder(rows, 1, 5)
    positions = np.random.default_rng(0).integers(0, last + 1, size=1000)
    start = time.process_time()
    for position in positions.tolist():
        probe.sample_ids(position, position + 1)
    per_probe = (time.process_time() - start) / positions.size
    summary = {name: statistics.median(values) for name, values in results.items()}
    summary["random_probe_us"] = per_probe * 1e6
    return summary


def time_first_use(repeats: int) -> dict[str, float]:
    """CPU ns per position of ``shard_first_use`` over 2**20 positions (prefetch planning)."""
    order = EpochOrder(np.full(BIG_SHARDS, BIG_ROWS, dtype=np.int64), 3, 1)
    times = []
    for repeat in range(repeats):
        start = 10**8 * (repeat + 1)
        begin = time.process_time()
        order.shard_first_use(start, start + (1 << 20))
        times.append((time.process_time() - begin) / (1 << 20) * 1e9)
    return {"shard_first_use_ns_per_position": statistics.median(times)}


STEP_CASES: list[tuple[str, ShuffleOptions]] = [
    ("window 2^18, stagger (default)", ShuffleOptions()),
    ("window 2^18, no stagger", ShuffleOptions(stagger=False)),
    ("window 2^16, stagger", ShuffleOptions(window=1 << 16)),
    ("window 2^20, stagger", ShuffleOptions(window=1 << 20)),
    ("window 300000, stagger", ShuffleOptions(window=300_000)),
    ("window 256 shards, stagger", ShuffleOptions(window=256, window_unit="shards")),
    ("full shuffle of 1e9", ShuffleOptions(window=2**31)),
    ("no shuffle", ShuffleOptions(enabled=False)),
]


def time_steps(options: ShuffleOptions, steps: int) -> dict[str, float]:
    """Microseconds per step of 1024, amortized over ``steps`` consecutive steps."""
    rows = np.full(BIG_SHARDS, BIG_ROWS, dtype=np.int64)
    start_position = 123_456_789
    out: dict[str, float] = {}
    for name, call in (
        ("sample_ids_us", lambda o, a: o.sample_ids(a, a + STEP)),
        ("locate_us", lambda o, a: o.locate(a, a + STEP)),
    ):
        order = EpochOrder(rows, 9, 2, options)
        begin = time.process_time()
        for step in range(steps):
            call(order, start_position + step * STEP)
        out[name] = (time.process_time() - begin) / steps * 1e6
    for name, world in (("worker_1of1_us", 1), ("worker_rank3of8_us", 8)):
        order = EpochOrder(rows, 9, 2, options)
        segment = EpochSegment(order.num_samples, start_position, STEP, world, TailPolicy.DROP)
        batches = segment.worker_batches(order, rank=min(3, world - 1), worker=0, num_workers=1)
        begin = time.process_time()
        for _ in range(steps):
            next(batches)
        out[name] = (time.process_time() - begin) / steps * 1e6
    out["ids_per_s"] = STEP / out["worker_1of1_us"] * 1e6
    return out


#: (label, nodes, ranks per node): the multi-node split of a global batch of 1024.
NODE_CASES = [("contiguous, 8 ranks", 1, 8, 0), ("contiguous, 1 rank", 1, 1, 0),
              ("2 nodes x 4 ranks", 2, 4, 0), ("8 nodes x 1 rank", 8, 1, 0),
              ("8 nodes x 8 ranks", 8, 8, 0), ("64 nodes x 1 rank", 64, 1, 0),
              ("8 nodes x 8, partitions 64", 8, 8, 64),
              ("64 nodes x 1, partitions 64", 64, 1, 64),
              ("64 nodes x 8, partitions 64", 64, 8, 64)]
#: Rows per chunk of the benchmark's shards (1 KB samples in 64 KiB chunks).
NODE_CHUNK_ROWS = 64


def time_node_split(steps: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per-step CPU cost of one rank's part under the locality split (docs/multinode.md),
    all the steps in one ``rank_batches`` call (as the loader asks for many steps at once),
    against the contiguous split, cases interleaved, median of ``repeats``; beside it the
    cost of reading the whole batch's samples (``order.samples`` of 1024 positions, which a
    1-rank run pays too), the split's own cost (the difference to that), and the samples
    moved off the nodes that hold them (paid moves, as a fraction of the batch).

    The shards hold 1,000 rows in 64-row chunks (pieces per docs/multinode.md). Each repeat
    builds a new order and assignment (its per-shard table included)."""
    rows = np.full(BIG_SHARDS, BIG_ROWS, dtype=np.int64)
    chunk = np.full(BIG_SHARDS, NODE_CHUNK_ROWS, dtype=np.int64)
    start_position = 123_456_789
    times: dict[str, list[float]] = {label: [] for label, _, _, _ in NODE_CASES}
    reads: dict[int, list[float]] = {0: [], 64: []}
    moved: dict[str, float] = {}
    counts = ShardCounts.of(rows)
    for _ in range(repeats):
        for label, nodes, per_node, partitions in NODE_CASES:
            order = EpochOrder(counts, 9, 2, ShuffleOptions(partitions=partitions))
            world = nodes * per_node
            segment = EpochSegment(order.num_samples, start_position, STEP, world)
            layout = UnitLayout(rows, chunk, piece_rows_for(1 << 18, nodes, chunk))
            assignment: RankAssignment = CONTIGUOUS if nodes == 1 else \
                PartitionAssignment(nodes, locality_key("bench"), partitions, counts, layout,
                                    STEP) if partitions else \
                LocalityAssignment(nodes, locality_key("bench"), layout, STEP)
            begin = time.process_time()
            segment.rank_batches(order, range(steps), world // 2 - 1 if world > 1 else 0,
                                 assignment)
            times[label].append((time.process_time() - begin) / steps * 1e6)
            if isinstance(assignment, LocalityAssignment):
                moved[label] = moved_fraction(order, segment, assignment, steps)
        for partitions, found in reads.items():
            order = EpochOrder(counts, 9, 2, ShuffleOptions(partitions=partitions))
            begin = time.process_time()
            order.samples(start_position, start_position + steps * STEP)
            found.append((time.process_time() - begin) / steps * 1e6)
    read = {partitions: statistics.median(found) for partitions, found in reads.items()}
    return {label: {"rank_part_us": statistics.median(times[label]),
                    "read_batch_us": read[partitions],
                    "split_us": statistics.median(times[label]) - read[partitions],
                    "moved_fraction": moved.get(label, 0.0)}
            for label, _, _, partitions in NODE_CASES}


def moved_fraction(order: EpochOrder, segment: EpochSegment, assignment: LocalityAssignment,
                   steps: int) -> float:
    """Samples read by a node that does not hold their piece (paid moves), a fraction."""
    moved = 0
    for step in range(0, steps, 8):
        first, _ = segment.step_span(step)
        nodes = assignment.node_of_slots(order, first, segment.part_sizes(step))
        _, shards, rows = order.samples(first, first + STEP)
        held = (nodes == assignment.owners(shards, rows)) | (
            nodes == assignment.backups(shards, rows))
        moved += int((~held).sum())
    return moved / (len(range(0, steps, 8)) * STEP)


QUALITY_WINDOWS = [1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 10**7]


def shuffle_quality(window: int, stagger: bool, batches: int) -> dict[str, float]:
    """Quality measures of one setting on 1e7 samples in 1e4 shards of 1000 rows."""
    rows = np.full(10**4, 1000, dtype=np.int64)
    order = EpochOrder(rows, 77, 0, ShuffleOptions(window=window, stagger=stagger))
    total = order.num_samples
    distinct: list[int] = []
    overlaps: list[float] = []
    # Consecutive pairs of batches spread over the epoch; in half of them the first batch
    # ends exactly at a window boundary, where plain windows change shards all at once.
    starts = np.linspace(0, total - 2 * STEP, batches).astype(np.int64)
    starts[: batches // 2] = (starts[: batches // 2] // window + 1) * window - STEP
    for start in np.clip(starts, 0, total - 2 * STEP).tolist():
        first = set(order.locate(start, start + STEP)[0].tolist())
        second = set(order.locate(start + STEP, start + 2 * STEP)[0].tolist())
        distinct.append(len(first))
        overlaps.append(len(first & second) / len(first | second))
    sampled = np.arange(0, total, 97, dtype=np.int64)
    corr = float(np.corrcoef(sampled, order.sample_ids_at(sampled))[0, 1])
    span = min(window, total)
    spans = [np.unique(order.locate(s, s + span)[0]).size
             for s in np.linspace(0, total - span, 5).astype(np.int64).tolist()]
    return {
        "shards_per_batch_mean": float(np.mean(distinct)),
        "shards_per_batch_min": float(np.min(distinct)),
        "corr_position_id": corr,
        "consecutive_overlap_min": float(np.min(overlaps)),
        "shards_per_window_run": float(np.mean(spans)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer steps and batches")
    parser.add_argument("--nodes-only", action="store_true",
                        help="only the multi-node split (section 4)")
    args = parser.parse_args(argv)
    steps = 256 if args.quick else 1024
    if args.nodes_only:
        print_node_split(time_node_split(steps, args.repeats), steps, args.repeats)
        return 0
    batches = 40 if args.quick else 200
    report: dict[str, Any] = {"first_id": time_first_id(args.repeats), "steps": {},
                              "quality": {}, "first_use": time_first_use(args.repeats)}
    first = report["first_id"]
    print("1. first sample id, epoch of 1e9 samples in 1e6 shards (median of "
          f"{args.repeats}, build included)")
    print(f"   build {first['build_ms']:.1f} ms | id at 0: {first['first_id_at_0_ms']:.1f} ms | "
          f"id at last: {first['first_id_at_last_ms']:.1f} ms | random probe on a built\n"
          f"   order: {first['random_probe_us']:.0f} us")
    print(f"   shard_first_use over 2^20 positions: "
          f"{report['first_use']['shard_first_use_ns_per_position']:.0f} ns a position")
    print(f"\n2. steps of {STEP} (us per step, amortized over {steps} steps)")
    print(f"   {'setting':32} {'sample_ids':>10} {'locate':>8} {'worker 1/1':>10} "
          f"{'rank 3/8':>8} {'Mids/s 1/1':>10}")
    for name, options in STEP_CASES:
        result = time_steps(options, steps)
        report["steps"][name] = result
        print(f"   {name:32} {result['sample_ids_us']:10.1f} {result['locate_us']:8.1f} "
              f"{result['worker_1of1_us']:10.1f} {result['worker_rank3of8_us']:8.1f} "
              f"{result['ids_per_s'] / 1e6:10.1f}")
    print(f"\n3. shuffle quality, 1e7 samples in 1e4 shards of 1000, batches of {STEP}")
    print(f"   {'window':>9} {'stagger':>7} {'shards/batch':>12} {'min':>5} {'corr':>8} "
          f"{'min overlap':>11} {'shards/run':>10}")
    for window in QUALITY_WINDOWS:
        for stagger in (False, True):
            quality = shuffle_quality(window, stagger, batches)
            report["quality"][f"{window}/{'stagger' if stagger else 'plain'}"] = quality
            print(f"   {window:9d} {stagger!s:>7} {quality['shards_per_batch_mean']:12.1f} "
                  f"{quality['shards_per_batch_min']:5.0f} {quality['corr_position_id']:8.4f} "
                  f"{quality['consecutive_overlap_min']:11.3f} "
                  f"{quality['shards_per_window_run']:10.1f}")
    report["nodes"] = time_node_split(steps, args.repeats)
    print_node_split(report["nodes"], steps, args.repeats)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_plan.json")
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"\nwrote {path}")
    return 0


def print_node_split(result: dict[str, dict[str, float]], steps: int, repeats: int) -> None:
    print(f"\n4. multi-node split of a global batch of {STEP} (one rank's part, us per step "
          f"over {steps} steps, median of {repeats}, interleaved; read = the whole batch's "
          "samples, which the split needs and a 1-rank run reads too; split = the rest)")
    print(f"   {'case':28} {'us/step':>8} {'read':>6} {'split':>6} {'moved':>7}")
    for label, row in result.items():
        print(f"   {label:28} {row['rank_part_us']:8.1f} {row['read_batch_us']:6.1f} "
              f"{row['split_us']:6.1f} {row['moved_fraction']:7.3f}")


if __name__ == "__main__":
    sys.exit(main())
