"""Arrow arrays read and built through their buffers, as numpy views.

pyarrow's own ``to_numpy`` (and ``pa.array`` of Python objects) imports pandas where it is
installed, to ask whether its input is a pandas object: 0.4 s of a fresh process's first
batch. Everything on the way from ``index.json`` to a batch reads Arrow through these
functions instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


class StringColumn:
    """Fast access to one string of an Arrow string column (numpy views of its buffers; a
    pyarrow scalar per access would cost several microseconds). Nothing is copied or
    scanned: a string's offsets and validity bit are read when it is asked for."""

    __slots__ = ("_data", "_offsets", "_start", "_valid")

    def __init__(self, column: pa.Array) -> None:
        buffers = column.buffers()
        width = np.int64 if pa.types.is_large_string(column.type) else np.int32
        self._offsets = np.frombuffer(buffers[1], dtype=width)[
            column.offset:column.offset + len(column) + 1] if buffers[1] is not None else \
            np.zeros(1, np.int64)
        self._data = memoryview(buffers[2]) if buffers[2] is not None else memoryview(b"")
        self._valid = np.frombuffer(buffers[0], np.uint8) \
            if buffers[0] is not None and column.null_count else None
        self._start = column.offset

    def __getitem__(self, k: int) -> str | None:
        if self._valid is not None:
            bit = self._start + k
            if not (int(self._valid[bit >> 3]) >> (bit & 7)) & 1:
                return None
        return str(self._data[int(self._offsets[k]):int(self._offsets[k + 1])], "utf-8")



def numpy_values(array: pa.Array, *, fill: int | None = None) -> np.ndarray:
    """The values of a null-free, fixed-width numeric Arrow array: a numpy view of its buffer.

    pyarrow's own ``to_numpy`` (and ``pa.array`` of Python objects) imports pandas where it is
    installed, to ask whether its input is a pandas object: 0.4 s of a fresh process's first
    batch (``fill_null`` too: its ``pa.scalar`` does the same). Everything on the way from
    ``index.json`` to a batch reads Arrow through this, the string builder below and
    :func:`null_mask` instead. Nulls become ``fill`` (a copy); without ``fill`` they are
    refused.
    """
    dtype = np.dtype(str(array.type))
    if len(array) == 0:
        return np.zeros(0, dtype)
    values = np.frombuffer(array.buffers()[1], dtype)[array.offset:array.offset + len(array)]
    if not array.null_count:
        return values
    if fill is None:
        raise ValueError(f"{array.null_count} nulls in an array read as plain values")
    return np.where(null_mask(array), dtype.type(fill), values)


def string_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets rebased to 0, UTF-8 bytes) of a string array: numpy views, no copy of the
    characters (``offsets[k]:offsets[k + 1]`` of the bytes is value ``k``; a null's is
    empty)."""
    width = np.int64 if pa.types.is_large_string(column.type) else np.int32
    buffers = column.buffers()
    if buffers[1] is None:
        return np.zeros(len(column) + 1, np.int64), np.zeros(0, np.uint8)
    offsets = np.frombuffer(buffers[1], width)[column.offset:column.offset + len(column) + 1]
    first, last = int(offsets[0]), int(offsets[-1])
    data = np.frombuffer(buffers[2], np.uint8)[first:last] if buffers[2] is not None and \
        last > first else np.zeros(0, np.uint8)
    return offsets.astype(np.int64) - first, data


def contains(data: np.ndarray, pattern: bytes) -> bool:
    """Whether the bytes ``data`` contain ``pattern`` anywhere (a megabyte at a time)."""
    step = 1 << 20
    for start in range(0, data.size, step):
        if bytes(data[start:start + step + len(pattern) - 1]).find(pattern) >= 0:
            return True
    return False


def null_mask(column: pa.Array) -> np.ndarray:
    """True where ``column`` is null, read from its validity bitmap (see
    :func:`numpy_values`)."""
    bits = np.unpackbits(np.frombuffer(column.buffers()[0], np.uint8), bitorder="little")
    return bits[column.offset:column.offset + len(column)] == 0



def string_array(values: Sequence[str | None], type_: pa.DataType) -> pa.Array:
    """An Arrow string array built from its buffers (see :func:`numpy_values`)."""
    encoded = [b"" if value is None else value.encode() for value in values]
    offsets = np.zeros(len(encoded) + 1, np.int64 if type_ == pa.large_string() else np.int32)
    np.cumsum([len(item) for item in encoded], out=offsets[1:])
    valid = np.fromiter((value is not None for value in values), bool, len(encoded))
    nulls = len(encoded) - int(valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little").tobytes()) if nulls else None
    return pa.Array.from_buffers(type_, len(encoded), [bitmap, pa.py_buffer(offsets.tobytes()),
                                                       pa.py_buffer(b"".join(encoded))],
                                 null_count=nulls)

