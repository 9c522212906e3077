"""Real servers on 127.0.0.1 for the tests: an S3-compatible server and a faulty HTTP server.

- :class:`MotoServer` runs moto's standalone S3-compatible server as a subprocess on a free
  port; :class:`S3Bucket` is a bucket in it, with the fsspec ``storage_options`` that reach it.
- :class:`FaultServer` is an HTTP/1.1 server that either serves the files of a directory
  (GET and HEAD, single ranges, and S3's ListObjectsV2, so that s3fs, boto3 and the peers'
  S3 clients read ``s3://<first folder>/<rest>`` from it with the server as endpoint) or
  forwards every request to an upstream server (a reverse proxy, e.g. in front of moto, so
  that s3fs -> proxy -> moto runs under faults). It counts requests per method and path,
  tracks how many are in flight at once, and injects faults chosen by a
  :class:`FaultInjector`: at random at a given rate, or by a per-path script. A
  :class:`StoreModel` makes it behave like a remote object store: a first-byte latency per
  request and a bandwidth per connection. ``python tests/servers.py --root DIR`` runs one in
  a process of its own (benchmarks: it must not share the client's interpreter lock).

Only the standard library (plus boto3 to create buckets). Credentials are dummies set by
:func:`aws_test_environment`; nothing here ever leaves the loopback interface.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import email.utils
import functools
import http.client
import http.server
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from xml.sax.saxutils import escape as xml_escape

HOST = "127.0.0.1"
#: ``GET`` it for the request and byte totals of a server (JSON); ``POST`` to read and zero.
STATS_PATH = "/__stats__"

#: What a :class:`FaultServer` can do to a request instead of answering it well.
#: error: answer ``status`` (503 by default) with a short body;
#: slow: wait ``delay_s`` before answering;
#: stall: send the headers and half the body, wait ``delay_s``, then send the rest;
#: reset: send the headers and half the body, then abort the connection (TCP RST);
#: truncate: announce the full Content-Length, send half the body, close the connection;
#: corrupt: send the whole body with one byte flipped;
#: oversize: announce and send the body followed by ``oversize_bytes`` more bytes (an object
#: larger than its index says, e.g. rewritten), stopping early if the client goes away;
#: ignore_range: answer a ``Range`` request with 200 and the whole object (as some servers do);
#: shifted_range: answer a ``Range`` request with 206, the right length and Content-Range, but
#: the bytes one position further on (a server or proxy that gets ranges wrong).
FAULT_KINDS = ("error", "slow", "stall", "reset", "truncate", "corrupt", "oversize",
               "ignore_range", "shifted_range")


@dataclasses.dataclass(frozen=True)
class StoreModel:
    """How a :class:`FaultServer` imitates a remote object store (the default: plain loopback).

    Attributes:
        latency_s: the time to the first byte of every answer (S3: ~10-50 ms).
        bandwidth: bytes per second of one answer (one connection); None: unlimited.
    """

    latency_s: float = 0.0
    bandwidth: float | None = None

    def __str__(self) -> str:
        if self.latency_s == 0 and self.bandwidth is None:
            return "loopback"
        rate = "unlimited" if self.bandwidth is None else f"{self.bandwidth / 1e6:g} MB/s"
        return f"{self.latency_s * 1e3:g} ms, {rate} per connection"


_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "expect", "content-length"}
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------------ fault choice


class FaultInjector:
    """Decides, request by request, which fault (if any) a :class:`FaultServer` injects.

    A path's script (see :meth:`script`) is used first, one entry per request, ``None``
    meaning "answer well"; once it is used up, a fault is drawn with probability ``rate``
    from ``kinds`` (seeded, so a run is repeatable). Only requests whose method is in
    ``methods`` are touched (GET by default, so uploads and HEADs pass cleanly).

    Thread safety: all methods may be called from any thread.
    """

    def __init__(
        self,
        *,
        rate: float = 0.0,
        kinds: Iterable[str] = ("error",),
        status: int = 503,
        delay_s: float = 1.0,
        methods: Iterable[str] = ("GET",),
        seed: int = 1,
        oversize_bytes: int = 32 << 20,
    ) -> None:
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._scripts: dict[str, collections.deque[str | None]] = {}
        self.rate = rate
        self.kinds = tuple(kinds)
        self.status = status
        self.delay_s = delay_s
        self.methods = frozenset(methods)
        self.oversize_bytes = oversize_bytes
        self.injected: collections.Counter[str] = collections.Counter()
        self._validate()

    def configure(self, **settings: Any) -> None:
        """Change ``rate``, ``kinds``, ``status``, ``delay_s``, ``methods``, ``seed`` or
        ``oversize_bytes`` at once."""
        with self._lock:
            for name, value in settings.items():
                if name == "seed":
                    self._random.seed(value)
                elif name in ("rate", "kinds", "status", "delay_s", "methods", "oversize_bytes"):
                    setattr(self, name, frozenset(value) if name == "methods" else value)
                else:
                    raise TypeError(f"unknown fault setting {name!r}")
            self.kinds = tuple(self.kinds)
            self._validate()

    def script(self, path: str, faults: Iterable[str | None]) -> None:
        """Queue ``faults`` for the next requests to ``path`` (``None``: answer well)."""
        steps = list(faults)
        for kind in steps:
            _check_kind(kind)
        with self._lock:
            self._scripts.setdefault(path, collections.deque()).extend(steps)

    def clear(self) -> None:
        """No scripts, no random faults, counters of injected faults at zero."""
        with self._lock:
            self._scripts.clear()
            self.rate = 0.0
            self.injected.clear()

    def choose(self, method: str, path: str) -> str | None:
        """The fault for this request, or None."""
        with self._lock:
            if method not in self.methods:
                return None
            script = self._scripts.get(path)
            if script:
                kind = script.popleft()
            elif self.rate > 0 and self._random.random() < self.rate:
                kind = self._random.choice(self.kinds)
            else:
                kind = None
            if kind is not None:
                self.injected[kind] += 1
            return kind

    def _validate(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], not {self.rate}")
        for kind in self.kinds:
            _check_kind(kind)


def _check_kind(kind: str | None) -> None:
    if kind is not None and kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r}; choose from {FAULT_KINDS}")


class RequestLog:
    """Requests seen by a server: counts per (method, path) and concurrency.

    Thread safety: all methods may be called from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._sent: collections.Counter[str] = collections.Counter()
        self._whole: collections.Counter[tuple[str, str]] = collections.Counter()
        self.in_flight = 0
        self.max_in_flight = 0

    def begin(self, method: str, path: str, *, ranged: bool = False) -> None:
        with self._lock:
            self._counts[(method, path)] += 1
            if not ranged:
                self._whole[(method, path)] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def sent(self, nbytes: int, path: str) -> None:
        with self._lock:
            self._sent[path] += nbytes

    def bytes_sent(self, path: str) -> int:
        """Body bytes written to clients for ``path`` (every request, faults included)."""
        with self._lock:
            return self._sent[path]

    def sent_by_path(self) -> dict[str, int]:
        """Body bytes written to clients, per path."""
        with self._lock:
            return dict(self._sent)

    def count(self, path: str | None = None, method: str = "GET") -> int:
        """Requests with ``method`` to ``path`` (to any path when None)."""
        with self._lock:
            return sum(n for (m, p), n in self._counts.items()
                       if m == method and (path is None or p == path))

    def whole_counts(self, method: str = "GET") -> dict[str, int]:
        """Requests with ``method`` and no ``Range`` header (whole objects), per path."""
        with self._lock:
            return {p: n for (m, p), n in self._whole.items() if m == method}

    def counts(self, method: str = "GET") -> dict[str, int]:
        """Requests with ``method``, per path."""
        with self._lock:
            return {p: n for (m, p), n in self._counts.items() if m == method}

    def totals(self, *, reset: bool = False) -> bytes:
        """``{"requests": n, "bytes": b}`` of every method and path, as JSON (then zeroed,
        with ``reset``)."""
        with self._lock:
            totals = {"requests": sum(self._counts.values()), "bytes": sum(self._sent.values())}
        if reset:
            self.reset()
        return json.dumps(totals).encode()

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._sent.clear()
            self._whole.clear()
            self.max_in_flight = self.in_flight


