"""Pure-Python twin of the C++ core (``csrc/``): the same functions, the same results.

It is the test oracle and the readable statement of what the native code must do. Select it
with ``STREAMCACHE_NATIVE=0``. Functions return errors as values, exactly as the extension does:
``(code, item, message)`` tuples, with the codes of ``csrc/status.h``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

OK, OUT_OF_RANGE, CORRUPT, IO, INVALID = 0, 1, 2, 3, 4
_MASK = (1 << 64) - 1
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5
_num_threads = 1

Status = tuple[int, int, str]


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _round(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _MASK
    return (_rotl(acc, 31) * _P1) & _MASK


class _Xxh64:
    """Streaming XXH64 state, as in the xxHash specification."""

    def __init__(self, seed: int) -> None:
        self.seed = seed & _MASK
        self.acc = [
            (seed + _P1 + _P2) & _MASK, (seed + _P2) & _MASK, seed & _MASK, (seed - _P1) & _MASK,
        ]
        self.total = 0
        self.pending = b""

    def update(self, data: bytes) -> None:
        self.total += len(data)
        data = self.pending + data
        usable = len(data) - len(data) % 32
        acc = self.acc
        for start in range(0, usable, 32):
            a, b, c, d = struct.unpack_from("<4Q", data, start)
            acc[0], acc[1] = _round(acc[0], a), _round(acc[1], b)
            acc[2], acc[3] = _round(acc[2], c), _round(acc[3], d)
        self.pending = data[usable:]

    def digest(self) -> int:
        if self.total >= 32:
            a = self.acc
            h = (_rotl(a[0], 1) + _rotl(a[1], 7) + _rotl(a[2], 12) + _rotl(a[3], 18)) & _MASK
            for lane in a:
                h ^= _round(0, lane)
                h = (h * _P1 + _P4) & _MASK
        else:
            h = (self.seed + _P5) & _MASK
        h = (h + self.total) & _MASK
        rest = self.pending
        pos = 0
        while len(rest) - pos >= 8:
            h ^= _round(0, struct.unpack_from("<Q", rest, pos)[0])
            h = (_rotl(h, 27) * _P1 + _P4) & _MASK
            pos += 8
        if len(rest) - pos >= 4:
            h ^= (struct.unpack_from("<I", rest, pos)[0] * _P1) & _MASK
            h = (_rotl(h, 23) * _P2 + _P3) & _MASK
            pos += 4
        for byte in rest[pos:]:
            h ^= (byte * _P5) & _MASK
            h = (_rotl(h, 11) * _P1) & _MASK
        h ^= h >> 33
        h = (h * _P2) & _MASK
        h ^= h >> 29
        h = (h * _P3) & _MASK
        h ^= h >> 32
        return h


def xxh64(data: np.ndarray, seed: int = 0) -> int:
    state = _Xxh64(seed)
    state.update(np.ascontiguousarray(data).tobytes())
    return state.digest()


def xxh64_file(path: str, seed: int = 0) -> tuple[int, int, str, int, int]:
    state = _Xxh64(seed)
    try:
        with open(path, "rb") as f:
            while block := f.read(4 << 20):
                state.update(block)
    except OSError as exc:
        return IO, -1, f"{path}: {exc.strerror}", 0, 0
    return OK, -1, "", state.digest(), state.total


def _row_message(i: int, shard: int, row: int) -> str:
    return f"batch item {i} asks for shard {shard} row {row}"


def _check_shard(i: int, shard: int, n_sources: int) -> Status | None:
    if shard < 0 or shard >= n_sources:
        return OUT_OF_RANGE, i, f"batch item {i} names shard {shard} of {n_sources}"
    return None


_INT64_MAX = (1 << 63) - 1
Array = tuple[str, object, np.dtype | None, bool]  # name, value, exact dtype, writable


def array_problem(name: str, array: object, dtype: np.dtype | None = None, *,
                  writable: bool = False, one_d: bool = True) -> str | None:
    """What makes ``array`` unfit for the native core, or None.

    The extension refuses to convert arrays (``.noconvert()`` in ``csrc/bindings.cpp``): a
    converting cast would silently copy an output, whose result is then lost, or truncate
    int64 values to uint8. Arrays must be numpy arrays of the exact dtype, C-contiguous,
    and writable if they are outputs.
    """
    if not isinstance(array, np.ndarray):
        return f"{name} must be a numpy array, got {type(array).__name__}"
    if dtype is not None and array.dtype != dtype:
        return f"{name} must have dtype {dtype}, got {array.dtype}"
    if one_d and array.ndim != 1:
        return f"{name} must be one-dimensional, got shape {array.shape}"
    if not array.flags.c_contiguous:
        return f"{name} must be C-contiguous (it would be copied, and an output's copy lost)"
    if writable and not array.flags.writeable:
        return f"{name} must be writable"
    return None


def _first_problem(function: str, arrays: Sequence[Array]) -> Status | None:
    for name, array, dtype, writable in arrays:
        problem = array_problem(name, array, dtype, writable=writable)
        if problem is not None:
            return INVALID, -1, f"{function}: {problem}"
    return None


_U8, _I32, _I64 = np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64)


def _each(name: str, arrays: Sequence[object], dtype: np.dtype) -> list[Array]:
    if not isinstance(arrays, (list, tuple)):
        return [(name, arrays, None, False)]  # "must be a numpy array": a list is expected
    return [(f"{name}[{k}]", a, dtype, False) for k, a in enumerate(arrays)]


def check_fixed_args(sources: Sequence[object], stride: int, which: object, rows: object,
                     out: object) -> Status | None:
    """The array checks of ``gather_fixed`` (``out`` may have any dtype and shape)."""
    arrays = [*_each("sources", sources, _U8), ("which", which, _I32, False),
              ("rows", rows, _I64, False)]
    if (err := _first_problem("gather_fixed", arrays)) is not None:
        return err
    problem = array_problem("out", out, writable=True, one_d=False)
    return None if problem is None else (INVALID, -1, f"gather_fixed: {problem}")


def check_var_args(function: str, values: Sequence[object], offsets: Sequence[object],
                   which: object, rows: object, out_offsets: object,
                   out_values: object = None) -> Status | None:
    """The array checks of ``var_offsets`` and (with ``out_values``) ``gather_var``."""
    arrays = [*_each("values", values, _U8), *_each("offsets", offsets, _I64),
              ("which", which, _I32, False), ("rows", rows, _I64, False),
              ("out_offsets", out_offsets, _I64, out_values is None)]
    if (err := _first_problem(function, arrays)) is not None:
        return err
    if out_values is None:
        return None
    problem = array_problem("out_values", out_values, writable=True, one_d=False)
    return None if problem is None else (INVALID, -1, f"{function}: {problem}")


def gather_fixed(
    sources: Sequence[np.ndarray], stride: int, which: np.ndarray, rows: np.ndarray,
    out: np.ndarray,
) -> Status:
    if (err := check_fixed_args(sources, stride, which, rows, out)) is not None:
        return err
    if len(which) != len(rows):
        return INVALID, -1, "which and rows differ in length"
    if stride <= 0:
        return INVALID, -1, "stride must be positive"
    out_bytes = out.reshape(-1).view(np.uint8)
    if out_bytes.size < len(rows) * stride:
        return INVALID, -1, (
            f"output holds {out_bytes.size} bytes, batch needs {len(rows)} rows of {stride} bytes"
        )
    for i, (shard, row) in enumerate(zip(which.tolist(), rows.tolist(), strict=True)):
        if (err := _check_shard(i, shard, len(sources))) is not None:
            return err
        src = sources[shard]
        n_rows = src.size // stride
        if row < 0 or row >= n_rows:
            return OUT_OF_RANGE, i, f"{_row_message(i, shard, row)} but it has {n_rows} rows"
        out_bytes[i * stride:(i + 1) * stride] = src[row * stride:(row + 1) * stride]
    return OK, -1, ""


def _var_row(
    values: np.ndarray, offsets: np.ndarray, elem_size: int, i: int, shard: int, row: int,
) -> tuple[Status | None, int, int]:
    n_rows = offsets.size - 1
    if row < 0 or row >= n_rows:
        return (OUT_OF_RANGE, i, f"{_row_message(i, shard, row)} but it has {n_rows} rows"), 0, 0
    begin, end = int(offsets[row]), int(offsets[row + 1])
    n_elems = values.size // elem_size
    if begin < 0 or end < begin or end > n_elems:
        message = (
            f"{_row_message(i, shard, row)}: offsets [{begin}, {end}) do not fit its "
            f"{n_elems} elements"
        )
        return (CORRUPT, i, message), 0, 0
    return None, begin, end


def _check_var_request(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], elem_size: int,
    which: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray,
) -> Status | None:
    """The checks var_offsets and gather_var share, in the extension's order."""
    if len(which) != len(rows):
        return INVALID, -1, "which and rows differ in length"
    if out_offsets.size != len(rows) + 1:
        return INVALID, -1, "out_offsets must hold len(rows) + 1 entries"
    if len(values) != len(offsets):
        return INVALID, -1, "values and offsets lists differ in length"
    for i, off in enumerate(offsets):
        if off.size == 0:
            return CORRUPT, i, "an offsets buffer must hold at least one entry"
    if elem_size <= 0:
        return INVALID, -1, "elem_size must be positive"
    return None


