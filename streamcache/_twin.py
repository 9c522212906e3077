"""Pure-Python twin of the C++ core (``csrc/``): the same functions, the same results.

It is the test oracle and the readable statement of what the native code must do. Select it
with ``STREAMCACHE_NATIVE=0``. Functions return errors as values, exactly as the extension does:
``(code, item, message)`` tuples, with the codes of ``csrc/status.h``. The argument checks
and the other kernels' twins are in the ``streamcache._twin_*`` modules imported below.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence

import numpy as np

from ._twin_backups import choose_backups as choose_backups  # the Backend protocol's choice
from ._twin_bijection import feistel_walk as feistel_walk  # the Backend protocol's Feistel pass
from ._twin_checks import (
    CORRUPT,
    INVALID,
    IO,
    OK,
    OUT_OF_RANGE,
    Status,
    array_problem,
    check_fixed_args,
    check_var_args,
    check_var_request,
)
from ._twin_chunks import locate_chunks as locate_chunks  # the Backend protocol's chunk lookup
from ._twin_ipc import check_ipc_offsets, ipc_record_batches  # noqa: F401 (_twin_ipc.py)
from ._twin_rngs import GlobalRngs as GlobalRngs  # the Backend protocol's GlobalRngs
from ._twin_scheduler import Scheduler as Scheduler  # the Backend protocol's Scheduler
from ._twin_split import owner_nodes as owner_nodes  # the Backend protocol's split kernels
from ._twin_split import paid_moves as paid_moves
from ._twin_split import release_moves as release_moves

_MASK = (1 << 64) - 1
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5
_num_threads = 1


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


class Xxh64:
    """XXH64 of the concatenation of every buffer given to :meth:`update`."""

    def __init__(self, seed: int = 0) -> None:
        self._state = _Xxh64(seed)

    def update(self, data: np.ndarray) -> None:
        self._state.update(np.ascontiguousarray(data).tobytes())

    def digest(self) -> int:
        return self._state.digest()


def xxh64(data: np.ndarray, seed: int = 0) -> int:
    state = _Xxh64(seed)
    state.update(np.ascontiguousarray(data).tobytes())
    return state.digest()


def xxh64_pieces(data: np.ndarray, piece: int, out: np.ndarray, guard: bool = False) -> Status:
    """The XXH64 of each ``piece`` bytes of ``data`` into ``out`` (uint64); ``guard`` as in
    :func:`stream_copy` (accepted, does nothing)."""
    for name, array, dtype, writable in (("data", data, np.dtype(np.uint8), False),
                                         ("out", out, np.dtype(np.uint64), True)):
        if (problem := array_problem(name, array, dtype=dtype, writable=writable)) is not None:
            return INVALID, -1, problem
    if piece <= 0:
        return INVALID, -1, "piece must be positive"
    count = -(-len(data) // piece)
    if len(out) != count:
        return INVALID, -1, f"out holds {len(out)} digests, the data has {count} pieces"
    for i in range(count):
        out[i] = xxh64(data[i * piece:(i + 1) * piece])
    return OK, -1, ""


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


def var_offsets(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], elem_size: int,
    which: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray,
) -> tuple[int, int, str, int]:
    err = check_var_args("var_offsets", values, offsets, which, rows, out_offsets)
    if err is None:
        err = check_var_request(values, offsets, elem_size, which, rows, out_offsets)
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
        err = check_var_request(values, offsets, elem_size, which, rows, out_offsets)
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


def gather_bytes(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], which: np.ndarray,
    rows: np.ndarray,
) -> tuple[int, int, str, list[bytes]]:
    """The rows of byte columns as one ``bytes`` each (checked as :func:`var_offsets`)."""
    err = check_var_args("gather_bytes", values, offsets, which, rows, np.zeros(1, np.int64))
    if err is not None:
        return (*err, [])
    if len(which) != len(rows):
        return INVALID, -1, "which and rows differ in length", []
    out_offsets = np.empty(len(rows) + 1, dtype=np.int64)
    code, item, message, _ = var_offsets(values, offsets, 1, which, rows, out_offsets)
    if code != OK:
        return code, item, message, []
    return OK, -1, "", [
        values[shard][int(offsets[shard][row]):int(offsets[shard][row + 1])].tobytes()
        for shard, row in zip(which.tolist(), rows.tolist(), strict=True)
    ]


class ColumnChunks:
    """One shard's column: the buffers of each of its record batches (csrc/bindings.cpp)."""

    def __init__(self, values: Sequence[np.ndarray], offsets: Sequence[np.ndarray]) -> None:
        if offsets and len(offsets) != len(values):
            raise ValueError("values and offsets lists differ in length")
        self.values = list(values)
        self.offsets = list(offsets)

    def __len__(self) -> int:
        return len(self.values)


def _flat_offsets(columns: Sequence[ColumnChunks]) -> list[np.ndarray] | Status:
    for i, column in enumerate(columns):
        if not column.offsets:
            return INVALID, i, "a column without offsets in a variable-width gather"
    return [o for column in columns for o in column.offsets]


def gather_fixed_chunks(columns: Sequence[ColumnChunks], stride: int, which: np.ndarray,
                        rows: np.ndarray, out: np.ndarray) -> Status:
    """:func:`gather_fixed` over the columns' chunks, numbered one after another."""
    return gather_fixed([v for column in columns for v in column.values], stride, which, rows,
                        out)


def var_offsets_chunks(columns: Sequence[ColumnChunks], elem_size: int, which: np.ndarray,
                       rows: np.ndarray, out_offsets: np.ndarray) -> tuple[int, int, str, int]:
    offsets = _flat_offsets(columns)
    if isinstance(offsets, tuple):
        return (*offsets, 0)
    return var_offsets([v for column in columns for v in column.values], offsets, elem_size,
                       which, rows, out_offsets)