# ------------------------------------------------------------------------------ HTTP server


@dataclasses.dataclass
class _Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    length: int | None = None  # the Content-Length of a HEAD reply (it has no body)


class FaultServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 that serves ``root`` or proxies ``upstream``.

    Args:
        root: a directory whose files are served at ``/<relative path>``.
        upstream: a base URL (``http://host:port``) to forward every request to.
        faults: the fault policy (a quiet :class:`FaultInjector` by default).
        store: latency and bandwidth of a remote store (default: plain loopback).

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        faults: the :class:`FaultInjector`; change it at any time.
        requests: the :class:`RequestLog`.

    Use it as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        *,
        root: str | os.PathLike[str] | None = None,
        upstream: str | None = None,
        faults: FaultInjector | None = None,
        store: StoreModel | None = None,
    ) -> None:
        if (root is None) == (upstream is None):
            raise ValueError("give exactly one of root= (serve files) or upstream= (proxy)")
        self.root = None if root is None else os.path.realpath(os.fspath(root))
        self.upstream = None if upstream is None else urllib.parse.urlsplit(upstream)
        self.faults = faults or FaultInjector()
        self.store = store or StoreModel()
        self.requests = RequestLog()
        self.stopping = threading.Event()
        self._httpd = _ThreadingServer((HOST, 0), _Handler, owner=self)
        self.port = int(self._httpd.server_address[1])
        self.url = f"http://{HOST}:{self.port}"
        self._thread: threading.Thread | None = None

    def url_for(self, path: str) -> str:
        """The URL of ``path`` (relative to ``root``, or the upstream's path)."""
        return f"{self.url}/{urllib.parse.quote(path.lstrip('/'))}"

    def put(self, path: str, data: bytes) -> str:
        """Write ``data`` to ``root/path`` (directories made as needed); returns its URL."""
        if self.root is None:
            raise ValueError("put() needs a server made with root=; this one is a proxy")
        full = os.path.join(self.root, path.lstrip("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
        return self.url_for(path)

    def start(self) -> FaultServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"fault-server-{self.port}", daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self.stopping.set()  # wakes handlers sleeping in a slow or stall fault
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def respond(self, method: str, target: str, headers: Mapping[str, str], body: bytes,
                fault: str | None = None) -> _Reply:
        """The answer to a request: well-formed, or bent by a range fault."""
        if fault == "ignore_range":
            headers = {k: v for k, v in headers.items() if k.lower() != "range"}
        if self.upstream is not None:
            return _forward(self.upstream, method, target, headers, body)
        assert self.root is not None
        return _serve_file(self.root, method, target, headers, shift=fault == "shifted_range")


class _ThreadingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # socketserver listens with a backlog of 5: a burst of new connections (four ranks of a
    # node opening their range readers' at once) overflowed it, and the kernel's 1 s SYN
    # retransmission put a second into some ranks' first batch; object stores accept bursts
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], handler: type, *, owner: FaultServer) -> None:
        self.owner = owner
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a client that gave up or timed out: expected under faults
        super().handle_error(request, client_address)


