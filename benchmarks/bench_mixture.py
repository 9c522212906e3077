"""A mixture of many sources: time to the first batch and peak memory, by number of sources.

Run:  python benchmarks/bench_mixture.py
          [--sources 10,500,3000] [--repeats 3] [--before SRC] [--store local|s3]

Data (written once under benchmarks/out/mixture): N sources, each a dataset of 64 samples of
int32[64] tokens written by ShardWriter at the defaults (zstd, default chunk and shard sizes,
one shard a source), weights drawn from a seeded RNG in [0.5, 1.5) with two decimals, as
people write them (with 3,000 their ratios need the longest quota period, 65,536). The
mixture is read at the library's defaults (shuffle on, tail "drop", no cache limit,
num_workers 0) with a global batch of 256, infinite, one fresh process per measurement:

  open      StreamDataset([...Source...]) and StreamLoader (every source's index loaded)
  first     from the start of ``open`` to the first batch in hand
  next      20 more steps after the first (ms a step)
  RSS       the process's peak resident memory (ru_maxrss), and its peak after importing
            streamcache and torch alone (the floor every row includes)

``--before SRC`` measures an exported commit too (``git archive <commit> streamcache | tar -x
-C SRC`` plus the built ``_core`` extension copied into ``SRC/streamcache``), interleaved with
the working tree (or ``--after SRC``, another export): each repeat runs both, alternating
which goes first. Medians are printed; benchmarks/out/bench_mixture.json has every run.
``--cache cold`` (default) gives every run a fresh cache folder (a job's first start: the
shards are installed while the loader starts); ``--cache warm`` keeps one folder, with every
source installed, between runs (a restart). ``--store s3`` reads the same sources as
``s3://sources/s00000...`` from tests/servers.py's S3-compatible server on loopback, in a
process of its own (every index and shard a request), instead of the local folder.

Last result: see docs/mixtures.md ("Many sources").
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # (servers.py, --store s3)
OUT = os.path.join(HERE, "out")
ROOT = os.path.join(OUT, "mixture")
SAMPLES, ROW, BATCH, STEPS, SEED = 64, 64, 256, 20, 7


def source_url(n: int, endpoint: str | None = None) -> str:
    """Source ``n``: its folder, or with ``endpoint`` its URL on the loopback S3 server
    (which serves ROOT, the first folder being the bucket)."""
    if endpoint:
        return f"s3://sources/s{n:05d}"
    return os.path.join(ROOT, "sources", f"s{n:05d}")


def write_sources(count: int) -> None:
    """Sources 0..count-1, each written once (kept between runs)."""
    import numpy as np

    from streamcache import ShardWriter

    for n in range(count):
        url = source_url(n)
        if os.path.exists(os.path.join(url, "index.json")):
            continue
        with ShardWriter(url) as writer:
            for i in range(SAMPLES):
                writer.write({"tokens": np.full(ROW, n * SAMPLES + i, dtype=np.int32)})


def weights(count: int) -> list[float]:
    import numpy as np

    return np.round(np.random.default_rng(SEED).uniform(0.5, 1.5, count), 2).tolist()


def child(count: int, src: str | None, endpoint: str | None = None) -> dict[str, float]:
    """One measurement in this (fresh) process."""
    if src:
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not type(f).__module__.startswith("_editable_skbc_streamcache")]
        sys.path.insert(0, src)
    import torch  # noqa: F401  (the floor: what every run imports)

    import streamcache
    from streamcache import Source, StreamDataset, StreamLoader

    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cache = os.path.join(ROOT, "cache")
    start = time.perf_counter()
    sources = [Source(source_url(n, endpoint), weight=w) for n, w in enumerate(weights(count))]
    storage = None
    if endpoint:
        from servers import s3_storage_options

        storage = s3_storage_options(endpoint)
    loader = StreamLoader(StreamDataset(sources, global_batch_size=BATCH, seed=SEED,
                                        cache_dir=cache, infinite=True,
                                        storage_options=storage))
    opened = time.perf_counter()
    batches = iter(loader)
    next(batches)
    first = time.perf_counter()
    for _ in range(STEPS):
        next(batches)
    done = time.perf_counter()
    loader.close()
    return {"open_s": opened - start, "first_s": first - start,
            "step_ms": (done - first) / STEPS * 1000,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "floor_mb": floor, "module": os.path.dirname(streamcache.__file__)}


def measure(count: int, src: str | None, endpoint: str | None = None) -> dict[str, float]:
    command = [sys.executable, os.path.abspath(__file__), "--child", str(count)]
    if src:
        command += ["--src", src]
    if endpoint:
        command += ["--endpoint", endpoint]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", default="10,500,3000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default=None, help="an exported commit to compare with")
    parser.add_argument("--after", default=None,
                        help="an exported commit to measure instead of the working tree")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold")
    parser.add_argument("--store", choices=["local", "s3"], default="local")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--src", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.src, args.endpoint)))
        return
    counts = [int(c) for c in args.sources.split(",")]
    write_sources(max(counts))
    if args.store == "s3":
        from servers import aws_test_environment, serve_in_process

        with aws_test_environment():  # (the children inherit the dummy credentials)
            server, endpoint = serve_in_process(ROOT)
            try:
                run(args, counts, endpoint)
            finally:
                server.terminate()
                server.wait(10)
        return
    run(args, counts, None)


def run(args: argparse.Namespace, counts: list[int], endpoint: str | None) -> None:
    installs = [("after", args.after)] + ([("before", args.before)] if args.before else [])
    runs: list[dict[str, object]] = []
    for repeat in range(args.repeats):
        for count in counts:
            for name, src in (installs if repeat % 2 == 0 else installs[::-1]):
                if args.cache == "cold":
                    shutil.rmtree(os.path.join(ROOT, "cache"), ignore_errors=True)
                result = measure(count, src, endpoint)
                runs.append({"install": name, "sources": count, "repeat": repeat,
                             "cache": args.cache, "store": args.store, **result})
                print(f"  {name:6} {count:5} sources  first {result['first_s']:7.2f} s  "
                      f"peak RSS {result['rss_mb']:7.0f} MB", flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_mixture.json"), "w") as f:
        json.dump(runs, f, indent=1)
    print(f"\n{'install':8}{'sources':>8}{'open s':>9}{'first s':>9}{'step ms':>9}"
          f"{'peak RSS MB':>13}{'floor MB':>10}")
    for count in counts:
        for name, _ in installs:
            mine = [r for r in runs if r["install"] == name and r["sources"] == count]

            def median(key: str, rows: list[dict[str, object]] = mine) -> float:
                return statistics.median(float(r[key]) for r in rows)  # type: ignore[arg-type]

            print(f"{name:8}{count:8}{median('open_s'):9.2f}{median('first_s'):9.2f}"
                  f"{median('step_ms'):9.1f}{median('rss_mb'):13.0f}{median('floor_mb'):10.0f}")


if __name__ == "__main__":
    main()
