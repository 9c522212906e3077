"""The dataset index: ``index.json`` beside the shards.

It lists every shard (path relative to the index, format, rows, bytes, checksum), the schema
and a fingerprint of the whole, under a format version. From :data:`SHARD_TABLE_MIN_SHARDS`
shards on, the shard list is a Parquet side file beside it (format version 2); in memory it is
always a columnar :class:`~streamcache.format.shard_table.ShardTable`.

An index is untrusted input. Loading is strict: a missing key, an unknown version, a value of
the wrong type or range, a document over :data:`MAX_INDEX_BYTES` or nested deeper than
:data:`MAX_JSON_DEPTH`, a fingerprint that does not match the content, or a shard path outside
the index's folder (see :func:`check_shard_paths`) is an :class:`IndexFormatError`.

:func:`build_index` makes an index for Parquet or Arrow IPC files (or streams, such as Hugging
Face ``save_to_disk`` writes) by anyone, reading only their footers (in parallel), so existing
data streams without conversion.
"""

from __future__ import annotations

import argparse
import json
import math
import posixpath
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from ..errors import (
    ChecksumMismatchError,
    EmptyDatasetError,
    IndexFormatError,
    IndexNotFoundError,
    SchemaError,
    SourceError,
)
from ..remote import storage
from ..remote.fetch import FetchOptions
from ..remote.fetch import read_capped as fetch_capped
from ..units import plural
from .checksum import checksum_bytes, checksum_file, verify_bytes
from .columns import field_from_arrow
from .schema import Schema
from .shard_table import MAX_SHARDS, SHARD_FORMATS, ShardInfo, ShardTable, shard_entry_hook

INDEX_NAME = "index.json"
FORMAT_NAME = "streamcache-index"
FORMAT_VERSION = 1  # shards listed in index.json
TABLE_FORMAT_VERSION = 2  # shards in a Parquet side file (large indexes)
READ_VERSIONS = (FORMAT_VERSION, TABLE_FORMAT_VERSION)
MAX_INDEX_BYTES = 256 << 20  # index.json; a larger shard table belongs in a side file
MAX_SHARD_TABLE_BYTES = 4 << 30  # the side file as stored
MAX_SHARD_TABLE_DECODED = 16 << 30  # and decoded (checked from its metadata, before decoding)
MAX_JSON_DEPTH = 32  # an index nests 4 deep; deeper is hostile or damaged
SHARD_TABLE_MIN_SHARDS = 10_000  # from this many shards on, the table is a Parquet side file
SHARD_TABLE_PREFIX = "_streamcache-shards-"  # '_': data tools (Spark, pyarrow) skip it
_PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".arrows")


