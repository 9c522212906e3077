"""Cold start against the peers: time to the first batch, samples/s over the first 4,096
samples (the first batch and every download included), bytes and requests, from one
S3-compatible server on loopback.

Run (in the peers' venv, see README.md; ~25 min with the defaults on this 2-core VM):

    /tmp/peers-venv/bin/python benchmarks/peers/cold.py [--repeats 3] [--scale 1]
        [--stores loopback,20ms-100MBps] [--kinds tokens,blobs]
        [--systems streamcache,webdataset,litdata,mosaic]
    /tmp/peers-venv/bin/python benchmarks/peers/cold.py --systems streamcache-2r,streamcache-4r
        (streamcache as 2 or 4 ranks of one node, one cache folder)

Setup. The server is tests/servers.py's FaultServer in a process of its own: GET and HEAD with
single ranges (only the bytes asked for are read from the file), S3's ListObjectsV2, no
authentication, every request and byte counted. Two store models: plain loopback, and
"20ms-100MBps" (a 20 ms first-byte latency on every request, 100 MB/s per connection), which
is what a request to S3 costs. Data: ``tokens`` (int32[256], 1 KB, 196,608 samples, global
batch 256) and ``blobs`` (uint8[100000], 100 KB, 4,608 samples, batch 32), random content,
written once into each system's format: streamcache at the library's defaults (ShardWriter:
zstd, 64 KiB chunks, 64 MB shards), the peers as benchmarks/peers/run.py writes them
(uncompressed, ~16 MB shards: WebDataset tars, LitData chunks, Mosaic MDS). Every case is a
fresh process (imports excluded from the clock), one process, no worker processes, shuffled,
an empty cache folder; the clock starts before the dataset object is made. The systems run
interleaved (the order rotated every repeat); the table gives medians over the repeats and
the ratios are medians of per-repeat ratios. WebDataset streams its tars with ``pipe:curl``
over plain HTTP from the same server; LitData and Mosaic read ``s3://`` through it.

Results go to benchmarks/out/peers/cold.json; the last run's table is in docs/cache.md
("Cold start: measured").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))

from common import OUT, aws_env, use_streamcache_snapshot  # noqa: E402

#: What is measured: $PEERS_STREAMCACHE_SRC (an exported commit, see README.md) or the
#: editable install; jobs inherit the variable.
STREAMCACHE_SOURCE = use_streamcache_snapshot()
from servers import StoreModel, serve_in_process, server_totals  # noqa: E402

FIRST = 4096
BUCKET = "cold"
SYSTEMS = ("streamcache", "webdataset", "litdata", "mosaic")
#: streamcache as N ranks of one node (one process each, one cache folder: one download per
#: node), the clock from a common start to the last rank's 4,096th global sample; asked for
#: by name (``--systems streamcache-2r,streamcache-4r``)
RANKED = ("streamcache-2r", "streamcache-4r")
STORES = {"loopback": StoreModel(), "20ms-100MBps": StoreModel(0.02, 100e6)}
#: name -> (row shape, dtype, global batch, samples)
DATA: dict[str, tuple[tuple[int, ...], Any, int, int]] = {
    "tokens": ((256,), np.int32, 256, 196_608),
    "blobs": ((100_000,), np.uint8, 32, 4_608),
}
JOB_TIMEOUT_S = 300


def array_path(root: str, data: str) -> str:
    return os.path.join(root, f"{data}.npy")


def make_array(root: str, data: str, scale: float) -> str:
    shape, dtype, _, count = DATA[data]
    path = array_path(root, data)
    rows = max(FIRST + 256, int(count * scale)) if data == "blobs" else int(count * scale)
    if not os.path.exists(path):
        rng = np.random.default_rng(0)
        array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows, *shape))
        for start in range(0, rows, 1024):
            stop = min(rows, start + 1024)
            high = 50_000 if data == "tokens" else 256
            array[start:stop] = rng.integers(0, high, (stop - start, *shape), dtype=dtype)
        array.flush()
    return path


def build(system: str, data: str, source: str, out: str) -> None:
    """``out``: the system's copy of ``data`` (the array at ``source``), written once."""
    if os.path.exists(os.path.join(out, ".done")):
        return
    shutil.rmtree(out, ignore_errors=True)
    array = np.load(source, mmap_mode="r")
    if system == "streamcache":
        from streamcache import Field, Schema, ShardWriter

        shape, dtype, _, _ = DATA[data]
        schema = Schema([Field.tensor("data", dtype, shape)])
        with ShardWriter(out, schema=schema) as writer:  # the library's defaults
            for row in array:
                writer.write({"data": np.asarray(row)})
    elif system == "litdata":
        from litdata import optimize

        step = max(1, len(array) // 32)
        jobs = [(source, start, min(len(array), start + step))
                for start in range(0, len(array), step)]
        optimize(fn=_litdata_samples, inputs=jobs, output_dir=out, chunk_bytes=16 << 20,
                 num_workers=2, mode="overwrite", verbose=False)
    else:
        import sys_mosaic
        import sys_webdataset

        module = {"webdataset": sys_webdataset, "mosaic": sys_mosaic}[system]
        module.build(data, array, out)
    open(os.path.join(out, ".done"), "w").close()


def _litdata_samples(job: tuple[str, int, int]) -> Any:
    source, start, stop = job
    array = np.load(source, mmap_mode="r")
    for i in range(start, stop):
        yield {"id": i, "data": np.asarray(array[i])}


# ------------------------------------------------------------------------------ one job


def ranks_of(system: str) -> int:
    """How many ranks of one node a system runs as (``streamcache-<N>r``: N; others: 1)."""
    return int(system.split("-")[1][:-1]) if system in RANKED else 1


def open_loader(system: str, data: str, url: str, cache: str, rank: int = 0,
                world: int = 1) -> Any:
    """An iterable of batches (dicts with the samples' global ids)."""
    _, _, batch, _ = DATA[data]
    folder = "streamcache" if system.startswith("streamcache") else system
    remote = f"s3://{BUCKET}/{folder}/{data}"
    if folder == "streamcache":
        from streamcache import StreamDataset, StreamLoader

        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"}}
        dataset = StreamDataset(remote, global_batch_size=batch, rank=rank, world_size=world,
                                cache_dir=cache, storage_options=options)
        return StreamLoader(dataset)
    if system == "webdataset":
        import webdataset as wds

        folder = os.path.join(cache, "..", "served", BUCKET, system, data)
        names = sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
        urls = [f"pipe:curl -s -f {url}/{BUCKET}/{system}/{data}/{n}" for n in names]
        _, dtype, _, _ = DATA[data]
        return (wds.WebDataset(urls, shardshuffle=len(urls), seed=17, empty_check=False)
                .shuffle(1000)
                .map(lambda s: (int(s["__key__"]), np.frombuffer(s["bin"], dtype=dtype)))
                .batched(batch, collation_fn=_wds_collate, partial=False))
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from sys_litdata import _allow_http

        _allow_http()
        dataset = StreamingDataset(remote, shuffle=True, drop_last=True, seed=17,
                                   cache_dir=cache, storage_options={
                                       "endpoint_url": url, "aws_access_key_id": "testing",
                                       "aws_secret_access_key": "testing",
                                       "region_name": "us-east-1"})
        return StreamingDataLoader(dataset, batch_size=batch, num_workers=0, drop_last=True)
    import sys_mosaic

    streaming = sys_mosaic._import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(remote=remote, local=cache, shuffle=True,
                                         shuffle_seed=17, batch_size=batch)
    return streaming.StreamingDataLoader(dataset, batch_size=batch, num_workers=0,
                                         drop_last=True)


def _wds_collate(samples: list[tuple[int, np.ndarray]]) -> dict[str, Any]:
    return {"id": np.array([s[0] for s in samples]), "data": np.stack([s[1] for s in samples])}


def batch_ids(batch: Any) -> np.ndarray:
    """The global ids of a batch (every system's batches here are dicts)."""
    ids = batch["__id__"] if "__id__" in batch else batch["id"]
    return np.asarray(ids).reshape(-1).astype(np.int64)


def mixing(ids: np.ndarray, count: int) -> float:
    """How far apart consecutive samples are, as the mean absolute difference of
    consecutive global ids over ``count / 3`` (its expectation for a uniform shuffle of
    ``count`` samples): ~1.0 for a full shuffle, ~0 for sequential reading. The metric the
    cold-start table prints beside each system's rate, so that a faster start is never
    bought with a weaker shuffle unseen."""
    if len(ids) < 2:
        return 0.0
    return float(np.abs(np.diff(ids)).mean() / (count / 3))


def job(system: str, data: str, url: str, cache: str, count: int, rank: int = 0,
        start_at: float | None = None) -> dict[str, Any]:
    """One cold run (one rank of ``system``, whose clock starts at the wall-clock time
    ``start_at`` when given); ``count``: the samples of the dataset served (for
    :func:`mixing`). Every rank reads until the job has covered :data:`FIRST` global
    samples."""
    import torch  # noqa: F401  (imports are not timed)

    # the library and the S3 client it uses (a lazy import would be timed otherwise)
    if system.startswith("streamcache"):
        import s3fs  # noqa: F401

        import streamcache.loading.loader  # noqa: F401
    elif system == "mosaic":
        import boto3
        import sys_mosaic

        sys_mosaic._import_streaming()
    elif system == "litdata":
        import boto3  # noqa: F401
        import litdata  # noqa: F401
        import obstore  # noqa: F401
    else:
        import webdataset  # noqa: F401
    _, _, batch, _ = DATA[data]
    while start_at is not None and time.time() < start_at:
        time.sleep(0.001)
    started = time.perf_counter()
    loader = open_loader(system, data, url, cache, rank, ranks_of(system))
    first = 0.0
    seen = 0
    ids: list[np.ndarray] = []
    for one in loader:
        ids.append(batch_ids(one))
        seen += batch
        if not first:
            first = time.perf_counter() - started
        if seen >= FIRST:
            break
    total = time.perf_counter() - started
    result: dict[str, Any] = {"first_s": first, "samples": seen, "total_s": total,
              "samples_per_s": seen / total, "mixing": mixing(np.concatenate(ids), count)}
    if ranks_of(system) > 1:
        result["ids"] = [part.tolist() for part in ids]
    return result


def combine_ranks(parts: list[dict[str, Any]], count: int) -> dict[str, Any]:
    """One result of a job's ranks: the last rank's first batch and end (a step needs every
    rank), the global batches rebuilt step by step (rank 0's part, rank 1's, ...)."""
    steps = min(len(p["ids"]) for p in parts)
    ids = np.concatenate([np.asarray(p["ids"][k], np.int64) for k in range(steps)
                          for p in parts])
    total = max(p["total_s"] for p in parts)
    return {"first_s": max(p["first_s"] for p in parts), "samples": parts[0]["samples"],
            "total_s": total, "samples_per_s": parts[0]["samples"] / total,
            "mixing": mixing(ids, count)}



# ------------------------------------------------------------------------------ the run


def run_job(system: str, data: str, url: str, scratch: str) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix=f"{system}-", dir=scratch)
    count = len(np.load(array_path(scratch, data), mmap_mode="r"))
    world = ranks_of(system)
    # ranks start together, once every process has imported what it needs
    start_at = time.time() + 6.0 if world > 1 else None
    server_totals(url, reset=True)
    processes = []
    for rank in range(world):
        spec = json.dumps({"system": system, "data": data, "url": url, "cache": cache,
                           "count": count, "rank": rank, "start_at": start_at})
        ranked = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                  "LOCAL_WORLD_SIZE": str(world)} if world > 1 else {}
        processes.append(subprocess.Popen(
            [sys.executable, __file__, "--job", spec], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **aws_env(url), **ranked},
            start_new_session=True))
    outputs = [_finish(process) for process in processes]
    totals = server_totals(url)
    shutil.rmtree(cache, ignore_errors=True)
    errors = [o for o in outputs if "error" in o]
    if errors:
        return errors[0]
    result = outputs[0] if world == 1 else combine_ranks(outputs, count)
    return {**result, **totals}


