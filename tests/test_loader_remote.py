"""StreamLoader over a real S3-compatible server on loopback, through the node cache.

Requests are counted at a proxy in front of the server: every shard is downloaded once per
node, however many loaders (ranks) read it and however many epochs run.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import fsspec
import numpy as np
import pytest
from loader_helpers import ids_of

from streamcache import ShardWriter, Source, StreamDataset, StreamLoader
from streamcache.errors import CacheBudgetError
from streamcache.loading import mixture
from streamcache.remote.options import FetchOptions


@pytest.fixture
def remote_dataset(s3_bucket, request) -> str:
    url = s3_bucket.url(f"loader-{request.node.name}")
    with ShardWriter(url, shard_size=1500, storage_options=s3_bucket.storage_options()) as w:
        for i in range(600):
            w.write({"x": i, "t": np.arange(i % 7, dtype=np.int16)})
    return url


def test_two_ranks_two_epochs_one_download_per_shard(remote_dataset, s3_bucket,
                                                     s3_fault_proxy, tmp_path) -> None:
    options = s3_bucket.storage_options(via=s3_fault_proxy.url)
    loaders = [StreamLoader(StreamDataset(remote_dataset, global_batch_size=40, rank=rank,
                                          world_size=2, cache_dir=str(tmp_path / "cache"),
                                          storage_options=options, shuffle_window=200))
               for rank in range(2)]
    s3_fault_proxy.requests.reset()
    for epoch in range(2):
        seen = np.concatenate([ids_of(b) for loader in loaders for b in loader])
        assert np.array_equal(np.sort(seen), np.arange(600)), f"epoch {epoch}"
    counts = {path: n for path, n in s3_fault_proxy.requests.counts().items()
              if path.endswith(".arrow")}
    shards = len(loaders[0].dataset.index.shards)
    assert len(counts) == shards and set(counts.values()) == {1}, counts
    stats = loaders[0].dataset.reader.store.stats
    assert stats.hits > 0
    for loader in loaders:
        loader.close()


def test_transient_faults_do_not_change_the_data(remote_dataset, s3_bucket, s3_fault_proxy,
                                                 tmp_path) -> None:
    s3_fault_proxy.faults.configure(rate=0.3, kinds=["error", "reset", "truncate"], seed=3)
    dataset = StreamDataset(remote_dataset, global_batch_size=50, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"), shuffle_window=200,
                            storage_options=s3_bucket.storage_options(via=s3_fault_proxy.url))
    with StreamLoader(dataset) as loader:
        batches = list(loader)
    assert sum(s3_fault_proxy.faults.injected.values()) > 0
    for batch in batches:
        assert np.array_equal(batch["x"].numpy(), ids_of(batch))
        assert np.array_equal(batch["t_lengths"].numpy(), ids_of(batch) % 7)
    assert sorted(np.concatenate([ids_of(b) for b in batches]).tolist()) == list(range(600))


def test_cache_limit_below_the_working_set_is_refused_with_the_minimum(
        remote_dataset, s3_bucket, tmp_path) -> None:
    with pytest.raises(CacheBudgetError, match=r"give at least [\d,]+ bytes, or lower "
                                                r"shuffle_window"):
        StreamDataset(remote_dataset, global_batch_size=50, rank=0, world_size=1,
                      cache_dir=str(tmp_path / "cache"), cache_limit=1000,
                      storage_options=s3_bucket.storage_options())


def test_cache_limit_at_a_third_of_the_dataset(remote_dataset, s3_bucket, tmp_path) -> None:
    options = s3_bucket.storage_options()
    probe = StreamDataset(remote_dataset, global_batch_size=50, rank=0, world_size=1,
                          cache_dir=str(tmp_path / "cache"), shuffle_window=100,
                          storage_options=options)
    total = sum(s.raw_bytes or 0 for s in probe.index.shards)
    limit = max(probe.working_set_bytes(), total // 3)
    dataset = StreamDataset(remote_dataset, global_batch_size=50, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"), shuffle_window=100,
                            cache_limit=limit, storage_options=options)
    with StreamLoader(dataset) as loader:
        seen = []
        for batch in loader:
            seen.append(ids_of(batch))
            assert dataset.reader.store.cache.usage().bytes <= limit
    assert sorted(np.concatenate(seen).tolist()) == list(range(600))


def _filesystems_made(monkeypatch) -> list[str]:
    """The protocols of the private filesystems Fetchers make from now on (one S3 client
    each)."""
    made: list[str] = []
    original = fsspec.core.url_to_fs

    def counting(url: str, **kwargs: Any) -> Any:
        if kwargs.get("skip_instance_cache"):
            made.append(url.split("://", 1)[0])
        return original(url, **kwargs)

    monkeypatch.setattr(fsspec.core, "url_to_fs", counting)
    return made


def test_the_index_and_the_first_pass_share_one_client(remote_dataset, s3_bucket, tmp_path,
                                                       monkeypatch) -> None:
    """Making an S3 client costs ~0.1 s of a cold start's first batch: the index is read with
    the Fetcher the first pass then downloads (and reads ranges) with."""
    made = _filesystems_made(monkeypatch)
    dataset = StreamDataset(remote_dataset, global_batch_size=50, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"), shuffle_window=200,
                            storage_options=s3_bucket.storage_options())
    with StreamLoader(dataset) as loader:
        ids = np.concatenate([ids_of(batch) for batch in loader])
    assert sorted(ids.tolist()) == list(range(600))
    assert made == ["s3"]
    # a later pass after close() reads too (the first Fetcher was closed with its cache;
    # every shard is installed now, so it needs no client at all)
    dataset.close()
    with StreamLoader(dataset) as loader:
        assert sorted(np.concatenate([ids_of(b) for b in loader]).tolist()) == list(range(600))
    assert made == ["s3"]


def test_a_dataset_closed_or_pickled_before_its_first_pass_still_reads(
        remote_dataset, s3_bucket, tmp_path) -> None:
    """The index's Fetcher is not pickled (a worker process makes its own) and is closed
    with a dataset that never read; either dataset then reads every sample."""
    dataset = StreamDataset(remote_dataset, global_batch_size=50, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"), shuffle_window=200,
                            storage_options=s3_bucket.storage_options())
    copy = pickle.loads(pickle.dumps(dataset))
    dataset.close()
    for each in (dataset, copy):
        with StreamLoader(each) as loader:
            ids = np.concatenate([ids_of(batch) for batch in loader])
        assert sorted(ids.tolist()) == list(range(600))


def test_closing_the_dataset_ends_a_stalled_first_download_at_once(
        remote_dataset, s3_bucket, s3_fault_proxy, tmp_path) -> None:
    """The Fetcher the index was read with belongs to the first pass's cache from then on:
    closing the dataset cancels that cache's stalled requests, and nothing asks again (a
    Fetcher nobody closed would time the stalls out after ``timeout_s`` and retry them)."""
    dataset = StreamDataset(remote_dataset, global_batch_size=50, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"), shuffle_window=200,
                            fetch=FetchOptions(timeout_s=0.5, backoff_initial_s=0.1),
                            storage_options=s3_bucket.storage_options(via=s3_fault_proxy.url))
    _close_while_stalled(dataset, s3_fault_proxy)


def test_closing_a_mixture_ends_its_sources_stalled_downloads_at_once(
        s3_bucket, s3_fault_proxy, tmp_path) -> None:
    """The Fetcher a mixture's sources share is closed with them (their caches do not own
    it): closing the dataset cancels stalled requests as a single dataset's does."""
    urls = _write_sources(s3_bucket, "stalled-mix", 2)
    dataset = StreamDataset([Source(url, weight=1.0) for url in urls], global_batch_size=20,
                            rank=0, world_size=1, cache_dir=str(tmp_path / "cache"),
                            fetch=FetchOptions(timeout_s=0.5, backoff_initial_s=0.1),
                            storage_options=s3_bucket.storage_options(via=s3_fault_proxy.url))
    _close_while_stalled(dataset, s3_fault_proxy)