@dataclass(frozen=True)
class DatasetIndex:
    """The parsed ``index.json`` of a dataset. ``url`` is where it was loaded from.

    ``shards`` may be given as any sequence of :class:`ShardInfo`; it is kept as a columnar
    :class:`ShardTable` (no Python object per shard).
    """

    schema: Schema
    shards: Sequence[ShardInfo]
    fingerprint: str = ""
    url: str = ""
    created: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.from_infos(self.shards))
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", compute_fingerprint(self.schema, self.shards))

    @property
    def shard_table(self) -> ShardTable:
        return cast(ShardTable, self.shards)

    @property
    def num_samples(self) -> int:
        return self.shard_table.total_rows

    @property
    def total_bytes(self) -> int:
        return int(self.shard_table.nbytes.sum(dtype=np.uint64))

    @property
    def shard_rows(self) -> np.ndarray:
        """Every shard's row count (int64, read-only)."""
        return self.shard_table.rows

    @property
    def root(self) -> str:
        """The folder URL that relative shard paths are resolved against."""
        return posixpath.dirname(self.url) if self.url.endswith(INDEX_NAME) else self.url

    def shard_url(self, shard: int | ShardInfo) -> str:
        info = self.shards[shard] if isinstance(shard, int) else shard
        return storage.join(self.root, info.path)

    @property
    def has_side_table(self) -> bool:
        """Whether the shard table is stored as a Parquet side file (from
        :data:`SHARD_TABLE_MIN_SHARDS` shards on) rather than listed in index.json."""
        return uses_side_table(len(self.shards))

    def to_json(self, shard_table: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The index document; ``shard_table`` names the side file that holds the shards
        (required exactly when :attr:`has_side_table`)."""
        if (shard_table is not None) != self.has_side_table:
            raise ValueError("an index of this size needs a shard table file"
                             if self.has_side_table else "this index lists its shards inline")
        out: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": TABLE_FORMAT_VERSION if self.has_side_table else FORMAT_VERSION,
            # (recomputed: an index loaded from an older layout gets its new layout's digest)
            "fingerprint": compute_fingerprint(self.schema, self.shards),
            "created": self.created or time.time(),
            "num_samples": self.num_samples,
            "schema": self.schema.to_json(),
        }
        if shard_table is None:
            out["shards"] = self.shard_table.to_json()
        else:
            out["shard_table"] = dict(shard_table)
        return out

    def dumps(self, shard_table: Mapping[str, Any] | None = None) -> bytes:
        return (json.dumps(self.to_json(shard_table), indent=1) + "\n").encode()


def uses_side_table(num_shards: int) -> bool:
    return num_shards >= SHARD_TABLE_MIN_SHARDS


def compute_fingerprint(schema: Schema, shards: Sequence[ShardInfo]) -> str:
    """A digest of what decides the data: schema, shard paths, formats, rows, sizes, checksums.

    A small index digests its JSON shard list (format version 1); a large one digests the
    shard table's columns (version 2), without a Python object per shard.
    """
    if not uses_side_table(len(shards)):
        return _fingerprint_inline(schema, shards)
    table = shards if isinstance(shards, ShardTable) else ShardTable.from_infos(shards)
    return _fingerprint_table(schema, table)


def _fingerprint_table(schema: Schema, shards: ShardTable) -> str:
    content = {"version": TABLE_FORMAT_VERSION, "schema": schema.to_json(),
               "shards": shards.digest()}
    return checksum_bytes(json.dumps(content, sort_keys=True).encode())


def _fingerprint_inline(schema: Schema, shards: Sequence[ShardInfo]) -> str:
    """The fingerprint of a version-1 index (over the JSON shard list)."""
    table = shards if isinstance(shards, ShardTable) else ShardTable.from_infos(shards)
    content = {
        "version": FORMAT_VERSION,
        "schema": schema.to_json(),
        "shards": table.identity_rows(),
    }
    return checksum_bytes(json.dumps(content, sort_keys=True).encode())


def index_url(url: str) -> str:
    """The index.json URL for a dataset URL (a folder, or the index file itself)."""
    return url if url.rstrip("/").endswith(INDEX_NAME) else storage.join(url, INDEX_NAME)


ReadCapped = Callable[[str, int], bytes]


def parse_index(raw: bytes, url: str, *, allow_external_paths: bool = False,
                read: ReadCapped | None = None) -> DatasetIndex:
    """Parse and validate index bytes; every problem names ``url`` and what to do.

    Args:
        allow_external_paths: accept shard paths outside the index's folder (absolute paths
            or URLs of the index's own protocol); never a path of another protocol.
        read: ``read(url, limit)`` returns an object's bytes (more than ``limit`` when it is
            larger); used for a shard-table side file (default: fsspec).

    Raises:
        IndexFormatError: malformed, oversized or too deeply nested JSON, a field of the wrong
            type or range, a fingerprint that does not match, a shard path outside the root.
        EmptyDatasetError: no samples.
    """
    obj = _decode_document(raw, url)
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
    shards = _shard_table(obj, url, version, read or _fsspec_read)
    index = DatasetIndex(schema, shards, fingerprint=str(recorded), url=url,
                         created=float(created))
    actual = (_fingerprint_inline(schema, shards) if version == FORMAT_VERSION
              else _fingerprint_table(schema, shards))
    if actual != recorded:
        raise IndexFormatError(
            f"{url}: the recorded fingerprint {recorded} does not match its content "
            f"({actual}); the index was edited or damaged: rebuild it"
        )
    stated = obj.get("num_samples", index.num_samples)
    if stated != index.num_samples or type(stated) is not int:
        raise IndexFormatError(f"{url} says num_samples={stated!r}, its shards hold "
                               f"{index.num_samples}; the index was edited or damaged: rebuild it")
    check_shard_paths(index, allow_external_paths=allow_external_paths)
    if index.num_samples == 0:
        raise EmptyDatasetError(f"the dataset at {url} has no samples")
    return index


def _decode_document(raw: bytes, url: str) -> dict[str, Any]:
    if len(raw) > MAX_INDEX_BYTES:
        raise IndexFormatError(
            f"{url} is over {MAX_INDEX_BYTES} bytes (the cap on index.json); rebuild it with "
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


def _shard_table(obj: dict[str, Any], url: str, version: int, read: ReadCapped,
                 ) -> ShardTable:
    key = "shards" if version == FORMAT_VERSION else "shard_table"
    if key not in obj:
        raise IndexFormatError(f"{url} is missing or has a malformed key: {key!r}")
    if version == FORMAT_VERSION:
        return ShardTable.from_json(obj.pop("shards"))  # (the entries are freed once read)
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
    where = storage.join(posixpath.dirname(url), name)
    data = read(where, size)
    if len(data) != size:
        raise IndexFormatError(f"{where} is {len(data)} bytes, {url} says {size}; the shard "
                               "table was rewritten or damaged: rebuild the index")
    try:
        verify_bytes(data, checksum, what=where)
        meta = pq.read_metadata(pa.BufferReader(data))
        decoded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > MAX_SHARDS or decoded > MAX_SHARD_TABLE_DECODED:
            raise IndexFormatError(
                f"{where} holds {meta.num_rows} shards in {decoded} bytes decoded, over the cap "
                f"of {MAX_SHARDS} shards or {MAX_SHARD_TABLE_DECODED} bytes: rebuild the index"
            )
        table = pq.read_table(pa.BufferReader(data))
    except (ChecksumMismatchError, pa.ArrowInvalid, OSError) as exc:
        raise IndexFormatError(f"{where} is not a readable shard table ({exc}): rebuild the "
                               "index") from exc
    del data
    shards = ShardTable.from_arrow(table, where)
    del table
    if side.get("shards", len(shards)) != len(shards):
        raise IndexFormatError(f"{url} says its shard table holds {side.get('shards')!r} "
                               f"shards, {where} holds {len(shards)}: rebuild the index")
    pa.default_memory_pool().release_unused()  # the decoded file's pages, back to the OS
    return shards


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


# ---------------------------------------------------------------- shard paths


def check_shard_paths(index: DatasetIndex, *, allow_external_paths: bool = False) -> None:
    """Refuse shard paths that leave the dataset's root.

    A relative path must stay under the index's folder (no ``..`` above it); an absolute path
    or URL must lie under that folder too, unless ``allow_external_paths``; even then it must
    use the index's own protocol, so an index on an object store can never name a local file.

    Raises:
        IndexFormatError: naming the first offending path and the option.
    """
    paths = index.shard_table.paths()
    suspicious = pc.or_(pc.or_(pc.starts_with(paths, "/"), pc.match_substring(paths, "://")),
                        pc.match_substring_regex(paths, r"(^|/)\.\.(/|$)"))
    root_protocol, root_path = _split_url(index.root)
    for k in np.flatnonzero(suspicious.to_numpy(zero_copy_only=False)):
        path = paths[int(k)].as_py()
        if not storage.is_absolute_url(path):
            if posixpath.normpath(path).split("/")[0] == "..":
                raise IndexFormatError(
                    f"{index.url}: shard path {path!r} leaves the dataset's folder with '..'; "
                    "name files under the index's folder (or, with allow_external_paths=True, "
                    "by their absolute path or URL)"
                )
            continue
        protocol, location = _split_url(path)
        if protocol == root_protocol and _under(location, root_path):
            continue
        if not allow_external_paths:
            raise IndexFormatError(
                f"{index.url}: shard path {path!r} is outside the dataset's folder "
                f"{index.root}; pass allow_external_paths=True to read shards elsewhere on "
                f"the index's own filesystem ({root_protocol}://)"
            )
        if protocol != root_protocol:
            raise IndexFormatError(
                f"{index.url}: shard path {path!r} is on {protocol}://, the index on "
                f"{root_protocol}://; an index may name external shards on its own filesystem "
                "only, even with allow_external_paths=True: copy the shards beside the index"
            )


def _split_url(url: str) -> tuple[str, str]:
    """(protocol, normalized path): local paths and ``file://`` URLs are ``file``."""
    protocol, sep, rest = url.partition("://")
    if not sep:
        protocol, rest = "file", url
    protocol = "file" if protocol == "local" else protocol
    rest = posixpath.normpath("/" + rest.lstrip("/")) if protocol != "file" else \
        posixpath.normpath(rest)
    return protocol, rest


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def load_index(url: str, storage_options: Mapping[str, Any] | None = None, *,
               allow_external_paths: bool = False, fetch: FetchOptions | None = None,
               ) -> DatasetIndex:
    """Load a dataset's index from a folder URL or an index.json URL.

    ``allow_external_paths``: see :func:`check_shard_paths`. ``fetch``: the stall timeout
    and retries of the reads (see :class:`~streamcache.remote.fetch.FetchOptions`); a read that
    fails raises :class:`~streamcache.remote.fetch.FetchError` naming the URL.
    """
    target = index_url(url)
    fs, path = storage.filesystem(target, storage_options)
    try:
        raw = fetch_capped(storage.unstrip(fs, path), MAX_INDEX_BYTES, options=fetch,
                           storage_options=storage_options)
    except FileNotFoundError:
        raise IndexNotFoundError(
            f"no {INDEX_NAME} at {target}: write the dataset with ShardWriter / "
            "`streamcache convert`, or build an index for existing Parquet/Arrow files with "
            f"`streamcache index {url}`"
        ) from None

    def read(side_url: str, limit: int) -> bytes:
        try:
            return fetch_capped(side_url, limit, options=fetch, storage_options=storage_options)
        except FileNotFoundError:
            raise IndexFormatError(f"{side_url}, the shard table of {target}, is missing: "
                                   "rebuild the index") from None

    return parse_index(raw, storage.unstrip(fs, path), allow_external_paths=allow_external_paths,
                       read=read)


