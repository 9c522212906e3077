"""Each shard opened once however many reader threads ask for it at the same time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from loader_helpers import make_dataset

from streamcache.loading.single_flight import SingleFlight


def _waiting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the threads that wait for another's call (one entry each)."""
    from streamcache.loading import single_flight

    waiting: list[int] = []

    class Counted(Future):  # type: ignore[type-arg]
        def result(self, timeout: float | None = None) -> object:
            waiting.append(1)
            return super().result(timeout)

    monkeypatch.setattr(single_flight, "Future", Counted)
    return waiting


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert condition()


def test_threads_that_ask_while_a_call_runs_get_its_result_and_a_later_ask_calls_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = _waiting(monkeypatch)
    flight: SingleFlight[object] = SingleFlight()
    calls: list[int] = []
    release = threading.Event()

    def call() -> object:
        calls.append(1)
        release.wait(10)
        return object()

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(flight.run, "k", call) for _ in range(6)]
        _until(lambda: len(waiting) == 5)  # the others wait for the first one's call now
        release.set()
        results = [f.result(10) for f in futures]
    assert len(calls) == 1 and all(r is results[0] for r in results)
    assert flight.run("k", lambda: "again") == "again"  # nothing kept after the call


def test_an_error_reaches_every_thread_that_waited_and_the_key_is_free_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = _waiting(monkeypatch)
    flight: SingleFlight[int] = SingleFlight()
    started, release = threading.Event(), threading.Event()

    def failing() -> int:
        started.set()
        release.wait(10)
        raise OSError("disk gone")

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(flight.run, 1, failing)
        assert started.wait(10)
        others = [pool.submit(flight.run, 1, lambda: 7) for _ in range(2)]
        _until(lambda: len(waiting) == 2)
        release.set()
        for future in [first, *others]:
            with pytest.raises(OSError, match="disk gone"):
                future.result(10)
    assert flight.run(1, lambda: 7) == 7
    assert flight.run(2, lambda: 8) == 8  # keys are independent


def test_reader_threads_asking_for_the_same_shards_open_each_once(tmp_path, monkeypatch) -> None:
    from streamcache import DatasetReader
    from streamcache.format import reader as shard_reader

    url = make_dataset(str(tmp_path), [50, 60, 70], seq=False)
    opened: list[str] = []
    real = shard_reader.ShardReader.__init__

    def counting(self, path: str, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        opened.append(path)
        time.sleep(0.05)  # an open long enough for the other threads to ask meanwhile
        real(self, path, *args, **kwargs)

    monkeypatch.setattr(shard_reader.ShardReader, "__init__", counting)
    with DatasetReader(url, local_dir=str(tmp_path / "cache")) as reader:
        ids = np.arange(180)
        barrier = threading.Barrier(4)

        def read() -> list[int]:
            barrier.wait(10)
            return reader.read_batch(ids)["x"].tolist()

        with ThreadPoolExecutor(4) as pool:
            batches = [f.result(30) for f in [pool.submit(read) for _ in range(4)]]
    assert all(batch == list(range(180)) for batch in batches)
    assert sorted(opened) == sorted(set(opened)) and len(opened) == 3
