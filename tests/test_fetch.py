"""The Fetcher against real loopback servers: a faulty HTTP server, moto's S3, a forked child."""

from __future__ import annotations

import errno
import gc
import os
import random
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import botocore.exceptions
import fsspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from servers import FaultServer, S3Bucket

from streamcache.cache.prefetch import PrefetchOptions
from streamcache.errors import ChecksumMismatchError, ConfigError, StreamcacheError
from streamcache.format.checksum import checksum_bytes
from streamcache.remote.download import TEMP_SUFFIX
from streamcache.remote.fetch import Fetcher, FetchRequest
from streamcache.remote.options import FetchOptions
from streamcache.remote.retry import FetchError, backoff_delay, is_transient


def fast(**overrides: Any) -> FetchOptions:
    """Options with short waits, so that retries cost milliseconds."""
    settings: dict[str, Any] = dict(
        max_concurrency=8, timeout_s=10.0, retries=4, backoff_initial_s=0.002, backoff_max_s=0.02
    )
    settings.update(overrides)
    return FetchOptions(**settings)


def payload(seed: int, size: int = 50_000) -> bytes:
    return random.Random(seed).randbytes(size)


# ------------------------------------------------------------------------------ pure parts


def _client_error(status: int, code: str) -> botocore.exceptions.ClientError:
    response: Any = {"Error": {"Code": code, "Message": code},
                     "ResponseMetadata": {"HTTPStatusCode": status}}
    return botocore.exceptions.ClientError(response, "GetObject")


def _wrapped(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


def _response_error(status: int) -> aiohttp.ClientResponseError:
    return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make_error", "transient"),
    [
        (lambda: FileNotFoundError("x"), False),
        (lambda: PermissionError("x"), False),
        (lambda: ValueError("bad argument"), False),
        (lambda: OSError(errno.ENOENT, "gone"), False),
        (lambda: ConnectionResetError(), True),
        (lambda: TimeoutError(), True),
        (lambda: OSError(errno.EIO, "io"), True),
        (lambda: ChecksumMismatchError("x"), True),
        (lambda: aiohttp.ClientPayloadError("short"), True),
        (lambda: aiohttp.ServerDisconnectedError(), True),
        (lambda: _response_error(503), True),
        (lambda: _response_error(500), True),
        (lambda: _response_error(429), True),
        (lambda: _response_error(408), True),
        (lambda: _response_error(501), False),
        (lambda: _response_error(403), False),
        (lambda: _response_error(400), False),
        # s3fs translates botocore's ClientError into an OSError raised from it
        (lambda: _wrapped(OSError(errno.EBUSY, "busy"), _client_error(503, "SlowDown")), True),
        (lambda: _wrapped(OSError(errno.EIO, "x"), _client_error(400, "InvalidRequest")), False),
        (lambda: _wrapped(PermissionError("denied"), _client_error(403, "AccessDenied")), False),
        (lambda: _wrapped(RuntimeError("wrapper"), ConnectionResetError()), True),
    ],
)
def test_errors_are_classified_from_types_and_http_status(
    make_error: Callable[[], BaseException], transient: bool
) -> None:
    assert is_transient(make_error()) is transient


@given(
    retry=st.integers(1, 40),
    initial=st.floats(0, 10),
    maximum=st.floats(0, 100),
    jitter=st.floats(0, 1),
    draw=st.floats(0, 1, exclude_max=True),
)
def test_backoff_grows_exponentially_up_to_the_cap_with_bounded_jitter(
    retry: int, initial: float, maximum: float, jitter: float, draw: float
) -> None:
    options = FetchOptions(backoff_initial_s=initial, backoff_max_s=maximum, jitter=jitter)
    ceiling = min(maximum, initial * 2.0 ** (retry - 1))
    delay = backoff_delay(retry, options, draw)
    assert ceiling * (1 - jitter) - 1e-9 <= delay <= ceiling + 1e-9


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        FetchOptions(max_concurrency=0)
    with pytest.raises(ValueError, match="jitter"):
        FetchOptions(jitter=1.5)


