"""Pictures for the CLI (``bench --plot``, ``goodput --plot``), drawn with matplotlib.

matplotlib is optional (``pip install matplotlib``): it is imported only when a
plot is asked for, and its absence is one clear :class:`MissingDependencyError`. The
format follows the file's suffix (PNG, SVG, PDF, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import MissingDependencyError

if TYPE_CHECKING:
    from ..goodput import GoodputReport
    from .bench_result import BenchResult

RATE_WINDOW_STEPS = 10  # steps averaged into one throughput point


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or, in a "
            "checkout of streamcache, pip install -e '.[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rate_curve(result: BenchResult, window: int = RATE_WINDOW_STEPS,
               ) -> tuple[list[int], list[float]]:
    """(step, samples/s) of ``result``, each rate over the last ``window`` steps."""
    steps, rates = [], []
    timeline = result.timeline
    for i in range(1, len(timeline)):
        j = max(0, i - window)
        elapsed = timeline[i].at_s - timeline[j].at_s
        if elapsed > 0:
            steps.append(timeline[i].step)
            rates.append((timeline[i].samples - timeline[j].samples) / elapsed)
    return steps, rates


def hit_ratio_curve(result: BenchResult) -> tuple[list[int], list[float]]:
    """(step, cache hits / lookups so far) of ``result``; empty without cache counters."""
    steps, ratios = [], []
    for sample in result.timeline:
        if sample.cache_hits is None or sample.cache_misses is None:
            continue
        lookups = sample.cache_hits + sample.cache_misses
        if lookups:
            steps.append(sample.step)
            ratios.append(sample.cache_hits / lookups)
    return steps, ratios


def plot_bench(results: Sequence[BenchResult], path: str) -> None:
    """Throughput, time waited per step, and the cache hit ratio against the step, one panel
    each, for every run of ``streamcache bench`` that finished, and where the streamcache
    run's time went (:func:`time_split`); written to ``path``."""
    plt = require_matplotlib()
    finished = [r for r in results if r.error is None and r.timeline]
    figure, axes = plt.subplots(4, 1, figsize=(9, 12.5),
                                gridspec_kw={"height_ratios": [3, 3, 3, 1.2]})
    rate_ax, wait_ax, hit_ax, time_ax = axes
    wait_ax.sharex(rate_ax)
    hit_ax.sharex(rate_ax)
    for result in finished:
        rate_ax.plot(*rate_curve(result), label=f"{result.name}: "
                     f"{result.samples_per_s:,.0f} samples/s")
        wait_ax.plot([s.step for s in result.timeline],
                     [s.waited_s * 1e3 for s in result.timeline], lw=0.8,
                     label=f"{result.name}: {result.waited_s:.2f} s in all")
    rate_ax.set_yscale("log")
    rate_ax.set(title="Throughput", ylabel=f"samples/s (last {RATE_WINDOW_STEPS} steps, log)")
    wait_ax.set(title="Time the training loop waited for each batch", ylabel="ms")
    _draw_hits(hit_ax, finished[0] if finished else None)
    for ax in (rate_ax, wait_ax, hit_ax):
        if ax is not hit_ax and finished:
            ax.legend(loc="best")
        ax.grid(alpha=0.3, which="both")
    hit_ax.set_xlabel("step")
    _draw_time_split(time_ax, finished[0] if finished else None)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _draw_hits(ax: Any, result: BenchResult | None) -> None:
    steps, ratios = hit_ratio_curve(result) if result is not None else ([], [])
    ax.set(title="Cache hit ratio (shard lookups so far, streamcache)", ylabel="%")
    if not steps or result is None:
        ax.text(0.5, 0.5, "no cache counters", ha="center", va="center", transform=ax.transAxes)
        return
    last = result.timeline[-1]
    ax.plot(steps, [100 * r for r in ratios], color="tab:green",
            label=f"{last.cache_hits} hits of {(last.cache_hits or 0) + (last.cache_misses or 0)}"
                  " lookups")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right")


def time_split(result: BenchResult) -> list[tuple[str, float]]:
    """(part, seconds) of a run's steady time (from its first batch on): the loop's own work,
    then its wait for batches split
    into readers blocked on downloads (spread over the reader threads), the transform on the
    loop's thread, and the rest of the wait (reading from the cache); empty without the
    loader's statistics."""
    stats = result.loader_stats
    if stats is None:
        return []
    threads = max(1, int(result.settings.get("threads", 1)))
    downloads = min(stats.wait_s, stats.shard_wait_s / threads)
    transform = min(stats.wait_s - downloads, stats.transform_s)
    return [("loop's work", max(0.0, result.steady_s - stats.wait_s)),
            ("waiting: downloads", downloads), ("waiting: transform", transform),
            ("waiting: reads", max(0.0, stats.wait_s - downloads - transform))]


def _draw_time_split(ax: Any, result: BenchResult | None) -> None:
    parts = time_split(result) if result is not None else []
    ax.set(title="Where the time went after the first batch (streamcache; --explain says "
                 "what would help)",
           xlabel="seconds", yticks=[])
    if not parts:
        ax.text(0.5, 0.5, "no loader statistics", ha="center", va="center",
                transform=ax.transAxes)
        return
    left = 0.0
    colors = ("tab:green", "tab:red", "tab:orange", "tab:purple")
    for (name, seconds), color in zip(parts, colors, strict=True):
        ax.barh(0, seconds, left=left, color=color, label=f"{name}: {seconds:.2f} s")
        left += seconds
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2, fontsize="small")


def plot_goodput(report: GoodputReport, save_cost: float, restart_cost: float,
                 path: str) -> None:
    """Expected goodput against the checkpoint interval (log scale), with the chosen or
    recommended interval and Young's and Daly's marked; written to ``path``."""
    from ..goodput import expected_goodput, format_duration

    plt = require_matplotlib()
    low = max(1.0, report.interval / 100)
    high = min(report.mtbf * 2, report.interval * 100)
    intervals = [low * (high / low) ** (k / 399) for k in range(400)]
    goodputs = [100 * expected_goodput(t, report.mtbf, save_cost, restart_cost)
                for t in intervals]
    figure, ax = plt.subplots(figsize=(9, 5.5))
    ax.plot([t / 60 for t in intervals], goodputs, color="tab:blue", label="expected goodput")
    label = "recommended" if report.recommended else "chosen"
    ax.axvline(report.interval / 60, color="tab:red",
               label=f"{label}: {format_duration(report.interval)}, {report.goodput:.1%}")
    for name, value, style in (("Young", report.young, ":"), ("Daly", report.daly, "--")):
        if value is not None and low <= value <= high:
            ax.axvline(value / 60, color="gray", ls=style,
                       label=f"{name}'s: {format_duration(value)}")
    ax.set_xscale("log")
    ax.set_ylim(max(0.0, math.floor(min(goodputs) / 10) * 10), 100)
    ax.set(xlabel="checkpoint interval (minutes, log scale)", ylabel="goodput (%)",
           title=f"Goodput vs checkpoint interval: MTBF {format_duration(report.mtbf)}, "
                 f"save {format_duration(save_cost)}, restart {format_duration(restart_cost)}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower center")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


__all__ = ["hit_ratio_curve", "plot_bench", "plot_goodput", "rate_curve", "require_matplotlib",
           "time_split"]