def _write_sources(s3_bucket: Any, prefix: str, count: int) -> list[str]:
    """``count`` small datasets in the bucket; sample ``i`` of source ``k`` is ``100 k + i``."""
    urls = []
    for k in range(count):
        urls.append(s3_bucket.url(f"{prefix}-{k}"))
        with ShardWriter(urls[-1], storage_options=s3_bucket.storage_options()) as writer:
            for i in range(40):
                writer.write({"x": 100 * k + i})
    return urls


def _close_while_stalled(dataset: StreamDataset, proxy: Any) -> None:
    """Every request stalls; the first batch is awaited in a thread; closing the dataset
    ends it within seconds, with an error, and no request reaches the server afterwards."""
    proxy.faults.configure(rate=1.0, kinds=["stall"], delay_s=60.0)
    outcome: list[BaseException | None] = []

    def first_batch() -> None:
        try:
            next(iter(StreamLoader(dataset)))
            outcome.append(None)
        except BaseException as error:  # (what the loop would see)
            outcome.append(error)

    reader = threading.Thread(target=first_batch, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while not proxy.faults.injected["stall"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.faults.injected["stall"], "no request reached the server"
    started = time.monotonic()
    dataset.close()
    reader.join(10)
    assert not reader.is_alive(), "the first batch still waits on a stalled request"
    assert time.monotonic() - started < 5
    assert outcome and isinstance(outcome[0], Exception), outcome
    asked = proxy.requests.count()
    time.sleep(2.0)  # four stall timeouts: a request still owned by nobody would be retried
    assert proxy.requests.count() == asked
    proxy.faults.clear()


def test_a_mixture_reads_the_indexes_of_one_store_with_one_client(s3_bucket, s3_fault_proxy,
                                                                  tmp_path, monkeypatch) -> None:
    """A Fetcher per source made an S3 client per source, one after another on fsspec's event
    loop, for its index, then its cache, then its range reads (8 sources on one store: 18
    clients, 3.7-4.0 s to the first batch); sources of the same storage options share one
    for their indexes and one for their caches, sources of other options get their own."""
    direct, proxied = s3_bucket.storage_options(), s3_bucket.storage_options(
        via=s3_fault_proxy.url)
    urls = _write_sources(s3_bucket, "mix", 3)
    made = _filesystems_made(monkeypatch)
    # one index at a time: each load sees the options that s3fs rewrote in the one before
    monkeypatch.setattr(mixture, "INDEX_THREADS", 1)
    dataset = StreamDataset([Source(url, weight=1.0) for url in urls], global_batch_size=20,
                            rank=0, world_size=1, cache_dir=str(tmp_path / "cache"),
                            storage_options=s3_bucket.storage_options())  # (fresh options)
    assert made == ["s3"]
    with StreamLoader(dataset) as loader:
        xs = np.concatenate([batch["x"].numpy() for batch in loader])
    assert made == ["s3", "s3"]  # the sources' caches and range reads: one more between them
    assert len(xs) >= 100 and len(set(xs.tolist())) == len(xs)  # (an epoch: no repeats)
    assert set(xs.tolist()) <= {100 * k + i for k in range(3) for i in range(40)}
    made.clear()
    StreamDataset([Source(urls[0], weight=1.0),
                   Source(urls[1], weight=1.0, storage_options=proxied),
                   Source(urls[2], weight=1.0)],
                  global_batch_size=20, rank=0, world_size=1,
                  cache_dir=str(tmp_path / "cache2"), storage_options=direct).close()
    assert made == ["s3", "s3"]