def save_index(index: DatasetIndex, url: str, storage_options: Mapping[str, Any] | None = None,
               ) -> str:
    """Publish ``index`` atomically at ``url`` (folder or index.json); returns its URL.

    From :data:`SHARD_TABLE_MIN_SHARDS` shards on, the shards go to a Parquet side file
    beside index.json, named by its content and published first; index.json names it with
    its size and checksum, and its fingerprint covers the table's content.
    """
    target = index_url(url)
    fs, path = storage.filesystem(target, storage_options)
    side: dict[str, Any] | None = None
    if index.has_side_table:
        sink = pa.BufferOutputStream()
        pq.write_table(index.shard_table.to_arrow(), sink, compression="zstd")
        data = sink.getvalue().to_pybytes()
        checksum = checksum_bytes(data)
        name = f"{SHARD_TABLE_PREFIX}{checksum.partition(':')[2]}.parquet"
        storage.publish_bytes(fs, storage.join(posixpath.dirname(path), name), data)
        side = {"path": name, "bytes": len(data), "checksum": checksum,
                "shards": len(index.shards)}
    storage.publish_bytes(fs, path, index.dumps(side))
    return storage.unstrip(fs, path)


# ---------------------------------------------------------------- indexing existing files


def _shard_format(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(_ARROW_SUFFIXES):
        return "arrow"
    return None


def _hidden(relative: str) -> bool:
    """Spark/Hive side files (_SUCCESS, _metadata, .crc, ._x) are not data."""
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def discover_files(url: str, storage_options: Mapping[str, Any] | None = None,
                   ) -> tuple[Any, str, list[str]]:
    """Data files under a folder (recursively, Hive partitions included) or matching a glob.

    Returns (filesystem, root folder, sorted paths). Side files are skipped.
    """
    fs, path = storage.filesystem(url, storage_options)
    if any(ch in path for ch in "*?["):
        root = path.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0]
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        root = path.rstrip("/")
        saved = _saved_by_hf_datasets(fs, root, url)
        found = saved if saved is not None else [p for p in fs.find(path) if _shard_format(p)]
    elif fs.exists(path):
        root, found = posixpath.dirname(path), [path]
    else:
        raise SourceError(f"nothing at {url}: give a folder, a glob, or a file")
    files = sorted(p for p in found if _shard_format(p) and not _hidden(p[len(root):]))
    if not files:
        raise SourceError(f"no Parquet or Arrow IPC files found at {url}")
    return fs, root, files


