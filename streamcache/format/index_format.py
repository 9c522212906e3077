"""The on-disk format of ``index.json``: its name and versions, the caps on an untrusted
document, its fingerprint, and the strict decoding of what a writer of the folder controls.

An index is untrusted input: a document over its cap (the caller's, see
:data:`streamcache.format.index.MAX_INDEX_BYTES`) or nested deeper than
:data:`MAX_JSON_DEPTH`, an unknown version, a value of the wrong type or range, or a shard
table side file over its caps is an :class:`IndexFormatError` naming the URL and what to do.
:func:`~streamcache.format.index.parse_index` builds the index from the parts decoded here.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import ChecksumMismatchError, IndexFormatError
from ..remote import storage
from .checksum import checksum_bytes, verify_bytes
from .node_table import TableKey, open_node_table
from .schema import Schema
from .shard_entry import ShardInfo, shard_entry_hook
from .shard_table import ShardTable
from .side_table import decode_side_table
from .table_layout import LayoutWriter, memory_writer, open_memory

FORMAT_NAME = "streamcache-index"
FORMAT_VERSION = 1  # shards listed in index.json
TABLE_FORMAT_VERSION = 2  # shards in a Parquet side file (large indexes)
READ_VERSIONS = (FORMAT_VERSION, TABLE_FORMAT_VERSION)
MAX_SHARD_TABLE_BYTES = 4 << 30  # the side file as stored
MAX_SHARD_TABLE_DECODED = 16 << 30  # and decoded, at most (see side_table.decoded_cap)
MAX_JSON_DEPTH = 32  # an index nests 4 deep; deeper is hostile or damaged
SHARD_TABLE_MIN_SHARDS = 10_000  # from this many shards on, the table is a Parquet side file
SHARD_TABLE_PREFIX = "_streamcache-shards-"  # '_': data tools (Spark, pyarrow) skip it

ReadCapped = Callable[[str, int], bytes]


def uses_side_table(num_shards: int) -> bool:
    return num_shards >= SHARD_TABLE_MIN_SHARDS


def compute_fingerprint(schema: Schema, shards: Sequence[ShardInfo]) -> str:
    """A digest of what decides the data: schema, shard paths, formats, rows, sizes, checksums.

    A small index digests its JSON shard list (format version 1); a large one digests the
    shard table's columns (version 2), without a Python object per shard.
    """
    if not uses_side_table(len(shards)):
        return fingerprint_inline(schema, shards)
    table = shards if isinstance(shards, ShardTable) else ShardTable.from_infos(shards)
    return fingerprint_table(schema, table)


def fingerprint_table(schema: Schema, shards: ShardTable | str) -> str:
    """The fingerprint of a version-2 index: its schema and its table's digest (given, or
    of ``shards``)."""
    content = {"version": TABLE_FORMAT_VERSION, "schema": schema.to_json(),
               "shards": shards if isinstance(shards, str) else shards.digest()}
    return checksum_bytes(json.dumps(content, sort_keys=True).encode())


def fingerprint_inline(schema: Schema, shards: Sequence[ShardInfo]) -> str:
    """The fingerprint of a version-1 index (over the JSON shard list)."""
    table = shards if isinstance(shards, ShardTable) else ShardTable.from_infos(shards)
    content = {
        "version": FORMAT_VERSION,
        "schema": schema.to_json(),
        "shards": table.identity_rows(),
    }
    return checksum_bytes(json.dumps(content, sort_keys=True).encode())


def decode_document(raw: bytes, url: str, max_bytes: int) -> dict[str, Any]:
    """The JSON object of an index document of at most ``max_bytes``, checked for its size,
    depth and format name before it is parsed."""
    if len(raw) > max_bytes:
        raise IndexFormatError(
            f"{url} is over {max_bytes} bytes (the cap on index.json); rebuild it with "
            "`streamcache index`, which stores a large shard table as a Parquet side file"
        )
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise IndexFormatError(
            f"{url} nests {depth} levels deep, over the cap of {MAX_JSON_DEPTH}; it is not a "
            "streamcache index (damaged or hostile): rebuild it with `streamcache index`"
        )
    try:
        obj = json.loads(raw, object_hook=shard_entry_hook)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise IndexFormatError(
            f"{url} is not valid JSON ({exc}); the index is corrupt: rebuild it with "
            "`streamcache index` or rewrite the dataset"
        ) from exc
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise IndexFormatError(f"{url} is not a streamcache index (no 'format': '{FORMAT_NAME}')")
    return obj


def decode_header(obj: dict[str, Any], url: str) -> tuple[int, Schema, str, float]:
    """(version, schema, recorded fingerprint, created) of a decoded index document."""
    version = obj.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise IndexFormatError(
            f"{url} has index format version {version!r}; this streamcache reads versions "
            f"{list(READ_VERSIONS)}: upgrade streamcache or rebuild the index"
        )
    try:
        schema = Schema.from_json(obj["schema"])
        recorded = obj["fingerprint"]
        if not isinstance(recorded, str):
            raise TypeError(f"'fingerprint' is a {type(recorded).__name__}, not a string")
        created = obj.get("created", 0.0)
        if type(created) not in (int, float) or not math.isfinite(created):
            raise TypeError(f"'created' is {created!r}, not a finite number")
    except (KeyError, TypeError, ValueError) as exc:
        raise IndexFormatError(f"{url} is missing or has a malformed key: {exc}") from exc
    return version, schema, str(recorded), float(created)


def json_depth(raw: bytes) -> int:
    """How deeply a JSON document nests arrays and objects (brackets inside strings excluded).

    Vectorized: the cost is a few passes over the bytes, never a recursion.
    """
    data = np.frombuffer(raw, dtype=np.uint8)
    quotes = np.flatnonzero(data == ord('"'))
    slashes = np.flatnonzero(data == ord("\\"))
    if quotes.size and slashes.size:  # a quote is escaped by an odd run of backslashes
        breaks = np.flatnonzero(np.diff(slashes) != 1)
        run_starts = slashes[np.concatenate(([0], breaks + 1))]
        run_ends = slashes[np.concatenate((breaks, [slashes.size - 1]))]
        at = np.minimum(np.searchsorted(run_ends, quotes - 1), run_ends.size - 1)
        ends_here = run_ends[at] == quotes - 1
        escaped = ends_here & ((run_ends[at] - run_starts[at] + 1) % 2 == 1)
        quotes = quotes[~escaped]
    steps = _BRACKET_STEPS[data]
    brackets = np.flatnonzero(steps)
    outside = np.searchsorted(quotes, brackets) % 2 == 0  # an even number of quotes before
    return int(np.cumsum(steps[brackets[outside]], dtype=np.int64).max(initial=0))


_BRACKET_STEPS = np.zeros(256, dtype=np.int8)
_BRACKET_STEPS[[ord("["), ord("{")]] = 1
_BRACKET_STEPS[[ord("]"), ord("}")]] = -1


def decode_inline_table(obj: dict[str, Any], url: str) -> ShardTable:
    """The shards listed in a version-1 index document."""
    if "shards" not in obj:
        raise IndexFormatError(f"{url} is missing or has a malformed key: 'shards'")
    return ShardTable.from_json(obj.pop("shards"))  # (the entries are freed once read)


@dataclass(frozen=True)
class SideEntry:
    """The ``shard_table`` entry of a version-2 index: its side file and what it holds."""

    name: str
    bytes: int
    checksum: str
    shards: Any  # the stated shard count (checked against the table; None: not stated)


def side_entry(obj: dict[str, Any], url: str) -> SideEntry:
    """The validated ``shard_table`` entry of a version-2 index document."""
    if "shard_table" not in obj:
        raise IndexFormatError(f"{url} is missing or has a malformed key: 'shard_table'")
    side = obj["shard_table"]
    if not isinstance(side, dict):
        raise IndexFormatError(f"{url}: 'shard_table' is a {type(side).__name__}, not an object")
    name, size, checksum = side.get("path"), side.get("bytes"), side.get("checksum")
    if not (isinstance(name, str) and name.startswith(SHARD_TABLE_PREFIX) and "/" not in name
            and type(size) is int and 0 <= size <= MAX_SHARD_TABLE_BYTES
            and isinstance(checksum, str)):
        raise IndexFormatError(
            f"{url}: 'shard_table' must name a '{SHARD_TABLE_PREFIX}*' file beside it with its "
            f"bytes (at most {MAX_SHARD_TABLE_BYTES}) and checksum; got {side!r}"
        )
    return SideEntry(name, size, checksum, side.get("shards"))


def open_side_table(obj: dict[str, Any], url: str, schema: Schema, recorded: str,
                    read: ReadCapped | None, table_cache: str | None) -> ShardTable:
    """The shard table of a version-2 index document: the node copy in ``table_cache``
    (built from the side file, once per node and version, if there is none: see
    format/node_table.py), else the side file decoded in memory. Either way the table is
    the side file's, verified (checksum, values, fingerprint) before it is used."""
    entry = side_entry(obj, url)
    where = storage.join(posixpath.dirname(url), entry.name)

    def build(writer: LayoutWriter) -> dict[str, Any]:
        data = read_side_file(where, entry, url, read)
        facts = decode_side_table(data, where, writer, MAX_SHARD_TABLE_DECODED)
        del data
        if entry.shards is not None and entry.shards != facts.shards:
            raise IndexFormatError(f"{url} says its shard table holds {entry.shards!r} "
                                   f"shards, {where} holds {facts.shards}: rebuild the index")
        check_fingerprint(url, recorded, fingerprint_table(schema, facts.digest))
        return {"shards": facts.shards, "digest": facts.digest,
                "paths_outside": facts.paths_outside}

    if table_cache is not None:
        key = TableKey(recorded, entry.checksum, entry.bytes)
        table = open_node_table(table_cache, key, build)
        pa.default_memory_pool().release_unused()  # a build's pages, back to the OS
        if table is not None:
            return table
    buffer, writer = memory_writer()
    metadata = build(writer)
    writer.finish(metadata["shards"], metadata)
    table = open_memory(buffer, where)
    pa.default_memory_pool().release_unused()  # the decoding's pages, back to the OS
    return table


