"""Progress lines: redrawn in place on a terminal, whole lines in a log; numbers for people."""

from __future__ import annotations

import io

from streamcache.progress import ProgressLine
from streamcache.units import format_number, parse_size, plural


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_whole_lines_never_carriage_returns() -> None:
    stream, clock = io.StringIO(), _Clock()
    line = ProgressLine(stream, "streamcache", total=100, clock=clock, log_interval_s=5)
    for step in range(1, 101):
        clock.now = step * 0.5
        line.update(step, f"{step * 10} samples")
    line.close()
    text = stream.getvalue()
    assert "\r" not in text and "[" not in text
    lines = text.splitlines()
    assert len(lines) == 10 and all(row.startswith("streamcache: ") for row in lines)
    assert lines[-1] == "streamcache: 100% 100/100 steps 1000 samples"


def test_a_terminal_gets_one_bar_redrawn_in_place() -> None:
    stream, clock = _Terminal(), _Clock()
    line = ProgressLine(stream, "streamcache", total=10, clock=clock, tty_interval_s=0.2)
    for step in range(1, 11):
        clock.now = step * 0.25
        line.update(step)
    line.close()
    text = stream.getvalue()
    assert text.count("\r") == 10 and text.endswith("\n") and text.count("\n") == 1
    assert "[" + "#" * 24 + "]" in text and "100% 10/10 steps" in text


def test_silent_without_a_stream() -> None:
    line = ProgressLine(None, "x", total=3)
    line.update(1, force=True)
    line.close()


def test_counters_and_counts_read_like_prose() -> None:
    assert format_number(1.810775754) == "1.811" and format_number(2.0) == "2"
    assert format_number(12) == "12"
    assert plural(1, "shard") == "1 shard" and plural(2, "shard") == "2 shards"
    assert plural(1_000, "sample") == "1,000 samples"
    assert parse_size("10KB") == 10_000 and parse_size("2 MiB") == 2 << 20
    assert parse_size("1.5g") == 1_500_000_000 and parse_size("4096") == 4096


def test_convert_progress_in_a_log_is_whole_lines() -> None:
    from streamcache.format.convert import Progress

    stream = io.StringIO()
    progress = Progress(stream)
    progress.update(4096, 2_000_000)
    progress._last -= 2  # a second later
    progress.update(8192, 4_000_000)
    progress.done()
    lines = stream.getvalue().split("\n")
    assert "\r" not in stream.getvalue() and lines[-1] == ""
    assert [row.split(" samples")[0] for row in lines[:-1]] == ["converting: 4,096",
                                                                "converting: 8,192"]


def test_bench_prints_rounded_counters(tmp_path) -> None:
    from loader_helpers import make_dataset

    from streamcache.cli.bench import format_results, run_bench

    url = make_dataset(str(tmp_path), [20], seq=False)
    text = format_results(run_bench(url, batch_size=10, cache_dir=str(tmp_path / "c")))
    wait = next(part for part in text.split() if part.startswith("wait_s="))
    assert len(wait.split("=")[1].rstrip(",").partition(".")[2]) <= 3, text
    assert f"cache folder: {tmp_path / 'c'}" in text