# ------------------------------------------------------------------------------ local, memory


def test_fetches_local_and_memory_objects_whole(tmp_path: Path) -> None:
    data = payload(1, 300_001)
    (tmp_path / "obj").write_bytes(data)
    fsspec.filesystem("memory").pipe("/fetch-test/obj", data)
    with Fetcher(fast(block_size=65_536)) as fetcher:
        for url in (str(tmp_path / "obj"), f"file://{tmp_path}/obj", "memory://fetch-test/obj"):
            assert fetcher.fetch(url, size=len(data), checksum=checksum_bytes(data)) == data
        assert fetcher.stats.objects == 3
        assert fetcher.stats.bytes == 3 * len(data)


def test_fetch_to_file_installs_atomically_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    data = payload(2)
    fsspec.filesystem("memory").pipe("/fetch-test/file", data)
    target = tmp_path / "cache" / "shard"
    target.parent.mkdir()
    with Fetcher(fast()) as fetcher:
        written = fetcher.fetch_to_file(
            "memory://fetch-test/file", target, size=len(data), checksum=checksum_bytes(data)
        )
        assert written == len(data)
        assert target.read_bytes() == data
        with pytest.raises(ChecksumMismatchError, match="memory://fetch-test/file"):
            fetcher.fetch_to_file("memory://fetch-test/file", tmp_path / "cache" / "bad",
                                  checksum="xxh64:0123456789abcdef")
    assert sorted(p.name for p in target.parent.iterdir()) == ["shard"]
    assert not any(p.name.endswith(TEMP_SUFFIX) for p in target.parent.iterdir())


def test_a_local_write_error_is_raised_as_it_is_and_not_retried(tmp_path: Path) -> None:
    fsspec.filesystem("memory").pipe("/fetch-test/local", b"data")
    with Fetcher(fast()) as fetcher:
        with pytest.raises(FileNotFoundError, match="no-such-dir"):
            fetcher.fetch_to_file("memory://fetch-test/local", tmp_path / "no-such-dir" / "x")
        assert (fetcher.stats.retries, fetcher.stats.failures) == (0, 1)


# ------------------------------------------------------------------------------ HTTP faults


def test_all_fetches_complete_correctly_when_a_fifth_of_requests_fail(
    fault_server: FaultServer,
) -> None:
    objects = {f"shard-{i:03d}": payload(i, 20_000 + i) for i in range(60)}
    requests = [
        FetchRequest(fault_server.put(name, data), len(data), checksum_bytes(data))
        for name, data in objects.items()
    ]
    fault_server.faults.configure(rate=0.2, kinds=("error", "reset", "truncate", "corrupt"))
    with Fetcher(fast(retries=8)) as fetcher:
        results = fetcher.fetch_many(requests)
        stats = fetcher.stats
    assert [r.data for r in results] == list(objects.values())
    injected = sum(fault_server.faults.injected.values())
    assert injected >= 5  # the faults really happened...
    assert stats.retries == injected  # ...and each one cost exactly one retry
    assert stats.requests == fault_server.requests.count() == len(objects) + injected


@pytest.mark.parametrize("fault", ["error", "reset", "truncate", "corrupt", "slow", "stall"])
def test_each_kind_of_transient_fault_is_retried(fault_server: FaultServer, fault: str) -> None:
    data = payload(3)
    url = fault_server.put("obj", data)
    delaying = fault in ("slow", "stall")
    fault_server.faults.configure(delay_s=5.0)  # slow and stall exceed timeout_s below
    fault_server.faults.script("/obj", [fault, fault])
    with Fetcher(fast(timeout_s=1.0 if delaying else 10.0)) as fetcher:
        # size is not given: the short body of "truncate"/"reset" is caught on the wire
        assert fetcher.fetch(url, checksum=checksum_bytes(data)) == data
        assert fetcher.stats.retries == 2
    assert fault_server.requests.count("/obj") == 3


