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
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import Any, TextIO

import numpy as np
import torch

from ..errors import UsageError
from ..loading.dataset import StreamDataset
from ..loading.dataset_reader import DatasetReader
from ..loading.loader import StreamLoader
from ..loading.stats import LoaderStats
from ..progress import ProgressLine
from ..units import format_number, size_argument
from .bench_result import BenchResult, StepSample
from .plots import plot_bench, require_matplotlib


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


CacheCounters = Callable[[], tuple[int, int]]


def measure(name: str, batches: Iterable[Any], *, max_steps: int | None, compute_s: float,
            progress: TextIO | None = None, total_steps: int | None = None,
            cache_counters: CacheCounters | None = None) -> BenchResult:
    """Drive a loop over ``batches``; ``waited_s`` is the time spent inside ``next()``.

    ``progress`` gets a live line (a bar on a terminal, plain lines in a log);
    ``cache_counters`` returns the cache's (hits, misses) so far, sampled at every step for
    the timeline.
    """
    result = BenchResult(name)
    iterator: Iterator[Any] = iter(batches)
    total = min(filter(None, (max_steps, total_steps)), default=None)
    meter = ProgressLine(progress, name, total=total)
    started = time.perf_counter()
    while max_steps is None or result.steps < max_steps:
        before = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        now = time.perf_counter()
        waited = 0.0
        if result.steps == 0:
            result.first_batch_s = now - started
        else:
            waited = now - before
            result.waited_s += waited
        result.steps += 1
        result.samples += _batch_size(batch)
        result.bytes += _nbytes(batch)
        if result.steps == 1:
            result.first_batch_samples, result.first_batch_bytes = result.samples, result.bytes
        hits, misses = cache_counters() if cache_counters is not None else (None, None)
        result.timeline.append(StepSample(result.steps, now - started, waited, result.samples,
                                          hits, misses))
        if compute_s:
            time.sleep(compute_s)
        meter.update(result.steps, f"{result.samples:,} samples, "
                                   f"{result.samples / (now - started):,.0f} samples/s")
    result.seconds = time.perf_counter() - started
    result.peak_rss_mb = peak_rss_mb()
    meter.close()
    return result


class PaddedCollate:
    """The baseline's collate: variable-length fields padded with zeros to the batch's
    longest, plus ``<name>_lengths``, as streamcache's ``ragged="padded"`` delivers them;
    everything else through torch's default collate. (A class, so worker processes can
    pickle it.)"""

    def __init__(self, sequence_fields: Iterable[str]) -> None:
        self.sequence_fields = frozenset(sequence_fields)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        rest = [{k: v for k, v in s.items() if k not in self.sequence_fields} for s in samples]
        batch: dict[str, Any] = torch.utils.data.default_collate(rest)
        for name in self.sequence_fields & samples[0].keys():
            values = [np.asarray(s[name]) for s in samples]
            lengths = np.array([len(v) for v in values], dtype=np.int64)
            padded = np.zeros((len(values), int(lengths.max(initial=0))), values[0].dtype)
            for row, value in enumerate(values):
                padded[row, :len(value)] = value
            batch[name], batch[name + "_lengths"] = torch.from_numpy(padded), torch.from_numpy(
                lengths)
        return batch


class _MapView(torch.utils.data.Dataset):
    """The same samples as a map-style Dataset, one sample per __getitem__ (the baseline)."""

    def __init__(self, url: str, fields: list[str] | None, local_dir: str | None) -> None:
        self.url, self.fields, self.local_dir = url, fields, local_dir
        self._reader: DatasetReader | None = None
        with DatasetReader(url, fields=fields, local_dir=local_dir) as reader:
            self._length = len(reader)
            self.sequence_fields = [f.name for f in reader.schema if f.kind == "sequence"]

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._reader is None:
            self._reader = DatasetReader(self.url, fields=self.fields, local_dir=self.local_dir)
        sample = self._reader[i]
        return {k: v for k, v in sample.items() if not isinstance(v, (bytes, str))}


def make_demo_dataset(folder: str, samples: int = 100_000) -> str:
    """A synthetic dataset of ~1 KB token rows (int32[256]) and labels, written once."""
    from ..format.schema import Field, Schema
    from ..format.writer import ShardWriter

    url = os.path.join(folder, "demo")
    if os.path.exists(os.path.join(url, "index.json")):
        return url
    rng = np.random.default_rng(0)
    schema = Schema([Field.tensor("tokens", "int32", (256,)), Field.tensor("label", "int64")])
    import pyarrow as pa

    from ..format.columns import build_column

    with ShardWriter(url, schema=schema, shard_size=16 << 20, overwrite=True) as writer:
        for start in range(0, samples, 8192):
            n = min(8192, samples - start)
            tokens = rng.integers(0, 50_000, (n, 256), dtype=np.int32)
            labels = np.arange(start, start + n) % 10
            writer.write_batch(pa.table({"tokens": build_column(schema["tokens"], tokens),
                                         "label": labels}))
    return url


