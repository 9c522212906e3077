"""The native functions, from the C++ extension or from their pure-Python twin.

``STREAMCACHE_NATIVE=0`` selects the twin (``streamcache._twin``) at import; tests switch
between the two with :func:`use`. Both return errors as values; this module turns them into
:class:`~streamcache.errors.StreamcacheError` subclasses, so callers see one exception family.

Thread safety: every function may be called from any thread; the native ones release the GIL
for the whole job.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

from . import _twin
from ._twin import Status
from .errors import CorruptDataError, NativeError, RowOutOfRangeError, StreamcacheError

_compiled: ModuleType | None
try:
    _compiled = importlib.import_module("streamcache._core")
except ImportError:  # an install without the extension; the twin still works
    _compiled = None

CODE_OUT_OF_RANGE = 1
CODE_CORRUPT = 2
CODE_IO = 3
CODE_INVALID = 4
CODE_INTERNAL = 5

_backend: ModuleType


def _initial_backend() -> ModuleType:
    wanted = os.environ.get("STREAMCACHE_NATIVE", "1").strip().lower()
    if wanted in ("0", "false", "no", "twin", "python"):
        return _twin
    if _compiled is None:
        raise StreamcacheError(
            "the streamcache C++ extension is not built; reinstall with "
            "`pip install -e .` or set STREAMCACHE_NATIVE=0 to use the pure-Python twin"
        )
    return _compiled


_backend = _initial_backend()


def backend_name() -> str:
    """``"native"`` or ``"twin"``: which implementation is in use."""
    return "twin" if _backend is _twin else "native"


def available_backends() -> list[str]:
    return ["native", "twin"] if _compiled is not None else ["twin"]


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Select ``"native"`` or ``"twin"`` for the duration of a ``with`` block (tests)."""
    global _backend
    previous = _backend
    if name == "twin":
        _backend = _twin
    elif name == "native":
        if _compiled is None:
            raise StreamcacheError("the C++ extension is not built")
        _backend = _compiled
    else:
        raise ValueError(f"unknown backend {name!r}; use 'native' or 'twin'")
    try:
        yield
    finally:
        _backend = previous


def _raise(code: int, item: int, message: str) -> None:
    if code == 0:
        return
    if code == CODE_OUT_OF_RANGE:
        raise RowOutOfRangeError(message, code, item)
    if code == CODE_CORRUPT:
        raise CorruptDataError(message)
    raise NativeError(message, code, item)


def _refused(exc: TypeError, problem: Status | None) -> NoReturn:
    """The extension refused an argument (it never converts arrays): say what is wrong."""
    if problem is None:  # not an array the twin's checks know: the binding's own message
        raise NativeError(f"invalid arguments for the native core: {exc}", CODE_INVALID) from exc
    raise NativeError(problem[2], problem[0], problem[1]) from exc


def xxh64(data: Any, seed: int = 0) -> int:
    """XXH64 of a contiguous buffer (bytes, memoryview, numpy array)."""
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    return int(_backend.xxh64(buf.reshape(-1).view(np.uint8), seed))


def xxh64_file(path: str, seed: int = 0) -> tuple[int, int]:
    """XXH64 of a file's bytes and the number of bytes read. Raises OSError-like errors."""
    code, item, message, digest, size = _backend.xxh64_file(os.fspath(path), seed)
    if code != 0:
        raise NativeError(f"cannot checksum {path}: {message}", code, item)
    return int(digest), int(size)


def gather_fixed(
    sources: Sequence[np.ndarray], stride: int, which: np.ndarray, rows: np.ndarray,
    out: np.ndarray,
) -> None:
    """Copy row ``rows[i]`` of ``sources[which[i]]`` (``stride`` bytes) into ``out``'s row i.

    Args:
        sources: one-dimensional C-contiguous uint8 arrays, one per shard.
        which: C-contiguous int32 shard indices; rows: C-contiguous int64 row numbers.
        out: any C-contiguous, writable array (bytes are what count: datetimes and bools too).

    Raises:
        RowOutOfRangeError: a row or shard that does not exist.
        NativeError: an array of the wrong dtype, shape or layout (nothing is converted or
            copied), or an output too small for the batch.
    """
    problem = _twin.array_problem("out", out, writable=True, one_d=False)
    if problem is not None:  # checked here: a non-contiguous out would reshape into a copy
        raise NativeError(f"gather_fixed: {problem}", CODE_INVALID)
    flat = out.reshape(-1).view(np.uint8)
    sources = list(sources)
    try:
        status = _backend.gather_fixed(sources, stride, which, rows, flat)
    except TypeError as exc:
        _refused(exc, _twin.check_fixed_args(sources, stride, which, rows, flat))
    _raise(*status)


