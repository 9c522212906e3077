"""The native functions, from the C++ extension or from their pure-Python twin.

``STREAMCACHE_NATIVE=0`` selects the twin (``streamcache._twin``) at import; tests switch
between the two with :func:`use`. Both return errors as values; this module turns them into
:class:`~streamcache.errors.StreamcacheError` subclasses, so callers see one exception family.

Thread safety: every function may be called from any thread; the native ones release the GIL
for the whole job.

The implementations and which one is in use are ``_native_backend.py``'s (:func:`use`,
:func:`backend_name` and the error codes are also this module's); the prefetch scheduler is
``_native_scheduler.py``; the multi-node split's kernels, ``_native_split.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _native_backend, _twin, _twin_checks
from ._native_backend import (
    CODE_CORRUPT,
    CODE_INTERNAL,
    CODE_INVALID,
    CODE_IO,
    CODE_OUT_OF_RANGE,
    Backend,
    DirectGlobalRngsImpl,
    GlobalRngsImpl,
    available_backends,
    backend_name,
    raise_error,
    refused,
    use,
)
from ._native_chunks import locate_chunks
from ._native_plan import feistel_walk
from ._native_split import choose_backups, owner_nodes, paid_moves, release_moves
from .errors import NativeError


def xxh64(data: Any, seed: int = 0) -> int:
    """XXH64 of a contiguous buffer (bytes, memoryview, numpy array)."""
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    return int(_native_backend.active.xxh64(buf.reshape(-1).view(np.uint8), seed))


def xxh64_file(path: str, seed: int = 0) -> tuple[int, int]:
    """XXH64 of a file's bytes and the number of bytes read. Raises OSError-like errors."""
    code, item, message, digest, size = _native_backend.active.xxh64_file(os.fspath(path), seed)
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
    # Checked here: a non-contiguous out would reshape into a copy, and the rows into nowhere.
    if not isinstance(out, np.ndarray) or not (out.flags.c_contiguous and out.flags.writeable):
        problem = _twin_checks.array_problem("out", out, writable=True, one_d=False)
        raise NativeError(f"gather_fixed: {problem}", CODE_INVALID)
    flat = out.reshape(-1).view(np.uint8)
    sources = list(sources)
    try:
        status = _native_backend.active.gather_fixed(sources, stride, which, rows, flat)
    except TypeError as exc:
        refused(exc, _twin_checks.check_fixed_args(sources, stride, which, rows, flat))
    raise_error(*status)