def _finish(process: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        stdout, stderr = process.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.communicate()
        stdout, stderr = "", f"no result within {JOB_TIMEOUT_S} s"
    lines = stdout.strip().splitlines()
    if process.returncode != 0 or not lines:
        tail = [line for line in stderr.strip().splitlines() if line.strip()]
        return {"error": (tail[-1] if tail else f"exit {process.returncode}")[:300]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1].get("error", "no run")}
    return {key: statistics.median(r[key] for r in ok)
            for key in ("first_s", "samples_per_s", "bytes", "requests", "mixing")}


def ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-repeat ratios of streamcache to the peers, medians."""
    out: dict[str, Any] = {}
    ours = runs.get("streamcache", [])
    for peer in (s for s in runs if s != "streamcache"):
        pairs = [(a, b) for a, b in zip(ours, runs[peer], strict=False)
                 if "error" not in a and "error" not in b]
        if pairs:
            out[peer] = {
                "first_batch_x": statistics.median(a["first_s"] / b["first_s"] for a, b in pairs),
                "rate_x": statistics.median(a["samples_per_s"] / b["samples_per_s"]
                                            for a, b in pairs)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--kinds", default="tokens,blobs")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--keep", action="store_true", help="keep the built datasets")
    args = parser.parse_args(argv)
    if args.job:
        spec = json.loads(args.job)
        print(json.dumps(job(spec["system"], spec["data"], spec["url"], spec["cache"],
                             spec["count"], spec["rank"], spec["start_at"])))
        return 0
    systems, kinds = args.systems.split(","), args.kinds.split(",")
    root = os.path.join(OUT, "cold")
    served = os.path.join(root, "served")
    os.makedirs(served, exist_ok=True)
    for data in kinds:
        source = make_array(root, data, args.scale)
        for system in {"streamcache" if s in RANKED else s for s in systems}:
            build(system, data, source, os.path.join(served, BUCKET, system, data))
    results: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg(),
                               "streamcache": STREAMCACHE_SOURCE}
    try:
        for store in args.stores.split(","):
            process, url = serve_in_process(served, STORES[store])
            try:
                for data in kinds:
                    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
                    for repeat in range(args.repeats):
                        order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
                        for system in order:
                            result = run_job(system, data, url, root)
                            runs[system].append(result)
                            print(f"[{repeat}] {store:13} {data:7} {system:12} "
                                  f"{_short(result)}", file=sys.stderr, flush=True)
                    results[f"{store}/{data}"] = {
                        "runs": runs, "medians": {s: summarize(r) for s, r in runs.items()},
                        "ratios": ratios(runs)}
            finally:
                process.terminate()
                process.wait(10)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    with open(os.path.join(OUT, "cold.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_table(results)
    return 0


def _short(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return (f"first {result['first_s']:.2f}s, {result['samples_per_s']:,.0f}/s, "
            f"{result['bytes'] / 1e6:,.0f} MB, {result['requests']} requests, "
            f"mixing {result['mixing']:.2f}")


def print_table(results: dict[str, Any]) -> None:
    print(f"{'store':13} {'data':7} {'system':12} {'first batch s':>13} {'samples/s':>10} "
          f"{'MB':>7} {'requests':>9} {'mixing':>7}")
    for key, value in results.items():
        if "/" not in key:
            continue
        store, data = key.split("/")
        for system, m in value["medians"].items():
            if "error" in m:
                print(f"{store:13} {data:7} {system:12} error: {m['error']}")
                continue
            print(f"{store:13} {data:7} {system:12} {m['first_s']:13.2f} "
                  f"{m['samples_per_s']:10,.0f} {m['bytes'] / 1e6:7,.0f} {m['requests']:9,.0f} "
                  f"{m['mixing']:7.2f}")
        for peer, r in value["ratios"].items():
            print(f"{'':13} {data:7} streamcache/{peer}: first batch {r['first_batch_x']:.2f}x, "
                  f"samples/s {r['rate_x']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
