"""Opening a dataset of 1k, 100k and 1M shards: construction, first batch and memory.

Run:  python benchmarks/bench_open.py [--repeats 3]
          [--shards 1000,100000,1000000] [--ranks 1,8] [--nodes 1,8] [--data DIR]
          [--baseline SRC]

What a rank process pays to open a dataset, as a user sees it: a fresh process imports
streamcache (not timed), then ``StreamDataset(url, global_batch_size=256, shuffle=True,
rank=r, world_size=W)`` (construction) and the first batch of a ``StreamLoader`` over it
(first batch). Each process reports both times, its peak RSS (``ru_maxrss``) and its PSS
at the end (``/proc/self/smaps_rollup``: pages shared by the node's processes, the node copy
of the shard table among them, counted once over all of them).

The datasets (made once under ``--data``, default benchmarks/out/open-data): N shards of
1,000 rows each (an int64 ``x`` and 32 int32 ``tokens``), written at the defaults (zstd,
64 KiB chunks; ShardWriter wrote the first shard, the others are hard links to copies of it,
so 1M shards need little disk), described by an index the library writes
(``save_index``: from 10,000 shards on, the Parquet side file).

Cases, per shard count and rank count (W processes started together, one node):

  cold   no node copy of the shard table yet (``cache_dir/tables`` removed first); the
         shards the first batch needs are installed already (the first round installs them)
  warm   the node copy made by an earlier process, the shards installed: what every
         restart after the first pays

Rounds run interleaved (every case once per round), ``--repeats`` rounds; the tables give
medians over rounds (of the per-process median for W ranks), and the ratios the goals of
issue 26 name, each against the 1k-shard case of the same run.

``--baseline SRC`` runs the same children with ``SRC`` first on ``sys.path`` (a checkout
of another version, e.g. ``git archive <commit> | tar -x -C SRC`` plus the built
``_core`` extension copied into ``SRC/streamcache``), for the before/after table.

Results also go to benchmarks/out/open.json.

Last results (2026-12-02 01:00 UTC, ``--repeats 3`` with ``--baseline`` an export of the code
before the side-file work, at 1k and 100k shards, 1 rank; 2 cores, no GPU; other engineers'
jobs on the machine; medians; the baseline's 1M-shard cases were not run: its 100k-shard first
batch already took 18-23 s):

  source    shards ranks case  construct s first batch s peak RSS MB sum RSS MB sum PSS MB steps/s
  this       1,000     1 cold        0.093         0.649       320.1      320.1      220.7
  this       1,000     1 warm        0.043         0.550       358.8      358.8      230.7     20.9
  this       1,000     8 cold        0.294         2.769       288.6     2308.2     1440.2
  this       1,000     8 warm        0.230         2.187       288.6     2308.8     1438.6
  this     100,000     1 cold        0.264         0.764       349.5      349.5      223.4
  this     100,000     1 warm        0.010         0.554       361.7      361.7      232.1     22.1
  this     100,000     8 cold        0.059         2.078       294.9     2387.1     1493.9
  this     100,000     8 warm        0.019         1.441       295.0     2359.4     1505.3
  this   1,000,000     1 cold        1.542         0.322       417.5      417.5      311.7
  this   1,000,000     1 warm        0.011         0.482       374.8      374.8      240.7     44.3
  this   1,000,000     8 cold        1.844         2.527       308.6     2540.1     1591.3
  this   1,000,000     8 warm        0.066         2.282       308.2     2469.0     1514.1
  baseline   1,000     1 cold        0.055         0.460       342.8      342.8      219.3
  baseline   1,000     1 warm        0.027         0.309       358.8      358.8      237.1     30.7
  baseline 100,000     1 cold        0.340        18.235       455.4      455.4      351.1
  baseline 100,000     1 warm        0.572        22.930       465.7      465.7      334.8     16.7

Against the 1k-shard case of the same run, at 1M shards: warm (every start after the node's
first), construction 0.26x (0.011 s) with 1 rank and 0.29x with 8, first batch 0.88x and
1.04x, peak RSS +16.0 MB a process with 1 rank and +19.6 MB with 8, the 8 ranks together
+75.5 MB PSS (+160 MB by summed RSS, which counts the node copy's shared pages once per
process); cold (the node's first process decodes the side file), construction 1.54 s
(16.6x) and +97 MB peak RSS in that process. Steady state (200 steps, 1 rank, warm) was
20.9, 22.1 and 44.3 steps/s at 1k, 100k and 1M shards: no loss (the spread is the machine's
load and cache warmth, not the table). The baseline at 100k shards: first batch 40-74x its
1k case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
ROWS = 1000
GLOBAL_BATCH = 256
LINKS_PER_FILE = 60_000  # ext4 allows 65,000 links to one inode


# ---------------------------------------------------------------- the datasets


def make_dataset(folder: str, shards: int) -> str:
    """A dataset of ``shards`` identical 1,000-row shards at ``folder`` (made once)."""
    index_path = os.path.join(folder, "index.json")
    if os.path.exists(index_path):
        return folder
    import numpy as np
    import pyarrow as pa

    from streamcache import ShardWriter
    from streamcache.format.index import DatasetIndex, save_index
    from streamcache.format.shard_table import ShardTable

    base = folder + ".base"
    shutil.rmtree(base, ignore_errors=True)
    with ShardWriter(base) as writer:
        for i in range(ROWS):
            writer.write({"x": np.int64(i), "tokens": np.arange(32, dtype=np.int32) + i})
    (info,) = writer.index.shards
    os.makedirs(folder, exist_ok=True)
    copies = []
    for c in range(-(-shards // LINKS_PER_FILE)):
        copy = os.path.join(folder, f".copy-{c}")
        shutil.copyfile(os.path.join(base, info.path), copy)
        copies.append(copy)
    names = [f"shard-000000000000-{k:07d}.arrow" for k in range(shards)]
    for k, name in enumerate(names):
        target = os.path.join(folder, name)
        if not os.path.exists(target):
            os.link(copies[k // LINKS_PER_FILE], target)
    def column(value: Any, dtype: Any) -> Any:
        return np.full(shards, value, dtype)

    def strings(value: str | None) -> Any:
        return pa.array([value] * shards, pa.string())

    table = ShardTable(
        pa.array(names, pa.large_string()), column(0, np.uint8), column(info.rows, np.int64),
        column(info.bytes, np.int64), strings(info.checksum), strings(info.compression),
        column(info.raw_bytes, np.int64), column(info.chunk_rows, np.int64),
        column(info.tail_bytes, np.int64), strings(info.tail_checksum))
    index = DatasetIndex(writer.index.schema, table)
    save_index(index, folder)
    shutil.rmtree(base, ignore_errors=True)
    return folder


# ---------------------------------------------------------------- one rank process


def child(url: str, cache: str, rank: int, world: int, steps: int, nodes: int = 1) -> None:
    """One rank: import (not timed), construct, first batch, then ``steps`` more batches;
    prints one JSON line."""
    import streamcache
    import streamcache.loading.dataset
    import streamcache.loading.loader
    from streamcache import StreamDataset, StreamLoader
    del streamcache
    start = time.perf_counter()
    dataset = StreamDataset(url, global_batch_size=GLOBAL_BATCH, shuffle=True, rank=rank,
                            world_size=world, cache_dir=cache,
                            **({"nodes": nodes} if nodes > 1 else {}))
    built = time.perf_counter()
    loader = StreamLoader(dataset)
    batches = iter(loader)
    next(batches)
    first = time.perf_counter()
    for _ in range(steps):
        next(batches)
    done = time.perf_counter()
    loader.close()
    dataset.close()
    print(json.dumps({
        "construct_s": built - start, "first_batch_s": first - built,
        "steps_per_s": steps / (done - first) if steps else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pss_mb": _pss_mb(),
    }), flush=True)


def _pss_mb() -> float | None:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


#: Runs this file with another checkout of streamcache first (an editable install's import
#: finder would otherwise take precedence over ``sys.path``).
_BOOT = ("import runpy, sys\n"
         "sys.meta_path[:] = [f for f in sys.meta_path\n"
         "                    if type(f).__name__ != 'ScikitBuildRedirectingFinder']\n"
         "source, script = sys.argv[1:3]\n"
         "sys.path.insert(0, source)\n"
         "sys.argv = sys.argv[2:]\n"
         "runpy.run_path(script, run_name='__main__')\n")


def run_ranks(url: str, cache: str, world: int, steps: int, src: str | None,
              nodes: int = 1) -> list[dict]:
    """``world`` rank processes started together; their reports."""
    script = os.path.abspath(__file__)
    start = [sys.executable, "-W", "ignore"] + (["-c", _BOOT, src] if src else [])
    procs = [subprocess.Popen(
        [*start, script, "--child", url, "--cache", cache, "--rank", str(r),
         "--world", str(world), "--steps", str(steps), "--nodes", str(nodes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)]
    reports = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"a rank failed:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


# ---------------------------------------------------------------- the benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", default="1",
                        help="node counts, comma-separated: with N > 1 the W ranks are W/N to "
                             "a node (every rank process is counted; cases where N does not "
                             "divide W are skipped)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", default="1000,100000,1000000")
    parser.add_argument("--ranks", default="1,8")
    parser.add_argument("--throughput-steps", type=int, default=200)
    parser.add_argument("--data", default=os.path.join(OUT, "open-data"))
    parser.add_argument("--baseline", default=None)
    parser.add_argument("--baseline-shards", default="1000,100000")
    parser.add_argument("--baseline-ranks", default="1")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.cache, args.rank, args.world, args.steps, int(args.nodes))
        return
    counts = [int(c) for c in args.shards.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    urls = {n: make_dataset(os.path.join(args.data, f"shards-{n}"), n) for n in counts}
    node_counts = [int(c) for c in args.nodes.split(",")]
    cases = [("this", None, n, world, nodes) for n in counts for world in ranks
             for nodes in node_counts if world % nodes == 0]
    if args.baseline:
        cases += [("baseline", args.baseline, n, world, nodes)
                  for n in (int(c) for c in args.baseline_shards.split(","))
                  for world in (int(r) for r in args.baseline_ranks.split(","))
                  for nodes in node_counts if world % nodes == 0]
    results: dict[str, list[Any]] = {}
    for round_ in range(-1, args.repeats):  # round -1 installs the shards: not counted
        for source, src, n, world, nodes in cases:
            for case in ("cold", "warm"):
                cache = os.path.join(args.data, f"cache-{source}-{n}")
                if case == "cold":
                    shutil.rmtree(os.path.join(cache, "tables"), ignore_errors=True)
                steps = args.throughput_steps if world == 1 and case == "warm" else 0
                reports = run_ranks(urls[n], cache, world, steps if round_ >= 0 else 0, src,
                                    nodes)
                key = f"{source}|{n}|{world}|{case}" + (f"|{nodes}" if nodes > 1 else "")
                if round_ >= 0:
                    results.setdefault(key, []).append(reports)
                print(f"round {round_} {key}: " + json.dumps(_summary(reports)), flush=True)
    _report(results, sorted({case[0] for case in cases}, reverse=True), counts, ranks)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "open.json"), "w") as f:
        json.dump(results, f, indent=1)


def _summary(reports: list[dict]) -> dict[str, float]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in reports)
    return {"construct_s": round(med("construct_s"), 3),
            "first_batch_s": round(med("first_batch_s"), 3),
            "peak_rss_mb": round(med("peak_rss_mb"), 1),
            "sum_rss_mb": round(sum(r["peak_rss_mb"] for r in reports), 1),
            "sum_pss_mb": round(sum(r["pss_mb"] or 0 for r in reports), 1),
            **({"steps_per_s": round(med("steps_per_s"), 1)}
               if reports[0].get("steps_per_s") else {})}


def _report(results: dict[str, list[Any]], sources: list[str], counts: list[int],
            ranks: list[int]) -> None:
    print()
    header = (f"{'source':<9}{'shards':>9}{'ranks':>6} {'case':<5}{'construct s':>12}"
              f"{'first batch s':>14}{'peak RSS MB':>12}{'sum RSS MB':>11}{'sum PSS MB':>11}"
              f"{'steps/s':>9}")
    print(header)
    med: dict[str, dict[str, float]] = {}
    for key, rounds in results.items():
        summaries = [_summary(r) for r in rounds]
        med[key] = {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
        source, n, world, case, *nodes = key.split("|")
        m = med[key]
        world = f"{world}/{nodes[0]}n" if nodes else world
        print(f"{source:<9}{int(n):>9,}{world:>6} {case:<5}{m['construct_s']:>12.3f}"
              f"{m['first_batch_s']:>14.3f}{m['peak_rss_mb']:>12.1f}{m['sum_rss_mb']:>11.1f}"
              f"{m['sum_pss_mb']:>11.1f}{m.get('steps_per_s', float('nan')):>9.1f}")
    print()
    small = min(counts)
    for source in sources:
        for n in counts:
            if n == small:
                continue
            for world in ranks:
                for case in ("cold", "warm"):
                    base = med.get(f"{source}|{small}|{world}|{case}")
                    this = med.get(f"{source}|{n}|{world}|{case}")
                    if not base or not this:
                        continue
                    print(f"{source} {n:,} vs {small:,} shards, {world} rank(s), {case}: "
                          f"construction {this['construct_s'] / base['construct_s']:.2f}x, "
                          f"first batch {this['first_batch_s'] / base['first_batch_s']:.2f}x, "
                          f"peak RSS {this['peak_rss_mb'] - base['peak_rss_mb']:+.1f} MB a "
                          f"process, {this['sum_rss_mb'] - base['sum_rss_mb']:+.1f} MB RSS "
                          f"and {this['sum_pss_mb'] - base['sum_pss_mb']:+.1f} MB PSS over "
                          "the ranks")
    for key, this in med.items():  # several nodes against one, the same ranks and shards
        source, n, world, case, *nodes = key.split("|")
        base = med.get("|".join((source, n, world, case)))
        if nodes and base:
            print(f"{source} {int(n):,} shards, {world} ranks as {nodes[0]} nodes vs one node, "
                  f"{case}: peak RSS {this['peak_rss_mb'] - base['peak_rss_mb']:+.1f} MB a "
                  f"process, {this['sum_pss_mb'] - base['sum_pss_mb']:+.1f} MB PSS over the "
                  f"ranks, first batch {this['first_batch_s'] / base['first_batch_s']:.2f}x")


if __name__ == "__main__":
    main()
