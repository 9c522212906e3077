"""The streamcache demo: convert a small dataset, stream it shuffled, print throughput.

    python examples/demo.py [--samples 200000] [--workdir DIR]

Without --workdir its files (Parquet, shards, node cache) go to a temporary folder that is
removed at the end; with it they stay in DIR.

1. writes a synthetic Parquet dataset with pyarrow (token sequences and labels),
2. converts it into streamcache shards (`streamcache convert`),
3. streams one shuffled epoch with StreamLoader (node cache, prefetcher, native gather),
   checks that every sample arrives exactly once, and prints samples/s and MB/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from streamcache import StreamDataset, StreamLoader, convert


def make_parquet(path: str, samples: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 300, samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
    table = pa.table({
        "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
        "label": pa.array(np.arange(samples) % 10, pa.int64()),
    })
    pq.write_table(table, path, row_group_size=16_384)


def working_folder(path: str | None) -> contextlib.AbstractContextManager[str]:
    """``path`` as given (kept), or a temporary folder removed at the end of the block."""
    if path:
        return contextlib.nullcontext(path)
    return tempfile.TemporaryDirectory(prefix="streamcache-demo-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="streamcache demo")
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a "
                                                        "temporary folder, removed)")
    args = parser.parse_args(argv)
    with working_folder(args.workdir) as workdir:
        run(workdir, args.samples, args.batch_size)
    if not args.workdir:
        print(f"removed the temporary folder {workdir}")
    return 0


def run(workdir: str, samples: int, batch_size: int) -> None:
    """Write, convert and stream the demo dataset under ``workdir``."""
    src, dst = os.path.join(workdir, "source.parquet"), os.path.join(workdir, "shards")

    make_parquet(src, samples)
    report = convert(src, dst, shard_size=16 << 20, overwrite=True)
    print(report.summary())

    dataset = StreamDataset(dst, batch_size=batch_size, seed=1, rank=0, world_size=1,
                            cache_dir=os.path.join(workdir, "cache"))
    with StreamLoader(dataset) as loader:
        started = time.perf_counter()
        ids, nbytes, first = [], 0, None
        for batch in loader:
            first = first or time.perf_counter() - started
            ids.append(batch["__id__"].numpy())
            nbytes += sum(t.numel() * t.element_size() for t in batch.values())
        elapsed = time.perf_counter() - started
    seen = np.concatenate(ids)
    expected = len(seen) // batch_size * batch_size
    assert len(seen) == len(np.unique(seen)) == expected, "a sample was lost or repeated"
    print(f"streamed one shuffled epoch, {len(seen):,} samples exactly once, in {elapsed:.2f} s "
          f"(first batch after {first:.2f} s, including the first shard installs): "
          f"{len(seen) / elapsed:,.0f} samples/s, {nbytes / 1e6 / elapsed:,.0f} MB/s "
          f"(batch {batch_size}, files in {workdir})")


if __name__ == "__main__":
    sys.exit(main())