def test_a_body_that_is_always_corrupt_raises_checksum_mismatch(
    fault_server: FaultServer,
) -> None:
    data = payload(4)
    url = fault_server.put("obj", data)
    fault_server.faults.configure(rate=1.0, kinds=("corrupt",))
    with Fetcher(fast(retries=2)) as fetcher, pytest.raises(ChecksumMismatchError) as caught:
        fetcher.fetch(url, checksum=checksum_bytes(data))
    assert url in str(caught.value) and "3 attempts" in str(caught.value)
    assert fault_server.requests.count("/obj") == 3


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_local_object_that_fails_its_checksum_is_not_read_again(
        tmp_path: Path, where: str) -> None:
    """Read again, a local (or in-memory) object gives the same bytes: one attempt, then the
    error at once, without the retries' backoff (a damaged local shard made a cold start wait
    ~26 s for its error)."""
    data = payload(6)
    if where == "file":
        url = str(tmp_path / "obj")
        Path(url).write_bytes(data)
    else:
        url = f"memory://fetch-local-{os.getpid()}/obj"
        fsspec.filesystem("memory").pipe(url, data)
    wrong = checksum_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    slow = fast(retries=3, backoff_initial_s=5.0, backoff_max_s=5.0)
    started = time.monotonic()
    with Fetcher(slow) as fetcher, pytest.raises(ChecksumMismatchError) as caught:
        fetcher.fetch(url, checksum=wrong)
    assert time.monotonic() - started < 4  # (a retry would have waited 5 s first)
    assert "[1 attempt]" in str(caught.value) and "does not match" in str(caught.value)
    with Fetcher(slow) as fetcher, pytest.raises(ChecksumMismatchError):
        fetcher.fetch_to_file(url, tmp_path / "copy", checksum=wrong)
    assert not (tmp_path / "copy").exists()
    assert time.monotonic() - started < 8


def test_a_short_body_is_caught_by_the_size_and_names_the_cause(
    fault_server: FaultServer,
) -> None:
    data = payload(5)
    url = fault_server.put("obj", data)
    with Fetcher(fast(retries=1)) as fetcher, pytest.raises(FetchError) as caught:
        fetcher.fetch(url, size=len(data) + 10)  # the index says more than the server has
    error = caught.value
    assert (error.url, error.attempts, error.permanent) == (url, 2, False)
    assert f"received {len(data)} bytes" in str(error)


def test_a_missing_object_fails_at_once_with_a_clear_error(fault_server: FaultServer) -> None:
    url = fault_server.url_for("no/such/shard")
    with Fetcher(fast(backoff_initial_s=5.0)) as fetcher, pytest.raises(FetchError) as caught:
        fetcher.fetch(url, size=10)
    error = caught.value
    assert (error.url, error.attempts, error.permanent) == (url, 1, True)
    assert isinstance(error.cause, FileNotFoundError)
    assert url in str(error) and "not retried" in str(error) and "FileNotFoundError" in str(error)
    assert fault_server.requests.count("/no/such/shard") == 1


def test_access_denied_is_not_retried(fault_server: FaultServer) -> None:
    url = fault_server.put("obj", b"secret")
    fault_server.faults.configure(status=403)
    fault_server.faults.script("/obj", ["error"])
    with Fetcher(fast()) as fetcher, pytest.raises(FetchError, match="403") as caught:
        fetcher.fetch(url)
    assert caught.value.attempts == 1 and caught.value.permanent
    assert fault_server.requests.count("/obj") == 1


def test_a_server_slower_than_the_timeout_is_retried_then_fails_clearly(
    fault_server: FaultServer,
) -> None:
    url = fault_server.put("obj", payload(6))
    fault_server.faults.configure(rate=1.0, kinds=("slow",), delay_s=5.0)
    with Fetcher(fast(timeout_s=0.2, retries=2)) as fetcher, pytest.raises(FetchError) as caught:
        fetcher.fetch(url)
    # each attempt ended at its timeout: a slow body delivered in full would have succeeded
    assert caught.value.attempts == 3 and not caught.value.permanent
    assert "timeout_s=0.2" in str(caught.value)
    assert fault_server.requests.count("/obj") == 3