def _noting_first(loader: StreamLoader, into: list[LoaderStats]) -> Iterator[Any]:
    """``loader``'s batches; its statistics are noted in ``into`` once the first batch is
    received (when the loop asks for the second)."""
    for number, batch in enumerate(loader):
        yield batch
        if number == 0:
            into.append(loader.stats())


def _cache_counters(dataset: StreamDataset) -> CacheCounters | None:
    stats = getattr(dataset.reader.store, "stats", None)
    if stats is None or not hasattr(stats, "hits"):
        return None
    store = dataset.reader.store
    return lambda: (store.stats.hits, store.stats.misses)  # type: ignore[attr-defined]


def _store_counters(dataset: StreamDataset) -> dict[str, Any]:
    stats = getattr(dataset.reader.store, "stats", None)
    if stats is None:
        return {}
    return asdict(stats) if hasattr(stats, "__dataclass_fields__") else dict(vars(stats))


def run_bench(url: str, *, batch_size: int = 256, num_workers: int = 0,
              cache_dir: str | None = None, cache_limit: int | None = None,
              fields: list[str] | None = None, steps: int | None = None,
              compute_ms: float = 0.0, compare: bool = False, seed: int = 0,
              progress: TextIO | None = None,
              on_result: Callable[[BenchResult], object] | None = None) -> list[BenchResult]:
    """Stream ``url`` with streamcache (and a plain DataLoader with ``compare``).

    ``on_result`` is called with each result as soon as it is measured. The baseline's
    failure never loses streamcache's result: it is returned as a result whose ``error``
    says what went wrong.
    """
    options: dict[str, Any] = {"batch_size": batch_size, "rank": 0, "world_size": 1,
                               "seed": seed, "cache_dir": cache_dir, "fields": fields}
    if cache_limit is not None:
        options["cache_limit"] = cache_limit
    dataset = StreamDataset(url, **options)
    results = []
    with StreamLoader(dataset, num_workers=num_workers, prefetch=4) as loader:
        after_first: list[LoaderStats] = []
        result = measure("streamcache", _noting_first(loader, after_first), max_steps=steps,
                         compute_s=compute_ms / 1e3, progress=progress,
                         total_steps=len(loader), cache_counters=_cache_counters(dataset))
        # steady state, as the rates: from the first batch on (start-up is first_batch_s)
        result.loader_stats = loader.stats().since(after_first[0]) if after_first else None
        result.settings = {"num_workers": loader.num_workers, "threads": loader.threads}
        result.store = _store_counters(dataset)
        result.cache_dir = getattr(getattr(dataset.reader.store, "cache", None), "cache_dir",
                                   None)
    results.append(result)
    if on_result is not None:
        on_result(result)
    if compare:
        baseline = _run_baseline(url, fields, cache_dir, batch_size=batch_size,
                                 num_workers=num_workers, steps=steps, compute_ms=compute_ms,
                                 progress=progress)
        results.append(baseline)
        if on_result is not None:
            on_result(baseline)
    return results


def _run_baseline(url: str, fields: list[str] | None, cache_dir: str | None, *,
                  batch_size: int, num_workers: int, steps: int | None, compute_ms: float,
                  progress: TextIO | None) -> BenchResult:
    """A plain DataLoader over a map-style view of the same samples (shuffled, padded)."""
    name = "torch DataLoader"
    try:
        view = _MapView(url, fields, cache_dir)
        baseline = torch.utils.data.DataLoader(
            view, batch_size=batch_size, shuffle=True, num_workers=num_workers,
            drop_last=True, collate_fn=PaddedCollate(view.sequence_fields))
        return measure(name, baseline, max_steps=steps, compute_s=compute_ms / 1e3,
                       progress=progress, total_steps=len(baseline))
    except Exception as exc:  # the baseline is torch's code on the user's data: report, go on
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return BenchResult(name, error=f"{type(exc).__name__}: {message}")


