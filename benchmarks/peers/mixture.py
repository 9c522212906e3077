"""The weighted-mixture case: streamcache ``Source(weight=)`` against Mosaic Streaming's
``Stream(proportion=)`` and LitData's ``CombinedStreamingDataset(weights=)``.

Run (after the setup in README.md; a few minutes on 2 cores):

    /tmp/peers-venv/bin/python benchmarks/peers/mixture.py [--repeats 3] [--scale 1.0]

Data: three token sources (int32[256], 1 KB a sample) of 40,000, 20,000 and 10,000 samples
at --scale 1, weights 0.5 / 0.3 / 0.2, written once into each system's own format under
benchmarks/out/peers/mixture (shards of about 16 MB, uncompressed). Every sample carries
``source * 10**6 + row``, so each batch's composition and every duplicate or skip is counted.

Per system, each in a fresh process, system order rotated each repeat, global batch 256,
num_workers 0, warm page cache:
  rate     samples/s in steady state (first batch to 6 s after it, or 1000 steps)
  drift    from the same run: the largest |count of a source so far - weight * samples so
           far| over the sources and every batch boundary (samples), and the mean over
           batches of the largest |count of a source in the batch - weight * 256|
  resume   20 steps, state_dict, a new loader loads it and takes 20 more: are those the
           uninterrupted run's steps 20-39 (same batches), and how many samples are extra
           or missing against them
streamcache is measured from a snapshot of HEAD (see README.md), or the working tree with
--live. Writes benchmarks/out/peers/mixture/results.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
from common import OUT, SHARD_BYTES, log, use_streamcache_snapshot  # noqa: E402

STREAMCACHE_SOURCE = use_streamcache_snapshot()  # before anything imports streamcache

ROOT = os.path.join(OUT, "mixture")
SIZES = (40_000, 20_000, 10_000)
WEIGHTS = (0.5, 0.3, 0.2)
BATCH = 256
SEED = 17
ROW = 256  # int32 tokens a sample
BUDGET_S, MAX_STEPS = 6.0, 1000
RESUME_AT, RESUME_STEPS = 20, 20
SYSTEMS = ["streamcache", "mosaic", "litdata"]
JOB_TIMEOUT_S = 300


def source_dir(system: str, source: int) -> str:
    return os.path.join(ROOT, system, f"s{source}")


def sizes(scale: float) -> list[int]:
    return [max(BATCH * 4, int(n * scale)) for n in SIZES]


def rows(source: int, count: int) -> Iterator[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(source)
    for start in range(0, count, 4096):
        block = rng.integers(0, 1 << 15, (min(4096, count - start), ROW), dtype=np.int32)
        for i, row in enumerate(block):
            yield source * 10**6 + start + i, row


# ------------------------------------------------------------------------------ systems


def build(system: str, source: int, count: int) -> None:
    out = source_dir(system, source)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if system == "streamcache":
        from streamcache import Field, Schema, ShardWriter

        schema = Schema([Field.tensor("data", np.int32, (ROW,))])
        with ShardWriter(out, schema=schema, compression=None, shard_size=SHARD_BYTES) as w:
            for _, row in rows(source, count):
                w.write({"data": row})
    elif system == "mosaic":
        from sys_mosaic import _import_streaming

        streaming = _import_streaming()
        with streaming.MDSWriter(out=out, columns={"id": "int64", "data": f"ndarray:int32:{ROW}"},
                                 compression=None, size_limit=SHARD_BYTES) as w:
            for sample_id, row in rows(source, count):
                w.write({"id": sample_id, "data": row})
    else:
        from litdata import optimize

        optimize(fn=_litdata_samples, inputs=[(source, count)], output_dir=out,
                 chunk_bytes=SHARD_BYTES, num_workers=1, mode="overwrite", verbose=False)


def _litdata_samples(job: tuple[int, int]) -> Iterator[dict[str, Any]]:
    for sample_id, row in rows(*job):
        yield {"id": sample_id, "data": row}


class Loader:
    """A system's mixture loader: batches as arrays of sample ids, a state, load, close."""

    def __init__(self, system: str, cache: str) -> None:
        self.system = system
        count = len(SIZES)
        if system == "streamcache":
            from streamcache import Source, StreamDataset, StreamLoader

            dataset = StreamDataset([Source(source_dir(system, s), weight=WEIGHTS[s])
                                     for s in range(count)], global_batch_size=BATCH,
                                    seed=SEED, infinite=True, cache_dir=cache)
            self.loader = StreamLoader(dataset, prefetch=4)
        elif system == "mosaic":
            from sys_mosaic import _import_streaming

            streaming = _import_streaming()
            from streaming.base.util import clean_stale_shared_memory

            clean_stale_shared_memory()
            streams = [streaming.Stream(local=source_dir(system, s), proportion=WEIGHTS[s])
                       for s in range(count)]
            dataset = streaming.StreamingDataset(streams=streams, shuffle=True,
                                                 shuffle_seed=SEED, batch_size=BATCH)
            self.loader = streaming.StreamingDataLoader(dataset, batch_size=BATCH,
                                                        num_workers=0, drop_last=True)
        else:
            from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset

            parts = [StreamingDataset(source_dir(system, s), shuffle=True, seed=SEED,
                                      drop_last=True) for s in range(count)]
            combined = CombinedStreamingDataset(parts, weights=list(WEIGHTS), seed=SEED,
                                                iterate_over_all=False)
            self.loader = StreamingDataLoader(combined, batch_size=BATCH, num_workers=0,
                                              drop_last=True)

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:  # a mixture is read across epochs
            for batch in self.loader:
                if self.system == "streamcache":
                    yield (batch["__source__"] * 10**6 + batch["__id__"]).numpy()
                else:
                    yield np.asarray(batch["id"])

    def steps(self, count: int, budget_s: float = 0.0) -> tuple[list[np.ndarray], float]:
        out: list[np.ndarray] = []
        started = time.perf_counter()
        first = 0.0
        for batch in self:
            if not out:
                first = time.perf_counter()
            out.append(batch)
            if len(out) >= count or (budget_s and time.perf_counter() - first > budget_s):
                break
        return out, (time.perf_counter() - first if len(out) > 1 else time.perf_counter()
                     - started)

    def state(self) -> Any:
        return self.loader.state_dict()

    def load(self, state: Any) -> None:
        self.loader.load_state_dict(state)