def check_fingerprint(url: str, recorded: str, actual: str) -> None:
    """Refuse an index whose recorded fingerprint is not its content's."""
    if actual != recorded:
        raise IndexFormatError(
            f"{url}: the recorded fingerprint {recorded} does not match its content "
            f"({actual}); the index was edited or damaged: rebuild it"
        )


def read_side_file(where: str, entry: SideEntry, url: str, read: ReadCapped | None) -> bytes:
    """The side file's bytes, of the size and checksum the index records."""
    data = (read or _fsspec_read)(where, entry.bytes)
    if len(data) != entry.bytes:
        raise IndexFormatError(f"{where} is {len(data)} bytes, {url} says {entry.bytes}; the "
                               "shard table was rewritten or damaged: rebuild the index")
    try:
        verify_bytes(data, entry.checksum, what=where)
    except ChecksumMismatchError as exc:
        raise IndexFormatError(f"{where} is not a readable shard table ({exc}): rebuild the "
                               "index") from exc
    return data


def _fsspec_read(url: str, limit: int) -> bytes:
    fs, path = storage.filesystem(url)
    try:
        return read_capped(fs, path, limit)
    except FileNotFoundError:
        raise IndexFormatError(f"{url}, the index's shard table, is missing: rebuild the "
                               "index") from None


def read_capped(fs: Any, path: str, limit: int) -> bytes:
    """An object's bytes, reading at most ``limit + 1`` of them (a larger object's result is
    longer than ``limit``, whatever its size)."""
    return bytes(fs.cat_file(path, start=0, end=limit + 1))