def test_a_body_that_stalls_midway_times_out(fault_server: FaultServer) -> None:
    data = payload(7)
    url = fault_server.put("obj", data)
    fault_server.faults.configure(rate=1.0, kinds=("stall",), delay_s=5.0)
    with Fetcher(fast(timeout_s=1.0, retries=0)) as fetcher, pytest.raises(FetchError) as caught:
        fetcher.fetch(url)
    assert f"after {len(data) // 2} bytes" in str(caught.value)


def test_concurrency_is_bounded_across_fetch_many_and_threads(fault_server: FaultServer) -> None:
    urls = [fault_server.put(f"o{i}", payload(i, 1000)) for i in range(12)]
    fault_server.faults.configure(rate=1.0, kinds=("slow",), delay_s=0.25)
    with Fetcher(fast(max_concurrency=3)) as fetcher:
        fetcher.fetch_many(FetchRequest(url) for url in urls)
        assert fault_server.requests.max_in_flight == 3
        fault_server.requests.reset()
        threads = [threading.Thread(target=fetcher.fetch, args=(url,)) for url in urls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert fault_server.requests.max_in_flight == 3
    assert fault_server.requests.count() == 12


def test_many_threads_share_one_fetcher_under_faults(fault_server: FaultServer) -> None:
    objects = {f"t{i}": payload(100 + i, 5000) for i in range(32)}
    urls = {name: fault_server.put(name, data) for name, data in objects.items()}
    fault_server.faults.configure(rate=0.2, kinds=("error", "reset", "corrupt"))
    results: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def work(names: list[str]) -> None:
        try:
            for name in names:
                results[name] = fetcher.fetch(urls[name], checksum=checksum_bytes(objects[name]))
        except BaseException as error:  # reported below
            errors.append(error)

    names = sorted(objects)
    with Fetcher(fast(retries=8)) as fetcher:
        threads = [threading.Thread(target=work, args=(names[i::8],)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert not errors
    assert results == objects


def test_fetch_many_raises_the_failure_and_writes_files(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    data = payload(8)
    good = fault_server.put("good", data)
    with Fetcher(fast()) as fetcher:
        [result] = fetcher.fetch_many([FetchRequest(good, path=str(tmp_path / "good"))])
        assert (result.nbytes, result.data) == (len(data), None)
        assert (tmp_path / "good").read_bytes() == data
        missing = fault_server.url_for("missing")
        with pytest.raises(FetchError) as caught:
            fetcher.fetch_many([FetchRequest(good), FetchRequest(missing), FetchRequest(good)])
        assert caught.value.url == missing


def test_close_stops_threads_and_interrupts_a_backoff(fault_server: FaultServer) -> None:
    url = fault_server.put("obj", b"data")
    fault_server.faults.configure(rate=1.0, kinds=("error",))
    fetcher = Fetcher(fast(backoff_initial_s=30.0, backoff_max_s=30.0, jitter=0.0))
    fetcher.fetch_many([])  # starts the pool
    outcome: list[BaseException] = []
    waiting = threading.Thread(target=lambda: _capture(outcome, fetcher.fetch, url))
    waiting.start()
    while fault_server.requests.count("/obj") == 0:
        time.sleep(0.01)
    fetcher.close()
    waiting.join(timeout=10)  # the backoff is 30 s: only close() ends it this soon
    assert not waiting.is_alive()
    assert isinstance(outcome[0], StreamcacheError) and "closed" in str(outcome[0])
    assert not [t for t in threading.enumerate() if t.name.startswith("streamcache-fetch")]
    with pytest.raises(StreamcacheError, match="closed"):
        fetcher.fetch(url)


def _capture(sink: list[BaseException], function: Callable[..., Any], *args: Any) -> None:
    try:
        function(*args)
    except BaseException as error:  # handed to the test
        sink.append(error)


# ------------------------------------------------------------------------------ S3 (moto)


def test_fetches_from_s3(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    data = payload(9, 200_000)
    url = s3_bucket.put("fetch/plain/obj", data)
    with Fetcher(fast(storage_options=s3_bucket.storage_options())) as fetcher:
        assert fetcher.fetch(url, size=len(data), checksum=checksum_bytes(data)) == data
        fetcher.fetch_to_file(url, tmp_path / "obj", checksum=checksum_bytes(data))
        assert (tmp_path / "obj").read_bytes() == data
        with pytest.raises(FetchError) as caught:
            fetcher.fetch(s3_bucket.url("fetch/plain/missing"))
    assert caught.value.permanent and caught.value.attempts == 1
    assert isinstance(caught.value.cause, FileNotFoundError)


def test_users_storage_options_are_left_as_written(s3_bucket: S3Bucket) -> None:
    """botocore rewrites a ``retries`` dict in place (``max_attempts`` -> ``total_max_attempts``):
    the options a user passes are copied, nested dicts too, wherever a filesystem is made
    (the Fetcher, the index's and writer's helper, a checkpoint location), so the user's dict
    reads the same afterwards and works again."""
    import copy

    from streamcache.checkpoint.tiers import Location
    from streamcache.remote import storage

    data = payload(11, 1_000)
    url = s3_bucket.put("fetch/options/obj", data)
    options = s3_bucket.storage_options()
    options["config_kwargs"]["retries"] = {"max_attempts": 2, "mode": "standard"}
    written = copy.deepcopy(options)
    for _ in range(2):
        with Fetcher(fast(storage_options=options)) as fetcher:
            assert fetcher.fetch(url, size=len(data)) == data
        fs, path = storage.filesystem(url, options)
        assert fs.cat_file(path) == data
        assert Location(s3_bucket.url("fetch/options"), options).fs.exists(path)
        assert options == written
    assert storage.plain_copy(None) == {}
    nested = {"a": [{"b": 1}], "c": {"d": [2]}}
    copied = storage.plain_copy(nested)
    copied["a"][0]["b"] = copied["c"]["d"][0] = 0
    assert nested == {"a": [{"b": 1}], "c": {"d": [2]}}
    session = object()  # (a value that is not a dict or list is shared, not copied)
    assert storage.plain_copy({"session": session})["session"] is session


def test_fetches_from_s3_through_a_faulty_proxy(
    s3_bucket: S3Bucket, s3_fault_proxy: FaultServer
) -> None:
    objects = {f"fetch/faulty/{i}": payload(200 + i, 10_000) for i in range(30)}
    requests = [
        FetchRequest(s3_bucket.put(key, data), len(data), checksum_bytes(data))
        for key, data in objects.items()
    ]
    s3_fault_proxy.faults.configure(rate=0.2, kinds=("error", "reset", "truncate", "corrupt"))
    options = fast(retries=8, storage_options=s3_bucket.storage_options(via=s3_fault_proxy.url))
    with Fetcher(options) as fetcher:
        results = fetcher.fetch_many(requests)
        assert fetcher.stats.retries >= 1
    assert [r.data for r in results] == list(objects.values())
    assert sum(s3_fault_proxy.faults.injected.values()) >= 3
    assert set(s3_fault_proxy.requests.counts()) == {f"/{s3_bucket.name}/{k}" for k in objects}


@pytest.mark.parametrize(("status", "attempts"), [(503, 3), (500, 3), (403, 1), (404, 1)])
def test_s3_errors_through_the_proxy_are_classified_by_status(
    s3_bucket: S3Bucket, s3_fault_proxy: FaultServer, status: int, attempts: int
) -> None:
    url = s3_bucket.put(f"fetch/status/{status}", b"data")
    s3_fault_proxy.faults.configure(rate=1.0, kinds=("error",), status=status)
    options = fast(retries=2, storage_options=s3_bucket.storage_options(via=s3_fault_proxy.url))
    with Fetcher(options) as fetcher, pytest.raises(FetchError) as caught:
        fetcher.fetch(url)
    assert (caught.value.attempts, caught.value.permanent) == (attempts, attempts == 1)
    assert s3_fault_proxy.requests.count(f"/{s3_bucket.name}/fetch/status/{status}") == attempts


# ------------------------------------------------------------------------------ fork


def _fetch_in_child(check: Callable[[], bool], timeout_s: float = 30.0) -> int:
    """Run ``check`` in a forked child; its exit status (0: True, 1: False, 2: raised)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "fork() of a threaded process"
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 2
        try:
            status = 0 if check() else 1
        finally:
            os._exit(status)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(wait_status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


def test_a_fetcher_used_before_fork_works_in_the_child(
    s3_bucket: S3Bucket, fault_server: FaultServer
) -> None:
    s3_data, http_data = payload(10), payload(11)
    s3_url = s3_bucket.put("fetch/fork/obj", s3_data)
    http_url = fault_server.put("fork-obj", http_data)
    with Fetcher(fast(storage_options=s3_bucket.storage_options())) as s3_fetcher, \
            Fetcher(fast()) as http_fetcher:
        # the parent's filesystems, sessions and event loop exist before the fork
        assert s3_fetcher.fetch(s3_url) == s3_data
        assert http_fetcher.fetch(http_url) == http_data

        def child() -> bool:
            gc.collect()  # as a long-lived child (a DataLoader worker) eventually does
            results = s3_fetcher.fetch_many([FetchRequest(s3_url)] * 3)
            return all(r.data == s3_data for r in results) and (
                http_fetcher.fetch(http_url, checksum=checksum_bytes(http_data)) == http_data
            )

        assert _fetch_in_child(child) == 0
        # The parent's Fetchers still work after the child is gone, first time: had the child
        # closed the parent's connections, a request would time out here and be retried.
        assert s3_fetcher.fetch(s3_url) == s3_data
        assert http_fetcher.fetch(http_url) == http_data
        assert s3_fetcher.stats.retries == http_fetcher.stats.retries == 0
    assert fault_server.requests.count("/fork-obj") == 3


def test_garbage_holding_a_parents_session_is_collected_before_fork(
    fault_server: FaultServer,
) -> None:
    # Collected in the child instead, such garbage would close the parent's session there
    # (fsspec's finalizer then waits about a second for a loop that does not run there).
    url = fault_server.put("gc-obj", b"data")
    gc.disable()  # keep the garbage below uncollected until the fork
    try:
        with Fetcher(fast(retries=0)) as fetcher:
            fetcher.fetch(url)
            with pytest.raises(FetchError) as caught:
                fetcher.fetch(fault_server.url_for("missing"))
        # The error's traceback holds the closed Fetcher's filesystem; a cycle keeps it alive.
        error = caught.value
        error.cycle = error  # type: ignore[attr-defined]
        garbage = weakref.ref(error)
        del error, caught, fetcher
        assert garbage() is not None
        assert _fetch_in_child(lambda: garbage() is None) == 0
        assert garbage() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("make", [
    lambda: FetchOptions(timeout_s="10"),  # type: ignore[arg-type]
    lambda: FetchOptions(retries=True),
    lambda: FetchOptions(max_concurrency=2.5),  # type: ignore[arg-type]
    lambda: FetchOptions(allow_unverified_ranges=1),  # type: ignore[arg-type]
    lambda: FetchOptions(storage_options=["key"]),  # type: ignore[arg-type]
    lambda: PrefetchOptions(workers="4"),  # type: ignore[arg-type]
    lambda: PrefetchOptions(poll_s=None),  # type: ignore[arg-type]
], ids=["timeout-str", "retries-bool", "concurrency-float", "unverified-int", "storage-list",
        "workers-str", "poll-none"])
def test_options_of_the_wrong_type_are_config_errors_naming_the_field(make: Any) -> None:
    with pytest.raises(ConfigError, match=r"invalid (Fetch|Prefetch)Options: \w+ must be"):
        make()
