"""A reader thread reads several of its steps with one gather (thread_batches.py,
``read_steps_together``): every batch is the one a step read alone gives, an error comes at
the step whose rows have it (after the steps before it), and a cold start still reads its
first steps one by one."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamcache.errors import RowOutOfRangeError
from streamcache.format.ragged import Ragged
from streamcache.format.writer import ShardWriter
from streamcache.loading import dataset_reader, thread_batches
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader

SIZES = [37, 64, 50, 29]  # four shards of uneven sizes: steps span shards


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Sample i: x == i, a float vector, a sequence of i % 7 int32, bytes of i % 5 and a
    str of i % 3 characters (every kind of field the gather splits)."""
    root = str(tmp_path_factory.mktemp("together") / "ds")
    with ShardWriter(root, shard_size=1 << 40, compression=None) as writer:
        i = 0
        for rows in SIZES:
            for _ in range(rows):
                writer.write({"x": i, "v": np.full(3, i, dtype=np.float32),
                              "t": np.arange(i % 7, dtype=np.int32) + i,
                              "b": bytes([i % 251]) * (i % 5), "s": "é" * (i % 3)})
                i += 1
            writer.cut()
    return root


class Counting:
    """Counts the reads of several steps at once that one gather served."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.together = 0
        original = dataset_reader.DatasetReader.read_warm

        def read_warm(reader: Any, shards: np.ndarray, rows: np.ndarray) -> Any:
            arrays = original(reader, shards, rows)
            self.together += arrays is not None
            return arrays

        monkeypatch.setattr(dataset_reader.DatasetReader, "read_warm", read_warm)


def epochs(url: str, cache: str, epochs: int = 2, **options: Any) -> list[dict[str, Any]]:
    threads = options.pop("threads", 2)
    options.setdefault("global_batch_size", 8)
    dataset = StreamDataset(url, rank=0, world_size=1, cache_dir=cache, seed=11, **options)
    batches = []
    with StreamLoader(dataset, threads=threads) as loader:
        for _ in range(epochs):
            batches.extend(loader)
    return batches


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Ragged):
        return isinstance(b, Ragged) and a.tolist() == b.tolist()
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return bool(a == b)


def double(sample: dict[str, Any]) -> dict[str, Any]:
    """A per-sample transform that draws from torch's generator (seeded per sample)."""
    return {"x": sample["x"] * 2, "noise": torch.rand(()), "t": len(sample["t"])}


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 40), ragged=st.sampled_from(["padded", "offsets"]),
       tail=st.sampled_from(["drop", "pad", "split"]), threads=st.integers(1, 3),
       seeds=st.booleans(), transform=st.booleans())
def test_steps_read_together_are_the_steps_read_alone(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int, ragged: str,
        tail: str, threads: int, seeds: bool, transform: bool) -> None:
    options: dict[str, Any] = dict(global_batch_size=batch, ragged=ragged, tail=tail,
                                   threads=threads, with_seeds=seeds,
                                   transform=double if transform else None)
    cache = str(tmp_path / f"cache-{batch}-{ragged}-{tail}-{threads}-{seeds}-{transform}")
    with monkeypatch.context() as alone:
        alone.setattr(thread_batches, "MAX_TOGETHER", 1)
        expected = epochs(url, cache, **options)
    counting = Counting(monkeypatch)
    got = epochs(url, cache, **options)
    assert len(got) == len(expected) > 0
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same(a, b), f"step {step}: {a} != {b}"
    if len(expected) >= 2 * threads + 2 * (threads + 1):  # room for a group after the first
        assert counting.together > 0  # (the rows are tiny: 16 steps fit TOGETHER_BYTES)


