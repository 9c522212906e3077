"""Cold start: time to the first batch, samples/s over the first 4,096 samples (the first
batch and the downloads included), bytes and requests, over an object server on loopback.

Run:  python benchmarks/bench_cold.py [--mb 256] [--mb-100kb 450] [--repeats 3]
          [--stores loopback,20ms-100MBps] [--kinds 1kb,100kb]
      python benchmarks/bench_cold.py --chunk-sizes      (stored bytes per chunk size)

Setup: tests/servers.py's FaultServer in a process of its own (GET and HEAD with single
ranges, reading only the bytes asked for; S3's ListObjectsV2; every request and byte
counted), as plain loopback and with a store model: a 20 ms first-byte latency on every
request and 100 MB/s per connection, what a request to S3 costs. Two datasets written at the
library's defaults (ShardWriter: zstd, 64 KiB chunks, 64 MB shards): "1kb" (256 int32 tokens
of a Zipf vocabulary per sample, global batch 256) and "100kb" (100 KB of random bytes per
sample, as encoded images are, global batch 32). Every case starts cold (a new StreamDataset
and StreamLoader over an empty cache folder, default options; the default shuffle window
covers these datasets whole) and reads the first 4,096 samples; the clock starts before the
dataset is made (the index read counts).

  ranges-off  the cold-start rule switched off (reader.cold_ranges=False): the first batch
              waits for the whole shards it touches, as every version before range reads
  after       this version: the first steps by range ahead of the downloads, then whole
              shards in first-use order (docs/cache.md, "Range reads and the cold start")
  warm        every shard installed already: the floor (making the dataset, reading the
              index, starting threads) that no cold start can go below

The cases run interleaved (one round of all of them per repeat); the table gives medians, and
each ratio is the median of the per-round ratios. Results also go to benchmarks/out/cold.json.
The comparison with WebDataset, LitData and Mosaic on the same server is
benchmarks/peers/cold.py. Last results: docs/cache.md ("Cold start: measured").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from streamcache import ShardWriter, StreamDataset, StreamLoader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from servers import StoreModel, serve_in_process, server_totals  # noqa: E402

STORES = {"loopback": StoreModel(), "20ms-100MBps": StoreModel(0.02, 100e6)}

FIRST = 4096
CASES = ("ranges-off", "after", "warm")
BATCH = {"1kb": 256, "100kb": 32}


def samples(kind: str, megabytes: int) -> Any:
    rng = np.random.default_rng(0)
    if kind == "1kb":
        for _ in range(megabytes * 1024):
            yield {"tokens": np.minimum(rng.zipf(1.2, 256), 50_000).astype(np.int32)}
    else:
        for _ in range(megabytes * 10):  # (--mb-100kb 450: 4,500 samples, one epoch > 4,096)
            yield {"image": rng.bytes(100_000), "label": int(rng.integers(1000))}


class ObjectServer:
    """The files under ``root`` served by tests/servers.py's FaultServer in a process of its
    own (as a remote store is: it does not share the client's interpreter lock), with the
    store model ``store``. A context manager."""

    def __init__(self, root: str, store: StoreModel) -> None:
        self._process, self.url = serve_in_process(root, store)

    def totals(self, *, reset: bool = False) -> dict[str, int]:
        return server_totals(self.url, reset=reset)

    def __enter__(self) -> ObjectServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._process.terminate()
        self._process.wait(10)


def build(root: str, kind: str, megabytes: int) -> None:
    """Write the dataset at the library's defaults (zstd, 64 KiB chunks, 64 MB shards)."""
    with ShardWriter(os.path.join(root, kind)) as writer:
        for sample in samples(kind, megabytes):
            writer.write(sample)


def cold_run(url: str, kind: str, scratch: str, cold_ranges: bool = True,
             cache: str | None = None) -> dict[str, float]:
    """Seconds to the first batch and samples/s over the first FIRST samples, cold (or from
    ``cache``, kept, when given)."""
    keep = cache is not None
    cache = cache or tempfile.mkdtemp(dir=scratch)
    started = time.perf_counter()
    dataset = StreamDataset(url, global_batch_size=BATCH[kind], rank=0, world_size=1,
                            cache_dir=cache)
    dataset.reader.cold_ranges = cold_ranges
    loader = StreamLoader(dataset)
    first = 0.0
    seen = 0
    try:
        for batch in loader:
            seen += len(batch["__id__"])
            if not first:
                first = time.perf_counter() - started
            if seen >= FIRST:
                break
        elapsed = time.perf_counter() - started
        ranged = dataset.reader.range_stats
    finally:
        loader.close()
        if not keep:
            shutil.rmtree(cache, ignore_errors=True)
    return {"first_s": first, "samples_per_s": seen / elapsed, "range_bytes": ranged.bytes,
            "range_requests": ranged.requests}


def run_round(server: ObjectServer, kind: str, scratch: str, turn: int,
              ) -> dict[str, dict[str, float]]:
    """Every case once, the order rotated by ``turn`` (no case always runs first)."""
    url = f"{server.url}/{kind}"
    runs = {
        "ranges-off": lambda: cold_run(url, kind, scratch, cold_ranges=False),
        "after": lambda: cold_run(url, kind, scratch),
        "warm": lambda: cold_run(url, kind, scratch, cache=os.path.join(scratch, kind)),
    }
    order = CASES[turn % len(CASES):] + CASES[:turn % len(CASES)]
    out = {}
    for case in order:
        server.totals(reset=True)
        out[case] = {**runs[case](), **server.totals()}
    return out


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    def median(case: str, key: str) -> float:
        return statistics.median(r[case][key] for r in rounds)

    def ratio(num: str, den: str, key: str) -> float:
        return statistics.median(r[num][key] / r[den][key] for r in rounds)

    out: dict[str, Any] = {case: {key: median(case, key) for key in rounds[0][case]}
                           for case in CASES}
    out["first_off_over_after"] = ratio("ranges-off", "after", "first_s")
    out["rate_after_over_off"] = ratio("after", "ranges-off", "samples_per_s")
    return out


def chunk_sizes() -> None:
    """Stored bytes and bytes per chunk of one 16 MB shard of 1 KB token samples (zstd), for
    chunk sizes from 8 KiB to 128 KiB, against one record batch per shard."""
    import pyarrow as pa

    data = [s["tokens"] for s in samples("1kb", 16)]
    scratch = tempfile.mkdtemp(prefix="bench-chunks-")
    try:
        sizes = {}
        for kib in (None, 8, 16, 32, 64, 128):
            folder = os.path.join(scratch, str(kib))
            chunk = {"chunk_size": 1 << 30} if kib is None else {"chunk_size": kib << 10}
            with ShardWriter(folder, shard_size=1 << 30, **chunk) as writer:
                writer.write_batch(pa.table({"tokens": pa.array(data, pa.large_list(pa.int32()))}))
            assert writer.index is not None
            info = writer.index.shards[0]
            sizes[kib] = (info.bytes, -(-info.rows // (info.chunk_rows or info.rows)))
        base = sizes[None][0]
        for kib, (nbytes, chunks) in sizes.items():
            if kib is not None:
                print(f"chunk {kib:4d} KiB: stored {nbytes / base:.3f}x one batch, "
                      f"{nbytes / chunks / 1024:.1f} KiB per chunk on the wire")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="MB of 1 KB samples")
    parser.add_argument("--mb-100kb", type=int, default=450, help="MB of 100 KB samples")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="1kb,100kb")
    parser.add_argument("--chunk-sizes", action="store_true",
                        help="only compare chunk sizes (stored bytes, bytes per chunk)")
    args = parser.parse_args(argv)
    if args.chunk_sizes:
        chunk_sizes()
        return 0
    kinds = args.kinds.split(",")
    scratch = tempfile.mkdtemp(prefix="bench-cold-")
    results: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg()}
    try:
        data = os.path.join(scratch, "served")
        for kind in kinds:
            build(data, kind, args.mb if kind == "1kb" else args.mb_100kb)
        for store_name in args.stores.split(","):
            with ObjectServer(data, STORES[store_name]) as server:
                for kind in kinds:  # a warm-up (imports, connections), and the warm case's cache
                    cache = os.path.join(scratch, kind)
                    if not os.path.isdir(cache):
                        os.makedirs(cache)
                        dataset = StreamDataset(f"{server.url}/{kind}", global_batch_size=1,
                                                rank=0, world_size=1, cache_dir=cache)
                        for shard in range(len(dataset.index.shards)):
                            dataset.reader.store.local_path(shard)
                        dataset.close()
                rounds: dict[str, list[Any]] = {kind: [] for kind in kinds}
                for repeat in range(args.repeats):
                    for kind in kinds:
                        rounds[kind].append(run_round(server, kind, scratch, repeat))
                        print(f"round {repeat + 1} {store_name} {kind}: " + ", ".join(
                            f"{case} {rounds[kind][-1][case]['first_s']:.2f}s"
                            for case in CASES), flush=True)
                for kind in kinds:
                    key = f"{store_name}/{kind}"
                    results[key] = summarize(rounds[kind])
                    results[key]["rounds"] = rounds[kind]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    print_table(results, [k for k in results if "/" in k])
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "cold.json"), "w") as file:
        json.dump(results, file, indent=1)
    return 0


def print_table(results: dict[str, Any], keys: list[str]) -> None:
    print(f"{'store/data':20} {'case':11} {'first batch s':>13} {'samples/s':>10} {'MB':>7} "
          f"{'requests':>9} {'range req':>9}")
    for key in keys:
        r = results[key]
        for case in CASES:
            m = r[case]
            print(f"{key:20} {case:11} {m['first_s']:13.2f} {m['samples_per_s']:10,.0f} "
                  f"{m['bytes'] / 1e6:7,.0f} {m['requests']:9,.0f} {m['range_requests']:9,.0f}")
        print(f"{key:20} first batch ranges-off/after {r['first_off_over_after']:.1f}x, "
              f"samples/s after/ranges-off {r['rate_after_over_off']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