HF_STATE = "state.json"  # beside the Arrow files of a Hugging Face `save_to_disk` folder
HF_DATASET_DICT = "dataset_dict.json"  # beside the split folders of a saved DatasetDict
HF_SIDE_FILES = (HF_STATE, "dataset_info.json", HF_DATASET_DICT)  # never data
_MAX_SIDE_JSON_BYTES = 16 << 20


def _saved_by_hf_datasets(fs: Any, root: str, url: str) -> list[str] | None:
    """The data files of a folder written by Hugging Face ``datasets.save_to_disk``, in the
    order its ``state.json`` lists them; None for any other folder.

    Raises:
        SourceError: the folder holds a DatasetDict (several splits: index one), or its
            ``state.json`` is malformed or names a file that is not there.
    """
    if fs.exists(storage.join(root, HF_DATASET_DICT)):
        splits = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)
                        if fs.isdir(p))
        raise SourceError(
            f"{url} holds a Hugging Face DatasetDict (splits {splits}): index one split, e.g. "
            f"`streamcache index {storage.join(url.rstrip('/'), splits[0] if splits else 'train')}`"
        )
    state_path = storage.join(root, HF_STATE)
    if not fs.exists(state_path):
        return None
    try:
        state = json.loads(read_capped(fs, state_path, _MAX_SIDE_JSON_BYTES))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{storage.unstrip(fs, state_path)} is not a Hugging Face datasets "
                          f"state file ({exc}); save the dataset again") from exc
    files = []
    for name in names:
        if not isinstance(name, str) or not _shard_format(name) or "/" in name or \
                name.startswith("."):
            raise SourceError(f"{storage.unstrip(fs, state_path)} lists {name!r}, not an Arrow "
                              "file beside it; save the dataset again")
        files.append(storage.join(root, name))
    missing = [f for f in files if not fs.exists(f)]
    if missing:
        raise SourceError(f"{storage.unstrip(fs, state_path)} lists {missing[0]}, which is "
                          "missing; save the dataset again")
    return files