#: Bytes an answer sends at a time (and counts, and paces when its bandwidth is limited).
_PACE_SLICE = 256 << 10


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    _paced: tuple[float, int] = (0.0, 0)  # (when this answer started, bytes sent since)
    timeout = 30  # an idle keep-alive connection frees its thread after this
    # TCP_NODELAY, as object stores and HTTP servers set it: with Nagle's algorithm a small
    # body written after its headers waits for the client's delayed ACK, and every request on
    # a reused connection took ~44 ms instead of ~3 (curl, on a fresh connection each time,
    # did not see it); clients that reuse connections and make many small requests (range
    # reads, ListObjects pages) were measured at a latency no store has
    disable_nagle_algorithm = True
    server: _ThreadingServer

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet tests

    def _handle(self) -> None:
        owner = self.server.owner
        path = urllib.parse.urlsplit(self.path).path
        body = self._read_body()
        if path == STATS_PATH:  # (a benchmark's look at the counters; not counted itself)
            self._send(_Reply(200, [("Content-Type", "application/json")],
                              owner.requests.totals(reset=self.command == "POST")), None)
            return
        owner.requests.begin(self.command, path, ranged="Range" in self.headers)
        try:
            fault = owner.faults.choose(self.command, path)
            if fault == "slow" and owner.stopping.wait(owner.faults.delay_s):
                self.close_connection = True
                return
            if owner.store.latency_s and owner.stopping.wait(owner.store.latency_s):
                self.close_connection = True
                return
            if fault == "error":
                reply = _Reply(owner.faults.status, [("Content-Type", "text/plain")],
                               b"injected fault\n")
            else:
                reply = owner.respond(self.command, self.path, self.headers, body, fault)
            self._paced = (time.monotonic(), 0)
            self._send(reply, fault)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up; nothing more to say
        finally:
            owner.requests.end()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, reply: _Reply, fault: str | None) -> None:
        owner = self.server.owner
        extra = owner.faults.oversize_bytes if fault == "oversize" and reply.body else 0
        self.send_response(reply.status)
        for name, value in reply.headers:
            self.send_header(name, value)
        head = self.command == "HEAD" and reply.length is not None
        length = reply.length if head else len(reply.body)
        self.send_header("Content-Length", str((length or 0) + extra))
        self.end_headers()
        if self.command == "HEAD":
            return
        body = reply.body
        if fault == "corrupt" and body:
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
        if fault in ("stall", "reset", "truncate") and len(body) > 1:
            half = len(body) // 2
            self._write(body[:half])
            self.wfile.flush()
            if fault == "stall":
                if owner.stopping.wait(owner.faults.delay_s):
                    return
                self._write(body[half:])
                return
            self.close_connection = True
            if fault == "reset":  # close with RST instead of FIN
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            return
        self._write(body)
        chunk = b"\x5a" * (1 << 16)
        while extra > 0 and not owner.stopping.is_set():
            piece = chunk[: min(extra, len(chunk))]
            self._write(piece)
            extra -= len(piece)

    def _write(self, data: bytes) -> None:
        """Send ``data`` in slices (each counted once sent, so that a client that goes away
        mid-body is charged what it received), at one connection's rate when limited."""
        owner = self.server.owner
        bandwidth = owner.store.bandwidth
        path = urllib.parse.urlsplit(self.path).path
        view = memoryview(data)
        for at in range(0, len(view), _PACE_SLICE):
            started, sent = self._paced
            if bandwidth is not None:
                due = started + sent / bandwidth - time.monotonic()
                if due > 0 and owner.stopping.wait(due):
                    return
            piece = view[at:at + _PACE_SLICE]
            self.wfile.write(piece)
            self._paced = (started, sent + len(piece))
            owner.requests.sent(len(piece), path)


