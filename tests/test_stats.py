"""Is my job input-bound? ``StreamLoader.stats()``, ``log_stats`` and ``bench --explain``.

The report must name the right bottleneck in three staged runs: a slow store (every request
waits 0.3 s, cold cache), a slow transform (a warm cache, 3 ms of Python per sample), and
fast everything (a warm cache, the loop working 40 ms a step). Each asserts on the counters
behind the answer, not on which of two durations won. Then the surfaces' adversarial cases:
a logger that raises or is slow, stats read from another thread while the loop runs and
the loader closes, targets that are none of the kinds ``log_stats`` knows.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from loader_helpers import make_dataset
from servers import FaultServer, StoreModel

from streamcache import StreamDataset, StreamLoader
from streamcache.cli.main import main as cli_main
from streamcache.errors import ConfigError
from streamcache.loading.explain import diagnose
from streamcache.loading.stats import LoaderStats


def _slow_transform(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.003)
    return {"x": sample["x"]}


def _run(loader: StreamLoader, work_s: float = 0.0, *, steady: bool = False,
         ) -> tuple[LoaderStats, float]:
    """What a pass counted and its wall time; ``steady``: from the first batch on (the
    start-up, opening the reader and starting its threads, is not the steady state)."""
    stream = iter(loader)
    if steady:
        next(stream)
    before, started = loader.stats(), time.perf_counter()
    for _ in stream:
        if work_s:
            time.sleep(work_s)
    return loader.stats().since(before), time.perf_counter() - started


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A local dataset (zstd shards, installed into the cache on first use) and a cache
    that already holds every shard."""
    folder = str(tmp_path_factory.mktemp("stats"))
    url, cache = make_dataset(folder, [60, 60, 60, 60], seq=False), folder + "/cache"
    with StreamLoader(StreamDataset(url, global_batch_size=24, rank=0, world_size=1,
                                    cache_dir=cache)) as loader:
        for _ in loader:
            pass
    return url, cache


def test_a_slow_store_is_named_the_bottleneck(tmp_path: Path) -> None:
    served = tmp_path / "served"
    url = make_dataset(str(served), [60, 60, 60, 60], seq=False)
    with FaultServer(root=served, store=StoreModel(latency_s=0.3)) as server:
        dataset = StreamDataset(server.url_for("ds/index.json"), global_batch_size=24,
                                rank=0, world_size=1, cache_dir=str(tmp_path / "cache"))
        with StreamLoader(dataset) as loader:
            stats, wall_s = _run(loader)
    assert url  # written where the server serves it
    diagnosis = diagnose(stats, wall_s)
    assert diagnosis.bottleneck == "store", str(diagnosis)
    assert stats.steps == 10 and stats.bytes_fetched > 0
    assert stats.cache_misses + stats.range_reads > 0  # the evidence the answer rests on
    assert stats.transform_s == 0
    assert "input-bound on the store" in str(diagnosis)


def test_a_slow_transform_is_named_the_bottleneck(warm: tuple[str, str]) -> None:
    url, cache = warm
    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache,
                            transform=_slow_transform)
    with StreamLoader(dataset) as loader:
        stats, wall_s = _run(loader, steady=True)
    diagnosis = diagnose(stats, wall_s)
    assert diagnosis.bottleneck == "transform", str(diagnosis)
    assert stats.cache_misses == 0 and stats.range_reads == 0 and stats.bytes_fetched == 0
    assert stats.transform_s >= 9 * 24 * 0.003  # the sleeps alone
    assert "num_workers=" in str(diagnosis)


def test_a_slow_transform_in_worker_processes_is_named_with_its_workers(
        warm: tuple[str, str]) -> None:
    """The advice to move a slow transform into worker processes, followed: the verdict
    still names the transform (the workers' counters come with their batches) and never
    advises reader threads, which do nothing with worker processes."""
    url, cache = warm
    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache,
                            transform=_slow_transform)
    with StreamLoader(dataset, num_workers=2) as loader:
        stats, wall_s = _run(loader, steady=True)
    diagnosis = diagnose(stats, wall_s, num_workers=2)
    assert diagnosis.bottleneck == "transform", str(diagnosis)
    assert stats.workers == 2 and stats.transform_s >= 8 * 24 * 0.003  # the workers' sleeps
    assert "threads=" not in str(diagnosis) and "2 worker processes" in str(diagnosis)
    assert "cache hits" in str(diagnosis)  # the workers' lookups, not "no cache lookups"


