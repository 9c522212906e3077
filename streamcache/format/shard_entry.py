"""One shard's entry in an index, and the rules every entry obeys.

Everything read from an index is untrusted: :meth:`ShardInfo.from_json`, the table built from
an index (format/shard_table.py) and a side file (format/side_table.py) check the type and
range of every field (rows and bytes are integers in ``[0, 2**63)``, checksums ``xxh64:`` plus
16 hex digits, formats known, at most :data:`MAX_SHARDS` shards) and raise
:class:`IndexFormatError` naming the shard and the rule.

A shard written in chunks (several record batches of ``chunk_rows`` rows each, the last one
shorter; see writer.py) also records its chunk layout: ``chunk_rows``, and the size and
checksum of its tail (the Arrow IPC footer and what follows it), so a range reader maps a row
to its chunk without reading any batch header and reads the footer in one verified request
(cache/ranges.py). The three are optional (absent in older indexes and for files written by
others), present together or not at all, and not part of the fingerprint: they describe how
the bytes are laid out, which the checksum already covers, and an older streamcache reads such
an index as before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import IndexFormatError

SHARD_FORMATS = ("arrow", "parquet", "arrow_stream")
MAX_COUNT = 2**63  # rows and bytes are below this (they must fit an int64)
MAX_SHARDS = 2**31 - 1  # the native gather addresses shards with int32
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 64  # compression names
_CHECKSUM = re.compile(r"xxh64:[0-9a-f]{16}")
UNKNOWN = -1  # raw_bytes (or a chunk layout) not recorded, in an int64 column
#: The smallest tail an Arrow IPC file can have: footer length (4 bytes) and magic (6 bytes).
MIN_TAIL_BYTES = 10


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the index records it."""

    path: str  # relative to the index's folder, or an absolute URL
    format: str  # one of SHARD_FORMATS
    rows: int
    bytes: int
    checksum: str | None = None  # "xxh64:<hex>" of the object's bytes; None: size only
    compression: str | None = None  # of the stored buffers, for information
    raw_bytes: int | None = None  # uncompressed size of the data, when known
    chunk_rows: int | None = None  # rows per record batch (the last may have fewer)
    tail_bytes: int | None = None  # bytes of the Arrow IPC footer and what follows it
    tail_checksum: str | None = None  # "xxh64:<hex>" of those tail bytes

    @property
    def chunked(self) -> bool:
        """Whether the index records this shard's chunk layout (range reads by chunk)."""
        return self.chunk_rows is not None

    def to_json(self) -> dict[str, Any]:
        out = {
            "path": self.path, "format": self.format, "rows": self.rows, "bytes": self.bytes,
            "checksum": self.checksum, "compression": self.compression,
            "raw_bytes": self.raw_bytes,
        }
        if self.chunk_rows is not None:  # (absent otherwise: older indexes read the same)
            out.update(chunk_rows=self.chunk_rows, tail_bytes=self.tail_bytes,
                       tail_checksum=self.tail_checksum)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> ShardInfo:
        """A validated shard entry; :class:`IndexFormatError` names the shard and the rule."""
        return cls(*validated_row(obj))


class ShardRow(tuple[Any, ...]):
    """A validated shard entry as a plain tuple of :class:`ShardInfo`'s fields (compact: a
    JSON index of a million shards is parsed into these, not into dicts)."""

    __slots__ = ()


def validated_row(obj: Any) -> ShardRow:
    """Check one JSON shard entry: (path, format, rows, bytes, checksum, compression,
    raw_bytes, chunk_rows, tail_bytes, tail_checksum), each of the right type and range, or
    :class:`IndexFormatError`."""
    if type(obj) is not dict and not isinstance(obj, Mapping):
        raise IndexFormatError(f"a shard entry is a {type(obj).__name__}, not an object")
    path = obj.get("path")
    if type(path) is not str or not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise IndexFormatError(
            f"shard path {path!r} is not a non-empty string of at most {MAX_PATH_CHARS} "
            "characters"
        )
    fmt = obj.get("format")
    if fmt not in SHARD_FORMATS:
        raise IndexFormatError(
            f"shard {path!r} has unknown format {fmt!r}; known: {list(SHARD_FORMATS)}"
        )
    checksum = obj.get("checksum")
    if checksum is not None and not (type(checksum) is str and _CHECKSUM.fullmatch(checksum)):
        raise IndexFormatError(
            f"shard {path!r} has checksum {checksum!r}; expected 'xxh64:' and 16 hex digits"
        )
    compression = obj.get("compression")
    if compression is not None and not (type(compression) is str
                                        and len(compression) <= MAX_NAME_CHARS):
        raise IndexFormatError(f"shard {path!r} has a malformed compression {compression!r}")
    rows, nbytes = _count(obj.get("rows"), path, "rows"), _count(obj.get("bytes"), path, "bytes")
    return ShardRow((path, fmt, rows, nbytes, checksum, compression,
                     _count(obj.get("raw_bytes"), path, "raw_bytes", optional=True),
                     *_chunk_layout(obj, path, fmt, nbytes)))