def _footer_info(fs: Any, path: str, root: str) -> tuple[ShardInfo, pa.Schema, str]:
    fmt = _shard_format(path)
    size = int(fs.size(path))
    relative = path[len(root):].lstrip("/") if path.startswith(root) else storage.unstrip(fs, path)
    with fs.open(path, "rb") as f:
        try:
            if fmt == "parquet":
                meta = pq.ParquetFile(f).metadata
                rows, arrow_schema = meta.num_rows, meta.schema.to_arrow_schema()
                raw = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
                compression = _parquet_compression(meta)
            else:
                fmt, rows, arrow_schema, raw = _arrow_rows(f)
                compression = None
        except (pa.ArrowInvalid, OSError) as exc:
            raise SourceError(
                f"{storage.unstrip(fs, path)} is not a readable {fmt} file: {exc}"
            ) from exc
    info = ShardInfo(relative, str(fmt), rows, size, None, compression, raw)
    return info, arrow_schema, storage.unstrip(fs, path)


def _arrow_rows(f: Any) -> tuple[str, int, pa.Schema, int | None]:
    """(format, rows, schema, raw bytes or None) of an Arrow IPC file, or of a footer-less IPC
    stream such as Hugging Face ``save_to_disk`` writes (no footer: its batches are read)."""
    try:
        reader = ipc.open_file(f)
    except pa.ArrowInvalid:
        f.seek(0)
        stream = ipc.open_stream(f)
        rows = raw = 0
        for batch in stream:
            rows, raw = rows + batch.num_rows, raw + batch.nbytes
        return "arrow_stream", rows, stream.schema, raw
    rows = sum(reader.get_record_batch(i).num_rows for i in range(reader.num_record_batches))
    return "arrow", rows, reader.schema, None


def _parquet_compression(meta: Any) -> str | None:
    if meta.num_row_groups == 0 or meta.num_columns == 0:
        return None
    codec = str(meta.row_group(0).column(0).compression).lower()
    return None if codec == "uncompressed" else codec


def _schema_of(arrow_schema: pa.Schema, fields: Sequence[str] | None, where: str) -> Schema:
    names = list(fields) if fields is not None else arrow_schema.names
    missing = [n for n in names if n not in arrow_schema.names]
    if missing:
        raise SchemaError(f"{where} has no column(s) {missing}; it has {arrow_schema.names}")
    return Schema(field_from_arrow(arrow_schema.field(n)) for n in names)


