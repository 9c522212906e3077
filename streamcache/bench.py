"""``streamcache bench``: stream a dataset and report throughput, latency and waiting.

The measurement a user runs first: steady-state samples/s and MB/s (from the first batch
on), time to first batch (start-up: opening, first fetches), cache hit rate and
bytes fetched (when the shard store keeps counters), the time the training loop waited for
data, and peak RSS. ``--compare`` runs a plain ``torch.utils.data.DataLoader`` over a
map-style view of the same data in the same process, interleaved after the streamcache run,
and prints the ratio. ``--compute-ms`` simulates the model's work per step, to show that the
loop stops waiting once the compute per step exceeds the read time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .dataset import StreamDataset
from .dataset_reader import DatasetReader
from .loader import StreamLoader


@dataclass
class BenchResult:
    """One streaming run."""

    name: str
    steps: int = 0
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    first_batch_s: float = 0.0
    waited_s: float = 0.0
    peak_rss_mb: float = 0.0
    store: dict[str, Any] = field(default_factory=dict)

    first_batch_samples: int = 0
    first_batch_bytes: int = 0

    @property
    def steady_s(self) -> float:
        """Seconds from the first batch to the end (start-up is ``first_batch_s``)."""
        return self.seconds - self.first_batch_s

    @property
    def samples_per_s(self) -> float:
        """Steady-state rate: samples after the first batch over :attr:`steady_s`."""
        counted = self.samples - self.first_batch_samples
        return counted / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        counted = self.bytes - self.first_batch_bytes
        return counted / 1e6 / self.steady_s if self.steady_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": self.samples_per_s, "mb_per_s": self.mb_per_s}


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    if isinstance(batch, (bytes, str)):
        return len(batch)
    return 0


def _batch_size(batch: Any) -> int:
    if isinstance(batch, dict) and "__id__" in batch:
        return len(batch["__id__"])
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    return len(batch)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, batches: Iterable[Any], *, max_steps: int | None, compute_s: float,
            progress: Any = None) -> BenchResult:
    """Drive a loop over ``batches``; ``waited_s`` is the time spent inside ``next()``."""
    result = BenchResult(name)
    iterator: Iterator[Any] = iter(batches)
    started = last_report = time.perf_counter()
    while max_steps is None or result.steps < max_steps:
        before = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        now = time.perf_counter()
        if result.steps == 0:
            result.first_batch_s = now - started
        else:
            result.waited_s += now - before
        result.steps += 1
        result.samples += _batch_size(batch)
        result.bytes += _nbytes(batch)
        if result.steps == 1:
            result.first_batch_samples, result.first_batch_bytes = result.samples, result.bytes
        if compute_s:
            time.sleep(compute_s)
        if progress is not None and now - last_report > 0.5:
            last_report = now
            rate = result.samples / (now - started)
            progress.write(f"\r{name}: {result.steps} steps, {result.samples:,} samples, "
                           f"{rate:,.0f} samples/s")
            progress.flush()
    result.seconds = time.perf_counter() - started
    result.peak_rss_mb = peak_rss_mb()
    if progress is not None:
        progress.write("\n")
    return result


class _MapView(torch.utils.data.Dataset):
    """The same samples as a map-style Dataset, one sample per __getitem__ (the baseline)."""

    def __init__(self, url: str, fields: list[str] | None, local_dir: str | None) -> None:
        self.url, self.fields, self.local_dir = url, fields, local_dir
        self._reader: DatasetReader | None = None
        self._length = len(DatasetReader(url, fields=fields, local_dir=local_dir))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._reader is None:
            self._reader = DatasetReader(self.url, fields=self.fields, local_dir=self.local_dir)
        sample = self._reader[i]
        return {k: v for k, v in sample.items() if not isinstance(v, (bytes, str))}


def make_demo_dataset(folder: str, samples: int = 100_000) -> str:
    """A synthetic dataset of ~1 KB token rows (int32[256]) and labels, written once."""
    from .schema import Field, Schema
    from .writer import ShardWriter

    url = os.path.join(folder, "demo")
    if os.path.exists(os.path.join(url, "index.json")):
        return url
    rng = np.random.default_rng(0)
    schema = Schema([Field.tensor("tokens", "int32", (256,)), Field.tensor("label", "int64")])
    import pyarrow as pa

    from .columns import build_column

    with ShardWriter(url, schema=schema, shard_size=16 << 20, overwrite=True) as writer:
        for start in range(0, samples, 8192):
            n = min(8192, samples - start)
            tokens = rng.integers(0, 50_000, (n, 256), dtype=np.int32)
            labels = np.arange(start, start + n) % 10
            writer.write_batch(pa.table({"tokens": build_column(schema["tokens"], tokens),
                                         "label": labels}))
    return url


def run_bench(url: str, *, batch_size: int = 256, num_workers: int = 0,
              cache_dir: str | None = None, cache_limit: int | None = None,
              fields: list[str] | None = None, steps: int | None = None,
              compute_ms: float = 0.0, compare: bool = False, seed: int = 0,
              progress: Any = None) -> list[BenchResult]:
    """Stream ``url`` with streamcache (and a plain DataLoader with ``compare``)."""
    options: dict[str, Any] = {"batch_size": batch_size, "rank": 0, "world_size": 1,
                               "seed": seed, "cache_dir": cache_dir, "fields": fields}
    if cache_limit is not None:
        options["cache_limit"] = cache_limit
    dataset = StreamDataset(url, **options)
    results = []
    with StreamLoader(dataset, num_workers=num_workers, prefetch=4) as loader:
        result = measure("streamcache", loader, max_steps=steps, compute_s=compute_ms / 1e3,
                         progress=progress)
        stats = getattr(dataset.reader.store, "stats", None)
        if stats is not None:
            result.store = asdict(stats) if hasattr(stats, "__dataclass_fields__") else dict(
                vars(stats))
        results.append(result)
    if compare:
        baseline = torch.utils.data.DataLoader(
            _MapView(url, fields, cache_dir), batch_size=batch_size, shuffle=True,
            num_workers=num_workers, drop_last=True)
        results.append(measure("torch DataLoader", baseline, max_steps=steps,
                               compute_s=compute_ms / 1e3, progress=progress))
    return results


def format_results(results: list[BenchResult]) -> str:
    lines = [f"{'loader':<18}{'samples/s':>12}{'MB/s':>9}{'1st batch':>11}{'waited':>9}"
             f"{'steps':>7}{'peak RSS':>10}"]
    for r in results:
        lines.append(f"{r.name:<18}{r.samples_per_s:>12,.0f}{r.mb_per_s:>9,.1f}"
                     f"{r.first_batch_s:>10.3f}s{r.waited_s:>8.2f}s{r.steps:>7}"
                     f"{r.peak_rss_mb:>8.0f}MB")
    for r in results:
        if r.store:
            lines.append(f"{r.name} store: " + ", ".join(f"{k}={v}" for k, v in r.store.items()))
    if len(results) == 2 and results[1].samples_per_s:
        lines.append(f"ratio streamcache / DataLoader: "
                     f"{results[0].samples_per_s / results[1].samples_per_s:.2f}x")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", help="dataset folder or index.json (any fsspec URL)")
    parser.add_argument("--demo", action="store_true",
                        help="make a synthetic dataset (100k ~1 KB samples) and bench it")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--cache-dir")
    parser.add_argument("--cache-limit", type=int, help="bytes")
    parser.add_argument("--fields", help="comma-separated fields to read")
    parser.add_argument("--steps", type=int, help="stop after this many steps (default: epoch)")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="simulated compute per step, to show overlap")
    parser.add_argument("--compare", action="store_true",
                        help="also run a plain torch DataLoader over the same data")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    url = args.url
    if args.demo:
        url = make_demo_dataset(os.path.join(tempfile.gettempdir(), "streamcache-bench"))
    if url is None:
        raise SystemExit("streamcache bench: give a dataset URL or --demo")
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    results = run_bench(url, batch_size=args.batch_size, num_workers=args.workers,
                        cache_dir=args.cache_dir, cache_limit=args.cache_limit, fields=fields,
                        steps=args.steps, compute_ms=args.compute_ms, compare=args.compare,
                        progress=None if args.json else sys.stderr)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=1))
    else:
        print(format_results(results))
    return 0
