"""Output buffers of the gather, reused once no batch refers to them.

A batch of 32 rows of 100 KB is 3.2 MB. A fresh allocation of that size is fresh memory from
the OS (glibc serves large blocks with mmap and trims its heap after them), so the gather's
first write to each of its 4 KB pages is a page fault that zeroes the page: measured on the
100 KB benchmark, about 270 faults and as much CPU time as the copy itself, every step.
:class:`BufferPool` keeps a few such buffers and hands one out again once the batch made from
it is gone: a buffer is free when the pool's own reference is the only one left (every array
and tensor made from it refers to it through its ``base``), which is exact, not a guess
about the training loop.

The pool's buffers live long, so the C allocator never sees a large block freed; glibc then
keeps its default thresholds and returns the top of its heap to the OS whenever more than
128 KB of it is free, under the 80-120 KB ``bytes`` objects of a batch of images too, which
then fault again on every allocation. :func:`settle_allocator` frees one 16 MB block once, from
which glibc learns (its "dynamic mmap threshold") what any program that frees a large array
teaches it: measured, 200-340 faults per 32-image step fell to the 50-100 of the shard pages.

Thread safety: :meth:`BufferPool.take` may be called from any thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np

from .. import forksafe

_ALIGN = 64 << 10  # capacities are rounded up to this, with a quarter of slack for variable sizes


class BufferPool:
    """Byte buffers for batches, reused once nothing made from them is alive.

    Args:
        min_bytes: smaller requests get a plain ``np.empty`` (the allocator's own caches
            serve them without page faults).
        max_buffers, max_bytes: what the pool keeps; beyond that, requests get plain arrays.
    """

    def __init__(self, *, min_bytes: int = 64 << 10, max_buffers: int = 12,
                 max_bytes: int = 512 << 20,
                 allocate: Callable[[int], np.ndarray] | None = None) -> None:
        self.min_bytes = min_bytes
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        # makes a buffer of n bytes (a uint8 array that owns its memory, or whose base is
        # not an array: views of it must refer to it); e.g. page-locked memory
        self._allocate = allocate or _plain
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0  # requests served by a buffer that was handed out before
        # The count sys.getrefcount gives for a buffer only the pool's list refers to, measured
        # here the way take() measures (interpreters differ in what the call itself adds).
        probe = [np.empty(0, dtype=np.uint8)]
        self._free_count = sys.getrefcount(probe[0])
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        """A forked child starts empty, with its own lock (a parent's thread may have held
        the inherited one at the fork; the parent's buffers are the parent's batches)."""
        self._lock = threading.Lock()
        self._buffers = []

    def take(self, nbytes: int) -> np.ndarray:
        """A writable, C-contiguous uint8 array of ``nbytes`` bytes (uninitialized)."""
        if nbytes < self.min_bytes:
            return self._allocate(nbytes)
        settle_allocator()
        with self._lock:
            buffers = self._buffers
            best = -1
            for i in range(len(buffers)):
                # a view, an array or a tensor made from the buffer holds one more reference
                if self._is_free(buffers, i) and buffers[i].size >= nbytes and (
                        best < 0 or buffers[i].size < buffers[best].size):
                    best = i
            if best >= 0:
                self.reused += 1
                return buffers[best][:nbytes]
            capacity = -(-(nbytes + nbytes // 4) // _ALIGN) * _ALIGN
            self._make_room(capacity)
            buffers = self._buffers
            buffer = self._allocate(capacity)
            if len(buffers) < self.max_buffers and self._held() + capacity <= self.max_bytes:
                buffers.append(buffer)
            return buffer[:nbytes]

    def _is_free(self, buffers: list[np.ndarray], i: int) -> bool:
        return sys.getrefcount(buffers[i]) == self._free_count

    def _make_room(self, capacity: int) -> None:
        """Drop free buffers too small for the requests now seen (under the lock)."""
        buffers = self._buffers
        self._buffers = [buffers[i] for i in range(len(buffers))
                         if not self._is_free(buffers, i) or buffers[i].size >= capacity]

    def _held(self) -> int:
        return sum(b.size for b in self._buffers)

    def clear(self) -> None:
        """Forget every buffer (those in use stay alive with their batches)."""
        with self._lock:
            self._buffers = []


def _plain(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


_settled = False


def settle_allocator() -> None:
    """Allocate and free one 16 MB block, once per process (see the module's docstring)."""
    global _settled
    if not _settled:
        _settled = True
        block = np.empty(16 << 20, dtype=np.uint8)  # untouched: no page is faulted in
        del block


#: The gather's pool (shared by every reader of the process).
POOL = BufferPool()

_OUTPUTS: contextvars.ContextVar[BufferPool] = contextvars.ContextVar(
    "streamcache_gather_outputs", default=POOL)


def output_pool() -> BufferPool:
    """The pool the gather (and padding) on this thread takes its output buffers from."""
    return _OUTPUTS.get()


@contextlib.contextmanager
def gather_into(pool: BufferPool) -> Iterator[None]:
    """Inside the block, the gather (on this thread) takes its output buffers from ``pool``
    (e.g. one of page-locked memory, so that the batch's tensors are pinned as they are
    gathered, with no copy after)."""
    token = _OUTPUTS.set(pool)
    try:
        yield
    finally:
        _OUTPUTS.reset(token)
