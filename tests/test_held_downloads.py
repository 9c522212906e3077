"""A cold reader takes the first steps' rows from a compressed shard's downloaded bytes while
its install decodes them (cache/downloads.py, ``Prefetcher.downloaded``,
``RangeReader.read_rows(source=...)``).

What is checked: the rows equal the stored ones and cost no request and no cold budget; the
first batches come before the install ends and the whole epoch is exact; bytes that no
checksum verified (an index without one) are hashed chunk by chunk, and damaged or short
bytes are refused, never served; a child process starts with nothing held.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import FaultServer
from test_ranges_server import FAST, ROWS, check_ids, sample

from streamcache import StreamDataset, StreamLoader, load_index, write_dataset
from streamcache.cache import install
from streamcache.cache.downloads import HeldDownloads
from streamcache.cache.ranges import RangeReader
from streamcache.errors import ChecksumMismatchError, ShardCorruptError
from streamcache.remote.fetch import Fetcher


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("data") / "ds"
    write_dataset((sample(i) for i in range(ROWS)), str(folder))
    return folder


def _stored(dataset: Path) -> tuple[Any, bytes]:
    index = load_index(str(dataset))
    assert index.shards[0].compression == "zstd" and index.shards[0].chunked
    return index, (dataset / index.shards[0].path).read_bytes()


def test_rows_from_downloaded_bytes_equal_the_stored_rows_and_cost_no_request(
        dataset: Path) -> None:
    with FaultServer(root=dataset.parent) as server:
        index = load_index(server.url_for("ds"))
        data = (dataset / index.shards[0].path).read_bytes()
        path = "/ds/" + index.shards[0].path
        before = server.requests.count(path)
        reader = RangeReader(index, Fetcher(FAST))
        try:
            rows = np.array([3999, 0, 1234, 1234, 2500, 17], dtype=np.int64)
            shard_reader, local = reader.read_rows(0, rows, source=data)
            ids = shard_reader.batch.column("id").to_numpy()[local]
            assert ids.tolist() == rows.tolist()
            tokens = shard_reader.batch.column("tokens")
            for i, row in zip(local.tolist(), rows.tolist(), strict=True):
                np.testing.assert_array_equal(tokens[i].values.to_numpy(), sample(row)["tokens"])
            assert server.requests.count(path) == before  # sliced, not requested
            assert reader.stats.requests == 0 and reader.stats.bytes == 0
            whole = index.shards[0].bytes  # no budget used: all of it is left
            assert reader.cold_budget_left(0, more=whole, budget=1.0)
        finally:
            reader.close()


def test_bytes_no_checksum_verified_are_hashed_chunk_by_chunk(dataset: Path) -> None:
    """An index without the object's checksum: the download verified only its size, so each
    chunk taken from the bytes is checked against its digest; a damaged one is refused."""
    index, data = _stored(dataset)
    unchecked = dataclasses.replace(
        index, shards=[dataclasses.replace(index.shards[0], checksum=None)])
    info = index.shards[0]
    damaged = bytearray(data)
    middle = (info.bytes - info.tail_bytes) // 2  # (inside a chunk's body)
    damaged[middle:middle + 64] = bytes(64)
    for which, expected in ((unchecked, ChecksumMismatchError), (index, None)):
        reader = RangeReader(which, Fetcher(FAST))
        try:
            rows = np.arange(ROWS, dtype=np.int64)
            if expected is None:  # the bytes' checksum was verified: the good bytes serve
                shard_reader, local = reader.read_rows(0, rows, source=data)
                assert shard_reader.batch.column("id").to_numpy()[local].tolist() == \
                    rows.tolist()
            else:
                with pytest.raises(expected):
                    reader.read_rows(0, rows, source=bytes(damaged))
        finally:
            reader.close()


@pytest.mark.parametrize("cut", [1, 4096, 10 ** 9])
def test_short_downloaded_bytes_are_refused(dataset: Path, cut: int) -> None:
    index, data = _stored(dataset)
    short = data[:max(0, len(data) - cut)]
    reader = RangeReader(index, Fetcher(FAST))
    try:
        with pytest.raises((ShardCorruptError, ChecksumMismatchError)):
            reader.read_rows(0, np.arange(ROWS, dtype=np.int64), source=short)
    finally:
        reader.close()


def test_bytes_of_a_shard_that_is_not_chunked_are_refused(dataset: Path) -> None:
    """Only a chunked shard's chunks are decoded alone; the reader never turns such a call
    into a request of its own (a second download of the object)."""
    index, data = _stored(dataset)
    whole = dataclasses.replace(index, shards=[dataclasses.replace(
        index.shards[0], chunk_rows=None, tail_bytes=None, tail_checksum=None)])
    assert not whole.shards[0].chunked
    reader = RangeReader(whole, Fetcher(FAST))
    try:
        with pytest.raises(ValueError, match="not chunked"):
            reader.read_rows(0, np.arange(3, dtype=np.int64), source=data)
        assert reader.stats.requests == 0
    finally:
        reader.close()


def test_held_downloads_wait_until_offered_or_settled() -> None:
    held = HeldDownloads()
    assert held.wait(3, lambda: True, 0.01) is None  # settled: nothing to wait for
    found: list[bytes | None] = []
    waiter = threading.Thread(target=lambda: found.append(held.wait(3, lambda: False, 0.01)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    held.offer(3, b"stored bytes")
    waiter.join(5)
    assert found == [b"stored bytes"] and len(held) == 1
    held.done(3)
    assert len(held) == 0
    settled = threading.Event()
    waiter = threading.Thread(target=lambda: found.append(held.wait(3, settled.is_set, 10)))
    waiter.start()
    settled.set()
    held.done(3)  # (an install that ended wakes the waiter to look again)
    waiter.join(5)
    assert not waiter.is_alive() and found[-1] is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_holds_nothing() -> None:
    held = HeldDownloads()
    held.offer(1, b"x")
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os._exit(0 if len(held) == 0 and held.wait(1, lambda: True, 0.01) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(held) == 1


def _cold_dataset(server: FaultServer, tmp_path: Path) -> StreamDataset:
    """The served dataset at the defaults, one rank, batches of 64, an empty cache."""
    return StreamDataset(server.url_for("ds"), global_batch_size=64, rank=0, world_size=1,
                         cache_dir=str(tmp_path / "cache"))


def test_the_first_batches_come_from_the_download_while_the_install_decodes(
        dataset: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The install's decode is held until the first batch is out: it must come from the
    downloaded bytes (waiting for the install would take the 20 s the hold lasts); then the
    epoch goes on from the installed shard, every sample once, each exact."""
    decode = threading.Event()
    real = install.materialize

    def held_materialize(*args: Any, **kwargs: Any) -> Any:
        decode.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(install, "materialize", held_materialize)
    with FaultServer(root=dataset.parent) as server:
        data = _cold_dataset(server, tmp_path)
        batches = []
        started = time.monotonic()
        with StreamLoader(data) as loader:
            for batch in loader:
                batches.append(batch)
                if len(batches) == 1:
                    assert time.monotonic() - started < 10
                    assert not data.reader.store.ready(0)  # the install is still decoding
                    decode.set()
        data.close()
    check_ids(batches)
    ids = np.concatenate([np.asarray(b["__id__"]) for b in batches])
    assert len(ids) == ROWS // 64 * 64 and len(np.unique(ids)) == len(ids)


def test_an_install_that_fails_after_its_download_raises_its_error_and_never_hangs(
        dataset: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The decode fails after the bytes were offered (a shard whose content the install
    refuses): the first batch may come from the verified bytes, but the loader then raises
    the install's own error instead of waiting or serving more."""

    def failing_materialize(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)  # (the reader takes the first step's rows meanwhile)
        raise ShardCorruptError("the install refused this shard (test)")

    monkeypatch.setattr(install, "materialize", failing_materialize)
    with FaultServer(root=dataset.parent) as server:
        data = _cold_dataset(server, tmp_path)
        batches = []
        started = time.monotonic()
        with pytest.raises(ShardCorruptError, match="refused this shard"), \
                StreamLoader(data) as loader:
            for batch in loader:
                batches.append(batch)
        data.close()
    assert time.monotonic() - started < 30
    assert len(batches) <= 1
    check_ids(batches)