def _serve_file(root: str, method: str, target: str, headers: Mapping[str, str], *,
                shift: bool = False) -> _Reply:
    """A file of ``root`` (only the bytes asked for are read), a bucket's listing
    (ListObjectsV2) or a bucket's HEAD; the first folder under ``root`` is the bucket."""
    if method not in ("GET", "HEAD"):
        return _Reply(405, [("Allow", "GET, HEAD")], b"")
    split = urllib.parse.urlsplit(target)
    relative = urllib.parse.unquote(split.path).lstrip("/")
    query = urllib.parse.parse_qs(split.query)
    full = os.path.realpath(os.path.join(root, relative))
    if "/" not in relative.rstrip("/") and os.path.isdir(full) and full.startswith(root + os.sep):
        if method == "HEAD" or ("list-type" not in query and "prefix" not in query):
            return _Reply(200, [("Content-Type", "application/xml")], b"", 0)
        return _list_objects(full, relative.rstrip("/"), query)
    if not full.startswith(root + os.sep) or not os.path.isfile(full):
        return _Reply(404, [("Content-Type", "application/xml")],
                      b"<Error><Code>NoSuchKey</Code></Error>")
    st = os.stat(full)
    size = st.st_size
    common = [("Content-Type", "application/octet-stream"), ("Accept-Ranges", "bytes"),
              ("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"'),
              ("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))]
    wanted = _parse_range(headers.get("Range"), size)
    if wanted is None:
        return _Reply(200, common, _read_file(full, 0, size, method), size)
    start, stop = wanted
    if start >= stop:
        return _Reply(416, [("Content-Range", f"bytes */{size}")], b"")
    content_range = ("Content-Range", f"bytes {start}-{stop - 1}/{size}")
    at = min(start + 1, size - (stop - start)) if shift else start
    return _Reply(206, [*common, content_range], _read_file(full, at, stop - start, method),
                  stop - start)


def _read_file(path: str, offset: int, length: int, method: str) -> bytes:
    if method == "HEAD":
        return b""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _list_objects(folder: str, bucket: str, query: Mapping[str, list[str]]) -> _Reply:
    """S3's ListObjectsV2 of the files under ``folder`` (one page; ``delimiter`` folds
    sub-folders into common prefixes)."""
    prefix = query.get("prefix", [""])[0]
    delimiter = query.get("delimiter", [""])[0]
    keys, prefixes = [], set()
    for base, _, files in os.walk(folder):
        for name in files:
            key = os.path.relpath(os.path.join(base, name), folder).replace(os.sep, "/")
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter)[0] + delimiter)
            else:
                keys.append(key)
    parts = [f"<ListBucketResult><Name>{xml_escape(bucket)}</Name>"
             f"<Prefix>{xml_escape(prefix)}</Prefix><KeyCount>{len(keys) + len(prefixes)}"
             "</KeyCount><MaxKeys>100000</MaxKeys><IsTruncated>false</IsTruncated>"]
    for key in sorted(keys):
        st = os.stat(os.path.join(folder, key))
        modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
        parts.append(f"<Contents><Key>{xml_escape(key)}</Key><LastModified>{modified}"
                     f"</LastModified><ETag>&quot;{st.st_size:x}-{st.st_mtime_ns:x}&quot;</ETag>"
                     f"<Size>{st.st_size}</Size><StorageClass>STANDARD</StorageClass></Contents>")
    for common in sorted(prefixes):
        parts.append(f"<CommonPrefixes><Prefix>{xml_escape(common)}</Prefix></CommonPrefixes>")
    parts.append("</ListBucketResult>")
    return _Reply(200, [("Content-Type", "application/xml")], "".join(parts).encode())


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, stop)`` of a single ``bytes=`` range, or None for the whole body."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes="):].strip().partition("-")
    if not first:  # the last N bytes
        return max(0, size - int(last)), size
    start = int(first)
    stop = size if not last else min(size, int(last) + 1)
    return start, stop