def gather_var(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], elem_size: int,
    which: np.ndarray, rows: np.ndarray, allocate: Callable[[int], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Gather variable-width rows; returns (values as uint8 bytes, int64 offsets in elements).

    Args:
        values: one-dimensional C-contiguous uint8 arrays, one per shard; offsets: their
            C-contiguous int64 offsets (rows + 1 entries, in elements of ``elem_size`` bytes).
        which: C-contiguous int32 shard indices; rows: C-contiguous int64 row numbers.
        allocate: makes the values' output (a writable, C-contiguous uint8 array of the
            number of bytes it is given); default ``np.empty``.

    Raises:
        RowOutOfRangeError: a row or shard that does not exist.
        CorruptDataError: a shard's offsets do not fit its values.
        NativeError: an array of the wrong dtype, shape or layout (nothing is converted).
    """
    values = list(values)
    offsets = list(offsets)
    out_offsets = np.empty(len(rows) + 1, dtype=np.int64)
    try:
        code, item, message, total = _native_backend.active.var_offsets(
            values, offsets, elem_size, which, rows, out_offsets
        )
    except TypeError as exc:
        refused(exc, _twin_checks.check_var_args("var_offsets", values, offsets, which, rows,
                                                  out_offsets))
    raise_error(code, item, message)
    nbytes = int(total) * elem_size
    out_values = allocate(nbytes) if allocate is not None else np.empty(nbytes, dtype=np.uint8)
    raise_error(*_native_backend.active.gather_var(values, offsets, elem_size, which, rows,
                                                   out_offsets, out_values))
    return out_values, out_offsets


def gather_bytes(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], which: np.ndarray,
    rows: np.ndarray,
) -> list[bytes]:
    """The chosen rows of byte columns (``elem_size`` 1), one ``bytes`` object per row.

    Each row is copied once, from the shard straight into its bytes object (in parallel, GIL
    released): the form a ``bytes`` field takes in a batch, without a contiguous copy first.

    Args, Raises: as :func:`gather_var`.
    """
    values = list(values)
    offsets = list(offsets)
    try:
        code, item, message, result = _native_backend.active.gather_bytes(values, offsets,
                                                                          which, rows)
    except TypeError as exc:
        refused(exc, _twin_checks.check_var_args("gather_bytes", values, offsets, which, rows,
                                                  np.zeros(1, np.int64)))
    raise_error(code, item, message)
    return list(result)


class ColumnChunks:
    """One shard's column as the ``*_chunks`` gathers read it: the buffers of each of its
    record batches (one, or the chunks of a shard read in place), converted for the backend
    once (per backend) instead of on every batch.

    Args:
        values: one-dimensional C-contiguous uint8 arrays, one per record batch.
        offsets: for a variable-width column, their int64 offsets; else None.

    Thread safety: any thread may use it (two threads converting it at once both succeed).
    """

    __slots__ = ("_handles", "offsets", "values")

    def __init__(self, values: Sequence[np.ndarray],
                 offsets: Sequence[np.ndarray] | None = None) -> None:
        self.values = list(values)
        self.offsets = list(offsets) if offsets is not None else []
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.values)

    def handle(self) -> Any:
        """This column as the active backend holds it."""
        backend = _native_backend.active
        handle = self._handles.get(id(backend))
        if handle is None:
            handle = self._handles[id(backend)] = backend.ColumnChunks(self.values, self.offsets)
        return handle


def gather_fixed_chunks(columns: Sequence[ColumnChunks], stride: int, which: np.ndarray,
                        rows: np.ndarray, out: np.ndarray) -> None:
    """:func:`gather_fixed` over the columns' record batches: ``which[i]`` numbers them one
    column after another (column k's batch j is ``sum(len(c) for c in columns[:k]) + j``).

    Raises: as :func:`gather_fixed`.
    """
    if not isinstance(out, np.ndarray) or not (out.flags.c_contiguous and out.flags.writeable):
        problem = _twin_checks.array_problem("out", out, writable=True, one_d=False)
        raise NativeError(f"gather_fixed: {problem}", CODE_INVALID)
    handles = [column.handle() for column in columns]
    raise_error(*_native_backend.active.gather_fixed_chunks(handles, stride, which, rows,
                                         out.reshape(-1).view(np.uint8)))


def gather_var_chunks(columns: Sequence[ColumnChunks], elem_size: int, which: np.ndarray,
                      rows: np.ndarray, allocate: Callable[[int], np.ndarray] | None = None,
                      ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gather_var` over the columns' record batches (numbered as
    :func:`gather_fixed_chunks` says). Raises: as :func:`gather_var`."""
    handles = [column.handle() for column in columns]
    out_offsets = np.empty(len(rows) + 1, dtype=np.int64)
    code, item, message, total = _native_backend.active.var_offsets_chunks(
        handles, elem_size, which, rows, out_offsets)
    raise_error(code, item, message)
    nbytes = int(total) * elem_size
    out_values = allocate(nbytes) if allocate is not None else np.empty(nbytes, dtype=np.uint8)
    raise_error(*_native_backend.active.gather_var_chunks(handles, elem_size, which, rows,
                                                          out_offsets, out_values))
    return out_values, out_offsets


def gather_bytes_chunks(columns: Sequence[ColumnChunks], which: np.ndarray,
                        rows: np.ndarray) -> list[bytes]:
    """:func:`gather_bytes` over the columns' record batches. Raises: as :func:`gather_var`."""
    handles = [column.handle() for column in columns]
    code, item, message, result = _native_backend.active.gather_bytes_chunks(handles, which,
                                                                             rows)
    raise_error(code, item, message)
    return list(result)


def pad_rows(values: np.ndarray, offsets: np.ndarray, width: int, pad_value: Any,
             out: np.ndarray) -> None:
    """Rows ``values[offsets[i]:offsets[i + 1]]`` into ``out`` (``[len(offsets) - 1, width]``
    of ``values.dtype``), each cut to ``width`` or filled with ``pad_value``: one copy per row,
    with the GIL released.

    Raises:
        NativeError: an array is not C-contiguous, ``out`` is not writable or not of that
            size, or the offsets are not a non-decreasing range inside ``values``.
    """
    for name, array in (("values", values), ("out", out)):
        if (problem := _twin_checks.array_problem(name, array, dtype=values.dtype,
                                                  writable=name == "out",
                                                  one_d=name == "values")) is not None:
            raise NativeError(f"pad_rows: {problem}", CODE_INVALID)
    pad = np.array([pad_value], dtype=values.dtype).view(np.uint8)
    try:
        status = _native_backend.active.pad_rows(values.view(np.uint8), offsets,
                                                 values.dtype.itemsize, width, pad,
                                                 out.reshape(-1).view(np.uint8))
    except TypeError as exc:
        refused(exc, _twin_checks.array_problem_status("pad_rows", "offsets", offsets,
                                                        np.dtype(np.int64)))
    raise_error(*status)


def stream_copy(source: np.ndarray, out: np.ndarray, threads: int = 1,
                guard: bool = False) -> None:
    """``out[:] = source`` (one-dimensional uint8 arrays of one size, not overlapping), with
    the GIL released, split over up to ``threads`` threads of the native pool; a large copy
    uses non-temporal stores (for a destination read again only after it has left the
    caches, as a checkpoint's staging buffers are: about 1.7x a plain copy).

    ``guard``: ``out`` may be a shared mapping of a file another process can truncate; a
    store past the file's end then raises instead of killing the process with SIGBUS
    (the native core only; its pure-Python twin cannot catch the fault).

    Raises:
        NativeError: an array is not a C-contiguous uint8 vector, ``out`` is not writable,
            the sizes differ or the buffers overlap; with ``guard``, ``out``'s file was cut
            short during the copy (``out`` then holds part of ``source``).
    """
    for name, array in (("source", source), ("out", out)):
        if (problem := _twin_checks.array_problem(name, array, dtype=np.dtype(np.uint8),
                                                  writable=name == "out")) is not None:
            raise NativeError(f"stream_copy: {problem}", CODE_INVALID)
    raise_error(*_native_backend.active.stream_copy(source, out, int(threads), bool(guard)))


def xxh64_pieces(data: np.ndarray, piece: int, guard: bool = False) -> list[int]:
    """The XXH64 of each consecutive ``piece`` bytes of the uint8 vector ``data`` (the last
    piece may be shorter), hashed with the GIL released; ``guard`` as in
    :func:`stream_copy`.

    Raises:
        NativeError: ``data`` is not a C-contiguous uint8 vector or ``piece`` is not
            positive; with ``guard``, ``data``'s file was cut short while it was read.
    """
    if (problem := _twin_checks.array_problem("data", data, dtype=np.dtype(np.uint8),
                                              writable=False)) is not None:
        raise NativeError(f"xxh64_pieces: {problem}", CODE_INVALID)
    if piece <= 0:
        raise NativeError("xxh64_pieces: piece must be positive", CODE_INVALID)
    out = np.empty(-(-len(data) // piece), dtype=np.uint64)
    raise_error(*_native_backend.active.xxh64_pieces(data, int(piece), out, bool(guard)))
    return [int(d) for d in out]


def ipc_record_batches(file: np.ndarray, nodes_per_batch: int, buffers_per_batch: int,
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every record batch of an Arrow IPC file, from its bytes (``file``: uint8, the whole
    file; csrc/ipc.h): its rows, its field nodes as ``[batches, nodes, (length, null_count)]``
    and its buffers as ``[batches, buffers, (file offset, length)]``.

    Raises:
        CorruptDataError: the file is malformed (an offset outside it, a count that
            contradicts the schema's).
        NativeError: a file the walk does not read (compressed bodies, dictionaries).
    """
    code, item, message, rows, nodes, buffers = _native_backend.active.ipc_record_batches(
        file, nodes_per_batch, buffers_per_batch)
    raise_error(code, item, message)
    return (rows, nodes.reshape(-1, nodes_per_batch, 2),
            buffers.reshape(-1, buffers_per_batch, 2))


def check_ipc_offsets(file: np.ndarray, at: np.ndarray, count: np.ndarray,
                      values_bytes: np.ndarray, elem_size: int) -> None:
    """Each batch's ``count[b] + 1`` int64 offsets at ``file[at[b]:]`` (8-byte aligned) start
    at 0 or more, never decrease and end within ``values_bytes[b] // elem_size``.

    Raises:
        CorruptDataError: a batch's offsets do not (the batch is the error's subject).
    """
    raise_error(*_native_backend.active.check_ipc_offsets(file, at, count, values_bytes,
                                                          elem_size))


def group_shards(shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct shards of a batch in increasing order, and each row's position among them
    (int32): ``numpy.unique(shards, return_inverse=True)``, in a microsecond or two.

    Raises:
        NativeError: ``shards`` is not a one-dimensional C-contiguous int64 array.
    """
    unique = np.empty(len(shards), dtype=np.int64)
    which = np.empty(len(shards), dtype=np.int32)
    try:
        code, item, message, count = _native_backend.active.group_shards(shards, unique, which)
    except TypeError as exc:
        refused(exc, _twin_checks.array_problem_status("group_shards", "shards", shards,
                                                        np.dtype(np.int64)))
    raise_error(code, item, message)
    return unique[:count], which


def global_rngs(python_random: Any, numpy_random_state: Any,
                torch_state: np.ndarray) -> GlobalRngsImpl:
    """The active backend's ``GlobalRngs`` over these generators (see csrc/bindings.cpp; the
    caller checks the native one against the twin before trusting it:
    :mod:`streamcache.loading.seeding`)."""
    return _native_backend.active.GlobalRngs(python_random, numpy_random_state, torch_state)


def direct_global_rngs(python_random: Any, numpy_random_state: Any, torch_state: np.ndarray,
                       torch_engine: int, numpy_gauss: int) -> DirectGlobalRngsImpl:
    """The native ``GlobalRngs`` in direct mode: it writes torch's engine and numpy's normal
    cache at these addresses itself (the caller has found and checked them:
    :mod:`streamcache.loading.rng_layouts`), and saves and restores every state."""
    if backend_name() != "native":
        raise TypeError("direct mode writes the generators' memory: the native backend only")
    rngs: Any = _native_backend.active.GlobalRngs(python_random, numpy_random_state,
                                                  torch_state)
    rngs.attach(torch_engine, numpy_gauss)
    direct: DirectGlobalRngsImpl = rngs
    return direct


def twin_global_rngs(python_random: Any, numpy_random_state: Any,
                     torch_state: np.ndarray) -> GlobalRngsImpl:
    """The twin's ``GlobalRngs`` (the reference the native one is checked against)."""
    return _twin.GlobalRngs(python_random, numpy_random_state, torch_state)


class Xxh64:
    """XXH64 of everything given to :meth:`update`, in order (a file checksummed while it is
    written gives the digest :func:`xxh64_file` gives for the whole file).

    Thread safety: any thread may call; the native update releases the GIL.
    """

    def __init__(self, seed: int = 0) -> None:
        self._impl = _native_backend.active.Xxh64(int(seed))

    def update(self, data: Any) -> None:
        """Add a contiguous buffer (bytes, memoryview, numpy array)."""
        buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        self._impl.update(buf.reshape(-1).view(np.uint8))

    def digest(self) -> int:
        return int(self._impl.digest())


def set_num_threads(threads: int) -> None:
    """Size of the native thread pool (0 = one per core this process may run on: its affinity
    mask, read once per process). No effect on the twin."""
    _native_backend.active.set_num_threads(int(threads))


def get_num_threads() -> int:
    return int(_native_backend.active.get_num_threads())


def set_gather_threads(threads: int) -> None:
    """Gathers called from *this thread* split a large copy over at most ``threads`` threads
    of the native pool, this one included (0: the pool's size, the default; 1: never split).
    For a thread among others that keep every core busy: there a split only adds wake-ups."""
    if int(threads) < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    _native_backend.active.set_gather_threads(int(threads))


def get_gather_threads() -> int:
    """This thread's limit set by :func:`set_gather_threads` (0: the pool's size)."""
    return int(_native_backend.active.get_gather_threads())


__all__ = [
    "CODE_CORRUPT",
    "CODE_INTERNAL",
    "CODE_INVALID",
    "CODE_IO",
    "CODE_OUT_OF_RANGE",
    "Backend",
    "ColumnChunks",
    "Xxh64",
    "available_backends",
    "backend_name",
    "check_ipc_offsets",
    "choose_backups",
    "direct_global_rngs",
    "feistel_walk",
    "gather_bytes",
    "gather_bytes_chunks",
    "gather_fixed",
    "gather_fixed_chunks",
    "gather_var",
    "gather_var_chunks",
    "get_gather_threads",
    "get_num_threads",
    "global_rngs",
    "group_shards",
    "ipc_record_batches",
    "locate_chunks",
    "owner_nodes",
    "paid_moves",
    "release_moves",
    "set_gather_threads",
    "set_num_threads",
    "stream_copy",
    "twin_global_rngs",
    "use",
    "xxh64",
    "xxh64_file",
]
