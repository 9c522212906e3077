"""StreamLoader vs a plain DataLoader over the same local data, warm page cache.

Run:  python benchmarks/bench_loader.py [--repeats 3] [--mb 256]

Data (built once under benchmarks/out/loader-data, uncompressed local shards read in place;
the baseline reads the same bytes from a numpy memmap):
  tokens  1 KB samples: int32[256] token rows          (--mb MB in all)
  blobs   100 KB samples: uint8[100000] rows           (--mb MB in all)
Cases (each in a fresh process, interleaved, --repeats times; shuffled order, batch 256 for
tokens and 32 for blobs, one epoch):
  dataloader-wN   torch DataLoader(map-style memmap Dataset, shuffle=True, num_workers=N)
  streamcache-wN  StreamLoader(StreamDataset(...), num_workers=N)
  gather-limit    numpy fancy-index gather of the same shuffled batches from the memmap,
                  one process: the page-cache limit for a shuffled per-sample gather
Rates are steady state (from the first batch to the end of the epoch); start-up is the
"1st batch" column. Also: time to first batch of a fresh StreamLoader vs one that
load_state_dict()s a state at 90% of the epoch, and each case's peak RSS (VmHWM of its
process plus its largest worker's).

Last result (2026-11-29 11:21 UTC, 2-core machine, load average 2.5-3.1 while a peer
benchmark ran beside it; `python benchmarks/bench_loader.py --repeats 3 --mb 256`; medians;
"vs DL-w0" is the ratio to the plain DataLoader with num_workers=0 of the same data):

  data    case             samples/s   MB/s  vs DL-w0  1st batch s  peak RSS MB
  tokens  gather-limit     2,457,063  2,516    10.58       0.031       469
  tokens  dataloader-w0      232,165    238     1.00       0.027       480
  tokens  streamcache-w0     999,937  1,024     4.31       0.448       530
  tokens  dataloader-w2      114,034    117     0.49       0.135       646
  tokens  streamcache-w2     892,595    914     3.84       0.542       530
  tokens  resume-0 / -90   first batch 0.0275 s / 0.0284 s (1.03x)
  blobs   gather-limit        33,300  3,330     1.60       0.016       472
  blobs   dataloader-w0       20,842  2,084     1.00       0.021       480
  blobs   streamcache-w0      23,627  2,363     1.13       0.437       541
  blobs   dataloader-w2        6,093    609     0.29       0.145       631
  blobs   streamcache-w2      25,857  2,586     1.24       0.571       546
  blobs   resume-0 / -90   first batch 0.0315 s / 0.0355 s (1.13x)

streamcache-w2 has no transform, so worker_mode="auto" reads with 2 native threads (see
StreamLoader); with worker processes forced it measured 0.16M tokens/s in the peer run.
The 1st-batch column of the streamcache rows includes opening the dataset (index, plan,
cache, prefetcher); resume-N time only the first batch of an opened loader.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "out", "loader-data")
SHAPES = {"tokens": ((256,), np.int32, 256), "blobs": ((100_000,), np.uint8, 32)}


def build(mb: int) -> None:
    from streamcache import Field, Schema, ShardWriter

    os.makedirs(DATA, exist_ok=True)
    for name, (shape, dtype, _) in SHAPES.items():
        row_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        n = mb * 1_000_000 // row_bytes
        marker = os.path.join(DATA, f"{name}.done")
        if os.path.exists(marker):
            with open(marker) as f:
                if json.load(f)["n"] == n:
                    continue
        rng = np.random.default_rng(0)
        array = np.lib.format.open_memmap(os.path.join(DATA, f"{name}.npy"), mode="w+",
                                          dtype=dtype, shape=(n, *shape))
        for start in range(0, n, 4096):
            stop = min(n, start + 4096)
            array[start:stop] = rng.integers(0, 255, (stop - start, *shape), dtype=dtype)
        array.flush()
        schema = Schema([Field.tensor("data", dtype, shape)])
        with ShardWriter(os.path.join(DATA, name), schema=schema, compression=None,
                         shard_size=64 << 20, overwrite=True) as writer:
            for start in range(0, n, 4096):
                import pyarrow as pa

                from streamcache.format.columns import build_column

                column = build_column(schema.fields[0], np.asarray(array[start:start + 4096]))
                writer.write_batch(pa.table({"data": column}))
        with open(marker, "w") as f:
            json.dump({"n": n}, f)


class MemmapDataset:
    """The baseline: a map-style Dataset over a numpy memmap."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.array: Any = None
        self.length = int(np.load(path, mmap_mode="r").shape[0])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.array is None:
            self.array = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.array(self.array[i]))