def format_results(results: list[BenchResult]) -> str:
    """The table people read: one row per run, a failed run's reason, the cache's counters
    (rounded) and where it lives, and the ratio when both runs finished."""
    lines = [f"{'loader':<18}{'samples/s':>12}{'MB/s':>9}{'1st batch':>11}{'waited':>9}"
             f"{'steps':>7}{'peak RSS':>10}"]
    for r in results:
        if r.error is not None:
            lines.append(f"{r.name}: failed: {r.error}")
            continue
        lines.append(f"{r.name:<18}{r.samples_per_s:>12,.0f}{r.mb_per_s:>9,.1f}"
                     f"{r.first_batch_s:>10.3f}s{r.waited_s:>8.2f}s{r.steps:>7}"
                     f"{r.peak_rss_mb:>8.0f}MB")
    for r in results:
        if r.store:
            lines.append(f"{r.name} cache (whole run, first batch included): " + ", ".join(
                f"{k}={format_number(v)}" for k, v in r.store.items()))
        if r.cache_dir:
            lines.append(f"{r.name} cache folder: {r.cache_dir}")
    finished = [r for r in results if r.error is None]
    if len(results) == 2 and len(finished) == 2 and results[1].samples_per_s:
        lines.append(f"streamcache: {results[0].samples_per_s / results[1].samples_per_s:.2f}x "
                     f"the samples/s of the baseline, a plain torch DataLoader over the same "
                     f"data in this process (map-style, one sample per __getitem__, shuffled, "
                     f"same batch size and workers)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", help="dataset folder or index.json (any fsspec URL)")
    parser.add_argument("--demo", action="store_true",
                        help="make a synthetic dataset (100k ~1 KB samples) in a temporary "
                             "folder, bench it, and remove it")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--cache-dir", help="node cache folder (default: ~/.cache/streamcache "
                                            "or $STREAMCACHE_CACHE_DIR; printed)")
    parser.add_argument("--cache-limit", type=size_argument,
                        help="cache budget, e.g. 10GB, 512MiB or bytes")
    parser.add_argument("--fields", help="comma-separated fields to read")
    parser.add_argument("--steps", type=int, help="stop after this many steps (default: epoch)")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="simulated compute per step, to show overlap")
    parser.add_argument("--compare", action="store_true",
                        help="also run a plain torch DataLoader over the same data")
    parser.add_argument("--explain", action="store_true",
                        help="say where the run's time went (the loop's work, waiting on "
                             "downloads, transforms or reads) and what setting would help; "
                             "give --compute-ms for your model's time per step")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", metavar="FILE",
                        help="draw throughput, waiting and cache hits per step into FILE "
                             "(PNG, SVG or PDF; needs matplotlib: pip install matplotlib)")


def run(args: argparse.Namespace) -> int:
    if args.url is None and not args.demo:
        raise UsageError("give a dataset URL, or --demo for a synthetic one")
    if args.plot:
        require_matplotlib()  # before minutes of streaming, not after
    with contextlib.ExitStack() as stack:
        url, cache_dir = args.url, args.cache_dir
        if args.demo:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="streamcache-bench-"))
            print(f"demo dataset in {folder} (removed at exit)", file=sys.stderr)
            url = make_demo_dataset(folder)
            cache_dir = cache_dir or os.path.join(folder, "cache")
        results = _bench_from_args(args, url, cache_dir)
    if args.plot:
        plot_bench(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _bench_from_args(args: argparse.Namespace, url: str, cache_dir: str | None,
                     ) -> list[BenchResult]:
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None

    def show_early(result: BenchResult) -> None:
        # streamcache's own numbers are on screen before the baseline starts
        if not args.json and args.compare and result.name == "streamcache":
            print(f"streamcache: {result.samples_per_s:,.0f} samples/s; now a plain "
                  "DataLoader over the same data", file=sys.stderr, flush=True)

    results = run_bench(url, batch_size=args.batch_size, num_workers=args.workers,
                        cache_dir=cache_dir, cache_limit=args.cache_limit, fields=fields,
                        steps=args.steps, compute_ms=args.compute_ms, compare=args.compare,
                        progress=None if args.json else sys.stderr, on_result=show_early)
    if args.json:
        payload = [r.to_json() for r in results]
        if args.explain:
            for item, result in zip(payload, results, strict=True):
                diagnosis = result.explain()
                if diagnosis is not None:
                    item["explain"] = {"bottleneck": diagnosis.bottleneck,
                                       "wait_share": diagnosis.wait_share,
                                       "lines": list(diagnosis.lines)}
        print(json.dumps(payload, indent=1))
    else:
        print(format_results(results))
        diagnosis = results[0].explain() if args.explain else None
        if diagnosis is not None:  # (its counters are the steady state's, as the rates are)
            print("from the first batch on (start-up, cold fetches included, is the first "
                  "batch's time):")
            print(str(diagnosis))
    return results