def var_offsets(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], elem_size: int,
    which: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray,
) -> tuple[int, int, str, int]:
    err = check_var_args("var_offsets", values, offsets, which, rows, out_offsets)
    if err is None:
        err = _check_var_request(values, offsets, elem_size, which, rows, out_offsets)
    if err is not None:
        return (*err, 0)
    max_elems = _INT64_MAX // elem_size  # the batch's bytes must fit an int64
    running = 0
    out_offsets[0] = 0
    for i, (shard, row) in enumerate(zip(which.tolist(), rows.tolist(), strict=True)):
        if (err := _check_shard(i, shard, len(values))) is not None:
            return (*err, 0)
        err, begin, end = _var_row(values[shard], offsets[shard], elem_size, i, shard, row)
        if err is not None:
            return (*err, 0)
        if end - begin > max_elems - running:
            return INVALID, i, f"batch item {i} makes the batch larger than 2**63 bytes", 0
        running += end - begin
        out_offsets[i + 1] = running
    return OK, -1, "", running


def gather_var(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], elem_size: int,
    which: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray, out_values: np.ndarray,
) -> Status:
    err = check_var_args("gather_var", values, offsets, which, rows, out_offsets, out_values)
    if err is None:
        err = _check_var_request(values, offsets, elem_size, which, rows, out_offsets)
    if err is not None:
        return err
    out_bytes = out_values.reshape(-1).view(np.uint8)
    # Every row i writes out_offsets[i] .. out_offsets[i + 1], which must lie inside
    # [0, last]; `last` elements must fit the output.
    last = int(out_offsets[-1]) if len(rows) else 0
    if last < 0 or last > out_bytes.size // elem_size:
        return INVALID, -1, (
            f"output holds {out_bytes.size} bytes, out_offsets end at {last} elements of "
            f"{elem_size} bytes"
        )
    for i, (shard, row) in enumerate(zip(which.tolist(), rows.tolist(), strict=True)):
        dst_begin, dst_end = int(out_offsets[i]), int(out_offsets[i + 1])
        if dst_begin < 0 or dst_end < dst_begin or dst_end > last:
            return INVALID, i, (
                f"out_offsets[{i}:{i + 2}] = [{dst_begin}, {dst_end}] is not a non-decreasing "
                f"range inside [0, {last}]"
            )
        if (err := _check_shard(i, shard, len(values))) is not None:
            return err
        err, begin, end = _var_row(values[shard], offsets[shard], elem_size, i, shard, row)
        if err is not None:
            return err
        if end - begin != dst_end - dst_begin:
            return INVALID, i, "out_offsets do not match the rows asked for"
        out_bytes[dst_begin * elem_size:dst_end * elem_size] = (
            values[shard][begin * elem_size:end * elem_size]
        )
    return OK, -1, ""


