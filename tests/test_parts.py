"""Large objects fetched as concurrent byte ranges (streamcache/remote/parts.py).

The contract: the bytes are the object's, in memory and in a file; the whole object is checked
against its size and checksum, so a part damaged, shifted or cut short is retried and never
served; a server that ignores ``Range`` gets one GET; objects without a checksum, small ones
and local files are read by one request as before; a dataset installed in parts reads exactly.
And what a hostile server can send: every range shifted (refused with the checksum error, no
file left), a range answered with the whole object, bodies cut short.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import FaultServer, S3Bucket
from test_cache import FAST_RETRIES, check_batch, serve_dataset, shard_gets

from streamcache import DatasetReader
from streamcache.cache.node import NodeCache
from streamcache.errors import ChecksumMismatchError
from streamcache.format.checksum import checksum_bytes
from streamcache.remote import parts, transfer
from streamcache.remote.fetch import Fetcher
from streamcache.remote.options import FetchOptions
from streamcache.remote.retry import FetchError

PART = 64 << 10
DATA = np.random.default_rng(7).bytes(5 * PART + 1234)  # six parts, the last one short


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts, "PART_BYTES", PART)


def fetch(fetcher: Fetcher, url: str, path: Path | None = None,
          checksum: str | None = checksum_bytes(DATA)) -> bytes:
    if path is None:
        return parts.fetch_bytes(fetcher, url, size=len(DATA), checksum=checksum)
    assert parts.fetch_to_path(fetcher, url, str(path), size=len(DATA),
                               checksum=checksum) == len(DATA)
    return path.read_bytes()


@pytest.mark.parametrize("into", ["memory", "file"])
def test_an_object_comes_in_parts_and_is_the_objects_bytes(
        fault_server: FaultServer, tmp_path: Path, into: str) -> None:
    url = fault_server.put("obj", DATA)
    with Fetcher(FAST_RETRIES) as fetcher:
        assert fetch(fetcher, url, tmp_path / "obj" if into == "file" else None) == DATA
        assert fetcher.stats.bytes == len(DATA)
    assert fault_server.requests.count("/obj") == 6  # one GET per part


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "shifted_range"])
@pytest.mark.parametrize("into", ["memory", "file"])
def test_a_damaged_part_retries_the_set_and_is_never_served(
        fault_server: FaultServer, tmp_path: Path, fault: str, into: str) -> None:
    url = fault_server.put("obj", DATA)
    # the third and fourth requests' answers: the parts go out in parallel, so either may be
    # the last part, where the server cannot shift a range (tests/servers.py) and a
    # "shifted_range" is no fault at all; one of the two is always a damaged part
    fault_server.faults.script("/obj", [None, None, fault, fault])
    with Fetcher(FAST_RETRIES) as fetcher:
        assert fetch(fetcher, url, tmp_path / "obj" if into == "file" else None) == DATA
        assert fetcher.stats.retries >= 1


@pytest.mark.parametrize("into", ["memory", "file"])
def test_a_server_that_shifts_every_range_is_refused_by_the_checksum(
        fault_server: FaultServer, tmp_path: Path, into: str) -> None:
    url = fault_server.put("obj", DATA)
    fault_server.faults.configure(rate=1.0, kinds=("shifted_range",))
    target = tmp_path / "obj"
    with Fetcher(FAST_RETRIES) as fetcher, pytest.raises(ChecksumMismatchError, match="obj"):
        fetch(fetcher, url, target if into == "file" else None)


@pytest.mark.parametrize("into", ["memory", "file"])
def test_a_server_that_ignores_ranges_is_read_with_one_get(
        fault_server: FaultServer, tmp_path: Path, into: str) -> None:
    url = fault_server.put("obj", DATA)
    fault_server.faults.configure(rate=1.0, kinds=("ignore_range",))
    with Fetcher(FAST_RETRIES) as fetcher:
        assert fetch(fetcher, url, tmp_path / "obj" if into == "file" else None) == DATA


def test_no_checksum_a_small_object_or_a_local_file_take_one_request(
        fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.put("obj", DATA)
    small = fault_server.put("small", DATA[:2 * PART - 1])
    local = tmp_path / "local"
    local.write_bytes(DATA)
    with Fetcher(FAST_RETRIES) as fetcher:
        assert fetch(fetcher, url, checksum=None) == DATA  # (a shifted range would pass)
        assert parts.fetch_bytes(fetcher, small, size=2 * PART - 1,
                                 checksum=checksum_bytes(DATA[:2 * PART - 1])) == DATA[
            :2 * PART - 1]
        assert fetch(fetcher, str(local)) == DATA
    assert fault_server.requests.count("/obj") == fault_server.requests.count("/small") == 1


def test_a_dead_server_fails_with_the_fetch_error_and_leaves_no_file(
        fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.put("obj", DATA)
    fault_server.faults.configure(rate=1.0, kinds=("error",))
    target = tmp_path / "obj"
    with Fetcher(FAST_RETRIES) as fetcher, pytest.raises(FetchError, match="obj"):
        fetch(fetcher, url, target)
    # (an install removes its download file whatever happened: cache/install.py)


@pytest.mark.parametrize("compression", ["zstd", None], ids=["decoded", "as-stored"])
def test_a_dataset_installed_in_parts_reads_exactly(
        fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        compression: str | None) -> None:
    index = serve_dataset(fault_server, num_shards=3, compression=compression)
    part = max(1024, min(info.bytes for info in index.shards) // 3)
    monkeypatch.setattr(parts, "PART_BYTES", part)
    cache = NodeCache(index, str(tmp_path / "cache"), fetch_options=FAST_RETRIES)
    with DatasetReader(index, store=cache, cold_ranges=False) as reader:
        ids = np.random.default_rng(1).permutation(len(reader))
        for start in range(0, len(ids), 32):
            check_batch(reader.read_batch(ids[start:start + 32]), ids[start:start + 32])
        assert cache.stats.installs == 3
    gets = shard_gets(fault_server)
    for info in index.shards:
        assert gets[f"/ds/{info.path}"] == -(-info.bytes // part) >= 3, gets
    assert not [p for p in (tmp_path / "cache" / "tmp").rglob("*") if p.is_file()]
    assert os.path.isdir(tmp_path / "cache" / "datasets")


# ------------------------------------------------------------------ on S3: each part streamed


def s3_options(s3_bucket: S3Bucket, via: FaultServer | None = None) -> FetchOptions:
    return dataclasses.replace(FAST_RETRIES, storage_options=s3_bucket.storage_options(
        via=via.url if via is not None else None))


@pytest.mark.parametrize("into", ["memory", "file"])
def test_on_s3_every_part_is_streamed_and_the_bytes_are_the_objects(
        s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: str) -> None:
    """On s3fs each part's GET is read as its body arrives (no whole-body read to join on the
    event loop's thread); the object is the same bytes, in memory and in a file."""
    url = s3_bucket.put(f"parts/streamed-{into}", DATA)
    streamed: list[tuple[int, int]] = []
    real = transfer._s3_range

    async def counted(fs: Any, path: str, start: int, end: int, timeout: float,
                      hand: Any = None) -> tuple[list[bytes], int]:
        streamed.append((start, end))
        return await real(fs, path, start, end, timeout, hand)

    monkeypatch.setattr(transfer, "_s3_range", counted)
    with Fetcher(s3_options(s3_bucket)) as fetcher:
        assert fetch(fetcher, url, tmp_path / "obj" if into == "file" else None) == DATA
        assert fetcher.stats.bytes == len(DATA)
    assert sorted(streamed) == [(s, min(s + PART, len(DATA))) for s in range(0, len(DATA), PART)]


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "reset", "stall", "error"])
@pytest.mark.parametrize("into", ["memory", "file"])
def test_on_s3_a_damaged_or_stalled_part_retries_the_set_and_is_never_served(
        s3_bucket: S3Bucket, s3_fault_proxy: FaultServer, tmp_path: Path, fault: str,
        into: str) -> None:
    """A part whose streamed body is cut, damaged, stalled or refused is retried with the
    whole set; what is served is the object's bytes (the whole is checked). (A shifted range
    is the HTTP tests' above: the proxy forwards ranges as asked.)"""
    key = f"parts/faulty-{fault}-{into}"
    url = s3_bucket.put(key, DATA)
    s3_fault_proxy.faults.configure(delay_s=2.0)  # (a stall: longer than the timeout below)
    s3_fault_proxy.faults.script(f"/{s3_bucket.name}/{key}", [None, None, fault])
    options = dataclasses.replace(s3_options(s3_bucket, s3_fault_proxy), timeout_s=0.5)
    with Fetcher(options) as fetcher:
        assert fetch(fetcher, url, tmp_path / "obj" if into == "file" else None) == DATA
        assert fetcher.stats.retries >= 1


