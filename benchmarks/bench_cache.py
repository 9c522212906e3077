"""Node cache and prefetcher: cold epoch, warm reads, reader wait, Belady vs LRU, many small
shards.

Run:  python benchmarks/bench_cache.py [--repeats 5] [--mb 64] [--workers 4]
          [--parts cold,warm,wait,evict,small] [--small-shards 10000]

Four parts, each a ratio measured in the same run (cases interleaved per repetition; the
median of the per-repetition ratios is reported), and one rate (small):

cold   a dataset of --mb MB (about 100 KB samples, random bytes, zstd Arrow shards of ~2 MB)
       in moto's S3-compatible server on 127.0.0.1 (tests/servers.py).
         raw       s3fs ``fs.cat(all shard URLs, batch_size=workers)``: the network limit here
         cache     a cold NodeCache + Prefetcher (workers threads) installing every shard:
                   download to a temporary file, fsync, xxh64, decode, write the local
                   layout, fsync, rename (what a first epoch pays)
       ratio = raw seconds / cache seconds (1.0: the cache installs at the network's rate).
warm   batch reads from a warm cache (page cache hot) through ``DatasetReader.read_batch``
       of random ids, vs the page-cache gather limit: the faster of (a) the native gather
       called directly on the same memory-mapped columns with the rows located in advance
       and (b) numpy fancy indexing of them (no index lookup, no store, no checks); a
       contiguous copy of the same bytes (memcpy) is shown as the bandwidth ceiling.
         small  ~1 KB samples (uint8[1024]), batches of 512
         large  ~100 KB samples (uint8[100000]), batches of 64
       ratio = reader rows/s / limit rows/s.
wait   one epoch in plan order (shuffled, windows of 2 shards) of a --mb MB dataset of
       10 KB samples from a cold cache on S3, batches of 64, with --compute-ms of simulated
       compute per step: time in ``read_batch`` per step with prefetching (Prefetcher,
       lookahead 16) and without (NodeCache installing on demand).
evict  Belady vs LRU re-fetches with cache_limit at 30% of the dataset over 3 epochs of the
       real plan order (EpochOrder, shuffled, windows of 8 shards): a pure simulation over
       the order (streamcache.cache.eviction.simulate_fetches), and a real run of the same reads
       through a NodeCache (local compressed source, so every fetch materializes).
small  a cold first epoch of --small-shards one-row shards (local zstd Arrow files, indexed
       with checksums: every shard is installed) through StreamDataset + StreamLoader with
       the defaults (global batches of 64, 4 prefetch threads), each repetition into a fresh
       cache folder: shards installed per second of the epoch (the median). Bounded, before
       #33 item 7, by the rewrite of the whole accounting file on every install.

Results go to benchmarks/out/bench_cache.json.

small, last results (2026-12-04, the 2-core VM shared with other engineers' jobs: measured
under load; ``--parts small --small-shards 10000``; load average from ``uptime`` at the
start and the end of each run):

  code                                   installs/s   epoch s   load average
  before (accounting rewritten per install)    18.2     548.5   1.90 -> 5.76  (1 repetition)
  after (records appended: cache/ledger.py)    293.4      34.1   1.31 -> 4.11  (3 repetitions:
                                                                 293, 277, 297 installs/s)

After the change an install of a one-row shard is the download, the decode and five fsyncs
(the downloaded temporary and its folder, the materialized file and its folder, the shard
folder): about 3 ms each on this disk, most of what is left.

Last results (2026-11-29, 2-core VM shared with other engineers' jobs: load average 5.4-5.8
during the runs; Python 3.11; ``--repeats 5 --mb 64 --workers 8``; the S3 server and the
client share the two cores; ratios are taken round by round, then the median). Two full runs
a few minutes apart, to show the spread (run 1 before the eviction grace period was added,
run 2 with it):

  part                          run 1: ours   limit   ratio    run 2: ours    limit   ratio
  cold epoch MB/s (S3)                 45.6    59.6    0.83            67.8    116.4    0.74
  warm small rows/s (1 KB)          2693403 5684510    0.65         1395041  3339895    0.41
  warm large rows/s (100 KB)          43098   49789    0.90           62975    72352    0.93
  read ms/step, prefetch on/off  6.46/33.70            5.2x       5.17/14.67             2.8x
  after the first step, on/off   1.53/21.91           14.4x       0.67/12.29            18.4x
  fetches Belady/LRU, simulated     158/216           1.59          158/216            1.59
  fetches Belady/LRU, real          158/216           1.59          158/216            1.59

Later cold-only reruns (``--parts cold --repeats 7 --mb 64``), after the cache stopped
probing compressed shards for the local layout (that probe decompressed each shard once
more): 0.53 with --workers 8 (load average 6.5) and 0.65 with --workers 4 (load 5-6; raw
130 MB/s, cache 67 MB/s, per-round ratios 0.46 to 1.28). Measured alongside, per 64 MB:
the cache used 0.45-0.6 s of CPU against 0.3 s for raw reads, of which materializing
(decode, write) and the checksum take about 0.1 s; the rest is the Fetcher's block-by-block
streaming to a file and thread hand-offs. On this loaded 2-core machine the cold target of
0.8 is therefore met in some runs and missed in others.

cold: the cache installs at 0.74-0.83 of the raw network rate (target 0.8) while it also
fsyncs, checksums, decodes and writes every shard; per round the ratio ranged from 0.50 to
1.60 (the raw rate alone from 22 to 124 MB/s), and the cache's CPU work competes with the
moto server for the same two cores, which raw reads do not. warm: 0.90-0.93 of the
page-cache gather limit for 100 KB samples, 0.41-0.65 for 1 KB samples in batches of 512
(target 0.5): the store is not involved in warm reads (DatasetReader keeps its mapped
shards); what separates the reader from the limit is DatasetReader's per-batch
bookkeeping (locate, unique, per-field views, about half of 0.1 ms a batch when profiled
alone). wait: with 20 ms of compute per step, prefetching cuts the reader's time per step
by 3-5x over the epoch and by 14-18x after the first step (the first step is a cold start).
evict: 60 shards, 3 epochs, limit 30%: LRU re-fetched 156 shards, Belady 98 (1.59x), and
the real cache made the simulated number of fetches in both full runs. With the eviction
grace period (a shard some process's lookup() handed out in the last 2 s is kept unless
nothing else makes room) the real count depends on timing: one ``--parts evict`` run gave
160 Belady fetches against 158 simulated (this benchmark reads shards milliseconds apart,
so the grace can override Belady), still 216 for LRU.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from servers import MotoServer, S3Bucket, aws_test_environment  # noqa: E402

from streamcache import (  # noqa: E402
    DatasetReader,
    StreamDataset,
    StreamLoader,
    _native,
    load_index,
    write_dataset,
)
from streamcache.cache.advice import shard_usage  # noqa: E402
from streamcache.cache.eviction import simulate_fetches  # noqa: E402
from streamcache.cache.node import NodeCache  # noqa: E402
from streamcache.cache.prefetch import Prefetcher, PrefetchOptions  # noqa: E402
from streamcache.format.index import DatasetIndex, build_index  # noqa: E402
from streamcache.format.reader import ShardReader  # noqa: E402
from streamcache.plan import EpochOrder, ShuffleOptions  # noqa: E402
from streamcache.remote.options import FetchOptions  # noqa: E402

OUT = os.path.join(HERE, "out")


def blobs(count: int, size: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    for i in range(count):
        yield {"id": i, "data": rng.integers(0, 256, size, dtype=np.uint8)}


def schema(size: int) -> dict[str, str]:
    return {"id": "int", "data": f"tensor:uint8:{size}"}


# ------------------------------------------------------------------------------- cold


def cold_raw(urls: list[str], options: dict[str, Any], workers: int) -> float:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    started = time.perf_counter()
    fs.cat(urls, batch_size=workers)
    return time.perf_counter() - started


def cold_cache(index: DatasetIndex, options: dict[str, Any], workers: int,
               scratch: str) -> float:
    cache_dir = tempfile.mkdtemp(dir=scratch)
    fetch = FetchOptions(max_concurrency=workers, storage_options=options)
    cache = NodeCache(index, cache_dir, fetch_options=fetch)
    shards = list(range(len(index.shards)))
    started = time.perf_counter()
    with Prefetcher(cache, PrefetchOptions(workers=workers, lookahead_shards=len(shards))) as p:
        p.update(shards, shards)
        for shard in shards:
            p.local_path(shard)
        seconds = time.perf_counter() - started
    shutil.rmtree(cache_dir, ignore_errors=True)
    return seconds


def run_cold(bucket: S3Bucket, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    options = bucket.storage_options(client_retries=True)
    size = 100_000
    count = int(args.mb * 1e6 / size)
    write_dataset(blobs(count, size, 0), bucket.url("cold"), schema=schema(size),
                  shard_size=2_000_000, storage_options=options)
    index = load_index(bucket.url("cold"), options)
    urls = [index.shard_url(k) for k in range(len(index.shards))]
    mb = index.total_bytes / 1e6
    cold_cache(index, options, args.workers, scratch)  # warm-up: connections, imports
    times: dict[str, list[float]] = {"raw": [], "cache": []}
    for repeat in range(args.repeats):
        times["raw"].append(cold_raw(urls, options, args.workers))
        times["cache"].append(cold_cache(index, options, args.workers, scratch))
        print(f"cold round {repeat + 1}: raw {mb / times['raw'][-1]:.1f} MB/s, "
              f"cache {mb / times['cache'][-1]:.1f} MB/s", flush=True)
    ratios = [raw / own for raw, own in zip(times["raw"], times["cache"], strict=True)]
    return {"mb": mb, "shards": len(urls), "seconds": times,
            "raw_mb_s": mb / statistics.median(times["raw"]),
            "cache_mb_s": mb / statistics.median(times["cache"]),
            "ratio": statistics.median(ratios)}


# ------------------------------------------------------------------------------- warm


def warm_case(folder: str, size: int, count: int, batch: int, args: argparse.Namespace,
              ) -> dict[str, Any]:
    index = write_dataset(blobs(count, size, 1), os.path.join(folder, f"src{size}"),
                          schema=schema(size), shard_size=8_000_000)
    cache = NodeCache(index, os.path.join(folder, f"cache{size}"))
    reader = DatasetReader(index, fields=["data"], store=cache)
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, count, batch) for _ in range(args.warm_batches)]
    for ids in batches[:4]:
        reader.read_batch(ids)  # installs and maps every shard touched
    for k in range(len(index.shards)):
        reader.shard_reader(k)
    mapped = [ShardReader(cache.local_path(k), index.schema) for k in range(len(index.shards))]
    columns = [m.buffers("data").data.reshape(-1, size) for m in mapped]
    starts = np.concatenate([[0], np.cumsum(index.shard_rows)])

    located = [(np.searchsorted(starts, ids, side="right") - 1) for ids in batches]
    located_rows = [ids - starts[shards] for ids, shards in zip(batches, located, strict=True)]
    flat = [c.reshape(-1) for c in columns]

    def numpy_gather() -> None:  # fancy indexing, shard by shard
        for ids, shards in zip(batches, located, strict=True):
            out = np.empty((len(ids), size), dtype=np.uint8)
            for k in np.unique(shards):
                chosen = shards == k
                out[chosen] = columns[k][ids[chosen] - starts[k]]

    def native_gather() -> None:  # the core's gather, rows located in advance
        for shards, rows in zip(located, located_rows, strict=True):
            out = np.empty((len(rows), size), dtype=np.uint8)
            _native.gather_fixed(flat, size, shards.astype(np.int32), rows, out)

    def memcpy() -> None:  # the same bytes, contiguous: the bandwidth ceiling
        for ids in batches:
            out = np.empty((len(ids), size), dtype=np.uint8)
            np.copyto(out, columns[0][: len(ids)])

    def ours() -> None:
        for ids in batches:
            reader.read_batch(ids)

    cases = {"numpy": numpy_gather, "native": native_gather, "memcpy": memcpy, "reader": ours}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, run in cases.items():
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
    rows = len(batches) * batch
    limits = [min(a, b) for a, b in zip(times["numpy"], times["native"], strict=True)]
    ratios = [lim / own for lim, own in zip(limits, times["reader"], strict=True)]
    reader.close()
    for m in mapped:
        m.close()
    rate = {name: rows / statistics.median(t) for name, t in times.items()}
    return {"sample_bytes": size, "batch": batch, "rows": rows, "seconds": times,
            "rows_s": rate, "limit_rows_s": rows / statistics.median(limits),
            "reader_rows_s": rate["reader"],
            "reader_gb_s": rate["reader"] * size / 1e9,
            "memcpy_gb_s": rate["memcpy"] * size / 1e9,
            "ratio": statistics.median(ratios)}


def run_warm(scratch: str, args: argparse.Namespace) -> dict[str, Any]:
    folder = tempfile.mkdtemp(dir=scratch)
    return {"small": warm_case(folder, 1024, 40_000, 512, args),
            "large": warm_case(folder, 100_000, 600, 64, args)}


# ------------------------------------------------------------------------------- wait


def run_wait(bucket: S3Bucket, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    options = bucket.storage_options(client_retries=True)
    size = 10_000
    write_dataset(blobs(int(args.mb * 1e6 / size), size, 4), bucket.url("wait"),
                  schema=schema(size), shard_size=2_000_000, storage_options=options)
    index = load_index(bucket.url("wait"), options)
    order = EpochOrder(index.shard_rows, seed=1, epoch=0,
                       shuffle=ShuffleOptions(window=2, window_unit="shards"))
    usage = shard_usage(order)
    fetch = FetchOptions(max_concurrency=args.workers, storage_options=options)
    batch = 64
    results: dict[str, Any] = {}
    for mode in ("off", "on"):
        cache = NodeCache(index, tempfile.mkdtemp(dir=scratch), fetch_options=fetch)
        prefetcher = Prefetcher(cache, PrefetchOptions(workers=args.workers)) \
            if mode == "on" else None
        reader = DatasetReader(index, fields=["id"], store=prefetcher or cache)
        spent: list[float] = []
        for position in range(0, order.num_samples, batch):
            if prefetcher is not None:
                prefetcher.update(*usage.upcoming(position))
            ids = order.sample_ids(position, min(order.num_samples, position + batch))
            began = time.perf_counter()
            reader.read_batch(ids)
            spent.append(time.perf_counter() - began)
            time.sleep(args.compute_ms / 1e3)
        steps = len(spent)
        results[mode] = {"steps": steps, "read_ms_per_step": sum(spent) / steps * 1e3,
                         "first_step_ms": spent[0] * 1e3,
                         "later_steps_ms": sum(spent[1:]) / max(1, steps - 1) * 1e3}
        if prefetcher is not None:
            stats = prefetcher.stats
            results[mode].update(wait_ms_per_step=stats.wait_s / steps * 1e3, hits=stats.hits,
                                 misses=stats.misses)
        reader.close()
        print(f"wait {mode}: {results[mode]}", flush=True)
    results["compute_ms"] = args.compute_ms
    return results


# ------------------------------------------------------------------------------- evict


def plan_reads(index: DatasetIndex, epochs: int, batch: int) -> np.ndarray:
    """The shards read, in order, batch by batch (a shard once per batch)."""
    reads: list[np.ndarray] = []
    for epoch in range(epochs):
        order = EpochOrder(index.shard_rows, seed=5, epoch=epoch,
                           shuffle=ShuffleOptions(window=8, window_unit="shards"))
        for position in range(0, order.num_samples, batch):
            shards, _ = order.locate(position, min(order.num_samples, position + batch))
            reads.append(shards[np.sort(np.unique(shards, return_index=True)[1])])
    return np.concatenate(reads)


def real_fetches(index: DatasetIndex, reads: np.ndarray, limit: int, policy: str,
                 working_set: int, scratch: str) -> int:
    from streamcache.cache.eviction import next_use_table

    following = next_use_table(reads)
    cache = NodeCache(index, tempfile.mkdtemp(dir=scratch), cache_limit=limit,
                      working_set_bytes=working_set)
    upcoming: dict[int, float] = {}
    if policy == "belady":
        cache.set_next_use(lambda shard: upcoming.get(shard, float("inf")))
    for i, shard in enumerate(reads.tolist()):
        upcoming[shard] = float(following[i])
        cache.local_path(shard)
    cache.close()
    return cache.stats.installs


def run_evict(scratch: str, args: argparse.Namespace) -> dict[str, Any]:
    size = 4096
    index = write_dataset(blobs(60 * 50, size, 3), os.path.join(scratch, "evict-src"),
                          schema=schema(size), shard_size=50 * size)
    probe = NodeCache(index, os.path.join(scratch, "evict-probe"))
    sizes = np.array([probe.estimated_bytes(k) for k in range(len(index.shards))])
    limit = int(0.3 * sizes.sum())
    reads = plan_reads(index, 3, 64)
    working_set = int(sizes.max()) * 9  # one window of 8 shards plus one across a seam
    out: dict[str, Any] = {"shards": len(index.shards), "limit_fraction": 0.3,
                           "epochs": 3, "distinct": len(index.shards)}
    for policy in ("belady", "lru"):
        out[f"simulated_{policy}"] = simulate_fetches(reads, sizes, limit, policy)
        out[f"real_{policy}"] = real_fetches(index, reads, limit, policy, working_set, scratch)
    for kind in ("simulated", "real"):
        out[f"{kind}_refetch_ratio_lru_over_belady"] = (
            (out[f"{kind}_lru"] - len(index.shards))
            / max(1, out[f"{kind}_belady"] - len(index.shards)))
    print(f"evict: {out}", flush=True)
    return out


# ------------------------------------------------------------------------------- small


def one_row_shards(folder: str, count: int) -> str:
    """``count`` zstd Arrow files of one row each, indexed with checksums: every shard is
    installed (decoded into the local layout), none is read in place. Written with pyarrow
    and indexed (``streamcache index --checksum``'s path): ShardWriter would take minutes
    for 10,000 shards."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    os.makedirs(folder)
    arrow_schema = pa.schema([("id", pa.int64())])
    options = ipc.IpcWriteOptions(compression="zstd")
    for i in range(count):
        with ipc.new_file(os.path.join(folder, f"part-{i:06d}.arrow"), arrow_schema,
                          options=options) as writer:
            writer.write_batch(pa.record_batch([pa.array([i], pa.int64())],
                                               schema=arrow_schema))
    return build_index(folder, checksums=True).url or folder


def small_epoch(url: str, scratch: str, batch: int) -> dict[str, float]:
    """One cold first epoch through StreamDataset + StreamLoader (default prefetching) into
    a fresh cache folder: seconds, and shards installed per second."""
    cache_dir = tempfile.mkdtemp(dir=scratch)
    began = time.perf_counter()
    dataset = StreamDataset(url, global_batch_size=batch, rank=0, world_size=1,
                            cache_dir=cache_dir)
    samples = 0
    with StreamLoader(dataset) as loader:
        for step in loader:
            samples += len(step["id"])
    seconds = time.perf_counter() - began
    dataset.close()
    installed = sum(name.endswith(".arrow") for _, _, names in
                    os.walk(os.path.join(cache_dir, "datasets")) for name in names)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"seconds": seconds, "samples": samples, "installed": installed,
            "installs_s": installed / seconds}


