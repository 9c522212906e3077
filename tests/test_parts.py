"""Large objects fetched as concurrent byte ranges (streamcache/remote/parts.py).

The contract: the bytes are the object's, in memory and in a file; the whole object is checked
against its size and checksum, so a part damaged, shifted or cut short is retried and never
served; a server that ignores ``Range`` gets one GET; objects without a checksum, small ones
and local files are read by one request as before; a dataset installed in parts reads exactly.
And what a hostile server can send: every range shifted (refused with the checksum error, no
file left), a range answered with the whole object, bodies cut short.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from servers import FaultServer
from test_cache import FAST_RETRIES, check_batch, serve_dataset, shard_gets

from streamcache import DatasetReader
from streamcache.cache.node import NodeCache
from streamcache.errors import ChecksumMismatchError
from streamcache.format.checksum import checksum_bytes
from streamcache.remote import parts
from streamcache.remote.fetch import Fetcher
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
    fault_server.faults.script("/obj", [None, None, fault])  # the third request's answer
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
