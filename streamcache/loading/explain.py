"""Where a run's time went, and what setting would help: ``streamcache bench --explain``.

A pure function of a :class:`~streamcache.loading.stats.LoaderStats` difference (what a run
counted) and the run's wall time. The training loop's time splits into its own work and
the wait for batches. Below a small share of waiting (:data:`INPUT_BOUND_SHARE`) the job is
not input-bound and nothing needs to change. Otherwise the counters name the cause:

- the transform: a per-sample or batch transform ran on the loop's thread for at least
  half of the wait (``transform_s``), or, with worker processes, took at least half of the
  workers' time (the workers send their counters with their batches);
- the store: readers had to go to the store for what they read (cache misses: a reader
  blocked on a shard not installed yet; or range reads of shards not in the cache): the
  downloads are slower than the loop;
- reading: every read was a cache hit, yet batches were not ready in time: the gather,
  decoding or page-cache reads are slower than the loop.

The evidence is counted, not timed against each other, so the answer does not depend on
which of two similar durations won a race.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .stats import LoaderStats

Bottleneck = Literal["none", "store", "transform", "read"]

#: The loop waiting less than this share of its time for reads is not input-bound.
INPUT_BOUND_SHARE = 0.10
#: A transform on the loop's thread is work the job does somewhere: below this share of the
#: loop's time, moving it to worker processes is not worth calling the job input-bound.
TRANSFORM_BOUND_SHARE = 0.20


@dataclass(frozen=True)
class Diagnosis:
    """What limits a run: ``bottleneck``, the share of the loop's time spent waiting, and
    the lines of the report (where the time went, then what to change)."""

    bottleneck: Bottleneck
    wait_share: float
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def diagnose(stats: LoaderStats, wall_s: float, *, num_workers: int = 0,
             threads: int = 2) -> Diagnosis:
    """Name what the loop waited on in a run that counted ``stats`` over ``wall_s`` seconds.

    ``num_workers``/``threads`` are the loader's settings, for the advice. See the module
    docstring for how the cause is told.
    """
    steps = max(1, stats.steps)
    wait_share = stats.wait_s / wall_s if wall_s > 0 else 0.0
    lines = [_where(stats, wall_s, wait_share, steps), _counters(stats)]
    on_loop = 0.0 if num_workers else min(stats.transform_s, stats.wait_s)
    transform_share = on_loop / wall_s if wall_s > 0 else 0.0
    if wait_share - transform_share < INPUT_BOUND_SHARE and \
            transform_share < TRANSFORM_BOUND_SHARE:
        lines.append(f"not input-bound: the loop waited {wait_share:.0%} of its time for "
                     "batches" + (f", {transform_share:.0%} of it the transform on its own "
                                  "thread (worker processes could give back at most that)"
                                  if transform_share >= 0.005 else "") +
                     "; no input setting would speed it up much")
        return Diagnosis("none", wait_share, tuple(lines))
    bottleneck: Bottleneck
    if num_workers and stats.transform_s >= (stats.transform_s + stats.read_s) / 2:
        bottleneck = "transform"  # the workers' time went to the transform
    elif not num_workers and stats.transform_s >= stats.wait_s / 2:
        bottleneck = "transform"
    elif stats.cache_misses or stats.range_reads:
        bottleneck = "store"
    else:
        bottleneck = "read"
    lines.append(_advice(bottleneck, stats, steps, num_workers, threads))
    return Diagnosis(bottleneck, wait_share, tuple(lines))


def _where(stats: LoaderStats, wall_s: float, wait_share: float, steps: int) -> str:
    work_s = max(0.0, wall_s - stats.wait_s)
    return (f"where the time went: {wall_s:.2f} s over {stats.steps} steps; the loop worked "
            f"{work_s:.2f} s ({1 - wait_share:.0%}) and waited for batches {stats.wait_s:.2f} s "
            f"({wait_share:.0%}, {1e3 * stats.wait_s / steps:.1f} ms a step); "
            f"{stats.ready_steps} of {stats.steps} batches had been read ahead when asked"
            f"{_ready_note(stats)}")


def _ready_note(stats: LoaderStats) -> str:
    """Why batches read ahead may still be waited for: the transform runs after the read."""
    if stats.workers or not stats.transform_s:
        return ""
    return " (a transform on the loop's thread still runs after the read)"


def _counters(stats: LoaderStats) -> str:
    hit_rate = stats.cache_hit_rate
    hits = "no cache lookups" if hit_rate is None else \
        f"cache hits {stats.cache_hits} of {stats.cache_hits + stats.cache_misses} " \
        f"({hit_rate:.0%}), range reads {stats.range_reads}"
    where = f"in the {stats.workers} worker processes" if stats.workers else \
        "on the loop's thread"
    readers = "worker processes" if stats.workers else "threads"
    return (f"behind the wait: readers blocked on downloads {stats.shard_wait_s:.2f} s, "
            f"transform {where} {stats.transform_s:.2f} s, reading "
            f"{stats.read_s:.2f} s (all {readers}); {hits}; fetched "
            f"{stats.bytes_fetched / 1e6:,.1f} MB, retries {stats.fetch_retries}, stalls "
            f"{stats.fetch_stalls}")


def _advice(bottleneck: Bottleneck, stats: LoaderStats, steps: int, num_workers: int,
            threads: int) -> str:
    if bottleneck == "store":
        faults = f" ({stats.fetch_retries} retries, {stats.fetch_stalls} stalls: check the " \
                 "store's health)" if stats.fetch_retries or stats.fetch_stalls else ""
        return ("input-bound on the store: readers waited for shards to download" + faults +
                "; fetch further ahead and in parallel (PrefetchOptions(workers=8, "
                "lookahead_shards=...), FetchOptions(max_concurrency=32)), keep the cache on "
                "fast local disk with a cache_limit that holds the working set, or warm it "
                "with one epoch before the run")
    if bottleneck == "transform":
        per_step = 1e3 * stats.transform_s / steps
        more = max(2, num_workers * 2)
        if num_workers:
            return (f"input-bound on the transform: {per_step:.1f} ms a step in the "
                    f"{num_workers} worker processes, most of their time; more workers "
                    f"(StreamLoader(num_workers={more})) if the cores are free, a cheaper "
                    "transform, or a batch_transform (one call per batch, not per sample)")
        return (f"input-bound on the transform: {per_step:.1f} ms a step ran on the loop's "
                f"thread; run it in worker processes (StreamLoader(num_workers={more})), or "
                "make it a batch_transform (one call per batch instead of one per sample)")
    if num_workers:
        return (f"input-bound on reading in the {num_workers} worker processes: batches were "
                f"not ready in time; more workers (StreamLoader(num_workers={num_workers * 2}))"
                ", read only the fields the model needs (fields=[...]), or, without a "
                "transform, threads (num_workers=0) read with less overhead")
    return (f"input-bound on reading: batches from the cache were not ready in time; raise "
            f"StreamLoader(threads={threads * 2}, prefetch=...) and read only the fields the "
            "model needs (fields=[...])")


__all__ = ["INPUT_BOUND_SHARE", "TRANSFORM_BOUND_SHARE", "Bottleneck", "Diagnosis", "diagnose"]
