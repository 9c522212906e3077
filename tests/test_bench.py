"""streamcache bench: the library function and the CLI adapter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from loader_helpers import make_dataset, write_dataset

from streamcache.cli.bench import format_results, run_bench
from streamcache.cli.main import main


def test_run_bench_counts_every_sample_and_compares(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [60, 40], seq=False)
    results = run_bench(url, batch_size=10, cache_dir=str(tmp_path / "c"), compare=True)
    streamcache, baseline = results
    assert (streamcache.steps, streamcache.samples) == (10, 100)
    assert (baseline.steps, baseline.samples) == (10, 100)
    assert streamcache.bytes == 100 * 8 + 100 * 8  # x (int64) and __id__ (int64)
    assert streamcache.first_batch_s > 0 and streamcache.samples_per_s > 0
    table = format_results(results)  # the ratio says what it is against
    assert "x the samples/s of the baseline, a plain torch DataLoader" in table


def test_compute_time_is_not_counted_as_waiting(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [200], seq=False)
    (result,) = run_bench(url, batch_size=10, cache_dir=str(tmp_path / "c"), steps=15,
                          compute_ms=20)
    assert result.steps == 15
    # Start-up, the waits inside next() and the 15 computes are disjoint parts of the run:
    # were a compute counted as waiting, these would add up to more than the whole run.
    waited_per_step = [step.waited_s for step in result.timeline]
    assert waited_per_step[0] == 0.0 and sum(waited_per_step) == pytest.approx(result.waited_s)
    assert result.first_batch_s + result.waited_s + 15 * 0.02 <= result.seconds + 1e-6


def test_cli_json(tmp_path, capsys) -> None:
    url = make_dataset(str(tmp_path), [30], seq=False)
    assert main(["bench", url, "--batch-size", "10", "--json", "--cache-dir",
                 str(tmp_path / "c")]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["name"] == "streamcache" and result["samples"] == 30


def test_compare_pads_variable_length_fields_like_streamcache(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [60, 40])  # "t" holds i % 5 values: variable length
    streamcache, baseline = run_bench(url, batch_size=10, cache_dir=str(tmp_path / "c"),
                                      compare=True)
    assert baseline.error is None
    assert (baseline.steps, baseline.samples) == (streamcache.steps, streamcache.samples) == (
        10, 100)


def test_a_failing_baseline_keeps_the_streamcache_result(tmp_path) -> None:
    url = str(tmp_path / "ds")
    # torch's default collate cannot batch the datetime objects the map-style view returns
    write_dataset([{"x": i, "when": np.datetime64(i, "s")} for i in range(30)], url)
    seen: list[str] = []
    results = run_bench(url, batch_size=10, cache_dir=str(tmp_path / "c"), compare=True,
                        on_result=lambda result: seen.append(result.name))
    assert seen == ["streamcache", "torch DataLoader"]
    assert results[0].samples == 30 and results[0].error is None
    assert results[1].error is not None and "datetime" in results[1].error
    text = format_results(results)
    assert "torch DataLoader: failed" in text and "ratio" not in text


def test_cli_plot_draws_throughput_waiting_and_hits(tmp_path, capsys) -> None:
    url = make_dataset(str(tmp_path), [60, 40])
    path = tmp_path / "bench.png"
    assert main(["bench", url, "--batch-size", "5", "--compare", "--cache-dir",
                 str(tmp_path / "c"), "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 20_000
    assert f"plot: {path}" in capsys.readouterr().out


def test_timeline_feeds_the_plots(tmp_path) -> None:
    from streamcache.cli.plots import hit_ratio_curve, rate_curve

    url = make_dataset(str(tmp_path), [60, 40])
    (result,) = run_bench(url, batch_size=5, cache_dir=str(tmp_path / "c"))
    assert [s.step for s in result.timeline] == list(range(1, 21))
    assert result.timeline[-1].samples == 100
    steps, ratios = hit_ratio_curve(result)
    assert steps and all(0.0 <= r <= 1.0 for r in ratios)
    rate_steps, rates = rate_curve(result)
    assert rate_steps == list(range(2, 21)) and all(r > 0 for r in rates)