def set_num_threads(threads: int) -> None:
    global _num_threads
    _num_threads = max(1, threads)


def get_num_threads() -> int:
    return _num_threads


# ------------------------------------------------------------------ prefetch scheduler twin

SHARD_UNKNOWN, SHARD_QUEUED, SHARD_IN_FLIGHT, SHARD_READY, SHARD_FAILED = 0, 1, 2, 3, 4
WAIT_READY, WAIT_FAILED, WAIT_TIMEOUT, WAIT_STOPPED, WAIT_NOT_SCHEDULED = 0, 1, 2, 3, 4
TASK_STOPPED, TASK_TIMEOUT = -1, -2


class _Entry:
    __slots__ = ("bytes", "message", "priority", "state")

    def __init__(self) -> None:
        self.state = SHARD_UNKNOWN
        self.priority = 0
        self.bytes = 0
        self.message = ""


class Scheduler:
    """Twin of ``csrc/scheduler.h``: the same methods, states, sentinels and counters.

    The queue is a sorted list of (priority, shard) here (bisect), a std::set there.
    """

    def __init__(self, inflight_budget: int) -> None:
        import threading  # imported here: the rest of the twin has no use for it

        self._budget = int(inflight_budget)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._entries: dict[int, _Entry] = {}
        self._queue: list[tuple[int, int]] = []
        self._inflight_bytes = 0
        self._inflight_tasks = 0
        self._stopping = False
        # hits, misses, bytes_fetched, bytes_evicted, wait_ns, tasks_done, tasks_failed
        self._counters = [0] * 7

    def submit(self, shard: int, priority: int, bytes: int) -> bool:
        import bisect

        with self._lock:
            if self._stopping:
                return False
            entry = self._entries.setdefault(shard, _Entry())
            if entry.state in (SHARD_IN_FLIGHT, SHARD_READY):
                return False
            if entry.state == SHARD_QUEUED:
                if entry.priority == priority:
                    return True
                self._queue.remove((entry.priority, shard))
            entry.state, entry.priority, entry.bytes, entry.message = (
                SHARD_QUEUED, priority, bytes, "")
            bisect.insort(self._queue, (priority, shard))
            self._work.notify_all()
            return True

    def cancel(self, shard: int) -> bool:
        with self._lock:
            entry = self._entries.get(shard)
            if entry is None or entry.state != SHARD_QUEUED:
                return False
            self._queue.remove((entry.priority, shard))
            del self._entries[shard]
            self._work.notify_all()
            return True

    def _head_fits(self) -> bool:
        if not self._queue:
            return False
        if self._inflight_tasks == 0:
            return True
        head = self._entries[self._queue[0][1]]
        return self._inflight_bytes + head.bytes <= self._budget

    def next_task(self, timeout_s: float) -> int:
        with self._lock:
            ready = self._work.wait_for(lambda: self._stopping or self._head_fits(),
                                        None if timeout_s < 0 else timeout_s)
            if self._stopping:
                return TASK_STOPPED
            if not ready:
                return TASK_TIMEOUT
            _, shard = self._queue.pop(0)
            entry = self._entries[shard]
            entry.state = SHARD_IN_FLIGHT
            self._inflight_bytes += entry.bytes
            self._inflight_tasks += 1
            return shard

    def complete(self, shard: int, ok: bool, bytes_fetched: int, message: str) -> None:
        with self._lock:
            entry = self._entries.get(shard)
            if entry is None or entry.state != SHARD_IN_FLIGHT:
                return
            self._inflight_bytes -= entry.bytes
            self._inflight_tasks -= 1
            entry.state = SHARD_READY if ok else SHARD_FAILED
            entry.message = "" if ok else message
            self._counters[2] += bytes_fetched
            self._counters[5 if ok else 6] += 1
            self._work.notify_all()
            self._done.notify_all()

    def mark_ready(self, shard: int) -> None:
        with self._lock:
            entry = self._entries.setdefault(shard, _Entry())
            if entry.state == SHARD_IN_FLIGHT:
                return
            if entry.state == SHARD_QUEUED:
                self._queue.remove((entry.priority, shard))
            entry.state, entry.message = SHARD_READY, ""
            self._work.notify_all()
            self._done.notify_all()

    def forget(self, shard: int, bytes_evicted: int) -> None:
        with self._lock:
            self._counters[3] += bytes_evicted
            entry = self._entries.get(shard)
            if entry is not None and entry.state in (SHARD_READY, SHARD_FAILED):
                del self._entries[shard]

    def _state(self, shard: int) -> int:
        entry = self._entries.get(shard)
        return SHARD_UNKNOWN if entry is None else entry.state

    def wait(self, shard: int, timeout_s: float, count_access: bool) -> tuple[int, str]:
        import time

        with self._lock:
            ready_on_entry = self._state(shard) == SHARD_READY
            if count_access:
                self._counters[0 if ready_on_entry else 1] += 1
            if not ready_on_entry:
                started = time.perf_counter_ns()
                self._done.wait_for(
                    lambda: self._stopping or self._state(shard) in (
                        SHARD_READY, SHARD_FAILED, SHARD_UNKNOWN),
                    None if timeout_s < 0 else timeout_s)
                self._counters[4] += time.perf_counter_ns() - started
            state = self._state(shard)
            if state == SHARD_READY:
                return WAIT_READY, ""
            if state == SHARD_FAILED:
                return WAIT_FAILED, self._entries[shard].message
            if self._stopping:
                return WAIT_STOPPED, ""
            if state == SHARD_UNKNOWN:
                return WAIT_NOT_SCHEDULED, ""
            return WAIT_TIMEOUT, ""

    def note_hit(self) -> None:
        with self._lock:
            self._counters[0] += 1

    def state(self, shard: int) -> int:
        with self._lock:
            return self._state(shard)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            self._done.notify_all()

    def stopped(self) -> bool:
        with self._lock:
            return self._stopping

    def counters(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._counters)

    def inflight_bytes(self) -> int:
        with self._lock:
            return self._inflight_bytes

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)