@pytest.mark.parametrize("into", ["memory", "file"])
def test_on_s3_a_proxy_that_drops_the_range_gets_one_get(
        s3_bucket: S3Bucket, s3_fault_proxy: FaultServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, into: str) -> None:
    """A proxy that drops ``Range`` (the store answers every part with the whole object): the
    first streamed part notices a body longer than asked, and the object comes by one GET."""
    key = f"parts/ranges-dropped-{into}"
    url = s3_bucket.put(key, DATA)
    s3_fault_proxy.faults.configure(rate=1.0, kinds=("ignore_range",), methods=("GET",))
    monkeypatch.setattr(transfer, "_PIECE_BYTES", 16 << 10)
    received: list[tuple[int, int]] = []  # (asked, received) per streamed part
    real = transfer._s3_range

    async def counted(fs: Any, path: str, start: int, end: int, timeout: float,
                      hand: Any = None) -> tuple[list[bytes], int]:
        pieces, length = await real(fs, path, start, end, timeout, hand)
        received.append((end - start, length))
        return pieces, length

    monkeypatch.setattr(transfer, "_s3_range", counted)
    with Fetcher(s3_options(s3_bucket, s3_fault_proxy)) as fetcher:
        assert fetch(fetcher, url, tmp_path / "obj" if into == "file" else None) == DATA
    # each whole-object answer was read one piece past its range, not to its end
    assert received and all(asked < n <= asked + (16 << 10) for asked, n in received), received