def run_small(scratch: str, args: argparse.Namespace) -> dict[str, Any]:
    url = one_row_shards(os.path.join(scratch, "small-src"), args.small_shards)
    rounds = []
    for repeat in range(args.repeats):
        rounds.append(small_epoch(url, scratch, batch=64))
        print(f"small round {repeat + 1}: {rounds[-1]}", flush=True)
    return {"shards": args.small_shards, "rounds": rounds,
            "installs_s": statistics.median(r["installs_s"] for r in rounds),
            "load_average": os.getloadavg()}


# ------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mb", type=float, default=48.0, help="size of the S3 dataset, MB")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--warm-batches", type=int, default=60)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--small-shards", type=int, default=10_000,
                        help="one-row shards of the 'small' part")
    parser.add_argument("--parts", default="cold,warm,wait,evict,small")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    os.makedirs(OUT, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench-cache-", dir=OUT)
    results: dict[str, Any] = {"args": vars(args)}
    try:
        if parts & {"cold", "wait"}:
            with aws_test_environment(), MotoServer() as server:
                bucket = S3Bucket.create(server.endpoint_url, "bench-cache")
                results["cold"] = run_cold(bucket, args, scratch)
                if "wait" in parts:
                    results["wait"] = run_wait(bucket, args, scratch)
        if "warm" in parts:
            results["warm"] = run_warm(scratch, args)
        if "evict" in parts:
            results["evict"] = run_evict(scratch, args)
        if "small" in parts:
            results["small"] = run_small(scratch, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(results)
    with open(os.path.join(OUT, "bench_cache.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'part':<28}{'ours':>14}{'limit/other':>14}{'ratio':>8}")
    if "cold" in results:
        c = results["cold"]
        print(f"{'cold epoch MB/s (S3)':<28}{c['cache_mb_s']:>14.1f}{c['raw_mb_s']:>14.1f}"
              f"{c['ratio']:>8.2f}")
    for name in ("small", "large"):
        if "warm" in results:
            w = results["warm"][name]
            print(f"{'warm ' + name + ' rows/s':<28}{w['reader_rows_s']:>14.0f}"
                  f"{w['limit_rows_s']:>14.0f}{w['ratio']:>8.2f}"
                  f"   ({w['reader_gb_s']:.2f} GB/s; memcpy {w['memcpy_gb_s']:.2f} GB/s)")
    if "wait" in results:
        on, off = results["wait"]["on"], results["wait"]["off"]
        for key in ("read_ms_per_step", "later_steps_ms"):
            print(f"{key + ' on/off':<28}{on[key]:>14.2f}{off[key]:>14.2f}"
                  f"{off[key] / max(on[key], 1e-9):>8.1f}")
    if "small" in results:
        m = results["small"]
        print(f"{'small shards installs/s':<28}{m['installs_s']:>14.1f}"
              f"{'':>14}{'':>8}   ({m['shards']} one-row shards, cold first epoch)")
    if "evict" in results:
        e = results["evict"]
        for kind in ("simulated", "real"):
            print(f"{kind + ' fetches belady/lru':<28}{e[kind + '_belady']:>14}"
                  f"{e[kind + '_lru']:>14}"
                  f"{e[kind + '_refetch_ratio_lru_over_belady']:>8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
