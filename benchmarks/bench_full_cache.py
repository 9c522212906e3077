"""Installs into a full node cache that holds many shards: what choosing a victim costs.

Run:  python benchmarks/bench_full_cache.py [--residents 10000] [--shards 400] [--repeats 3]
                                            [--baseline SRC]

A cache folder is filled once (under benchmarks/out/full-cache) with ``--residents`` installed
one-row shards of one dataset (bench_cache.py's ``small`` shards: zstd Arrow files indexed
with checksums, so every shard is installed). Each case copies that folder (not timed) and,
in a fresh process, reads one epoch of another dataset of ``--shards`` such shards through
StreamDataset + StreamLoader at the defaults, with ``cache_limit`` set to the bytes the folder
holds: every install first evicts (the other dataset's shards, whose next use is unknown,
go first). Reported: installs per second of the epoch, and evictions. ``--baseline SRC`` runs
the same cases with ``SRC`` (an exported version of streamcache, see bench_open.py) first on
``sys.path``, alternating with this tree's in every repetition.

Last result (2026-12-06 21:07-21:11 UTC, ``--residents 10000 --shards 300 --repeats 3
--baseline <export of d50370e>``, the 2-core machine otherwise quiet, load average 1.08
before, 1.25 after): the baseline (a Python key per resident, two rankings an eviction)
6.1, 8.6 and 9.9 installs/s; this (one numpy ranking, cache/eviction.py
``victims_in_order``) 67.4, 62.1 and 59.1 (medians 8.6 and 62.1: 7.2x). Into an empty cache
the same shards install at ~200/s (bench_cache.py's ``small`` part).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out", "full-cache")
sys.path.insert(0, HERE)
from bench_cache import one_row_shards  # noqa: E402

CHILD = r"""
import json, os, sys, time
if sys.argv[1]:  # (the editable install's finder comes before sys.path: drop it)
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not type(f).__module__.startswith("_editable_skbc_streamcache")]
    sys.path.insert(0, sys.argv[1])
import streamcache
from streamcache import StreamDataset, StreamLoader
url, cache_dir, limit = sys.argv[2], sys.argv[3], int(sys.argv[4])
began = time.perf_counter()
dataset = StreamDataset(url, global_batch_size=16, rank=0, world_size=1, cache_dir=cache_dir,
                        cache_limit=limit, shuffle_window=64)
with StreamLoader(dataset) as loader:
    samples = sum(len(step["id"]) for step in loader)
seconds = time.perf_counter() - began
dataset.close()
print(json.dumps({"seconds": seconds, "samples": samples, "imported": streamcache.__file__}))
"""


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(folder) for name in names
               if name.endswith(".arrow"))


def filled(residents: int) -> tuple[str, int]:
    """The cache folder holding ``residents`` installed shards (made once) and their bytes."""
    from streamcache import StreamDataset, StreamLoader

    base = os.path.join(OUT, f"base-{residents}")
    marker = base + ".done"
    if not os.path.exists(marker):
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(base + "-src", ignore_errors=True)
        url = one_row_shards(base + "-src", residents)
        dataset = StreamDataset(url, global_batch_size=64, rank=0, world_size=1,
                                cache_dir=os.path.join(base, "cache"))
        with StreamLoader(dataset) as loader:
            for _ in loader:
                pass
        dataset.close()
        with open(marker, "w") as f:
            f.write("done\n")
    return os.path.join(base, "cache"), folder_bytes(os.path.join(base, "cache"))


def reader_dataset(shards: int) -> str:
    """The dataset read into the full cache: ``shards`` one-row shards (made once)."""
    url = os.path.join(OUT, f"reader-{shards}")
    if not os.path.exists(url + ".done"):
        shutil.rmtree(url, ignore_errors=True)
        one_row_shards(url, shards)
        with open(url + ".done", "w") as f:
            f.write("done\n")
    return url


def one(src: str, url: str, base: str, limit: int, shards: int) -> dict[str, Any]:
    work = os.path.join(OUT, "work")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work, symlinks=True)
    try:
        result = subprocess.run([sys.executable, "-c", CHILD, src, url, work, str(limit)],
                                capture_output=True, text=True, check=True)
        run = json.loads(result.stdout.strip().splitlines()[-1])
        installed = sum(name.endswith(".arrow") for root, _, names in os.walk(work)
                        for name in names)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    run["installs_s"] = shards / run["seconds"]
    run["resident_after"] = installed
    return run


def clock() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--residents", type=int, default=10_000)
    parser.add_argument("--shards", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None)
    args = parser.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    base, limit = filled(args.residents)
    url = reader_dataset(args.shards)
    codes = {"this": ""} if args.baseline is None else {"baseline": args.baseline, "this": ""}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in codes}
    print(f"load average {os.getloadavg()[0]:.2f} at {clock()} UTC", flush=True)
    for repeat in range(args.repeats):
        names = list(codes) if repeat % 2 == 0 else list(reversed(codes))
        for name in names:
            run = one(codes[name], url, base, limit, args.shards)
            runs[name].append(run)
            print(f"{name:9} {run['installs_s']:8.1f} installs/s  {run['seconds']:6.2f} s  "
                  f"resident after {run['resident_after']}  ({run['imported']})", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at {clock()} UTC")
    for name, rows in runs.items():
        rate = statistics.median(r["installs_s"] for r in rows)
        print(f"{name:9} median {rate:8.1f} installs/s into a cache of {args.residents:,} shards "
              f"({limit:,} bytes, the limit)")
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump({"args": vars(args), "limit": limit, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