def test_on_s3_a_missing_object_is_permanent_and_named(
        s3_bucket: S3Bucket, tmp_path: Path) -> None:
    with Fetcher(s3_options(s3_bucket)) as fetcher, pytest.raises(FetchError) as caught:
        fetch(fetcher, s3_bucket.url("parts/never-written"), tmp_path / "obj")
    assert caught.value.permanent and "never-written" in str(caught.value)
    assert not (tmp_path / "obj").exists() or (tmp_path / "obj").stat().st_size == 0


def test_on_s3_each_piece_is_handed_on_as_it_arrives_and_kept_nowhere(
        s3_bucket: S3Bucket) -> None:
    """With ``each``, the pieces of every part go to it (on the calling thread) and none is
    kept: together they are the object, byte for byte; an ``each`` that fails (a full disk)
    ends the set with its error, without waiting for the rest."""
    url = s3_bucket.put("parts/handed", DATA)
    ranges = [(s, min(s + PART, len(DATA))) for s in range(0, len(DATA), PART)]
    got = bytearray(len(DATA))
    seen: list[tuple[int, int]] = []

    def each(offset: int, piece: bytes) -> None:
        seen.append((offset, len(piece)))
        got[offset:offset + len(piece)] = piece

    with Fetcher(s3_options(s3_bucket)) as fetcher:
        assert fetcher.fetch_range_pieces(url, ranges, each=each) == [[] for _ in ranges]
        assert bytes(got) == DATA and fetcher.stats.bytes == len(DATA)
        assert sum(n for _, n in sorted(seen)) == len(DATA)

        def full(offset: int, piece: bytes) -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(FetchError, match="No space left"):
            fetcher.fetch_range_pieces(url, ranges, each=full)