def test_worker_processes_count_their_cache_lookups_and_downloads(tmp_path: Path) -> None:
    served = tmp_path / "served"
    make_dataset(str(served), [60, 60, 60, 60], seq=False)
    with FaultServer(root=served) as server:
        dataset = StreamDataset(server.url_for("ds/index.json"), global_batch_size=24,
                                rank=0, world_size=1, cache_dir=str(tmp_path / "cache"),
                                transform=_slow_transform)
        with StreamLoader(dataset, num_workers=2) as loader:
            stats, wall_s = _run(loader)
    assert stats.cache_hits + stats.cache_misses + stats.range_reads > 0
    assert stats.bytes_fetched > 0  # the cold cache's downloads, made in the workers
    assert "no cache lookups" not in str(diagnose(stats, wall_s, num_workers=2))


def test_a_trivial_transform_on_the_loops_thread_is_not_called_input_bound() -> None:
    """12% of the loop in a cheap transform, every batch read ahead: moving the transform
    would give back at most 12%, which is not what "input-bound" tells a user."""
    trivial = LoaderStats(steps=100, wait_s=0.125, ready_steps=100, transform_s=0.12)
    diagnosis = diagnose(trivial, 1.0)
    assert diagnosis.bottleneck == "none", str(diagnosis)
    assert "12% of it the transform" in str(diagnosis)
    heavy = LoaderStats(steps=100, wait_s=0.45, ready_steps=100, transform_s=0.44)
    assert diagnose(heavy, 1.0).bottleneck == "transform"
    reads = LoaderStats(steps=100, wait_s=0.30, ready_steps=10, transform_s=0.05)
    assert diagnose(reads, 1.0).bottleneck == "read"


def test_fast_everything_is_not_input_bound(warm: tuple[str, str]) -> None:
    url, cache = warm
    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache)
    with StreamLoader(dataset) as loader:
        stats, wall_s = _run(loader, work_s=0.04, steady=True)
    diagnosis = diagnose(stats, wall_s)
    assert diagnosis.bottleneck == "none", str(diagnosis)
    assert stats.cache_misses == 0 and stats.bytes_fetched == 0 and stats.transform_s == 0
    assert stats.ready_steps >= stats.steps - 1
    assert "not input-bound" in str(diagnosis)


def test_bench_explain_prints_where_the_time_went(warm: tuple[str, str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url, cache = warm
    assert cli_main(["bench", url, "--cache-dir", cache, "--batch-size", "24",
                     "--compute-ms", "40", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "where the time went" in out and "not input-bound" in out
    # the cache line counts the whole run, the explanation the steady state: each says so
    # (on a cold cache they read as a contradiction: hits and misses beside "no lookups")
    assert "cache (whole run, first batch included):" in out
    assert out.index("from the first batch on") < out.index("where the time went")
    assert cli_main(["bench", url, "--cache-dir", cache, "--batch-size", "24", "--explain",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)[0]
    assert report["explain"]["bottleneck"] in ("none", "read")
    assert report["loader_stats"]["steps"] == 9  # steady state: from the first batch on


def test_stats_per_step_counters(warm: tuple[str, str]) -> None:
    url, cache = warm
    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache)
    with StreamLoader(dataset, prefetch=3) as loader:
        assert loader.stats() == LoaderStats(prefetch_target=3)  # nothing opened yet
        stream = iter(loader)
        next(stream)
        first = loader.stats()
        assert first.steps == 1 and first.wait_s == first.last_wait_s > 0
        for _ in stream:
            pass
        last = loader.stats()
    assert last.steps == 10 and 0 <= last.prefetch_depth <= 3
    assert last.cache_hits >= 4 and last.cache_misses == 0 and last.read_s > 0  # all installed
    step = last.since(first)
    assert step.steps == 9 and step.prefetch_depth == last.prefetch_depth
    assert step.metrics()["wait_ms_per_step"] == pytest.approx(1e3 * step.wait_s / 9)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def __call__(self, metrics: Mapping[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))


class _LightningLike:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int | None]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((metrics, step))


class _SummaryWriterLike:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars.append((tag, value, global_step))


def test_log_stats_reports_every_n_steps_to_each_kind_of_logger(warm: tuple[str, str]) -> None:
    url, cache = warm
    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache)
    recorder, lightning, writer = _Recorder(), _LightningLike(), _SummaryWriterLike()
    with StreamLoader(dataset) as loader:
        loader.log_stats(recorder, every_n_steps=3)
        loader.log_stats(lightning, every_n_steps=5, prefix="data/")
        loader.log_stats(writer, every_n_steps=10)
        for _ in loader:
            pass
    assert [step for _, step in recorder.calls] == [3, 6, 9]
    assert all(m["streamcache/steps"] == 3 for m, _ in recorder.calls)  # each report: 3 steps
    assert [step for _, step in lightning.calls] == [5, 10]
    assert "data/wait_ms_per_step" in lightning.calls[0][0]
    assert {step for _, _, step in writer.scalars} == {10}
    assert ("streamcache/steps", 10.0, 10) in writer.scalars


def test_a_failing_logger_is_warned_about_once_and_training_goes_on(
        warm: tuple[str, str]) -> None:
    url, cache = warm
    calls = []

    def broken(metrics: Mapping[str, float], step: int) -> None:
        calls.append(step)
        raise ConnectionError("the metrics server went away")

    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache)
    with StreamLoader(dataset) as loader:
        hook = loader.log_stats(broken, every_n_steps=2)
        with pytest.warns(RuntimeWarning, match="ConnectionError.*not called again") as caught:
            steps = sum(1 for _ in loader)
    assert steps == 10 and calls == [2]
    assert len([w for w in caught if "stats logger" in str(w.message)]) == 1
    assert hook.closed and isinstance(hook.failure, ConnectionError)


def test_a_slow_logger_shows_in_the_stats(warm: tuple[str, str]) -> None:
    url, cache = warm
    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache)
    with StreamLoader(dataset) as loader:
        loader.log_stats(lambda metrics, step: time.sleep(0.05), every_n_steps=1)
        for _ in loader:
            pass
        stats = loader.stats()
    assert stats.log_s >= 10 * 0.05  # the loop's time in the logger is counted, not hidden