def build_index(url: str, *, fields: Sequence[str] | None = None, checksums: bool = False,
                output: str | None = None, storage_options: Mapping[str, Any] | None = None,
                threads: int = 16, write: bool = True) -> DatasetIndex:
    """Index existing Parquet / Arrow IPC files at ``url`` (folder or glob).

    Reads only footers (in ``threads`` parallel requests) unless ``checksums`` is set, which
    reads every file whole to record its checksum. Every file must have the same schema (for
    the selected ``fields``). The index is published at ``output`` (default: the files'
    common folder) unless ``write`` is false.

    Raises:
        SourceError: no files, or a file is unreadable.
        SchemaError: files disagree on the schema, or a column type is unsupported.
    """
    fs, root, files = discover_files(url, storage_options)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        infos = list(pool.map(lambda p: _footer_info(fs, p, root), files))
    _, first_schema, first_url = infos[0]
    schema = _schema_of(first_schema, fields, first_url)
    for _, arrow_schema, where in infos[1:]:
        other = _schema_of(arrow_schema, schema.names, where)
        if other != schema:
            diff = [f"{a.name}: {a.kind} {a.dtype} {list(a.shape)} vs {b.kind} {b.dtype} "
                    f"{list(b.shape)}" for a, b in zip(schema, other, strict=True) if a != b]
            raise SchemaError(
                f"{where} does not match the schema of {first_url}: {'; '.join(diff)}"
            )
    shards = [info for info, _, _ in infos]
    target = output or storage.unstrip(fs, root)
    if output is not None and storage.filesystem(output, storage_options)[1].rstrip("/") != root:
        # the index lives elsewhere: name every file by its full URL
        _check_same_filesystem(output, storage.unstrip(fs, root), storage_options)
        shards = [replace(s, path=storage.unstrip(fs, storage.join(root, s.path))) for s in shards]
    if checksums:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            shards = list(pool.map(lambda s: _with_checksum(fs, root, s), shards))
    index = DatasetIndex(schema, tuple(shards), created=time.time())
    if index.num_samples == 0:
        raise EmptyDatasetError(f"the files at {url} hold no rows")
    if write:
        written = save_index(index, target, storage_options)
        index = replace(index, url=written)
    else:
        index = replace(index, url=index_url(target))
    return index


def _check_same_filesystem(output: str, files: str,
                           storage_options: Mapping[str, Any] | None) -> None:
    out_fs, out_path = storage.filesystem(output, storage_options)
    out_protocol, files_protocol = (_split_url(storage.unstrip(out_fs, out_path))[0],
                                    _split_url(files)[0])
    if out_protocol != files_protocol:
        raise SourceError(
            f"an index at {output} ({out_protocol}://) could not name files on "
            f"{files_protocol}:// ({files}): an index names shards on its own filesystem "
            "only; write the index beside the files, or copy them"
        )


def _with_checksum(fs: Any, root: str, shard: ShardInfo) -> ShardInfo:
    full = storage.join(root, shard.path)
    if storage.is_local(fs):
        return replace(shard, checksum=checksum_file(full))
    return replace(shard, checksum=checksum_bytes(fs.cat_file(full)))


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="folder or glob of Parquet / Arrow IPC files (any fsspec URL)")
    parser.add_argument("--fields", help="comma-separated columns to include (default: all)")
    parser.add_argument("--checksum", action="store_true",
                        help="read every file whole to record checksums (default: footers only)")
    parser.add_argument("--output", help="where to write index.json (default: the files' folder)")
    parser.add_argument("--threads", type=int, default=16, help="parallel footer reads")


def run(args: argparse.Namespace) -> int:
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    started = time.perf_counter()
    index = build_index(args.url, fields=fields, checksums=args.checksum, output=args.output,
                        threads=args.threads)
    elapsed = time.perf_counter() - started
    print(f"indexed {plural(len(index.shards), 'file')}, {plural(index.num_samples, 'row')}, "
          f"{index.total_bytes / 1e6:.1f} MB in {elapsed:.2f} s -> {index.url}")
    if any(storage.is_absolute_url(s.path) for s in index.shards):
        print("its files lie outside the index's folder: read it with "
              "allow_external_paths=True (StreamDataset, DatasetReader, load_index)")
    return 0


__all__ = [
    "INDEX_NAME",
    "SHARD_FORMATS",
    "DatasetIndex",
    "ShardInfo",
    "build_index",
    "discover_files",
    "index_url",
    "load_index",
    "parse_index",
    "save_index",
]
