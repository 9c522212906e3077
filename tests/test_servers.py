"""The test servers do what other tests rely on: serve, count, proxy, and break on request."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path

import pytest
import s3fs
from servers import FAULT_KINDS, FaultInjector, FaultServer, S3Bucket


def get(server: FaultServer, path: str, method: str = "GET",
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.fixture
def served(fault_server: FaultServer) -> bytes:
    data = bytes(range(256)) * 40
    assert fault_server.root is not None
    (Path(fault_server.root) / "dir").mkdir()
    (Path(fault_server.root) / "dir" / "obj").write_bytes(data)
    return data


def test_serves_files_ranges_and_heads_and_counts_them(
    fault_server: FaultServer, served: bytes
) -> None:
    assert get(fault_server, "/dir/obj")[::2] == (200, served)
    status, headers, body = get(fault_server, "/dir/obj", "HEAD")
    assert (status, headers["Content-Length"], body) == (200, str(len(served)), b"")
    status, headers, body = get(fault_server, "/dir/obj", headers={"Range": "bytes=10-19"})
    assert (status, body, headers["Content-Range"]) == (206, served[10:20], "bytes 10-19/10240")
    assert get(fault_server, "/dir/obj", headers={"Range": "bytes=-5"})[2] == served[-5:]
    assert get(fault_server, "/dir/missing")[0] == 404
    assert get(fault_server, "/../../etc/passwd")[0] == 404
    assert fault_server.requests.count("/dir/obj") == 3
    assert fault_server.requests.count("/dir/obj", method="HEAD") == 1
    assert fault_server.requests.counts() == {
        "/dir/obj": 3, "/dir/missing": 1, "/../../etc/passwd": 1
    }


def test_error_and_corrupt_faults(fault_server: FaultServer, served: bytes) -> None:
    fault_server.faults.script("/dir/obj", ["error", "corrupt", None])
    assert get(fault_server, "/dir/obj")[0] == 503
    status, _, body = get(fault_server, "/dir/obj")
    assert status == 200 and len(body) == len(served)
    assert sum(a != b for a, b in zip(body, served, strict=True)) == 1
    assert get(fault_server, "/dir/obj")[2] == served
    assert fault_server.faults.injected == {"error": 1, "corrupt": 1}


@pytest.mark.parametrize("fault", ["truncate", "reset"])
def test_faults_that_cut_the_body_short(
    fault_server: FaultServer, served: bytes, fault: str
) -> None:
    fault_server.faults.script("/dir/obj", [fault])
    with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
        get(fault_server, "/dir/obj")
    assert get(fault_server, "/dir/obj")[2] == served  # the next request is answered well


@pytest.mark.parametrize("fault", ["slow", "stall"])
def test_faults_that_delay(fault_server: FaultServer, served: bytes, fault: str) -> None:
    fault_server.faults.configure(delay_s=0.3)
    fault_server.faults.script("/dir/obj", [fault])
    started = time.monotonic()
    assert get(fault_server, "/dir/obj")[2] == served
    assert time.monotonic() - started >= 0.3


def test_random_faults_follow_the_seed_and_the_methods() -> None:
    def draws(seed: int) -> list[str | None]:
        injector = FaultInjector(rate=0.5, kinds=FAULT_KINDS, seed=seed)
        return [injector.choose("GET", "/p") for _ in range(50)]

    assert draws(7) == draws(7) != draws(8)
    assert 10 < sum(kind is not None for kind in draws(7)) < 40
    injector = FaultInjector(rate=1.0)
    assert injector.choose("HEAD", "/p") is None and injector.choose("GET", "/p") == "error"
    with pytest.raises(ValueError, match="unknown fault"):
        injector.script("/p", ["explode"])


def test_counts_requests_in_flight(fault_server: FaultServer, served: bytes) -> None:
    fault_server.faults.configure(rate=1.0, kinds=("slow",), delay_s=0.3)
    threads = [threading.Thread(target=get, args=(fault_server, "/dir/obj")) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert fault_server.requests.max_in_flight == 4
    # the client has its answer before the handler thread counts itself out: wait for that
    deadline = time.monotonic() + 10
    while fault_server.requests.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fault_server.requests.in_flight == 0


def test_proxies_s3_requests_to_moto_and_injects_faults(
    s3_bucket: S3Bucket, s3_fault_proxy: FaultServer
) -> None:
    fs = s3fs.S3FileSystem(
        skip_instance_cache=True, **s3_bucket.storage_options(via=s3_fault_proxy.url)
    )
    url = s3_bucket.url("servers/proxied")
    fs.pipe_file(url, b"through the proxy")  # PUT is never faulted by default
    assert s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="servers/proxied")[
        "Body"
    ].read() == b"through the proxy"
    assert fs.cat_file(url) == b"through the proxy"
    path = f"/{s3_bucket.name}/servers/proxied"
    assert s3_fault_proxy.requests.count(path, method="PUT") == 1
    assert s3_fault_proxy.requests.count(path) == 1
    s3_fault_proxy.faults.script(path, ["error"])
    with pytest.raises(OSError, match="Service Unavailable"):
        fs.cat_file(url)
    assert s3_fault_proxy.requests.count(path) == 2
