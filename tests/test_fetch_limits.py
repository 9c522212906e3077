"""The Fetcher's bounds: bodies larger than expected, stalls, close while stalled, defaults.

Each test runs against the project's fault server on loopback and judges by counters (bytes
the server sent, requests it saw, the Fetcher's stats) and events, never by elapsed time.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import FaultServer

from streamcache.cache.prefetch import PrefetchOptions
from streamcache.errors import IndexFormatError, IndexNotFoundError, StreamcacheError
from streamcache.format import index as index_module
from streamcache.format.index import load_index
from streamcache.format.writer import write_dataset
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.dataset_reader import DatasetReader
from streamcache.remote.download import TEMP_SUFFIX
from streamcache.remote.fetch import Fetcher
from streamcache.remote.options import FetchOptions
from streamcache.remote.retry import FetchError, backoff_delay


def fast(**overrides: Any) -> FetchOptions:
    settings: dict[str, Any] = dict(timeout_s=10.0, retries=3, backoff_initial_s=0.002,
                                    backoff_max_s=0.02)
    settings.update(overrides)
    return FetchOptions(**settings)


def payload(seed: int, size: int = 50_000) -> bytes:
    return random.Random(seed).randbytes(size)


def test_a_body_larger_than_the_index_says_is_cut_off_at_the_expected_size(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    data = payload(1)
    url = fault_server.put("big", data)
    fault_server.faults.configure(rate=1.0, kinds=("oversize",), oversize_bytes=96 << 20)
    with Fetcher(fast()) as fetcher, pytest.raises(FetchError) as caught:
        fetcher.fetch_to_file(url, tmp_path / "big", size=len(data))
    error = caught.value
    assert error.url == url and error.permanent and error.attempts == 1
    assert f"more than the {len(data)} bytes" in str(error)
    # the download stopped right after the expected size: the server could only push what
    # the sockets' buffers hold beyond it, nowhere near the 96 MiB it offered
    fault_server.close()  # its handler notices the closed connection and stops counting
    assert fault_server.requests.bytes_sent("/big") < len(data) + (24 << 20)
    assert os.listdir(tmp_path) == ["served"]  # no file, no temporary left


def test_an_object_over_the_cap_is_refused_without_reading_it_all(
    fault_server: FaultServer,
) -> None:
    url = fault_server.put("unsized", payload(2, 200_000))
    with Fetcher(fast(block_size=4096)) as fetcher, pytest.raises(FetchError) as caught:
        fetcher.fetch(url, max_bytes=10_000)
    assert caught.value.permanent and "more than the 10000 bytes" in str(caught.value)
    assert fetcher.stats.retries == 0
    with Fetcher(fast()) as fetcher:
        assert len(fetcher.fetch(url, max_bytes=200_000)) == 200_000


def test_a_local_file_of_the_wrong_size_fails_at_once(tmp_path: Path) -> None:
    (tmp_path / "shard").write_bytes(b"x" * 1000)
    with Fetcher(fast(retries=6, backoff_initial_s=5.0)) as fetcher:
        for size in (999, 1001):
            with pytest.raises(FetchError) as caught:
                fetcher.fetch(str(tmp_path / "shard"), size=size)
            assert caught.value.permanent and caught.value.attempts == 1
            assert "the index records" in str(caught.value)
        assert fetcher.stats.retries == 0 and fetcher.stats.requests == 2


def test_close_ends_a_download_stalled_midway(fault_server: FaultServer) -> None:
    data = payload(3)
    url = fault_server.put("stalled", data)
    fault_server.faults.configure(rate=1.0, kinds=("stall",), delay_s=120.0)
    fetcher = Fetcher(fast(timeout_s=120.0))
    outcome: list[BaseException] = []

    def download() -> None:
        try:
            fetcher.fetch(url)
        except BaseException as error:  # handed to the test
            outcome.append(error)

    thread = threading.Thread(target=download, daemon=True)
    thread.start()
    while fault_server.requests.bytes_sent("/stalled") == 0:
        thread.join(0.01)
    fetcher.close()
    thread.join(timeout=20)  # the stall lasts 120 s, the timeout too: only close() ends it
    assert not thread.is_alive()
    assert isinstance(outcome[0], StreamcacheError) and "closed" in str(outcome[0])


def test_the_default_options_bound_a_stalled_object_to_about_a_minute() -> None:
    options = FetchOptions()
    attempts = options.retries + 1
    waits = sum(backoff_delay(retry, options, 0.0) for retry in range(1, attempts))
    assert options.timeout_s <= 15 and attempts * options.timeout_s + waits <= 75


def test_no_temporary_is_left_after_a_refused_body(fault_server: FaultServer,
                                                   tmp_path: Path) -> None:
    url = fault_server.put("short", payload(4, 1000))
    with Fetcher(fast(retries=0)) as fetcher, pytest.raises(FetchError):
        fetcher.fetch_to_file(url, tmp_path / "x", size=10)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(TEMP_SUFFIX)]


# ------------------------------------------------------------------ options from the dataset


def _served_dataset(server: FaultServer) -> str:
    assert server.root is not None
    write_dataset(({"x": np.arange(8, dtype=np.int64) + i} for i in range(64)),
                  os.path.join(server.root, "ds"), shard_size=512)
    return server.url_for("ds")


def test_stream_dataset_downloads_with_the_fetch_options_it_is_given(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    url = _served_dataset(fault_server)
    fault_server.faults.script("/ds/index.json", [None])
    fault_server.faults.configure(rate=1.0, kinds=("stall",), delay_s=120.0)
    options = FetchOptions(timeout_s=0.5, retries=1, backoff_initial_s=0.01)
    dataset = StreamDataset(url, batch_size=4, shuffle=False, cache_dir=str(tmp_path / "c"),
                            prefetch=PrefetchOptions(workers=1), fetch=options)
    try:
        with pytest.raises(FetchError) as caught:
            next(iter(dataset))
    finally:
        dataset.close()
    error = caught.value
    assert error.attempts == 2 and "timeout_s=0.5" in str(error)
    assert error.url.startswith(url) and error.url.endswith(".arrow")


def test_dataset_reader_downloads_with_the_fetch_options_it_is_given(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    url = _served_dataset(fault_server)
    fault_server.faults.script("/ds/index.json", [None])
    fault_server.faults.configure(rate=1.0, kinds=("stall",), delay_s=120.0)
    options = FetchOptions(timeout_s=0.5, retries=2, backoff_initial_s=0.01)
    with DatasetReader(url, local_dir=str(tmp_path / "c"), fetch=options) as reader, \
            pytest.raises(FetchError) as caught:
        reader[0]
    assert caught.value.attempts == 3 and "timeout_s=0.5" in str(caught.value)


# ------------------------------------------------------------------ the index


def test_index_json_is_read_with_timeouts_and_retries(fault_server: FaultServer) -> None:
    url = _served_dataset(fault_server)
    options = FetchOptions(timeout_s=0.5, retries=2, backoff_initial_s=0.01)
    fault_server.faults.configure(delay_s=120.0)
    fault_server.faults.script("/ds/index.json", ["slow", "stall"])
    assert load_index(url, fetch=options).num_samples == 64  # the third request answers
    assert fault_server.requests.count("/ds/index.json") == 3
    fault_server.faults.script("/ds/index.json", ["stall"] * 3)
    with pytest.raises(FetchError) as caught:
        load_index(url, fetch=options)
    error = caught.value
    assert error.url == f"{url}/index.json" and error.attempts == 3
    assert f"cannot fetch {url}/index.json" in str(error) and "timeout_s=0.5" in str(error)
    with pytest.raises(IndexNotFoundError):
        load_index(fault_server.url_for("nothing-here"), fetch=options)


def test_an_oversized_index_is_not_read_to_its_end(fault_server: FaultServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url = _served_dataset(fault_server)
    monkeypatch.setattr(index_module, "MAX_INDEX_BYTES", 1 << 20)
    fault_server.faults.configure(rate=1.0, kinds=("oversize",), oversize_bytes=96 << 20)
    with pytest.raises(IndexFormatError, match="is over"):
        load_index(url, fetch=FetchOptions(retries=0))
    fault_server.close()
    assert fault_server.requests.bytes_sent("/ds/index.json") < 24 << 20


# ------------------------------------------------------------------ Ctrl-C


_LOOP = textwrap.dedent("""
    import sys
    from streamcache import StreamDataset, StreamLoader
    dataset = StreamDataset(sys.argv[1], batch_size=4, cache_dir=sys.argv[2])
    print("loading", flush=True)
    try:
        for batch in StreamLoader(dataset):
            pass
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(0)
    sys.exit(1)
""")


def test_ctrl_c_reaches_the_loop_while_a_download_is_stalled(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    url = _served_dataset(fault_server)
    fault_server.faults.script("/ds/index.json", [None] * 4)
    fault_server.faults.configure(rate=1.0, kinds=("stall",), delay_s=600.0)
    shards = [name for name in os.listdir(os.path.join(str(fault_server.root), "ds"))
              if name.endswith(".arrow")]
    loop = subprocess.Popen([sys.executable, "-c", _LOOP, url, str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not any(fault_server.requests.bytes_sent(f"/ds/{name}") for name in shards):
            assert loop.poll() is None, loop.communicate()
            time.sleep(0.02)  # until a shard's download has begun (and stalled midway)
        loop.send_signal(signal.SIGINT)
        # a stalled download is given up after about a minute with the defaults; Ctrl-C must
        # not wait for that
        out, err = loop.communicate(timeout=30)
    finally:
        if loop.poll() is None:
            loop.kill()
            loop.communicate()
    assert loop.returncode == 0, err
    assert "interrupted" in out
