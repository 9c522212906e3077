"""The columns of a shard of many record batches, located in the file's own bytes.

Opening a chunked shard read in place (ShardWriter's chunks of 64 KiB: 672 record batches in a
64 MB shard of 100 KB rows) through pyarrow built an Arrow object per batch and column, then a
pair of numpy views of each: 12-30 ms a shard, on the reader threads a cold first batch waits
for. Here one native walk of the file (csrc/ipc.h) gives every batch's row count, field nodes
and buffer places, the offsets are checked in one native pass per column, and the views are
slices of one array over the mapping: 5-8 ms a shard of 672 chunks against 28 (most of it the
first touch of each message's page in a fresh mapping; the walk itself is under 1 ms).

It is an accelerator only: where it does not apply (another backend, a type it does not lay
out, compressed bodies, a column with nulls or of another type than its field, str fields,
whose UTF-8 pyarrow checks) or finds anything wrong, it gives None and the reader reads the
file with pyarrow, which reads it or raises the error that says what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from .. import _native
from ..errors import StreamcacheError
from .schema import Field


def _counts(t: pa.DataType) -> tuple[int, int] | None:
    """(field nodes, buffers) a column of type ``t`` has in an IPC record batch, or None."""
    if pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t) or pa.types.is_list(t):
        inner = _counts(t.value_type)
        own = 1 if pa.types.is_fixed_size_list(t) else 2  # validity (and offsets)
        return None if inner is None else (1 + inner[0], own + inner[1])
    if (pa.types.is_large_binary(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_string(t)):
        return 1, 3  # validity, offsets, values
    if pa.types.is_fixed_size_binary(t) or ((pa.types.is_integer(t) or pa.types.is_floating(t)
                                            or pa.types.is_temporal(t)) and t.bit_width % 8 == 0):
        return 1, 2  # validity, values
    return None


def located_columns(mapped: pa.Buffer, schema: pa.Schema, fields: Sequence[Field],
                    ) -> tuple[list[int], dict[str, _native.ColumnChunks]] | None:
    """(rows of each record batch, each field's chunks) of the IPC file ``mapped`` (its whole
    bytes) whose schema is ``schema``, or None where the caller must read it with pyarrow."""
    if _native.backend_name() != "native" or len(set(schema.names)) != len(schema.names):
        return None
    counts = [_counts(f.type) for f in schema]
    if any(c is None for c in counts) or any(f.kind == "str" for f in fields):
        return None
    node_at = np.cumsum([0] + [c[0] for c in counts if c is not None])
    buffer_at = np.cumsum([0] + [c[1] for c in counts if c is not None])
    file = np.frombuffer(mapped, dtype=np.uint8)
    try:
        rows, nodes, buffers = _native.ipc_record_batches(file, int(node_at[-1]),
                                                          int(buffer_at[-1]))
    except StreamcacheError:
        return None
    if len(rows) < 2 or (nodes[:, node_at[:-1], 0] != rows[:, None]).any():
        return None  # (one batch: pyarrow opens it as fast)
    whole = file[:file.size // 8 * 8].view(np.int64)
    columns: dict[str, _native.ColumnChunks] = {}
    for field in fields:
        if field.name not in schema.names:
            return None
        index = schema.names.index(field.name)
        if not schema.field(index).type.equals(field.arrow_type()):
            return None
        mine = slice(int(node_at[index]), int(node_at[index + 1]))
        if nodes[:, mine, 1].any():
            return None  # nulls
        last = buffers[:, int(buffer_at[index + 1]) - 1]  # (values: the column's last buffer)
        nested = node_at[index + 1] - node_at[index] > 1  # a list: its child node, as pyarrow
        child = nodes[:, int(node_at[index]) + 1, 0] if nested else None  # checks it
        if field.fixed_width:
            size = rows * field.row_bytes
            if (last[:, 1] < size).any() or (child is not None and (
                    child * field.numpy_dtype.itemsize != size).any()):
                return None
            columns[field.name] = _native.ColumnChunks(
                [file[at:at + n] for at, n in zip(last[:, 0].tolist(), size.tolist(), strict=True)])
            continue
        values_bytes = np.ascontiguousarray(last[:, 1])
        if child is not None:
            if (values_bytes < child * field.elem_size).any():
                return None
            values_bytes = child * field.elem_size  # (offsets must end within the child)
        values = [file[at:at + length] for at, length in last.tolist()]
        offsets_at = np.ascontiguousarray(buffers[:, int(buffer_at[index]) + 1, 0])
        if ((buffers[:, int(buffer_at[index]) + 1, 1] < (rows + 1) * 8).any()):
            return None
        try:
            _native.check_ipc_offsets(file, offsets_at, rows, values_bytes, field.elem_size)
        except StreamcacheError:
            return None
        offsets = [whole[at // 8:at // 8 + n + 1] for at, n in zip(offsets_at.tolist(),
                                                                      rows.tolist(), strict=True)]
        columns[field.name] = _native.ColumnChunks(values, offsets)
    return rows.tolist(), columns


__all__ = ["located_columns"]