def test_ids_once_per_epoch_with_steps_read_together(url: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    counting = Counting(monkeypatch)
    batches = epochs(url, str(tmp_path / "cache"), epochs=3, global_batch_size=4)
    steps = sum(SIZES) // 4
    ids = [b["__id__"].numpy() for b in batches]
    for epoch in range(3):
        seen = np.sort(np.concatenate(ids[epoch * steps:(epoch + 1) * steps]))
        assert len(np.unique(seen)) == steps * 4 and seen.max() < sum(SIZES)
    assert counting.together > 0


@pytest.mark.parametrize("raised, expected", [
    (RowOutOfRangeError, RowOutOfRangeError),
    # a StopIteration from a read would end the loop's for as if the epoch were over
    (StopIteration, RuntimeError),
])
def test_an_error_comes_at_the_step_whose_rows_have_it(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        raised: type[Exception], expected: type[Exception]) -> None:
    """A row that cannot be read (here: sample 120, made to fail in the gather) fails its own
    step: every step before it is delivered, then its error, even when the step was read
    together with others."""
    cache = str(tmp_path / "cache")
    order = [b["__id__"].numpy() for b in epochs(url, cache, epochs=1, global_batch_size=4)]
    bad_step = next(k for k, ids in enumerate(order) if 120 in ids)
    assert bad_step >= 4  # (after the first steps, which are read alone)
    original = dataset_reader.gather

    def gather(shards: Any, which: np.ndarray, rows: np.ndarray, fields: Any) -> Any:
        if any(os.path.basename(shards[k].path).endswith("00002.arrow") and rows[i] == 120 - 101
               for i, k in enumerate(which.tolist())):
            raise raised("sample 120 cannot be read")  # (a new one: a raised one keeps
            # its traceback's frames, and with them the readers, for as long as it lives)
        return original(shards, which, rows, fields)

    monkeypatch.setattr(dataset_reader, "gather", gather)
    counting = Counting(monkeypatch)
    dataset = StreamDataset(url, rank=0, world_size=1, cache_dir=cache, seed=11,
                            global_batch_size=4)
    got = []
    with StreamLoader(dataset) as loader, pytest.raises(expected, match="120"):
        for batch in loader:
            got.append(batch["__id__"].numpy())
    assert len(got) == bad_step
    assert all(np.array_equal(a, b) for a, b in zip(got, order, strict=False))
    assert counting.together > 0


def test_a_mixture_and_a_cold_start_read_their_steps_alone(url: str, tmp_path: Path) -> None:
    """No reader of several sources reads steps together (1), and a reader whose cold start
    is not over reads nothing together (the cold-start rule counts steps)."""
    from streamcache import Source

    mixture = StreamDataset([Source(url, weight=1.0), Source(url, weight=1.0)], rank=0,
                            world_size=1, cache_dir=str(tmp_path / "c1"), global_batch_size=4)
    assert thread_batches.steps_together(mixture) == 1
    dataset = StreamDataset(url, rank=0, world_size=1, cache_dir=str(tmp_path / "c2"),
                            global_batch_size=4)
    reader = dataset.reader
    reader._cold_steps_left = 2
    assert reader.read_warm(np.array([0, 1]), np.array([0, 0])) is None
    reader._cold_steps_left = 0
    assert reader.read_warm(np.array([0, 1]), np.array([0, 0])) is None  # not open yet
    reader.shard_readers([0, 1])
    arrays = reader.read_warm(np.array([0, 1]), np.array([3, 0]))
    assert arrays is not None and arrays["x"].tolist() == [3, 37]
    dataset.close()


def test_a_thread_reads_its_next_group_while_the_loop_takes_the_last(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader thread reads its next group before the loop has taken all of the last one
    (else the cores sit idle while the loop takes a group), and never holds more than two
    groups' batches."""
    monkeypatch.setattr(thread_batches, "MAX_TOGETHER", 4)
    waiting: list[int] = []  # batches a thread held when it started a read of several steps
    original = dataset_reader.DatasetReader.read_warm

    def read_warm(reader: Any, shards: np.ndarray, rows: np.ndarray) -> Any:
        waiting.extend(len(p._ready) for batches in list(thread_batches._running)
                       for p in batches._producers if p._thread is threading.current_thread())
        return original(reader, shards, rows)

    monkeypatch.setattr(dataset_reader.DatasetReader, "read_warm", read_warm)
    dataset = StreamDataset(url, rank=0, world_size=1, cache_dir=str(tmp_path / "cache"),
                            seed=11, global_batch_size=2)
    held = []
    others = set(thread_batches._running)  # (iterations of earlier tests, not yet collected)
    with StreamLoader(dataset, threads=1, prefetch=1) as loader:
        for _ in range(2):
            for batch in loader:
                time.sleep(0.002)  # a slow loop: the thread is ahead of it
                held.extend(len(p._ready) for batches in list(thread_batches._running)
                            if batches not in others for p in batches._producers)
                assert len(batch["__id__"]) == 2
    assert waiting and max(waiting) >= 1, waiting  # a read started while batches waited
    assert max(held) <= 2 * 4 - 1, held  # at most two groups (one of them being taken)


@pytest.mark.parametrize("row_bytes, batch, expected", [
    (1024, 256, {7}), (100_000, 32, {1}), (8, 4, {thread_batches.MAX_TOGETHER})])
def test_how_many_steps_a_thread_reads_at_once(tmp_path: Path, row_bytes: int, batch: int,
                                               expected: set[int]) -> None:
    root = str(tmp_path / "ds")
    with ShardWriter(root, compression=None) as writer:
        for i in range(64):
            writer.write({"data": np.full(row_bytes, i % 256, dtype=np.uint8)})
    dataset = StreamDataset(root, rank=0, world_size=1, cache_dir=str(tmp_path / "cache"),
                            global_batch_size=batch, tail="pad")
    # 2 MiB of 1 KB rows, 256 a step: 7 steps (a row is a little more than its payload in
    # the index's bytes: Arrow's framing); 100 KB rows, 32 a step: 3.2 MB, one step
    assert thread_batches.steps_together(dataset) in expected


def test_ragged_split_gives_the_rows_of_each_part() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 6, 40)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.integers(0, 100, int(offsets[-1])).astype(np.int32)
    ragged = Ragged(values, offsets)
    rows = [bytes([i]) * i for i in range(40)]
    for bounds in ([0, 40], [0, 0, 13, 40], [0, 1, 2, 39, 40], [0, 20, 20, 40]):
        parts = ragged.split(bounds)
        assert [len(p) for p in parts] == np.diff(bounds).tolist()
        for part, (a, b) in zip(parts, itertools.pairwise(bounds), strict=True):
            assert part.offsets[0] == 0 and part.kind == "sequence"
            assert [r.tolist() for r in part] == [r.tolist() for r in list(ragged)[a:b]]
        as_rows = Ragged.from_rows(rows).split(bounds)
        assert [p.tolist() for p in as_rows] == [rows[a:b] for a, b in
                                                  itertools.pairwise(bounds)]