# ------------------------------------------------------------------------------ measures


def drift(batches: list[np.ndarray]) -> dict[str, float]:
    weights = np.asarray(WEIGHTS)
    counts = np.stack([np.bincount(b // 10**6, minlength=len(WEIGHTS)) for b in batches])
    seen = np.cumsum(counts, axis=0)
    total = np.cumsum(counts.sum(axis=1))[:, None]
    return {"max_cumulative_drift": float(np.abs(seen - weights * total).max()),
            "mean_batch_deviation": float(np.abs(counts - weights * BATCH).max(axis=1).mean())}


def job(system: str, kind: str) -> dict[str, Any]:
    import torch  # noqa: F401  (imported before the clock starts)

    cache = tempfile.mkdtemp(prefix="mixture-")
    try:
        if kind == "rate":
            loader = Loader(system, cache)
            batches, seconds = loader.steps(MAX_STEPS, BUDGET_S)
            rate = sum(len(b) for b in batches[1:]) / max(seconds, 1e-9)
            return {"samples_per_s": rate, "steps": len(batches), **drift(batches)}
        reference, _ = Loader(system, cache).steps(RESUME_AT + RESUME_STEPS)
        first = Loader(system, cache)
        head, _ = first.steps(RESUME_AT)
        state = json.loads(json.dumps(first.state(), default=_jsonable))
        second = Loader(system, cache)
        second.load(state)
        tail, _ = second.steps(RESUME_STEPS)
        mine = np.concatenate(head + tail)
        ref = np.concatenate(reference)
        values, mine_counts = np.unique(mine, return_counts=True)
        extra = sum(max(0, c - int((ref == v).sum())) for v, c in zip(values, mine_counts,
                                                                    strict=True))
        return {"head_equal": all(np.array_equal(a, b) for a, b in zip(
                    head, reference[:RESUME_AT], strict=True)),
                "same_batches": all(np.array_equal(a, b) for a, b in zip(
                    tail, reference[RESUME_AT:], strict=True)),
                "extra": int(extra), "missing": int(len(ref) - len(mine) + extra)}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def spawn(system: str, kind: str) -> dict[str, Any]:
    try:
        done = subprocess.run([sys.executable, __file__, "--job", system, kind],
                              capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"error": f"no result after {JOB_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": (tail[-1] if tail else f"exit {done.returncode}")[:300]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def table(results: dict[str, Any]) -> str:
    lines = ["| system | samples/s (median) | max cumulative drift (samples) | mean per-batch "
             "deviation (samples of 256) | resume: same batches | extra / missing |",
             "|---|---:|---:|---:|---|---:|"]
    for system in SYSTEMS:
        rates = [r for r in results["rate"][system] if "samples_per_s" in r]
        resume = results["resume"][system]
        if not rates:
            lines.append(f"| {system} | {results['rate'][system][0]} | | | | |")
            continue
        median = float(np.median([r["samples_per_s"] for r in rates]))
        worst = max(r["max_cumulative_drift"] for r in rates)
        deviation = float(np.mean([r["mean_batch_deviation"] for r in rates]))
        same = resume.get("same_batches", resume.get("error", "?"))
        lines.append(f"| {system} | {median:,.0f} | {worst:.1f} | {deviation:.1f} | {same} | "
                     f"{resume.get('extra', '-')} / {resume.get('missing', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--live", action="store_true")
    parser.add_argument("--job", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(job(*args.job)))
        return 0
    if not args.live and not os.environ.get("PEERS_STREAMCACHE_SRC"):
        from run import snapshot_head

        os.environ["PEERS_STREAMCACHE_SRC"] = snapshot_head()
    log(f"streamcache measured from: {os.environ.get('PEERS_STREAMCACHE_SRC', 'working tree')}")
    marker = os.path.join(ROOT, f"built-{args.scale}")
    if not os.path.exists(marker):
        shutil.rmtree(ROOT, ignore_errors=True)
        for system in SYSTEMS:
            for source, count in enumerate(sizes(args.scale)):
                subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r});"
                                f" import mixture; mixture.build({system!r}, {source}, {count})"],
                               check=True)
        open(marker, "w").close()
    started = time.time()
    results: dict[str, Any] = {"rate": {s: [] for s in SYSTEMS}, "resume": {}}
    for repeat in range(args.repeats):
        for system in SYSTEMS[repeat % 3:] + SYSTEMS[:repeat % 3]:
            result = spawn(system, "rate")
            log(f"[{repeat}] {system:<12} {result}")
            results["rate"][system].append(result)
    for system in SYSTEMS:
        results["resume"][system] = spawn(system, "resume")
        log(f"resume {system:<12} {results['resume'][system]}")
    results.update(command=" ".join(["benchmarks/peers/mixture.py", *(argv or sys.argv[1:])]),
                   sizes=sizes(args.scale), weights=WEIGHTS, wall_s=time.time() - started,
                   load=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(os.path.join(ROOT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
