"""The pure-Python twin of csrc/ipc.cpp: an Arrow IPC file's record batches from its bytes.

Same rules, same outputs, same errors as the native walk (see ``csrc/ipc.h``); a property
test holds the two together on written and damaged files.
"""

from __future__ import annotations

import numpy as np

from ._twin_checks import CORRUPT, INVALID, OK, Status

UNSUPPORTED = -2  # the item of an INVALID status: a file the walk does not read
_MAGIC = b"ARROW1"
_CONTINUATION = 0xFFFFFFFF
_RECORD_BATCH = 3
_BLOCK_BYTES = 24


class _Malformed(Exception):
    pass


class _Flat:
    """A flatbuffer inside ``data[start:start + size]``, every read bounds-checked."""

    def __init__(self, data: memoryview, start: int, size: int) -> None:
        self.data, self.start, self.size = data, start, size

    def _int(self, at: int, width: int, signed: bool) -> int:
        if at < 0 or at > self.size or self.size - at < width:
            raise _Malformed
        where = self.start + at
        return int.from_bytes(self.data[where:where + width], "little", signed=signed)

    def u8(self, at: int) -> int:
        return self._int(at, 1, False)

    def u16(self, at: int) -> int:
        return self._int(at, 2, False)

    def u32(self, at: int) -> int:
        return self._int(at, 4, False)

    def i32(self, at: int) -> int:
        return self._int(at, 4, True)

    def i64(self, at: int) -> int:
        return self._int(at, 8, True)

    def field(self, table: int, field_id: int) -> int:
        vtable = table - self.i32(table)
        if vtable < 0 or vtable >= self.size:
            raise _Malformed
        slot = 4 + 2 * field_id
        if slot + 2 > self.u16(vtable):
            return 0
        offset = self.u16(vtable + slot)
        return 0 if offset == 0 else table + offset

    def follow(self, at: int) -> int:
        target = at + self.u32(at)
        if target >= self.size:
            raise _Malformed
        return target

    def vector(self, at: int, element: int) -> tuple[int, int]:
        vec = self.follow(at)
        count = self.u32(vec)
        if count * element > self.size - vec - 4:
            raise _Malformed
        return vec + 4, count


def _batch(data: memoryview, b: int, offset: int, meta: int, body: int, want_nodes: int,
           want_buffers: int) -> Status | tuple[int, list[int], list[int]]:
    prefix = _Flat(data, offset, meta)
    try:
        first = prefix.u32(0)
        start, length = 4, prefix.i32(0)
        if first == _CONTINUATION:
            start, length = 8, prefix.i32(4)
    except _Malformed:
        return CORRUPT, b, "its message is shorter than its prefix"
    if length <= 0 or length > meta - start:
        return CORRUPT, b, "its message length does not fit its block"
    msg = _Flat(data, offset + start, length)
    try:
        root = msg.follow(0)
        type_at, header_at, body_at = (msg.field(root, i) for i in (1, 2, 3))
    except _Malformed:
        return CORRUPT, b, "its message is malformed"
    try:
        if type_at == 0 or header_at == 0:
            raise _Malformed
        kind = msg.u8(type_at)
    except _Malformed:
        return CORRUPT, b, "its message has no header"
    if kind != _RECORD_BATCH:
        return INVALID, UNSUPPORTED, "a message that is not a record batch"
    try:
        body_length = msg.i64(body_at) if body_at else 0
    except _Malformed:
        return CORRUPT, b, "its message is malformed"
    if body_length != body:
        return CORRUPT, b, "its body length differs from the footer's"
    try:
        batch = msg.follow(header_at)
        length_at, nodes_at, buffers_at, compression_at = (msg.field(batch, i)
                                                           for i in range(4))
    except _Malformed:
        return CORRUPT, b, "its record batch header is malformed"
    if compression_at:
        return INVALID, UNSUPPORTED, "a compressed record batch"
    try:
        rows = msg.i64(length_at) if length_at else 0
    except _Malformed:
        return CORRUPT, b, "its row count is malformed"
    if rows < 0:
        return CORRUPT, b, "a negative row count"
    try:
        first_node, node_count = msg.vector(nodes_at, 16) if nodes_at else (0, 0)
        first_buffer, buffer_count = msg.vector(buffers_at, 16) if buffers_at else (0, 0)
    except _Malformed:
        return CORRUPT, b, "its node or buffer list does not fit its message"
    if node_count != want_nodes or buffer_count != want_buffers:
        return CORRUPT, b, (f"it has {node_count} field nodes and {buffer_count} buffers; the "
                            f"schema has {want_nodes} and {want_buffers}")
    nodes: list[int] = []
    for i in range(node_count):
        length_, nulls = msg.i64(first_node + 16 * i), msg.i64(first_node + 16 * i + 8)
        if length_ < 0 or nulls < 0 or nulls > length_:
            return CORRUPT, b, "a field node's counts are impossible"
        nodes += [length_, nulls]
    buffers: list[int] = []
    for i in range(buffer_count):
        at, size = msg.i64(first_buffer + 16 * i), msg.i64(first_buffer + 16 * i + 8)
        if at < 0 or size < 0 or at > body or size > body - at:
            return CORRUPT, b, "a buffer lies outside its batch's body"
        if at % 8:
            return CORRUPT, b, "a buffer is not 8-byte aligned in its batch's body"
        buffers += [offset + meta + at, size]
    return rows, nodes, buffers