def _forward(
    upstream: urllib.parse.SplitResult, method: str, target: str,
    headers: Mapping[str, str], body: bytes,
) -> _Reply:
    connection = http.client.HTTPConnection(upstream.hostname or HOST, upstream.port, timeout=60)
    try:
        # The Host header travels unchanged: S3 signatures cover it.
        connection.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            if name.lower() not in _HOP_BY_HOP:
                connection.putheader(name, value)
        if body or method in ("PUT", "POST"):
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body or None)
        response = connection.getresponse()
        data = response.read()
        kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
        length = response.getheader("Content-Length")
        return _Reply(response.status, kept, data, int(length) if length else len(data))
    finally:
        connection.close()


# ------------------------------------------------------------------------------ S3 (moto)

_AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_AWS_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
              "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN",
              "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CA_BUNDLE")


@contextlib.contextmanager
def aws_test_environment() -> Iterator[None]:
    """Dummy AWS credentials and no user AWS configuration, restored afterwards."""
    saved = {name: os.environ.get(name) for name in (*_AWS_TEST_ENV, *_AWS_UNSET)}
    os.environ.update(_AWS_TEST_ENV)
    for name in _AWS_UNSET:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def s3_storage_options(endpoint_url: str, *, client_retries: bool = False) -> dict[str, Any]:
    """fsspec ``storage_options`` for s3fs against a loopback endpoint, with dummy keys.

    ``client_retries=False`` turns botocore's own retries off, so that the retries a test
    observes are the Fetcher's (s3fs still retries a failed connection by itself).
    """
    options: dict[str, Any] = {
        "key": _AWS_TEST_ENV["AWS_ACCESS_KEY_ID"],
        "secret": _AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
    }
    if not client_retries:
        options["config_kwargs"] = {"retries": {"max_attempts": 0, "mode": "standard"}}
    return options


