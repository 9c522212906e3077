"""The TCP connections of a gloo process group, so that a failing rank can close them.

Under an in-process restart (NVIDIA Resiliency Extension's ``inprocess.Wrapper``), the rank
that failed stays alive and makes a new process group; its peers, blocked in a collective
with it, learn of the failure only when its connections close. NVRx's abort covers NCCL
communicators; for gloo, neither ``_abort_process_group``, ``ProcessGroup.shutdown()``, the
backend's ``abort()`` nor ``destroy_process_group()`` closed the pair sockets in torch 2.13
(docs/recovery.md: the survivor waited for the group's whole timeout), while a ``shutdown()``
of the failing rank's established connection ended the survivor's wait at once.

gloo connects every pair of ranks when the group is made (``connectFullMesh``), so the
group's connections are the TCP sockets that appear in this process while it is made::

    with GlooLinks.track(keep_ports=[store_port]) as links:
        dist.init_process_group("gloo", store=store)
    ...
    except BaseException:
        links.shutdown()         # peers blocked in a collective with this rank fail now
        raise

``keep_ports``: connections to or from these ports are never touched (the store's: the
failing rank makes its next group through the same store). ``MASTER_PORT`` is kept too.
Linux only (``/proc``); elsewhere nothing is found and :meth:`GlooLinks.shutdown` does
nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

_ESTABLISHED = "01"


def _socket_inodes() -> dict[int, int]:
    """This process's open sockets: {inode: fd}."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    found[int(target[8:-1])] = int(name)
    return found


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """Every TCP socket of this network namespace: {inode: (local port, remote port, state)}."""
    table: dict[int, tuple[int, int, str]] = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as lines:
            next(lines, None)  # the header
            for line in lines:
                parts = line.split()
                with contextlib.suppress(IndexError, ValueError):
                    local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
                    table[inode] = (int(local.rsplit(":", 1)[1], 16),
                                    int(remote.rsplit(":", 1)[1], 16), state)
    return table


@dataclass
class GlooLinks:
    """The established TCP connections that appeared while a gloo group was made (by inode:
    a file descriptor number may be reused; the inode names the socket itself)."""

    inodes: set[int] = field(default_factory=set)
    keep_ports: frozenset[int] = frozenset()

    @classmethod
    @contextlib.contextmanager
    def track(cls, keep_ports: Iterable[int] = ()) -> Iterator[GlooLinks]:
        """Record the connections made inside the block (the group's, once it is made)."""
        keep = set(keep_ports)
        with contextlib.suppress(ValueError):
            keep.add(int(os.environ.get("MASTER_PORT", "")))
        links = cls(keep_ports=frozenset(keep))
        before = set(_socket_inodes())
        yield links
        table = _tcp_table()
        for inode in set(_socket_inodes()) - before:
            ports = table.get(inode)
            if ports is None or ports[2] != _ESTABLISHED:
                continue  # not TCP, or a listening socket
            if ports[0] in links.keep_ports or ports[1] in links.keep_ports:
                continue
            links.inodes.add(inode)

    def shutdown(self) -> int:
        """Shut both directions of every tracked connection still open (peers reading from
        it see the end at once; the descriptors stay open for their owner to close). Returns
        how many were shut down."""
        done = 0
        for inode, fd in _socket_inodes().items():
            if inode not in self.inodes:
                continue
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=os.dup(fd))  # a second handle on the same socket
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
                finally:
                    sock.close()  # (closes the duplicate only)
        return done


__all__ = ["GlooLinks"]
