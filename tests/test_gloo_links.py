"""GlooLinks (streamcache/gloo_links.py): a failing rank closes its gloo group's connections
and the peer blocked in a collective with it fails at once, not at the group's timeout.

Real processes, real gloo, a 60 s group timeout: rank 0 blocks in an all-reduce that rank 1
never joins. With ``shutdown()`` in rank 1 (which stays alive), rank 0 fails within about a
second of it; without, rank 0 waits until rank 1's process ends. The store's connection is
kept: rank 1 still uses the store after the shutdown.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from streamcache.gloo_links import GlooLinks

_RANK = r"""
import datetime, json, sys, time
import torch, torch.distributed as dist
from streamcache.gloo_links import GlooLinks

rank, port, shut = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
with GlooLinks.track(keep_ports=[port]) as links:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
dist.barrier()
if rank == 0:
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))  # rank 1 never joins it
        out = {"raised": False}
    except Exception as exc:
        out = {"raised": True, "error": str(exc)[:300]}
    out["waited_s"] = time.monotonic() - started
    out["tracked"] = len(links.inodes)
    print(json.dumps(out), flush=True)
else:
    time.sleep(1.0)
    closed = links.shutdown() if shut else 0
    store.set("after", "1")  # the store's connection was kept
    print(json.dumps({"closed": closed, "tracked": len(links.inodes),
                      "store": store.get("after").decode()}), flush=True)
    time.sleep(4.0)  # alive: rank 0 must fail from the shutdown, not from this exit
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Any, shut: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port),
                               "1" if shut else "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert lines, stderr[-3000:]
        outs.append(json.loads(lines[-1]))
    return outs[0], outs[1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")
def test_a_peer_blocked_with_a_rank_that_shut_its_links_fails_at_once(tmp_path: Any) -> None:
    zero, one = _run(tmp_path, shut=True)
    assert one["tracked"] >= 1 and one["closed"] == one["tracked"], one
    assert one["store"] == "1"
    assert zero["raised"], zero
    assert zero["waited_s"] < 3.0, zero  # ~1 s: the shutdown; rank 1 lives until ~5 s


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")
def test_without_the_shutdown_the_peer_waits_for_the_process_to_end(tmp_path: Any) -> None:
    """The control: the same run without shutdown() fails only when rank 1's process ends."""
    zero, one = _run(tmp_path, shut=False)
    assert one["closed"] == 0
    assert zero["raised"], zero
    assert zero["waited_s"] > 4.0, zero


def test_nothing_tracked_means_nothing_shut() -> None:
    assert GlooLinks().shutdown() == 0
    with GlooLinks.track() as links:
        pass
    assert links.inodes == set()


def _listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")
def test_only_connections_made_in_the_block_and_not_to_kept_ports_are_tracked() -> None:
    outside_server, kept_server, server = _listener(), _listener(), _listener()
    outside = socket.create_connection(outside_server.getsockname())  # before the block
    kept_port = kept_server.getsockname()[1]
    try:
        with GlooLinks.track(keep_ports=[kept_port]) as links:
            mine = socket.create_connection(server.getsockname())
            kept = socket.create_connection(kept_server.getsockname())
            listening = _listener()  # a listening socket is not a connection
        peer, _ = server.accept()
        assert len(links.inodes) == 1
        assert links.shutdown() == 1
        assert peer.recv(1) == b""  # the other end sees the end at once
        outside.sendall(b"x")  # untouched: made before the block
        kept.sendall(b"x")  # untouched: to a kept port
        accepted = [outside_server.accept()[0], kept_server.accept()[0]]
        assert [a.recv(1) for a in accepted] == [b"x", b"x"]
        for s in (mine, kept, listening, peer, *accepted):
            s.close()
    finally:
        for s in (outside, outside_server, kept_server, server):
            s.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")
def test_a_descriptor_number_reused_by_another_connection_is_not_shut_down() -> None:
    """The group's connections are known by inode: after one is closed, another socket that
    gets its descriptor number is someone else's (a loader's, a store's)."""
    server = _listener()
    try:
        with GlooLinks.track() as links:
            first = socket.create_connection(server.getsockname())
        fd = first.fileno()
        server.accept()[0].close()
        first.close()
        second = socket.create_connection(server.getsockname())
        assert second.fileno() == fd  # (the lowest free number: the same)
        peer, _ = server.accept()
        assert links.shutdown() == 0
        second.sendall(b"y")
        assert peer.recv(1) == b"y"
        second.close()
        peer.close()
    finally:
        server.close()