def test_log_stats_refuses_what_it_cannot_log_to(warm: tuple[str, str]) -> None:
    url, cache = warm
    with StreamLoader(StreamDataset(url, global_batch_size=24, rank=0, world_size=1,
                                    cache_dir=cache)) as loader:
        with pytest.raises(ConfigError, match=r"Lightning logger.*SummaryWriter.*wandb"):
            loader.log_stats(object())
        with pytest.raises(ConfigError, match="every_n_steps"):
            loader.log_stats(_Recorder(), every_n_steps=0)
        with pytest.raises(ConfigError, match="prefix"):
            loader.log_stats(_Recorder(), prefix=3)  # type: ignore[arg-type]


def test_stats_read_from_another_thread_while_the_loop_runs_and_closes(
        warm: tuple[str, str]) -> None:
    url, cache = warm
    dataset = StreamDataset(url, global_batch_size=24, rank=0, world_size=1, cache_dir=cache,
                            infinite=True)
    loader = StreamLoader(dataset)
    snapshots: list[LoaderStats] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def watch() -> None:
        try:
            while not stop.is_set():
                snapshots.append(loader.stats())
        except BaseException as error:  # reported below
            errors.append(error)

    watcher = threading.Thread(target=watch, name="stats-watcher")
    watcher.start()
    try:
        for step, _ in enumerate(loader, start=1):
            if step == 30:
                break
        loader.close()
        time.sleep(0.05)  # snapshots of a closed loader, too
    finally:
        stop.set()
        watcher.join(10)
    assert errors == [] and len(snapshots) > 10
    steps = [s.steps for s in snapshots]
    assert steps == sorted(steps) and steps[-1] == 30  # monotonic, never torn backwards
    assert loader.stats().steps == 30
    # a snapshot never opens a reader again: the closed loader has none
    from streamcache.loading.stats import open_reader
    assert open_reader(loader.dataset) is None


def test_wandb_like_targets_get_the_metrics_with_the_next_commit() -> None:
    import types

    from streamcache.loading.stats_logger import metrics_sink

    logged: list[tuple[dict[str, float], dict[str, Any]]] = []
    wandb = types.ModuleType("wandb")
    wandb.log = lambda data, **kw: logged.append((data, kw))  # type: ignore[attr-defined]
    metrics_sink(wandb)({"a": 1.0}, 7)
    assert logged == [({"a": 1.0}, {"commit": False})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert metrics_sink(print) is print  # a plain function is called as it is


def test_the_plot_shows_where_the_time_went(warm: tuple[str, str]) -> None:
    """The split the plot's last panel draws (tests/test_bench.py draws the whole plot)."""
    from streamcache.cli.bench import run_bench
    from streamcache.cli.plots import time_split

    url, cache = warm
    (result,) = run_bench(url, batch_size=24, cache_dir=cache, compute_ms=20)
    parts = dict(time_split(result))
    assert parts["loop's work"] >= 8 * 0.02  # the simulated compute after the first batch
    assert sum(parts.values()) == pytest.approx(result.steady_s)
    assert parts["waiting: downloads"] == 0 and parts["waiting: transform"] == 0  # warm