def gather_var_chunks(columns: Sequence[ColumnChunks], elem_size: int, which: np.ndarray,
                      rows: np.ndarray, out_offsets: np.ndarray, out_values: np.ndarray
                      ) -> Status:
    offsets = _flat_offsets(columns)
    if isinstance(offsets, tuple):
        return offsets
    return gather_var([v for column in columns for v in column.values], offsets, elem_size,
                      which, rows, out_offsets, out_values)


def gather_bytes_chunks(columns: Sequence[ColumnChunks], which: np.ndarray, rows: np.ndarray
                        ) -> tuple[int, int, str, list[bytes]]:
    offsets = _flat_offsets(columns)
    if isinstance(offsets, tuple):
        return (*offsets, [])
    return gather_bytes([v for column in columns for v in column.values], offsets, which, rows)


def pad_rows(values: np.ndarray, offsets: np.ndarray, elem_size: int, width: int,
             pad: np.ndarray, out: np.ndarray) -> Status:
    """Rows ``values[offsets[i]:offsets[i + 1]]`` (elements of ``elem_size`` bytes) as an
    ``n x width`` matrix in ``out``: each row cut to ``width`` elements or filled with copies
    of the ``elem_size`` bytes of ``pad``."""
    for name, array, dtype, writable, one_d in (
            ("values", values, np.dtype(np.uint8), False, True),
            ("offsets", offsets, np.dtype(np.int64), False, True),
            ("pad", pad, np.dtype(np.uint8), False, True),
            ("out", out, None, True, False)):
        if (problem := array_problem(name, array, dtype=dtype, writable=writable,
                                     one_d=one_d)) is not None:
            return INVALID, -1, problem
    if elem_size <= 0:
        return INVALID, -1, "elem_size must be positive"
    if width < 0:
        return INVALID, -1, "width must not be negative"
    if len(offsets) == 0:
        return INVALID, -1, "offsets must hold at least one entry"
    if pad.size != elem_size:
        return INVALID, -1, "pad must hold elem_size bytes"
    n = len(offsets) - 1
    row_bytes = width * elem_size
    if out.nbytes != n * row_bytes:
        return INVALID, -1, (f"output holds {out.nbytes} bytes, {n} rows of {width} elements "
                             f"of {elem_size} bytes need {n * row_bytes}")
    n_elems = values.size // elem_size
    bounds = offsets.tolist()
    for i in range(n):
        begin, end = bounds[i], bounds[i + 1]
        if begin < 0 or end < begin or end > n_elems:
            return INVALID, i, (f"offsets[{i}:{i + 2}] = [{begin}, {end}] is not a "
                                f"non-decreasing range inside the {n_elems} elements of values")
    rows = out.reshape(-1).view(np.uint8).reshape(n, row_bytes)
    rows[:] = np.tile(pad, width)
    for i in range(n):
        kept = min(bounds[i + 1] - bounds[i], width) * elem_size
        start = bounds[i] * elem_size
        rows[i, :kept] = values[start:start + kept]
    return OK, -1, ""


def stream_copy(source: np.ndarray, out: np.ndarray, threads: int = 1,
                guard: bool = False) -> Status:
    """``out[:] = source`` for one-dimensional uint8 arrays of one size that do not overlap
    (the native one streams large copies past the caches and splits them over ``threads``).

    ``guard`` is accepted and does nothing: Python cannot survive a SIGBUS, so a mapped file
    truncated under this copy kills the process (only the native one guards)."""
    for name, array in (("source", source), ("out", out)):
        if (problem := array_problem(name, array, dtype=np.dtype(np.uint8),
                                     writable=name == "out")) is not None:
            return INVALID, -1, problem
    if threads <= 0:
        return INVALID, -1, "threads must be positive"
    if len(source) != len(out):
        return INVALID, -1, (f"source holds {len(source)} bytes, out {len(out)}: give "
                             "buffers of one size")
    if len(source) and np.may_share_memory(source, out):
        return INVALID, -1, "source and destination overlap: copy into a separate buffer"
    np.copyto(out, source)
    return OK, -1, ""


def group_shards(shards: np.ndarray, unique_out: np.ndarray,
                 which_out: np.ndarray) -> tuple[int, int, str, int]:
    """The distinct shards in increasing order into ``unique_out``, each row's position among
    them into ``which_out``; returns (code, item, message, count)."""
    for name, array, dtype in (("shards", shards, np.dtype(np.int64)),
                               ("unique_out", unique_out, np.dtype(np.int64)),
                               ("which_out", which_out, np.dtype(np.int32))):
        if (problem := array_problem(name, array, dtype=dtype,
                                     writable=name != "shards")) is not None:
            return INVALID, -1, problem, 0
    if len(unique_out) < len(shards) or len(which_out) != len(shards):
        return INVALID, -1, ("unique_out must hold len(shards) entries and which_out exactly "
                             "as many"), 0
    unique, which = np.unique(shards, return_inverse=True)
    unique_out[:len(unique)] = unique
    which_out[:] = which
    return OK, -1, "", len(unique)


def set_num_threads(threads: int) -> None:
    global _num_threads
    _num_threads = max(1, threads)


def get_num_threads() -> int:
    return _num_threads


_gather_limit = threading.local()  # the twin gathers on the calling thread: kept, not used


def set_gather_threads(threads: int) -> None:
    _gather_limit.threads = max(0, threads)


def get_gather_threads() -> int:
    return int(getattr(_gather_limit, "threads", 0))