def run_case(case: str, data: str) -> dict[str, Any]:
    import torch

    # One intra-op thread, as in DataLoader workers: on a busy 2-core machine torch's
    # OpenMP threads made default_collate's torch.stack of 32 x 100 KB rows take 10-200 ms,
    # which would flatter streamcache against the num_workers=0 baseline.
    torch.set_num_threads(1)

    shape, dtype, batch = SHAPES[data]
    started = time.perf_counter()
    samples = 0
    first_batch = None
    if case.startswith("dataloader"):
        workers = int(case.rsplit("w", 1)[1])
        loader: Any = torch.utils.data.DataLoader(
            MemmapDataset(os.path.join(DATA, f"{data}.npy")), batch_size=batch, shuffle=True,
            num_workers=workers, drop_last=True)
        for out in loader:
            first_batch = first_batch or time.perf_counter() - started
            samples += len(out)
    elif case.startswith("streamcache"):
        from streamcache import StreamDataset, StreamLoader

        workers = int(case.rsplit("w", 1)[1])
        dataset = StreamDataset(os.path.join(DATA, data), batch_size=batch, rank=0,
                                world_size=1, seed=int(time.time()))
        with StreamLoader(dataset, num_workers=workers, prefetch=4) as loader:
            for out in loader:
                first_batch = first_batch or time.perf_counter() - started
                samples += len(out["__id__"])
    elif case == "gather-limit":
        array = np.load(os.path.join(DATA, f"{data}.npy"), mmap_mode="r")
        order = np.random.default_rng().permutation(len(array))
        for start in range(0, len(order) - batch + 1, batch):
            out = array[np.sort(order[start:start + batch])]
            first_batch = first_batch or time.perf_counter() - started
            samples += len(out)
    elif case.startswith("resume"):
        from streamcache import StreamDataset, StreamLoader

        dataset = StreamDataset(os.path.join(DATA, data), batch_size=batch, rank=0,
                                world_size=1, seed=5)
        loader = StreamLoader(dataset)
        if case == "resume-90":
            state = loader.state_dict()
            state["cursor"]["samples_consumed"] = int(dataset.index.num_samples * 0.9)
            loader.load_state_dict(state)
        started = time.perf_counter()
        out = next(iter(loader))
        first_batch = time.perf_counter() - started
        samples = len(out["__id__"])
        loader.close()
    elapsed = time.perf_counter() - started
    # steady state: from the first batch on (start-up is reported as first_batch_s)
    steady = elapsed - (first_batch or 0.0) if case.startswith(("data", "stream")) else elapsed
    counted = samples - batch if case.startswith(("data", "stream")) else samples
    row_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return {"case": case, "data": data, "seconds": elapsed, "samples": samples,
            "samples_per_s": counted / steady, "mb_per_s": counted * row_bytes / 1e6 / steady,
            "first_batch_s": first_batch, "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """Peak RSS of this process (VmHWM, reset at exec) plus its largest child's."""
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return (hwm_kb + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


CASES = ["gather-limit", "dataloader-w0", "streamcache-w0", "dataloader-w2", "streamcache-w2",
         "resume-0", "resume-90"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--case")
    parser.add_argument("--data")
    parser.add_argument("--out", default=os.path.join(HERE, "out", "bench_loader.json"))
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.data)))
        return 0
    build(args.mb)
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for data in SHAPES:
            for case in CASES:
                result = subprocess.run([sys.executable, __file__, "--case", case, "--data",
                                         data], capture_output=True, text=True, check=True)
                runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    print(f"{'data':<8}{'case':<16}{'samples/s':>12}{'MB/s':>9}{'vs DL-w0':>9}"
          f"{'1st batch s':>12}{'peak RSS MB':>12}")
    for data in SHAPES:
        base = statistics.median(r["samples_per_s"] for r in runs
                                 if r["data"] == data and r["case"] == "dataloader-w0")
        for case in CASES:
            mine = [r for r in runs if r["data"] == data and r["case"] == case]
            rate = statistics.median(r["samples_per_s"] for r in mine)
            print(f"{data:<8}{case:<16}{rate:>12,.0f}"
                  f"{statistics.median(r['mb_per_s'] for r in mine):>9,.0f}"
                  f"{rate / base:>9.2f}"
                  f"{statistics.median(r['first_batch_s'] for r in mine):>12.4f}"
                  f"{max(r['peak_rss_mb'] for r in mine):>12.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