def _chunk_layout(obj: Any, path: str, fmt: str, nbytes: int,
                  ) -> tuple[int | None, int | None, str | None]:
    """(chunk_rows, tail_bytes, tail_checksum) of an entry: all three or none, in range."""
    values = (obj.get("chunk_rows"), obj.get("tail_bytes"), obj.get("tail_checksum"))
    if values == (None, None, None):
        return None, None, None
    chunk_rows, tail_bytes, tail_checksum = values
    if not (fmt == "arrow" and type(chunk_rows) is int and 1 <= chunk_rows < MAX_COUNT
            and type(tail_bytes) is int and MIN_TAIL_BYTES <= tail_bytes <= nbytes
            and type(tail_checksum) is str and _CHECKSUM.fullmatch(tail_checksum)):
        raise IndexFormatError(
            f"shard {path!r} has a malformed chunk layout (chunk_rows={chunk_rows!r}, "
            f"tail_bytes={tail_bytes!r}, tail_checksum={tail_checksum!r}); it must be an "
            f"'arrow' shard with chunk_rows >= 1, {MIN_TAIL_BYTES} <= tail_bytes <= "
            "bytes and an 'xxh64:' checksum, all three or none: rebuild the index"
        )
    return chunk_rows, tail_bytes, tail_checksum


def shard_entry_hook(obj: dict[str, Any]) -> Any:
    """A ``json.loads`` object hook: each shard entry becomes a validated :class:`ShardRow` as
    soon as it is parsed (so the parse holds no dict per shard)."""
    if "path" in obj and "rows" in obj and "format" in obj:
        return validated_row(obj)
    return obj


def _count(value: Any, path: str, key: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value < MAX_COUNT:
        raise IndexFormatError(
            f"shard {path!r} has {key}={value!r}; it must be an integer in [0, 2**63)"
        )
    return value


def exact_sum(values: np.ndarray) -> int:
    """The exact sum of int64 values in [0, 2**63), without int64 overflow."""
    high = int((values >> 32).sum(dtype=np.int64))
    low = int((values & 0xFFFFFFFF).sum(dtype=np.int64))
    return (high << 32) + low



def check_chunk_columns(formats: np.ndarray, nbytes: np.ndarray, chunk_rows: np.ndarray,
                        tail_bytes: np.ndarray, tail_valid: np.ndarray | None, where: str,
                        entry: Any = None) -> None:
    """Chunk layouts (chunk rows, tail bytes, whether a tail checksum is recorded, -1 or
    False for none) are all three or none, an 'arrow' shard's, in range (the tail
    checksums' form is checked with their values). ``entry(k)``, when given, names the
    first offending shard.

    Raises:
        IndexFormatError: naming the shard (or its number) and the rule.
    """
    known = chunk_rows != UNKNOWN
    tails = tail_bytes != UNKNOWN
    checksums = np.ones(known.size, bool) if tail_valid is None else tail_valid
    if not (known.any() or tails.any() or (tail_valid is not None and tail_valid.any())):
        return
    if (known == tails).all() and (known == checksums).all() and (
            (chunk_rows[known] >= 1).all() and (tail_bytes[known] >= MIN_TAIL_BYTES).all()
            and (tail_bytes[known] <= nbytes[known]).all()
            and (formats[known] == SHARD_FORMATS.index("arrow")).all()):
        return
    for k in np.flatnonzero(known | tails | checksums).tolist():
        if entry is not None:
            try:
                validated_row(entry(k).to_json())
            except IndexFormatError as exc:
                raise IndexFormatError(f"{where}: {exc}") from None
        elif not (known[k] and tails[k] and checksums[k] and chunk_rows[k] >= 1
                  and MIN_TAIL_BYTES <= tail_bytes[k] <= nbytes[k]
                  and formats[k] == SHARD_FORMATS.index("arrow")):
            raise IndexFormatError(
                f"{where}: shard {k} has a malformed chunk layout (chunk_rows="
                f"{int(chunk_rows[k])}, tail_bytes={int(tail_bytes[k])}, a tail checksum: "
                f"{bool(checksums[k])}); it must be an 'arrow' shard with chunk_rows >= 1, "
                f"{MIN_TAIL_BYTES} <= tail_bytes <= bytes and an 'xxh64:' checksum, all "
                "three or none: rebuild the index")
    raise IndexFormatError(f"{where}: a chunk layout is malformed")  # (not reached)