def ipc_record_batches(file: np.ndarray, nodes_per_batch: int, buffers_per_batch: int,
                       ) -> tuple[int, int, str, np.ndarray, np.ndarray, np.ndarray]:
    """See csrc/ipc.h."""
    empty = np.zeros(0, dtype=np.int64)
    data = np.ascontiguousarray(file, dtype=np.uint8).data.cast("B")
    size = len(data)
    if size < 18 or bytes(data[:6]) != _MAGIC or bytes(data[size - 6:]) != _MAGIC:
        return CORRUPT, -1, "it does not begin and end like an Arrow IPC file", empty, empty, empty
    footer_length = int.from_bytes(data[size - 10:size - 6], "little", signed=True)
    if footer_length <= 0 or footer_length > size - 18:
        return CORRUPT, -1, "its footer length does not fit the file", empty, empty, empty
    footer_start = size - 10 - footer_length
    footer = _Flat(data, footer_start, footer_length)
    try:
        root = footer.follow(0)
        dictionaries_at, batches_at = footer.field(root, 2), footer.field(root, 3)
    except _Malformed:
        return CORRUPT, -1, "its footer is malformed", empty, empty, empty
    if dictionaries_at:
        try:
            _, count = footer.vector(dictionaries_at, _BLOCK_BYTES)
        except _Malformed:
            return (CORRUPT, -1, "its footer's dictionary list does not fit it", empty, empty,
                    empty)
        if count:
            return INVALID, UNSUPPORTED, "dictionary batches", empty, empty, empty
    try:
        first, count = footer.vector(batches_at, _BLOCK_BYTES) if batches_at else (0, 0)
    except _Malformed:
        return CORRUPT, -1, "its footer's record batch list does not fit it", empty, empty, empty
    rows, nodes, buffers = [], [], []
    for b in range(count):
        at = first + _BLOCK_BYTES * b
        offset, meta, body = footer.i64(at), footer.i32(at + 8), footer.i64(at + 16)
        if (offset < 8 or meta < 8 or body < 0 or offset > footer_start
                or meta > footer_start - offset or body > footer_start - offset - meta):
            return CORRUPT, b, "its block lies outside the file's data", empty, empty, empty
        found = _batch(data, b, offset, meta, body, nodes_per_batch, buffers_per_batch)
        if len(found) == 3 and isinstance(found[2], str):
            return (*found, empty, empty, empty)
        batch_rows, batch_nodes, batch_buffers = found
        rows.append(batch_rows)
        nodes += batch_nodes
        buffers += batch_buffers
    as_array = [np.array(v, dtype=np.int64) for v in (rows, nodes, buffers)]
    return OK, -1, "", *as_array  # type: ignore[return-value]


def check_ipc_offsets(file: np.ndarray, at: np.ndarray, count: np.ndarray,
                      values_bytes: np.ndarray, elem_size: int) -> Status:
    """See csrc/ipc.h."""
    if not at.size == count.size == values_bytes.size:
        return INVALID, -1, "at, count and values_bytes must hold one entry per batch"
    if elem_size <= 0:
        return INVALID, -1, "elem_size must be positive"
    size = file.size
    for b, (where, n, values) in enumerate(zip(at.tolist(), count.tolist(),
                                               values_bytes.tolist(), strict=True)):
        if where < 0 or where % 8 or n < 0 or values < 0 or where > size \
                or n + 1 > (size - where) // 8:
            return CORRUPT, b, "its offsets do not fit the file or are not aligned"
        offsets = file[where:where + 8 * (n + 1)].view("<i8")
        if offsets[0] < 0 or bool((offsets[1:] < offsets[:-1]).any()):  # (no diff: overflow)
            return CORRUPT, b, "its offsets decrease or start below 0"
        if int(offsets[-1]) > values // elem_size:
            return CORRUPT, b, "its offsets run past its values"
    return OK, -1, ""