def gather_var(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], elem_size: int,
    which: np.ndarray, rows: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Gather variable-width rows; returns (values as uint8 bytes, int64 offsets in elements).

    Args:
        values: one-dimensional C-contiguous uint8 arrays, one per shard; offsets: their
            C-contiguous int64 offsets (rows + 1 entries, in elements of ``elem_size`` bytes).
        which: C-contiguous int32 shard indices; rows: C-contiguous int64 row numbers.

    Raises:
        RowOutOfRangeError: a row or shard that does not exist.
        CorruptDataError: a shard's offsets do not fit its values.
        NativeError: an array of the wrong dtype, shape or layout (nothing is converted).
    """
    values = list(values)
    offsets = list(offsets)
    out_offsets = np.empty(len(rows) + 1, dtype=np.int64)
    try:
        code, item, message, total = _backend.var_offsets(
            values, offsets, elem_size, which, rows, out_offsets
        )
    except TypeError as exc:
        _refused(exc, _twin.check_var_args("var_offsets", values, offsets, which, rows,
                                           out_offsets))
    _raise(code, item, message)
    out_values = np.empty(int(total) * elem_size, dtype=np.uint8)
    _raise(*_backend.gather_var(values, offsets, elem_size, which, rows, out_offsets, out_values))
    return out_values, out_offsets


def set_num_threads(threads: int) -> None:
    """Size of the native thread pool (0 = one per core). No effect on the twin."""
    _backend.set_num_threads(int(threads))


def get_num_threads() -> int:
    return int(_backend.get_num_threads())


# ------------------------------------------------------------------ prefetch scheduler

#: Shard states of :class:`Scheduler` (``csrc/scheduler.h`` ShardState).
SHARD_UNKNOWN, SHARD_QUEUED, SHARD_IN_FLIGHT, SHARD_READY, SHARD_FAILED = 0, 1, 2, 3, 4
#: Results of :meth:`Scheduler.wait` (WaitResult).
WAIT_READY, WAIT_FAILED, WAIT_TIMEOUT, WAIT_STOPPED, WAIT_NOT_SCHEDULED = 0, 1, 2, 3, 4
#: What :meth:`Scheduler.next_task` returns instead of a shard.
TASK_STOPPED, TASK_TIMEOUT = -1, -2


@dataclass(frozen=True)
class SchedulerCounters:
    """A snapshot of a :class:`Scheduler`'s counters."""

    hits: int
    misses: int
    bytes_fetched: int
    bytes_evicted: int
    wait_s: float
    tasks_done: int
    tasks_failed: int


class Scheduler:
    """The prefetch queue, in-flight byte budget, shard states and waits of the C++ core.

    A thin facade over ``_core.Scheduler`` or its twin (chosen when it is made). See
    ``csrc/scheduler.h`` for the contract of every method. ``next_task`` and ``wait`` release
    the GIL while they block.

    Thread safety: every method may be called from any thread. Not to be used in a child
    process forked after it was made.
    """

    def __init__(self, inflight_budget: int) -> None:
        self._impl = _backend.Scheduler(int(inflight_budget))
        self.backend = backend_name()

    def submit(self, shard: int, priority: int, nbytes: int) -> bool:
        return bool(self._impl.submit(int(shard), int(priority), int(nbytes)))

    def cancel(self, shard: int) -> bool:
        return bool(self._impl.cancel(int(shard)))

    def next_task(self, timeout_s: float) -> int:
        return int(self._impl.next_task(float(timeout_s)))

    def complete(self, shard: int, ok: bool, bytes_fetched: int = 0, message: str = "") -> None:
        self._impl.complete(int(shard), bool(ok), int(bytes_fetched), str(message))

    def mark_ready(self, shard: int) -> None:
        self._impl.mark_ready(int(shard))

    def forget(self, shard: int, bytes_evicted: int = 0) -> None:
        self._impl.forget(int(shard), int(bytes_evicted))

    def wait(self, shard: int, timeout_s: float, *, count_access: bool = False,
             ) -> tuple[int, str]:
        code, message = self._impl.wait(int(shard), float(timeout_s), bool(count_access))
        return int(code), str(message)

    def note_hit(self) -> None:
        self._impl.note_hit()

    def state(self, shard: int) -> int:
        return int(self._impl.state(int(shard)))

    def stop(self) -> None:
        self._impl.stop()

    def stopped(self) -> bool:
        return bool(self._impl.stopped())

    def counters(self) -> SchedulerCounters:
        hits, misses, fetched, evicted, wait_ns, done, failed = self._impl.counters()
        return SchedulerCounters(int(hits), int(misses), int(fetched), int(evicted),
                                 wait_ns / 1e9, int(done), int(failed))

    def inflight_bytes(self) -> int:
        return int(self._impl.inflight_bytes())

    def queued(self) -> int:
        return int(self._impl.queued())
