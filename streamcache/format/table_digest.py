"""The digest of a shard table's columns: what the fingerprint of a large index covers.

A column is digested from its buffers, without a Python object per shard; a side file is
digested the same way while it is decoded (format/side_table.py), so a table decoded from it
and one built in memory have the same digest.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .arrow_arrays import null_mask, string_buffers
from .checksum import checksum_bytes


def fixed_digest(column: np.ndarray) -> str:
    """A checksum of a fixed-width column's bytes (a part of :meth:`ShardTable.digest`)."""
    return checksum_bytes(np.ascontiguousarray(column).tobytes())


def table_digest(count: int, parts: Sequence[str]) -> str:
    """:meth:`ShardTable.digest` from its parts: the formats, rows, bytes and raw bytes
    columns (:func:`fixed_digest`), then the paths, checksums and compressions
    (:func:`strings_digest`)."""
    return checksum_bytes(json.dumps([count, *parts]).encode())



def strings_digest(column: pa.Array) -> str:
    """A checksum of a string column: lengths (-1 for null) and the concatenated characters
    (digested in place, without a copy)."""
    offsets, data = string_buffers(column)
    return strings_digest_of(offsets, ~null_mask(column) if column.null_count else None, data)


def strings_digest_of(offsets: np.ndarray, valid: np.ndarray | None, data: Any) -> str:
    """:func:`strings_digest` of a column given as its offsets (from 0), validity (None: no
    nulls) and bytes."""
    lengths = np.diff(offsets).astype(np.int64)
    if valid is not None:
        if (lengths[~valid] != 0).any():  # a null that spans bytes adds none of them
            data = b"".join(bytes(data[int(offsets[k]):int(offsets[k + 1])])
                            for k in np.flatnonzero(valid).tolist())
        lengths[~valid] = -1
    return checksum_bytes((checksum_bytes(lengths) + checksum_bytes(data)).encode())