class MotoServer:
    """moto's S3-compatible server as a subprocess on a free port of 127.0.0.1.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>`` once started.
    """

    def __init__(self, *, startup_timeout_s: float = 30.0) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.endpoint_url = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  (the server's output; closed on exit)

    def start(self) -> MotoServer:
        for _ in range(3):  # a free port can be taken between the probe and the bind
            port = free_port()
            env = {**os.environ, **_AWS_TEST_ENV}
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            )
            self.endpoint_url = f"http://{HOST}:{port}"
            if self._wait_ready(port):
                return self
            self.stop()
        self._log.seek(0)
        output = self._log.read().decode(errors="replace")
        raise RuntimeError(f"moto server did not start:\n{output}")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                return False
            try:
                connection = http.client.HTTPConnection(HOST, port, timeout=2)
                connection.request("GET", "/moto-api/data.json")
                connection.getresponse().read()
                connection.close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API)."""
        connection = http.client.HTTPConnection(urllib.parse.urlsplit(self.endpoint_url).netloc)
        connection.request("POST", "/moto-api/reset")
        connection.getresponse().read()
        connection.close()

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=10)
        self._process = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self._log.close()


@dataclasses.dataclass
class S3Bucket:
    """A bucket on a loopback S3 server (created by :meth:`create`)."""

    endpoint_url: str
    name: str

    @classmethod
    def create(cls, endpoint_url: str, name: str) -> S3Bucket:
        bucket = cls(endpoint_url, name)
        bucket.client.create_bucket(Bucket=name)
        return bucket

    @functools.cached_property
    def client(self) -> Any:
        """A boto3 S3 client for the server (dummy credentials); made once, thread-safe."""
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=_AWS_TEST_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        )

    def url(self, key: str) -> str:
        return f"s3://{self.name}/{key.lstrip('/')}"

    def put(self, key: str, data: bytes) -> str:
        """Store ``data`` at ``key``; returns its ``s3://`` URL."""
        self.client.put_object(Bucket=self.name, Key=key.lstrip("/"), Body=data)
        return self.url(key)

    def storage_options(self, *, via: str | None = None, client_retries: bool = False,
                        ) -> dict[str, Any]:
        """s3fs options reaching this bucket directly, or through the proxy at ``via``."""
        return s3_storage_options(via or self.endpoint_url, client_retries=client_retries)


# ------------------------------------------------------------------------------ own process


def server_totals(url: str, *, reset: bool = False) -> dict[str, int]:
    """The request and byte totals of the server at ``url`` (see :data:`STATS_PATH`)."""
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=30)
    try:
        connection.request("POST" if reset else "GET", STATS_PATH)
        return dict(json.loads(connection.getresponse().read()))
    finally:
        connection.close()


def serve_in_process(root: str, store: StoreModel | None = None,
                     ) -> tuple[subprocess.Popen[str], str]:
    """A :class:`FaultServer` of ``root`` in a process of its own (``python servers.py``), so
    that it does not share the client's interpreter lock, as a remote store does not.
    Returns the process (terminate it when done) and the server's URL."""
    store = store or StoreModel()
    command = [sys.executable, os.path.abspath(__file__), "--root", root,
               "--latency-ms", str(store.latency_s * 1e3)]
    if store.bandwidth is not None:
        command += ["--mb-per-s", str(store.bandwidth / 1e6)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("http://"):
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return process, line.strip()


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="serve a folder as FaultServer does")
    parser.add_argument("--root", required=True)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--mb-per-s", type=float, default=None)
    args = parser.parse_args(argv)
    store = StoreModel(args.latency_ms / 1e3, None if args.mb_per_s is None else
                       args.mb_per_s * 1e6)
    with FaultServer(root=args.root, store=store) as server:
        print(server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
